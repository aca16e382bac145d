"""The harness on a real GPU (run with STREAMPOOL_GPU_TESTS=1): every command end to end,
kernels from PTX, the free-memory guard of larger-than-memory, and the peers installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from streampool import mr
from streampool.harness.output import SCHEMA_PATH

pytestmark = pytest.mark.gpu

PROGRAM = """\
import threading, streampool
streams = [streampool.Stream() for _ in range(4)]
def work(i):
    bufs = []
    for n in range(200):
        bufs.append(streampool.DeviceBuffer(size=4096 * (1 + n % 9), stream=streams[i]))
        if len(bufs) > 8:
            bufs.pop(0)
threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print("done")
"""


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "STREAMPOOL_DEVICE"}
    return subprocess.run(
        [sys.executable, "-m", "streampool", *args], env=env, capture_output=True, text=True, timeout=600
    )


def valid(text: str) -> dict[str, Any]:
    document = json.loads(text)
    try:
        import jsonschema
    except ImportError:  # the test extra has it; a bare GPU machine may not
        assert document["schema"] == "streampool.harness/2"
    else:
        jsonschema.validate(document, json.loads(SCHEMA_PATH.read_text()))
    assert document["device"]["simulated"] is False
    # The card by name and size (a report says which GPU its figures are of).
    assert document["device"]["name"] and document["device"]["total_bytes"] > 0, document["device"]
    return document


@pytest.mark.parametrize("workload", ["random", "window", "multistream", "pipeline"])
def test_bench_on_the_gpu(workload: str) -> None:
    out = run(
        "bench",
        workload,
        "--resources",
        "async,pool(async),binning(async)",
        "--threads",
        "1,4",
        "--quick",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = valid(out.stdout)
    assert "simulated" not in out.stderr
    assert all(r["oom_events"] == 0 and r["throughput"] > 0 for r in doc["runs"])


def test_larger_than_memory_with_and_without_prefetch() -> None:
    out = run("bench", "larger-than-memory", "--resources", "managed,prefetch(managed)", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    assert {r["resource"] for r in valid(out.stdout)["summary"]} == {"managed", "prefetch(managed)"}


def test_larger_than_memory_above_free_memory_is_refused() -> None:
    free, _ = mr.available_device_memory()
    out = run("bench", "larger-than-memory", "--resources", "managed", "--param", f"total={free + (1 << 30)}")
    assert out.returncode == 4 and "above the device's free memory" in out.stderr


def test_stress_on_the_gpu_verifies_data_with_kernels() -> None:
    out = run(
        "stress",
        "--resources",
        "pool(async),async,binning(async)",
        "--seconds",
        "3",
        "--threads",
        "4",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    reports = valid(out.stdout)["stress"]
    assert all(r["ok"] and r["verified_bytes"] > 0 and not r["race_detector"] for r in reports)


def test_profile_then_recommend_on_the_gpu(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text(PROGRAM)
    log = tmp_path / "app.log"
    out = run("profile", "-o", str(log), "--", sys.executable, str(program))
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    rec = run("recommend", str(log), "--json")
    assert rec.returncode == 0, rec.stderr
    doc = valid(rec.stdout)
    assert doc["profile"]["threads"] == 4 and doc["profile"]["streams"] == 4
    assert doc["recommendation"]["choice"] != "cuda"
    # Each candidate, peers too, replays the log as many times over as its runs need.
    assert set(doc["params"]["passes"]) == set(doc["profile"]["candidates"])
    assert all(r["passes"] == doc["params"]["passes"][r["resource"]] for r in doc["runs"])
    plot = run("plot", str(log), "-o", str(tmp_path / "app.png"))
    assert plot.returncode == 0 or "streampool[harness]" in plot.stderr


PEERS = {
    "rmm": ["rmm:async", "rmm:pool(cuda)", "rmm:arena", "rmm:binning"],
    "cupy": ["cupy:pool", "cupy:async"],
    "torch": ["torch:native"],
}


@pytest.mark.parametrize("lib", sorted(PEERS))
def test_peers_side_by_side(lib: str) -> None:
    if importlib.util.find_spec(lib) is None:
        pytest.skip(f"{lib} is not installed")
    out = run(
        "bench",
        "window",
        "--resources",
        ",".join(["async", *PEERS[lib]]),
        "--threads",
        "1,4",
        "--quick",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    assert {r["resource"] for r in valid(out.stdout)["summary"]} == {"async", *PEERS[lib]}
