"""DLPack consumers on the simulated device: numpy.from_dlpack over memory the host can
read (managed and pinned: on the simulated device, as on a GPU, the host reads it where
it is), refused with a clear error for device memory; the consumer's stream ordered after
the buffer's; the buffer kept alive by the consumer; another device refused.

Device memory on the simulated device is host memory underneath, but it is reported as
device memory (kDLCUDA, as its CUDA array interface is): a consumer that reads it from
the host would be relying on what no GPU gives (tests/test_gpu_frameworks.py covers the
GPU consumers: PyTorch, CuPy, JAX)."""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

np = pytest.importorskip("numpy")

HOST_READABLE = [mr.ManagedMemoryResource, mr.PinnedHostMemoryResource]


@pytest.mark.parametrize("resource", HOST_READABLE)
def test_numpy_reads_host_readable_memory(resource: type[mr.MemoryResource]) -> None:
    stats = mr.StatisticsResourceAdaptor(resource())
    data = bytes(range(256)) * 4
    buf = streampool.DeviceBuffer(size=len(data), mr=stats, stream=streampool.Stream())
    buf.copy_from_host(data)  # enqueued on the buffer's stream; numpy waits for it
    array = np.from_dlpack(buf)
    assert array.dtype == np.uint8 and array.shape == (len(data),)
    assert array.tobytes() == data
    cpu = np.from_dlpack(buf, device="cpu")  # asks for dl_device=(kDLCPU, 0)
    assert cpu.tobytes() == data
    # The arrays keep the memory alive after the buffer is gone.
    del buf
    gc.collect()
    assert stats.allocation_counts.current_bytes == len(data)
    assert array[255] == 255 and cpu[1] == 1
    del array, cpu
    gc.collect()
    assert stats.allocation_counts.current_bytes == 0


def test_numpy_refuses_device_memory() -> None:
    buf = streampool.DeviceBuffer(size=64)
    with pytest.raises(BufferError, match=r"host cannot read: copy it to the host first \(buf\.copy_to_host"):
        np.from_dlpack(buf, device="cpu")
    with pytest.raises((BufferError, RuntimeError, TypeError)):
        np.from_dlpack(buf)  # kDLCUDA: numpy's own refusal
    assert buf.copy_to_host().size == 64  # the buffer is still usable


def test_a_consumer_stream_waits_for_the_buffer(sim: SimulatedDevice) -> None:
    producer, consumer = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=producer)
    sim.write(producer, buf.ptr, 4096, "producer writes")
    capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
    sim.read(consumer, buf.ptr, 4096, "consumer reads")  # ordered: the fixture finds no race
    sim.run()
    del capsule


@pytest.mark.races_expected
def test_no_synchronisation_is_asked_with_minus_one(sim: SimulatedDevice) -> None:
    producer, consumer = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=producer)
    sim.write(producer, buf.ptr, 4096, "producer writes")
    buf.__dlpack__(stream=-1, max_version=(1, 0))
    sim.read(consumer, buf.ptr, 4096, "consumer reads")
    sim.run()
    assert sim.races(), "stream=-1 must not order the consumer (the consumer said it orders itself)"
    sim.clear_races()


@pytest.mark.nosim
def test_a_consumer_on_another_device_is_refused() -> None:
    with SimulatedDevice(capacity_bytes=1 << 24, devices=2):
        buf = streampool.DeviceBuffer(size=64, mr=mr.CudaAsyncMemoryResource(device=0))
        with pytest.raises(BufferError, match="DeviceBuffer is on device 0 but the consumer is on device 1"):
            buf.__dlpack__(dl_device=(2, 1), stream=1)
        other = streampool.Stream(device=1)
        with pytest.raises(
            BufferError, match="consumer's stream is on device 1 but the DeviceBuffer on device 0"
        ):
            buf.__dlpack__(stream=other.handle)
        with pytest.raises(BufferError, match="consumer's stream is on device 1"):
            buf.__dlpack__(stream=other)
        assert buf.__dlpack__(stream=1) is not None  # still usable


def test_managed_memory_goes_to_its_gpu_as_device_memory_and_the_cpu_is_device_0() -> None:
    managed = streampool.DeviceBuffer(size=64, mr=mr.ManagedMemoryResource())
    assert managed.__dlpack_device__() == (13, 0)
    # A consumer that names its GPU (kDLCUDA) gets managed memory without a copy.
    assert managed.__dlpack__(dl_device=(2, 0), stream=1) is not None
    for buf in (managed, streampool.DeviceBuffer(size=64, mr=mr.PinnedHostMemoryResource())):
        with pytest.raises(BufferError, match=r"names CPU 5: DLPack's CPU device is \(1, 0\)"):
            buf.__dlpack__(dl_device=(1, 5))
        assert buf.__dlpack__(dl_device=(1, 0)) is not None


@pytest.mark.parametrize("how", ["del", "close"])
@pytest.mark.parametrize("pooled", [False, True])
def test_the_free_follows_the_consumers_work_once_it_lets_go(
    sim: SimulatedDevice, how: str, pooled: bool
) -> None:
    # torch and CuPy call the deleter when the tensor dies on the host, their kernels on its
    # stream maybe still queued: the memory's free must follow them.
    res: mr.MemoryResource = mr.CudaAsyncMemoryResource()
    if pooled:
        res = mr.ShardedPoolMemoryResource(res)
    producer, consumer = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=producer, mr=res)
    ptr = buf.ptr
    sim.write(producer, ptr, 4096, label="producer writes")
    capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
    sim.read(consumer, ptr, 4096, label="consumer's kernel reads, queued")
    if how == "del":
        del buf
    else:
        buf.close()
    del capsule  # the consumer lets go: the deleter runs now
    gc.collect()
    _reuse_and_write(sim, producer, ptr, res)


def _reuse_and_write(
    sim: SimulatedDevice, producer: streampool.Stream, ptr: int, res: mr.MemoryResource | None = None
) -> None:
    """The next owner of the freed 4 KiB at ``ptr`` (reused on the buffer's stream,
    ``producer``) writes it: the fixture fails the test on any race with the consumer's
    work."""
    again = streampool.DeviceBuffer(size=4096, stream=producer, mr=res)
    assert again.ptr == ptr, "the memory is reused on the buffer's stream"
    sim.write(producer, again.ptr, 4096, label="next owner writes")
    sim.run()


def _fake_library(monkeypatch: pytest.MonkeyPatch, name: str, **cuda: Callable[..., Any]) -> None:
    """An imported module ``name`` whose ``cuda`` namespace has these functions: CuPy's or
    PyTorch's, as the export looks up their current stream."""
    module = types.ModuleType(name)
    module.cuda = types.SimpleNamespace(**cuda)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)


class _OtherLibrarysStream:
    """A stream object of another library (CuPy's has the handle as ``.ptr``, PyTorch's as
    ``.cuda_stream``) that, as CuPy's does, destroys its stream when it dies."""

    def __init__(self) -> None:
        self.stream = streampool.Stream()
        self.ptr = self.cuda_stream = self.stream.handle


@pytest.mark.parametrize("how", ["cupy", "torch", "object", "wrapped"])
def test_the_consumers_stream_lives_until_the_consumer_lets_go(
    sim: SimulatedDevice, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """CuPy's and PyTorch's ``from_dlpack`` pass their current stream's handle; CuPy destroys
    a stream when its object dies, maybe before the arrays made on it (a ``with
    cupy.cuda.Stream():`` block). The export keeps that stream's object alive until the
    deleter has ordered the free after it: on the CUDA driver, ordering after a destroyed
    stream's handle crashed the process. The same for a stream object given, and for a
    ``streampool.Stream`` wrapping one."""
    current = [_OtherLibrarysStream()]
    if how == "cupy":
        _fake_library(monkeypatch, "cupy", get_current_stream=lambda: current[0])
    elif how == "torch":
        _fake_library(
            monkeypatch, "torch", is_initialized=lambda: True, current_stream=lambda device=None: current[0]
        )
    consumer = current[0]
    producer = streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=producer)
    ptr = buf.ptr
    given: object = {"object": consumer, "wrapped": streampool.Stream(consumer)}.get(how, consumer.ptr)
    capsule = buf.__dlpack__(stream=given, max_version=(1, 0))
    sim.read(consumer.stream, ptr, 4096, label="consumer's kernel reads, queued")
    alive = weakref.ref(consumer)
    del buf, consumer, given
    current.clear()  # the library's stream object is gone: only the export holds it
    gc.collect()
    assert alive() is not None, "the export keeps the consumer's stream alive"
    errors = streampool.drop_errors()[0]
    del capsule  # the consumer lets go
    gc.collect()
    assert alive() is None, "and lets it go with the tensor"
    assert streampool.drop_errors()[0] == errors, streampool.drop_errors()[1][-1:]
    _reuse_and_write(sim, producer, ptr)


def test_pytorchs_stream_is_not_asked_for_before_its_cuda_is_initialised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Looking for the owner of a bare handle initialises nothing: PyTorch's current stream
    is asked for only once PyTorch's CUDA is initialised."""
    asked: list[bool] = []
    _fake_library(
        monkeypatch,
        "torch",
        is_initialized=lambda: asked.append(False) or False,
        current_stream=lambda device=None: asked.append(True),
    )
    consumer = streampool.Stream()
    buf = streampool.DeviceBuffer(size=64, stream=streampool.Stream())
    capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
    assert asked == [False]
    del capsule, buf
    gc.collect()


@pytest.mark.nosim
def test_an_export_to_the_host_takes_no_stream_and_waits() -> None:
    with SimulatedDevice(capacity_bytes="64MiB") as dev:
        s = streampool.Stream()
        buf = streampool.DeviceBuffer(size=5, stream=s, mr=mr.ManagedMemoryResource())
        buf.copy_from_host(b"hello", stream=s)  # enqueued, not yet run
        for stream in (1, 2, s.handle):
            with pytest.raises(BufferError, match=r"takes stream=None"):
                buf.__dlpack__(stream=stream, dl_device=(1, 0))
        for stream in (True, False):
            with pytest.raises(BufferError, match="is a bool"):
                buf.__dlpack__(stream=stream)
        with pytest.raises(ValueError, match="max_version"):
            buf.__dlpack__(max_version=(-1, 0))
        capsule = buf.__dlpack__(dl_device=(1, 0))
        assert dev.queued(s) == 0, "the host waited for the buffer's work"
        del capsule


@pytest.mark.nosim
def test_a_buffer_of_an_exited_simulated_device_exports_nothing() -> None:
    with SimulatedDevice(capacity_bytes="64MiB"):
        pool = mr.ShardedPoolMemoryResource(mr.CudaMemoryResource(), expandable=True)
        buf = streampool.DeviceBuffer(size=4096, mr=pool)
    assert buf.closed
    for export in (
        lambda: buf.ptr,
        lambda: buf.__cuda_array_interface__,
        lambda: buf.__dlpack__(stream=-1),
        lambda: buf.__dlpack__(stream=1),
    ):
        with pytest.raises(ValueError, match="closed"):
            export()


def test_a_librarys_current_stream_of_another_handle_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the current stream whose handle the consumer gave is kept alive with the export:
    CuPy's current stream, another stream, is not."""
    current = [_OtherLibrarysStream()]
    _fake_library(monkeypatch, "cupy", get_current_stream=lambda: current[0])
    alive = weakref.ref(current[0])
    consumer = streampool.Stream()
    buf = streampool.DeviceBuffer(size=64, stream=streampool.Stream())
    capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
    current.clear()
    gc.collect()
    assert alive() is None, "a stream the consumer did not name is not kept"
    del capsule, buf
    gc.collect()


def test_a_per_thread_consumer_let_go_on_another_thread_is_still_followed(sim: SimulatedDevice) -> None:
    """A consumer on its thread's per-thread default stream (handle 2) lets go of the tensor
    on another thread, where handle 2 names another stream: the free still follows the
    consumer's work (the legacy default stream, which every per-thread stream synchronises
    with, stands for it there)."""
    producer = streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=producer)
    ptr = buf.ptr
    held: list[object] = []

    def consumer_thread(exported: streampool.DeviceBuffer) -> None:
        held.append(exported.__dlpack__(stream=2, max_version=(1, 0)))
        sim.read(2, ptr, 4096, label="consumer's kernel on its per-thread stream, queued")

    worker = threading.Thread(target=consumer_thread, args=(buf,))
    worker.start()
    worker.join()
    del buf
    held.clear()  # the deleter runs on this thread
    gc.collect()
    _reuse_and_write(sim, producer, ptr)
