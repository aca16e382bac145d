"""streampool.allocators.numba where Numba cannot take it: no GPU (``numba.cuda.is_available()``
is False) and Numba's CUDA simulator. Over stand-ins for Numba's modules, so that Numba need
not be installed."""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import streampool
from streampool import allocators, mr

PLUGIN = "streampool.allocators.numba"


class PendingDeallocs:
    """Numba's ``_PendingDeallocs`` as numba-cuda has it: ``add_item(dtor, handle, size)``
    frees at once (its capacity unset) unless disabled, as inside ``defer_cleanup``."""

    def __init__(self) -> None:
        self.items: list[tuple[Callable[[int], None], int]] = []
        self.disabled = 0

    def add_item(self, dtor: Callable[[int], None], handle: int, size: int = 0) -> None:
        self.items.append((dtor, handle))
        self.clear()

    def clear(self) -> None:
        while not self.disabled and self.items:
            dtor, handle = self.items.pop(0)
            dtor(handle)

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        self.disabled += 1
        try:
            yield
        finally:
            self.disabled -= 1


class HostOnlyCUDAMemoryManager:
    """What the plugin inherits of Numba's: ``allocations``, ``deallocations``, ``reset``
    (which forgets the records) and ``defer_cleanup``."""

    def __init__(self, context: object = None) -> None:
        self.context = context
        self.allocations: dict[int, object] = {}
        self.deallocations = PendingDeallocs()

    def reset(self) -> None:
        self.allocations.clear()
        self.deallocations.clear()

    @contextlib.contextmanager
    def defer_cleanup(self) -> Iterator[None]:
        with self.deallocations.disable():
            yield


class MemoryPointer:
    """Numba's: its finalizer runs when the object goes."""

    def __init__(self, context: object, pointer: Any, size: int, finalizer: Any = None) -> None:
        self.device_pointer, self.size = pointer, size
        if finalizer is not None:
            weakref.finalize(self, finalizer)


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
        cuda.HostOnlyCUDAMemoryManager = HostOnlyCUDAMemoryManager
        cuda.MemoryPointer = MemoryPointer
        driver.MemoryInfo = type("MemoryInfo", (), {})
        driver.USE_NV_BINDING = False
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
    with pytest.raises(ImportError, match="needs Numba's CUDA target: pip install numba-cuda") as raised:
        fresh_plugin()
    assert type(raised.value) is ImportError  # Numba is there, without what is needed
    monkeypatch.setitem(sys.modules, "numba", None)  # no Numba: ModuleNotFoundError, as RMM's
    with pytest.raises(
        ModuleNotFoundError, match="needs Numba's CUDA target: pip install numba-cuda"
    ) as missing:
        fresh_plugin()
    assert missing.value.name == "numba"


def counted_manager(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> tuple[mr.StatisticsResourceAdaptor, Any]:
    """The plugin's manager over stand-ins for Numba, with statistics over the device's
    resource, current for the test."""
    fake_numba(monkeypatch)
    stats = mr.StatisticsResourceAdaptor(streampool.get_current_device_resource())
    streampool.set_current_device_resource(stats)
    return stats, fresh_plugin().StreampoolNumbaManager(context=None)


def test_numbas_context_reset_frees_the_plugins_memory(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> None:
    # Numba's base manager only forgets its records at a reset: the plugin's memory stayed
    # allocated for ever (RMM's plugin keeps buffers there, which the clearing frees).
    stats, manager = counted_manager(monkeypatch, fresh_plugin)
    kept = [manager.memalloc(1 << 20) for _ in range(4)]
    assert stats.allocation_counts.current_bytes == 4 << 20
    manager.reset()
    assert stats.allocation_counts.current_bytes == 0
    del kept
    gc.collect()  # their finalizers free nothing twice
    assert stats.allocation_counts.current_bytes == 0 and stats.allocation_counts.total_count == 4


def test_an_array_that_outlives_a_reset_frees_nothing_of_the_memory_handed_out_since(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> None:
    # The reset freed the old array's memory; the next allocation got the same address.
    # The old array's finalizer then freed the new array's memory (its record, under the
    # same address), and the allocation after it shared the new array's memory.
    stats, manager = counted_manager(monkeypatch, fresh_plugin)
    old = manager.memalloc(1 << 20)
    manager.reset()
    new = manager.memalloc(1 << 20)
    del old
    gc.collect()
    assert stats.allocation_counts.current_bytes == 1 << 20  # the new array's, still live
    other = manager.memalloc(1 << 20)
    assert other.device_pointer.value != new.device_pointer.value
    del new, other
    gc.collect()
    assert stats.allocation_counts.current_bytes == 0


def test_numbas_defer_cleanup_holds_the_plugins_frees(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> None:
    stats, manager = counted_manager(monkeypatch, fresh_plugin)
    pointer = manager.memalloc(4096)
    del pointer
    gc.collect()
    assert stats.allocation_counts.current_bytes == 0  # outside the block, at once
    with manager.defer_cleanup():
        pointer = manager.memalloc(4096)
        del pointer
        gc.collect()
        assert stats.allocation_counts.current_bytes == 4096  # held while the block runs
    manager.deallocations.clear()  # Numba's next flush
    assert stats.allocation_counts.current_bytes == 0


def test_the_plugin_set_by_the_environment_refuses_the_simulated_device(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin: Callable[[], Any]
) -> None:
    # NUMBA_CUDA_MEMORY_MANAGER=streampool.allocators.numba bypasses use()'s check: Numba's
    # kernels would have been given host addresses.
    fake_numba(monkeypatch)
    manager = fresh_plugin().StreampoolNumbaManager(context=None)
    monkeypatch.setattr(allocators._native, "using_simulated_device", lambda: True)
    with pytest.raises(RuntimeError, match=r"cannot serve Numba here: .*simulated device"):
        manager.initialize()
