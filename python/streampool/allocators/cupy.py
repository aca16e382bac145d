"""CuPy allocates through streampool: ``use()``, or ``cupy.cuda.set_allocator`` with
:func:`streampool_cupy_allocator`.

Each allocation is made on CuPy's current stream, through the current resource of the
current device, and freed on CuPy's current stream of the thread that releases it (as
CuPy's own ``MemoryAsyncPool`` does): work on other streams that still uses the memory
must be ordered before that stream, as with CuPy's own pools.

Example (GPU only)::

    import cupy
    from streampool.allocators import cupy as sp_cupy

    sp_cupy.use()
    a = cupy.arange(1 << 20)            # allocated through streampool

RMM's name: ``rmm_cupy_allocator`` (``rmm.allocators.cupy``) is
:func:`streampool_cupy_allocator` here, and both names work.
"""

from __future__ import annotations

from typing import Any

try:
    import cupy
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "streampool.allocators.cupy needs CuPy: pip install cupy-cuda13x (or the CuPy build for "
        "your CUDA version)"
    ) from e

from .. import _native

__all__ = ["rmm_cupy_allocator", "streampool_cupy_allocator", "use"]


class _Allocation:
    """Owns one allocation for CuPy's ``UnownedMemory``: frees it, when CuPy lets go, on
    CuPy's current stream of the releasing thread, through the resource that made it."""

    __slots__ = ("mr", "ptr", "size")

    def __init__(self, mr: _native.MemoryResource, ptr: int, size: int) -> None:
        self.mr, self.ptr, self.size = mr, ptr, size

    def __del__(self) -> None:
        try:
            stream = cupy.cuda.get_current_stream()
        except Exception:  # interpreter shutdown: CuPy may be gone; order after everything
            stream = None
        self.mr.deallocate(self.ptr, self.size, stream)


def streampool_cupy_allocator(nbytes: int) -> Any:
    """Allocates ``nbytes`` on CuPy's current stream through streampool's current resource
    of the current device: the allocator function for ``cupy.cuda.set_allocator``. Returns a
    ``cupy.cuda.MemoryPointer``; raises ``streampool.OutOfMemoryError`` (a MemoryError)
    when the resource cannot serve it."""
    mr = _native.get_current_device_resource()
    stream = cupy.cuda.get_current_stream()
    ptr = mr.allocate(nbytes, stream)
    owner = _Allocation(mr, ptr, nbytes)
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, mr.device)
    return cupy.cuda.MemoryPointer(mem, 0)


rmm_cupy_allocator = streampool_cupy_allocator


def use() -> str:
    """Makes :func:`streampool_cupy_allocator` CuPy's allocator (``cupy.cuda.set_allocator``)
    for the rest of the process, or until it is set again. Returns what it did."""
    cupy.cuda.set_allocator(streampool_cupy_allocator)
    return "cupy.cuda.set_allocator(streampool.allocators.cupy.streampool_cupy_allocator)"
