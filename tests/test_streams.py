"""Streams: our own, the default streams, and other libraries' stream objects."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice


def test_owned_stream() -> None:
    s = streampool.Stream()
    assert s.handle not in (0, 1, 2)
    assert s.__cuda_stream__() == (0, s.handle)
    s.synchronize()
    assert s == s and hash(s) == hash(s)
    assert s != streampool.Stream()


def test_default_streams() -> None:
    assert streampool.DEFAULT_STREAM.handle == 0
    assert streampool.LEGACY_DEFAULT_STREAM.handle in (0, 1)
    assert streampool.PER_THREAD_DEFAULT_STREAM.handle == 2
    streampool.DEFAULT_STREAM.synchronize()
    streampool.PER_THREAD_DEFAULT_STREAM.synchronize()


def _check_accepted(obj: object, stream: streampool.Stream) -> None:
    """``obj`` is read as ``stream`` wherever a stream is taken: allocations through it are
    on that stream, and a buffer keeps the object it was given. (``Stream(obj)`` takes
    stream objects only: an int there would read as a device.)"""
    if not isinstance(obj, int):
        assert streampool.Stream(obj) == stream, obj  # type: ignore[arg-type]
    resource = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    ptr = resource.allocate(256, obj)  # type: ignore[arg-type]
    assert [r.stream for r in resource.outstanding()] == [stream.handle], obj
    resource.deallocate(ptr, 256, obj)  # type: ignore[arg-type]
    buf = streampool.DeviceBuffer(size=16, stream=obj, mr=resource)  # type: ignore[arg-type]
    assert buf.stream is obj
    assert [r.stream for r in resource.outstanding()] == [stream.handle], obj


def test_foreign_stream_objects() -> None:
    s = streampool.Stream()

    class CudaCoreLike:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, s.handle)

    torch_like = types.SimpleNamespace(cuda_stream=s.handle)
    cupy_like = types.SimpleNamespace(ptr=s.handle)
    numba_like = types.SimpleNamespace(handle=types.SimpleNamespace(value=s.handle))
    for obj in (CudaCoreLike(), torch_like, cupy_like, numba_like, s.handle, s):
        _check_accepted(obj, s)


def test_bad_stream_objects() -> None:
    class Broken:
        def __cuda_stream__(self) -> object:
            return "nope"

    with pytest.raises((TypeError, ValueError)):
        streampool.DeviceBuffer(size=16, stream=Broken())  # type: ignore[arg-type]

    class Version(types.SimpleNamespace):
        def __cuda_stream__(self) -> object:
            return self.answer

    # Every stream= argument checks the protocol as Stream(obj) does.
    handle = streampool.Stream().handle
    for answer, error, words in (
        ((1, handle), NotImplementedError, "version"),
        ((0,), TypeError, "pair"),
        ((0, handle, 7), TypeError, "pair"),
    ):
        obj = Version(answer=answer)
        uses: tuple[Callable[[Any], object], ...] = (
            streampool.Stream,
            lambda o: streampool.DeviceBuffer(size=16, stream=o),
            lambda o: streampool.get_current_device_resource().allocate(16, o),
        )
        for use in uses:
            with pytest.raises(error, match=words):
                use(obj)
    with pytest.raises(streampool.InvalidStreamError):
        streampool.DeviceBuffer(size=16, stream=0x12345)
    with pytest.raises(ValueError):
        streampool.DeviceBuffer(size=16, stream=-3)


def test_a_cuda_stream_protocol_of_another_version_names_the_version() -> None:
    class Future:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (1, 4096)

    with pytest.raises(
        NotImplementedError,
        match=r"protocol version 1 is not supported \(only version 0; it returned \(1, 4096\)\)",
    ):
        streampool.Stream(Future())


def test_wait_stream_orders_one_stream_after_another(sim: SimulatedDevice) -> None:
    """``b.wait_stream(a)``: what b does from then on follows what a had enqueued, whatever
    form ``a`` comes in (ours, another library's object, a handle, the default stream); the
    host does not wait."""
    a, b = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=a)
    forms: list[object] = [a, types.SimpleNamespace(cuda_stream=a.handle), a.handle]
    for other in forms:
        sim.write(a, buf.ptr, 4096, label="written on a")
        b.wait_stream(other)  # type: ignore[arg-type]
        assert sim.queued(a) > 0, "the host did not wait"
        sim.read(b, buf.ptr, 4096, label="read on b after the wait")
        sim.run()
    sim.write(streampool.DEFAULT_STREAM, buf.ptr, 4096, label="written on the legacy stream")
    b.wait_stream(None)  # None: the legacy default stream, as every stream= argument
    sim.read(b, buf.ptr, 4096, label="read on b after the wait")
    sim.run()  # the fixture fails the test on any race


def test_wait_stream_refuses_what_is_not_a_stream() -> None:
    s = streampool.Stream()
    with pytest.raises(TypeError, match="cannot use a str as a stream"):
        s.wait_stream("nope")  # type: ignore[arg-type]
    with pytest.raises(streampool.InvalidStreamError):
        s.wait_stream(0xDEAD0)  # no live stream has that handle (the simulated device knows)
    s.wait_stream(streampool.Stream())  # and the stream is still usable


@pytest.mark.nosim
def test_wait_stream_orders_streams_of_two_devices() -> None:
    with SimulatedDevice(capacity_bytes="64MiB", devices=2) as dev:
        a, b = streampool.Stream(device=0), streampool.Stream(device=1)
        buf = streampool.DeviceBuffer(size=4096, stream=a, mr=mr.ManagedMemoryResource(device=0))
        dev.write(a, buf.ptr, 4096, label="written on device 0")
        b.wait_stream(a)
        dev.read(b, buf.ptr, 4096, label="read on device 1 after the wait")
        dev.run()
        assert not dev.races(), dev.races()
