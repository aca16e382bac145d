"""Small Python types that the native module and ``streampool.mr`` share."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["CudaStreamFlags", "PoolHandle"]


class CudaStreamFlags(IntEnum):
    """How a new stream relates to the legacy default stream (RMM's ``CudaStreamFlags``,
    the driver's ``CU_STREAM_DEFAULT`` and ``CU_STREAM_NON_BLOCKING``).

    Accepted by :class:`streampool.Stream` as ``flags=``::

        >>> s = streampool.Stream(flags=mr.CudaStreamFlags.SYNC_DEFAULT)  # a blocking stream
    """

    SYNC_DEFAULT = 0
    """The stream synchronises with the legacy default stream (``blocking=True``)."""
    NON_BLOCKING = 1
    """The stream does not synchronise with the legacy default stream (``blocking=False``,
    streampool's default)."""


class PoolHandle(int):
    """A driver pool handle (``CUmemoryPool``) as an int that can also be called.

    ``pool_handle`` is a property in streampool and a method in RMM; this int works as
    both: ``mr.pool_handle`` and ``mr.pool_handle()`` give the same number::

        >>> h = mr.CudaAsyncMemoryResource().pool_handle
        >>> h == mr.CudaAsyncMemoryResource().pool_handle()
        True
    """

    __slots__ = ()

    def __call__(self) -> int:
        """The handle as a plain int (RMM's ``pool_handle()``)."""
        return int(self)

    def __repr__(self) -> str:
        return f"PoolHandle({int(self):#x})"
