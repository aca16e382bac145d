"""RMM's ``rmm.pylibrmm.cuda_stream_pool``: a fixed set of streams handed out in turn."""

from __future__ import annotations

import itertools
import operator
import threading

from .._native import Stream
from .._types import CudaStreamFlags

__all__ = ["CudaStreamPool"]


class CudaStreamPool:
    """``pool_size`` streams of the current device, made at once with ``flags`` (blocking by
    default, as RMM's) and kept for the pool's life; :meth:`get_stream` hands them out in
    turn, so successive calls may give the same stream. Safe to share between threads::

        >>> from streampool.pylibrmm.cuda_stream_pool import CudaStreamPool
        >>> pool = CudaStreamPool(4)
        >>> pool.get_stream() == pool.get_stream(1)  # the first, then the second of four
        False
        >>> pool.get_stream(5) == pool.get_stream(1)  # ids wrap around the pool
        True
    """

    def __init__(self, pool_size: int = 16, flags: CudaStreamFlags = CudaStreamFlags.SYNC_DEFAULT) -> None:
        try:
            size = operator.index(pool_size)
        except TypeError:
            raise TypeError(f"pool_size must be an int, not {type(pool_size).__name__}") from None
        if size <= 0:
            raise ValueError(f"pool_size must be greater than zero, got {size}")
        self._streams = tuple(Stream(flags=flags) for _ in range(size))  # Stream checks the flags
        self._next = itertools.count()
        self._lock = threading.Lock()

    def get_stream(self, stream_id: int | None = None) -> Stream:
        """The next stream in turn, or with ``stream_id`` the stream at that position
        (modulo the pool's size, as RMM's)."""
        if stream_id is None:
            with self._lock:
                stream_id = next(self._next)
        else:
            try:
                stream_id = operator.index(stream_id)
            except TypeError:
                raise TypeError(f"stream_id must be an int or None, not {type(stream_id).__name__}") from None
            if stream_id < 0:
                raise ValueError(f"stream_id must be non-negative, got {stream_id}")
        return self._streams[stream_id % len(self._streams)]

    def get_pool_size(self) -> int:
        """How many streams the pool holds."""
        return len(self._streams)

    def __repr__(self) -> str:
        return f"CudaStreamPool(pool_size={len(self._streams)})"
