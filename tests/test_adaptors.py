"""The adaptors of ``streampool.mr``: what each adds, bad input, threads, and Python
callbacks (failure callbacks, logging sinks, stack capture) that run inside allocate and
free. The conformance suite (test_conformance.py) runs over every adaptor as well."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import pickle
import random
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice
from streampool.statistics import Statistics

from .conftest import SIM_CAPACITY
from .test_state_machine import SETTINGS, ResourceMachine

MiB = 1 << 20
# Hypothesis over the per-test simulated device: each example makes its own resources.
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
JOIN_TIMEOUT = 60.0

ADAPTORS: dict[str, Callable[[mr.MemoryResource], mr.UpstreamResourceAdaptor]] = {
    "statistics": lambda up: mr.StatisticsResourceAdaptor(up),
    "tracking": lambda up: mr.TrackingResourceAdaptor(up),
    "logging": lambda up: mr.LoggingResourceAdaptor(up, callback=[].append),
    "limiting": lambda up: mr.LimitingResourceAdaptor(up, "64MiB"),
    "failure_callback": lambda up: mr.FailureCallbackResourceAdaptor(up, lambda nbytes: False),
    "prefetch": lambda up: mr.PrefetchResourceAdaptor(up),
    "binning": lambda up: mr.BinningMemoryResource(up, 8, 12),
    "fixed_size": lambda up: mr.FixedSizeMemoryResource(up, block_size=4096, blocks_to_preallocate=16),
}


def run_threads(target: Callable[[int], None], n: int = 8) -> None:
    """Runs ``target(i)`` on ``n`` threads; fails if one raises or is still running after
    JOIN_TIMEOUT seconds (a deadlock)."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {JOIN_TIMEOUT}s (deadlock?): {alive}"
    if errors:
        raise errors[0]


# --- every adaptor ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ADAPTORS))
def test_upstream_is_kept_alive_and_returned(name: str) -> None:
    up = mr.CudaAsyncMemoryResource()
    adaptor = ADAPTORS[name](up)
    assert isinstance(adaptor, mr.UpstreamResourceAdaptor)
    assert isinstance(adaptor, mr.MemoryResource)
    assert adaptor.upstream is up
    assert adaptor.get_upstream() is up
    assert (adaptor.device, adaptor.memory_kind, adaptor.backend) == (up.device, up.memory_kind, up.backend)
    assert type(adaptor).__name__ in repr(adaptor) and "CudaAsyncMemoryResource" in repr(adaptor)
    del up
    gc.collect()
    ptr = adaptor.allocate(1000)
    adaptor.deallocate(ptr, 1000)
    assert type(adaptor.upstream).__name__ == "CudaAsyncMemoryResource"


@pytest.mark.parametrize("name", sorted(ADAPTORS))
def test_upstream_must_be_a_resource(name: str) -> None:
    with pytest.raises(TypeError):
        ADAPTORS[name](object())  # type: ignore[arg-type]


def test_the_base_adaptor_class_is_not_constructible() -> None:
    with pytest.raises(TypeError):
        mr.UpstreamResourceAdaptor()  # type: ignore[call-arg]


def test_adaptors_report_the_memory_kind_of_their_upstream() -> None:
    managed = mr.PrefetchResourceAdaptor(mr.StatisticsResourceAdaptor(mr.ManagedMemoryResource()))
    assert managed.memory_kind == "managed"
    pinned = mr.TrackingResourceAdaptor(mr.PinnedHostMemoryResource())
    assert pinned.memory_kind == "pinned_host"


def test_device_buffers_through_a_stack(sim: SimulatedDevice) -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    top = mr.TrackingResourceAdaptor(mr.LimitingResourceAdaptor(stats, "16MiB"))
    s = streampool.Stream()
    buf = streampool.DeviceBuffer.to_device(b"streampool" * 1000, stream=s, mr=top)
    assert buf.mr is top
    assert [r.size for r in top.outstanding()] == [10000]
    assert buf.tobytes() == b"streampool" * 1000
    del buf
    assert top.outstanding() == []
    assert stats.allocation_counts.total_bytes == 10000
    assert stats.allocation_counts.current_bytes == 0


# --- statistics ------------------------------------------------------------------------


def test_statistics_counts() -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    assert stats.allocation_counts == Statistics(0, 0, 0, 0, 0, 0)
    a = stats.allocate(1000)
    b = stats.allocate("1MiB")
    assert stats.allocation_counts == Statistics(1000 + MiB, 2, 1000 + MiB, 2, 1000 + MiB, 2)
    stats.deallocate(b, MiB)
    c = stats.allocate(24)
    assert stats.allocation_counts == Statistics(1024, 2, 1000 + MiB, 2, 1024 + MiB, 3)
    stats.deallocate(a, 1000)
    stats.deallocate(c, 24)
    assert stats.allocation_counts == Statistics(0, 0, 1000 + MiB, 2, 1024 + MiB, 3)
    assert stats.allocate(0) == 0  # the null allocation is not counted
    assert stats.allocation_counts.total_count == 3


def test_statistics_stack_of_counters() -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    outer = stats.allocate(1000)
    before = stats.push_counters()
    assert before == Statistics(1000, 1, 1000, 1, 1000, 1)
    assert stats.allocation_counts == Statistics(0, 0, 0, 0, 0, 0)
    inner = stats.allocate(500)
    stats.deallocate(outer, 1000)  # allocated before the push: the scope goes below zero
    assert stats.allocation_counts.current_bytes == 0  # reported as 0, not negative
    popped = stats.pop_counters()
    assert popped.total_bytes == 500 and popped.total_count == 1 and popped.peak_bytes == 500
    # Merged as RMM does: current adds up, the scope's peak counts on top of what was live.
    assert stats.allocation_counts == Statistics(500, 1, 1500, 2, 1500, 2)
    stats.deallocate(inner, 500)


def test_popping_the_base_counters_is_a_value_error() -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    with pytest.raises(IndexError, match="only the base counters"):
        stats.pop_counters()
    stats.push_counters()
    stats.pop_counters()
    with pytest.raises(IndexError, match="only the base counters"):
        stats.pop_counters()
    ptr = stats.allocate(256)  # still usable
    stats.deallocate(ptr, 256)


def test_failed_allocations_are_not_counted() -> None:
    stats = mr.StatisticsResourceAdaptor(mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "1MiB"))
    with pytest.raises(streampool.OutOfMemoryError):
        stats.allocate("2MiB")
    with pytest.raises(streampool.InvalidPointerError):
        stats.deallocate(0xDEAD0000, 256)
    assert stats.allocation_counts == Statistics(0, 0, 0, 0, 0, 0)


def test_statistics_object() -> None:
    s = Statistics(current_bytes=1, current_count=2, peak_bytes=3, peak_count=4, total_bytes=5, total_count=6)
    assert s["peak_bytes"] == 3 and "total_count" in s and "bytes" not in s
    assert (
        dict(s)
        == dataclasses.asdict(s)
        == {
            "current_bytes": 1,
            "current_count": 2,
            "peak_bytes": 3,
            "peak_count": 4,
            "total_bytes": 5,
            "total_count": 6,
        }
    )
    with pytest.raises(KeyError):
        s["nope"]
    # Iterated as the dictionary is: its keys (not s[0], s[1], ...).
    assert list(s) == list(s.keys()) and len(s) == 6
    assert s.values() == (1, 2, 3, 4, 5, 6) and dict(s.items()) == dict(s)
    assert pickle.loads(pickle.dumps(s)) == s
    s.current_bytes = 7  # a snapshot whose fields can be set, as RMM's (a plain dataclass)
    assert s["current_bytes"] == 7
    assert "peak_bytes=3" in repr(s)


class CountersModel:
    """RMM's statistics_resource_adaptor counters, in Python: signed values, a stack, and
    the merge of a popped scope into its parent."""

    def __init__(self) -> None:
        self.stack = [self.zero()]

    @staticmethod
    def zero() -> dict[str, list[int]]:
        return {"bytes": [0, 0, 0], "count": [0, 0, 0]}  # value, peak, total

    def record(self, nbytes: int, sign: int) -> None:
        top = self.stack[-1]
        for key, n in (("bytes", nbytes), ("count", 1)):
            c = top[key]
            c[0] += sign * n
            if sign > 0:
                c[1] = max(c[1], c[0])
                c[2] += n

    def push(self) -> Statistics:
        before = self.snapshot()
        self.stack.append(self.zero())
        return before

    def pop(self) -> Statistics:
        child = self.stack.pop()
        popped = self.snapshot(child)
        for key in ("bytes", "count"):
            parent, c = self.stack[-1][key], child[key]
            parent[1] = max(parent[1], parent[0] + c[1])
            parent[0] += c[0]
            parent[2] += c[2]
        return popped

    def snapshot(self, counters: dict[str, list[int]] | None = None) -> Statistics:
        top = self.stack[-1] if counters is None else counters
        (bv, bp, bt), (cv, cp, ct) = top["bytes"], top["count"]
        bv, cv = max(bv, 0), max(cv, 0)
        return Statistics(bv, cv, max(bp, bv), max(cp, cv), bt, ct)


STATISTICS_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(1, 4 * MiB)),
        st.tuples(st.just("free"), st.integers(0, 1 << 16)),
        st.tuples(st.just("push"), st.just(0)),
        st.tuples(st.just("pop"), st.just(0)),
    ),
    max_size=50,
)


@HYPOTHESIS
@given(ops=STATISTICS_OPS)
def test_statistics_equal_a_model(ops: list[tuple[str, int]]) -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    model = CountersModel()
    live: list[tuple[int, int]] = []
    for op, arg in ops:
        if op == "allocate":
            live.append((stats.allocate(arg), arg))
            model.record(arg, +1)
        elif op == "free" and live:
            ptr, n = live.pop(arg % len(live))
            stats.deallocate(ptr, n)
            model.record(n, -1)
        elif op == "push":
            assert stats.push_counters() == model.push()
        elif op == "pop":
            if len(model.stack) == 1:
                with pytest.raises(IndexError):
                    stats.pop_counters()
            else:
                assert stats.pop_counters() == model.pop()
        assert stats.allocation_counts == model.snapshot(), (op, arg)
    for ptr, n in live:
        stats.deallocate(ptr, n)


# --- tracking --------------------------------------------------------------------------


def test_tracking_records_and_report() -> None:
    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    s = streampool.Stream()
    a = tracked.allocate(1000, s)
    b = tracked.allocate("1MiB")
    records = {r.ptr: r for r in tracked.outstanding()}
    assert set(records) == {a, b}
    assert (records[a].size, records[a].stream) == (1000, s.handle)
    assert (records[b].size, records[b].stream) == (MiB, 0)
    assert records[a].stack is None and isinstance(records[a].thread, str) and records[a].thread
    assert tracked.get_allocated_bytes() == 1000 + MiB
    report = tracked.get_outstanding_allocations_str()
    assert "2 outstanding allocations" in report and f"{a:#x}" in report and f"{b:#x}" in report
    tracked.deallocate(a, 1000, s)
    tracked.deallocate(b, MiB)
    assert tracked.outstanding() == [] and tracked.get_allocated_bytes() == 0
    assert tracked.get_outstanding_allocations_str() == ""  # nothing outstanding: empty, as RMM's


def allocate_here_for_the_stack(resource: mr.MemoryResource) -> int:
    return resource.allocate(4096)


def test_tracking_captures_python_stacks() -> None:
    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource(), capture_stacks=True)
    ptr = allocate_here_for_the_stack(tracked)
    from_thread: list[int] = []

    def in_a_thread_named_for_the_stack() -> None:
        from_thread.append(allocate_here_for_the_stack(tracked))

    t = threading.Thread(target=in_a_thread_named_for_the_stack, name="stack-thread")
    t.start()
    t.join(JOIN_TIMEOUT)
    records = {r.ptr: r for r in tracked.outstanding()}
    here = records[ptr].stack
    assert here is not None
    assert "allocate_here_for_the_stack" in here and "test_tracking_captures_python_stacks" in here
    there = records[from_thread[0]]
    assert there.stack is not None and "in_a_thread_named_for_the_stack" in there.stack
    assert "test_tracking_captures_python_stacks" not in there.stack  # that thread's own stack
    assert "allocate_here_for_the_stack" in tracked.get_outstanding_allocations_str()
    tracked.deallocate(ptr, 4096)
    tracked.deallocate(from_thread[0], 4096)


def test_tracking_refuses_bad_frees_and_changes_nothing() -> None:
    below = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    tracked = mr.TrackingResourceAdaptor(below)
    ptr = tracked.allocate(4096)
    foreign = below.allocate(4096)  # allocated around the tracking adaptor
    with pytest.raises(streampool.InvalidPointerError, match="not an outstanding allocation"):
        tracked.deallocate(foreign, 4096)
    with pytest.raises(streampool.InvalidPointerError, match="4096 bytes but freed with 4000"):
        tracked.deallocate(ptr, 4000)
    with pytest.raises(streampool.InvalidPointerError):
        tracked.deallocate(ptr + 256, 4096)
    assert [(r.ptr, r.size) for r in tracked.outstanding()] == [(ptr, 4096)]
    assert below.allocation_counts.current_count == 2  # the upstream was never asked
    tracked.deallocate(ptr, 4096)
    with pytest.raises(streampool.InvalidPointerError, match="double free"):
        tracked.deallocate(ptr, 4096)
    assert below.allocation_counts.current_count == 1
    below.deallocate(foreign, 4096)


def test_log_outstanding_allocations(caplog: pytest.LogCaptureFixture) -> None:
    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    with caplog.at_level(logging.WARNING, logger="streampool"):
        tracked.log_outstanding_allocations()
    assert caplog.records == []  # nothing outstanding, nothing logged
    ptr = tracked.allocate(777)
    with caplog.at_level(logging.WARNING, logger="streampool"):
        tracked.log_outstanding_allocations()
    [record] = caplog.records
    assert record.name == "streampool" and record.levelno == logging.WARNING
    assert "1 outstanding allocation" in record.getMessage() and f"{ptr:#x}" in record.getMessage()
    tracked.deallocate(ptr, 777)


TRACKING_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(1, 2 * MiB), st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 1 << 16), st.just(0)),
        st.tuples(st.just("bad_size"), st.integers(0, 1 << 16), st.integers(1, 255)),
        st.tuples(st.just("double_free"), st.just(0), st.just(0)),
    ),
    max_size=50,
)


@HYPOTHESIS
@given(ops=TRACKING_OPS)
def test_tracking_outstanding_is_the_live_set(ops: list[tuple[str, int, int]]) -> None:
    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    streams = [streampool.DEFAULT_STREAM, streampool.Stream(), streampool.Stream()]
    live: dict[int, tuple[int, int]] = {}
    freed: list[tuple[int, int]] = []
    for op, a, b in ops:
        if op == "allocate":
            ptr = tracked.allocate(a, streams[b])
            live[ptr] = (a, streams[b].handle)
            freed = [f for f in freed if f[0] != ptr]
        elif op == "free" and live:
            ptr = sorted(live)[a % len(live)]
            size, handle = live.pop(ptr)
            tracked.deallocate(ptr, size, handle)
            freed.append((ptr, size))
        elif op == "bad_size" and live:
            ptr = sorted(live)[a % len(live)]
            with pytest.raises(streampool.InvalidPointerError):
                tracked.deallocate(ptr, live[ptr][0] + b)
        elif op == "double_free" and freed:
            with pytest.raises(streampool.InvalidPointerError):
                tracked.deallocate(*freed[-1])
        assert {(r.ptr, r.size, r.stream) for r in tracked.outstanding()} == {
            (p, n, h) for p, (n, h) in live.items()
        }
        assert tracked.get_allocated_bytes() == sum(n for n, _ in live.values())
    for ptr, (size, handle) in live.items():
        tracked.deallocate(ptr, size, handle)


# --- limiting --------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, -(1 << 40), "0MiB", "0"])
def test_limit_must_be_positive(limit: Any) -> None:
    with pytest.raises(ValueError, match="allocation_limit"):
        mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), limit)


@pytest.mark.parametrize("limit", [1.5, None, True, [1]])
def test_limit_must_be_a_size(limit: Any) -> None:
    with pytest.raises(TypeError, match="allocation_limit"):
        mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), limit)


def test_limit_refuses_and_recovers() -> None:
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "1MiB")
    assert limited.get_allocation_limit() == MiB
    a = limited.allocate(768 << 10)
    assert limited.get_allocated_bytes() == 768 << 10
    with pytest.raises(streampool.OutOfMemoryError) as info:
        limited.allocate(512 << 10)
    assert info.value.requested == 512 << 10 and info.value.available == 256 << 10
    assert "LimitingResourceAdaptor" in str(info.value)
    assert limited.get_allocated_bytes() == 768 << 10  # the refused reservation was given back
    b = limited.allocate(256 << 10)  # exactly up to the limit
    limited.deallocate(a, 768 << 10)
    limited.deallocate(b, 256 << 10)
    assert limited.get_allocated_bytes() == 0
    c = limited.allocate(MiB)
    limited.deallocate(c, MiB)


def test_limit_is_never_exceeded_under_threads() -> None:
    # Below what one thread alone holds at times (up to 4 blocks of up to 1 MiB), so that the
    # limit is reached even when the OS runs the threads one after another.
    limit = 2 * MiB
    below = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    limited = mr.LimitingResourceAdaptor(below, limit)
    refused = [0] * 8
    over: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if (n := limited.get_allocated_bytes()) > limit:
                over.append(n)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    def worker(i: int) -> None:
        rng = random.Random(i)
        held: list[tuple[int, int]] = []
        for _ in range(300):
            if held and (len(held) > 3 or rng.random() < 0.4):
                ptr, n = held.pop(rng.randrange(len(held)))
                limited.deallocate(ptr, n)
            else:
                n = rng.randrange(1, MiB)
                try:
                    held.append((limited.allocate(n), n))
                except streampool.OutOfMemoryError:
                    refused[i] += 1
        for ptr, n in held:
            limited.deallocate(ptr, n)

    try:
        run_threads(worker)
    finally:
        done.set()
        watcher.join(JOIN_TIMEOUT)
    assert not over, f"allocated bytes above the limit: {max(over)}"
    counts = below.allocation_counts
    assert counts.peak_bytes <= limit  # exact: counted below the limit, at each allocation
    assert counts.current_bytes == 0 and limited.get_allocated_bytes() == 0
    assert sum(refused) > 0, "the limit was never reached: the test proves nothing"


# --- failure callback ------------------------------------------------------------------


@pytest.mark.parametrize("callback", [None, 3, "free_something", [print]])
def test_failure_callback_must_be_callable(callback: Any) -> None:
    with pytest.raises(TypeError, match="callback must be callable"):
        mr.FailureCallbackResourceAdaptor(mr.CudaAsyncMemoryResource(), callback)


def limited_async(limit: str = "4MiB") -> mr.LimitingResourceAdaptor:
    return mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), limit)


def test_failure_callback_false_gives_out_of_memory() -> None:
    calls: list[tuple[int, int]] = []

    def callback(nbytes: int) -> bool:
        calls.append((nbytes, threading.get_ident()))
        return False

    adaptor = mr.FailureCallbackResourceAdaptor(limited_async(), callback)
    with pytest.raises(streampool.OutOfMemoryError) as info:
        adaptor.allocate("5MiB")
    assert info.value.requested == 5 * MiB
    assert calls == [(5 * MiB, threading.get_ident())]  # once, on the calling thread
    ptr = adaptor.allocate("1MiB")  # fits: the callback is not called
    adaptor.deallocate(ptr, MiB)
    assert len(calls) == 1


def test_failure_callback_is_not_called_for_other_errors() -> None:
    calls: list[int] = []
    adaptor = mr.FailureCallbackResourceAdaptor(limited_async(), lambda n: calls.append(n) or False)
    with pytest.raises(streampool.InvalidStreamError):
        adaptor.allocate(256, 0x7777)
    with pytest.raises(streampool.InvalidPointerError):
        adaptor.deallocate(0xDEAD0000, 256)
    assert calls == []


def test_failure_callback_frees_into_the_same_adaptor_and_retries() -> None:
    cache: list[tuple[int, int]] = []
    calls: list[int] = []

    def callback(nbytes: int) -> bool:
        calls.append(nbytes)
        if not cache:
            return False
        ptr, n = cache.pop(0)
        adaptor.deallocate(ptr, n)  # into the adaptor that is allocating: no lock is held
        probe = adaptor.allocate(256)  # and allocating from it works too
        adaptor.deallocate(probe, 256)
        return True

    adaptor = mr.FailureCallbackResourceAdaptor(limited_async(), callback)
    cache += [(adaptor.allocate(MiB), MiB) for _ in range(4)]
    ptr = adaptor.allocate("2MiB")  # needs two cached blocks freed
    assert calls == [2 * MiB, 2 * MiB] and len(cache) == 2
    adaptor.deallocate(ptr, 2 * MiB)
    for p, n in cache:
        adaptor.deallocate(p, n)


class CallbackFailed(Exception):
    pass


def test_failure_callback_exception_reaches_the_caller_unchanged() -> None:
    raised = CallbackFailed("no memory to give back")

    def callback(nbytes: int) -> bool:
        raise raised

    adaptor = mr.FailureCallbackResourceAdaptor(limited_async(), callback)
    with pytest.raises(CallbackFailed) as info:
        adaptor.allocate("5MiB")
    assert info.value is raised
    ptr = adaptor.allocate(MiB)  # still usable
    adaptor.deallocate(ptr, MiB)
    # The stashed exception was consumed: later errors are their own.
    with pytest.raises(streampool.InvalidPointerError):
        adaptor.deallocate(0xDEAD0000, 256)
    with pytest.raises(CallbackFailed) as again:
        adaptor.allocate("5MiB")
    assert again.value is raised


@pytest.mark.parametrize("answer", [None, 0, "", 0.0, False])
def test_a_false_answer_of_the_failure_callback_lets_the_error_through(answer: object) -> None:
    # RMM reads the answer as a C bool: None, 0 and other false values mean no retry.
    calls: list[int] = []
    adaptor = mr.FailureCallbackResourceAdaptor(
        limited_async(), lambda nbytes: calls.append(nbytes) or answer
    )
    with pytest.raises(streampool.OutOfMemoryError):
        adaptor.allocate("5MiB")
    assert calls == [5 * MiB]
    ptr = adaptor.allocate(256)
    adaptor.deallocate(ptr, 256)


@pytest.mark.parametrize("answer", [1, "yes", [0]])
def test_a_true_answer_of_the_failure_callback_retries(answer: object) -> None:
    calls: list[int] = []

    def callback(nbytes: int) -> object:
        calls.append(nbytes)
        return answer if len(calls) < 3 else False

    adaptor = mr.FailureCallbackResourceAdaptor(limited_async(), callback)
    with pytest.raises(streampool.OutOfMemoryError):
        adaptor.allocate("5MiB")
    assert calls == [5 * MiB] * 3


def test_a_memory_error_of_an_allocate_function_calls_the_failure_callback() -> None:
    # RMM's test_failure_callback_resource_adaptor: the allocate function raises
    # MemoryError, the callback retries once, then lets the original error through.
    counts = {"alloc": 0, "cb": 0}
    base = mr.CudaAsyncMemoryResource()
    fail = MemoryError("Intentional allocation failure")

    def allocate(size: int, stream: streampool.Stream) -> int:
        counts["alloc"] += 1
        raise fail

    def callback(nbytes: int) -> bool:
        counts["cb"] += 1
        return counts["cb"] < 2

    cb = mr.CallbackMemoryResource(allocate, lambda ptr, size, stream: base.deallocate(ptr, size, stream))
    for upstream in (cb, mr.StatisticsResourceAdaptor(cb)):
        counts.update(alloc=0, cb=0)
        adaptor = mr.FailureCallbackResourceAdaptor(upstream, callback)
        with pytest.raises(MemoryError) as info:
            adaptor.allocate(256)
        assert info.value is fail and counts == {"alloc": 2, "cb": 2}
        # A MemoryError below the pool is the pool's upstream running out: its own error.
        pool = mr.FailureCallbackResourceAdaptor(mr.PoolMemoryResource(upstream), lambda n: False)
        with pytest.raises(MemoryError):
            pool.allocate(256)


def test_a_callbacks_exception_survives_streampool_calls_in_later_callbacks() -> None:
    # The allocate function's exception is kept until the outer call raises it; a failure
    # callback that uses streampool meanwhile (closing a cached buffer, as the docs
    # suggest; an allocation that fails) used to clear it, and the caller got a plain
    # StreampoolError in place of its MemoryError.
    base = mr.CudaAsyncMemoryResource()

    class NoRoom(MemoryError):
        pass

    def allocate(size: int, stream: streampool.Stream) -> int:
        raise NoRoom(f"no room for {size}")

    cb = mr.CallbackMemoryResource(allocate, lambda ptr, size, stream: None)
    cache = [streampool.DeviceBuffer(size=4096, mr=base) for _ in range(3)]

    def free_cache(nbytes: int) -> bool:
        cache.pop().close()
        return False

    def fail_elsewhere(nbytes: int) -> bool:
        with pytest.raises(streampool.InvalidPointerError):
            base.deallocate(0xDEAD0000, 256)
        with pytest.raises(streampool.OutOfMemoryError):
            mr.LimitingResourceAdaptor(base, allocation_limit=256).allocate(4096)
        return False

    for callback in (free_cache, fail_elsewhere):
        adaptor = mr.FailureCallbackResourceAdaptor(cb, callback)
        with pytest.raises(NoRoom, match="no room for 1024"):
            adaptor.allocate(1024)

    # A logging callback's own exception, with a streampool call in the callback that logs
    # the undo line of the failed allocation.
    class Full(Exception):
        pass

    def log(line: str) -> None:
        if ",allocate," in line:
            raise Full(line)
        streampool.DeviceBuffer(size=256, mr=base).close()

    logged = mr.LoggingResourceAdaptor(base, callback=log)
    with pytest.raises(Full):
        logged.allocate(256)


def test_failure_callback_cycle_is_collected() -> None:
    class Marker:
        pass

    marker = Marker()
    alive = weakref.ref(marker)
    holder: list[Any] = [marker]
    adaptor = mr.FailureCallbackResourceAdaptor(
        mr.CudaAsyncMemoryResource(), lambda n, held=holder: bool(held)
    )
    holder.append(adaptor)  # adaptor -> callback -> holder -> adaptor
    del adaptor, holder, marker
    gc.collect()
    assert alive() is None


def test_failure_callbacks_free_and_retry_under_threads() -> None:
    """8 threads allocate through a failure-callback adaptor over a small limit; when it
    runs out, the callback frees blocks that other threads cached into the same stack and
    asks for a retry."""
    cache: list[tuple[int, int]] = []
    cache_lock = threading.Lock()
    retries = [0]

    def callback(nbytes: int) -> bool:
        with cache_lock:
            victim = cache.pop(0) if cache else None
        if victim is None:
            return False
        top.deallocate(*victim)
        retries[0] += 1
        return True

    top = mr.FailureCallbackResourceAdaptor(
        mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "8MiB"), callback
    )

    def worker(i: int) -> None:
        rng = random.Random(i)
        for _ in range(200):
            n = rng.randrange(64 << 10, MiB)
            try:
                ptr = top.allocate(n)
            except streampool.OutOfMemoryError:
                continue
            with cache_lock:
                cache.append((ptr, n))

    run_threads(worker)
    assert retries[0] > 0
    for ptr, n in cache:
        top.deallocate(ptr, n)
    assert top.upstream.get_allocated_bytes() == 0  # type: ignore[attr-defined]


# --- the design's "no deadlock with Python" --------------------------------------------


def test_no_deadlock_with_python_callbacks_in_the_stack() -> None:
    """8 threads allocate and free through logging(Python sink) over failure callback
    (Python, frees into the same stack) over limiting over tracking over the driver's pool;
    everything must finish within a bounded time, with nothing lost."""
    lines: list[str] = []
    lines_lock = threading.Lock()
    cache: list[tuple[int, int, streampool.Stream]] = []
    cache_lock = threading.Lock()

    def sink(line: str) -> None:
        with lines_lock:
            lines.append(line)
        sum(range(50))  # some Python work with the GIL held

    def on_oom(nbytes: int) -> bool:
        with cache_lock:
            victim = cache.pop() if cache else None
        if victim is None:
            return False
        top.deallocate(*victim)  # through the top of the stack: logging runs again, nested
        return True

    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    limited = mr.LimitingResourceAdaptor(tracked, "12MiB")
    top = mr.LoggingResourceAdaptor(mr.FailureCallbackResourceAdaptor(limited, on_oom), callback=sink)
    streams = [streampool.Stream() for _ in range(4)]

    def worker(i: int) -> None:
        rng = random.Random(100 + i)
        mine: list[tuple[int, int, streampool.Stream]] = []
        for _ in range(150):
            roll = rng.random()
            if roll < 0.45:
                n, s = rng.randrange(1, 2 * MiB), rng.choice(streams)
                with contextlib.suppress(streampool.OutOfMemoryError):
                    mine.append((top.allocate(n, s), n, s))
            elif roll < 0.7 and mine:
                with cache_lock:
                    cache.append(mine.pop())
            elif mine:
                top.deallocate(*mine.pop(rng.randrange(len(mine))))
        for a in mine:
            top.deallocate(*a)

    run_threads(worker)
    with cache_lock:
        remaining = list(cache)
    assert {r.ptr for r in tracked.outstanding()} == {p for p, _, _ in remaining}
    for a in remaining:
        top.deallocate(*a)
    assert tracked.outstanding() == [] and limited.get_allocated_bytes() == 0
    events = streampool.logs.parse_log("\n".join(lines))
    allocated = sum(1 for e in events if e.action == "allocate")
    freed = sum(1 for e in events if e.action == "free")
    assert allocated == freed > 0


# --- prefetch --------------------------------------------------------------------------


@pytest.mark.parametrize("upstream", [mr.ManagedMemoryResource, mr.CudaAsyncMemoryResource])
def test_prefetch_round_trip(upstream: Callable[[], mr.MemoryResource], sim: SimulatedDevice) -> None:
    prefetch = mr.PrefetchResourceAdaptor(upstream())
    s = streampool.Stream()
    buf = streampool.DeviceBuffer.to_device(bytes(range(256)) * 64, stream=s, mr=prefetch)
    assert buf.tobytes() == bytes(range(256)) * 64
    ptr = prefetch.allocate(MiB, s)
    sim.write(s, ptr, MiB)
    prefetch.deallocate(ptr, MiB, s)
    sim.run()


# --- binning and fixed-size ------------------------------------------------------------


def test_binning_routes_by_size() -> None:
    small = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    medium = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    large = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    binning = mr.BinningMemoryResource(large)
    binning.add_bin(64 << 10, medium)  # added out of order: kept sorted
    binning.add_bin(1024, small)
    assert [size for size, _ in binning.bins] == [1024, 64 << 10]
    assert binning.bin_mrs == [medium, small]
    assert [r for _, r in binning.bins] == [small, medium]
    assert binning.bins[0][1] is small  # the objects given, not copies
    expected = {1: small, 1024: small, 1025: medium, 64 << 10: medium, (64 << 10) + 1: large, 8 * MiB: large}
    ptrs = {n: binning.allocate(n) for n in expected}
    for n, target in expected.items():
        assert target.allocation_counts.current_bytes >= n
    assert small.allocation_counts.current_count == 2
    assert medium.allocation_counts.current_count == 2
    assert large.allocation_counts.current_count == 2
    for n, ptr in ptrs.items():
        binning.deallocate(ptr, n)
    assert all(r.allocation_counts.current_count == 0 for r in (small, medium, large))


def test_binning_exponents_make_fixed_size_bins() -> None:
    binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 10, 13)
    assert [size for size, _ in binning.bins] == [1024, 2048, 4096, 8192]
    assert binning.bin_mrs == []
    assert all(
        isinstance(r, mr.MemoryResource) and "FixedSizeMemoryResource" in repr(r) for _, r in binning.bins
    )
    ptrs = [(binning.allocate(n), n) for n in (1, 1000, 1500, 8192, 8193, 3 * MiB)]
    assert len({p for p, _ in ptrs}) == len(ptrs)
    for p, n in ptrs:
        binning.deallocate(p, n)
    assert [size for size, _ in mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), -1, -1).bins] == []


@pytest.mark.parametrize("exponents", [(12, 10), (10, None), (None, 10), (10, 41), (-2, 10), (10, 64)])
def test_binning_bad_exponents(exponents: tuple[int | None, int | None]) -> None:
    with pytest.raises(ValueError, match="exponent"):
        mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), *exponents)


def test_binning_refuses_late_bins() -> None:
    binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 10, 12)
    with pytest.raises(ValueError, match="allocation_size"):
        binning.add_bin(0)
    with pytest.raises(ValueError, match="allocation_size"):
        binning.add_bin(-5)
    held = binning.allocate(3000)  # from the 4 KiB bin
    with pytest.raises(ValueError, match="add bins before allocating"):
        binning.add_bin(3072)  # would take 3000-byte frees away from the 4 KiB bin
    binning.add_bin(1 << 20)  # takes sizes from the upstream, which has nothing outstanding
    assert [size for size, _ in binning.bins] == [1024, 2048, 4096, 1 << 20]
    with pytest.raises(ValueError, match="replace bins before allocating"):
        binning.add_bin("4KiB", mr.CudaAsyncMemoryResource())  # its bin has `held` outstanding
    assert binning.bin_mrs == []  # the refused resource was not kept
    binning.deallocate(held, 3000)


def test_binning_keeps_bin_resources_alive() -> None:
    binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource())
    binning.add_bin(4096, mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource()))
    gc.collect()
    ptr = binning.allocate(100)
    [tracked] = binning.bin_mrs
    assert isinstance(tracked, mr.TrackingResourceAdaptor)
    assert [r.ptr for r in tracked.outstanding()] == [ptr]
    binning.deallocate(ptr, 100)


def test_fixed_size_blocks() -> None:
    fixed = mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), block_size=1000, blocks_to_preallocate=4)
    assert (fixed.block_size, fixed.blocks_to_preallocate) == (1024, 4)  # rounded up to 256
    assert mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource()).block_size == MiB
    s = streampool.Stream()
    a = fixed.allocate(1024, s)
    fixed.deallocate(a, 1024, s)
    assert fixed.allocate(10, s) == a  # same-stream reuse
    # Above the block size: a MemoryError, as RMM's, which a failure callback hears of.
    with pytest.raises(streampool.OutOfMemoryError, match="blocks of 1024 bytes are the most it serves"):
        fixed.allocate(1025, s)
    asked: list[int] = []
    retrying = mr.FailureCallbackResourceAdaptor(fixed, lambda nbytes: asked.append(nbytes) or False)
    with pytest.raises(MemoryError):
        retrying.allocate(1025, s)
    assert asked == [1025]
    blocks = [fixed.allocate(512, s) for _ in range(9)]  # grows past one chunk
    assert len(set(blocks) | {a}) == 10
    fixed.deallocate(a, 10, s)
    with pytest.raises(streampool.InvalidPointerError, match="double free"):
        fixed.deallocate(a, 10, s)
    for p in blocks:
        fixed.deallocate(p, 512, s)


@pytest.mark.parametrize(("block_size", "blocks"), [(0, 4), (-1, 4), ("0KiB", 4), (1024, 0)])
def test_fixed_size_bad_arguments(block_size: Any, blocks: int) -> None:
    with pytest.raises(ValueError, match=r"block_size|blocks_to_preallocate"):
        mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), block_size, blocks)


def test_fixed_size_out_of_memory_reclaims_other_streams_blocks() -> None:
    block = SIM_CAPACITY // 8
    fixed = mr.FixedSizeMemoryResource(
        mr.CudaAsyncMemoryResource(), block_size=block, blocks_to_preallocate=2
    )
    a, b = streampool.Stream(), streampool.Stream()
    on_a = [fixed.allocate(block, a) for _ in range(4)]  # half the device, on a's lists
    for p in on_a:
        fixed.deallocate(p, block, a)
    # b grows until the device is full, then takes a's blocks (after a device sync).
    on_b: list[int] = []
    with pytest.raises(streampool.OutOfMemoryError):
        for _ in range(20):
            on_b.append(fixed.allocate(block, b))
    assert set(on_a) <= set(on_b) and len(set(on_b)) == len(on_b)
    for p in on_b:
        fixed.deallocate(p, block, b)


def test_fixed_size_out_of_memory_names_the_size_asked() -> None:
    fixed = mr.FixedSizeMemoryResource(
        mr.CudaAsyncMemoryResource(), block_size="64KiB", blocks_to_preallocate=8192
    )
    with pytest.raises(streampool.OutOfMemoryError) as info:
        fixed.allocate(1000)  # a chunk of 512 MiB does not fit the 256 MiB device
    assert info.value.requested == 1000
    assert "1000 bytes" in str(info.value)


# --- stream ordering of the suballocating adaptors, under the race detector ------------

RACE_FACTORIES: dict[str, Callable[[], mr.MemoryResource]] = {
    "fixed_size": lambda: mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), "1MiB", 4),
    "binning": lambda: mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 8, 16),
    "stack": lambda: mr.LoggingResourceAdaptor(
        mr.TrackingResourceAdaptor(mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "48MiB")),
        callback=lambda line: None,
    ),
}


@pytest.mark.nosim
@pytest.mark.parametrize("name", sorted(RACE_FACTORIES))
def test_adaptors_have_no_races(name: str) -> None:
    machine = type(f"Machine_{name}", (ResourceMachine,), {"factory": staticmethod(RACE_FACTORIES[name])})
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()


# --- interpreter shutdown --------------------------------------------------------------

EXIT_SCRIPT = """
import streampool
from streampool import mr
lines = []
top = mr.LoggingResourceAdaptor(
    mr.FailureCallbackResourceAdaptor(
        mr.TrackingResourceAdaptor(mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource()), capture_stacks=True),
        lambda nbytes: False,
    ),
    callback=lines.append,
)
binning = mr.BinningMemoryResource(top, 8, 12)
streampool.set_current_device_resource(binning)
bufs = [streampool.DeviceBuffer(size=n, stream=s) for n in (100, 5000) for s in (None, streampool.Stream(), 2)]
cycle = [bufs, top]
cycle.append(cycle)

class FreesAtExit:
    def __del__(self):
        streampool.DeviceBuffer(size=10)

keep = FreesAtExit()
print("ok")
"""


@pytest.mark.nosim
def test_exit_with_live_buffers_and_python_callbacks_is_quiet() -> None:
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, "ok\n", "")


# --- depth: every call recurses through a chain, so chains are at most MAX_RESOURCE_DEPTH deep


def build_chain(levels: int, base: mr.MemoryResource | None = None) -> mr.MemoryResource:
    """``levels`` adaptors over ``base`` (a new CudaAsyncMemoryResource by default),
    cycling through the kinds."""
    kinds: list[Callable[[mr.MemoryResource], mr.MemoryResource]] = [
        mr.StatisticsResourceAdaptor,
        mr.TrackingResourceAdaptor,
        lambda up: mr.LoggingResourceAdaptor(up, callback=lambda line: None),
        lambda up: mr.LimitingResourceAdaptor(up, "1GiB"),
        lambda up: mr.FailureCallbackResourceAdaptor(up, lambda nbytes: False),
        mr.PrefetchResourceAdaptor,
        mr.BinningMemoryResource,
    ]
    resource = base if base is not None else mr.CudaAsyncMemoryResource()
    for i in range(levels):
        resource = kinds[i % len(kinds)](resource)
    return resource


def test_a_chain_deeper_than_the_limit_is_refused_and_the_chain_still_works() -> None:
    limit = mr.MAX_RESOURCE_DEPTH
    assert limit == 256
    top = build_chain(limit - 1)  # the deepest allowed: limit resources, the leaf included
    for make in (
        mr.StatisticsResourceAdaptor,
        mr.TrackingResourceAdaptor,
        lambda up: mr.LimitingResourceAdaptor(up, 1),
        mr.BinningMemoryResource,
        mr.FixedSizeMemoryResource,
        lambda up: mr.LoggingResourceAdaptor(up, callback=print),
    ):
        with pytest.raises(
            streampool.InvalidArgumentError, match=f"{limit + 1} resources deep.*limit of {limit}"
        ):
            make(top)
    assert issubclass(streampool.InvalidArgumentError, ValueError)
    binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource())
    with pytest.raises(ValueError, match="limit of 256"):
        binning.add_bin(4096, top)
    ptr = top.allocate(4096)
    top.deallocate(ptr, 4096)
    assert binning.bins == []


def test_the_deepest_chain_allocates_frees_and_drops_in_a_thread() -> None:
    """In a Python thread with a 2 MiB stack (a Rust thread's default; Python's is
    larger): an allocation, a free, a DeviceBuffer and dropping the chain, from the top."""
    results: list[object] = []

    def work() -> None:
        leaf = mr.CudaAsyncMemoryResource()
        alone = sys.getrefcount(leaf)
        top = build_chain(mr.MAX_RESOURCE_DEPTH - 1, leaf)
        ptr = top.allocate(1000)
        top.deallocate(ptr, 1000)
        buf = streampool.DeviceBuffer(size=4096, mr=top)
        del buf
        del top
        gc.collect()
        results.append(sys.getrefcount(leaf) == alone)  # the whole chain was dropped

    previous = threading.stack_size(2 << 20)
    try:
        t = threading.Thread(target=work)
        t.start()
    finally:
        threading.stack_size(previous)
    t.join(JOIN_TIMEOUT)
    assert results == [True]


def test_a_bin_that_calls_back_into_the_binning_resource_is_refused() -> None:
    binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource())
    over = mr.StatisticsResourceAdaptor(binning)
    with pytest.raises(ValueError, match="add bins before wrapping it"):
        binning.add_bin(1024, over)  # allocations of 1024 bytes would recurse for ever
    binning.add_bin(1024, mr.CudaAsyncMemoryResource())  # not deeper: accepted
    ptr = over.allocate(100)
    over.deallocate(ptr, 100)


# --- wrong sizes: refused where the resource can tell, and nothing changes


def test_binning_refuses_a_free_with_another_size_in_both_directions() -> None:
    below = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    binning = mr.BinningMemoryResource(below, 8, 12)  # 256 B .. 4 KiB bins
    small = binning.allocate(300)
    big = binning.allocate(MiB)
    before = below.allocation_counts
    for ptr, wrong, right in ((small, MiB, 300), (big, 300, MiB), (small, 1000, 300)):
        with pytest.raises(
            streampool.InvalidPointerError, match=f"allocated with {right} bytes but freed with {wrong}"
        ):
            binning.deallocate(ptr, wrong)
    with pytest.raises(streampool.InvalidPointerError, match="not an outstanding allocation"):
        binning.deallocate(small + 256, 300)
    assert below.allocation_counts == before  # the upstream was never asked
    live = [(small, 300), (big, MiB)]
    for n in (300, 300, MiB, 4096):  # usable, and nothing overlaps what is live
        p = binning.allocate(n)
        assert all(p + n <= q or q + m <= p for q, m in live)
        live.append((p, n))
    for p, n in live:
        binning.deallocate(p, n)
    with pytest.raises(streampool.InvalidPointerError, match="double free"):
        binning.deallocate(small, 300)


def test_limiting_refuses_a_free_of_more_than_is_in_use() -> None:
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "1MiB")
    ptr = limited.allocate(1000)  # counts 1024: rounded up to 256, as RMM's adaptor counts
    with pytest.raises(streampool.InvalidPointerError, match="4000 bytes, but only 1024 bytes are allocated"):
        limited.deallocate(ptr, 4000)
    assert limited.get_allocated_bytes() == 1024
    limited.deallocate(ptr, 1000)
    with pytest.raises(streampool.InvalidPointerError):
        limited.deallocate(ptr, 1000)
    assert limited.get_allocated_bytes() == 0  # never wraps below zero
    whole = limited.allocate("1MiB")  # the whole limit is still there
    limited.deallocate(whole, "1MiB")


def test_statistics_refuse_a_free_of_more_than_is_in_use() -> None:
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    ptr = stats.allocate(1000)
    before = stats.allocation_counts
    with pytest.raises(streampool.InvalidPointerError, match="1000 bytes in 1 allocation"):
        stats.deallocate(ptr, 4000)
    assert stats.allocation_counts == before
    stats.deallocate(ptr, 1000)
    with pytest.raises(streampool.InvalidPointerError, match="0 bytes in 0 allocation"):
        stats.deallocate(ptr, 1000)
    assert (stats.allocation_counts.current_bytes, stats.allocation_counts.total_bytes) == (0, 1000)


def test_the_async_resource_cannot_check_sizes() -> None:
    """Documented: the driver's free takes no size, so a wrong size frees the allocation."""
    resource = mr.CudaAsyncMemoryResource()
    ptr = resource.allocate(4096)
    resource.deallocate(ptr, 1 << 40)
    assert "Sizes are not checked" in (mr.CudaAsyncMemoryResource.__doc__ or "")


# --- the fast path: adaptors over the sharded pool keep the GIL


@pytest.mark.parametrize(
    ("name", "make", "fast"),
    [
        ("statistics", mr.StatisticsResourceAdaptor, True),
        ("tracking", mr.TrackingResourceAdaptor, True),
        ("limiting", lambda up: mr.LimitingResourceAdaptor(up, "1GiB"), True),
        ("logging", lambda up: mr.LoggingResourceAdaptor(up, callback=lambda line: None), False),
    ],
)
def test_adaptors_over_the_pool_take_its_fast_path(
    name: str, make: Callable[[mr.MemoryResource], mr.MemoryResource], fast: bool
) -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    adaptor = make(pool)
    s = streampool.Stream()
    adaptor.deallocate(adaptor.allocate(4096, s), 4096, s)  # grows the pool: the full path
    before = streampool._native._fast_path_calls()
    for _ in range(10):
        adaptor.deallocate(adaptor.allocate(4096, s), 4096, s)
    assert streampool._native._fast_path_calls() - before == (20 if fast else 0), name


# --- failures in Drop are recorded


@pytest.mark.drop_errors_expected
def test_a_failed_log_line_when_a_buffer_is_collected_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    unraisable: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: unraisable.append(info.exc_value))

    def refuse_frees(line: str) -> None:
        if ",free," in line:
            raise OSError("the log disk is full")

    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=refuse_frees)
    count, _ = streampool.drop_errors()
    buf = streampool.DeviceBuffer(size=4096, mr=logged)
    ptr = buf.ptr
    del buf  # freed; the log line's failure is recorded, and the callback's exception is unraisable
    assert [type(e) for e in unraisable] == [OSError]
    after, recent = streampool.drop_errors()
    assert after == count + 1
    assert recent[-1].startswith(
        f"LoggingResourceAdaptor: the log line of a free of 4096 bytes at {ptr:#x}, which was freed"
    )
    assert "the log disk is full" in recent[-1]
    ptr = logged.allocate(4096)  # still usable; a free that happened does not raise there either
    logged.deallocate(ptr, 4096)
    assert [type(e) for e in unraisable] == [OSError, OSError]
    assert streampool.drop_errors()[0] == after + 1


def test_callback_resource_refuses_a_misaligned_address_and_gives_it_back() -> None:
    inner = mr.CudaMemoryResource()
    given_back: list[int] = []

    def allocate(size: int, stream: object) -> int:
        return int(inner.allocate(size + 256)) + 8  # a bug: not 256-byte aligned

    def deallocate(ptr: int, size: int, stream: object) -> None:
        given_back.append(ptr)
        inner.deallocate(ptr - 8, size + 256)

    cb = mr.CallbackMemoryResource(allocate, deallocate)
    for resource in (cb, mr.StatisticsResourceAdaptor(cb), mr.ShardedPoolMemoryResource(cb)):
        with pytest.raises(streampool.InvalidArgumentError, match="not 256-byte aligned"):
            resource.allocate(1000)
    assert len(given_back) == 3 and all(p % 256 == 8 for p in given_back)


def test_ctrl_c_while_an_out_of_memory_error_is_made_stays_keyboard_interrupt() -> None:
    # A signal's exception raised while streampool builds the OutOfMemoryError goes on as
    # KeyboardInterrupt (it became RuntimeError "cannot raise OutOfMemoryError").
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    limited = mr.LimitingResourceAdaptor(mr.CudaMemoryResource(), 1 << 20)
    s = streampool.Stream()
    try:
        for _ in range(100):
            signal.setitimer(signal.ITIMER_REAL, 0.001)
            with pytest.raises(KeyboardInterrupt):
                while True:
                    with contextlib.suppress(MemoryError):
                        limited.allocate(2 << 20, s)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
