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
    if chosen != "default":
        return f"skipped: the program chose Numba's memory manager {chosen} (NUMBA_CUDA_MEMORY_MANAGER)"
    from . import numba

    return str(numba._install())


def _route_torch(report: Report) -> str | None:
    """PyTorch's allocator is swapped as PyTorch first initialises CUDA: a program that
    chooses its own before (``change_current_allocator``, ``PYTORCH_CUDA_ALLOC_CONF``)
    keeps it, and is told so."""
    import torch

    from . import torch as ours

    cuda = torch.cuda
    if cuda.is_initialized():  # too late: the error says so
        return ours._install()
    first = cuda._lazy_init
    once = threading.Lock()

    def _lazy_init() -> None:
        with once:  # PyTorch's first initialisation may come from several threads at once
            if cuda._lazy_init is _lazy_init:
                cuda._lazy_init = first
                if not _STOPPED.is_set():
                    report(LIBRARIES["torch"], _swap_torch(ours, cuda))
        first()

    cuda._lazy_init = _lazy_init
    return None


def _swap_torch(ours: ModuleType, cuda: Any) -> str:
    if cuda.is_initialized():  # by a path that bound PyTorch's own _lazy_init
        return "skipped: PyTorch had initialised CUDA (and its allocator) before its first allocation"
    backend = (
        cuda.memory.get_allocator_backend() if hasattr(cuda.memory, "get_allocator_backend") else "native"
    )
    if backend != "native":
        return f"skipped: the program chose PyTorch's {backend} allocator (PYTORCH_CUDA_ALLOC_CONF)"
    try:
        return str(ours._install())
    except RuntimeError as e:
        if "initialized" in str(e.__cause__ or ""):
            return "skipped: the program set its own PyTorch allocator (change_current_allocator)"
        return f"failed: {type(e).__name__}: {e}"


#: Set in a forked child (:func:`stop`): nothing more is routed or reported there.
_STOPPED = threading.Event()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the waited-for modules with the finders after it, and routes each once its
    module has run."""

    def __init__(self, modules: Iterable[str], report: Report, router: Router) -> None:
        self.waiting = set(modules)
        self.report, self.router = report, router
        self._finding: set[str] = set()
        self._running: set[str] = set()  # streampool's modules (_OURS) being imported
        self._lock = threading.Lock()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        ours = {_OURS[m] for m in self.waiting}
        if (fullname not in self.waiting and fullname not in ours) or fullname in self._finding:
            return None
        self._finding.add(fullname)  # the finders after this one answer the look-up below
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
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
                for library in [m for m in self.waiting if _OURS[m] == fullname and m in sys.modules]:
                    # imported by it, and waiting for it to finish
                    if failed is None:
                        self.routed(library)
                    else:
                        self.give_up(library, f"failed: {type(failed).__name__}: {failed}")

        loader.exec_module = exec_module  # this spec's loader: made for this import alone
        return spec

    def _take(self, module: str) -> bool:
        """Whether ``module`` is to be routed now (then no longer waited for); leaves
        ``sys.meta_path`` once nothing is."""
        with self._lock:
            if _STOPPED.is_set() or module not in self.waiting or _OURS[module] in self._running:
                return False
            self.waiting.discard(module)
            if not self.waiting:
                with contextlib.suppress(ValueError):
                    sys.meta_path.remove(self)
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
    for finder in [f for f in sys.meta_path if isinstance(f, _Finder)]:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)


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
