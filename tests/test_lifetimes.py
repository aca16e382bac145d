"""Lifetimes: buffers outliving their stream objects, freed on other threads, and alive
at interpreter exit."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice


def test_per_thread_stream_buffer_collected_on_another_thread(sim: SimulatedDevice) -> None:
    resource = mr.CudaAsyncMemoryResource()
    box: list[streampool.DeviceBuffer] = []

    def make() -> None:
        buf = streampool.DeviceBuffer(size=4096, stream=streampool.PER_THREAD_DEFAULT_STREAM, mr=resource)
        sim.write(streampool.PER_THREAD_DEFAULT_STREAM, buf.ptr, 4096, label="worker's write")
        box.append(buf)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    box.clear()  # collected here, on the main thread
    gc.collect()
    s = streampool.Stream()
    again = streampool.DeviceBuffer(size=4096, stream=s, mr=resource)
    sim.write(s, again.ptr, 4096, label="reuse")
    sim.run()
    assert sim.races() == []


def test_buffer_whose_stream_object_was_dropped(sim: SimulatedDevice) -> None:
    resource = mr.CudaAsyncMemoryResource()
    s = streampool.Stream()
    buf = streampool.DeviceBuffer(size=1024, stream=s, mr=resource)
    sim.write(s, buf.ptr, 1024)
    del s
    gc.collect()
    del buf
    gc.collect()
    other = streampool.Stream()
    again = streampool.DeviceBuffer(size=1024, stream=other, mr=resource)
    sim.write(other, again.ptr, 1024)
    sim.run()
    assert sim.races() == []


EXIT_SCRIPT = """
import streampool
from streampool import mr
keep = [mr.CudaAsyncMemoryResource(initial_pool_size="1MiB"), mr.CudaMemoryResource(), mr.PinnedHostMemoryResource()]
bufs = [streampool.DeviceBuffer(size=1000, mr=m, stream=s) for m in keep for s in (None, streampool.Stream(), 2)]
cycle = [bufs]
cycle.append(cycle)
streampool.set_current_device_resource(keep[1])
print("ok")
"""


@pytest.mark.nosim
def test_exit_with_live_buffers_and_resources_is_quiet() -> None:
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, "ok\n", "")


@pytest.mark.nosim
def test_exit_inside_an_active_simulated_device_is_quiet() -> None:
    script = "from streampool.sim import SimulatedDevice\nd = SimulatedDevice().__enter__()\n" + EXIT_SCRIPT
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, "ok\n", "")


@pytest.mark.gpu
def test_exit_with_live_buffers_on_the_gpu_is_quiet() -> None:
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (0, "ok\n", "")
