"""PyTorch, CuPy and Numba routed as a program imports them (what `streampool profile`
does in the program it runs): stand-in packages of those names, in a process of their own
(the real ones may be installed, and a routed import cannot be undone)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.nosim

STAND_INS = {
    # Each records, as its last statement, that its body ran: routing comes after it.
    "torch/__init__.py": "BODY_DONE = True\n",
    "numba/__init__.py": "BODY_DONE = True\n",
    "numba/cuda/__init__.py": "BODY_DONE = True\n",
    "cupy/__init__.py": "raise ImportError('this CuPy cannot be imported')\n",
}


def _run(tmp_path: Path, code: str) -> list[str]:
    for name, body in STAND_INS.items():
        path = tmp_path / "lib" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    prelude = textwrap.dedent(
        """
        import sys
        from streampool.allocators import _on_import
        said = []
        def router(module):
            if module == "numba.cuda":
                raise RuntimeError("no GPU for Numba")
            return f"routed after its body: {getattr(sys.modules[module], 'BODY_DONE', False)}"
        def report(library, done):
            said.append(f"{library}: {done}")
        """
    )
    path = os.pathsep.join([str(tmp_path / "lib"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, STREAMPOOL_DEVICE="sim", PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_each_library_is_routed_once_its_import_has_run(tmp_path: Path) -> None:
    lines = _run(
        tmp_path,
        """
        _on_import.route_on_import(report, router=router)
        finder = sys.meta_path[0]
        print(said)
        import torch
        import torch  # a second import routes nothing again
        print(said)
        import numba
        print(len(said))  # numba alone is not Numba's CUDA target
        import numba.cuda  # the routing fails: reported, and the import stands
        print(said[-1], numba.cuda.BODY_DONE)
        try:
            import cupy
        except ImportError as e:
            print("cupy:", e, len(said))
        print(finder in sys.meta_path)  # CuPy is still waited for
        """,
    )
    assert lines == [
        "[]",
        "['PyTorch: routed after its body: True']",
        "1",
        "Numba: failed: RuntimeError: no GPU for Numba True",
        "cupy: this CuPy cannot be imported 2",  # nothing said of it
        "True",
    ]


def test_a_library_imported_already_is_routed_at_once_and_the_finder_leaves(tmp_path: Path) -> None:
    lines = _run(
        tmp_path,
        """
        import torch
        before = list(sys.meta_path)
        _on_import.route_on_import(report, ["torch"], router=router)
        print(said, sys.meta_path == before)
        """,
    )
    assert lines == ["['PyTorch: routed after its body: True'] True"]


def test_on_the_simulated_device_nothing_is_routed(tmp_path: Path) -> None:
    lines = _run(
        tmp_path,
        """
        from streampool.allocators import SIMULATED
        _on_import.route_on_import(report)
        import torch
        print(said == [f"PyTorch: {SIMULATED}"])
        """,
    )
    assert lines == ["True"]


def test_an_unknown_library_is_refused() -> None:
    from streampool.allocators import _on_import

    with pytest.raises(ValueError, match="no routing for 'jax'"):
        _on_import.route_on_import(lambda library, done: None, ["jax"])
    with pytest.raises(ValueError, match="no routing for module 'jax'"):
        _on_import.route("jax")


def test_a_library_imported_by_streampools_own_module_is_routed_once_that_module_has_run(
    tmp_path: Path,
) -> None:
    # A program that calls streampool.allocators.torch.use() itself imports PyTorch through
    # that module, which routing needs whole.
    lines = _run(
        tmp_path,
        """
        def whole(module):
            ours = sys.modules.get("streampool.allocators.torch")
            return f"streampool's module whole: {hasattr(ours, 'use')}"
        _on_import.route_on_import(report, ["torch"], router=whole)
        import streampool.allocators.torch
        print(len(said), said[0])
        """,
    )
    assert lines == ["1 PyTorch: streampool's module whole: True"]
