"""RMM's ``rmm.mr.experimental`` path: ``from streampool.mr.experimental import
CudaAsyncManagedMemoryResource`` where RMM code wrote ``rmm.mr.experimental``. Here the
resource is not experimental, and is also :class:`streampool.mr.CudaAsyncManagedMemoryResource`.

Example (a GPU whose driver has managed-memory pools, CUDA 13)::

    from streampool.mr.experimental import CudaAsyncManagedMemoryResource

    managed = CudaAsyncManagedMemoryResource()
"""

from __future__ import annotations

from .._native import CudaAsyncManagedMemoryResource

__all__ = ["CudaAsyncManagedMemoryResource"]
