"""streampool.allocators.numba where Numba cannot take it: no GPU (``numba.cuda.is_available()``
is False) and Numba's CUDA simulator. Over stand-ins for Numba's modules, so that Numba need
not be installed."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from streampool import allocators

PLUGIN = "streampool.allocators.numba"


def fake_numba(monkeypatch: pytest.MonkeyPatch, *, gpu: bool = True, simulator: bool = False) -> list[object]:
    """Stand-ins for ``numba``, ``numba.cuda`` and ``numba.cuda.cudadrv.driver`` in
    sys.modules: a CUDA target that sees a GPU or not, or the simulator's ``numba.cuda``
    (no memory manager classes). Returns the list ``set_memory_manager`` appends to."""
    managers: list[object] = []
    numba: Any = types.ModuleType("numba")
    numba.config = types.SimpleNamespace(ENABLE_CUDASIM=1 if simulator else 0)
    cuda: Any = types.ModuleType("numba.cuda")
    cuda.is_available = lambda: gpu
    cuda.set_memory_manager = managers.append
    cudadrv: Any = types.ModuleType("numba.cuda.cudadrv")
    driver: Any = types.ModuleType("numba.cuda.cudadrv.driver")
    if not simulator:
        cuda.HostOnlyCUDAMemoryManager = type("HostOnlyCUDAMemoryManager", (), {})
        cuda.MemoryPointer = type("MemoryPointer", (), {})
        driver.MemoryInfo = type("MemoryInfo", (), {})
    numba.cuda, cuda.cudadrv, cudadrv.driver = cuda, cudadrv, driver
    for name, module in [
        ("numba", numba),
        ("numba.cuda", cuda),
        ("numba.cuda.cudadrv", cudadrv),
        ("numba.cuda.cudadrv.driver", driver),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    return managers


@pytest.fixture
def fresh_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], Any]]:
    """Imports streampool.allocators.numba afresh (over whatever stands in for Numba), and
    forgets it after the test."""
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    yield lambda: importlib.import_module(PLUGIN)
    sys.modules.pop(PLUGIN, None)


def only_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """use_everywhere() finds Numba's CUDA target and nothing else, on a real backend."""
    monkeypatch.setattr(
        allocators.importlib.util, "find_spec", lambda name: object() if name == "numba.cuda" else None
    )
    monkeypatch.setattr(allocators._native, "using_simulated_device", lambda: False)


def test_use_everywhere_skips_numba_when_it_sees_no_gpu(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> None:
    managers = fake_numba(monkeypatch, gpu=False)
    only_numba(monkeypatch)
    done = allocators.use_everywhere()
    assert done["numba"] == "skipped: Numba sees no CUDA device (numba.cuda.is_available() is False)"
    assert managers == []  # Numba's memory manager left as it was
    assert fresh_plugin().use().startswith("skipped: Numba sees no CUDA device")
    assert managers == []


def test_use_everywhere_configures_numba_when_it_sees_a_gpu(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> None:
    managers = fake_numba(monkeypatch, gpu=True)
    only_numba(monkeypatch)
    done = allocators.use_everywhere()
    assert done["numba"].startswith("numba.cuda.set_memory_manager(")
    assert managers == [fresh_plugin().StreampoolNumbaManager]


def test_numbas_cuda_simulator_is_named(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> None:
    fake_numba(monkeypatch, simulator=True)
    with pytest.raises(ImportError, match="CUDA simulator") as raised:
        fresh_plugin()
    message = str(raised.value)
    assert "NUMBA_ENABLE_CUDASIM=1" in message and "no external memory managers" in message
    assert "pip install" not in message
    only_numba(monkeypatch)
    done = allocators.use_everywhere()
    assert done["numba"].startswith("skipped: numba.cuda cannot be imported (ImportError: ")
    assert "CUDA simulator" in done["numba"]


def test_numba_without_its_cuda_target_names_the_package(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> None:
    fake_numba(monkeypatch, simulator=False)
    monkeypatch.delattr(sys.modules["numba.cuda"], "HostOnlyCUDAMemoryManager")
    with pytest.raises(ImportError, match="needs Numba's CUDA target: pip install numba-cuda"):
        fresh_plugin()
