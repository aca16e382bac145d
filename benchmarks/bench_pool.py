"""streampool's resources from Python, on the workloads of benchmarks/bench_py.py (the peers' side).

- fixed: one thread, one non-blocking stream: ``mr.allocate``/``mr.deallocate`` pairs and
  ``DeviceBuffer`` create+drop, median ns per pair over repetitions (the pool bare and
  under a StatisticsResourceAdaptor, which forwards its fast path);
- control: the same loops over calls that do nothing (a pair of empty function calls, an
  empty Python class made with the same keywords as ``DeviceBuffer``): what the interpreter
  costs on this host at this moment, the floor under the two fixed figures;
- window: T threads, each on its own stream, each keeping a FIFO of 16 live allocations of
  log-uniform size in [1 KiB, 4 MiB] (pre-generated), freeing the oldest before each new
  one; aggregate allocations/s in one common window, ns per operation per thread, and the
  slowest thread's share of the mean; beside them, memory: the peak of the bytes the
  resource reserved (the pool's ``peak_reserved_bytes``, or the driver pool's reserved
  bytes, sampled) over the peak of the live bytes (summed over threads, sampled every
  millisecond, so a short peak can be missed and the ratio reads high).

Usage: python benchmarks/bench_pool.py [--secs 0.5] [--reps 3] [--threads 1,2,4,8,16]
       [--json FILE]. Without a CUDA driver it runs on the simulated device and says so
(those numbers measure the simulator).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import streampool
from streampool import mr

WINDOW = 16


def resources() -> dict[str, Callable[[], mr.MemoryResource]]:
    return {
        "ShardedPool(async)": lambda: mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()),
        # An adaptor over the pool: what forwarding the pool's fast path through it costs.
        "Statistics(Pool)": lambda: mr.StatisticsResourceAdaptor(
            mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
        ),
        # RMM's arena interface over the sharded pool: a fixed 2 GiB reservation (the window
        # workload holds at most 16 threads x 16 x 4 MiB = 1 GiB live).
        "Arena(async)": lambda: mr.ArenaMemoryResource(mr.CudaAsyncMemoryResource(), arena_size="2GiB"),
        "CudaAsync": lambda: mr.CudaAsyncMemoryResource(),
    }


def timed_pairs(
    a: Callable[[int, streampool.Stream], Any],
    d: Callable[[Any, int, streampool.Stream], Any],
    n: int,
    s: streampool.Stream,
    reps: int,
    iters: int = 20000,
) -> float:
    """Median ns per ``p = a(n, s); d(p, n, s)`` over the repetitions."""
    samples = []
    for _ in range(max(reps, 3)):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            p = a(n, s)
            d(p, n, s)
        samples.append((time.perf_counter_ns() - t0) / iters)
    return statistics.median(samples)


def fixed_pairs(resource: mr.MemoryResource, n: int, reps: int) -> float:
    s = streampool.Stream()
    ns = timed_pairs(resource.allocate, resource.deallocate, n, s, reps)
    s.synchronize()
    return ns


def fixed_buffers(
    resource: mr.MemoryResource, n: int, reps: int, iters: int = 20000, current: bool = False
) -> float:
    """ns per DeviceBuffer create+drop; with ``current``, on the current device resource
    (``DeviceBuffer(size=n, stream=s)``, as RMM users write it) set to ``resource``."""
    s = streampool.Stream()
    DB = streampool.DeviceBuffer
    previous = streampool.set_current_device_resource(resource) if current else None
    samples = []
    for _ in range(max(reps, 3)):
        t0 = time.perf_counter_ns()
        if current:
            for _ in range(iters):
                b = DB(size=n, stream=s)
                del b
        else:
            for _ in range(iters):
                b = DB(size=n, stream=s, mr=resource)
                del b
        samples.append((time.perf_counter_ns() - t0) / iters)
    s.synchronize()
    if previous is not None:
        streampool.set_current_device_resource(previous)
    return statistics.median(samples)


class _Empty:
    """A class with DeviceBuffer's signature that does nothing: the control's object."""

    __slots__ = ()

    def __init__(self, size: int = 0, stream: object = None, mr: object = None) -> None:
        pass


def control(reps: int, iters: int = 20000) -> tuple[float, float]:
    """ns per pair of empty calls, and per empty object made with DeviceBuffer's keywords."""

    def nothing(a: object, b: object, c: object = None) -> None:
        pass

    s, n = streampool.Stream(), 4096
    pair = timed_pairs(nothing, nothing, n, s, reps, iters)
    objects = []
    for _ in range(max(reps, 3)):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            b = _Empty(size=n, stream=s, mr=None)
            del b
        objects.append((time.perf_counter_ns() - t0) / iters)
    return pair, statistics.median(objects)


def sizes(seed: int, m: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [int(1024 * math.exp(rng.random() * math.log(4096))) for _ in range(m)]


def reserved_now(resource: mr.MemoryResource) -> int:
    """The peak bytes a pool reserved, or the driver pool's reserved bytes now; 0 when the
    resource does not tell (looks through adaptors to the resource they wrap)."""
    while True:
        stats = getattr(resource, "stats", None)
        if isinstance(stats, dict) and "peak_reserved_bytes" in stats:  # the pool, the arena
            return int(stats["peak_reserved_bytes"])
        if isinstance(resource, mr.CudaAsyncMemoryResource):
            return resource.reserved_bytes
        get_upstream = getattr(resource, "get_upstream", None)
        if get_upstream is None:
            return 0
        resource = get_upstream()


def window(make: Callable[[], mr.MemoryResource], threads: int, secs: float) -> dict[str, float]:
    resource = make()
    if isinstance(resource, mr.CudaAsyncMemoryResource):
        resource.trim_to(0)  # the device's pool: start from what it holds now
    counts = [0] * threads
    live_bytes = [0] * threads
    stop = threading.Event()
    ready = threading.Barrier(threads + 1)

    def worker(t: int) -> None:
        s = streampool.Stream()
        sz = sizes(t + 1)
        live: deque[tuple[int, int]] = deque()
        a, d = resource.allocate, resource.deallocate
        i = 0
        ready.wait()
        while not stop.is_set():
            if len(live) == WINDOW:
                p, n = live.popleft()
                d(p, n, s)
                live_bytes[t] -= n
            n = sz[i & 4095]
            live.append((a(n, s), n))
            live_bytes[t] += n
            i += 1
            counts[t] = i
        for p, n in live:
            d(p, n, s)
        s.synchronize()

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    peak = {"live": 0, "reserved": 0}

    def sample() -> None:
        while not stop.is_set():
            peak["live"] = max(peak["live"], sum(live_bytes))
            peak["reserved"] = max(peak["reserved"], reserved_now(resource))
            time.sleep(0.001)

    pool.append(threading.Thread(target=sample))
    for th in pool:
        th.start()
    ready.wait()
    time.sleep(0.1)
    start = list(counts)
    t0 = time.perf_counter()
    time.sleep(secs)
    end = list(counts)
    elapsed = time.perf_counter() - t0
    stop.set()
    for th in pool:
        th.join()
    per = [e - s for s, e in zip(start, end)]
    mean = sum(per) / threads
    reserved = max(peak["reserved"], reserved_now(resource))
    return {
        "peak_live_bytes": peak["live"],
        "peak_reserved_bytes": reserved,
        "allocs_per_sec": sum(per) / elapsed,
        "ns_per_op_per_thread": elapsed * 1e9 / mean if mean else math.inf,
        "slowest_share": min(per) / mean if mean else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secs", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        device = streampool.backend_description()
        sim = None
    except streampool.CudaDriverNotFoundError as e:
        print(f"no CUDA driver ({e}); running on the simulated device: these numbers measure the simulator")
        sim = streampool.sim.SimulatedDevice(capacity_bytes="64GiB").__enter__()
        device = sim.describe()
    print(f"device: {device}")
    pair, obj = control(args.reps)
    print(
        f"fixed  {'control':<20} {'-':>8}    empty call pair     {pair:8.1f} ns   empty object {obj:8.1f} ns"
    )
    results = [{"workload": "fixed", "resource": "control", "ns_per_pair": pair, "ns_per_buffer": obj}]
    for name, make in resources().items():
        for n in (256, 64 << 10, 4 << 20):
            pair = fixed_pairs(make(), n, args.reps)
            buf = fixed_buffers(make(), n, args.reps)
            cur = fixed_buffers(make(), n, args.reps, current=True)
            print(
                f"fixed  {name:<20} {n:>8} B  allocate+deallocate {pair:8.1f} ns   DeviceBuffer {buf:8.1f} ns"
                f"   (current resource {cur:8.1f} ns)"
            )
            results.append(
                {
                    "workload": "fixed",
                    "resource": name,
                    "bytes": n,
                    "ns_per_pair": pair,
                    "ns_per_buffer": buf,
                    "ns_per_buffer_current": cur,
                }
            )
        for t in (int(x) for x in args.threads.split(",")):
            runs = [window(make, t, args.secs) for _ in range(args.reps)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            # Memory: the worst round's reserved/live, and its figures.
            worst = max(runs, key=lambda r: r["peak_reserved_bytes"] / max(r["peak_live_bytes"], 1))
            med["peak_live_bytes"], med["peak_reserved_bytes"] = (
                worst["peak_live_bytes"],
                worst["peak_reserved_bytes"],
            )
            mib = 1 << 20
            memory = (
                f"reserved/live {worst['peak_reserved_bytes'] / max(worst['peak_live_bytes'], 1):.2f} "
                f"({worst['peak_reserved_bytes'] / mib:.0f}/{worst['peak_live_bytes'] / mib:.0f} MiB, worst round)"
                if worst["peak_reserved_bytes"]
                else "reserved/live n/a (the resource does not report its reserved bytes)"
            )
            print(
                f"window {name:<20} T={t:<2} {med['allocs_per_sec'] / 1e6:8.3f} M allocs/s "
                f"{med['ns_per_op_per_thread']:8.1f} ns/op/thread  slowest {med['slowest_share']:.2f}  {memory}"
            )
            results.append({"workload": "window", "resource": name, "threads": t, **med})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "results": results}, f, indent=1)
    if sim is not None:
        sim.__exit__(None, None, None)


if __name__ == "__main__":
    main()
