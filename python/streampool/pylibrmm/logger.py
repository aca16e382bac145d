"""RMM's logger functions (``rmm.set_logging_level`` and the rest, ``rmm.pylibrmm.logger``),
over the ``streampool`` logger of Python's :mod:`logging`, which is where streampool writes
what it reports (an arena's state when an allocation fails with ``dump_log_on_failure``,
a tracking adaptor's ``log_outstanding_allocations()``).

RMM's logger is a C++ logger with a level and a flush level of its own; here the level is
the ``streampool`` logger's level, so the two ways of setting it agree::

    >>> streampool.set_logging_level(streampool.level_enum.error)  # warnings are not shown
    >>> logging.getLogger("streampool").level == logging.ERROR
    True
    >>> streampool.should_log(streampool.level_enum.warn)
    False

By default the logger follows Python's (its effective level is the root logger's, WARNING
unless the program configures logging), where RMM's starts at ``info``.
"""

from __future__ import annotations

import logging
from enum import IntEnum

__all__ = [
    "flush_logger",
    "get_flush_level",
    "get_logging_level",
    "level_enum",
    "set_flush_level",
    "set_logging_level",
    "should_log",
]


class level_enum(IntEnum):  # RMM's name
    """RMM's logging levels (rapids-logger's ``level_enum``), with its values."""

    trace = 0
    debug = 1
    info = 2
    warn = 3
    error = 4
    critical = 5
    off = 6
    n_levels = 7


# Python's level for each of RMM's; logging has no TRACE, so trace is a level below DEBUG.
# `off` (and `n_levels`, RMM's count of levels, which it also takes) is above CRITICAL.
_TO_PYTHON = {
    level_enum.trace: 5,
    level_enum.debug: logging.DEBUG,
    level_enum.info: logging.INFO,
    level_enum.warn: logging.WARNING,
    level_enum.error: logging.ERROR,
    level_enum.critical: logging.CRITICAL,
    level_enum.off: logging.CRITICAL + 1,
    level_enum.n_levels: logging.CRITICAL + 1,
}

_LOGGER = logging.getLogger("streampool")
# Records at this level or above flush the logger's handlers once written (RMM's default).
_flush_level = level_enum.warn


def _check(level: object) -> level_enum:
    if not isinstance(level, level_enum):
        raise TypeError(
            f"level must be a streampool.level_enum (RMM's level_enum), not {type(level).__name__}"
        )
    return level


def _from_python(levelno: int) -> level_enum:
    """The most verbose of RMM's levels that a logger at ``levelno`` writes."""
    for level in level_enum:
        if _TO_PYTHON[level] >= levelno:
            return level
    return level_enum.off


def should_log(level: level_enum) -> bool:
    """Whether a record at ``level`` would be written: the ``streampool`` logger is enabled
    for it (its own level, else its ancestors'). TypeError for anything but a
    :class:`level_enum`, as RMM's."""
    level = _check(level)
    if level >= level_enum.off:
        return False
    return _LOGGER.isEnabledFor(_TO_PYTHON[level])


def set_logging_level(level: level_enum) -> None:
    """Sets the ``streampool`` logger's level (``level_enum.off`` silences it)::

    >>> streampool.set_logging_level(streampool.level_enum.off)
    """
    _LOGGER.setLevel(_TO_PYTHON[_check(level)])


def get_logging_level() -> level_enum:
    """The ``streampool`` logger's effective level, as RMM's level that it writes from
    (``warn`` for Python's default WARNING)."""
    return _from_python(_LOGGER.getEffectiveLevel())


def flush_logger() -> None:
    """Flushes the handlers that the ``streampool`` logger's records reach (its own, then
    its ancestors' while it propagates)."""
    logger: logging.Logger | None = _LOGGER
    while logger is not None:
        for handler in logger.handlers:
            handler.flush()
        logger = logger.parent if logger.propagate else None


def set_flush_level(level: level_enum) -> None:
    """Records of ``level`` or above that streampool writes flush the handlers at once
    (:func:`flush_logger`); ``warn`` by default. Python's stream and file handlers flush
    every record anyway; this matters for buffering handlers."""
    global _flush_level
    _flush_level = _check(level)


def get_flush_level() -> level_enum:
    """The level from which streampool's records flush the handlers (:func:`set_flush_level`)."""
    return _flush_level


def _emit(levelno: int, message: str) -> None:
    """Writes one of streampool's records (the native module calls this), then flushes when
    it is at or above the flush level."""
    _LOGGER.log(levelno, "%s", message)
    if (
        _flush_level < level_enum.off
        and levelno >= _TO_PYTHON[_flush_level]
        and _LOGGER.isEnabledFor(levelno)
    ):
        flush_logger()
