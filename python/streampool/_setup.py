"""The one-call setup (:func:`setup`: the recommended resource for a device, made its
current resource), and RMM's (:func:`reinitialize` and the functions around it), so that
RMM code runs unchanged."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable
from typing import Any, SupportsIndex, TypeVar

from ._errors import StreampoolError
from ._native import (
    _reset_device_resources,
    backend_description,
    device_count,
    device_info,
    get_current_device,
    get_per_device_resource,
    parse_size,
    set_current_device_resource,
    set_per_device_resource,
)
from .mr import (
    CudaAsyncManagedMemoryResource,
    CudaAsyncMemoryResource,
    LoggingResourceAdaptor,
    ManagedMemoryResource,
    MemoryResource,
    PoolMemoryResource,
    PrefetchResourceAdaptor,
)

__all__ = [
    "disable_logging",
    "enable_logging",
    "get_log_filenames",
    "is_initialized",
    "register_reinitialize_hook",
    "reinitialize",
    "setup",
    "unregister_reinitialize_hook",
]


def setup(larger_than_memory: bool = False, device: int | None = None) -> MemoryResource:
    """Makes the recommended resource the resource of ``device`` (the current device when
    None) and returns it.

    * By default: :class:`~streampool.mr.CudaAsyncMemoryResource`, the driver's
      stream-ordered pool (the device's current pool, shared with every library that uses
      it, its release threshold raised when it is the default pool).
    * ``larger_than_memory=True``, for work larger than the GPU's memory: managed memory
      that is prefetched to the device on the allocating stream as it is handed out, i.e.
      :class:`~streampool.mr.PrefetchResourceAdaptor` over
      :class:`~streampool.mr.CudaAsyncManagedMemoryResource` (the CUDA 13 driver's
      stream-ordered managed pool) where the device has managed pools
      (``device_info()["managed_pools"]``), else over
      :class:`~streampool.mr.ManagedMemoryResource` (``cuMemAllocManaged``). On a device
      without concurrent managed access (``device_info()["concurrent_managed_access"]``
      False: Windows, WSL, some Jetson boards), where the driver takes no prefetch,
      :class:`~streampool.mr.ManagedMemoryResource` alone: the driver migrates its memory
      at each kernel launch there.

    Buffers made afterwards without ``mr=`` use it; buffers made before keep theirs.
    TypeError when ``larger_than_memory`` is not True or False (a NumPy bool, 0 and 1 are
    taken too). Example::

        >>> type(streampool.setup()).__name__
        'CudaAsyncMemoryResource'
        >>> buf = streampool.DeviceBuffer(size=1 << 20)  # from it
    """
    if not _flag("larger_than_memory", larger_than_memory):
        mr: MemoryResource = CudaAsyncMemoryResource(device=device)
    else:
        info = device_info(device)
        if not info["concurrent_managed_access"]:
            mr = ManagedMemoryResource(device=device)
        elif info["managed_pools"]:
            mr = PrefetchResourceAdaptor(CudaAsyncManagedMemoryResource(device=device))
        else:
            mr = PrefetchResourceAdaptor(ManagedMemoryResource(device=device))
    if device is None:
        set_current_device_resource(mr)
    else:
        set_per_device_resource(device, mr)
    return mr


# ---------------------------------------------------------------------------------------
# RMM's initialisation API.

_F = TypeVar("_F", bound=Callable[..., object])
_reinitialize_hooks: list[tuple[Callable[..., object], tuple[Any, ...], dict[str, Any]]] = []
# The backend (its backend_description(), which names a simulated device by its own
# number) and the devices the last reinitialize() configured there; None before the first.
# The logging functions look at the current device instead when it is None or of another
# backend (a simulated device that has been exited).
_configured_devices: tuple[str, list[int]] | None = None


def _type_name(value: object) -> str:
    """The type of ``value`` for messages, with its module unless it is a builtin
    (``numpy.bool``, not ``bool``)."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _flag(name: str, value: object) -> bool:
    """A yes/no argument as RMM's C ``bool`` arguments take it: True or False, a NumPy
    bool, or the int 0 or 1; TypeError naming ``name`` for anything else."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be True or False (or 1 or 0), not {value!r} (a {_type_name(value)})")


def _size(name: str, value: object) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None


def _ordinal(value: object) -> int | None:
    """``value`` as a device ordinal: an int or an object with ``__index__`` (a NumPy
    integer), never a bool; None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # not an integer (NumPy's bool has no __index__)
        return None


def _devices(devices: object) -> list[int]:
    """RMM's ``devices``: a device ordinal, a list of them, or None (device 0); each must
    exist."""
    single = _ordinal(devices)
    if devices is None:
        wanted: list[object] = [0]
    elif single is not None:
        wanted = [single]
    elif isinstance(devices, Iterable) and not isinstance(devices, (str, bytes)):
        wanted = list(devices)
    else:
        raise TypeError(f"devices must be a device ordinal or a list of them, not {_type_name(devices)}")
    count = device_count()
    out: list[int] = []
    for item in wanted:
        d = _ordinal(item)
        if d is None:
            raise TypeError(f"devices: {item!r} is not a device ordinal (an int)")
        if not 0 <= d < count:
            raise ValueError(f"devices: device {d} does not exist ({count} device(s): 0..{count - 1})")
        if d not in out:
            out.append(d)
    return out


def _log_file_base(log_file_name: object) -> str:
    """The log file name before RMM's ``.dev<N>`` suffix: the argument, else
    ``STREAMPOOL_LOG_FILE``, else ``RMM_LOG_FILE``."""
    if log_file_name is None:
        log_file_name = os.environ.get("STREAMPOOL_LOG_FILE") or os.environ.get("RMM_LOG_FILE")
        if not log_file_name:
            raise ValueError(
                "logging needs a file: pass log_file_name= or set STREAMPOOL_LOG_FILE (or RMM_LOG_FILE)"
            )
    if not isinstance(log_file_name, (str, os.PathLike)):
        raise TypeError(f"log_file_name must be a str or a path, not {type(log_file_name).__name__}")
    return os.fspath(log_file_name)


def _device_log_file(base: str, device: int) -> str:
    """RMM's per-device name: ``.dev<N>`` before the extension (``rmm.log`` ->
    ``rmm.dev0.log``)."""
    stem, ext = os.path.splitext(base)
    return f"{stem}.dev{device}{ext}"


def reinitialize(
    pool_allocator: bool = False,
    managed_memory: bool = False,
    initial_pool_size: SupportsIndex | str | None = None,
    maximum_pool_size: SupportsIndex | str | None = None,
    devices: int | Iterable[int] | None = 0,
    logging: bool = False,
    log_file_name: str | os.PathLike[str] | None = None,
) -> None:
    """Sets the resource of each of ``devices`` afresh, as RMM's ``rmm.reinitialize``;
    every other device goes back to its initial resource.

    For each device: :class:`~streampool.mr.CudaAsyncMemoryResource` (where RMM uses
    ``CudaMemoryResource``: the driver's pool is the better default), or with
    ``managed_memory`` :class:`~streampool.mr.ManagedMemoryResource`; with
    ``pool_allocator`` a :class:`~streampool.mr.PoolMemoryResource` over it (the sharded
    pool; ``initial_pool_size=None`` reserves nothing up front, where RMM reserves half the
    free memory; both sizes are ignored without ``pool_allocator``, as in RMM); with
    ``logging`` a :class:`~streampool.mr.LoggingResourceAdaptor` on top, writing to
    ``log_file_name`` (else ``STREAMPOOL_LOG_FILE``, else ``RMM_LOG_FILE``) with RMM's
    ``.dev<N>`` suffix before the extension.

    ``pool_allocator``, ``managed_memory`` and ``logging`` take True or False, a NumPy
    bool, or 0 or 1 (RMM's are C bools); ``devices`` a device ordinal (an int or a NumPy
    integer, not a bool), a list of them (an empty one gives every device back its initial
    resource), or None (device 0).

    Registered hooks (:func:`register_reinitialize_hook`) run first, latest first. The
    arguments are checked before anything changes, and every resource is made before any
    is set: a bad argument (TypeError/ValueError naming it) or a failure leaves the device
    resources as they were. Memory from earlier resources stays valid while it is held.

    Example::

        >>> streampool.reinitialize(pool_allocator=True, maximum_pool_size="8GiB", devices=[0])
        >>> type(streampool.mr.get_per_device_resource(0)).__name__
        'PoolMemoryResource'
    """
    pool_allocator = _flag("pool_allocator", pool_allocator)
    managed_memory = _flag("managed_memory", managed_memory)
    logging = _flag("logging", logging)
    initial = _size("initial_pool_size", initial_pool_size)
    maximum = _size("maximum_pool_size", maximum_pool_size)
    if pool_allocator and initial is not None and maximum is not None and initial > maximum:
        raise ValueError(f"initial_pool_size ({initial}) is larger than maximum_pool_size ({maximum})")
    wanted = _devices(devices)
    base = _log_file_base(log_file_name) if logging and wanted else None

    # Over a copy: a hook may unregister hooks (itself included) as it runs.
    for func, args, kwargs in reversed(list(_reinitialize_hooks)):
        func(*args, **kwargs)

    made: dict[int, MemoryResource] = {}
    for d in wanted:
        mr: MemoryResource = (
            ManagedMemoryResource(device=d) if managed_memory else CudaAsyncMemoryResource(device=d)
        )
        if pool_allocator:
            mr = PoolMemoryResource(mr, initial_pool_size=initial, maximum_pool_size=maximum)
        if base is not None:
            mr = LoggingResourceAdaptor(mr, log_file_name=_device_log_file(base, d))
        made[d] = mr
    _reset_device_resources()
    for d, mr in made.items():
        set_per_device_resource(d, mr)
    global _configured_devices
    _configured_devices = (backend_description(), wanted)


def is_initialized() -> bool:
    """True when device resources can be made and used: a CUDA driver was found or a
    simulated device is in use (RMM's ``is_initialized``, which is true whenever RMM could
    be imported; every device has a resource from the start here too). False, never an
    error, when they cannot: no driver, or a backend setting that is refused (such as
    ``STREAMPOOL_SIM_DEVICES=0``; any use of a resource raises the reason)::

        >>> streampool.is_initialized()
        True
    """
    try:
        backend_description()
    except StreampoolError:
        return False
    return True


def register_reinitialize_hook(func: _F, *args: Any, **kwargs: Any) -> _F:
    """Has :func:`reinitialize` call ``func(*args, **kwargs)`` before it changes anything
    (hooks run latest first), as RMM's; returns ``func``. TypeError when it is not
    callable::

        >>> cache = {"x": 1}
        >>> _ = streampool.register_reinitialize_hook(cache.clear)  # returns cache.clear
        >>> streampool.reinitialize()
        >>> cache
        {}
    """
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    _reinitialize_hooks.append((func, args, kwargs))
    return func


def unregister_reinitialize_hook(func: Callable[..., object]) -> None:
    """Removes every registration of ``func`` (nothing when it has none)::

    >>> cache = {}
    >>> _ = streampool.register_reinitialize_hook(cache.clear)
    >>> streampool.unregister_reinitialize_hook(cache.clear)
    """
    _reinitialize_hooks[:] = [h for h in _reinitialize_hooks if h[0] != func]


def _logging_devices() -> list[int]:
    """The devices the last :func:`reinitialize` configured, where that was on the current
    backend; else the current device."""
    if _configured_devices is not None:
        backend, devices = _configured_devices
        if backend == backend_description():
            return list(devices)
    return [get_current_device()]


def enable_logging(log_file_name: str | os.PathLike[str] | None = None) -> None:
    """Wraps the resource of every device that :func:`reinitialize` configured (the current
    device before any, or when that was under another backend, such as a simulated device
    since exited) in a :class:`~streampool.mr.LoggingResourceAdaptor`, unless it is one
    already; the file gets RMM's ``.dev<N>`` suffix. Every adaptor is made before any is
    set, so a failure changes nothing. ValueError when a device needs an adaptor and no file
    is named (argument, ``STREAMPOOL_LOG_FILE`` or ``RMM_LOG_FILE``); where every device
    logs already, nothing happens, as in RMM::

        >>> streampool.mr.enable_logging("alloc.csv")  # alloc.dev0.csv
    """
    devices = [
        d for d in _logging_devices() if not isinstance(get_per_device_resource(d), LoggingResourceAdaptor)
    ]
    if not devices:
        return
    base = _log_file_base(log_file_name)
    made: dict[int, MemoryResource] = {}
    for d in devices:
        made[d] = LoggingResourceAdaptor(get_per_device_resource(d), log_file_name=_device_log_file(base, d))
    for d, mr in made.items():
        set_per_device_resource(d, mr)


def disable_logging() -> None:
    """Unwraps the logging adaptor that :func:`enable_logging` or ``reinitialize(logging=True)``
    put on each configured device::

        >>> streampool.mr.disable_logging()
    """
    for d in _logging_devices():
        current = get_per_device_resource(d)
        if isinstance(current, LoggingResourceAdaptor):
            set_per_device_resource(d, current.get_upstream())


def get_log_filenames() -> dict[int, str | None]:
    """The log file of each configured device (None where it does not log), as RMM's::

    >>> streampool.reinitialize(devices=[0], logging=True, log_file_name="rmm.log")
    >>> streampool.mr.get_log_filenames()  # doctest: +ELLIPSIS
    {0: '.../rmm.dev0.log'}
    """
    out: dict[int, str | None] = {}
    for d in _logging_devices():
        current = get_per_device_resource(d)
        out[d] = current.get_file_name() if isinstance(current, LoggingResourceAdaptor) else None
    return out
