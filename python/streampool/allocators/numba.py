"""Numba allocates through streampool: an External Memory Management (EMM) plugin.

Either set it in the environment before Numba makes its CUDA context::

    NUMBA_CUDA_MEMORY_MANAGER=streampool.allocators.numba python program.py

or in the program, before the first CUDA array::

    from streampool.allocators import numba as sp_numba
    sp_numba.use()       # numba.cuda.set_memory_manager(StreampoolNumbaManager)

Device arrays are then allocated through the current resource of the current device, on
the legacy default stream, and freed there when Numba lets go of them. (An unknown
``NUMBA_CUDA_MEMORY_MANAGER`` is Numba's error: "Failed to use memory manager from
...", raised at the first CUDA use; the value must name an importable module with a
``_numba_memory_manager`` attribute, as this one has.)

RMM's name: ``RMMNumbaManager`` (``rmm.allocators.numba``) is
:class:`StreampoolNumbaManager` here, and both names work. IPC handles of this memory are
not available yet; for memory that another process can import, use a
``CudaAsyncMemoryResource(enable_ipc=True)``.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

from .. import _native
from . import SIMULATED


def _cuda_simulator() -> bool:
    """True when Numba's CUDA simulator stands in for its CUDA target
    (``NUMBA_ENABLE_CUDASIM=1``)."""
    try:
        from numba import config
    except ImportError:
        return False
    return bool(getattr(config, "ENABLE_CUDASIM", False))


try:
    from numba import cuda
    from numba.cuda import HostOnlyCUDAMemoryManager, MemoryPointer
    from numba.cuda.cudadrv.driver import MemoryInfo
except ImportError as e:  # pragma: no cover - depends on what is installed
    if _cuda_simulator():
        raise ImportError(
            "streampool.allocators.numba cannot be used under Numba's CUDA simulator "
            "(NUMBA_ENABLE_CUDASIM=1): the simulator has no external memory managers. Unset "
            "NUMBA_ENABLE_CUDASIM to have Numba allocate through streampool on a GPU"
        ) from e
    # The class of what failed, with the module's name: ModuleNotFoundError without Numba
    # (or without its CUDA target), as RMM's module raises; ImportError for a Numba that
    # lacks what is needed.
    error = ModuleNotFoundError if isinstance(e, ModuleNotFoundError) else ImportError
    raise error(
        "streampool.allocators.numba needs Numba's CUDA target: pip install numba-cuda", name=e.name
    ) from e

__all__ = ["RMMNumbaManager", "StreampoolNumbaManager", "use"]


def _device_pointer(ptr: int) -> Any:
    """The pointer type Numba's driver binding takes: the NVIDIA binding's ``CUdeviceptr``
    where Numba uses it (the default of numba-cuda), a ctypes integer otherwise."""
    try:
        from numba.cuda.cudadrv.driver import USE_NV_BINDING
    except ImportError:
        USE_NV_BINDING = True  # numba-cuda releases that dropped the ctypes binding
    if USE_NV_BINDING:
        from cuda.bindings.driver import CUdeviceptr

        return CUdeviceptr(ptr)
    return ctypes.c_uint64(ptr)


class _Record(NamedTuple):
    """What the plugin keeps of an allocation in Numba's ``allocations``: where it goes back."""

    mr: Any
    size: int


class StreampoolNumbaManager(HostOnlyCUDAMemoryManager):  # type: ignore[misc]
    """Numba's EMM plugin over streampool: device memory from the current resource of the
    current device; host and pinned memory as Numba makes them itself."""

    def initialize(self) -> None:
        """Refuses the simulated device, whose memory (host memory) Numba's kernels cannot
        use, as ``use()`` does (``NUMBA_CUDA_MEMORY_MANAGER`` reaches here without it);
        otherwise nothing to set up: the resource is looked up at each allocation."""
        if _native.using_simulated_device():
            raise RuntimeError(
                f"streampool's Numba plugin cannot serve Numba here: {SIMULATED.removeprefix('skipped: ')}"
            )

    def memalloc(self, size: int) -> Any:
        """Allocates ``size`` bytes on the legacy default stream through streampool's current
        resource. When Numba releases the returned ``MemoryPointer``, the free is handed to
        Numba's pending deallocations, as Numba's own memory's is: inside
        ``numba.cuda.defer_cleanup()`` it waits for the block's end; it is made on the legacy
        default stream."""
        mr = _native.get_current_device_resource()
        ptr = mr.allocate(size)
        if ptr == 0:  # 0 bytes: the null pointer, nothing to free
            return MemoryPointer(self.context, _device_pointer(0), size)
        allocations, deallocations = self.allocations, self.deallocations
        mine = allocations[ptr] = _Record(mr, size)

        def streampool_free(handle: int) -> None:
            # Numba's reset frees the context's memory and forgets it (`reset` below): what is
            # no longer recorded is not freed again. Only this allocation's own record: after
            # a reset, the address may have been handed out again, to an array still in use,
            # whose record is another.
            if allocations.get(handle) is mine:
                del allocations[handle]
                mine.mr.deallocate(handle, mine.size)

        def finalizer() -> None:
            deallocations.add_item(streampool_free, ptr, size)

        return MemoryPointer(self.context, _device_pointer(ptr), size, finalizer=finalizer)

    def reset(self) -> None:
        """Numba's ``Context.reset()``: every allocation of the context goes. Frees the device
        memory this plugin allocated (Numba's base manager only forgets its records, which
        would leave that memory allocated for ever), then resets as Numba's manager does."""
        ours = [(ptr, record) for ptr, record in self.allocations.items() if isinstance(record, _Record)]
        for ptr, _ in ours:
            del self.allocations[ptr]
        for ptr, record in ours:
            record.mr.deallocate(ptr, record.size)
        super().reset()

    def get_memory_info(self) -> Any:
        """``(free, total)`` bytes of the device, as the driver reports them (the current
        resource may hold free memory of its own on top of ``free``)."""
        free, total = _native.available_device_memory(_native.get_current_device())
        return MemoryInfo(free=free, total=total)

    def get_ipc_handle(self, memory: Any) -> Any:
        """Not available for this plugin's memory: raises RuntimeError naming the way to
        share memory between processes."""
        raise RuntimeError(
            "streampool's Numba plugin cannot export IPC handles of its memory (Numba's IPC "
            "carries memory of cuMemAlloc, not of a stream-ordered pool): share a buffer between "
            "processes with streampool.ipc (export and import_buffer, over a "
            "CudaAsyncMemoryResource(enable_ipc=True)), and hand it to Numba through "
            "numba.cuda.as_cuda_array"
        )

    @property
    def interface_version(self) -> int:
        """The EMM interface version this plugin implements (1)."""
        return 1


RMMNumbaManager = StreampoolNumbaManager

#: What ``NUMBA_CUDA_MEMORY_MANAGER=streampool.allocators.numba`` makes Numba use.
_numba_memory_manager = StreampoolNumbaManager


def _context_made() -> bool:
    """True when Numba has made a CUDA context already (it then keeps its memory manager)."""
    try:
        from numba.cuda.cudadrv.driver import driver

        devices = driver.__dict__.get("devices") or {}
        return any(getattr(d, "primary_context", None) is not None for d in devices.values())
    except Exception:
        return False


def use() -> str:
    """Makes :class:`StreampoolNumbaManager` Numba's memory manager
    (``numba.cuda.set_memory_manager``). Call it before Numba's first CUDA use: a context
    made before keeps its manager, and this raises RuntimeError saying so. Returns what it
    did: a ``"skipped: ..."`` line, changing nothing, when Numba sees no GPU
    (``numba.cuda.is_available()`` is False) or on the simulated device."""
    if _native.using_simulated_device():
        return SIMULATED
    if not cuda.is_available():
        return "skipped: Numba sees no CUDA device (numba.cuda.is_available() is False)"
    if _context_made():
        raise RuntimeError(
            "streampool.allocators.numba.use() came too late: Numba has already made its CUDA "
            "context, which keeps its memory manager. Call use() before Numba's first CUDA use, "
            "or set NUMBA_CUDA_MEMORY_MANAGER=streampool.allocators.numba in the environment."
        )
    return _install()


def _install() -> str:
    """:func:`use` without its checks of the device: touches none (``streampool profile``
    routes Numba as the program imports it, before it could fork)."""
    cuda.set_memory_manager(StreampoolNumbaManager)
    return "numba.cuda.set_memory_manager(streampool.allocators.numba.StreampoolNumbaManager)"
