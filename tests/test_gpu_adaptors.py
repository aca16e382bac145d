"""On a real GPU (STREAMPOOL_GPU_TESTS=1): adaptor stacks over the driver's pool."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import streampool
from streampool import mr
from streampool.logs import parse_log

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_stack_over_the_driver(tmp_path: pathlib.Path) -> None:
    assert not streampool.using_simulated_device()
    log = tmp_path / "gpu.csv"
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    limited = mr.LimitingResourceAdaptor(stats, "256MiB")
    tracked = mr.TrackingResourceAdaptor(limited, capture_stacks=True)
    top = mr.LoggingResourceAdaptor(tracked, log)
    a, b = streampool.Stream(), streampool.Stream()
    payloads = [bytes([i]) * (i * MiB + 123) for i in range(1, 6)]
    bufs = [
        streampool.DeviceBuffer.to_device(p, stream=a if i % 2 else b, mr=top) for i, p in enumerate(payloads)
    ]
    for buf, p in zip(bufs, payloads):
        assert buf.ptr % 256 == 0
        assert buf.tobytes() == p
    sizes = [len(p) for p in payloads]
    counts = stats.allocation_counts
    assert (counts.current_bytes, counts.current_count, counts.total_count) == (sum(sizes), 5, 5)
    assert {(r.ptr, r.size) for r in tracked.outstanding()} == {(buf.ptr, buf.size) for buf in bufs}
    assert all(r.stack and "test_stack_over_the_driver" in r.stack for r in tracked.outstanding())
    assert limited.get_allocated_bytes() == sum(-(-n // 256) * 256 for n in sizes)  # each rounded up to 256
    with pytest.raises(streampool.OutOfMemoryError) as info:
        top.allocate("300MiB", a)
    assert info.value.requested == 300 * MiB
    ptrs = [buf.ptr for buf in bufs]
    del bufs, buf
    a.synchronize()
    b.synchronize()
    assert tracked.outstanding() == [] and limited.get_allocated_bytes() == 0
    counts = stats.allocation_counts
    assert (counts.current_bytes, counts.peak_bytes, counts.total_bytes) == (0, sum(sizes), sum(sizes))
    events = parse_log(log)
    assert [e.action for e in events] == ["allocate"] * 5 + ["allocate failure"] + ["free"] * 5
    assert [e.ptr for e in events[:5]] == ptrs and sorted(e.ptr for e in events[6:]) == sorted(ptrs)
    assert [e.size for e in events[:5]] == sizes
    assert {e.stream for e in events[:5]} == {a.handle, b.handle}


def test_failure_callback_on_real_out_of_memory() -> None:
    calls: list[int] = []
    too_much = 2 * streampool.device_info()["total_bytes"]
    # A pool of its own, trimmed after: on a failed allocation the driver grows a pool to
    # the whole card before giving up, and the shared pool (release threshold: the
    # maximum) would keep it all, starving managed memory and other processes.
    own = mr.CudaAsyncMemoryResource(release_threshold=0)
    adaptor = mr.FailureCallbackResourceAdaptor(own, lambda n: calls.append(n) or False)
    try:
        with pytest.raises(streampool.OutOfMemoryError) as info:
            adaptor.allocate(too_much)
        assert calls == [too_much] and info.value.requested == too_much
        buf = streampool.DeviceBuffer.to_device(b"after" * 1000, mr=adaptor)
        assert buf.tobytes() == b"after" * 1000
        del buf
    finally:
        streampool.DEFAULT_STREAM.synchronize()
        own.trim_to(0)
    assert own.reserved_bytes < 1 << 30


def test_prefetch_managed_round_trip() -> None:
    prefetch = mr.PrefetchResourceAdaptor(mr.ManagedMemoryResource())
    s = streampool.Stream()
    payload = bytes(range(256)) * 4096
    buf = streampool.DeviceBuffer.to_device(payload, stream=s, mr=prefetch)
    assert buf.tobytes() == payload


def test_binning_round_trip_across_streams() -> None:
    binning = mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 8, 20)
    a, b = streampool.Stream(), streampool.Stream()
    for i in range(40):
        n = 100 << (i % 15)
        buf = streampool.DeviceBuffer.to_device(bytes([i]) * n, stream=a if i % 2 else b, mr=binning)
        assert buf.tobytes() == bytes([i]) * n
        del buf
        other = streampool.DeviceBuffer(size=n, stream=b if i % 2 else a, mr=binning)
        other.copy_from_host(bytes([255 - i]) * n)
        assert other.tobytes() == bytes([255 - i]) * n


def test_binning_gives_free_chunks_back_when_its_upstream_runs_out() -> None:
    # 40 streams each holding a 1 MiB buffer at once under a 64 MiB limit: the 1 MiB bin's
    # chunks hold them; once freed, a request of another bin, and one larger than every
    # bin, get its wholly free chunks given back rather than an out-of-memory with nothing
    # live.
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "64MiB")
    binning = mr.BinningMemoryResource(limited, 10, 20)
    streams = [streampool.Stream() for _ in range(40)]
    bufs = [
        streampool.DeviceBuffer.to_device(bytes([i]) * MiB, stream=s, mr=binning)
        for i, s in enumerate(streams)
    ]
    assert [b.tobytes()[-1:] for b in bufs] == [bytes([i]) for i in range(40)]
    del bufs, streams
    held = limited.get_allocated_bytes()
    assert held >= 32 * MiB
    small = streampool.DeviceBuffer.to_device(b"x" * 1000, mr=binning)
    large = streampool.DeviceBuffer.to_device(b"y" * (48 * MiB), mr=binning)
    assert small.tobytes() == b"x" * 1000 and large.tobytes()[-1:] == b"y"
    assert limited.get_allocated_bytes() < held + 48 * MiB


def test_binning_streams_in_turn_reuse_one_chunk_on_the_gpu() -> None:
    # A stream per task, one after another: each takes the blocks the last one freed (after
    # a wait on its event) instead of a chunk of its own; the data reads back right.
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "64MiB")
    binning = mr.BinningMemoryResource(limited, 10, 20)
    for i in range(40):
        s = streampool.Stream()
        buf = streampool.DeviceBuffer.to_device(bytes([i]) * MiB, stream=s, mr=binning)
        assert buf.tobytes() == bytes([i]) * MiB
        del buf, s
    assert limited.get_allocated_bytes() <= 4 * MiB


def test_exit_with_live_buffers_and_python_callbacks_on_the_gpu_is_quiet() -> None:
    from .test_adaptors import EXIT_SCRIPT

    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (0, "ok\n", "")
