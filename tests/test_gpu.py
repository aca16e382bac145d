"""On a real GPU (STREAMPOOL_GPU_TESTS=1): every resource against the driver, checked
where possible through other libraries (cuda.bindings, CuPy, PyTorch)."""

from __future__ import annotations

import pytest

import streampool
from streampool import mr

pytestmark = pytest.mark.gpu

FACTORIES = {
    "async_current": lambda: mr.CudaAsyncMemoryResource(),
    "async_own": lambda: mr.CudaAsyncMemoryResource(initial_pool_size="64MiB"),
    "async_ipc": lambda: mr.CudaAsyncMemoryResource(enable_ipc=True, release_threshold="256MiB"),
    "cuda": lambda: mr.CudaMemoryResource(),
    "managed": lambda: mr.ManagedMemoryResource(),
    "pinned": lambda: mr.PinnedHostMemoryResource(),
}


def test_not_simulated() -> None:
    assert not streampool.using_simulated_device()
    info = streampool.device_info()
    assert info["memory_pools"] and info["total_bytes"] > 1 << 30


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_round_trip(name: str) -> None:
    resource = FACTORIES[name]()
    s = streampool.Stream()
    payload = bytes(range(256)) * 4096
    buf = streampool.DeviceBuffer.to_device(payload, stream=s, mr=resource)
    assert buf.ptr % 256 == 0
    assert buf.tobytes() == payload
    ptrs = [resource.allocate(n, s) for n in (1, 256, 1 << 20, 64 << 20)]
    assert len(set(ptrs)) == 4
    for p, n in zip(ptrs, (1, 256, 1 << 20, 64 << 20)):
        resource.deallocate(p, n, s)
    s.synchronize()


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_data_survives_reuse_on_another_stream(name: str) -> None:
    resource = FACTORIES[name]()
    a, b = streampool.Stream(), streampool.Stream()
    for i in range(20):
        buf = streampool.DeviceBuffer.to_device(bytes([i]) * (1 << 20), stream=a if i % 2 else b, mr=resource)
        del buf
        other = streampool.DeviceBuffer(size=1 << 20, stream=b if i % 2 else a, mr=resource)
        other.copy_from_host(bytes([255 - i]) * (1 << 20))
        assert other.tobytes() == bytes([255 - i]) * (1 << 20)


def test_default_async_allocations_come_from_the_current_pool() -> None:
    from cuda.bindings import driver

    resource = mr.CudaAsyncMemoryResource()
    err, current = driver.cuDeviceGetMemPool(0)
    assert err == driver.CUresult.CUDA_SUCCESS
    assert int(current) == resource.pool_handle
    ptr = resource.allocate(1 << 20)
    err, pool = driver.cuPointerGetAttribute(
        driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr
    )
    assert err == driver.CUresult.CUDA_SUCCESS
    assert int(pool) == resource.pool_handle == streampool._native.pointer_pool(ptr)
    resource.deallocate(ptr, 1 << 20)
    err, threshold = driver.cuMemPoolGetAttribute(
        current, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    )
    assert int(threshold) == 2**64 - 1


def test_own_pool_attributes_and_trim() -> None:
    own = mr.CudaAsyncMemoryResource(initial_pool_size="32MiB", release_threshold="1GiB")
    assert own.owns_pool and own.release_threshold == 1 << 30
    assert own.reserved_bytes >= 32 << 20
    own.trim_to(0)
    assert own.reserved_bytes == 0


def test_view_over_another_librarys_pool() -> None:
    from cuda.bindings import driver

    err, pool = driver.cuDeviceGetDefaultMemPool(0)
    assert err == driver.CUresult.CUDA_SUCCESS
    view = mr.CudaAsyncViewMemoryResource(int(pool))
    buf = streampool.DeviceBuffer.to_device(b"view" * 100, mr=view)
    assert buf.tobytes() == b"view" * 100


def test_cupy_reads_our_buffers() -> None:
    cupy = pytest.importorskip("cupy")
    buf = streampool.DeviceBuffer.to_device(bytes(range(200)))
    arr = cupy.asarray(buf)
    assert arr.dtype == cupy.uint8 and int(arr.sum()) == sum(range(200))
    arr2 = cupy.from_dlpack(buf)
    assert int(arr2[199]) == 199


def test_torch_reads_our_buffers_and_lends_its_streams() -> None:
    torch = pytest.importorskip("torch")
    buf = streampool.DeviceBuffer.to_device(bytes(range(100)))
    t = torch.from_dlpack(buf)
    assert t.device.type == "cuda" and int(t.sum()) == sum(range(100))
    ts = torch.cuda.Stream()
    with_torch_stream = streampool.DeviceBuffer.to_device(b"x" * 64, stream=ts)
    assert with_torch_stream.stream is ts and with_torch_stream.tobytes() == b"x" * 64


def test_other_libraries_streams() -> None:
    """Streams of CuPy, Numba and cuda.core order our copies (and stay alive with the buffer)."""
    made = []
    cupy = pytest.importorskip("cupy")
    made.append(cupy.cuda.Stream(non_blocking=True))
    try:
        from numba import cuda as numba_cuda

        made.append(numba_cuda.stream())
    except Exception:  # pragma: no cover - numba missing or too old on this machine
        pass
    try:
        from cuda.core import Device

        dev = Device(0)
        dev.set_current()
        made.append(dev.create_stream())
    except Exception:  # pragma: no cover
        pass
    for s in made:
        buf = streampool.DeviceBuffer.to_device(b"stream" * 10, stream=s)
        assert buf.stream is s and buf.tobytes() == b"stream" * 10, type(s)
    assert len(made) >= 2, made


def test_out_of_memory_is_clear_and_recoverable() -> None:
    resource = mr.CudaAsyncMemoryResource()
    with pytest.raises(streampool.OutOfMemoryError, match=str(1 << 50)):
        resource.allocate(1 << 50)
    # The failed attempt does not leave the shared pool holding the card.
    assert resource.reserved_bytes < 8 << 30, resource.reserved_bytes
    ptr = resource.allocate(1 << 20)
    resource.deallocate(ptr, 1 << 20)


def test_destroyed_and_bogus_pointers() -> None:
    resource = mr.CudaMemoryResource()
    with pytest.raises(streampool.InvalidPointerError):
        resource.deallocate(0x1000, 256)
    ptr = resource.allocate(256)
    resource.deallocate(ptr, 256)
    with pytest.raises(streampool.InvalidPointerError):
        resource.deallocate(ptr, 256)  # double free
    s = streampool.Stream()
    handle = s.handle
    del s
    with pytest.raises(streampool.InvalidStreamError, match="destroyed"):
        resource.allocate(256, handle)
    assert resource.allocate(0) == 0


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_rmm_buffer_api_moves_real_data(name: str) -> None:
    resource = FACTORIES[name]()
    s = streampool.Stream()
    payload = bytes(range(256)) * 4096
    src = streampool.DeviceBuffer.to_device(payload, stream=s, mr=resource)
    made = streampool.DeviceBuffer(ptr=src.ptr, size=src.size, stream=s, mr=resource)
    assert made.tobytes() == payload
    dup = src.copy()
    dst = streampool.DeviceBuffer(size=len(payload) + 16, stream=streampool.Stream(), mr=resource)
    dst.copy_from_device(dup)
    assert dst.tobytes()[: len(payload)] == payload
    dst.resize(4 * len(payload))
    dst.reserve(8 * len(payload))
    assert dst.capacity() == 8 * len(payload) and dst.tobytes()[: len(payload)] == payload
    buf = streampool.DeviceBuffer(size=4096, mr=resource)
    buf.prefetch()  # managed memory moves; other memory has nothing to move
    with pytest.raises(streampool.InvalidPointerError):
        resource.deallocate(buf.ptr, buf.size)
    assert bytes(buf.copy_to_host()) == buf.tobytes()
