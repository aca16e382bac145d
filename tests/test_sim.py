"""The simulated device seen from Python: activation, the race detector, streams."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice


@pytest.mark.nosim
def test_process_wide_and_exclusive() -> None:
    with SimulatedDevice(capacity_bytes="64MiB") as dev:
        assert streampool.using_simulated_device()
        seen: list[bool] = []
        t = threading.Thread(target=lambda: seen.append(streampool.using_simulated_device()))
        t.start()
        t.join()
        assert seen == [True]
        with pytest.raises(streampool.StreampoolError, match="already active"):
            SimulatedDevice().__enter__()
        assert "simulated" in dev.describe()


@pytest.mark.nosim
def test_objects_are_refused_outside_their_device() -> None:
    with SimulatedDevice(capacity_bytes="64MiB"):
        resource = mr.CudaAsyncMemoryResource()
        stream = streampool.Stream()
        buf = streampool.DeviceBuffer(size=1024, stream=stream, mr=resource)
    with pytest.raises(streampool.StreampoolError, match="closed"):
        resource.allocate(256)
    with SimulatedDevice(capacity_bytes="64MiB"):
        other = mr.CudaAsyncMemoryResource()
        with pytest.raises(streampool.InvalidStreamError):
            other.allocate(256, stream)
    del buf  # freeing after the device closed is silent


def test_race_between_unordered_streams_is_found(sim: SimulatedDevice) -> None:
    a, b = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=a)
    sim.write(a, buf.ptr, 4096, label="producer")
    sim.read(b, buf.ptr, 4096, label="consumer")
    sim.run()
    races = sim.races()
    assert len(races) == 1
    assert "producer" in str(races[0]) and "consumer" in str(races[0])
    sim.clear_races()


def test_event_ordering_or_completion_removes_the_race(sim: SimulatedDevice) -> None:
    """A read on stream b of what stream a wrote is no race when b waits on an event
    recorded on a after the write (a DLPack export to b's stream records one on a and makes
    b wait on it), nor when a's work completed before the read was enqueued."""
    a, b = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=a)
    sim.write(a, buf.ptr, 4096, label="written on a")
    capsule = buf.__dlpack__(stream=b.handle, max_version=(1, 0))  # b waits on a's event
    assert sim.queued(a) > 0, "a's write is still queued: the event orders it, not completion"
    sim.read(b, buf.ptr, 4096, label="read on b after the event")
    sim.run()
    assert sim.races() == []
    del capsule
    sim.write(a, buf.ptr, 4096, label="written on a again")
    a.synchronize()  # completion orders everything enqueued later
    sim.read(b, buf.ptr, 4096, label="read on b after completion")
    sim.run()
    assert sim.races() == []


def test_step_runs_one_operation(sim: SimulatedDevice) -> None:
    s = streampool.Stream()
    buf = streampool.DeviceBuffer(size=256, stream=s)
    sim.write(s, buf.ptr, 256)
    sim.write(s, buf.ptr, 256)
    assert sim.pending == 2
    assert sim.step(s) is True
    assert sim.pending == 1
    sim.run()
    assert sim.pending == 0
    assert sim.step(s) is False


def test_use_after_free_is_refused(sim: SimulatedDevice) -> None:
    resource = mr.CudaMemoryResource()
    ptr = resource.allocate(1024)
    resource.deallocate(ptr, 1024)
    with pytest.raises(streampool.InvalidPointerError):
        sim.write(None, ptr, 1024)


def test_per_thread_default_streams_differ_between_threads(sim: SimulatedDevice) -> None:
    buf = streampool.DeviceBuffer(size=1024)
    sim.write(streampool.PER_THREAD_DEFAULT_STREAM, buf.ptr, 1024, label="main thread")
    t = threading.Thread(
        target=lambda: sim.read(streampool.PER_THREAD_DEFAULT_STREAM, buf.ptr, 1024, label="other thread")
    )
    t.start()
    t.join()
    sim.run()
    races = sim.races()
    assert len(races) == 1 and "other thread" in str(races[0])
    sim.clear_races()


def test_out_of_memory_names_size_and_capacity() -> None:
    with pytest.raises(streampool.OutOfMemoryError, match=str(1 << 40)):
        streampool.DeviceBuffer(size=1 << 40)


@pytest.mark.nosim
def test_environment_variable_selects_the_simulated_device(tmp_path) -> None:
    import os
    import subprocess
    import sys

    code = "import streampool; b = streampool.DeviceBuffer(size=10); print(streampool.using_simulated_device(), b.size)"
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "10"]
    assert out.stderr == ""


@pytest.mark.nosim
def test_the_simulator_s_variables_are_read_once_at_first_use() -> None:
    """README: read once, at the library's first use; a later change to the environment
    neither breaks nor changes the device (every lookup re-read them, and /proc, before)."""
    code = (
        "import os, streampool\n"
        "first = streampool.backend_description()\n"
        "os.environ['STREAMPOOL_SIM_CAPACITY'] = 'lots'\n"
        "os.environ['STREAMPOOL_SIM_DEVICES'] = '9999'\n"
        "streampool.Stream()\n"
        "assert streampool.backend_description() == first, first\n"
        "print(first)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMPOOL_")}
    env |= {"STREAMPOOL_DEVICE": "sim", "STREAMPOOL_SIM_CAPACITY": "64MiB"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "64 MiB" in done.stdout


@pytest.mark.nosim
def test_work_never_synchronised_keeps_a_bounded_backlog() -> None:
    """A program on the simulated device that never synchronises (copies on a stream, a
    stream per task) keeps at most 65,536 operations queued; the rest ran early, counted."""
    with SimulatedDevice(capacity_bytes="64MiB") as dev:
        buf = streampool.DeviceBuffer(size=256)
        copies = [buf.copy() for _ in range(70_000)]
        del copies
        assert dev.pending <= 65_536
        assert dev.ran_early > 0
        dev.run()
        assert dev.races() == []
    with SimulatedDevice(capacity_bytes="64MiB") as dev:
        streampool.DeviceBuffer(size=256).copy().copy()
        dev.run()
        assert dev.ran_early == 0  # below the bound nothing runs early
