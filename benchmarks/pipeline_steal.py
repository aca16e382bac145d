"""The native pipeline's long calls beside the time the hypervisor took (Linux guests).

On a virtual machine the host may run another guest's work on a virtual CPU's physical
core; the guest's kernel counts that time as "steal" (``/proc/stat``) and the thread on
that virtual CPU simply stops, with no context switch: a call it was in reads as long,
and on the CPU. This program runs the pipeline (``streampool._native.pipeline``) run by
run, reads the machine's steal counter before and after each, and prints one line per
run: chunks/s, peak reserved and live MiB, the longest call, the calls over the threshold
by class (preempted / slept / stolen / on CPU, and where the running ones ran: see
``docs/harness.md``) and the steal ticks during the run; then the runs with a call over
``--over-us`` split by whether any steal happened during them. The counter counts in
ticks of 10 ms, so a steal of a millisecond shows only when it crosses a tick; the
``stolen`` class, from each thread's own CPU clock, sees it whole where the guest's kernel
keeps stolen time out of its threads' clocks.

    python3 benchmarks/pipeline_steal.py [--runs 100] [--pairs 8] [--over-us 500]
        [--null-us 0] [--resource "pool(async, headroom=2, event_batch=8)"]

With ``--null-us M``, each thread also times a span that only spins for M µs after each
allocator call (``null_call_us``, the control: see ``docs/harness.md``), and each line
gives those over the threshold too.
"""

from __future__ import annotations

import argparse
from collections import Counter

from streampool import _native
from streampool.harness.specs import make_resource


def steal_ticks() -> int:
    """The machine's steal time so far, in clock ticks (0 where /proc/stat has none)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if fields[0] == "cpu" and len(fields) > 8 else 0


def classes(lc: dict) -> str:
    """A run's long (or null) calls: count (preempted/slept/stolen/on CPU), longest."""
    return (
        f"{lc['calls']} ({lc['preempted']}/{lc['slept']}/{lc['stolen']}/{lc['on_cpu']})"
        f" {lc['longest_ns'] / 1e3:.0f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=3000, help="chunks per pair")
    ap.add_argument("--over-us", type=float, default=500.0, help="the long calls' threshold")
    ap.add_argument(
        "--null-us", type=float, default=0.0, help="a null call of this length after each call (0: none)"
    )
    ap.add_argument("--resource", default="pool(async, headroom=2, event_batch=8)")
    args = ap.parse_args()
    rows = []
    totals: dict[str, Counter[str]] = {"long_calls": Counter(), "null_calls": Counter()}
    print(
        "run  chunks/s  reserved/live MiB  longest_us  calls over (preempted/slept/stolen/on CPU) longest_us"
        "  seen in; running in  [null calls over, the same]  steal_ticks"
    )
    for i in range(args.runs):
        resource = make_resource(args.resource).resource  # a fresh one per run, as the harness does
        before = steal_ticks()
        r = _native.pipeline(
            resource,
            pairs=args.pairs,
            chunks_per_pair=args.chunks,
            long_call_us=args.over_us,
            null_call_us=args.null_us,
        )
        steal = steal_ticks() - before
        lc, null = r["long_calls"], r.get("null_calls")
        rows.append((lc["calls"], null["calls"] if null else 0, steal))
        for key, got in (("long_calls", lc), ("null_calls", null)):
            for k, v in (got or {}).items():
                if isinstance(v, int) and k not in ("over_ns", "longest_ns"):
                    totals[key][k] += v
                elif isinstance(v, dict):
                    totals[key].update({f"{k}.{kk}": vv for kk, vv in v.items()})
        seen = ",".join(f"{k}={n}" for part in ("sampled", "running_in") for k, n in lc[part].items() if n)
        print(
            f"{i:3d}  {r['chunks_per_second']:8.0f}  {(r['peak_reserved_bytes'] or 0) >> 20:>8}/{r['peak_live_bytes'] >> 20:<8}"
            f"  {r['longest_call_ns'] / 1e3:10.0f}  {classes(lc)}  {seen or '-'}"
            f"  [{classes(null) if null else '-'}]  {steal}"
        )
        del resource
    with_steal = [row for row in rows if row[2]]
    for what, col in (("a call", 0), ("a null call", 1)):
        if col == 1 and not args.null_us:
            continue
        hit = [row for row in rows if row[col]]
        print(
            f"{len(rows)} runs; {len(with_steal)} with steal; {len(hit)} with {what} over {args.over_us:g} µs,"
            f" {sum(1 for row in hit if row[2])} of them with steal"
        )
    for key, total in totals.items():
        if total:
            print(f"{key}: " + ", ".join(f"{k} {v}" for k, v in total.items() if v))


if __name__ == "__main__":
    main()
