"""Resources by spec string: ``async``, ``pool(async)``, ``pool(async, initial=8GiB)``,
``stats(pool(async))``, ``rmm:pool(cuda)``, ``cupy:pool``, ...

A spec is a name with optional arguments in parentheses: adaptors and pools take their
upstream as the first argument, then ``key=value`` options (sizes as ``"8GiB"``, see
:func:`streampool.parse_size`). Peers (RMM, CuPy, PyTorch) are wrapped behind
streampool's resource interface (a :class:`~streampool.mr.CallbackMemoryResource`), so
that every workload runs on them in the same process. Example::

    from streampool.harness import make_resource
    candidate = make_resource("pool(async, initial=1GiB)")
    ptr = candidate.resource.allocate(1 << 20)
    candidate.resource.deallocate(ptr, 1 << 20)
    print(candidate.code)   # the Python lines that make the same resource
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import mr
from .._native import Stream, parse_size, pointer_pool, using_simulated_device

__all__ = [
    "VALID_SPECS",
    "Candidate",
    "PeerMissingError",
    "SpecError",
    "check_distinct",
    "make_resource",
    "parse_spec",
    "split_specs",
]


class SpecError(ValueError):
    """A spec string that does not name a resource (the message lists the valid ones)."""


@contextlib.contextmanager
def _naming(text: str) -> Iterator[None]:
    """Adds the whole spec to a SpecError about a part of it (``nosuch`` in ``pool(nosuch)``)."""
    try:
        yield
    except SpecError as e:
        whole = str(parse_spec(text))
        if whole in str(e):
            raise
        raise SpecError(f"in the spec {whole!r}: {e}") from None


class PeerMissingError(RuntimeError):
    """A spec names a peer library that is not installed (the message names the package)."""


@dataclass(frozen=True)
class Spec:
    """A parsed spec: ``name(args..., key=value...)``."""

    name: str
    args: tuple[Spec, ...] = ()
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        inner = [str(a) for a in self.args] + [f"{k}={v}" for k, v in self.options]
        return f"{self.name}({', '.join(inner)})" if inner else self.name


# A name, a `key=value` option (its value runs to the next comma or parenthesis: sizes
# may have a space, "1 GiB"), or a parenthesis or comma.
_TOKEN = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.:]*(?:\s*=\s*[^,()\s](?:[^,()]*[^,()\s])?)?|[(),])")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            raise SpecError(f"resource spec {text!r}: cannot read {text[pos:].strip()!r}. {_valid()}")
        key, eq, value = m.group(1).partition("=")
        out.append(f"{key.strip()}{eq}{value.strip()}")
        pos = m.end()
    return out


def parse_spec(text: str) -> Spec:
    """Parses one spec string (no resource is made); SpecError when it does not parse,
    TypeError when it is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"a resource spec must be a str, not {type(text).__name__}")
    tokens = _tokens(text)

    def parse(i: int) -> tuple[Spec, int]:
        if i >= len(tokens) or tokens[i] in "(),":
            raise SpecError(f"resource spec {text!r}: expected a resource name. {_valid()}")
        name = tokens[i]
        if "=" in name:
            raise SpecError(f"resource spec {text!r}: an option ({name}) where a resource was expected")
        i += 1
        args: list[Spec] = []
        options: list[tuple[str, str]] = []
        if i < len(tokens) and tokens[i] == "(":
            i += 1
            while i < len(tokens) and tokens[i] != ")":
                if "=" in tokens[i]:
                    key, value = tokens[i].split("=", 1)
                    if any(k == key for k, _ in options):
                        raise SpecError(
                            f"resource spec {text!r}: the option {key!r} of {name} is given twice; "
                            "give it once"
                        )
                    options.append((key, value))
                    i += 1
                else:
                    arg, i = parse(i)
                    args.append(arg)
                if i < len(tokens) and tokens[i] == ",":
                    i += 1
            if i >= len(tokens):
                raise SpecError(f"resource spec {text!r}: missing ')'")
            i += 1
        return Spec(name, tuple(args), tuple(options)), i

    spec, end = parse(0)
    if end != len(tokens):
        raise SpecError(f"resource spec {text!r}: unexpected {' '.join(tokens[end:])!r} after {spec}")
    return spec


def split_specs(text: str) -> list[str]:
    """Splits ``--resources`` at top-level commas; SpecError for an empty spec or one given
    twice (:func:`check_distinct`). Example::

        >>> from streampool.harness import split_specs
        >>> split_specs("async,pool(async, initial=1GiB)")
        ['async', 'pool(async, initial=1GiB)']
    """
    if not isinstance(text, str):
        raise TypeError(f"resource specs must be a str, not {type(text).__name__}")
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    if any(not p for p in parts):
        raise SpecError(f"--resources {text!r}: an empty spec (two commas, or one at an end)")
    check_distinct(parts)
    return parts


def check_distinct(specs: Sequence[str]) -> None:
    """SpecError naming a spec given twice (spaces aside): its runs could not be told apart
    from the other's in a summary. To see how much a resource's runs vary, give
    ``--repeats``; the min-max of each row is that spread."""
    seen: dict[str, str] = {}
    for text in specs:
        key = str(parse_spec(text))
        if key in seen:
            raise SpecError(
                f"{text!r} is given twice (as {seen[key]!r} before it); every resource is measured once a "
                "repeat (stress: once), so its runs could not be told apart: give each spec once (in bench, "
                "replay and recommend, its min-max over --repeats is the spread between its runs)"
            )
        seen[key] = text


@dataclass
class Candidate:
    """A resource made from a spec: ``resource`` (a streampool MemoryResource, peers
    wrapped), ``spec`` (canonical), ``code`` (the Python lines that make it), ``peer``
    (``None`` or the library's name), ``reserved`` (a function giving the bytes the resource
    holds from the device now, None when it cannot say), ``reserves_live`` (True when
    the resource holds nothing beyond what is live: no pool anywhere in the stack),
    ``shared_pool`` (the driver resource whose ``reserved_bytes`` ``reserved`` reads when
    that is the device's pool, shared with every resource and library that uses it, and
    so holding what others left in it; None otherwise)."""

    spec: str
    resource: mr.MemoryResource
    code: str
    peer: str | None = None
    reserved: Callable[[], int | None] = lambda: None
    reserves_live: bool = False
    keep: list[Any] = field(default_factory=list)
    shared_pool: Any = None


# --- streampool's own resources ----------------------------------------------------------

_SIZE_OPTIONS = {"initial", "maximum", "release", "size", "limit"}
_BOOL_OPTIONS = {"expandable", "steal_whole_blocks", "one_heap"}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _options(spec: Spec, allowed: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in spec.options:
        if key not in allowed:
            known = ", ".join(allowed) or "none"
            raise SpecError(f"resource spec {spec}: {spec.name} has no option {key!r} (options: {known})")
        try:
            if key in _SIZE_OPTIONS:
                out[allowed[key]] = parse_size(value)
            elif key in _BOOL_OPTIONS:
                if value.lower() not in _BOOLS:
                    raise ValueError("expected true or false")
                out[allowed[key]] = _BOOLS[value.lower()]
            elif key in ("min", "max", "events_every", "event_batch"):
                out[allowed[key]] = int(value)
            else:
                out[allowed[key]] = None if value == "none" else float(value)
        except ValueError as e:
            raise SpecError(f"resource spec {spec}: option {key}={value}: {e}") from None
    return out


#: The options a resource cannot be made without, by resource.
_REQUIRED = {"limit": "limit"}


def _required(spec: Spec) -> None:
    key = _REQUIRED.get(spec.name)
    if key is not None and key not in dict(spec.options):
        example = next(v for v in VALID_SPECS if v.startswith(f"{spec.name}("))
        raise SpecError(f"resource spec {spec}: {spec.name} needs the option {key}=, e.g. {example}")


def _arity(spec: Spec, n: int) -> None:
    if len(spec.args) != n:
        what = "no upstream" if n == 0 else "one upstream, e.g. pool(async)"
        raise SpecError(f"resource spec {spec}: {spec.name} takes {what}, got {len(spec.args)}")


_OWN_POOLS = (mr.ShardedPoolMemoryResource, mr.ArenaMemoryResource)
_DRIVER_POOLS = (mr.CudaAsyncMemoryResource, mr.CudaAsyncManagedMemoryResource)


def _holder(resource: mr.MemoryResource) -> Any:
    """The resource of ``resource``'s stack (itself, or down through its adaptors) that
    holds memory from the device beyond what is live: a pool of streampool's own or the
    driver's; None for neither."""
    while isinstance(resource, mr.UpstreamResourceAdaptor) and not isinstance(resource, _OWN_POOLS):
        resource = resource.upstream
    return resource if isinstance(resource, _OWN_POOLS + _DRIVER_POOLS) else None


def _driver_pool(resource: mr.MemoryResource) -> Any:
    """The driver resource whose reserved bytes :func:`_reserved` reads for ``resource``,
    or None (a pool of streampool's own, or none)."""
    holder = _holder(resource)
    return holder if isinstance(holder, _DRIVER_POOLS) else None


def _reserved(resource: mr.MemoryResource) -> int | None:
    """Bytes ``resource`` holds from the device: a pool's size, the driver pool's reserved
    bytes; through an adaptor, its upstream's; for a binning resource with no pool under it,
    the most its upstream handed out (the statistics adaptor :func:`_ours` puts there)."""
    holder = _holder(resource)
    if holder is not None:
        return holder.pool_size() if isinstance(holder, _OWN_POOLS) else holder.reserved_bytes
    while isinstance(resource, mr.UpstreamResourceAdaptor):
        below = resource.upstream
        if isinstance(resource, mr.BinningMemoryResource) and isinstance(below, mr.StatisticsResourceAdaptor):
            return int(below.allocation_counts.peak_bytes)
        resource = below
    return None


# name -> (number of upstreams, options {spec key: keyword}, maker, code template)
_OURS: dict[str, tuple[int, dict[str, str], Callable[..., mr.MemoryResource], str]] = {
    "async": (
        0,
        {"initial": "initial_pool_size", "release": "release_threshold"},
        mr.CudaAsyncMemoryResource,
        "mr.CudaAsyncMemoryResource({opts})",
    ),
    "cuda": (0, {}, mr.CudaMemoryResource, "mr.CudaMemoryResource({opts})"),
    "managed": (0, {}, mr.ManagedMemoryResource, "mr.ManagedMemoryResource({opts})"),
    "async_managed": (
        0,
        {"initial": "initial_pool_size", "release": "release_threshold"},
        mr.CudaAsyncManagedMemoryResource,
        "mr.CudaAsyncManagedMemoryResource({opts})",
    ),
    "pool": (
        1,
        {
            "initial": "initial_pool_size",
            "maximum": "maximum_pool_size",
            "release": "release_threshold",
            "headroom": "headroom",
            "events_every": "events_every",
            "event_batch": "event_batch",
            "expandable": "expandable",
            "steal_whole_blocks": "steal_whole_blocks",
            "one_heap": "one_heap",
            "gather_interval": "gather_interval",
        },
        mr.ShardedPoolMemoryResource,
        "mr.ShardedPoolMemoryResource({up}{opts})",
    ),
    "arena": (1, {"size": "arena_size"}, mr.ArenaMemoryResource, "mr.ArenaMemoryResource({up}{opts})"),
    "binning": (
        1,
        {"min": "min_size_exponent", "max": "max_size_exponent"},
        mr.BinningMemoryResource,
        "mr.BinningMemoryResource({up}{opts})",
    ),
    "prefetch": (1, {}, mr.PrefetchResourceAdaptor, "mr.PrefetchResourceAdaptor({up})"),
    "stats": (1, {}, mr.StatisticsResourceAdaptor, "mr.StatisticsResourceAdaptor({up})"),
    "tracking": (1, {}, mr.TrackingResourceAdaptor, "mr.TrackingResourceAdaptor({up})"),
    "limit": (
        1,
        {"limit": "allocation_limit"},
        mr.LimitingResourceAdaptor,
        "mr.LimitingResourceAdaptor({up}{opts})",
    ),
}
#: Binning's default size classes, 1 KiB to 1 MiB (RMM's ``binning`` bench uses a range
#: like this); the same for ``rmm:binning``.
BINNING_DEFAULT = {"min_size_exponent": 10, "max_size_exponent": 20}


def _latency_adaptor() -> Any:
    return getattr(mr, "LatencyHistogramAdaptor", None)


def _ours(spec: Spec, device: int | None = None, build: bool = True) -> tuple[Any, str]:
    """Our resource for ``spec`` and the code that makes it; ``device``: the device of its
    driver resources (None: the current device). ``build=False``: the code only (the
    resource None), for a device this process may not have."""
    if spec.name == "latency":
        adaptor = _latency_adaptor()
        if adaptor is None:
            raise SpecError(
                "resource spec latency(...): this build of streampool has no LatencyHistogramAdaptor"
            )
        _arity(spec, 1)
        _options(spec, {})
        upstream, code = _ours(spec.args[0], device, build)
        return adaptor(upstream) if build else None, f"mr.LatencyHistogramAdaptor({code})"
    if ":" in spec.name:  # a peer inside a pool or an adaptor: refused as a bare one would be first
        _peer_module(spec)
        raise SpecError(
            f"resource spec {spec}: a peer library's resource cannot be the upstream of streampool's "
            "pools and adaptors; measure it on its own"
        )
    if spec.name not in _OURS:
        raise SpecError(f"unknown resource {spec.name!r} in spec {str(spec)!r}. {_valid()}")
    n, allowed, make, template = _OURS[spec.name]
    _arity(spec, n)
    kwargs = _options(spec, allowed)
    _required(spec)
    if spec.name == "binning":
        kwargs = {**BINNING_DEFAULT, **kwargs}
    opts = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    if n == 0:
        if device is not None:
            kwargs["device"] = device
            opts = ", ".join(filter(None, [opts, f"device={device}"]))
        upstreams, code = [], template.format(opts=opts)
    else:
        upstream, up_code = _ours(spec.args[0], device, build)
        if spec.name == "binning" and build and _holder(upstream) is None:
            # No pool under the bins to read: a statistics adaptor counts what they take
            # (not in the code printed: it only measures).
            upstream = mr.StatisticsResourceAdaptor(upstream)
        upstreams, code = [upstream], template.format(up=up_code, opts=f", {opts}" if opts else "")
    if not build:
        return None, code
    try:
        return make(*upstreams, **kwargs), code
    except ValueError as e:  # a value the resource refuses (a negative interval, ...)
        raise SpecError(f"resource spec {spec}: {e}") from None


# --- peers ------------------------------------------------------------------------------

_PEER_PACKAGES = {"rmm": "rmm-cu12 (or rmm-cu13)", "cupy": "cupy-cuda12x (or cupy-cuda13x)", "torch": "torch"}
PEER_SPECS = [
    "rmm:async",
    "rmm:pool(cuda)",
    "rmm:pool(async)",
    "rmm:arena",
    "rmm:binning",
    "cupy:pool",
    "cupy:async",
    "torch:native",
]


def _import_peer(lib: str) -> Any:
    try:
        return importlib.import_module(lib)
    except ImportError as e:
        raise PeerMissingError(
            f"resource spec {lib}:...: {lib} is not installed ({e}). Install it with "
            f"`pip install {_PEER_PACKAGES[lib]}`, or leave the spec out."
        ) from None


def _peer_module(spec: Spec) -> tuple[str, Spec, Any]:
    """The peer library a spec names, imported: ``(library, the spec without it, module)``.
    SpecError for an unknown peer; PeerMissingError on the simulated device, or naming the
    package to install when the library is not installed."""
    lib, _, name = spec.name.partition(":")
    if lib not in _PEER_PACKAGES:
        raise SpecError(f"unknown peer library {lib!r} in spec {str(spec)!r}. {_valid()}")
    inner = Spec(name, spec.args, spec.options)
    if str(inner) not in {p.split(":", 1)[1] for p in PEER_SPECS if p.startswith(lib + ":")}:
        raise SpecError(f"unknown peer resource {str(spec)!r}. {_valid()}")
    if using_simulated_device():
        raise PeerMissingError(
            f"resource spec {spec}: peers allocate real GPU memory and cannot run on the simulated device"
        )
    return lib, inner, _import_peer(lib)


def _peer(spec: Spec) -> Candidate:
    lib, inner, module = _peer_module(spec)
    maker = {"rmm": _rmm, "cupy": _cupy, "torch": _torch}[lib]
    allocate, deallocate, reserved, keep, code = maker(module, str(inner))
    resource = mr.CallbackMemoryResource(allocate, deallocate)
    return Candidate(str(spec), resource, code, peer=lib, reserved=reserved, keep=keep)


def _rmm(rmm: Any, name: str) -> tuple[Any, ...]:
    """RMM's resource ``name``, with what it holds from the device: a pool's size; for RMM's
    own driver pool (``async``, and under ``binning``), that pool's reserved bytes, read
    through a view of it, found from the pool of a first allocation (RMM sets its release
    threshold to the device's memory, so it keeps what it grew to); for ``arena``, the
    most its upstream handed out (a statistics adaptor under it)."""
    rmr = importlib.import_module("rmm.mr")
    from rmm.pylibrmm.stream import Stream as RmmStream

    def pool_size(pool: Any) -> Callable[[], int | None]:
        return lambda: int(pool.pool_size())

    def driver_pool(res: Any) -> Callable[[], int | None]:
        # RMM's Python resource does not give its pool's handle: one allocation (before
        # the run) names it.
        probe = res.allocate(256)
        pool = pointer_pool(int(probe))
        res.deallocate(probe, 256)
        if pool is None:
            return lambda: None
        view = mr.CudaAsyncViewMemoryResource(pool)
        return lambda: view.reserved_bytes

    def upstream_peak(stats: Any) -> Callable[[], int | None]:
        def read() -> int | None:
            counts = stats.allocation_counts  # a dict in RMM before 25, a Statistics after
            return int(counts["peak_bytes"] if isinstance(counts, dict) else counts.peak_bytes)

        return read

    def make() -> tuple[Any, Callable[[], int | None], list[Any]]:
        if name == "async":
            res = rmr.CudaAsyncMemoryResource()
            return res, driver_pool(res), []
        if name in ("pool(cuda)", "pool(async)"):
            up = rmr.CudaMemoryResource() if name == "pool(cuda)" else rmr.CudaAsyncMemoryResource()
            res = rmr.PoolMemoryResource(up)
            return res, pool_size(res), []
        if name == "arena":
            stats = rmr.StatisticsResourceAdaptor(rmr.CudaMemoryResource())
            return rmr.ArenaMemoryResource(stats), upstream_peak(stats), [stats]
        up = rmr.CudaAsyncMemoryResource()  # binning
        res = rmr.BinningMemoryResource(
            up, BINNING_DEFAULT["min_size_exponent"], BINNING_DEFAULT["max_size_exponent"]
        )
        return res, driver_pool(up), [up]

    res, reserved, held = make()
    streams: dict[int, Any] = {}

    def rs(stream: Stream) -> Any:
        s = streams.get(stream.handle)
        if s is None:
            s = streams[stream.handle] = RmmStream(stream)
        return s

    return (
        lambda size, stream: res.allocate(size, rs(stream)),
        lambda ptr, size, stream: res.deallocate(ptr, size, rs(stream)),
        reserved,
        [res, streams, *held],
        _peer_code("rmm", name),
    )


def _cupy(cupy: Any, name: str) -> tuple[Any, ...]:
    pool = cupy.cuda.MemoryPool() if name == "pool" else cupy.cuda.MemoryAsyncPool()
    live: dict[int, Any] = {}
    streams: dict[int, Any] = {}

    def cs(stream: Stream) -> Any:
        s = streams.get(stream.handle)
        if s is None:
            s = streams[stream.handle] = cupy.cuda.ExternalStream(stream.handle)
        return s

    def allocate(size: int, stream: Stream) -> int:
        with cs(stream):
            memory = pool.malloc(size)
        live[memory.ptr] = memory
        return int(memory.ptr)

    def deallocate(ptr: int, size: int, stream: Stream) -> None:
        with cs(stream):  # CuPy records the free on the current stream
            del live[ptr]

    total = getattr(pool, "total_bytes", None)  # what the pool holds from the device

    def reserved() -> int | None:
        return int(total()) if total is not None else None

    return allocate, deallocate, reserved, [pool, live, streams], _peer_code("cupy", name)


def _torch(torch: Any, name: str) -> tuple[Any, ...]:
    device = torch.cuda.current_device()
    return (
        lambda size, stream: int(torch.cuda.caching_allocator_alloc(size, device, stream.handle)),
        lambda ptr, size, stream: torch.cuda.caching_allocator_delete(ptr),
        lambda: int(torch.cuda.memory_reserved(device)),
        [],
        _peer_code("torch", name),
    )


def _peer_code(lib: str, name: str) -> str:
    """The lines that make a peer's resource a program's (its library's own)."""
    if lib == "rmm":
        return f"import rmm\nrmm.mr.set_current_device_resource(<rmm:{name}>)"
    if lib == "cupy":
        kind = "MemoryPool" if name == "pool" else "MemoryAsyncPool"
        return f"import cupy\ncupy.cuda.set_allocator(cupy.cuda.{kind}().malloc)"
    return "import torch\n# PyTorch's caching allocator is its default: nothing to set"


# --- the entry point --------------------------------------------------------------------

VALID_SPECS = [
    "async",
    "async(initial=1GiB, release=1GiB)",
    "cuda",
    "managed",
    "async_managed",
    "pool(async)",
    "pool(async, initial=8GiB, maximum=16GiB, headroom=0.15)",
    "arena(async, size=4GiB)",
    "binning(async, min=10, max=20)",
    "prefetch(managed)",
    "stats(X)",
    "tracking(X)",
    "limit(X, limit=2GiB)",
    "latency(X)",
    *PEER_SPECS,
]


def _valid() -> str:
    return "Valid specs: " + ", ".join(VALID_SPECS) + " (X: any spec)."


_SETUP = "from streampool import mr, set_current_device_resource\n"


def make_resource(text: str) -> Candidate:
    """Makes the resource a spec string names. SpecError (a ValueError) for a spec that
    does not parse or names no resource, listing the valid ones; PeerMissingError naming
    the package to install for a peer that is not installed."""
    spec = parse_spec(text)
    if ":" in spec.name:
        return _peer(spec)
    with _naming(text):
        resource, code = _ours(spec)
    driver = _driver_pool(resource)
    return Candidate(
        str(spec),
        resource,
        f"{_SETUP}set_current_device_resource({code})",
        reserved=lambda: _reserved(resource),
        reserves_live=not _names(spec) & _CACHING,
        shared_pool=driver if driver is not None and not driver.owns_pool else None,
    )


def setup_code(text: str, device: int = 0) -> str:
    """The Python lines that make the resource a spec string names the resource of
    ``device``: ``set_current_device_resource(...)`` for device 0 (a program's current
    device unless it sets another), else ``set_per_device_resource(device, ...)`` with the
    resource made on that device. A peer's lines are its library's own (device 0's).
    Nothing is made: the device need not exist in this process (a log recorded on device 1
    of another machine). SpecError as :func:`check_spec` for a spec that names nothing."""
    check_spec(text)
    spec = parse_spec(text)
    if ":" in spec.name:
        lib, _, name = spec.name.partition(":")
        return _peer_code(lib, str(Spec(name, spec.args, spec.options)))
    with _naming(text):
        _resource, code = _ours(spec, device or None, build=False)
    if not device:
        return f"{_SETUP}set_current_device_resource({code})"
    return f"from streampool import mr, set_per_device_resource\nset_per_device_resource({device}, {code})"


def check_spec(text: str) -> None:
    """Checks a spec string without making anything: SpecError (a ValueError) naming what
    does not parse, names no resource (listing the valid ones), has the wrong number of
    upstreams, an option the resource does not take, lacks one it needs, or gives an
    option a value of the wrong form (a size, a number, true or false), as
    :func:`make_resource` would. What only the resource can judge (a value out of its
    range) is found when it is made. Example::

        from streampool.harness import check_spec
        check_spec("pool(async, initial=1GiB)")  # fine
        check_spec("pool(async, bogus=3)")  # SpecError: pool has no option 'bogus' (...)
    """

    def walk(spec: Spec, top: bool) -> None:
        if ":" in spec.name:
            lib, _, name = spec.name.partition(":")
            inner = str(Spec(name, spec.args, spec.options))
            if f"{lib}:{inner}" not in PEER_SPECS:
                raise SpecError(f"unknown peer resource {str(spec)!r}. {_valid()}")
            if not top:
                raise SpecError(
                    f"resource spec {spec}: a peer library's resource cannot be the upstream of "
                    "streampool's pools and adaptors; measure it on its own"
                )
            return
        if spec.name == "latency":
            n, allowed = 1, {}
        elif spec.name in _OURS:
            n, allowed = _OURS[spec.name][0], _OURS[spec.name][1]
        else:
            raise SpecError(f"unknown resource {spec.name!r} in spec {str(spec)!r}. {_valid()}")
        _arity(spec, n)
        _options(spec, allowed)
        _required(spec)
        for arg in spec.args:
            walk(arg, False)

    with _naming(text):
        walk(parse_spec(text), True)


def resource_from_spec(text: str, device: int | None = None) -> mr.MemoryResource:
    """The resource a spec string names (see :func:`make_resource`), on ``device`` (None:
    the current device). Peers' resources are made on the current device only (ValueError
    naming it otherwise). Used by ``streampool.dask`` for spec strings. Example::

        >>> from streampool.harness import resource_from_spec
        >>> resource_from_spec("stats(pool(async))")
        <StatisticsResourceAdaptor over <ShardedPoolMemoryResource over <CudaAsyncMemoryResource(...)>>>
    """
    import streampool

    spec = parse_spec(text)
    if ":" not in spec.name:
        with _naming(text):
            resource: mr.MemoryResource = _ours(spec, device)[0]
        return resource
    current = streampool.get_current_device()
    if device is not None and device != current:
        raise ValueError(
            f"resource spec {text!r}: a peer's resource is made on the current device ({current}), "
            f"not device {device}; pass a function (device) -> MemoryResource for other devices"
        )
    return _peer(spec).resource


_CACHING = {"async", "async_managed", "pool", "arena", "binning"}


def _names(spec: Spec) -> set[str]:
    return {spec.name}.union(*(_names(a) for a in spec.args))
