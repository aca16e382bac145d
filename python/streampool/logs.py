"""Allocation logs in RMM's CSV format, as :class:`~streampool.mr.LoggingResourceAdaptor`
writes them and RMM's ``logging_resource_adaptor`` does::

    Thread,Time,Action,Pointer,Size,Stream
    2342727,15:47:02.841961,allocate,0x10012400000,1048576,0
    2342727,15:47:02.841977,free,0x10012400000,1048576,0

so that logs recorded with RMM replay here and ours replay there. The parser is the
Rust core's (``streampool::adaptors::parse_log``).
"""

from __future__ import annotations

import os

from ._native import LOG_HEADER, LogEvent, _parse_log

__all__ = ["LOG_HEADER", "LogEvent", "parse_log"]


def parse_log(source: str | bytes | os.PathLike[str]) -> list[LogEvent]:
    """The events of a log, in file order.

    ``source`` is a path (``os.PathLike``, or a ``str`` of one line that does not start
    with the header) or the log's text (``str`` or ``bytes``, UTF-8). Raises
    InvalidArgumentError (a ValueError) naming the line that does not parse, and
    OSError when the file cannot be read.
    """
    if isinstance(source, bytes):
        return _parse_log(source.decode())
    if isinstance(source, str) and ("\n" in source or source.lstrip("\ufeff").startswith(LOG_HEADER)):
        return _parse_log(source)
    with open(source, encoding="utf-8") as f:
        return _parse_log(f.read())
