"""The conformance suite: every resource passes the same tests on the simulated device."""

from __future__ import annotations

import threading

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

from .conftest import SIM_CAPACITY


def overlaps(live: dict[int, int], ptr: int, size: int) -> bool:
    return any(ptr < p + n and p < ptr + size for p, n in live.items())


def test_zero_size(resource: mr.MemoryResource, stream: streampool.Stream) -> None:
    assert resource.allocate(0, stream) == 0
    resource.deallocate(0, 0, stream)
    assert resource.allocate(0) == 0


def test_sizes_alignment_no_overlap(resource: mr.MemoryResource, sim: SimulatedDevice) -> None:
    s = streampool.Stream()
    live: dict[int, int] = {}
    for size in [1, 7, 255, 256, 257, 4096, 4097, 1 << 16, 1 << 20, 3 << 20, "16MiB"]:
        ptr = resource.allocate(size, s)
        n = streampool.parse_size(size)
        assert ptr % 256 == 0
        assert not overlaps(live, ptr, n)
        sim.write(s, ptr, n)
        live[ptr] = n
    for ptr, n in live.items():
        resource.deallocate(ptr, n, s)
    sim.run()


def test_same_stream_reuse(resource: mr.MemoryResource, sim: SimulatedDevice) -> None:
    s = streampool.Stream()
    for _ in range(20):
        ptr = resource.allocate(4096, s)
        sim.write(s, ptr, 4096)
        sim.read(s, ptr, 4096)
        resource.deallocate(ptr, 4096, s)
    sim.run()


def test_cross_stream_reuse(resource: mr.MemoryResource, sim: SimulatedDevice) -> None:
    streams = [streampool.Stream() for _ in range(3)]
    for i in range(30):
        s = streams[i % 3]
        size = 1024 << (i % 4)
        ptr = resource.allocate(size, s)
        sim.write(s, ptr, size, label=f"round {i}")
        resource.deallocate(ptr, size, s)
        if i % 5 == 0:
            sim.step(streams[0])
    sim.run()


def test_default_streams(resource: mr.MemoryResource, sim: SimulatedDevice) -> None:
    for s in (
        None,
        streampool.DEFAULT_STREAM,
        streampool.LEGACY_DEFAULT_STREAM,
        streampool.PER_THREAD_DEFAULT_STREAM,
        0,
        1,
        2,
    ):
        ptr = resource.allocate(512, s)
        sim.write(s, ptr, 512)
        resource.deallocate(ptr, 512, s)
    sim.run()


def test_frees_from_other_threads(resource: mr.MemoryResource) -> None:
    s = streampool.Stream()
    ptrs = [resource.allocate(1000, s) for _ in range(64)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                with lock:
                    if not ptrs:
                        return
                    ptr = ptrs.pop()
                resource.deallocate(ptr, 1000, s)
                mine = resource.allocate(300, s)
                resource.deallocate(mine, 300, s)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_out_of_memory(resource: mr.MemoryResource) -> None:
    if resource.memory_kind == "pinned_host":
        pytest.skip("pinned host memory does not count against the simulated device's capacity")
    s = streampool.Stream()
    with pytest.raises(streampool.OutOfMemoryError) as info:
        resource.allocate(SIM_CAPACITY + 1, s)
    assert isinstance(info.value, MemoryError)
    assert str(SIM_CAPACITY + 1) in str(info.value)
    assert info.value.requested == SIM_CAPACITY + 1
    # still usable
    ptr = resource.allocate(SIM_CAPACITY // 2, s)
    resource.deallocate(ptr, SIM_CAPACITY // 2, s)


@pytest.mark.parametrize("size", [-1, -(1 << 40), "-1MiB", "lots", 1.5, None])
def test_bad_sizes(resource: mr.MemoryResource, size: object) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        resource.allocate(size)  # type: ignore[arg-type]
    assert str(size) in str(info.value) or type(size).__name__ in str(info.value)
    ptr = resource.allocate(256)
    resource.deallocate(ptr, 256)


@pytest.mark.parametrize("bad", [object(), "stream", 3.5, [1]])
def test_bad_streams(resource: mr.MemoryResource, bad: object) -> None:
    with pytest.raises(TypeError, match=type(bad).__name__):
        resource.allocate(256, bad)  # type: ignore[arg-type]
    ptr = resource.allocate(256)
    resource.deallocate(ptr, 256)


def test_unknown_and_destroyed_stream_handles(resource: mr.MemoryResource) -> None:
    with pytest.raises(streampool.InvalidStreamError, match="0x7777"):
        resource.allocate(256, 0x7777)
    s = streampool.Stream()
    handle = s.handle
    del s
    with pytest.raises(streampool.InvalidStreamError, match=hex(handle)):
        resource.allocate(256, handle)
    ptr = resource.allocate(256)
    resource.deallocate(ptr, 256)


def test_bad_pointers(resource: mr.MemoryResource) -> None:
    s = streampool.Stream()
    ptr = resource.allocate(1024, s)
    with pytest.raises(streampool.InvalidPointerError):
        resource.deallocate(0xDEAD0000, 1024, s)
    with pytest.raises(streampool.InvalidPointerError):
        resource.deallocate(0, 16, s)
    with pytest.raises(streampool.InvalidPointerError):
        resource.deallocate(ptr, 0, s)
    resource.deallocate(ptr, 1024, s)
    with pytest.raises(streampool.InvalidPointerError):
        resource.deallocate(ptr, 1024, s)  # double free
    again = resource.allocate(1024, s)
    resource.deallocate(again, 1024, s)


def test_repr_names_the_resource(resource: mr.MemoryResource) -> None:
    assert type(resource).__name__ in repr(resource)
    assert resource.device == 0
