"""``stress``: a long randomised run that verifies the data.

Threads allocate random sizes on random streams of their own and fill each allocation
with a pattern of its own by a kernel (:func:`streampool.kernels.fill`). Most frees check
the pattern by a kernel first (:func:`streampool.kernels.check`, which synchronises the
stream): memory that another allocation overlapped, or that was reused before a kernel
finished with it, shows up as wrong words. Some of these frees go to another stream than
the allocation's (its stream has finished with it), so that cross-stream reuse is
exercised. The other frees (``PENDING_SHARE``) are made with kernels still pending on the
memory: a compute kernel (:func:`streampool.kernels.compute`, ``PENDING_ITERATIONS``
passes over every word) and a fill with another pattern are enqueued on the allocation's
stream and the memory freed there at once, unchecked. The resource must then order the
memory's next use after those kernels: a resource that hands it to another stream
without ordering (early cross-stream reuse) has the next owner's pattern overwritten,
which that owner's check finds, and on the simulated device its race detector also
reports the unordered reuse. Every allocation is also
checked against the live ones for overlap. A run that verified nothing (every
allocation refused, say) is not ok: ``nothing_verified`` says so. Example::

    from streampool.harness import make_resource, stress
    report = stress.run(make_resource("pool(async)"), seconds=2, threads=4)
    assert report["ok"], report
"""

from __future__ import annotations

import bisect
import functools
import random
import threading
import time
from typing import Any

from .._native import Stream, parse_size, using_simulated_device
from ._threads import run_threads
from .specs import Candidate
from .trace import live_intervals_overlap
from .workloads import _kernels

__all__ = ["PENDING_SHARE", "run"]

#: The share of frees made with kernels still pending on the memory (unchecked).
PENDING_SHARE = 0.25
#: The compute kernel's passes before such a free, on a GPU: enough that the kernels are
#: still pending when the host has the memory's next owner fill it (on an H200, early
#: reuse was found at 256 passes, not at 64). On the simulated device kernels run only
#: when the host waits for them, so one pass keeps them pending.
PENDING_ITERATIONS = 256


def run(
    candidate: Candidate,
    *,
    seconds: float = 10.0,
    threads: int = 4,
    streams: int = 2,
    max_size: int | str = "1MiB",
    max_live: int = 32,
    seed: int = 0,
    sim: Any = None,
    operations: int | None = None,
) -> dict[str, Any]:
    """Stresses ``candidate`` for ``seconds`` with ``threads`` threads of ``streams``
    streams each (``operations``: each thread also stops after that many, for a run that a
    seed repeats exactly on one thread); returns the report: ok, operations, allocations,
    refused (allocations that ran out of memory), verified_bytes (checked by kernels),
    pending_frees (made with a kernel pending, unchecked), corruptions, overlaps, races
    (each a list of sentences; the first 20 kept), errors, race_detector, and
    nothing_verified: no check failed, but none was made either (ok is then False).
    ``sim``: the active SimulatedDevice, whose race detector is read at the end: the races
    it found during this run are reported, not those found before (the detector keeps the
    first 1000 of a device: ``sim.clear_races()`` before a run if it may hold that many,
    as ``streampool stress`` does before each resource). On Ctrl-C
    the threads stop (each frees what it holds) before the KeyboardInterrupt goes on.
    ValueError for a ``max_size`` below 1 byte."""
    kernels = _kernels()
    passes = 1 if using_simulated_device() else PENDING_ITERATIONS
    top = parse_size(max_size)
    if top < 1:
        raise ValueError(f"stress: max_size must be at least 1 byte, not {max_size!r}")
    lock = threading.Lock()
    live: list[tuple[int, int]] = []
    report: dict[str, Any] = {
        "operations": 0,
        "allocations": 0,
        "refused": 0,
        "verified_bytes": 0,
        "pending_frees": 0,
        "corruptions": [],
        "overlaps": [],
        "errors": [],
    }
    earlier = len(sim.races()) if sim is not None else 0  # found before this run: not its own
    deadline = time.monotonic() + seconds
    stop = threading.Event()
    resource = candidate.resource

    def note(kind: str, text: str) -> None:
        with lock:
            if len(report[kind]) < 20:
                report[kind].append(text)

    def body(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        mine = [Stream() for _ in range(streams)]
        held: list[tuple[int, int, int, Stream]] = []  # ptr, size, pattern seed, stream
        ops = allocations = refused = verified = pending = 0

        def release(ptr: int, size: int, stream: Stream) -> None:
            with lock:  # before the free: another thread may be handed the memory at once
                live.pop(bisect.bisect_left(live, (ptr, size)))
            resource.deallocate(ptr, size, stream)

        def free_one() -> None:
            nonlocal verified, pending
            ptr, size, pattern, stream = held.pop(rng.randrange(len(held)))
            if rng.random() < PENDING_SHARE:
                # Freed with kernels pending on it, which end by writing another pattern: its
                # next owner's pattern is overwritten unless the resource orders the reuse.
                # The last kernel and the free are on any of the thread's streams (ordered
                # after the memory's own first, as a program must): a resource that orders
                # reuse after the allocation's stream but not the free's is caught too.
                free_on = rng.choice(mine)
                kernels.compute(ptr, size, stream, iterations=passes)
                if free_on.handle != stream.handle:
                    free_on.wait_stream(stream)
                kernels.fill(ptr, size, pattern + 1, free_on)
                release(ptr, size, free_on)
                pending += 1
                return
            bad = kernels.check(ptr, size, pattern, stream)  # synchronises the stream
            verified += size
            if bad:
                note(
                    "corruptions",
                    f"{bad} wrong 8-byte word(s) in {size} bytes at {ptr:#x} "
                    f"(allocated by thread {index}, pattern {pattern})",
                )
            release(ptr, size, rng.choice(mine))  # cross-stream free: the check synchronised `stream`

        try:
            while time.monotonic() < deadline and not stop.is_set() and ops != operations:
                ops += 1
                if held and (len(held) >= max_live or rng.random() < 0.45):
                    free_one()
                    continue
                size = rng.randint(1, top)
                stream = rng.choice(mine)
                try:
                    ptr = resource.allocate(size, stream)
                except MemoryError:
                    refused += 1
                    if held:
                        free_one()
                    continue
                allocations += 1
                with lock:
                    hit = live_intervals_overlap(live, ptr, size)
                    if hit is None:
                        bisect.insort(live, (ptr, size))
                if hit is not None:
                    note("overlaps", f"[{ptr:#x}, +{size}) handed out while [{hit[0]:#x}, +{hit[1]}) is live")
                    resource.deallocate(ptr, size, stream)
                    continue
                pattern = rng.getrandbits(32)
                kernels.fill(ptr, size, pattern, stream)
                held.append((ptr, size, pattern, stream))
            while held:
                free_one()
        except Exception as e:
            note("errors", f"thread {index}: {type(e).__name__}: {e}")
        finally:
            for s in mine:
                s.synchronize()
            with lock:
                report["operations"] += ops
                report["allocations"] += allocations
                report["refused"] += refused
                report["verified_bytes"] += verified
                report["pending_frees"] += pending

    run_threads([functools.partial(body, i) for i in range(threads)], stop, name="stress")
    races = [str(r) for r in sim.races()[earlier:]] if sim is not None else []
    report["races"] = races[:20]
    report["race_detector"] = sim is not None
    failed = bool(report["corruptions"] or report["overlaps"] or races or report["errors"])
    report["nothing_verified"] = not failed and report["verified_bytes"] == 0
    report["ok"] = not failed and not report["nothing_verified"]
    return report
