"""PyTorch, CuPy and Numba routed through streampool as a program imports them:
:func:`streampool.allocators.use_on_import`, and what ``streampool profile`` does in the
program it runs, so that what they allocate reaches the resource it logs.

CuPy and Numba are routed as soon as their import has finished (a finder on
``sys.meta_path`` wraps the module's ``exec_module``), before the program can allocate
with them; PyTorch at its first CUDA initialisation (``torch.cuda._lazy_init``, which
PyTorch calls before its first CUDA tensor), so that a program that sets its own allocator
before keeps it. Routing touches no device (no ``torch.cuda.is_available()``, which
initialises CUDA, after which a forked child cannot use it), and a library imported
already is routed at once (PyTorch at its first CUDA use still). A library whose import
fails is left to fail as it would; a routing that fails, or that the program's own choice
of allocator makes pointless, leaves the library its own allocator, and says why to
``report`` (the library's name and a line), as it says what each routing did.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from .. import _native
from . import SIMULATED

#: The libraries routed, by the module whose import routes them, with their names.
LIBRARIES = {"torch": "PyTorch", "cupy": "CuPy", "numba.cuda": "Numba"}
#: The names :func:`streampool.allocators.use_on_import` takes, with their modules.
NAMES = {"torch": "torch", "cupy": "cupy", "numba": "numba.cuda"}
#: Those names by the libraries' names (``"PyTorch"``: ``"torch"``).
NAME_OF = {LIBRARIES[module]: name for name, module in NAMES.items()}
#: How what a routing did begins when the library keeps its own allocator: skipped (the
#: program's choice, the simulated device), failed, or replaced by the program after.
KEPT = ("skipped", "failed", "replaced")


def kept_own(done: str) -> bool:
    """Whether a routing's report (``done``) says the library keeps its own allocator."""
    return done.startswith(KEPT)


#: streampool's module for each library, which imports it at its top: a library imported
#: by it (a program calling ``use()`` itself) is routed once that module has run, since
#: routing needs the whole module.
_OURS = {"torch": f"{__package__}.torch", "cupy": f"{__package__}.cupy", "numba.cuda": f"{__package__}.numba"}

Report = Callable[[str, str], None]
#: Routes a library, given its module (a key of LIBRARIES) and the report: what was done,
#: or None when the routing is deferred (it reports then itself).
Router = Callable[[str, Report], "str | None"]


def route(module: str, report: Report) -> str | None:
    """Routes the library that ``module`` (a key of :data:`LIBRARIES`, imported) belongs to
    through the current resource of each device; what was done (``"skipped: ..."`` on the
    simulated device, whose memory a GPU library cannot use), or None for PyTorch, which is
    routed at its first CUDA initialisation and tells ``report`` then."""
    if module not in LIBRARIES:
        raise ValueError(f"no routing for module {module!r}; routed: {', '.join(LIBRARIES)}")
    if _native.using_simulated_device():
        return SIMULATED
    if module == "torch":
        return _route_torch(report)
    if module == "cupy":
        from . import cupy

        return cupy.use()
    import numba.core.config

    chosen = getattr(numba.core.config, "CUDA_MEMORY_MANAGER", "default")
    if chosen == f"{__package__}.numba":
        return f"NUMBA_CUDA_MEMORY_MANAGER={chosen}, the program's own setting"
    if chosen != "default":
        return f"skipped: the program chose Numba's memory manager {chosen} (NUMBA_CUDA_MEMORY_MANAGER)"
    from . import numba

    return str(numba._install())


#: What routing PyTorch says when streampool is its allocator already.
_ALREADY = "already allocating through streampool"


def _route_torch(report: Report) -> str | None:
    """PyTorch's allocator is swapped as PyTorch first initialises CUDA
    (``torch.cuda._lazy_init``, which PyTorch's C++ calls before its first CUDA tensor; the
    modules of ``torch.cuda`` that bound it by name get the wrapper too): a program that
    chooses its own allocator before keeps it, and is told so."""
    import torch

    from . import torch as ours

    cuda = torch.cuda
    if ours._IN_USE:
        return _ALREADY
    if cuda.is_initialized():
        return "skipped: PyTorch had initialised CUDA, and its allocator, before it could be routed"
    first = cuda._lazy_init
    holders: list[Any] = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("torch.cuda") and getattr(m, "_lazy_init", None) is first
    ]
    lock = threading.RLock()
    state = {"done": False, "busy": False}

    def _lazy_init() -> None:
        if not state["done"]:
            with lock:  # PyTorch's first initialisation may come from several threads at once
                if not state["done"] and not state["busy"]:
                    state["busy"] = True
                    try:
                        if not _STOPPED.is_set():
                            done = _swap_torch(ours, cuda)
                            with contextlib.suppress(Exception):  # a warning raised as an error
                                report(LIBRARIES["torch"], done)
                    finally:
                        state["done"] = True  # swapped before anyone runs PyTorch's own
                        for module in holders:
                            if getattr(module, "_lazy_init", None) is _lazy_init:
                                module._lazy_init = first
        first()

    for module in holders:
        module._lazy_init = _lazy_init
    return None


def _swap_torch(ours: ModuleType, cuda: Any) -> str:
    """Swaps PyTorch's allocator for streampool's where the program has not chosen one;
    what was done. Never raises: PyTorch then initialises with its own allocator."""
    try:
        if ours._IN_USE:
            return _ALREADY
        if cuda.is_initialized():  # by a path that called PyTorch's own initialisation
            return "skipped: PyTorch had initialised CUDA, and its allocator, before its first allocation"
        backend = (
            cuda.memory.get_allocator_backend() if hasattr(cuda.memory, "get_allocator_backend") else "native"
        )
        if backend == "pluggable":
            return "skipped: the program set its own PyTorch allocator (change_current_allocator)"
        if backend != "native":
            return (
                f"skipped: the program chose PyTorch's {backend} allocator (PYTORCH_ALLOC_CONF or "
                "PYTORCH_CUDA_ALLOC_CONF)"
            )
        return str(ours._install())
    except Exception as e:
        return f"failed: {type(e).__name__}: {e}"


#: Set in a forked child (:func:`stop`): nothing more is routed or reported there.
_STOPPED = threading.Event()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the waited-for modules with the finders after it, and routes each once its
    module has run. It stays on ``sys.meta_path`` once nothing is waited for (or after
    :func:`stop`), answering nothing: taking it off could make another thread's look-up,
    walking the list then, skip the finder after it."""

    def __init__(self, modules: Iterable[str], report: Report, router: Router) -> None:
        self.waiting = set(modules)
        self.report, self.router = report, router
        self._finding = threading.local()  # this thread's look-ups in progress (find_spec)
        self._running: set[str] = set()  # streampool's modules (_OURS) being imported
        self._lock = threading.Lock()

    def _waited(self) -> set[str]:
        with self._lock:
            return set() if _STOPPED.is_set() else set(self.waiting)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        waited = self._waited()
        ours = {_OURS[m] for m in waited}
        finding: set[str] = self._finding.__dict__.setdefault("names", set())
        if (fullname not in waited and fullname not in ours) or fullname in finding:
            return None
        finding.add(fullname)  # the finders after this one answer the look-up below
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            if fullname not in ours:
                run(module)  # an import that fails fails as it would
                self.routed(fullname)
                return
            self._running.add(fullname)
            try:
                run(module)
            except BaseException as e:
                failed: BaseException | None = e
                raise
            else:
                failed = None
            finally:
                self._running.discard(fullname)
                for library in [m for m in self._waited() if _OURS[m] == fullname and m in sys.modules]:
                    # imported by it, and waiting for it to finish
                    if failed is None:
                        self.routed(library)
                    else:
                        self.give_up(library, f"failed: {type(failed).__name__}: {failed}")

        loader.exec_module = exec_module  # this spec's loader: made for this import alone
        return spec

    def _take(self, module: str) -> bool:
        """Whether ``module`` is to be routed now (then no longer waited for)."""
        with self._lock:
            if _STOPPED.is_set() or module not in self.waiting or _OURS[module] in self._running:
                return False
            self.waiting.discard(module)
        return True

    def routed(self, module: str) -> None:
        """Routes ``module``'s library (once; after streampool's module for it, where that
        is being imported) and reports what happened."""
        if not self._take(module):
            return
        try:
            done = self.router(module, self.report)
        except Exception as e:  # the program runs on with the library's own allocator
            done = f"failed: {type(e).__name__}: {e}"
        if done is not None:
            self.report(LIBRARIES[module], done)

    def give_up(self, module: str, why: str) -> None:
        if self._take(module):
            self.report(LIBRARIES[module], why)


def stop() -> None:
    """Nothing more is routed or reported in this process (a forked child of a profiled
    program runs as it would unprofiled, save what was routed before the fork)."""
    _STOPPED.set()


def route_on_import(
    report: Report, modules: Iterable[str] = tuple(LIBRARIES), router: Router = route
) -> None:
    """Routes each library of ``modules`` (keys of :data:`LIBRARIES`) as the program imports
    it, at once where it is imported already; ``report(name, what)`` is told what each
    routing did. ``router``: what routes a module (:func:`route`)."""
    wanted = list(dict.fromkeys(modules))
    unknown = [m for m in wanted if m not in LIBRARIES]
    if unknown:
        raise ValueError(f"no routing for {', '.join(map(repr, unknown))}; routed: {', '.join(LIBRARIES)}")
    if not wanted:
        return
    finder = _Finder(wanted, report, router)
    sys.meta_path.insert(0, finder)
    for module in wanted:
        if module in sys.modules:
            finder.routed(module)
