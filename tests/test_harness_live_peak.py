"""The peak of live bytes that the harness reports beside every speed, on several threads,
and the bound on it that keeps managed memory within a real GPU's free memory.

A replay on several threads measures its own peak (each thread notes when its allocations
returned and its frees were called; the notes are merged in time), not the log's peak in
recorded order: a generated log used to list one thread after another, and its recorded
peak was one thread's (a window replay on 16 threads reported 15 MiB live for what was
about 16 times that)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streampool.harness import bench, trace, workloads
from streampool.harness.specs import make_resource
from streampool.harness.trace import ALLOCATE, FREE, Trace

MiB = 1 << 20
REPLAYERS = [
    pytest.param(True, id="native"),
    pytest.param(False, id="python"),
]


def thread_peaks(t: Trace) -> list[int]:
    """Each thread's own peak of live bytes."""
    return [
        trace.recorded_peak([r for r in t.records if r[3] == th]) for th in sorted({r[3] for r in t.records})
    ]


def test_a_generated_log_lists_the_threads_in_turn() -> None:
    # One size, a window of 4: each thread has 5 allocations live at its peak (the new one
    # before the oldest goes); four threads at one pace have 4 x 5 MiB live at once.
    t = workloads.window_trace(allocations=10, window=4, sizes=("1MiB",), threads=4)
    assert thread_peaks(t) == [5 * MiB] * 4
    # In turn: 4 x 5 MiB (listed one thread after another, the log's peak was one thread's).
    assert trace.recorded_peak(t.records) == 20 * MiB
    assert [r[3] for r in t.records[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(sum(r[3] == th for r in t.records) == 20 for th in range(4))
    r = workloads.random_trace(allocations=50, max_size="1MiB", threads=3, seed=7)
    assert [x[3] for x in r.records[:6]] == [0, 1, 2, 0, 1, 2]
    assert trace.recorded_peak(r.records) <= sum(thread_peaks(r))


@pytest.mark.parametrize("native", REPLAYERS)
def test_a_replay_on_threads_measures_what_was_live_at_once(native: bool) -> None:
    if native and not trace.native_replay_available():
        pytest.skip("this build has no native replayer")
    # Thread 1 frees thread 0's allocation once it exists, while its own is live: whatever
    # the threads' pace, both are live when that free is called, and never more.
    t = Trace(
        [
            (0, 3 * MiB, 0, 0, 0, ALLOCATE),
            (0, 5 * MiB, 1, 1, 1, ALLOCATE),
            (0, 3 * MiB, 0, 1, 1, FREE),
            (0, 5 * MiB, 1, 1, 1, FREE),
        ]
    )
    out = trace.replay(make_resource("cuda").resource, t, gap_scale=0.0, native=native)
    assert (out["peak_live_bytes"], out["peak_live_measured"]) == (8 * MiB, True)


@pytest.mark.parametrize("native", REPLAYERS)
def test_a_log_listed_one_thread_after_another_is_measured_as_it_ran(native: bool) -> None:
    if native and not trace.native_replay_available():
        pytest.skip("this build has no native replayer")
    # Listed thread by thread, but timed: thread 0 holds 3 MiB from 0 to 100 ms, thread 1
    # 5 MiB from 10 to 110 ms. The log's order says 5 MiB at most; the replay, keeping the
    # recorded times, has both live for 90 ms.
    ms = 1_000_000
    t = Trace(
        [
            (0, 3 * MiB, 0, 0, 0, ALLOCATE),
            (100 * ms, 3 * MiB, 0, 0, 0, FREE),
            (10 * ms, 5 * MiB, 1, 1, 1, ALLOCATE),
            (110 * ms, 5 * MiB, 1, 1, 1, FREE),
        ]
    )
    assert trace.recorded_peak(t.records) == 5 * MiB
    out = trace.replay(make_resource("cuda").resource, t, gap_scale=1.0, native=native)
    assert out["peak_live_bytes"] == 8 * MiB


@pytest.mark.parametrize("native", REPLAYERS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(threads=st.integers(2, 4), seed=st.integers(0, 1000), window=st.integers(1, 6))
def test_a_replay_s_peak_lies_between_one_thread_s_and_all_of_theirs(
    native: bool, threads: int, seed: int, window: int
) -> None:
    if native and not trace.native_replay_available():
        pytest.skip("this build has no native replayer")
    t = workloads.window_trace(
        allocations=40, window=window, sizes=("256", "4KiB", "64KiB"), threads=threads, seed=seed
    )
    peaks = thread_peaks(t)
    out = trace.replay(make_resource("pool(async)").resource, t, gap_scale=0.0, native=native)
    assert max(peaks) <= out["peak_live_bytes"] <= sum(peaks), (peaks, out["peak_live_bytes"])


def test_notes_at_the_same_time_count_the_free_first() -> None:
    assert trace.peak_of_notes([(1, 10), (5, 10), (5, -10), (9, -10)]) == 10
    assert trace.peak_of_notes([(5, 10), (1, 10), (9, -10), (6, -10)]) == 20
    assert trace.peak_of_notes([]) == 0


# --- the bound that managed memory must find free on a real GPU -------------------------------


def test_each_workload_s_peak_bound() -> None:
    """Each workload's bound from its parameters: multistream, pipeline and
    larger-than-memory by formula; window and random the sum of the threads' own peaks in a
    log generated here with the same parameters; replay the log's recorded peak."""
    assert workloads.peak_live("multistream", {"threads": 3, "size": "2MiB"}) == 6 * MiB
    assert workloads.peak_live("multistream", {}) == MiB  # the defaults: one thread, 1 MiB
    depth = workloads.HANDOFF_DEPTH + 2
    assert workloads.peak_live("pipeline", {"threads": 2, "chunk_size": "1MiB"}) == 2 * depth * MiB
    assert workloads.peak_live("larger-than-memory", {"total": "3MiB"}) == 3 * MiB
    w = workloads.window_trace(allocations=10, window=4, sizes=("1MiB",), threads=4)
    assert sum(thread_peaks(w)) == 20 * MiB  # one size: 5 live per thread at its peak
    # The workload's own sizes (256 B to 1 MiB): each window's bound differs from the next.
    for window in (3, 4, 5):
        w = workloads.window_trace(allocations=30, window=window, threads=2, seed=5)
        assert workloads.peak_live(
            "window", {"threads": 2, "allocations": 30, "window": window, "seed": 5}
        ) == sum(thread_peaks(w)), window
    r = workloads.random_trace(allocations=30, max_size="64KiB", threads=2, seed=3)
    assert workloads.peak_live(
        "random", {"threads": 2, "allocations": 30, "max_size": "64KiB", "seed": 3}
    ) == sum(thread_peaks(r))
    log = Trace([(0, 7 * MiB, 0, 0, 0, ALLOCATE), (0, 7 * MiB, 0, 0, 0, FREE)])
    assert workloads.peak_live("replay", {"log": log}) == 7 * MiB


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness takes its real-GPU branch (the simulated device still serves the memory:
    conftest's 256 MiB device)."""
    monkeypatch.setattr(workloads, "using_simulated_device", lambda: False)
    monkeypatch.setattr(bench, "using_simulated_device", lambda: False)


@pytest.mark.parametrize(
    ("name", "params", "small"),
    [
        ("multistream", {"threads": 2, "size": "200MiB", "iterations": 1}, {"size": "1MiB"}),
        ("pipeline", {"threads": 1, "chunk_size": "64MiB", "chunks": 1}, {"chunk_size": "1MiB"}),
        # about 4 x 301 x 0.36 MiB live at once, each thread's peak below the device's 256 MiB
        ("window", {"threads": 4, "allocations": 400, "window": 300}, {"window": 4}),
    ],
)
def test_workloads_refuse_managed_memory_beyond_free_memory_on_a_gpu(
    on_a_gpu: None, name: str, params: dict[str, Any], small: dict[str, Any]
) -> None:
    with pytest.raises(
        workloads.WorkloadError, match=r"managed: the workload's peak live bytes .*never oversubscribes"
    ):
        workloads.run(name, make_resource("managed"), **params)
    out = workloads.run(name, make_resource("managed"), **(params | small))
    assert out["oom_events"] == 0


def test_a_log_is_refused_on_its_recorded_peak(on_a_gpu: None) -> None:
    t = workloads.window_trace(40, 8, sizes=("16MiB",), threads=2)  # 2 x 9 x 16 MiB in turn
    with pytest.raises(workloads.WorkloadError, match=r"managed: the trace's peak live bytes \(288\.0 MiB\)"):
        workloads.run("replay", make_resource("managed"), log=t)


def test_measure_refuses_before_anything_runs(on_a_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def one_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("nothing should run")

    monkeypatch.setattr(bench, "one_run", one_run)
    with pytest.raises(
        workloads.WorkloadError, match=r"^managed: the workload's peak live bytes \(400\.0 MiB\)"
    ):
        bench.measure("multistream", ["async", "managed"], threads=[1, 2], params={"size": "200MiB"})
    assert bench.refused("multistream", ["async", "managed"], [1, 2], {"size": "200MiB"}).keys() == {
        "managed"
    }
    assert bench.refused("multistream", ["async", "managed"], [1], {"size": "1MiB"}) == {}


def test_on_the_simulated_device_nothing_is_refused() -> None:
    assert bench.refused("multistream", ["managed"], [4], {"size": "1TiB"}) == {}


def producer_consumer(chunks: int, every_ns: int = 2000) -> Trace:
    """A producer thread allocates a 1 MiB chunk every ``every_ns`` on its stream; a
    consumer thread frees each half that later on its own: the program never had two
    chunks live."""
    records = []
    for i in range(chunks):
        records.append((every_ns * i, MiB, i, 0, 0, ALLOCATE))
        records.append((every_ns * i + every_ns // 2, MiB, i, 1, 1, FREE))
    return Trace(records)


@pytest.mark.parametrize("native", REPLAYERS)
def test_no_replay_thread_runs_further_ahead_than_the_lead(native: bool) -> None:
    # The program's queue is not in its log: left to itself, the producer runs ahead of
    # the consumer and holds many chunks live; kept to the recorded order across threads,
    # as the program's queue kept it, one chunk is live at a time.
    t = producer_consumer(300)
    resource = make_resource("async").resource
    assert trace.replay(resource, t, gap_scale=0, max_lead=0, native=native)["peak_live_bytes"] == MiB
    # 10 µs of lead: the producer is at most 5 chunks ahead, and one more in its call.
    peak = trace.replay(resource, t, gap_scale=0, max_lead=10e-6, native=native)["peak_live_bytes"]
    assert MiB <= peak <= 7 * MiB, peak
    # The default keeps it to 1 ms: with a chunk every 20 µs, at most 50 chunks ahead.
    out = trace.replay(resource, producer_consumer(300, every_ns=20_000), gap_scale=0, native=native)
    assert out["events"] == 600 and MiB <= out["peak_live_bytes"] <= 52 * MiB, out
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="max_lead must be a number of seconds >= 0"):
            trace.replay(resource, t, gap_scale=0, max_lead=bad, native=native)


def random_log(seed: int) -> Trace:
    """Four threads; times that go back; frees on any thread; ids allocated again once
    freed (as logs that use addresses as ids)."""
    import random

    rng = random.Random(seed)
    records, live, free_ids, next_id = [], [], [], 0
    for _ in range(rng.randrange(1, 80)):
        thread, t = rng.randrange(4), rng.randrange(5000)
        if live and rng.random() < 0.5:
            alloc_id = live.pop(0)
            records.append((t, 256, alloc_id, thread, thread, FREE))
            free_ids.append(alloc_id)
        else:
            alloc_id = free_ids.pop() if free_ids else (next_id := next_id + 1)
            records.append((t, 256, alloc_id, thread, thread, ALLOCATE))
            live.append(alloc_id)
    return Trace(records)


@pytest.mark.parametrize("native", REPLAYERS)
def test_a_replay_with_a_lead_always_ends(native: bool) -> None:
    # Whatever the times and whoever frees what, the thread with the earliest time can go
    # on: no replay waits forever (a daemon thread, so that a hang fails the test).
    import threading

    resource = make_resource("async").resource

    def replay(t: Trace, lead: float, done: list[int]) -> None:
        done.append(trace.replay(resource, t, gap_scale=0, max_lead=lead, native=native)["events"])

    for seed in range(40):
        t = random_log(seed)
        for lead in (0, 1e-6, 1e-3):
            done: list[int] = []
            runner = threading.Thread(target=replay, args=(t, lead, done), daemon=True)
            runner.start()
            runner.join(20)
            assert done, f"the replay did not end within 20 s (seed {seed}, lead {lead}): {t.records}"
