"""RMM's ``rmm.pylibrmm.memory_resource``: the names of :mod:`streampool.mr`, with its
``experimental`` module."""

from __future__ import annotations

from ..mr import *  # noqa: F403
from ..mr import __all__ as _mr_all

__all__ = list(_mr_all)
