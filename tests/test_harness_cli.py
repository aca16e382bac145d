"""The harness's commands end to end (subprocesses on the simulated device): output, exit
codes, JSON validated against the schema, profile passing a program through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from streampool.harness.device import Device
from streampool.harness.output import SCHEMA_PATH
from streampool.sim import SimulatedDevice

pytestmark = pytest.mark.nosim

PROGRAM = """\
import sys, threading, streampool
streams = [streampool.Stream() for _ in range(3)]
def work(i):
    bufs = []
    for n in range(30):
        bufs.append(streampool.DeviceBuffer(size=1024 * (1 + n % 5), stream=streams[i]))
        if len(bufs) > 4:
            bufs.pop(0)
threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
for t in threads: t.start()
for t in threads: t.join()
print("output of the program", sys.argv[1:])
print("to stderr", file=sys.stderr)
if "fail" in sys.argv:
    sys.exit(7)
if "crash" in sys.argv:
    raise RuntimeError("the program crashed")
"""


def run(*args: str, cwd: Path | None = None, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STREAMPOOL_DEVICE": "sim", **environ}
    return subprocess.run(
        [sys.executable, "-m", "streampool", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def valid(text: str) -> dict[str, Any]:
    document = json.loads(text)
    try:
        import jsonschema
    except ImportError:  # the test extra has it; a bare GPU machine may not
        assert document["schema"] == "streampool.harness/2"
    else:
        jsonschema.validate(document, json.loads(SCHEMA_PATH.read_text()))
    assert document["device"]["simulated"] is True
    return document


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    return path


@pytest.fixture
def log(tmp_path: Path, program: Path) -> Path:
    out = run("profile", "-o", str(tmp_path / "app.log"), "--", sys.executable, str(program))
    assert out.returncode == 0, out.stderr
    return tmp_path / "app.log"


def test_info_stays_the_default_command() -> None:
    for args in ((), ("info",)):
        out = run(*args)
        assert out.returncode == 0 and "environment report" in out.stdout.splitlines()[0]


def test_larger_than_memory_is_measured_on_managed_memory_by_default() -> None:
    out = run("bench", "larger-than-memory", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    assert [r["resource"] for r in valid(out.stdout)["summary"]] == ["managed", "prefetch(managed)"]
    assert "managed,prefetch(managed) for larger-than-memory" in run("bench", "--help").stdout


def test_a_gpu_is_announced_by_name_and_memory() -> None:
    gpu = Device(
        "CUDA driver 13.0 (1 device)",
        simulated=False,
        name="NVIDIA H100 80GB HBM3",
        total_bytes=85_031_714_816,
    )
    assert gpu.headline() == "NVIDIA H100 80GB HBM3, 79.2 GiB; CUDA driver 13.0 (1 device)"
    unnamed = Device("CUDA driver 13.0 (1 device)", simulated=False)
    assert unnamed.headline() == "CUDA driver 13.0 (1 device)"
    with SimulatedDevice():  # as_json asks the driver's version
        assert (gpu.as_json()["name"], gpu.as_json()["total_bytes"]) == (
            "NVIDIA H100 80GB HBM3",
            85_031_714_816,
        )
        assert unnamed.as_json()["name"] is None


def test_the_simulated_device_takes_its_capacity_from_the_environment() -> None:
    out = run("bench", "random", "--resources", "async", "--quick", "--json", STREAMPOOL_SIM_CAPACITY="96MiB")
    assert out.returncode == 0, out.stderr
    device = valid(out.stdout)["device"]
    assert "(96 MiB)" in device["description"]
    # The measured device by name and size, as a GPU's report gives its card.
    assert (device["name"], device["total_bytes"]) == ("streampool simulated device", 96 << 20)
    # Above that capacity, managed memory runs out: the simulator does not oversubscribe.
    out = run(
        "bench", "larger-than-memory", "--param", "total=128MiB", "--json", STREAMPOOL_SIM_CAPACITY="96MiB"
    )
    assert out.returncode == 0, out.stderr
    assert all(r["oom_events"] > 0 and r["peak_live_bytes"] < 96 << 20 for r in valid(out.stdout)["summary"])
    out = run("bench", "random", "--quick", STREAMPOOL_SIM_CAPACITY="lots")
    assert out.returncode == 2
    assert "the environment variable STREAMPOOL_SIM_CAPACITY is 'lots'" in out.stderr, out.stderr


@pytest.mark.parametrize("workload", ["random", "window", "multistream", "pipeline", "larger-than-memory"])
def test_bench_each_workload_json(workload: str) -> None:
    one = workload == "larger-than-memory"  # one thread and one stream
    specs = "managed,prefetch(managed)" if one else "async,pool(async)"
    threads = () if one else ("--threads", "1,2")
    out = run("bench", workload, "--resources", specs, *threads, "--quick", "--json")
    assert out.returncode == 0, out.stderr
    doc = valid(out.stdout)
    assert doc["command"] == "bench" and doc["workload"] == workload and doc["repeats"] == 2
    counts = 1 if one else 2
    assert len(doc["runs"]) == 2 * 2 * counts and len(doc["summary"]) == 2 * counts
    assert "simulated device" in out.stderr
    if workload == "pipeline":
        # The native pipeline reports the pool's own driver calls per chunk (the driver's
        # pool does not count them).
        calls = {r["resource"]: r["driver_calls_per_chunk"] for r in doc["summary"]}
        assert calls["async"] is None and calls["pool(async)"]["max"] > 0, calls


def test_bench_pipeline_classifies_long_calls_from_native_threads_only() -> None:
    args = ("bench", "pipeline", "--resources", "pool(async)", "--threads", "2", "--quick")
    out = run(*args, "--param", "driver=native", "--param", "long_call_us=0.001", "--json")
    assert out.returncode == 0, out.stderr
    doc = valid(out.stdout)
    (summary,) = doc["summary"]
    long = summary["long_calls"]
    assert long["calls"] == sum(r["long_calls"]["calls"] for r in doc["runs"]) > 0
    assert long["preempted"] + long["slept"] + long["stolen"] + long["on_cpu"] == long["calls"]
    assert sum(long["sampled"].values()) <= long["calls"]
    assert sum(long["running_in"].values()) == long["sampled"]["running"]
    out = run(*args, "--param", "driver=native", "--param", "long_call_us=0.001", "--param", "null_call_us=1")
    assert "calls > 1 ns: preempted/slept/stolen/on CPU" in out.stdout, out.stdout
    assert "null calls > 1 ns: preempted/slept/stolen/on CPU" in out.stdout, out.stdout
    assert "seen in" in out.stdout and "running in" in out.stdout, out.stdout
    # From Python threads a long call is a wait for the GIL as often as not: refused.
    # A usage error, said before anything runs.
    out = run(*args, "--param", "driver=python", "--param", "long_call_us=100")
    assert out.returncode == 2 and "driver=native" in out.stderr, out.stderr
    assert "Device:" not in out.stdout, out.stdout


def test_bench_table_is_plain_text_when_piped_and_says_simulated_device() -> None:
    out = run("bench", "window", "--resources", "async,stats(pool(async))", "--quick")
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout
    assert "simulated device" in out.stdout
    for column in ("ratio to first", "peak live / reserved", "alloc p50 / p99", "syncs/waits"):
        assert column in out.stdout
    assert "stats(pool(async))" in out.stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("bench", "nope"), 2, "unknown workload 'nope'; valid workloads: random, window"),
        (("bench", "random", "--resources", "async,nosuch"), 2, "Valid specs: async"),
        (("bench", "random", "--resources", "rmm:async"), 4, "simulated device"),
        (("bench", "random", "--threads", "0"), 2, "at least 1"),
        (("bench", "random", "--repeats", "0"), 2, "at least 1"),
        (("stress", "--seconds", "-1"), 2, "positive number of seconds"),
        (
            ("bench", "random", "--param", "bogus=1", "--quick"),
            2,
            "takes no parameter 'bogus'; its --param parameters: allocations, ",
        ),
        (("bench", "random", "--param", "threads=2", "--quick"), 2, "give it as --threads"),
        (
            ("bench", "pipeline", "--param", "chunks=abc", "--quick"),
            2,
            "chunks must be an integer, not 'abc'",
        ),
        (
            ("bench", "pipeline", "--param", "kernel_us=x", "--quick"),
            2,
            "kernel_us must be a number, not 'x'",
        ),
        (("bench", "replay"), 2, "--log"),
        (("replay", "/nonexistent/app.log"), 3, "replay: /nonexistent/app.log: No such file or directory"),
        (("recommend", "/tmp"), 3, "recommend: /tmp: Is a directory"),
        (("profile",), 2, "nothing to run"),
        (("bench", "random", "--", "python"), 2, "takes no program"),
    ],
)
def test_bad_input_gets_a_clear_message_and_a_documented_exit_code(
    args: tuple[str, ...], code: int, message: str
) -> None:
    out = run(*args)
    assert out.returncode == code, (out.stdout, out.stderr)
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_profile_passes_output_and_exit_status_through(tmp_path: Path, program: Path) -> None:
    path = tmp_path / "fail.log"
    out = run("profile", "-o", str(path), "--", sys.executable, str(program), "a", "fail")
    assert out.returncode == 7
    assert "output of the program ['a', 'fail']" in out.stdout and "to stderr" in out.stderr
    assert "exited with status 7" in out.stderr
    lines = path.read_text().splitlines()
    assert lines[0] == "Thread,Time,Action,Pointer,Size,Stream" and len(lines) == 1 + 2 * 3 * 30


def test_profile_says_why_a_program_that_sets_its_own_resource_logged_nothing(tmp_path: Path) -> None:
    prog = tmp_path / "own.py"
    prog.write_text(
        "import streampool\nfrom streampool import mr\n"
        "streampool.set_current_device_resource(mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()))\n"
        "bufs = [streampool.DeviceBuffer(size=4096) for _ in range(10)]\n"
    )
    out = run("profile", "-o", str(tmp_path / "own.log"), "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    assert "0 event(s) logged" in out.stderr
    assert "through a resource it sets itself" in out.stderr and "StatisticsResourceAdaptor" in out.stderr


def test_profile_says_why_a_program_that_passes_its_own_resource_logged_nothing(tmp_path: Path) -> None:
    # A resource passed with mr= is used instead of the current device resource, which
    # profile logs: nothing is logged, and the hint names that case.
    prog = tmp_path / "explicit.py"
    prog.write_text(
        "import streampool\nfrom streampool import mr\n"
        "pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())\n"
        "bufs = [streampool.DeviceBuffer(size=4096, mr=pool) for _ in range(10)]\n"
    )
    out = run("profile", "-o", str(tmp_path / "explicit.log"), "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    assert "0 event(s) logged" in out.stderr
    assert "or passes explicitly (mr= to DeviceBuffer" in out.stderr, out.stderr


def test_profile_of_a_crashing_program_keeps_its_partial_log(tmp_path: Path, program: Path) -> None:
    path = tmp_path / "crash.log"
    out = run("profile", "-o", str(path), "--", str(program), "crash")  # prog.py runs under this Python
    assert out.returncode == 1
    assert "RuntimeError: the program crashed" in out.stderr
    assert f"the log keeps the 180 event(s) recorded until then: {path}" in out.stderr
    assert run("replay", str(path), "--quick").returncode == 0


TWO_DEVICES = """\
import sys, streampool
held = [streampool.DeviceBuffer(size=4096) for _ in range(3)]
held += [streampool.DeviceBuffer(size=4096, mr=streampool.get_per_device_resource(1)) for _ in range(2)]
held.clear()
if "fail" in sys.argv:
    sys.exit(5)
"""


def test_profile_names_each_devices_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMPOOL_SIM_DEVICES", "2")
    program = tmp_path / "two.py"
    program.write_text(TWO_DEVICES)
    path = tmp_path / "app.log"
    stale = tmp_path / "app.log.dev3"  # of an earlier run on more devices
    stale.write_text("Thread,Time,Action,Pointer,Size,Stream\n")
    out = run("profile", "-o", str(path), "--", sys.executable, str(program))
    assert out.returncode == 0, out.stderr
    assert (
        f"10 event(s) logged, one log per device: 6 to {path} (device 0), 4 to {path}.dev1 (device 1)"
        in out.stderr
    )
    assert not stale.exists()
    assert len(Path(f"{path}.dev1").read_text().splitlines()) == 1 + 4
    out = run("profile", "-o", str(path), "--", sys.executable, str(program), "fail")
    assert out.returncode == 5
    assert (
        "the logs keep the 10 event(s) recorded until then, one log per device: "
        f"6 to {path} (device 0), 4 to {path}.dev1 (device 1)"
    ) in out.stderr


def test_recommend_a_log_of_a_device_this_machine_lacks(tmp_path: Path, log: Path) -> None:
    # A log recorded on device 1 of another machine: replayed here on device 0, and the code
    # names device 1's resource without making it (this process has one device).
    dev1 = tmp_path / "other.log.dev1"
    dev1.write_text(log.read_text())
    out = run("recommend", str(dev1), "--quick", "--json")
    assert out.returncode == 0, out.stderr
    code = valid(out.stdout)["recommendation"]["code"]
    assert "set_per_device_resource(1, " in code and "device=1" in code, code


def test_profile_of_a_program_that_cannot_start(tmp_path: Path) -> None:
    out = run("profile", "-o", str(tmp_path / "x.log"), "--", "/nonexistent/program")
    assert out.returncode == 127 and "cannot run" in out.stderr


@pytest.mark.skipif(os.environ.get("STREAMPOOL_GPU_TESTS") == "1", reason="this machine has a CUDA driver")
def test_recommend_without_a_driver_says_how_to_run_the_program(log: Path) -> None:
    out = run("recommend", str(log), "--quick", STREAMPOOL_DEVICE="")
    assert out.returncode == 0, out.stderr
    assert "run the program with STREAMPOOL_DEVICE=sim" in out.stdout, out.stdout
    out = run("recommend", str(log), "--quick")  # STREAMPOOL_DEVICE=sim: the program has it too
    assert "run the program with STREAMPOOL_DEVICE=sim" not in out.stdout


@pytest.mark.skipif(os.environ.get("STREAMPOOL_GPU_TESTS") == "1", reason="this machine has a CUDA driver")
def test_recommend_without_a_driver_names_the_simulators_settings_it_measured_with(
    tmp_path: Path, log: Path
) -> None:
    # A log of device 1, measured on 2 simulated devices of 400 MiB: the program needs both.
    dev1 = tmp_path / "app.log.dev1"
    dev1.write_text(log.read_text())
    settings = {"STREAMPOOL_SIM_DEVICES": "2", "STREAMPOOL_SIM_CAPACITY": " 400 MiB"}
    out = run("recommend", str(dev1), "--quick", STREAMPOOL_DEVICE="", **settings)
    assert out.returncode == 0, out.stderr
    hint = "run the program with STREAMPOOL_DEVICE=sim STREAMPOOL_SIM_CAPACITY='400 MiB' STREAMPOOL_SIM_DEVICES=2)"
    assert hint in out.stdout, out.stdout
    # Blank ones are unset to the library: not named.
    blank = {"STREAMPOOL_SIM_DEVICES": " ", "STREAMPOOL_SIM_CAPACITY": ""}
    out = run("recommend", str(log), "--quick", STREAMPOOL_DEVICE="", **blank)
    assert out.returncode == 0, out.stderr
    assert "run the program with STREAMPOOL_DEVICE=sim)" in out.stdout, out.stdout


def test_replay_json_and_the_log_it_read(log: Path) -> None:
    out = run("replay", str(log), "--resources", "async,pool(async),cuda", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    doc = valid(out.stdout)
    assert doc["log"]["events"] == 180 and doc["log"]["threads"] == 3 and doc["log"]["streams"] == 3
    assert {r["resource"] for r in doc["summary"]} == {"async", "pool(async)", "cuda"}
    for row in doc["summary"]:  # the replay's own peak on 3 threads, measured
        assert row["peak_live_bytes"] > 0 and row["peak_reserved_bytes"] >= row["peak_live_bytes"]
    assert all(r["peak_live_measured"] is True for r in doc["runs"])


def test_replay_of_a_malformed_log_names_the_lines(tmp_path: Path, log: Path) -> None:
    lines = log.read_text().splitlines()
    lines[4] = "not,a,line"
    bad = tmp_path / "bad.log"
    bad.write_text("\n".join(lines) + "\n")
    out = run("replay", str(bad), "--quick")
    assert out.returncode == 3 and "line 5: expected 6 comma-separated fields" in out.stderr
    assert run("replay", str(bad), "--quick", "--skip-malformed").returncode == 0


def test_replay_passes_and_the_note_on_runs_too_short_to_time(log: Path) -> None:
    # The log's 180 events replay in well under a millisecond: a line says how many passes
    # would make a run long enough to time.
    out = run("replay", str(log), "--repeats", "1", "--resources", "pool(async)")
    assert out.returncode == 0, out.stderr
    assert "are too short to time" in out.stderr and "--passes " in out.stderr, out.stderr
    out = run("replay", str(log), "--quick", "--resources", "pool(async)", "--passes", "3", "--json")
    assert out.returncode == 0, out.stderr
    doc = valid(out.stdout)
    assert doc["params"]["passes"] == 3
    assert all(r["events"] == 3 * doc["log"]["events"] for r in doc["runs"])
    refused = run("replay", str(log), "--passes", "0")
    assert refused.returncode == 2 and "--passes" in refused.stderr
    refused = run("replay", str(log), "--passes", str(10**9))
    assert refused.returncode == 2 and "events a run" in refused.stderr, refused.stderr
    # bench's replay takes its passes as a parameter, and the note names it so.
    out = run(
        "bench",
        "replay",
        "--log",
        str(log),
        "--repeats",
        "1",
        "--resources",
        "pool(async)",
        "--param",
        "passes=2",
    )
    assert out.returncode == 0, out.stderr
    assert "--param passes=" in out.stderr and "--passes" not in out.stderr, out.stderr


def test_bench_of_a_generated_trace_too_short_to_time_says_how_many_allocations() -> None:
    out = run("bench", "window", "--resources", "pool(async)", "--repeats", "1", "--param", "allocations=200")
    assert out.returncode == 0, out.stderr
    assert "are too short to time" in out.stderr and "--param allocations=" in out.stderr, out.stderr
    quick = run("bench", "window", "--resources", "pool(async)", "--quick")  # a smoke test: no note
    assert quick.returncode == 0 and "too short" not in quick.stderr, quick.stderr


def test_recommend_a_log(log: Path) -> None:
    out = run("recommend", str(log), "--quick", "--json")
    assert out.returncode == 0, out.stderr
    doc = valid(out.stdout)
    rec = doc["recommendation"]
    assert rec["choice"] in doc["profile"]["candidates"] and rec["choice"] != "cuda"
    assert "set_current_device_resource(" in rec["code"]
    # A log of 180 events replays in well under a millisecond, too short to time: each run
    # replays it over and over.
    events = sum(1 for line in log.read_text().splitlines() if ",allocate," in line or ",free," in line)
    passes = doc["params"]["passes"]  # by candidate
    assert set(passes) == set(doc["profile"]["candidates"]) and max(passes.values()) > 1
    assert all(r["events"] == r["passes"] * events for r in doc["runs"] if not r["oom_events"])
    text = run("recommend", str(log), "--quick").stdout
    assert "times over in each run" in text and "(one replay took" in text
    for part in ("Recommended:", "Why:", "Apply it", "simulated device", "3 thread(s) and 3 stream(s)"):
        assert part in text
    assert "peak live / reserved" in text  # the replay's own, measured


def test_recommend_a_program_profiles_it_first(tmp_path: Path, program: Path) -> None:
    kept = tmp_path / "kept.log"
    out = run("recommend", "--quick", "-o", str(kept), "--", sys.executable, str(program))
    assert out.returncode == 0, out.stderr
    assert "output of the program" in out.stdout and "Recommended:" in out.stdout
    assert kept.exists()
    failing = run("recommend", "--quick", "--", sys.executable, str(program), "fail")
    assert failing.returncode == 7 and "Recommended:" not in failing.stdout


def test_plot_a_log(tmp_path: Path, log: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    out = run("plot", str(log), "-o", str(png), "--resource", "pool(async)")
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "simulated device" in out.stdout
    # A name without a suffix: the PNG gets one, and the message names the file written.
    out = run("plot", str(log), "-o", str(tmp_path / "plots"))
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path / 'plots.png'}" in out.stdout and (tmp_path / "plots.png").exists()
    # A resource too small for the log: the plot is drawn, and what it leaves out is said.
    out = run("plot", str(log), "-o", str(png), "--resource", "limit(async, limit=256)")
    assert out.returncode == 0, out.stderr
    assert "of the log's allocations ran out of memory on limit(async, limit=256)" in out.stderr
    assert "Warning" not in out.stderr, out.stderr  # no legend asked of an empty histogram


def test_bench_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = run(
        "bench",
        "window",
        "--resources",
        "async,pool(async)",
        "--threads",
        "1,2",
        "--quick",
        "--plot",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["window-latency.png", "window-throughput.png"]


def test_latency_plot_draws_percentiles_where_runs_kept_no_call_times() -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from streampool.harness import plots

    def run_of(spec: str, p50: int, samples: list[int] | None) -> dict[str, object]:
        percentiles = {"p50": p50, "p90": 2 * p50, "p99": 4 * p50, "p999": 8 * p50, "max": 16 * p50}
        return {
            "resource": spec,
            "allocate": percentiles,
            "_latencies": {"allocate": samples} if samples else None,
        }

    # The native pipeline's runs: percentiles only. One line per resource, five points each.
    fig, ax = plt.subplots()
    native = [run_of("a", 100, None), run_of("a", 300, None), run_of("b", 1000, None)]
    assert plots.latency_plot(ax, native) == "percentiles"
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines == {"a": [200, 400, 800, 1600, 3200], "b": [1000, 2000, 4000, 8000, 16000]}
    plt.close(fig)
    # Runs with every call's time: a histogram per resource.
    fig, ax = plt.subplots()
    assert (
        plots.latency_plot(ax, [run_of("a", 100, [100, 120, 5000]), run_of("b", 50, [50, 60])])
        == "distribution"
    )
    assert len(ax.patches) == 2 and not ax.get_lines()
    plt.close(fig)


def test_plots_without_matplotlib_name_the_extra(tmp_path: Path) -> None:
    blocked = "import sys; sys.modules['matplotlib'] = None; import runpy; runpy.run_module('streampool', run_name='__main__')"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            blocked,
            "bench",
            "window",
            "--resources",
            "async",
            "--quick",
            "--plot",
            str(tmp_path),
        ],
        env=dict(os.environ, STREAMPOOL_DEVICE="sim"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 4, out.stderr
    assert "pip install 'streampool[harness]'" in out.stderr and not list(tmp_path.glob("*.png"))


def test_stress_json_and_exit_status() -> None:
    out = run("stress", "--resources", "pool(async),async", "--seconds", "0.5", "--threads", "2", "--json")
    assert out.returncode == 0, out.stderr
    doc = valid(out.stdout)
    assert [r["resource"] for r in doc["stress"]] == ["pool(async)", "async"]
    assert all(r["ok"] and r["race_detector"] and r["verified_bytes"] > 0 for r in doc["stress"])


def test_console_script_has_the_harness() -> None:
    exe = Path(sys.executable).with_name("streampool")
    if not exe.exists():
        pytest.skip("console script not installed")
    out = subprocess.run([str(exe), "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--resources" in out.stdout


def test_the_schema_is_valid_and_refuses_a_broken_document(log: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    out = run("replay", str(log), "--resources", "async", "--repeats", "1", "--json")
    document = valid(out.stdout)
    for breakage in (
        lambda d: d.update(schema="streampool.harness/0"),
        lambda d: d.pop("summary"),
        lambda d: d["runs"][0].pop("peak_reserved_bytes"),
        lambda d: d["summary"][0]["throughput"].pop("median"),
        lambda d: d["device"].update(simulated="yes"),
    ):
        broken = json.loads(out.stdout)
        breakage(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)
    assert document["runs"][0]["replayer"] == "native"


def test_a_terminal_gets_a_rich_table_and_a_pipe_plain_text() -> None:
    import io

    from streampool.harness.output import Output

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    rows = [["pool(async)", "4", "1.00M"]]
    plain = io.StringIO()
    Output(stream=plain).table("title [simulated device]", ["resource", "threads", "events/s"], rows)
    assert plain.getvalue().splitlines()[:2] == ["title [simulated device]", "resource     threads  events/s"]
    pytest.importorskip("rich")
    terminal = Terminal()
    Output(stream=terminal).table("title [simulated device]", ["resource", "threads", "events/s"], rows)
    text = terminal.getvalue()
    assert "simulated device" in text and "pool(async)" in text and "┃" in text


def test_the_guide_script_refuses_an_unknown_part_before_running_anything(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "guide.sh"
    out = tmp_path / "guide"
    env = {**os.environ, "PARTS": "window,bogus", "GUIDE_OUT": str(out)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown part 'bogus' in PARTS" in done.stderr
    assert not out.exists()  # nothing measured, nothing written


# bench and replay stopped part-way: a signal lands in the third run (the runs are patched
# so that it lands there every time), in a process of its own.
STOPPED = """\
import os, signal, sys, time
from streampool.harness import bench, cli
real, calls = bench.one_run, []
def one_run(*args, **kwargs):
    calls.append(args)
    if len(calls) == 3:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(30)  # the handler's exception ends the sleep
        print("the signal did not stop the run", file=sys.stderr)
    return real(*args, **kwargs)
bench.one_run = one_run
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize(("signal_name", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
@pytest.mark.parametrize("command", ["bench", "replay"])
def test_a_stopped_bench_or_replay_reports_the_runs_that_finished(
    signal_name: str, status: int, command: str, log: Path
) -> None:
    what = ["bench", "window", "--param", "allocations=50"] if command == "bench" else ["replay", str(log)]
    args = [*what, "--resources", "async,pool(async)", "--repeats", "3"]
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    for json_out in (True, False):
        out = subprocess.run(
            [sys.executable, "-c", STOPPED, signal_name, *args, *(["--json"] if json_out else [])],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == status, out.stderr
        assert f"streampool {command}: interrupted after 2 of 6 runs" in out.stderr
        assert "did not stop" not in out.stderr
        if json_out:
            doc = valid(out.stdout)
            assert doc["interrupted"] is True
            assert [(r["resource"], r["repeat"]) for r in doc["runs"]] == [("async", 0), ("pool(async)", 0)]
            assert [row["repeats"] for row in doc["summary"]] == [1, 1]
        else:
            assert "INTERRUPTED after 2 of 6 runs" in out.stdout
            assert "pool(async)" in out.stdout


BENCH = ["bench", "window", "--param", "allocations=50", "--json"]


# SIGTERM whose KeyboardInterrupt Python drops (raised in a finaliser, printed as "Exception
# ignored"): the measurement still stops before its next run, or reports whole after its last.
LOST = """\
import os, signal, sys, time
from streampool.harness import bench, cli
real, calls = bench.one_run, []
class Finaliser:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler's exception ends the sleep, and is lost with __del__'s
def one_run(*args, **kwargs):
    calls.append(args)
    if len(calls) == int(sys.argv[1]):
        Finaliser()
    return real(*args, **kwargs)
bench.one_run = one_run
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("at", "said"), [(3, "interrupted after 3 of 6 runs"), (6, "terminated after its last run")]
)
def test_a_sigterm_whose_exception_was_lost_still_stops_the_bench(at: int, said: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", LOST, str(at), *BENCH, "--resources", "async,pool(async)", "--repeats", "3"],
        env=dict(os.environ, STREAMPOOL_DEVICE="sim"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 143, out.stderr
    assert "Exception ignored" in out.stderr and f"streampool bench: {said}" in out.stderr
    doc = valid(out.stdout)
    assert len(doc["runs"]) == at and doc["interrupted"] is (at < 6)


def test_an_interrupted_measurement_pickles_whole() -> None:
    import pickle

    from streampool.harness import bench

    e = bench.Interrupted([{"resource": "async"}], [], 4)
    copy = pickle.loads(pickle.dumps(e))
    assert (type(copy), copy.runs, copy.summary, copy.planned, str(copy)) == (
        bench.Interrupted,
        e.runs,
        [],
        4,
        "interrupted after 1 of 4 runs",
    )


def test_a_bench_stopped_before_any_run_finished_says_interrupted() -> None:
    out = subprocess.run(
        [sys.executable, "-c", STOPPED.replace("len(calls) == 3", "len(calls) == 1"), "SIGTERM", *BENCH],
        env=dict(os.environ, STREAMPOOL_DEVICE="sim"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (out.returncode, out.stdout) == (143, "")
    assert out.stderr.strip().splitlines()[-1] == "streampool bench: interrupted"


def test_a_finished_bench_says_it_was_not_interrupted() -> None:
    out = run("bench", "window", "--param", "allocations=50", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert valid(out.stdout)["interrupted"] is False


@pytest.fixture
def torch_program(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A program that imports a stand-in `torch` (the PYTHONPATH to give it), allocates
    through streampool and prints what profile's variables its environment holds."""
    (tmp_path / "lib" / "torch").mkdir(parents=True)
    (tmp_path / "lib" / "torch" / "__init__.py").write_text("")
    path = tmp_path / "torch_prog.py"
    path.write_text(
        "import os, torch, streampool\n"
        "streampool.DeviceBuffer(size=4096)\n"
        "print(sorted(k for k in os.environ if k.startswith('STREAMPOOL_PROFILE')))\n"
    )
    pythonpath = os.pathsep.join([str(tmp_path / "lib"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return path, {"PYTHONPATH": pythonpath}


def test_profile_routes_the_frameworks_a_program_imports(
    tmp_path: Path, torch_program: tuple[Path, dict[str, str]]
) -> None:
    program, env = torch_program
    log = str(tmp_path / "app.log")
    out = run("profile", "-o", log, "--", sys.executable, str(program), **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # the program's own children see none of profile's variables
    # On the simulated device PyTorch keeps its allocator (its memory is host memory), and
    # says so; on a GPU it allocates through the logged resource (tests/test_gpu_frameworks.py).
    assert (
        "streampool profile: nothing of what PyTorch allocated is logged: skipped: streampool runs on the "
        "simulated device"
    ) in out.stderr
    assert f"2 event(s) logged to {log}" in out.stderr  # the buffer's allocation and free
    quiet = run("profile", "--no-frameworks", "-o", log, "--", sys.executable, str(program), **env)
    assert quiet.returncode == 0, quiet.stderr
    assert "PyTorch" not in quiet.stderr


# profile and recommend where a framework was routed (as on a GPU): the shim's notes stand in.
ROUTED = """\
import sys
from streampool.harness import cli, profile
profile.read_notes = lambda path: {"PyTorch": "torch.cuda allocator: CUDAPluggableAllocator(...)",
                                   "Numba": "failed: RuntimeError: no CUDA"}
sys.exit(cli.main(sys.argv[1:]))
"""


def test_recommend_routes_what_the_profile_routed(program: Path, log: Path) -> None:
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run(
        [sys.executable, "-c", ROUTED, "recommend", "--quick", "--json", "--", sys.executable, str(program)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "streampool profile: PyTorch allocated through the logged resource" in out.stderr
    assert (
        "streampool profile: nothing of what Numba allocated is logged: failed: RuntimeError: no CUDA"
        in out.stderr
    )
    rec = valid(out.stdout)["recommendation"]
    assert rec["code"].splitlines()[-2:] == [
        "from streampool import allocators",
        "allocators.use_on_import('torch')  # PyTorch allocates through it, as when profiled",
    ]
    assert any("PyTorch allocated through the logged resource in the profile" in r for r in rec["reasons"])
    # A log given: its profile is not known, so the code is the resource's alone, and a
    # line says what to add for the frameworks.
    given = run("recommend", "--quick", str(log))
    assert given.returncode == 0, given.stderr
    assert "use_on_import" not in given.stdout.split("Apply it")[1].split("(a program whose")[0]
    assert (
        "add `from streampool import allocators; allocators.use_on_import()` after these lines"
        in given.stdout
    )
    refused = run("recommend", "--no-frameworks", str(log))
    assert refused.returncode == 2 and "--no-frameworks is for a program profiled first" in refused.stderr
