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
        def router(module, report):
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


def test_a_library_imported_already_is_routed_at_once(tmp_path: Path) -> None:
    lines = _run(
        tmp_path,
        """
        import torch
        _on_import.route_on_import(report, ["torch"], router=router)
        finder = sys.meta_path[0]
        # Nothing is waited for now: the finder stays on sys.meta_path, answering nothing.
        print(said, finder.find_spec("torch") is None, finder.find_spec("numba.cuda") is None)
        """,
    )
    assert lines == ["['PyTorch: routed after its body: True'] True True"]


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


def test_use_on_import_is_quiet_on_the_simulated_device(tmp_path: Path) -> None:
    lines = _run(
        tmp_path,
        """
        import warnings
        warnings.simplefilter("error")
        from streampool import allocators
        allocators.use_on_import()
        import torch
        print("quiet", [type(f).__name__ for f in sys.meta_path].count("_Finder"))
        """,
    )
    assert lines == ["quiet 1"]  # still waiting for CuPy and Numba


def test_an_unknown_library_is_refused() -> None:
    from streampool.allocators import _on_import

    with pytest.raises(ValueError, match="no routing for 'jax'"):
        _on_import.route_on_import(lambda library, done: None, ["jax"])
    with pytest.raises(ValueError, match="no routing for module 'jax'"):
        _on_import.route("jax", lambda library, done: None)
    from streampool import allocators

    with pytest.raises(ValueError, match="use_on_import\\(\\) takes 'torch', 'cupy', 'numba', not 'jax'"):
        allocators.use_on_import("torch", "jax")


def test_a_library_imported_by_streampools_own_module_is_routed_once_that_module_has_run(
    tmp_path: Path,
) -> None:
    # A program that calls streampool.allocators.torch.use() itself imports PyTorch through
    # that module, which routing needs whole.
    lines = _run(
        tmp_path,
        """
        def whole(module, report):
            ours = sys.modules.get("streampool.allocators.torch")
            return f"streampool's module whole: {hasattr(ours, 'use')}"
        _on_import.route_on_import(report, ["torch"], router=whole)
        import streampool.allocators.torch
        print(len(said), said[0])
        """,
    )
    assert lines == ["1 PyTorch: streampool's module whole: True"]


def test_a_forked_child_routes_and_reports_nothing(tmp_path: Path) -> None:
    lines = _run(
        tmp_path,
        """
        import os
        _on_import.route_on_import(report, router=router)
        os.register_at_fork(after_in_child=_on_import.stop)
        pid = os.fork()
        if pid == 0:
            import torch
            print("child", said, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        import torch
        print("parent", said)
        """,
    )
    assert lines == ["child []", "parent ['PyTorch: routed after its body: True']"]


# PyTorch is routed at its first CUDA initialisation: a stand-in torch.cuda whose
# `_lazy_init` PyTorch's C++ looks up on the module, as PyTorch's does.
TORCH_CUDA = """\
import os
_initialized = False
def is_initialized():
    return _initialized
def _lazy_init():
    global _initialized
    _initialized = True
def first_cuda_tensor():  # as PyTorch's C++ does: the function looked up on the module
    import torch.cuda
    torch.cuda._lazy_init()
from . import memory
"""
TORCH_MEMORY = """\
import os
from . import _lazy_init  # bound by name, as PyTorch's torch.cuda.memory does
def get_allocator_backend():
    return os.environ.get("BACKEND", "native")
def set_per_process_memory_fraction(fraction):
    _lazy_init()
"""


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("swapped", "PyTorch: swapped"),
        ("by-name", "PyTorch: swapped"),  # first initialised by a function that bound it by name
        (
            "backend",
            "PyTorch: skipped: the program chose PyTorch's cudaMallocAsync allocator (PYTORCH_ALLOC_CONF or "
            "PYTORCH_CUDA_ALLOC_CONF)",
        ),
        ("own", "PyTorch: skipped: the program set its own PyTorch allocator (change_current_allocator)"),
        ("already", "PyTorch: already allocating through streampool"),
        ("fails", "PyTorch: failed: OSError: no allocator here"),
        (
            "initialised",
            "PyTorch: skipped: PyTorch had initialised CUDA, and its allocator, before its first allocation",
        ),
        ("stopped", None),
    ],
)
def test_pytorch_is_routed_at_its_first_cuda_initialisation(
    tmp_path: Path, case: str, said: str | None
) -> None:
    (tmp_path / "lib" / "torch" / "cuda").mkdir(parents=True)
    (tmp_path / "lib" / "torch" / "cuda" / "__init__.py").write_text(TORCH_CUDA)
    (tmp_path / "lib" / "torch" / "cuda" / "memory.py").write_text(TORCH_MEMORY)
    lines = _run(
        tmp_path,
        f"""
        import os
        case = {case!r}
        os.environ["BACKEND"] = {{"backend": "cudaMallocAsync", "own": "pluggable"}}.get(case, "native")
        import torch, torch.cuda
        from streampool.allocators import torch as ours
        def install():
            if case == "fails":
                raise OSError("no allocator here")
            ours._IN_USE = True
            return "swapped"
        ours._install = install
        print(_on_import._route_torch(report), said)  # deferred: nothing yet
        if case == "already":
            ours._IN_USE = True
        if case == "initialised":
            torch.cuda._initialized = True
        if case == "stopped":
            _on_import.stop()
        if case == "by-name":
            torch.cuda.memory.set_per_process_memory_fraction(0.5)
        torch.cuda.first_cuda_tensor()  # PyTorch initialises all the same
        torch.cuda.first_cuda_tensor()  # routed once, and PyTorch's own _lazy_init is back
        back = [m._lazy_init.__module__ for m in (torch.cuda, torch.cuda.memory)]
        print(said, back, torch.cuda.is_initialized())
        """,
    )
    assert lines[0] == "None []"
    assert lines[1] == f"{[said] if said else []} ['torch.cuda', 'torch.cuda'] True"


def test_no_thread_initialises_pytorch_before_the_swap(tmp_path: Path) -> None:
    (tmp_path / "lib" / "torch" / "cuda").mkdir(parents=True)
    (tmp_path / "lib" / "torch" / "cuda" / "__init__.py").write_text(
        TORCH_CUDA.replace("    _initialized = True\n", "    _initialized = True\n    ORDER.append('init')\n")
        + "ORDER = []\n"
    )
    (tmp_path / "lib" / "torch" / "cuda" / "memory.py").write_text(TORCH_MEMORY)
    lines = _run(
        tmp_path,
        """
        import threading, time
        import torch, torch.cuda
        from streampool.allocators import torch as ours
        def install():
            torch.cuda.ORDER.append("swap")
            time.sleep(0.3)  # the other thread's first tensor comes meanwhile
            torch.cuda.ORDER.append("swapped")
            return "swapped"
        ours._install = install
        _on_import._route_torch(report)
        threads = [threading.Thread(target=torch.cuda.first_cuda_tensor) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        print(torch.cuda.ORDER, said)
        """,
    )
    assert lines == ["['swap', 'swapped', 'init', 'init'] ['PyTorch: swapped']"]
