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


DAEMONS_SCRIPT = """
import sys, threading, time
import streampool
from streampool import mr

base = mr.CudaAsyncMemoryResource()
if sys.argv[1] == "logging":  # a Python sink that lets the GIL go (as file I/O does)
    resource = mr.LoggingResourceAdaptor(base, callback=lambda line: time.sleep(0))
else:
    def allocate(size, stream):
        time.sleep(0)
        return base.allocate(size, stream)
    resource = mr.CallbackMemoryResource(allocate, lambda p, n, s: base.deallocate(p, n, s))
streampool.set_current_device_resource(resource)

def work():
    s = streampool.Stream()
    while True:
        b = streampool.DeviceBuffer(size=4096, stream=s)
        del b

for _ in range(3):
    threading.Thread(target=work, daemon=True).start()
time.sleep(0.2)
print("ok")
"""


@pytest.mark.nosim
@pytest.mark.parametrize("through", ["logging", "callback"])
def test_exit_while_daemon_threads_run_python_callbacks(through: str) -> None:
    # CPython before 3.14 ends a daemon thread that takes the GIL back during finalisation
    # with pthread_exit; unwound through the binding, that aborted the process.
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", DAEMONS_SCRIPT, through],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr


@pytest.mark.gpu
def test_exit_with_live_buffers_on_the_gpu_is_quiet() -> None:
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (0, "ok\n", "")


# --- a resize while a call runs (Python code the call runs, or another thread) ----------


def test_dlpack_export_never_outgrows_its_allocation() -> None:
    # Converting the consumer's stream runs its __cuda_stream__, which resizes the buffer:
    # the tensor keeps the size of the allocation it exports (pinned host memory, which
    # NumPy takes, so that its shape can be read).
    np = pytest.importorskip("numpy")
    buf = streampool.DeviceBuffer(size=256, mr=mr.PinnedHostMemoryResource())

    class Resizing:
        def __cuda_stream__(self) -> tuple[int, int]:
            buf.resize(1 << 20)
            return (0, 2)

    capsule = buf.__dlpack__(stream=Resizing())
    assert buf.size == 1 << 20

    class Exported:
        def __dlpack__(self, **kwargs: object) -> object:
            return capsule

        def __dlpack_device__(self) -> tuple[int, int]:
            return buf.__dlpack_device__()

    assert np.from_dlpack(Exported()).nbytes == 256


def test_a_resize_during_a_resize_copies_only_what_the_old_memory_holds() -> None:
    buf = streampool.DeviceBuffer.to_device(b"x" * 256)

    class Resizing:
        calls = 0

        def __cuda_stream__(self) -> tuple[int, int]:
            Resizing.calls += 1
            if Resizing.calls == 2:  # the first conversion checks the stream, the second orders the copy
                buf.resize(1 << 20)
            return (0, 0)

    buf.resize(4096, stream=Resizing())
    assert buf.size == 4096
    assert buf.tobytes()[:256] == b"x" * 256


def test_copy_to_device_copies_what_it_read_with_the_allocation() -> None:
    buf = streampool.DeviceBuffer.to_device(b"y" * 256)

    class Device:
        calls = 0

        def __index__(self) -> int:
            Device.calls += 1
            if Device.calls == 2:
                buf.resize(1 << 20)
            return 0

    out = buf.copy_to_device(Device())
    assert out.size == 256
    assert out.tobytes() == b"y" * 256


@pytest.mark.nosim
def test_a_closed_devices_buffer_raises_invalid_argument_everywhere() -> None:
    with SimulatedDevice():
        buf = streampool.DeviceBuffer(size=64)
    for call in (lambda: buf.ptr, buf.tobytes, lambda: buf.copy_from_host(b"z")):
        with pytest.raises(streampool.InvalidArgumentError, match="closed"):
            call()


# --- reference cycles -------------------------------------------------------------------


def _collected(make: object) -> tuple[bool, int, int]:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    previous = streampool.set_current_device_resource(stats)
    errors = streampool.drop_errors()[0]
    try:
        ref = make()  # type: ignore[operator]
        gc.collect()
        return ref() is None, stats.allocation_counts["current_bytes"], streampool.drop_errors()[0] - errors
    finally:
        streampool.set_current_device_resource(previous)


@pytest.mark.parametrize("device", ["sim", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_buffer_in_a_cycle_with_its_stream_object_is_collected_and_freed(device: str) -> None:
    # The record-stream pattern: a stream wrapper keeps the buffers made on it. On the GPU
    # the stream the collector destroyed first is never handed to the driver again (it
    # crashed there).
    import weakref

    class Tracked:
        def __init__(self) -> None:
            self.inner = streampool.Stream()
            self.pending: list[streampool.DeviceBuffer] = []

        def __cuda_stream__(self) -> tuple[int, int]:
            return self.inner.__cuda_stream__()

    def make() -> object:
        s = Tracked()
        s.pending.append(streampool.DeviceBuffer(size=1 << 20, stream=s))
        return weakref.ref(s.pending[0])

    # Collected, and freed although the collector may drop its stream first.
    for _ in range(5):
        assert _collected(make) == (True, 0, 0)


def test_a_cycle_through_a_wrapped_streams_owner_is_collected() -> None:
    import weakref

    class Holder:
        def __init__(self) -> None:
            self.inner = streampool.Stream()
            self.wrapped = streampool.Stream(self)
            self.buf = streampool.DeviceBuffer(size=1 << 20, stream=self.wrapped)

        def __cuda_stream__(self) -> tuple[int, int]:
            return self.inner.__cuda_stream__()

    assert _collected(lambda: weakref.ref(Holder())) == (True, 0, 0)


def test_a_cycle_through_a_buffers_resource_is_collected() -> None:
    import weakref

    class Workspace:
        def __init__(self) -> None:
            self.lines: list[str] = []
            self.mr = mr.LoggingResourceAdaptor(streampool.get_current_device_resource(), callback=self.log)
            self.buf = streampool.DeviceBuffer(size=1 << 20, mr=self.mr)

        def log(self, line: str) -> None:  # a bound method: the resource holds the workspace
            if hasattr(self, "lines"):  # the collector may have cleared it first
                self.lines.append(line)

    assert _collected(lambda: weakref.ref(Workspace())) == (True, 0, 0)


# --- threads that come and go -----------------------------------------------------------


def test_per_thread_streams_of_exited_threads_leave_the_pool() -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())

    def work() -> None:
        buf = streampool.DeviceBuffer(size=1 << 16, stream=streampool.PER_THREAD_DEFAULT_STREAM, mr=pool)
        del buf
        streampool.PER_THREAD_DEFAULT_STREAM.synchronize()

    for _ in range(300):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert len(pool.stats["shard_free_bytes"]) < 10, pool.stats


FORK_SCRIPT = """
import os, threading
import streampool

stop = threading.Event()
started = threading.Barrier(3)

def busy():
    s = streampool.Stream()
    started.wait()  # the device is in use before the first fork
    while not stop.is_set():
        b = streampool.DeviceBuffer(size=4096, stream=s)
        del b

workers = [threading.Thread(target=busy) for _ in range(2)]
for t in workers:
    t.start()
started.wait()
codes = []
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        try:
            streampool.Stream()
            os._exit(1)
        except streampool.StreampoolError as e:
            os._exit(0 if "fork()" in str(e) and "spawn" in str(e) else 2)
        except BaseException:
            os._exit(3)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
stop.set()
for t in workers:
    t.join()
print(codes)
"""


@pytest.mark.nosim
def test_a_forked_child_is_told_to_spawn_instead() -> None:
    # Threads hold the device's locks at the fork: the child must not wait on them.
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert (out.returncode, out.stdout) == (0, f"{[0] * 20}\n"), out.stderr


def test_a_buffer_whose_stream_was_destroyed_is_freed_once_on_the_legacy_stream(tmp_path: object) -> None:
    # Freed from Python (the pool's fast path first): the dead handle is never used (no event
    # recorded there, no block in its shard), and a logging adaptor logs one free.
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), events_every=1)
    lines: list[str] = []
    logged = mr.LoggingResourceAdaptor(pool, callback=lines.append)
    s = streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=int(s.handle), mr=logged)  # a borrowed handle
    dead = int(s.handle)
    del s  # destroys the stream
    before = dict(pool.stats["shard_free_bytes"])
    del buf
    after = pool.stats["shard_free_bytes"]
    assert pool.stats["used_bytes"] == 0
    legacy = (1 << 64) - 1  # the legacy stream's shard
    assert after.get(legacy, 0) - before.get(legacy, 0) == 4096, (before, after)
    assert all(after[k] <= before.get(k, 0) for k in after if k != legacy), (before, after)
    frees = [line for line in lines if ",free," in line]
    assert len(frees) == 1 and not frees[0].endswith(f"{dead:#x}"), lines


FORKED_USE_SCRIPT = """
import ctypes, os
import streampool
from streampool import _native, mr

lib = ctypes.CDLL(_native.__file__)
lib.streampool_alloc.restype = ctypes.c_void_p
lib.streampool_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.streampool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
mr.set_current_device_resource(pool)
buf = streampool.DeviceBuffer(size=1 << 16)
lib.streampool_free(lib.streampool_alloc(4096, 0, None), 4096, 0, None)  # a block in the pool's list
pid = os.fork()
if pid == 0:
    refused = lib.streampool_alloc(4096, 0, None) is None and "fork()" in (_native._capi_last_error()[1] or "")
    del buf  # the parent's memory: let go of, not given back
    os._exit(0 if refused and pool.stats["used_bytes"] == 1 << 16 else 2 if refused else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.nosim
def test_a_forked_child_neither_allocates_through_the_c_entry_points_nor_frees_the_parents_memory() -> None:
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run(
        [sys.executable, "-c", FORKED_USE_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout) == (0, "0\n"), out.stderr
