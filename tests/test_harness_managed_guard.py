"""The harness never asks for more managed memory than a real GPU has free (it can hang a
shared GPU), and larger-than-memory sizes its data set sensibly.

The machine has no GPU: the harness is made to take its real-GPU branch by replacing
``using_simulated_device`` in the modules that decide (``workloads``, ``recommend``), while
the simulated device serves the memory and says how much is free."""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streampool import mr
from streampool.harness import bench, cli, recommend, workloads
from streampool.harness.specs import Candidate, make_resource
from streampool.harness.trace import ALLOCATE, FREE, Trace
from streampool.sim import SimulatedDevice

MiB = 1 << 20
GiB = 1 << 30
CAPACITY = "64MiB"  # the simulated device of the command-line tests
CHUNK = 16 * MiB
HEADER = "Thread,Time,Action,Pointer,Size,Stream"


def big_trace(chunks: int = 6, size: int = CHUNK) -> Trace:
    """One thread allocating ``chunks`` chunks of ``size`` (all live at once), then freeing them."""
    allocs = [(0, size, i, 0, 0, ALLOCATE) for i in range(chunks)]
    return Trace(allocs + [(0, size, i, 0, 0, FREE) for i in range(chunks)])


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness takes its real-GPU branch (the simulated device still serves the memory)."""
    monkeypatch.setattr(workloads, "using_simulated_device", lambda: False)
    monkeypatch.setattr(bench, "using_simulated_device", lambda: False)
    monkeypatch.setattr(recommend, "using_simulated_device", lambda: False)


@pytest.fixture
def big_log(tmp_path: Path) -> Path:
    """A log whose peak live bytes (6 x 16 MiB = 96 MiB) are above the 64 MiB device."""
    lines = [HEADER]
    lines += [f"1,1.{i},allocate,{hex(0x100000 + i * CHUNK)},{CHUNK},0x0" for i in range(6)]
    lines += [f"1,2.{i},free,{hex(0x100000 + i * CHUNK)},{CHUNK},0x0" for i in range(6)]
    path = tmp_path / "big.log"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cli.main`` on a 64 MiB simulated device of its own."""
    monkeypatch.setenv("STREAMPOOL_DEVICE", "sim")
    monkeypatch.setenv("STREAMPOOL_SIM_CAPACITY", CAPACITY)


# --- 1a: the replay workload refuses managed memory beyond the GPU's free memory ---------------


def test_a_replay_on_managed_memory_beyond_free_memory_is_refused_on_a_gpu(on_a_gpu: None) -> None:
    t = big_trace(6, 64 * MiB)  # 384 MiB live at the peak, on conftest's 256 MiB device
    for spec in ("prefetch(managed)", "managed", "pool(managed)"):
        with pytest.raises(workloads.WorkloadError) as e:
            workloads.run("replay", make_resource(spec), log=t)
        message = str(e.value)
        assert spec in message and "384.0 MiB" in message and "256.0 MiB" in message
        assert "never oversubscribes" in message and "more free memory" in message
    assert workloads.oversubscribes(make_resource("managed"), big_trace(3, 64 * MiB)) is None


def test_device_memory_and_a_peak_within_free_memory_still_replay_on_a_gpu(on_a_gpu: None) -> None:
    out = workloads.run("replay", make_resource("prefetch(managed)"), log=big_trace(3, 64 * MiB))
    assert out["oom_events"] == 0
    # Device memory cannot oversubscribe: what does not fit runs out of memory.
    out = workloads.run("replay", make_resource("async"), log=big_trace(6, 64 * MiB))
    assert out["oom_events"] == 2


def test_on_the_simulated_device_an_over_large_managed_replay_runs_out_of_memory() -> None:
    out = workloads.run("replay", make_resource("prefetch(managed)"), log=big_trace(6, 64 * MiB))
    assert out["oom_events"] == 2


@pytest.mark.nosim
def test_bench_replay_measures_the_others_then_exits_4(
    on_a_gpu: None, command_line: None, big_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["replay", str(big_log), "--resources", "async,managed", "--repeats", "1", "--json"])
    out = capsys.readouterr()
    assert status == cli.EXIT_CANNOT_RUN, out.err
    assert "managed: the trace's peak live bytes (96.0 MiB)" in out.err
    assert "above the device's free memory (64.0 MiB)" in out.err
    document = json.loads(out.out)
    assert [row["resource"] for row in document["summary"]] == ["async"]  # async's results kept
    assert document["summary"][0]["oom_events"] == 2
    # bench replay takes the same path.
    status = cli.main(
        ["bench", "replay", "--log", str(big_log), "--resources", "managed,async", "--repeats", "1"]
    )
    out = capsys.readouterr()
    assert status == cli.EXIT_CANNOT_RUN and "managed: the trace's peak" in out.err
    assert "async" in out.out


@pytest.mark.nosim
def test_what_an_earlier_resource_freed_into_the_driver_pool_does_not_refuse_a_later_one(
    on_a_gpu: None, command_line: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 40 MiB peak fits the 64 MiB device once the driver's pool is trimmed; the pool
    # spec before it leaves 32 MiB in the driver's default pool when it is made and dropped.
    chunk = 10 * MiB
    lines = [HEADER]
    lines += [f"1,1.{i},allocate,{hex(0x100000 + i * chunk)},{chunk},0x0" for i in range(4)]
    lines += [f"1,2.{i},free,{hex(0x100000 + i * chunk)},{chunk},0x0" for i in range(4)]
    log = tmp_path / "fits.log"
    log.write_text("\n".join(lines) + "\n")
    status = cli.main(
        ["replay", str(log), "--resources", "pool(async, initial=32MiB),managed", "--repeats", "1", "--json"]
    )
    out = capsys.readouterr()
    assert status == cli.EXIT_OK, out.err
    assert [row["resource"] for row in json.loads(out.out)["summary"]] == [
        "pool(async, initial=32MiB)",
        "managed",
    ]


@pytest.mark.nosim
def test_a_replay_with_only_managed_resources_is_refused_before_it_runs(
    on_a_gpu: None,
    command_line: None,
    big_log: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def measure(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("nothing should be measured")

    monkeypatch.setattr(bench, "measure", measure)
    status = cli.main(["replay", str(big_log), "--resources", "managed,prefetch(managed)", "--repeats", "1"])
    out = capsys.readouterr()
    assert status == cli.EXIT_CANNOT_RUN, out.err
    assert "managed: the trace's peak" in out.err and "prefetch(managed): the trace's peak" in out.err


# --- 1b: recommend on a GPU with a peak above free memory measures nothing ----------------------


@pytest.mark.nosim
def test_recommend_with_a_peak_above_free_memory_on_a_gpu_measures_nothing(
    on_a_gpu: None, command_line: None, big_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["recommend", str(big_log), "--repeats", "1"])
    out = capsys.readouterr()
    assert status == cli.EXIT_CANNOT_RUN, out.err
    assert "streampool.setup(larger_than_memory=True)" in out.err
    assert "nothing was measured" in out.err and "more free memory" in out.err
    assert "96.0 MiB" in out.err and "64.0 MiB" in out.err
    assert "OOM" not in out.out and "Recommended" not in out.out  # no replay table, no choice
    # --json: the document, with no runs and no recommendation, and the same error.
    status = cli.main(["recommend", str(big_log), "--repeats", "1", "--json"])
    out = capsys.readouterr()
    assert status == cli.EXIT_CANNOT_RUN
    document = json.loads(out.out)
    assert document["runs"] == [] and document["summary"] == []
    assert document["recommendation"] is None
    assert "larger_than_memory=True" in document["error"] and "nothing was measured" in document["error"]
    assert document["profile"]["candidates"] == ["prefetch(managed)", "managed"]
    jsonschema = pytest.importorskip("jsonschema")
    schema = Path(workloads.__file__).parent / "schema.json"
    jsonschema.validate(document, json.loads(schema.read_text()))


@pytest.mark.nosim
def test_recommend_on_the_simulated_device_still_measures(
    command_line: None, big_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["recommend", str(big_log), "--repeats", "1", "--json"])
    out = capsys.readouterr()
    assert status == cli.EXIT_CANNOT_RUN  # every candidate ran out of memory
    document = json.loads(out.out)
    assert [row["resource"] for row in document["summary"]] == ["prefetch(managed)", "managed"]
    assert "every candidate ran out of memory" in document["error"]


# --- 2: larger-than-memory with no free memory left ---------------------------------------------


@pytest.fixture
def small_device() -> Iterator[None]:
    with SimulatedDevice(capacity_bytes=CAPACITY):
        yield


@pytest.mark.nosim
def test_larger_than_memory_with_no_free_memory_is_a_workload_error(small_device: None) -> None:
    full = make_resource(f"pool(managed, initial={CAPACITY})")  # leaves nothing free
    with pytest.raises(workloads.WorkloadError, match=r"no free device memory left .*--param total=SIZE"):
        workloads.run("larger-than-memory", full, passes=1)
    with pytest.raises(workloads.WorkloadError, match="no free device memory left"):
        workloads.run("larger-than-memory", full, total="0B", passes=1)  # 0 bytes: the default
    del full
    with pytest.raises(workloads.WorkloadError, match="chunk_size"):
        workloads.larger_than_memory(make_resource("managed"), total="1MiB", chunk_size=0)


@pytest.mark.nosim
def test_bench_larger_than_memory_with_no_free_memory_exits_4(
    command_line: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench",
        "larger-than-memory",
        "--resources",
        f"pool(managed, initial={CAPACITY})",
        "--repeats",
        "1",
    ]
    status = cli.main(argv)
    out = capsys.readouterr()
    assert status == cli.EXIT_CANNOT_RUN, out.err
    assert "no free device memory left for the data set" in out.err and "Traceback" not in out.err


# --- 3: larger-than-memory's default total on the simulated device ------------------------------


def untouched() -> Candidate:
    """A resource whose memory is never touched (addresses only): the sizes the workload asks for
    cost no host memory."""
    top = [1 << 32]

    def allocate(size: int, stream: Any) -> int:
        top[0] += (size + 255) // 256 * 256
        return top[0]

    return Candidate("untouched", mr.CallbackMemoryResource(allocate, lambda *_: None), "")


@pytest.mark.nosim
def test_larger_than_memory_default_total_is_at_most_1_gib_on_the_simulated_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    idle = types.SimpleNamespace(fill=lambda *a, **k: None, compute=lambda *a, **k: None)
    monkeypatch.setattr(workloads, "_kernels", lambda: idle)
    with SimulatedDevice(capacity_bytes="16GiB"):  # the simulator's default capacity
        out = workloads.run("larger-than-memory", untouched(), passes=1)
        assert out["peak_live_bytes"] == GiB and out["oom_events"] == 0
        out = workloads.run("larger-than-memory", untouched(), total="3GiB", passes=1)
        assert out["peak_live_bytes"] == 3 * GiB  # an explicit total is taken as given
    with SimulatedDevice(capacity_bytes="1GiB"):  # half the free memory, below the cap
        out = workloads.run("larger-than-memory", untouched(), passes=1)
        assert out["peak_live_bytes"] == GiB // 2
