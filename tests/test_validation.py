"""Bad arguments and bad environments get clear errors, and leave things usable: sizes as
strings, counts, exponents, out-of-memory reports, STREAMPOOL_DEVICE, objects of an exited
simulated device, the tracking adaptor's thread names, the simulator's capacity, and
reference cycles through adaptors."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

from .conftest import RESOURCES, SIM_CAPACITY

MIB = 1 << 20
HUGE = 2**70


# --- parse_size --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.5", 1),  # a fraction of a byte is dropped, as RMM's parse_bytes does
        ("0.9", 0),
        ("0.1KiB", 102),  # 102.4
        ("1.9999KB", 1999),
        ("4.35MB", 4_350_000),  # exact: 4.35 * 10**6 is 4349999.999... as a float
        ("1G", 1 << 30),
        ("1GiB", 1 << 30),
        ("1GB", 10**9),
        ("1PiB", 1 << 50),
        ("1P", 1 << 50),
        ("2 EiB", 2 << 60),
        ("3pb", 3 * 10**15),
        ("1EB", 10**18),
    ],
)
def test_parse_size_units_and_fractions(text: str, expected: int) -> None:
    assert streampool.parse_size(text) == expected


@pytest.mark.parametrize("text", ["16EiB", "1e3", "1.2.3MB", ".", "5 ZiB"])
def test_parse_size_refusals_name_the_text(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text).replace("'", '"'))):
        streampool.parse_size(text)


def test_fractional_sizes_reach_resources_truncated() -> None:
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "1.5KiB")
    assert limited.get_allocation_limit() == 1536
    pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), maximum_pool_size="1.9999MiB")
    ptr = pool.allocate("0.5MiB")
    pool.deallocate(ptr, MIB // 2)


# --- counts and sizes: ValueError naming the argument and the value ---------------------


@pytest.mark.nosim
@pytest.mark.parametrize(
    ("devices", "words"), [(0, ">= 1, got 0"), (-1, ">= 1, got -1"), (HUGE, f"<= 1024, got {HUGE}")]
)
def test_simulated_device_counts(devices: int, words: str) -> None:
    with pytest.raises(ValueError, match=f"devices must be {re.escape(words)}"):
        SimulatedDevice(capacity_bytes="64MiB", devices=devices)
    with pytest.raises(TypeError, match="devices must be an int, not float"):
        SimulatedDevice(capacity_bytes="64MiB", devices=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"devices must be a number of devices .*, not None"):
        SimulatedDevice(capacity_bytes="64MiB", devices=None)  # type: ignore[arg-type]
    with SimulatedDevice(capacity_bytes="64MiB", devices=3):
        assert streampool.device_count() == 3


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda up: mr.ShardedPoolMemoryResource(up, events_every=0), "events_every must be >= 1, got 0"),
        (lambda up: mr.ShardedPoolMemoryResource(up, events_every=-5), "events_every must be >= 1, got -5"),
        (
            lambda up: mr.ShardedPoolMemoryResource(up, events_every=HUGE),
            f"events_every must be <= {2**64 - 1}, got {HUGE}",
        ),
        (
            lambda up: mr.ShardedPoolMemoryResource(up, maximum_pool_size=1),
            "maximum_pool_size must be at least 256 bytes",
        ),
        (lambda up: mr.ShardedPoolMemoryResource(up, maximum_pool_size=255), "got 255"),
        (
            lambda up: mr.ShardedPoolMemoryResource(up, maximum_pool_size=-1),
            "maximum_pool_size must be >= 0, got -1",
        ),
        (
            lambda up: mr.ShardedPoolMemoryResource(up, initial_pool_size=HUGE),
            f"initial_pool_size = {HUGE} is too large",
        ),
        (
            lambda up: mr.FixedSizeMemoryResource(up, blocks_to_preallocate=0),
            "blocks_to_preallocate must be >= 1, got 0",
        ),
        (
            lambda up: mr.FixedSizeMemoryResource(up, blocks_to_preallocate=-1),
            "blocks_to_preallocate must be >= 1, got -1",
        ),
        (lambda up: mr.FixedSizeMemoryResource(up, blocks_to_preallocate=HUGE), f"got {HUGE}"),
        (lambda up: mr.LimitingResourceAdaptor(up, -3), "allocation_limit must be > 0, got -3"),
    ],
)
def test_bad_counts_are_value_errors_naming_the_argument(
    make: Callable[[mr.MemoryResource], object], words: str
) -> None:
    upstream = mr.CudaAsyncMemoryResource()
    with pytest.raises(ValueError, match=re.escape(words)):
        make(upstream)
    ptr = upstream.allocate(4096)  # the upstream is untouched
    upstream.deallocate(ptr, 4096)


def test_good_counts_still_work() -> None:
    mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), maximum_pool_size=256)
    pool = mr.ShardedPoolMemoryResource(
        mr.CudaAsyncMemoryResource(), maximum_pool_size="1MiB", events_every=1
    )
    pool.deallocate(pool.allocate(256), 256)
    fixed = mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), 4096, blocks_to_preallocate=1)
    assert fixed.blocks_to_preallocate == 1
    fixed.deallocate(fixed.allocate(100), 100)


# --- binning: one message for an exponent out of range -----------------------------------


@pytest.mark.parametrize("bad", [41, 50, 64, 70, -5, HUGE, -HUGE])
def test_binning_exponents_have_one_message(bad: int) -> None:
    upstream = mr.CudaAsyncMemoryResource()
    expected = f"max_size_exponent must be in 0..=40 (bins of 1 byte to 1 TiB) or None, got {bad}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        mr.BinningMemoryResource(upstream, 3, bad)
    with pytest.raises(ValueError, match=re.escape(expected.replace("max_", "min_"))):
        mr.BinningMemoryResource(upstream, bad, 3)
    with pytest.raises(ValueError, match=re.escape("min_size_exponent (5) must be <= max_size_exponent (3)")):
        mr.BinningMemoryResource(upstream, 5, 3)
    with pytest.raises(TypeError, match="max_size_exponent must be an int"):
        mr.BinningMemoryResource(upstream, 3, "8")  # type: ignore[arg-type]
    binning = mr.BinningMemoryResource(upstream, 3, 40)
    assert len(binning.bins) == 33  # 2**3 .. 2**8 are rounded up to one 256-byte bin, as RMM rounds
    assert mr.BinningMemoryResource(upstream, -1, -1).bins == []  # RMM's "none"
    binning.deallocate(binning.allocate(100), 100)


def test_binning_with_one_exponent_names_the_missing_one() -> None:
    upstream = mr.CudaAsyncMemoryResource()
    for args, message in (
        ((-1, 20), "max_size_exponent is 20 but min_size_exponent is not given (None, or RMM's -1)"),
        ((None, 20), "max_size_exponent is 20 but min_size_exponent is not given"),
        ((10, -1), "min_size_exponent is 10 but max_size_exponent is not given (None, or RMM's -1)"),
        ((10, None), "min_size_exponent is 10 but max_size_exponent is not given"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            mr.BinningMemoryResource(upstream, *args)


# --- out of memory: what limited the request, and a real `available` -------------------


def test_out_of_memory_through_a_chunk_names_the_chunk_and_the_limit() -> None:
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "100MiB")
    fixed = mr.FixedSizeMemoryResource(limited, "1MiB", blocks_to_preallocate=200)
    with pytest.raises(streampool.OutOfMemoryError) as info:
        fixed.allocate(1000)
    text = str(info.value)
    assert "limit 104857600 bytes" in text and f"asked for {200 * MIB} bytes" in text, text
    assert info.value.requested == 1000 and info.value.available == 100 * MIB
    small = mr.FixedSizeMemoryResource(limited, "1MiB", blocks_to_preallocate=10)
    small.deallocate(small.allocate(1000), 1000)


@pytest.mark.parametrize("name", sorted(set(RESOURCES) - {"pinned"}))
def test_available_is_a_real_figure_or_none(name: str) -> None:
    # Pinned host memory does not count against the simulated device's capacity.
    resource = RESOURCES[name]()
    with pytest.raises(streampool.OutOfMemoryError) as info:
        resource.allocate(SIM_CAPACITY + MIB)
    available = info.value.available
    assert available is None or 0 <= available <= SIM_CAPACITY, (name, available, str(info.value))
    assert str(2**64 - 1) not in str(info.value)
    resource.deallocate(resource.allocate(4096), 4096)


def test_available_over_a_pool_over_a_limit_is_not_a_sentinel() -> None:
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "100MiB")
    pool = mr.ShardedPoolMemoryResource(limited)
    with pytest.raises(streampool.OutOfMemoryError) as info:
        pool.allocate("150MiB")
    assert info.value.available is None or info.value.available <= 100 * MIB
    pool.deallocate(pool.allocate(MIB), MIB)


@pytest.mark.nosim
def test_as_much_available_as_asked_says_why_it_was_refused() -> None:
    # The driver's pool reserves 2 MiB at a time: with 1 MiB left on the device, a 1 MiB
    # request fails, and "1048576 bytes available" alone would read as a contradiction.
    with SimulatedDevice(capacity_bytes="3MiB"):
        resource = mr.CudaAsyncMemoryResource()
        held = [resource.allocate(MIB), resource.allocate(MIB)]
        with pytest.raises(streampool.OutOfMemoryError) as info:
            resource.allocate(MIB)
        assert info.value.available is not None and info.value.available >= MIB
        assert "units of 2 MiB or more" in str(info.value), str(info.value)
        for ptr in held:
            resource.deallocate(ptr, MIB)
        resource.deallocate(resource.allocate(MIB), MIB)  # still usable


# --- STREAMPOOL_DEVICE ------------------------------------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "STREAMPOOL_DEVICE"} | env
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.nosim
def test_a_bad_streampool_device_is_named_at_first_use() -> None:
    code = """
import streampool
from streampool.sim import SimulatedDevice
print("imported")
try:
    streampool.DeviceBuffer(size=10)
except streampool.InvalidArgumentError as e:
    print("refused:", e)
with SimulatedDevice(capacity_bytes="64MiB"):
    print("sim works:", streampool.DeviceBuffer(size=10).size)
"""
    out = _python(code, STREAMPOOL_DEVICE="bogus")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "imported"
    assert lines[1].startswith("refused:"), lines
    for words in ("STREAMPOOL_DEVICE", '"bogus"', '"sim"', '"cuda"'):
        assert words in lines[1], lines[1]
    assert lines[2] == "sim works: 10"
    assert out.stderr == ""


# --- objects of an exited simulated device ----------------------------------------------


@pytest.mark.nosim
def test_objects_of_an_exited_device_are_refused_even_from_their_own_memory() -> None:
    with SimulatedDevice(capacity_bytes="64MiB") as dev:
        pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
        pool.deallocate(pool.allocate(4096), 4096)  # now in the pool's own free list
        fixed = mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), 4096)
        fixed.deallocate(fixed.allocate(100), 100)
        buf = streampool.DeviceBuffer(size=4096, mr=pool)
        assert not buf.closed
    assert dev.closed
    assert buf.closed, "a buffer of an exited device reports itself closed"
    refused = "is closed; objects made under it cannot be used outside it"
    for resource in (pool, fixed):
        with pytest.raises(streampool.InvalidArgumentError, match=refused):
            resource.allocate(4096)
        with pytest.raises(streampool.InvalidArgumentError, match=refused):
            streampool.DeviceBuffer(size=4096, mr=resource)
    del buf  # its free is silent
    with SimulatedDevice(capacity_bytes="64MiB"):
        fresh = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
        assert not streampool.DeviceBuffer(size=4096, mr=fresh).closed


# --- the tracking adaptor names Python threads -------------------------------------------


def test_allocation_records_name_the_python_thread() -> None:
    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    main = tracked.allocate(256)
    idents: list[int | None] = []

    def work() -> None:
        idents.append(threading.get_ident())
        tracked.allocate(512)

    t = threading.Thread(target=work, name="loader-7")
    t.start()
    t.join()
    records = {r.size: r for r in tracked.outstanding()}
    assert records[256].thread == f"MainThread (ident {threading.main_thread().ident})"
    assert records[512].thread == f"loader-7 (ident {idents[0]})"
    assert "loader-7" in tracked.get_outstanding_allocations_str()
    tracked.deallocate(main, 256)
    tracked.deallocate(records[512].ptr, 512)
    assert tracked.outstanding() == []


# --- the simulator's capacity -----------------------------------------------------------


@pytest.mark.nosim
def test_the_default_capacity_fits_the_host() -> None:
    dev = SimulatedDevice()
    assert MIB <= dev.capacity_bytes <= 16 << 30
    assert dev.capacity_bytes % MIB == 0
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    # MemAvailable moves; the capacity was read a moment ago.
    assert dev.capacity_bytes <= max(available * 2, MIB)


@pytest.mark.nosim
def test_out_of_host_memory_under_ulimit_is_named_clearly() -> None:
    code = """
import resource, streampool
from streampool.sim import SimulatedDevice
with open("/proc/self/status") as f:
    in_use = next(int(l.split()[1]) << 10 for l in f if l.startswith("VmSize:"))
limit = in_use + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
print("default capacity within the limit:", SimulatedDevice().capacity_bytes <= 1 << 30)
with SimulatedDevice(capacity_bytes="64GiB"):
    try:
        streampool.DeviceBuffer(size=8 << 30)
    except streampool.OutOfMemoryError as e:
        print("refused:", e, "| available:", e.available)
    print("still usable:", streampool.DeviceBuffer.to_device(b"abc").tobytes())
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "default capacity within the limit: True"
    assert lines[1].startswith("refused:"), lines
    for words in ("host memory", "the host refused", "64 GiB", "capacity_bytes", "STREAMPOOL_SIM_CAPACITY"):
        assert words in lines[1], lines[1]
    assert lines[1].endswith("| available: None")
    assert lines[2] == "still usable: b'abc'"


# --- reference cycles through adaptors ---------------------------------------------------


def _collected(tracked: mr.TrackingResourceAdaptor) -> bool:
    gc.collect()
    return tracked.get_allocated_bytes() == 0


def test_a_cycle_through_an_upstream_is_collected() -> None:
    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    # fixed -> stats -> callback adaptor -> its callback -> fixed: each link but the last
    # is an adaptor's upstream.
    holder: list[mr.MemoryResource] = []
    retry = mr.FailureCallbackResourceAdaptor(tracked, lambda nbytes, holder=holder: bool(holder) and False)
    fixed = mr.FixedSizeMemoryResource(mr.StatisticsResourceAdaptor(retry), 4096, blocks_to_preallocate=4)
    holder.append(fixed)
    fixed.deallocate(fixed.allocate(100), 100)
    assert tracked.get_allocated_bytes() == 4 * 4096, "the chunk is held until the resource goes"
    del fixed, retry, holder
    assert _collected(tracked)
    tracked.deallocate(tracked.allocate(256), 256)


def test_a_failure_callback_that_closes_over_the_resource_above_it_is_collected() -> None:
    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())

    box: list[mr.MemoryResource] = []

    def on_failure(nbytes: int, box: list[mr.MemoryResource] = box) -> bool:
        return not box

    # pool -> its upstream, the callback adaptor -> on_failure -> box -> pool
    pool = mr.ShardedPoolMemoryResource(
        mr.FailureCallbackResourceAdaptor(tracked, on_failure), initial_pool_size="1MiB"
    )
    box.append(pool)
    pool.deallocate(pool.allocate(4096), 4096)
    assert tracked.get_allocated_bytes() >= MIB, "the pool holds its chunk until it goes"
    del pool, box, on_failure
    assert _collected(tracked)


def test_python_attributes_that_refer_back_are_collected() -> None:
    class Pool(mr.ShardedPoolMemoryResource):
        pass

    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    # pool.__dict__ -> logged -> its upstream, pool
    pool = Pool(tracked, initial_pool_size="1MiB")
    logged = mr.LoggingResourceAdaptor(pool, callback=lambda line: None)
    pool.owner = logged  # type: ignore[attr-defined]
    # binning -> its bin -> bin.__dict__ -> binning
    binning = mr.BinningMemoryResource(tracked)
    bin_pool = Pool(tracked, initial_pool_size="1MiB")
    binning.add_bin(4096, bin_pool)
    bin_pool.owner = binning  # type: ignore[attr-defined]
    binning.deallocate(binning.allocate(100), 100)
    assert tracked.get_allocated_bytes() >= 2 * MIB
    del pool, logged, binning, bin_pool
    assert _collected(tracked)
