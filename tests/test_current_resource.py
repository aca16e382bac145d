"""The current resource per device (RMM's set_current_device_resource and friends)."""

from __future__ import annotations

import pytest

import streampool
from streampool import mr


def test_initial_resource_is_the_async_pool() -> None:
    current = streampool.get_current_device_resource()
    assert isinstance(current, mr.CudaAsyncMemoryResource)
    assert streampool.get_current_device_resource() is current
    assert mr.get_current_device_resource() is current
    assert streampool.get_per_device_resource(0) is current


def test_set_returns_previous_and_is_used_by_buffers() -> None:
    first = streampool.get_current_device_resource()
    mine = mr.CudaMemoryResource()
    assert streampool.set_current_device_resource(mine) is first
    try:
        assert streampool.DeviceBuffer(size=10).mr is mine
        assert streampool.set_per_device_resource(0, first) is mine
        assert streampool.get_current_device_resource() is first
    finally:
        streampool.set_current_device_resource(first)


def test_bad_input() -> None:
    with pytest.raises(TypeError):
        streampool.set_current_device_resource("nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device 5"):
        streampool.get_per_device_resource(5)
    with pytest.raises(ValueError, match="device 3"):
        streampool.set_per_device_resource(3, mr.CudaMemoryResource())
    with pytest.raises(ValueError, match="device 9"):
        mr.CudaAsyncMemoryResource(device=9)
    assert isinstance(streampool.get_current_device_resource(), mr.MemoryResource)


def test_async_pool_options_and_attributes() -> None:
    own = mr.CudaAsyncMemoryResource(initial_pool_size="4MiB", release_threshold="1GiB")
    assert own.owns_pool
    assert own.release_threshold == 1 << 30
    assert own.reserved_bytes >= 4 << 20
    ptr = own.allocate(1 << 20)
    assert own.used_bytes >= 1 << 20
    own.deallocate(ptr, 1 << 20)
    streampool.DEFAULT_STREAM.synchronize()
    own.trim_to(0)
    assert own.reserved_bytes == 0
    shared = mr.CudaAsyncMemoryResource()
    assert not shared.owns_pool
    assert shared.release_threshold == 2**64 - 1  # raised on the default pool
    with pytest.raises(ValueError, match="0x1234"):
        mr.CudaAsyncViewMemoryResource(0x1234)
    view = mr.CudaAsyncViewMemoryResource(own.pool_handle)
    assert view.pool_handle == own.pool_handle and not view.owns_pool
    assert streampool._native.pointer_pool(shared.allocate(256)) == shared.pool_handle


@pytest.mark.parametrize(
    "text,expected", [("1GiB", 1 << 30), ("1GB", 10**9), ("512 MiB", 512 << 20), (42, 42)]
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert streampool.parse_size(text) == expected
