"""streampool._native.replay and pipeline on the simulated device (and on a GPU)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import pytest

import streampool
from streampool import _native, mr
from streampool.sim import SimulatedDevice

REC = struct.Struct("<QQQIIB7x")


def _log(n: int = 300, threads: int = 3) -> bytes:
    """``n`` allocations over ``threads`` threads on a stream each, in a window of 4 per
    thread; every third one freed by the next thread, on its stream."""
    out, pending, t = [], [], 0
    for i in range(n):
        th = i % threads
        size = 256 * (1 + i % 50)
        t += 1000
        out.append(REC.pack(t, size, i, th, th, 0))
        pending.append((i, size, (th + 1) % threads if i % 3 == 0 else th))
        if len(pending) > 4 * threads:
            j, sz, freer = pending.pop(0)
            t += 100
            out.append(REC.pack(t, sz, j, freer, freer, 1))
    for j, _sz, freer in pending:
        out.append(REC.pack(t, 0, j, freer, freer, 1))
    return b"".join(out)


def test_replay_reports_on_the_sharded_pool(sim: SimulatedDevice) -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    stats = mr.StatisticsResourceAdaptor(pool)
    r = _native.replay(stats, _log(), gap_scale=0)
    assert (r["events"], r["threads"], r["streams"], r["oom_events"]) == (600, 3, 3, 0)
    assert r["allocate_ns"]["count"] == 300 and r["free_ns"]["count"] == 300
    a = r["allocate_ns"]
    assert a["p50"] <= a["p90"] <= a["p99"] <= a["p999"] <= a["max"]
    assert r["alloc_seconds"] > 0 and r["seconds"] > 0
    assert r["peak_reserved_bytes"] is not None and r["peak_reserved_bytes"] >= r["peak_live_bytes"] > 0
    assert r["synchronizations"] is not None and r["waits"] is not None  # the pool beneath counts them
    assert r["simulated"] is True and r["resource"] == "StatisticsResourceAdaptor"
    assert stats.allocation_counts.current_bytes == 0  # everything was freed
    # The driver's pool reports its reserved bytes, not synchronisations.
    r = _native.replay(mr.CudaAsyncMemoryResource(), _log(60), gap_scale=0.5)
    assert r["peak_reserved_bytes"] is not None and r["synchronizations"] is None
    # A plain resource reports no footprint.
    assert _native.replay(mr.CudaMemoryResource(), _log(30), gap_scale=0)["peak_reserved_bytes"] is None


def test_replay_keeps_each_streams_sequence_of_operations(sim: SimulatedDevice) -> None:
    records = _log(240, threads=3)
    lines: list[str] = []
    logged = mr.LoggingResourceAdaptor(
        mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()), callback=lines.append
    )
    _native.replay(logged, records, gap_scale=0)
    # Recorded: per stream label, the (action, size) sequence (sizes of frees from their allocations).
    sizes: dict[int, int] = {}
    recorded: dict[int, list[tuple[str, int]]] = {}
    for _t_ns, size, alloc_id, _thread, stream, op in REC.iter_unpack(records):
        if op == 0:
            sizes[alloc_id] = size
        recorded.setdefault(stream, []).append(("allocate" if op == 0 else "free", sizes[alloc_id]))
    # Replayed: per stream handle, from the log's lines.
    replayed: dict[str, list[tuple[str, int]]] = {}
    for line in lines[1:]:
        _thread, _time, action, _ptr, size, stream = line.split(",")
        replayed.setdefault(stream, []).append((action, int(size)))
    assert sorted(replayed.values()) == sorted(recorded.values())


def test_the_null_resource_measures_the_replayer_alone(sim: SimulatedDevice) -> None:
    null = _native._NullMemoryResource()
    r = _native.replay(null, _log(300), gap_scale=0)
    assert (r["events"], r["allocate_ns"]["count"], r["free_ns"]["count"]) == (600, 300, 300)
    assert r["peak_reserved_bytes"] is None and r["resource"] == "NullMemoryResource"
    a, b = null.allocate(256), null.allocate(256)
    assert a != b and a % 256 == 0  # distinct, aligned, and never to be used
    null.deallocate(a, 256)
    null.deallocate(b, 256)


def test_replay_counts_out_of_memory_and_goes_on(sim: SimulatedDevice) -> None:
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "1MiB")
    log = b"".join(
        [
            REC.pack(0, 768 << 10, 1, 0, 0, 0),
            REC.pack(1, 512 << 10, 2, 0, 0, 0),  # over the limit
            REC.pack(2, 0, 2, 1, 1, 1),  # its free, on another thread: skipped
            REC.pack(3, 0, 1, 1, 1, 1),
        ]
    )
    r = _native.replay(limited, log, gap_scale=0)
    assert (r["oom_events"], r["allocate_ns"]["count"], r["free_ns"]["count"]) == (1, 1, 1)
    assert r["peak_live_bytes"] == 768 << 10
    assert limited.get_allocated_bytes() == 0


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (b"x" * 41, "41 bytes is not a multiple of 40"),
        (REC.pack(0, 64, 1, 0, 0, 3), "record 0: op 3"),
        (REC.pack(0, 64, 1, 0, 0, 0) + REC.pack(1, 64, 2, 0, 0, 1), "record 1: free of allocation id 2"),
        (
            REC.pack(0, 64, 1, 0, 0, 0) + REC.pack(1, 64, 1, 0, 0, 0),
            "record 1: allocation id 1 is allocated again",
        ),
        (
            REC.pack(0, 64, 1, 0, 0, 0) + REC.pack(1, 32, 1, 0, 0, 1),
            "with size 32, but it was allocated with 64",
        ),
    ],
)
def test_bad_logs_name_the_record(sim: SimulatedDevice, records: bytes, message: str) -> None:
    resource = mr.CudaAsyncMemoryResource()
    with pytest.raises(streampool.InvalidArgumentError, match=message):
        _native.replay(resource, records)
    assert _native.replay(resource, _log(30), gap_scale=0)["events"] == 60  # still usable


def test_bad_arguments(sim: SimulatedDevice) -> None:
    resource = mr.CudaAsyncMemoryResource()
    with pytest.raises(streampool.InvalidArgumentError, match="gap_scale"):
        _native.replay(resource, b"", gap_scale=-1)
    with pytest.raises(TypeError):
        _native.replay(resource, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.replay(object(), b"")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pairs must be >= 1, got 0"):
        _native.pipeline(resource, pairs=0)
    with pytest.raises(streampool.InvalidArgumentError, match="chunk_bytes must be >= 8"):
        _native.pipeline(resource, chunk_bytes=4)
    with pytest.raises(streampool.InvalidArgumentError, match="kernel_us"):
        _native.pipeline(resource, kernel_us=-1.0)
    with pytest.raises(ValueError, match="chunks_per_pair must be >= 0, got -1"):
        _native.pipeline(resource, chunks_per_pair=-1)
    for depth in (1 << 40, 2**62):  # its queue's slots are made up front (was: an abort)
        with pytest.raises(ValueError, match=r"queue_depth must be <= 65536"):
            _native.pipeline(resource, queue_depth=depth, chunks_per_pair=2)
    with pytest.raises(streampool.InvalidArgumentError, match="kernel_us must be a number from 0"):
        _native.pipeline(resource, kernel_us=1e300)
    for chunks in (1 << 40, 2**63):  # refused before anything is reserved (was: an abort)
        with pytest.raises(ValueError, match=r"chunks_per_pair must be <= 4294967296"):
            _native.pipeline(resource, chunks_per_pair=chunks)


def test_pipeline_moves_every_chunk_intact(sim: SimulatedDevice) -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    r = _native.pipeline(pool, pairs=2, chunk_bytes="64KiB", chunks_per_pair=30, kernel_us=5, queue_depth=2)
    assert (r["chunks"], r["checked"], r["mismatches"]) == (60, 60, 0)
    assert r["allocate_ns"]["count"] == 60 and r["free_ns"]["count"] == 60
    assert (
        r["peak_reserved_bytes"] is not None and r["peak_reserved_bytes"] >= r["peak_live_bytes"] >= 64 << 10
    )
    assert 0 < r["alloc_share"] < 1 and r["compute_iterations"] >= 1
    assert r["chunks_per_second"] > 0 and r["longest_call_ns"] >= r["allocate_ns"]["p50"]
    # The pool's own driver calls, by kind; every chunk crossed streams, so events were
    # recorded to order the reuse.
    calls = r["driver_calls"]
    assert calls is not None and calls["event_records"] > 0
    kinds = ("event_records", "event_queries", "stream_waits", "synchronizations", "growths")
    assert calls["total"] == sum(calls[k] for k in kinds)
    assert r["driver_calls_per_chunk"] == pytest.approx(calls["total"] / 60)
    # The driver's pool does not count its calls.
    plain = _native.pipeline(
        mr.CudaAsyncMemoryResource(), chunk_bytes="64KiB", chunks_per_pair=5, kernel_us=0
    )
    assert plain["driver_calls"] is None and plain["driver_calls_per_chunk"] is None
    assert "long_calls" not in plain  # not asked


def test_pipeline_classifies_long_calls(sim: SimulatedDevice) -> None:
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    # Every call is over a threshold of 1 ns: each is counted once, in one class.
    r = _native.pipeline(
        pool, pairs=2, chunk_bytes="64KiB", chunks_per_pair=20, kernel_us=0, long_call_us=0.001
    )
    long = r["long_calls"]
    assert long["over_ns"] == 1 and long["calls"] == 80
    assert long["preempted"] + long["slept"] + long["stolen"] + long["on_cpu"] == long["calls"]
    assert set(long["sampled"]) == {"running", "futex", "ioctl", "sched_yield", "sleep", "other"}
    assert sum(long["sampled"].values()) <= long["calls"]
    assert set(long["running_in"]) == {"driver", "streampool", "system", "other", "ended", "unanswered"}
    assert sum(long["running_in"].values()) == long["sampled"]["running"]
    assert "null_calls" not in r  # not asked
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="long_call_us"):
            _native.pipeline(pool, chunks_per_pair=2, long_call_us=bad)
        with pytest.raises(ValueError, match="null_call_us"):
            _native.pipeline(pool, chunks_per_pair=2, long_call_us=1, null_call_us=bad)
    for bad_shape in ({"null_call_us": 1}, {"long_call_us": 1, "null_call_us": 101}):
        with pytest.raises(ValueError, match="null_call_us"):  # named as the caller passed it
            _native.pipeline(pool, chunks_per_pair=2, **bad_shape)
    # A null call after each of the 80 allocator calls, 5 µs each: all over 1 ns.
    r = _native.pipeline(
        pool,
        pairs=2,
        chunk_bytes="64KiB",
        chunks_per_pair=20,
        kernel_us=0,
        long_call_us=0.001,
        null_call_us=5,
    )
    null = r["null_calls"]
    assert null["over_ns"] == 1 and null["calls"] == 80
    assert null["preempted"] + null["slept"] + null["stolen"] + null["on_cpu"] == 80


@pytest.mark.gpu
@pytest.mark.parametrize(
    "make", [mr.CudaAsyncMemoryResource, lambda: mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())]
)
def test_replay_and_pipeline_on_a_gpu(make: object) -> None:
    resource = make()  # type: ignore[operator]
    r = _native.replay(resource, _log(3000, threads=4), gap_scale=0)
    assert r["events"] == 6000 and r["oom_events"] == 0 and r["simulated"] is False
    assert r["peak_reserved_bytes"] >= r["peak_live_bytes"] > 0
    p = _native.pipeline(resource, pairs=4, chunk_bytes="1MiB", chunks_per_pair=500, kernel_us=20)
    assert p["mismatches"] == 0 and p["checked"] == 2000 and p["chunks"] == 2000
    assert (p["driver_calls"] is None) == isinstance(resource, mr.CudaAsyncMemoryResource)


@pytest.mark.nosim
def test_ctrl_c_stops_a_native_replay_at_once(tmp_path) -> None:
    """A replay of a log with an hour between two events stops on SIGINT, as the Python
    replayer does, instead of sleeping out the hour."""
    code = textwrap.dedent(
        """
        import os, signal, struct, threading, time
        from streampool import _native, mr
        rec = struct.Struct("<QQQIIB7x")
        records = rec.pack(0, 4096, 1, 0, 0, 0) + rec.pack(3_600 * 10**9, 4096, 1, 0, 0, 1)
        limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "1GiB")
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            _native.replay(limited, records, gap_scale=1.0)
        except KeyboardInterrupt:
            print("interrupted", limited.get_allocated_bytes())
        """
    )
    env = dict(os.environ, STREAMPOOL_DEVICE="sim")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["interrupted", "0"], out.stdout


def test_the_default_lead_is_one_figure_everywhere() -> None:
    # The native replayer's default, its signature's (which the stubs copy) and the
    # harness's are the same 1 ms.
    import inspect

    from streampool.harness import trace

    assert inspect.signature(_native.replay).parameters["max_lead"].default == trace.MAX_LEAD == 0.001
