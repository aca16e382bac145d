"""PyTorch, CuPy and C callers allocating through streampool, next to their own allocators.

Three parts, each printed as a table and written as JSON (the last line of the output, and
--json FILE); reserved memory is always shown beside live memory:

(a) torch: 8 threads, each on its own torch stream, a loop of torch.empty of mixed sizes
    (log-uniform, 4 KiB to 64 MiB), a small kernel (fill_ then add_), a FIFO window of 4
    live tensors per thread, every 8th tensor handed to a second stream (a kernel there,
    record_stream, and the first stream waiting for the second: PyTorch does not pass
    record_stream to a pluggable allocator, so without that wait its free would not be
    ordered after the second stream's use). Every tensor's first and last element are
    checked against the expected value ("wrong" must be 0). Variants: `streampool`
    (streampool's sharded pool over the driver's pool, through CUDAPluggableAllocator),
    `native` (PyTorch's caching allocator), `async` (PyTorch's cudaMallocAsync backend),
    and `none`, the ceiling: the same loop with no allocation in it (each tensor a view of
    a tensor made before), so that no allocator can make this loop faster than `none` is.
    PyTorch's allocator is fixed per process, so every run is a fresh interpreter; the
    variants are interleaved and repeated (--reps), and the median run is reported.
(b) cupy: 8 threads, each on its own non-blocking CuPy stream, cupy.cuda.alloc of mixed
    sizes (log-uniform, 4 KiB to 64 MiB) with a FIFO window of 16 live allocations per
    thread. Variants: `streampool` (the sharded pool over the driver's pool, through
    streampool.allocators.cupy), `pool` (CuPy's MemoryPool), `async` (CuPy's
    MemoryAsyncPool); one interpreter per run, interleaved and repeated.
(c) capi: allocate+free pairs through the exported C functions streampool_alloc and
    streampool_free called from C (benchmarks/capi_pair.c, compiled with `cc` at run
    time; ctypes-bound timing, marked so, where there is no compiler), on 1 and 8 threads,
    each on its own stream, and on 1 thread on the legacy default stream, over the sharded
    pool (its fast path) and the driver's pool; beside them, alternated in every repeat,
    the pair PyTorch is given (streampool_alloc_cxx and streampool_free_cxx, which count
    PyTorch's memory statistics): the `functions` column.

    python3 benchmarks/bench_frameworks.py [--parts torch,cupy,capi] [--reps 3]
        [--iters 1000] [--threads 8] [--json FILE] [--sim]

--sim runs part (c) on the simulated device (parts (a) and (b) need a GPU, PyTorch and
CuPy: each is skipped, saying why, where its library or the GPU is missing).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def sizes(seed: int, n: int, lo_log2: int = 12, hi_log2: int = 26) -> list[int]:
    """`n` log-uniform sizes in [2**lo_log2, 2**hi_log2] bytes, multiples of 4."""
    rng = random.Random(seed)
    return [max(4, int(2 ** rng.uniform(lo_log2, hi_log2)) // 4 * 4) for _ in range(n)]


def run_threads(work: Any, n: int) -> list[Any]:
    """Runs work(t, barrier) on n threads started together; returns their results."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            results[t] = work(t, barrier)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


def streampool_pool() -> tuple[Any, Any]:
    """The sharded pool over the device's driver pool, with statistics over it, made the
    current resource: (pool, statistics)."""
    import streampool
    from streampool import mr

    pool = mr.ShardedPoolMemoryResource(streampool.get_current_device_resource())
    stats = mr.StatisticsResourceAdaptor(pool)
    streampool.set_current_device_resource(stats)
    return pool, stats


# ---------------------------------------------------------------------------------------
# (a) PyTorch


MAX_TENSOR = 1 << 26  # bytes: the largest size `sizes(..., 12, 26)` gives


def torch_worker(variant: str, threads: int, iters: int) -> dict[str, Any]:
    pool = stats = None
    if variant == "streampool":
        pool, stats = streampool_pool()
        from streampool.allocators import torch as sp_torch

        sp_torch.use()
    import torch

    backend = torch.cuda.memory.get_allocator_backend()
    device = torch.device("cuda")
    window = 4

    def work(t: int, barrier: threading.Barrier) -> dict[str, Any]:
        plan = sizes(1000 + t, iters, 12, 26)
        main, other = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(main):
            # `none`: no allocation in the loop. Each tensor is a view of one of window + 1
            # tensors of the largest size, made before; a slot is used again only after
            # the window has let go of its last view, on the same stream (and `main` has
            # waited for `other`), so the values checked are as in the other variants.
            ring = None
            if variant == "none":
                ring = [
                    torch.empty(MAX_TENSOR // 4, dtype=torch.float32, device=device)
                    for _ in range(window + 1)
                ]
            got = torch.zeros((iters, 2), dtype=torch.float32, device=device)
            expected = []
            live: deque[Any] = deque()
            barrier.wait()
            start = time.perf_counter()
            for i, nbytes in enumerate(plan):
                v = float(i % 1024)
                if ring is None:
                    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
                else:
                    x = ring[i % len(ring)].narrow(0, 0, nbytes // 4)
                x.fill_(v)
                x.add_(1.0)
                want = v + 1.0
                if i % 8 == 0:
                    other.wait_stream(main)
                    with torch.cuda.stream(other):
                        x.mul_(2.0)
                    x.record_stream(other)
                    main.wait_stream(other)
                    want *= 2.0
                got[i, 0].copy_(x[0])
                got[i, 1].copy_(x[-1])
                expected.append(want)
                live.append(x)
                if len(live) > window:
                    live.popleft()
            live.clear()
            main.synchronize()
            elapsed = time.perf_counter() - start
            want_t = torch.tensor(expected, dtype=torch.float32).unsqueeze(1).expand(-1, 2)
            wrong = int((got.cpu() != want_t).any(dim=1).sum())
        return {"elapsed": elapsed, "wrong": wrong}

    # Warm-up (the first CUDA calls, the pools' first growth), then the timed run.
    run_threads(lambda t, b: work(t, b), threads)
    torch.cuda.synchronize()
    results = run_threads(lambda t, b: work(t, b), threads)
    torch.cuda.synchronize()
    wall = max(r["elapsed"] for r in results)
    out: dict[str, Any] = {
        "variant": variant,
        "backend": backend,
        "tensors_per_s": threads * iters / wall,
        "wrong": sum(r["wrong"] for r in results),
    }
    if variant == "streampool":
        import streampool

        out["peak_reserved_bytes"] = pool.stats["peak_reserved_bytes"]
        out["peak_live_bytes"] = stats.allocation_counts.peak_bytes
        out["failures"] = streampool.allocators.failure_count()
    else:
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["peak_live_bytes"] = torch.cuda.max_memory_allocated()
    return out


# ---------------------------------------------------------------------------------------
# (b) CuPy


def cupy_worker(variant: str, threads: int, iters: int) -> dict[str, Any]:
    import cupy

    pool = stats = None
    peak = {"reserved": 0, "live": 0}
    if variant == "streampool":
        pool, stats = streampool_pool()
        from streampool.allocators import cupy as sp_cupy

        sp_cupy.use()
    elif variant == "pool":
        cupy_pool = cupy.cuda.MemoryPool()
        cupy.cuda.set_allocator(cupy_pool.malloc)
    elif variant == "async":
        cupy_pool = cupy.cuda.MemoryAsyncPool()
        cupy.cuda.set_allocator(cupy_pool.malloc)
    else:
        raise ValueError(variant)
    window = 16

    def sample() -> None:
        if variant != "streampool":
            peak["reserved"] = max(peak["reserved"], cupy_pool.total_bytes())
            peak["live"] = max(peak["live"], cupy_pool.used_bytes())

    def work(t: int, barrier: threading.Barrier) -> float:
        plan = sizes(2000 + t, iters, 12, 26)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            live: deque[Any] = deque()
            barrier.wait()
            start = time.perf_counter()
            for i, nbytes in enumerate(plan):
                live.append(cupy.cuda.alloc(nbytes))
                if len(live) > window:
                    live.popleft()
                if t == 0 and i % 64 == 0:
                    sample()
            live.clear()
            stream.synchronize()
            return time.perf_counter() - start

    run_threads(work, threads)  # warm-up
    wall = max(run_threads(work, threads))
    out: dict[str, Any] = {"variant": variant, "allocs_per_s": threads * iters / wall}
    if variant == "streampool":
        out["peak_reserved_bytes"] = pool.stats["peak_reserved_bytes"]
        out["peak_live_bytes"] = stats.allocation_counts.peak_bytes
    else:
        out["peak_reserved_bytes"] = peak["reserved"]
        out["peak_live_bytes"] = peak["live"]
        out["peaks_sampled"] = True  # every 64th allocation of one thread
    return out


# ---------------------------------------------------------------------------------------
# (c) the C entry points


def compiled_pair() -> Any:
    """pair_ns from benchmarks/capi_pair.c, compiled now; None without a C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    out = Path(tempfile.mkdtemp()) / "capi_pair.so"
    done = subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(HERE / "capi_pair.c")],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(f"capi: {cc} failed, timing through ctypes instead:\n{done.stderr}", file=sys.stderr)
        return None
    fn = ctypes.CDLL(str(out)).pair_ns
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
    fn.argtypes += [ctypes.POINTER(ctypes.c_long)]
    return fn


def time_pairs(
    pair: Any, fns: tuple[Any, Any, int, int], size: int, device: int, streams: list[Any], iters: int
) -> float:
    """Mean ns per pair over the threads, one thread per stream, started together."""
    alloc, free, alloc_addr, free_addr = fns

    def timed(t: int, barrier: threading.Barrier) -> float:
        handle = streams[t].handle
        barrier.wait()
        if pair is not None:
            bad = ctypes.c_long(0)
            ns = float(pair(alloc_addr, free_addr, size, device, handle, iters, ctypes.byref(bad)))
            assert bad.value == 0, "an allocation failed"
            return ns
        start = time.perf_counter_ns()
        for _ in range(iters):
            free(alloc(size, device, handle), size, device, handle)
        return (time.perf_counter_ns() - start) / iters

    return statistics.mean(run_threads(timed, len(streams)))


def capi_part(reps: int, thread_counts: list[int]) -> list[dict[str, Any]]:
    import streampool
    from streampool import allocators, mr

    lib = ctypes.CDLL(allocators.library_path())
    pairs = {}
    for label, alloc_name, free_name in (
        ("C", allocators.ALLOC_FUNCTION, allocators.FREE_FUNCTION),
        ("C++, counted", allocators.CXX_ALLOC_FUNCTION, allocators.FREE_CXX_FUNCTION),
    ):
        alloc, free = getattr(lib, alloc_name), getattr(lib, free_name)
        alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        addresses = (ctypes.cast(alloc, ctypes.c_void_p).value, ctypes.cast(free, ctypes.c_void_p).value)
        pairs[label] = (alloc, free, *addresses)
    pair = compiled_pair()
    iters = 200_000 if pair is not None else 20_000
    device = streampool.get_current_device()
    base = streampool.get_current_device_resource()
    rows = []
    for name, resource in (("sharded", mr.ShardedPoolMemoryResource(base)), ("async", base)):
        streampool.set_current_device_resource(resource)
        for size in (256, 64 << 10):
            # Each thread on a stream of its own; and one thread on the legacy default
            # stream, whose handle needs no lookup (a stream of its own costs one
            # cuStreamGetId per call: what tells it from a new stream with a reused handle).
            for n, kind in [(n, "own") for n in thread_counts] + [(1, "legacy")]:
                streams = [
                    streampool.Stream() if kind == "own" else streampool.DEFAULT_STREAM for _ in range(n)
                ]
                per_rep: dict[str, list[float]] = {label: [] for label in pairs}
                for fns in pairs.values():
                    time_pairs(pair, fns, size, device, streams, iters // 10)  # warm-up
                for _ in range(reps):
                    for label, fns in pairs.items():
                        per_rep[label].append(time_pairs(pair, fns, size, device, streams, iters))
                for label, times in per_rep.items():
                    rows.append(
                        {
                            "resource": name,
                            "functions": label,
                            "size": size,
                            "threads": n,
                            "stream": kind,
                            "ns_per_pair": statistics.median(times),
                            "timed_in": "C"
                            if pair is not None
                            else "ctypes (no C compiler: Python's call cost included)",
                        }
                    )
                for s in streams:
                    s.synchronize()
        streampool.set_current_device_resource(base)
    if allocators.failure_count():
        raise RuntimeError(f"the C entry points failed: {allocators.last_error()}")
    return rows


# ---------------------------------------------------------------------------------------
# The driver: one interpreter per run for (a) and (b).


def subprocess_run(part: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if part == "torch" and variant == "async":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    cmd = [sys.executable, __file__, "--worker", f"{part}:{variant}", "--threads", str(args.threads)]
    cmd += ["--iters", str(args.iters)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        return {"variant": variant, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_runs(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The run whose `key` is the median (the lower middle one for an even count), with
    every run's `key` beside it."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    ranked = sorted(ok, key=lambda r: r[key])
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    chosen[f"{key}_runs"] = [round(r[key]) for r in ok]
    chosen["wrong"] = sum(r.get("wrong", 0) for r in ok)
    return chosen


def library_missing(name: str) -> str | None:
    import importlib.util

    if importlib.util.find_spec(name) is None:
        return f"{name} is not installed"
    return None


def table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{c:>22}" for c in columns))
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            if isinstance(v, float):
                v = f"{v:,.1f}"
            elif isinstance(v, int) and c.endswith("bytes"):
                v = f"{v / MiB:,.1f} MiB"
            cells.append(f"{v!s:>22}")
        print("  ".join(cells))
        if "error" in r:
            print(f"    failed: {r['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="torch,cupy,capi")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=1000, help="allocations per thread per run, parts a and b")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--sim", action="store_true", help="part c on the simulated device")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        part, variant = args.worker.split(":")
        worker = torch_worker if part == "torch" else cupy_worker
        print(json.dumps(worker(variant, args.threads, args.iters)))
        return

    import streampool

    parts = args.parts.split(",")
    results: dict[str, Any] = {"threads": args.threads, "iters": args.iters, "reps": args.reps}
    gpu = not args.sim and not streampool.using_simulated_device()
    for part, library, variants, key in (
        ("torch", "torch", ["streampool", "native", "async", "none"], "tensors_per_s"),
        ("cupy", "cupy", ["streampool", "pool", "async"], "allocs_per_s"),
    ):
        if part not in parts:
            continue
        missing = library_missing(library) or (None if gpu else "no GPU (--sim, or a simulated device)")
        if missing:
            results[part] = {"skipped": missing}
            print(f"\n{part}: skipped: {missing}")
            continue
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for _ in range(args.reps):  # interleaved: every variant once per round
            for v in variants:
                runs[v].append(subprocess_run(part, v, args))
        rows = [median_runs(runs[v], key) for v in variants]
        results[part] = rows
        cols = ["variant", key, "peak_reserved_bytes", "peak_live_bytes", "wrong"]
        table(f"({part}) {args.threads} threads x {args.iters} per run, median of {args.reps}", rows, cols)
    if "capi" in parts:
        if args.sim:
            from streampool.sim import SimulatedDevice

            with SimulatedDevice(capacity_bytes="4GiB"):
                rows = capi_part(args.reps, sorted({1, args.threads}))
        else:
            rows = capi_part(args.reps, sorted({1, args.threads}))
        results["capi"] = rows
        table(
            "(capi) allocate + free pairs: streampool_alloc + streampool_free (C), "
            "streampool_alloc_cxx + streampool_free_cxx (C++, counted)",
            rows,
            ["resource", "functions", "size", "threads", "stream", "ns_per_pair"],
        )
        print(f"  timed in: {rows[0]['timed_in']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
