"""The per-thread default stream across threads: a buffer made on one thread's per-thread
default stream stays ordered with that stream when another thread reads, exports or frees
it (handle 2 names the calling thread's own stream, so the other thread orders its work
through the legacy default stream instead)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

PTDS = streampool.PER_THREAD_DEFAULT_STREAM
SIZE = 4096
T = TypeVar("T")


def on_another_thread(fn: Callable[[], T]) -> T:
    """Runs `fn` on a new thread and returns its result (or raises its exception)."""
    out: list[T] = []
    err: list[BaseException] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # re-raised on the calling thread
            err.append(e)

    t = threading.Thread(target=body, name="maker")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def made_elsewhere(
    sim: SimulatedDevice, resource: mr.MemoryResource | None = None, size: int = SIZE
) -> streampool.DeviceBuffer:
    """A buffer made on another thread's per-thread stream and written there (the write is
    left in flight)."""

    def make() -> streampool.DeviceBuffer:
        buf = streampool.DeviceBuffer(size=size, stream=PTDS, mr=resource)
        sim.write(PTDS, buf.ptr, size, label="maker's write")
        return buf

    buf = on_another_thread(make)
    assert sim.pending >= 1, "the maker's write must still be in flight"
    return buf


def assert_no_races(sim: SimulatedDevice) -> None:
    sim.run()
    races = sim.races()
    sim.clear_races()  # reported here, not again by the fixture
    assert races == []


@pytest.mark.parametrize("how", ["tobytes", "copy_to_host", "copy_from_host"])
def test_host_copies_from_another_thread_are_ordered(sim: SimulatedDevice, how: str) -> None:
    buf = made_elsewhere(sim)
    if how == "copy_from_host":
        buf.copy_from_host(b"\x07" * SIZE)
        expected = b"\x07" * SIZE
    else:
        data = bytes(buf.tobytes() if how == "tobytes" else buf.copy_to_host())
        # The copy ran after the maker's write (a kernel write fills with one value, never 0).
        assert data[0] != 0 and data == data[:1] * SIZE
        expected = data
    assert_no_races(sim)
    assert buf.tobytes() == expected


@pytest.mark.parametrize("consumer", ["stream", "per_thread", "per_thread_int", "legacy"])
def test_dlpack_export_from_another_thread_orders_the_consumer(sim: SimulatedDevice, consumer: str) -> None:
    buf = made_elsewhere(sim)
    stream: object = {
        "stream": streampool.Stream(),
        "per_thread": PTDS,  # this thread's own: not the maker's, though both are handle 2
        "per_thread_int": 2,
        "legacy": None,
    }[consumer]
    capsule = buf.__dlpack__(stream=stream)
    sim.read(stream, buf.ptr, SIZE, label="consumer's read")  # type: ignore[arg-type]
    assert_no_races(sim)
    del capsule


def test_cuda_array_interface_names_the_stream_as_the_reader_must_use_it(sim: SimulatedDevice) -> None:
    buf = made_elsewhere(sim)
    assert on_another_thread(lambda: buf.__cuda_array_interface__["stream"]) == 1
    cai = buf.__cuda_array_interface__
    assert cai["stream"] == 1  # 2 would name this thread's own per-thread stream
    sim.read(cai["stream"], buf.ptr, SIZE, label="CAI consumer")
    assert_no_races(sim)

    def own() -> int:
        mine = streampool.DeviceBuffer(size=SIZE, stream=PTDS)
        return mine.__cuda_array_interface__["stream"]

    assert on_another_thread(own) == 2


@pytest.mark.parametrize("again_on", ["per_thread", "stream"])
def test_collected_on_another_thread_then_reallocated(
    sim: SimulatedDevice, resource: mr.MemoryResource, again_on: str
) -> None:
    buf = made_elsewhere(sim, resource)
    del buf
    gc.collect()
    s = PTDS if again_on == "per_thread" else streampool.Stream()
    again = streampool.DeviceBuffer(size=SIZE, stream=s, mr=resource)
    sim.write(s, again.ptr, SIZE, label="reuse")
    assert_no_races(sim)


def test_freed_on_another_thread_without_waiting(sim: SimulatedDevice) -> None:
    # The driver's pool hands the block to another stream before the free has completed,
    # making that stream wait for the free: the free must itself be ordered after the
    # maker's write, with nothing run on the host meanwhile.
    resource = mr.CudaAsyncMemoryResource()
    buf = made_elsewhere(sim, resource)
    ptr = buf.ptr
    del buf
    gc.collect()
    # Freed on the legacy stream (as this thread names the maker's per-thread stream): the
    # maker's write is still queued, and the free's legacy-stream barrier.
    assert sim.pending == 2, "freeing must not wait for the device"
    s = streampool.Stream()
    again = streampool.DeviceBuffer(size=SIZE, stream=s, mr=resource)
    assert again.ptr == ptr
    sim.write(s, again.ptr, SIZE, label="reuse")
    assert_no_races(sim)


def test_pool_reuses_a_block_freed_on_another_thread_in_order(sim: SimulatedDevice) -> None:
    # A pool that cannot grow: the reallocation gets the very block that was freed.
    pool = mr.ShardedPoolMemoryResource(
        mr.CudaMemoryResource(), initial_pool_size="64KiB", maximum_pool_size="64KiB"
    )
    buf = made_elsewhere(sim, pool, size=64 << 10)
    ptr = buf.ptr
    del buf
    gc.collect()
    again = streampool.DeviceBuffer(size=64 << 10, stream=PTDS, mr=pool)
    assert again.ptr == ptr
    sim.write(PTDS, again.ptr, 64 << 10, label="reuse")
    assert_no_races(sim)


def test_closed_on_another_thread(sim: SimulatedDevice) -> None:
    resource = mr.CudaAsyncMemoryResource()
    buf = made_elsewhere(sim, resource)
    ptr = buf.ptr
    buf.close()
    s = streampool.Stream()
    again = streampool.DeviceBuffer(size=SIZE, stream=s, mr=resource)
    assert again.ptr == ptr
    sim.write(s, again.ptr, SIZE, label="reuse")
    assert_no_races(sim)
