"""Memory resources, RMM-style: ``from streampool import mr`` where RMM users wrote
``import rmm.mr``.

Every resource implements the stream-ordered contract: ``allocate(nbytes, stream=None)``
returns memory usable by work enqueued on ``stream`` after the call, and
``deallocate(ptr, nbytes, stream=None)`` makes it reusable by work ordered after what is
enqueued on ``stream`` at the time. ``stream=None`` is the legacy default stream.

The recommended resource is :class:`CudaAsyncMemoryResource` (the driver's own pool),
which is also the initial resource of every device.
"""

from __future__ import annotations

from ._native import (
    CudaAsyncMemoryResource,
    CudaAsyncViewMemoryResource,
    CudaMemoryResource,
    ManagedMemoryResource,
    MemoryResource,
    PinnedHostMemoryResource,
    get_current_device_resource,
    get_per_device_resource,
    set_current_device_resource,
    set_per_device_resource,
)

__all__ = [
    "CudaAsyncMemoryResource",
    "CudaAsyncViewMemoryResource",
    "CudaMemoryResource",
    "ManagedMemoryResource",
    "MemoryResource",
    "PinnedHostMemoryResource",
    "get_current_device_resource",
    "get_per_device_resource",
    "set_current_device_resource",
    "set_per_device_resource",
]
