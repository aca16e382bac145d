"""The command line and the no-driver path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

GPU = os.environ.get("STREAMPOOL_GPU_TESTS") == "1"


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "STREAMPOOL_DEVICE"}
    full.update(env)
    return subprocess.run(args, env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.nosim
def test_environment_report_on_the_simulated_device() -> None:
    out = _run([sys.executable, "-m", "streampool"], STREAMPOOL_DEVICE="sim")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "simulated device" in text.lower()
    for name in (
        "CudaAsyncMemoryResource",
        "CudaMemoryResource",
        "ManagedMemoryResource",
        "PinnedHostMemoryResource",
    ):
        assert name in text
    # The report names the default; a recommendation is `streampool recommend`'s, measured.
    assert "Default:       CudaAsyncMemoryResource" in text and "streampool recommend app.log" in text
    assert "Recommended" not in text


@pytest.mark.nosim
@pytest.mark.skipif(GPU, reason="this machine has a CUDA driver")
def test_environment_report_without_a_driver_says_so() -> None:
    out = _run([sys.executable, "-m", "streampool"])
    assert out.returncode == 0, out.stderr
    assert "no cuda driver" in out.stdout.lower()
    assert "simulated device" in out.stdout.lower()


@pytest.mark.nosim
def test_console_script() -> None:
    exe = shutil.which("streampool")
    if exe is None:
        pytest.skip("console script not on PATH")
    out = _run([exe], STREAMPOOL_DEVICE="sim")
    assert out.returncode == 0 and "CudaAsyncMemoryResource" in out.stdout


@pytest.mark.nosim
@pytest.mark.skipif(GPU, reason="this machine has a CUDA driver")
def test_first_gpu_use_without_a_driver_raises_a_clear_error() -> None:
    code = (
        "import streampool\n"
        "try:\n"
        "    streampool.DeviceBuffer(size=16)\n"
        "except streampool.CudaDriverNotFoundError as e:\n"
        "    print(type(e).__name__, '|', e)\n"
    )
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("CudaDriverNotFoundError |")
    assert "simulated device" in out.stdout


@pytest.mark.nosim
@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
def test_report_into_a_closed_pipe_exits_0_quietly(unbuffered: bool) -> None:
    """`python -m streampool | head -1`: the reader may leave before the report is written.

    The pipe's reading end is closed before the report starts, so that every write fails:
    the first line's (unbuffered) or the final flush's (buffered).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("STREAMPOOL_DEVICE", "PYTHONUNBUFFERED")}
    env["STREAMPOOL_DEVICE"] = "sim"
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "streampool"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""


@pytest.mark.nosim
@pytest.mark.skipif(shutil.which("head") is None or shutil.which("bash") is None, reason="no bash or head")
def test_report_piped_into_head_exits_0() -> None:
    script = f'set -o pipefail; "{sys.executable}" -m streampool | head -1'
    out = _run(["bash", "-c", script], STREAMPOOL_DEVICE="sim", PYTHONUNBUFFERED="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("streampool ") and out.stdout.count("\n") == 1
    assert out.stderr == ""
