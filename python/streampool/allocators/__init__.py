"""Allocators for other libraries: PyTorch, CuPy and Numba allocate through streampool.

Each library has a module with RAPIDS RMM's names next to ours (``rmm.allocators.*``), so
moving from RMM is a change of import:

* :mod:`streampool.allocators.torch`: ``use()``, ``mem_pool()``,
  ``streampool_torch_allocator`` (RMM: ``rmm_torch_allocator``);
* :mod:`streampool.allocators.cupy`: ``use()``, ``streampool_cupy_allocator``
  (RMM: ``rmm_cupy_allocator``);
* :mod:`streampool.allocators.numba`: ``StreampoolNumbaManager`` (RMM:
  ``RMMNumbaManager``), also through ``NUMBA_CUDA_MEMORY_MANAGER=streampool.allocators.numba``;
* :mod:`streampool.allocators.rmm`: ``use()`` makes RMM (and so cuDF) allocate from the
  same driver pool as streampool's default resource, rather than through streampool.

:func:`use_everywhere` configures every one of them that is installed, in one call;
:func:`use_on_import` has each allocate through streampool as the program imports it,
touching no device (what ``streampool profile`` does in the program it runs).
Every allocation goes through the current resource of its device
(:func:`streampool.set_current_device_resource`), so pools, adaptors and statistics
apply to the libraries' memory. Set the resource first: memory is freed through the
resource that is current when it is freed, and a change while PyTorch's memory is live
warns (``RuntimeWarning``), since a resource that did not make the memory may accept it
and hand live memory out again.

streampool's extension module exports C functions for other libraries (no GIL, no Python
object on that path), in the file :func:`library_path` names: ``void* streampool_alloc(size_t
size, int device, cudaStream_t stream)`` and ``void streampool_free(void* ptr, size_t size,
int device, cudaStream_t stream)``, which return NULL (and free nothing) on failure
(:func:`last_error` says why, and a line on stderr, for callers that may not check). Two
more allocation functions say nothing on stderr, for callers that handle the failure:
``streampool_try_alloc``, which returns NULL, and, for C++ callers,
``streampool_alloc_cxx``, which throws a C++ exception instead (a ``std::bad_alloc`` with
the message when out of memory, as RMM's allocator does; PyTorch's
``c10::OutOfMemoryError`` once :func:`streampool.allocators.torch.use` has found PyTorch's
libraries in the process, see :mod:`streampool.allocators.torch`).
:func:`streampool.allocators.torch.use` gives PyTorch ``streampool_alloc_cxx`` and
``streampool_free_cxx``, which count what PyTorch's memory statistics report; ``mem_pool()`` gives it ``streampool_try_alloc``, whose NULL
PyTorch's caching allocator checks (it frees what it caches and tries again first).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

from .. import _native

__all__ = [
    "ALLOC_FUNCTION",
    "CAPTURE_BEGIN_FUNCTION",
    "CAPTURE_END_FUNCTION",
    "CXX_ALLOC_FUNCTION",
    "FREE_CXX_FUNCTION",
    "FREE_FUNCTION",
    "SIMULATED",
    "TRY_ALLOC_FUNCTION",
    "failure_count",
    "last_error",
    "library_path",
    "use_everywhere",
    "use_on_import",
]

#: The name of the exported allocation function in :func:`library_path` (NULL on failure,
#: said on stderr too).
ALLOC_FUNCTION = "streampool_alloc"
#: The name of the exported allocation function that returns NULL on failure and says
#: nothing on stderr, for callers that check (PyTorch's ``MemPool`` is given it).
TRY_ALLOC_FUNCTION = "streampool_try_alloc"
#: The name of the exported allocation function that throws a C++ exception on failure
#: (for C++ callers: PyTorch's ``CUDAPluggableAllocator`` is given it).
CXX_ALLOC_FUNCTION = "streampool_alloc_cxx"
#: The name of the exported free function in :func:`library_path`.
FREE_FUNCTION = "streampool_free"
#: The name of the exported free function for what ``streampool_alloc_cxx`` gave: the pair
#: keeps PyTorch's memory statistics (:func:`streampool.allocators.torch.memory_stats`).
FREE_CXX_FUNCTION = "streampool_free_cxx"
#: The exported function to call just before capturing a CUDA graph whose allocations come
#: through these entry points, ``void (int device, uint64_t, uint64_t, const void *)`` (the
#: last three unread: PyTorch's ``beginAllocateToPool`` hook, which :func:`torch.use` sets,
#: has that shape). Until the matching :data:`CAPTURE_END_FUNCTION`, the entry points ask
#: each stream whether it captures and put off the frees a capture forbids
#: (docs/frameworks.md, "CUDA graphs").
CAPTURE_BEGIN_FUNCTION = "streampool_capture_begin"
#: The exported function to call once that capture has ended, however it ended (failed
#: too: until then frees through the entry points wait), ``void (int device, uint64_t,
#: uint64_t)`` (PyTorch's ``endAllocateToPool`` hook).
CAPTURE_END_FUNCTION = "streampool_capture_end"


def library_path() -> str:
    """The file of streampool's extension module, which exports ``streampool_alloc``,
    ``streampool_try_alloc``, ``streampool_alloc_cxx``, ``streampool_free`` and
    ``streampool_free_cxx`` (for
    ``torch.cuda.memory.CUDAPluggableAllocator`` or ``ctypes``)."""
    path = _native.__file__
    assert path is not None  # an extension module always has a file
    return path


def last_error() -> str | None:
    """The most recent failure of the exported C functions (from any thread), naming the
    call and the reason, or None when none has failed since the process started."""
    return _native._capi_last_error()[1]


def failure_count() -> int:
    """How many calls of the exported C functions have failed since the process started."""
    return _native._capi_last_error()[0]


_LIBRARIES = ("torch", "cupy", "numba", "rmm")

#: What each library's ``use()`` returns on the simulated device, changing nothing.
SIMULATED = (
    "skipped: streampool runs on the simulated device (STREAMPOOL_DEVICE=sim or a SimulatedDevice), "
    "whose memory is host memory that a GPU library's kernels cannot use"
)


def use_everywhere(*, verbose: bool = False) -> dict[str, str]:
    """Makes every installed library among PyTorch, CuPy and Numba allocate through
    streampool, and RMM (cuDF) share its driver pool (each library's ``use()``), in one
    call, before any of them allocates.

    Returns ``{library: what was done}`` for each of the four (a library that is not
    installed, cannot be imported, or sees no GPU is listed as skipped, with the reason);
    prints it when ``verbose``. A library that is installed but cannot be configured any more
    (PyTorch after its first CUDA tensor) raises, naming the fix. Example::

        >>> done = streampool.allocators.use_everywhere()  # first thing, before the libraries allocate
        >>> sorted(done)
        ['cupy', 'numba', 'rmm', 'torch']
    """
    done: dict[str, str] = {}
    simulated = _native.using_simulated_device()
    for name in _LIBRARIES:
        probe = "numba.cuda" if name == "numba" else name
        try:
            found = importlib.util.find_spec(probe) is not None
        except (ImportError, ValueError):  # numba without numba.cuda; a stand-in without __spec__
            found = False
        if not found:
            done[name] = f"skipped: {probe} is not installed"
            continue
        if simulated:
            done[name] = SIMULATED
            continue
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except Exception as e:  # installed, but not usable here (numba-cuda without CUDA)
            done[name] = f"skipped: {probe} cannot be imported ({type(e).__name__}: {e})"
            continue
        try:
            done[name] = module.use()
        except ImportError as e:  # the torch and cupy modules import without their library
            cause = e.__cause__ or e
            done[name] = f"skipped: {probe} cannot be imported ({type(cause).__name__}: {cause})"
    if verbose:
        for name, what in done.items():
            print(f"streampool.allocators: {name}: {what}")
    return done


def use_on_import(*libraries: str) -> None:
    """Makes PyTorch, CuPy and Numba (or those named: ``"torch"``, ``"cupy"``,
    ``"numba"``) allocate through streampool as the program imports them, touching no
    device: CuPy and Numba as soon as their import has finished, PyTorch at its first CUDA
    initialisation, so that a program that chooses its own allocator before (PyTorch's
    ``change_current_allocator``, ``PYTORCH_CUDA_ALLOC_CONF``, ``NUMBA_CUDA_MEMORY_MANAGER``)
    keeps it. A library imported already is routed at once (PyTorch still at its first CUDA
    use). What ``streampool profile`` does in the program it runs, and what ``streampool
    recommend -- prog`` puts in its code for the libraries it routed.

    Unlike :func:`use_everywhere`, it never asks a library whether it sees a GPU (PyTorch's
    ``torch.cuda.is_available()`` initialises CUDA, after which a forked child cannot use
    it), and it leaves RMM alone. A library that keeps its own allocator (a routing that
    failed, or the program's own choice) is named in a ``RuntimeWarning`` with the reason;
    on the simulated device nothing is routed (its memory is host memory), silently.
    Example::

        from streampool import allocators

        allocators.use_on_import("torch")  # first thing in the program
        import torch

        x = torch.ones(4, device="cuda")  # allocated through streampool's current resource
    """
    from . import _on_import

    unknown = [name for name in libraries if name not in _on_import.NAMES]
    if unknown:
        raise ValueError(
            f"use_on_import() takes {', '.join(map(repr, _on_import.NAMES))}, not {', '.join(map(repr, unknown))}"
        )

    def report(library: str, done: str) -> None:
        if _on_import.kept_own(done) and done != SIMULATED:
            warnings.warn(
                f"streampool.allocators.use_on_import: {library} keeps its own allocator: {done}",
                RuntimeWarning,
                stacklevel=2,
            )

    names = libraries or tuple(_on_import.NAMES)
    _on_import.route_on_import(report, [_on_import.NAMES[name] for name in names])
