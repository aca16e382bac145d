"""RMM's ``rmm.pylibrmm`` module paths, for code that imports from them: replacing ``rmm``
with ``streampool`` in ``from rmm.pylibrmm.stream import Stream`` (and in
``rmm.pylibrmm.device_buffer``, ``rmm.pylibrmm.memory_resource``) keeps it working. Each
module holds streampool's objects under RMM's names; nothing here is new (see
``docs/rmm-migration.md``). RMM's ``CudaStreamPool`` is not provided.

Example::

    from streampool.pylibrmm.stream import DEFAULT_STREAM, Stream  # was rmm.pylibrmm.stream
"""

from __future__ import annotations

from .._native import DeviceBuffer
from .._types import CudaStreamFlags
from . import device_buffer, memory_resource, stream

__all__ = ["CudaStreamFlags", "DeviceBuffer", "device_buffer", "memory_resource", "stream"]
