"""DeviceBuffer: exports (CUDA array interface, DLPack), host copies, pickling, closing."""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice


def test_basics() -> None:
    s = streampool.Stream()
    buf = streampool.DeviceBuffer(size=1000, stream=s)
    assert buf.size == buf.nbytes == len(buf) == 1000
    assert buf.ptr % 256 == 0
    assert buf.stream is s
    assert buf.mr is streampool.get_current_device_resource()
    assert "1000" in repr(buf)


def test_defaults_and_zero_size() -> None:
    buf = streampool.DeviceBuffer()
    assert buf.size == 0 and buf.ptr == 0
    assert buf.tobytes() == b""
    assert bytes(buf.copy_to_host()) == b""
    assert buf.__cuda_array_interface__["data"] == (0, False)


def test_host_round_trip() -> None:
    payload = bytes(range(256)) * 17
    buf = streampool.DeviceBuffer.to_device(payload)
    assert buf.size == len(payload)
    assert buf.tobytes() == payload
    out = bytearray(len(payload))
    assert buf.copy_to_host(out) is out
    assert bytes(out) == payload
    buf.copy_from_host(b"\xff" * 10)
    assert buf.tobytes()[:10] == b"\xff" * 10 and buf.tobytes()[10:] == payload[10:]


def test_copies_on_other_resources_and_streams() -> None:
    for resource in (mr.CudaMemoryResource(), mr.ManagedMemoryResource(), mr.PinnedHostMemoryResource()):
        s = streampool.Stream()
        buf = streampool.DeviceBuffer.to_device(b"abc" * 100, stream=s, mr=resource)
        assert buf.mr is resource
        assert buf.tobytes() == b"abc" * 100


def test_host_copy_bad_input() -> None:
    buf = streampool.DeviceBuffer(size=8)
    with pytest.raises(ValueError, match="9"):
        buf.copy_from_host(b"x" * 9)
    with pytest.raises(ValueError):
        buf.copy_to_host(bytearray(4))
    with pytest.raises(TypeError):
        buf.copy_from_host("not bytes")  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError, BufferError)):
        buf.copy_to_host(b"readonly!")  # type: ignore[arg-type]
    buf.copy_from_host(b"12345678")
    assert buf.tobytes() == b"12345678"


def test_cuda_array_interface() -> None:
    s = streampool.Stream()
    buf = streampool.DeviceBuffer(size=64, stream=s)
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3
    assert cai["shape"] == (64,)
    assert cai["typestr"] == "|u1"
    assert cai["data"] == (buf.ptr, False)
    assert cai["strides"] is None
    assert cai["stream"] == s.handle
    assert streampool.DeviceBuffer(size=1).__cuda_array_interface__["stream"] == 1
    ptds = streampool.DeviceBuffer(size=1, stream=streampool.PER_THREAD_DEFAULT_STREAM)
    assert ptds.__cuda_array_interface__["stream"] == 2


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


def _capsule_pointer(capsule: object, name: bytes) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, name)


@pytest.mark.parametrize(
    ("resource", "device_type"),
    [(mr.CudaAsyncMemoryResource, 2), (mr.ManagedMemoryResource, 13), (mr.PinnedHostMemoryResource, 3)],
)
def test_dlpack_versioned(resource: type[mr.MemoryResource], device_type: int) -> None:
    buf = streampool.DeviceBuffer(size=100, mr=resource())
    assert buf.__dlpack_device__() == (device_type, 0)
    capsule = buf.__dlpack__(max_version=(1, 1), stream=-1)
    assert "dltensor_versioned" in repr(capsule)
    t = DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
    assert t.major == 1
    assert t.dl_tensor.data == buf.ptr
    assert (t.dl_tensor.device.device_type, t.dl_tensor.device.device_id) == (device_type, 0)
    assert t.dl_tensor.ndim == 1 and t.dl_tensor.shape[0] == 100
    assert (t.dl_tensor.dtype.code, t.dl_tensor.dtype.bits, t.dl_tensor.dtype.lanes) == (1, 8, 1)
    del capsule  # unconsumed: the destructor calls the deleter, which releases the buffer


def test_dlpack_legacy_capsule_without_max_version() -> None:
    buf = streampool.DeviceBuffer(size=16)
    capsule = buf.__dlpack__()
    assert "dltensor" in repr(capsule) and "versioned" not in repr(capsule)
    assert _capsule_pointer(capsule, b"dltensor") != 0


@pytest.mark.parametrize("bad", [(-1, 0), (1,), (1, 0, 0), [1, 0], (1.0, 0), (True, 0), "1.0"])
def test_dlpack_max_version_of_the_wrong_form_is_a_value_error_naming_it(bad: object) -> None:
    buf = streampool.DeviceBuffer(size=16)
    with pytest.raises(ValueError, match="max_version must be a"):
        buf.__dlpack__(max_version=bad)  # type: ignore[arg-type]

    class Index:  # stands for an int, as numpy's integers do
        def __init__(self, n: object) -> None:
            self.n = n

        def __index__(self) -> int:
            return self.n  # type: ignore[return-value]

    for wrong in [Index("1"), Index(1.5)]:  # an __index__ that gives no int
        with pytest.raises(ValueError, match="max_version must be a"):
            buf.__dlpack__(max_version=(wrong, 0))  # type: ignore[arg-type]

    # Any version above the ones known is as good as the highest: a versioned capsule.
    for version in [(2**70, 0), (1, 2**70), (Index(1), Index(0))]:
        capsule = buf.__dlpack__(max_version=version)
        assert _capsule_pointer(capsule, b"dltensor_versioned")
        del capsule
    assert buf.size == 16


def test_dlpack_keeps_the_buffer_alive() -> None:
    """An unconsumed capsule keeps the buffer's memory allocated after the buffer itself
    is deleted (its tensor still points there), and its destructor frees it."""
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    buf = streampool.DeviceBuffer.to_device(b"z" * 32, mr=stats)
    assert stats.allocation_counts.current_bytes == 32
    capsule = buf.__dlpack__(max_version=(1, 0))
    ptr = buf.ptr
    del buf
    gc.collect()
    assert stats.allocation_counts.current_bytes == 32, "freed while the capsule holds it"
    t = DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
    assert t.dl_tensor.data == ptr
    del t, capsule
    gc.collect()
    assert stats.allocation_counts.current_bytes == 0, "the capsule's destructor frees the memory"


def test_dlpack_consumer_stream_is_ordered(sim: SimulatedDevice) -> None:
    producer, consumer = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=256, stream=producer)
    sim.write(producer, buf.ptr, 256, label="producer")
    buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
    sim.read(consumer, buf.ptr, 256, label="consumer")
    sim.run()
    assert sim.races() == []


def test_dlpack_bad_arguments() -> None:
    buf = streampool.DeviceBuffer(size=16)
    with pytest.raises(BufferError):
        buf.__dlpack__(stream=0)
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)
    buf.__dlpack__(stream=-1)


def test_pickle_round_trip() -> None:
    buf = streampool.DeviceBuffer.to_device(b"hello device")
    again = pickle.loads(pickle.dumps(buf))
    assert again.tobytes() == b"hello device"
    assert again.ptr != buf.ptr


def test_close_and_context_manager() -> None:
    resource = mr.CudaAsyncMemoryResource()
    with streampool.DeviceBuffer(size=4096, mr=resource) as buf:
        assert not buf.closed
    assert buf.closed
    for use in (lambda: buf.ptr, buf.tobytes, lambda: buf.__cuda_array_interface__, lambda: buf.__dlpack__()):
        with pytest.raises(ValueError, match="closed"):
            use()
    buf.close()  # twice is fine
    again = streampool.DeviceBuffer(size=4096, mr=resource)
    assert again.size == 4096


def test_memory_is_freed_when_its_last_user_is_done() -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())

    def used() -> int:
        return int(pool.stats["used_bytes"])

    buf = streampool.DeviceBuffer(size=4096, mr=pool)
    assert used() == 4096 and buf.ptr != 0 and not buf.closed
    del buf  # never shared: freed at once
    assert used() == 0

    buf = streampool.DeviceBuffer(size=4096, mr=pool)
    capsule = buf.__dlpack__(max_version=(1, 0))
    buf.close()  # the consumer still holds the memory
    assert buf.closed and used() == 4096
    with pytest.raises(ValueError, match="closed"):
        buf.ptr  # noqa: B018
    del capsule
    assert used() == 0

    buf = streampool.DeviceBuffer(size=4096, mr=pool)
    capsule = buf.__dlpack__(max_version=(1, 0))
    del buf
    assert used() == 4096
    del capsule
    assert used() == 0

    buf = streampool.DeviceBuffer(size=4096, mr=pool)
    buf.__dlpack__(max_version=(1, 0))  # shared, and the consumer is gone already
    buf.close()
    assert used() == 0


def test_buffer_keeps_its_stream_alive(sim: SimulatedDevice) -> None:
    import gc

    s = streampool.Stream()
    handle = s.handle
    buf = streampool.DeviceBuffer(size=128, stream=s)
    del s
    gc.collect()
    sim.write(buf.stream, buf.ptr, 128)
    assert buf.stream.handle == handle
    del buf
    gc.collect()
    sim.run()


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="-5"):
        streampool.DeviceBuffer(size=-5)
    with pytest.raises(TypeError):
        streampool.DeviceBuffer(size=10, mr="not a resource")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        streampool.DeviceBuffer(size=10, stream=object())  # type: ignore[arg-type]


# --- RMM's DeviceBuffer API -------------------------------------------------------------


def _pool() -> mr.ShardedPoolMemoryResource:
    return mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())


def _used(pool: mr.ShardedPoolMemoryResource) -> int:
    return int(pool.stats["used_bytes"])


class _CudaArray:
    """A foreign device array: only a CUDA array interface."""

    def __init__(self, **cai: object) -> None:
        self.__cuda_array_interface__ = {"version": 3, "strides": None, "typestr": "|u1", **cai}


def test_copy_to_host_gives_a_numpy_array_or_fills_ary() -> None:
    np = pytest.importorskip("numpy")
    buf = streampool.DeviceBuffer.to_device(b"abc")
    host = buf.copy_to_host()
    assert isinstance(host, np.ndarray) and host.dtype == np.uint8 and host.shape == (3,)
    assert host.tolist() == [97, 98, 99]
    ary = np.zeros(5, dtype=np.uint8)
    assert buf.copy_to_host(ary=ary) is ary
    assert ary.tolist() == [97, 98, 99, 0, 0]
    s = streampool.Stream()
    assert bytes(buf.copy_to_host(stream=s)) == b"abc"
    with pytest.raises(ValueError, match="ary has 2 bytes; the buffer needs 3"):
        buf.copy_to_host(bytearray(2))
    with pytest.raises(TypeError, match="ary must support the buffer protocol"):
        buf.copy_to_host([0, 0, 0])  # type: ignore[arg-type]
    assert buf.tobytes() == b"abc"


def test_copy_to_host_without_numpy_gives_a_bytearray() -> None:
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import streampool\n"
        "out = streampool.DeviceBuffer.to_device(b'xyz').copy_to_host()\n"
        "assert type(out) is bytearray and out == b'xyz', out\n"
    )
    env = {**os.environ, "STREAMPOOL_DEVICE": "sim"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_tobytes_and_bytes(sim: SimulatedDevice) -> None:
    s = streampool.Stream()
    buf = streampool.DeviceBuffer.to_device(b"payload", stream=s)
    other = streampool.Stream()
    assert buf.tobytes(stream=other) == b"payload"
    assert bytes(buf) == b"payload"
    with pytest.raises(TypeError, match="as a stream"):
        buf.tobytes(stream=object())  # type: ignore[arg-type]
    assert buf.__sizeof__() == 7


def test_construct_from_a_device_pointer(sim: SimulatedDevice) -> None:
    payload = bytes(range(200))
    src = streampool.DeviceBuffer.to_device(payload)
    s = streampool.Stream()
    before = sim.queued(s)
    buf = streampool.DeviceBuffer(ptr=src.ptr, size=150, stream=s)
    assert sim.queued(s) == before + 1, "the copy is enqueued on the buffer's stream, not waited for"
    assert buf.size == 150 and buf.ptr != src.ptr and buf.stream is s
    assert buf.tobytes() == payload[:150]
    # On the legacy default stream the copy is waited for, as RMM does.
    again = streampool.DeviceBuffer(ptr=src.ptr, size=200)
    assert sim.queued(streampool.DEFAULT_STREAM) == 0
    assert again.tobytes() == payload
    assert streampool.DeviceBuffer(ptr=0, size=0).size == 0
    resource = mr.CudaMemoryResource()
    assert streampool.DeviceBuffer(ptr=src.ptr, size=10, mr=resource).mr is resource


def test_construct_from_a_pointer_bad_input() -> None:
    pool = _pool()
    src = streampool.DeviceBuffer.to_device(b"z" * 64, mr=pool)
    used = _used(pool)
    # ptr=0 is RMM's default: nothing to copy from, the buffer is allocated as asked.
    unfilled = streampool.DeviceBuffer(ptr=0, size=8, mr=pool)
    assert unfilled.size == 8 and unfilled.ptr != 0
    del unfilled
    with pytest.raises(ValueError, match="-1"):
        streampool.DeviceBuffer(ptr=-1, size=8, mr=pool)
    with pytest.raises(TypeError):
        streampool.DeviceBuffer(ptr="0x1000", size=8, mr=pool)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size must be >= 0"):
        streampool.DeviceBuffer(ptr=src.ptr, size=-8, mr=pool)
    # A source smaller than `size`: the simulated device knows where its allocations end.
    small = streampool.DeviceBuffer(size=64, mr=mr.CudaMemoryResource())
    with pytest.raises(streampool.InvalidPointerError, match="source"):
        streampool.DeviceBuffer(ptr=small.ptr, size=64 + 4096, mr=pool)
    assert _used(pool) == used, "nothing leaked by the refused calls"
    assert streampool.DeviceBuffer(ptr=src.ptr, size=64, mr=pool).tobytes() == b"z" * 64


def test_copy_is_deep_and_ordered_on_the_buffer_stream(sim: SimulatedDevice) -> None:
    import copy

    pool = _pool()
    s = streampool.Stream()
    buf = streampool.DeviceBuffer.to_device(b"original", stream=s, mr=pool)
    sim.write(s, buf.ptr, 8, label="producer")  # pending: the copy must come after it
    before = sim.queued(s)
    dup = buf.copy()
    assert sim.queued(s) == before + 1
    assert dup.ptr != buf.ptr and dup.size == 8 and dup.mr is pool and dup.stream is s
    produced = buf.tobytes()
    assert produced != b"original", "the simulated kernel wrote"
    buf.copy_from_host(b"changed!")
    assert dup.tobytes() == produced
    assert copy.copy(buf).tobytes() == b"changed!"
    assert copy.deepcopy(buf).tobytes() == b"changed!"
    assert streampool.DeviceBuffer(size=0).copy().size == 0
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        buf.copy()


def test_copy_from_device_buffer_and_cuda_array_interface() -> None:
    dst = streampool.DeviceBuffer(size=10)
    dst.copy_from_host(b"." * 10)
    dst.copy_from_device(streampool.DeviceBuffer.to_device(b"abc"))
    assert dst.tobytes() == b"abc......."
    src = streampool.DeviceBuffer.to_device(bytes(range(16)))
    cai = src.__cuda_array_interface__
    words = _CudaArray(data=cai["data"], shape=(2,), typestr="<u4", stream=cai["stream"])
    dst.copy_from_device(words, stream=streampool.Stream())
    assert dst.tobytes() == bytes(range(8)) + b".."
    grid = _CudaArray(data=cai["data"], shape=(2, 1, 5), strides=(5, 7, 1))  # a length-1 axis: any stride
    dst.copy_from_device(grid)
    assert dst.tobytes() == bytes(range(10))
    dst.copy_from_device(_CudaArray(data=(0, False), shape=(0,)))  # empty: nothing to copy


def test_copy_from_device_orders_both_streams(sim: SimulatedDevice) -> None:
    pool = _pool()
    a, b = streampool.Stream(), streampool.Stream()
    src = streampool.DeviceBuffer(size=4096, stream=a, mr=pool)
    sim.write(a, src.ptr, 4096, label="producer on a")
    dst = streampool.DeviceBuffer(size=4096, stream=b, mr=pool)
    dst.copy_from_device(src)  # on b: after the producer
    ptr = src.ptr
    del src  # freed on a; the pool reuses it on a at once
    reused = streampool.DeviceBuffer(size=4096, stream=a, mr=pool)
    assert reused.ptr == ptr
    sim.write(a, reused.ptr, 4096, label="next writer on a")  # after the copy's read on b
    sim.run()  # the fixture fails the test on any race


def test_copy_from_device_through_the_interface_orders_its_stream(sim: SimulatedDevice) -> None:
    a, b = streampool.Stream(), streampool.Stream()
    src = streampool.DeviceBuffer(size=256, stream=a)
    sim.write(a, src.ptr, 256, label="producer on a")
    foreign = _CudaArray(data=(src.ptr, False), shape=(256,), stream=a.handle)
    dst = streampool.DeviceBuffer(size=256, stream=b)
    dst.copy_from_device(foreign)
    sim.write(a, src.ptr, 256, label="next writer on a")
    sim.run()


def test_copy_from_device_bad_input() -> None:
    dst = streampool.DeviceBuffer(size=8)
    dst.copy_from_host(b"12345678")
    src = streampool.DeviceBuffer.to_device(b"x" * 16)
    ptr = src.ptr
    cases: list[tuple[object, type[Exception], str]] = [
        (b"host bytes", TypeError, "must be a DeviceBuffer or have __cuda_array_interface__, not bytes"),
        (src, ValueError, "cuda_ary has 16 bytes; the buffer holds only 8"),
        (_CudaArray(data=(ptr, False), shape=(4,), strides=(2,)), ValueError, "must be C-contiguous"),
        (_CudaArray(data=(ptr, False), shape=(2, 2), strides=(1, 2)), ValueError, "must be C-contiguous"),
        (_CudaArray(data=(0, False), shape=(4,)), ValueError, "null data pointer for 4 bytes"),
        (_CudaArray(data=(ptr, False), shape=(4,), mask=object()), ValueError, "masked"),
        (_CudaArray(data=(ptr, False), shape=(4,), stream=0), ValueError, "stream 0 is disallowed"),
        (_CudaArray(data=(ptr, False), shape=(4,), typestr="<f"), ValueError, "item size"),
        (_CudaArray(data=(ptr, False), shape=(-1,)), ValueError, "shape"),
        (_CudaArray(data=(ptr, False)), ValueError, "has no 'shape'"),
    ]
    for cuda_ary, error, words in cases:
        with pytest.raises(error, match=re.escape(words)):
            dst.copy_from_device(cuda_ary)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="as a stream"):
        dst.copy_from_device(streampool.DeviceBuffer(size=2), stream="nope")  # type: ignore[arg-type]
    assert dst.tobytes() == b"12345678", "left as it was"
    src.close()
    with pytest.raises(ValueError, match="closed"):
        dst.copy_from_device(src)


def test_resize_and_reserve() -> None:
    buf = streampool.DeviceBuffer.to_device(b"0123456789")
    assert buf.capacity() == 10
    ptr = buf.ptr
    buf.resize(4)  # within the capacity: nothing moves
    assert (buf.size, buf.nbytes, len(buf), buf.capacity(), buf.ptr) == (4, 4, 4, 10, ptr)
    assert buf.tobytes() == b"0123"
    buf.resize(10)
    assert buf.ptr == ptr and buf.tobytes()[:4] == b"0123"
    buf.resize(4)
    buf.resize(20)  # beyond: a new allocation, holding the first `size` bytes
    assert (buf.size, buf.capacity()) == (20, 20) and buf.ptr != ptr
    assert buf.tobytes()[:4] == b"0123"
    assert buf.__cuda_array_interface__["shape"] == (20,)
    buf.reserve(100)
    assert (buf.size, buf.capacity()) == (20, 100)
    assert buf.tobytes()[:4] == b"0123"
    assert buf.__cuda_array_interface__["shape"] == (20,)
    ptr = buf.ptr
    buf.reserve(50)  # never shrinks
    assert buf.capacity() == 100 and buf.ptr == ptr
    buf.resize("64 B")
    assert buf.size == 64 and buf.ptr == ptr
    empty = streampool.DeviceBuffer()
    empty.reserve(16)
    assert (empty.size, empty.capacity()) == (0, 16) and empty.ptr != 0


def test_dlpack_exports_the_size_not_the_capacity() -> None:
    buf = streampool.DeviceBuffer(size=10)
    buf.reserve(4096)
    capsule = buf.__dlpack__(max_version=(1, 0))
    t = DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
    assert t.dl_tensor.shape[0] == 10


def test_resize_on_another_stream_is_ordered(sim: SimulatedDevice) -> None:
    pool = _pool()
    a, b = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=1024, stream=a, mr=pool)
    sim.write(a, buf.ptr, 1024, label="producer on a")
    before = sim.queued(b)
    buf.resize(8192, stream=b)  # the copy runs on b, after the producer
    assert sim.queued(b) > before
    assert buf.stream is a, "the buffer stays on its stream"
    sim.write(a, buf.ptr, 8192, label="writer on a, after the copy")
    old_reused = streampool.DeviceBuffer(size=1024, stream=a, mr=pool)
    sim.write(a, old_reused.ptr, 1024, label="reuse of the old memory on a")
    sim.run()
    assert _used(pool) == 8192 + 1024


def test_resize_and_reserve_bad_input() -> None:
    pool = _pool()
    buf = streampool.DeviceBuffer.to_device(b"keep", mr=pool)
    used = _used(pool)
    with pytest.raises(ValueError, match="new_size must be >= 0, got -1"):
        buf.resize(-1)
    with pytest.raises(ValueError, match="new_capacity must be >= 0, got -5"):
        buf.reserve(-5)
    with pytest.raises(TypeError, match="new_size"):
        buf.resize(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="as a stream"):
        buf.resize(100, stream=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="as a stream"):
        buf.reserve(100, stream=object())  # type: ignore[arg-type]
    with pytest.raises(streampool.OutOfMemoryError):
        buf.resize(1 << 60)
    assert (buf.size, buf.tobytes(), _used(pool)) == (4, b"keep", used), "left as it was"
    buf.close()
    for call in (lambda: buf.resize(8), lambda: buf.reserve(8), buf.capacity):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_prefetch_of_memory_that_is_not_managed_does_nothing(sim: SimulatedDevice) -> None:
    s = streampool.Stream()
    for resource in (mr.CudaAsyncMemoryResource(), mr.CudaMemoryResource(), mr.PinnedHostMemoryResource()):
        buf = streampool.DeviceBuffer.to_device(b"abc", stream=s, mr=resource)
        buf.prefetch()
        buf.prefetch("host", stream=streampool.Stream())
        assert sim.pending == 0
        # The arguments are checked as for managed memory: a device that does not exist.
        for device in (5, 2**31 - 1):
            with pytest.raises(streampool.InvalidArgumentError, match=f"device {device} does not exist"):
                buf.prefetch(device)
        with pytest.raises(ValueError, match='"host" or None'):
            buf.prefetch("gpu")
        with pytest.raises(TypeError, match="as a stream"):
            buf.prefetch(stream=object())  # type: ignore[arg-type]
        assert buf.tobytes() == b"abc"
        buf.close()
        with pytest.raises(ValueError, match="closed"):
            buf.prefetch()


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_in_band(protocol: int) -> None:
    payload = bytes(range(256)) * 4
    data = pickle.dumps(streampool.DeviceBuffer.to_device(payload), protocol=protocol)
    assert protocol < 3 or payload in data
    assert pickle.loads(data).tobytes() == payload


def test_pickle_protocol_5_out_of_band() -> None:
    payload = bytes(range(256)) * 4
    buf = streampool.DeviceBuffer.to_device(payload)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(buf, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and payload not in data
    assert bytes(buffers[0].raw()) == payload
    again = pickle.loads(data, buffers=buffers)
    assert again.tobytes() == payload and again.ptr != buf.ptr
    _, (held,) = buf.__reduce_ex__(5)
    assert isinstance(held, pickle.PickleBuffer)
    _, (held,) = buf.__reduce_ex__(4)
    assert held == payload


# --- freeing a buffer's pointer by hand ------------------------------------------------


def _hidden_ptr(buf: streampool.DeviceBuffer) -> int:
    """The address as repr shows it: a way to the pointer that the binding does not see."""
    found = re.search(r"ptr=(0x[0-9a-f]+)", repr(buf))
    assert found is not None
    return int(found.group(1), 16)


@pytest.mark.parametrize("route", ["ptr", "cai", "dlpack"])
def test_deallocating_an_open_buffers_pointer_is_refused(route: str) -> None:
    pool = _pool()
    buf = streampool.DeviceBuffer.to_device(b"mine" * 256, mr=pool)
    if route == "ptr":
        ptr = buf.ptr
    elif route == "cai":
        ptr = buf.__cuda_array_interface__["data"][0]
    else:
        capsule = buf.__dlpack__(max_version=(1, 0))
        ptr = DLManagedTensorVersioned.from_address(
            _capsule_pointer(capsule, b"dltensor_versioned")
        ).dl_tensor.data
        del capsule
    with pytest.raises(
        streampool.InvalidPointerError, match=f"{ptr:#x} is the memory of an open DeviceBuffer"
    ):
        pool.deallocate(ptr, 1024)
    assert buf.tobytes() == b"mine" * 256 and _used(pool) == 1024, "the buffer is untouched"
    buf.close()
    assert _used(pool) == 0
    # Closed, the buffer no longer owns the address: the pool alone judges it now.
    with pytest.raises(streampool.InvalidPointerError, match="not an outstanding allocation"):
        pool.deallocate(ptr, 1024)
    assert pool.allocate(1024) == ptr, "the address is free for anyone again"
    pool.deallocate(ptr, 1024)


def test_resize_and_drop_forget_the_old_address() -> None:
    pool = _pool()
    buf = streampool.DeviceBuffer(size=256, mr=pool)
    old = buf.ptr
    buf.resize(100_000)
    raw = pool.allocate(256)
    assert raw == old, "the old memory went back to the pool"
    pool.deallocate(raw, 256)  # not refused: no buffer owns it now
    new = buf.ptr
    del buf
    raw = pool.allocate(100_000)
    assert raw == new
    pool.deallocate(raw, 100_000)


@pytest.mark.parametrize("factory", [_pool, lambda: mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())])
def test_a_buffer_freed_behind_its_back_reports_the_double_free(
    factory: Callable[[], mr.MemoryResource], monkeypatch: pytest.MonkeyPatch
) -> None:
    reports: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    resource = factory()
    buf = streampool.DeviceBuffer(size=4096, mr=resource)
    ptr = _hidden_ptr(buf)
    resource.deallocate(ptr, 4096)  # a route the binding cannot see: allowed
    del buf
    gc.collect()
    assert len(reports) == 1
    assert reports[0].exc_type is streampool.InvalidPointerError
    text = str(reports[0].exc_value)
    assert f"4096 bytes at {ptr:#x}" in text and "freed by hand" in text
    again = streampool.DeviceBuffer.to_device(b"fine", mr=resource)
    assert again.tobytes() == b"fine"
    # close() raises the same error where the caller can catch it.
    buf = streampool.DeviceBuffer(size=512, mr=resource)
    resource.deallocate(_hidden_ptr(buf), 512)
    with pytest.raises(streampool.InvalidPointerError):
        buf.close()
    assert buf.closed and len(reports) == 1


def test_a_double_free_found_by_a_dlpack_consumer_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    reports: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    pool = _pool()
    buf = streampool.DeviceBuffer(size=4096, mr=pool)
    ptr = _hidden_ptr(buf)
    capsule = buf.__dlpack__(max_version=(1, 0))
    buf.close()  # the consumer still holds the memory, and no buffer owns its address now
    pool.deallocate(ptr, 4096)
    del capsule
    gc.collect()
    assert [r.exc_type for r in reports] == [streampool.InvalidPointerError]


def test_a_copy_from_an_address_that_is_not_mapped_is_refused() -> None:
    """On the simulated device, an address that is neither its memory nor mapped host memory
    is an InvalidPointerError when the copy is enqueued (it once crashed the process when
    the copy ran), and the buffer stays usable."""
    bad = 0xDEAD0000
    with pytest.raises(streampool.InvalidPointerError, match="nor host memory"):
        streampool.DeviceBuffer(size=16, ptr=bad)

    class Foreign:
        __cuda_array_interface__: ClassVar[dict[str, Any]] = {
            "shape": (16,),
            "typestr": "|u1",
            "data": (bad, False),
            "version": 3,
            "stream": None,
        }

    buf = streampool.DeviceBuffer.to_device(b"x" * 16)
    with pytest.raises(streampool.InvalidPointerError, match="nor host memory"):
        buf.copy_from_device(Foreign())
    assert buf.tobytes() == b"x" * 16


@pytest.mark.nosim
def test_prefetch_of_memory_that_is_not_managed_checks_its_stream() -> None:
    with SimulatedDevice(capacity_bytes="64MiB", devices=2):
        buf = streampool.DeviceBuffer(size=256, mr=mr.CudaAsyncMemoryResource())
        # As for managed memory, a stream of any device will do: nothing to move.
        buf.prefetch(stream=streampool.Stream(device=1))
        buf.prefetch(stream=streampool.Stream())
        with pytest.raises(TypeError, match="stream"):
            buf.prefetch(stream=object())  # type: ignore[arg-type]
