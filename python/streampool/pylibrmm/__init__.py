"""RMM's ``rmm.pylibrmm`` module paths, for code that imports from them: replacing ``rmm``
with ``streampool`` in ``from rmm.pylibrmm.stream import Stream`` (and in
``rmm.pylibrmm.device_buffer``, ``rmm.pylibrmm.memory_resource``, ``rmm.pylibrmm.logger``,
``rmm.pylibrmm.cuda_stream_pool``) keeps it working. Each module holds streampool's
objects under RMM's names (see ``docs/rmm-migration.md``); ``logger`` works on the
``streampool`` logger of Python's ``logging``.

Example::

    from streampool.pylibrmm.stream import DEFAULT_STREAM, Stream  # was rmm.pylibrmm.stream
"""

from __future__ import annotations

from .._native import DeviceBuffer
from .._types import CudaStreamFlags
from . import cuda_stream_pool, device_buffer, logger, memory_resource, stream

__all__ = [
    "CudaStreamFlags",
    "DeviceBuffer",
    "cuda_stream_pool",
    "device_buffer",
    "logger",
    "memory_resource",
    "stream",
]
