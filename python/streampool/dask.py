"""Scale out with Dask: a streampool resource on every ``dask.distributed`` worker.

Run one worker process per GPU (as ``dask-cuda``'s ``LocalCUDACluster`` does, or a
``LocalCluster`` with one worker per GPU) and register :class:`StreampoolPlugin`: at each
worker's start-up it makes the chosen resource on the worker's device and sets it as that
device's resource, so that every ``DeviceBuffer`` (and every library hooked to streampool)
that the worker's tasks allocate on that device allocates from it. Where each worker sees
its own GPU as device 0 (``dask-cuda``'s workers, or ``CUDA_VISIBLE_DEVICES`` set per
worker) that is every allocation; a ``LocalCluster`` whose workers all see every GPU gives
worker N device N (modulo the count), while its tasks' current device stays 0, so tasks
there name the resource (``mr=streampool.dask.worker_resource()``, as below). A
``DeviceBuffer`` that Dask sends to a worker process (a result given to a task on another
worker, a task's argument, scattered data) is unpickled there into that worker's resource,
on its device. (Workers of one process, ``processes=False``, are handed the object itself,
on the device it was made on.)
:func:`statistics` gathers what each worker's resource has allocated. It is the
counterpart of ``dask-cuda``'s ``RMMSetup`` plugin.

Example (needs one GPU per worker; ``STREAMPOOL_DEVICE=sim`` in the workers' environment
runs it on simulated devices instead)::

    from distributed import Client, LocalCluster
    import streampool
    import streampool.dask


    def work(nbytes):
        buf = streampool.DeviceBuffer(size=nbytes, mr=streampool.dask.worker_resource())
        return buf.device


    if __name__ == "__main__":  # the worker processes import this script: start the cluster once
        with LocalCluster(n_workers=2, threads_per_worker=4) as cluster, Client(cluster) as client:
            streampool.dask.register(client, "pool")  # one sharded pool per worker's GPU
            print(client.gather(client.map(work, [1 << 20] * 8, pure=False)))
            print(streampool.dask.statistics(client))

Needs ``distributed`` (``pip install 'streampool[dask]'``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable
from typing import Any, cast

try:
    from distributed import Client, WorkerPlugin, get_worker
except ImportError as error:  # pragma: no cover - exercised only without distributed
    raise ImportError(
        "streampool.dask needs Dask's distributed scheduler: pip install 'streampool[dask]'"
    ) from error

import streampool

from . import mr
from ._setup import _ordinal

__all__ = [
    "RESOURCE_NAMES",
    "ResourceFactory",
    "StreampoolPlugin",
    "register",
    "statistics",
    "worker_device",
    "worker_resource",
]

#: A function that makes a worker's resource, given the worker's device ordinal. It is
#: pickled and sent to the workers: a module-level function or a ``functools.partial``.
ResourceFactory = Callable[[int], mr.MemoryResource]


def _async(device: int) -> mr.MemoryResource:
    return mr.CudaAsyncMemoryResource(device=device)


def _pool(device: int) -> mr.MemoryResource:
    return mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(device=device))


def _cuda(device: int) -> mr.MemoryResource:
    return mr.CudaMemoryResource(device=device)


def _managed(device: int) -> mr.MemoryResource:
    return mr.ManagedMemoryResource(device=device)


def _async_managed(device: int) -> mr.MemoryResource:
    return mr.CudaAsyncManagedMemoryResource(device=device)


#: The resource names :class:`StreampoolPlugin` knows, and what each makes on a device.
RESOURCE_NAMES: dict[str, ResourceFactory] = {
    "async": _async,
    "pool": _pool,
    "pool(async)": _pool,
    "cuda": _cuda,
    "managed": _managed,
    "async-managed": _async_managed,
}


# Workers of one process (a LocalCluster with processes=False) share its devices. For each
# device a plugin has installed a resource on: the resource it had before the first of them
# (restored when the last is torn down), and the resources installed since, oldest first.
_LOCK = threading.Lock()
_BEFORE: dict[int, mr.MemoryResource | None] = {}
_INSTALLED: dict[int, list[mr.MemoryResource]] = {}


def _resolve(resource: str | ResourceFactory) -> ResourceFactory:
    """The factory behind a resource argument: a callable as it is, a name of
    :data:`RESOURCE_NAMES`, a ``"module:function"`` import path, or a resource spec of
    the harness (``"stats(pool(async))"``, or a peer's, ``"rmm:async"``: docs/harness.md),
    made on the worker's current device."""
    if callable(resource):
        return resource
    if not isinstance(resource, str):
        raise TypeError(
            f"resource must be a resource name, a spec string or a function (device) -> MemoryResource, "
            f"not {type(resource).__name__}"
        )
    spec = resource.strip()
    if spec in RESOURCE_NAMES:
        return RESOURCE_NAMES[spec]
    from streampool.harness import specs

    module, colon, name = spec.partition(":")
    # "rmm:async", "cupy:pool", ...: a peer's resource spec of the harness, not an import path.
    peers = {p.partition(":")[0] for p in specs.PEER_SPECS}
    if colon and "(" not in spec and module.strip() not in peers:
        try:
            factory = getattr(importlib.import_module(module), name, None)
        except (ImportError, ValueError) as e:  # ValueError: an empty module name
            raise ValueError(
                f'resource {resource!r}: a "module:function" path, whose module cannot be imported '
                f"({type(e).__name__}: {e})"
            ) from e
        if not callable(factory):
            raise ValueError(f"resource {resource!r}: {module} has no function {name!r}")
        return cast(ResourceFactory, factory)
    try:
        specs.check_spec(spec)  # here, in the client: a bad spec fails before any worker
    except specs.SpecError as e:
        names = ", ".join(repr(n) for n in RESOURCE_NAMES)
        raise ValueError(
            f'unknown resource {resource!r}; expected one of {names}, a "module:function" path, '
            f"a function (device) -> MemoryResource, or a resource spec ({e})"
        ) from None
    return lambda device: specs.resource_from_spec(spec, device=device)


def _worker_index(name: object) -> int | None:
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    if isinstance(name, str) and name.isdigit():
        return int(name)
    return None


def _visible_devices() -> list[str] | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return [v for v in (part.strip() for part in visible.split(",")) if v]


class StreampoolPlugin(WorkerPlugin):
    """A ``dask.distributed`` worker plugin that installs a streampool resource on each
    worker at start-up (and on workers that join later).

    Args:
        resource: what to install: a name (``"async"``: the driver's pool, the default;
            ``"pool"`` or ``"pool(async)"``: a sharded pool over it; ``"cuda"``,
            ``"managed"``, ``"async-managed"``), a resource spec of the harness
            (``"stats(pool(async))"``, ``"rmm:async"``), a ``"module:function"`` path, or a function
            ``(device) -> MemoryResource`` (pickled to the workers: a module-level function
            or a ``functools.partial``).
        device: the device ordinal every worker uses; by default each worker picks its own:
            device 0 when ``CUDA_VISIBLE_DEVICES`` is set (``dask-cuda`` gives each worker
            the list with its own GPU first, as its ``RMMSetup`` assumes), else its worker
            name's index modulo the device count (a ``LocalCluster``'s workers are named 0,
            1, ...), else device 0.
        statistics: wrap the resource in a ``StatisticsResourceAdaptor`` (unless it is one),
            so that :func:`statistics` can report what each worker allocated.

    The resource becomes the worker's device's resource (``set_per_device_resource``), so
    code that allocates on that device without naming a resource uses it; tasks can also
    ask for it with :func:`worker_resource`. On teardown the device gets back the resource it
    had before (when workers of one process share it: once the last of them is torn down).
    """

    name = "streampool"

    def __init__(
        self,
        resource: str | ResourceFactory = "async",
        *,
        device: int | None = None,
        statistics: bool = True,
    ) -> None:
        _resolve(resource)  # refuse a bad argument here, on the client, not on every worker
        if device is not None:
            ordinal = _ordinal(device)  # an int, or a NumPy integer; never a bool
            if ordinal is None:
                raise TypeError(f"device must be a device ordinal (an int >= 0) or None, not {device!r}")
            device = ordinal
        if device is not None and device < 0:
            raise ValueError(f"device must be a device ordinal (an int >= 0) or None, got {device!r}")
        if not isinstance(statistics, bool):
            raise TypeError(f"statistics must be True or False, not {statistics!r}")
        self.resource = resource
        self.device = device
        self.statistics = statistics
        self._installed: tuple[int, mr.MemoryResource] | None = None
        self._setup_error: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # What a worker needs; resources installed here never travel.
        return {"resource": self.resource, "device": self.device, "statistics": self.statistics}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.resource, self.device, self.statistics = state["resource"], state["device"], state["statistics"]
        self._installed = None
        self._setup_error = None

    def pick_device(self, worker: Any) -> int:
        """The device this plugin gives ``worker`` (see the class docs)."""
        if self.device is not None:
            return self.device
        if _visible_devices():  # dask-cuda's workers: their own GPU first
            return 0
        index = _worker_index(getattr(worker, "name", None))
        return 0 if index is None else index % streampool.device_count()

    def setup(self, worker: Any) -> None:
        self._setup_error = None
        try:
            self._setup(worker)
        except Exception as e:
            # Where it failed, on the error itself (a note: register() raises it on the
            # client, among several workers), and kept for the tasks' and statistics()'
            # error: a worker that joins later logs a failed setup only in its own log.
            where = f"streampool's plugin on worker {getattr(worker, 'name', None)!r}"
            with contextlib.suppress(Exception):
                where += f", device {self.pick_device(worker)}"
            e.add_note(f"(in {where})")
            self._setup_error = f"{type(e).__name__}: {e} (in {where})"
            raise

    def _setup(self, worker: Any) -> None:
        count = streampool.device_count()
        if count == 0:
            raise ValueError(f"worker {worker.name!r} sees no device ({streampool.backend_description()})")
        device = self.pick_device(worker)
        if device >= count:
            raise ValueError(
                f"worker {worker.name!r} was given device {device}, but this process sees {count} "
                f"device{'s' if count != 1 else ''} ({streampool.backend_description()})"
            )
        made = _resolve(self.resource)(device)
        if not isinstance(made, mr.MemoryResource):
            raise TypeError(f"the resource factory returned {type(made).__name__}, not a MemoryResource")
        if made.device != device:
            raise ValueError(
                f"the resource factory made a resource of device {made.device} for worker {worker.name!r}, "
                f"whose device is {device}"
            )
        if self.statistics and not isinstance(made, mr.StatisticsResourceAdaptor):
            made = mr.StatisticsResourceAdaptor(made)
        with _LOCK:
            previous = streampool.set_per_device_resource(device, made)
            if not _INSTALLED.get(device):
                _BEFORE[device] = previous
            _INSTALLED.setdefault(device, []).append(made)
        self._installed = (device, made)

    def teardown(self, worker: Any) -> None:
        """Gives the device back the resource it had before this plugin's, or, where other
        workers of this process still run on it, the latest of theirs; a resource set since
        by someone else is left in place."""
        if self._installed is None:
            return
        device, made = self._installed
        self._installed = None
        with _LOCK:
            installed = _INSTALLED.get(device, [])
            installed[:] = [r for r in installed if r is not made]
            after = installed[-1] if installed else _BEFORE.pop(device, None)
            if streampool.get_per_device_resource(device) is made and after is not None:
                streampool.set_per_device_resource(device, after)
        del made  # a pool gives its memory back to the driver's pool as it goes
        if not installed and isinstance(after, mr.CudaAsyncMemoryResource):
            # The driver's default pool keeps what it gets back (its release threshold is
            # the maximum): a plugin registered next would find the device full.
            with contextlib.suppress(Exception):
                after.trim_to(0)


def _arrival_resource() -> mr.MemoryResource | None:
    """Where a ``DeviceBuffer`` unpickled in this process is made (the binding's
    ``_rebuild_device_buffer`` asks, once this module is imported): the resource of the one
    device a plugin has set up here (a worker process), else None, the current device's
    (no plugin, or workers of one process on several devices, which Dask hands objects
    without pickling them)."""
    with _LOCK:
        devices = [device for device, installed in _INSTALLED.items() if installed]
    return streampool.get_per_device_resource(devices[0]) if len(devices) == 1 else None


def _installed(worker: Any = None) -> tuple[int, mr.MemoryResource]:
    if worker is None:
        try:
            worker = get_worker()
        except ValueError:
            raise RuntimeError(
                "streampool.dask.worker_resource() and worker_device() are for tasks running on a Dask worker"
            ) from None
    # The plugin under its own name first, else one registered under another name.
    named = worker.plugins.get(StreampoolPlugin.name)
    for plugin in [named, *reversed(list(worker.plugins.values()))]:
        if isinstance(plugin, StreampoolPlugin) and plugin._installed is not None:
            return plugin._installed
    failed = getattr(named, "_setup_error", None)
    if failed is not None:
        raise RuntimeError(f"the streampool plugin's setup failed on worker {worker.name!r}: {failed}")
    raise RuntimeError(
        f"worker {worker.name!r} has no streampool resource: register the plugin first "
        "(streampool.dask.register(client, ...))"
    )


def worker_resource() -> mr.MemoryResource:
    """The resource :class:`StreampoolPlugin` installed on the worker running this task."""
    return _installed()[1]


def worker_device() -> int:
    """The device ordinal of the worker running this task."""
    return _installed()[0]


def register(
    client: Client,
    resource: str | ResourceFactory = "async",
    *,
    device: int | None = None,
    statistics: bool = True,
) -> StreampoolPlugin:
    """Registers a :class:`StreampoolPlugin` with ``client``'s cluster: the workers there now
    and those that join later install the resource. Returns the plugin.

    Where a worker's setup fails (a value only the resource judges, a device the worker
    lacks), the worker's error is raised here, with a note naming the worker and its device,
    and the plugin is not left with the scheduler. Dask has by then torn down a plugin that
    this process registered before with the same scheduler: that one is registered again
    (a note says so), so a mistake in a second registration leaves the workers with the
    first one's resources, made anew."""
    plugin = StreampoolPlugin(resource, device=device, statistics=statistics)
    _refuse_asynchronous(client, "register")
    scheduler = str(getattr(client.scheduler, "address", ""))
    before = _REGISTERED.get(scheduler)
    if before is not None and not client.run_on_scheduler(_has_plugin, name=plugin.name):  # type: ignore[no-untyped-call]
        before = None  # unregistered since
    try:
        client.register_plugin(plugin)
    except BaseException as e:
        # A worker's setup failed (a value only the resource judges, a device it lacks): the
        # plugin would stay with the scheduler and fail every worker that joins later.
        with contextlib.suppress(Exception):
            client.unregister_worker_plugin(plugin.name)  # type: ignore[no-untyped-call]
        # Dask tore down the plugin registered before under the same name, on every worker,
        # before setting this one up: register it again rather than leave the workers bare.
        if before is not None and isinstance(e, Exception):
            _REGISTERED.pop(scheduler, None)
            try:
                client.register_plugin(before)
            except Exception as again:
                e.add_note(
                    "(the streampool plugin registered before could not be registered again "
                    f"({type(again).__name__}: {again}): the workers have no streampool resource)"
                )
            else:
                _REGISTERED[scheduler] = before
                e.add_note(
                    "(the streampool plugin registered before is registered again: its resources "
                    "are new ones, whose statistics start from zero)"
                )
        raise
    _REGISTERED[scheduler] = plugin
    return plugin


#: The plugin :func:`register` registered last with each scheduler (by address), put back
#: when a later registration fails.
_REGISTERED: dict[str, StreampoolPlugin] = {}


def _has_plugin(dask_scheduler: Any, name: str) -> bool:
    return name in dask_scheduler.worker_plugins


def _worker_statistics(dask_worker: Any) -> dict[str, Any]:
    device, resource = _installed(dask_worker)
    report: dict[str, Any] = {
        "device": device,
        "resource": repr(resource),
        "backend": streampool.backend_description(),
    }
    if isinstance(resource, mr.StatisticsResourceAdaptor):
        report.update(dict(resource.allocation_counts))
    return report


def statistics(client: Client) -> dict[str, dict[str, Any]]:
    """Each worker's device, resource, backend and (with the plugin's ``statistics=True``)
    allocation counters (``current_bytes``, ``peak_bytes``, ``total_bytes`` and the counts),
    by worker address. RuntimeError from a worker without the plugin."""
    _refuse_asynchronous(client, "statistics")
    result: dict[str, dict[str, Any]] = client.run(_worker_statistics)
    return result


def _refuse_asynchronous(client: Client, what: str) -> None:
    """TypeError for an asynchronous Client, whose calls return awaitables that these
    functions would drop (the plugin never registered, a coroutine for the statistics)."""
    if getattr(client, "asynchronous", False):
        raise TypeError(
            f"streampool.dask.{what}() needs a synchronous Client; with an asynchronous one, "
            "await client.register_plugin(streampool.dask.StreampoolPlugin(...)) and "
            "await client.run(...) yourself"
        )
