"""Regressions of the harness's review: stress frees with kernels pending and refuses to
call a run that verified nothing OK; profile leaves Ctrl-C to the program; traces keep
per-thread default streams apart, count only the threads and streams they replay and
close an allocation whose address is allocated again; forked children are not logged;
both replayers report the log's peak; the workloads' streams default to one per thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from streampool import mr
from streampool.harness import profile, recommend, stress, trace, workloads
from streampool.harness.specs import Candidate, make_resource
from streampool.harness.trace import ALLOCATE, FREE, Trace

HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


def cli(*args: str, **popen: Any) -> subprocess.Popen[str]:
    """``python -m streampool ARGS`` on the simulated device."""
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    return subprocess.Popen(
        [sys.executable, "-m", "streampool", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def log_of(tmp_path: Path, *lines: str) -> Trace:
    path = tmp_path / "app.log"
    path.write_text(HEADER + "".join(f"{line}\n" for line in lines))
    return trace.read_log(str(path))


# --- 1. stress: frees with kernels pending; a run that verified nothing -----------------


def ignores_streams() -> Candidate:
    """A cache of 4 KiB blocks that hands the last one freed to any stream at once, without
    ordering (allocations of at most 4 KiB)."""
    base = mr.CudaAsyncMemoryResource()
    free: list[int] = []

    def allocate(size: int, stream: Any) -> int:
        return free.pop() if free else base.allocate(4096, stream)

    return Candidate(
        "ignores-streams", mr.CallbackMemoryResource(allocate, lambda p, n, s: free.append(p)), ""
    )


@pytest.mark.races_expected
def test_stress_catches_memory_reused_on_another_stream_before_its_kernel_finished(sim: Any) -> None:
    # One thread, a fixed number of operations: the same run every time.
    report = stress.run(
        ignores_streams(), seconds=60, threads=1, streams=2, max_size="4KiB", operations=200, sim=sim
    )
    assert report["operations"] == 200 and report["pending_frees"] > 0
    assert not report["ok"] and not report["nothing_verified"]
    assert report["races"] and "is not ordered before" in report["races"][0]


def orders_after_the_allocations_stream_only() -> Candidate:
    """A cache that, at a free, waits for the stream the memory was allocated on, not the
    stream it is freed on: work pending on the freeing stream is not ordered before reuse."""
    base = mr.CudaMemoryResource()
    free: list[tuple[int, int]] = []
    made: dict[int, tuple[int, Any]] = {}

    def allocate(size: int, stream: Any) -> int:
        for i, (ptr, held) in enumerate(free):
            if held >= size:
                free.pop(i)
                made[ptr] = (held, stream)
                return ptr
        ptr = base.allocate(size, stream)
        made[ptr] = (size, stream)
        return ptr

    def deallocate(ptr: int, size: int, stream: Any) -> None:
        held, allocated_on = made.pop(ptr)
        allocated_on.synchronize()  # the free's own stream is not waited for
        free.append((ptr, held))

    return Candidate("allocation-stream-only", mr.CallbackMemoryResource(allocate, deallocate), "")


@pytest.mark.races_expected
def test_stress_catches_reuse_not_ordered_after_the_freeing_stream(sim: Any) -> None:
    # Frees with kernels pending are made on any of a thread's streams, the freeing
    # stream's work included in what the reuse must follow.
    report = stress.run(
        orders_after_the_allocations_stream_only(),
        seconds=60,
        threads=1,
        streams=2,
        max_size="4KiB",
        operations=400,
        sim=sim,
    )
    assert report["pending_frees"] > 0 and not report["ok"]
    assert report["races"] and "is not ordered before" in report["races"][0]


@pytest.mark.parametrize("spec", ["async", "pool(async)", "binning(async)", "cuda", "managed"])
def test_stress_passes_resources_that_order_reuse(sim: Any, spec: str) -> None:
    report = stress.run(
        make_resource(spec), seconds=60, threads=2, streams=2, max_size="4KiB", operations=300, sim=sim
    )
    assert report["ok"], report
    assert report["pending_frees"] > 0 and report["verified_bytes"] > 0 and not report["races"]


def test_stress_that_verified_nothing_is_not_ok(sim: Any) -> None:
    report = stress.run(make_resource("limit(async, limit=1)"), seconds=60, threads=1, operations=50, sim=sim)
    assert (report["allocations"], report["refused"], report["verified_bytes"]) == (0, 50, 0)
    assert not report["ok"] and report["nothing_verified"]
    assert not (report["corruptions"] or report["overlaps"] or report["races"] or report["errors"])


@pytest.mark.nosim
def test_stress_command_says_nothing_verified_and_exits_4() -> None:
    child = cli("stress", "--resources", "limit(async, limit=1)", "--seconds", "0.1", "--threads", "1")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 4, err
    assert "NOTHING VERIFIED" in out and "OK" not in out
    assert "nothing verified on limit(async, limit=1)" in err


# --- 2. profile: Ctrl-C is the program's ------------------------------------------------

SIGINT_PROGRAM = """\
import pathlib, sys, time, streampool
keep = streampool.DeviceBuffer(size=1111)
try:
    pathlib.Path(sys.argv[1]).write_text("ready")
    # Short sleeps: a SIGINT that lands after Python's last check for signals but before
    # the sleep starts does not end it (CPython sees the signal once the sleep returns),
    # so one long sleep could hold the KeyboardInterrupt for all of it.
    for _ in range(1200):
        time.sleep(0.1)
except KeyboardInterrupt:
    streampool.DeviceBuffer(size=4242).close()  # the clean-up allocates and frees
    print("cleaned up", flush=True)
    sys.exit(3)
"""


@pytest.mark.nosim
@pytest.mark.parametrize("command", ["profile", "recommend"])
def test_ctrl_c_is_the_programs_and_its_status_and_clean_up_pass_through(
    tmp_path: Path, command: str
) -> None:
    program, ready, log = tmp_path / "prog.py", tmp_path / "ready", tmp_path / "app.log"
    program.write_text(SIGINT_PROGRAM)
    # A session of its own: SIGINT to its process group is what Ctrl-C at a terminal sends.
    child = cli(
        command, "-o", str(log), "--", sys.executable, str(program), str(ready), start_new_session=True
    )
    try:
        while not ready.exists():  # the program is in its sleep, SIGINT handled
            assert child.poll() is None, child.communicate()
            threading.Event().wait(0.01)
        os.killpg(child.pid, signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 3, err
    assert "cleaned up" in out and "interrupted" not in err
    assert "the program exited with status 3; the log keeps the 4 event(s) recorded until then" in err
    sizes = [line.split(",")[4] for line in log.read_text().splitlines()[1:]]
    assert sizes == ["1111", "4242", "4242", "1111"]


def test_profile_puts_back_the_sigint_handler_and_leaves_the_program_its_own(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)
    # The program's SIGINT is Python's own (KeyboardInterrupt), not inherited as ignored.
    check = "import signal, sys; sys.exit(0 if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 5)"
    assert profile.run([sys.executable, "-c", check], str(tmp_path / "app.log"), simulated=True) == 0
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(profile.CannotStartError):
        profile.run([str(tmp_path / "missing")], str(tmp_path / "app.log"), simulated=True)
    assert signal.getsignal(signal.SIGINT) is before


# --- 3. the per-thread default stream is one stream per thread --------------------------


def test_the_per_thread_default_stream_is_a_stream_per_thread(tmp_path: Path) -> None:
    t = log_of(
        tmp_path,
        "1,10:00:00.000001,allocate,0x1000,100,0x2",
        "2,10:00:00.000002,allocate,0x2000,100,0x2",
        "1,10:00:00.000003,allocate,0x3000,100,0x0",
        "2,10:00:00.000004,allocate,0x4000,100,0x1",  # 0 and 1: the one legacy default stream
        "1,10:00:00.000005,free,0x1000,100,0x2",
        "2,10:00:00.000006,free,0x2000,100,0x2",
    )
    assert (t.threads, t.streams) == (2, 3)
    assert t.stream_handles == [2, 2, 0]
    assert {r[4] for r in t.records if r[3] == 0} == {0, 2} and {r[4] for r in t.records if r[3] == 1} == {
        1,
        2,
    }
    for native in (True, False):
        assert trace.replay(make_resource("async").resource, t, gap_scale=0, native=native)["events"] == 8


def test_recommend_does_not_call_several_threads_on_one_stream_uncontended() -> None:
    records = [
        (0, 4096, t * 10 + n, t, 0, op) for t in range(4) for n in range(10) for op in (ALLOCATE, FREE)
    ]
    many = recommend.analyse(Trace(records), free_device_bytes=1 << 30)
    assert (many.threads, many.streams, many.preferred) == (4, 1, "async")
    assert not any("no lock is contended" in r for r in many.reasons)
    assert any("4 threads share one stream" in r for r in many.reasons)
    one = recommend.analyse(Trace([r for r in records if r[3] == 0]), free_device_bytes=1 << 30)
    assert any(r.startswith("one thread on one stream: no lock is contended") for r in one.reasons)


def test_threads_and_streams_that_only_free_are_not_counted_as_allocating() -> None:
    # One producer thread allocates on one stream; three consumer threads free on theirs.
    records = []
    for n in range(30):
        records.append((n, (1 + n % 7) << 14, n, 0, 0, ALLOCATE))
        records.append((n + 1, (1 + n % 7) << 14, n, 1 + n % 3, 1 + n % 3, FREE))
    t = Trace(records)
    assert (t.threads, t.streams) == (4, 4)  # the replay runs them all
    one = recommend.analyse(t, free_device_bytes=1 << 30)
    assert (one.threads, one.streams, one.preferred) == (1, 1, "async")
    assert one.reasons[0].startswith(
        "1 thread(s) and 1 stream(s) allocate, 3 more thread(s) and 3 more stream(s) only free; 30 allocations"
    )
    assert not any(r.startswith("many threads and streams") for r in one.reasons)
    assert any(
        r.startswith("one thread allocates, on one stream: only the frees of the 3 other")
        for r in one.reasons
    )
    # The frees on other streams still count as memory handed over.
    assert recommend.HANDOFF in one.candidates and one.cross_stream_frees == 30
    # Four producers on four streams, four consumers: many threads and streams allocate.
    many = [(n, 4096, n, n % 4, n % 4, ALLOCATE) for n in range(40)]
    many += [(n + 1, 4096, n, 4 + n % 4, 4 + n % 4, FREE) for n in range(40)]
    four = recommend.analyse(Trace(many), free_device_bytes=1 << 30)
    assert (four.threads, four.streams, four.preferred) == (4, 4, "pool(async)")
    assert four.reasons[0].startswith("4 thread(s) and 4 stream(s) allocate, 4 more thread(s) and 4 more")


# --- 4. only the threads and streams with replayed events count -------------------------


def test_threads_and_streams_without_replayed_events_do_not_count(tmp_path: Path) -> None:
    t = log_of(
        tmp_path,
        "9,10:00:00.000001,allocate failure,0x0,100,0x5",  # not replayed
        "8,10:00:00.000002,allocate,0x7000,0,0x6",  # nothing allocated: not replayed
        "7,10:00:00.000003,free,0x9000,100,0x7",  # allocated before the log: not replayed
        "1,10:00:00.000004,allocate,0x1000,100,0x1000",
        "1,10:00:00.000005,free,0x1000,100,0x1000",
    )
    assert (t.threads, t.streams, t.thread_ids, t.stream_handles) == (1, 1, [1], [0x1000])
    assert (t.recorded_failures, t.unmatched_frees) == (1, 1)
    profile_ = recommend.analyse(t, free_device_bytes=1 << 30)
    assert (profile_.threads, profile_.streams) == (t.threads, t.streams)


def test_replay_says_which_lines_of_the_log_it_does_not_replay(tmp_path: Path) -> None:
    log_of(
        tmp_path,
        "9,10:00:00.000001,allocate failure,0x0,100,0x5",
        "7,10:00:00.000003,free,0x9000,100,0x7",
        "1,10:00:00.000004,allocate,0x1000,100,0x1000",
        "1,10:00:00.000005,free,0x1000,100,0x1000",
    )
    done = cli("replay", str(tmp_path / "app.log"), "--resources", "async", "--quick")
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    assert "not replayed: 1 allocation(s) that failed when recorded and 1 free(s) of memory" in out, out


def test_a_trace_counts_the_threads_and_streams_its_records_use() -> None:
    # Labels need not be 0..N-1: both replayers make one thread and stream per label.
    t = Trace(
        [
            (0, 64, 0, 0, 3, ALLOCATE),
            (0, 64, 1, 5, 7, ALLOCATE),
            (0, 64, 0, 0, 3, FREE),
            (0, 64, 1, 5, 7, FREE),
        ]
    )
    assert (t.threads, t.streams) == (2, 2)
    for native in (True, False):
        result = trace.replay(make_resource("async").resource, t, gap_scale=0, native=native)
        assert result["events"] == 4 and result["peak_live_bytes"] in (64, 128)  # as the threads ran


# --- 5. an address allocated again while live ---------------------------------------------


def test_an_allocation_whose_address_is_allocated_again_is_freed_at_the_end(tmp_path: Path) -> None:
    t = log_of(
        tmp_path,
        "1,10:00:00.000001,allocate,0x1000,100,0",
        "1,10:00:00.000002,allocate,0x1000,200,0",  # the free of the first is missing
        "1,10:00:00.000003,free,0x1000,200,0",
    )
    assert t.closing_frees == 1 and t.events == 4
    assert [(r[1], r[2], r[5]) for r in t.records] == [
        (100, 0, ALLOCATE),
        (200, 1, ALLOCATE),
        (200, 1, FREE),
        (100, 0, FREE),
    ]
    for native in (True, False):
        stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
        result = trace.replay(stats, t, gap_scale=0, native=native)
        assert (result["events"], result["peak_live_bytes"]) == (4, 300)
        assert stats.allocation_counts.current_count == 0  # nothing left allocated


# --- 6. forked children are not logged -----------------------------------------------------

FORK_PROGRAM = """\
import os, streampool
b = streampool.DeviceBuffer(size=123)
pid = os.fork()
if pid == 0:
    try:  # a child of a process that used the device cannot (it is told to spawn instead)
        streampool.DeviceBuffer(size=777).close()
        os._exit(9)
    except streampool.UnsupportedError:
        os._exit(0)
_, status = os.waitpid(pid, 0)
b.close()
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.nosim
def test_a_forked_child_is_not_logged(tmp_path: Path) -> None:
    program, log = tmp_path / "prog.py", tmp_path / "app.log"
    program.write_text(FORK_PROGRAM)
    child = cli("profile", "-o", str(log), "--", sys.executable, str(program))
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    sizes = [line.split(",")[4] for line in log.read_text().splitlines()[1:]]
    assert sizes == ["123", "123"]


# --- 7. the Python replayer reports the log's peak, in recorded order ---------------------


def test_the_replayers_measure_their_own_peak_and_the_log_keeps_its_own() -> None:
    # Recorded: thread 0's 100 bytes are freed before thread 1 allocates 200: a peak of 200.
    # Replayed on two threads with no gaps, the two may overlap or not: each replayer
    # reports the peak it measured (200 or 300), never more than both, never less than one.
    records = [
        (0, 100, 0, 0, 0, ALLOCATE),
        (1, 100, 0, 0, 0, FREE),
        (2, 200, 1, 1, 1, ALLOCATE),
        (3, 200, 1, 1, 1, FREE),
    ]
    t = Trace(records)
    base = mr.CudaAsyncMemoryResource()
    # The replay holds both at once: each free waits until both threads are in a free.
    both_freeing = threading.Barrier(2, timeout=60)

    def deallocate(ptr: int, size: int, stream: Any) -> None:
        both_freeing.wait()
        base.deallocate(ptr, size, stream)

    held = mr.CallbackMemoryResource(base.allocate, deallocate)
    python = trace.replay(held, t, gap_scale=0, native=False)
    native = trace.replay(base, t, gap_scale=0, native=True)
    assert trace.recorded_peak(records) == 200
    assert python["peak_live_bytes"] in (200, 300) and native["peak_live_bytes"] in (200, 300)
    assert python["peak_live_measured"] and native["peak_live_measured"]


# --- 8. the workloads' streams: one per thread by default --------------------------------


def test_the_workloads_have_one_stream_per_thread_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_resource("pool(async)")
    assert workloads.run("window", pool, threads=4, allocations=10)["streams"] == 4
    assert workloads.run("random", pool, threads=3, allocations=10)["streams"] == 3
    assert workloads.run("window", pool, threads=4, streams=2, allocations=10)["streams"] == 2
    assert workloads.window_trace(10, threads=4).streams == workloads.random_trace(10, threads=4).streams == 4
    made: list[object] = []
    real = workloads.Stream

    def counted() -> object:
        made.append(real())
        return made[-1]

    monkeypatch.setattr(workloads, "Stream", counted)
    workloads.run("multistream", pool, threads=3, iterations=2, size="4KiB")
    assert len(made) == 3
    with pytest.raises(ValueError, match="streams must be at least 0"):
        workloads.run("window", pool, streams=-1)


def test_both_replayers_take_a_frees_size_0_as_the_allocations() -> None:
    """The record format lets a free give size 0 (the allocation's is meant)."""
    t = trace.Trace([(0, 4096, 1, 0, 0, trace.ALLOCATE), (10, 0, 1, 0, 0, trace.FREE)])
    for native in (True, False):
        result = trace.replay(make_resource("async").resource, t, gap_scale=0, native=native)
        assert result["events"] == 2 and result["peak_live_bytes"] == 4096, (native, result)


def test_the_hand_off_share_counts_the_programs_own_frees(tmp_path: Path) -> None:
    # 20 allocations never freed (closed by the trace on their own stream), then 2 handed
    # from stream 0x10 to 0x20: all of the program's frees are on another stream.
    never = [f"1,10:00:00.{i:06d},allocate,0x{i + 1:x}00000,4096,0x10" for i in range(20)]
    handed = [
        "1,10:00:01.000000,allocate,0x7000000,1048576,0x10",
        "2,10:00:01.000001,free,0x7000000,1048576,0x20",
        "1,10:00:01.000002,allocate,0x7100000,1048576,0x10",
        "2,10:00:01.000003,free,0x7100000,1048576,0x20",
    ]
    t = log_of(tmp_path, *never, *handed)
    assert t.closing_frees == 20
    profile_ = recommend.analyse(t, free_device_bytes=1 << 30)
    assert recommend.HANDOFF in profile_.candidates
    assert any("(100% of frees)" in r for r in profile_.reasons)


def test_a_log_with_more_threads_than_the_replayer_runs_is_refused_as_bad_input(tmp_path: Path) -> None:
    lines = [f"{n},10:00:00.000001,allocate,0x{n:x}000,256,0x0" for n in range(1, workloads.MAX_THREADS + 2)]
    log = tmp_path / "many.log"
    log.write_text(HEADER + "\n".join(lines) + "\n")
    proc = cli("replay", str(log), "--resources", "cuda")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3 and "the log has 1025 threads" in err and "at most 1024" in err, err
    with pytest.raises(ValueError, match="the log has 1025 threads"):
        workloads.replay(make_resource("cuda"), log=str(log))
