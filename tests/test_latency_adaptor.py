"""LatencyHistogramAdaptor: per-call latency histograms, and opt-in NVTX ranges."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice


def test_every_call_is_counted(sim: SimulatedDevice) -> None:
    hist = mr.LatencyHistogramAdaptor(mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()))
    assert isinstance(hist, mr.LatencyHistogramResourceAdaptor)

    def work() -> None:
        s = streampool.Stream()
        for i in range(200):
            p = hist.allocate(256 * (1 + i % 7), s)
            hist.deallocate(p, 256 * (1 + i % 7), s)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with pytest.raises(streampool.InvalidPointerError):
        hist.deallocate(0x12345600, 64)  # a refused call is counted too
    h = hist.histogram()
    a, d = h["allocate"], h["deallocate"]
    assert (a["count"], d["count"]) == (800, 801)
    assert sum(n for _, n in a["buckets"]) == 800
    assert 0 < a["p50_ns"] <= a["p90_ns"] <= a["p99_ns"] <= a["p999_ns"] <= a["max_ns"] <= a["total_ns"]
    bounds = [b for b, _ in a["buckets"]]
    assert bounds == sorted(bounds)
    hist.reset()
    assert hist.histogram()["allocate"]["count"] == 0
    assert hist.upstream is not None


def test_bad_upstream(sim: SimulatedDevice) -> None:
    with pytest.raises(TypeError):
        mr.LatencyHistogramAdaptor(object())  # type: ignore[arg-type]


@pytest.mark.nosim
@pytest.mark.skipif(
    bool(ctypes.util.find_library("nvToolsExt") or ctypes.util.find_library("nvtx3interop")),
    reason="an NVTX library is installed here: the warning is for machines without one",
)
def test_nvtx_without_the_library_warns_once_and_works() -> None:
    code = textwrap.dedent(
        """
        import streampool
        from streampool import mr
        hist = mr.LatencyHistogramAdaptor(mr.CudaAsyncMemoryResource())
        for _ in range(3):
            hist.deallocate(hist.allocate(1024), 1024)
        print(hist.histogram()["allocate"]["count"])
        """
    )
    env = dict(os.environ, STREAMPOOL_DEVICE="sim", STREAMPOOL_NVTX="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
    assert out.stderr.count("no NVTX library could be loaded") == 1, out.stderr


@pytest.mark.nosim
@pytest.mark.parametrize(
    ("value", "warning"),
    [
        ("TRUE", "no NVTX library could be loaded"),
        ("On", "no NVTX library could be loaded"),
        ("Off", None),
        ("0", None),
        ("enable", "is 'enable', which is neither on"),
    ],
)
def test_nvtx_values_any_case_and_a_word_on_others(value: str, warning: str | None) -> None:
    code = "from streampool import mr\nh = mr.LatencyHistogramAdaptor(mr.CudaAsyncMemoryResource())\nh.deallocate(h.allocate(64), 64)"
    env = dict(os.environ, STREAMPOOL_DEVICE="sim", STREAMPOOL_NVTX=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if warning is None:
        assert "STREAMPOOL_NVTX" not in out.stderr, out.stderr
    else:
        assert out.stderr.count(warning.replace("'", '"')) == 1, out.stderr


@pytest.mark.nosim
def test_nvtx_warning_on_a_broken_stderr_loses_the_warning_not_the_allocation() -> None:
    # A daemon whose log collector has gone: its stderr is a pipe with no reader.
    read_end, write_end = os.pipe()
    os.close(read_end)
    code = textwrap.dedent(
        """
        from streampool import mr
        h = mr.LatencyHistogramAdaptor(mr.CudaAsyncMemoryResource())
        for _ in range(3):
            h.deallocate(h.allocate(1 << 20), 1 << 20)
        print("ok")
        """
    )
    env = dict(os.environ, STREAMPOOL_DEVICE="sim", STREAMPOOL_NVTX="1")
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            stderr=write_end,
            stdout=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert out.stdout.strip() == "ok"


_FAKE_NVTX = r"""
#include <stdio.h>
static int pushes, pops, depth, deepest;
int nvtxRangePushA(const char *name) { (void)name; pushes++; if (++depth > deepest) deepest = depth; return depth; }
int nvtxRangePop(void) { pops++; return --depth; }
__attribute__((destructor)) static void report(void) { fprintf(stderr, "nvtx %d %d %d\n", pushes, pops, deepest); }
"""


@pytest.mark.nosim
@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler to build a stand-in NVTX library")
@pytest.mark.parametrize("upstream", ["async", "pool(async)"])
def test_nvtx_one_range_per_call(tmp_path, upstream: str) -> None:
    """Each allocate and deallocate is one range, whether or not the upstream has a fast path."""
    src = tmp_path / "nvtx.c"
    src.write_text(_FAKE_NVTX)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libnvToolsExt.so.1"), str(src)], check=True
    )
    code = textwrap.dedent(
        f"""
        from streampool import harness, mr
        hist = mr.LatencyHistogramAdaptor(harness.resource_from_spec({upstream!r}))
        for _ in range(3):
            hist.deallocate(hist.allocate(1024), 1024)
        print(hist.histogram()["allocate"]["count"], hist.histogram()["deallocate"]["count"])
        """
    )
    env = dict(os.environ, STREAMPOOL_DEVICE="sim", STREAMPOOL_NVTX="1", LD_LIBRARY_PATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "3"]
    assert "nvtx 6 6 1" in out.stderr, out.stderr


@pytest.mark.gpu
def test_histogram_on_a_gpu() -> None:
    hist = mr.LatencyHistogramAdaptor(mr.CudaAsyncMemoryResource())
    for _ in range(1000):
        hist.deallocate(hist.allocate(1 << 20), 1 << 20)
    a = hist.histogram()["allocate"]
    assert a["count"] == 1000 and 0 < a["p50_ns"] <= a["max_ns"]
