"""The harness at its edges: runs are independent of what earlier runs
left in the device's pool; a replay whose allocations ran out of memory on several
threads reports no live peak it did not reach (nor copies one into reserved); stress
charges each resource with its own races only; profile passes SIGTERM and SIGHUP on to
the program and refuses a Python script that does not exist (127); bench and replay exit
4 when every allocation ran out of memory; the rich table never breaks a number; a spec
option given twice is refused."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import streampool
from streampool import mr
from streampool.harness import bench, profile, stress, trace
from streampool.harness.output import Output
from streampool.harness.specs import Candidate, SpecError, make_resource, parse_spec
from streampool.harness.trace import ALLOCATE, FREE, Trace

from .test_harness_cli import valid

SCHEMA = Path(streampool.__file__).parent / "harness" / "schema.json"
HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


def cli(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    """``python -m streampool ARGS`` on the simulated device."""
    return subprocess.run(
        [sys.executable, "-m", "streampool", *args],
        env=dict(os.environ, STREAMPOOL_DEVICE="sim", **environ),
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- 2. runs are independent: the device's pool keeps nothing from an earlier run -------


def test_async_does_not_report_what_an_earlier_run_left_in_the_device_pool() -> None:
    # The sharded pool takes 64 MiB from the device's pool and gives it back when
    # collected; the device's pool kept it (release threshold at the maximum), and async,
    # run next on that pool, read it as its own reserved bytes.
    runs, _ = bench.measure(
        "window", ["pool(async, initial=64MiB)", "async"], repeats=1, params={"allocations": 50}
    )
    first, second = runs
    assert (first["resource"], second["resource"]) == ("pool(async, initial=64MiB)", "async")
    assert first["peak_reserved_bytes"] >= 64 << 20
    assert second["peak_live_bytes"] <= second["peak_reserved_bytes"] < 32 << 20, second


def test_cuda_after_async_finds_the_memory_async_freed() -> None:
    # On the 256 MiB device: async frees 160 MiB into the device's pool, which kept it, and
    # cuda, outside that pool, then ran out of memory.
    t = Trace([(0, 160 << 20, 0, 0, 0, ALLOCATE), (0, 160 << 20, 0, 0, 0, FREE)])
    runs, _ = bench.measure("replay", ["async", "cuda"], repeats=1, params={"log": t, "gap_scale": 0.0})
    assert [(r["resource"], r["oom_events"]) for r in runs] == [("async", 0), ("cuda", 0)]
    assert mr.CudaAsyncMemoryResource().reserved_bytes == 0  # trimmed after the run too


def test_async_reserved_leaves_out_what_others_hold_in_the_shared_pool() -> None:
    # 64 MiB allocated from the device's pool by someone else, live through the run: not
    # the run's, though the pool holds it (and trimming cannot release it).
    shared = mr.CudaAsyncMemoryResource()
    stream = streampool.Stream()
    ptr = shared.allocate(64 << 20, stream)
    try:
        (run,), _ = bench.measure("window", ["async"], repeats=1, params={"allocations": 50})
    finally:
        shared.deallocate(ptr, 64 << 20, stream)
        stream.synchronize()
    assert run["peak_live_bytes"] <= run["peak_reserved_bytes"] < 32 << 20, run
    assert make_resource("async").shared_pool is not None
    assert make_resource("stats(async)").shared_pool is not None
    assert make_resource("async(initial=1MiB)").shared_pool is None  # a pool of its own
    assert make_resource("pool(async)").shared_pool is None  # the sharded pool's own size


# --- 3. a replay with failed allocations on several threads: the live peak it reached ----


def _two_threads_one_too_large() -> Trace:
    """Thread 0 allocates 1 PiB (always out of memory) and 1 KiB (a); thread 1 allocates
    1 KiB (b), then frees a (waiting until a exists) and b: when a's free is called both
    are live, whatever the threads' pace, so the replay's own peak is exactly 2 KiB."""
    return Trace(
        [
            (0, 1 << 50, 0, 0, 0, ALLOCATE),
            (0, 1024, 1, 0, 0, ALLOCATE),
            (0, 1024, 2, 1, 1, ALLOCATE),
            (0, 1 << 50, 0, 0, 0, FREE),
            (0, 1024, 1, 1, 1, FREE),
            (0, 1024, 2, 1, 1, FREE),
        ]
    )


@pytest.mark.parametrize("native", [True, False])
def test_a_replay_on_threads_with_failed_allocations_reports_the_peak_it_reached(native: bool) -> None:
    if native and not trace.native_replay_available():
        pytest.skip("this build has no native replayer")
    result = trace.replay(mr.CudaMemoryResource(), _two_threads_one_too_large(), gap_scale=0.0, native=native)
    assert (result["oom_events"], result["peak_live_bytes"], result["peak_live_measured"]) == (1, 2048, True)
    # On one thread too: the log's peak less the failure.
    one = Trace([(0, 1 << 50, 0, 0, 0, ALLOCATE), (0, 1024, 1, 0, 0, ALLOCATE), (0, 1024, 1, 0, 0, FREE)])
    result = trace.replay(mr.CudaMemoryResource(), one, gap_scale=0.0, native=native)
    assert (result["oom_events"], result["peak_live_bytes"], result["peak_live_measured"]) == (1, 1024, True)


def test_a_resource_holding_only_what_is_live_reports_the_measured_peak_as_reserved() -> None:
    params = {"log": _two_threads_one_too_large(), "gap_scale": 0.0}
    _, summary = bench.measure("replay", ["cuda", "async"], threads=[2], streams=2, repeats=1, params=params)
    cuda, driver_pool = summary
    assert (cuda["resource"], cuda["peak_live_bytes"], cuda["peak_reserved_bytes"]) == ("cuda", 2048, 2048)
    assert driver_pool["peak_live_bytes"] == 2048 and driver_pool["peak_reserved_bytes"] is not None


@pytest.mark.nosim
def test_replay_cli_shows_the_live_peak_reached_not_the_log_s(tmp_path: Path) -> None:
    log = tmp_path / "oom.log"
    log.write_text(
        HEADER
        + "1,0.001,allocate,0x1000,1125899906842624,0\n"
        + "1,0.002,allocate,0x2000,1024,0\n"
        + "2,0.003,allocate,0x3000,1024,7\n"
        + "1,0.004,free,0x1000,1125899906842624,0\n"
        + "1,0.005,free,0x2000,1024,0\n"
        + "2,0.006,free,0x3000,1024,7\n"
    )
    out = cli("replay", str(log), "--resources", "cuda,async", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = valid(out.stdout)
    for row in doc["summary"]:  # 1 or 2 KiB, as the threads ran; never the failed 1 PiB
        assert row["oom_events"] == 1 and 1024 <= row["peak_live_bytes"] <= 2048, row
    cuda = {r["resource"]: r for r in doc["summary"]}["cuda"]
    assert cuda["peak_reserved_bytes"] == cuda["peak_live_bytes"]


# --- 4. stress: each resource's own races ------------------------------------------------


@pytest.mark.races_expected
def test_stress_does_not_charge_a_resource_with_an_earlier_resource_s_races(sim: Any) -> None:
    upstream = mr.CudaMemoryResource()
    free: list[int] = []  # a cache that hands a freed 4 KiB block to any stream at once

    def allocate(size: int, stream: Any) -> int:
        return free.pop() if free else upstream.allocate(4096, stream)

    racy = Candidate("racy", mr.CallbackMemoryResource(allocate, lambda p, n, s: free.append(p)), "")
    first = stress.run(racy, seconds=60, threads=1, streams=2, max_size="4KiB", operations=200, sim=sim)
    assert first["races"] and not first["ok"]
    second = stress.run(
        make_resource("pool(async)"),
        seconds=60,
        threads=1,
        streams=2,
        max_size="4KiB",
        operations=200,
        sim=sim,
    )
    assert second["races"] == [] and second["ok"], second


# --- 5. profile passes SIGTERM and SIGHUP on to the program ------------------------------

SLEEPER = """\
import os, sys, time, streampool
buf = streampool.DeviceBuffer(size=4096)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.nosim
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_profile_passes_a_stop_signal_on_to_the_program(tmp_path: Path, signum: int) -> None:
    prog, pid_file = tmp_path / "sleeper.py", tmp_path / "pid"
    prog.write_text(SLEEPER)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streampool",
            "profile",
            "-o",
            str(tmp_path / "x.log"),
            "--",
            sys.executable,
            str(prog),
            str(pid_file),
        ],
        env=dict(os.environ, STREAMPOOL_DEVICE="sim"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid = 0
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signum, err
        assert f"the program exited with status {128 + signum}" in err
        assert not _alive(pid), "the program was left running"
    finally:
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_profile_wait_puts_the_signal_handlers_back() -> None:
    def mine(signum: int, frame: Any) -> None:
        pass

    before = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        assert profile.wait([sys.executable, "-c", "pass"], dict(os.environ)) == 0
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is mine
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


# --- 6. a Python script that does not exist cannot start (127) ----------------------------


def test_the_script_of_a_command_line() -> None:
    assert profile.script(["prog.py", "-v"]) == "prog.py"
    assert profile.script(["python", "prog.py"]) == "prog.py"
    assert profile.script(["/usr/bin/python3.12", "-u", "-X", "dev", "app"]) == "app"
    assert profile.script([sys.executable, "-Wignore", "prog.py"]) == "prog.py"
    for argv in (["python", "-m", "pytest"], ["python", "-c", "pass"], ["python"], ["pytest", "a.py"], []):
        assert profile.script(argv) is None, argv


@pytest.mark.nosim
def test_profile_of_a_missing_script_exits_127_without_the_nothing_allocated_hint(tmp_path: Path) -> None:
    log = str(tmp_path / "x.log")
    for args in (
        ("profile", "-o", log, "--", "no_such_script.py"),
        ("profile", "-o", log, "--", "python", "no_such_script.py", "arg"),
        ("recommend", "--", "no_such_script.py"),
    ):
        out = cli(*args)
        assert out.returncode == 127, (args, out.stderr)
        assert "cannot run 'no_such_script.py': No such file or directory" in out.stderr
        assert "nothing allocated" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.nosim
def test_a_program_that_fails_is_not_told_it_allocated_nothing(tmp_path: Path) -> None:
    prog = tmp_path / "fails.py"
    prog.write_text("import sys\nsys.exit(3)\n")
    out = cli("profile", "-o", str(tmp_path / "x.log"), "--", "python", str(prog))
    assert out.returncode == 3 and "exited with status 3" in out.stderr
    assert "nothing allocated" not in out.stderr
    prog.write_text("print('no allocation')\n")
    out = cli("profile", "-o", str(tmp_path / "x.log"), "--", "python", str(prog))
    assert out.returncode == 0 and "nothing allocated" in out.stderr  # the hint, where it applies


# --- 7. bench and replay: every allocation out of memory is exit 4 -----------------------


@pytest.mark.nosim
def test_bench_and_replay_exit_4_when_every_allocation_ran_out_of_memory(tmp_path: Path) -> None:
    message = "nothing measured: every allocation ran out of memory on every resource"

    def multistream(size: str, resources: str) -> subprocess.CompletedProcess[str]:
        return cli(
            "bench",
            "multistream",
            "--quick",
            "--repeats",
            "1",
            "--param",
            f"size={size}",
            "--resources",
            resources,
        )

    out = multistream("1PiB", "async,cuda")
    assert out.returncode == 4 and message in out.stderr, out.stderr
    log = tmp_path / "big.log"
    log.write_text(
        HEADER + "1,0.001,allocate,0x1000,1125899906842624,0\n1,0.002,free,0x1000,1125899906842624,0\n"
    )
    out = cli("replay", str(log), "--repeats", "1", "--json")
    assert out.returncode == 4 and message in out.stderr, out.stderr
    assert all(r["oom_events"] == 1 for r in valid(out.stdout)["summary"])  # the document stands
    # One resource that ran: exit 0.
    out = multistream("64MiB", "limit(async, limit=1MiB),async")
    assert out.returncode == 0, out.stderr
    # The resource that measured no call shows no latencies (the percentiles of none are 0).
    row = next(line for line in out.stdout.splitlines() if line.startswith("limit(async"))
    assert " ns" not in row and " us" not in row, row


# --- 8. the rich table never breaks a number --------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


ROWS = [
    [
        "async",
        "1",
        "181.71k [181.71k-181.71k]",
        "0",
        "1.00 [1.00-1.00]",
        "93.5%",
        "194 ns / 517 ns",
        "5.08 ms",
        "10.4 MiB / 12.0 MiB",
        "-",
    ],
    [
        "pool(async)",
        "1",
        "704.12k [704.12k-704.12k]",
        "0",
        "3.88 [3.88-3.88]",
        "41.1%",
        "53 ns / 90 ns",
        "998.1 us",
        "10.4 MiB / 12.3 MiB",
        "0/0",
    ],
]
COLUMNS = [
    "resource",
    "threads",
    "events/s median [min-max]",
    "OOM",
    "ratio to first",
    "alloc share",
    "alloc p50 / p99",
    "longest call",
    "peak live / reserved",
    "syncs/waits",
]


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_table_keeps_every_cell_on_one_line(width: int) -> None:
    rich_console = pytest.importorskip("rich.console")
    stream = _Terminal()
    out = Output(stream=stream)
    out.console = rich_console.Console(file=stream, width=width, force_terminal=True, color_system=None)
    out.table("bench window", COLUMNS, ROWS)
    text = stream.getvalue()
    for row in ROWS:
        for cell in row:
            assert cell in text, (cell, text)
    assert ("┃" in text) == (width == 200), text  # rich's table where it fits, else plain text


# --- 9. a spec option given twice --------------------------------------------------------


def test_a_spec_option_given_twice_is_refused() -> None:
    with pytest.raises(SpecError, match="the option 'initial' of pool is given twice"):
        parse_spec("pool(async, initial=8GiB, initial=1MiB)")
    with pytest.raises(SpecError, match="the option 'limit' of limit is given twice"):
        make_resource("limit(pool(async), limit=1MiB, limit=2MiB)")
    assert (
        str(parse_spec("pool(async, initial=8GiB, maximum=16GiB)"))
        == "pool(async, initial=8GiB, maximum=16GiB)"
    )
