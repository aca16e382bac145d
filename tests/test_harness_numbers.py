"""The harness's figures against answers known in advance: percentile ranks, a log that
crosses midnight, a spec given twice, the pool's synchronisations and waits on every path,
the latencies of the median run, and the streams a pipeline uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from streampool.harness import bench, specs, trace, workloads
from streampool.harness.specs import SpecError, make_resource
from streampool.harness.trace import ALLOCATE, FREE


def test_percentiles_are_nearest_rank_as_the_native_side_ranks_them() -> None:
    hundred = list(range(1, 101))
    assert trace.percentiles(hundred) == {"p50": 50, "p90": 90, "p99": 99, "p999": 100, "max": 100}
    assert trace.quantile(list(range(1, 1001)), 0.999) == 999
    assert trace.quantile([10, 20], 0.5) == 10
    assert trace.quantile([7], 0.5) == trace.quantile([7], 0.999) == 7
    assert trace.quantile([], 0.5) == 0


def test_a_log_crossing_midnight_with_lines_out_of_order_spans_microseconds(tmp_path: Path) -> None:
    # Threads stamp, then write, unlocked: a line stamped before midnight can follow one
    # stamped after it.
    log = tmp_path / "midnight.csv"
    log.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "1,23:59:59.999990,allocate,0x1000,1024,0\n"
        "2,00:00:00.000001,allocate,0x2000,1024,0\n"
        "1,23:59:59.999995,free,0x1000,1024,0\n"
        "2,00:00:00.000010,free,0x2000,1024,0\n"
    )
    t = trace.read_log(str(log))
    times = {(r[2], r[5]): r[0] for r in t.records}
    assert max(times.values()) == 20_000  # 23:59:59.999990 to 00:00:00.000010
    assert times[(0, FREE)] == 5_000  # 5 µs after its allocation, not a day
    # A log that crosses midnight in order still counts on.
    log.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "1,23:59:59.5,allocate,0x1000,1024,0\n"
        "1,00:00:00.5,free,0x1000,1024,0\n"
    )
    assert [r[0] for r in trace.read_log(str(log)).records] == [0, 1_000_000_000]
    # A gap of more than 12 hours within one day is a gap, not a line of the day before.
    log.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "1,01:00:00.0,allocate,0x1000,1024,0\n"
        "1,14:00:00.0,free,0x1000,1024,0\n"
    )
    assert [r[0] for r in trace.read_log(str(log)).records] == [0, 13 * 3600 * 1_000_000_000]


@pytest.mark.parametrize(
    "given", ["async,async", "pool(async),pool( async )", "stats(pool(async)),async,stats(pool(async))"]
)
def test_a_spec_given_twice_is_refused(given: str) -> None:
    with pytest.raises(SpecError, match="is given twice"):
        specs.split_specs(given)
    with pytest.raises(SpecError, match="is given twice"):  # from Python too, before anything runs
        bench.measure("window", _split_raw(given), repeats=1, params={"allocations": 10})


def _split_raw(text: str) -> list[str]:
    """``text`` split at top-level commas without the check."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def test_the_command_line_refuses_a_spec_given_twice() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "streampool", "bench", "window", "--resources", "async,async", "--quick"],
        capture_output=True,
        text=True,
        env={"STREAMPOOL_DEVICE": "sim", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2, out.stderr
    assert "'async' is given twice" in out.stderr and "Traceback" not in out.stderr


MiB = 1 << 20
#: A pool that must synchronise or wait to serve :func:`_short_trace`: at its maximum,
#: memory freed on one stream serves the next allocation on another only after a wait on
#: that stream's event, or a device synchronisation where no event covers it.
SHORT_POOL = "pool(async, maximum=4MiB, gather_interval=0)"


def _short_trace(rounds: int = 10) -> trace.Trace:
    """One thread: 2 MiB held on stream 0 throughout, and ``rounds`` 2 MiB allocations,
    each freed at once, on streams 0 and 1 in turn. With 4 MiB at most, each one takes the
    memory the one before freed on the other stream: on the sharded pool and the arena
    (seen on the simulated device, the same on both replayers) 1 synchronisation and 8
    waits."""
    records = [(0, 2 * MiB, rounds, 0, 0, ALLOCATE)]
    for i in range(rounds):
        records += [(0, 2 * MiB, i, 0, i % 2, ALLOCATE), (0, 2 * MiB, i, 0, i % 2, FREE)]
    records.append((0, 2 * MiB, rounds, 0, 0, FREE))
    return trace.Trace(records)


def _replayers() -> list[bool]:
    """The replayers this build has: the native one (when built) and the Python one."""
    return [native for native in (True, False) if not native or trace.native_replay_available()]


def test_the_pool_s_synchronisations_and_waits_are_reported_on_every_path() -> None:
    """A pool at its maximum, which must wait or synchronise to reuse memory across
    streams, reports more than none of each on every path: the kernel workloads (Python
    threads), directly and beneath an adaptor, and both replayers; a resource with no pool
    of streampool's own reports None. Each run counts from its own start, not the pool's."""
    # One thread on two streams in turn, each iteration taking the memory the one before
    # freed on the other stream: by a wait on its event (9 of them).
    kernels = {"threads": 1, "streams": 2, "iterations": 10, "size": "1MiB"}
    out = workloads.run(
        "multistream", make_resource("pool(async, maximum=1MiB, gather_interval=0)"), **kernels
    )
    assert out["waits"] > 0, out
    out = workloads.run("multistream", make_resource("stats(pool(async, maximum=1MiB))"), **kernels)
    assert out["waits"] > 0, out
    assert workloads.run("multistream", make_resource("async"), iterations=5)["waits"] is None
    for native in _replayers():
        out = trace.replay(make_resource(SHORT_POOL).resource, _short_trace(), gap_scale=0.0, native=native)
        assert out["oom_events"] == 0, (native, out)
        assert out["synchronizations"] > 0 and out["waits"] > 0, (native, out)
    # Counted from the run's start: a pool's earlier work is not the run's. The pool has
    # waited before each run, and waits again in it.
    pool = make_resource("pool(async, maximum=1MiB, gather_interval=0)")
    workloads.run("multistream", pool, **kernels)
    before = trace.pool_counters(pool.resource)
    again = workloads.run("multistream", pool, **kernels)
    after = trace.pool_counters(pool.resource)
    assert before is not None and after is not None and before[1] > 0
    assert again["waits"] > 0
    assert (again["synchronizations"], again["waits"]) == (after[0] - before[0], after[1] - before[1])
    for native in _replayers():
        pool = make_resource(SHORT_POOL)
        trace.replay(pool.resource, _short_trace(), gap_scale=0.0, native=native)
        before = trace.pool_counters(pool.resource)
        again = trace.replay(pool.resource, _short_trace(), gap_scale=0.0, native=native)
        after = trace.pool_counters(pool.resource)
        assert before is not None and after is not None and before[0] > 0 and before[1] > 0, native
        assert again["waits"] > 0, (native, again)
        since = (after[0] - before[0], after[1] - before[1])
        assert (again["synchronizations"], again["waits"]) == since, native


def _run(resource: str, repeat: int, throughput: float, p50: int) -> dict[str, Any]:
    lat = {"p50": p50, "p90": p50, "p99": p50, "p999": p50, "max": p50}
    return {
        "resource": resource,
        "threads": 1,
        "streams": 1,
        "repeat": repeat,
        "unit": "events/s",
        "throughput": throughput,
        "seconds": 1.0,
        "alloc_seconds": 0.1,
        "allocate": lat,
        "free": lat,
        "peak_live_bytes": 1,
        "peak_reserved_bytes": 1,
        "oom_events": 0,
    }


def test_of_two_runs_the_latencies_shown_are_the_slower_run_s() -> None:
    (row,) = bench.summarise([_run("async", 0, 200.0, 100), _run("async", 1, 100.0, 900)], ["async"])
    assert row["throughput"]["median"] == 150.0 and row["allocate"]["p50"] == 900
    (row,) = bench.summarise(
        [_run("async", i, tp, int(tp)) for i, tp in enumerate((3.0, 1.0, 2.0))], ["async"]
    )
    assert row["allocate"]["p50"] == 2  # of three, the median run's


def test_a_pipeline_reports_its_two_streams_per_pair() -> None:
    for driver in ("native", "python"):
        runs, summary = bench.measure(
            "pipeline",
            ["pool(async)"],
            threads=[2],
            repeats=1,
            params={"chunks": 4, "chunk_size": "64KiB", "kernel_us": 0, "driver": driver},
        )
        assert runs[0]["streams"] == summary[0]["streams"] == 4, driver


def test_the_arena_s_counters_are_the_same_on_every_path() -> None:
    """The arena reports its pool's synchronisations, waits and reserved bytes to the native
    drivers as to the Python ones (the native replay and pipeline said nothing before): the
    two replayers report the same counts, more than none of each, for one single-threaded
    trace that makes an arena at its size wait and synchronise, and the two pipeline
    drivers the same reserved bytes (the arena's size)."""
    counts: dict[bool, tuple[int, int]] = {}
    for native in _replayers():
        out = trace.replay(
            make_resource("arena(async, size=4MiB)").resource, _short_trace(), gap_scale=0.0, native=native
        )
        assert out["oom_events"] == 0, (native, out)
        counts[native] = (out["synchronizations"], out["waits"])
        assert counts[native][0] > 0 and counts[native][1] > 0, (native, out)
    if trace.native_replay_available():
        assert counts[True] == counts[False]
    reserved: dict[str, int] = {}
    for driver in ("native", "python"):
        out = workloads.run(
            "pipeline",
            make_resource("arena(async, size=8MiB)"),
            chunks=4,
            chunk_size="64KiB",
            kernel_us=0,
            driver=driver,
        )
        reserved[driver] = out["peak_reserved_bytes"]
        assert isinstance(out["synchronizations"], int) and isinstance(out["waits"], int), (driver, out)
    assert reserved == {"native": 8 * MiB, "python": 8 * MiB}  # the arena's size, on both


def test_byte_counts_read_in_the_largest_unit_that_fits() -> None:
    from streampool.harness.output import human_bytes

    assert human_bytes(1023) == "1023 B" and human_bytes(3 << 20) == "3.0 MiB"
    assert human_bytes(1 << 50) == "1.0 PiB"
    assert human_bytes((1 << 64) - 1) == "16.0 EiB"  # a log's largest size, not "16777216.0 TiB"
    assert human_bytes(None) == "n/a"
