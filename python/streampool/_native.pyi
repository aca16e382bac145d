"""The native module of streampool (Rust, PyO3). Import from ``streampool`` and
``streampool.mr`` rather than from here; these stubs are written by hand and checked with
``python -m mypy.stubtest streampool._native``.

Importing never touches the CUDA driver. Every call that can block (a driver call, a
device wait, a resource's lock) releases the GIL.
"""

import os
import pickle
import sys
from collections.abc import Callable, Iterable
from types import GenericAlias, TracebackType
from typing import (
    Any,
    ClassVar,
    Final,
    Generic,
    Literal,
    NotRequired,
    Protocol,
    Self,
    SupportsIndex,
    TypeAlias,
    TypedDict,
    final,
    overload,
    type_check_only,
)

from typing_extensions import Buffer, CapsuleType, TypeVar, disjoint_base

from streampool._errors import OutOfMemoryError
from streampool._types import CudaStreamFlags, PoolHandle
from streampool.statistics import Statistics

__all__ = [
    "DEFAULT_STREAM",
    "LEGACY_DEFAULT_STREAM",
    "LOG_HEADER",
    "MAX_LOG_TIME_S",
    "MAX_RESOURCE_DEPTH",
    "PER_THREAD_DEFAULT_STREAM",
    "AllocationRecord",
    "ArenaMemoryResource",
    "BinningMemoryResource",
    "CallbackMemoryResource",
    "CudaAsyncManagedMemoryResource",
    "CudaAsyncMemoryResource",
    "CudaAsyncViewMemoryResource",
    "CudaMemoryResource",
    "CupyAllocator",
    "CupyMemory",
    "DeviceBuffer",
    "FailureCallbackResourceAdaptor",
    "FixedSizeMemoryResource",
    "IpcImportedMemoryResource",
    "LatencyHistogramResourceAdaptor",
    "LimitingResourceAdaptor",
    "LogEvent",
    "LoggingResourceAdaptor",
    "ManagedMemoryResource",
    "MemoryResource",
    "PinnedHostMemoryResource",
    "PrefetchResourceAdaptor",
    "ShardedPoolMemoryResource",
    "StatisticsResourceAdaptor",
    "Stream",
    "TrackingResourceAdaptor",
    "UpstreamResourceAdaptor",
    "_NullMemoryResource",
    "_SimDevice",
    "__version__",
    "_capi_last_error",
    "_capture_hook_calls",
    "_capture_hooks_open_a_region",
    "_fast_path_calls",
    "_ipc_export",
    "_kernel_check",
    "_kernel_compute",
    "_kernel_fill",
    "_parse_log",
    "_rebuild_device_buffer",
    "_reset_device_resources",
    "_set_profile_log",
    "_torch_memory_stats",
    "_torch_reset_memory_stats",
    "_use_torch_out_of_memory",
    "available_device_memory",
    "backend_description",
    "device_can_access_peer",
    "device_count",
    "device_info",
    "driver_version",
    "drop_errors",
    "enable_peer_access",
    "get_current_device",
    "get_current_device_resource",
    "get_per_device_resource",
    "parse_size",
    "pipeline",
    "pointer_pool",
    "replay",
    "set_current_device_resource",
    "set_per_device_resource",
    "using_simulated_device",
]

__version__: Final[str]

_Size: TypeAlias = SupportsIndex | str
if sys.version_info >= (3, 12):
    _HostBuffer: TypeAlias = Buffer
else:
    # NumPy declares its arrays' buffer protocol (`__buffer__`) from Python 3.12 only.
    import numpy

    _HostBuffer: TypeAlias = Buffer | numpy.ndarray[Any, Any]
_B = TypeVar("_B", bound=_HostBuffer)

@type_check_only
class _CudaStreamProtocol(Protocol):
    """cuda.core's stream protocol."""
    def __cuda_stream__(self) -> tuple[int, int]: ...

@type_check_only
class _TorchStream(Protocol):
    """torch.cuda.Stream."""
    @property
    def cuda_stream(self) -> int: ...

@type_check_only
class _CupyStream(Protocol):
    """cupy.cuda.Stream."""
    @property
    def ptr(self) -> int: ...

@type_check_only
class _NumbaStream(Protocol):
    """A Numba stream (``handle`` is a ctypes ``c_void_p``)."""
    @property
    def handle(self) -> Any: ...

_StreamLike: TypeAlias = Stream | int | _CudaStreamProtocol | _TorchStream | _CupyStream | _NumbaStream | None
"""What every ``stream=`` argument accepts. None is the legacy default stream; ints 0 and
1 name it too, 2 the per-thread default stream; any other int must be a live stream."""

# --- streams ------------------------------------------------------------------------

@final
class Stream:
    """A CUDA stream: one streampool created and owns, one borrowed from another library,
    or one of the default streams.

    ``Stream(device=None, blocking=False)`` creates a stream on ``device`` (the current
    device when None) of the current backend (the CUDA driver, or the active simulated
    device). It is non-blocking unless ``blocking`` (or, as RMM takes it,
    ``flags=CudaStreamFlags.SYNC_DEFAULT``, also second positionally as in RMM's
    ``Stream(obj=None, flags=None)``; ``blocking`` and ``flags`` must agree when both are
    given, ValueError otherwise): it does not synchronise with the legacy default
    stream. It is destroyed when the last reference to it goes away (buffers made on it
    keep it alive).

    ``Stream(obj)``, as RMM's: a wrapper of another library's stream (an object with
    ``__cuda_stream__`` of protocol version 0, a ``torch.cuda.Stream``, a
    ``cupy.cuda.Stream``, a Numba stream, or another ``Stream``) that keeps ``obj`` alive.
    An int is refused (TypeError): pass ``device=`` for a new stream, or give a raw handle
    straight to any ``stream=`` argument.

    Streams compare equal when they are the same stream of the same backend.

    Example::

        s = streampool.Stream()                                       # new, non-blocking
        b = streampool.Stream(flags=mr.CudaStreamFlags.SYNC_DEFAULT)  # new, blocking
        t = streampool.Stream(torch.cuda.current_stream())            # torch's (PyTorch, a GPU)
    """

    def __new__(
        cls,
        obj: Stream | _CudaStreamProtocol | _TorchStream | _CupyStream | _NumbaStream | None = None,
        flags: CudaStreamFlags | int | None = None,
        *,
        device: int | None = None,
        blocking: bool | None = None,
    ) -> Stream: ...
    @property
    def handle(self) -> int:
        """The driver's handle as an int: 0 for the legacy default stream, 2 for the
        per-thread default stream."""
    @property
    def device(self) -> int | None:
        """The device the stream belongs to; None for the default streams, which exist on
        every device."""
    def synchronize(self) -> None:
        """Waits until all work enqueued on the stream has completed (GIL released). On a
        stream streampool made, the sharded pool learns from it that the frees made on the
        stream before it have completed: other streams reuse that memory with no event."""
    def is_default(self) -> bool:
        """True for the legacy and the per-thread default streams (RMM's ``is_default()``)."""
    def wait_stream(self, other: _StreamLike) -> None:
        """Orders the work enqueued on this stream from now on after the work enqueued on
        ``other`` so far: an event recorded on ``other``, which this stream waits for; the
        host does not wait (as ``torch.cuda.Stream.wait_stream``). ``other`` is any stream a
        ``stream=`` argument takes, of this stream's device or another. Use it to hand
        memory between streams: before memory written on ``other`` is read on this stream,
        and before memory that ``other`` still reads is freed on this one.

        Example::

            producer, consumer = streampool.Stream(), streampool.Stream()
            buf = streampool.DeviceBuffer.to_device(b"data", stream=producer)
            consumer.wait_stream(producer)  # the consumer's kernels see the copy
        """
    def __cuda_stream__(self) -> tuple[int, int]:
        """cuda.core's stream protocol: ``(0, handle)``."""
    def __int__(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

DEFAULT_STREAM: Final[Stream]
"""The legacy default stream (handle 0): what ``stream=None`` means."""
LEGACY_DEFAULT_STREAM: Final[Stream]
"""The same stream as DEFAULT_STREAM (the driver names it 0 and 1)."""
PER_THREAD_DEFAULT_STREAM: Final[Stream]
"""The per-thread default stream (handle 2): a different stream on each host thread."""

# --- resources ----------------------------------------------------------------------

@disjoint_base
class MemoryResource:
    """Base class of every memory resource (not constructible itself).

    The stream-ordered contract: memory from ``allocate(nbytes, stream)`` may be used by
    work enqueued on ``stream`` after the call; ``deallocate(ptr, nbytes, stream)`` makes
    it reusable by work ordered after everything enqueued on ``stream`` before the call.
    ``allocate(0)`` returns 0; every other allocation is aligned to at least 256 bytes.
    A resource is bound to one device; streams of another device are refused.
    """

    def allocate(self, nbytes: _Size, stream: _StreamLike = None) -> int:
        """Allocates ``nbytes`` (an int, or a string such as ``"1MiB"``) for use on
        ``stream`` (default: the legacy default stream); returns the address.

        Raises OutOfMemoryError (a MemoryError) naming the size asked and what was free,
        ValueError for a negative size, InvalidStreamError for a stream that is not live
        or belongs elsewhere."""
    def deallocate(self, ptr: int, nbytes: _Size, stream: _StreamLike = None) -> None:
        """Frees ``ptr`` (of ``nbytes`` bytes, as allocated) for reuse by work ordered
        after what is enqueued on ``stream`` now. InvalidPointerError where the resource
        can tell the pointer or size is wrong, and for the address of an open DeviceBuffer
        that Python code has read (the buffer frees its memory itself)."""
    @property
    def device(self) -> int:
        """The device ordinal the resource is bound to."""
    @property
    def memory_kind(self) -> Literal["device", "managed", "pinned_host"]:
        """What kind of memory it hands out."""
    @property
    def backend(self) -> str:
        """The backend it lives on, e.g. ``"CUDA driver 13.0"`` or ``"simulated device #1 (16 GiB)"``."""

@final
class CudaAsyncMemoryResource(MemoryResource):
    """The driver's stream-ordered pool (``cuMemAllocFromPoolAsync``): the recommended
    resource, and the initial resource of every device.

    With no options it uses the device's current pool, shared with every library that
    uses the driver's pool (the default pool's release threshold is raised to the
    maximum). With ``initial_pool_size``, ``release_threshold``, ``enable_ipc`` or
    ``peer_access`` (even an empty list) it creates a pool of its own, destroyed with the
    resource. ``initial_pool_size`` is reserved up front (allocated and freed once) and
    kept as long as ``release_threshold`` (default: the maximum) is at least that size:
    the driver trims a pool to its threshold at every synchronisation, so a smaller
    threshold gives the rest back at once.

    ``peer_access``: other devices whose work may read and write the pool's memory
    (``cuMemPoolSetAccess``; see :meth:`set_peer_access`), e.g. ``peer_access=[1]`` for a
    pool on device 0 that kernels on device 1 read.

    Sizes are not checked on free: the driver's free (``cuMemFreeAsync``) takes no size and
    the resource keeps no record per allocation, so ``deallocate(ptr, 1 << 40)`` is
    accepted and frees the allocation at ``ptr``, whatever its size. Wrap it in a
    TrackingResourceAdaptor to have wrong sizes refused.

    Example::

        pool = mr.CudaAsyncMemoryResource()  # the device's default pool, shared with other libraries
        own = mr.CudaAsyncMemoryResource(initial_pool_size="1GiB", release_threshold="4GiB")  # a pool of its own
        ptr = own.allocate(1 << 20)
        own.deallocate(ptr, 1 << 20)
    """

    def __new__(
        cls,
        initial_pool_size: _Size | None = None,
        release_threshold: _Size | None = None,
        enable_ipc: bool = False,
        device: int | None = None,
        peer_access: Iterable[int] | None = None,
    ) -> CudaAsyncMemoryResource: ...
    @property
    def pool_handle(self) -> PoolHandle:
        """The driver pool handle (``CUmemoryPool`` as an int); callable too, for RMM's
        ``pool_handle()``: ``mr.pool_handle == mr.pool_handle()``."""
    @property
    def owns_pool(self) -> bool:
        """True when this resource created its pool (and destroys it when collected)."""
    @property
    def release_threshold(self) -> int:
        """Bytes the pool keeps at a synchronisation before releasing memory to the system."""
    @property
    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the system."""
    @property
    def used_bytes(self) -> int:
        """Bytes handed out by the pool (for a shared pool, other libraries' too)."""
    @property
    def peer_access(self) -> list[int]:
        """The devices other than the pool's own that may read and write its memory
        (``cuMemPoolGetAccess``), in order."""
    def set_peer_access(self, device: int, enabled: bool = True) -> None:
        """Grants (or, with ``enabled=False``, withdraws) read-write access to the pool's
        memory, present and future, from work on ``device`` (``cuMemPoolSetAccess``). Pool
        memory does not follow :func:`enable_peer_access`: this is its switch.
        InvalidArgumentError naming both devices when ``device`` does not exist, is the
        pool's own, or cannot reach it (``device_can_access_peer``)."""
    def trim_to(self, nbytes: _Size) -> None:
        """Releases free memory to the system until the pool holds at most ``nbytes``."""

@final
class CudaAsyncManagedMemoryResource(MemoryResource):
    """The CUDA 13 driver's stream-ordered pool of managed memory, for work larger than the
    GPU: memory usable from host and device, handed out in stream order, that
    ``DeviceBuffer.prefetch`` accepts. The driver takes no advice on it
    (``DeviceBuffer.advise`` raises UnsupportedError; ManagedMemoryResource's memory takes
    advice).

    With no options it uses the device's current managed pool (the default managed pool's
    release threshold is raised to the maximum; a pool someone else set is left alone).
    With ``initial_pool_size`` or ``release_threshold`` it creates a managed pool of its
    own, destroyed with the resource. Needs a CUDA 13 driver and a GPU with concurrent
    managed access: UnsupportedError, saying which is missing, otherwise (use
    ManagedMemoryResource there). Keep managed allocations well below the GPU's free
    memory unless the work needs to oversubscribe it.

    Sizes are not checked on free (the driver's free takes no size), as for
    CudaAsyncMemoryResource.
    """

    def __new__(
        cls,
        initial_pool_size: _Size | None = None,
        release_threshold: _Size | None = None,
        device: int | None = None,
    ) -> CudaAsyncManagedMemoryResource: ...
    @property
    def pool_handle(self) -> PoolHandle:
        """The driver pool handle (``CUmemoryPool`` as an int); callable too, for RMM's
        ``pool_handle()``: ``mr.pool_handle == mr.pool_handle()``."""
    @property
    def owns_pool(self) -> bool:
        """True when this resource created its pool (and destroys it when collected)."""
    @property
    def release_threshold(self) -> int:
        """Bytes the pool keeps at a synchronisation before releasing memory to the system."""
    @property
    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the system."""
    @property
    def used_bytes(self) -> int:
        """Bytes handed out by the pool (for a shared pool, other libraries' too)."""
    @property
    def peer_access(self) -> list[int]:
        """The devices other than the pool's own that may read and write its memory
        (``cuMemPoolGetAccess``), in order."""
    def set_peer_access(self, device: int, enabled: bool = True) -> None:
        """Grants (or, with ``enabled=False``, withdraws) read-write access to the pool's
        memory, present and future, from work on ``device`` (``cuMemPoolSetAccess``). Pool
        memory does not follow :func:`enable_peer_access`: this is its switch.
        InvalidArgumentError naming both devices when ``device`` does not exist, is the
        pool's own, or cannot reach it (``device_can_access_peer``)."""
    def trim_to(self, nbytes: _Size) -> None:
        """Releases free memory to the system until the pool holds at most ``nbytes``."""

@final
class CudaAsyncViewMemoryResource(MemoryResource):
    """Allocates from a driver pool someone else owns (PyTorch's, CuPy's) and never
    destroys it: the owner must outlive the view. ``pool_handle`` is an int, or a
    ``cuda.bindings`` handle object (``driver.CUmemoryPool``, ``runtime.cudaMemPool_t``, as
    RMM takes it; read with ``int()``). A handle that is not a pool raises ValueError. Sizes are not checked on free (the
    driver's free takes no size).

    ``device`` is the device the pool lies on; by default the one the driver says it does
    (the only device that can use it, or the one whose current or default pool it is), else
    the current device. A pool of another device, or one ``device`` cannot use, raises
    InvalidArgumentError naming its device, since the view's buffers would name the wrong
    device.

    A view of a device's current or default *managed* pool (``CudaAsyncManagedMemoryResource().pool_handle``,
    as RMM's ``CudaAsyncManagedMemoryResource`` is built) hands out managed memory:
    ``memory_kind`` is ``"managed"``, and prefetching and DLPack treat it so. A managed pool
    that someone created is taken for device memory (the driver tells a pool's allocation
    type only from CUDA 13.2 on)."""

    def __new__(cls, pool_handle: int | Any, device: int | None = None) -> CudaAsyncViewMemoryResource: ...
    @property
    def pool_handle(self) -> PoolHandle:
        """The driver pool handle this resource allocates from; callable too, for RMM's
        ``pool_handle()``."""
    @property
    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the system (whoever allocated them)."""
    @property
    def used_bytes(self) -> int:
        """Bytes handed out by the pool (whoever allocated them)."""
    @property
    def owns_pool(self) -> Literal[False]:
        """Always False: a view never destroys the pool."""

@final
class CudaMemoryResource(MemoryResource):
    """Plain device memory (``cuMemAlloc``/``cuMemFree``); every free waits for the device.
    Sizes are not checked on free (``cuMemFree`` takes no size).

    Example::

        plain = mr.CudaMemoryResource()
        ptr = plain.allocate(4096)
        plain.deallocate(ptr, 4096)
    """

    def __new__(cls, device: int | None = None) -> CudaMemoryResource: ...

@final
class ManagedMemoryResource(MemoryResource):
    """Managed (unified) memory (``cuMemAllocManaged``), for work larger than device memory.
    Sizes are not checked on free (``cuMemFree`` takes no size).

    Example::

        managed = mr.ManagedMemoryResource()
        buf = streampool.DeviceBuffer(size=1 << 20, mr=managed)
        buf.prefetch()  # to the buffer's device, on its stream
    """

    def __new__(cls, device: int | None = None) -> ManagedMemoryResource: ...

@final
class PinnedHostMemoryResource(MemoryResource):
    """Page-locked host memory (``cuMemHostAlloc``). Sizes are not checked on free
    (``cuMemFreeHost`` takes no size).

    Example::

        pinned = mr.PinnedHostMemoryResource()
        staging = streampool.DeviceBuffer(size=1 << 20, mr=pinned)
    """

    def __new__(cls, device: int | None = None) -> PinnedHostMemoryResource: ...

def get_current_device_resource() -> MemoryResource:
    """The resource of the current device: a CudaAsyncMemoryResource until one is set.
    Under a simulated device, that device's resources."""

def set_current_device_resource(mr: MemoryResource) -> MemoryResource | None:
    """Makes ``mr`` the resource of the current device; returns the previous one (None only
    when there was none and the initial one cannot be made). ``mr`` must be bound to the
    current device of the current backend (ValueError otherwise). RuntimeWarning when
    memory allocated through the C entry points (PyTorch's allocator) is live on the
    device: it would be freed through ``mr``, which did not make it.

    Example::

        pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
        previous = mr.set_current_device_resource(pool)
        buf = streampool.DeviceBuffer(size=1 << 20)  # from the pool
        mr.set_current_device_resource(previous)
    """

def get_per_device_resource(device: int) -> MemoryResource:
    """The resource of ``device`` (ValueError when it does not exist)."""

def set_per_device_resource(device: int, mr: MemoryResource) -> MemoryResource | None:
    """Makes ``mr`` the resource of ``device``; returns the previous one. ``mr`` must be
    bound to that device of the current backend (ValueError otherwise). RuntimeWarning as
    :func:`set_current_device_resource` says."""

def get_current_device() -> int:
    """The current device of the current backend."""

def available_device_memory(device: int | None = None) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device``'s memory (the current device when None), as
    the driver reports them (``cuMemGetInfo``): RMM's ``available_device_memory()``.
    ValueError for a device that does not exist.

    Example::

        free, total = mr.available_device_memory()
    """

def _reset_device_resources() -> None:
    """Forgets the resource of every device of the current backend (each goes back to its
    initial resource); used by ``streampool.reinitialize``."""

def _set_profile_log(log: str | os.PathLike[str] | None) -> None:
    """Sets (or clears, None) ``streampool profile``'s log: each device's initial resource,
    as the device is first used, is then the driver's pool under a logging adaptor writing
    there (device N > 0 to ``LOG.devN``); for ``streampool profile``'s start-up hook."""

# --- adaptors -----------------------------------------------------------------------
# Python callbacks (failure callbacks, logging callbacks, stack capture) run on the thread
# that called allocate/deallocate, with the GIL re-taken and no lock of any resource held;
# an exception they raise reaches that caller unchanged.

MAX_RESOURCE_DEPTH: Final[int]
"""The deepest chain of resources that may be built (256): an adaptor, pool or binning
resource that would be deeper (itself and the chain below it) raises InvalidArgumentError
(a ValueError) naming its depth and this limit. Every call recurses through the chain, and
a deeper one could overflow the thread's stack."""

_U = TypeVar("_U", bound=MemoryResource, covariant=True, default=MemoryResource)
"""The type of an adaptor's upstream: ``StatisticsResourceAdaptor(pool)`` is a
``StatisticsResourceAdaptor[ShardedPoolMemoryResource]``, whose ``upstream_mr`` is the
pool (a bare ``StatisticsResourceAdaptor`` means ``[MemoryResource]``)."""

@disjoint_base
class UpstreamResourceAdaptor(MemoryResource, Generic[_U]):
    """Base class of the resources that wrap another one (not constructible itself). Keeps
    the upstream alive, and shows it to the garbage collector: a reference cycle through
    an upstream (a callback that refers to a resource over its adaptor) is collected."""

    @property
    def upstream(self) -> _U:
        """The resource this one wraps, as it was given. ValueError once the garbage
        collector has cleared it (only code that runs while a cycle is collected, such
        as a finaliser, can see that)."""
    def get_upstream(self) -> _U:
        """The resource this one wraps (RMM's name; same as ``upstream``)."""
    @property
    def upstream_mr(self) -> _U:
        """The resource this one wraps (RMM's attribute; same as ``upstream``)."""
    @classmethod
    def __class_getitem__(cls, item: Any) -> GenericAlias:
        """``StatisticsResourceAdaptor[PoolMemoryResource]`` where an annotation is evaluated
        at run time: a ``types.GenericAlias``."""

@final
class StatisticsResourceAdaptor(UpstreamResourceAdaptor[_U]):
    """Counts what passes through it: current, peak and total bytes and allocations, on a
    stack of counters (``push_counters``/``pop_counters``) for measuring code blocks, as
    RMM's. Counts allocations once their upstream call has returned; a scope that frees
    memory allocated before it began reports ``current`` as 0, not below.

    It keeps no record per allocation, so it cannot check a free's size; a free of more
    bytes than are in use through it (all scopes together), or when nothing is, is
    certainly wrong and raises InvalidPointerError without reaching the upstream (nothing
    changes). Other wrong sizes are counted as given where the upstream takes them (the
    driver's pool takes any size): wrap the upstream in a TrackingResourceAdaptor to have
    them refused. Takes the upstream's fast path (the GIL kept) where the upstream has one.

    Example::

        stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
        ptr = stats.allocate(1 << 20)
        print(stats.allocation_counts.current_bytes)  # 1048576
        stats.deallocate(ptr, 1 << 20)
    """

    def __new__(cls, upstream_mr: _U) -> StatisticsResourceAdaptor[_U]: ...
    @property
    def allocation_counts(self) -> Statistics:
        """The counters on top of the stack."""
    def push_counters(self) -> Statistics:
        """Pushes zeroed counters; returns the counters on top before the push."""
    def pop_counters(self) -> Statistics:
        """Pops the counters on top (adding them into the ones below) and returns them.
        IndexError when only the base counters are left (as RMM's)."""

@final
class AllocationRecord:
    """One outstanding allocation of a TrackingResourceAdaptor."""

    @property
    def ptr(self) -> int:
        """The address."""
    @property
    def size(self) -> int:
        """The size in bytes, as asked."""
    @property
    def stream(self) -> int:
        """The handle of the stream it was allocated on."""
    @property
    def thread(self) -> str:
        """The allocating Python thread: its name and ident, e.g. ``"MainThread (ident
        140230...)"`` (``threading.current_thread()``)."""
    @property
    def stack(self) -> str | None:
        """The Python stack at the allocation, when the adaptor captures stacks."""
    def __eq__(self, other: object, /) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

@final
class TrackingResourceAdaptor(UpstreamResourceAdaptor[_U]):
    """Tracks every outstanding allocation (address, size, stream, thread and, with
    ``capture_stacks``, the Python stack: slow, for finding leaks). A free of a pointer it
    did not hand out, a double free or a size that does not match raises
    InvalidPointerError, and the upstream is not called. Without ``capture_stacks``, takes
    the upstream's fast path (the GIL kept) where the upstream has one. Each allocation
    records the Python thread's name and ident (a call into Python per allocation).

    Example::

        tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource(), capture_stacks=True)
        ptr = tracked.allocate(4096)
        print(tracked.get_outstanding_allocations_str())  # where each live allocation was made
        tracked.deallocate(ptr, 4096)
    """

    def __new__(cls, upstream_mr: _U, capture_stacks: bool = False) -> TrackingResourceAdaptor[_U]: ...
    def get_allocated_bytes(self) -> int:
        """Bytes allocated through it and not yet freed."""
    def get_outstanding_allocations_str(self) -> str:
        """The leak report: a summary line, then one line per outstanding allocation
        (address, size, stream, thread), each followed by its stack when captured; ``""``
        when nothing is outstanding, as RMM's."""
    def log_outstanding_allocations(self) -> None:
        """Logs the leak report to the ``streampool`` logger (Python ``logging``) at WARNING
        level when anything is outstanding; does nothing otherwise."""
    def outstanding(self) -> list[AllocationRecord]:
        """The outstanding allocations, by address."""

LOG_HEADER: Final[str]
"""The first line of every allocation log: ``"Thread,Time,Action,Pointer,Size,Stream"``."""
MAX_LOG_TIME_S: Final[float]
"""The latest time, in seconds, a log line may carry (about 292 years: ``i64::MAX``
nanoseconds, rounded down); a later, negative or non-finite time is a malformed line."""

@final
class LogEvent:
    """One event of an allocation log."""

    @property
    def thread(self) -> int:
        """The id of the thread that acted."""
    @property
    def time(self) -> float:
        """When, in seconds: since the epoch, or since midnight for RMM's ``HH:MM:SS.us``."""
    @property
    def action(self) -> Literal["allocate", "allocate failure", "free"]:
        """What happened."""
    @property
    def ptr(self) -> int:
        """The address (0 for a failed allocation)."""
    @property
    def size(self) -> int:
        """The size in bytes."""
    @property
    def stream(self) -> int:
        """The stream handle."""
    def __eq__(self, other: object, /) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

def _parse_log(text: str) -> list[LogEvent]:
    """Parses the text of an allocation log (use ``streampool.logs.parse_log``)."""

@final
class LoggingResourceAdaptor(UpstreamResourceAdaptor[_U]):
    """Logs every allocation, failed allocation and free as a CSV line in RMM's format
    (``LOG_HEADER``), to a file (flushed after every line) and/or to ``callback``, which
    is called with each line, without its newline.

    With neither ``log_file_name`` nor ``callback``, the file is ``STREAMPOOL_LOG_FILE``,
    else ``RMM_LOG_FILE``; ValueError when neither is set. Unlike RMM, no ``.dev<N>``
    suffix is added to the name. An exception raised by ``callback`` on an allocation
    reaches the caller, and the allocation is undone (freed and logged so); the adaptor
    stays usable. On a free, the memory is freed anyway and deallocate returns: the
    exception goes to ``sys.unraisablehook`` and the failure to ``streampool.drop_errors()``
    (an error from a free would tell the adaptors above that nothing was freed, and they
    would keep counting the memory). A callback that allocates or frees through the adaptor
    it logs for (whose line would call it again, from inside itself) gets
    InvalidArgumentError from that call. Frees are logged and passed on with
    the size given (the upstream checks it where it can). Every call releases the GIL (no
    fast path): a file write may block, and a free is logged before it happens. A log
    file that cannot be created raises OSError (FileNotFoundError, PermissionError, ...)
    naming it, at construction; one that cannot be written later raises it from
    allocate, and is recorded in ``streampool.drop_errors()`` on a free.

    Example::

        logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), log_file_name="alloc.csv")
        logged.deallocate(logged.allocate(4096), 4096)
        logged.flush()  # alloc.csv: one line per call, RMM's CSV format
    """

    def __new__(
        cls,
        upstream_mr: _U,
        log_file_name: str | os.PathLike[str] | None = None,
        callback: Callable[[str], object] | None = None,
    ) -> LoggingResourceAdaptor[_U]: ...
    def flush(self) -> None:
        """Writes out anything buffered (lines are flushed as they are written)."""
    def get_file_name(self) -> str | None:
        """The absolute path of the log file; None when logging only to a callback."""

@final
class LimitingResourceAdaptor(UpstreamResourceAdaptor[_U]):
    """Refuses, with OutOfMemoryError, allocations that would take the bytes outstanding
    through it over ``allocation_limit`` (an int > 0, or a string such as ``"2GiB"``;
    ValueError otherwise). Each allocation counts rounded up to a multiple of 256 bytes,
    as RMM's adaptor counts it. Holds under any number of threads.

    It keeps no record per allocation, so it cannot check a free's size; a free of more
    bytes than are allocated through it is certainly wrong and raises InvalidPointerError
    without reaching the upstream (nothing changes: free it again with the right size).
    The count never goes below 0. Other wrong sizes move it by the size given where the
    upstream takes them (the driver's pool takes any size): wrap the upstream in a
    TrackingResourceAdaptor to have them refused. Takes the upstream's fast path (the GIL
    kept) where the upstream has one.

    Example::

        limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), allocation_limit="1GiB")
        ptr = limited.allocate(1 << 20)
        print(limited.get_allocated_bytes())  # 1048576
        limited.deallocate(ptr, 1 << 20)
    """

    def __new__(cls, upstream_mr: _U, allocation_limit: _Size) -> LimitingResourceAdaptor[_U]: ...
    def get_allocated_bytes(self) -> int:
        """Bytes allocated through it and not yet freed (each rounded up to 256, with
        reservations of allocations in flight)."""
    def get_allocation_limit(self) -> int:
        """The limit, in bytes."""

@final
class FailureCallbackResourceAdaptor(UpstreamResourceAdaptor[_U]):
    """Calls ``callback(nbytes)`` when the upstream runs out of memory (an
    OutOfMemoryError, or a MemoryError that a CallbackMemoryResource's allocate function
    raised): a true result (as ``bool()`` reads it, RMM's rule) retries the allocation, a
    false one (None included) lets the error reach the caller. The callback may free
    memory into the same stack (no lock is held), and use streampool otherwise. An exception
    it raises reaches the caller of allocate unchanged. A callback that always answers true
    retries until Ctrl-C (checked after every call). TypeError when ``callback`` is not
    callable. Frees are passed on as given (the upstream checks sizes where it can).

    Example::

        cache = []

        def on_failure(nbytes):
            freed = bool(cache)
            cache.clear()  # give cached buffers back, then try again
            return freed

        upstream = mr.FailureCallbackResourceAdaptor(mr.CudaAsyncMemoryResource(), on_failure)
    """

    def __new__(
        cls, upstream_mr: _U, callback: Callable[[int], object]
    ) -> FailureCallbackResourceAdaptor[_U]: ...

@final
class PrefetchResourceAdaptor(UpstreamResourceAdaptor[_U]):
    """Prefetches every allocation to the device on the allocating stream
    (``cuMemPrefetchAsync``), for managed memory. Frees are passed on as given (the
    upstream checks sizes where it can).

    Example::

        prefetched = mr.PrefetchResourceAdaptor(mr.ManagedMemoryResource())
        buf = streampool.DeviceBuffer(size=1 << 20, mr=prefetched)  # prefetched to the device
    """

    def __new__(cls, upstream_mr: _U) -> PrefetchResourceAdaptor[_U]: ...

@final
class FixedSizeMemoryResource(UpstreamResourceAdaptor[_U]):
    """Blocks of one size (``block_size``, default 1 MiB, rounded up to 256) carved from
    chunks of ``blocks_to_preallocate`` blocks taken from the upstream as needed. Not a
    general resource: a larger allocation raises OutOfMemoryError (a MemoryError, as RMM's
    ``out_of_memory``), naming the block size. The
    bins of BinningMemoryResource are made of these. A free of a block that is not
    outstanding, or with more bytes than a block, raises InvalidPointerError (it records
    blocks, not sizes: a smaller size frees the same block). ``blocks_to_preallocate``
    below 1 (or beyond 2**64) raises ValueError naming it.

    Blocks are reused as in RMM's pools: a block freed on a stream serves that stream at
    once; a stream with none of its own takes the fullest other stream's free blocks,
    made to wait (on the device, not the host) on an event recorded at that stream's
    latest free, before taking a chunk from the upstream. Each free records that event (a
    driver call). When the upstream runs out of memory the device is synchronised once and
    every block freed before serves every stream. Chunks go back to the upstream when the
    resource is dropped (a BinningMemoryResource also gives back its bins' wholly free
    chunks when a request finds the upstream out of memory).

    Example::

        blocks = mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), block_size="1MiB")
        ptr = blocks.allocate(1000)  # any size up to the block size takes one block
        blocks.deallocate(ptr, 1000)
    """

    def __new__(
        cls,
        upstream_mr: _U,
        block_size: _Size | None = None,
        blocks_to_preallocate: SupportsIndex | None = 128,
    ) -> FixedSizeMemoryResource[_U]: ...
    @property
    def block_size(self) -> int:
        """The size of every block, in bytes."""
    @property
    def blocks_to_preallocate(self) -> int:
        """Blocks taken from the upstream at a time."""

@final
class BinningMemoryResource(UpstreamResourceAdaptor[_U]):
    """Routes each allocation to the bin of the smallest size class that fits it, and
    larger ones to the upstream. With both exponents, starts with a
    FixedSizeMemoryResource bin for every power of two in
    ``[2**min_size_exponent, 2**max_size_exponent]`` (None, or RMM's -1: none).

    It records every allocation's size: a free of a pointer it did not hand out, a double
    free, or a size other than the one allocated (which would send the free to another
    bin, or to the upstream) raises InvalidPointerError, and nothing changes. Exponents
    are in 0..=40 (bins of 1 byte to 1 TiB), the first at most the second; anything else
    raises InvalidArgumentError (a ValueError) naming the argument and the value.

    When a request finds the upstream out of memory, the bins it made give back their
    chunks whose blocks are all free (after a device synchronisation), and the request is
    tried again: memory a bin took for streams that are gone, or for sizes no longer asked
    for, serves the other bins and the upstream.

    Example::

        upstream = mr.CudaAsyncMemoryResource()
        binning = mr.BinningMemoryResource(upstream, 18, 22)  # bins of 256 KiB to 4 MiB
        ptr = binning.allocate(300_000)  # from the 512 KiB bin
        binning.deallocate(ptr, 300_000)
    """

    def __new__(
        cls,
        upstream_mr: _U,
        min_size_exponent: SupportsIndex | None = None,
        max_size_exponent: SupportsIndex | None = None,
    ) -> BinningMemoryResource[_U]: ...
    def add_bin(self, allocation_size: _Size, bin_resource: MemoryResource | None = None) -> None:
        """Adds a bin for allocations up to ``allocation_size`` bytes (rounded up to 256, as
        RMM), served by ``bin_resource`` (kept alive), or by a new FixedSizeMemoryResource
        of that block size. For a size that has a bin already: None changes nothing (as
        RMM); a resource replaces the bin's resource (RMM ignores it silently), refused
        with ValueError while that bin has allocations outstanding. ValueError too while
        the bin that would give up sizes to a new one has allocations outstanding, or for
        a ``bin_resource`` that would make this resource deeper than it was when a
        resource was built over it (add bins before wrapping it; a bin that calls back
        into this resource is always refused), and for a ``bin_resource`` of another
        device or of another kind of memory than the upstream's (every buffer reports
        the kind of memory it holds).

        Example::

            binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 10, 20)
            binning.add_bin(1 << 15, mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource()))
        """
    @property
    def bin_mrs(self) -> list[MemoryResource]:
        """The resources given to ``add_bin``, in order (RMM's ``bin_mrs``)."""
    @property
    def bins(self) -> list[tuple[int, MemoryResource]]:
        """Every bin as ``(allocation_size, resource)``, smallest first; bins made here
        appear as plain MemoryResource objects."""

# --- the sharded pool -----------------------------------------------------------------

@type_check_only
class _PoolStats(TypedDict):
    reserved_bytes: int
    peak_reserved_bytes: int
    used_bytes: int
    free_bytes: int
    common_free_bytes: int
    shard_free_bytes: dict[int, int]
    retired_shards: int
    grown_bytes: int
    released_bytes: int
    upstream_growths: int
    completed_steals: int
    cross_stream_waits: int
    synchronizations: int
    events_recorded: int
    event_queries: int

@disjoint_base
class ShardedPoolMemoryResource(UpstreamResourceAdaptor[_U]):
    """The lock-sharded stream-ordered pool: suballocates memory from ``upstream_mr`` with
    one shard of free blocks per stream, so that threads on different streams do not wait
    for one another (RMM's ``PoolMemoryResource``, without its one lock).

    ``initial_pool_size=None`` reserves nothing up front; ``maximum_pool_size=None`` means
    no limit but the upstream's; sizes are rounded to 256 bytes. ``release_threshold``:
    free bytes kept before whole free chunks go back, after each of the pool's own device
    synchronisations (when memory runs short; not the program's), and ``release()`` gives
    back everything free.
    ``events_every``: a stream records an event after this many frees, so that other
    streams can reuse what it freed (the interval doubles after each event, up to 64
    times, while no stream is short of memory). ``event_batch`` (default 1): the fewest
    frees one event covers when another stream asks for this stream's memory; more means
    fewer driver calls per block handed between streams (a pipeline's allocator time)
    for more memory held meanwhile. ``headroom``: the footprint budget, free
    memory the pool may hold beyond the peak live bytes, as a fraction of them (at least
    2 MiB), before it reuses another stream's memory by waiting rather than growing
    (``None``: grow whenever no completed block fits, unless streams that have ended
    left that much free, which is then gathered). ``gather_interval`` (seconds,
    default 100 µs): at the budget the pool gathers free memory with a device
    synchronisation, which stops every thread short of memory meanwhile; within this long
    of the last gathering it grows past the budget instead, up to four times the budget's
    allowance (the peak live bytes plus the headroom) (0: gather at every shortage, the
    least memory; on the H200 at 16 threads, 1.7 times the peak live bytes at 3.5-5.5 M
    allocations/s against 3.9 times at 97-107 M/s with the default: benchmarks/RESULTS.md,
    "Commits 85cb897 and 8ba5d69"). ``expandable=True`` grows in place: the pool reserves one range of
    addresses and maps device memory at its end with the driver's virtual memory calls,
    so that new memory joins the free block before it and the pool holds less for the
    same live bytes (like PyTorch's ``expandable_segments``); the upstream must then be
    ``CudaMemoryResource`` or ``CudaAsyncMemoryResource`` (ValueError otherwise) and
    serves only what the range cannot. ``steal_whole_blocks=True``: a stream short of
    memory that takes another stream's completed free block takes all of it, not only what
    it asked for, so that memory moves between streams whole (on the H200 at 16 threads,
    window workload: 2.1-2.7 times the peak live bytes at 39-57 M allocations/s, against
    3.2-4.0 times at 82-140 M/s without; benchmarks/RESULTS.md, "Commit 84adecc"). All
    three, ``expandable=True, steal_whole_blocks=True, gather_interval=0``, hold the least
    on many threads: 1.5-1.6 times the peak live bytes at 4 and 16 threads, as little as
    the driver's pool or less (it held 1.60-2.05 and 1.63-1.69), at 6.4-7.1 M
    allocations/s on 16 threads (the driver's pool 0.11-0.13; benchmarks/RESULTS.md,
    "Commits d54cde1 and 939a767"). ``one_heap=True``: no shards; every free merges at once
    into one heap for every stream, and a stream handed memory that another stream freed
    waits on that free's event (``cuStreamWaitEvent``), as the driver's pool orders its
    reuse; with ``expandable=True`` the least memory on many threads, at a fraction of the
    default's speed (benchmarks/RESULTS.md); ValueError with ``release_threshold`` or
    ``steal_whole_blocks``. Shards of streams streampool made
    are retired when those streams are destroyed. A free must pass the size it allocated, as
    in RMM: a double free, an address the pool never handed out, or a size that does not
    round to the allocation's is always refused, and changes nothing. ValueError naming
    the argument for a ``maximum_pool_size`` below 256 bytes (the pool's granularity: sizes
    are rounded up to multiples of it, ``initial_pool_size`` and ``maximum_pool_size`` alike), a
    ``maximum_pool_size`` below ``initial_pool_size``, an ``events_every`` or ``event_batch``
    below 1, and a negative or non-finite ``headroom`` or ``gather_interval``.
    Requests from 4 KiB to 64 MiB are served rounded up to one of 16 sizes per power of two
    (at most 6.25 % more): one whose rounded size passes ``maximum_pool_size`` raises
    OutOfMemoryError naming the size to raise it to.

    Example::

        pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), maximum_pool_size="8GiB")
        streampool.set_current_device_resource(pool)
        compact = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), expandable=True)
        lean = mr.ShardedPoolMemoryResource(
            mr.CudaAsyncMemoryResource(), expandable=True, steal_whole_blocks=True, gather_interval=0
        )
        leanest = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), expandable=True, one_heap=True)
    """

    def __new__(
        cls,
        upstream_mr: _U,
        initial_pool_size: _Size | None = None,
        maximum_pool_size: _Size | None = None,
        release_threshold: _Size | None = None,
        events_every: SupportsIndex | None = 64,
        headroom: float | None = 0.15,
        gather_interval: float = 0.0001,
        event_batch: SupportsIndex | None = 1,
        expandable: bool = False,
        steal_whole_blocks: bool = False,
        one_heap: bool = False,
    ) -> Self: ...
    def pool_size(self) -> int:
        """Bytes the pool holds from its upstream (RMM's ``pool_size()``)."""
    @property
    def stats(self) -> _PoolStats:
        """What the pool holds and how often each step of its policy ran."""
    def release(self) -> int:
        """Gives back to the upstream every chunk that holds no live allocation: synchronises the device,
        gathers every free block and returns every entirely free chunk; returns the bytes
        released (afterwards the pool holds only the chunks live allocations lie in, and
        its footprint budget starts again from what is live). Over the device's default
        pool (``CudaAsyncMemoryResource()``), which keeps what is freed into it (release
        threshold at the maximum), warns (``UserWarning``) how much that pool still holds:
        ``upstream.trim_to(0)`` hands it to the system.

        Example::

            pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
            pool.deallocate(pool.allocate(1 << 20), 1 << 20)
            pool.release()
            pool.upstream.trim_to(0)   # and the device's pool gives it to the system
        """

@final
class ArenaMemoryResource(UpstreamResourceAdaptor[_U]):
    """RMM's ``ArenaMemoryResource`` (its arguments and shape), built on the sharded pool:
    one global reservation of ``arena_size`` bytes taken from ``upstream_mr`` up front (RMM's
    global arena) and free blocks kept per stream, the per-thread default stream per thread
    (RMM's per-thread and per-stream arenas).

    It is a ShardedPoolMemoryResource with ``initial_pool_size = maximum_pool_size =
    arena_size`` that keeps what it frees, not RMM's superblock algorithm; like the pool, it
    may give a wholly free reservation back and take it again when an allocation fails
    (a request larger than the arena fails at once, giving nothing back).
    ``arena_size=None``: half the device's free memory, as RMM; rounded down to 256 bytes
    (ValueError below 256). ``dump_log_on_failure=True``: a failed allocation writes the
    arena's state to the ``streampool`` logger (Python ``logging``, level ERROR) before
    OutOfMemoryError is raised.

    Example::

        arena = mr.ArenaMemoryResource(mr.CudaAsyncMemoryResource(), arena_size="4GiB")
        streampool.set_current_device_resource(arena)
    """

    def __new__(
        cls, upstream_mr: _U, arena_size: _Size | None = None, dump_log_on_failure: bool = False
    ) -> ArenaMemoryResource[_U]: ...
    def pool_size(self) -> int:
        """Bytes the arena holds from its upstream."""
    @property
    def stats(self) -> _PoolStats:
        """The pool's statistics, as :attr:`ShardedPoolMemoryResource.stats`."""
    def release(self) -> int:
        """Gives back every chunk that holds no live allocation, as :meth:`ShardedPoolMemoryResource.release`
        (returns the bytes released); afterwards the arena grows again on demand, up to
        ``arena_size``."""
    @property
    def arena_size(self) -> int:
        """The bytes of the global arena."""
    @property
    def dump_log_on_failure(self) -> bool:
        """Whether a failed allocation logs the arena's state."""

# --- Python functions as a resource -----------------------------------------------------

@final
class CallbackMemoryResource(MemoryResource):
    """Allocates and frees through two Python functions, as RMM's:
    ``allocate_func(size, stream) -> ptr`` and ``deallocate_func(ptr, size, stream)``, where
    ``stream`` is a :class:`Stream` (``DEFAULT_STREAM`` for the legacy default stream).
    Bound to ``device`` (the current device when None). For debugging and experiments:
    every call takes the GIL.

    The functions run on the calling thread with no lock of any resource held. An
    exception they raise reaches the caller of allocate/deallocate unchanged (a MemoryError
    from ``allocate_func`` is out of memory to the adaptors above: a
    FailureCallbackResourceAdaptor calls its callback; an exception of ``deallocate_func``
    when a buffer is collected goes to ``sys.unraisablehook`` and
    ``streampool.drop_errors()``); an
    allocate result that is not an int (or NumPy integer) raises TypeError there, one
    outside ``0..2**64`` ValueError, 0 for a non-empty request OutOfMemoryError, and an
    address that is not 256-byte aligned (as every resource's memory is) is given back to
    ``deallocate_func`` and refused with InvalidArgumentError (RMM takes it).
    TypeError when either is not callable.

    Example::

        base = mr.CudaAsyncMemoryResource()
        def allocate(size, stream):
            print(f"allocating {size} bytes")
            return base.allocate(size, stream)
        def deallocate(ptr, size, stream):
            base.deallocate(ptr, size, stream)
        streampool.set_current_device_resource(mr.CallbackMemoryResource(allocate, deallocate))
    """

    def __new__(
        cls,
        allocate_func: Callable[[int, Stream], int],
        deallocate_func: Callable[[int, int, Stream], object],
        *,
        device: int | None = None,
    ) -> CallbackMemoryResource: ...

# --- buffers ------------------------------------------------------------------------

_Advice: TypeAlias = Literal[
    "read_mostly",
    "unset_read_mostly",
    "preferred_location",
    "unset_preferred_location",
    "accessed_by",
    "unset_accessed_by",
]
"""What ``DeviceBuffer.advise`` takes (``CU_MEM_ADVISE_SET_READ_MOSTLY`` and the rest)."""

@type_check_only
class _CudaArrayInterface(TypedDict):
    shape: tuple[int]
    typestr: Literal["|u1"]
    data: tuple[int, Literal[False]]
    version: Literal[3]
    strides: None
    stream: int

@final
class DeviceBuffer:
    """Untyped memory of ``size`` bytes from ``mr`` (default: the current device's
    resource), ordered on ``stream`` (default: the legacy default stream).

    The memory may be used by work enqueued on ``stream`` after the buffer is made, and is
    freed on that stream when the buffer is collected or closed. A buffer made on the
    per-thread default stream stays ordered with the stream of the thread that made it:
    used, exported or collected on another thread (whose handle 2 names its own stream),
    its work, exports and free are ordered through the legacy default stream, which
    synchronises with every per-thread default stream. Exports: the CUDA array interface
    (v3) and DLPack (a 1-D uint8 tensor).

    A drop-in for ``rmm.DeviceBuffer`` (RMM's methods and argument names), except that
    ``stream=None`` means the legacy default stream when a buffer is made, and the
    buffer's own stream in its methods (RMM's methods default to its default stream). A
    method given another ``stream=`` enqueues its work there alone, as RMM's do: work
    still queued on the buffer's own stream is not waited for (order the streams first),
    except by ``resize``/``reserve``, which order both, and ``copy_from_device``, which
    orders the source's stream.

    ``__dlpack__(stream=s)`` orders ``s`` after the buffer's stream, and, when the consumer
    lets go of the tensor, the buffer's stream after ``s`` (its kernels may still be
    queued): the memory's free follows the consumer's work; the export keeps ``s``'s
    stream object alive until then (the object given, or, for a handle, CuPy's or
    PyTorch's current stream where it has that handle). ``stream=-1`` leaves both to
    the consumer. An export to the host (``dl_device=(1, 0)``) takes ``stream=None`` only,
    and waits.

    Freeing a buffer's memory by hand (``mr.deallocate(buf.ptr, buf.size)``) is refused
    with InvalidPointerError while the buffer is open and its address has been read from
    Python (``ptr``, ``__cuda_array_interface__`` or ``__dlpack__``, the ways Python code
    comes by it); the buffer stays usable. A hand free the binding cannot see (an address
    taken from ``repr``, or freed from C, or through another library) makes the buffer's own
    free a double free: where the resource tracks its allocations (the sharded pool, the
    tracking adaptor, the plain ``cuMemFree`` resource and the simulated device) it is
    refused, and ``close()`` raises it as InvalidPointerError while collection reports it
    through ``sys.unraisablehook`` (as Python reports an exception in ``__del__``), naming
    the pointer. Where the resource does not track (the driver's stream-ordered pool on a
    real GPU) it is not detected, and memory handed out after the hand free may alias the
    buffer's until then: never free a buffer's pointer by hand.

    On the simulated device, ``ptr`` is a host address, useless to real GPU libraries.
    Once that device has been exited the buffer is ``closed``: ``ptr`` and the exports
    raise, since the memory went with the device.

    Example::

        buf = streampool.DeviceBuffer(size=1 << 20)  # from the current device's resource
        buf.copy_from_host(bytes(range(256)) * 4096)
        print(list(buf.tobytes()[:4]))  # [0, 1, 2, 3]
        copy = buf.copy()  # another buffer, its own memory
    """

    def __new__(
        cls,
        size: _Size | None = 0,
        stream: _StreamLike = None,
        mr: MemoryResource | None = None,
        *,
        ptr: int | None = None,
    ) -> DeviceBuffer:
        """With ``ptr``, the new buffer holds a copy of the ``size`` bytes at ``ptr`` (device,
        managed or pinned memory), enqueued on ``stream``; on the legacy default stream the
        copy is also waited for (as RMM does), on any other it is not, and the caller orders
        the source's writers before it and keeps the source alive until it has run.
        ``ptr=0`` (RMM's default) copies nothing: the memory is left as allocated.
        ValueError for a negative ``ptr``; TypeError for a ``ptr`` that is not an int."""
    @property
    def ptr(self) -> int:
        """The device address (0 for an empty buffer). ValueError once closed. It changes
        when ``resize`` or ``reserve`` moves the contents."""
    @property
    def size(self) -> int:
        """The size in bytes."""
    @property
    def nbytes(self) -> int:
        """The size in bytes (same as ``size``)."""
    def capacity(self) -> int:
        """The bytes allocated: at least ``size`` (``reserve`` and a shrinking ``resize``
        leave room). ValueError once closed."""
    @property
    def stream(self) -> Any:
        """The stream the buffer was made on, as given (DEFAULT_STREAM when none was); the
        buffer keeps it alive."""
    @property
    def mr(self) -> MemoryResource:
        """The resource the memory came from."""
    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called, or once the simulated device the buffer
        was made on has been exited (the buffer can no longer be used)."""
    def __len__(self) -> int: ...
    def __sizeof__(self) -> int:
        """``size``, as RMM reports it (the device memory, not the host object)."""
    def __bytes__(self) -> bytes:
        """``tobytes()``."""
    @property
    def __cuda_array_interface__(self) -> _CudaArrayInterface:
        """The CUDA array interface, version 3: ``size`` uint8 values, with the stream the
        data is ordered on (1: the legacy default stream, 2: the per-thread default stream,
        else the handle). A buffer made on the per-thread default stream reports 2 on the
        thread that made it and 1 on any other."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(device_type, device_id)``: kDLCUDA (2) for device memory, kDLCUDAManaged (13)
        for managed memory, kDLCUDAHost (3) for pinned host memory."""
    def __dlpack__(
        self,
        *,
        stream: int | Any | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> CapsuleType:
        """A DLPack capsule of the buffer (its ``size`` bytes) as a 1-D uint8 tensor:
        ``"dltensor_versioned"`` (DLPack 1.1) when ``max_version >= (1, 0)``, a legacy
        ``"dltensor"`` otherwise. The tensor keeps the buffer's current memory alive until
        the consumer deletes it (also across a ``resize`` that moves the buffer).

        ``stream`` is the consumer's (DLPack's convention): -1 no synchronisation, 1 the
        legacy default stream, 2 the per-thread default stream, else a stream handle or
        object, made to wait for the buffer's stream; 0 is refused (ambiguous). None means
        the legacy default stream, and for managed or pinned memory the host waits for the
        buffer's stream too (a consumer that names no stream, as numpy, may read on the
        host). When the consumer deletes the tensor, the buffer's stream waits for the
        consumer's (not for -1), so that the memory's free follows the consumer's work.
        ``dl_device=(1, 0)`` (the CPU) is accepted for managed and pinned memory, with
        ``stream=None`` only. Raises BufferError naming the fix for device memory asked for
        on the CPU, for a stream given with the CPU or as a bool, for a consumer
        (``dl_device`` or stream) on another device, and for ``copy=True``; ValueError for a
        negative ``max_version``."""
    @overload
    def copy_to_host(self, ary: None = None, stream: _StreamLike = None) -> Any:
        """Copies the buffer to the host and waits for the copy (GIL released). Without
        ``ary``, returns a new numpy uint8 array (a bytearray when numpy is not installed);
        with ``ary`` (a writable, C-contiguous buffer of at least ``size`` bytes), fills and
        returns it. ``stream``: where the copy is ordered (default: the buffer's own
        stream)."""
    @overload
    def copy_to_host(self, ary: _B, stream: _StreamLike = None) -> _B: ...
    def copy_from_host(self, ary: _HostBuffer, stream: _StreamLike = None) -> None:
        """Copies a host buffer of at most ``size`` bytes to the start of the buffer and
        waits for the copy (GIL released). ``stream`` defaults to the buffer's own."""
    def copy_from_device(self, cuda_ary: Any, stream: _StreamLike = None) -> None:
        """Copies device memory to the start of the buffer, enqueued on ``stream`` (default:
        the buffer's own) and not waited for. ``cuda_ary`` is another DeviceBuffer or any
        object with a C-contiguous ``__cuda_array_interface__`` of at most ``size`` bytes
        (TypeError for anything else, ValueError for a larger, strided, masked or null
        source). When the source names a stream (a buffer's own, or the interface's v3
        ``stream``) other than the copy's, the copy waits for the work enqueued there and
        that stream waits for the copy, so the source's owner may reuse it in its own
        stream order. The buffer's own stream is not ordered after a copy on another
        ``stream``: order it (``buf.stream.wait_stream(stream)``, or synchronise ``stream``)
        before the buffer is used there or freed, which happens on its own stream. A
        DeviceBuffer of another device is copied between the devices
        (``cuMemcpyPeerAsync``, which needs no peer access)."""
    def tobytes(self, stream: _StreamLike = None) -> bytes:
        """The contents as bytes (a host copy, waited for), ordered on ``stream`` (default:
        the buffer's own)."""
    @staticmethod
    def to_device(
        b: _HostBuffer, stream: _StreamLike = None, mr: MemoryResource | None = None
    ) -> DeviceBuffer:
        """A new buffer holding a copy of ``b``."""
    def copy_to_device(
        self, device: int, stream: _StreamLike = None, mr: MemoryResource | None = None
    ) -> DeviceBuffer:
        """A new buffer on ``device`` holding a copy of this one: allocated from ``mr``
        (default: that device's current resource) on ``stream`` (a stream of that device;
        default: its legacy default stream), filled by a copy between the devices
        (``cuMemcpyPeerAsync``, which needs no peer access) enqueued there and not waited
        for. The copy is ordered after this buffer's stream, and this buffer's stream after
        the copy. ValueError when ``mr`` belongs to another device; InvalidStreamError when
        ``stream`` does."""
    @property
    def device(self) -> int:
        """The device ordinal the memory belongs to (its resource's device)."""
    def copy(self) -> DeviceBuffer:
        """A deep copy: a new buffer of ``size`` bytes from the same resource, on the same
        stream, filled by a copy enqueued on that stream (not waited for)."""
    def __copy__(self) -> DeviceBuffer:
        """``copy()``."""
    def __deepcopy__(self, memo: Any) -> DeviceBuffer:
        """``copy()``."""
    def resize(self, new_size: _Size, stream: _StreamLike = None) -> None:
        """Sets the size. Within ``capacity()`` nothing moves (growing exposes bytes of
        unspecified value); beyond it the contents move to a new allocation of
        ``new_size`` bytes on the buffer's stream, copied on ``stream`` (default: the
        buffer's own; another stream waits for the buffer's, and the buffer's for the
        copy), the old memory is freed on the buffer's stream, and ``ptr`` changes
        (addresses read before are stale). The buffer keeps its stream, unlike RMM's."""
    def reserve(self, new_capacity: _Size, stream: _StreamLike = None) -> None:
        """Makes ``capacity()`` at least ``new_capacity``, keeping the size and contents;
        when it grows, the contents move as in ``resize``."""
    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        """Pickles through a host copy; unpickling allocates from the current resource."""
    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, tuple[bytes | pickle.PickleBuffer]]:
        """As ``__reduce__``; with protocol 5 or later the host copy is a
        ``pickle.PickleBuffer``, which ``pickle.dumps(..., buffer_callback=...)`` can take
        out of band."""
    def prefetch(self, device: int | Literal["host"] | None = None, stream: _StreamLike = None) -> None:
        """Prefetches managed memory to ``device`` (a device ordinal, ``"host"`` or -1, CUDA's
        ``cudaCpuDeviceId``, or None for the device of the buffer's resource), in order on ``stream`` (default: the
        buffer's own stream; a stream of any device will do, such as that of the device that
        will read the pages). Returns at once (GIL released). Memory that is not managed
        has nothing to move: the arguments are checked and nothing else happens (as RMM's).
        ValueError once closed."""
    def advise(self, advice: _Advice, device: int | Literal["host"] | None = None) -> None:
        """Advises the driver how the memory (managed memory only) will be used, for
        ``device`` (a device ordinal, ``"host"`` or -1, or None for the buffer's device; ignored,
        as the driver ignores it, by the read-mostly pair and ``"unset_preferred_location"``). ValueError for an unknown advice or once closed;
        InvalidArgumentError naming the resource when the memory is not managed;
        UnsupportedError for memory of CudaAsyncManagedMemoryResource, on which the driver
        takes no advice (ManagedMemoryResource's memory takes it)."""
    @property
    def last_prefetch_location(self) -> int | Literal["host"] | None:
        """Where the whole buffer (managed memory only) was last asked to be prefetched: a
        device ordinal, ``"host"``, or None when never (or its parts went to different
        places). The request, not whether the pages have arrived."""
    def close(self) -> None:
        """Frees the memory now, on its stream; later use raises ValueError and closing
        again does nothing. Memory still used by a DLPack consumer is freed when that
        consumer is done. When the free fails (a ``CallbackMemoryResource`` whose function
        raised, say), the buffer stays open and closing it again tries again; memory the
        resource refuses as not its own (freed by hand: InvalidPointerError) is let go of."""
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> Literal[False]:
        """Closes the buffer; exceptions propagate."""

def _rebuild_device_buffer(data: Buffer) -> DeviceBuffer:
    """Unpickles a DeviceBuffer: a copy of ``data`` from the current resource."""

# --- sharing a buffer with another process (streampool.ipc) -------------------------

def _ipc_export(buffer: DeviceBuffer) -> tuple[int, bytes, int, int, int]:
    """Exports ``buffer``'s memory after synchronising the stream it was made on:
    ``(fd, export_data, nbytes, device, pid)``; the caller owns ``fd``. Use
    ``streampool.ipc.export``."""

@final
class IpcImportedMemoryResource(MemoryResource):
    """The memory another process exported, imported into this one: the resource behind
    ``streampool.ipc.import_buffer``'s buffer. It hands out that one buffer and cannot
    allocate otherwise; the buffer frees the import (``cuMemFree``) when closed or
    collected, and the imported pool goes with the resource."""

    def __new__(
        cls, fd: int, export_data: bytes, nbytes: _Size, pid: int, device: int
    ) -> IpcImportedMemoryResource: ...
    @property
    def ptr(self) -> int:
        """The imported memory's address in this process."""
    @property
    def nbytes(self) -> int:
        """Bytes imported."""

# --- the simulated device -----------------------------------------------------------

@final
class _SimDevice:
    """A simulated device (wrapped by ``streampool.sim.SimulatedDevice``): host memory
    standing in for device memory, streams as queues that run only when told, and a
    happens-before race detector. Its pointers are host addresses, useless to real GPU
    libraries."""

    def __new__(cls, capacity_bytes: _Size | None = None, devices: SupportsIndex = 1) -> _SimDevice:
        """``capacity_bytes``: device memory of each device (None: what the host can give
        this process now, at most 16 GiB); ``devices``: how many, 1 to 1024 (ValueError
        naming the value otherwise)."""
    def activate(self) -> None:
        """Makes this device what new objects run on. SimulatedDeviceActiveError when a
        simulated device is already active; ValueError when this one is closed."""
    def deactivate(self) -> None:
        """Stops this device being active and closes it (idempotent)."""
    @property
    def active(self) -> bool:
        """True while this device is the active one."""
    @property
    def closed(self) -> bool:
        """True once deactivated."""
    def write(self, stream: _StreamLike, ptr: int, nbytes: _Size, label: str | None = None) -> None:
        """Enqueues a simulated kernel writing ``[ptr, ptr + nbytes)`` on ``stream``."""
    def read(self, stream: _StreamLike, ptr: int, nbytes: _Size, label: str | None = None) -> None:
        """Enqueues a simulated kernel reading ``[ptr, ptr + nbytes)`` on ``stream``."""
    def step(self, stream: _StreamLike) -> bool:
        """Runs the head of ``stream``'s queue if it may run now."""
    def step_any(self) -> bool:
        """Runs one operation that may run now; False when none can."""
    def run(self) -> None:
        """Runs everything queued until no stream has work; Ctrl-C stops it between two operations."""
    @property
    def pending(self) -> int:
        """Operations queued on all streams and not yet run."""
    def queued(self, stream: _StreamLike) -> int:
        """Operations queued on ``stream`` and not yet run."""
    def begin_capture(self, stream: _StreamLike) -> None:
        """Begins capturing a CUDA graph on ``stream`` (global mode)."""
    def end_capture(self, stream: _StreamLike) -> None:
        """Ends ``stream``'s capture; raises when it was invalidated."""
    def races(self) -> list[str]:
        """The races found so far, as sentences naming both operations."""
    def race_records(self) -> list[tuple[str, str, bool, str, bool, int, int]]:
        """The races as ``(text, earlier, earlier_writes, later, later_writes, start, end)``."""
    def clear_races(self) -> None:
        """Forgets the races found so far."""
    @property
    def races_dropped(self) -> int:
        """Races found beyond the number kept."""
    @property
    def ran_early(self) -> int:
        """Operations run early because too much work waited unrun (more than 65,536
        operations, or their clocks over two million entries, never synchronised)."""
    @property
    def capacity_bytes(self) -> int:
        """Device memory of each simulated device, in bytes."""
    def set_driver_version(self, version: int) -> None:
        """Makes the device report driver ``version`` from now on; below 13000 it has no
        managed pools."""
    def set_concurrent_managed_access(self, enabled: bool) -> None:
        """Makes the device report (or not) concurrent managed access from now on; without
        it there are no managed pools, and prefetches and advice naming a GPU (as preferred
        location or as accessed by) are refused, as the driver refuses them (Windows, WSL, some Jetson boards)."""
    def set_peer_capable(self, a: int, b: int, capable: bool) -> None:
        """Makes devices ``a`` and ``b`` able (or not) to reach each other's memory."""
    def describe(self) -> str:
        """E.g. ``"simulated device #3 (16 GiB)"``."""

# --- module functions ---------------------------------------------------------------

@type_check_only
class _DeviceInfo(TypedDict):
    device: int
    name: str
    total_bytes: int
    memory_pools: bool
    managed_pools: bool
    concurrent_managed_access: bool
    posix_fd_ipc: bool

def parse_size(size: _Size) -> int:
    """Parses a byte size: ``"4096"``, ``"512MiB"``, ``"1.5 GiB"``.

    Binary units (powers of 1024): KiB, MiB, GiB, TiB, PiB, EiB, and the bare letters K, M,
    G, T, P, E, which mean the same: ``"1G"`` and ``"1GiB"`` are both 2**30 bytes. Decimal
    units (powers of 1000): kB, MB, GB, TB, PB, EB: ``"1GB"`` is 10**9 bytes. Units are
    case-insensitive. A fraction of a byte is dropped (``"1.5"`` is 1), as RMM's
    ``parse_bytes`` does. An int is returned as it is. ValueError for a negative,
    unparsable or too large size.

    Example::

        print(streampool.parse_size("1.5 GiB"))  # 1610612736
        print(streampool.parse_size("1GB"))  # 1000000000
    """

def backend_description() -> str:
    """What new objects run on, e.g. ``"CUDA driver 13.0"``. CudaDriverNotFoundError when
    there is no driver and no simulated device."""

def driver_version() -> int:
    """The driver's version (``cuDriverGetVersion``), e.g. 13000."""

def device_count() -> int:
    """The number of devices of the current backend."""

def device_info(device: int | None = None) -> _DeviceInfo:
    """What a device (default: the current one) can do."""

def using_simulated_device() -> bool:
    """True when new objects run on a simulated device (one is active, or STREAMPOOL_DEVICE=sim)."""

def device_can_access_peer(device: int, peer: int) -> bool:
    """Whether work on ``device`` can access memory of ``peer`` directly
    (``cuDeviceCanAccessPeer``; False for ``device == peer``)."""

def enable_peer_access(device: int, peer: int) -> None:
    """Lets work on ``device`` access memory that ``peer`` allocated with ``cudaMalloc``
    (``CudaMemoryResource``): ``cuCtxEnablePeerAccess`` between their primary contexts.
    Pool memory does not follow it: grant that with ``CudaAsyncMemoryResource(peer_access=
    [...])``. Enabling it again does nothing; InvalidArgumentError naming both devices when
    they cannot reach each other or are the same device."""

def pointer_pool(ptr: int, device: int | None = None) -> int | None:
    """The driver pool (``CUmemoryPool`` as an int) that ``ptr`` came from, or None for memory
    not from a pool (``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)``). Any
    library's pointer may be asked: memory of PyTorch's ``cudaMallocAsync`` backend, of
    CuPy's ``MemoryAsyncPool`` and of the default ``CudaAsyncMemoryResource`` all report the
    device's current pool, which equals ``get_current_device_resource().pool_handle``."""

def drop_errors() -> tuple[int, list[str]]:
    """Failures that happened where nobody could be told (freeing memory or destroying a
    stream or event when its last reference went away, a resource giving its memory back,
    clean-up after another error): ``(count since the process started, the most recent
    messages, oldest first)``. Some are expected at interpreter exit."""

@final
class CupyAllocator:
    """CuPy's allocator function (``streampool.allocators.cupy.streampool_cupy_allocator``):
    ``allocator(nbytes)`` allocates on CuPy's current stream through the current resource of
    the current device and returns a ``cupy.cuda.MemoryPointer`` whose memory is freed, when
    CuPy lets go of it, through the resource that made it, on the stream it was allocated
    on (on CuPy's current stream of the releasing thread once CuPy has destroyed that one;
    always on an ``ExternalStream``'s, whose stream CuPy never destroys; on the legacy
    default stream for memory of another thread's per-thread default stream). Made from
    CuPy's ``UnownedMemory``, ``MemoryPointer`` and ``get_current_stream``, the capsule of
    ``cupy.cuda.stream.get_current_stream_ptr`` (None: the stream is read through
    ``get_current_stream``), ``cupy.cuda.ExternalStream``, and the class out of memory
    raises (a subclass of ``OutOfMemoryError``, made with its arguments; None: that class).
    A capsule of another signature, or another class, raises TypeError."""

    def __new__(
        cls,
        unowned_memory: Any,
        memory_pointer: Any,
        get_current_stream: Any,
        stream_capsule: Any = None,
        external_stream: Any = None,
        out_of_memory: type[OutOfMemoryError] | None = None,
    ) -> Self: ...
    @property
    def native_stream_lookup(self) -> bool:
        """Whether CuPy's current stream is read through its C function (the fast way)."""
    def __call__(self, nbytes: int) -> Any: ...

@final
class CupyMemory:
    """The owner of one allocation made by a ``CupyAllocator``: frees it when CuPy lets go."""

def _torch_memory_stats(
    device: int,
) -> tuple[list[int], list[int], int, tuple[int, int] | None]:
    """What PyTorch allocated through ``streampool_alloc_cxx`` and freed through
    ``streampool_free_cxx`` on ``device``: ``(bytes, allocations, out-of-memory failures,
    reserved)``, each stat ``[current, peak, allocated, freed]``, ``reserved`` the device's
    current resource's ``(reserved bytes, their peak)`` where it reports them."""

def _torch_reset_memory_stats(device: int, peak: bool) -> None:
    """PyTorch's resets of those statistics: with ``peak``, the peaks to what is current
    (the current resource's peak of reserved bytes too); otherwise the totals to 0."""

def _use_torch_out_of_memory() -> bool:
    """From now on, ``streampool_alloc_cxx`` out of memory throws PyTorch's
    ``c10::OutOfMemoryError`` (``torch.OutOfMemoryError`` in Python), made from the PyTorch
    libraries this process has loaded; False where it cannot, and the exception stays a
    ``std::bad_alloc``. Looked for once per process."""

def _capi_last_error() -> tuple[int, str | None]:
    """``(failures so far, the most recent failure's message)`` of the exported C entry
    points ``streampool_alloc``/``streampool_free``, from any thread (what
    ``streampool.allocators.last_error()`` reads)."""

def _capture_hook_calls() -> tuple[int, int]:
    """``(begins, ends)`` of CUDA graph captures announced on the calling thread so far
    (``streampool_capture_begin``/``streampool_capture_end``): compared around PyTorch's
    capture calls, they tell whether a call that failed reached its hook."""

def _capture_hooks_open_a_region(on: bool) -> None:
    """While ``on``, the CUDA graph capture hooks called on this thread announce nothing:
    set around PyTorch's calls that open and close a ``torch.cuda.use_mem_pool`` region,
    which calls the same hooks as a capture."""

def _fast_path_calls() -> int:
    """Calls settled on the fast path (with the GIL kept) so far, wrapping at 2**32: for
    tests."""

# The harness's native parts ----------------------------------------------------------

def _kernel_fill(
    ptr: int, size: _Size, seed: int, stream: _StreamLike = None, device: int | None = None
) -> None:
    """Enqueues the fill kernel (use ``streampool.kernels.fill``)."""

def _kernel_check(
    ptr: int, size: _Size, seed: int, stream: _StreamLike = None, device: int | None = None
) -> int:
    """Runs the check kernel and synchronises the stream, also below 8 bytes where no kernel
    runs (use ``streampool.kernels.check``)."""

def _kernel_compute(
    ptr: int,
    size: _Size,
    iterations: int,
    stream: _StreamLike = None,
    device: int | None = None,
) -> None:
    """Enqueues the compute kernel (use ``streampool.kernels.compute``)."""

@type_check_only
class LatencyPercentiles(TypedDict):
    """Per-call latency in nanoseconds (nearest rank) of ``count`` calls."""

    count: int
    p50: int
    p90: int
    p99: int
    p999: int
    max: int

@type_check_only
class ReplayReport(TypedDict):
    resource: str
    device: str
    simulated: bool
    events: int
    threads: int
    streams: int
    seconds: float
    alloc_seconds: float
    allocate_ns: LatencyPercentiles
    free_ns: LatencyPercentiles
    peak_live_bytes: int
    peak_reserved_bytes: int | None
    oom_events: int
    synchronizations: int | None
    waits: int | None

def replay(
    resource: MemoryResource, records: bytes, *, gap_scale: float = 1.0, max_lead: float | None = 0.001
) -> ReplayReport:
    """Replays an allocation log on ``resource`` from native threads, with the GIL released.

    ``records``: packed little-endian 40-byte records, ``struct.Struct("<QQQIIB7x")`` =
    ``(t_ns, size, alloc_id, thread, stream, op)``, op 0 = allocate, 1 = free, in recorded
    order. ``thread`` and ``stream`` are labels: one native thread per recorded thread, one
    new (non-blocking) stream per recorded stream. Each thread replays its events in
    recorded order, waiting the recorded gaps times ``gap_scale`` (0: as fast as possible),
    from the earliest recorded time. No thread runs more than ``max_lead`` seconds of
    recorded time ahead of another (default 1 ms; None: no bound): before an event
    recorded at ``t``, a thread waits until every other has done its events recorded
    before ``t - max_lead``. The program's queues and locks are not in the log; that keeps
    the order they gave across threads, so that a producer does not run ahead of its
    consumer and hold more memory live than the program had. Ctrl-C stops it within 50 ms (what it holds is freed,
    and KeyboardInterrupt raised). A free of another thread's allocation waits until it exists, and when its stream
    differs, waits on an event recorded after the allocation (as a real program orders a
    hand-off). An allocation that runs out of memory is counted (``oom_events``) and
    skipped with its free; allocations the log never frees are freed after the run.

    Returns: ``events``, ``seconds`` (wall), ``alloc_seconds`` (inside allocator calls, all
    threads), ``allocate_ns``/``free_ns`` percentiles, ``peak_live_bytes`` (the most
    live at once during the replay, over every thread), ``peak_reserved_bytes`` (where the resource, or the pool beneath its adaptors,
    reports it: the sharded pool, the driver's pool; else None), ``synchronizations`` and
    ``waits`` the resource made during the run (the sharded pool; else None), ``simulated``.

    Raises InvalidArgumentError, naming the record, for a length that is not a multiple of
    40, an unknown op, a free of an id that is not live, an id allocated twice while live,
    a free whose size differs from the allocation's, a negative ``gap_scale``, or gaps
    that ``gap_scale`` would stretch past ``MAX_LOG_TIME_S`` seconds; ValueError for a
    negative or NaN ``max_lead``.

    Example::

        import struct, streampool
        rec = struct.Struct("<QQQIIB7x")
        log = rec.pack(0, 1024, 1, 0, 0, 0) + rec.pack(5000, 1024, 1, 0, 0, 1)
        report = streampool._native.replay(streampool.mr.CudaAsyncMemoryResource(), log, gap_scale=0)
        print(report["allocate_ns"]["p50"])
    """

@type_check_only
class _DriverCalls(TypedDict):
    """The driver calls a resource made of its own over a run, by kind (the sharded pool
    counts them; other resources report None)."""

    event_records: int
    event_queries: int
    stream_waits: int
    synchronizations: int
    growths: int
    total: int

@type_check_only
class _Sampled(TypedDict):
    """What long calls' threads were doing when a watchdog looked, once per call past the
    threshold (``/proc/self/task/TID/syscall``; Linux): running, or in which system call
    (``futex``: a lock or a condition; ``ioctl``: a driver call in the kernel)."""

    running: int
    futex: int
    ioctl: int
    sched_yield: int
    sleep: int
    other: int

@type_check_only
class _RunningIn(TypedDict):
    """Where the watchdog found the running threads of ``_Sampled``: the library holding the
    instruction a signal interrupted (``driver``: libcuda; ``streampool``: its own code;
    ``system``: the C library or the loader; ``other``; ``ended``: the call had ended by the
    answer; ``unanswered``: no answer within 2 ms, or a platform other than Linux on x86-64
    and AArch64)."""

    driver: int
    streampool: int
    system: int
    other: int
    ended: int
    unanswered: int

@type_check_only
class _CallClasses(TypedDict):
    """The calls over ``over_ns`` (``longest_ns``: the longest), by what the calling thread
    did meanwhile (its context switches and its CPU clock; Linux): ``preempted`` (the operating system switched it out
    while it could run), ``slept`` (it waited: a lock, a condition, the driver), ``stolen``
    (neither, yet its CPU clock ran for less than half the call: the host took the virtual
    CPU, or interrupts took the time), ``on_cpu`` (the rest: the call's own work, a
    spinning wait included)."""

    over_ns: int
    calls: int
    longest_ns: int
    preempted: int
    slept: int
    stolen: int
    on_cpu: int

@type_check_only
class _LongCalls(_CallClasses):
    """The allocator calls over ``over_ns`` (``_CallClasses``), with ``sampled`` and
    ``running_in``: what a watchdog saw their threads doing."""

    sampled: _Sampled
    running_in: _RunningIn

@type_check_only
class PipelineReport(TypedDict):
    resource: str
    device: str
    simulated: bool
    pairs: int
    chunk_bytes: int
    chunks: int
    seconds: float
    chunks_per_second: float
    alloc_seconds: float
    alloc_share: float
    allocate_ns: LatencyPercentiles
    free_ns: LatencyPercentiles
    longest_call_ns: int
    peak_live_bytes: int
    peak_reserved_bytes: int | None
    synchronizations: int | None
    waits: int | None
    driver_calls: _DriverCalls | None
    driver_calls_per_chunk: float | None
    checked: int
    mismatches: int
    compute_iterations: int
    long_calls: NotRequired[_LongCalls]
    null_calls: NotRequired[_CallClasses]

def pipeline(
    resource: MemoryResource,
    *,
    pairs: int | None = 1,
    chunk_bytes: _Size | None = None,
    chunks_per_pair: int | None = 1000,
    kernel_us: float = 20.0,
    queue_depth: int | None = 4,
    check_every: int | None = 1,
    long_call_us: float = 0.0,
    null_call_us: float = 0.0,
) -> PipelineReport:
    """The producer/consumer pipeline across streams, driven from native threads with the
    GIL released: ``pairs`` producers, each on its own stream, allocate a chunk of
    ``chunk_bytes`` (default 1 MiB), fill it with a kernel, record an event and hand it to
    their consumer (at most ``queue_depth`` ahead); the consumer, on its own stream, waits
    on the event, runs the compute kernel (about ``kernel_us`` of kernel time, calibrated
    once; 0: none), checks every ``check_every``-th chunk (0: never; the check synchronises
    the consumer's stream) and frees the chunk on its stream.

    Returns ``chunks_per_second``, ``alloc_share`` (host time inside allocator calls, all
    threads, against their wall time), ``longest_call_ns``, ``peak_reserved_bytes`` beside
    ``peak_live_bytes``, ``mismatches`` (must be 0), latency percentiles and the
    resource's ``synchronizations``/``waits``, and its own ``driver_calls`` by kind (event
    records and queries, stream waits, synchronisations, growths; None where it does not
    count them) with ``driver_calls_per_chunk``, their total per chunk. With ``long_call_us``
    above 0, ``long_calls`` classifies the calls longer than that (``_LongCalls``: was the
    thread switched out, asleep, or neither), from the thread's context switches read
    around every call (outside its timed span) and a watchdog thread's look at each long
    call's thread (``sampled``, ``running_in``). With ``null_call_us`` as well, every thread
    also times, after each allocator call, a span that only spins that long (a call of an
    allocator that does nothing); ``null_calls`` classifies those over ``long_call_us``
    the same way: what the machine alone gives a call of that length. Bad shapes
    (``pairs`` outside 1..=512, ``chunk_bytes`` < 8, ``queue_depth`` outside 1..=65536,
    ``chunks_per_pair`` above 2**32, ``kernel_us`` outside 0..=1000000, ``null_call_us``
    above 100 or without ``long_call_us``) raise
    InvalidArgumentError; a negative or infinite ``long_call_us`` or ``null_call_us``,
    ValueError.

    Example::

        pool = streampool.mr.ShardedPoolMemoryResource(streampool.mr.CudaAsyncMemoryResource())
        report = streampool._native.pipeline(pool, pairs=2, chunks_per_pair=100, kernel_us=0)
        print(report["mismatches"])  # 0
    """

@type_check_only
class LatencyHistogram(TypedDict):
    """One kind of call's latencies, in nanoseconds; percentiles are the upper bound of
    the bucket holding that rank (at most 25 % above), capped at ``max_ns``."""

    count: int
    total_ns: float
    max_ns: float
    p50_ns: float
    p90_ns: float
    p99_ns: float
    p999_ns: float
    buckets: list[tuple[float, int]]

@type_check_only
class LatencyHistograms(TypedDict):
    allocate: LatencyHistogram
    deallocate: LatencyHistogram

@final
class LatencyHistogramResourceAdaptor(UpstreamResourceAdaptor[_U]):
    """Records how long each allocate and deallocate call takes, in histograms of
    log-spaced buckets (4 per power of two), lock-free and cheap enough to leave on (two
    time-stamp counter reads and a few plain updates of the calling thread's own counters
    per call, no atomic read-modify-write; the fast path is forwarded and timed too). Also ``streampool.mr.LatencyHistogramAdaptor``.

    With ``STREAMPOOL_NVTX=1`` in the environment, each call is also an NVTX range
    ("streampool allocate", "streampool deallocate"), so an Nsight Systems timeline shows
    allocator time beside kernels; the NVTX library (``libnvToolsExt.so.1`` or
    ``libnvtx3interop.so``) is loaded at run time, and when none is found a warning is
    printed once and ranges stay off.

    Example::

        timed = mr.LatencyHistogramResourceAdaptor(mr.CudaAsyncMemoryResource())
        p = timed.allocate(1 << 20)
        timed.deallocate(p, 1 << 20)
        print(timed.histogram()["allocate"]["p99_ns"])
    """

    def __new__(cls, upstream_mr: _U) -> LatencyHistogramResourceAdaptor[_U]: ...
    def histogram(self) -> LatencyHistograms:
        """The histograms so far: ``{"allocate": {...}, "deallocate": {...}}``, each with
        ``count``, ``total_ns``, ``max_ns``, ``p50_ns``, ``p90_ns``, ``p99_ns``, ``p999_ns`` and
        ``buckets`` (non-empty ones: upper bound in ns, calls)."""
    def reset(self) -> None:
        """Forgets every call recorded so far (a call made at the same moment on another
        thread may be forgotten too)."""

@final
class _NullMemoryResource(MemoryResource):
    """For benchmarks only: a resource that hands out no memory. Every allocation gets a
    distinct address that must never be used (nothing is behind it), and frees do nothing;
    it measures what a workload costs around the allocator, e.g. the replayer's own time per
    event: ``replay(_NullMemoryResource(), log, gap_scale=0)["seconds"] / events``."""

    def __new__(cls, device: int | None = None) -> _NullMemoryResource: ...
