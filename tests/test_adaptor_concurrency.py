"""Adaptors and the fixed-size and binning resources under threads (simulated device).

Each test runs threads against one resource for about a second and checks what must hold
whatever the interleaving: no lock taken in a bad order (a hang), no out-of-memory error
while free blocks can serve the request, statistics that one moment had. Not timings.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

SECONDS = 1.0

# Replacing a bin that the binning resource made drops that bin's resource, which gives
# its chunks back through the upstream: here a logging adaptor whose sink is Python, so
# it needs the GIL. Another thread allocating through the binning resource holds the GIL
# while it waits for the bins' lock. Run in a child process, so that a hang fails the test
# instead of stopping the suite.
ADD_BIN_WHILE_ALLOCATING = textwrap.dedent(
    """
    import threading
    import streampool
    from streampool import mr
    from streampool.sim import SimulatedDevice

    with SimulatedDevice(capacity_bytes="1GiB") as dev:
        s, busy = streampool.Stream(), streampool.Stream()
        logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=lambda line: None)
        binning = mr.BinningMemoryResource(logged, 8, 12)
        binning.deallocate(binning.allocate(1000, s), 1000, s)  # the 1 KiB bin holds a chunk
        scratch = mr.CudaAsyncMemoryResource().allocate(16 << 20, busy)
        for _ in range(200):  # work that the dropped bin's synchronisation waits for
            dev.write(busy, scratch, 16 << 20)
        stop, started = threading.Event(), threading.Event()

        def allocate_meanwhile():
            started.set()
            while not stop.is_set():
                q = binning.allocate(1 << 20, s)  # above every bin: the upstream
                binning.deallocate(q, 1 << 20, s)
                wrapped = mr.StatisticsResourceAdaptor(binning)  # asks the binning's depth
                del wrapped

        t = threading.Thread(target=allocate_meanwhile)
        t.start()
        started.wait()
        binning.add_bin(1024, mr.CudaAsyncMemoryResource())  # replaces the 1 KiB bin
        stop.set()
        t.join()
    print("ok")
    """
)


def test_replacing_a_bin_while_another_thread_allocates_does_not_hang() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ADD_BIN_WHILE_ALLOCATING], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _run_for_a_while(stop: threading.Event, targets: list[Callable[[], None]]) -> None:
    """Runs each target on a thread of its own for SECONDS, then sets ``stop`` and joins."""
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    time.sleep(SECONDS)
    stop.set()
    for t in threads:
        t.join()


@pytest.mark.parametrize("kind", ["fixed", "binning"])
def test_no_out_of_memory_while_reclaimable_blocks_serve_every_request(
    kind: str, sim: SimulatedDevice
) -> None:
    # 4 chunks of 512 blocks under a limit of 8 MiB; 6 threads each hold at most 8 blocks
    # and free them on a second stream, so blocks come back to others only by the
    # resource's reclaim (a device synchronisation). Every request fits: none may fail.
    dev = sim
    assert dev is not None
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), 8 << 20)
    top: mr.MemoryResource
    if kind == "binning":
        binning = mr.BinningMemoryResource(limited)
        binning.add_bin(4096)
        top = binning
    else:
        top = mr.FixedSizeMemoryResource(limited, block_size=4096, blocks_to_preallocate=512)
    stop = threading.Event()
    failures: list[str] = []
    allocations = [0]

    def worker(seed: int) -> None:
        rng, s, other = random.Random(seed), streampool.Stream(), streampool.Stream()
        live: list[int] = []
        while not stop.is_set():
            if len(live) >= 8 or (live and rng.random() < 0.5):
                top.deallocate(live.pop(), 4096, other)
            else:
                try:
                    live.append(top.allocate(4096, s))
                    allocations[0] += 1
                except streampool.OutOfMemoryError as e:
                    failures.append(f"{len(live)} held: {e}")
        for p in live:
            top.deallocate(p, 4096, other)

    busy = streampool.Stream()
    scratch = mr.CudaAsyncMemoryResource().allocate(1 << 20, busy)

    def keep_the_device_busy() -> None:  # work that each reclaim's synchronisation waits for
        while not stop.is_set():
            for _ in range(20):
                dev.write(busy, scratch, 1 << 20)
            time.sleep(0.002)

    _run_for_a_while(stop, [lambda i=i: worker(i) for i in range(6)] + [keep_the_device_busy])
    assert allocations[0] > 1000
    assert failures == [], f"{len(failures)} failed, e.g. {failures[0]}"
    assert limited.get_allocated_bytes() <= 8 << 20
    dev.run()
    assert dev.races() == []


def test_statistics_are_one_moments_while_threads_allocate() -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    stop = threading.Event()
    torn: list[object] = []
    reads = [0]

    def worker() -> None:
        s = streampool.Stream()
        while not stop.is_set():
            ptrs = [stats.allocate(256, s) for _ in range(8)]
            for p in ptrs:
                stats.deallocate(p, 256, s)

    def reader() -> None:
        while not stop.is_set():
            st = stats.allocation_counts
            reads[0] += 1
            if (
                st.current_bytes != 256 * st.current_count
                or st.total_bytes != 256 * st.total_count
                or st.total_count < st.current_count
                or st.peak_count < st.current_count
            ):
                torn.append(st)

    _run_for_a_while(stop, [worker, worker, reader])
    assert reads[0] > 100
    assert torn == [], f"{len(torn)} of {reads[0]} reads torn, e.g. {torn[0]}"
    final = stats.allocation_counts
    assert (final.current_bytes, final.current_count) == (0, 0)


def _run(code: str) -> list[str]:
    """Runs ``code`` in a child process (which enters a simulated device); its output's words."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.nosim
def test_ctrl_c_during_a_stack_capture_is_not_lost() -> None:
    # A tracking adaptor that captures the Python stack runs Python code at every
    # allocation: a Ctrl-C landing there must still stop the program.
    words = _run(
        """
        import os, signal, threading, time
        from streampool import mr
        from streampool.sim import SimulatedDevice
        with SimulatedDevice(capacity_bytes="64MiB"):
            tracking = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource(), capture_stacks=True)
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            start = time.monotonic()
            try:
                while time.monotonic() - start < 10:
                    tracking.deallocate(tracking.allocate(256), 256)
                print("not-interrupted")
            except KeyboardInterrupt:
                print("interrupted", time.monotonic() - start < 5)
        """
    )
    assert words == ["interrupted", "True"]


@pytest.mark.nosim
def test_ctrl_c_inside_a_stack_capture_reaches_the_program_every_time() -> None:
    # The timing of the test above made deterministic: the capture itself raises what a
    # Ctrl-C landing in it raises.
    words = _run(
        """
        import sys, traceback
        from streampool import mr
        from streampool.sim import SimulatedDevice
        unraisable = []
        sys.unraisablehook = lambda u: unraisable.append(u.exc_type.__name__)
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        with SimulatedDevice(capacity_bytes="64MiB"):
            tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource(), capture_stacks=True)
            traceback.format_stack = interrupted
            try:
                tracked.allocate(256)
                for _ in range(10000):
                    pass
                print("lost", unraisable)
            except KeyboardInterrupt:
                print("interrupted", unraisable)
        """
    )
    assert words == ["interrupted", "[]"]


@pytest.mark.nosim
def test_ctrl_c_stops_a_simulated_device_run_between_operations() -> None:
    words = _run(
        """
        import os, signal, threading, time
        import streampool
        from streampool import mr
        from streampool.sim import SimulatedDevice
        with SimulatedDevice(capacity_bytes="256MiB") as dev:
            s = streampool.Stream()
            ptr = mr.CudaAsyncMemoryResource().allocate(64 << 20, s)
            for _ in range(400):
                dev.write(s, ptr, 64 << 20)
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            start = time.monotonic()
            try:
                dev.run()
                print("not-interrupted")
            except KeyboardInterrupt:
                print("interrupted", time.monotonic() - start < 2, dev.pending > 0)
            dev.run()
            print(dev.pending)
        """
    )
    assert words == ["interrupted", "True", "True", "0"]


@pytest.mark.nosim
def test_a_keyboard_interrupt_raised_on_another_thread_stays_there() -> None:
    # A logging sink that raises KeyboardInterrupt on a free, on a worker thread: reported
    # there (the unraisable hook), never turned into a Ctrl-C of the main thread.
    words = _run(
        """
        import sys, threading, time
        from streampool import mr
        from streampool.sim import SimulatedDevice
        reports = []
        sys.unraisablehook = lambda u: reports.append(u.exc_type.__name__)
        def sink(line):
            if ",free," in line:
                raise KeyboardInterrupt
        with SimulatedDevice(capacity_bytes="64MiB"):
            logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=sink)
            def work():
                logged.deallocate(logged.allocate(256), 256)
            t = threading.Thread(target=work)
            t.start()
            t.join()
            try:
                time.sleep(0.3)
                print("main-not-interrupted", reports)
            except KeyboardInterrupt:
                print("main-interrupted", reports)
        """
    )
    assert words == ["main-not-interrupted", "['KeyboardInterrupt']"]


@pytest.mark.nosim
def test_ctrl_c_stops_a_failure_callback_that_runs_no_python_code() -> None:
    # `bool(nbytes)` is true: retries for ever, as documented, until Ctrl-C; a builtin runs
    # no bytecode, so the loop itself must look for the signal.
    words = _run(
        """
        import os, signal, threading, time
        from streampool import mr
        from streampool.sim import SimulatedDevice
        with SimulatedDevice(capacity_bytes="64MiB"):
            limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), allocation_limit=1 << 20)
            held = limited.allocate(1 << 20)
            retrying = mr.FailureCallbackResourceAdaptor(limited, bool)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            start = time.monotonic()
            try:
                retrying.allocate(4096)
                print("not-interrupted")
            except KeyboardInterrupt:
                print("interrupted", time.monotonic() - start < 5, limited.get_allocated_bytes() == 1 << 20)
        """
    )
    assert words == ["interrupted", "True", "True"]


def test_concurrent_add_bin_keeps_every_given_bin() -> None:
    # Each thread's add_bin reads the bins to know which given resources stopped being
    # bins: one read before another thread's add dropped that thread's resource.
    upstream = mr.CudaAsyncMemoryResource()
    for _ in range(100):
        binning = mr.BinningMemoryResource(upstream)
        given = [mr.FixedSizeMemoryResource(upstream, size, 1) for size in (1024, 4096)]
        barrier = threading.Barrier(2)

        def add(
            binning: mr.BinningMemoryResource,
            barrier: threading.Barrier,
            resource: mr.FixedSizeMemoryResource,
            size: int,
        ) -> None:
            barrier.wait()
            binning.add_bin(size, resource)

        threads = [
            threading.Thread(target=add, args=(binning, barrier, r, s))
            for r, s in zip(given, (1024, 4096), strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {id(r) for r in binning.bin_mrs} == {id(r) for r in given}
