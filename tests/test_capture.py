"""CUDA graph captures through the allocator entry points (PyTorch's and CuPy's path), on
the simulated device, which refuses what the driver refuses during a capture and
invalidates it as the driver does (``SimulatedDevice.begin_capture``). The GPU half,
PyTorch's ``torch.cuda.graph`` and CuPy's capture on the driver, is in
tests/test_gpu_frameworks.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import streampool
from streampool import allocators, mr
from streampool.sim import SimulatedDevice

from .test_allocators import ALLOC, FREE

MIB = 1 << 20


def alloc(size: int, stream: streampool.Stream) -> int:
    return ALLOC(size, 0, stream.handle) or 0


def free(ptr: int, size: int, stream: streampool.Stream) -> None:
    FREE(ptr, size, 0, stream.handle)


@pytest.fixture
def current(sim: SimulatedDevice) -> Iterator[None]:
    previous = streampool.get_current_device_resource()
    yield
    streampool.set_current_device_resource(previous)


def use(resource: mr.MemoryResource) -> None:
    streampool.set_current_device_resource(resource)


def test_the_drivers_pool_allocates_graph_memory_in_a_capture(sim: SimulatedDevice, current: None) -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    use(stats)
    s = streampool.Stream()
    failures = allocators.failure_count()
    sim.begin_capture(s)
    p, q = alloc(MIB, s), alloc(2 * MIB, s)
    assert p and q
    free(p, MIB, s)  # in the capture: a free node of the graph
    sim.end_capture(s)  # raises had anything invalidated the capture
    free(q, 2 * MIB, s)  # graph memory freed after its capture
    assert allocators.failure_count() == failures, allocators.last_error()
    assert stats.allocation_counts.current_bytes == 0


def test_the_sharded_pool_passes_a_captures_allocations_to_the_drivers_pool(
    sim: SimulatedDevice, current: None
) -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    use(pool)
    s = streampool.Stream()
    warm = alloc(MIB, s)  # the stream is now one the thread keeps (the fast path's)
    free(warm, MIB, s)
    reserved = pool.stats["reserved_bytes"]
    failures = allocators.failure_count()
    sim.begin_capture(s)
    p = alloc(3 * MIB, s)
    assert p
    sim.end_capture(s)
    assert pool.stats["reserved_bytes"] == reserved  # graph memory is not the pool's
    free(p, 3 * MIB, s)
    assert allocators.failure_count() == failures, allocators.last_error()
    assert pool.stats["used_bytes"] == 0


def test_a_free_of_memory_from_before_the_capture_waits_for_its_end(
    sim: SimulatedDevice, current: None
) -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    use(pool)
    s = streampool.Stream()
    before = alloc(MIB, s)
    failures = allocators.failure_count()
    sim.begin_capture(s)
    free(before, MIB, s)  # PyTorch frees on the allocation's stream, capturing or not
    assert pool.stats["used_bytes"] > 0  # put off: its block would be reused in the graph's life
    inside = alloc(MIB, s)  # the capture goes on; nothing put off is due yet
    free(inside, MIB, s)
    assert pool.stats["used_bytes"] > 0
    sim.end_capture(s)
    later = alloc(256, s)  # the next call frees what was put off
    free(later, 256, s)
    assert allocators.failure_count() == failures, allocators.last_error()
    assert pool.stats["used_bytes"] == 0


def test_a_free_on_another_stream_during_a_capture_waits_for_its_end(
    sim: SimulatedDevice, current: None
) -> None:
    """PyTorch frees a tensor on the stream it was allocated on, capturing or not; during a
    capture in the global mode the driver refuses a free on another stream, and the
    capture is invalidated."""
    use(mr.CudaAsyncMemoryResource())
    s, t = streampool.Stream(), streampool.Stream()
    before = alloc(MIB, t)
    failures = allocators.failure_count()
    sim.begin_capture(s)
    inside = alloc(MIB, s)  # the entry points see the capture
    free(before, MIB, t)  # put off
    free(inside, MIB, s)
    sim.end_capture(s)  # raises had the free reached the driver
    later = alloc(256, t)  # frees what was put off
    free(later, 256, t)
    assert allocators.failure_count() == failures, allocators.last_error()


@pytest.mark.parametrize("kind", ["fixed_size", "binning", "cuda", "pool_over_cuda", "arena"])
def test_a_resource_that_cannot_serve_a_capture_says_so(
    sim: SimulatedDevice, current: None, kind: str
) -> None:
    upstream = mr.CudaAsyncMemoryResource()
    resource: mr.MemoryResource = {
        "fixed_size": lambda: mr.FixedSizeMemoryResource(upstream, block_size=MIB),
        "binning": lambda: mr.BinningMemoryResource(upstream, 10, 22),
        "cuda": mr.CudaMemoryResource,
        "pool_over_cuda": lambda: mr.ShardedPoolMemoryResource(mr.CudaMemoryResource()),
        "arena": lambda: mr.ArenaMemoryResource(upstream, arena_size=64 * MIB),
    }[kind]()
    use(resource)
    s = streampool.Stream()
    failures = allocators.failure_count()
    sim.begin_capture(s)
    assert alloc(4096, s) == 0
    assert allocators.failure_count() == failures + 1
    error = allocators.last_error() or ""
    assert "capturing a CUDA graph" in error and "CudaAsyncMemoryResource" in error, error
    sim.end_capture(s)  # the refusal harmed nothing
    p = alloc(4096, s)
    assert p
    free(p, 4096, s)


def test_asking_a_capturing_streams_identity_invalidates_the_capture(sim: SimulatedDevice) -> None:
    """What the entry points avoid: the simulated device models the driver's answer."""
    s = streampool.Stream()
    sim.begin_capture(s)
    with pytest.raises(streampool.StreampoolError, match="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"):
        s.synchronize()
    with pytest.raises(streampool.StreampoolError, match="INVALIDATED"):
        sim.end_capture(s)
