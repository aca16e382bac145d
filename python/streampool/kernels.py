"""Fill, check and compute kernels that need no compiler, CuPy or PyTorch.

The kernels are PTX text that the CUDA driver JIT-compiles the first time a device uses
them (``cuModuleLoadData``); on the simulated device, simulated kernels read and write
the memory the same way, are checked by the race detector like any stream work, and
take a simulated duration (2 us plus the bytes touched at 1 TB/s).

The pattern: 8-byte word ``i`` of a buffer filled with ``seed`` is a hash of
``(seed, i)``, so data that lands at the wrong place, comes from another buffer or was
overwritten is found by :func:`check`. A buffer of ``size`` bytes holds ``size // 8``
words; its last ``size % 8`` bytes are neither filled nor checked. ``ptr`` must be 8-byte
aligned (every allocation is) and be device memory of at least ``size`` bytes that you
own, ordered for ``stream``: the driver cannot check that (a bad address faults the
context, and where the GPU reaches host memory, as pinned memory or on systems with HMM,
the kernel writes whatever lies there, as a raw CuPy kernel would), the simulated device
refuses it.

Example::

    import streampool
    from streampool import kernels

    mr = streampool.mr.CudaAsyncMemoryResource()
    s = streampool.Stream()
    p = mr.allocate(1 << 20, s)
    kernels.fill(p, 1 << 20, seed=7, stream=s)
    kernels.compute(p, 1 << 20, s, iterations=4)  # kernel time; the data stays
    assert kernels.check(p, 1 << 20, seed=7, stream=s) == 0
    mr.deallocate(p, 1 << 20, s)
"""

from __future__ import annotations

from typing import Any

from . import _native

__all__ = ["check", "compute", "fill"]


def fill(ptr: int, size: int | str, seed: int, stream: Any = None, *, device: int | None = None) -> None:
    """Enqueue on ``stream`` a kernel that fills ``size`` bytes at ``ptr`` with the pattern
    of ``seed`` (an int in ``0..2**64``). ``device``: for a default stream, the device
    (default: the current one)."""
    _native._kernel_fill(ptr, size, seed, stream, device)


def check(ptr: int, size: int | str, seed: int, stream: Any = None, *, device: int | None = None) -> int:
    """Check ``size`` bytes at ``ptr`` against the pattern of ``seed`` with a kernel on
    ``stream``; synchronise ``stream`` and return the number of 8-byte words that differ
    (0: intact). Below 8 bytes (no whole word) nothing is checked and 0 returned, but
    ``stream`` is still synchronised, so the memory may then be freed on another stream."""
    return _native._kernel_check(ptr, size, seed, stream, device)


def compute(
    ptr: int, size: int | str, stream: Any = None, iterations: int = 1, *, device: int | None = None
) -> None:
    """Enqueue on ``stream`` a read-modify-write kernel: ``iterations`` passes, each reading
    every word of ``size`` bytes at ``ptr``, multiplying it by an odd constant and by that
    constant's inverse, and writing it back. Kernel time in proportion to
    ``iterations * size``; the data is left as it was, so :func:`check` still passes."""
    _native._kernel_compute(ptr, size, iterations, stream, device)
