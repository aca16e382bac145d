"""The native module of streampool (Rust, PyO3). Import from ``streampool`` and
``streampool.mr`` rather than from here; these stubs are written by hand and checked with
``python -m mypy.stubtest streampool._native``.

Importing never touches the CUDA driver. Every call that can block (a driver call, a
device wait, a resource's lock) releases the GIL.
"""

from types import TracebackType
from typing import (
    Any,
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

__all__ = [
    "DEFAULT_STREAM",
    "LEGACY_DEFAULT_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "CudaAsyncMemoryResource",
    "CudaAsyncViewMemoryResource",
    "CudaMemoryResource",
    "DeviceBuffer",
    "ManagedMemoryResource",
    "MemoryResource",
    "PinnedHostMemoryResource",
    "Stream",
    "_SimDevice",
    "__version__",
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

# --- buffers ------------------------------------------------------------------------

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
        """True once ``close()`` has been called."""
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

    def __new__(cls, capacity_bytes: _Size, devices: int = 1) -> _SimDevice: ...
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
    """Parses a byte size: ``"4096"``, ``"512MiB"``, ``"1.5 GiB"`` (binary units), ``"1GB"``
    (decimal); an int is returned as it is. ValueError for a negative or unparsable size."""

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
