"""CuPy allocates through streampool: ``use()``, or ``cupy.cuda.set_allocator`` with
:func:`streampool_cupy_allocator`.

Each allocation is made on CuPy's current stream, through the current resource of the
current device, and freed on the stream it was allocated on (as CuPy's own
``MemoryAsyncPool`` and RMM's allocator do): work on other streams that still uses the
memory must be ordered before that stream's later work, as with CuPy's own pools. When
CuPy has destroyed that stream by then, the free is on CuPy's current stream of the
releasing thread, as CuPy's own is.

Out of memory raises CuPy's own error, ``cupy.cuda.memory.OutOfMemoryError``, as CuPy's
pools do (RMM's allocator raises a plain ``MemoryError``): the error is streampool's
``OutOfMemoryError`` too, with its message and attributes (:data:`OutOfMemoryError`).

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

from .. import _errors, _native
from . import SIMULATED

#: What the allocator and ``use()`` raise without CuPy (the module imports, as RMM's does).
MISSING = (
    "streampool.allocators.cupy needs CuPy: pip install cupy-cuda13x (or the CuPy build for your "
    "CUDA version)"
)

_IMPORT_ERROR: ImportError | None = None
try:
    import cupy
except ImportError as e:  # pragma: no cover - depends on what is installed
    cupy = None
    _IMPORT_ERROR = e


__all__ = ["OutOfMemoryError", "rmm_cupy_allocator", "streampool_cupy_allocator", "use"]


def _stream_capsule(cupy_module: Any) -> Any:
    """CuPy's C function that reads the current stream (``get_current_stream_ptr``, exported
    by ``cupy.cuda.stream``), or None where this CuPy does not export it."""
    stream_module = getattr(cupy_module.cuda, "stream", None)
    capi = getattr(stream_module, "__pyx_capi__", None) or {}
    return capi.get("get_current_stream_ptr")


def _out_of_memory_error(cupy_module: Any) -> type[_errors.OutOfMemoryError] | None:
    """streampool's ``OutOfMemoryError`` that is CuPy's ``cupy.cuda.memory.OutOfMemoryError``
    too, or None where this CuPy has none."""
    cupys = getattr(getattr(cupy_module.cuda, "memory", None), "OutOfMemoryError", None)
    if not (isinstance(cupys, type) and issubclass(cupys, MemoryError)):
        return None

    class OutOfMemoryError(_errors.OutOfMemoryError, cupys):  # type: ignore[misc, valid-type]
        """Out of memory in :func:`streampool_cupy_allocator`: ``streampool.OutOfMemoryError``
        and CuPy's ``cupy.cuda.memory.OutOfMemoryError`` at once, so that a program that
        catches CuPy's error (to free memory and try again) catches it, as under CuPy's own
        pools. Its message and attributes are streampool's."""

        def __init__(
            self, message: str = "", requested: int | None = None, available: int | None = None
        ) -> None:
            # Neither base's __init__: each would call the other's with its own arguments.
            MemoryError.__init__(self, message)
            self.requested, self.available = requested, available
            # CuPy's attributes, as its own error sets them (the total allocated is unknown).
            self._size, self._total, self._limit = requested or 0, -1, 0

    # Found by pickle as this module's attribute.
    OutOfMemoryError.__module__, OutOfMemoryError.__qualname__ = __name__, "OutOfMemoryError"
    return OutOfMemoryError


def _make(cupy_module: Any, out_of_memory: type[_errors.OutOfMemoryError] | None) -> _native.CupyAllocator:
    cuda = cupy_module.cuda
    capsule = _stream_capsule(cupy_module)
    external = getattr(cuda, "ExternalStream", None)
    parts = (cuda.UnownedMemory, cuda.MemoryPointer, cuda.get_current_stream)
    try:
        return _native.CupyAllocator(*parts, capsule, external, out_of_memory)
    except TypeError:  # a capsule of another signature: read the stream through Python
        return _native.CupyAllocator(*parts, None, external, out_of_memory)


def _without_cupy(nbytes: int) -> Any:
    """The allocator where CuPy is not installed: ModuleNotFoundError, as RMM's."""
    raise ModuleNotFoundError(MISSING, name="cupy") from _IMPORT_ERROR


_CUPYS = None if cupy is None else _out_of_memory_error(cupy)

#: What :func:`streampool_cupy_allocator` raises out of memory: streampool's
#: ``OutOfMemoryError`` that is CuPy's ``cupy.cuda.memory.OutOfMemoryError`` too (without
#: CuPy, or a CuPy that has no such error, streampool's own), so that ``except
#: OutOfMemoryError`` works with or without CuPy.
OutOfMemoryError: type[_errors.OutOfMemoryError] = _CUPYS or _errors.OutOfMemoryError

#: Allocates ``nbytes`` on CuPy's current stream through streampool's current resource of
#: the current device: the allocator function for ``cupy.cuda.set_allocator``. Returns a
#: ``cupy.cuda.MemoryPointer``; raises :data:`OutOfMemoryError` (streampool's
#: ``OutOfMemoryError`` and CuPy's ``cupy.cuda.memory.OutOfMemoryError`` at once, both
#: MemoryErrors) when the resource cannot serve it. A callable object of streampool's
#: extension: no Python code runs on its path, and the memory is freed, when CuPy lets go
#: of it, through the resource that made it, on the stream it was allocated on.
streampool_cupy_allocator: Any = _without_cupy if cupy is None else _make(cupy, _CUPYS)

rmm_cupy_allocator = streampool_cupy_allocator


def use() -> str:
    """Makes :func:`streampool_cupy_allocator` CuPy's allocator (``cupy.cuda.set_allocator``)
    for the rest of the process, or until it is set again (for one block of code, CuPy's
    ``with cupy.cuda.using_allocator(streampool_cupy_allocator):`` puts the previous
    allocator back at its end). Returns what it did (a
    ``"skipped: ..."`` line, changing nothing, on the simulated device)."""
    if cupy is None:
        raise ImportError(MISSING) from _IMPORT_ERROR
    if _native.using_simulated_device():
        return SIMULATED
    cupy.cuda.set_allocator(streampool_cupy_allocator)
    return "cupy.cuda.set_allocator(streampool.allocators.cupy.streampool_cupy_allocator)"
