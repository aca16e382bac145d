"""Shared fixtures.

Every test runs on a fresh simulated device (entered for the test, exited after) unless
it is marked ``gpu``; GPU tests run only with ``STREAMPOOL_GPU_TESTS=1`` on a machine
with a CUDA driver (see DEVELOPERS.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

GPU = os.environ.get("STREAMPOOL_GPU_TESTS") == "1"
SIM_CAPACITY = 256 << 20


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (runs with STREAMPOOL_GPU_TESTS=1)")
    config.addinivalue_line("markers", "nosim: the test manages simulated devices itself")
    config.addinivalue_line("markers", "races_expected: the test provokes races on purpose")
    config.addinivalue_line(
        "markers", "drop_errors_expected: the test provokes failures recorded in streampool.drop_errors()"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run with STREAMPOOL_GPU_TESTS=1 (DEVELOPERS.md)")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds folder names too
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def sim(request: pytest.FixtureRequest) -> Iterator[SimulatedDevice | None]:
    """The simulated device every non-GPU test runs on (a `nosim` test makes its own). A
    test fails on a race the detector found, and on a failure recorded where nobody could
    be told (a new entry in streampool.drop_errors(): a free or a stream's destruction
    when its last reference went), unless it provokes them on purpose (`races_expected`,
    `drop_errors_expected`)."""
    if request.node.get_closest_marker("gpu"):
        yield None
        return
    before = streampool.drop_errors()[0]
    if request.node.get_closest_marker("nosim"):
        yield None
    else:
        with SimulatedDevice(capacity_bytes=SIM_CAPACITY) as dev:
            yield dev
            races = dev.races()
        assert not races or request.node.get_closest_marker("races_expected"), f"unexpected races: {races}"
    count, recent = streampool.drop_errors()
    if count != before and not request.node.get_closest_marker("drop_errors_expected"):
        pytest.fail(
            f"{count - before} unexpected drop error(s) (this test's, or an earlier test's garbage "
            f"collected now), the last: {recent[-1]}"
        )


_OWNERS: list[mr.MemoryResource] = []


def _view() -> mr.MemoryResource:
    owner = mr.CudaAsyncMemoryResource(release_threshold=0)
    _OWNERS.append(owner)  # the view never destroys the pool; its owner must outlive it
    return mr.CudaAsyncViewMemoryResource(owner.pool_handle)


def _adaptor_stack() -> mr.MemoryResource:
    """Logging over tracking over limiting over statistics over the driver's pool."""
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    limited = mr.LimitingResourceAdaptor(stats, "200MiB")
    tracked = mr.TrackingResourceAdaptor(limited)
    return mr.LoggingResourceAdaptor(tracked, callback=[].append)


def _binning() -> mr.MemoryResource:
    binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 10, 16)
    binning.add_bin("4MiB", mr.CudaAsyncMemoryResource())
    return binning


def _callback() -> mr.MemoryResource:
    base = mr.CudaAsyncMemoryResource()
    return mr.CallbackMemoryResource(base.allocate, base.deallocate)


RESOURCES = {
    "async_current": lambda: mr.CudaAsyncMemoryResource(),
    "async_own": lambda: mr.CudaAsyncMemoryResource(initial_pool_size="8MiB", release_threshold="64MiB"),
    "async_view": _view,
    "cuda": lambda: mr.CudaMemoryResource(),
    "managed": lambda: mr.ManagedMemoryResource(),
    "async_managed": lambda: mr.CudaAsyncManagedMemoryResource(),
    "async_managed_own": lambda: mr.CudaAsyncManagedMemoryResource(initial_pool_size="8MiB"),
    "pinned": lambda: mr.PinnedHostMemoryResource(),
    # Adaptors, over the driver's pool (FixedSizeMemoryResource is not a general resource:
    # it refuses sizes above its block; it runs here as the bins of "binning").
    "adaptor_statistics": lambda: mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource()),
    "adaptor_latency": lambda: mr.LatencyHistogramAdaptor(mr.CudaAsyncMemoryResource()),
    "adaptor_tracking": lambda: mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource(), capture_stacks=True),
    "adaptor_logging": lambda: mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=[].append),
    "adaptor_limiting": lambda: mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "200MiB"),
    "adaptor_failure_callback": lambda: mr.FailureCallbackResourceAdaptor(
        mr.CudaAsyncMemoryResource(), lambda nbytes: False
    ),
    "adaptor_prefetch": lambda: mr.PrefetchResourceAdaptor(mr.CudaAsyncMemoryResource()),
    "adaptor_prefetch_managed": lambda: mr.PrefetchResourceAdaptor(mr.ManagedMemoryResource()),
    "adaptor_binning": _binning,
    "pool_over_async": lambda: mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()),
    "pool_rmm_name": lambda: mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size="16MiB"),
    "pool_bounded": lambda: mr.ShardedPoolMemoryResource(
        mr.CudaAsyncMemoryResource(), maximum_pool_size="200MiB", release_threshold="8MiB", events_every=4
    ),
    "pool_batched": lambda: mr.ShardedPoolMemoryResource(
        mr.CudaAsyncMemoryResource(), headroom=2, event_batch=8
    ),
    "pool_expandable": lambda: mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), expandable=True),
    "pool_lean": lambda: mr.ShardedPoolMemoryResource(
        mr.CudaAsyncMemoryResource(),
        expandable=True,
        steal_whole_blocks=True,
        gather_interval=0,
        events_every=1,
    ),
    "pool_one_heap": lambda: mr.ShardedPoolMemoryResource(
        mr.CudaAsyncMemoryResource(), expandable=True, one_heap=True
    ),
    "adaptor_stack": _adaptor_stack,
    "arena": lambda: mr.ArenaMemoryResource(mr.CudaAsyncMemoryResource(), arena_size="160MiB"),
    "callback": _callback,
}


@pytest.fixture(params=sorted(RESOURCES))
def resource(request: pytest.FixtureRequest, sim: SimulatedDevice | None) -> Iterator[mr.MemoryResource]:
    yield RESOURCES[request.param]()
    _OWNERS.clear()


@pytest.fixture
def stream() -> streampool.Stream:
    return streampool.Stream()
