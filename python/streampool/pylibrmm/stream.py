"""RMM's ``rmm.pylibrmm.stream``: :class:`streampool.Stream` and the default streams."""

from __future__ import annotations

from .._native import DEFAULT_STREAM, LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Stream
from .._types import CudaStreamFlags

__all__ = [
    "DEFAULT_STREAM",
    "LEGACY_DEFAULT_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "CudaStreamFlags",
    "Stream",
]
