"""The native pipeline's long calls beside the time the hypervisor took (Linux guests).

On a virtual machine the host may run another guest's work on a virtual CPU's physical
core; the guest's kernel counts that time as "steal" (``/proc/stat``) and the thread on
that virtual CPU simply stops, with no context switch: a call it was in reads as long,
and on the CPU. This program runs the pipeline (``streampool._native.pipeline``) run by
run, reads the machine's steal counter before and after each, and prints one line per
run: chunks/s, peak reserved and live MiB, the longest call, the calls over the threshold by class (preempted /
slept / on CPU, see ``docs/harness.md``) and the steal ticks during the run; then the
runs with a call over ``--over-us`` split by whether any steal happened during them.

    python3 benchmarks/pipeline_steal.py [--runs 100] [--pairs 8] [--over-us 500]
        [--resource "pool(async, headroom=2, event_batch=8)"]
"""

from __future__ import annotations

import argparse

from streampool import _native
from streampool.harness.specs import make_resource


def steal_ticks() -> int:
    """The machine's steal time so far, in clock ticks (0 where /proc/stat has none)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if fields[0] == "cpu" and len(fields) > 8 else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=3000, help="chunks per pair")
    ap.add_argument("--over-us", type=float, default=500.0, help="the long calls' threshold")
    ap.add_argument("--resource", default="pool(async, headroom=2, event_batch=8)")
    args = ap.parse_args()
    rows = []
    print("run  chunks/s  reserved/live MiB  longest_us  long(preempted/slept/on_cpu)  steal_ticks")
    for i in range(args.runs):
        resource = make_resource(args.resource).resource  # a fresh one per run, as the harness does
        before = steal_ticks()
        r = _native.pipeline(
            resource, pairs=args.pairs, chunks_per_pair=args.chunks, long_call_us=args.over_us
        )
        steal = steal_ticks() - before
        lc = r["long_calls"]
        rows.append((r["longest_call_ns"] / 1e3, lc["calls"], steal))
        print(
            f"{i:3d}  {r['chunks_per_second']:8.0f}  {(r['peak_reserved_bytes'] or 0) >> 20:>8}/{r['peak_live_bytes'] >> 20:<8}"
            f"  {r['longest_call_ns'] / 1e3:10.0f}  "
            f"{lc['calls']} ({lc['preempted']}/{lc['slept']}/{lc['on_cpu']})  {steal}"
        )
        del resource
    long_runs = [row for row in rows if row[1]]
    with_steal = [row for row in rows if row[2]]
    print(
        f"{len(rows)} runs; {len(with_steal)} with steal; {len(long_runs)} with a call over {args.over_us:g} µs, "
        f"{sum(1 for row in long_runs if row[2])} of them with steal"
    )


if __name__ == "__main__":
    main()
