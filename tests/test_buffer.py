"""DeviceBuffer: exports (CUDA array interface, DLPack), host copies, pickling, closing."""

from __future__ import annotations

import ctypes
import pickle

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
    assert buf.copy_to_host() == bytearray()
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


def test_dlpack_keeps_the_buffer_alive() -> None:
    import gc
    import weakref

    buf = streampool.DeviceBuffer.to_device(b"z" * 32)
    capsule = buf.__dlpack__(max_version=(1, 0))
    ref = weakref.ref(buf) if hasattr(buf, "__weakref__") else None
    ptr = buf.ptr
    del buf
    gc.collect()
    if ref is not None:
        assert ref() is not None
    t = DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
    assert t.dl_tensor.data == ptr
    del capsule
    gc.collect()


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
