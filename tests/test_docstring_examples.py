"""Every ``>>>`` example in the package's docstrings runs as shown, each in a fresh
interpreter on the simulated device, with ``streampool`` and ``mr`` imported (as the
examples assume)."""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import streampool


def _examples() -> list[tuple[str, str]]:
    found = []
    for info in pkgutil.walk_packages(streampool.__path__, "streampool."):
        name = info.name
        if name == "streampool._native" or name.split(".")[-1].startswith("__"):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:  # a hookup for a library not installed here (CuPy, PyTorch, ...)
            continue
        for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
            if test.examples and test.name.startswith(name):
                found.append((name, test.name))
    return sorted(set(found))


RUN = r"""
import doctest, importlib, sys
import streampool
from streampool import mr
module, name = sys.argv[1], sys.argv[2]
tests = [t for t in doctest.DocTestFinder().find(importlib.import_module(module), module) if t.name == name]
assert len(tests) == 1, (name, [t.name for t in tests])
tests[0].globs.update(streampool=streampool, mr=mr)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
runner.run(tests[0])
sys.exit(1 if runner.summarize(verbose=False).failed else 0)
"""

EXAMPLES = _examples()


def test_the_package_has_examples() -> None:
    assert len(EXAMPLES) >= 10, EXAMPLES


@pytest.mark.nosim
@pytest.mark.parametrize(("module", "name"), EXAMPLES, ids=[n for _, n in EXAMPLES])
def test_a_docstring_example_runs_as_shown(module: str, name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMPOOL_")}
    done = subprocess.run(
        [sys.executable, "-c", RUN, module, name],
        cwd=tmp_path,  # files an example writes land here
        env=env | {"STREAMPOOL_DEVICE": "sim"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- the native classes' and functions' examples: in help() as in the stub, and they run ---


def _stub_examples() -> list[tuple[str, str, str]]:
    """``(name, example code, runtime doc)`` of every ``Example::`` block in the typing stub
    of the native module (python/streampool/_native.pyi)."""
    import ast
    import inspect
    import textwrap

    from streampool import _native

    stub = Path(streampool.__file__).with_name("_native.pyi")
    found = []

    def add(name: str, node: ast.AST, runtime: object) -> None:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc and "Example::" in doc:
            body = (
                doc.split("Example::", 1)[1].split("\n\n", 1)[1]
                if "\n\n" in doc.split("Example::", 1)[1]
                else ""
            )
            lines = []
            for line in body.splitlines():
                if line and not line.startswith(" "):
                    break  # the text after the block
                lines.append(line)
            found.append(
                (name, textwrap.dedent("\n".join(lines)).strip(), getattr(runtime, "__doc__", None) or "")
            )

    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and hasattr(_native, node.name):
            runtime = getattr(_native, node.name)
            add(node.name, node, runtime)
            for sub in getattr(node, "body", []):
                if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_"):
                    add(f"{node.name}.{sub.name}", sub, inspect.getattr_static(runtime, sub.name, None))
    return found


STUB_EXAMPLES = _stub_examples()


def test_the_stub_has_examples() -> None:
    assert len(STUB_EXAMPLES) >= 9, [n for n, _, _ in STUB_EXAMPLES]


@pytest.mark.parametrize(("name", "code", "runtime"), STUB_EXAMPLES, ids=[n for n, _, _ in STUB_EXAMPLES])
def test_help_shows_the_stub_s_example(name: str, code: str, runtime: str) -> None:
    """help() shows the native doc, not the stub's: an example must be in both."""

    def words(text: str) -> str:
        return " ".join(text.replace("``", "`").split())

    for line in code.splitlines():
        if line.strip():
            assert words(line) in words(runtime), f"{name}: help() lacks {line.strip()!r}"


@pytest.mark.nosim
@pytest.mark.parametrize(("name", "code", "runtime"), STUB_EXAMPLES, ids=[n for n, _, _ in STUB_EXAMPLES])
def test_the_stub_s_example_runs(name: str, code: str, runtime: str, tmp_path: Path) -> None:
    needs = [lib for lib in ("torch", "cupy", "numba") if f"{lib}." in code]
    for lib in needs:
        pytest.importorskip(lib)
    if needs or "GPU" in code:
        pytest.skip(f"{name}: the example needs a GPU")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMPOOL_")}
    done = subprocess.run(
        [sys.executable, "-c", "import streampool\nfrom streampool import mr\n" + code],
        cwd=tmp_path,
        env=env | {"STREAMPOOL_DEVICE": "sim"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{name}:\n{code}\n{done.stdout}{done.stderr}"
