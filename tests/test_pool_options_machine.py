"""A Hypothesis state machine over the sharded pool with every combination of its options,
four upstreams and up to two adaptors above it: streams made and dropped (with frees
pending), frees on the allocating stream and across streams (after an event, a
synchronisation or the device's run), Python threads on their own or per-thread default
streams, buffers collected on other threads, ``release()``, bad frees and requests too
large. After every step: live ranges disjoint, no race on the simulated device, the pool's
figures add up (and the adaptors' are exact), nothing above the maximum, an empty pool
serves any request within it, and ``release()`` with nothing live leaves nothing.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import warnings
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

MiB = 1 << 20
#: Examples per run: small in CI; ``POOL_MACHINE_EXAMPLES=2000`` for a long soak.
EXAMPLES = int(os.environ.get("POOL_MACHINE_EXAMPLES", "100"))


def class_size(n: int) -> int:
    """The size the pool serves a request of ``n`` bytes with (the pool's size classes)."""
    b = max(n, 1)
    b = (b + 255) // 256 * 256
    if b <= 4096 or b >= (64 << 20):
        return b
    k = b.bit_length() - 1
    g = 1 << (k - 4)
    return (b + g - 1) // g * g


def wait(consumer: Any, producer: Any) -> None:
    """consumer waits on an event recorded on producer now (DLPack's hand-off)."""
    b = streampool.DeviceBuffer(size=0, stream=producer, mr=mr.CudaMemoryResource())
    cap = b.__dlpack__(stream=consumer)
    del cap
    b.close()


OPTIONS = st.fixed_dictionaries(
    {
        "expandable": st.booleans(),
        "steal_whole_blocks": st.booleans(),
        "headroom": st.sampled_from([None, 0.0, 0.15, 2.0]),
        "event_batch": st.sampled_from([1, 2, 4]),
        "events_every": st.sampled_from([1, 2, 64]),
        "gather_interval": st.sampled_from([0.0, 1e-4, 3600.0]),
        "release_threshold": st.sampled_from([None, 0, MiB]),
        "maximum_pool_size": st.sampled_from([None, 4 * MiB, 8 * MiB + 256, 5_000_001, 16 * MiB]),
        "initial_pool_size": st.sampled_from([None, 0, 256, MiB, 2 * MiB + 256, 3_000_001]),
    }
)

UPSTREAMS = ["async_default", "async_own", "cuda", "stats_cuda"]
ADAPTORS = st.lists(
    st.sampled_from(["statistics", "tracking", "limiting", "logging", "binning"]), max_size=2, unique=True
)

SIZES = st.one_of(
    st.sampled_from(
        [
            0,
            1,
            255,
            256,
            257,
            4095,
            4097,
            65537,
            MiB - 1,
            MiB + 1,
            2 * MiB,
            3 * MiB + 7,
            4 * MiB,
            5 * MiB,
            8 * MiB,
        ]
    ),
    st.integers(1, 3 * MiB),
)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dev = SimulatedDevice(capacity_bytes="256MiB").__enter__()
        self.streams: list[tuple[str, Any]] = []  # (kind, stream argument)
        self.live: dict[int, tuple[int, Any]] = {}  # ptr -> (size, stream arg)
        self.log: list[str] = []
        self.built = False

    def teardown(self) -> None:
        try:
            if self.built:
                self.dev.run()
                races = self.dev.races()
                assert not races, races[0]
                # Everything freed and dropped while the device lives: a pool dropped with
                # memory live, or after the device, records a drop error.
                for p, (n, s) in sorted(self.live.items()):
                    self.top.deallocate(p, n, s)
                self.live.clear()
                del self.top, self.pool, self.adaptors
                self.streams.clear()
                gc.collect()
        finally:
            self.dev.__exit__(None, None, None)

    @initialize(opts=OPTIONS, upstream=st.sampled_from(UPSTREAMS), adaptors=ADAPTORS)
    def build(self, opts: dict[str, Any], upstream: str, adaptors: list[str]) -> None:
        maximum, initial = opts["maximum_pool_size"], opts["initial_pool_size"]
        if maximum is not None and initial is not None and initial > maximum:
            opts["initial_pool_size"] = None
        if opts["expandable"] and upstream == "stats_cuda":
            upstream = "cuda"
        factories: dict[str, Callable[[], mr.MemoryResource]] = {
            "async_default": lambda: mr.CudaAsyncMemoryResource(),
            "async_own": lambda: mr.CudaAsyncMemoryResource(release_threshold=0),
            "cuda": lambda: mr.CudaMemoryResource(),
            "stats_cuda": lambda: mr.StatisticsResourceAdaptor(mr.CudaMemoryResource()),
        }
        up = factories[upstream]()
        self.opts = opts
        self.pool = mr.PoolMemoryResource(up, **opts)
        maximum = opts["maximum_pool_size"]
        # Sizes are rounded up to 256 bytes, the maximum too (as documented).
        self.max = None if maximum is None else -(-maximum // 256) * 256
        top: Any = self.pool
        self.adaptors: dict[str, Any] = {}
        for a in sorted(adaptors, key=lambda a: a != "binning"):
            if a == "statistics":
                top = mr.StatisticsResourceAdaptor(top)
            elif a == "tracking":
                top = mr.TrackingResourceAdaptor(top)
            elif a == "limiting":
                top = mr.LimitingResourceAdaptor(top, 12 * MiB)
            elif a == "logging":
                top = mr.LoggingResourceAdaptor(top, callback=self.log.append)
            elif a == "binning":
                top = mr.BinningMemoryResource(top, 8, 14)
            self.adaptors[a] = top
        self.top = top
        self.built = True
        self.streams = [
            ("nb", streampool.Stream()),
            ("legacy", streampool.DEFAULT_STREAM),
            ("ptds", streampool.PER_THREAD_DEFAULT_STREAM),
        ]
        self.check_accounting()

    # --- streams ------------------------------------------------------------------
    @rule(kind=st.sampled_from(["nb", "blocking", "legacy", "ptds", "raw"]))
    def new_stream(self, kind: str) -> None:
        if len(self.streams) > 8:
            return
        if kind == "nb":
            s: Any = streampool.Stream()
        elif kind == "blocking":
            s = streampool.Stream(blocking=True)
        elif kind == "legacy":
            s = streampool.DEFAULT_STREAM
        elif kind == "ptds":
            s = streampool.PER_THREAD_DEFAULT_STREAM
        else:
            s = streampool.Stream()
            self.streams.append(("nb", s))  # keeps it alive while its raw handle is used
            s = s.handle
        self.streams.append((kind, s))

    @rule(i=st.integers(0, 100))
    def drop_stream(self, i: int) -> None:
        if not self.streams:
            return
        kind, s = self.streams[i % len(self.streams)]
        # a raw handle must not outlive its stream: drop it with its owner
        if kind == "nb" and any(k == "raw" and r == s.handle for k, r in self.streams):
            return
        if kind == "raw" and any(a is s or a == s for _, a in self.live.values()):
            return
        self.streams.pop(i % len(self.streams))

    def pick(self, i: int) -> Any:
        return self.streams[i % len(self.streams)][1]

    # --- allocation -----------------------------------------------------------------
    @rule(i=st.integers(0, 100), size=SIZES)
    def allocate(self, i: int, size: int) -> None:
        if not self.streams:
            return
        s = self.pick(i)
        before = self.pool.stats
        try:
            ptr = self.top.allocate(size, s)
        except streampool.OutOfMemoryError as e:
            msg = str(e)
            cap = self.max if self.max is not None else 64 * MiB
            if before["used_bytes"] == 0 and "limiting" not in self.adaptors and class_size(size) <= cap:
                raise AssertionError(f"out of memory on an empty pool for {size}: {msg} {self.opts}") from e
            assert f"allocate {size} bytes" in msg or "limit" in msg, msg
            self.check_accounting()
            return
        if size == 0:
            assert ptr == 0
            return
        assert ptr % 256 == 0, hex(ptr)
        for p, (n, _) in self.live.items():
            assert ptr + size <= p or p + n <= ptr, f"overlap {ptr:#x}+{size} with {p:#x}+{n}"
        self.live[ptr] = (size, s)
        self.dev.write(s, ptr, size, label=f"first write {ptr:#x}+{size}")
        if self.max is not None:
            assert self.pool.stats["reserved_bytes"] <= self.max

    @rule(i=st.integers(0, 100), sizes=st.lists(SIZES, min_size=1, max_size=6))
    def allocate_many(self, i: int, sizes: list[int]) -> None:
        for size in sizes:
            self.allocate(i, size)

    def pick_live(self, j: int) -> tuple[int, int, Any]:
        keys = sorted(self.live)
        p = keys[j % len(keys)]
        n, s = self.live[p]
        return p, n, s

    @rule(j=st.integers(0, 1000), write=st.booleans())
    def touch(self, j: int, write: bool) -> None:
        if not self.live or not self.streams:
            return
        p, n, s = self.pick_live(j)
        (self.dev.write if write else self.dev.read)(s, p, n, label=f"touch {p:#x}")

    @rule(j=st.integers(0, 1000))
    def free_same(self, j: int) -> None:
        if not self.live or not self.streams:
            return
        p, n, s = self.pick_live(j)
        self.top.deallocate(p, n, s)
        del self.live[p]

    @rule(
        j=st.integers(0, 1000),
        i=st.integers(0, 100),
        how=st.sampled_from(["event", "sync", "run", "event_use"]),
    )
    def free_cross(self, j: int, i: int, how: str) -> None:
        if not self.live or not self.streams:
            return
        p, n, s = self.pick_live(j)
        t = self.pick(i)
        if how in ("event", "event_use"):
            wait(t, s)
            if how == "event_use":
                self.dev.read(t, p, n, label=f"consumer read {p:#x}")
        elif how == "sync":
            if isinstance(s, int):
                self.dev.run()
            else:
                s.synchronize()
        else:
            self.dev.run()
        self.top.deallocate(p, n, t)
        del self.live[p]

    @rule()
    def free_null(self) -> None:
        self.top.deallocate(0, 0, None)

    # --- device ---------------------------------------------------------------------
    @rule(i=st.integers(0, 100))
    def step(self, i: int) -> None:
        if not self.streams:
            return
        self.dev.step(self.pick(i))

    @rule()
    def step_any(self) -> None:
        self.dev.step_any()

    @rule()
    def run(self) -> None:
        self.dev.run()

    @rule(i=st.integers(0, 100))
    def synchronize(self, i: int) -> None:
        if not self.streams:
            return
        s = self.pick(i)
        if isinstance(s, streampool.Stream):
            s.synchronize()

    # --- pool maintenance -------------------------------------------------------------
    @rule()
    def release(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            released = self.pool.release()
        assert released >= 0
        s = self.pool.stats
        if not self.live and "binning" not in self.adaptors:
            assert s["reserved_bytes"] == 0, (s, self.opts)
        self.check_accounting()

    # --- bad input ----------------------------------------------------------------------
    @rule(j=st.integers(0, 1000), kind=st.sampled_from(["wrong_size", "interior", "outside"]))
    def bad_free(self, j: int, kind: str) -> None:
        if not self.live or not self.streams:
            return
        p, n, s = self.pick_live(j)
        if kind == "wrong_size":
            bad_n = n * 2 + 4096
            args = (p, bad_n)
        elif kind == "interior":
            if n < 512:
                return
            args = (p + 256, 256)
        else:
            args = (0x10, 256)
        before = self.figures()
        try:
            self.top.deallocate(args[0], args[1], s)
        except (streampool.InvalidPointerError, ValueError):
            pass
        else:
            raise AssertionError(f"bad free {kind} {args} accepted (adaptors {list(self.adaptors)})")
        after = self.figures()
        assert before == after, (kind, before, after)

    @rule(size=st.sampled_from([1 << 30, 200 * MiB, (1 << 62)]))
    def too_big(self, size: int) -> None:
        before = self.figures()
        try:
            p = self.top.allocate(size, None)
        except (streampool.OutOfMemoryError, MemoryError, ValueError) as e:
            assert "bytes" in str(e) or str(size) in str(e), str(e)
        else:
            self.top.deallocate(p, size, None)
            return
        # Short of memory, the pool (and a binning resource above it) may give free memory
        # back first; nothing live changes.
        after = self.figures()
        for figures in (before, after):
            del figures["reserved_bytes"], figures["free_bytes"]
            if "binning" in self.adaptors:
                del figures["used_bytes"]
        assert after == before, (before, after)
        self.check_accounting()

    # --- threads ------------------------------------------------------------------------
    @rule(n=st.integers(1, 3), ops=st.integers(1, 30), ptds=st.booleans(), seed=st.integers(0, 1 << 30))
    def threads(self, n: int, ops: int, ptds: bool, seed: int) -> None:
        errors: list[BaseException] = []
        results: list[list[tuple[int, int]]] = []
        lock = threading.Lock()

        def work(t: int) -> None:
            rnd = random.Random(seed + t)
            try:
                s: Any = streampool.PER_THREAD_DEFAULT_STREAM if ptds and t % 2 == 0 else streampool.Stream()
                mine: dict[int, int] = {}
                for _ in range(ops):
                    if mine and rnd.random() < 0.4:
                        p = rnd.choice(sorted(mine))
                        self.top.deallocate(p, mine.pop(p), s)
                    else:
                        size = rnd.choice([1, 300, 5000, 70000, MiB + 3])
                        try:
                            p = self.top.allocate(size, s)
                        except streampool.OutOfMemoryError:
                            continue
                        with lock:
                            for q, m in mine.items():
                                assert p + size <= q or q + m <= p
                            for q, (m, _) in self.live.items():
                                assert p + size <= q or q + m <= p, "overlap with main thread's"
                        mine[p] = size
                        self.dev.write(s, p, size, label=f"thread {t} write {p:#x}")
                if rnd.random() < 0.5:
                    for p in sorted(mine):
                        self.dev.write(s, p, mine[p], label="thread last write")
                        self.top.deallocate(p, mine.pop(p), s)
                    return  # exits with frees pending on its stream
                # hand the rest back: synchronise so main may free them anywhere
                s.synchronize()
                with lock:
                    results.append(list(mine.items()))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads), "deadlock"
        if errors:
            raise errors[0]
        for items in results:
            for p, m in items:
                for q, (k, _) in self.live.items():
                    assert p + m <= q or q + k <= p
                self.live[p] = (m, streampool.DEFAULT_STREAM)

    # --- buffers --------------------------------------------------------------------
    @rule(i=st.integers(0, 100), size=SIZES, where=st.sampled_from(["here", "thread", "close"]))
    def buffer(self, i: int, size: int, where: str) -> None:
        if not self.streams:
            return
        s = self.pick(i)
        try:
            buf = streampool.DeviceBuffer(size=size, stream=s, mr=self.top)
        except streampool.OutOfMemoryError:
            return
        if size:
            p = buf.ptr
            for q, (n, _) in self.live.items():
                assert p + size <= q or q + n <= p, "buffer overlap"
            self.dev.write(s, p, size, label=f"buffer write {p:#x}")
        if where == "here":
            del buf
        elif where == "close":
            buf.close()
        else:
            box = [buf]
            del buf
            th = threading.Thread(target=box.clear)
            th.start()
            th.join()

    # --- invariants -----------------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        s = self.pool.stats
        out: dict[str, Any] = {k: s[k] for k in ("reserved_bytes", "used_bytes", "free_bytes")}
        if "statistics" in self.adaptors:
            c = self.adaptors["statistics"].allocation_counts
            out["stat"] = (c.current_bytes, c.current_count)
        if "tracking" in self.adaptors:
            out["track"] = self.adaptors["tracking"].get_allocated_bytes()
        if "limiting" in self.adaptors:
            out["limit"] = self.adaptors["limiting"].get_allocated_bytes()
        return out

    def check_accounting(self) -> None:
        s = self.pool.stats
        assert s["reserved_bytes"] == s["used_bytes"] + s["free_bytes"], s
        assert s["grown_bytes"] == s["reserved_bytes"] + s["released_bytes"], s
        assert s["free_bytes"] == s["common_free_bytes"] + sum(s["shard_free_bytes"].values()), s
        assert self.pool.pool_size() == s["reserved_bytes"]
        assert s["peak_reserved_bytes"] >= s["reserved_bytes"], s
        if self.max is not None:
            assert s["reserved_bytes"] <= self.max, (s, self.max)
        sizes = [n for n, _ in self.live.values()]
        if "binning" not in self.adaptors:
            assert s["used_bytes"] == sum(class_size(n) for n in sizes), (s["used_bytes"], sizes)
        if "statistics" in self.adaptors:
            c = self.adaptors["statistics"].allocation_counts
            assert c.current_bytes == sum(sizes), (c, sizes)
            assert c.current_count == len(sizes), (c, sizes)
        if "tracking" in self.adaptors:
            t = self.adaptors["tracking"]
            assert t.get_allocated_bytes() == sum(sizes)
            assert len(t.outstanding()) == len(sizes)
        if "limiting" in self.adaptors:
            assert self.adaptors["limiting"].get_allocated_bytes() == sum(
                (n + 255) // 256 * 256 for n in sizes
            )

    @invariant()
    def figures_add_up_and_no_race(self) -> None:
        if not getattr(self, "built", False):
            return
        races = self.dev.races()
        assert not races, races[0]
        self.check_accounting()


@pytest.mark.nosim
def test_the_pool_with_every_option_keeps_the_contract() -> None:
    machine = PoolMachine.TestCase
    machine.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
    )
    machine().runTest()
