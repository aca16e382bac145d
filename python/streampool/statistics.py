"""Allocation statistics of the current device resource, with RMM's names
(``rmm.statistics``): RMM users switch by changing the import.

:func:`enable_statistics` wraps the current device resource in a
:class:`~streampool.mr.StatisticsResourceAdaptor`; :func:`get_statistics`,
:func:`push_statistics` and :func:`pop_statistics` read and nest its counters;
:func:`statistics` does all of that for a block; :func:`profiler` records the
statistics of functions and blocks in :class:`ProfilerRecords`.

Everything here looks at the *current device resource* only: statistics are "enabled"
exactly when that resource is a ``StatisticsResourceAdaptor``, and every function is a
no-op returning ``None`` otherwise. The counters are the adaptor's, shared by all threads:
a profiled block sees allocations other threads make while it runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from types import TracebackType
from typing import Literal, ParamSpec, Self, TypeVar

from . import mr

__all__ = [
    "ProfilerContext",
    "ProfilerRecords",
    "Statistics",
    "default_profiler_records",
    "enable_statistics",
    "get_statistics",
    "pop_statistics",
    "profiler",
    "push_statistics",
    "statistics",
]

_FIELDS = ("current_bytes", "current_count", "peak_bytes", "peak_count", "total_bytes", "total_count")


@dataclasses.dataclass
class Statistics:
    """What a :class:`~streampool.mr.StatisticsResourceAdaptor` counted (one set of
    counters of its stack).

    Also readable by key (``stats["peak_bytes"]``, ``dict(stats)``), as the dictionary that
    older RMM versions returned. A snapshot: as RMM's, its fields can be set, which changes
    nothing in the adaptor, and it is not hashable.

    Attributes:
        current_bytes: bytes allocated and not yet freed.
        current_count: allocations not yet freed.
        peak_bytes: the highest ``current_bytes`` seen.
        peak_count: the highest ``current_count`` seen.
        total_bytes: bytes ever allocated.
        total_count: allocations ever made.
    """

    current_bytes: int
    current_count: int
    peak_bytes: int
    peak_count: int
    total_bytes: int
    total_count: int

    def __getitem__(self, key: str) -> int:
        if key not in _FIELDS:
            raise KeyError(key)
        value: int = getattr(self, key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in _FIELDS

    def keys(self) -> tuple[str, ...]:
        """The field names, in order (so that ``dict(stats)`` works)."""
        return _FIELDS

    def __iter__(self) -> Iterator[str]:
        """The field names, as a dictionary iterates its keys."""
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def values(self) -> tuple[int, ...]:
        """The counters, in the order of :meth:`keys`."""
        return tuple(self[k] for k in _FIELDS)

    def items(self) -> tuple[tuple[str, int], ...]:
        """``(name, value)`` pairs, in the order of :meth:`keys`."""
        return tuple((k, self[k]) for k in _FIELDS)


def _adaptor() -> mr.StatisticsResourceAdaptor | None:
    current = mr.get_current_device_resource()
    return current if isinstance(current, mr.StatisticsResourceAdaptor) else None


def enable_statistics() -> None:
    """Makes the current device resource a :class:`~streampool.mr.StatisticsResourceAdaptor`
    over the previous one, unless it already is one (then this does nothing).

    The adaptor must stay the current resource while statistics are wanted: the other
    functions here look only at the current resource.
    """
    current = mr.get_current_device_resource()
    if not isinstance(current, mr.StatisticsResourceAdaptor):
        mr.set_current_device_resource(mr.StatisticsResourceAdaptor(current))


def get_statistics() -> Statistics | None:
    """The counters on top of the current resource's stack; None when statistics are not
    enabled."""
    adaptor = _adaptor()
    return None if adaptor is None else adaptor.allocation_counts


def push_statistics() -> Statistics | None:
    """Pushes zeroed counters on the current resource's stack and returns the counters on
    top *before* the push; None (and nothing done) when statistics are not enabled."""
    adaptor = _adaptor()
    return None if adaptor is None else adaptor.push_counters()


def pop_statistics() -> Statistics | None:
    """Pops the counters on top of the current resource's stack (adding them into the
    ones below) and returns them; None (and nothing done) when statistics are not
    enabled. IndexError when there is nothing to pop (no earlier push), as RMM's."""
    adaptor = _adaptor()
    return None if adaptor is None else adaptor.pop_counters()


@contextmanager
def statistics() -> Iterator[None]:
    """Statistics for a block, as RMM's ``rmm.statistics.statistics()``.

    When statistics are enabled already, pushes fresh counters on entry and pops them on
    exit. Otherwise makes a new ``StatisticsResourceAdaptor`` over the current resource the
    current resource on entry, and on exit puts the previous resource back (the counters
    go with the adaptor; read them inside the block with :func:`get_statistics`).

    Raises ValueError on exit when the current resource was changed inside the block (the
    resource it set is left in place, and nothing is popped). Example::

        >>> from streampool.statistics import get_statistics, statistics
        >>> with statistics():
        ...     buf = streampool.DeviceBuffer(size=1 << 20)
        ...     print(get_statistics().peak_bytes)
        1048576
    """
    prior = None
    if push_statistics() is None:
        prior = mr.get_current_device_resource()
        enable_statistics()
    current = mr.get_current_device_resource()
    try:
        yield
    finally:
        if mr.get_current_device_resource() is not current:
            raise ValueError("the current device resource was changed inside the statistics() block")
        if prior is None:
            pop_statistics()
        else:
            mr.set_current_device_resource(prior)


class ProfilerRecords:
    """The statistics that :func:`profiler` recorded, by name; thread-safe."""

    @dataclasses.dataclass
    class MemoryRecord:
        """The statistics of one function or block.

        Attributes:
            num_calls: times it ran.
            memory_total: bytes it allocated, summed over all its runs.
            memory_peak: the most bytes it had allocated at once, over all its runs.
        """

        num_calls: int = 0
        memory_total: int = 0
        memory_peak: int = 0

        def add(self, memory_total: int, memory_peak: int) -> None:
            """Counts one more run that allocated ``memory_total`` bytes, at most
            ``memory_peak`` at once."""
            self.num_calls += 1
            self.memory_total += memory_total
            self.memory_peak = max(self.memory_peak, memory_peak)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, ProfilerRecords.MemoryRecord] = {}

    def add(self, name: str, data: Statistics) -> None:
        """Adds one run of ``name`` that counted ``data`` (its total and peak bytes)."""
        with self._lock:
            record = self._records.setdefault(name, ProfilerRecords.MemoryRecord())
            record.add(memory_total=data.total_bytes, memory_peak=data.peak_bytes)

    @property
    def records(self) -> dict[str, ProfilerRecords.MemoryRecord]:
        """The records by name (a copy of the mapping; the records themselves are live)."""
        with self._lock:
            return dict(self._records)

    def report(self, ordered_by: Literal["num_calls", "memory_peak", "memory_total"] = "memory_peak") -> str:
        """The records as a table, largest ``ordered_by`` first."""
        if ordered_by not in ("num_calls", "memory_peak", "memory_total"):
            raise ValueError(f"ordered_by must be num_calls, memory_peak or memory_total, not {ordered_by!r}")
        rows = sorted(self.records.items(), key=lambda item: getattr(item[1], ordered_by), reverse=True)
        lines = ["Memory Profiling", "================", ""]
        if not rows:
            lines.append("No data, maybe profiling wasn't enabled?")
            return "\n".join(lines)
        lines += [
            "Legends:",
            "  ncalls       - number of times the function or code block was called",
            "  memory_peak  - peak memory allocated in function or code block (in bytes)",
            "  memory_total - total memory allocated in function or code block (in bytes)",
            "",
            f"Ordered by: {ordered_by}",
            "",
            "ncalls     memory_peak    memory_total  filename:lineno(function)",
        ]
        lines += [f"{r.num_calls:6,d} {r.memory_peak:15,d} {r.memory_total:15,d}  {name}" for name, r in rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.records})"

    def __str__(self) -> str:
        return self.report()


default_profiler_records = ProfilerRecords()
"""Where :func:`profiler` records unless given ``records=``."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _describe(func: Callable[..., object]) -> str:
    """``path:line(qualified name)`` of a function, as RMM names profiled functions."""
    func = inspect.unwrap(func)
    try:
        _, line = inspect.getsourcelines(func)
        path = inspect.getfile(func)
    except (OSError, TypeError):  # no source (a builtin, code made by exec)
        return getattr(func, "__qualname__", repr(func))
    return f"{path}:{line}({getattr(func, '__qualname__', repr(func))})"


class ProfilerContext:
    """What :func:`profiler` returns: a decorator and a context manager (RMM's name)."""

    def __init__(self, records: ProfilerRecords, name: str) -> None:
        self._records = records
        self._name = name

    def __call__(self, func: Callable[_P, _R]) -> Callable[_P, _R]:
        name = self._name or _describe(func)
        records = self._records

        @wraps(func)
        def profiled(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            push_statistics()
            try:
                return func(*args, **kwargs)
            finally:
                if (stats := pop_statistics()) is not None:
                    records.add(name, stats)

        return profiled

    def __enter__(self) -> Self:
        if not self._name:
            raise ValueError("profiler() used as a context manager needs a name: profiler(name=...)")
        push_statistics()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if (stats := pop_statistics()) is not None:
            self._records.add(self._name, stats)


def profiler(*, records: ProfilerRecords = default_profiler_records, name: str = "") -> ProfilerContext:
    """Records the statistics of a function (as a decorator) or a block (as a context
    manager) in ``records``, under ``name``.

    As a decorator, ``name`` defaults to ``path:line(qualified name)`` of the function; as
    a context manager it is required (ValueError). When statistics are not enabled (see
    :func:`enable_statistics`), nothing is recorded. Each run pushes counters on entry and
    pops them on exit, so nested profiled blocks count into their enclosing ones. Example::

        >>> from streampool.statistics import default_profiler_records, enable_statistics, profiler
        >>> enable_statistics()
        >>> with profiler(name="load"):
        ...     buf = streampool.DeviceBuffer(size=4096)
        >>> default_profiler_records.records["load"].num_calls
        1
    """
    return ProfilerContext(records, name)
