"""What a typed program sees: the documented API under ``mypy --strict`` (``make lint``
checks this file; ``tests/test_typed_usage.py`` runs it on the simulated device, so the
types asserted here are the run time's too)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import assert_type, get_origin

import numpy as np

import streampool
from streampool import DeviceBuffer, Stream, mr
from streampool.allocators import cupy as sp_cupy
from streampool.harness.trace import read_log
from streampool.pylibrmm.stream import Stream as RmmPathStream
from streampool.statistics import Statistics


def host_arrays() -> None:
    """NumPy arrays are host buffers (NumPy declares the buffer protocol from 3.12 only)."""
    data = np.arange(16, dtype=np.uint8)
    buf = DeviceBuffer.to_device(data)
    buf.copy_from_host(np.zeros(16, np.uint8))
    out = buf.copy_to_host(np.empty(16, np.uint8))
    assert_type(out, np.ndarray[tuple[int], np.dtype[np.uint8]])
    assert bytes(out) == bytes(16)


def streams() -> None:
    s = Stream(None, mr.CudaStreamFlags.NON_BLOCKING)  # RMM's positional order
    buf = DeviceBuffer(size=64, stream=s)
    got = buf.stream
    assert isinstance(got, Stream) and got == s
    assert RmmPathStream is Stream


def resources() -> None:
    previous = mr.set_current_device_resource(mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource()))
    try:
        DeviceBuffer(size=1000)
        stats = streampool.get_current_device_resource()
        assert isinstance(stats, mr.StatisticsResourceAdaptor)
        counts = stats.allocation_counts
        assert_type(counts, Statistics)
        assert counts.total_bytes == 1000
    finally:
        if previous is not None:
            mr.set_current_device_resource(previous)
    owner = mr.CudaAsyncMemoryResource(initial_pool_size="2MiB")
    view = mr.CudaAsyncViewMemoryResource(owner.pool_handle)
    assert int(view.pool_handle) == int(owner.pool_handle)


def over_any_resource(stats: mr.StatisticsResourceAdaptor) -> None:
    assert_type(stats.upstream_mr, mr.MemoryResource)  # a bare name: an adaptor over any resource


def adaptor_stacks() -> None:
    # An adaptor's upstream keeps its type: the pool's own methods, without a cast.
    upstream = mr.CudaAsyncMemoryResource(initial_pool_size="2MiB")  # a driver pool of its own
    pool = mr.PoolMemoryResource(upstream, initial_pool_size="2MiB")
    stats = mr.StatisticsResourceAdaptor(pool)
    assert_type(stats.upstream_mr, mr.PoolMemoryResource[mr.CudaAsyncMemoryResource])
    over_any_resource(stats)
    tracked: mr.TrackingResourceAdaptor[mr.StatisticsResourceAdaptor[mr.PoolMemoryResource]]
    tracked = mr.TrackingResourceAdaptor(stats)
    tracked.deallocate(tracked.allocate(1000), 1000)
    assert tracked.upstream_mr.upstream_mr.pool_size() == 1 << 21
    assert stats.upstream_mr.release() == 1 << 21
    stats.upstream_mr.upstream_mr.trim_to(0)
    # Subscripted at run time too (an annotation outside `from __future__ import annotations`).
    alias = mr.LimitingResourceAdaptor[mr.ShardedPoolMemoryResource]
    assert get_origin(alias) is mr.LimitingResourceAdaptor


def errors() -> None:
    try:
        mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), 256).allocate(1 << 20)
    except (sp_cupy.OutOfMemoryError, MemoryError):  # a class with CuPy or without
        pass
    else:
        raise AssertionError("1 MiB under a limit of 256 bytes")


def logs() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "app.log"
        path.write_text(streampool.logs.LOG_HEADER + "\n")
        assert read_log(path).records == []


def setup() -> None:
    streampool.reinitialize(pool_allocator=True, initial_pool_size=np.int64(1 << 21))  # NumPy ints
    try:
        pool = streampool.get_current_device_resource()
        assert isinstance(pool, mr.PoolMemoryResource) and pool.pool_size() == 1 << 21
    finally:
        streampool.reinitialize()


def main() -> None:
    host_arrays()
    streams()
    resources()
    adaptor_stacks()
    errors()
    logs()
    setup()


if __name__ == "__main__":
    main()
