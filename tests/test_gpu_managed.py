"""On a real GPU (STREAMPOOL_GPU_TESTS=1): managed memory against the driver, checked
through cuda.bindings where it is installed. Managed allocations stay small (at most
64 MiB): asking for more managed memory than the card has free can hang it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import streampool
from streampool import mr

pytestmark = pytest.mark.gpu

MIB = 1 << 20
MAX = 2**64 - 1


def driver() -> Any:
    """cuda.bindings' driver module, or skip."""
    bindings = pytest.importorskip("cuda.bindings.driver")
    return bindings


def managed_pool(**options: Any) -> mr.CudaAsyncManagedMemoryResource:
    """The managed pool resource, or skip with the reason it gives (which requirement is
    missing)."""
    try:
        return mr.CudaAsyncManagedMemoryResource(**options)
    except streampool.UnsupportedError as e:
        pytest.skip(str(e))


def last_prefetch_location(buf: streampool.DeviceBuffer) -> int:
    """``CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION`` through cuda.bindings: a device,
    -1 (the host) or -2 (none)."""
    d = driver()
    attr = d.CUmem_range_attribute.CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION
    err, value = d.cuMemRangeGetAttribute(4, attr, buf.ptr, buf.size)
    assert err == d.CUresult.CUDA_SUCCESS, err
    return int(value)


def is_managed(buf: streampool.DeviceBuffer) -> bool:
    """``CU_POINTER_ATTRIBUTE_IS_MANAGED`` through cuda.bindings."""
    d = driver()
    err, value = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED, buf.ptr)
    assert err == d.CUresult.CUDA_SUCCESS, err
    return bool(value)


@pytest.fixture
def restore_resource() -> Iterator[None]:
    previous = streampool.get_current_device_resource()
    yield
    streampool.set_current_device_resource(previous)


MANAGED = {
    "managed": lambda: mr.ManagedMemoryResource(),
    "async_managed": lambda: managed_pool(),
    "async_managed_own": lambda: managed_pool(initial_pool_size="32MiB"),
}


@pytest.mark.parametrize("name", sorted(MANAGED))
def test_prefetch_moves_pages_to_the_device_and_back(name: str) -> None:
    if not streampool.device_info()["concurrent_managed_access"]:
        pytest.skip("device 0 has no concurrent managed access: prefetch to a device needs it")
    s = streampool.Stream()
    payload = bytes(range(256)) * (64 * MIB // 256)
    buf = streampool.DeviceBuffer.to_device(payload, stream=s, mr=MANAGED[name]())
    buf.prefetch()
    assert buf.last_prefetch_location == 0
    assert last_prefetch_location(buf) == 0
    buf.prefetch("host")
    s.synchronize()
    assert buf.last_prefetch_location == "host"
    assert last_prefetch_location(buf) == -1
    buf.prefetch(device=0, stream=streampool.Stream())
    assert last_prefetch_location(buf) == 0
    assert buf.tobytes() == payload


def test_fresh_managed_memory_was_never_prefetched() -> None:
    buf = streampool.DeviceBuffer(size=4 * MIB, mr=mr.ManagedMemoryResource())
    assert buf.last_prefetch_location is None
    assert last_prefetch_location(buf) == -2


@pytest.mark.parametrize("name", sorted(MANAGED))
def test_advice_is_accepted_on_managed_memory(name: str) -> None:
    buf = streampool.DeviceBuffer(size=4 * MIB, mr=MANAGED[name]())
    if name.startswith("async"):
        # The driver (580) refuses advice on memory from managed pools: a clear error.
        with pytest.raises(streampool.UnsupportedError, match=r"read_mostly|ReadMostly"):
            buf.advise("read_mostly")
        pytest.skip("the driver takes no advice on managed-pool memory")
    for advice in ("read_mostly", "unset_read_mostly", "accessed_by", "unset_accessed_by"):
        buf.advise(advice)
    for where in (0, "host"):
        buf.advise("preferred_location", device=where)
        buf.advise("unset_preferred_location", device=where)
    d = driver()
    buf.advise("read_mostly")
    attr = d.CUmem_range_attribute.CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY
    err, value = d.cuMemRangeGetAttribute(4, attr, buf.ptr, buf.size)
    assert err == d.CUresult.CUDA_SUCCESS and int(value) == 1


def test_advice_on_device_memory_is_a_clear_error_and_prefetch_does_nothing() -> None:
    buf = streampool.DeviceBuffer(size=4 * MIB, mr=mr.CudaAsyncMemoryResource())
    with pytest.raises(streampool.InvalidArgumentError, match="comes from CudaAsyncMemoryResource"):
        buf.advise("read_mostly")
    buf.prefetch()  # as RMM's: nothing to move
    buf.prefetch("host")
    buf.copy_from_host(b"x" * 16)
    assert buf.tobytes()[:16] == b"x" * 16


def test_the_default_managed_pool_threshold_is_the_maximum() -> None:
    d = driver()
    resource = managed_pool()
    assert resource.memory_kind == "managed" and not resource.owns_pool
    location = d.CUmemLocation()
    location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    location.id = 0
    kind = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_MANAGED
    err, current = d.cuMemGetMemPool(location, kind)
    assert err == d.CUresult.CUDA_SUCCESS, err
    assert int(current) == resource.pool_handle
    err, default = d.cuMemGetDefaultMemPool(location, kind)
    assert err == d.CUresult.CUDA_SUCCESS, err
    if int(default) == resource.pool_handle:
        assert resource.release_threshold == MAX
        attr = d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
        err, threshold = d.cuMemPoolGetAttribute(current, attr)
        assert err == d.CUresult.CUDA_SUCCESS and int(threshold) == MAX
    ptr = resource.allocate(16 * MIB)
    assert streampool._native.pointer_pool(ptr) == resource.pool_handle
    resource.deallocate(ptr, 16 * MIB)


def test_an_own_managed_pool_allocates_and_reads_back() -> None:
    own = managed_pool(initial_pool_size="32MiB", release_threshold="64MiB")
    assert own.owns_pool and own.release_threshold == 64 * MIB
    assert own.reserved_bytes >= 32 * MIB
    a, b = streampool.Stream(), streampool.Stream()
    for i in range(8):
        buf = streampool.DeviceBuffer.to_device(bytes([i]) * (16 * MIB), stream=a if i % 2 else b, mr=own)
        assert buf.tobytes() == bytes([i]) * (16 * MIB)
        del buf
    own.trim_to(0)


def test_the_larger_than_memory_setup_prefetches(restore_resource: None) -> None:
    adaptor = getattr(mr, "PrefetchResourceAdaptor", None)
    if adaptor is None:
        pytest.skip("streampool.mr.PrefetchResourceAdaptor is not available")
    chosen = streampool.setup(larger_than_memory=True)
    assert isinstance(chosen, adaptor)
    expected = (
        mr.CudaAsyncManagedMemoryResource
        if streampool.device_info()["managed_pools"]
        else mr.ManagedMemoryResource
    )
    assert type(chosen.upstream) is expected  # type: ignore[attr-defined]
    s = streampool.Stream()
    buf = streampool.DeviceBuffer(size=16 * MIB, stream=s)
    assert buf.mr is chosen
    assert last_prefetch_location(buf) == 0
    buf.copy_from_host(b"\x07" * (16 * MIB))
    assert buf.tobytes() == b"\x07" * (16 * MIB)
    default = streampool.setup()
    assert type(default) is mr.CudaAsyncMemoryResource


def test_an_adaptor_stack_over_the_managed_pool(restore_resource: None) -> None:
    adaptor = getattr(mr, "PrefetchResourceAdaptor", None)
    statistics = getattr(mr, "StatisticsResourceAdaptor", None)
    if adaptor is None or statistics is None:
        pytest.skip("the adaptors are not available")
    stack = statistics(adaptor(managed_pool()))
    s = streampool.Stream()
    bufs = [streampool.DeviceBuffer(size=4 * MIB, stream=s, mr=stack) for _ in range(4)]
    assert all(last_prefetch_location(b) == 0 for b in bufs)
    assert stack.allocation_counts.current_bytes == 16 * MIB  # type: ignore[attr-defined]
    del bufs
    s.synchronize()


def test_a_view_of_the_default_managed_pool_is_managed_memory() -> None:
    # RMM's CudaAsyncManagedMemoryResource is a view of the device's default managed pool;
    # the driver's own answer (CU_POINTER_ATTRIBUTE_IS_MANAGED) says what the memory is.
    if not streampool.device_info()["concurrent_managed_access"]:
        pytest.skip("device 0 has no concurrent managed access: prefetch to a device needs it")
    view = mr.CudaAsyncViewMemoryResource(managed_pool().pool_handle)
    assert view.memory_kind == "managed"
    s = streampool.Stream()
    buf = streampool.DeviceBuffer.to_device(b"managed" * 1000, stream=s, mr=view)
    assert is_managed(buf)
    buf.prefetch(stream=s)
    assert last_prefetch_location(buf) == 0
    assert buf.tobytes() == b"managed" * 1000
    assert mr.CudaAsyncViewMemoryResource(mr.CudaAsyncMemoryResource().pool_handle).memory_kind == "device"
