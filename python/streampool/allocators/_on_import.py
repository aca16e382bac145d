"""PyTorch, CuPy and Numba routed through streampool as a program imports them: what
``streampool profile`` does in the program it runs, so that what they allocate reaches
the resource it logs.

Each library is routed as soon as its import has finished (a finder on ``sys.meta_path``
wraps its module's ``exec_module``), before the program can allocate with it: PyTorch can
swap its allocator only before its first CUDA tensor, Numba its memory manager only before
its first context. Routing touches no device (no ``torch.cuda.is_available()``, which
initialises CUDA, after which a forked child cannot use it), and a library imported
already is routed at once. What each routing did, or why it did not, goes to ``report``
(the library's name and a line); a library whose import fails is left to fail as it
would, and a routing that fails leaves the library its own allocator.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from .. import _native
from . import SIMULATED

#: The libraries routed, by the module whose import routes them, with their names.
LIBRARIES = {"torch": "PyTorch", "cupy": "CuPy", "numba.cuda": "Numba"}
#: streampool's module for each library, which imports it at its top: a library imported
#: by it (a program calling ``use()`` itself) is routed once that module has run, since
#: routing needs the whole module.
_OURS = {"torch": f"{__package__}.torch", "cupy": f"{__package__}.cupy", "numba.cuda": f"{__package__}.numba"}

Report = Callable[[str, str], None]


def route(module: str) -> str:
    """Routes the library that ``module`` (a key of :data:`LIBRARIES`, imported) belongs to
    through streampool's current resource; what was done (``"skipped: ..."`` on the
    simulated device, whose memory a GPU library cannot use)."""
    if _native.using_simulated_device():
        return SIMULATED
    if module == "torch":
        from . import torch

        return torch._install()
    if module == "cupy":
        from . import cupy

        return cupy.use()
    if module == "numba.cuda":
        from . import numba

        return numba._install()
    raise ValueError(f"no routing for module {module!r}; routed: {', '.join(LIBRARIES)}")


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the waited-for modules with the finders after it, and routes each once its
    module has run."""

    def __init__(self, modules: Iterable[str], report: Report, router: Callable[[str], str]) -> None:
        self.waiting = set(modules)
        self.report, self.router = report, router
        self._finding: set[str] = set()
        self._running: set[str] = set()  # streampool's modules (_OURS) being imported

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
            if fullname in ours:
                self._running.add(fullname)
                try:
                    run(module)
                finally:
                    self._running.discard(fullname)
                    for library in [m for m in self.waiting if _OURS[m] == fullname and m in sys.modules]:
                        self.routed(library)  # imported by it, and waiting for it to finish
                return
            run(module)  # an import that fails fails as it would
            self.routed(fullname)

        loader.exec_module = exec_module  # this spec's loader: made for this import alone
        return spec

    def routed(self, module: str) -> None:
        """Routes ``module``'s library (once; after streampool's module for it, where that
        is being imported) and reports what happened; leaves ``sys.meta_path`` once every
        library is routed."""
        if module not in self.waiting or _OURS[module] in self._running:
            return
        self.waiting.discard(module)
        if not self.waiting and self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            done = self.router(module)
        except Exception as e:  # the program runs on with the library's own allocator
            done = f"failed: {type(e).__name__}: {e}"
        self.report(LIBRARIES.get(module, module), done)


def route_on_import(
    report: Report, modules: Iterable[str] = tuple(LIBRARIES), router: Callable[[str], str] = route
) -> None:
    """Routes each library of ``modules`` (keys of :data:`LIBRARIES`) as the program imports
    it, at once where it is imported already; ``report(name, what)`` is told what each
    routing did. ``router``: what routes a module (:func:`route`)."""
    wanted = list(modules)
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
