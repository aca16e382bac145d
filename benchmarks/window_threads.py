"""The window workload on many threads, on a model of one growing range of memory: how
much memory each way of sharing free memory between threads needs, as a floor for the
pool's figures at 4 and 16 threads.

Each thread replays the window bench's sizes (``window_fit.py``: 16 live allocations of
log-uniform size in [1 KiB, 4 MiB], the oldest freed before each new one), the threads'
operations interleaved at random (seeded). Sizes are rounded as the pool rounds them; the
range grows at its end by what the free block there lacks, in 2 MiB pages, as
``expandable=True`` does; a fit takes the lowest-addressed free block that is large
enough. Every free is known complete at once (no events, no waits): the model gives the
pool every advantage but the one it cannot have, a single heap. Policies:

- ``shared``: one heap for every thread; every free merges with its free neighbours at
  once. What one list behind one lock would hold (and every operation takes that lock).
- ``gather``: each thread keeps what it frees (merged with its own free neighbours); a
  thread that finds no fit takes the common heap whole when a block there fits (as the
  pool imports its common list), and when none does, every thread's free memory is moved
  to the common heap (merging there) before it looks again, and grows: the pool's
  gathering, at every miss.
- ``steal``: as ``gather``, but a thread that finds no fit in the common heap first takes
  a whole free block from another thread (``steal_whole_blocks=True``), and gathers only
  when none fits.

It prints, per policy, the peak grown over the peak live bytes, and the share of
operations that touched memory other than the thread's own (the common heap, another
thread's, a gathering), the operations a pool must make under a shared lock. It also
prints the threads' own peaks of live bytes summed, over the peak live bytes: a pool
that kept each thread's memory to itself would hold at least that.

``--budgets K,...`` prints, instead, a floor with no fragmentation at all: each thread
holds a budget of bytes, set every K of its operations to the most it will have live
before the next setting (known in advance), the threads in lockstep. What the budgets
sum to at their peak, over the peak live bytes, is the least that any pool holds whose
threads exchange memory only every K operations, however well it fits blocks; its
fragmentation comes on top.

    python3 benchmarks/window_threads.py [--threads 4,16] [--passes 1] [--seed 0]
    python3 benchmarks/window_threads.py --budgets 1,2,4,8,16,64 [--threads 4,16]
"""

from __future__ import annotations

import argparse
import bisect
import random

from window_fit import PAGE, WINDOW, align, class_size, sizes

COMMON = -1


class Range:
    """Free blocks of one growing range, each owned by a thread or the common heap; a free
    block merges with adjacent free blocks of the same owner."""

    def __init__(self, threads: int, policy: str) -> None:
        self.policy = policy
        self.length: dict[int, int] = {}  # free block start -> length
        self.owner: dict[int, int] = {}
        self.before: dict[int, int] = {}  # free block end -> start
        self.starts: dict[int, list[int]] = {o: [] for o in [*range(threads), COMMON]}
        self.end = self.grown = 0
        self.shared_ops = 0

    def _add(self, at: int, n: int, owner: int) -> None:
        if self.owner.get(at + n) == owner:
            n += self._remove(at + n)
        prev = self.before.get(at)
        if prev is not None and self.owner[prev] == owner:
            n += self._remove(prev)
            at = prev
        self.length[at], self.owner[at], self.before[at + n] = n, owner, at
        bisect.insort(self.starts[owner], at)

    def _remove(self, at: int) -> int:
        n, owner = self.length.pop(at), self.owner.pop(at)
        del self.before[at + n]
        s = self.starts[owner]
        s.pop(bisect.bisect_left(s, at))
        return n

    def _fit(self, owner: int, n: int) -> int | None:
        return next((a for a in self.starts[owner] if self.length[a] >= n), None)

    def _take(self, at: int, n: int, rest_to: int) -> int:
        length = self._remove(at)
        if length > n:
            self._add(at + n, length - n, rest_to)
        return at

    def _gather(self) -> None:
        for owner, starts in self.starts.items():
            if owner != COMMON:
                for at in list(starts):
                    self._add(at, self._remove(at), COMMON)

    def _grow(self, n: int) -> None:
        tail = self.before.get(self.end)
        have = self._remove(tail) if tail is not None and self.owner[tail] == COMMON else 0
        step = align(n - have, PAGE)
        self._add(self.end - have, have + step, COMMON)
        self.end += step
        self.grown += step

    def allocate(self, t: int, n: int) -> int:
        if self.policy == "shared":
            self.shared_ops += 1
            at = self._fit(COMMON, n)
            if at is None:
                self._grow(n)
                at = self._fit(COMMON, n)
            return self._take(at, n, COMMON)
        at = self._fit(t, n)
        if at is None:
            self.shared_ops += 1
            at = self._from_common(t, n)
        if at is None and self.policy == "steal":
            for other in self.starts:
                if other not in (t, COMMON) and (block := self._fit(other, n)) is not None:
                    return self._take(block, n, t)
        if at is None:
            self._gather()
            at = self._from_common(t, n)
        if at is None:
            self._grow(n)
            at = self._from_common(t, n)
        assert at is not None, "growth always fits"
        return self._take(at, n, t)

    def _from_common(self, t: int, n: int) -> int | None:
        """Where a block of ``n`` bytes lies once the common heap, if one of its blocks
        fits, has moved whole to thread ``t`` (as the pool's import does)."""
        if self._fit(COMMON, n) is None:
            return None
        for at in list(self.starts[COMMON]):
            self._add(at, self._remove(at), t)
        return self._fit(t, n)

    def free(self, t: int, at: int, n: int) -> None:
        self.shared_ops += self.policy == "shared"
        self._add(at, n, COMMON if self.policy == "shared" else t)


def run(threads: int, policy: str, passes: int, seed: int) -> tuple[float, float, float]:
    rng = random.Random(seed)
    memory = Range(threads, policy)
    seqs = [sizes(t + 1) for t in range(threads)]
    rings: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    done = [0] * threads
    own_live, own_peak = [0] * threads, [0] * threads
    live = peak = ops = 0
    total = passes * len(seqs[0])
    running = list(range(threads))
    while running:
        t = rng.choice(running)
        ring = rings[t]
        if len(ring) == WINDOW:
            at, n, asked = ring.pop(0)
            memory.free(t, at, n)
            live -= asked
            own_live[t] -= asked
            ops += 1
        asked = seqs[t][done[t] % len(seqs[t])]
        n = class_size(asked)
        ring.append((memory.allocate(t, n), n, asked))
        live += asked
        own_live[t] += asked
        peak, own_peak[t] = max(peak, live), max(own_peak[t], own_live[t])
        ops += 1
        done[t] += 1
        if done[t] == total:
            running.remove(t)
    return memory.grown / peak, memory.shared_ops / ops, sum(own_peak) / peak


def budgets(threads: int, passes: int, every: int) -> float:
    """The budgets' peak sum over the peak live bytes (``--budgets``)."""
    lives = []
    for t in range(threads):
        seq, ring, live, out = sizes(t + 1), [], 0, []
        for i in range(passes * len(seq)):
            if len(ring) == WINDOW:
                live -= ring.pop(0)
            ring.append(seq[i % len(seq)])
            live += ring[-1]
            out.append(live)
        lives.append(out)
    steps = len(lives[0])
    peak = max(sum(step) for step in zip(*lives))
    held = [0] * steps
    for out in lives:
        for start in range(0, steps, every):
            most = max(out[start : start + every])
            for i in range(start, min(start + every, steps)):
                held[i] += most
    return max(held) / peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="4,16", help="thread counts (thread t uses seed t+1)")
    ap.add_argument("--passes", type=int, default=1, help="passes over each thread's 8,192 sizes")
    ap.add_argument("--seed", type=int, default=0, help="the interleaving's seed")
    ap.add_argument("--budgets", help="print the floor with no fragmentation, budgets set every K operations")
    args = ap.parse_args()
    if args.budgets:
        every = [int(k) for k in args.budgets.split(",")]
        print("threads  " + "  ".join(f"K={k:<5}" for k in every))
        for threads in (int(t) for t in args.threads.split(",")):
            row = "  ".join(f"{budgets(threads, args.passes, k):<7.3f}" for k in every)
            print(f"{threads:>7}  {row}", flush=True)
        print("(budgets over peak live bytes; no fragmentation, the threads in lockstep)")
        return
    print("threads  policy   grown/live  shared ops  threads' own peaks/live")
    for threads in (int(t) for t in args.threads.split(",")):
        for policy in ("shared", "gather", "steal"):
            grown, shared, own = run(threads, policy, args.passes, args.seed)
            print(f"{threads:>7}  {policy:<7}  {grown:>10.2f}  {shared:>10.1%}  {own:>23.2f}", flush=True)
    print("(a model of one range with every free known complete at once, not the pool)")


if __name__ == "__main__":
    main()
