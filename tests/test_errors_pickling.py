"""Exceptions survive pickle and copy (type, message, attributes, notes), so that they
cross process boundaries (multiprocessing, dask); the simulated device's race cap."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
from collections.abc import Callable
from typing import TypeVar

import pytest

import streampool
from streampool import mr
from streampool.harness import plots, profile, recommend, specs, workloads
from streampool.harness.trace import LogFormatError, Trace
from streampool.sim import SimulatedDevice

ROUND_TRIPS: dict[str, Callable[[BaseException], BaseException]] = {
    "pickle": lambda e: pickle.loads(pickle.dumps(e)),
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
}

# Each class once: `RMMError` is RMM's name for `StreampoolError`, the same class.
EXPORTED = list(
    {
        obj: None
        for name in streampool.__all__
        if isinstance(obj := getattr(streampool, name), type) and issubclass(obj, BaseException)
    }
)

# Attributes the exceptions with constructor arguments set, with sample values.
ATTRIBUTES: dict[type[BaseException], dict[str, object]] = {
    streampool.OutOfMemoryError: {"requested": 10, "available": 5},
    streampool.CudaError: {"call": "cuMemAlloc", "code": 2, "name": "CUDA_ERROR_OUT_OF_MEMORY"},
}


E = TypeVar("E", bound=BaseException)


def _annotated(e: E) -> E:
    e.add_note("while loading shard 3")
    e.worker = "w1"  # type: ignore[attr-defined]
    return e


def _check_same(r: BaseException, e: BaseException, attrs: tuple[str, ...] = ()) -> None:
    assert type(r) is type(e)
    assert str(r) == str(e)
    assert r.args == e.args
    assert r.__notes__ == ["while loading shard 3"]
    assert r.worker == "w1"  # type: ignore[attr-defined]
    for attr in attrs:
        if hasattr(e, attr):
            assert getattr(r, attr) == getattr(e, attr), attr


#: Every exception class ``streampool`` exports, by name: a new one must be added here, and
#: to ATTRIBUTES when its constructor takes more than a message.
KNOWN_EXCEPTIONS = {
    "CudaDriverNotFoundError",
    "CudaError",
    "InvalidArgumentError",
    "InvalidPointerError",
    "InvalidStreamError",
    "OutOfMemoryError",
    "SimulatedDeviceActiveError",
    "StreampoolError",
    "UnsupportedError",
}


def test_every_exported_exception_is_tested() -> None:
    """The exception classes in ``streampool.__all__`` (which the round-trip tests take,
    EXPORTED) are exactly those listed here, each once: an exception added or removed
    fails this test until the list, and ATTRIBUTES where it has attributes, say so."""
    names = [c.__name__ for c in EXPORTED]
    assert len(names) == len(set(names)), names
    assert set(names) == KNOWN_EXCEPTIONS
    assert set(ATTRIBUTES) <= set(EXPORTED)


@pytest.mark.parametrize("how", ROUND_TRIPS)
@pytest.mark.parametrize("cls", EXPORTED, ids=lambda c: c.__name__)
def test_exported_exception_round_trips_with_notes_and_attributes(cls: type[BaseException], how: str) -> None:
    for args in (("a message",), ()):
        e = cls(*args)
        r = ROUND_TRIPS[how](_annotated(e))
        _check_same(r, e, ("requested", "available", "call", "code", "name"))


@pytest.mark.parametrize("how", ROUND_TRIPS)
@pytest.mark.parametrize("cls", list(ATTRIBUTES), ids=lambda c: c.__name__)
def test_exception_attributes_round_trip(cls: type[BaseException], how: str) -> None:
    values = ATTRIBUTES[cls]
    e = _annotated(cls("a message", *values.values()))
    r = ROUND_TRIPS[how](e)
    _check_same(r, e)
    assert {k: getattr(r, k) for k in values} == values


@pytest.mark.parametrize(
    "cls", [streampool.OutOfMemoryError, streampool.CudaError, streampool.CudaDriverNotFoundError]
)
def test_bare_raise(cls: type[streampool.StreampoolError]) -> None:
    with pytest.raises(cls) as info:
        raise cls
    assert str(info.value) == ""
    for attr in ("requested", "available", "call", "code", "name"):
        assert getattr(info.value, attr, None) is None
    if cls is streampool.OutOfMemoryError:
        assert isinstance(info.value, MemoryError)


def test_native_out_of_memory_round_trips() -> None:
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), 100)
    with pytest.raises(streampool.OutOfMemoryError) as info:
        limited.allocate(1000)
    e = _annotated(info.value)
    assert e.requested == 1000
    _check_same(pickle.loads(pickle.dumps(e)), e, ("requested", "available"))


HARNESS_ERRORS = [
    specs.SpecError("s"),
    specs.PeerMissingError("p"),
    recommend.NothingToRecommendError("n"),
    workloads.WorkloadError("w"),
    profile.CannotStartError("c"),
    plots.PlotsUnavailableError("p"),
]


@pytest.mark.parametrize("how", ROUND_TRIPS)
@pytest.mark.parametrize("e", HARNESS_ERRORS, ids=lambda e: type(e).__name__)
def test_harness_exception_round_trips(e: BaseException, how: str) -> None:
    e = type(e)(*e.args)  # a fresh one per test, to annotate (a copy can share its notes)
    _check_same(ROUND_TRIPS[how](_annotated(e)), e)


def _log_format_error() -> LogFormatError:
    errors = [(n, f"bad field {n}") for n in range(3, 15)]  # over 10: the message abridges
    return LogFormatError("app.log", errors, Trace(records=[(0, 256, 0, 0, 0, 0)], thread_ids=[7]))


@pytest.mark.parametrize("how", ROUND_TRIPS)
def test_log_format_error_round_trips(how: str) -> None:
    e = _annotated(_log_format_error())
    r = ROUND_TRIPS[how](e)
    assert isinstance(r, LogFormatError)
    assert r.path == "app.log"
    _check_same(r, e, ("path", "errors", "trace"))
    assert r.trace is not None and r.trace.thread_ids == [7]


@pytest.mark.nosim
def test_log_format_error_from_a_process_pool() -> None:
    # Before it pickled, the pool's result thread died unpickling it and the call hung.
    code = "from streampool.harness.trace import LogFormatError\nraise LogFormatError('x.csv', [(3, 'bad')], None)"
    with multiprocessing.get_context("spawn").Pool(1) as pool, pytest.raises(LogFormatError) as info:
        pool.apply_async(exec, (code,)).get(timeout=60)
    assert info.value.path == "x.csv"
    assert info.value.errors == [(3, "bad")]
    assert info.value.trace is None


@pytest.mark.races_expected
def test_races_dropped_counts_races_beyond_the_cap(sim: SimulatedDevice) -> None:
    a, b = streampool.Stream(), streampool.Stream()
    buf = streampool.DeviceBuffer(size=4096, stream=a)
    sim.write(a, buf.ptr, 8)
    sim.write(b, buf.ptr, 8)
    sim.run()
    assert len(sim.races()) == 1 and sim.races_dropped == 0
    for _ in range(1200):
        sim.write(a, buf.ptr, 8)
        sim.write(b, buf.ptr, 8)
    sim.run()
    assert len(sim.races()) == 1000
    assert sim.races_dropped > 0
    sim.clear_races()
    assert sim.races() == [] and sim.races_dropped == 0
