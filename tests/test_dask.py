"""streampool.dask: a resource on every Dask worker, one worker per device, statistics back.

The plugin is tested in this process against a stand-in worker (fast, every branch), then
on a LocalCluster of worker processes on simulated devices (``STREAMPOOL_DEVICE=sim`` in
their environment), and, marked ``gpu``, on the GPUs.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("distributed")

from distributed import Client, LocalCluster, wait

import streampool
import streampool.dask
from streampool import mr
from streampool.dask import StreampoolPlugin
from streampool.harness import PeerMissingError
from streampool.sim import SimulatedDevice


class FakeWorker:
    """What the plugin reads of a worker: its name and its plugins."""

    def __init__(self, name: object) -> None:
        self.name = name
        self.plugins: dict[str, Any] = {}


@pytest.fixture
def two_devices(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatedDevice]:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with SimulatedDevice(capacity_bytes="64MiB", devices=2) as dev:
        yield dev


def pool_of(device: int) -> mr.MemoryResource:
    return mr.CudaAsyncMemoryResource(device=device, release_threshold="16MiB")


@pytest.mark.nosim
def test_each_worker_gets_its_device_and_resource(two_devices: SimulatedDevice) -> None:
    for name, device in [(0, 0), (1, 1), ("3", 1), ("tcp://10.0.0.1:4000", 0)]:
        plugin = StreampoolPlugin("pool")
        worker = FakeWorker(name)
        plugin.setup(worker)
        assert plugin.pick_device(worker) == device
        installed = streampool.get_per_device_resource(device)
        assert isinstance(installed, mr.StatisticsResourceAdaptor)
        assert installed.device == device
        assert "ShardedPoolMemoryResource" in repr(installed)
        buf = streampool.DeviceBuffer(size=4096, mr=installed)
        assert buf.device == device
        assert installed.allocation_counts.current_bytes == 4096
        del buf
        plugin.teardown(worker)
        assert streampool.get_per_device_resource(device) is not installed, "teardown restores"


@pytest.mark.nosim
def test_a_spec_string_is_made_by_the_harness(two_devices: SimulatedDevice) -> None:
    plugin = StreampoolPlugin("binning(pool(async))")
    worker = FakeWorker(0)
    plugin.setup(worker)
    installed = streampool.get_per_device_resource(0)
    assert "BinningMemoryResource" in repr(installed)
    buf = streampool.DeviceBuffer(size=4096, mr=installed)
    del buf
    plugin.teardown(worker)
    # On another device than the current one too.
    plugin = StreampoolPlugin("pool(async, expandable=true)")
    plugin.setup(FakeWorker(1))
    installed = streampool.get_per_device_resource(1)
    assert installed.device == 1 and "ShardedPoolMemoryResource" in repr(installed)
    assert streampool.DeviceBuffer(size=4096, mr=installed).device == 1
    plugin.teardown(FakeWorker(1))


@pytest.mark.nosim
def test_workers_of_one_process_sharing_a_device_restore_what_it_had(two_devices: SimulatedDevice) -> None:
    before = streampool.get_per_device_resource(0)
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        plugins = [StreampoolPlugin("pool", device=0) for _ in range(3)]
        for i, plugin in enumerate(plugins):
            plugin.setup(FakeWorker(i))
        assert plugins[2]._installed is not None
        assert streampool.get_per_device_resource(0) is plugins[2]._installed[1]
        for n, i in enumerate(order):
            alive = [
                p._installed[1] for j, p in enumerate(plugins) if j not in order[: n + 1] and p._installed
            ]
            plugins[i].teardown(FakeWorker(i))
            now = streampool.get_per_device_resource(0)
            # Never a torn-down worker's resource: another live one's, then the original.
            assert now is (alive[-1] if alive else before), (order, n)
    # A resource set by someone else meanwhile is left in place.
    plugin = StreampoolPlugin("async", device=0)
    plugin.setup(FakeWorker(0))
    mine = mr.CudaAsyncMemoryResource(device=0, release_threshold="1MiB")
    streampool.set_per_device_resource(0, mine)
    plugin.teardown(FakeWorker(0))
    assert streampool.get_per_device_resource(0) is mine
    streampool.set_per_device_resource(0, before)


@pytest.mark.nosim
def test_a_threaded_cluster_gives_the_device_its_resource_back() -> None:
    with SimulatedDevice(capacity_bytes="64MiB"):
        before = streampool.get_per_device_resource(0)
        with (
            LocalCluster(
                n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
            ) as cluster,
            Client(cluster) as client,
        ):
            streampool.dask.register(client, "pool", device=0)
            assert streampool.get_per_device_resource(0) is not before
        assert streampool.get_per_device_resource(0) is before


@pytest.mark.nosim
def test_device_from_the_argument_and_from_cuda_visible_devices(
    two_devices: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = StreampoolPlugin(pool_of, device=1, statistics=False)
    plugin.setup(FakeWorker(0))
    installed = streampool.get_per_device_resource(1)
    assert isinstance(installed, mr.CudaAsyncMemoryResource) and installed.release_threshold == 16 << 20
    numpy = pytest.importorskip("numpy")
    assert StreampoolPlugin(device=numpy.int64(1)).device == 1  # any integer, as elsewhere
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # one GPU per worker: device 0
    assert StreampoolPlugin().pick_device(FakeWorker(1)) == 0
    # dask-cuda's LocalCUDACluster rotates the list, each worker's own GPU first: worker 1
    # sees "1,0", and device 1 there was physical GPU 0, worker 0's.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert StreampoolPlugin().pick_device(FakeWorker(1)) == 0


@pytest.mark.nosim
def test_bad_input_names_the_argument_and_the_devices(two_devices: SimulatedDevice) -> None:
    with pytest.raises(ValueError, match="unknown resource 'pol'; expected one of 'async', 'pool'"):
        StreampoolPlugin("pol")
    with pytest.raises(TypeError, match="resource must be a resource name"):
        StreampoolPlugin(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        StreampoolPlugin("streampool.mr:nothing")
    for path in (":", "nosuch_module_here:f"):
        with pytest.raises(ValueError, match=r'"module:function" path, whose module cannot be imported'):
            StreampoolPlugin(path)
    # A peer's spec is a spec, not an import path of the peer's module: made on the worker
    # (where, here, the simulated device refuses peers), and checked in the client.
    with pytest.raises(PeerMissingError, match="cannot run on the simulated device"):
        StreampoolPlugin("rmm:async").setup(FakeWorker(0))
    with pytest.raises(ValueError, match="unknown peer resource 'cupy:bogus'"):
        StreampoolPlugin("cupy:bogus")
    with pytest.raises(ValueError, match="device must be a device ordinal"):
        StreampoolPlugin(device=-1)
    for device in (1.5, True):
        with pytest.raises(TypeError, match="device must be a device ordinal"):
            StreampoolPlugin(device=device)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="statistics must be True or False"):
        StreampoolPlugin(statistics="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="given device 2, but this process sees 2 devices"):
        StreampoolPlugin(device=2).setup(FakeWorker(0))
    wrong = functools.partial(mr.CudaAsyncMemoryResource, device=0)
    with pytest.raises(ValueError, match="made a resource of device 0 for worker 1, whose device is 1"):
        StreampoolPlugin(lambda device: wrong()).setup(FakeWorker(1))
    with pytest.raises(TypeError, match="returned int, not a MemoryResource"):
        StreampoolPlugin(lambda device: 7).setup(FakeWorker(0))  # type: ignore[arg-type,return-value]
    # A resource "module:function" path resolves; the device's resource is usable after all that.
    StreampoolPlugin("streampool.dask:_async").setup(FakeWorker(0))
    streampool.DeviceBuffer(size=256, mr=streampool.get_per_device_resource(0))


@pytest.mark.nosim
def test_a_bad_spec_is_refused_on_the_client_and_a_failed_setup_leaves_no_plugin() -> None:
    # The client refuses what the spec's form shows, before any worker sees it.
    for bad in (
        "pool(async, bogus=3)",
        "pool(cuda, cuda)",
        "limit(async)",
        "pool(async, initial=abc)",
        "stats(async, x=1)",
    ):
        with pytest.raises(ValueError, match=r"unknown resource|resource spec"):
            StreampoolPlugin(bad)
    # What only the resource judges fails on the worker: the plugin is not left behind.
    with (
        SimulatedDevice(capacity_bytes="64MiB"),
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        with pytest.raises(ValueError, match="gather_interval") as failed:
            streampool.dask.register(client, "pool(async, gather_interval=-1)", device=0)
        # The error names the worker and the device, in a note.
        assert failed.value.__notes__ == ["(in streampool's plugin on worker 0, device 0)"]
        plugins = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))
        assert "streampool" not in plugins
        streampool.dask.register(client, "pool(async)", device=0)  # a good one still goes in
        # A failed registration after it puts it back (Dask tore it down first), and says so.
        with pytest.raises(ValueError, match="gather_interval") as failed:
            streampool.dask.register(client, "pool(async, gather_interval=-1)", device=0)
        assert failed.value.__notes__[-1].startswith(
            "(the streampool plugin registered before is registered again"
        )
        [stats] = streampool.dask.statistics(client).values()
        assert stats["resource"].startswith("<StatisticsResourceAdaptor over <ShardedPoolMemoryResource"), (
            stats
        )
        assert client.submit(lambda: streampool.dask.worker_device()).result(timeout=30) == 0


def test_worker_resource_outside_a_worker_is_refused() -> None:
    for function in (streampool.dask.worker_resource, streampool.dask.worker_device):
        with pytest.raises(RuntimeError, match=r"worker_resource\(\) and worker_device\(\) are for tasks"):
            function()


@pytest.mark.nosim
def test_a_buffer_unpickled_in_a_worker_process_lands_in_its_resource(
    two_devices: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What Dask does to a buffer it sends to a worker process: a LocalCluster's workers see
    # every GPU, with device 0 current, so an unpickled buffer must be told its device.
    monkeypatch.setattr(streampool.dask, "_INSTALLED", {})
    monkeypatch.setattr(streampool.dask, "_BEFORE", {})
    made = streampool.DeviceBuffer.to_device(b"moved" * 100)
    assert pickle.loads(pickle.dumps(made)).device == 0, "no plugin: the current device"
    plugin, worker = StreampoolPlugin("async", device=1), FakeWorker(1)
    plugin.setup(worker)
    try:
        installed = streampool.get_per_device_resource(1)
        for protocol in (4, 5):
            arrived = pickle.loads(pickle.dumps(made, protocol=protocol))
            assert (arrived.device, arrived.mr, bytes(arrived)) == (1, installed, b"moved" * 100)
    finally:
        plugin.teardown(worker)
    assert pickle.loads(pickle.dumps(made)).device == 0, "torn down: the current device again"


def test_a_plugin_registered_under_another_name_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = FakeWorker(0)
    plugin = StreampoolPlugin("async")
    worker.plugins["gpu-memory"] = plugin  # client.register_plugin(plugin, name="gpu-memory")
    monkeypatch.setattr(streampool.dask, "get_worker", lambda: worker)
    # Other tests leave plugins set up on devices of simulated devices since exited.
    monkeypatch.setattr(streampool.dask, "_INSTALLED", {})
    monkeypatch.setattr(streampool.dask, "_BEFORE", {})
    with pytest.raises(RuntimeError, match="has no streampool resource"):
        streampool.dask.worker_resource()  # not set up yet
    plugin.setup(worker)
    try:
        assert streampool.dask.worker_resource() is plugin._installed[1]  # type: ignore[index]
        assert streampool.dask.worker_device() == 0
    finally:
        plugin.teardown(worker)


def fill_and_check(value: int, nbytes: int) -> tuple[int, int, bool]:
    """A task: allocates from the worker's resource, writes, reads back."""
    resource = streampool.dask.worker_resource()
    data = bytes([value % 251]) * nbytes
    buf = streampool.DeviceBuffer.to_device(data, mr=resource)
    return streampool.dask.worker_device(), buf.device, bytes(buf) == data


def make_buffer(value: int, nbytes: int) -> streampool.DeviceBuffer:
    """A task whose result moves to another worker."""
    return streampool.DeviceBuffer.to_device(bytes([value]) * nbytes, mr=streampool.dask.worker_resource())


def where_it_arrived(buf: streampool.DeviceBuffer) -> tuple[int, int, int, bytes]:
    """A task given a buffer made on another worker: this worker's device, the buffer's,
    what this worker's resource has in use, and the bytes."""
    resource = streampool.dask.worker_resource()
    assert isinstance(resource, mr.StatisticsResourceAdaptor)
    in_use = resource.allocation_counts.current_bytes
    return streampool.dask.worker_device(), buf.device, in_use, bytes(buf)


def run_on_cluster(n_workers: int, env: dict[str, str], resource: str = "pool") -> None:
    # The worker processes unpickle the tasks by this module's name (``tests.test_dask``
    # under pytest's importlib mode), from the folder that holds that package; they start
    # with this process's sys.path, which has that folder only when pytest runs from the
    # repository.
    here = str(Path(__file__).resolve().parents[fill_and_check.__module__.count(".")])
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(here)
        on_cluster(n_workers, env, resource)


def on_cluster(n_workers: int, env: dict[str, str], resource: str) -> None:
    with (
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=2,
            processes=True,
            dashboard_address=None,
            env=env,
        ) as cluster,
        Client(cluster) as client,
    ):
        streampool.dask.register(client, resource)
        futures = client.map(fill_and_check, range(4 * n_workers), [1 << 16] * (4 * n_workers))
        # A failure, not a hang, where the workers cannot run them (when the worker processes
        # cannot import this module, Dask waits for ever).
        wait(futures, timeout=120)
        results = client.gather(futures)
        assert all(ok for _, _, ok in results), results
        assert all(worker == buffer for worker, buffer, _ in results), results
        stats = streampool.dask.statistics(client)
        assert sorted(s["device"] for s in stats.values()) == list(range(n_workers)), stats
        assert sum(s["total_count"] for s in stats.values()) == 4 * n_workers, stats
        for s in stats.values():
            assert s["current_bytes"] == 0 and s["peak_bytes"] >= 1 << 16, s
            made = {"pool": "ShardedPoolMemoryResource", "async": "CudaAsyncMemoryResource"}[resource]
            assert s["resource"].startswith(f"<StatisticsResourceAdaptor over <{made}"), s
        if n_workers > 1:
            # A buffer made on one worker and given to a task on another arrives in that
            # worker's resource, on its device (by pickling it would land on device 0).
            by_device = {s["device"]: address for address, s in stats.items()}
            produced = client.submit(make_buffer, 7, 4096, workers=[by_device[0]], pure=False)
            moved = client.submit(where_it_arrived, produced, workers=[by_device[1]], pure=False)
            device, buffer_device, in_use, data = moved.result(timeout=120)
            assert (device, buffer_device, data) == (1, 1, bytes([7]) * 4096)
            assert in_use >= 4096, "counted by the receiving worker's resource"
        # A device the workers do not have: the workers' error reaches the client.
        with pytest.raises(ValueError, match="was given device 99, but this process sees"):
            streampool.dask.register(client, "async", device=99)


@pytest.mark.nosim
def test_a_cluster_of_worker_processes_one_per_simulated_device() -> None:
    env = {"STREAMPOOL_DEVICE": "sim", "STREAMPOOL_SIM_DEVICES": "2", "STREAMPOOL_SIM_CAPACITY": "64MiB"}
    run_on_cluster(2, env)


@pytest.mark.gpu
def test_a_cluster_on_the_gpus() -> None:
    """One worker per GPU, two at most (one on a one-GPU machine)."""
    run_on_cluster(min(2, streampool.device_count()), {"STREAMPOOL_DEVICE": "cuda"})


@pytest.mark.gpu
def test_a_cluster_on_two_gpus() -> None:
    if streampool.device_count() < 2:
        pytest.skip(f"needs two GPUs, found {streampool.device_count()}")
    run_on_cluster(2, {"STREAMPOOL_DEVICE": "cuda"}, resource="async")


@pytest.mark.nosim
def test_teardown_hands_the_driver_pools_memory_back(
    two_devices: SimulatedDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default pool keeps what it gets back: a plugin registered next found the device
    # full (a 12 GiB pool's memory reserved after it was gone, on 16 GiB).
    monkeypatch.setattr(streampool.dask, "_INSTALLED", {})  # as a fresh worker process has them
    monkeypatch.setattr(streampool.dask, "_BEFORE", {})
    free_before = mr.available_device_memory(0)[0]
    plugin = StreampoolPlugin(functools.partial(_primed_pool, initial="48MiB"))
    worker = FakeWorker(0)
    plugin.setup(worker)
    assert mr.available_device_memory(0)[0] <= free_before - (48 << 20)
    plugin.teardown(worker)
    assert mr.available_device_memory(0)[0] >= free_before  # earlier tests' leftovers too


def _primed_pool(device: int, initial: str) -> mr.MemoryResource:
    return mr.PoolMemoryResource(mr.CudaAsyncMemoryResource(device=device), initial_pool_size=initial)


@pytest.mark.nosim
def test_a_failed_setup_is_what_tasks_are_told(two_devices: SimulatedDevice) -> None:
    # A worker that joins later logs its failed setup in its own log only: tasks asking for
    # the resource were told to register the plugin, which was registered.
    plugin = StreampoolPlugin(device=1)
    worker = FakeWorker("late")
    worker.plugins[StreampoolPlugin.name] = plugin
    plugin.device = 5  # as a worker of a machine with fewer devices finds it
    with pytest.raises(ValueError, match="was given device 5"):
        plugin.setup(worker)
    with pytest.raises(
        RuntimeError,
        match=r"setup failed on worker 'late': ValueError: worker 'late' was given device 5, .* "
        r"\(in streampool's plugin on worker 'late', device 5\)",
    ):
        streampool.dask._installed(worker)


def test_an_asynchronous_client_is_refused_rather_than_dropped() -> None:
    class AsyncClient:
        asynchronous = True

    for call in (streampool.dask.register, streampool.dask.statistics):
        with pytest.raises(TypeError, match="needs a synchronous Client"):
            call(AsyncClient())  # type: ignore[arg-type]
