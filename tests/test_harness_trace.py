"""Logs (streampool's and RMM's CSV) into traces, and replay fidelity."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import streampool
from streampool import mr
from streampool.harness import trace, workloads
from streampool.harness.specs import make_resource
from streampool.harness.trace import ALLOCATE, FREE, LogFormatError, read_log
from streampool.sim import SimulatedDevice

HEADER = "Thread,Time,Action,Pointer,Size,Stream"
# RMM's logging_resource_adaptor: times since midnight, hex pointers and streams.
RMM_LOG = f"""{HEADER}
2342727,23:59:59.999000,allocate,0x7f0000000000,1048576,0x0
2342727,23:59:59.999500,allocate,0x7f0000100000,256,0x55d0c0a0b0c0
2342728,00:00:00.000100,allocate failure,(nil),1099511627776,0x55d0c0a0b0c0
2342728,00:00:00.000200,free,0x7f0000100000,256,0x55d0c0a0b0c0
2342727,00:00:00.000300,free,0x7effffff0000,4096,0x0
2342727,00:00:00.000400,allocate,0x7f0000200000,512,0x1
"""


def _write(tmp_path: Path, text: str, name: str = "app.log") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_an_rmm_log_becomes_a_trace(tmp_path: Path) -> None:
    t = read_log(_write(tmp_path, RMM_LOG))
    ops = [(r[1], r[3], r[4], r[5]) for r in t.records]
    # the failure and the free of memory allocated before the log began are not replayed;
    # what the log never frees is freed at its end, on the thread and stream that made it
    assert ops == [
        (1048576, 0, 0, ALLOCATE),
        (256, 0, 1, ALLOCATE),
        (256, 1, 1, FREE),
        (512, 0, 0, ALLOCATE),  # stream 0x1 is the legacy default stream, as 0x0
        (1048576, 0, 0, FREE),
        (512, 0, 0, FREE),
    ]
    assert (t.threads, t.streams) == (2, 2)
    assert (t.recorded_failures, t.unmatched_frees, t.closing_frees) == (1, 1, 2)
    times = [r[0] for r in t.records]
    assert times[:4] == [0, 500_000, 1_200_000, 1_400_000]  # across midnight, in ns
    assert times == sorted(times)
    assert t.stream_handles == [0, 0x55D0C0A0B0C0]


def test_a_log_whose_threads_wrote_out_of_time_order_replays(tmp_path: Path) -> None:
    # Threads log concurrently: a later line can carry an earlier time than the first one.
    text = f"""{HEADER}
11,0.000500,allocate,0x7f0000000000,256,0x0
12,0.000100,allocate,0x7f0000100000,512,0x0
12,0.000200,free,0x7f0000100000,512,0x0
11,0.000600,free,0x7f0000000000,256,0x0
"""
    t = read_log(_write(tmp_path, text))
    assert [r[0] for r in t.records] == [400_000, 0, 100_000, 500_000]  # from the earliest
    t.pack()  # every time fits the record (it used to be negative and refused)
    out = trace.replay(mr.CudaAsyncMemoryResource(), t, gap_scale=0.0)
    assert out["events"] == 4


def test_malformed_lines_are_named_by_number_and_nothing_else_is_lost(tmp_path: Path) -> None:
    lines = RMM_LOG.splitlines()
    lines[2] = "2342727,23:59:59.999500,allocate,0xZZ,256,0x0"  # line 3: bad pointer
    lines.insert(5, "garbage")  # line 6
    lines.append("1,2,3")  # line 9
    path = _write(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(LogFormatError) as info:
        read_log(path)
    assert [n for n, _ in info.value.errors] == [3, 6, 9]
    text = str(info.value)
    assert "line 3: bad pointer `0xZZ`" in text and "line 6:" in text and "line 9:" in text
    assert "--skip-malformed" in text
    kept = info.value.trace
    assert (
        kept is not None and sum(r[5] == ALLOCATE for r in kept.records) == 2
    )  # the good lines' allocations
    skipped = read_log(path, skip_malformed=True)
    assert skipped.records == kept.records and skipped.malformed == 3  # type: ignore[attr-defined]


def test_a_log_without_its_header_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LogFormatError, match="line 1: expected the header"):
        read_log(_write(tmp_path, "\n".join(RMM_LOG.splitlines()[1:])))


def test_an_unreadable_log_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_log(str(tmp_path / "missing.log"))


def _per_stream(lines: list[str]) -> list[list[tuple[str, int]]]:
    """Each stream's sequence of (action, size), streams in order of first appearance."""
    streams: dict[str, list[tuple[str, int]]] = {}
    for line in lines:
        if line.startswith("Thread,"):
            continue  # a callback gets the header too
        _thread, _time, action, _ptr, size, stream = line.split(",")
        streams.setdefault(stream, []).append((action, int(size)))
    return list(streams.values())


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_replay_repeats_each_streams_operations_in_recorded_order(tmp_path: Path, native: bool) -> None:
    _fidelity(tmp_path, native)


@pytest.mark.gpu
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_replay_fidelity_on_the_gpu(tmp_path: Path, native: bool) -> None:
    _fidelity(tmp_path, native)


def _fidelity(tmp_path: Path, native: bool) -> None:
    # Record: 3 threads, each on its own stream, a window of allocations; one cross-thread free.
    path = str(tmp_path / "recorded.log")
    logger = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), path)
    streams = [streampool.Stream() for _ in range(3)]  # alive throughout: handles are reused

    def work(i: int) -> None:
        s = streams[i]
        ring = []
        for n in range(40):
            size = 256 * (1 + (n * (i + 3)) % 9)
            ring.append((logger.allocate(size, s), size))
            if len(ring) > 5:
                ptr, old = ring.pop(0)
                logger.deallocate(ptr, old, s)
        for ptr, size in ring:
            logger.deallocate(ptr, size, s)
        s.synchronize()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logger.flush()
    recorded = Path(path).read_text().splitlines()[1:]
    t = read_log(path)
    assert t.threads == 3 and t.streams == 3 and t.events == len(recorded)

    replayed: list[str] = []
    under = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=replayed.append)
    result = trace.replay(under, t, gap_scale=0.0, native=native)
    assert result["events"] == t.events and result["oom_events"] == 0
    assert result["peak_live_bytes"] > 0
    assert sorted(_per_stream(replayed)) == sorted(_per_stream(recorded))


def test_replay_with_gaps_and_a_cross_thread_free() -> None:
    records = [
        (0, 4096, 0, 0, 0, ALLOCATE),
        (1_000_000, 4096, 0, 1, 1, FREE),  # freed by another thread, on another stream
        (2_000_000, 512, 1, 1, 1, ALLOCATE),
        (2_000_000, 512, 1, 1, 1, FREE),
    ]
    seen: list[str] = []
    under = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=seen.append)
    result = trace.replay(under, trace.Trace(records), gap_scale=1.0, native=False)
    assert result["seconds"] >= 0.002  # the recorded gaps are kept
    assert [line.split(",")[2] for line in seen[1:]] == ["allocate", "free", "allocate", "free"]


@pytest.mark.parametrize("native", [True, False])
def test_replay_orders_a_free_on_another_stream_after_its_allocation(
    sim: SimulatedDevice, native: bool
) -> None:
    # The memory is written on the allocating stream and read on the freeing one, as a
    # program's kernels would: the free must be ordered after the allocation's stream, on
    # the same thread and on another (the Python replayer did neither).
    records = []
    for i in range(50):
        records += [(10 * i, 1 << 20, i, i % 2, 0, ALLOCATE), (10 * i + 5, 1 << 20, i, (i // 2) % 2, 1, FREE)]
    base = mr.CudaAsyncMemoryResource()

    def allocate(size: int, stream: streampool.Stream) -> int:
        ptr = base.allocate(size, stream)
        sim.write(stream, ptr, size, "fill after allocate")
        return ptr

    def deallocate(ptr: int, size: int, stream: streampool.Stream) -> None:
        sim.read(stream, ptr, size, "read before free")
        base.deallocate(ptr, size, stream)

    resource = mr.CallbackMemoryResource(allocate, deallocate)
    trace.replay(resource, trace.Trace(records), gap_scale=0.0, max_lead=None, native=native)
    sim.run()
    assert sim.races() == []


def test_replay_counts_out_of_memory_and_goes_on() -> None:
    records = [
        (0, 1 << 40, 0, 0, 0, ALLOCATE),
        (0, 1 << 40, 0, 0, 0, FREE),
        (0, 256, 1, 0, 0, ALLOCATE),
        (0, 256, 1, 0, 0, FREE),
    ]
    result = trace.replay(mr.CudaAsyncMemoryResource(), trace.Trace(records), gap_scale=0.0, native=False)
    assert result["oom_events"] == 1 and result["allocate"]["max"] > 0


@pytest.mark.parametrize("name", ["random", "window"])
def test_generated_traces_free_everything_they_allocate(name: str) -> None:
    make = workloads.random_trace if name == "random" else workloads.window_trace
    t = make(200, threads=3, streams=2)
    allocs = [r for r in t.records if r[5] == ALLOCATE]
    frees = [r for r in t.records if r[5] == FREE]
    assert len(allocs) == 600 and sorted(r[2] for r in frees) == sorted(r[2] for r in allocs)
    assert (t.threads, t.streams) == (3, 2)
    assert len(t.pack()) == trace.RECORD.size * t.events


def test_sequential_replay_samples_live_and_reserved() -> None:
    candidate = make_resource("pool(async)")
    t = workloads.window_trace(50, window=4)
    out = trace.sequential_replay(candidate.resource, t, candidate.reserved)
    assert len(out["live"]) == t.events and out["live"][-1] == 0
    assert max(out["live"]) <= max(r for r in out["reserved"] if r is not None)


# --- what the review found ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "bad"),
    [
        (["1,0,allocate,0x1000,4096,0", "1,99999999999,free,0x1000,4096,0"], [3]),  # beyond 2^63 ns
        (["1,-5,allocate,0x1000,4096,0", "1,1e300,free,0x1000,4096,0"], [2, 3]),
    ],
)
def test_a_time_out_of_range_is_a_malformed_line(tmp_path: Path, lines: list[str], bad: list[int]) -> None:
    # Refused by the log parser (MAX_LOG_TIME_S), as every malformed line is.
    path = _write(tmp_path, "\n".join([HEADER, *lines]) + "\n")
    with pytest.raises(LogFormatError) as e:
        read_log(path)
    assert [n for n, _ in e.value.errors] == bad
    assert all("time" in why for _, why in e.value.errors), e.value.errors
    assert read_log(path, skip_malformed=True).malformed == len(bad)


def test_traces_refuse_times_they_cannot_hold() -> None:
    class Event:
        thread, action, ptr, size, stream = 1, "allocate", 0x1000, 64, 0

        def __init__(self, time: float) -> None:
            self.time = time

    for time in (-1.0, float("inf"), float("nan"), 1e300, 1e11):
        with pytest.raises(ValueError, match=r"log event 1: time .* out of range"):
            trace.from_events([Event(0.0), Event(time)])
    with pytest.raises(ValueError, match=r"trace record 1 .*: a field is out of range"):
        trace.Trace([(0, 64, 0, 0, 0, ALLOCATE), (2**64, 64, 0, 0, 0, FREE)]).pack()


@pytest.mark.parametrize("text", ["", "   ", "\n\n", HEADER + "\n"])
def test_an_empty_log_is_a_trace_of_no_events(tmp_path: Path, text: str) -> None:
    assert read_log(_write(tmp_path, text)).events == 0


def test_log_text_is_never_taken_for_a_path(tmp_path: Path) -> None:
    from streampool.logs import parse_log_file, parse_log_text

    line = "6750,05:24:57.524290,allocate,0x7fbb9503b100,4096,0x1010"  # one line, no header
    for text in ("", line, line.encode()):
        with pytest.raises(ValueError, match="expected the header"):
            parse_log_text(text)
    assert parse_log_text(f"{HEADER}\n{line}")[0].size == 4096
    path = _write(tmp_path, f"{HEADER}\n{line}\n")
    assert parse_log_file(path) == parse_log_text(f"{HEADER}\n{line}\n")
    # The one-line log without its header is refused as such, not as a missing file.
    with pytest.raises(LogFormatError, match="line 1: expected the header"):
        read_log(_write(tmp_path, line))


@pytest.mark.parametrize("native", [True, False])
def test_failed_allocations_are_not_counted_as_events(native: bool) -> None:
    records = [
        (0, 1 << 40, 0, 0, 0, ALLOCATE),  # runs out of memory: skipped with its free
        (0, 256, 1, 0, 0, ALLOCATE),
        (0, 256, 1, 0, 0, FREE),
        (0, 1 << 40, 0, 0, 0, FREE),
    ]
    result = trace.replay(mr.CudaAsyncMemoryResource(), trace.Trace(records), gap_scale=0.0, native=native)
    assert (result["events"], result["oom_events"], result["peak_live_bytes"]) == (2, 1, 256)


def test_plot_charges_a_free_to_the_stream_and_thread_that_allocated(tmp_path: Path) -> None:
    from streampool.harness import plots

    # A producer (thread 1, stream 0x10) allocates; a consumer (thread 2, stream 0x20)
    # frees what it was handed, and allocates and frees memory of its own.
    t = read_log(
        _write(
            tmp_path,
            f"""{HEADER}
1,0.1,allocate,0x1000,4096,0x10
1,0.2,allocate,0x2000,4096,0x10
2,0.3,free,0x1000,4096,0x20
2,0.4,allocate,0x3000,512,0x20
2,0.5,free,0x2000,4096,0x20
2,0.6,free,0x3000,512,0x20
""",
        )
    )
    for key in (3, 4):  # thread, stream
        steps = plots._steps(t, key)
        assert min(min(ys) for _, ys in steps.values()) >= 0
        assert steps[0][1] == [4096, 8192, 4096, 0] and steps[1][1] == [512, 0]
