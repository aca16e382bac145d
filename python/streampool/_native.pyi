"""The native module of streampool (Rust, PyO3). Import from ``streampool`` and
``streampool.mr`` rather than from here; these stubs are written by hand and checked with
``python -m mypy.stubtest streampool._native``.

Importing never touches the CUDA driver. Every call that can block (a driver call, a
device wait, a resource's lock) releases the GIL.
"""

import os
from collections.abc import Callable
from types import TracebackType
from typing import (
    Any,
    ClassVar,
    Final,
    Literal,
    Protocol,
    Self,
    SupportsIndex,
    TypeAlias,
    TypedDict,
    TypeVar,
    final,
    type_check_only,
)

from typing_extensions import Buffer, CapsuleType, disjoint_base

from streampool.statistics import Statistics

__all__ = [
    "DEFAULT_STREAM",
    "LEGACY_DEFAULT_STREAM",
    "LOG_HEADER",
    "PER_THREAD_DEFAULT_STREAM",
    "AllocationRecord",
    "BinningMemoryResource",
    "CudaAsyncManagedMemoryResource",
    "CudaAsyncMemoryResource",
    "CudaAsyncViewMemoryResource",
    "CudaMemoryResource",
    "DeviceBuffer",
    "FailureCallbackResourceAdaptor",
    "FixedSizeMemoryResource",
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
    "_SimDevice",
    "__version__",
    "_parse_log",
    "_rebuild_device_buffer",
    "backend_description",
    "device_count",
    "device_info",
    "driver_version",
    "get_current_device",
    "get_current_device_resource",
    "get_per_device_resource",
    "parse_size",
    "pointer_pool",
    "set_current_device_resource",
    "set_per_device_resource",
    "using_simulated_device",
]

__version__: Final[str]

_Size: TypeAlias = SupportsIndex | str
_B = TypeVar("_B", bound=Buffer)

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
    device). It is non-blocking unless ``blocking``: it does not synchronise with the
    legacy default stream. It is destroyed when the last reference to it goes away
    (buffers made on it keep it alive).

    Streams compare equal when they are the same stream of the same backend.
    """

    def __new__(cls, device: int | None = None, blocking: bool = False) -> Stream: ...
    @property
    def handle(self) -> int:
        """The driver's handle as an int: 0 for the legacy default stream, 2 for the
        per-thread default stream."""
    @property
    def device(self) -> int | None:
        """The device the stream belongs to; None for the default streams, which exist on
        every device."""
    def synchronize(self) -> None:
        """Waits until all work enqueued on the stream has completed (GIL released)."""
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
        can tell the pointer or size is wrong."""
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
    maximum). With ``initial_pool_size``, ``release_threshold`` or ``enable_ipc`` it
    creates a pool of its own, destroyed with the resource.
    """

    def __new__(
        cls,
        initial_pool_size: _Size | None = None,
        release_threshold: _Size | None = None,
        enable_ipc: bool = False,
        device: int | None = None,
    ) -> CudaAsyncMemoryResource: ...
    @property
    def pool_handle(self) -> int:
        """The driver pool handle (``CUmemoryPool`` as an int)."""
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
    def trim_to(self, nbytes: _Size) -> None:
        """Releases free memory to the system until the pool holds at most ``nbytes``."""

@final
class CudaAsyncManagedMemoryResource(MemoryResource):
    """The CUDA 13 driver's stream-ordered pool of managed memory, for work larger than the
    GPU: memory usable from host and device, handed out in stream order, that
    ``DeviceBuffer.prefetch`` and ``DeviceBuffer.advise`` accept.

    With no options it uses the device's current managed pool (the default managed pool's
    release threshold is raised to the maximum; a pool someone else set is left alone).
    With ``initial_pool_size`` or ``release_threshold`` it creates a managed pool of its
    own, destroyed with the resource. Needs a CUDA 13 driver and a GPU with concurrent
    managed access: UnsupportedError, saying which is missing, otherwise (use
    ManagedMemoryResource there). Keep managed allocations well below the GPU's free
    memory unless the work needs to oversubscribe it.
    """

    def __new__(
        cls,
        initial_pool_size: _Size | None = None,
        release_threshold: _Size | None = None,
        device: int | None = None,
    ) -> CudaAsyncManagedMemoryResource: ...
    @property
    def pool_handle(self) -> int:
        """The driver pool handle (``CUmemoryPool`` as an int)."""
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
    def trim_to(self, nbytes: _Size) -> None:
        """Releases free memory to the system until the pool holds at most ``nbytes``."""

@final
class CudaAsyncViewMemoryResource(MemoryResource):
    """Allocates from a driver pool someone else owns (PyTorch's, CuPy's) and never
    destroys it: the owner must outlive the view. A handle that is not a pool raises
    ValueError."""

    def __new__(cls, pool_handle: int, device: int | None = None) -> CudaAsyncViewMemoryResource: ...
    @property
    def pool_handle(self) -> int:
        """The driver pool handle this resource allocates from."""
    @property
    def owns_pool(self) -> Literal[False]:
        """Always False: a view never destroys the pool."""

@final
class CudaMemoryResource(MemoryResource):
    """Plain device memory (``cuMemAlloc``/``cuMemFree``); every free waits for the device."""

    def __new__(cls, device: int | None = None) -> CudaMemoryResource: ...

@final
class ManagedMemoryResource(MemoryResource):
    """Managed (unified) memory (``cuMemAllocManaged``), for work larger than device memory."""

    def __new__(cls, device: int | None = None) -> ManagedMemoryResource: ...

@final
class PinnedHostMemoryResource(MemoryResource):
    """Page-locked host memory (``cuMemHostAlloc``)."""

    def __new__(cls, device: int | None = None) -> PinnedHostMemoryResource: ...

def get_current_device_resource() -> MemoryResource:
    """The resource of the current device: a CudaAsyncMemoryResource until one is set.
    Under a simulated device, that device's resources."""

def set_current_device_resource(mr: MemoryResource) -> MemoryResource | None:
    """Makes ``mr`` the resource of the current device; returns the previous one (None only
    when there was none and the initial one cannot be made). ``mr`` must be bound to the
    current device of the current backend (ValueError otherwise)."""

def get_per_device_resource(device: int) -> MemoryResource:
    """The resource of ``device`` (ValueError when it does not exist)."""

def set_per_device_resource(device: int, mr: MemoryResource) -> MemoryResource | None:
    """Makes ``mr`` the resource of ``device``; returns the previous one. ``mr`` must be
    bound to that device of the current backend (ValueError otherwise)."""

def get_current_device() -> int:
    """The current device of the current backend."""

# --- adaptors -----------------------------------------------------------------------
# Python callbacks (failure callbacks, logging callbacks, stack capture) run on the thread
# that called allocate/deallocate, with the GIL re-taken and no lock of any resource held;
# an exception they raise reaches that caller unchanged.

@disjoint_base
class UpstreamResourceAdaptor(MemoryResource):
    """Base class of the resources that wrap another one (not constructible itself). Keeps
    the upstream alive, and shows it to the garbage collector: a reference cycle through
    an upstream (a callback that refers to a resource over its adaptor) is collected."""

    @property
    def upstream(self) -> MemoryResource:
        """The resource this one wraps, as it was given. ValueError once the garbage
        collector has cleared it (only code that runs while a cycle is collected, such
        as a finaliser, can see that)."""
    def get_upstream(self) -> MemoryResource:
        """The resource this one wraps (RMM's name; same as ``upstream``)."""

@final
class StatisticsResourceAdaptor(UpstreamResourceAdaptor):
    """Counts what passes through it: current, peak and total bytes and allocations, on a
    stack of counters (``push_counters``/``pop_counters``) for measuring code blocks, as
    RMM's. Counts allocations once their upstream call has returned; a scope that frees
    memory allocated before it began reports ``current`` as 0, not below."""

    def __new__(cls, upstream_mr: MemoryResource) -> StatisticsResourceAdaptor: ...
    @property
    def allocation_counts(self) -> Statistics:
        """The counters on top of the stack."""
    def push_counters(self) -> Statistics:
        """Pushes zeroed counters; returns the counters on top before the push."""
    def pop_counters(self) -> Statistics:
        """Pops the counters on top (adding them into the ones below) and returns them.
        ValueError (InvalidArgumentError) when only the base counters are left."""

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
class TrackingResourceAdaptor(UpstreamResourceAdaptor):
    """Tracks every outstanding allocation (address, size, stream, thread and, with
    ``capture_stacks``, the Python stack: slow, for finding leaks). A free of a pointer it
    did not hand out, a double free or a size that does not match raises
    InvalidPointerError, and the upstream is not called. Each allocation records the
    Python thread's name and ident (a call into Python per allocation)."""

    def __new__(
        cls, upstream_mr: MemoryResource, capture_stacks: bool = False
    ) -> TrackingResourceAdaptor: ...
    def get_allocated_bytes(self) -> int:
        """Bytes allocated through it and not yet freed."""
    def get_outstanding_allocations_str(self) -> str:
        """The leak report: a summary line, then one line per outstanding allocation
        (address, size, stream, thread), each followed by its stack when captured."""
    def log_outstanding_allocations(self) -> None:
        """Logs the leak report to the ``streampool`` logger (Python ``logging``) at WARNING
        level when anything is outstanding; does nothing otherwise."""
    def outstanding(self) -> list[AllocationRecord]:
        """The outstanding allocations, by address."""

LOG_HEADER: Final[str]
"""The first line of every allocation log: ``"Thread,Time,Action,Pointer,Size,Stream"``."""

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
class LoggingResourceAdaptor(UpstreamResourceAdaptor):
    """Logs every allocation, failed allocation and free as a CSV line in RMM's format
    (``LOG_HEADER``), to a file (flushed after every line) and/or to ``callback``, which
    is called with each line, without its newline.

    With neither ``log_file_name`` nor ``callback``, the file is ``STREAMPOOL_LOG_FILE``,
    else ``RMM_LOG_FILE``; ValueError when neither is set. Unlike RMM, no ``.dev<N>``
    suffix is added to the name. An exception raised by ``callback`` reaches the caller
    of allocate/deallocate; the adaptor stays usable. A log file that cannot be created
    raises OSError (FileNotFoundError, PermissionError, ...) naming it, at construction;
    one that cannot be written later raises it from allocate/deallocate."""

    def __new__(
        cls,
        upstream_mr: MemoryResource,
        log_file_name: str | os.PathLike[str] | None = None,
        callback: Callable[[str], object] | None = None,
    ) -> LoggingResourceAdaptor: ...
    def flush(self) -> None:
        """Writes out anything buffered (lines are flushed as they are written)."""
    def get_file_name(self) -> str | None:
        """The absolute path of the log file; None when logging only to a callback."""

@final
class LimitingResourceAdaptor(UpstreamResourceAdaptor):
    """Refuses, with OutOfMemoryError, allocations that would take the bytes outstanding
    through it over ``allocation_limit`` (an int > 0, or a string such as ``"2GiB"``;
    ValueError otherwise). Holds under any number of threads."""

    def __new__(cls, upstream_mr: MemoryResource, allocation_limit: _Size) -> LimitingResourceAdaptor: ...
    def get_allocated_bytes(self) -> int:
        """Bytes allocated through it and not yet freed (as asked, with reservations of
        allocations in flight)."""
    def get_allocation_limit(self) -> int:
        """The limit, in bytes."""

@final
class FailureCallbackResourceAdaptor(UpstreamResourceAdaptor):
    """Calls ``callback(nbytes)`` when the upstream runs out of memory: True retries the
    allocation, False lets the OutOfMemoryError reach the caller. The callback may free
    memory into the same stack (no lock is held). An exception it raises reaches the caller
    of allocate unchanged; a result that is not a bool raises TypeError there. TypeError
    when ``callback`` is not callable."""

    def __new__(
        cls, upstream_mr: MemoryResource, callback: Callable[[int], bool]
    ) -> FailureCallbackResourceAdaptor: ...

@final
class PrefetchResourceAdaptor(UpstreamResourceAdaptor):
    """Prefetches every allocation to the device on the allocating stream
    (``cuMemPrefetchAsync``), for managed memory."""

    def __new__(cls, upstream_mr: MemoryResource) -> PrefetchResourceAdaptor: ...

@final
class FixedSizeMemoryResource(UpstreamResourceAdaptor):
    """Blocks of one size (``block_size``, default 1 MiB, rounded up to 256) carved from
    chunks of ``blocks_to_preallocate`` blocks taken from the upstream as needed. Not a
    general resource: a larger allocation raises InvalidArgumentError (a ValueError). The
    bins of BinningMemoryResource are made of these. ``blocks_to_preallocate`` below 1 (or
    beyond 2**64) raises ValueError naming it."""

    def __new__(
        cls,
        upstream_mr: MemoryResource,
        block_size: _Size | None = None,
        blocks_to_preallocate: SupportsIndex = 128,
    ) -> FixedSizeMemoryResource: ...
    @property
    def block_size(self) -> int:
        """The size of every block, in bytes."""
    @property
    def blocks_to_preallocate(self) -> int:
        """Blocks taken from the upstream at a time."""

@final
class BinningMemoryResource(UpstreamResourceAdaptor):
    """Routes each allocation to the bin of the smallest size class that fits it, and
    larger ones to the upstream. With both exponents, starts with a
    FixedSizeMemoryResource bin for every power of two in
    ``[2**min_size_exponent, 2**max_size_exponent]`` (None, or RMM's -1: none). Exponents
    are in 0..=40 (bins of 1 byte to 1 TiB), the first at most the second; anything else
    raises InvalidArgumentError (a ValueError) naming the argument and the value."""

    def __new__(
        cls,
        upstream_mr: MemoryResource,
        min_size_exponent: SupportsIndex | None = None,
        max_size_exponent: SupportsIndex | None = None,
    ) -> BinningMemoryResource: ...
    def add_bin(self, allocation_size: _Size, bin_resource: MemoryResource | None = None) -> None:
        """Adds a bin for allocations up to ``allocation_size`` bytes, served by
        ``bin_resource`` (kept alive), or by a new FixedSizeMemoryResource of that block
        size. ValueError for a size that already has a bin."""
    @property
    def bin_mrs(self) -> list[MemoryResource]:
        """The resources given to ``add_bin``, in order (RMM's ``bin_mrs``)."""
    @property
    def bins(self) -> list[tuple[int, MemoryResource]]:
        """Every bin as ``(allocation_size, resource)``, smallest first; bins made here
        appear as plain MemoryResource objects."""

# --- the sharded pool -----------------------------------------------------------------

class _PoolStats(TypedDict):
    reserved_bytes: int
    used_bytes: int
    free_bytes: int
    common_free_bytes: int
    shard_free_bytes: dict[int, int]
    grown_bytes: int
    released_bytes: int
    upstream_growths: int
    completed_steals: int
    cross_stream_waits: int
    synchronizations: int
    events_recorded: int

@disjoint_base
class ShardedPoolMemoryResource(UpstreamResourceAdaptor):
    """The lock-sharded stream-ordered pool: suballocates memory from ``upstream_mr`` with
    one shard of free blocks per stream, so that threads on different streams do not wait
    for one another (RMM's ``PoolMemoryResource``, without its one lock).

    ``initial_pool_size=None`` reserves nothing up front; ``maximum_pool_size=None`` means
    no limit but the upstream's; sizes are rounded to 256 bytes. ``release_threshold``:
    free bytes kept before whole free chunks go back after a synchronisation.
    ``events_every``: a stream records an event after this many frees, so that other
    streams can reuse what it freed (the interval doubles after each event, up to 64
    times, while no stream is short of memory). A free must pass the size it allocated, as
    in RMM: a double free, an address the pool never handed out, or a size that does not
    round to the allocation's is always refused, and changes nothing. ValueError naming
    the argument for a ``maximum_pool_size`` below 256 bytes (it would round to 0) and an
    ``events_every`` below 1.

    Example::

        pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), maximum_pool_size="8GiB")
        streampool.set_current_device_resource(pool)
    """

    def __new__(
        cls,
        upstream_mr: MemoryResource,
        initial_pool_size: _Size | None = None,
        maximum_pool_size: _Size | None = None,
        release_threshold: _Size | None = None,
        events_every: SupportsIndex = 64,
    ) -> Self: ...
    def pool_size(self) -> int:
        """Bytes the pool holds from its upstream (RMM's ``pool_size()``)."""
    @property
    def stats(self) -> _PoolStats:
        """What the pool holds and how often each step of its policy ran."""
    def release(self) -> int:
        """Gives every entirely free chunk whose frees are known complete back to the
        upstream; returns the bytes released."""

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
    freed on that stream when the buffer is collected or closed (a buffer made on the
    per-thread default stream and collected on another thread waits for the device
    first). Exports: the CUDA array interface (v3) and DLPack (a 1-D uint8 tensor).

    On the simulated device, ``ptr`` is a host address, useless to real GPU libraries.
    """

    def __new__(
        cls, size: _Size = 0, stream: _StreamLike = None, mr: MemoryResource | None = None
    ) -> DeviceBuffer: ...
    @property
    def ptr(self) -> int:
        """The device address (0 for an empty buffer). ValueError once closed."""
    @property
    def size(self) -> int:
        """The size in bytes."""
    @property
    def nbytes(self) -> int:
        """The size in bytes (same as ``size``)."""
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
    @property
    def __cuda_array_interface__(self) -> _CudaArrayInterface:
        """The CUDA array interface, version 3: ``size`` uint8 values, with the stream the
        data is ordered on (1: the legacy default stream, 2: the per-thread default stream,
        else the handle)."""
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
        """A DLPack capsule of the buffer as a 1-D uint8 tensor: ``"dltensor_versioned"``
        (DLPack 1.1) when ``max_version >= (1, 0)``, a legacy ``"dltensor"`` otherwise. The
        tensor keeps the buffer (and its memory) alive until the consumer deletes it.

        ``stream`` is the consumer's: None means the legacy default stream, -1 no
        synchronisation, 0 is refused (ambiguous); otherwise the consumer stream is made to
        wait for the buffer's stream. Raises BufferError for another ``dl_device`` or
        ``copy=True``."""
    def copy_to_host(self, out: _B | None = None, stream: _StreamLike = None) -> bytearray | _B:
        """Copies the buffer to the host and waits for the copy (GIL released). Without
        ``out``, returns a new bytearray; with ``out`` (a writable, C-contiguous buffer of
        at least ``size`` bytes), fills and returns it. ``stream``: where the copy is
        ordered (default: the buffer's own stream)."""
    def copy_from_host(self, obj: Buffer, stream: _StreamLike = None) -> None:
        """Copies a host buffer of at most ``size`` bytes to the start of the buffer and
        waits for the copy (GIL released). ``stream`` defaults to the buffer's own."""
    def tobytes(self) -> bytes:
        """The contents as bytes (a host copy ordered on the buffer's stream)."""
    @staticmethod
    def to_device(
        host_bytes: Buffer, stream: _StreamLike = None, mr: MemoryResource | None = None
    ) -> DeviceBuffer:
        """A new buffer holding a copy of ``host_bytes``."""
    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        """Pickles through a host copy; unpickling allocates from the current resource."""
    def prefetch(self, device: int | Literal["host"] | None = None, stream: _StreamLike = None) -> None:
        """Prefetches the memory (managed memory only) to ``device`` (a device ordinal,
        ``"host"``, or None for the device of the buffer's resource), in order on
        ``stream`` (default: the buffer's own stream). Returns at once (GIL released).
        ValueError once closed; InvalidArgumentError (a ValueError) naming the resource
        when the memory is not managed."""
    def advise(self, advice: _Advice, device: int | Literal["host"] | None = None) -> None:
        """Advises the driver how the memory (managed memory only) will be used, for
        ``device`` (a device ordinal, ``"host"``, or None for the buffer's device; ignored
        by the read-mostly pair). ValueError for an unknown advice or once closed;
        InvalidArgumentError naming the resource when the memory is not managed."""
    @property
    def last_prefetch_location(self) -> int | Literal["host"] | None:
        """Where the whole buffer (managed memory only) was last asked to be prefetched: a
        device ordinal, ``"host"``, or None when never (or its parts went to different
        places). The request, not whether the pages have arrived."""
    def close(self) -> None:
        """Frees the memory now, on its stream; later use raises ValueError and closing
        again does nothing. Memory still used by a DLPack consumer is freed when that
        consumer is done."""
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> bool:
        """Closes the buffer; exceptions propagate."""

def _rebuild_device_buffer(data: Buffer) -> DeviceBuffer:
    """Unpickles a DeviceBuffer: a copy of ``data`` from the current resource."""

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
        """Runs everything queued until no stream has work."""
    @property
    def pending(self) -> int:
        """Operations queued on all streams and not yet run."""
    def queued(self, stream: _StreamLike) -> int:
        """Operations queued on ``stream`` and not yet run."""
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
    def capacity_bytes(self) -> int:
        """Device memory of each simulated device, in bytes."""
    def set_driver_version(self, version: int) -> None:
        """Makes the device report driver ``version`` from now on; below 13000 it has no
        managed pools."""
    def set_concurrent_managed_access(self, enabled: bool) -> None:
        """Makes the device report (or not) concurrent managed access from now on; without
        it there are no managed pools."""
    def describe(self) -> str:
        """E.g. ``"simulated device #3 (16 GiB)"``."""

# --- module functions ---------------------------------------------------------------

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
    unparsable or too large size."""

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

def pointer_pool(ptr: int, device: int | None = None) -> int | None:
    """The driver pool ``ptr`` came from, or None for memory not from a pool."""
