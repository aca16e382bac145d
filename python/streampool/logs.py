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

__all__ = ["LOG_HEADER", "LogEvent", "parse_log", "parse_log_file", "parse_log_text"]


def parse_log_text(text: str | bytes) -> list[LogEvent]:
    """The events of a log's text (``str``, or ``bytes`` in UTF-8), in file order; never
    read as a path. Raises InvalidArgumentError (a ValueError) naming the line that does
    not parse (an empty text has no header: it does not parse either)."""
    return _parse_log(text.decode() if isinstance(text, bytes) else text)


def parse_log_file(path: str | os.PathLike[str]) -> list[LogEvent]:
    """The events of the log in the file ``path`` (see :func:`parse_log_text`); OSError
    when the file cannot be read."""
    if not isinstance(path, (str, os.PathLike)):  # open() would take an int as a descriptor, and close it
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    with open(path, encoding="utf-8") as f:
        return parse_log_text(f.read())


def parse_log(source: str | bytes | os.PathLike[str]) -> list[LogEvent]:
    """The events of a log, in file order: a convenience that guesses what ``source`` is.

    ``source`` is a path (``os.PathLike``, or a ``str`` of one line that does not start
    with the header) or the log's text (``bytes``, or a ``str`` with a newline or starting
    with the header). A log's text of one line without its header would be taken for a
    path: where it matters, say which it is with :func:`parse_log_text` or
    :func:`parse_log_file`. Raises InvalidArgumentError (a ValueError) naming the line
    that does not parse, OSError when the file cannot be read, and TypeError for anything
    else (an int is not taken for a file descriptor). Example::

        >>> from streampool.logs import parse_log
        >>> events = parse_log("Thread,Time,Action,Pointer,Size,Stream\\n1,10:00:00.000001,allocate,0x100,256,0\\n")
        >>> events[0].action, events[0].size
        ('allocate', 256)
    """
    if not isinstance(source, (str, bytes, os.PathLike)):
        raise TypeError(f"source must be a str, bytes or os.PathLike, not {type(source).__name__}")
    if isinstance(source, bytes) or (
        isinstance(source, str) and ("\n" in source or source.lstrip("\ufeff").startswith(LOG_HEADER))
    ):
        return parse_log_text(source)
    return parse_log_file(source)
