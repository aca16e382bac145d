"""The peers' side of the benchmarks, from Python: RAPIDS RMM, CuPy, PyTorch, the driver.

The same workloads as benchmarks/bench_pool.py (streampool's side) and as
benchmarks/bench_rmm.cpp (RMM from C++), so that the figures compare; run on a GPU
machine by benchmarks/gpu-bench.sh and benchmarks/pinned.sh (benchmarks/README.md).

Part A (--part A): one thread, one non-default (non-blocking) stream,
  allocate+free pairs of a fixed size; median ns per pair over 7 repetitions
  (each ~20 ms after calibration), after a warm-up.
Part B (--part B): T threads, each with its own non-blocking stream; each keeps
  a FIFO window of 16 live allocations of log-uniform random size in
  [1 KiB, 4 MiB] (pre-generated), freeing the oldest before each new
  allocation; 100 ms warm-up, then aggregate allocs/s inside one common window
  (main thread snapshots per-thread op counters).
Part V (--part V): versions only.

Peers: RMM 26.10 (python wheels rmm-cu13/librmm-cu13), CuPy MemoryPool and
MemoryAsyncPool, PyTorch caching allocator, raw cuMemAllocAsync/cuMemFreeAsync
through cuda.bindings.driver. Parts A and B import rmm, cupy and torch (all three must be
installed); a resource that fails to set up or to run is reported (RAWA/RAWB ... FAILED)
and skipped.
"""

import argparse
import json
import math
import os
import random
import statistics
import sys
import threading
import time

GiB = 1 << 30
perf = time.perf_counter


def log(*a):
    print(*a, flush=True)


def versions():
    out = {"python": sys.version.split()[0]}
    for mod in ("rmm", "cupy", "torch", "numpy", "cuda.bindings", "cuda.core"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "?")
        except Exception as e:
            out[mod] = f"import failed: {e!r}"
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        out["cuDriverGetVersion"] = driver.cuDriverGetVersion()[1]
    except Exception as e:
        out["cuDriverGetVersion"] = repr(e)
    try:
        import torch

        out["torch.version.cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:
        out["torch.cuda"] = repr(e)
    try:
        import cupy

        out["cupy.runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as e:
        out["cupy.runtime"] = repr(e)
    return out


# ----------------------------------------------------------------------------
# driver helpers
_ctx = None


def drv_ctx():
    """Make device 0's primary context current on the calling thread."""
    global _ctx
    from cuda.bindings import driver

    if _ctx is None:
        (err,) = driver.cuInit(0)
        assert err == 0, err
        err, dev = driver.cuDeviceGet(0)
        assert err == 0, err
        err, _ctx = driver.cuDevicePrimaryCtxRetain(dev)
        assert err == 0, err
    (err,) = driver.cuCtxSetCurrent(_ctx)
    assert err == 0, err


def drv_stream():
    from cuda.bindings import driver

    drv_ctx()
    err, hs = driver.cuStreamCreate(int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
    assert err == 0, err
    return hs


def raise_default_pool_threshold():
    """Default pool of device 0: keep freed memory (no trim at sync points).

    Shared by raw cuMemAllocAsync and cupy MemoryAsyncPool (which use the
    device's current pool); rmm's CudaAsyncMemoryResource has its own pool.
    """
    from cuda.bindings import driver

    drv_ctx()
    err, pool = driver.cuDeviceGetDefaultMemPool(0)
    assert err == 0, err
    v = driver.cuuint64_t(2**64 - 1)
    (err,) = driver.cuMemPoolSetAttribute(
        pool, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, v
    )
    assert err == 0, err


# ----------------------------------------------------------------------------
# resources


def rmm_resources():
    import rmm
    import rmm.mr as mr

    res = {}
    res["rmm_cuda"] = lambda: mr.CudaMemoryResource()
    res["rmm_async"] = lambda: mr.CudaAsyncMemoryResource()
    res["rmm_pool(cuda)"] = lambda: mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=4 * GiB)
    res["rmm_pool(async)"] = lambda: mr.PoolMemoryResource(
        mr.CudaAsyncMemoryResource(), initial_pool_size=4 * GiB
    )
    res["rmm_arena(cuda)"] = lambda: mr.ArenaMemoryResource(mr.CudaMemoryResource(), arena_size=8 * GiB)
    res["rmm_binning(async)"] = lambda: mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 10, 22)
    return rmm, res


def rmm_stream():
    from rmm.pylibrmm.stream import CudaStreamFlags, Stream

    return Stream(flags=CudaStreamFlags.NON_BLOCKING)


# ---- Part A pair loops: each returns a function loop(n, iters) that runs
# `iters` allocate+free pairs of n bytes on its own non-default stream.


def pairs_rmm_mr(mrobj):
    st = rmm_stream()

    def loop(n, iters, a=mrobj.allocate, d=mrobj.deallocate, s=st):
        for _ in range(iters):
            d(a(n, s), n, s)

    return loop, st.synchronize


def pairs_rmm_devbuf(mrobj):
    import rmm

    st = rmm_stream()
    DB = rmm.DeviceBuffer

    def loop(n, iters, DB=DB, s=st, m=mrobj):
        for _ in range(iters):
            DB(size=n, stream=s, mr=m)

    return loop, st.synchronize


def pairs_cupy(pool):
    import cupy

    st = cupy.cuda.Stream(non_blocking=True)
    st.use()  # current stream for this thread

    def loop(n, iters, m=pool.malloc):
        for _ in range(iters):
            m(n)

    return loop, st.synchronize


def pairs_torch():
    import torch

    s = torch.cuda.Stream()
    torch.cuda.set_stream(s)
    dev = torch.device("cuda", 0)
    u8 = torch.uint8

    def loop(n, iters, e=torch.empty, dev=dev, u8=u8):
        for _ in range(iters):
            e(n, dtype=u8, device=dev)

    return loop, s.synchronize


def pairs_raw():
    from cuda.bindings import driver

    hs = drv_stream()

    def loop(n, iters, a=driver.cuMemAllocAsync, f=driver.cuMemFreeAsync, hs=hs):
        for _ in range(iters):
            f(a(n, hs)[1], hs)

    def sync():
        driver.cuStreamSynchronize(hs)

    # correctness check once
    err, p = driver.cuMemAllocAsync(1024, hs)
    assert err == 0, err
    (err,) = driver.cuMemFreeAsync(p, hs)
    assert err == 0, err
    return loop, sync


def pairs_noop():
    def a(n, s):
        return 0

    def d(p, n, s):
        return None

    def loop(n, iters, a=a, d=d, s=None):
        for _ in range(iters):
            d(a(n, s), n, s)

    return loop, lambda: None


def time_pairs(loop, sync, n, reps=7, target=0.02):
    warm = 20 if n >= (64 << 20) else 200
    loop(n, warm)
    sync()
    iters = 10
    while True:
        t0 = perf()
        loop(n, iters)
        dt = perf() - t0
        if dt > 0.005 or iters >= (1 << 20):
            break
        iters *= 4
    iters = max(10, int(iters * target / dt))
    r = []
    for _ in range(reps):
        t0 = perf()
        loop(n, iters)
        r.append((perf() - t0) * 1e9 / iters)
    sync()
    r.sort()
    return statistics.median(r), r[0], r[-1], iters


def part_a(args):
    import cupy
    import torch  # noqa: F401

    raise_default_pool_threshold()
    _rmm, res = rmm_resources()
    sizes = [256, 64 << 10, 4 << 20, 256 << 20]
    cases = [("python_noop_call_baseline", pairs_noop)]
    for name, mk in res.items():
        cases.append((f"{name}.allocate/deallocate", lambda mk=mk: pairs_rmm_mr(mk())))
    for name in ("rmm_async", "rmm_pool(async)", "rmm_arena(cuda)"):
        cases.append((f"{name} DeviceBuffer", lambda mk=res[name]: pairs_rmm_devbuf(mk())))
    cases.append(("cupy_MemoryPool", lambda: pairs_cupy(cupy.cuda.MemoryPool())))
    cases.append(("cupy_MemoryAsyncPool", lambda: pairs_cupy(cupy.cuda.MemoryAsyncPool())))
    cases.append(("torch_caching", pairs_torch))
    cases.append(("raw_cuMemAllocAsync", pairs_raw))
    rows = []
    for name, mk in cases:
        try:
            loop, sync = mk()
        except Exception as e:
            log(f"RAWA {name} SETUP-FAILED {e!r}")
            continue
        meds = []
        for n in sizes:
            try:
                med, lo, hi, iters = time_pairs(loop, sync, n)
            except Exception as e:
                log(f"RAWA {name} {n} FAILED {e!r}")
                meds.append(float("nan"))
                continue
            meds.append(med)
            log(f"RAWA {name} size={n} med_ns={med:.0f} min={lo:.0f} max={hi:.0f} iters={iters}")
            rows.append({"case": name, "size": n, "med_ns": med, "min_ns": lo, "max_ns": hi})
        rows.append({"case": name, "summary": meds})
        del loop, sync
    log(f"# cpu canary end: python noop pair {cpu_canary():.0f} ns")
    log("\n## Python A: single thread, 1 non-blocking stream, alloc+free pair, ns (median of 7)")
    log(f"{'case':44s} {'256B':>9s} {'64KiB':>9s} {'4MiB':>9s} {'256MiB':>9s}")
    for r in rows:
        if "summary" in r:
            log(f"{r['case']:44s} " + " ".join(f"{x:9.0f}" for x in r["summary"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


# ---- Part B: per-thread ops factories. Each returns (alloc(n)->handle,
# free(handle, n) or None). None means "drop the reference" frees it.


def mk_thread_rmm(mrobj):
    def setup():
        st = rmm_stream()
        a, d = mrobj.allocate, mrobj.deallocate
        return (lambda n: a(n, st)), (lambda p, n: d(p, n, st)), st.synchronize

    return setup


def mk_thread_cupy(pool):
    def setup():
        import cupy

        st = cupy.cuda.Stream(non_blocking=True)
        st.use()
        return pool.malloc, None, st.synchronize

    return setup


def mk_thread_torch():
    def setup():
        import torch

        s = torch.cuda.Stream()
        torch.cuda.set_stream(s)
        dev = torch.device("cuda", 0)
        u8 = torch.uint8
        e = torch.empty
        return (lambda n: e(n, dtype=u8, device=dev)), None, s.synchronize

    return setup


def mk_thread_raw():
    def setup():
        from cuda.bindings import driver

        hs = drv_stream()
        a, f = driver.cuMemAllocAsync, driver.cuMemFreeAsync
        return (lambda n: a(n, hs)[1]), (lambda p, n: f(p, hs)), (lambda: driver.cuStreamSynchronize(hs))

    return setup


def gen_sizes(seed, m=4096):
    rng = random.Random(seed)
    lo, hi = math.log(1024), math.log(4 << 20)
    return [int(math.exp(rng.uniform(lo, hi))) for _ in range(m)]


def run_mt(setup, T, secs, W=16):
    """Aggregate allocs/s inside one common window.

    Workers publish their op count in cnt[t] after every op; the main thread
    snapshots all counters at the window's start and end (workers keep running
    before and after), so a straggler cannot stretch the denominator.
    Returns (allocs/s, T/allocs_s in ns, min share, max share).
    """
    ctl = [0]
    ready = []
    cnt = [0] * T
    errs = []

    def worker(t):
        try:
            alloc, free, sync = setup()
            sizes = gen_sizes(1234 + t)
            M = len(sizes) - 1
            ring = [alloc(sizes[i]) for i in range(W)]
            rsz = sizes[:W]
            k, h = W, 0
            ready.append(t)
            while ctl[0] == 0:
                time.sleep(0.0005)
            c = 0
            while ctl[0] == 1:
                if free is None:
                    ring[h] = None
                else:
                    free(ring[h], rsz[h])
                n = sizes[k & M]
                k += 1
                ring[h] = alloc(n)
                rsz[h] = n
                h += 1
                if h == W:
                    h = 0
                c += 1
                cnt[t] = c
            for i in range(W):
                if free is not None:
                    free(ring[i], rsz[i])
                ring[i] = None
            sync()
        except Exception as e:
            errs.append(repr(e))
            ready.append(-1)

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(T)]
    for th in ths:
        th.start()
    while len(ready) < T:
        time.sleep(0.001)
    ctl[0] = 1
    time.sleep(0.1)
    t0 = perf()
    s0 = list(cnt)
    time.sleep(secs)
    s1 = list(cnt)
    t1 = perf()
    ctl[0] = 2
    for th in ths:
        th.join()
    if errs:
        raise RuntimeError(errs[0])
    d = [b - a for a, b in zip(s0, s1)]
    tot = sum(d)
    aps = tot / (t1 - t0)
    mean = tot / T
    return aps, (T * 1e9 / aps if aps else -1), (min(d) / mean if mean else 0), (max(d) / mean if mean else 0)


def cpu_canary():
    loop, _ = pairs_noop()
    t0 = perf()
    loop(0, 200000)
    return (perf() - t0) * 1e9 / 200000


def part_b(args):
    import cupy

    raise_default_pool_threshold()
    _rmm, res = rmm_resources()
    setups = [
        ("rmm_async", lambda: mk_thread_rmm(res["rmm_async"]())),
        ("rmm_pool(async)", lambda: mk_thread_rmm(res["rmm_pool(async)"]())),
        ("rmm_pool(cuda)", lambda: mk_thread_rmm(res["rmm_pool(cuda)"]())),
        ("rmm_arena(cuda)", lambda: mk_thread_rmm(res["rmm_arena(cuda)"]())),
        ("cupy_MemoryPool", lambda: mk_thread_cupy(cupy.cuda.MemoryPool())),
        ("cupy_MemoryAsyncPool", lambda: mk_thread_cupy(cupy.cuda.MemoryAsyncPool())),
        ("torch_caching", mk_thread_torch),
        ("raw_cuMemAllocAsync", mk_thread_raw),
    ]
    Ts = [int(x) for x in args.threads.split(",")]
    rows = []
    for name, mk in setups:
        try:
            setup = mk()
        except Exception as e:
            log(f"RAWB {name} SETUP-FAILED {e!r}")
            continue
        for T in Ts:
            aps, nss, shr = [], [], []
            for r in range(args.reps):
                try:
                    a, ns, mn, mx = run_mt(setup, T, args.secs)
                except Exception as e:
                    log(f"RAWB {name} T={T} FAILED {e!r}")
                    break
                aps.append(a)
                nss.append(ns)
                shr.append(mn)
                log(
                    f"RAWB {name} T={T} rep={r} allocs_per_s={a:.0f} ns_per_op_thread={ns:.0f} min_share={mn:.2f} max_share={mx:.2f}"
                )
            if aps:
                rows.append(
                    (name, T, statistics.median(aps), min(aps), max(aps), statistics.median(nss), min(shr))
                )
        del setup
    log(f"# cpu canary end: python noop pair {cpu_canary():.0f} ns")
    log(
        f"\n## Python B: multi-thread window-16 log-uniform 1KiB-4MiB; aggregate allocs/s in a common window, median [min-max] of {args.reps}; ns/op/thr = T/aggregate; min_share = slowest thread ops / mean"
    )
    log(
        f"{'resource':24s} {'T':>3s} {'allocs/s':>10s} {'[min - max]':>23s} {'ns/op/thr':>10s} {'min_share':>9s}"
    )
    for name, T, med, lo, hi, ns, sh in rows:
        log(f"{name:24s} {T:3d} {med:10.0f}   [{lo:9.0f} - {hi:9.0f}] {ns:10.0f} {sh:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["A", "B", "V"], required=True)
    ap.add_argument("--secs", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    log("# versions", json.dumps(versions()))
    log("# switchinterval", sys.getswitchinterval(), "cpus", os.cpu_count())
    log(f"# cpu canary start: python noop pair {cpu_canary():.0f} ns")
    if args.part == "A":
        part_a(args)
    elif args.part == "B":
        part_b(args)


if __name__ == "__main__":
    main()
