"""PyTorch allocates through streampool: ``use()`` before the first CUDA tensor.

PyTorch's ``CUDAPluggableAllocator`` calls the C functions that streampool's extension
module exports (no GIL, no Python object on that path), which allocate through the
current resource of the tensor's device. A failed allocation raises a Python error with
the reason, and the program goes on: the allocation function throws a C++ exception, which
PyTorch turns into a Python error. Out of memory raises ``torch.OutOfMemoryError`` (as
PyTorch's own allocator does, so a program that catches it to retry with less memory works
unchanged), with a message that begins as PyTorch's does: ``CUDA out of memory. streampool:
streampool_alloc(size=..., ...): out of memory: ...``. streampool does not link against
PyTorch: it makes PyTorch's exception from the PyTorch libraries the process has loaded
(checked against the libraries of PyTorch 2.5.1, 2.11 and 2.15). Where it cannot
(``use()``'s answer says so), out of memory is a ``RuntimeError`` with that message, as
with RMM's allocator. Any other failure (a device that does not exist, for one) is a
``RuntimeError``.

PyTorch's memory statistics (``torch.cuda.memory_allocated()`` and the rest), which raise
under any pluggable allocator, answer from streampool's counts after ``use()``
(:func:`memory_stats`).

Example (GPU only)::

    import streampool
    from streampool.allocators import torch as sp_torch

    stats = streampool.mr.StatisticsResourceAdaptor(streampool.get_current_device_resource())
    streampool.set_current_device_resource(stats)
    sp_torch.use()                      # before the first CUDA tensor
    import torch
    x = torch.ones(1 << 20, device="cuda")
    print(stats.allocation_counts.current_bytes)   # >= 4 MiB: the tensor's memory
    print(torch.cuda.memory_allocated())           # 4194304: PyTorch's view of the same

RMM's name: ``rmm_torch_allocator`` (``rmm.allocators.torch``) is
:data:`streampool_torch_allocator` here, and both names work. As RMM's, the module imports
without PyTorch, and the allocator is None where PyTorch cannot use it: PyTorch not
installed, built without CUDA, or seeing no GPU (``torch.cuda.is_available()`` False), and
on the simulated device; so RMM code that checks ``rmm_torch_allocator is not None`` runs
unchanged. Reading it calls ``torch.cuda.is_available()``, as RMM's module does at import
and :func:`use` does, which initialises the CUDA driver in the process (children forked
afterwards cannot use CUDA). Without PyTorch, :func:`use` and :func:`allocator` raise
ImportError naming the package.
"""

from __future__ import annotations

import ctypes
import operator
import warnings
from typing import Any

from .. import _errors, _native
from . import (
    CAPTURE_BEGIN_FUNCTION,
    CAPTURE_END_FUNCTION,
    CXX_ALLOC_FUNCTION,
    FREE_CXX_FUNCTION,
    FREE_FUNCTION,
    SIMULATED,
    TRY_ALLOC_FUNCTION,
    library_path,
)

#: What every function here raises without PyTorch (the module imports, as RMM's does, with
#: its allocator None).
MISSING = "streampool.allocators.torch needs PyTorch with CUDA support: pip install torch"

_IMPORT_ERROR: ImportError | None = None
try:
    import torch
    import torch.cuda.memory as _torch_memory
except ImportError as e:  # pragma: no cover - depends on what is installed
    torch = None
    _torch_memory = None
    _IMPORT_ERROR = e


def _need_torch() -> None:
    if torch is None:
        raise ImportError(MISSING) from _IMPORT_ERROR


# Also `streampool_torch_allocator` and `rmm_torch_allocator`, made on first use (`__getattr__`).
__all__ = [
    "allocator",
    "empty_cache",
    "mem_pool",
    "memory_stats",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "use",
]

# The CUDAPluggableAllocator of each pair of functions (made once each).
_ALLOCATORS: dict[tuple[str, str], Any] = {}
_IN_USE = False


def allocator() -> Any:
    """The ``torch.cuda.memory.CUDAPluggableAllocator`` over streampool's exported
    functions (made once): ``streampool_alloc_cxx``, whose failures PyTorch raises
    (``torch.OutOfMemoryError`` when out of memory, see the module's docs), and
    ``streampool_free_cxx``; the two count what :func:`memory_stats` reports. Raises
    RuntimeError where this PyTorch has no CUDA support."""
    made = _pluggable(CXX_ALLOC_FUNCTION, FREE_CXX_FUNCTION)
    _native._use_torch_out_of_memory()  # looked for once; PyTorch's libraries are loaded
    return made


def _pluggable(alloc_function: str, free_function: str) -> Any:
    _need_torch()
    if _native.using_simulated_device():
        raise RuntimeError(
            f"no PyTorch allocator over streampool here: {SIMULATED.removeprefix('skipped: ')}"
        )
    if (alloc_function, free_function) not in _ALLOCATORS:
        if not _cuda_built():
            raise RuntimeError(
                f"this PyTorch ({torch.__version__}) is built without CUDA, so it cannot take a CUDA "
                "allocator: install a CUDA build of PyTorch (pip install torch)"
            )
        pluggable = _torch_memory.CUDAPluggableAllocator(library_path(), alloc_function, free_function)
        _HOOKED[alloc_function] = _announce_captures(pluggable)
        _ALLOCATORS[alloc_function, free_function] = pluggable
    return _ALLOCATORS[alloc_function, free_function]


# Whether the pluggable allocator of each allocation function announces captures.
_HOOKED: dict[str, bool] = {}


def _announce_captures(pluggable: Any) -> bool:
    """Makes PyTorch tell streampool when it begins and ends capturing a CUDA graph (the
    pluggable allocator's pool hooks, which ``torch.cuda.graph`` calls around each capture):
    only then do the entry points ask streams whether they capture (docs/frameworks.md,
    "CUDA graphs"). False where this PyTorch has no such hooks: captures then fail."""
    inner = getattr(pluggable, "_allocator", None)
    begin = getattr(inner, "set_begin_allocate_to_pool", None)
    end = getattr(inner, "set_end_allocate_to_pool_fn", None)
    if begin is None or end is None:
        return False
    lib = ctypes.CDLL(library_path())
    try:
        begin(ctypes.cast(getattr(lib, CAPTURE_BEGIN_FUNCTION), ctypes.c_void_p).value)
        end(ctypes.cast(getattr(lib, CAPTURE_END_FUNCTION), ctypes.c_void_p).value)
    except (TypeError, RuntimeError):  # a PyTorch whose setters take something else
        return False
    cuda = getattr(torch, "cuda", None)
    graph_type = getattr(cuda, "CUDAGraph", None)
    if graph_type is not None:
        _end_failed_captures(graph_type, getattr(lib, CAPTURE_END_FUNCTION))
    _regions_announce_nothing(getattr(torch, "_C", None), getattr(cuda, "memory", None))
    return True


# The functions of torch._C that open and close a memory pool region
# (`torch.cuda.use_mem_pool`), which call the same pool hooks as a capture.
_REGION_FUNCTIONS = (
    "_cuda_beginAllocateCurrentThreadToPool",
    "_cuda_beginAllocateCurrentStreamToPool",
    "_cuda_beginAllocateToPool",
    "_cuda_endAllocateToPool",
    "_cuda_endAllocateCurrentStreamToPool",
)


def _regions_announce_nothing(*namespaces: Any) -> None:
    """Makes the pool hooks that PyTorch calls when a ``torch.cuda.use_mem_pool`` region
    opens and closes announce no capture: such a region captures nothing, and under an
    announcement every free through streampool would wait until the region's end. Wraps
    those functions in each namespace given that has them (``torch._C``, and
    ``torch.cuda.memory``, which imported them by name), once; a capture begun inside a
    region is announced as any other."""
    for namespace in namespaces:
        for name in _REGION_FUNCTIONS:
            original = getattr(namespace, name, None)
            if not callable(original) or getattr(original, _MARK, False):
                continue
            setattr(namespace, name, _wrapper(original, _opening_a_region(original)))


def _opening_a_region(original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        _native._capture_hooks_open_a_region(True)
        try:
            return original(*args, **kwargs)
        finally:
            _native._capture_hooks_open_a_region(False)

    return call


# The attribute that marks a function of PyTorch's that streampool has wrapped.
_MARK = "_streampool_wrapped"


def _wrapper(original: Any, call: Any) -> Any:
    """`call`, standing in for PyTorch's `original`: named and documented as it is, and
    marked, so that it is wrapped once."""
    setattr(call, _MARK, True)
    call.__doc__, call.__name__ = original.__doc__, getattr(original, "__name__", call.__name__)
    return call


def _end_failed_captures(graph_type: Any, end: Any) -> None:
    """Ends the announcement of a capture that fails, and only that one: PyTorch calls its
    begin hook in ``capture_begin`` before ``cudaStreamBeginCapture``, which may fail (a
    stream that already captures), and ``capture_end`` raises when the capture was
    invalidated (a synchronisation in it, say) before it calls its end hook; an
    announcement left behind would keep every free through streampool waiting. Wraps both
    methods of ``graph_type`` (``torch.cuda.CUDAGraph``, which ``torch.cuda.graph`` uses)
    once. The hooks run on the calling thread, whose counts of them
    (``_native._capture_hook_calls``) tell whether the failed call announced a begin that
    no end followed: an end already made, or a begin never made, is not made up for."""
    if getattr(graph_type.capture_end, _MARK, False):
        return
    end.restype = None
    end.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]

    def ending_on_failure(original: Any, owes_end: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            before = _native._capture_hook_calls()
            try:
                return original(self, *args, **kwargs)
            except BaseException:
                if owes_end(before, _native._capture_hook_calls()):
                    end(0, 0, 0)
                raise

        return _wrapper(original, call)

    # capture_begin: its begin hook ran, and no end; capture_end: its end hook did not run
    # while this thread has a begin without an end.
    graph_type.capture_begin = ending_on_failure(
        graph_type.capture_begin, lambda b, a: a[0] > b[0] and a[1] == b[1]
    )
    graph_type.capture_end = ending_on_failure(
        graph_type.capture_end, lambda b, a: a[1] == b[1] and a[0] > a[1]
    )


def use(*, memory_stats: bool = True) -> str:
    """Makes streampool PyTorch's CUDA allocator for the rest of the process
    (``torch.cuda.memory.change_current_allocator``). Call it before the first CUDA tensor:
    PyTorch cannot swap an allocator it has used, and this raises RuntimeError saying so.
    Calling it again is harmless (with ``memory_stats=True`` after ``False``, the statistics
    then answer). Returns what it did (a ``"skipped: ..."`` line, changing
    nothing, on the simulated device or where PyTorch sees no GPU).

    PyTorch's pluggable allocators keep no memory statistics: ``torch.cuda.memory_stats()``,
    ``memory_allocated()``, ``max_memory_allocated()``, ``memory_reserved()``,
    ``memory_summary()`` and ``reset_peak_memory_stats()`` raise RuntimeError under them,
    and so does what calls them; ``torch.cuda.empty_cache()`` does nothing. With
    ``memory_stats=True`` (the default) they answer from streampool's counts instead
    (:func:`memory_stats`), and ``empty_cache()`` hands back what the resource holds free
    (:func:`empty_cache`): this replaces the four functions of ``torch._C`` they call
    (``_cuda_memoryStats``, ``_cuda_resetPeakMemoryStats``,
    ``_cuda_resetAccumulatedMemoryStats``, ``_cuda_emptyCache``); ``memory_stats=False``
    leaves PyTorch's.

    CUDA graphs (docs/frameworks.md, "CUDA graphs"): PyTorch's pool hooks tell streampool
    when a capture begins and ends, so that what a capture allocates is graph memory of the
    driver's pool (``torch.cuda.graph``, ``make_graphed_callables``). For that this wraps
    ``torch.cuda.CUDAGraph.capture_begin`` and ``capture_end`` (a capture that fails ends
    its announcement) and the functions that open and close a ``torch.cuda.use_mem_pool``
    region (which calls the same hooks and captures nothing), and makes the three functions
    of ``torch._C`` that ``torch.compile``'s CUDA graph trees (``mode="reduce-overhead"``)
    call first raise an error that says why they cannot run on a pluggable allocator and
    what works instead."""
    if not isinstance(memory_stats, bool):
        raise TypeError(f"memory_stats must be True or False, not {memory_stats!r}")
    _need_torch()
    if _IN_USE:
        # use(memory_stats=False) before: the statistics are PyTorch's still.
        ours = _STATS_FUNCTIONS["_cuda_memoryStats"]
        if (
            memory_stats
            and getattr(torch._C, "_cuda_memoryStats", None) is not ours
            and _answer_memory_stats(torch._C)
        ):
            return f"already allocating through streampool; torch.cuda.memory_stats() and the functions built on it {_ANSWERED}"
        return "already allocating through streampool"
    if _native.using_simulated_device():
        return SIMULATED
    if not torch.cuda.is_available():
        return "skipped: PyTorch sees no CUDA device (torch.cuda.is_available() is False)"
    return _install(memory_stats)


def _install(memory_stats: bool = True) -> str:
    """:func:`use` without its checks of the device: touches none (``streampool profile``
    routes PyTorch as the program imports it, before it could fork)."""
    global _IN_USE
    try:
        _torch_memory.change_current_allocator(allocator())
    except RuntimeError as e:
        if "initialized" not in str(e):
            raise
        raise RuntimeError(
            "streampool.allocators.torch.use() came too late: PyTorch has already initialised its "
            "CUDA allocator (a CUDA tensor was made, or torch.cuda memory was queried), and it cannot "
            "be swapped afterwards. Call use() before the first CUDA tensor, e.g. at the top of the "
            "program, or use mem_pool() to route one region's allocations through streampool."
        ) from e
    _IN_USE = True
    graphs = (
        "CUDA graph captures are announced to streampool"
        if _HOOKED.get(CXX_ALLOC_FUNCTION, False)
        else "CUDA graph captures are not announced (this PyTorch's pluggable allocator has no pool hooks)"
    )
    raises = (
        "torch.OutOfMemoryError"
        if _native._use_torch_out_of_memory()
        else "RuntimeError (PyTorch's out-of-memory error was not found in its libraries)"
    )
    stats = (
        _ANSWERED
        if memory_stats and _answer_memory_stats(torch._C)
        else "raise, and empty_cache() does nothing (memory_stats=False)"
    )
    if _refuse_graph_trees(torch._C):
        graphs += "; torch.compile's CUDA graph trees (mode='reduce-overhead') are refused, saying why"
    return (
        f"torch.cuda allocator: CUDAPluggableAllocator({library_path()!r}, {CXX_ALLOC_FUNCTION!r}, "
        f"{FREE_CXX_FUNCTION!r}); out of memory raises {raises}; torch.cuda.memory_stats() and the "
        f"functions built on it {stats}; {graphs}"
    )


_GRAPH_TREES_REFUSED = (
    "streampool: torch.compile's CUDA graph trees (mode='reduce-overhead', and 'max-autotune', "
    "which uses them) cannot run on a pluggable CUDA allocator, streampool's included: they save "
    "and restore the private pools of PyTorch's own caching allocator "
    "(torch._C._cuda_getCheckpointState), which neither a pluggable allocator (RMM's too) nor "
    "PyTorch's cudaMallocAsync backend has. Compile with mode='max-autotune-no-cudagraphs' or the "
    "default mode, or capture with torch.cuda.graph or torch.cuda.make_graphed_callables, which "
    "streampool serves (docs/frameworks.md, 'CUDA graphs')"
)

# The functions of torch._C that CUDA graph trees call first (PyTorch 2.11: the live
# allocation check under the default `slow_path_cudagraph_asserts`, then the checkpoint at
# every recording); under a pluggable allocator each raises "... does not yet support ...".
_GRAPH_TREE_FUNCTIONS = (
    "_cuda_checkPoolLiveAllocations",
    "_cuda_getCheckpointState",
    "_cuda_setCheckpointPoolState",
)


def _graph_trees_refused(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(_GRAPH_TREES_REFUSED)


def _refuse_graph_trees(torch_c: Any) -> bool:
    """Makes torch.compile's CUDA graph trees fail with an error that says why and what
    works instead (``_GRAPH_TREES_REFUSED``), in place of PyTorch's "pluggable does not yet
    support checkPoolLiveAllocations": replaces those functions of ``torch._C``
    (``torch_c``) that this PyTorch has, which nothing else calls. False where it has none."""
    names = [name for name in _GRAPH_TREE_FUNCTIONS if callable(getattr(torch_c, name, None))]
    for name in names:
        setattr(torch_c, name, _graph_trees_refused)
    return bool(names)


_ANSWERED = "answer from streampool's counts, and empty_cache() hands back what it holds free"


def _answer_memory_stats(torch_c: Any) -> bool:
    """Makes PyTorch's memory statistics answer from streampool's counts, replacing the
    functions of ``torch._C`` (``torch_c``) that they call; False, changing nothing, where
    this PyTorch has not all of them."""
    if not all(callable(getattr(torch_c, name, None)) for name in _STATS_FUNCTIONS):
        return False
    for name, ours in _STATS_FUNCTIONS.items():
        setattr(torch_c, name, ours)
    return True


def _stat(current: int = 0, peak: int = 0, allocated: int = 0, freed: int = 0) -> dict[str, int]:
    return {"current": current, "peak": peak, "allocated": allocated, "freed": freed}


def _by_pool(stat: dict[str, int]) -> dict[str, dict[str, int]]:
    # Only "all": streampool has no small and large pools (as PyTorch's cudaMallocAsync
    # backend, which reports its statistics so).
    return {"all": stat, "small_pool": _stat(), "large_pool": _stat()}


def _device(device: Any) -> int:
    """A device as PyTorch names one: None (the current device), an int, ``"cuda:1"`` or
    ``"cuda"``, a ``torch.device``; ``InvalidArgumentError`` for anything else, or a device
    this machine does not have."""
    index: int | None
    if device is None:
        index = None
    elif isinstance(device, str):
        kind, colon, number = device.partition(":")
        if kind != "cuda" or (colon and not (number.isascii() and number.isdigit())):
            raise _not_a_cuda_device(device)  # "cpu", "cuda:x", "cuda:"
        index = int(number) if colon else None
    elif hasattr(device, "type"):  # a torch.device
        if str(device.type) != "cuda":
            raise _not_a_cuda_device(device)
        index = device.index
    elif isinstance(device, bool) or not hasattr(device, "__index__"):
        raise _not_a_cuda_device(device)
    else:
        index = operator.index(device)
    if index is None:
        return int(_native.get_current_device())
    count = _native.device_count()
    if not 0 <= index < count:
        raise _errors.InvalidArgumentError(
            f"streampool: there is no CUDA device {device!r} (this machine has {count}: 0 to {count - 1})"
        )
    return index


def _not_a_cuda_device(device: Any) -> _errors.InvalidArgumentError:
    return _errors.InvalidArgumentError(
        f"streampool: {device!r} is not a CUDA device: give None (the current device), "
        "an index, 'cuda', 'cuda:N' or a torch.device of type 'cuda'"
    )


def memory_stats(device: Any = None) -> dict[str, Any]:
    """What PyTorch allocated through streampool on ``device`` (the current device when
    None), as PyTorch's ``torch.cuda.memory_stats_as_nested_dict()`` reports it: the bytes
    (``allocated_bytes``, and ``active_bytes`` and ``requested_bytes``, the same here) and
    the number of allocations (``allocation``, ``active``), each ``current``, ``peak``,
    ``allocated`` and ``freed`` since the last reset; ``reserved_bytes``, what the device's
    current resource holds from its upstream and its peak (for the driver's pool, which
    other libraries may share, all of its reserved memory; 0 during a CUDA graph capture,
    which asking the driver's pool would invalidate); ``num_ooms``, the out-of-memory
    failures. Counted by ``streampool_alloc_cxx`` and ``streampool_free_cxx``, the functions
    :func:`use` gives PyTorch (a ``mem_pool()`` region's memory is PyTorch's own, in its own
    statistics). Statistics streampool has no part in (segments, inactive splits, oversize
    allocations, retries) are 0, and only the ``all`` pool is filled, as PyTorch's
    ``cudaMallocAsync`` backend does.

    With :func:`use`, ``torch.cuda.memory_stats()`` and the functions built on it answer
    from this. Example (GPU only)::

        from streampool.allocators import torch as sp_torch
        sp_torch.use()
        import torch
        x = torch.empty(1 << 20, device="cuda")
        print(torch.cuda.memory_allocated())     # 1048576
        print(sp_torch.memory_stats()["allocated_bytes"]["all"]["current"])   # the same
    """
    by_bytes, by_count, out_of_memory, reserved = _native._torch_memory_stats(_device(device))
    allocated, allocations = _stat(*by_bytes), _stat(*by_count)
    return {
        "num_alloc_retries": 0,
        "num_ooms": out_of_memory,
        "max_split_size": -1,
        "num_sync_all_streams": 0,
        "num_device_alloc": by_count[2],
        "num_device_free": by_count[3],
        "allocation": _by_pool(allocations),
        "segment": _by_pool(_stat()),
        "active": _by_pool(dict(allocations)),
        "inactive_split": _by_pool(_stat()),
        "allocated_bytes": _by_pool(allocated),
        "reserved_bytes": _by_pool(_stat(*reserved) if reserved is not None else _stat()),
        "active_bytes": _by_pool(dict(allocated)),
        "inactive_split_bytes": _by_pool(_stat()),
        "requested_bytes": _by_pool(dict(allocated)),
        "oversize_allocations": _stat(),
        "oversize_segments": _stat(),
    }


def empty_cache() -> None:
    """What ``torch.cuda.empty_cache()`` does after :func:`use`: hands the free memory that
    the current device's resource holds back to the system, as PyTorch's own allocator does
    with its cache (under a pluggable allocator, PyTorch's does nothing). Down the resource's
    chain of upstreams: a ``ShardedPoolMemoryResource`` (or ``PoolMemoryResource``) or an
    ``ArenaMemoryResource`` gives back its free chunks (``release()``), and the driver's pool
    beneath, a ``CudaAsyncMemoryResource``, is trimmed to what is in use (``trim_to(0)``)
    once the device is synchronised, as PyTorch's ``cudaMallocAsync`` backend does (for the
    device's default pool, shared with other libraries, their free memory too). Other
    resources hold nothing to hand back."""
    _need_torch()
    _hand_back(_native.get_current_device_resource(), torch.cuda.synchronize)


def _empty_cache_of_torch(*_: Any) -> None:
    """``torch._C._cuda_emptyCache``'s replacement: :func:`empty_cache`, whatever PyTorch
    passes (a memory pool, in some versions: there is one here)."""
    empty_cache()


def _hand_back(resource: Any, synchronize: Any) -> None:
    """:func:`empty_cache` for ``resource``'s chain, ``synchronize`` waiting for the device."""
    synchronized = False
    while resource is not None:
        if isinstance(resource, (_native.ShardedPoolMemoryResource, _native.ArenaMemoryResource)):
            with warnings.catch_warnings():
                # It says how much the driver's pool beneath still holds: trimmed below.
                warnings.simplefilter("ignore", UserWarning)
                resource.release()  # synchronises the device itself
            synchronized = True
        elif isinstance(resource, _native.CudaAsyncMemoryResource):
            if not synchronized:
                synchronize()
            resource.trim_to(0)
        resource = resource.upstream if isinstance(resource, _native.UpstreamResourceAdaptor) else None


def reset_peak_memory_stats(device: Any = None) -> None:
    """Sets the peaks of :func:`memory_stats` to what is current (the device's current
    resource's peak of reserved bytes too), as ``torch.cuda.reset_peak_memory_stats()``."""
    _native._torch_reset_memory_stats(_device(device), True)


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Sets the totals of :func:`memory_stats` (``allocated``, ``freed``, ``num_ooms``) to 0,
    as ``torch.cuda.reset_accumulated_memory_stats()``."""
    _native._torch_reset_memory_stats(_device(device), False)


def mem_pool() -> Any:
    """A ``torch.cuda.MemPool`` whose memory comes from streampool, for a region of the
    program (PyTorch 2.5 or later, with its native caching allocator)::

        pool = streampool.allocators.torch.mem_pool()
        with torch.cuda.use_mem_pool(pool):
            x = torch.empty(1 << 20, device="cuda")   # allocated through streampool

    PyTorch's caching allocator manages the pool and checks each allocation it asks of
    streampool, so a failure there is its own ``torch.OutOfMemoryError`` (after it has
    freed what it caches), as with PyTorch's allocator. Raises RuntimeError naming what is
    missing where PyTorch has no ``MemPool``."""
    _need_torch()
    pool_type = getattr(torch.cuda, "MemPool", None)
    if pool_type is None or not hasattr(torch.cuda, "use_mem_pool"):
        raise RuntimeError(
            f"torch.cuda.MemPool needs PyTorch 2.5 or later (this is {torch.__version__}): upgrade "
            "PyTorch (pip install -U torch), or make streampool the allocator of the whole process "
            "with streampool.allocators.torch.use()"
        )
    # The function that returns NULL on failure: the caching allocator checks for it, frees
    # what it caches and tries again, so a failed attempt is said nowhere but in its error.
    return pool_type(allocator=_pluggable(TRY_ALLOC_FUNCTION, FREE_FUNCTION).allocator())


# The functions of torch._C that PyTorch's memory statistics and empty_cache() call, with
# what replaces each.
_STATS_FUNCTIONS: dict[str, Any] = {
    "_cuda_memoryStats": memory_stats,
    "_cuda_resetPeakMemoryStats": reset_peak_memory_stats,
    "_cuda_resetAccumulatedMemoryStats": reset_accumulated_memory_stats,
    "_cuda_emptyCache": _empty_cache_of_torch,
}


def _cuda_built() -> bool:
    """This PyTorch (installed) is built with CUDA, so it takes a pluggable CUDA allocator."""
    return hasattr(_torch_memory, "CUDAPluggableAllocator") and bool(torch.backends.cuda.is_built())


def _cuda_usable() -> bool:
    """PyTorch is installed with CUDA support and sees a GPU (``torch.cuda.is_available()``,
    which RMM's module asks), and the device is not simulated."""
    return (
        torch is not None
        and not _native.using_simulated_device()
        and _cuda_built()
        and bool(torch.cuda.is_available())
    )


def __getattr__(name: str) -> Any:
    # RMM's module attribute, made on first use: making it needs a CUDA build of PyTorch,
    # and importing this module must not.
    if name in ("streampool_torch_allocator", "rmm_torch_allocator"):
        return allocator() if _cuda_usable() else None  # as RMM's: None where no GPU is usable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
