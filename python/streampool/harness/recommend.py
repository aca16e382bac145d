"""``recommend``: which resource suits a recorded program, by rules and by measurement.

The rules read the log (the threads and streams that allocate, sizes, cross-stream frees,
peak live bytes against the device's free memory) and choose the candidates that fit and
the one to expect; the measurement replays the log on every candidate, interleaved and
repeated, and picks the fastest. When no candidate is measurably faster than a simpler one (the rules'
choice, or the default; :func:`choose` says what measurably means), the simpler one is
recommended, and the report says so. Example::

    from streampool.harness import recommend, trace
    t = trace.read_log("app.log")
    profile = recommend.analyse(t)
    print(profile.preferred, profile.reasons)
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._native import available_device_memory, using_simulated_device
from ..allocators._on_import import NAME_OF
from . import bench
from .output import human_bytes
from .specs import setup_code
from .trace import ALLOCATE, FREE, Trace, quantile, recorded_peak

__all__ = [
    "MIN_RUN_SECONDS",
    "SIMPLER_FIRST",
    "NothingToRecommendError",
    "Profile",
    "analyse",
    "calibrate",
    "choose",
    "passes_for",
    "unmeasurable",
]

# Memory handed from stream to stream (a producer/consumer pipeline): the sharded pool with
# more headroom, whose streams record an event only once 8 frees are waiting, hands it over
# in larger batches, each needing an event and a query, for more memory held; streams that
# the program synchronises (Stream.synchronize) hand it over with no event at all
# (docs/choosing-a-resource.md, the pipeline's section, has the trade).
HANDOFF = "pool(async, headroom=2, event_batch=8)"
HANDOFF_SHARE = 0.1  # "memory handed over": at least this share of frees on another stream
# Memory short: the sharded pool that holds the least on many threads (growth in place,
# whole free blocks taken between streams, every shortfall gathering the free memory of
# every stream), much slower there (docs/choosing-a-resource.md).
LEAN = "pool(async, expandable=true, steal_whole_blocks=true, gather_interval=0)"
# Memory shorter still: one heap for every stream, growing in place, which holds the least
# of all on many threads at a fraction of LEAN's speed (docs/choosing-a-resource.md).
ONE_HEAP = "pool(async, expandable=true, one_heap=true)"
# What the default sharded pool may hold over its peak live bytes on many threads: up to 4
# times on the window workload at 16 threads (benchmarks/RESULTS.md). A peak live above
# the device's free memory over this is "tight", and LEAN and ONE_HEAP are measured too.
HOLDS = 4
#: The plain resource: measured as a baseline, never recommended.
BASELINE = "cuda"
#: Candidates from the simplest (the default) to the most specialised: within noise, the
#: earlier one is recommended.
SIMPLER_FIRST = [
    "async",
    "prefetch(managed)",
    "managed",
    "pool(async)",
    "binning(async)",
    HANDOFF,
    LEAN,
    ONE_HEAP,
    BASELINE,
]
#: The least time a candidate's run should take: a log that replays faster (a few hundred
#: events: well under a millisecond) is timed mostly by its threads' start and the host's
#: moment, and which candidate wins changes from one invocation to the next. Such a log is
#: replayed several times over in each run (:func:`passes_for`).
MIN_RUN_SECONDS = 0.02
#: The most events one run replays when it repeats a short log.
MAX_RUN_EVENTS = 1_000_000
#: A replay this long (seconds) on the first candidate needs no passes on any (:func:`calibrate`).
LONG_ENOUGH = 1000 * MIN_RUN_SECONDS
SMALL = 1 << 20  # "small" allocations: at most 1 MiB at the median
MANY = 4  # "many" threads and streams


class NothingToRecommendError(RuntimeError):
    """Every candidate ran out of memory in its replay: none is recommended."""


@dataclass
class Profile:
    """What the rules read from a trace, the candidates that fit, the one they expect
    (``threads`` and ``streams``: those that allocate; the replay runs the ones that only
    free too, :attr:`Trace.threads <streampool.harness.trace.Trace.threads>`)."""

    threads: int
    streams: int
    allocations: int
    size_p50: int
    size_p99: int
    cross_stream_frees: int
    cross_thread_frees: int
    peak_live_bytes: int
    free_device_bytes: int
    preferred: str
    candidates: list[str]
    reasons: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _peers() -> list[str]:
    if using_simulated_device():
        return []
    found = []
    if importlib.util.find_spec("rmm") is not None:
        found += ["rmm:async", "rmm:pool(async)", "rmm:arena", "rmm:binning"]
    if importlib.util.find_spec("cupy") is not None:
        found += ["cupy:pool", "cupy:async"]
    if importlib.util.find_spec("torch") is not None:
        found += ["torch:native"]
    return found


def analyse(trace: Trace, free_device_bytes: int | None = None, peers: bool = True) -> Profile:
    """The rules: reads ``trace`` and returns its :class:`Profile` (``free_device_bytes``
    defaults to what the device has free now)."""
    if free_device_bytes is None:
        free_device_bytes = available_device_memory()[0]
    sizes = sorted(r[1] for r in trace.records if r[5] == ALLOCATE)
    alloc_at = {r[2]: r for r in trace.records if r[5] == ALLOCATE}
    frees = cross_stream = cross_thread = 0
    for r in trace.records:
        if r[5] == FREE:
            frees += 1
            a = alloc_at[r[2]]
            cross_stream += a[4] != r[4]
            cross_thread += a[3] != r[3]
    # The program's own frees: the closing frees the trace adds for memory the log never
    # freed (on the allocation's own stream) would dilute the share handed between streams.
    frees -= trace.closing_frees
    p50, p99 = quantile(sizes, 0.5), quantile(sizes, 0.99)
    peak = recorded_peak(trace.records)
    # The threads and streams that allocate: those that only free (a pipeline's consumers)
    # contend for no allocation; the replay's table counts them too (it runs them).
    threads = len({r[3] for r in trace.records if r[5] == ALLOCATE})
    streams = len({r[4] for r in trace.records if r[5] == ALLOCATE})
    free_threads, free_streams = trace.threads - threads, trace.streams - streams
    only_free = [
        f"{n} more {what}" for n, what in ((free_threads, "thread(s)"), (free_streams, "stream(s)")) if n
    ]
    reasons = [
        f"{threads} thread(s) and {streams} stream(s) allocate"
        + (f", {' and '.join(only_free)} only free" if only_free else "")
        + f"; {len(sizes)} allocations, sizes {human_bytes(p50)} at the median and "
        f"{human_bytes(p99)} at the 99th percentile",
        f"{cross_stream} free(s) on another stream than the allocation's, {cross_thread} on another thread",
        f"peak live {human_bytes(peak)} in the log's recorded order (the table's is each replay's own) "
        f"against {human_bytes(free_device_bytes)} free on the device",
    ]
    if peak > free_device_bytes:
        preferred = "prefetch(managed)"
        candidates = ["prefetch(managed)", "managed"]
        reasons.append(
            "the peak is larger than the device's free memory: only managed memory fits, and "
            "prefetching moves its pages to the GPU before the kernels need them"
        )
    else:
        candidates = ["async", "pool(async)", "binning(async)", BASELINE] + (_peers() if peers else [])
        if threads >= MANY and streams >= MANY and p50 <= SMALL:
            preferred = "pool(async)"
            reasons.append(
                "many threads and streams with small allocations: the sharded pool gives each stream "
                "its own shard, so they do not wait on one lock (the driver's pool serialises them)"
            )
        elif streams <= 1:
            preferred = "async"
            contention = (
                "one thread on one stream: no lock is contended"
                if threads <= 1 and not free_threads
                else f"one thread allocates, on one stream: only the frees of the {free_threads} other "
                "thread(s) can contend with it for a lock"
                if threads <= 1
                else f"{threads} threads share one stream: their calls can contend for a lock, and the "
                "sharded pool, whose shards are per stream, gives them one shard between them (a shard "
                "per stream, its advantage, does not apply)"
            )
            reasons.append(
                f"{contention}, so the driver's pool (the default, the simplest, and shared with "
                "PyTorch's and CuPy's async allocators) is expected to do; only a measured margin "
                "beyond noise picks another"
            )
        else:
            preferred = "async"
            reasons.append(
                "no pattern that calls for a special resource: the default, unless measured faster"
            )
        if cross_stream:
            reasons.append(
                "cross-stream frees: every candidate orders the reuse (the sharded pool prefers growing "
                "to making one stream wait on another)"
            )
        if frees and cross_stream >= HANDOFF_SHARE * frees:
            candidates.insert(candidates.index(BASELINE), HANDOFF)
            reasons.append(
                f"memory handed from stream to stream ({100 * cross_stream / frees:.0f}% of frees): "
                f"also measured, {HANDOFF}, which keeps more freed memory in reserve so that streams "
                "hand it over in batches of 8 or more (fewer driver calls per allocation, more memory held; "
                "where the consumers synchronise their streams, no driver call and little more memory)"
            )
        if peak * HOLDS > free_device_bytes:
            candidates[candidates.index(BASELINE) : candidates.index(BASELINE)] = [LEAN, ONE_HEAP]
            reasons.append(
                f"memory is tight: the peak live is {100 * peak / free_device_bytes:.0f}% of the "
                f"device's free memory, and the sharded pool may hold up to {HOLDS} times its live bytes "
                f"on many threads; also measured, {LEAN}, which holds about 1.5 times there (as the driver's "
                f"own pool does, or less) at about a twentieth of the allocation speed, and {ONE_HEAP}, "
                "which holds about 1.1-1.25 times at a twentieth of that; a candidate that runs out of "
                "memory in the replay is not recommended, and of the others the fastest is"
            )
    reasons.append(
        "if your program shares the GPU with PyTorch or CuPy, `async` shares one driver pool with "
        "their async allocators instead of splitting memory"
    )
    return Profile(
        threads,
        streams,
        len(sizes),
        p50,
        p99,
        cross_stream,
        cross_thread,
        peak,
        free_device_bytes,
        preferred,
        candidates,
        reasons,
    )


def unmeasurable(profile: Profile) -> str | None:
    """Why the candidates cannot be measured here, or None. On a real GPU, a peak above the
    device's free memory leaves only managed memory, and the replay workload refuses to
    replay such a log on it (the harness never oversubscribes a shared GPU): nothing would
    be measured. On the simulated device the replays run (and run out of memory)."""
    if using_simulated_device() or profile.peak_live_bytes <= profile.free_device_bytes:
        return None
    peak, free = human_bytes(profile.peak_live_bytes), human_bytes(profile.free_device_bytes)
    return (
        f"the log's peak live bytes ({peak}) are above the device's free memory ({free}): only "
        "managed memory fits: use it with prefetching, `streampool.setup(larger_than_memory=True)`; "
        "nothing was measured: replaying the log on managed memory would oversubscribe the GPU, and "
        "the harness never oversubscribes a shared GPU (it can hang it); to measure the candidates, "
        f"run recommend on a device with more free memory (at least {peak} free)"
    )


def _held(row: dict[str, Any]) -> str:
    """What a summary row's resource held at its peak against the peak live bytes ("" when
    a run does not say)."""
    reserved, live = row.get("peak_reserved_bytes"), row.get("peak_live_bytes")
    if reserved is None or live is None:
        return ""
    return f"held {human_bytes(reserved)} for {human_bytes(live)} live"


def passes_for(events: int, seconds: float, target: float = MIN_RUN_SECONDS) -> int:
    """How many times over each run replays a log of ``events`` events that one replay
    took ``seconds`` to run: enough for a run to last ``target`` seconds (at the rate of
    that replay), at most :data:`MAX_RUN_EVENTS` events a run (at least 1)."""
    if not seconds < target:
        return 1
    wanted = math.ceil(target / max(seconds, 1e-6))
    return max(1, min(wanted, MAX_RUN_EVENTS // max(1, events)))


def calibrate(trace: Trace, specs: Sequence[str], params: dict[str, Any]) -> tuple[dict[str, int], float]:
    """How many times over each spec's runs replay ``trace`` (``params``: the replay
    workload's own), and how long one replay took on the fastest spec. Each spec is timed
    itself, since the fastest need the most, each step the faster of two runs (one run
    alone may be a cold one; a replay of :data:`LONG_ENOUGH` / 50 seconds or more takes one
    run): one pass; while shorter than :data:`MIN_RUN_SECONDS`, the passes that time
    suggests for twice that (:func:`passes_for`: a short replay's time is mostly its
    threads' start, so a step falls short, and runs aimed at the least would land on both
    sides of it), three steps at most. One pass where the replay ran out of memory (a
    failed replay is no measure, and repeating it repeats the failures); and, to spare a
    long log's candidates a replay each, one pass for every spec when the first spec's
    replay took :data:`LONG_ENOUGH` seconds or more (a candidate a thousand times as fast
    would still run the least)."""

    def timed(spec: str, passes: int) -> tuple[float, bool]:
        runs: list[dict[str, Any]] = []
        for _ in range(2):
            more, _summary = bench.measure(
                "replay", [spec], [trace.threads], trace.streams, 1, params | {"passes": passes}
            )
            runs += more
            if more[0]["seconds"] >= LONG_ENOUGH / 50:
                break
        return min(r["seconds"] for r in runs), any(r["oom_events"] for r in runs)

    chosen: dict[str, int] = {}
    fastest = math.inf
    for spec in specs:
        seconds, failed = timed(spec, 1)
        if not chosen and seconds >= LONG_ENOUGH:
            return dict.fromkeys(specs, 1), seconds
        fastest = min(fastest, seconds)
        passes = 1
        for _ in range(3):
            more = 1 if failed else passes_for(passes * trace.events, seconds, 2 * MIN_RUN_SECONDS)
            if more == 1 or seconds >= MIN_RUN_SECONDS:
                break
            passes *= more
            seconds, failed = timed(spec, passes)
            if failed:
                passes = 1
                break
        chosen[spec] = passes
    return chosen, fastest


def choose(
    profile: Profile, summary: list[dict[str, Any]], device: int = 0, frameworks: Sequence[str] | None = None
) -> dict[str, Any]:
    """The recommendation from measured ``summary`` rows (one per candidate): the fastest
    by median throughput, unless a simpler candidate (the rules' choice first, then
    SIMPLER_FIRST order) is one that no candidate measurably beats
    (:func:`bench.measurably_faster`: faster in most repeats, and by more than NOISE_FLOOR
    at the median of the repeats' ratios; so one outlying run can neither hide a candidate
    that lost every repeat nor make one that lost most of them the recommendation). A
    candidate that ran out of memory in any run is never recommended; NothingToRecommendError when every one did.
    Returns choice, runner_up, margin (the choice's median over the runner-up's, minus 1),
    within_noise, a one-line headline, the reasoning and the code that makes the choice ``device``'s resource (the
    device the log was recorded on: :func:`~streampool.harness.specs.setup_code`). ``frameworks``:
    the libraries that allocated through the logged resource when the program was profiled
    (PyTorch, CuPy, Numba; None when unknown, as for a log given): for streampool's
    resource, the code then routes them too, as the profile did (:func:`framework_code`)."""
    candidates = [r for r in summary if r["resource"] != BASELINE]
    rows = {r["resource"]: r for r in candidates if not r["oom_events"]}
    out_of_memory = [
        f"{r['resource']} ({r['oom_events']} failed allocation(s) in {r['repeats']} runs)"
        for r in candidates
        if r["oom_events"]
    ]
    if not rows:
        raise NothingToRecommendError(
            f"every candidate ran out of memory replaying the log: {', '.join(out_of_memory)}; "
            f"nothing to recommend (the log's peak live bytes: {human_bytes(profile.peak_live_bytes)}, "
            f"free on the device: {human_bytes(profile.free_device_bytes)})"
        )
    ranked = sorted(rows.values(), key=lambda r: r["throughput"]["median"], reverse=True)
    fastest = ranked[0]
    order = [profile.preferred] + [s for s in SIMPLER_FIRST if s != profile.preferred]

    def beaten(row: dict[str, Any]) -> bool:
        """Whether another candidate is measurably faster than ``row``."""
        return any(bench.measurably_faster(o, row) for o in rows.values())

    simpler = [rows[s] for s in order if s in rows and not beaten(rows[s])]
    pick = simpler[0] if simpler else fastest
    others = [r for r in ranked if r is not pick]
    runner = others[0] if others else None
    margin = pick["throughput"]["median"] / runner["throughput"]["median"] - 1 if runner else None
    noise = runner is not None and not (
        bench.measurably_faster(pick, runner) or bench.measurably_faster(runner, pick)
    )
    why = list(profile.reasons)
    if out_of_memory:
        why.append(f"ran out of memory in the replay, so not recommended: {', '.join(out_of_memory)}")
    if pick is not fastest:
        which = "the rules' choice" if pick["resource"] == profile.preferred else "the simpler choice"
        gain = fastest["throughput"]["median"] / pick["throughput"]["median"] - 1
        why.append(
            f"measured: {fastest['resource']} was fastest ({100 * gain:+.1f}% at the median), but within noise "
            f"of {pick['resource']}, {which}, which is recommended (measurably faster means "
            f"faster in most repeats, and by more than {100 * bench.NOISE_FLOOR:.0f}% at the median of the "
            "repeats' ratios)"
        )
    elif noise and runner is not None:
        why.append(f"measured: {pick['resource']} and {runner['resource']} are within noise of each other")
    else:
        why.append(f"measured: {pick['resource']} was the fastest of {len(ranked)} candidate(s)")
    if pick["resource"] != profile.preferred and profile.preferred in rows and pick is fastest:
        why.append(f"the rules expected {profile.preferred}; the measurement overrules them")
    held = {r["resource"]: _held(r) for r in (pick, runner) if r is not None and _held(r)}
    if held:
        why.append(f"memory, at the replays' peak: {'; '.join(f'{k} {v}' for k, v in held.items())}")
    if runner is None or margin is None:
        headline = f"{pick['resource']} (the only candidate that fits)"
    elif pick is not fastest:
        gain = fastest["throughput"]["median"] / pick["throughput"]["median"] - 1
        headline = (
            f"{pick['resource']} (no candidate was measurably faster: {fastest['resource']}'s median is "
            f"{100 * gain:+.1f}%, within noise; see why below)"
        )
    elif noise:
        headline = (
            f"{pick['resource']} ({100 * margin:+.1f}% over {runner['resource']} at the median, within noise)"
        )
    else:
        headline = f"{pick['resource']} ({100 * margin:+.1f}% over {runner['resource']}, median of {pick['repeats']} runs)"
    if pick["resource"] in held:  # speed is never reported without memory
        headline = f"{headline}; it {held[pick['resource']]}"
    return {
        "headline": headline,
        "choice": pick["resource"],
        "runner_up": runner["resource"] if runner else None,
        "margin": margin,
        "within_noise": noise,
        "code": framework_code(setup_code(pick["resource"], device), pick["resource"], frameworks, why),
        "reasons": why,
        "throughput_median": pick["throughput"]["median"],
        "unit": pick["unit"],
        "fastest": fastest["resource"],
    }


def framework_code(code: str, resource: str, frameworks: Sequence[str] | None, why: list[str]) -> str:
    """``code`` that applies streampool's ``resource``, followed, when ``frameworks`` (the
    libraries that allocated through the logged resource in the profile) names any, by
    the call that routes them through it again as the profile did
    (:func:`streampool.allocators.use_on_import`); the reason is added to ``why``. A peer's
    code is left as it is: the libraries then keep their own allocators."""
    if not frameworks or ":" in resource:
        return code
    names = ", ".join(frameworks)
    why.append(
        f"{names} allocated through the logged resource in the profile (what profile does unless "
        "--no-frameworks), so the code routes them through the choice too"
    )
    args = ", ".join(repr(NAME_OF[f]) for f in frameworks if f in NAME_OF)
    return (
        f"{code}\nfrom streampool import allocators\n"
        f"allocators.use_on_import({args})  # {names} allocate{'s' * (len(frameworks) == 1)} through it, "
        "as when profiled"
    )
