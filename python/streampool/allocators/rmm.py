"""RMM, and so cuDF and every library that allocates through RMM, shares streampool's
driver pool: ``use()``.

RMM's allocations are made in C++ (cuDF's columns, for one), and routing each of them
through a streampool resource would cost a Python call per allocation (RMM's
``CallbackMemoryResource``). So instead ``use()`` makes RMM allocate from the driver pool
that streampool's default resource allocates from (the device's current pool, through
RMM's ``CudaAsyncViewMemoryResource``): memory that cuDF frees is then reusable by
streampool, by PyTorch's ``cudaMallocAsync`` backend and by CuPy's ``MemoryAsyncPool``, and
the other way round, instead of each library keeping memory of its own.

Example (GPU only)::

    import rmm
    import streampool
    from streampool.allocators import rmm as sp_rmm

    sp_rmm.use()
    buf = rmm.DeviceBuffer(size=1 << 20)
    print(streampool.pointer_pool(buf.ptr) == sp_rmm.pool_handle())   # True

A resource already set in RMM (``rmm.reinitialize(pool_allocator=True)``, or
``rmm.mr.set_current_device_resource``) is the program's choice: ``use()`` leaves it and
says so, unless ``replace=True``.
"""

from __future__ import annotations

from typing import Any

try:
    import rmm
    import rmm.mr
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "streampool.allocators.rmm needs RMM: pip install rmm-cu13 (or the RMM build for your CUDA version)"
    ) from e

from .. import _native

__all__ = ["pool_handle", "shared_pool_resource", "use"]


def pool_handle(device: int | None = None) -> int:
    """The driver pool that streampool's default resource of ``device`` (the current
    device when None) allocates from: the device's current pool (``cuDeviceGetMemPool``),
    as an int."""
    return int(_native.CudaAsyncMemoryResource(device=device).pool_handle)


def _view(handle: int) -> Any:
    """RMM's ``CudaAsyncViewMemoryResource`` over the driver pool ``handle``, which RMM takes
    as a ``CUmemoryPool`` of NVIDIA's ``cuda.bindings`` (an RMM dependency)."""
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before 12.6 named the module cuda.cuda
        from cuda import cuda as driver
    return rmm.mr.CudaAsyncViewMemoryResource(driver.CUmemoryPool(handle))


def shared_pool_resource(device: int | None = None) -> Any:
    """RMM's ``CudaAsyncViewMemoryResource`` over :func:`pool_handle` of ``device``: an RMM
    resource that allocates from the same driver pool as streampool's default resource."""
    return _view(pool_handle(device))


def use(device: int | None = None, *, replace: bool = False) -> str:
    """Makes RMM's resource of ``device`` (the current device when None) allocate from
    streampool's driver pool (:func:`shared_pool_resource`), where RMM still has its initial
    resource, or always with ``replace``. Returns what it did. Call it before RMM (cuDF)
    allocates, so that every allocation comes from the shared pool; memory allocated
    earlier is freed through the resource that made it, as RMM does."""
    if _native.using_simulated_device():
        return "skipped: streampool runs on the simulated device, whose pools RMM cannot allocate from"
    device = _native.get_current_device() if device is None else device
    handle = pool_handle(device)  # first: a device that does not exist is streampool's clear error
    current = rmm.mr.get_per_device_resource(device)
    if not replace and type(current) is not rmm.mr.CudaMemoryResource:  # RMM's initial resource
        return (
            f"left as it is: RMM's resource of device {device} is already {type(current).__name__} "
            "(set by the program); use(replace=True) replaces it"
        )
    rmm.mr.set_per_device_resource(device, _view(handle))
    return f"rmm.mr.set_per_device_resource({device}, CudaAsyncViewMemoryResource(pool {handle:#x}))"
