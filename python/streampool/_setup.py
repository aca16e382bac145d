"""The one-call setup: the recommended resource for a device, made its current resource."""

from __future__ import annotations

from ._native import device_info, set_current_device_resource, set_per_device_resource
from .mr import (
    CudaAsyncManagedMemoryResource,
    CudaAsyncMemoryResource,
    ManagedMemoryResource,
    MemoryResource,
    PrefetchResourceAdaptor,
)

__all__ = ["setup"]


def setup(larger_than_memory: bool = False, device: int | None = None) -> MemoryResource:
    """Makes the recommended resource the resource of ``device`` (the current device when
    None) and returns it.

    * By default: :class:`~streampool.mr.CudaAsyncMemoryResource`, the driver's
      stream-ordered pool (the device's current pool, shared with every library that uses
      it, its release threshold raised when it is the default pool).
    * ``larger_than_memory=True``, for work larger than the GPU's memory: managed memory
      that is prefetched to the device on the allocating stream as it is handed out, i.e.
      :class:`~streampool.mr.PrefetchResourceAdaptor` over
      :class:`~streampool.mr.CudaAsyncManagedMemoryResource` (the CUDA 13 driver's
      stream-ordered managed pool) where the device has managed pools
      (``device_info()["managed_pools"]``), else over
      :class:`~streampool.mr.ManagedMemoryResource` (``cuMemAllocManaged``).

    Buffers made afterwards without ``mr=`` use it; buffers made before keep theirs.
    """
    if not larger_than_memory:
        mr: MemoryResource = CudaAsyncMemoryResource(device=device)
    else:
        info = device_info(device)
        upstream: MemoryResource
        if info["managed_pools"]:
            upstream = CudaAsyncManagedMemoryResource(device=device)
        else:
            upstream = ManagedMemoryResource(device=device)
        mr = PrefetchResourceAdaptor(upstream)
    if device is None:
        set_current_device_resource(mr)
    else:
        set_per_device_resource(device, mr)
    return mr
