"""The RMM names that make "switch from RMM by changing an import" hold: reinitialize and
its companions, CallbackMemoryResource, ArenaMemoryResource, CudaStreamFlags, Stream(obj),
available_device_memory, pool_handle(), add_bin, and the statistics and tracking output."""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

from .conftest import SIM_CAPACITY

MiB = 1 << 20


@pytest.fixture
def two_devices() -> Iterator[SimulatedDevice]:
    with SimulatedDevice(capacity_bytes=SIM_CAPACITY, devices=2) as dev:
        yield dev


@pytest.fixture(autouse=True)
def _no_hooks() -> Iterator[None]:
    yield
    streampool._setup._reinitialize_hooks.clear()
    streampool._setup._configured_devices = None


def _roundtrip(resource: mr.MemoryResource) -> None:
    ptr = resource.allocate(1000)
    assert ptr != 0
    resource.deallocate(ptr, 1000)


# --- reinitialize ----------------------------------------------------------------------


def test_reinitialize_defaults_to_the_drivers_pool() -> None:
    mr.set_current_device_resource(mr.CudaMemoryResource())
    streampool.reinitialize()
    assert type(mr.get_current_device_resource()) is mr.CudaAsyncMemoryResource
    assert streampool.is_initialized() and mr.is_initialized()


@pytest.mark.nosim
def test_reinitialize_pool_managed_and_every_listed_device(two_devices: SimulatedDevice) -> None:
    streampool.reinitialize(
        pool_allocator=True, managed_memory=True, maximum_pool_size="64MiB", devices=[0, 1]
    )
    for d in (0, 1):
        pool = mr.get_per_device_resource(d)
        assert (
            type(pool) is mr.PoolMemoryResource
            and mr.get_per_device_resource_type(d) is mr.PoolMemoryResource
        )
        assert type(pool.upstream) is mr.ManagedMemoryResource and pool.device == d
        assert pool.stats["reserved_bytes"] == 0  # no initial size: nothing up front
        _roundtrip(pool)
        with pytest.raises(streampool.OutOfMemoryError):
            pool.allocate(65 * MiB)
    # Device 1 is not listed the next time: it goes back to its initial resource.
    streampool.reinitialize(devices=0)
    assert type(mr.get_per_device_resource(1)) is mr.CudaAsyncMemoryResource


@pytest.mark.nosim
def test_reinitialize_logs_per_device_with_rmms_file_names(
    two_devices: SimulatedDevice, tmp_path: Path
) -> None:
    streampool.reinitialize(devices=[0, 1], logging=True, log_file_name=tmp_path / "alloc.csv")
    names = mr.get_log_filenames()
    assert names == {0: str(tmp_path / "alloc.dev0.csv"), 1: str(tmp_path / "alloc.dev1.csv")}
    for d in (0, 1):
        logged = mr.get_per_device_resource(d)
        assert isinstance(logged, mr.LoggingResourceAdaptor)
        _roundtrip(logged)
        logged.flush()
        lines = Path(names[d] or "").read_text().splitlines()
        assert lines[0] == streampool.logs.LOG_HEADER and len(lines) == 3
    streampool.disable_logging()
    assert mr.get_log_filenames() == {0: None, 1: None}
    streampool.enable_logging(tmp_path / "again.log")
    assert mr.get_log_filenames()[1] == str(tmp_path / "again.dev1.log")


def test_reinitialize_takes_what_rmm_takes_and_enable_logging_is_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sizes in the wrong order are ignored without a pool, as RMM ignores them.
    streampool.reinitialize(initial_pool_size="2MiB", maximum_pool_size="1MiB")
    assert type(mr.get_current_device_resource()) is mr.CudaAsyncMemoryResource
    # No devices: every device gets its initial resource back, and nothing logs.
    mr.set_current_device_resource(mr.CudaMemoryResource())
    streampool.reinitialize(devices=[], logging=True)
    assert type(mr.get_current_device_resource()) is mr.CudaAsyncMemoryResource
    assert mr.get_log_filenames() == {}
    # enable_logging where every configured device logs already needs no file name.
    monkeypatch.delenv("STREAMPOOL_LOG_FILE", raising=False)
    monkeypatch.delenv("RMM_LOG_FILE", raising=False)
    streampool.reinitialize(logging=True, log_file_name=tmp_path / "alloc.csv")
    logged = mr.get_current_device_resource()
    streampool.enable_logging()
    assert mr.get_current_device_resource() is logged
    streampool.disable_logging()
    with pytest.raises(ValueError, match="log_file_name"):
        streampool.enable_logging()


def test_reinitialize_log_file_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMPOOL_LOG_FILE", raising=False)
    monkeypatch.setenv("RMM_LOG_FILE", str(tmp_path / "rmm.log"))
    streampool.reinitialize(logging=True)
    assert mr.get_log_filenames() == {0: str(tmp_path / "rmm.dev0.log")}
    monkeypatch.delenv("RMM_LOG_FILE")
    before = mr.get_current_device_resource()
    with pytest.raises(ValueError, match="log_file_name"):
        streampool.reinitialize(logging=True)
    assert mr.get_current_device_resource() is before


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pool_allocator": "yes"}, TypeError, "pool_allocator must be True or False"),
        ({"managed_memory": 2}, TypeError, "managed_memory"),
        ({"logging": None}, TypeError, "logging"),
        ({"initial_pool_size": "lots"}, ValueError, "initial_pool_size"),
        ({"maximum_pool_size": -1}, ValueError, "maximum_pool_size"),
        (
            {"pool_allocator": True, "initial_pool_size": "2MiB", "maximum_pool_size": "1MiB"},
            ValueError,
            "larger",
        ),
        ({"devices": 5}, ValueError, "device 5 does not exist"),
        ({"devices": [0, -1]}, ValueError, "device -1"),
        ({"devices": True}, TypeError, "devices"),
        ({"devices": ["0"]}, TypeError, "not a device ordinal"),
        ({"logging": True, "log_file_name": 3}, TypeError, "log_file_name"),
    ],
)
def test_reinitialize_bad_arguments_change_nothing(
    kwargs: dict[str, object], error: type, match: str
) -> None:
    hook_calls: list[int] = []
    streampool.register_reinitialize_hook(hook_calls.append, 1)
    before = mr.get_current_device_resource()
    with pytest.raises(error, match=match):
        streampool.reinitialize(**kwargs)  # type: ignore[arg-type]
    assert mr.get_current_device_resource() is before and hook_calls == []
    _roundtrip(before)


def test_reinitialize_hooks_run_first_latest_first() -> None:
    order: list[str] = []
    seen: list[type] = []
    streampool.register_reinitialize_hook(order.append, "first")
    assert streampool.register_reinitialize_hook(lambda: seen.append(type(mr.get_current_device_resource())))
    streampool.register_reinitialize_hook(order.append, "last")
    mr.set_current_device_resource(mr.CudaMemoryResource())
    streampool.reinitialize()
    assert order == ["last", "first"] and seen == [mr.CudaMemoryResource]  # before the change
    streampool.unregister_reinitialize_hook(order.append)
    streampool.reinitialize()
    assert order == ["last", "first"]
    with pytest.raises(TypeError, match="callable"):
        streampool.register_reinitialize_hook(42)  # type: ignore[arg-type]


def test_a_reinitialize_hook_may_unregister_hooks_as_they_run() -> None:
    calls: list[str] = []

    def first() -> None:
        calls.append("first")

    def last() -> None:
        calls.append("last")
        streampool.unregister_reinitialize_hook(first)
        streampool.unregister_reinitialize_hook(last)

    streampool.register_reinitialize_hook(first)
    streampool.register_reinitialize_hook(last)
    streampool.reinitialize()
    assert calls == ["last", "first"]  # each once, the list as it was when the call began
    streampool.reinitialize()
    assert calls == ["last", "first"]


@pytest.mark.nosim
@pytest.mark.parametrize(
    "error",
    [
        streampool.CudaDriverNotFoundError("no driver"),
        streampool.InvalidArgumentError('the environment variable STREAMPOOL_SIM_DEVICES is "0"'),
    ],
)
def test_is_initialized_is_false_when_resources_cannot_be_made(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    def refused() -> str:
        raise error

    monkeypatch.setattr(streampool._setup, "backend_description", refused)
    assert streampool.is_initialized() is False


# --- CallbackMemoryResource ------------------------------------------------------------


def test_callback_resource_calls_rmms_signatures() -> None:
    base = mr.CudaAsyncMemoryResource()
    calls: list[tuple[object, ...]] = []

    def allocate(size: int, stream: streampool.Stream) -> int:
        calls.append(("allocate", size, stream))
        return base.allocate(size, stream)

    def deallocate(ptr: int, size: int, stream: streampool.Stream) -> None:
        calls.append(("deallocate", ptr, size, stream))
        base.deallocate(ptr, size, stream)

    cb = mr.CallbackMemoryResource(allocate, deallocate)
    s = streampool.Stream()
    ptr = cb.allocate(1000, s)
    cb.deallocate(ptr, 1000, s)
    assert calls == [("allocate", 1000, s), ("deallocate", ptr, 1000, s)]
    calls.clear()
    with streampool.DeviceBuffer(size=10, mr=cb):
        pass
    assert [c[0] for c in calls] == ["allocate", "deallocate"]
    assert calls[0][2] is streampool.DEFAULT_STREAM
    assert cb.allocate(0) == 0 and len(calls) == 2  # zero bytes never reach the functions
    # Its repr names its device and backend, as every resource's does.
    assert repr(cb) == f"<CallbackMemoryResource(device=0, {base.backend})>"


def test_a_buffer_whose_free_fails_stays_open_and_closes_on_a_retry() -> None:
    base = mr.CudaAsyncMemoryResource()
    refuse = [True]

    def deallocate(ptr: int, size: int, stream: streampool.Stream) -> None:
        if refuse.pop():
            raise KeyboardInterrupt  # Ctrl-C inside the free: nothing freed
        base.deallocate(ptr, size, stream)

    stats = mr.StatisticsResourceAdaptor(mr.CallbackMemoryResource(base.allocate, deallocate))
    buf = streampool.DeviceBuffer(size=1000, mr=stats)
    ptr = buf.ptr  # read by Python code: a hand free of it is refused while the buffer owns it
    with pytest.raises(KeyboardInterrupt):
        buf.close()
    assert not buf.closed and stats.allocation_counts.current_bytes == 1000
    with pytest.raises(streampool.InvalidPointerError):
        stats.deallocate(ptr, 1000)  # still refused: the buffer is open again
    refuse.append(False)
    buf.close()
    assert buf.closed and stats.allocation_counts.current_bytes == 0


def test_callback_resource_holds_no_lock_across_the_call() -> None:
    """The allocate function frees, through the same resource, from another thread and
    waits for it: a lock held across the call would deadlock."""
    base = mr.CudaAsyncMemoryResource()
    held: list[int] = []

    def allocate(size: int, stream: streampool.Stream) -> int:
        if held:
            t = threading.Thread(target=cb.deallocate, args=(held.pop(), 64))
            t.start()
            t.join(timeout=10)
            assert not t.is_alive()
        return base.allocate(size, stream)

    cb = mr.CallbackMemoryResource(allocate, base.deallocate)
    held.append(cb.allocate(64))
    _roundtrip(cb)
    assert held == []


def test_callback_resource_bad_functions_and_results() -> None:
    base = mr.CudaAsyncMemoryResource()
    with pytest.raises(TypeError, match="allocate_func must be callable"):
        mr.CallbackMemoryResource(3, base.deallocate)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="deallocate_func must be callable"):
        mr.CallbackMemoryResource(base.allocate, None)  # type: ignore[arg-type]

    answers: list[object] = []

    def allocate(size: int, stream: streampool.Stream) -> object:
        answer = answers.pop()
        if isinstance(answer, Exception):
            raise answer
        return base.allocate(size, stream) if answer is None else answer

    def deallocate(ptr: int, size: int, stream: streampool.Stream) -> None:
        if ptr == 0xBAD00:
            raise KeyError("not mine")
        base.deallocate(ptr, size, stream)

    cb = mr.CallbackMemoryResource(allocate, deallocate)  # type: ignore[arg-type]
    boom = RuntimeError("boom")
    for answer, error, match in [
        (boom, RuntimeError, "boom"),
        ("0x10", TypeError, "must return the address as an int, not str"),
        (True, TypeError, "not bool"),
        (-1, ValueError, "not an address"),
        (0, streampool.OutOfMemoryError, "returned 0"),
    ]:
        answers.append(answer)
        with pytest.raises(error, match=match) as info:
            cb.allocate(100)
        if answer is boom:
            assert info.value is boom  # the very exception
    with pytest.raises(KeyError, match="not mine"):
        cb.deallocate(0xBAD00, 100)
    answers.append(None)
    _roundtrip_ptr = cb.allocate(100)  # still usable
    cb.deallocate(_roundtrip_ptr, 100)


class Address:
    """An integer type that is not int, as NumPy's uint64 is: it has ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_callback_allocate_may_return_any_integer_type() -> None:
    base = mr.CudaAsyncMemoryResource()
    cb = mr.CallbackMemoryResource(
        lambda size, stream: Address(base.allocate(size, stream)),  # type: ignore[arg-type,return-value]
        lambda ptr, size, stream: base.deallocate(ptr, size, stream),
    )
    buf = streampool.DeviceBuffer.to_device(b"integer types", mr=cb)
    assert bytes(buf) == b"integer types"


@pytest.mark.drop_errors_expected
def test_an_exception_of_deallocate_func_at_collection_reaches_the_unraisable_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # RMM's test_callback_mr_reports_deallocation_errors.
    import sys

    gc.collect()  # earlier tests' garbage, whose clean-up may record drop errors too
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: seen.append(info.exc_value))
    base = mr.CudaAsyncMemoryResource()
    failure = RuntimeError("My dealloc error")

    def deallocate(ptr: int, size: int, stream: streampool.Stream) -> None:
        base.deallocate(ptr, size, stream)
        raise failure

    cb = mr.CallbackMemoryResource(lambda size, stream: base.allocate(size, stream), deallocate)
    buf = streampool.DeviceBuffer(size=256, mr=cb)
    del buf
    gc.collect()
    assert seen == [failure], seen
    assert any("My dealloc error" in e for e in streampool.drop_errors()[1])


def test_upstream_mr_is_rmms_name_for_the_upstream() -> None:
    base = mr.CudaAsyncMemoryResource()
    for adaptor in (mr.StatisticsResourceAdaptor(base), mr.PoolMemoryResource(base)):
        if isinstance(adaptor, mr.UpstreamResourceAdaptor):
            assert adaptor.upstream_mr is base


# --- ArenaMemoryResource ---------------------------------------------------------------


def test_arena_reserves_its_size_up_front_and_never_grows() -> None:
    up = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    arena = mr.ArenaMemoryResource(up, arena_size="8MiB")
    assert isinstance(arena, mr.UpstreamResourceAdaptor)
    assert (arena.arena_size, arena.pool_size(), arena.dump_log_on_failure) == (8 * MiB, 8 * MiB, False)
    assert up.allocation_counts.current_bytes == 8 * MiB
    s1, s2 = streampool.Stream(), streampool.Stream()
    a, b = arena.allocate(MiB, s1), arena.allocate(MiB, s2)
    with pytest.raises(streampool.OutOfMemoryError):
        arena.allocate(7 * MiB, s1)
    arena.deallocate(a, MiB, s1)
    arena.deallocate(b, MiB, s2)
    assert up.allocation_counts.peak_bytes == 8 * MiB  # never more than the arena
    _roundtrip(arena)


def test_arena_has_the_pools_stats_and_release_and_keeps_its_reservation() -> None:
    up = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    arena = mr.ArenaMemoryResource(up, arena_size="8MiB")
    assert arena.stats["reserved_bytes"] == 8 * MiB
    # More than the arena holds: refused at once, naming the arena, with nothing given back.
    with pytest.raises(
        streampool.OutOfMemoryError, match=r"ArenaMemoryResource, a ShardedPoolMemoryResource"
    ):
        arena.allocate(16 * MiB)
    assert arena.pool_size() == 8 * MiB
    assert arena.stats["synchronizations"] == 0
    ptr = arena.allocate(MiB)
    assert arena.stats["used_bytes"] == MiB
    arena.deallocate(ptr, MiB)
    assert arena.release() == 8 * MiB
    assert arena.pool_size() == 0 == up.allocation_counts.current_bytes
    _roundtrip(arena)  # grows again on demand


def test_arena_default_size_is_half_the_free_memory() -> None:
    free, _ = mr.available_device_memory()
    arena = mr.ArenaMemoryResource(mr.CudaAsyncMemoryResource())
    assert arena.arena_size == free // 2 // 256 * 256


def test_arena_bad_sizes() -> None:
    up = mr.CudaAsyncMemoryResource()
    for size, error in [
        (100, ValueError),
        (0, ValueError),
        (-1, ValueError),
        ("big", ValueError),
        (1.5, TypeError),
        (2**64 - 1, ValueError),  # named as arena_size, not as the pool inside it
    ]:
        with pytest.raises(error, match="size"):
            mr.ArenaMemoryResource(up, arena_size=size)  # type: ignore[arg-type]
    with pytest.raises(
        streampool.OutOfMemoryError, match=r"ArenaMemoryResource \(reserving its arena_size"
    ) as info:
        mr.ArenaMemoryResource(up, arena_size=2 * SIM_CAPACITY)
    assert "ShardedPool" not in str(info.value) and info.value.requested == 2 * SIM_CAPACITY
    _roundtrip(mr.ArenaMemoryResource(up, arena_size="1MiB"))


def test_arena_dumps_its_state_on_failure(caplog: pytest.LogCaptureFixture) -> None:
    arena = mr.ArenaMemoryResource(mr.CudaAsyncMemoryResource(), arena_size="4MiB", dump_log_on_failure=True)
    with caplog.at_level(logging.ERROR, logger="streampool"), pytest.raises(streampool.OutOfMemoryError):
        arena.allocate(5 * MiB)
    [record] = caplog.records
    assert "allocating 5242880 bytes failed" in record.getMessage() and "PoolStats" in record.getMessage()
    _roundtrip(arena)
    quiet = mr.ArenaMemoryResource(mr.CudaAsyncMemoryResource(), arena_size="4MiB")
    caplog.clear()
    with pytest.raises(streampool.OutOfMemoryError):
        quiet.allocate(5 * MiB)
    assert caplog.records == []


# --- streams ---------------------------------------------------------------------------


def test_stream_flags_as_rmms() -> None:
    assert (int(mr.CudaStreamFlags.SYNC_DEFAULT), int(mr.CudaStreamFlags.NON_BLOCKING)) == (0, 1)
    assert streampool.CudaStreamFlags is mr.CudaStreamFlags

    class Index:  # an integer as NumPy's are: by __index__
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    for flags in (mr.CudaStreamFlags.SYNC_DEFAULT, mr.CudaStreamFlags.NON_BLOCKING, 0, 1, Index(0), Index(1)):
        s = streampool.Stream(flags=flags)  # type: ignore[arg-type]
        _roundtrip_on(s)
    streampool.Stream(blocking=True, flags=mr.CudaStreamFlags.SYNC_DEFAULT)
    streampool.Stream(blocking=True, flags=Index(0))  # type: ignore[arg-type]
    for flags in mr.CudaStreamFlags:  # RMM's order, Stream(obj=None, flags=None): positional too
        _roundtrip_on(streampool.Stream(None, flags))
    with pytest.raises(ValueError, match="flags must be"):
        streampool.Stream(None, 2)
    with pytest.raises(TypeError, match="only apply to a new stream"):
        streampool.Stream(streampool.Stream(), mr.CudaStreamFlags.NON_BLOCKING)
    with pytest.raises(ValueError, match="contradicts"):
        streampool.Stream(blocking=True, flags=Index(1))  # type: ignore[arg-type]
    for bad in (2, -1, Index(2)):
        with pytest.raises(ValueError, match="flags must be"):
            streampool.Stream(flags=bad)  # type: ignore[arg-type]
    for wrong in ("0", True, 0.0):
        with pytest.raises(TypeError, match=r"flags must be an integer, .* of type (str|bool|float)"):
            streampool.Stream(flags=wrong)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contradicts"):
        streampool.Stream(blocking=True, flags=mr.CudaStreamFlags.NON_BLOCKING)


def _roundtrip_on(s: streampool.Stream) -> None:
    resource = mr.CudaAsyncMemoryResource()
    resource.deallocate(resource.allocate(100, s), 100, s)


def test_stream_wraps_another_librarys_stream_and_keeps_it_alive() -> None:
    ours = streampool.Stream()

    class Foreign:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, ours.handle)

    foreign = Foreign()
    alive = weakref.ref(foreign)
    wrapped = streampool.Stream(foreign)
    del foreign
    gc.collect()
    assert alive() is not None  # the wrapper keeps it
    assert wrapped == ours and wrapped.__cuda_stream__() == (0, ours.handle)
    _roundtrip_on(wrapped)
    assert streampool.Stream(ours) == ours and streampool.Stream(streampool.DEFAULT_STREAM).is_default()
    assert not ours.is_default() and streampool.PER_THREAD_DEFAULT_STREAM.is_default()

    class CupyLike:
        ptr = ours.handle

    assert streampool.Stream(CupyLike()) == ours
    del wrapped
    gc.collect()
    assert alive() is None


def test_stream_of_bad_objects() -> None:
    class V1:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (1, 2)

    with pytest.raises(NotImplementedError, match="version"):
        streampool.Stream(V1())
    with pytest.raises(TypeError, match=r"Stream\(device=1\)"):
        streampool.Stream(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot use a"):
        streampool.Stream(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="only apply to a new stream"):
        streampool.Stream(streampool.DEFAULT_STREAM, blocking=True)

    class Dead:
        ptr = 0xDEAD000

    with pytest.raises(streampool.InvalidStreamError):
        streampool.Stream(Dead())
    _roundtrip_on(streampool.Stream())


# --- small names -----------------------------------------------------------------------


def test_available_device_memory() -> None:
    free, total = mr.available_device_memory()
    assert total == SIM_CAPACITY and 0 < free <= total
    assert mr.available_device_memory(0) == (free, total)
    with pytest.raises(ValueError, match="device"):
        mr.available_device_memory(7)


def test_pool_handle_is_a_property_and_a_method() -> None:
    owner = mr.CudaAsyncMemoryResource(release_threshold=0)
    view = mr.CudaAsyncViewMemoryResource(owner.pool_handle())
    for resource in (owner, view, mr.CudaAsyncManagedMemoryResource()):
        handle = resource.pool_handle
        assert isinstance(handle, int) and handle != 0
        assert resource.pool_handle() == handle and type(resource.pool_handle()) is int
    assert view.pool_handle == owner.pool_handle


def test_binning_add_bin_as_rmm() -> None:
    up = mr.CudaAsyncMemoryResource()
    binning = mr.BinningMemoryResource(up, 10, 12)
    binning.add_bin(2048)  # exists: nothing changes, as RMM
    binning.add_bin(1000)  # rounded up to 1024: exists
    binning.add_bin(300)  # rounded up to 512: new
    assert [size for size, _ in binning.bins] == [512, 1024, 2048, 4096]
    tracked = mr.TrackingResourceAdaptor(up)
    binning.add_bin(2048, tracked)  # replaces the automatic bin
    assert binning.bins[2][1] is tracked and binning.bin_mrs == [tracked]
    ptr = binning.allocate(1500)
    assert [r.ptr for r in tracked.outstanding()] == [ptr]
    with pytest.raises(ValueError, match="replace bins before allocating"):
        binning.add_bin(2048, mr.CudaAsyncMemoryResource())
    assert binning.bins[2][1] is tracked and binning.bin_mrs == [tracked]
    binning.deallocate(ptr, 1500)
    other = mr.TrackingResourceAdaptor(up)
    binning.add_bin(2048, other)  # nothing outstanding now: replaced, the old one let go
    assert binning.bin_mrs == [other]
    # A bin of another kind of memory than the upstream's is refused: its buffers would
    # report device memory as managed (DLPack, the CUDA array interface, prefetch).
    with pytest.raises(
        ValueError, match=r"hands out managed memory, but this resource's upstream .* device memory"
    ):
        binning.add_bin(4096, mr.ManagedMemoryResource())
    managed = mr.BinningMemoryResource(mr.ManagedMemoryResource(), 10, 12)
    with pytest.raises(ValueError, match=r"hands out device memory, but .* hands out managed memory"):
        managed.add_bin(1024, mr.CudaMemoryResource())
    managed.add_bin(1024, mr.ManagedMemoryResource())
    with streampool.DeviceBuffer(size=1000, mr=managed) as buf:
        assert buf.__dlpack_device__()[0] == 13  # kDLCUDAManaged


def test_statistics_fields_are_rmms() -> None:
    import dataclasses

    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    ptr = stats.allocate(1000)
    counts = stats.allocation_counts
    assert [f.name for f in dataclasses.fields(counts)] == [
        "current_bytes",
        "current_count",
        "peak_bytes",
        "peak_count",
        "total_bytes",
        "total_count",
    ]
    assert dataclasses.astuple(counts) == (1000, 1, 1000, 1, 1000, 1)
    stats.deallocate(ptr, 1000)


def test_rmm_aliases() -> None:
    assert mr.DeviceMemoryResource is mr.MemoryResource
    assert mr.get_current_device_resource_type() is type(mr.get_current_device_resource())
    assert os.fspath  # the module imports what its docs name
    for name in (
        "reinitialize",
        "is_initialized",
        "register_reinitialize_hook",
        "unregister_reinitialize_hook",
    ):
        assert name in streampool.__all__
    for name in (
        "ArenaMemoryResource",
        "CallbackMemoryResource",
        "CudaStreamFlags",
        "available_device_memory",
    ):
        assert name in mr.__all__


def test_a_view_takes_a_cuda_bindings_pool_handle_as_rmm_does() -> None:
    class CUmemoryPool:  # as cuda.bindings.driver's: int() is the handle (RMM reads it so)
        def __init__(self, handle: int) -> None:
            self.handle = handle

        def __int__(self) -> int:
            return self.handle

        def getPtr(self) -> int:  # where the object keeps the handle: a host address
            return id(self)

    owner = mr.CudaAsyncMemoryResource(initial_pool_size="2MiB")
    view = mr.CudaAsyncViewMemoryResource(CUmemoryPool(int(owner.pool_handle)))
    assert int(view.pool_handle) == int(owner.pool_handle)
    p = view.allocate(4096)
    # What the pool holds and hands out, whoever allocated it, as its owner reads it.
    assert (view.reserved_bytes, view.used_bytes) == (owner.reserved_bytes, owner.used_bytes)
    assert view.reserved_bytes >= 2 << 20 and view.used_bytes >= 4096
    view.deallocate(p, 4096)
    with pytest.raises(ValueError, match=r"is not a memory pool handle .* or a cuda.bindings CUmemoryPool"):
        mr.CudaAsyncViewMemoryResource(object())
    with pytest.raises(ValueError, match=r"is not a memory pool handle"):
        mr.CudaAsyncViewMemoryResource(1.5)  # a float has __int__ too, but is no handle


def test_rmms_module_paths_import_with_streampool_in_place_of_rmm() -> None:
    # Code that imports from RMM's module paths runs after replacing `rmm` by `streampool`.
    from streampool.mr.experimental import CudaAsyncManagedMemoryResource
    from streampool.pylibrmm import CudaStreamFlags, DeviceBuffer, memory_resource
    from streampool.pylibrmm.device_buffer import DeviceBuffer as Buffer
    from streampool.pylibrmm.memory_resource import CudaAsyncMemoryResource, experimental
    from streampool.pylibrmm.stream import DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Stream

    assert (
        CudaAsyncManagedMemoryResource
        is mr.CudaAsyncManagedMemoryResource
        is mr.experimental.CudaAsyncManagedMemoryResource
    )
    assert (CudaStreamFlags, DeviceBuffer, Buffer) == (
        mr.CudaStreamFlags,
        streampool.DeviceBuffer,
        DeviceBuffer,
    )
    assert (Stream, DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM) == (
        streampool.Stream,
        streampool.DEFAULT_STREAM,
        streampool.PER_THREAD_DEFAULT_STREAM,
    )
    assert CudaAsyncMemoryResource is mr.CudaAsyncMemoryResource and experimental is mr.experimental
    namespace: dict[str, object] = {}
    exec("from streampool.pylibrmm.memory_resource import *", namespace)
    assert {n: getattr(mr, n) for n in mr.__all__} == {n: namespace[n] for n in mr.__all__}
    assert streampool.pylibrmm.memory_resource is memory_resource  # after `import streampool`, as rmm's
    buf = Buffer(size=16, stream=Stream(None, CudaStreamFlags.NON_BLOCKING), mr=CudaAsyncMemoryResource())
    assert buf.size == 16


# --- RMM's top-level names: errors, the logger functions, the stream pool ---------------

# `rmm.__all__` of RMM 26.10 (rmm-cu13 26.10.0's rmm/__init__.py).
RMM_TOP_LEVEL = {
    "DeviceBuffer",
    "disable_logging",
    "RMMError",
    "enable_logging",
    "flush_logger",
    "get_flush_level",
    "get_log_filenames",
    "get_logging_level",
    "is_initialized",
    "level_enum",
    "mr",
    "register_reinitialize_hook",
    "reinitialize",
    "set_flush_level",
    "set_logging_level",
    "should_log",
    "unregister_reinitialize_hook",
}


def test_every_name_rmm_exports_at_the_top_level_is_there() -> None:
    assert RMM_TOP_LEVEL - set(streampool.__all__) == set()
    for name in RMM_TOP_LEVEL:
        assert getattr(streampool, name) is not None


def test_rmm_error_catches_streampools_errors() -> None:
    resource = mr.CudaAsyncMemoryResource()
    with pytest.raises(streampool.RMMError):
        resource.allocate(2 * SIM_CAPACITY)  # out of memory, a MemoryError too
    with pytest.raises(streampool.RMMError):
        mr.TrackingResourceAdaptor(resource).deallocate(0x1000, 8)  # never allocated there
    assert streampool.RMMError is streampool.StreampoolError
    _roundtrip(resource)


@pytest.fixture
def streampool_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("streampool")
    level, flush = logger.level, streampool.get_flush_level()
    yield logger
    logger.setLevel(level)
    streampool.set_flush_level(flush)


def test_logging_level_is_the_streampool_loggers(streampool_logger: logging.Logger) -> None:
    levels = streampool.level_enum
    assert [int(v) for v in levels] == list(range(8))  # rapids-logger's values
    streampool_logger.setLevel(logging.NOTSET)  # as in a fresh process: the root logger's level
    root = logging.getLogger()
    root_level = root.level
    try:
        root.setLevel(logging.WARNING)  # Python's default
        assert streampool.get_logging_level() is levels.warn
        assert streampool.should_log(levels.error) and not streampool.should_log(levels.info)
        root.setLevel(logging.DEBUG)
        assert streampool.get_logging_level() is levels.debug
    finally:
        root.setLevel(root_level)
    for level, python in (
        (levels.trace, 5),
        (levels.debug, logging.DEBUG),
        (levels.info, logging.INFO),
        (levels.warn, logging.WARNING),
        (levels.error, logging.ERROR),
        (levels.critical, logging.CRITICAL),
    ):
        streampool.set_logging_level(level)
        assert streampool_logger.level == python and streampool.get_logging_level() is level
        assert streampool.should_log(level) and not streampool.should_log(levels.off)
        assert all(streampool.should_log(v) == (v >= level) for v in levels if v < levels.off)
    streampool_logger.setLevel(logging.INFO + 5)  # set by Python: the first level it writes
    assert streampool.get_logging_level() is levels.warn
    for bad in ("warn", 3, logging.WARNING, None):
        with pytest.raises(TypeError, match=r"level must be a streampool\.level_enum"):
            streampool.set_logging_level(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="level must be"):
            streampool.should_log(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="level must be"):
            streampool.set_flush_level(bad)  # type: ignore[arg-type]


def test_logging_level_off_silences_the_leak_report(
    streampool_logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    ptr = tracked.allocate(777)
    caplog.set_level(logging.NOTSET)  # caplog's handler takes everything that reaches it
    streampool.set_logging_level(streampool.level_enum.off)
    tracked.log_outstanding_allocations()
    assert caplog.records == []
    streampool.set_logging_level(streampool.level_enum.warn)
    tracked.log_outstanding_allocations()
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "1 outstanding allocation" in record.getMessage()
    tracked.deallocate(ptr, 777)


def test_flush_level_flushes_a_buffering_handler(streampool_logger: logging.Logger) -> None:
    import logging.handlers

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    # Buffers everything until flushed (its own flush level is above every record).
    buffered = logging.handlers.MemoryHandler(1000, flushLevel=logging.CRITICAL + 10, target=Collect())
    streampool_logger.addHandler(buffered)
    try:
        streampool.set_logging_level(streampool.level_enum.info)
        tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
        ptr = tracked.allocate(777)
        assert streampool.get_flush_level() is streampool.level_enum.warn  # RMM's default
        tracked.log_outstanding_allocations()  # a WARNING record: flushed at once
        assert len(seen) == 1 and "outstanding" in seen[0]
        streampool.set_flush_level(streampool.level_enum.error)
        tracked.log_outstanding_allocations()
        assert len(seen) == 1 and len(buffered.buffer) == 1  # kept in the buffer
        streampool.flush_logger()
        assert len(seen) == 2 and buffered.buffer == []
        tracked.deallocate(ptr, 777)
    finally:
        streampool_logger.removeHandler(buffered)


def test_cuda_stream_pool_hands_out_its_streams_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    from streampool.pylibrmm import cuda_stream_pool
    from streampool.pylibrmm.cuda_stream_pool import CudaStreamPool

    pool = CudaStreamPool(3)
    assert pool.get_pool_size() == 3
    firsts = [pool.get_stream() for _ in range(6)]
    assert len({s.handle for s in firsts}) == 3 and firsts[:3] == firsts[3:]
    assert [pool.get_stream(i) for i in range(3)] == firsts[:3] and pool.get_stream(7) == firsts[1]
    for s in firsts[:3]:
        _roundtrip_on(s)
    # 8 threads share one pool: every stream handed out equally often.
    shared = CudaStreamPool(4)
    got: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        mine = [shared.get_stream().handle for _ in range(100)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got.count(h) for h in set(got)) == [200] * 4
    # The flags reach every stream; blocking (SYNC_DEFAULT) by default, as RMM's.
    made: list[object] = []

    def recording(*args: object, **kwargs: object) -> streampool.Stream:
        made.append(kwargs.get("flags"))
        return streampool.Stream(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cuda_stream_pool, "Stream", recording)
    CudaStreamPool(2)
    CudaStreamPool(2, mr.CudaStreamFlags.NON_BLOCKING)
    assert made == [mr.CudaStreamFlags.SYNC_DEFAULT] * 2 + [mr.CudaStreamFlags.NON_BLOCKING] * 2


def test_cuda_stream_pool_bad_arguments() -> None:
    from streampool.pylibrmm.cuda_stream_pool import CudaStreamPool

    for size in (0, -1):
        with pytest.raises(ValueError, match="pool_size must be greater than zero"):
            CudaStreamPool(size)
    with pytest.raises(TypeError, match="pool_size must be an int, not str"):
        CudaStreamPool("4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flags must be"):
        CudaStreamPool(2, 7)  # type: ignore[arg-type]
    pool = CudaStreamPool(2)
    with pytest.raises(ValueError, match="stream_id must be non-negative"):
        pool.get_stream(-1)
    with pytest.raises(TypeError, match="stream_id must be an int or None, not float"):
        pool.get_stream(1.0)  # type: ignore[arg-type]
    _roundtrip_on(pool.get_stream())
