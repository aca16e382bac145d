"""``stress``: a long randomised run that verifies the data.

Threads allocate random sizes on random streams of their own, fill each allocation with a
pattern of its own by a kernel (:func:`streampool.kernels.fill`), and before freeing it
check the pattern by a kernel (:func:`streampool.kernels.check`): memory that another
allocation overlapped, or that was reused before a kernel finished with it, shows up as
wrong words. Every allocation is also checked against the live ones for overlap; some
frees go to another stream than the allocation's (after the allocation's stream has
finished with it), so that cross-stream reuse is exercised. On the simulated device the
race detector reports any access not ordered after the previous one. Example::

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

from .._native import Stream, parse_size
from ._threads import run_threads
from .specs import Candidate
from .trace import live_intervals_overlap
from .workloads import _kernels

__all__ = ["run"]


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
) -> dict[str, Any]:
    """Stresses ``candidate`` for ``seconds`` with ``threads`` threads of ``streams``
    streams each; returns the report: ok, operations, allocations, verified_bytes,
    corruptions, overlaps, races (each a list of sentences; the first 20 kept), errors.
    ``sim``: the active SimulatedDevice, whose race detector is read at the end. On Ctrl-C
    the threads stop (each frees what it holds) before the KeyboardInterrupt goes on.
    ValueError for a ``max_size`` below 1 byte."""
    kernels = _kernels()
    top = parse_size(max_size)
    if top < 1:
        raise ValueError(f"stress: max_size must be at least 1 byte, not {max_size!r}")
    lock = threading.Lock()
    live: list[tuple[int, int]] = []
    report: dict[str, Any] = {
        "operations": 0,
        "allocations": 0,
        "verified_bytes": 0,
        "corruptions": [],
        "overlaps": [],
        "errors": [],
    }
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
        ops = allocations = verified = 0

        def free_one() -> None:
            nonlocal verified
            ptr, size, pattern, stream = held.pop(rng.randrange(len(held)))
            bad = kernels.check(ptr, size, pattern, stream)  # synchronises the stream
            verified += size
            if bad:
                note(
                    "corruptions",
                    f"{bad} wrong 8-byte word(s) in {size} bytes at {ptr:#x} "
                    f"(allocated by thread {index}, pattern {pattern})",
                )
            other = rng.choice(mine)  # cross-stream free: the check synchronised `stream`
            with lock:
                live.pop(bisect.bisect_left(live, (ptr, size)))
            resource.deallocate(ptr, size, other)

        try:
            while time.monotonic() < deadline and not stop.is_set():
                ops += 1
                if held and (len(held) >= max_live or rng.random() < 0.45):
                    free_one()
                    continue
                size = rng.randint(1, top)
                stream = rng.choice(mine)
                try:
                    ptr = resource.allocate(size, stream)
                except MemoryError:
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
                report["verified_bytes"] += verified

    run_threads([functools.partial(body, i) for i in range(threads)], stop, name="stress")
    races = [str(r) for r in sim.races()] if sim is not None else []
    report["races"] = races[:20]
    report["race_detector"] = sim is not None
    report["ok"] = not (report["corruptions"] or report["overlaps"] or races or report["errors"])
    return report
