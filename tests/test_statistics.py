"""``streampool.statistics``: RMM's ``rmm.statistics`` over the current device resource."""

from __future__ import annotations

import threading

import pytest

import streampool
from streampool import mr
from streampool.statistics import (
    ProfilerRecords,
    Statistics,
    default_profiler_records,
    enable_statistics,
    get_statistics,
    pop_statistics,
    profiler,
    push_statistics,
    statistics,
)

ZERO = Statistics(0, 0, 0, 0, 0, 0)


def test_disabled_is_a_no_op() -> None:
    assert not isinstance(mr.get_current_device_resource(), mr.StatisticsResourceAdaptor)
    assert get_statistics() is None
    assert push_statistics() is None
    assert pop_statistics() is None


def test_enable_statistics_wraps_the_current_resource_once() -> None:
    before = mr.get_current_device_resource()
    enable_statistics()
    stats = mr.get_current_device_resource()
    assert isinstance(stats, mr.StatisticsResourceAdaptor) and stats.upstream is before
    enable_statistics()
    assert mr.get_current_device_resource() is stats
    assert get_statistics() == ZERO
    buf = streampool.DeviceBuffer(size=1000)  # from the current resource
    assert get_statistics() == Statistics(1000, 1, 1000, 1, 1000, 1)
    del buf
    assert get_statistics() == Statistics(0, 0, 1000, 1, 1000, 1)


def test_push_and_pop_statistics() -> None:
    enable_statistics()
    outer = streampool.DeviceBuffer(size=100)
    assert push_statistics() == Statistics(100, 1, 100, 1, 100, 1)
    inner = streampool.DeviceBuffer(size=20)
    assert get_statistics() == Statistics(20, 1, 20, 1, 20, 1)
    assert pop_statistics() == Statistics(20, 1, 20, 1, 20, 1)
    assert get_statistics() == Statistics(120, 2, 120, 2, 120, 2)
    with pytest.raises(IndexError, match="only the base counters"):
        pop_statistics()
    del outer, inner


def test_statistics_block_enables_then_restores() -> None:
    before = mr.get_current_device_resource()
    with statistics():
        adaptor = mr.get_current_device_resource()
        assert isinstance(adaptor, mr.StatisticsResourceAdaptor) and adaptor.upstream is before
        buf = streampool.DeviceBuffer(size=4096)
        assert get_statistics() == Statistics(4096, 1, 4096, 1, 4096, 1)
        with statistics():  # enabled already: a pushed scope on the same adaptor
            assert mr.get_current_device_resource() is adaptor
            assert get_statistics() == ZERO
            other = streampool.DeviceBuffer(size=256)
        assert mr.get_current_device_resource() is adaptor
        assert get_statistics() == Statistics(4352, 2, 4352, 2, 4352, 2)  # the scope merged
        del buf, other
    assert mr.get_current_device_resource() is before
    assert get_statistics() is None


def test_statistics_block_keeps_an_enabled_adaptor() -> None:
    enable_statistics()
    adaptor = mr.get_current_device_resource()
    with statistics():
        buf = streampool.DeviceBuffer(size=10)
    assert mr.get_current_device_resource() is adaptor
    assert get_statistics() == Statistics(10, 1, 10, 1, 10, 1)
    del buf


def test_statistics_block_refuses_a_changed_resource() -> None:
    before = mr.get_current_device_resource()
    with pytest.raises(ValueError, match="changed inside"), statistics():
        mr.set_current_device_resource(mr.CudaAsyncMemoryResource())
    assert mr.get_current_device_resource() is not before  # left as the block set it


def test_statistics_block_propagates_exceptions_and_cleans_up() -> None:
    before = mr.get_current_device_resource()
    with pytest.raises(KeyError), statistics():
        raise KeyError("inside")
    assert mr.get_current_device_resource() is before


def test_profiler_as_decorator() -> None:
    records = ProfilerRecords()

    @profiler(records=records)
    def allocate_some(n: int) -> int:
        bufs = [streampool.DeviceBuffer(size=1000) for _ in range(n)]
        return len(bufs)

    @profiler(records=records, name="named")
    def fails() -> None:
        _buf = streampool.DeviceBuffer(size=5)
        raise RuntimeError("boom")

    assert allocate_some.__name__ == "allocate_some"  # functools.wraps
    assert allocate_some(1) == 1  # statistics not enabled: nothing recorded
    assert records.records == {}
    enable_statistics()
    assert allocate_some(3) == 3
    assert allocate_some(1) == 1
    with pytest.raises(RuntimeError):
        fails()
    [(name, record)] = [(k, v) for k, v in records.records.items() if k != "named"]
    assert name.endswith("(test_profiler_as_decorator.<locals>.allocate_some)")
    assert __file__ in name and ":" in name
    assert (record.num_calls, record.memory_total, record.memory_peak) == (2, 4000, 3000)
    named = records.records["named"]
    assert (named.num_calls, named.memory_total, named.memory_peak) == (1, 5, 5)
    totals = get_statistics()
    assert totals is not None
    assert (totals.peak_bytes, totals.peak_count, totals.total_bytes, totals.total_count) == (
        3000,
        3,
        4005,
        5,
    )


def test_profiler_as_context_manager_and_nested() -> None:
    records = ProfilerRecords()
    with pytest.raises(ValueError, match="needs a name"), profiler(records=records):
        pass
    enable_statistics()
    with profiler(records=records, name="outer"):
        a = streampool.DeviceBuffer(size=100)
        with profiler(records=records, name="inner"):
            b = streampool.DeviceBuffer(size=50)
            del b
        c = streampool.DeviceBuffer(size=10)
        del a, c
    outer, inner = records.records["outer"], records.records["inner"]
    assert (inner.num_calls, inner.memory_total, inner.memory_peak) == (1, 50, 50)
    assert (outer.num_calls, outer.memory_total, outer.memory_peak) == (1, 160, 150)


def test_profiler_uses_the_default_records() -> None:
    enable_statistics()
    with profiler(name="test_profiler_uses_the_default_records"):
        buf = streampool.DeviceBuffer(size=64)
        del buf
    record = default_profiler_records.records["test_profiler_uses_the_default_records"]
    assert record.memory_total >= 64


def test_report() -> None:
    records = ProfilerRecords()
    assert "No data" in records.report()
    records.add("small", Statistics(0, 0, 10, 1, 10, 1))
    records.add("big", Statistics(0, 0, 5000, 1, 6000, 2))
    records.add("small", Statistics(0, 0, 20, 1, 30, 1))
    for _ in range(3):
        records.add("often", Statistics(0, 0, 1, 1, 1, 1))
    small = records.records["small"]
    assert (small.num_calls, small.memory_total, small.memory_peak) == (2, 40, 20)
    by_peak = records.report()
    assert by_peak == str(records)
    assert "Ordered by: memory_peak" in by_peak
    rows = by_peak.splitlines()[-3:]
    assert [r.split()[-1] for r in rows] == ["big", "small", "often"]
    assert rows[0].split()[:3] == ["1", "5,000", "6,000"]
    rows = records.report(ordered_by="num_calls").splitlines()[-3:]
    assert [r.split()[-1] for r in rows] == ["often", "small", "big"]
    with pytest.raises(ValueError, match="ordered_by"):
        records.report(ordered_by="name")  # type: ignore[arg-type]
    assert repr(records).startswith("ProfilerRecords({")


def test_records_add_is_thread_safe() -> None:
    records = ProfilerRecords()

    def add() -> None:
        for _ in range(1000):
            records.add("x", Statistics(0, 0, 1, 1, 2, 1))

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert records.records["x"].num_calls == 8000 and records.records["x"].memory_total == 16000
