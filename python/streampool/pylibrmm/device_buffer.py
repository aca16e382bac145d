"""RMM's ``rmm.pylibrmm.device_buffer``: :class:`streampool.DeviceBuffer` (RMM's module
functions ``to_device`` and the ``copy_*_ptr`` ones are not provided: the buffer's methods
do the same)."""

from __future__ import annotations

from .._native import DeviceBuffer

__all__ = ["DeviceBuffer"]
