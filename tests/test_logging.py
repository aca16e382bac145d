"""``LoggingResourceAdaptor`` and ``streampool.logs``: RMM's CSV allocation log, written to
a file and/or a Python callback, and parsed back."""

from __future__ import annotations

import gc
import os
import pathlib
import sys
import threading
from typing import Any

import pytest

import streampool
from streampool import mr
from streampool.logs import LOG_HEADER, LogEvent, parse_log

# Verbatim from RMM's documentation (rapidsai/rmm, docs/user_guide/record_replay.md,
# "The CSV columns"): what RMM's logging_resource_adaptor writes, time of day to the
# microsecond, hexadecimal pointers, stream 0 for the default stream.
RMM_DOC_LOG = """\
Thread,Time,Action,Pointer,Size,Stream
2342727,15:47:02.841961,allocate,0x10012400000,1048576,0
2342727,15:47:02.841977,free,0x10012400000,1048576,0
"""

# The other forms RMM writes or documents: a failed allocation (spdlog's `%p` of a null
# pointer is "(nil)"), a non-default stream in hexadecimal, and "deallocate", which RMM's
# C++ logging guide uses for frees (rapidsai/rmm, docs/cpp/logging.md).
RMM_OTHER_FORMS = """\
Thread,Time,Action,Pointer,Size,Stream
140573312345856,14:03:22.123456,allocate failure,(nil),68719476736,0x5581c6e0a0f0
140573312345856,14:03:22.123789,allocate,0x7f8a40000400,2048,0x5581c6e0a0f0
140573312345856,14:03:22.124012,deallocate,0x7f8a40000400,2048,0x5581c6e0a0f0
"""


def test_rmm_documentation_log_parses() -> None:
    events = parse_log(RMM_DOC_LOG)
    assert [(e.thread, e.action, e.ptr, e.size, e.stream) for e in events] == [
        (2342727, "allocate", 0x10012400000, 1 << 20, 0),
        (2342727, "free", 0x10012400000, 1 << 20, 0),
    ]
    assert events[0].time == pytest.approx(15 * 3600 + 47 * 60 + 2.841961)
    assert events[1].time - events[0].time == pytest.approx(16e-6)
    assert isinstance(events[0], LogEvent) and "allocate" in repr(events[0])


def test_rmm_failure_and_stream_forms_parse() -> None:
    failed, allocated, freed = parse_log(RMM_OTHER_FORMS)
    assert (failed.action, failed.ptr, failed.size) == ("allocate failure", 0, 64 << 30)
    assert allocated.stream == freed.stream == 0x5581C6E0A0F0
    assert (freed.action, freed.ptr) == ("free", 0x7F8A40000400)


def test_parse_log_sources(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "rmm.csv"
    path.write_text(RMM_DOC_LOG)
    expected = parse_log(RMM_DOC_LOG)
    assert parse_log(path) == expected
    assert parse_log(str(path)) == expected
    assert parse_log(RMM_DOC_LOG.encode()) == expected
    assert parse_log(LOG_HEADER) == []
    with pytest.raises(FileNotFoundError):
        parse_log(str(tmp_path / "missing.csv"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty log"),
        ("Time,Thread\n1,2\n", "line 1: expected the header"),
        (LOG_HEADER + "\n1,00:00:01.0,allocate,0x100,12\n", "line 2: expected 6"),
        (LOG_HEADER + "\n\n1,00:00:01.0,grow,0x100,12,0\n", "line 3: unknown action"),
        (LOG_HEADER + "\n1,00:00:01.0,free,0xZZ,12,0\n", "line 2: bad pointer"),
        (LOG_HEADER + "\n1,00:00:01.0,free,0x100,-12,0\n", "line 2: bad size"),
    ],
)
def test_parse_log_names_the_bad_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_log(text + ("\n" if not text else ""))


def read_events(path: str | os.PathLike[str]) -> list[tuple[str, int, int, int]]:
    return [(e.action, e.ptr, e.size, e.stream) for e in parse_log(pathlib.Path(path))]


def test_log_file_parses_back_and_is_flushed_per_line(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "log.csv"
    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), log_file_name=path)
    assert logged.get_file_name() == str(path)
    assert path.read_text() == LOG_HEADER + "\n"
    s = streampool.Stream()
    a = logged.allocate(1000, s)
    # Read while the adaptor is alive and nothing was flushed explicitly.
    assert read_events(path) == [("allocate", a, 1000, s.handle)]
    b = logged.allocate("1MiB")
    logged.deallocate(a, 1000, s)
    assert read_events(path) == [
        ("allocate", a, 1000, s.handle),
        ("allocate", b, 1 << 20, 0),
        ("free", a, 1000, s.handle),
    ]
    with pytest.raises(streampool.OutOfMemoryError):
        logged.allocate("1GiB")
    logged.deallocate(b, "1MiB")
    logged.flush()
    events = parse_log(path)
    assert [e.action for e in events] == ["allocate", "allocate", "free", "allocate failure", "free"]
    assert (events[3].ptr, events[3].size) == (0, 1 << 30)
    assert {e.thread for e in events} == {threading.get_native_id()}
    lines = path.read_text().splitlines()
    assert lines[0] == LOG_HEADER and len(lines) == 6


def test_log_file_name_is_absolute(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), "relative.csv")
    assert logged.get_file_name() == str(tmp_path / "relative.csv")
    assert (tmp_path / "relative.csv").read_text() == LOG_HEADER + "\n"


def test_log_file_name_is_normalised_as_rmms_abspath(tmp_path: pathlib.Path) -> None:
    (tmp_path / "sub").mkdir()
    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), str(tmp_path / "sub" / ".." / "./a.csv"))
    assert (
        logged.get_file_name()
        == os.path.abspath(tmp_path / "sub" / ".." / "./a.csv")
        == str(tmp_path / "a.csv")
    )


@pytest.mark.parametrize("name", ["/dev/null", "fifo"])
def test_a_log_that_cannot_be_synchronised_flushes(name: str, tmp_path: pathlib.Path) -> None:
    # fsync answers EINVAL on /dev/null and pipes: nothing to make durable, no error (RMM's
    # flush, a stdio flush, has none either).
    if name == "fifo":
        fifo = tmp_path / "log.fifo"
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that opening it to write does not block
        name = str(fifo)
    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), name)
    logged.deallocate(logged.allocate(256), 256)
    logged.flush()
    if name != "/dev/null":
        assert os.read(reader, 1 << 16).decode().startswith(LOG_HEADER)
        os.close(reader)


def test_log_file_from_the_environment(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMPOOL_LOG_FILE", raising=False)
    monkeypatch.delenv("RMM_LOG_FILE", raising=False)
    with pytest.raises(ValueError, match="STREAMPOOL_LOG_FILE"):
        mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource())
    monkeypatch.setenv("RMM_LOG_FILE", str(tmp_path / "rmm.csv"))
    assert mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource()).get_file_name() == str(
        tmp_path / "rmm.csv"
    )
    monkeypatch.setenv("STREAMPOOL_LOG_FILE", str(tmp_path / "ours.csv"))
    assert mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource()).get_file_name() == str(
        tmp_path / "ours.csv"
    )
    # A callback alone is enough: the environment is not consulted.
    assert mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=print).get_file_name() is None


def test_unwritable_log_file(tmp_path: pathlib.Path) -> None:
    upstream = mr.CudaAsyncMemoryResource()
    missing = tmp_path / "missing-dir" / "log.csv"
    with pytest.raises(FileNotFoundError, match="cannot create the log file") as info:
        mr.LoggingResourceAdaptor(upstream, missing)
    assert info.value.filename == str(missing) and str(missing) in str(info.value)
    with pytest.raises(IsADirectoryError) as info:
        mr.LoggingResourceAdaptor(upstream, str(tmp_path))
    assert info.value.filename == str(tmp_path)
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError) as info:
            mr.LoggingResourceAdaptor(upstream, locked / "log.csv")
        assert info.value.filename == str(locked / "log.csv")
    # Nothing was broken: the upstream still allocates, and a good path works.
    logged = mr.LoggingResourceAdaptor(upstream, tmp_path / "ok.csv")
    logged.deallocate(logged.allocate(1024), 1024)
    assert len((tmp_path / "ok.csv").read_text().splitlines()) == 3


def test_callback_sink_gets_every_line(tmp_path: pathlib.Path) -> None:
    lines: list[str] = []
    path = tmp_path / "both.csv"
    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), path, callback=lines.append)
    ptr = logged.allocate(4096)
    logged.deallocate(ptr, 4096)
    assert lines[0] == LOG_HEADER
    assert all("\n" not in line for line in lines)
    assert lines == path.read_text().splitlines()
    assert [(e.action, e.ptr, e.size) for e in parse_log("\n".join(lines))] == [
        ("allocate", ptr, 4096),
        ("free", ptr, 4096),
    ]


def test_callback_must_be_callable() -> None:
    with pytest.raises(TypeError, match="callback must be callable"):
        mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback="log.csv")  # type: ignore[arg-type]


class SinkFailed(Exception):
    pass


@pytest.mark.drop_errors_expected
def test_raising_callback_reaches_the_caller_and_nothing_leaks() -> None:
    failure = SinkFailed("disk full")
    fail_on: set[str] = set()

    def sink(line: str) -> None:
        if line.split(",")[2] in fail_on:
            raise failure

    tracked = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    logged = mr.LoggingResourceAdaptor(tracked, callback=sink)
    fail_on.add("allocate")
    with pytest.raises(SinkFailed) as info:
        logged.allocate(1000)
    assert info.value is failure
    assert tracked.outstanding() == []  # the memory was freed again
    fail_on.clear()
    ptr = logged.allocate(1000)  # still usable
    fail_on.add("free")
    # A free that happened does not raise (adaptors above would take an error to mean
    # that nothing was freed): the sink's exception goes to sys.unraisablehook.
    unraisable: list[BaseException | None] = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys, "unraisablehook", lambda info: unraisable.append(info.exc_value))
        logged.deallocate(ptr, 1000)
    assert unraisable == [failure]
    assert tracked.outstanding() == []  # the free happened
    fail_on.clear()
    with pytest.raises(streampool.InvalidPointerError):
        logged.deallocate(ptr, 1000)  # its own error, not a stale SinkFailed


@pytest.mark.drop_errors_expected  # the undo of the refused allocation logs its free line, refused too
def test_a_callback_that_uses_its_own_adaptor_is_refused_not_recursed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each allocation through the adaptor logs a line, which called the callback again:
    # without end (each failed level logging its undo too, the work doubled per level).
    monkeypatch.setattr(sys, "unraisablehook", lambda info: None)
    base = mr.TrackingResourceAdaptor(mr.CudaAsyncMemoryResource())
    lines: list[str] = []
    holder: list[mr.LoggingResourceAdaptor] = []

    def sink(line: str) -> None:
        lines.append(line)
        if holder and ",allocate," in line:
            holder[0].allocate(256)

    logged = mr.LoggingResourceAdaptor(base, callback=sink)
    holder.append(logged)
    with pytest.raises(streampool.InvalidArgumentError, match="used the adaptor it logs for"):
        logged.allocate(256)
    assert base.outstanding() == [] and len(lines) < 20
    holder.clear()
    logged.deallocate(logged.allocate(256), 256)  # still usable
    # Another resource inside the callback is fine.
    other: list[int] = []
    logged2 = mr.LoggingResourceAdaptor(base, callback=lambda line: other.append(base.allocate(256)))
    logged2.deallocate(logged2.allocate(256), 256)
    for p in other:
        base.deallocate(p, 256)
    assert len(other) == 3 and base.outstanding() == []  # the header line, then two


@pytest.mark.drop_errors_expected
def test_a_failing_sink_on_a_free_leaves_the_counts_above_right(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "unraisablehook", lambda info: None)
    failing = [False]

    def sink(line: str) -> None:
        if failing[0]:
            raise SinkFailed(line)

    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=sink)
    limited = mr.LimitingResourceAdaptor(logged, "1MiB")
    stats = mr.StatisticsResourceAdaptor(limited)
    ptr = stats.allocate("1MiB")
    failing[0] = True
    stats.deallocate(ptr, "1MiB")
    assert stats.allocation_counts.current_bytes == 0 and limited.get_allocated_bytes() == 0
    with pytest.raises(streampool.InvalidPointerError):
        stats.deallocate(ptr, "1MiB")  # freed once only
    failing[0] = False
    stats.deallocate(stats.allocate("1MiB"), "1MiB")  # the limit's room came back


def test_raising_callback_on_the_header_fails_the_constructor() -> None:
    def sink(line: str) -> None:
        raise SinkFailed(line)

    with pytest.raises(SinkFailed, match="Thread,Time"):
        mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), callback=sink)


@pytest.mark.drop_errors_expected
def test_swallowed_callback_error_does_not_leak_into_later_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer freed by the collector cannot raise the sink's exception (it goes to
    sys.unraisablehook); it must not surface later in an unrelated call on the same thread."""
    unraisable: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: unraisable.append(info.exc_value))
    raised: list[Exception] = []

    def sink(line: str) -> None:
        if ",free," in line and not raised:
            raised.append(SinkFailed("at collection"))
            raise raised[0]

    logged = mr.LoggingResourceAdaptor(
        mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), "1MiB"), callback=sink
    )
    buf = streampool.DeviceBuffer(size=100, mr=logged)
    del buf
    gc.collect()
    assert raised  # the sink did raise, inside the free of the collected buffer
    assert unraisable == raised
    with pytest.raises(streampool.OutOfMemoryError):
        logged.allocate("2MiB")
    with pytest.raises(streampool.InvalidPointerError):
        logged.deallocate(0xDEAD0000, 256)


def test_log_from_many_threads(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "threads.csv"
    seen: list[str] = []
    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), path, callback=seen.append)
    errors: list[BaseException] = []
    ids: set[int] = set()

    def worker() -> None:
        try:
            ids.add(threading.get_native_id())
            for i in range(100):
                ptr = logged.allocate(256 * (i + 1))
                logged.deallocate(ptr, 256 * (i + 1))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors
    events = parse_log(path)
    assert len(events) == 1600 and {e.thread for e in events} == ids
    assert sorted(e.size for e in events if e.action == "allocate") == sorted(
        e.size for e in events if e.action == "free"
    )
    # Per address, every allocation is freed before the address is handed out again.
    open_ptrs: dict[int, Any] = {}
    for e in events:
        if e.action == "allocate":
            assert e.ptr not in open_ptrs
            open_ptrs[e.ptr] = e
        else:
            assert open_ptrs.pop(e.ptr).size == e.size
    assert len(seen) == 1601


def test_replaying_our_log_through_the_parser_matches_what_was_done(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "replay.csv"
    logged = mr.LoggingResourceAdaptor(mr.CudaAsyncMemoryResource(), path)
    streams = [streampool.DEFAULT_STREAM, streampool.Stream(), streampool.Stream()]
    done: list[tuple[str, int, int, int]] = []
    live: list[tuple[int, int, streampool.Stream]] = []
    for i in range(40):
        if i % 3 == 2 and live:
            ptr, n, s = live.pop(0)
            logged.deallocate(ptr, n, s)
            done.append(("free", ptr, n, s.handle))
        else:
            n, s = 1000 * (i + 1), streams[i % 3]
            ptr = logged.allocate(n, s)
            live.append((ptr, n, s))
            done.append(("allocate", ptr, n, s.handle))
    assert read_events(path) == done
    for ptr, n, s in live:
        logged.deallocate(ptr, n, s)
