"""Side-by-side measurement: every resource on a workload, interleaved and repeated.

The machines are noisy, so no single figure is reported: each (resource, thread count)
runs ``repeats`` times, the resources taking turns within each repeat (in a rotating
order), and the summary gives min/median/max of the throughput, of the allocator's share
of the host time, and of the ratio to the first resource *in the same repeat*. Example::

    from streampool.harness import bench
    runs, summary = bench.measure("window", ["async", "pool(async)"], threads=[1, 4])
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .. import mr
from .._errors import StreampoolError
from .._native import available_device_memory, using_simulated_device
from . import workloads
from .specs import check_distinct, make_resource
from .trace import Trace

__all__ = ["Interrupted", "measure", "refused", "release_device_pools", "spread", "summarise"]

#: Below this relative difference two medians are within noise when the repeats do not
#: tell them apart better (see ``within_noise``).
NOISE_FLOOR = 0.05


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def release_device_pools() -> None:
    """Trims the device's own pools (the driver's default pool, and its managed pool where
    the device has one) to what is allocated from them: they keep what is freed into them
    (their release threshold is at the maximum), which a later run would find reserved,
    or, outside them, missing from the device."""
    makers: tuple[Callable[[], Any], ...] = (mr.CudaAsyncMemoryResource, mr.CudaAsyncManagedMemoryResource)
    for make in makers:
        with contextlib.suppress(StreampoolError):  # no managed pool on this device or driver
            make().trim_to(0)


class Interrupted(KeyboardInterrupt):
    """A :func:`measure` that Ctrl-C stopped: a ``KeyboardInterrupt`` that keeps what had
    been measured. ``runs`` and ``summary`` are those of the runs that had finished (the
    run in progress is lost), and ``planned`` the number of runs the measurement was to
    make."""

    def __init__(self, runs: list[dict[str, Any]], summary: list[dict[str, Any]], planned: int) -> None:
        super().__init__(f"interrupted after {len(runs)} of {planned} runs")
        self.runs, self.summary, self.planned = runs, summary, planned

    def __reduce__(self) -> tuple[Any, ...]:  # pickles and copies whole
        return (type(self), (self.runs, self.summary, self.planned), self.__dict__)


def one_run(workload: str, spec: str, threads: int, streams: int, params: dict[str, Any]) -> dict[str, Any]:
    """Runs ``workload`` once on a fresh resource made from ``spec``. Runs are independent:
    the device's own pools are trimmed before and after (:func:`release_device_pools`),
    and a resource on the device's shared pool reports what that pool reserved beyond
    what others had allocated from it when the run started (which trimming cannot
    release). A resource that holds nothing beyond what is live (``reserves_live``)
    reports its measured peak live bytes as reserved (where ``peak_live_measured``)."""
    release_device_pools()
    candidate = make_resource(spec)
    held = candidate.shared_pool.used_bytes if candidate.shared_pool is not None else 0
    result = workloads.run(workload, candidate, threads=threads, streams=streams or threads, **params)
    if held and result.get("peak_reserved_bytes") is not None:
        result["peak_reserved_bytes"] = max(0, result["peak_reserved_bytes"] - held)
    measured = result.get("peak_live_measured", True)
    if result.get("peak_reserved_bytes") is None and candidate.reserves_live and measured:
        result["peak_reserved_bytes"] = result.get("peak_live_bytes")
    del candidate
    gc.collect()
    release_device_pools()
    return result


def refused(
    workload: str, specs: Sequence[str], threads: Iterable[int], params: dict[str, Any]
) -> dict[str, str]:
    """The specs on which ``workload`` (with ``params``, at the most of ``threads``) is
    refused here, each with why: on a real GPU, managed memory when the workload's peak
    live bytes (:func:`workloads.peak_live`) are above the device's free memory (the
    harness never oversubscribes a shared GPU, :func:`workloads.oversubscribes`). Nothing
    is made when the peak fits."""
    if using_simulated_device():
        return {}
    release_device_pools()  # what earlier runs freed into them is not memory the device lacks
    peak = workloads.peak_live(workload, params | {"threads": max(threads, default=1)})
    if peak <= available_device_memory()[0]:
        return {}
    log = params.get("log")
    subject = workloads.replay_subject(log, params.get("passes", 1)) if isinstance(log, Trace) else peak
    found = {}
    for s in specs:
        found[s] = workloads.oversubscribes(make_resource(s), subject)
        release_device_pools()
    return {s: why for s, why in found.items() if why is not None}


def measure(
    workload: str,
    specs: Sequence[str],
    threads: Iterable[int] = (1,),
    streams: int = 0,
    repeats: int = 3,
    params: dict[str, Any] | None = None,
    progress: Callable[[Iterable[Any], int, str], Iterable[Any]] | None = None,
    by_spec: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Runs ``workload`` on every spec, for every thread count, ``repeats`` times; returns
    the runs (one dict per run: resource, threads, streams, repeat and the workload's
    metrics, without raw latencies) and their summary (see :func:`summarise`). A spec on
    which the workload is refused here (:func:`refused`) is refused before anything runs:
    WorkloadError naming it. Ctrl-C raises :class:`Interrupted`, which keeps the runs that
    had finished. ``by_spec``: parameters of some specs' own, over ``params`` (a rate,
    such as a replay's events/s over its own number of passes, stays comparable); each
    such run carries them."""
    params = params or {}
    by_spec = by_spec or {}
    unknown = [s for s in by_spec if s not in specs]
    if unknown:
        raise ValueError(f"by_spec names specs that are not measured: {', '.join(map(repr, unknown))}")
    for own in by_spec.values():
        workloads.check(workload, params | own)
    if isinstance(specs, (str, bytes)) or not specs:
        raise TypeError(f"specs must be a non-empty list of resource specs, not {specs!r}")
    if isinstance(threads, (str, bytes, int)):
        raise TypeError(f"threads must be an iterable of thread counts (ints), e.g. [1, 4], not {threads!r}")
    threads = list(threads)
    if not threads:
        raise ValueError("threads must name at least one thread count")
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise TypeError(f"repeats must be an int >= 1, not {repeats!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, not {repeats!r}")
    for t in threads:  # before `streams or t` below makes a bad count read as a bad streams
        workloads.check_param(workload, "threads", t, "int")
    workloads.check(workload, params)
    workloads.check_events(workload, params, max(threads))
    check_distinct(specs)
    why = {
        k: v for s in specs for k, v in refused(workload, [s], threads, params | by_spec.get(s, {})).items()
    }
    if why:
        raise workloads.WorkloadError("; ".join(why.values()))
    plan = [
        (t, rep, specs[(i + rep) % len(specs)])
        for t in threads
        for rep in range(repeats)
        for i in range(len(specs))
    ]
    runs: list[dict[str, Any]] = []
    items: Iterable[Any] = plan if progress is None else progress(plan, len(plan), f"{workload}")
    try:
        for t, rep, spec in items:
            own = by_spec.get(spec, {})
            result = one_run(workload, spec, t, streams, params | own)
            latencies = result.pop("latencies_ns", None)
            runs.append(
                {
                    **result,
                    **own,
                    "resource": spec,
                    "threads": t,
                    # The workload's own count where it makes its streams (two per pipeline
                    # pair, a log's), else the one asked for.
                    "streams": result.get("streams") or streams or t,
                    "repeat": rep,
                    "_latencies": latencies,
                }
            )
        summary = summarise(runs, list(specs))
    except KeyboardInterrupt as e:
        close = getattr(items, "close", None)
        if close is not None:  # a progress display stops drawing before the report
            close()
        if isinstance(e, Interrupted):
            raise
        stopped = True
    else:
        stopped = False
    if stopped:  # raised here, with no context: the interrupted run's frames (its
        # resource, its buffers) went with the KeyboardInterrupt
        raise Interrupted(runs, summarise(runs, list(specs)), len(plan))
    return runs, summary


def summarise(runs: list[dict[str, Any]], specs: list[str]) -> list[dict[str, Any]]:
    """Per (resource, threads): min/median/max of throughput, of the allocator's share of
    host time (:func:`alloc_share`), of the ratio to the first
    resource's throughput in the same repeat; the median run's latency percentiles (of an
    even number of runs, the slower middle one's); the
    largest peaks of live and reserved bytes (of the runs that give them; None when none
    does), out-of-memory events, data mismatches, and the
    most synchronisations and waits the resource made in one run (None where it does not
    report them), min/median/max of the resource's own driver calls per chunk (the
    native pipeline; None elsewhere), and the runs' long calls and long null calls summed
    (the native pipeline with ``long_call_us``, ``null_call_us``; None elsewhere)."""
    out = []
    baseline = specs[0]
    for t in sorted({r["threads"] for r in runs}):
        base = {r["repeat"]: r["throughput"] for r in runs if r["threads"] == t and r["resource"] == baseline}
        for spec in specs:
            mine = [r for r in runs if r["threads"] == t and r["resource"] == spec]
            if not mine:
                continue
            tp = [r["throughput"] for r in mine]
            by_repeat = [r["throughput"] for r in sorted(mine, key=lambda r: r["repeat"])]
            # Of an even number of runs, the slower of the middle two (no run has the
            # median throughput then; its latencies are not the faster run's).
            median_run = sorted(mine, key=lambda r: r["throughput"])[(len(mine) - 1) // 2]
            shares = [alloc_share(r) for r in mine]
            ratios = [r["throughput"] / base[r["repeat"]] for r in mine if base.get(r["repeat"])]
            reserved = [r["peak_reserved_bytes"] for r in mine if r.get("peak_reserved_bytes") is not None]
            live = [r["peak_live_bytes"] for r in mine if r.get("peak_live_bytes") is not None]
            out.append(
                {
                    "resource": spec,
                    "threads": t,
                    "streams": mine[0]["streams"],
                    "repeats": len(mine),
                    "unit": mine[0]["unit"],
                    "throughput": spread(tp),
                    "throughput_by_repeat": by_repeat,
                    "ratio_to_first": spread(ratios) if ratios else None,
                    "alloc_share": spread(shares),
                    "allocate": median_run["allocate"],
                    "free": median_run["free"],
                    "longest_call_ns": max(max(r["allocate"]["max"], r["free"]["max"]) for r in mine),
                    "peak_live_bytes": max(live) if live else None,
                    "peak_reserved_bytes": max(reserved) if reserved else None,
                    "oom_events": sum(r["oom_events"] for r in mine),
                    "mismatches": sum(r.get("mismatches", 0) for r in mine),
                    "synchronizations": _most(mine, "synchronizations"),
                    "waits": _most(mine, "waits"),
                    "driver_calls_per_chunk": _spread_of(mine, "driver_calls_per_chunk"),
                    "long_calls": _long_calls(mine),
                    "null_calls": _long_calls(mine, "null_calls"),
                }
            )
    return out


def _long_calls(runs: list[dict[str, Any]], key: str = "long_calls") -> dict[str, Any] | None:
    """The runs' ``long_calls`` (or ``null_calls``) summed (same threshold in every run);
    None when none has them."""
    mine = [r[key] for r in runs if r.get(key)]
    if not mine:
        return None
    total: dict[str, Any] = {
        k: sum(m[k] for m in mine) for k in ("calls", "preempted", "slept", "stolen", "on_cpu")
    }
    total["longest_ns"] = max(m.get("longest_ns", 0) for m in mine)
    for part in ("sampled", "running_in"):
        if part in mine[0]:
            total[part] = {k: sum(m[part][k] for m in mine) for k in mine[0][part]}
    return {"over_ns": mine[0]["over_ns"], **total}


def _most(runs: list[dict[str, Any]], key: str) -> int | None:
    """The largest ``key`` over the runs that report it; None when none does."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return max(values) if values else None


def _spread_of(runs: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """min/median/max of ``key`` over the runs that report it; None when none does."""
    values = [float(r[key]) for r in runs if r.get(key) is not None]
    return spread(values) if values else None


def alloc_share(run: dict[str, Any]) -> float:
    """The share of host time inside allocator calls: the run's own figure where it gives
    one (the native pipeline), else ``alloc_seconds / (seconds * host threads)``."""
    if "alloc_share" in run:
        return float(run["alloc_share"])
    threads = run.get("host_threads", run["threads"])
    return run["alloc_seconds"] / (run["seconds"] * max(1, threads)) if run["seconds"] else 0.0


def within_noise(a: dict[str, float], b: dict[str, float]) -> bool:
    """Whether two throughput spreads cannot be told apart: their ranges overlap, or their
    medians differ by less than NOISE_FLOOR."""
    overlap = a["min"] <= b["max"] and b["min"] <= a["max"]
    close = abs(a["median"] - b["median"]) <= NOISE_FLOOR * max(a["median"], b["median"])
    return overlap or close


def measurably_faster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether summary row ``a`` ran measurably faster than row ``b``. With two or more
    repeats of each (the runs of one repeat ran one after the other, at the host's same
    moment): ``a`` was faster in most repeats (more than half: both of 2, 2 of 3), and by
    more than NOISE_FLOOR at the median of the repeats' ratios. Comparing runs of one
    repeat takes the host's moment out, which can move every run by 2 times; one outlying
    run can then neither hide a candidate that lost every repeat nor rescue one that lost
    most of them. Otherwise: ``a``'s median is higher and the spreads are not
    :func:`within_noise`."""
    ra, rb = a.get("throughput_by_repeat"), b.get("throughput_by_repeat")
    if ra and rb and len(ra) == len(rb) >= 2:
        ratios = [x / y if y > 0 else (float("inf") if x > 0 else 1.0) for x, y in zip(ra, rb)]
        won = sum(r > 1.0 for r in ratios)
        return 2 * won > len(ratios) and statistics.median(ratios) > 1.0 + NOISE_FLOOR
    return a["throughput"]["median"] > b["throughput"]["median"] and not within_noise(
        a["throughput"], b["throughput"]
    )
