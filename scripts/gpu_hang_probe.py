#!/usr/bin/env python3
"""Where does the per-thread default stream hang come from?

The scenario: four threads allocate on the per-thread default stream (handle 2), launch
kernels on it, free on it and exit without synchronising; the main thread then calls
``cudaDeviceSynchronize()``, which never returned on the H200 over
``CudaAsyncMemoryResource`` (alone, under the sharded pool or under the statistics
adaptor) and returned at once over ``CudaMemoryResource``.

Each variant runs in a fresh process (its own session, killed as a group after
``--timeout`` seconds) and changes one thing: who allocates (the driver's
``cuMemAllocAsync`` directly, or streampool's resources), what runs on the stream (a CuPy
kernel, a kernel launched through the driver or PyTorch, a memset, nothing), where the
free goes, and how the threads end. One line per variant:

    variant  PASS|HANG|ERROR|SKIP  seconds  stage reached  per-thread stream ids  detail

For a hang, the detail says what the process was doing when it was killed: each
thread's state and CPU use from /proc (a main thread spinning at 100 % waits on the GPU;
one asleep in a futex waits on a host lock), how many worker threads the OS still had
after Python joined them, and where the full log (with every thread's Python stack, and
native stacks when gdb is installed) is.

    python3 scripts/gpu_hang_probe.py --quick          # the suite's subset
    python3 scripts/gpu_hang_probe.py                  # every variant
    python3 scripts/gpu_hang_probe.py --rest --budget 540   # the ones --quick leaves out
    python3 scripts/gpu_hang_probe.py --only a,h-d,j-a --iters 200

Exit status: 0 when every variant ran (PASS, HANG or SKIP), 1 when one failed to run
(ERROR), 2 with ``--strict`` when one hung. ``--budget`` keeps a run under a wall-clock
limit: variants that a hang could carry past it are listed as NOTRUN. Importing this module starts nothing; the
GPU is touched only by the child processes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MIB = 1 << 20
# Each thread holds at most one of these at a time: 4 threads keep at most 64 MiB live.
SIZES = (1 * MIB, 4 * MIB, 16 * MIB)
PER_THREAD = 2
LEGACY = 0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the scenario; each field changes one thing."""

    name: str
    what: str
    # Who allocates: "raw" (cuMemAllocAsync/cuMemFreeAsync), "rawsync" (cuMemAlloc/cuMemFree),
    # or a streampool resource: "async", "pool", "stats", "cuda", "pool_cuda".
    alloc: str = "raw"
    # What runs on the stream between allocation and free: "cupy" (an elementwise kernel
    # under cupy.cuda.Stream.ptds), "cupy_ext" (under cupy.cuda.ExternalStream(2)),
    # "cupy_env" (CuPy's current stream with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1),
    # "ptx" (a kernel launched with cuLaunchKernel), "torch", "memset" (cuMemsetD8Async),
    # or "none".
    kernel: str = "cupy"
    # The stream the free is ordered on: "ptds" (the thread's own) or "legacy".
    free_on: str = "ptds"
    # How the threads end: "bare" (exit at once), "sync" (synchronise the per-thread
    # stream first), "stay" (stay alive until the main thread's synchronisation returned).
    end: str = "bare"
    # The stream the threads use: "ptds", or "own" (a blocking stream each thread creates
    # and never destroys).
    stream: str = "ptds"
    threads: int = 4
    # How the main thread synchronises: "runtime" (cuda.bindings' cudaDeviceSynchronize),
    # "driver" (cuCtxSynchronize), "cupy" (cupy.cuda.runtime.deviceSynchronize).
    main_sync: str = "runtime"
    # Seconds the main thread sleeps between joining the threads and synchronising.
    pause: float = 0.0
    # Record an event on the legacy stream and poll it before synchronising.
    poll_legacy: bool = False

    @property
    def env(self) -> dict[str, str]:
        return {"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"} if self.kernel == "cupy_env" else {}


def _v(name: str, what: str, **kw: Any) -> Variant:
    return Variant(name, what, **kw)


VARIANTS: tuple[Variant, ...] = (
    _v("a", "driver alloc/free on ptds + CuPy kernel (Stream.ptds)"),
    _v("a-ext", "as a, CuPy kernel on ExternalStream(2)", kernel="cupy_ext"),
    _v("a-env", "as a, CuPy's current stream under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1", kernel="cupy_env"),
    _v("b", "driver alloc/free on ptds, no kernel", kernel="none"),
    _v("b-memset", "driver alloc/free on ptds + cuMemsetD8Async (no kernel)", kernel="memset"),
    _v("c", "driver alloc/free on ptds + PTX kernel via cuLaunchKernel", kernel="ptx"),
    _v("c-torch", "driver alloc/free on ptds + torch kernel (ExternalStream(2))", kernel="torch"),
    _v("d", "streampool CudaAsyncMemoryResource + CuPy kernel", alloc="async"),
    _v("d-none", "streampool async, no kernel", alloc="async", kernel="none"),
    _v("d-ptx", "streampool async + PTX kernel", alloc="async", kernel="ptx"),
    _v("e", "ShardedPool(async) + CuPy kernel", alloc="pool"),
    _v("e-cuda", "ShardedPool(CudaMemoryResource) + CuPy kernel", alloc="pool_cuda"),
    _v("f", "Statistics(async) + CuPy kernel", alloc="stats"),
    _v("g", "CudaMemoryResource + CuPy kernel (control)", alloc="cuda"),
    _v("g-raw", "cuMemAlloc/cuMemFree + CuPy kernel (control)", alloc="rawsync"),
    _v("h-a", "a, threads synchronise ptds before exit", end="sync"),
    _v("h-b", "b, threads synchronise ptds before exit", kernel="none", end="sync"),
    _v("h-c", "c, threads synchronise ptds before exit", kernel="ptx", end="sync"),
    _v("h-d", "d, threads synchronise ptds before exit", alloc="async", end="sync"),
    _v("h-e", "e, threads synchronise ptds before exit", alloc="pool", end="sync"),
    _v("h-f", "f, threads synchronise ptds before exit", alloc="stats", end="sync"),
    _v("h-g", "g, threads synchronise ptds before exit", alloc="cuda", end="sync"),
    _v("i", "a, free on the legacy stream", free_on="legacy"),
    _v("i-d", "d, free on the legacy stream", alloc="async", free_on="legacy"),
    _v("j-a", "a, threads alive until after the main sync", end="stay"),
    _v("j-d", "d, threads alive until after the main sync", alloc="async", end="stay"),
    _v("k-drv", "a, main thread syncs with cuCtxSynchronize", main_sync="driver"),
    _v("k-cupy", "a, main thread syncs with cupy.cuda.runtime", main_sync="cupy"),
    _v("l", "a with one thread", threads=1),
    _v("m", "a on a created blocking stream per thread (kept alive)", stream="own"),
    _v("n", "a, main polls a legacy-stream event (5 s) before the sync", poll_legacy=True),
    _v("o", "a, main sleeps 2 s after join before the sync", pause=2.0),
)
BY_NAME = {v.name: v for v in VARIANTS}
# The suite's subset (pytest covers the pool and statistics variants, e, f, h-e, h-f).
QUICK = ("a", "b", "c", "d", "g", "h-a", "h-d", "i", "j-a")


@dataclasses.dataclass
class Result:
    name: str
    status: str  # PASS, HANG, ERROR, SKIP, NOTRUN (outside the budget)
    seconds: float
    stage: str = ""
    ids: str = ""
    detail: str = ""
    log: str = ""

    def line(self) -> str:
        return f"{self.name:<9} {self.status:<6} {self.seconds:6.2f}s  {self.stage:<13} {self.ids:<10} {self.detail}"

    def describe(self) -> str:
        """The line, then the end of the log before any native stacks: what a failing test
        prints."""
        tail = ""
        with contextlib.suppress(OSError):
            text = Path(self.log).read_text(errors="replace").split(NATIVE_STACKS)[0]
            tail = "\n".join(text.splitlines()[-40:])
        return f"{self.line()}\n--- {self.log} (last lines) ---\n{tail}"


# --------------------------------------------------------------------------------------
# The parent: runs each variant in its own process group and kills it on a time-out.


def _task_sample(pid: int) -> dict[int, tuple[str, int, str]]:
    """Per thread of `pid`: (state, utime+stime ticks, wchan)."""
    out: dict[int, tuple[str, int, str]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                wchan = ""
                with contextlib.suppress(OSError):
                    wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text().strip()
                out[int(tid)] = (fields[0], int(fields[11]) + int(fields[12]), wchan or "-")
            except (OSError, ValueError, IndexError):
                continue
    return out


NATIVE_STACKS = "\n=== probe: native stacks (gdb) ===\n"


def _diagnose(pid: int, log: Path, native_stacks: bool) -> str:
    """What a hung process's threads are doing (from /proc, over one second), its Python
    stacks (SIGUSR1: faulthandler) and, where gdb is installed, its native stacks (in
    the log). Returns a one-line summary."""
    first = _task_sample(pid)
    time.sleep(1.0)
    second = _task_sample(pid)
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    rows = []
    busy = 0
    for tid, (state, ticks, wchan) in sorted(second.items()):
        cpu = 100.0 * (ticks - first.get(tid, (state, ticks, wchan))[1]) / hz
        busy += cpu > 50
        rows.append(
            f"  tid {tid}{' (main)' if tid == pid else ''}: state {state} cpu {cpu:.0f}% wchan {wchan}"
        )
    main = second.get(pid)
    main_cpu = 100.0 * (main[1] - first.get(pid, main)[1]) / hz if main else 0.0
    with log.open("a") as f:
        f.write("\n=== probe: threads of the hung process ===\n" + "\n".join(rows) + "\n")
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGUSR1)  # faulthandler: every thread's Python stack, into the log
    time.sleep(0.5)
    gdb = shutil.which("gdb") if native_stacks else None
    if gdb:
        try:
            bt = subprocess.run(
                [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except subprocess.TimeoutExpired:
            bt = "gdb timed out\n"
        with log.open("a") as f:
            f.write(NATIVE_STACKS + bt)
    state = f"main {main[0]} {main_cpu:.0f}%cpu {main[2]}" if main else "main gone"
    return f"{state}; {len(second)} threads, {busy} busy{'; gdb in log' if gdb else ''}"


def _kill_group(proc: subprocess.Popen[bytes]) -> str:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=15)
        return ""
    except subprocess.TimeoutExpired:
        return f"; pid {proc.pid} did not die after SIGKILL (uninterruptible in the driver?)"


def _parse_child_log(text: str) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """The last stage reached, what the child knew before synchronising, its result."""
    stage, info, result = "start", {}, None
    for line in text.splitlines():
        if line.startswith("STAGE "):
            stage = line.split()[1]
        elif line.startswith(("INFO ", "RESULT ")):
            kind, _, payload = line.partition(" ")
            with contextlib.suppress(ValueError):
                if kind == "INFO":
                    info = json.loads(payload)
                else:
                    result = json.loads(payload)
    return stage, info, result


def _ids_summary(result: dict[str, Any]) -> str:
    ids = result.get("ids") or {}
    threads = [i for i in ids.get("threads", []) if isinstance(i, int)]
    if not threads:
        return "-"
    distinct = len(set(threads)) == len(threads) and ids.get("main") not in threads
    return f"{len(threads)} {'distinct' if distinct else 'SHARED'}"


def run_variant(
    name: str,
    *,
    timeout: float = 20.0,
    iters: int = 50,
    logs: Path | str | None = None,
    python: str = sys.executable,
    native_stacks: bool = True,
) -> Result:
    """Runs one variant in a fresh process group; kills the group after `timeout` s
    (after writing what its threads were doing into the log; `native_stacks`: with gdb's
    backtraces too, where gdb is installed)."""
    variant = BY_NAME[name]
    logdir = Path(logs) if logs else Path(tempfile.mkdtemp(prefix="hang-probe-"))
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"{name}.log"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("STREAMPOOL_DEVICE", "CUPY_CUDA_PER_THREAD_DEFAULT_STREAM")
    }
    env.update(variant.env, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    cmd = [python, "-u", str(Path(__file__).resolve()), "--child", name, "--iters", str(iters)]
    t0 = time.monotonic()
    log.write_bytes(b"")
    with log.open("ab") as out:  # appending: the diagnosis below goes after what the child wrote
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:  # interrupted (SIGTERM, Ctrl-C): the child must not outlive us
            _kill_group(proc)
            raise
    seconds = time.monotonic() - t0
    if rc is None:
        try:
            detail = _diagnose(proc.pid, log, native_stacks)
        finally:
            detail_kill = _kill_group(proc)
        detail += detail_kill
    else:
        detail = ""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the group may outlive it
    stage, info, result = _parse_child_log(log.read_text(errors="replace"))
    ids = _ids_summary(info)
    if rc is None:
        status = "HANG"
        if info.get("lingering"):
            detail += f"; {info['lingering']} thread(s) left after join"
    elif result and result.get("skip"):
        status, detail = "SKIP", str(result["skip"])
    elif rc == 0 and result and result.get("ok"):
        status = "PASS"
        detail = result.get("note", "")
    else:
        status = "ERROR"
        err = (result or {}).get("error") or _last_line(log)
        detail = f"rc={rc}: {err}"
    return Result(name, status, seconds, stage, ids, detail[:200], str(log))


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:160] if lines else "no output"


def probe(
    names: Sequence[str],
    *,
    timeout: float,
    iters: int,
    logs: Path,
    native_stacks: bool = True,
    budget: float | None = None,
) -> list[Result]:
    """Runs `names` one after another (never two on the GPU at once), printing each line.
    With a `budget` (seconds), starts no variant that a hang could carry past it."""
    print(f"hang probe: {len(names)} variant(s), {timeout:.0f} s time-out each, logs in {logs}", flush=True)
    print(f"{'variant':<9} {'state':<6} {'time':>7}  {'stage':<13} {'ptds ids':<10} detail", flush=True)
    results = []
    t0 = time.monotonic()
    for name in names:
        worst = timeout + (35 if native_stacks else 5)  # the time-out, the diagnosis, the kill
        if budget is not None and time.monotonic() - t0 + worst > budget:
            r = Result(name, "NOTRUN", 0.0, detail=f"the {budget:.0f} s budget could not fit it")
        else:
            r = run_variant(name, timeout=timeout, iters=iters, logs=logs, native_stacks=native_stacks)
        print(r.line(), flush=True)
        results.append(r)
    return results


def _legend(names: Sequence[str]) -> str:
    return "\n".join(f"  {n:<9} {BY_NAME[n].what}" for n in names)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--only", help="comma-separated variant names")
    parser.add_argument("--rest", action="store_true", help="every variant --quick leaves out")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds: start no variant a hang could carry past this"
    )
    parser.add_argument("--list", action="store_true", help="list the variants and exit")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per variant (default 20)")
    parser.add_argument(
        "--iters", type=int, default=None, help="allocations per thread (default 50; 20 with --quick)"
    )
    parser.add_argument("--logs", type=Path, default=None, help="log folder (default $SUITE_LOGS/hang-probe)")
    parser.add_argument("--strict", action="store_true", help="exit 2 when a variant hangs")
    parser.add_argument(
        "--no-native-stacks", action="store_true", help="no gdb backtraces of hung processes (faster)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # `timeout` and the like send SIGTERM: leave through SystemExit, which kills the child.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    iters = args.iters if args.iters is not None else (20 if args.quick else 50)
    if args.child:
        return _child(BY_NAME[args.child], iters)
    if args.list:
        print(_legend([v.name for v in VARIANTS]))
        return 0
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            parser.error(f"unknown variant(s) {unknown}; --list shows them")
    elif args.rest:
        names = [v.name for v in VARIANTS if v.name not in QUICK]
    else:
        names = list(QUICK) if args.quick else [v.name for v in VARIANTS]
    logs = args.logs or Path(os.environ.get("SUITE_LOGS", "/tmp/streampool-gpu")) / "hang-probe"
    results = probe(
        names,
        timeout=args.timeout,
        iters=iters,
        logs=logs,
        native_stacks=not args.no_native_stacks,
        budget=args.budget,
    )
    print("legend:\n" + _legend(names))
    states = ("PASS", "HANG", "ERROR", "SKIP", "NOTRUN")
    count = {s: [r.name for r in results if r.status == s] for s in states}
    print(
        "hang probe: "
        + ", ".join(
            f"{len(v)} {k}" + (f" ({' '.join(v)})" if v and k != "PASS" else "")
            for k, v in count.items()
            if v or k != "NOTRUN"
        )
    )
    if count["ERROR"]:
        return 1
    return 2 if args.strict and count["HANG"] else 0


# --------------------------------------------------------------------------------------
# The child: one variant, in this process. Prints STAGE lines as it goes and one RESULT
# line (JSON) at the end, then leaves with os._exit so that no interpreter teardown
# (resources dropped at exit) can blur what the variant measured.


def _say(stage: str) -> None:
    print(f"STAGE {stage} t={time.monotonic():.3f}", flush=True)


def _finish(result: dict[str, Any]) -> int:
    code = 0 if result.get("ok") or result.get("skip") else 1
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check(ret: Any) -> Any:
    """A cuda.bindings return tuple: raises on an error status, returns the value(s)."""
    err, *vals = ret if isinstance(ret, tuple) else (ret,)
    status: Any = getattr(err, "value", err)
    code = int(status)
    if code != 0:
        raise RuntimeError(f"CUDA error {err!r}")
    return vals[0] if len(vals) == 1 else tuple(vals) if vals else None


PTX = r"""
.version 7.0
.target sm_75
.address_size 64

.visible .entry add_one(.param .u64 add_one_p, .param .u64 add_one_n)
{
    .reg .pred %p<2>;
    .reg .b16 %rs<3>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [add_one_p];
    ld.param.u64 %rd2, [add_one_n];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd3, %r1, %r2;
    cvt.u64.u32 %rd4, %r3;
    add.s64 %rd3, %rd3, %rd4;
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd5, %rd1;
    add.s64 %rd6, %rd5, %rd3;
    ld.global.u8 %rs1, [%rd6];
    add.s16 %rs2, %rs1, 1;
    st.global.u8 [%rd6], %rs2;
DONE:
    ret;
}
"""

CUDA_SRC = r"""
extern "C" __global__ void add_one(unsigned char *p, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += 1;
}
"""


def _load_ptx_kernel(driver: Any, keep: list[Any]) -> tuple[Any, str]:
    """`add_one` from the hand-written PTX; from NVRTC when the driver refuses it."""
    import numpy as np

    try:
        image = np.frombuffer(PTX.encode() + b"\0", dtype=np.uint8)
        keep.append(image)
        module = _check(driver.cuModuleLoadData(image.ctypes.data))
        how = "ptx"
    except RuntimeError as first:
        from cuda.bindings import nvrtc

        prog = _check(nvrtc.nvrtcCreateProgram(CUDA_SRC.encode(), b"add_one.cu", 0, [], []))
        attr, dev = driver.CUdevice_attribute, _check(driver.cuDeviceGet(0))
        major = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
        _check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts))
        size = _check(nvrtc.nvrtcGetPTXSize(prog))
        buf = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, buf))
        image = np.frombuffer(buf, dtype=np.uint8).copy()
        keep.append(image)
        module = _check(driver.cuModuleLoadData(image.ctypes.data))
        how = f"nvrtc (hand PTX refused: {first})"
    keep.append(module)
    return _check(driver.cuModuleGetFunction(module, b"add_one")), how


def _child(v: Variant, iters: int) -> int:
    import faulthandler

    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _say("import")
    try:
        from cuda.bindings import driver, runtime
    except ImportError as e:
        return _finish({"skip": f"cuda.bindings missing: {e}"})
    import importlib

    cupy: Any = None
    torch: Any = None
    try:
        if v.kernel.startswith("cupy") or v.main_sync == "cupy":
            cupy = importlib.import_module("cupy")
        if v.kernel == "torch":
            torch = importlib.import_module("torch")
    except ImportError as e:
        return _finish({"skip": f"{e.name} missing"})
    note = ""
    keep: list[Any] = []
    try:
        _check(driver.cuInit(0))
        dev = _check(driver.cuDeviceGet(0))
        ctx = _check(driver.cuDevicePrimaryCtxRetain(dev))
        _check(driver.cuCtxSetCurrent(ctx))
        resource = _make_resource(v.alloc)
        func = None
        if v.kernel == "ptx":
            func, note = _load_ptx_kernel(driver, keep)
        _say("warm-up")
        if cupy is not None:
            cupy.cuda.Device(0).use()
            x = cupy.zeros(256, dtype=cupy.uint8)
            x += 1  # compiles (or loads) the elementwise kernel before any thread runs
            cupy.cuda.Stream.null.synchronize()
            del x
        if torch is not None:
            torch.zeros(16, device="cuda").add_(1)
            torch.cuda.synchronize()
        _check(runtime.cudaDeviceSynchronize())
        main_id = _check(driver.cuStreamGetId(driver.CUstream(PER_THREAD)))
    except Exception as e:
        return _finish({"error": f"setup: {type(e).__name__}: {e}"[:300]})

    try:
        kernel = _kernel(v, driver, cupy, torch, func)
        alloc, free = _alloc_free(v, driver, resource)
    except Exception as e:
        return _finish({"error": f"setup: {type(e).__name__}: {e}"[:300]})
    errors: list[str] = []
    ids: list[Any] = [None] * v.threads
    start = threading.Barrier(v.threads + 1)
    worked = threading.Barrier(v.threads + 1) if v.end == "stay" else None
    release = threading.Event()
    own_streams: list[Any] = []  # created streams are never destroyed (the variant is about ptds)

    def worker(k: int) -> None:
        try:
            if v.alloc in ("raw", "rawsync"):
                _check(driver.cuCtxSetCurrent(ctx))
            start.wait(30)
            stream = PER_THREAD
            if v.stream == "own":
                _check(driver.cuCtxSetCurrent(ctx))
                s = _check(driver.cuStreamCreate(0))
                own_streams.append(s)
                stream = int(s)
            for n in range(iters):
                size = SIZES[(n + k) % len(SIZES)]
                ptr = alloc(size, stream)
                kernel(ptr, size, stream, n)
                free(ptr, size, LEGACY if v.free_on == "legacy" else stream)
            ids[k] = _check(driver.cuStreamGetId(driver.CUstream(PER_THREAD)))
            if v.end == "sync":
                if resource is not None:
                    import streampool

                    streampool.PER_THREAD_DEFAULT_STREAM.synchronize()
                else:
                    _check(driver.cuStreamSynchronize(driver.CUstream(stream)))
        except Exception as e:
            errors.append(f"thread {k}: {type(e).__name__}: {e}"[:300])
            for barrier in (start, worked):
                if barrier is not None:
                    barrier.abort()  # the others stop waiting at once
            return
        if worked is not None:
            worked.wait(30)
            release.wait(60)

    tasks_before = len(os.listdir("/proc/self/task"))
    threads = [
        threading.Thread(target=worker, args=(k,), name=f"probe-{k}", daemon=True) for k in range(v.threads)
    ]
    for t in threads:
        t.start()
    _say("work")
    try:
        start.wait(30)
        if worked is not None:
            worked.wait(60)
    except threading.BrokenBarrierError:
        pass
    if v.end != "stay":
        _say("join")
        for t in threads:
            t.join(30)
        if any(t.is_alive() for t in threads):
            return _finish({"error": "a worker thread did not finish its work in 30 s", "errors": errors})
    if errors:
        return _finish({"error": errors[0], "errors": errors})
    time.sleep(0.2)
    lingering = max(
        0, len(os.listdir("/proc/self/task")) - tasks_before - (v.threads if v.end == "stay" else 0)
    )
    info = {"ids": {"main": main_id, "threads": ids}, "lingering": lingering}
    print("INFO " + json.dumps(info), flush=True)  # the ids and threads left, before any hang
    if v.pause:
        _say("pause")
        time.sleep(v.pause)
    legacy = ""
    if v.poll_legacy:
        _say("legacy-event")
        event = _check(driver.cuEventCreate(2))  # CU_EVENT_DISABLE_TIMING
        _check(driver.cuEventRecord(event, driver.CUstream(LEGACY)))
        t0 = time.monotonic()
        while True:
            err = driver.cuEventQuery(event)[0]
            if err == driver.CUresult.CUDA_SUCCESS:
                legacy = f"legacy event done after {time.monotonic() - t0:.3f} s"
                break
            if err != driver.CUresult.CUDA_ERROR_NOT_READY:
                legacy = f"legacy event query: {err!r}"
                break
            if time.monotonic() - t0 > 5:
                legacy = "legacy event NOT done after 5 s"
                break
            time.sleep(0.01)
        print(legacy, flush=True)
    _say("main-sync")
    t0 = time.monotonic()
    try:
        if v.main_sync == "driver":
            _check(driver.cuCtxSynchronize())
        elif v.main_sync == "cupy":
            cupy.cuda.runtime.deviceSynchronize()
        else:
            _check(runtime.cudaDeviceSynchronize())
    except Exception as e:
        return _finish({"error": f"main sync: {type(e).__name__}: {e}"[:300]})
    synced = time.monotonic() - t0
    if v.end == "stay":
        release.set()
        for t in threads:
            t.join(30)
    _say("done")
    note = "; ".join(x for x in (note, legacy, f"sync {synced * 1e3:.1f} ms") if x)
    return _finish({"ok": True, "note": note})


def _make_resource(alloc: str) -> Any:
    if alloc in ("raw", "rawsync"):
        return None
    import streampool
    from streampool import mr

    if streampool.using_simulated_device():
        raise RuntimeError("streampool runs on the simulated device here (STREAMPOOL_DEVICE=sim?)")
    makers: dict[str, Callable[[], Any]] = {
        "async": lambda: mr.CudaAsyncMemoryResource(),
        "pool": lambda: mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()),
        "stats": lambda: mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource()),
        "cuda": lambda: mr.CudaMemoryResource(),
        "pool_cuda": lambda: mr.ShardedPoolMemoryResource(mr.CudaMemoryResource()),
    }
    return makers[alloc]()


def _alloc_free(
    v: Variant, driver: Any, resource: Any
) -> tuple[Callable[[int, int], int], Callable[[int, int, int], None]]:
    if v.alloc == "raw":

        def alloc(size: int, stream: int) -> int:
            return int(_check(driver.cuMemAllocAsync(size, driver.CUstream(stream))))

        def free(ptr: int, size: int, stream: int) -> None:
            _check(driver.cuMemFreeAsync(ptr, driver.CUstream(stream)))

    elif v.alloc == "rawsync":

        def alloc(size: int, stream: int) -> int:
            return int(_check(driver.cuMemAlloc(size)))

        def free(ptr: int, size: int, stream: int) -> None:
            _check(driver.cuMemFree(ptr))

    else:
        import streampool

        # The streams as the scenario named them: streampool's own objects for the defaults.
        named = {PER_THREAD: streampool.PER_THREAD_DEFAULT_STREAM, LEGACY: streampool.LEGACY_DEFAULT_STREAM}

        def alloc(size: int, stream: int) -> int:
            return int(resource.allocate(size, named.get(stream, stream)))

        def free(ptr: int, size: int, stream: int) -> None:
            resource.deallocate(ptr, size, named.get(stream, stream))

    return alloc, free


def _kernel(
    v: Variant, driver: Any, cupy: Any, torch: Any, func: Any
) -> Callable[[int, int, int, int], None]:
    """What runs on the stream between an allocation and its free."""
    if v.kernel == "none":
        return lambda ptr, size, stream, n: None
    if v.kernel == "memset":
        return lambda ptr, size, stream, n: _check(
            driver.cuMemsetD8Async(ptr, n & 0xFF, size, driver.CUstream(stream))
        )
    if v.kernel == "ptx":
        import numpy as np

        def launch(ptr: int, size: int, stream: int, n: int) -> None:
            args = [np.array([ptr], dtype=np.uint64), np.array([size], dtype=np.uint64)]
            params = np.array([a.ctypes.data for a in args], dtype=np.uint64)
            grid = (size + 255) // 256
            _check(
                driver.cuLaunchKernel(
                    func, grid, 1, 1, 256, 1, 1, 0, driver.CUstream(stream), params.ctypes.data, 0
                )
            )

        return launch
    if v.kernel == "torch":

        class Cai:
            def __init__(self, ptr: int, size: int) -> None:
                self.__cuda_array_interface__ = {
                    "shape": (size,),
                    "typestr": "|u1",
                    "data": (ptr, False),
                    "version": 2,
                    "strides": None,
                }

        def torch_kernel(ptr: int, size: int, stream: int, n: int) -> None:
            t = torch.as_tensor(Cai(ptr, size), device="cuda")
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                t.add_(1)
            del t

        return torch_kernel

    ptds = getattr(cupy.cuda.Stream, "ptds", None)
    if ptds is None or ptds.ptr != PER_THREAD:
        raise RuntimeError(f"cupy.cuda.Stream.ptds is {ptds!r}, not the per-thread default stream")

    def cupy_kernel(ptr: int, size: int, stream: int, n: int) -> None:
        mem = cupy.cuda.UnownedMemory(ptr, size, None, 0)
        arr = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        if v.kernel == "cupy_env":
            current = cupy.cuda.get_current_stream().ptr
            assert current == stream, f"CuPy's current stream is {current}, not {stream}"
            arr += 1
        elif v.kernel == "cupy_ext" or stream != PER_THREAD:
            with cupy.cuda.ExternalStream(stream):
                arr += 1
        else:
            with ptds:
                arr += 1

    return cupy_kernel


if __name__ == "__main__":
    sys.exit(main())
