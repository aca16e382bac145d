"""The harness's workloads: named, documented, parameterised, usable from Python.

Each workload is ``run(resource, **params) -> dict`` over a streampool resource (peers
come wrapped, see :mod:`streampool.harness.specs`) and returns the same metrics:
``throughput`` (in ``unit``), ``events``, ``seconds``, ``alloc_seconds`` (time inside the
allocator's calls, summed over threads), ``allocate``/``free`` latency percentiles in ns,
``peak_live_bytes``, ``peak_reserved_bytes``, ``oom_events``. Example::

    from streampool.harness import make_resource, workloads
    pool = make_resource("pool(async)")
    print(workloads.run("window", pool, threads=4))  # one stream per thread (streams=4)

The trace workloads (random, window) generate a :class:`~streampool.harness.trace.Trace`
and replay it (natively when this build has the native replayer); multistream, pipeline
and larger-than-memory launch kernels (:mod:`streampool.kernels`) between allocations.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import queue
import random as _random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _native
from .._native import Stream, available_device_memory, parse_size, using_simulated_device
from . import trace as _trace
from ._threads import run_threads
from .output import human_bytes
from .specs import Candidate, make_resource

__all__ = [
    "HANDOFF_DEPTH",
    "WORKLOADS",
    "Workload",
    "WorkloadError",
    "check",
    "check_events",
    "check_param",
    "oversubscribes",
    "peak_live",
    "random_trace",
    "run",
    "window_trace",
]


class WorkloadError(RuntimeError):
    """A workload that cannot run here (too large for the device, kernels missing)."""


def _kernels() -> Any:
    try:
        from .. import kernels
    except ImportError as e:
        raise WorkloadError(
            f"this build of streampool has no kernels module (streampool.kernels): {e}"
        ) from None
    return kernels


# --- trace workloads --------------------------------------------------------------------


def random_trace(
    allocations: int = 10_000,
    max_size: int | str = "4MiB",
    threads: int = 1,
    streams: int = 0,
    seed: int = 0,
) -> _trace.Trace:
    """RMM's ``random_allocations`` bench: each thread makes ``allocations`` allocations of
    uniformly random sizes in ``[1, max_size]``; at each step it allocates or (half the
    time, when it holds any) frees a random one of its live allocations; what is left is
    freed at the end. Thread ``t`` works on stream ``t % streams`` (``streams`` 0: one
    stream per thread). The log lists the threads' operations in turn, one of each at a
    time, as threads running at one pace would make them."""
    rng = _random.Random(seed)
    top = parse_size(max_size)
    per_thread: list[list[tuple[int, int, int, int, int, int]]] = []
    next_id = 0
    streams = streams or threads  # 0: one per thread, as on the command line
    for t in range(threads):
        s = t % streams
        records: list[tuple[int, int, int, int, int, int]] = []
        per_thread.append(records)
        live: list[tuple[int, int]] = []
        made = 0
        while made < allocations or live:
            if made < allocations and (not live or rng.random() < 0.5):
                size = rng.randint(1, top)
                records.append((0, size, next_id, t, s, _trace.ALLOCATE))
                live.append((next_id, size))
                next_id += 1
                made += 1
            else:
                alloc_id, size = live.pop(rng.randrange(len(live)))
                records.append((0, size, alloc_id, t, s, _trace.FREE))
    return _in_turn(per_thread)


def _in_turn(per_thread: list[list[tuple[int, int, int, int, int, int]]]) -> _trace.Trace:
    """The threads' operations listed in turn, the first of each thread, then the second
    of each, and so on: the order of threads running at one pace, so that the log's own
    peak of live bytes (:func:`~streampool.harness.trace.recorded_peak`) is that of threads
    running together, not of one after another. (A replay keeps each thread's order; the
    replay measures its own peak.)"""
    merged = itertools.chain.from_iterable(itertools.zip_longest(*per_thread))
    return _trace.Trace([r for r in merged if r is not None])


def window_trace(
    allocations: int = 10_000,
    window: int = 16,
    sizes: tuple[int | str, ...] = ("256", "64KiB", "1MiB"),
    threads: int = 1,
    streams: int = 0,
    seed: int = 0,
) -> _trace.Trace:
    """Each thread keeps a ring of ``window`` live allocations: it allocates one (a size
    drawn from ``sizes``) and, once the ring is full, frees the oldest, ``allocations``
    times; then frees the rest. Thread ``t`` works on stream ``t % streams`` (``streams``
    0: one stream per thread). The log lists the threads' operations in turn, one of each
    at a time, as threads running at one pace would make them."""
    rng = _random.Random(seed)
    choices = [parse_size(s) for s in sizes]
    per_thread: list[list[tuple[int, int, int, int, int, int]]] = []
    next_id = 0
    streams = streams or threads  # 0: one per thread, as on the command line
    for t in range(threads):
        s = t % streams
        records: list[tuple[int, int, int, int, int, int]] = []
        per_thread.append(records)
        ring: list[tuple[int, int]] = []
        for _ in range(allocations):
            size = rng.choice(choices)
            records.append((0, size, next_id, t, s, _trace.ALLOCATE))
            ring.append((next_id, size))
            next_id += 1
            if len(ring) > window:
                alloc_id, old = ring.pop(0)
                records.append((0, old, alloc_id, t, s, _trace.FREE))
        records.extend((0, size, alloc_id, t, s, _trace.FREE) for alloc_id, size in ring)
    return _in_turn(per_thread)


def oversubscribes(candidate: Candidate, t: _trace.Trace | int) -> str | None:
    """Why running a workload whose peak live bytes are ``t`` (a trace: its recorded peak,
    :func:`~streampool.harness.trace.recorded_peak`; see :func:`peak_live`) on
    ``candidate`` is refused here, or None. On a real GPU, managed memory (the resource's
    ``memory_kind``) for a peak above the device's free memory is refused: the harness
    never oversubscribes a shared GPU (it can hang it). On the simulated device managed
    memory is the device's own memory: an over-large workload runs out of memory there."""
    if candidate.resource.memory_kind != "managed" or using_simulated_device():
        return None
    peak = t if isinstance(t, int) else _trace.recorded_peak(t.records)
    free = available_device_memory()[0]
    if peak <= free:
        return None
    what = "workload's" if isinstance(t, int) else "trace's"
    return (
        f"{candidate.spec}: the {what} peak live bytes ({human_bytes(peak)}) are above the "
        f"device's free memory ({human_bytes(free)}): running it on managed memory would "
        "oversubscribe the GPU, and the harness never oversubscribes a shared GPU (it can hang "
        "it); run it with smaller sizes or on a device with more free memory"
    )


def _refuse_oversubscription(candidate: Candidate, peak: _trace.Trace | int) -> None:
    refused = oversubscribes(candidate, peak)
    if refused is not None:
        raise WorkloadError(refused)


#: Chunks a pipeline's producer may have handed over that its consumer has not taken.
HANDOFF_DEPTH = 4


def peak_live(name: str, params: dict[str, Any]) -> int:
    """The most bytes workload ``name`` can have live at once with ``params`` (its own and
    ``threads``; the defaults for those not given): what managed memory must find free on
    a real GPU (:func:`oversubscribes`). random and window: the sum of the threads' own
    peaks; multistream: one ``size`` per thread; pipeline: ``HANDOFF_DEPTH`` + 2 chunks per
    pair (those handed over, the one being made and the one being consumed);
    larger-than-memory: ``total`` (0: half the free memory); replay: the log's recorded
    peak (what the program had live)."""
    declared = WORKLOADS[name].declared()
    p = {k: v.default for k, v in declared.items()} | params
    threads: int = p["threads"]
    if name in ("random", "window"):
        size = p["max_size"] if name == "random" else p["window"]
        return _generated_peak(name, p["allocations"], size, threads, p["streams"], p["seed"])
    if name == "multistream":
        return threads * parse_size(p["size"])
    if name == "pipeline":
        return threads * (HANDOFF_DEPTH + 2) * parse_size(p["chunk_size"])
    if name == "larger-than-memory":
        return parse_size(p["total"]) or available_device_memory()[0] // 2
    log = p["log"]
    subject = replay_subject(log if isinstance(log, _trace.Trace) else _trace.read_log(log), p["passes"])
    return subject if isinstance(subject, int) else _trace.recorded_peak(subject.records)


def replay_subject(t: _trace.Trace, passes: int) -> _trace.Trace | int:
    """What a replay of ``passes`` passes of ``t`` is judged on for oversubscription
    (:func:`oversubscribes`): ``t`` itself, whose recorded peak is one pass's, where every
    pass frees what it allocates (a log does: its closing frees; a refusal then names the
    log); else the peak of all the passes in bytes (what stays live piles up)."""
    if passes == 1 or 2 * sum(r[5] for r in t.records) == t.events:
        return t
    return _trace.recorded_peak(t.repeated(passes).records)


@functools.lru_cache(maxsize=16)
def _generated_peak(
    name: str, allocations: int, size: int | str, threads: int, streams: int, seed: int
) -> int:
    """:func:`_threads_peak` of a generated log, made once per set of parameters (the
    command line and :func:`~streampool.harness.bench.measure` both ask before a run)."""
    if name == "random":
        return _threads_peak(random_trace(allocations, size, threads=threads, streams=streams, seed=seed))
    return _threads_peak(window_trace(allocations, int(size), threads=threads, streams=streams, seed=seed))


def _threads_peak(t: _trace.Trace) -> int:
    """The sum of the threads' own peaks of live bytes in ``t``: the most that a replay
    keeping each thread's order can have live at once, when no thread frees another's
    allocation (as in the generated logs)."""
    per_thread: dict[int, list[tuple[int, ...]]] = {}
    for r in t.records:
        per_thread.setdefault(r[3], []).append(r)
    return sum(_trace.recorded_peak(records) for records in per_thread.values())


def _replay_result(
    candidate: Candidate,
    t: _trace.Trace,
    gap_scale: float,
    peak: int | _trace.Trace | None = None,
    max_lead: float | None = _trace.MAX_LEAD,
) -> dict[str, Any]:
    """``t`` replayed on ``candidate``, refused first where its peak (``peak``: bytes, or a
    trace's recorded peak; else ``t``'s) would oversubscribe the GPU (:func:`oversubscribes`)."""
    _refuse_oversubscription(candidate, t if peak is None else peak)
    out = _trace.replay(
        candidate.resource, t, gap_scale=gap_scale, max_lead=max_lead, reserved=candidate.reserved
    )
    # The calls that succeeded: a failed allocation (and its skipped free) is no work done.
    out["throughput"] = out["events"] / out["seconds"] if out["seconds"] else 0.0
    out["unit"] = "events/s"
    return out


def random(
    candidate: Candidate,
    *,
    threads: int = 1,
    streams: int = 0,
    allocations: int = 10_000,
    max_size: int | str = "4MiB",
    seed: int = 0,
) -> dict[str, Any]:
    """RMM's random_allocations bench, replayed (see :func:`random_trace`; ``streams`` 0:
    one per thread)."""
    t = random_trace(allocations, max_size, threads, streams, seed)
    return _replay_result(candidate, t, 0.0, _threads_peak(t))


def window(
    candidate: Candidate,
    *,
    threads: int = 1,
    streams: int = 0,
    allocations: int = 10_000,
    window: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Per-thread rings of live allocations, replayed (see :func:`window_trace`; ``streams``
    0: one per thread)."""
    t = window_trace(allocations, window, threads=threads, streams=streams, seed=seed)
    return _replay_result(candidate, t, 0.0, _threads_peak(t))


def replay(
    candidate: Candidate,
    *,
    log: str | _trace.Trace,
    gap_scale: float = 0.0,
    max_lead: float | None = _trace.MAX_LEAD,
    passes: int = 1,
    threads: int = 0,
    streams: int = 0,
) -> dict[str, Any]:
    """Replays a log (a path, or a Trace): each recorded thread and stream in recorded
    order, the gaps scaled by ``gap_scale`` (0: as fast as possible), no thread more than
    ``max_lead`` seconds of recorded time ahead of another (None: no bound;
    :func:`streampool.harness.trace.replay`), the whole log ``passes`` times over in each
    run (:meth:`~streampool.harness.trace.Trace.repeated`: a log too short to time alone).
    ``threads`` and ``streams`` are ignored (the log's own are replayed)."""
    t = _trace.read_log(log) if isinstance(log, str) else log
    check_replay_threads(t, "workload 'replay'")
    if passes * t.events > MAX_REPLAY_EVENTS:
        raise ValueError(
            f"workload 'replay': passes={passes} times the log's {t.events} events is more than "
            f"{MAX_REPLAY_EVENTS:,} events a run (each takes host memory while it is replayed)"
        )
    return _replay_result(
        candidate, t.repeated(passes), gap_scale, replay_subject(t, passes), max_lead=max_lead
    )


# --- kernel workloads -------------------------------------------------------------------


class _Meter:
    """Per-call latencies, allocator time and live/reserved peaks, shared by threads.

    The timed span holds the call alone: the resource's methods and the clock are looked
    up before it (on a cold cache the look-ups cost 50-120 ns a call, measured on the
    development machine, which the allocator's share would otherwise carry), and the end
    is read before ``append`` is."""

    def __init__(self, candidate: Candidate) -> None:
        self.candidate = candidate
        self._allocate = candidate.resource.allocate
        self._deallocate = candidate.resource.deallocate
        self.lock = threading.Lock()
        self.lat: tuple[list[int], list[int]] = ([], [])
        self.live = self.peak_live = self.peak_reserved = 0
        self.oom = 0
        self.counters = _trace.pool_counters(candidate.resource)

    def allocate(self, size: int, stream: Stream, mine: list[int]) -> int | None:
        allocate, clock = self._allocate, time.perf_counter_ns
        c = clock()
        try:
            ptr = allocate(size, stream)
        except MemoryError:
            with self.lock:
                self.oom += 1
            return None
        end = clock()
        mine.append(end - c)
        with self.lock:
            self.live += size
            self.peak_live = max(self.peak_live, self.live)
        return ptr

    def free(self, ptr: int, size: int, stream: Stream, mine: list[int]) -> None:
        deallocate, clock = self._deallocate, time.perf_counter_ns
        c = clock()
        deallocate(ptr, size, stream)
        end = clock()
        mine.append(end - c)
        with self.lock:
            self.live -= size

    def sample(self) -> None:
        value = self.candidate.reserved()
        if value is not None:
            with self.lock:
                self.peak_reserved = max(self.peak_reserved, value)

    def merge(self, a: list[int], f: list[int]) -> None:
        with self.lock:
            self.lat[0].extend(a)
            self.lat[1].extend(f)

    def result(self, seconds: float, done: int, unit: str) -> dict[str, Any]:
        """The metrics; ``done``: the work that succeeded, in ``unit`` (per second), and
        ``events`` the allocator calls that succeeded (the failed ones are ``oom_events``)."""
        self.sample()
        reserved = self.peak_reserved if self.candidate.reserved() is not None else None
        return {
            "events": len(self.lat[0]) + len(self.lat[1]),
            "seconds": seconds,
            "throughput": done / seconds if seconds else 0.0,
            "unit": unit,
            "alloc_seconds": (sum(self.lat[0]) + sum(self.lat[1])) / 1e9,
            "longest_call_ns": max(self.lat[0] + self.lat[1], default=0),
            "allocate": _trace.percentiles(self.lat[0]),
            "free": _trace.percentiles(self.lat[1]),
            "peak_live_bytes": self.peak_live,
            "peak_reserved_bytes": reserved,
            "oom_events": self.oom,
            **_trace.counted_since(self.counters, self.candidate.resource),
            "latencies_ns": {"allocate": self.lat[0], "free": self.lat[1]},
        }


def _threads(n: int, target: Callable[[int], None], stop: threading.Event) -> float:
    """Runs ``target(i)`` on ``n`` threads started together; returns the seconds from their
    start to the last one's end. On Ctrl-C sets ``stop`` (which the targets check) and
    joins them before the KeyboardInterrupt goes on."""
    errors: list[BaseException] = []
    started: list[float] = []
    barrier = threading.Barrier(n, action=lambda: started.append(time.perf_counter()))

    def body(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as e:
            errors.append(e)

    run_threads([functools.partial(body, i) for i in range(n)], stop, barrier.abort)
    seconds = time.perf_counter() - started[0]
    if errors:
        raise errors[0]
    return seconds


def multistream(
    candidate: Candidate,
    *,
    threads: int = 1,
    streams: int = 0,
    iterations: int = 200,
    size: int | str = "1MiB",
    kernel_iterations: int = 1,
) -> dict[str, Any]:
    """Allocations between kernels on many streams: ``threads`` threads share ``streams``
    streams (0: one per thread) round-robin; each iteration allocates ``size`` bytes on its
    stream, fills it and computes on it there (kernels), and frees it on the same stream."""
    kernels = _kernels()
    nbytes = parse_size(size)
    _refuse_oversubscription(candidate, peak_live("multistream", {"threads": threads, "size": nbytes}))
    streams = streams or threads  # 0: one per thread, as on the command line
    pool = [Stream() for _ in range(streams)]
    meter = _Meter(candidate)
    stop = threading.Event()

    def body(i: int) -> None:
        a: list[int] = []
        f: list[int] = []
        for n in range(iterations):
            if stop.is_set():
                break
            stream = pool[(i + n * threads) % streams]
            ptr = meter.allocate(nbytes, stream, a)
            if ptr is None:
                continue
            kernels.fill(ptr, nbytes, n, stream)
            kernels.compute(ptr, nbytes, stream, iterations=kernel_iterations)
            meter.free(ptr, nbytes, stream, f)
            if n % 64 == 0:
                meter.sample()
        meter.merge(a, f)

    seconds = _threads(threads, body, stop)
    for s in pool:
        s.synchronize()
    return meter.result(seconds, len(meter.lat[0]), "iterations/s")  # one allocation an iteration


def _calibrate(kernels: Any, ptr: int, nbytes: int, stream: Stream, kernel_us: float) -> int:
    """Compute-kernel iterations that take about ``kernel_us`` on this device."""
    if kernel_us <= 0:
        return 0
    kernels.compute(ptr, nbytes, stream, iterations=1)  # warm-up (the JIT, the first launch)
    stream.synchronize()
    start = time.perf_counter()
    kernels.compute(ptr, nbytes, stream, iterations=8)
    stream.synchronize()
    per_iteration_us = (time.perf_counter() - start) * 1e6 / 8
    return max(1, round(kernel_us / per_iteration_us)) if per_iteration_us > 0 else 1


def pipeline(
    candidate: Candidate,
    *,
    threads: int = 1,
    streams: int = 0,
    chunks: int = 1000,
    chunk_size: int | str = "1MiB",
    kernel_us: float = 20.0,
    check_every: int = 1,
    driver: str = "auto",
    long_call_us: float = 0.0,
    null_call_us: float = 0.0,
) -> dict[str, Any]:
    """The producer/consumer pipeline (the workload of RMM's async-default discussion):
    ``threads`` producer/consumer pairs; each producer allocates ``chunks`` chunks on its
    stream, fills them there and hands them over; its consumer computes on each chunk on
    its own stream (about ``kernel_us`` of kernel time), checks every ``check_every``-th
    chunk (a check synchronises the consumer's stream; 0: never) and frees it there.
    Reports chunks/s, the allocator's stall time (``alloc_seconds``, its share of host
    time) and the longest single call; ``mismatches`` counts chunks whose data was wrong.

    ``driver="native"`` runs it from Rust threads (``streampool._native.pipeline``; the
    hand-off is an event the consumer's stream waits on), ``"python"`` from Python threads
    launching the kernels (the producer's stream is synchronised before the hand-off),
    ``"auto"`` the native one when this build has it. ``streams`` is ignored (two per pair).

    ``long_call_us`` (native driver only; 0: off) classifies the allocator calls longer than
    that in ``long_calls``: how many there were, and of them how many the operating system
    switched out (``preempted``), how many slept (``slept``: a lock, the driver), how many
    lost their time to the host or to interrupts (``stolen``: the thread's CPU clock ran for
    less than half the call) and how many ran (``on_cpu``), from each thread's context
    switches and CPU clock read around every call; and where a watchdog found the threads
    (``sampled``, ``running_in``; see docs/harness.md). It tells a long call the allocator
    caused from one the host did. ``null_call_us`` (with ``long_call_us``; at most 100)
    also times, after every allocator call, a span that only spins that long, and
    classifies those over ``long_call_us`` in ``null_calls``: what the machine alone gives
    a call of that length, whatever the allocator."""
    nbytes = parse_size(chunk_size)
    _check_pipeline(check_every, driver, long_call_us, null_call_us)
    _refuse_oversubscription(candidate, peak_live("pipeline", {"threads": threads, "chunk_size": nbytes}))
    native = getattr(_native, "pipeline", None)
    if (long_call_us or driver == "native") and native is None:
        raise WorkloadError("pipeline driver=native: this build of streampool has no native pipeline")
    if native is not None and driver != "python":
        out = _trace.native_report(
            native(
                candidate.resource,
                pairs=threads,
                chunk_bytes=nbytes,
                chunks_per_pair=chunks,
                kernel_us=kernel_us,
                queue_depth=HANDOFF_DEPTH,
                check_every=check_every,
                long_call_us=long_call_us,
                null_call_us=null_call_us,
            )
        )
        out["throughput"] = out["chunks_per_second"]
        out["unit"] = "chunks/s"
        out["driver"] = "native"
        out["streams"] = 2 * threads  # a producer's and a consumer's per pair
        return out
    kernels = _kernels()
    meter = _Meter(candidate)
    probe_stream = Stream()
    probe = candidate.resource.allocate(nbytes, probe_stream)
    iterations = _calibrate(kernels, probe, nbytes, probe_stream, kernel_us)
    candidate.resource.deallocate(probe, nbytes, probe_stream)
    probe_stream.synchronize()
    mismatches, checked = [0], [0]
    stop = threading.Event()

    def pair(i: int) -> None:
        handoff: queue.Queue[tuple[int, int] | None] = queue.Queue(maxsize=HANDOFF_DEPTH)
        produce, consume = Stream(), Stream()
        a: list[int] = []
        f: list[int] = []

        def producer() -> None:
            try:
                for n in range(chunks):
                    if stop.is_set():
                        break
                    ptr = meter.allocate(nbytes, produce, a)
                    if ptr is None:
                        continue
                    kernels.fill(ptr, nbytes, i * chunks + n, produce)
                    produce.synchronize()  # the consumer's stream may use it once this is done
                    handoff.put((ptr, i * chunks + n))
                    if n % 64 == 0:
                        meter.sample()
            finally:
                handoff.put(None)

        t = threading.Thread(target=producer)
        t.start()
        while (item := handoff.get()) is not None:
            ptr, seed = item
            if iterations:
                kernels.compute(ptr, nbytes, consume, iterations=iterations)
            n = seed - i * chunks
            # A check synchronises the consumer's stream.
            if check_every and n % check_every == 0:
                checked[0] += 1
                mismatches[0] += bool(kernels.check(ptr, nbytes, seed, consume))
            meter.free(ptr, nbytes, consume, f)
        t.join()
        consume.synchronize()
        meter.merge(a, f)

    seconds = _threads(threads, pair, stop)
    out = meter.result(seconds, len(meter.lat[1]), "chunks/s")  # each chunk made is freed
    out["driver"] = "python"
    out["host_threads"] = 2 * threads  # a producer and a consumer per pair
    out["streams"] = 2 * threads  # and a stream each
    out["mismatches"] = mismatches[0]
    out["checked"] = checked[0]
    out["compute_iterations"] = iterations
    return out


#: larger-than-memory's default total on the simulated device at most: its memory is the
#: host's, which the kernels touch.
SIM_DEFAULT_TOTAL = 1 << 30


def larger_than_memory(
    candidate: Candidate,
    *,
    threads: int = 1,  # one thread and one stream: the command line refuses others
    streams: int = 1,
    total: int | str = 0,
    chunk_size: int | str = "64MiB",
    passes: int = 2,
) -> dict[str, Any]:
    """Work on a data set larger than what is resident: ``total`` bytes (default: half the
    device's free memory, at most 1 GiB on the simulated device, whose memory is the
    host's) in chunks of ``chunk_size`` (the last one smaller when ``total``
    is not a whole number of chunks), all allocated, then ``passes``
    passes that fill and compute on each chunk in turn on one stream, then freed. Meant for
    ``managed`` against ``prefetch(managed)`` (prefetching migrates the pages before the
    kernels need them). On a real GPU, a ``total`` above the device's free memory is refused
    (the harness never oversubscribes a shared GPU). On the simulated device managed memory
    is the device's own memory, so a ``total`` above its capacity runs out of memory there
    (the chunks that do not fit are counted as out-of-memory events and left out) rather
    than oversubscribing (``STREAMPOOL_SIM_CAPACITY`` sets the capacity)."""
    kernels = _kernels()
    free, _ = available_device_memory()
    default = min(free // 2, SIM_DEFAULT_TOTAL) if using_simulated_device() else free // 2
    nbytes = parse_size(total) or default  # a total of 0 bytes: the default
    if nbytes <= 0:
        raise WorkloadError(
            f"larger-than-memory: no free device memory left for the data set ({human_bytes(free)} "
            "free once the resource under test was made, and the default total is half of that); "
            "pass --param total=SIZE"
        )
    chunk = min(parse_size(chunk_size), nbytes)
    if chunk <= 0:
        raise WorkloadError(f"larger-than-memory: chunk_size must be at least 1 byte, not {chunk_size!r}")
    if nbytes > free and not using_simulated_device():
        raise WorkloadError(
            f"larger-than-memory: total={nbytes} bytes is above the device's free memory ({free} bytes); "
            "choose a smaller --param total=SIZE"
        )
    stream = Stream()
    meter = _Meter(candidate)
    a: list[int] = []
    f: list[int] = []
    start = time.perf_counter()
    sizes = [chunk] * (nbytes // chunk) + ([nbytes % chunk] if nbytes % chunk else [])
    ptrs = [(meter.allocate(size, stream, a), size) for size in sizes]
    held = [(p, size) for p, size in ptrs if p is not None]
    meter.sample()
    for p in range(passes):
        for i, (ptr, size) in enumerate(held):
            kernels.fill(ptr, size, p * len(held) + i, stream)
            kernels.compute(ptr, size, stream)
    stream.synchronize()
    for ptr, size in held:
        meter.free(ptr, size, stream, f)
    stream.synchronize()
    seconds = time.perf_counter() - start
    meter.merge(a, f)
    out = meter.result(seconds, passes * sum(size for _, size in held), "bytes/s")
    return out


@dataclass(frozen=True)
class Workload:
    """A named workload: ``run(candidate, **params)``, its default and ``--quick`` params,
    and the command-line options it ignores (``threads``, ``streams``), each with why."""

    name: str
    run: Callable[..., dict[str, Any]]
    quick: dict[str, Any]
    ignores: dict[str, str] = field(default_factory=dict)
    #: The resources ``bench`` measures it on when ``--resources`` is not given (None: the
    #: command line's default).
    resources: str | None = None

    @property
    def doc(self) -> str:
        return (self.run.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")

    @property
    def parameters(self) -> list[str]:
        """The parameters it takes (``threads``, ``streams`` and its own), in order."""
        return list(self.declared())

    def declared(self) -> dict[str, inspect.Parameter]:
        """Its parameters by name, as its signature declares them."""
        sig = inspect.signature(self.run)
        return {n: p for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("random", random, {"allocations": 500}),
        Workload("window", window, {"allocations": 1000}),
        Workload("multistream", multistream, {"iterations": 20, "size": "64KiB"}),
        Workload(
            "pipeline",
            pipeline,
            {"chunks": 20, "chunk_size": "256KiB", "kernel_us": 5},
            {"streams": "each producer/consumer pair (--threads) has two streams of its own"},
        ),
        Workload(
            "larger-than-memory",
            larger_than_memory,
            {"total": "16MiB", "chunk_size": "4MiB", "passes": 1},
            {
                "threads": "its passes run on one thread, one chunk after another",
                "streams": "its passes run on one stream, one chunk after another",
            },
            "managed,prefetch(managed)",
        ),
        Workload(
            "replay",
            replay,
            {},
            {
                "threads": "the log's own threads are replayed",
                "streams": "the log's own streams are replayed",
            },
        ),
    )
}

#: The least value of each numeric parameter that has one (sizes in bytes); numbers must
#: also be finite. (``pipeline`` checks its own ``check_every``, ``long_call_us`` and
#: ``null_call_us``, which take more than a least value.)
_LEAST: dict[str, int] = {
    "allocations": 1,
    "window": 1,
    "max_size": 1,
    "iterations": 1,
    "size": 1,
    "kernel_iterations": 0,
    "chunks": 1,
    "chunk_size": 8,
    "kernel_us": 0,
    "total": 0,  # 0: the default, half the device's free memory
    "passes": 1,
    "gap_scale": 0,
    "max_lead": 0,
    "streams": 0,  # 0: one per thread
    "threads": 1,
}


#: The most events one run of the replay workload replays (its passes times the log's).
MAX_REPLAY_EVENTS = 4_000_000

#: The most threads a workload runs (the native replayer's bound: one thread each).
MAX_THREADS = 1024


def check_replay_threads(t: _trace.Trace, name: str) -> None:
    """ValueError, naming ``name`` (the log or workload), when the log ``t`` has more
    threads than the replayer runs (one each, at most ``MAX_THREADS``)."""
    if t.threads > MAX_THREADS:
        raise ValueError(
            f"{name}: the log has {t.threads} threads, and the replayer runs one thread for each, "
            f"at most {MAX_THREADS}"
        )


#: The greatest value of each numeric parameter that has one.
_MOST: dict[str, int] = {
    "threads": MAX_THREADS,
    "allocations": MAX_REPLAY_EVENTS // 2,
    "chunks": 1 << 32,  # the pipeline's native driver's bound, a chunk each pair
}

#: The workloads whose trace is built in host memory first, two events an allocation.
_TRACED = ("window", "random")


def check_events(name: str, params: dict[str, Any], threads: int) -> None:
    """ValueError when a traced workload (window, random) would build more than
    ``MAX_REPLAY_EVENTS`` events for one run on ``threads`` threads (its ``allocations``
    are each thread's; each is two events held in host memory), as a replay is refused."""
    if name not in _TRACED:
        return
    allocations = params.get("allocations", WORKLOADS[name].declared()["allocations"].default)
    events = 2 * allocations * threads
    if events > MAX_REPLAY_EVENTS:
        raise ValueError(
            f"workload {name!r}: allocations={allocations:,} on {threads} thread{'s' if threads != 1 else ''} "
            f"is {events:,} events, more than {MAX_REPLAY_EVENTS:,} a run (each takes host memory "
            "while it is replayed): fewer allocations or threads"
        )


def _check_pipeline(check_every: int, driver: str, long_call_us: float, null_call_us: float) -> None:
    """The pipeline's parameters that take more than a least value: ValueError naming them."""
    if check_every < 0:
        raise ValueError(f"pipeline: check_every must be 0 (never) or more, not {check_every}")
    if driver not in ("auto", "native", "python"):
        raise ValueError(f"pipeline: driver must be auto, native or python, not {driver!r}")
    if not (long_call_us >= 0 and math.isfinite(long_call_us)):
        raise ValueError(f"pipeline: long_call_us must be a finite number >= 0 (0: off), not {long_call_us}")
    if not (0 <= null_call_us <= 100):
        raise ValueError(f"pipeline: null_call_us must be between 0 (off) and 100, not {null_call_us}")
    if null_call_us and not long_call_us:
        raise ValueError("pipeline: null_call_us needs long_call_us (the null calls are counted against it)")
    if long_call_us and driver == "python":
        raise ValueError(
            "pipeline: long_call_us classifies the calls of the native driver (driver=native); "
            "from Python threads a long call is most often a wait for the GIL"
        )


def check_param(workload: str, key: str, value: Any, kind: str) -> None:
    """Refuses ``value`` for parameter ``key`` of ``workload`` (declared as ``kind``:
    ``int``, ``float``, ``float | None``, or ``int | str`` for a size) when it is of the wrong type or below
    its least value (``_LEAST``) or above its greatest (``_MOST``): ValueError naming the
    parameter and what it takes."""
    where = f"workload {workload!r}: {key}"
    if kind == "float | None":
        if value is None:
            return
        kind = "float"
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where} must be an integer, not {value!r}")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{where} must be a number, not {value!r}")
    number, unit = value, ""
    if kind == "int | str":
        unit = " bytes" if _LEAST.get(key) != 1 else " byte"
        try:
            number = parse_size(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} must be a size in bytes, e.g. 64KiB, not {value!r}") from None
    least = _LEAST.get(key)
    if least is not None and not least <= number < math.inf:  # NaN fails every comparison
        finite = ", and finite" if kind == "float" else ""
        raise ValueError(f"{where} must be at least {least}{unit}{finite}, not {value!r}")
    most = _MOST.get(key)
    if most is not None and number > most:
        raise ValueError(f"{where} must be at most {most}, not {value!r}")


def check(name: str, params: dict[str, Any]) -> None:
    """Checks ``params`` for workload ``name`` without running it: ValueError naming the
    valid workloads, naming a parameter the workload does not take and listing those it
    does, or naming a parameter whose value is of the wrong type or out of range
    (:func:`check_param`)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}")
    declared = WORKLOADS[name].declared()
    unknown = [p for p in params if p not in declared]
    if unknown:
        raise ValueError(
            f"workload {name!r} takes no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters: {', '.join(declared)}"
        )
    # A number where the workload takes only one (sizes also take strings: "64KiB"), in range.
    for key, value in params.items():
        check_param(name, key, value, str(declared[key].annotation))
    if "threads" in params:
        check_events(name, params, params["threads"])
    if name == "pipeline":
        given = {k: p.default for k, p in declared.items()} | params
        _check_pipeline(given["check_every"], given["driver"], given["long_call_us"], given["null_call_us"])


def run(name: str, candidate: Candidate | str | _native.MemoryResource, **params: Any) -> dict[str, Any]:
    """Runs workload ``name`` on ``candidate``, its ``params`` checked first (:func:`check`):
    what ``make_resource(spec)`` made, a spec string (made so), or a resource (whose reserved
    bytes are reported where it holds memory itself, such as a pool, else None). The
    resource is measured as it is: nothing is trimmed first (``bench.one_run`` does)."""
    check(name, params)
    if isinstance(candidate, str):
        candidate = make_resource(candidate)
    elif isinstance(candidate, _native.MemoryResource):
        candidate = Candidate(type(candidate).__name__, candidate, "")
    elif not isinstance(candidate, Candidate):
        raise TypeError(
            "workloads.run() measures a resource spec (e.g. 'pool(async)'), what "
            f"make_resource(spec) made, or a MemoryResource, not {type(candidate).__name__}"
        )
    return WORKLOADS[name].run(candidate, **params)
