"""The harness's commands on bad input, out of memory and Ctrl-C (subprocesses on the
simulated device): one line saying what is wrong, the documented exit status, no
traceback, and nothing run that the error makes pointless."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import streampool

pytestmark = pytest.mark.nosim

SCHEMA = Path(streampool.__file__).parent / "harness" / "schema.json"
HEADER = "Thread,Time,Action,Pointer,Size,Stream"
PROGRAM = """\
import streampool
buf = streampool.DeviceBuffer(size=4096)
del buf
print("output of the program")
"""


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streampool", *args],
        env=dict(os.environ, STREAMPOOL_DEVICE="sim", **(env or {})),
        capture_output=True,
        text=True,
        timeout=120,
    )


def failed(out: subprocess.CompletedProcess[str], code: int, message: str) -> None:
    """``out`` exited with ``code``, saying ``message`` in one line of stderr, no traceback."""
    assert out.returncode == code, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if message in line]
    assert lines, out.stderr


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    return path


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- 1: recommend --json prints the document alone ------------------------------------------


def test_recommend_json_of_a_program_keeps_the_program_output_off_stdout(program: Path) -> None:
    out = run("recommend", "--json", "--quick", "--", sys.executable, str(program))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["command"] == "recommend"
    assert "output of the program" in out.stderr


# --- 2: out of memory -----------------------------------------------------------------------


def test_recommend_when_every_candidate_runs_out_of_memory(tmp_path: Path) -> None:
    # One 20 GiB allocation on the 16 GiB simulated device: managed memory is the only
    # candidate, and it runs out too.
    log = write(
        tmp_path,
        "over.log",
        f"{HEADER}\n1,1.0,allocate,0x1000,21474836480,0x10\n1,1.1,free,0x1000,21474836480,0x10\n",
    )
    out = run("recommend", log, "--quick")
    failed(out, 4, "every candidate ran out of memory replaying the log: prefetch(managed) (2 failed")
    assert "Recommended" not in out.stdout and "OOM" in out.stdout
    # With --json the measurements still come out, as a document with no recommendation.
    out = run("recommend", log, "--quick", "--json")
    failed(out, 4, "every candidate ran out of memory")
    document = json.loads(out.stdout)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(document, json.loads(SCHEMA.read_text()))
    assert document["recommendation"] is None and "every candidate ran out of memory" in document["error"]
    assert document["summary"] and all(row["oom_events"] == 2 for row in document["summary"])


def test_usage_mistakes_a_user_makes_are_refused_before_anything_runs(tmp_path: Path) -> None:
    log = write(
        tmp_path, "app.log", f"{HEADER}\n1,1.0,allocate,0x1000,4096,0x10\n1,1.1,free,0x1000,4096,0x10\n"
    )
    # -o names where a profiled program's log goes: with a log it would be ignored.
    out = run("recommend", "-o", str(tmp_path / "kept.log"), log, "--quick")
    failed(out, 2, "-o names where a profiled program's log goes")
    assert not (tmp_path / "kept.log").exists()
    # --param streams=N: --streams takes one number.
    out = run("bench", "window", "--param", "streams=2", "--quick")
    failed(out, 2, "give it as --streams N")
    out = run("bench", "window", "--param", "threads=2", "--quick")
    failed(out, 2, "give it as --threads (a list")


def test_bench_counts_no_throughput_for_failed_allocations() -> None:
    # Every allocation runs out of memory: the document is printed, and the exit status is
    # 4 (nothing measured).
    out = run("bench", "multistream", "--resources", "limit(async, limit=1KiB)", "--quick", "--json")
    assert out.returncode == 4, out.stderr
    assert "every allocation ran out of memory on every resource" in out.stderr
    (row,) = json.loads(out.stdout)["summary"]
    assert row["oom_events"] == 2 * 20 and row["throughput"]["max"] == 0


# --- 3, 9: profile: a log that cannot be written, a program that cannot start ---------------


def test_profile_refuses_a_log_it_cannot_write_before_running_the_program(
    tmp_path: Path, program: Path
) -> None:
    out = run("profile", "-o", str(tmp_path / "no" / "such" / "x.log"), "--", sys.executable, str(program))
    failed(out, 3, "cannot write the log")
    assert "output of the program" not in out.stdout


def test_profile_never_replaces_what_is_not_a_file(tmp_path: Path, program: Path) -> None:
    # `-o /dev/null` removed the device node and put a file in its place (as root).
    fifo, target, link = tmp_path / "pipe", tmp_path / "target.log", tmp_path / "link.log"
    os.mkfifo(fifo)
    target.write_text("kept")
    link.symlink_to(target)
    for log in (fifo, link, tmp_path):
        out = run("profile", "-o", str(log), "--", sys.executable, str(program))
        failed(out, 3, "is not a file")
        assert "output of the program" not in out.stdout
    assert fifo.is_fifo() and link.is_symlink() and target.read_text() == "kept"
    (tmp_path / "old.log.dev1").mkdir()  # an earlier run's log of device 1 that is not a file
    failed(
        run("profile", "-o", str(tmp_path / "old.log"), "--", sys.executable, str(program)),
        3,
        "is not a file",
    )
    assert (tmp_path / "old.log.dev1").is_dir()


def test_profile_never_replaces_a_file_that_is_not_a_log(tmp_path: Path, program: Path) -> None:
    # `-o app.py` (a program's source named by mistake) was replaced with an empty log.
    source = tmp_path / "keep.py"
    source.write_text("print(1)\n")
    out = run("profile", "-o", str(source), "--", sys.executable, str(program))
    failed(out, 3, f"{source} exists and is not an allocation log (its first line is not 'Thread,Time,")
    assert "output of the program" not in out.stdout and source.read_text() == "print(1)\n"
    # An old log (or an empty file, or one cut short in its header) is replaced.
    for old in ("", "Thread,Ti", "\ufeffThread,Time,Action,Pointer,Size,Stream\n1,2,allocate,0x1,8,0x0\n"):
        log = tmp_path / "old.log"
        log.write_text(old)
        assert run("profile", "-o", str(log), "--", sys.executable, str(program)).returncode == 0
        assert log.read_text().startswith("Thread,Time,Action")


@pytest.mark.parametrize("recommend", [False, True])
def test_a_program_that_cannot_start_leaves_the_old_logs(tmp_path: Path, recommend: bool) -> None:
    # The old log and its LOG.devN went before the program was found not to exist.
    log, dev1 = tmp_path / "k.log", tmp_path / "k.log.dev1"
    for path in (log, dev1):
        path.write_text("Thread,Time,Action,Pointer,Size,Stream\n")
    command = ("recommend", "--quick") if recommend else ("profile",)
    out = run(*command, "-o", str(log), "--", "streampool-no-such-program")
    failed(out, 127, "cannot run 'streampool-no-such-program': No such file or directory")
    out = run(*command, "-o", str(log), "--", str(tmp_path))  # a directory
    failed(out, 127, "Permission denied")
    assert log.exists() and dev1.exists()


def test_a_python_without_streampool_is_named_before_anything_runs(tmp_path: Path, program: Path) -> None:
    # `profile -- python app.py` with a `python` on PATH that lacks streampool: refused
    # with the interpreter named, before the old log goes.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    other = bin_dir / "python3"
    other.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')  # no site-packages: no streampool
    other.chmod(0o755)
    old = tmp_path / "app.log"
    old.write_text("Thread,Time,Action,Pointer,Size,Stream\n")
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
    out = run("profile", "-o", str(old), "--", "python3", str(program), env={"PATH": path})
    failed(out, 127, f"the program's Python, 'python3' ({other}), cannot import streampool (")
    assert "install streampool there" in out.stderr and sys.executable in out.stderr
    assert old.exists() and "output of the program" not in out.stdout


def test_the_shim_stops_a_program_it_cannot_profile(tmp_path: Path) -> None:
    from streampool.harness.profile import SHIM

    paths = [str(SHIM), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, STREAMPOOL_DEVICE="sim", PYTHONPATH=os.pathsep.join(paths))
    env["STREAMPOOL_PROFILE_LOG"] = str(tmp_path / "no" / "such" / "x.log")
    out = subprocess.run(
        [sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 127 and "ran" not in out.stdout
    assert "could not install the logging adaptor, so the program was not run" in out.stderr


def test_profile_of_a_program_that_is_not_executable(tmp_path: Path) -> None:
    script = tmp_path / "notexec.sh"
    script.write_text("echo hello\n")
    script.chmod(0o644)
    out = run("profile", "-o", str(tmp_path / "x.log"), "--", str(script))
    failed(out, 127, f"cannot run '{script}': Permission denied")
    assert "exited with status" not in out.stderr


# --- 4: workload parameters out of range ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bench", "pipeline", "--param", "chunks=-1"), "chunks must be at least 1, not -1"),
        (("bench", "pipeline", "--param", "chunks=0"), "chunks must be at least 1, not 0"),
        (("bench", "larger-than-memory", "--param", "chunk_size=0"), "chunk_size must be at least 8 bytes"),
        (("bench", "larger-than-memory", "--param", "passes=0"), "passes must be at least 1, not 0"),
        (("bench", "window", "--param", "allocations=0"), "allocations must be at least 1, not 0"),
        (("bench", "random", "--param", "allocations=-5"), "allocations must be at least 1, not -5"),
        (("bench", "window", "--param", "window=-1"), "window must be at least 1, not -1"),
        (("bench", "multistream", "--param", "iterations=0"), "iterations must be at least 1, not 0"),
        (("bench", "random", "--param", "max_size=0"), "max_size must be at least 1 byte, not 0"),
        (("stress", "--max-size", "0"), "expected a size of at least 1 byte, e.g. 1MiB, not '0'"),
        (("stress", "--seconds", "inf"), "positive number of seconds (a finite one), not 'inf'"),
        (("stress", "--seconds", "nan"), "positive number of seconds (a finite one), not 'nan'"),
        (
            ("replay", "app.log", "--max-lead", "-1"),
            "expected milliseconds (finite, 0 or more) or none, not '-1'",
        ),
        (("recommend", "app.log", "--max-lead", "inf"), "expected milliseconds (finite, 0 or more) or none"),
        (("bench", "replay", "--log", "app.log", "--param", "max_lead=-1"), "max_lead must be at least 0"),
        # Thread counts: bounded (each is a thread), each once (each is a run), none empty.
        (("bench", "window", "--threads", "99999999999"), "threads must be at most 1024, not 99999999999"),
        (("bench", "random", "--threads", "1,1025"), "threads must be at most 1024, not 1025"),
        (("bench", "window", "--threads", "4,4"), "expected distinct integers (each is one run), not '4,4'"),
        (
            ("bench", "window", "--threads", "1,,4"),
            "expected comma-separated integers, e.g. 1,4,16, not '1,,4'",
        ),
        (("stress", "--threads", "1025"), "expected at most 1024 threads, not '1025'"),
    ],
)
def test_parameters_out_of_range_are_usage_errors(args: tuple[str, ...], message: str) -> None:
    out = run(*args)
    failed(out, 2, message)
    assert "Device:" not in out.stdout  # refused before anything ran


# --- 5, 6, 7: logs with bad times, no events ------------------------------------------------

BIGTIME = f"{HEADER}\n1,0,allocate,0x1000,4096,0\n1,99999999999,free,0x1000,4096,0\n"
WEIRDTIME = f"{HEADER}\n1,-5,allocate,0x1000,4096,0\n1,1e300,free,0x1000,4096,0\n"


@pytest.mark.parametrize("command", ["replay", "recommend", "bench", "plot"])
@pytest.mark.parametrize(("text", "line"), [(BIGTIME, 3), (WEIRDTIME, 2)])
def test_a_time_out_of_range_is_a_malformed_line(tmp_path: Path, command: str, text: str, line: int) -> None:
    log = write(tmp_path, "time.log", text)
    args = ("bench", "replay", "--log", log) if command == "bench" else (command, log)
    out = run(*args, "--quick") if command != "plot" else run(*args)
    failed(out, 3, "malformed line(s)")
    assert "time" in next(x for x in out.stderr.splitlines() if x.strip().startswith(f"line {line}: "))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no events: no allocations to replay (none of 1 byte or more"),
        ("   ", "no events: no allocations to replay"),
        ("\n\n", "no events: no allocations to replay"),
        (f"{HEADER}\n", "no events: no allocations to replay"),
        ("6750,05:24:57.524290,allocate,0x7fbb9503b100,4096,0x1010", "line 1: expected the header"),
        (
            f"{HEADER}\n1,1.0,allocate failure,0x0,64,0\n",
            "no allocations to replay (only 1 failed allocation",
        ),
    ],
)
@pytest.mark.parametrize("command", ["replay", "plot"])
def test_a_log_with_nothing_to_replay_is_refused(
    tmp_path: Path, command: str, text: str, message: str
) -> None:
    log = write(tmp_path, "app.log", text)
    out = run(command, log)
    failed(out, 3, f"{log}: {message}" if "line 1" not in message else message)
    assert "No such file" not in out.stderr


# --- 10: the smaller ones -------------------------------------------------------------------


def test_plot_directory_that_cannot_be_written_is_refused_before_the_benchmark(tmp_path: Path) -> None:
    a_file = write(tmp_path, "not-a-directory", "")
    out = run("bench", "window", "--resources", "async", "--quick", "--json", "--plot", a_file)
    failed(out, 3, f"--plot {a_file}: cannot write plots there: it exists and is not a directory")
    assert out.stdout == ""


def test_plot_to_a_format_matplotlib_lacks_is_refused_before_the_replay(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log = write(tmp_path, "app.log", f"{HEADER}\n1,0,allocate,0x1000,64,0x0\n1,1,free,0x1000,64,0x0\n")
    out = run("plot", log, "-o", str(tmp_path / "x.txt"))
    failed(out, 2, f"-o {tmp_path / 'x.txt'}: matplotlib writes no .txt files; name one of ")
    assert ".png" in out.stderr and not (tmp_path / "x.txt").exists()


def test_options_that_are_workload_parameters_are_named_as_options(tmp_path: Path) -> None:
    log = write(tmp_path, "app.log", f"{HEADER}\n1,0,allocate,0x1000,64,0x0\n1,1,free,0x1000,64,0x0\n")
    for bad in ("-1", "inf", "nan", "x"):
        failed(
            run("replay", log, "--gap-scale", bad),
            2,
            f"--gap-scale: expected a finite number of 0 or more, not '{bad}'",
        )
    failed(
        run("bench", "pipeline", "--quick", "--param", "chunks=999999999999"),
        2,
        "workload 'pipeline': chunks must be at most 4294967296, not 999999999999",
    )
    # A trace built in memory: allocations times threads is bounded as a replay's events are.
    failed(
        run("bench", "window", "--quick", "--param", "allocations=99999999999999999999"),
        2,
        "workload 'window': allocations must be at most 2000000",
    )
    failed(
        run("bench", "random", "--quick", "--param", "allocations=1000000", "--threads", "1,4"),
        2,
        "workload 'random': allocations=1,000,000 on 4 threads is 8,000,000 events, more than 4,000,000 a run",
    )


def test_a_log_of_zero_byte_allocations_says_why_nothing_is_replayed(tmp_path: Path) -> None:
    log = write(tmp_path, "zero.log", f"{HEADER}\n1,0,allocate,0x0,0,0x0\n1,1,free,0x0,0,0x0\n")
    failed(run("replay", log), 3, "no allocations to replay (none of 1 byte or more: a 0-byte allocation")


def test_recommend_of_a_program_that_allocates_nothing_names_no_temporary_file(tmp_path: Path) -> None:
    quiet = write(tmp_path, "quiet.py", "print('nothing allocated')\n")
    out = run("recommend", "--quick", "--", sys.executable, quiet)
    failed(out, 3, "recommend: the program's profile: no events: no allocations to replay")
    assert "streampool-" not in out.stderr.splitlines()[-1], out.stderr


def test_profile_of_a_program_on_a_simulated_device_of_its_own_says_why_nothing_was_logged(
    tmp_path: Path,
) -> None:
    own = write(
        tmp_path,
        "own.py",
        "import streampool\nfrom streampool.sim import SimulatedDevice\n"
        "with SimulatedDevice(capacity_bytes='64MiB'):\n    streampool.DeviceBuffer(size=100)\n",
    )
    out = run("profile", "-o", str(tmp_path / "own.log"), "--", sys.executable, own)
    assert out.returncode == 0, out.stderr
    assert "0 event(s) logged" in out.stderr and "on a simulated device it makes itself" in out.stderr


def test_a_resource_the_device_refuses_to_make_is_named() -> None:
    out = run("bench", "window", "--resources", "async,async(initial=100GiB)", "--quick")
    failed(out, 4, "streampool bench: resource async(initial=100GiB): out of memory")


def test_recommend_of_a_program_leaves_no_temporary_log(tmp_path: Path, program: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = run("recommend", "--quick", "--", sys.executable, str(program), env={"TMPDIR": str(scratch)})
    assert out.returncode == 0, out.stderr
    assert "a temporary log (-o LOG keeps it)" in out.stderr
    assert list(scratch.iterdir()) == []


def test_skip_malformed_says_how_many_lines_it_skipped(tmp_path: Path) -> None:
    log = write(
        tmp_path, "bad.log", f"{HEADER}\n1,1.0,allocate,0x1000,64,0\nnot,a,line\n1,1.1,free,0x1000,64,0\n"
    )
    out = run("replay", log, "--resources", "async", "--repeats", "1", "--skip-malformed")
    assert out.returncode == 0, out.stderr
    assert f"{log}: 1 malformed line(s) skipped" in out.stdout


def test_a_first_line_replayed_in_place_of_a_missing_header_is_not_counted_skipped(tmp_path: Path) -> None:
    log = write(tmp_path, "cut.log", "1,1.0,allocate,0x10,10,0\n1,1.1,allocate,0x20,20,0\n")
    out = run("replay", log, "--resources", "cuda", "--repeats", "1", "--skip-malformed", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["log"]["malformed_lines"] == 0 and doc["log"]["events"] == 4
    assert "malformed line(s) skipped" not in out.stderr + out.stdout
    failed(run("replay", log, "--resources", "cuda"), 3, "expected the header")


def test_a_file_that_is_no_log_is_said_to_be_none(tmp_path: Path) -> None:
    text = write(tmp_path, "passwd", "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/:/bin/sh\n")
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    for path in (text, str(binary)):
        out = run("replay", path, "--resources", "async")
        failed(
            out,
            3,
            f"{path}: not an allocation log (streampool's, from `streampool profile -o LOG`, or RMM's CSV)",
        )
        assert "pass --skip-malformed" not in out.stderr
        assert all(c.isprintable() for line in out.stderr.splitlines() for c in line), out.stderr
    # A log with some good lines still lists its bad ones.
    log = write(tmp_path, "app.log", f"{HEADER}\n1,1.0,allocate,0x1000,64,0\n\x01\x02junk\n")
    out = run("replay", log, "--resources", "async")
    failed(out, 3, "1 malformed line(s) in the allocation log")
    assert "line 3: " in out.stderr and "\x01" not in out.stderr


def test_the_replays_lead_is_in_milliseconds_and_in_the_json(tmp_path: Path) -> None:
    log = write(tmp_path, "app.log", f"{HEADER}\n1,1.0,allocate,0x1000,64,0\n2,1.1,free,0x1000,64,0\n")
    for given, seconds in (("0.5", 0.0005), ("none", None)):
        out = run("replay", log, "--resources", "async", "--repeats", "1", "--json", "--max-lead", given)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["params"]["max_lead"] == seconds
    out = run("recommend", log, "--repeats", "1", "--json")
    assert json.loads(out.stdout)["params"]["max_lead"] == 0.001, out.stderr
    # `bench replay` takes it as a workload parameter, in seconds, `none` for no lead.
    for given, seconds in (("0.002", 0.002), ("none", None)):
        out = run(
            "bench",
            "replay",
            "--log",
            log,
            "--resources",
            "async",
            "--repeats",
            "1",
            "--json",
            "--param",
            f"max_lead={given}",
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["params"]["max_lead"] == seconds, out.stdout


def test_bench_replay_skips_malformed_lines_as_replay_does(tmp_path: Path) -> None:
    log = write(
        tmp_path, "app.log", f"{HEADER}\n1,1.0,allocate,0x1000,64,0\nnot a line\n1,2.0,free,0x1000,64,0\n"
    )
    failed(run("bench", "replay", "--log", log, "--quick"), 3, "pass --skip-malformed")
    out = run("bench", "replay", "--log", log, "--quick", "--resources", "async", "--skip-malformed")
    assert out.returncode == 0, out.stderr
    assert f"{log}: 1 malformed line(s) skipped" in out.stdout


def test_stress_seconds_win_over_quick() -> None:
    out = run("stress", "--seconds", "0.2", "--quick", "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "stress pool(async): 0.2 s" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bench", "replay", "--threads", "2"), "--threads does not apply to the replay workload"),
        (("bench", "replay", "--streams", "2"), "--streams does not apply to the replay workload"),
        (("bench", "pipeline", "--streams", "2"), "--streams does not apply to the pipeline workload"),
        (
            ("bench", "larger-than-memory", "--threads", "1,2"),
            "--threads does not apply to the larger-than-memory workload",
        ),
        (("bench", "window", "--log", "LOG"), "--log is for the replay workload"),
        (("bench", "window", "--skip-malformed"), "--skip-malformed is for the replay workload"),
        # As --param: refused as the option is, not sent to the option.
        (
            ("bench", "replay", "--log", "LOG", "--param", "streams=2"),
            "--param streams=... does not apply to the replay workload",
        ),
        (
            ("bench", "larger-than-memory", "--param", "threads=2"),
            "--param threads=... does not apply to the larger-than-memory workload",
        ),
        (
            ("bench", "replay", "--log", "LOG", "--param", "log=x.log"),
            "give the replay workload's log as --log LOG",
        ),
        # What --param takes is listed without what options give.
        (
            ("bench", "larger-than-memory", "--param", "allocations=1"),
            "its --param parameters: total, chunk_size, passes",
        ),
        (("bench", "replay", "--log", "LOG", "--param", "x=1"), "its --param parameters: gap_scale"),
    ],
)
def test_options_a_workload_ignores_are_refused(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    log = write(tmp_path, "app.log", f"{HEADER}\n1,1.0,allocate,0x1000,64,0\n")
    failed(run(*(log if a == "LOG" else a for a in args), "--quick"), 2, message)


def test_bench_replay_reports_the_logs_own_streams(tmp_path: Path) -> None:
    # Two threads on one stream.
    log = write(
        tmp_path,
        "app.log",
        f"{HEADER}\n1,1.0,allocate,0x1000,64,0x10\n2,1.1,allocate,0x2000,64,0x10\n"
        "1,1.2,free,0x1000,64,0x10\n2,1.3,free,0x2000,64,0x10\n",
    )
    out = run("bench", "replay", "--log", log, "--resources", "async", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["runs"]
    assert (row["threads"], row["streams"], row["events"]) == (2, 1, 4)


# --- 11: Ctrl-C -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("stress", "--seconds", "30", "--threads", "2"),
        ("bench", "pipeline", "--param", "driver=python", "--param", "chunks=100000", "--quick"),
        ("bench", "pipeline", "--param", "driver=native", "--param", "chunks=100000", "--quick"),
    ],
)
def test_ctrl_c_stops_the_threads_and_says_interrupted(args: tuple[str, ...]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "streampool", *args],
        env=dict(os.environ, STREAMPOOL_DEVICE="sim"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("Device:")  # the command runs
    time.sleep(0.3)  # its threads too
    proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - signalled < 10, "stopped at once, not at the run's end"
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == f"streampool {args[0]}: interrupted" and "Traceback" not in err, err
