"""The window workload at one thread, on a model of one contiguous region: how little
memory each way of choosing a free block needs to serve it.

The window workload (``rust/streampool/benches/window.rs``) keeps 16 live allocations
of log-uniform size in [1 KiB, 4 MiB] per thread, freeing the oldest before each new
one, from 8192 sizes drawn beforehand. This program replays one thread's sizes (the same
generator and seeds as the bench) twice over on a single region of C bytes, with frees
merged with their free neighbours at once, and finds for each fit policy the smallest C
from which every larger C (in 64 KiB steps, up to 1.6 times the peak live bytes) serves
the whole sequence. It measures the policies, not streampool: the pool grows chunk by
chunk from its upstream, and a block never spans two chunks.

Policies: ``best`` (the smallest free block that fits), ``first`` (the lowest address
that fits), ``next`` (the first fit from where the last allocation ended, wrapping), and
``classes`` (like the pool's: sizes rounded to its 16 lists per power of two, and the
most recently freed block of the lowest list that holds one that fits).

With ``--growth``, a model of a pool that grows instead: sizes rounded as the pool rounds
them, and when no free block fits, growth by 2 MiB pages, either as a chunk apart (the
request or an eighth of the peak live bytes, whichever is more; a block never spans two
chunks) or in place (what the free block at the end lacks, as ``expandable=True`` does),
with two fits: the newest block of the first size list that fits (``head``), or the lower
in memory of the heads of the first two lists that fit (``lower``). It prints the peak
grown over the peak live bytes after every two passes over the sizes.

    python3 benchmarks/window_fit.py [--seeds 1,2,3] [--growth [--passes 8]]
"""

from __future__ import annotations

import argparse
import bisect

MASK = (1 << 64) - 1
WINDOW = 16
SIZES = 8192
STEP = 64 << 10


def sizes(seed: int, n: int = SIZES) -> list[int]:
    """The bench's sizes for a thread (xorshift64, log-uniform in [1 KiB, 4 MiB])."""
    x = ((seed * 0x9E37_79B9_7F4A_7C15) & MASK) | 1
    out = []
    for _ in range(n):
        x ^= (x << 13) & MASK
        x ^= x >> 7
        x ^= (x << 17) & MASK
        u = (x >> 11) / (1 << 53)
        out.append(int(1024.0 * 4096.0**u))
    return out


def align(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def class_size(n: int) -> int:
    """The pool's rounding: to 256 bytes up to 4 KiB, then to 16 steps per power of two."""
    b = align(max(n, 1))
    if b <= 4096:
        return b
    return align(b, 1 << (b.bit_length() - 1 - 4))


def list_of(size: int) -> int:
    """The pool's size list of a block of ``size`` bytes (a multiple of 256)."""
    if size < 4096:
        return size // 256 - 1
    k = size.bit_length() - 1
    return (k - 12) * 16 + 15 + ((size >> (k - 4)) & 15)


class Region:
    """Free blocks of one region, by address, merged with their neighbours on free."""

    def __init__(self, capacity: int, policy: str) -> None:
        self.starts: list[int] = []  # free blocks' addresses, sorted
        self.length: dict[int, int] = {}
        self.order: dict[int, int] = {}  # when each free block was last listed (newest wins)
        self.clock = 0
        self.rover = 0
        self.policy = policy
        self._add(0, capacity)

    def _add(self, at: int, n: int) -> None:
        bisect.insort(self.starts, at)
        self.length[at] = n
        self.clock += 1
        self.order[at] = self.clock

    def _remove(self, at: int) -> int:
        self.starts.pop(bisect.bisect_left(self.starts, at))
        self.order.pop(at)
        return self.length.pop(at)

    def _choose(self, n: int) -> int | None:
        fits = [a for a in self.starts if self.length[a] >= n]
        if not fits:
            return None
        if self.policy == "best":
            return min(fits, key=lambda a: (self.length[a], a))
        if self.policy == "first":
            return fits[0]
        if self.policy == "next":
            later = [a for a in fits if a >= self.rover]
            return (later or fits)[0]
        # classes: ``n`` is a list's smallest size, so every block of a list at or above
        # its own fits; the newest block of the lowest such list
        first = min(list_of(self.length[a]) for a in fits)
        return max((a for a in fits if list_of(self.length[a]) == first), key=self.order.__getitem__)

    def allocate(self, n: int) -> int | None:
        at = self._choose(n)
        if at is None:
            return None
        length = self._remove(at)
        if length > n:
            self._add(at + n, length - n)
        self.rover = at + n
        return at

    def free(self, at: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, at)
        if i < len(self.starts) and self.starts[i] == at + n:
            n += self._remove(at + n)
        if i > 0:
            before = self.starts[i - 1]
            if before + self.length[before] == at:
                n += self._remove(before)
                at = before
        self._add(at, n)


def serves(capacity: int, seq: list[int], policy: str, passes: int = 2) -> bool:
    """Whether a region of ``capacity`` bytes serves the window over ``seq``."""
    region = Region(capacity, policy)
    size = class_size if policy == "classes" else align
    ring: list[tuple[int, int]] = []
    for k in range(WINDOW):
        n = size(seq[k])
        at = region.allocate(n)
        if at is None:
            return False
        ring.append((at, n))
    for k in range(WINDOW, WINDOW + passes * len(seq)):
        at, n = ring[k % WINDOW]
        region.free(at, n)
        m = size(seq[k % len(seq)])
        new = region.allocate(m)
        if new is None:
            return False
        ring[k % WINDOW] = (new, m)
    return True


def smallest(seq: list[int], policy: str, peak: int) -> int | None:
    """The smallest capacity from which every larger one (in STEP) serves ``seq``."""
    capacity = align(int(1.6 * peak), STEP)
    if not serves(capacity, seq, policy):
        return None
    while capacity - STEP >= peak and serves(capacity - STEP, seq, policy):
        capacity -= STEP
    return capacity


PAGE = 2 << 20


class GrowingPool:
    """Free blocks of a pool that grows in pages, merged with their neighbours (of one
    chunk) at once; ``in_place`` grows its one range at the end, else chunks apart."""

    def __init__(self, in_place: bool, fit: str) -> None:
        self.starts: list[int] = []
        self.length: dict[int, int] = {}
        self.chunk: dict[int, int] = {}
        self.order: dict[int, int] = {}
        self.clock = 0
        self.in_place, self.fit = in_place, fit
        self.end = 0  # the range's end (in place), or where the next chunk goes
        self.grown = self.peak_grown = self.live = self.peak_live = 0
        self.chunks = 0

    def _add(self, at: int, n: int, chunk: int) -> None:
        bisect.insort(self.starts, at)
        self.length[at], self.chunk[at] = n, chunk
        self.clock += 1
        self.order[at] = self.clock

    def _remove(self, at: int) -> int:
        self.starts.pop(bisect.bisect_left(self.starts, at))
        self.order.pop(at)
        self.chunk.pop(at)
        return self.length.pop(at)

    def _choose(self, n: int) -> int | None:
        by_list: dict[int, list[int]] = {}
        for a in self.starts:
            if list_of(self.length[a]) >= list_of(n):
                by_list.setdefault(list_of(self.length[a]), []).append(a)
        if not by_list:
            return None
        firsts = sorted(by_list)[: 2 if self.fit == "lower" else 1]
        heads = [max(by_list[k], key=self.order.__getitem__) for k in firsts]
        return min(heads)

    def _grow(self, n: int) -> None:
        if self.in_place:
            tail = next((a for a in self.starts if a + self.length[a] == self.end), None)
            have = self._remove(tail) if tail is not None else 0
            step = align(n - have, PAGE)
            self._add(self.end - have, have + step, 0)
        else:
            step = align(max(n, self.peak_live // 8), PAGE)
            self.chunks += 1
            self._add(self.end, step, self.chunks)
        self.end += step if self.in_place else step + (1 << 40)
        self.grown += step
        self.peak_grown = max(self.peak_grown, self.grown)

    def allocate(self, n: int, asked: int) -> tuple[int, int]:
        """The address and chunk of a block of ``n`` bytes (``asked`` of them live)."""
        at = self._choose(n)
        if at is None:
            self._grow(n)
            at = self._choose(n)
            assert at is not None
        chunk, length = self.chunk[at], self._remove(at)
        if length > n:
            self._add(at + n, length - n, chunk)
        self.live += asked
        self.peak_live = max(self.peak_live, self.live)
        return at, chunk

    def free(self, at: int, n: int, chunk: int, asked: int) -> None:
        self.live -= asked
        i = bisect.bisect_left(self.starts, at)
        if i < len(self.starts) and self.starts[i] == at + n and self.chunk[at + n] == chunk:
            n += self._remove(at + n)
        if i > 0:
            before = self.starts[i - 1]
            if before + self.length[before] == at and self.chunk[before] == chunk:
                n += self._remove(before)
                at = before
        self._add(at, n, chunk)


def growth(seed: int, in_place: bool, fit: str, passes: int) -> list[float]:
    """Peak grown over peak live bytes after every two passes over seed's sizes."""
    seq = sizes(seed)
    pool = GrowingPool(in_place, fit)
    ring: list[tuple[int, int, int, int]] = []
    out = []
    for k in range(WINDOW + passes * len(seq)):
        if len(ring) == WINDOW:
            pool.free(*ring.pop(0))
        asked = seq[k % len(seq)]
        n = class_size(asked)
        at, chunk = pool.allocate(n, asked)
        ring.append((at, n, chunk, asked))
        if k >= WINDOW and (k - WINDOW + 1) % (2 * len(seq)) == 0:
            out.append(round(pool.peak_grown / pool.peak_live, 2))
    return out


def main_growth(seeds: list[int], passes: int) -> None:
    print(
        "seed  "
        + "  ".join(f"{name:>24}" for name in ("chunks apart, head", "in place, head", "in place, lower"))
    )
    for seed in seeds:
        cells = [
            " ".join(f"{r:.2f}" for r in growth(seed, in_place, fit, passes))
            for in_place, fit in ((False, "head"), (True, "head"), (True, "lower"))
        ]
        print(f"{seed:>4}  " + "  ".join(f"{c:>24}" for c in cells))
    print("(peak grown / peak live bytes after every two passes over the sizes; a model, not the pool)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3", help="the bench's thread seeds (thread t uses t+1)")
    ap.add_argument(
        "--growth", action="store_true", help="model a pool that grows (chunks apart or in place)"
    )
    ap.add_argument("--passes", type=int, default=8, help="with --growth: passes over the sizes")
    args = ap.parse_args()
    if args.growth:
        main_growth([int(s) for s in args.seeds.split(",")], args.passes)
        return
    print("seed  peak live   " + "  ".join(f"{p:>14}" for p in ("best", "first", "next", "classes")))
    for seed in (int(s) for s in args.seeds.split(",")):
        seq = sizes(seed)
        # The live bytes as the bench counts them: the sizes asked for.
        peak = max(sum(seq[(i + j) % SIZES] for j in range(WINDOW)) for i in range(SIZES))
        cells = []
        for policy in ("best", "first", "next", "classes"):
            c = smallest(seq, policy, peak)
            cells.append(f"{c / 2**20:6.2f} ({c / peak:.2f})" if c else "      > 1.60")
        print(f"{seed:>4}  {peak / 2**20:6.2f} MiB  " + "  ".join(f"{c:>14}" for c in cells))
    print("(MiB, and times the peak live bytes; a model of one region, not the pool)")


if __name__ == "__main__":
    main()
