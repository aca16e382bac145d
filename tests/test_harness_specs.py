"""The harness's resource specs: every spec makes its resource; bad specs are refused clearly."""

from __future__ import annotations

import importlib.util

import pytest

import streampool
from streampool import mr
from streampool.harness import specs
from streampool.harness.specs import (
    VALID_SPECS,
    PeerMissingError,
    SpecError,
    check_spec,
    make_resource,
    split_specs,
)

OURS = {
    "async": mr.CudaAsyncMemoryResource,
    "async(initial=8MiB, release=16MiB)": mr.CudaAsyncMemoryResource,
    "cuda": mr.CudaMemoryResource,
    "managed": mr.ManagedMemoryResource,
    "pool(async)": mr.ShardedPoolMemoryResource,
    "pool(async, initial=8MiB)": mr.ShardedPoolMemoryResource,
    "pool(cuda, initial=4MiB, maximum=64MiB, headroom=none)": mr.ShardedPoolMemoryResource,
    "pool(async, expandable=true)": mr.ShardedPoolMemoryResource,
    "pool(async, expandable=true, steal_whole_blocks=true)": mr.ShardedPoolMemoryResource,
    "pool(async, expandable=true, steal_whole_blocks=true, gather_interval=0)": mr.ShardedPoolMemoryResource,
    "pool(async, expandable=true, one_heap=true)": mr.ShardedPoolMemoryResource,
    "prefetch(managed)": mr.PrefetchResourceAdaptor,
    "binning(async)": mr.BinningMemoryResource,
    "binning(async, min=12, max=16)": mr.BinningMemoryResource,
    "arena(async, size=32MiB)": mr.ArenaMemoryResource,
    "stats(pool(async))": mr.StatisticsResourceAdaptor,
    "tracking(async)": mr.TrackingResourceAdaptor,
    "limit(async, limit=64MiB)": mr.LimitingResourceAdaptor,
    "latency(pool(async))": mr.LatencyHistogramAdaptor,
}


@pytest.mark.parametrize("text", sorted(OURS))
def test_every_spec_makes_its_resource_and_its_code_makes_the_same(text: str) -> None:
    candidate = make_resource(text)
    assert type(candidate.resource) is OURS[text]
    stream = streampool.Stream()
    ptr = candidate.resource.allocate(1 << 16, stream)
    assert ptr != 0
    candidate.resource.deallocate(ptr, 1 << 16, stream)
    stream.synchronize()
    lines = candidate.code.splitlines()
    assert len(lines) == 2, candidate.code  # the 2 lines that apply it
    previous = streampool.get_current_device_resource()
    try:
        exec(candidate.code, {})
        assert type(streampool.get_current_device_resource()) is OURS[text]
    finally:
        streampool.set_current_device_resource(previous)


def test_reserved_bytes_beside_live_bytes() -> None:
    pool = make_resource("pool(async, initial=8MiB)")
    assert pool.reserved() == 8 << 20 and not pool.reserves_live
    plain = make_resource("stats(cuda)")
    assert plain.reserved() is None and plain.reserves_live  # holds nothing beyond what is live


def test_split_specs_at_top_level_commas_only() -> None:
    assert split_specs("async, pool(async, initial=1GiB),stats(pool(async))") == [
        "async",
        "pool(async, initial=1GiB)",
        "stats(pool(async))",
    ]
    with pytest.raises(SpecError, match="empty spec"):
        split_specs("async,,cuda")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("nosuch", r"unknown resource 'nosuch'.*Valid specs: async"),
        # A part's error names the whole spec the user wrote.
        ("pool(nosuch)", r"^in the spec 'pool\(nosuch\)': unknown resource 'nosuch'"),
        (
            "stats(pool(async, bogus=1))",
            r"^in the spec 'stats\(pool\(async, bogus=1\)\)': .*no option 'bogus'",
        ),
        ("pool(async", r"missing '\)'"),
        ("pool", r"takes one upstream"),
        ("async(async)", r"takes no upstream"),
        ("pool(async, bogus=1)", r"no option 'bogus' \(options: initial"),
        ("async(initial=lots)", r"option initial=lots"),
        ("pool(async, expandable=maybe)", r"option expandable=maybe: expected true or false"),
        ("pool(async, gather_interval=-1)", r"pool\(async, gather_interval=-1\): .*gather_interval"),
        ("pool(async) extra", r"unexpected"),
        ("nolib:async", r"unknown peer library 'nolib'"),
        ("rmm:nosuch", r"unknown peer resource 'rmm:nosuch'"),
        ("pool(a$ync)", r"cannot read"),
    ],
)
def test_bad_specs_are_refused_naming_the_valid_ones(text: str, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        make_resource(text)
    if "gather_interval" not in text:  # a value only the resource judges, when it is made
        with pytest.raises(SpecError):
            check_spec(text)


@pytest.mark.parametrize(
    "text",
    ["limit(async)", "stats(pool(async), x=1)", "pool(async, initial=abc)", "latency(async, x=1)", "latency"],
)
def test_check_spec_refuses_what_make_resource_refuses(text: str) -> None:
    with pytest.raises(SpecError) as made:
        make_resource(text)
    with pytest.raises(SpecError) as checked:
        check_spec(text)
    assert str(checked.value) == str(made.value)


@pytest.mark.parametrize("text", VALID_SPECS)
def test_check_spec_passes_every_valid_spec(text: str) -> None:
    check_spec(text.replace("X", "pool(async)"))  # X: any upstream


def test_peers_are_refused_on_the_simulated_device() -> None:
    with pytest.raises(PeerMissingError, match="simulated device"):
        make_resource("cupy:pool")


@pytest.mark.parametrize(
    ("lib", "package"), [("rmm", "pip install rmm-cu1"), ("cupy", "pip install cupy-cuda1")]
)
def test_a_peer_not_installed_names_the_package(lib: str, package: str) -> None:
    if importlib.util.find_spec(lib) is not None:
        pytest.skip(f"{lib} is installed")
    with pytest.raises(PeerMissingError, match=package):
        specs._import_peer(lib)


# --- the peers' wrappers, over stand-ins for their libraries ------------------------------
# (the real libraries need a GPU: the GPU suite runs them; here the plumbing is checked:
# stream conversion, the size and stream each call gets, frees, reserved bytes)


class _FakeRmmResource:
    def __init__(self, *args: object) -> None:
        self.base = mr.CudaAsyncMemoryResource()
        self.calls: list[tuple[str, int, object]] = []

    def allocate(self, size: int, stream: object) -> int:
        self.calls.append(("allocate", size, stream))
        return self.base.allocate(size)

    def deallocate(self, ptr: int, size: int, stream: object) -> None:
        self.calls.append(("free", size, stream))
        self.base.deallocate(ptr, size)

    def pool_size(self) -> int:
        return 12345


def _exercise(allocate: object, deallocate: object) -> None:
    resource = mr.CallbackMemoryResource(allocate, deallocate)  # type: ignore[arg-type]
    stream = streampool.Stream()
    ptr = resource.allocate(4096, stream)
    resource.deallocate(ptr, 4096, stream)


def _install_fake_rmm(monkeypatch: pytest.MonkeyPatch, rmr: object) -> None:
    """Makes ``rmr`` RMM's ``rmm.mr`` for the test, with RMM's stream wrapper beside it."""
    import sys
    import types

    stream_module = types.SimpleNamespace(Stream=lambda s: ("rmm-stream", s.handle))
    monkeypatch.setitem(sys.modules, "rmm.mr", rmr)
    monkeypatch.setitem(sys.modules, "rmm.pylibrmm", types.SimpleNamespace(stream=stream_module))
    monkeypatch.setitem(sys.modules, "rmm.pylibrmm.stream", stream_module)


def test_the_rmm_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    made: list[_FakeRmmResource] = []
    rmr = types.SimpleNamespace(
        CudaAsyncMemoryResource=lambda: made.append(_FakeRmmResource()) or made[-1],
        CudaMemoryResource=object,
        PoolMemoryResource=lambda up: made.append(_FakeRmmResource()) or made[-1],
    )
    _install_fake_rmm(monkeypatch, rmr)
    allocate, deallocate, reserved, _keep, code = specs._rmm(types.SimpleNamespace(), "pool(cuda)")
    _exercise(allocate, deallocate)
    calls = made[-1].calls
    assert [c[:2] for c in calls] == [("allocate", 4096), ("free", 4096)]
    assert calls[0][2] == calls[1][2] and calls[0][2][0] == "rmm-stream"  # one RMM stream per stream
    assert reserved() == 12345 and "rmm" in code


def test_every_rmm_resource_says_what_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Speed is never reported without memory: each RMM peer reports the bytes it holds from
    # the device (a pool's size; RMM's own driver pool's reserved bytes; the arena's upstream
    # peak), not None.
    import types

    own_pool = mr.CudaAsyncMemoryResource(initial_pool_size="4MiB", release_threshold="64MiB")

    class Async(_FakeRmmResource):  # RMM's: no pool handle; its pointers name its pool
        def allocate(self, size: int, stream: object = None) -> int:
            self.calls.append(("allocate", size, stream))
            return own_pool.allocate(size)

        def deallocate(self, ptr: int, size: int, stream: object = None) -> None:
            self.calls.append(("free", size, stream))
            own_pool.deallocate(ptr, size)

    class Stats(_FakeRmmResource):
        def __init__(self, upstream: object) -> None:
            super().__init__()
            self.allocation_counts = types.SimpleNamespace(peak_bytes=777)  # RMM 25 on: an object

    rmr = types.SimpleNamespace(
        CudaAsyncMemoryResource=Async,
        CudaMemoryResource=_FakeRmmResource,
        PoolMemoryResource=_FakeRmmResource,
        StatisticsResourceAdaptor=Stats,
        ArenaMemoryResource=_FakeRmmResource,
        BinningMemoryResource=_FakeRmmResource,
    )
    _install_fake_rmm(monkeypatch, rmr)
    expected = {"async": 4 << 20, "binning": 4 << 20, "pool(cuda)": 12345, "pool(async)": 12345, "arena": 777}
    for name, held in expected.items():
        allocate, deallocate, reserved, _keep, _code = specs._rmm(types.SimpleNamespace(), name)
        _exercise(allocate, deallocate)
        assert reserved() == held, name
    Stats.__init__ = lambda self, upstream: setattr(self, "allocation_counts", {"peak_bytes": 778})  # type: ignore[method-assign]
    assert specs._rmm(types.SimpleNamespace(), "arena")[2]() == 778  # RMM before 25: a dict


def test_the_cupy_wrapper() -> None:
    import types

    base = mr.CudaAsyncMemoryResource()
    current: list[int] = []
    freed: list[int] = []

    class Memory:
        def __init__(self, size: int) -> None:
            self.ptr, self.size = base.allocate(size), size

        def __del__(self) -> None:  # CuPy frees when the last reference goes
            freed.append(current[-1])
            base.deallocate(self.ptr, self.size)

    class External:  # CuPy's ExternalStream: reusable as the current stream
        def __init__(self, handle: int) -> None:
            self.handle = handle

        def __enter__(self) -> None:
            current.append(self.handle)

        def __exit__(self, *exc: object) -> None:
            current.pop()

    class Pool:
        def malloc(self, size: int) -> Memory:
            assert current, "allocated outside the stream's context"
            return Memory(size)

        def total_bytes(self) -> int:
            return 777

    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(MemoryPool=Pool, MemoryAsyncPool=Pool, ExternalStream=External)
    )
    allocate, deallocate, reserved, _keep, code = specs._cupy(cupy, "pool")
    stream = streampool.Stream()
    _exercise(allocate, deallocate)
    assert len(freed) == 1 and freed[0] != 0  # freed on the stream's context, not the default
    assert reserved() == 777 and "MemoryPool().malloc" in code
    del stream


def test_the_torch_wrapper() -> None:
    import types

    base = mr.CudaAsyncMemoryResource()
    seen: list[tuple[int, int]] = []
    sizes: dict[int, int] = {}

    def alloc(size: int, device: int, stream: int) -> int:
        seen.append((size, stream))
        ptr = base.allocate(size)
        sizes[ptr] = size
        return ptr

    cuda = types.SimpleNamespace(
        current_device=lambda: 0,
        caching_allocator_alloc=alloc,
        caching_allocator_delete=lambda ptr: base.deallocate(ptr, sizes.pop(ptr)),
        memory_reserved=lambda device: 4242,
    )
    allocate, deallocate, reserved, _keep, _code = specs._torch(types.SimpleNamespace(cuda=cuda), "native")
    _exercise(allocate, deallocate)
    assert len(seen) == 1 and seen[0][0] == 4096 and seen[0][1] != 0  # the stream's raw handle
    assert not sizes and reserved() == 4242


# --- what the review found ----------------------------------------------------------------


def test_a_required_option_left_out_is_named() -> None:
    with pytest.raises(SpecError, match=r"limit\(async\): limit needs the option limit=, e\.g\. limit\("):
        make_resource("limit(async)")


def test_a_size_may_have_a_space_before_its_unit() -> None:
    candidate = make_resource("pool(async, initial=1 MiB, maximum = 64 MiB )")
    assert "initial_pool_size=1048576, maximum_pool_size=67108864" in candidate.code
    with pytest.raises(SpecError, match=r"option initial=1 MiB x: .*cannot parse"):
        make_resource("pool(async, initial=1 MiB x)")


def test_a_peer_inside_another_spec_is_refused_as_a_bare_one(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PeerMissingError, match="cannot run on the simulated device"):
        make_resource("stats(rmm:async)")
    with pytest.raises(SpecError, match="unknown peer library 'nolib'"):
        make_resource("stats(nolib:async)")
    monkeypatch.setattr(specs, "using_simulated_device", lambda: False)
    if importlib.util.find_spec("rmm") is None:
        with pytest.raises(PeerMissingError, match=r"rmm is not installed.*pip install rmm-cu1"):
            make_resource("stats(rmm:async)")
    else:
        with pytest.raises(SpecError, match="cannot be the upstream"):
            make_resource("stats(rmm:async)")


@pytest.mark.nosim
@pytest.mark.parametrize("text", sorted(OURS))
def test_the_setup_code_for_another_device_runs_and_makes_its_resource(text: str) -> None:
    from streampool.sim import SimulatedDevice

    with SimulatedDevice(capacity_bytes="256MiB", devices=2):
        code = specs.setup_code(text, 1)
        assert "set_per_device_resource(1, " in code, code
        exec(code, {})  # what recommend prints for a log of device 1
        made = streampool.get_per_device_resource(1)
        assert isinstance(made, OURS[text]) and made.device == 1, (code, made)


@pytest.mark.parametrize("spec", ["binning(cuda)", "binning(managed)", "latency(binning(cuda))"])
def test_a_binning_resource_with_no_pool_under_it_says_what_it_holds(spec: str) -> None:
    # Speed is never reported without memory: what the bins took from the device, measured
    # by a statistics adaptor under them that the printed code leaves out.
    candidate = specs.make_resource(spec)
    assert "Statistics" not in candidate.code
    s = streampool.Stream()
    ptr = candidate.resource.allocate(1000, s)
    candidate.resource.deallocate(ptr, 1000, s)
    held = candidate.reserved()
    assert held is not None and held >= 1000, held
    assert specs.make_resource("binning(async)").reserved() is not None  # the driver pool, as before
