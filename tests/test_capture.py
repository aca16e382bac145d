"""CUDA graph captures through the allocator entry points (PyTorch's and CuPy's path), on
the simulated device, which refuses what the driver refuses during a capture and
invalidates it as the driver does (``SimulatedDevice.begin_capture``). The GPU half,
PyTorch's ``torch.cuda.graph`` and CuPy's capture on the driver, is in
tests/test_gpu_frameworks.py."""

from __future__ import annotations

import ctypes
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import streampool
from streampool import _native, allocators, mr
from streampool.sim import SimulatedDevice

from .test_allocators import ALLOC, FREE, LIB

MIB = 1 << 20
BEGIN = getattr(LIB, allocators.CAPTURE_BEGIN_FUNCTION)
BEGIN.restype = None
BEGIN.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p]
END = getattr(LIB, allocators.CAPTURE_END_FUNCTION)
END.restype = None
END.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]


@contextmanager
def capture(sim: SimulatedDevice, s: streampool.Stream | None = None) -> Iterator[None]:
    """A capture as PyTorch makes one: announced to the entry points (its pool hooks) just
    before it begins, and its end announced after it ends. `s=None`: the calling thread's
    per-thread default stream."""
    stream = s if s is not None else streampool.PER_THREAD_DEFAULT_STREAM
    BEGIN(0, 1, 2, None)
    sim.begin_capture(stream)
    try:
        yield
    finally:
        try:
            sim.end_capture(stream)  # raises had anything invalidated the capture
        finally:
            END(0, 1, 2)


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


def use_stats() -> mr.StatisticsResourceAdaptor[mr.CudaAsyncMemoryResource]:
    """Statistics over the driver's pool, made the device's resource."""
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    use(stats)
    return stats


def test_the_drivers_pool_allocates_graph_memory_in_a_capture(sim: SimulatedDevice, current: None) -> None:
    stats = use_stats()
    s = streampool.Stream()
    failures = allocators.failure_count()
    with capture(sim, s):
        p, q = alloc(MIB, s), alloc(2 * MIB, s)
        assert p and q
        free(p, MIB, s)  # in the capture: a free node of the graph
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
    with capture(sim, s):
        p = alloc(3 * MIB, s)
        assert p
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
    with capture(sim, s):
        free(before, MIB, s)  # PyTorch frees on the allocation's stream, capturing or not
        assert pool.stats["used_bytes"] > 0  # put off: its block would be reused in the graph's life
        inside = alloc(MIB, s)
        free(inside, MIB, s)
        assert pool.stats["used_bytes"] > 0
    later = alloc(256, s)  # the next call frees what was put off
    free(later, 256, s)
    assert allocators.failure_count() == failures, allocators.last_error()
    assert pool.stats["used_bytes"] == 0


@pytest.mark.parametrize("first", ["free", "alloc"])
def test_a_free_on_another_stream_during_a_capture_waits_for_its_end(
    sim: SimulatedDevice, current: None, first: str
) -> None:
    """During a capture in the global mode the driver refuses a free on another stream (and
    the capture is invalidated), from its beginning: before its first allocation too. While
    a capture is announced, frees wait (their stream is not asked: it may be gone), and an
    allocation on another stream is made in the relaxed mode."""
    stats = use_stats()
    s, t = streampool.Stream(), streampool.Stream()
    before = alloc(MIB, t)
    failures = allocators.failure_count()
    with capture(sim, s):
        if first == "alloc":
            free(alloc(MIB, s), MIB, s)
        free(before, MIB, t)  # put off
        assert stats.allocation_counts.current_bytes == MIB
        other = alloc(MIB, t)  # in the relaxed mode
        free(other, MIB, t)
        free(alloc(MIB, s), MIB, s)
    free(alloc(256, t), 256, t)  # frees what was put off
    assert allocators.failure_count() == failures, allocators.last_error()
    assert stats.allocation_counts.current_bytes == 0


def test_what_one_capture_put_off_waits_through_the_next(sim: SimulatedDevice, current: None) -> None:
    stats = use_stats()
    s1, s2, t = streampool.Stream(), streampool.Stream(), streampool.Stream()
    before = alloc(MIB, s1)
    failures = allocators.failure_count()
    with capture(sim, s1):
        free(before, MIB, s1)  # put off: memory from before the capture, on its stream
    with capture(sim, s2):  # announced: nothing put off is freed into it
        free(alloc(MIB, s2), MIB, s2)
        free(alloc(256, t), 256, t)
    free(alloc(256, t), 256, t)
    assert allocators.failure_count() == failures, allocators.last_error()
    assert stats.allocation_counts.current_bytes == 0


def test_a_capture_that_fails_leaves_the_entry_points_working(sim: SimulatedDevice, current: None) -> None:
    """PyTorch calls the end hook only once a capture has ended well: after an invalidated
    capture its announcement stays, until the streams seen capturing show it has ended."""
    stats = use_stats()
    s, t = streampool.Stream(), streampool.Stream()
    failures = allocators.failure_count()
    BEGIN(0, 1, 2, None)
    sim.begin_capture(s)
    free(alloc(MIB, s), MIB, s)  # the capture is seen
    with pytest.raises(streampool.StreampoolError):
        s.synchronize()  # invalidates the capture
    with pytest.raises(streampool.StreampoolError, match="INVALIDATED"):
        sim.end_capture(s)
    for _ in range(50):
        free(alloc(MIB, t), MIB, t)
    free(alloc(256, t), 256, t)
    assert stats.allocation_counts.current_bytes == 0
    assert allocators.failure_count() == failures, allocators.last_error()
    with capture(sim, s):  # and the next capture is announced as ever
        free(alloc(MIB, s), MIB, s)


def test_a_capture_on_a_thread_that_exits_leaves_nothing_behind(sim: SimulatedDevice, current: None) -> None:
    """Its per-thread default stream's frees put off are freed by another thread, on the
    legacy default stream (ordered after it)."""
    stats = use_stats()
    ptds = streampool.PER_THREAD_DEFAULT_STREAM
    failures = allocators.failure_count()

    def worker() -> None:
        before = ALLOC(MIB, 0, ptds.handle)
        with capture(sim):
            FREE(before, MIB, 0, ptds.handle)  # put off
            FREE(ALLOC(MIB, 0, ptds.handle), MIB, 0, ptds.handle)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    s = streampool.Stream()
    for _ in range(3):
        free(alloc(MIB, s), MIB, s)
    assert allocators.failure_count() == failures, allocators.last_error()
    assert stats.allocation_counts.current_bytes == 0


def test_outside_an_announced_capture_the_entry_points_ask_nothing_more(
    sim: SimulatedDevice, current: None
) -> None:
    """A capture not announced to the entry points is not seen (its stream is asked its
    identity, which invalidates it): streams are asked whether they capture only while one
    is announced, so that a program that never captures pays nothing, and a stream
    destroyed by its owner is never asked (the question crashes the driver there)."""
    s = streampool.Stream()
    sim.begin_capture(s)
    assert alloc(256, s) == 0
    with pytest.raises(streampool.StreampoolError, match="INVALIDATED"):
        sim.end_capture(s)


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
    with capture(sim, s):  # the refusal harms nothing
        assert alloc(4096, s) == 0
        assert allocators.failure_count() == failures + 1
        error = allocators.last_error() or ""
        assert "capturing a CUDA graph" in error and "CudaAsyncMemoryResource" in error, error
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


class _ForeignStream:
    """Another library's stream object (cuda.core's protocol)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def test_another_librarys_capturing_stream_is_wrapped_without_harming_the_capture(
    sim: SimulatedDevice,
) -> None:
    s = streampool.Stream()
    foreign = _ForeignStream(s.handle)
    served = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    refusing = mr.ShardedPoolMemoryResource(mr.CudaMemoryResource())
    sim.begin_capture(s)
    p = served.allocate(MIB, foreign)  # graph memory
    served.deallocate(p, MIB, foreign)
    with pytest.raises(streampool.StreampoolError, match="capturing a CUDA graph"):
        refusing.allocate(MIB, foreign)
    sim.end_capture(s)  # raises had anything asked the stream its identity
    q = refusing.allocate(MIB, foreign)  # an ordinary stream again
    refusing.deallocate(q, MIB, foreign)


def test_a_stream_object_made_during_a_capture_is_refused_saying_why(sim: SimulatedDevice) -> None:
    """A streampool.Stream lives on past the capture, marked or not: made from a capturing
    stream it is refused (asking the stream's device would invalidate the capture)."""
    s = streampool.Stream()
    sim.begin_capture(s)
    with pytest.raises(streampool.StreampoolError, match="capturing a CUDA graph"):
        streampool.Stream(_ForeignStream(s.handle))
    sim.end_capture(s)
    assert streampool.Stream(_ForeignStream(s.handle)).handle == s.handle


def test_use_hands_pytorch_the_capture_announcements() -> None:
    """What torch.use() sets on PyTorch's pluggable allocator (its pool hooks, which
    torch.cuda.graph calls around each capture), shown with a stand-in for it."""
    from streampool.allocators import torch as sp_torch

    class Hooks:
        def __init__(self, refuse: bool = False) -> None:
            self.set: dict[str, int] = {}
            self.refuse = refuse

        def set_begin_allocate_to_pool(self, address: int) -> None:
            if self.refuse:
                raise TypeError("incompatible function arguments")
            self.set["begin"] = address

        def set_end_allocate_to_pool_fn(self, address: int) -> None:
            self.set["end"] = address

    class Pluggable:
        def __init__(self, hooks: object) -> None:
            self._allocator = hooks

    hooks = Hooks()
    assert sp_torch._announce_captures(Pluggable(hooks))
    address = {
        name: ctypes.cast(getattr(LIB, f), ctypes.c_void_p).value
        for name, f in (
            ("begin", allocators.CAPTURE_BEGIN_FUNCTION),
            ("end", allocators.CAPTURE_END_FUNCTION),
        )
    }
    assert hooks.set == address
    assert not sp_torch._announce_captures(Pluggable(Hooks(refuse=True)))
    assert not sp_torch._announce_captures(Pluggable(object()))


def _announced() -> bool:
    """Whether a capture is announced: PyTorch's statistics then ask the pool nothing."""
    from streampool import _native

    return _native._torch_memory_stats(0)[3] is None


class _Graph:
    """A stand-in for ``torch.cuda.CUDAGraph``: ``capture_begin`` calls the begin hook
    before a failure it may raise, as PyTorch does (``cudaStreamBeginCapture`` comes after
    its hook), or raises before it (PyTorch's check of the stream comes first);
    ``capture_end`` raises before its end hook (an invalidated capture) or after it (a
    graph that fails to instantiate)."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail

    def capture_begin(self) -> None:
        if self.fail == "before begin hook":
            raise RuntimeError("CUDA graphs must be captured on a non-default stream")
        BEGIN(0, 1, 2, None)
        if self.fail == "after begin hook":
            raise RuntimeError("operation not permitted when stream is capturing")

    def capture_end(self) -> None:
        if self.fail == "before end hook":
            raise RuntimeError("operation failed due to a previous error during capture")
        END(0, 1, 2)
        if self.fail == "after end hook":
            raise RuntimeError("cudaGraphInstantiate failed")


@pytest.fixture
def graph_type(sim: SimulatedDevice) -> Iterator[type[_Graph]]:
    from streampool.allocators import torch as sp_torch

    class Graph(_Graph):
        pass

    sp_torch._end_failed_captures(Graph, getattr(LIB, allocators.CAPTURE_END_FUNCTION))
    sp_torch._end_failed_captures(Graph, getattr(LIB, allocators.CAPTURE_END_FUNCTION))  # once
    assert not _announced()
    yield Graph
    while _announced():
        END(0, 1, 2)


def test_a_capture_that_pytorch_ends_with_an_error_is_no_longer_announced(
    graph_type: type[_Graph],
) -> None:
    """PyTorch's capture_end raises before its end hook when the capture failed (one with no
    allocation is seen by nothing else): the wrapper ends the announcement."""
    graph = graph_type("before end hook")
    graph.capture_begin()
    assert _announced()
    with pytest.raises(RuntimeError, match="previous error"):
        graph.capture_end()
    assert not _announced()


def test_a_capture_that_fails_to_begin_after_its_hook_is_no_longer_announced(
    graph_type: type[_Graph],
) -> None:
    with pytest.raises(RuntimeError, match="not permitted"):
        graph_type("after begin hook").capture_begin()
    assert not _announced()


@pytest.mark.parametrize("fail", ["before begin hook", "after end hook", "capture_end alone"])
def test_a_failure_that_owes_no_end_leaves_another_capture_announced(
    graph_type: type[_Graph], fail: str
) -> None:
    """A failed call whose hook did not announce (a begin refused before its hook), or whose
    end hook already ran (a graph that failed to instantiate), or a capture_end with no
    begin on its thread, ends nothing: another capture, begun on another thread, stays
    announced."""
    other = threading.Thread(target=lambda: BEGIN(0, 3, 4, None))
    other.start()
    other.join()
    graph = graph_type(fail)
    if fail == "before begin hook":
        with pytest.raises(RuntimeError, match="non-default stream"):
            graph.capture_begin()
    elif fail == "after end hook":
        graph.capture_begin()
        with pytest.raises(RuntimeError, match="Instantiate"):
            graph.capture_end()
    else:
        with pytest.raises(RuntimeError, match="previous error"):
            graph_type("before end hook").capture_end()
    assert _announced()  # the other thread's capture
    END(0, 3, 4)
    assert not _announced()


def test_a_use_mem_pool_region_announces_no_capture(sim: SimulatedDevice, current: None) -> None:
    """PyTorch calls the pool hooks around a ``torch.cuda.use_mem_pool`` region too: the
    region captures nothing, and announced, it would keep every free waiting until its end.
    Its begin and end functions (stand-ins here, calling the hooks as PyTorch's do) announce
    nothing; a capture begun inside the region is announced as any other."""
    from streampool.allocators import torch as sp_torch

    def begin(device: int, pool: tuple[int, int]) -> None:
        BEGIN(device, *pool, None)

    def end(device: int, pool: tuple[int, int]) -> None:
        END(device, *pool)
        if pool == (9, 9):
            raise RuntimeError("no such pool")

    torch_c = types.SimpleNamespace(_cuda_beginAllocateCurrentThreadToPool=begin, _cuda_endAllocateToPool=end)
    cuda_memory = types.SimpleNamespace(
        _cuda_beginAllocateCurrentThreadToPool=begin, _cuda_endAllocateToPool=end
    )
    sp_torch._regions_announce_nothing(torch_c, cuda_memory)
    wrapped = cuda_memory._cuda_beginAllocateCurrentThreadToPool
    sp_torch._regions_announce_nothing(torch_c, cuda_memory)  # once
    assert cuda_memory._cuda_beginAllocateCurrentThreadToPool is wrapped
    assert torch_c._cuda_endAllocateToPool is not end
    before = _native._capture_hook_calls()
    cuda_memory._cuda_beginAllocateCurrentThreadToPool(0, (1, 2))
    assert not _announced()
    stats, s = use_stats(), streampool.Stream()
    free(alloc(MIB, s), MIB, s)
    assert stats.allocation_counts.current_bytes == 0  # freed, not put off
    BEGIN(0, 3, 4, None)  # a capture inside the region
    assert _announced()
    END(0, 3, 4)
    cuda_memory._cuda_endAllocateToPool(0, (1, 2))
    assert not _announced() and _native._capture_hook_calls() == (before[0] + 1, before[1] + 1)
    with pytest.raises(RuntimeError, match="no such pool"):
        torch_c._cuda_endAllocateToPool(0, (9, 9))
    BEGIN(0, 5, 6, None)  # the hooks announce again once the region's calls are done
    assert _announced()
    END(0, 5, 6)
    assert not _announced()
