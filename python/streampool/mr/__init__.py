"""Memory resources, RMM-style: ``from streampool import mr`` where RMM users wrote
``import rmm.mr``.

Every resource implements the stream-ordered contract: ``allocate(nbytes, stream=None)``
returns memory usable by work enqueued on ``stream`` after the call, and
``deallocate(ptr, nbytes, stream=None)`` makes it reusable by work ordered after what is
enqueued on ``stream`` at the time. ``stream=None`` is the legacy default stream.

The recommended resource is :class:`CudaAsyncMemoryResource` (the driver's own pool),
which is also the initial resource of every device. For work larger than the GPU,
:class:`CudaAsyncManagedMemoryResource` (the CUDA 13 driver's pool of managed memory) or
:class:`ManagedMemoryResource`, under a :class:`PrefetchResourceAdaptor`; or let
:func:`streampool.setup` choose (``setup(larger_than_memory=True)``).

For many threads and streams over one upstream, :class:`ShardedPoolMemoryResource` (also
under RMM's name, :class:`PoolMemoryResource`): a pool with one shard per stream, so that
threads on different streams do not wait for one another.

Adaptors wrap any resource and add one thing each (RMM's names): statistics
(:class:`StatisticsResourceAdaptor`), outstanding allocations and leak reports
(:class:`TrackingResourceAdaptor`), a CSV event log (:class:`LoggingResourceAdaptor`), a
byte cap (:class:`LimitingResourceAdaptor`), a callback on out-of-memory
(:class:`FailureCallbackResourceAdaptor`), prefetching of managed memory
(:class:`PrefetchResourceAdaptor`), per-call latency histograms and NVTX ranges
(:class:`LatencyHistogramResourceAdaptor`), size classes (:class:`BinningMemoryResource`, with
:class:`FixedSizeMemoryResource` bins). They stack, and keep their upstream alive.

Also RMM's :class:`ArenaMemoryResource` (over the sharded pool),
:class:`CallbackMemoryResource` (Python functions as a resource),
:func:`available_device_memory` and the logging switches of :func:`streampool.reinitialize`.
See the RMM migration guide (``docs/rmm-migration.md``) for every RMM name and ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._native import (
    MAX_RESOURCE_DEPTH,
    AllocationRecord,
    ArenaMemoryResource,
    BinningMemoryResource,
    CallbackMemoryResource,
    CudaAsyncManagedMemoryResource,
    CudaAsyncMemoryResource,
    CudaAsyncViewMemoryResource,
    CudaMemoryResource,
    FailureCallbackResourceAdaptor,
    FixedSizeMemoryResource,
    LatencyHistogramResourceAdaptor,
    LimitingResourceAdaptor,
    LoggingResourceAdaptor,
    ManagedMemoryResource,
    MemoryResource,
    PinnedHostMemoryResource,
    PrefetchResourceAdaptor,
    ShardedPoolMemoryResource,
    StatisticsResourceAdaptor,
    TrackingResourceAdaptor,
    UpstreamResourceAdaptor,
    available_device_memory,
    get_current_device_resource,
    get_per_device_resource,
    set_current_device_resource,
    set_per_device_resource,
)
from .._types import CudaStreamFlags, PoolHandle

__all__ = [
    "MAX_RESOURCE_DEPTH",
    "AllocationRecord",
    "ArenaMemoryResource",
    "BinningMemoryResource",
    "CallbackMemoryResource",
    "CudaAsyncManagedMemoryResource",
    "CudaAsyncMemoryResource",
    "CudaAsyncViewMemoryResource",
    "CudaMemoryResource",
    "CudaStreamFlags",
    "DeviceMemoryResource",
    "FailureCallbackResourceAdaptor",
    "FixedSizeMemoryResource",
    "LatencyHistogramAdaptor",
    "LatencyHistogramResourceAdaptor",
    "LimitingResourceAdaptor",
    "LoggingResourceAdaptor",
    "ManagedMemoryResource",
    "MemoryResource",
    "PinnedHostMemoryResource",
    "PoolHandle",
    "PoolMemoryResource",
    "PrefetchResourceAdaptor",
    "ShardedPoolMemoryResource",
    "StatisticsResourceAdaptor",
    "TrackingResourceAdaptor",
    "UpstreamResourceAdaptor",
    "available_device_memory",
    "disable_logging",
    "enable_logging",
    "experimental",
    "get_current_device_resource",
    "get_current_device_resource_type",
    "get_log_filenames",
    "get_per_device_resource",
    "get_per_device_resource_type",
    "is_initialized",
    "set_current_device_resource",
    "set_per_device_resource",
]

DeviceMemoryResource = MemoryResource
"""RMM's name for the base class of every resource (:class:`MemoryResource`)."""

LatencyHistogramAdaptor = LatencyHistogramResourceAdaptor
"""The short name of :class:`LatencyHistogramResourceAdaptor` (as in the Rust crate)."""


if TYPE_CHECKING:
    from typing_extensions import TypeVar

    _U = TypeVar("_U", bound=MemoryResource, covariant=True, default=MemoryResource)
else:
    from typing import TypeVar

    _U = TypeVar("_U", bound=MemoryResource, covariant=True)  # a default needs Python 3.13 at run time


class PoolMemoryResource(ShardedPoolMemoryResource[_U]):
    """RMM's name for :class:`ShardedPoolMemoryResource`, with RMM's arguments
    (``upstream_mr, initial_pool_size=None, maximum_pool_size=None``). Unlike RMM's pool,
    ``initial_pool_size=None`` reserves nothing up front: the pool grows on demand."""


def get_current_device_resource_type() -> type[MemoryResource]:
    """The type of the current device's resource (RMM's name)::

    >>> streampool.mr.get_current_device_resource_type()
    <class 'streampool.mr.CudaAsyncMemoryResource'>
    """
    return type(get_current_device_resource())


def get_per_device_resource_type(device: int) -> type[MemoryResource]:
    """The type of ``device``'s resource (RMM's name); ValueError when it does not exist::

    >>> streampool.mr.get_per_device_resource_type(0)
    <class 'streampool.mr.CudaAsyncMemoryResource'>
    """
    return type(get_per_device_resource(device))


# Last, because _setup builds on the classes above (PoolMemoryResource among them).
from .._setup import disable_logging, enable_logging, get_log_filenames, is_initialized  # noqa: E402
from . import experimental  # noqa: E402  (RMM's `rmm.mr.experimental`)
