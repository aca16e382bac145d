"""The argument forms of the hot calls (`allocate`, `deallocate`, `DeviceBuffer(...)`): every
form accepted and every error raised, pinned, so that the binding's fast paths for the
common forms (a plain int, a `Stream`) cannot change what the other forms do."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

import streampool
from streampool import mr

# The pool settles on the fast path with the GIL held; the driver's pool falls back to the
# call that releases it. Both paths must see the same arguments.
MAKERS: dict[str, Callable[[], mr.MemoryResource]] = {
    "pool": lambda: mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()),
    "async": lambda: mr.CudaAsyncMemoryResource(),
}


@pytest.fixture(params=sorted(MAKERS))
def res(request: pytest.FixtureRequest) -> mr.MemoryResource:
    return MAKERS[request.param]()


class MyInt(int):
    pass


class Index:
    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


SIZE_TYPE = 'must be a size in bytes (an int, or a string such as "1GiB"), not '
SIZES = [256, "256", "1KiB", MyInt(256), np.int64(256), np.uint64(256), Index(256)]


@pytest.mark.parametrize("size", SIZES, ids=repr)
def test_size_forms(res: mr.MemoryResource, size: object) -> None:
    s = streampool.Stream()
    p = res.allocate(size, s)  # type: ignore[arg-type]
    assert p != 0 and p % 256 == 0
    res.deallocate(p, size, s)  # type: ignore[arg-type]


def test_zero_size(res: mr.MemoryResource) -> None:
    assert res.allocate(0) == 0
    res.deallocate(0, 0)


@pytest.mark.parametrize(
    ("size", "error", "match"),
    [
        (True, TypeError, "nbytes " + SIZE_TYPE + "bool"),
        (1.0, TypeError, "nbytes " + SIZE_TYPE + "float"),
        (None, TypeError, "nbytes " + SIZE_TYPE + "NoneType"),
        (-1, ValueError, "nbytes must be >= 0, got -1"),
        (MyInt(-1), ValueError, "nbytes must be >= 0, got -1"),
        (np.int64(-1), ValueError, "nbytes must be >= 0, got -1"),
        (-(2**70), ValueError, f"nbytes must be >= 0, got {-(2**70)}"),
        (2**64, ValueError, f"nbytes = {2**64} is too large"),
        ("lots", streampool.InvalidArgumentError, "lots"),
        # Converted, then refused by the resource: above isize::MAX.
        (2**63, streampool.OutOfMemoryError, str(2**63)),
        (2**64 - 1, streampool.OutOfMemoryError, str(2**64 - 1)),
    ],
    ids=repr,
)
def test_bad_sizes(res: mr.MemoryResource, size: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        res.allocate(size)  # type: ignore[arg-type]


@pytest.mark.parametrize("form", [int, MyInt, np.uint64, Index], ids=lambda f: f.__name__)
def test_pointer_forms(res: mr.MemoryResource, form: Callable[[int], object]) -> None:
    p = res.allocate(4096)
    res.deallocate(form(p), 4096)  # type: ignore[arg-type]
    q = res.allocate(4096)  # the free took: the memory is usable again
    res.deallocate(q, 4096)


@pytest.mark.parametrize(
    ("ptr", "error", "match"),
    [
        (True, TypeError, "ptr must be an address (an int), not bool"),
        (1.0, TypeError, "ptr must be an address (an int), not float"),
        ("256", TypeError, "ptr must be an address (an int), not str"),
        (-1, ValueError, "ptr = -1 is not an address (must be in 0..2**64)"),
        (MyInt(-1), ValueError, "ptr = -1 is not an address (must be in 0..2**64)"),
        (2**64, ValueError, f"ptr = {2**64} is not an address (must be in 0..2**64)"),
        # Valid addresses, above and at the edges of what a C long holds: they reach the
        # resource, which does not know them.
        (2**63 + 256, streampool.InvalidPointerError, "0x8000000000000100"),
        (2**64 - 256, streampool.InvalidPointerError, "0xffffffffffffff00"),
        (2**63 - 256, streampool.InvalidPointerError, "0x7fffffffffffff00"),
    ],
    ids=repr,
)
def test_bad_pointers(res: mr.MemoryResource, ptr: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        res.deallocate(ptr, 256)  # type: ignore[arg-type]


def stream_forms() -> list[object]:
    s = streampool.Stream()
    return [
        None,
        s,
        s.handle,
        MyInt(s.handle),
        0,
        1,
        2,
        streampool.DEFAULT_STREAM,
        streampool.LEGACY_DEFAULT_STREAM,
        streampool.PER_THREAD_DEFAULT_STREAM,
    ]


def test_stream_forms(res: mr.MemoryResource) -> None:
    for form in stream_forms():
        p = res.allocate(256, form)  # type: ignore[arg-type]
        res.deallocate(p, 256, form)  # type: ignore[arg-type]
        p = res.allocate(nbytes=256, stream=form)  # type: ignore[arg-type]
        res.deallocate(ptr=p, nbytes=256, stream=form)  # type: ignore[arg-type]
        buf = streampool.DeviceBuffer(size=256, stream=form, mr=res)  # type: ignore[arg-type]
        assert buf.stream is (streampool.DEFAULT_STREAM if form is None else form)


@pytest.mark.nosim
def test_streams_of_other_devices_and_backends_are_refused() -> None:
    with streampool.sim.SimulatedDevice(capacity_bytes="64MiB", devices=2):
        other = streampool.Stream(device=1)
        for res in (MAKERS["pool"](), MAKERS["async"]()):
            with pytest.raises(streampool.InvalidStreamError, match="belongs to device 1"):
                res.allocate(256, other)
            with pytest.raises(streampool.InvalidStreamError, match="belongs to device 1"):
                streampool.DeviceBuffer(size=256, stream=other, mr=res)
    with streampool.sim.SimulatedDevice(capacity_bytes="64MiB"):
        res = MAKERS["pool"]()
        with pytest.raises(streampool.InvalidStreamError, match="but this object was made on"):
            res.allocate(256, other)  # a stream of a simulated device that is gone
        with pytest.raises(streampool.InvalidStreamError, match="names no live stream of simulated device"):
            res.allocate(256, other.handle)  # its handle means nothing to this one


@pytest.mark.parametrize(
    ("stream", "error", "match"),
    [
        (True, TypeError, "cannot use a bool as a stream"),
        (1.5, TypeError, "cannot use a float as a stream"),
        (object(), TypeError, "cannot use a object as a stream"),
        (-3, ValueError, "-3 is not a stream handle (must be in 0..2**64)"),
        (0x12345, streampool.InvalidStreamError, "0x12345"),
    ],
    ids=repr,
)
def test_bad_streams(res: mr.MemoryResource, stream: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        res.allocate(256, stream)  # type: ignore[arg-type]
    p = res.allocate(256)
    with pytest.raises(error, match=re.escape(match)):
        res.deallocate(p, 256, stream)  # type: ignore[arg-type]
    res.deallocate(p, 256)
    with pytest.raises(error, match=re.escape(match)):
        streampool.DeviceBuffer(size=256, stream=stream, mr=res)  # type: ignore[arg-type]


def test_method_argument_errors(res: mr.MemoryResource) -> None:
    with pytest.raises(
        TypeError, match=re.escape("allocate() takes from 1 to 2 positional arguments but 3 were given")
    ):
        res.allocate(1, None, 4)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=re.escape("allocate() got an unexpected keyword argument 'x'")):
        res.allocate(nbytes=1, x=4)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError, match=re.escape("deallocate() missing 1 required positional argument: 'nbytes'")
    ):
        res.deallocate(1)  # type: ignore[call-arg]


def test_buffer_argument_forms(res: mr.MemoryResource) -> None:
    s = streampool.Stream()
    for buf in (
        streampool.DeviceBuffer(100, s, res),
        streampool.DeviceBuffer(100, s, mr=res),
        streampool.DeviceBuffer(100, stream=s, mr=res),
        streampool.DeviceBuffer(mr=res, size=100, stream=s),
        streampool.DeviceBuffer(**{"stream": s, "mr": res, "size": "100"}),  # type: ignore[arg-type]
    ):
        assert (buf.size, buf.stream, buf.mr) == (100, s, res)
        assert buf.ptr != 0
    for buf in (
        streampool.DeviceBuffer(),
        streampool.DeviceBuffer(None, None, None),
        streampool.DeviceBuffer(size=None),
    ):
        assert (buf.size, buf.ptr, buf.stream) == (0, 0, streampool.DEFAULT_STREAM)
        assert buf.mr is streampool.get_current_device_resource()
    buf = streampool.DeviceBuffer(size=MyInt(7), mr=res)
    assert buf.size == 7 and type(buf.size) is int


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (
            (1, None, None, 4),
            {},
            "DeviceBuffer.__new__() takes from 0 to 3 positional arguments but 4 were given",
        ),
        ((1,), {"foo": 3}, "DeviceBuffer.__new__() got an unexpected keyword argument 'foo'"),
        ((1,), {"size": 3}, "DeviceBuffer.__new__() got multiple values for argument 'size'"),
        ((1, None), {"stream": None}, "DeviceBuffer.__new__() got multiple values for argument 'stream'"),
        ((), {"mr": 3}, "'int' object is not an instance of 'MemoryResource'"),
        ((), {"size": 1.5}, "size " + SIZE_TYPE + "float"),
    ],
)
def test_buffer_argument_errors(args: tuple[object, ...], kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(TypeError, match=re.escape(match)):
        streampool.DeviceBuffer(*args, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("size must be >= 0, got -1")):
        streampool.DeviceBuffer(size=-1)


# --- what a hostile argument gets: the user's own exception, or one naming the argument ---


class RaisingIndex:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __index__(self) -> int:
        raise self.error


class StrIndex:
    def __index__(self) -> str:  # type: ignore[override]
        return "5"


def test_an_index_that_raises_reaches_the_caller_unchanged(res: mr.MemoryResource) -> None:
    for error in (RuntimeError("mine"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            res.allocate(RaisingIndex(error))  # type: ignore[arg-type]
        with pytest.raises(type(error)):
            streampool.parse_size(RaisingIndex(error))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"__index__ returned non-int \(type str\)"):
        res.allocate(StrIndex())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="__index__ returned non-int"):
        streampool.DeviceBuffer(size=8).prefetch(device=StrIndex())  # type: ignore[arg-type]

    class Meta(type):
        def __index__(cls) -> int:
            return 4096

    class WithMeta(metaclass=Meta):
        pass

    # The instance's type's __index__, as operator.index looks it up: not its metaclass's.
    with pytest.raises(TypeError, match="nbytes must be"):
        res.allocate(WithMeta())  # type: ignore[arg-type]
    res.deallocate(res.allocate(256), 256)  # still usable


def test_the_native_pipeline_s_counts_are_named() -> None:
    from streampool import _native

    r = mr.CudaAsyncMemoryResource()
    for kw, error, match in [
        ({"pairs": -1}, ValueError, "pairs must be >= 1, got -1"),
        ({"pairs": 2**64}, ValueError, "pairs must be <= 512"),
        ({"pairs": True}, TypeError, "pairs must be an int, not bool"),
        ({"check_every": True}, TypeError, "check_every must be an int, not bool"),
        ({"queue_depth": 0}, ValueError, "queue_depth must be >= 1"),
        ({"null_call_us": 1}, ValueError, "null_call_us needs long_call_us"),
        ({"null_call_us": 101, "long_call_us": 1}, ValueError, "null_call_us must be at most 100"),
    ]:
        with pytest.raises(error, match=match):
            _native.pipeline(r, chunks_per_pair=1, kernel_us=0, **kw)
    assert _native.pipeline(r, pairs=1, chunks_per_pair=2, kernel_us=0)["chunks"] == 2


def test_an_ipc_import_s_fd_and_pid_are_named() -> None:
    from streampool.ipc import IpcImportedMemoryResource

    for fd, pid, error, match in [
        (2**31, 1, ValueError, "fd must be <= 2147483647"),
        (3, -1, ValueError, "pid must be >= 0"),
        (True, 1, TypeError, "fd must be an int, not bool"),
    ]:
        with pytest.raises(error, match=match):
            IpcImportedMemoryResource(fd, b"x" * 64, 256, pid, 0)


def test_a_log_parser_does_not_take_an_int_for_a_file_descriptor() -> None:
    import os

    from streampool import logs
    from streampool.harness import trace

    read, write = os.pipe()
    os.write(write, b"x")
    os.close(write)  # a parser that read it would not block
    try:
        for parse in (logs.parse_log, logs.parse_log_file, trace.read_log):
            with pytest.raises(TypeError, match="must be a str"):
                parse(read)  # type: ignore[arg-type]
        assert os.read(read, 1) == b"x"  # neither read nor closed
    finally:
        os.close(read)


def test_bench_measure_refuses_nonsense_arguments_naming_them() -> None:
    from streampool.harness import bench, specs

    for kwargs, error, match in [
        ({"specs": "async"}, TypeError, "specs must be a non-empty list"),
        ({"specs": []}, TypeError, "specs must be a non-empty list"),
        ({"threads": b"24"}, TypeError, "threads must be an iterable"),
        ({"threads": []}, ValueError, "at least one thread count"),
        ({"repeats": 0}, ValueError, "repeats must be an int >= 1"),
        ({"repeats": True}, TypeError, "repeats must be an int >= 1"),
        ({"repeats": 2.0}, TypeError, "repeats must be an int >= 1"),
        (
            {"threads": 4},
            TypeError,
            r"threads must be an iterable of thread counts \(ints\), e\.g\. \[1, 4\]",
        ),
    ]:
        args = {"specs": ["async"], "threads": [1], "repeats": 1} | kwargs
        with pytest.raises(error, match=match):
            bench.measure("window", params={"allocations": 10}, **args)
    with pytest.raises(TypeError, match="a resource spec must be a str, not list"):
        specs.make_resource(["async"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a str, not int"):
        specs.split_specs(5)  # type: ignore[arg-type]
