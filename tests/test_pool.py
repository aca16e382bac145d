"""The sharded pool from Python: RMM's name and arguments, its statistics, bad input, and
threads (no deadlock with Python callbacks in the stack)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice


def run_threads(work: Callable[[int], None], n: int, errors: list[BaseException]) -> None:
    """Runs `work(0..n)` on n threads; fails if one is stuck (a deadlock) or raised."""
    threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a thread is stuck (deadlock?)"
    assert not errors, errors[0]


def test_rmm_name_and_arguments() -> None:
    pool = mr.PoolMemoryResource(
        mr.CudaAsyncMemoryResource(), initial_pool_size="4MiB", maximum_pool_size="1GiB"
    )
    assert isinstance(pool, mr.ShardedPoolMemoryResource)
    assert pool.pool_size() == 4 << 20
    assert isinstance(pool.upstream, mr.CudaAsyncMemoryResource)
    assert "PoolMemoryResource" in repr(pool)


def test_nothing_is_reserved_up_front() -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    assert pool.pool_size() == 0
    buf = streampool.DeviceBuffer(size=1000, mr=pool)
    assert pool.pool_size() >= 1024
    del buf


def test_stats_and_release(sim: SimulatedDevice) -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), events_every=1)
    a, b = streampool.Stream(), streampool.Stream()
    p = pool.allocate(1 << 20, a)
    sim.write(a, p, 1 << 20)
    pool.deallocate(p, 1 << 20, a)
    sim.run()
    q = pool.allocate(1 << 20, b)  # a's free completed: taken without a wait
    s = pool.stats
    assert s["completed_steals"] == 1 and s["cross_stream_waits"] == 0
    assert s["reserved_bytes"] == s["used_bytes"] + s["free_bytes"]
    pool.deallocate(q, 1 << 20, b)
    sim.run()
    with pytest.warns(UserWarning, match="default pool"):  # over the device's default pool
        assert pool.release() >= 1 << 20
    s = pool.stats
    assert s["grown_bytes"] == s["reserved_bytes"] + s["released_bytes"]
    assert s["reserved_bytes"] == 0


def test_a_synchronised_stream_hands_its_frees_over_without_events(sim: SimulatedDevice) -> None:
    """`Stream.synchronize()` completes the frees made on the stream before it: another
    stream takes those blocks with no event recorded or queried; a block freed after it is
    handed out only ordered (here: a wait, at the pool's maximum)."""
    pool = mr.ShardedPoolMemoryResource(
        mr.CudaAsyncMemoryResource(), events_every=4096, maximum_pool_size="8MiB"
    )
    producer, consumer = streampool.Stream(), streampool.Stream()
    mib2 = 2 << 20
    xs = [pool.allocate(mib2, producer) for _ in range(4)]
    producer.synchronize()  # the allocations are complete: the consumer may use them
    for i, x in enumerate(xs[:3]):
        if i == 2:
            consumer.synchronize()
        sim.write(consumer, x, 256)  # the consumer's work on it, pending on the device
        pool.deallocate(x, mib2, consumer)
    before = pool.stats
    got = sorted(pool.allocate(mib2, producer) for _ in range(2))
    after = pool.stats
    assert got == sorted(xs[:2])
    for key in ("events_recorded", "event_queries", "cross_stream_waits", "synchronizations"):
        assert after[key] == before[key], key
    late = pool.allocate(mib2, producer)  # freed after the synchronisation: ordered first
    assert late == xs[2]
    s = pool.stats
    assert (
        s["cross_stream_waits"] + s["synchronizations"]
        > before["cross_stream_waits"] + before["synchronizations"]
    )
    sim.write(producer, late, 256)
    for x in [*got, late, xs[3]]:
        pool.deallocate(x, mib2, producer)
    sim.run()


def test_the_fast_path_takes_completed_blocks_from_any_other_stream(sim: SimulatedDevice) -> None:
    """An allocation that finds completed blocks in another stream's shard is settled
    without giving the GIL back (the binding's fast path), whichever consumer freed them,
    not only in the shard the stream last took from."""
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), events_every=1)
    producer = streampool.Stream()
    consumers = [streampool.Stream() for _ in range(3)]
    mib = 1 << 20
    xs = [pool.allocate(mib, producer) for _ in range(4)]  # two chunks, used up
    producer.synchronize()
    pool.deallocate(xs[0], mib, consumers[0])
    sim.run()
    first = pool.allocate(mib, producer)  # from the first consumer's shard
    assert first == xs[0]
    for x, consumer in zip(xs[1:3], consumers[1:]):
        sim.write(consumer, x, 256)
        pool.deallocate(x, mib, consumer)
    sim.run()
    before, fast = pool.stats, streampool._native._fast_path_calls()
    got = [pool.allocate(mib, producer) for _ in range(2)]
    assert streampool._native._fast_path_calls() - fast == 2
    assert sorted(got) == sorted(xs[1:3])
    after = pool.stats
    assert after["upstream_growths"] == before["upstream_growths"]
    assert after["completed_steals"] == before["completed_steals"] + 2
    for x in [first, *got, xs[3]]:
        pool.deallocate(x, mib, producer)
    sim.run()
    assert pool.stats["used_bytes"] == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"initial_pool_size": "2MiB", "maximum_pool_size": "1MiB"}, "maximum_pool_size"),
        ({"initial_pool_size": -1}, "initial_pool_size"),
        ({"maximum_pool_size": "lots"}, "lots"),
        ({"events_every": 0}, "events_every"),
        ({"event_batch": 0}, "event_batch"),
        ({"event_batch": -1}, "event_batch"),
        ({"headroom": -0.5}, "headroom"),
        ({"headroom": float("nan")}, "headroom"),
        ({"gather_interval": -1e-3}, "gather_interval"),
        ({"gather_interval": float("inf")}, "gather_interval"),
        ({"gather_interval": 1e20}, "gather_interval"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises((ValueError, OverflowError), match=match):
        mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        mr.ShardedPoolMemoryResource("not a resource")  # type: ignore[arg-type]


def test_expandable_grows_in_place_and_gives_everything_back() -> None:
    mib = 1 << 20
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), expandable=True)
    s = streampool.Stream()
    x = pool.allocate(mib, s)
    # The 1 MiB left at the end of the first mapping and a new one serve 3 MiB together.
    y = pool.allocate(3 * mib, s)
    assert y == x + mib
    assert pool.stats["reserved_bytes"] == 4 * mib
    pool.deallocate(x, mib, s)
    pool.deallocate(y, 3 * mib, s)
    assert pool.release() == 4 * mib
    assert pool.pool_size() == 0


@pytest.mark.parametrize("expandable", [False, True])
def test_a_maximum_off_the_mapping_granularity_is_reached(expandable: bool) -> None:
    # Growth in place maps 2 MiB at a time; below or between those, the upstream serves.
    mib = 1 << 20
    for maximum, initial in ((mib, mib), (3 * mib, None)):
        pool = mr.ShardedPoolMemoryResource(
            mr.CudaMemoryResource(),
            maximum_pool_size=maximum,
            initial_pool_size=initial,
            expandable=expandable,
        )
        p = pool.allocate(maximum)
        with pytest.raises(streampool.OutOfMemoryError, match=f"maximum_pool_size {maximum} reached"):
            pool.allocate(256)
        pool.deallocate(p, maximum)
        pool.deallocate(pool.allocate(256), 256)
    # A request whose size class passes the maximum says so.
    pool = mr.ShardedPoolMemoryResource(mr.CudaMemoryResource(), maximum_pool_size=5 * mib + 256)
    with pytest.raises(streampool.OutOfMemoryError, match="rounded up to one of 16 sizes") as e:
        pool.allocate(5 * mib + 256)
    # What could still be had: the room under the maximum (nothing is reserved yet).
    assert (e.value.requested, e.value.available) == (5 * mib + 256, 5 * mib + 256)
    small = mr.ShardedPoolMemoryResource(mr.CudaMemoryResource(), maximum_pool_size=mib)
    with pytest.raises(streampool.OutOfMemoryError, match=f"maximum_pool_size {mib}") as e:
        small.allocate(3 * mib)
    assert e.value.available == mib


@pytest.mark.parametrize("whole", [False, True])
def test_steal_whole_blocks_moves_the_rest_to_the_taking_stream(whole: bool) -> None:
    mib = 1 << 20
    pool = mr.ShardedPoolMemoryResource(
        mr.CudaAsyncMemoryResource(), events_every=1, steal_whole_blocks=whole
    )
    a, c = streampool.Stream(), streampool.Stream()
    # One 4 MiB chunk: x, and a block stream a keeps live.
    x, kept = pool.allocate(3 * mib, a), pool.allocate(mib, a)
    pool.deallocate(x, 3 * mib, a)
    a.synchronize()
    y = pool.allocate(mib, c)  # taken from a's shard, not grown
    assert (pool.stats["completed_steals"], pool.stats["upstream_growths"]) == (1, 1), pool.stats
    # With the whole block, the rest is c's own: its next request takes nothing from a.
    z = pool.allocate(mib, c)
    assert pool.stats["completed_steals"] == (1 if whole else 2), pool.stats
    for p, n, s in ((z, mib, c), (y, mib, c), (kept, mib, a)):
        pool.deallocate(p, n, s)
    with pytest.warns(UserWarning, match="trim_to"):  # the device's pool keeps what it gets
        assert pool.release() == 4 * mib


@pytest.mark.parametrize("expandable", [False, True])
def test_one_heap_orders_reuse_across_streams_by_the_free_s_event(expandable: bool) -> None:
    mib = 1 << 20
    pool = mr.ShardedPoolMemoryResource(mr.CudaMemoryResource(), one_heap=True, expandable=expandable)
    a, c = streampool.Stream(), streampool.Stream()
    payload = bytes(range(256)) * 4096
    # Written on a, freed on a while the write may still run (the simulated device runs
    # work only at synchronisations): c gets the same memory, after a wait on a's free.
    src = streampool.DeviceBuffer.to_device(payload, stream=a, mr=pool)
    first = src.ptr
    del src
    dst = streampool.DeviceBuffer(size=mib, stream=c, mr=pool)
    assert dst.ptr == first, "one heap: the memory a freed is c's at once"
    assert pool.stats["cross_stream_waits"] == 1, pool.stats
    dst.copy_from_device(streampool.DeviceBuffer.to_device(payload, stream=c, mr=pool))
    assert dst.tobytes() == payload
    assert pool.stats["upstream_growths"] in (1, 2), pool.stats  # the copy's source, perhaps
    del dst
    c.synchronize()
    stats = pool.stats
    assert (stats["used_bytes"], stats["shard_free_bytes"]) == (0, {}), stats  # no shards
    pool.release()
    assert (pool.stats["reserved_bytes"], pool.stats["free_bytes"]) == (0, 0), pool.stats


@pytest.mark.parametrize("other", [{"release_threshold": "1MiB"}, {"steal_whole_blocks": True}])
def test_one_heap_refuses_the_options_of_shards(other: dict[str, object]) -> None:
    up = mr.CudaMemoryResource()
    with pytest.raises(ValueError, match="one_heap takes neither release_threshold nor steal_whole_blocks"):
        mr.ShardedPoolMemoryResource(up, one_heap=True, **other)  # type: ignore[arg-type]
    up.deallocate(up.allocate(256), 256)  # still usable


@pytest.mark.parametrize(
    "upstream",
    [
        lambda: mr.ManagedMemoryResource(),
        lambda: mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource()),
    ],
)
def test_expandable_needs_device_memory_underneath(upstream: Callable[[], mr.MemoryResource]) -> None:
    up = upstream()
    with pytest.raises(ValueError, match="expandable"):
        mr.ShardedPoolMemoryResource(up, expandable=True)
    up.deallocate(up.allocate(256), 256)  # still usable


@pytest.mark.parametrize("gather_interval", [0.0, 3600.0])
def test_gather_interval_trades_synchronisations_for_memory(gather_interval: float) -> None:
    # Each round a new stream takes a 4 MiB block at the budget, while the last round's is
    # not known complete and no event covers it (freed after the event the pool asked for).
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), gather_interval=gather_interval)
    # Raw handles (borrowed streams): the pool cannot see their end, so it records no event
    # on them outside their calls; on streams it owns it would cover the last free with an
    # event and a wait instead of gathering.
    rounds, owned = 6, [streampool.Stream() for _ in range(6)]
    for s in (o.handle for o in owned):
        p, q = pool.allocate(4 << 20, s), pool.allocate(256, s)
        pool.deallocate(q, 256, s)
        pool.deallocate(p, 4 << 20, s)
    stats = pool.stats
    if gather_interval == 0:  # a gathering every round, one block reused
        assert stats["synchronizations"] >= rounds - 1 and stats["peak_reserved_bytes"] == 6 << 20, stats
    else:  # growth past the budget between gatherings, up to 4 times the budget (4 MiB + 2 MiB)
        assert 1 <= stats["synchronizations"] < rounds - 1, stats
        assert 6 << 20 < stats["peak_reserved_bytes"] <= 4 * ((6 << 20) + 256), stats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the device's default pool keeps is not the point here
        pool.release()


def test_release_says_what_the_devices_default_pool_still_holds() -> None:
    upstream = mr.CudaAsyncMemoryResource()  # the device's default pool: it keeps what it gets
    pool = mr.ShardedPoolMemoryResource(upstream)
    s = streampool.Stream()
    pool.deallocate(pool.allocate(3 << 20, s), 3 << 20, s)
    with pytest.warns(UserWarning, match=r"trim_to\(0\)"):
        assert pool.release() >= 3 << 20
    assert pool.stats["reserved_bytes"] == 0
    upstream.trim_to(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pool.release() == 0  # nothing held anywhere: nothing to say
    # A pool of its own (not the device's default pool): nothing to warn about.
    own = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(initial_pool_size="2MiB"))
    own.deallocate(own.allocate(1 << 20, s), 1 << 20, s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own.release()


def test_release_warns_of_the_free_memory_alone() -> None:
    # What trim_to(0) can hand back: the default pool's free memory, not the pool's live chunk.
    upstream = mr.CudaAsyncMemoryResource()
    pool = mr.ShardedPoolMemoryResource(upstream)
    live = pool.allocate(64 << 20)
    pool.deallocate(pool.allocate(1 << 20), 1 << 20)
    with pytest.warns(UserWarning, match=r"trim_to\(0\)") as caught:
        pool.release()
    said = int(str(caught[0].message).split("keeps ")[1].split(" bytes free")[0])
    before = upstream.reserved_bytes
    upstream.trim_to(0)
    assert said == before - upstream.reserved_bytes > 0
    pool.deallocate(live, 64 << 20)


@pytest.mark.parametrize("argument", ["initial_pool_size", "maximum_pool_size", "release_threshold"])
def test_a_size_that_does_not_parse_names_its_argument(argument: str) -> None:
    with pytest.raises(ValueError, match=rf"{argument}: cannot parse '?\"?1GiBB"):
        mr.PoolMemoryResource(mr.CudaMemoryResource(), **{argument: "1GiBB"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"arena_size: cannot parse"):
        mr.ArenaMemoryResource(mr.CudaMemoryResource(), arena_size="1GiBB")


@pytest.mark.parametrize("argument", ["headroom", "gather_interval"])
def test_a_flag_in_place_of_a_number_is_refused(argument: str) -> None:
    with pytest.raises(TypeError, match=rf"{argument} must be a number, not a bool"):
        mr.PoolMemoryResource(mr.CudaMemoryResource(), **{argument: True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"{argument} must be a number, not str"):
        mr.PoolMemoryResource(mr.CudaMemoryResource(), **{argument: "1"})  # type: ignore[arg-type]
    mr.PoolMemoryResource(mr.CudaMemoryResource(), **{argument: 1})  # an int is a number


def test_sizes_are_rounded_up_the_maximum_too() -> None:
    # Equal sizes stay equal, and a maximum holds an allocation of its own size.
    p = mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=1000, maximum_pool_size=1000)
    p.deallocate(p.allocate(1000), 1000)
    p = mr.PoolMemoryResource(mr.CudaMemoryResource(), maximum_pool_size=1000)
    p.deallocate(p.allocate(1000), 1000)


def test_the_arenas_out_of_memory_names_its_size() -> None:
    arena = mr.ArenaMemoryResource(mr.CudaMemoryResource(), arena_size="1MiB")
    with pytest.raises(MemoryError) as caught:
        arena.allocate((1 << 20) + 1)
    assert "arena_size" in str(caught.value) and "maximum_pool_size" not in str(caught.value), caught.value


def test_bad_frees_leave_the_pool_usable() -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    p = pool.allocate(4096)
    with pytest.raises(streampool.InvalidPointerError):
        pool.deallocate(p + (64 << 20), 4096)
    pool.deallocate(p, 4096)
    with pytest.raises(streampool.InvalidPointerError, match="double free"):
        pool.deallocate(p, 4096)
    assert pool.allocate(4096) == p
    with pytest.raises(streampool.InvalidPointerError, match="allocated with 4096 bytes"):
        pool.deallocate(p, 8192)  # not the allocation's size: refused in every build
    pool.deallocate(p, 4096)
    s = pool.stats
    assert s["reserved_bytes"] == s["used_bytes"] + s["free_bytes"] and s["used_bytes"] == 0


def test_eight_threads_several_streams(sim: SimulatedDevice) -> None:
    pool = mr.ShardedPoolMemoryResource(
        mr.CudaAsyncMemoryResource(), maximum_pool_size="64MiB", events_every=8
    )
    streams = [streampool.Stream() for _ in range(4)]
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            s = streams[t % 4] if t < 7 else streampool.PER_THREAD_DEFAULT_STREAM
            live = []
            for i in range(400):
                n = 1024 << ((t + i) % 8)
                p = pool.allocate(n, s)
                sim.write(s, p, n)
                live.append((p, n))
                if len(live) > 8:
                    q, m = live.pop(0)
                    pool.deallocate(q, m, s)
            for q, m in live:
                pool.deallocate(q, m, s)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    run_threads(work, 8, errors)
    sim.run()
    s = pool.stats
    assert s["used_bytes"] == 0 and s["reserved_bytes"] == s["free_bytes"]


def test_threads_on_the_fast_path_hand_the_gil_over() -> None:
    """Far more fast-path calls than the binding makes between two hand-overs of the GIL
    (1024), from threads that hand it to one another: every call completes, no two live
    allocations overlap, and the pool ends empty."""
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    live: dict[int, int] = {}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            s = streampool.Stream()
            for i in range(3000):
                n = 256 << (i % 4)
                p = pool.allocate(n, s)
                for q, m in list(live.items()):  # a snapshot: other threads change `live`
                    assert p + n <= q or q + m <= p, f"{p:#x}+{n} overlaps {q:#x}+{m}"
                live[p] = n
                buf = streampool.DeviceBuffer(size=n, stream=s, mr=pool)
                assert buf.ptr not in live
                del buf
                del live[p]
                pool.deallocate(p, n, s)
            s.synchronize()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    run_threads(work, 4, errors)
    assert pool.stats["used_bytes"] == 0


def test_no_deadlock_with_python_callbacks_in_the_stack() -> None:
    """design.md: no lock is held across a call into Python. 8 threads allocate through a
    logging sink and a failure callback that frees memory into the same pool and retries."""
    lines: list[str] = []
    spare: list[tuple[int, int]] = []
    lock = threading.Lock()
    holder: dict[str, mr.MemoryResource] = {}

    def on_oom(nbytes: int) -> bool:
        with lock:
            victims = list(spare)
            spare.clear()
        for p, n in victims:
            holder["pool"].deallocate(p, n)
        return bool(victims)

    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), maximum_pool_size="32MiB")
    holder["pool"] = pool
    stack = mr.LoggingResourceAdaptor(mr.FailureCallbackResourceAdaptor(pool, on_oom), callback=lines.append)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(200):
                n = (1 + (t + i) % 4) << 20
                try:
                    p = stack.allocate(n)
                except streampool.OutOfMemoryError:
                    continue
                if i % 3 == 0:
                    with lock:
                        spare.append((p, n))  # freed later by the failure callback
                else:
                    stack.deallocate(p, n)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    run_threads(work, 8, errors)
    for p, n in spare:
        pool.deallocate(p, n)
    assert len(lines) > 100


def test_a_stream_per_task_passed_as_a_handle_leaves_no_shard_per_task() -> None:
    """Another library's streams (here: handles as ints) end unseen by the pool: their
    shards leave once they hold nothing and no thread holds them, so a stream per task
    keeps the shards, and each new stream's first allocation, bounded."""
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    most = 0
    for _ in range(2000):
        s = streampool.Stream()
        ptr = pool.allocate(4096, s.handle)
        pool.deallocate(ptr, 4096, s.handle)
        s.synchronize()
        most = max(most, len(pool.stats["shard_free_bytes"]))
    assert most < 700, most
    stats = pool.stats
    assert stats["reserved_bytes"] == stats["used_bytes"] + stats["free_bytes"]
