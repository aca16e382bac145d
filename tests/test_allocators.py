"""The allocators of other libraries (streampool.allocators) on the simulated device: the
exported C entry points called through ctypes, and the interfaces of the PyTorch, CuPy and
Numba hookups that can be checked without a GPU (tests/test_gpu_frameworks.py runs them
with the libraries on a GPU)."""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any, Self

import pytest

import streampool
from streampool import allocators, mr
from streampool.sim import SimulatedDevice

LIB = ctypes.CDLL(allocators.library_path())
ALLOC = getattr(LIB, allocators.ALLOC_FUNCTION)
ALLOC.restype = ctypes.c_void_p
ALLOC.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
FREE = getattr(LIB, allocators.FREE_FUNCTION)
FREE.restype = None
FREE.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]


def alloc(size: int, device: int = 0, stream: int = 0) -> int:
    return ALLOC(size, device, stream) or 0


def free(ptr: int, size: int, device: int = 0, stream: int = 0) -> None:
    FREE(ptr, size, device, stream)


@pytest.fixture
def stats() -> Iterator[mr.StatisticsResourceAdaptor]:
    """Statistics over the device's resource, current for the test."""
    adaptor = mr.StatisticsResourceAdaptor(streampool.get_current_device_resource())
    previous = streampool.set_current_device_resource(adaptor)
    yield adaptor
    assert previous is not None
    streampool.set_current_device_resource(previous)


def test_a_pair_goes_through_the_current_resource(stats: mr.StatisticsResourceAdaptor) -> None:
    ptr = alloc(1000)
    assert ptr != 0 and ptr % 256 == 0
    assert stats.allocation_counts.current_bytes == 1000
    free(ptr, 1000)
    counts = stats.allocation_counts
    assert (counts.current_bytes, counts.total_count) == (0, 1)


def test_the_resource_set_later_is_used(sim: SimulatedDevice) -> None:
    ptr = alloc(256)  # before any resource is set or asked for from Python
    assert ptr != 0
    free(ptr, 256)
    tracking = mr.TrackingResourceAdaptor(streampool.get_current_device_resource())
    streampool.set_current_device_resource(tracking)
    ptr = alloc(512)
    assert tracking.get_allocated_bytes() == 512
    free(ptr, 512)
    assert tracking.get_allocated_bytes() == 0


def test_zero_bytes_is_null_and_not_a_failure() -> None:
    before = allocators.failure_count()
    assert alloc(0) == 0
    free(0, 0)
    assert allocators.failure_count() == before


def failed(call: object) -> str:
    """Runs `call`, checks that it failed once, and returns the message kept for it."""
    before = allocators.failure_count()
    assert call() in (None, 0)  # type: ignore[operator]
    assert allocators.failure_count() == before + 1
    message = allocators.last_error()
    assert message is not None
    return message


# A C++ caller of streampool_alloc_cxx, as PyTorch's pluggable allocator is: it catches what
# the call throws and says which kind it was (1: std::bad_alloc, 2: another std::exception,
# 3: anything else, 0: nothing thrown).
CXX_CALLER = r"""
#include <cstddef>
#include <cstring>
#include <exception>
#include <new>
typedef void* (*alloc_fn)(std::size_t, int, void*);
extern "C" int call(alloc_fn f, std::size_t size, int device, void** out, char* message, std::size_t cap) {
  try {
    *out = f(size, device, nullptr);
    return 0;
  } catch (const std::bad_alloc& e) {
    std::strncpy(message, e.what(), cap - 1);
    return 1;
  } catch (const std::exception& e) {
    std::strncpy(message, e.what(), cap - 1);
    return 2;
  } catch (...) {
    return 3;
  }
}
"""


@pytest.fixture(scope="module")
def cxx_call(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`call(size, device)` -> (kind, pointer, message): streampool_alloc_cxx from C++."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler here")
    folder = tmp_path_factory.mktemp("cxx")
    (folder / "caller.cpp").write_text(CXX_CALLER)
    library = folder / "libcaller.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(folder / "caller.cpp")], check=True)
    caller = ctypes.CDLL(str(library)).call
    caller.restype = ctypes.c_int
    function = ctypes.cast(getattr(LIB, allocators.CXX_ALLOC_FUNCTION), ctypes.c_void_p)

    def call(size: int, device: int = 0) -> tuple[int, int, str]:
        out, message = ctypes.c_void_p(), ctypes.create_string_buffer(512)
        kind = caller(function, ctypes.c_size_t(size), device, ctypes.byref(out), message, 512)
        return kind, out.value or 0, message.value.decode()

    return call


def test_the_cxx_entry_point_throws_what_failed(
    stats: mr.StatisticsResourceAdaptor, cxx_call: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    before = allocators.failure_count()
    kind, ptr, message = cxx_call(1 << 40)
    assert (kind, ptr) == (1, 0)  # a std::bad_alloc, with the reason, begun as PyTorch's
    assert message.startswith("CUDA out of memory. streampool: streampool_alloc(size=1099511627776")
    assert "out of memory: StatisticsResourceAdaptor (from CudaAsyncMemoryResource) could not" in message
    kind, ptr, message = cxx_call(16, device=7)
    assert (kind, ptr) == (2, 0)  # a std::runtime_error
    assert "device 7 does not exist" in message
    assert allocators.failure_count() == before + 2 and "device 7" in (allocators.last_error() or "")
    # Nothing thrown for a size of 0 (NULL, as streampool_alloc), and the resource is usable.
    assert cxx_call(0)[:2] == (0, 0)
    assert capfd.readouterr().err == ""  # the exceptions said it, not stderr
    kind, ptr, message = cxx_call(4096)
    assert kind == 0 and ptr != 0 and message == ""
    assert stats.allocation_counts.current_bytes == 4096
    free(ptr, 4096)
    assert stats.allocation_counts.current_bytes == 0


def test_failures_give_null_and_say_why(
    stats: mr.StatisticsResourceAdaptor, capfd: pytest.CaptureFixture[str]
) -> None:
    message = failed(lambda: alloc(1 << 40))
    assert "streampool_alloc(size=1099511627776" in message and "out of memory" in message
    assert capfd.readouterr().err == f"streampool: {message}\n"  # said on stderr too
    assert "device 7 does not exist" in failed(lambda: alloc(16, device=7))
    assert "device -1 does not exist" in failed(lambda: alloc(16, device=-1))
    assert "0x3039" in failed(lambda: alloc(16, stream=0x3039))
    # The resource is still usable.
    ptr = alloc(4096)
    assert ptr != 0
    free(ptr, 4096)
    assert stats.allocation_counts.current_bytes == 0


def test_try_alloc_gives_null_and_says_nothing(
    stats: mr.StatisticsResourceAdaptor, capfd: pytest.CaptureFixture[str]
) -> None:
    """streampool_try_alloc, for callers that check for NULL (PyTorch's MemPool): a failure
    is recorded but not said on stderr; otherwise it is streampool_alloc."""
    try_alloc = getattr(LIB, allocators.TRY_ALLOC_FUNCTION)
    try_alloc.restype, try_alloc.argtypes = ALLOC.restype, ALLOC.argtypes
    message = failed(lambda: try_alloc(1 << 40, 0, 0))
    assert "streampool_alloc(size=1099511627776" in message and "out of memory" in message
    assert "device 7 does not exist" in failed(lambda: try_alloc(16, 7, 0))
    assert capfd.readouterr().err == ""
    assert try_alloc(0, 0, 0) is None
    ptr = try_alloc(4096, 0, 0)
    assert ptr and stats.allocation_counts.current_bytes == 4096
    free(ptr, 4096)
    assert stats.allocation_counts.current_bytes == 0


def test_a_bad_free_is_recorded_and_leaves_the_resource_usable() -> None:
    tracking = mr.TrackingResourceAdaptor(streampool.get_current_device_resource())
    streampool.set_current_device_resource(tracking)
    ptr = alloc(1024)
    message = failed(lambda: free(ptr + 256, 1024))
    assert "streampool_free(ptr=" in message
    assert "size=0" in failed(lambda: free(ptr, 0))
    free(ptr, 1024)
    assert tracking.get_allocated_bytes() == 0


@pytest.mark.nosim
@pytest.mark.parametrize("pooled", [False, True])
def test_memory_whose_stream_was_destroyed_is_freed(pooled: bool) -> None:
    # PyTorch frees on the stream it recorded at allocation, however long after: a stream
    # that its owner destroyed meanwhile (an ExternalStream's) made the free fail, the
    # memory stay allocated, and every later change of resource warn of live memory.
    with SimulatedDevice(capacity_bytes="64MiB"):
        top = mr.CudaAsyncMemoryResource()
        stats = mr.StatisticsResourceAdaptor(mr.ShardedPoolMemoryResource(top) if pooled else top)
        streampool.set_current_device_resource(stats)
        stream = streampool.Stream()
        handle = stream.handle
        ptr = alloc(1 << 20, stream=handle)
        del stream
        gc.collect()
        failures = allocators.failure_count()
        free(ptr, 1 << 20, stream=handle)
        assert allocators.failure_count() == failures, allocators.last_error()
        assert stats.allocation_counts.current_bytes == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no live allocation left to warn of
            streampool.set_current_device_resource(mr.CudaAsyncMemoryResource())


def test_streams_are_honoured_and_ordered(sim: SimulatedDevice) -> None:
    """Each allocation through the C entry point is made on the stream it is given (the
    tracking adaptor over the pool records that stream's handle), and memory freed on one
    stream and reused on another through the sharded pool is ordered (the fixture's race
    detector checks it)."""
    pool = mr.ShardedPoolMemoryResource(streampool.get_current_device_resource())
    tracked = mr.TrackingResourceAdaptor(pool)
    streampool.set_current_device_resource(tracked)
    a, b = streampool.Stream(), streampool.Stream()
    for _ in range(3):
        for s in (a, b):
            ptr = alloc(1 << 16, stream=s.handle)
            assert [(r.ptr, r.stream) for r in tracked.outstanding()] == [(ptr, s.handle)]
            sim.write(s, ptr, 1 << 16, f"written on {'a' if s is a else 'b'}")
            free(ptr, 1 << 16, stream=s.handle)
            assert tracked.outstanding() == []
    for handle in (1, 2):  # the legacy stream's other name, and the per-thread one
        ptr = alloc(512, stream=handle)
        sim.write(handle, ptr, 512)
        free(ptr, 512, stream=handle)
    sim.run()


def test_threads_without_the_gil(stats: mr.StatisticsResourceAdaptor) -> None:
    """ctypes.CDLL releases the GIL around each call: the entry points run on threads that
    do not hold it, each on its own stream, concurrently."""
    errors: list[BaseException] = []

    def work(_: int) -> None:
        try:
            stream = streampool.Stream()
            held = [alloc(4096 * (i % 7 + 1), stream=stream.handle) for i in range(200)]
            assert all(held) and len(set(held)) == len(held)
            for i, ptr in enumerate(held):
                free(ptr, 4096 * (i % 7 + 1), stream=stream.handle)
            stream.synchronize()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads) and not errors, errors
    counts = stats.allocation_counts
    assert (counts.current_bytes, counts.total_count) == (0, 8 * 200)


def test_a_resource_change_with_c_allocations_live_warns() -> None:
    # Memory from the entry points is freed through the resource current at the free: a
    # change while some is live would free it through a resource that did not make it.
    pool = mr.ShardedPoolMemoryResource(streampool.get_current_device_resource())
    before = streampool.set_current_device_resource(pool)
    assert before is not None
    ptr = alloc(4096)
    with pytest.warns(
        RuntimeWarning, match=r"1 allocation\(s\) made on device 0 through streampool's C entry"
    ):
        streampool.set_current_device_resource(before)
    with pytest.warns(RuntimeWarning, match="C entry"):  # any change while some is live
        streampool.set_current_device_resource(pool)  # back: its own memory again
    with warnings.catch_warnings():
        # Made an error, the warning leaves the resource as it was.
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="C entry"):
            streampool.set_current_device_resource(before)
        assert streampool.get_current_device_resource() is pool
    free(ptr, 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streampool.set_current_device_resource(before)  # nothing live: no warning
        ptr = alloc(256)
        free(ptr, 256)
        streampool.set_current_device_resource(pool)
    streampool.set_current_device_resource(before)


# A failure callback that frees cached memory through the C entry point while the GIL is
# released (ctypes.CDLL releases it; so do a library's ops): the inner free runs the
# logging sink's Python code on a thread that PyO3 counts as attached but that does not
# hold the GIL. Run in a child, so that a crash fails the test instead of pytest.
REENTRY = textwrap.dedent(
    """
    import ctypes
    import streampool
    from streampool import allocators, mr
    from streampool.sim import SimulatedDevice

    lib = ctypes.CDLL(allocators.library_path())
    alloc, free = getattr(lib, allocators.ALLOC_FUNCTION), getattr(lib, allocators.FREE_FUNCTION)
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    with SimulatedDevice(capacity_bytes="64MiB"):
        cache, lines = [], []

        def on_oom(nbytes):
            while cache:
                free(cache.pop(), 1 << 20, 0, None)
            return True

        limited = mr.LimitingResourceAdaptor(streampool.get_current_device_resource(), 4 << 20)
        stack = mr.LoggingResourceAdaptor(
            mr.FailureCallbackResourceAdaptor(limited, on_oom), callback=lines.append
        )
        streampool.set_current_device_resource(stack)
        cache += [alloc(1 << 20, 0, None) for _ in range(4)]
        ptr = alloc(1 << 20, 0, None)  # out of memory: on_oom frees the cache
        assert ptr and not cache and allocators.failure_count() == 0, (ptr, cache)
        assert sum(",free," in line for line in lines) == 4, lines
        free(ptr, 1 << 20, 0, None)
    print("ok")
    """
)


@pytest.mark.nosim
def test_python_code_of_a_resource_reentered_without_the_gil() -> None:
    done = subprocess.run([sys.executable, "-c", REENTRY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stdout, done.stderr)


@pytest.mark.nosim
def test_the_backend_is_looked_up_again_when_a_simulated_device_is_exited() -> None:
    with SimulatedDevice(capacity_bytes=1 << 24):
        ptr = alloc(256)
        assert ptr != 0
        free(ptr, 256)
    with SimulatedDevice(capacity_bytes=1 << 24) as second:
        stats = mr.StatisticsResourceAdaptor(streampool.get_current_device_resource())
        streampool.set_current_device_resource(stats)
        ptr = alloc(256)
        assert stats.allocation_counts.current_bytes == 256
        free(ptr, 256)
        assert second.active
        kept = alloc(256)
    # Memory of an exited simulated device goes with it: its free succeeds silently, as a
    # DeviceBuffer's does (with no driver here; on a GPU machine the driver takes over).
    if not streampool.is_initialized():
        failures = allocators.failure_count()
        free(kept, 256)
        assert allocators.failure_count() == failures, allocators.last_error()


def test_use_everywhere_reports_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocators.importlib.util, "find_spec", lambda name: None)
    done = allocators.use_everywhere()
    assert set(done) == {"torch", "cupy", "numba", "rmm"}
    assert all(what.startswith("skipped:") and "not installed" in what for what in done.values())


def test_the_torch_and_cupy_modules_import_without_their_library_as_rmms_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # RMM code checks `rmm_torch_allocator is not None`; its cupy allocator raises when called.
    for library in ("torch", "cupy"):
        monkeypatch.setitem(sys.modules, library, None)  # what an uninstalled library looks like
        monkeypatch.delitem(sys.modules, f"streampool.allocators.{library}", raising=False)
    sp_torch = importlib.import_module("streampool.allocators.torch")
    sp_cupy = importlib.import_module("streampool.allocators.cupy")
    try:
        assert sp_torch.rmm_torch_allocator is None and sp_torch.streampool_torch_allocator is None
        for call in (sp_torch.use, sp_torch.allocator, sp_torch.mem_pool, sp_cupy.use):
            with pytest.raises(ImportError, match=r"pip install (torch|cupy)"):
                call()
        with pytest.raises(ModuleNotFoundError, match="pip install cupy"):
            sp_cupy.rmm_cupy_allocator(1024)
        # `except sp_cupy.OutOfMemoryError` works without CuPy too: streampool's own error.
        assert sp_cupy.OutOfMemoryError is streampool.OutOfMemoryError
    finally:
        for library in ("torch", "cupy"):
            sys.modules.pop(f"streampool.allocators.{library}", None)


def _stub_torch(monkeypatch: pytest.MonkeyPatch, *, built: bool, available: bool) -> list[str]:
    """A stand-in for PyTorch (CUDA build or not, a GPU seen or not); returns what made an
    allocator."""
    made: list[str] = []

    class CUDAPluggableAllocator:
        def __init__(self, path: str, alloc: str, free: str) -> None:
            made.append(alloc)

    torch = types.ModuleType("torch")
    memory = types.ModuleType("torch.cuda.memory")
    if built:
        memory.CUDAPluggableAllocator = CUDAPluggableAllocator  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(memory=memory, is_available=lambda: available)  # type: ignore[attr-defined]
    torch.backends = types.SimpleNamespace(cuda=types.SimpleNamespace(is_built=lambda: built))  # type: ignore[attr-defined]
    torch.__version__ = "0.0+stub"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.cuda", torch.cuda)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "torch.cuda.memory", memory)
    monkeypatch.delitem(sys.modules, "streampool.allocators.torch", raising=False)
    return made


@pytest.mark.parametrize(("built", "available"), [(False, False), (True, False), (True, True)])
def test_the_torch_allocator_is_none_where_pytorch_cannot_use_it_as_rmms(
    monkeypatch: pytest.MonkeyPatch, built: bool, available: bool
) -> None:
    # RMM's module: None unless torch.cuda.is_available(); RMM code checks `is not None`.
    made = _stub_torch(monkeypatch, built=built, available=available)
    try:
        sp_torch = importlib.import_module("streampool.allocators.torch")
        assert sp_torch.rmm_torch_allocator is None  # the simulated device: no GPU for PyTorch
        monkeypatch.setattr(sp_torch._native, "using_simulated_device", lambda: False)
        got = sp_torch.rmm_torch_allocator
        assert (got is not None) == (built and available) and made == (
            ["streampool_alloc_cxx"] if got else []
        )
    finally:
        sys.modules.pop("streampool.allocators.torch", None)


@pytest.mark.parametrize(
    ("module", "library", "fix"),
    [
        ("numba", "numba", "pip install numba-cuda"),
        ("rmm", "rmm", "pip install rmm-cu13"),
    ],
)
def test_importing_without_the_library_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, module: str, library: str, fix: str
) -> None:
    monkeypatch.setitem(sys.modules, library, None)  # what an uninstalled library looks like
    monkeypatch.delitem(sys.modules, f"streampool.allocators.{module}", raising=False)
    with pytest.raises(ImportError, match=fix):
        importlib.import_module(f"streampool.allocators.{module}")


def numba_plugin(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """streampool.allocators.numba, or a skip where Numba's CUDA target cannot be imported
    (``make test-numba`` installs it: these tests then run on the simulated device)."""
    try:
        plugin = importlib.import_module("streampool.allocators.numba")
    except Exception as e:  # numba-cuda raises more than ImportError without CUDA
        if os.environ.get("STREAMPOOL_TEST_NUMBA"):  # make test-numba: a failure, not a skip
            raise
        pytest.skip(f"numba.cuda cannot be imported here: {e}")
    from numba.cuda.cudadrv import driver

    # Numba's pending deallocations log through the logger its driver makes when it starts,
    # which it cannot do without a GPU.
    if getattr(driver, "_logger", None) is None:
        monkeypatch.setattr(driver, "_logger", driver.make_logger(), raising=False)
    return plugin


def address(pointer: Any) -> int:
    """A Numba MemoryPointer's address: its device pointer is the NVIDIA binding's
    ``CUdeviceptr`` (numba-cuda) or a ctypes integer (Numba's own ctypes binding)."""
    ptr = pointer.device_pointer
    return int(getattr(ptr, "value", None) or 0) if isinstance(ptr, ctypes._SimpleCData) else int(ptr)


def test_numba_plugin_allocates_through_the_current_resource(
    stats: mr.StatisticsResourceAdaptor, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = numba_plugin(monkeypatch)
    assert plugin.RMMNumbaManager is plugin.StreampoolNumbaManager
    manager = plugin.StreampoolNumbaManager(context=None)
    assert manager.interface_version == 1
    pointer = manager.memalloc(1000)
    assert address(pointer) != 0 and pointer.size == 1000
    assert stats.allocation_counts.current_bytes == 1000
    empty = manager.memalloc(0)
    assert address(empty) == 0
    del pointer, empty
    gc.collect()
    assert stats.allocation_counts.current_bytes == 0
    free_bytes, total = manager.get_memory_info()
    assert 0 < free_bytes <= total == mr.available_device_memory()[1]
    with pytest.raises(RuntimeError, match=r"CudaAsyncMemoryResource\(enable_ipc=True\)"):
        manager.get_ipc_handle(None)


def test_numba_memory_manager_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = numba_plugin(monkeypatch)
    from numba.cuda.cudadrv import driver

    # use() skips without a GPU, and on the simulated device.
    monkeypatch.setattr(plugin.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plugin._native, "using_simulated_device", lambda: False)

    monkeypatch.setattr(driver, "_memory_manager", None)
    monkeypatch.setattr(driver.config, "CUDA_MEMORY_MANAGER", "streampool.allocators.numba")
    driver._ensure_memory_manager()
    assert driver._memory_manager is plugin.StreampoolNumbaManager
    # An unknown setting: Numba's own error, naming the value.
    monkeypatch.setattr(driver, "_memory_manager", None)
    monkeypatch.setattr(driver.config, "CUDA_MEMORY_MANAGER", "streampool.allocators.nonesuch")
    with pytest.raises(RuntimeError, match=r"streampool\.allocators\.nonesuch"):
        driver._ensure_memory_manager()
    # use(): refused once Numba has made a context (it keeps its manager), done before.
    monkeypatch.setattr(driver, "_memory_manager", None)
    monkeypatch.setattr(plugin, "_context_made", lambda: True)
    with pytest.raises(
        RuntimeError, match=r"came too late.*NUMBA_CUDA_MEMORY_MANAGER=streampool\.allocators\.numba"
    ):
        plugin.use()
    assert driver._memory_manager is None
    monkeypatch.setattr(plugin, "_context_made", lambda: False)
    assert plugin.use().startswith("numba.cuda.set_memory_manager")
    assert driver._memory_manager is plugin.StreampoolNumbaManager


def test_use_everywhere_skips_a_library_that_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        allocators.importlib.util, "find_spec", lambda name: object() if name == "cupy" else None
    )
    monkeypatch.setitem(sys.modules, "cupy", None)  # found, but its import fails
    monkeypatch.delitem(sys.modules, "streampool.allocators.cupy", raising=False)
    monkeypatch.setattr(allocators._native, "using_simulated_device", lambda: False)
    done = allocators.use_everywhere(verbose=True)
    # The library's own reason, not streampool's wording of it.
    assert done["cupy"].startswith("skipped: cupy cannot be imported (ModuleNotFoundError: import of cupy")


# ---------------------------------------------------------------------------------------
# CuPy's allocator function, over stand-ins for CuPy's classes and its C stream function


_CAPSULE_PARTS: list[object] = []


class FakeCupy:
    """What ``streampool.allocators.cupy`` reads of CuPy: ``cuda.UnownedMemory``,
    ``cuda.MemoryPointer``, ``cuda.get_current_stream`` and the capsule of
    ``cuda.stream.get_current_stream_ptr`` (a ctypes function returning ``self.stream``).
    CuPy's stream objects are kept in ``objects`` by handle, as a program keeps its
    ``cupy.cuda.Stream``: delete one to have CuPy's stream destroyed."""

    def __init__(self) -> None:
        self.stream = 0  # the current stream: of every thread not in `streams`
        self.streams: dict[int, int] = {}
        self.objects: dict[int, Any] = {}
        self.allocator: object = None
        fake = self

        class UnownedMemory:
            def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem: UnownedMemory, offset: int) -> None:
                self.mem, self.ptr = mem, mem.ptr + offset

        class Stream:
            def __init__(self, ptr: int) -> None:
                self.ptr = ptr

        class ExternalStream(Stream):
            """CuPy's wrapper of another library's stream: current inside ``with``; the
            object goes at the end of the block, the stream does not."""

            def __enter__(self) -> Self:
                self.previous, fake.stream = fake.stream, self.ptr
                fake.objects[self.ptr] = self
                return self

            def __exit__(self, *exc: object) -> None:
                del fake.objects[self.ptr]
                fake.stream = self.previous

        def get_current_stream() -> Stream:
            handle = fake.current()
            return fake.objects.setdefault(handle, Stream(handle))

        self._function = ctypes.CFUNCTYPE(ctypes.c_ssize_t)(lambda: fake.current())
        self._name = ctypes.create_string_buffer(b"intptr_t (void)")  # the capsule keeps a pointer
        # CuPy's function lives as long as the process: so do these, for memory a failed
        # test leaves to the collector (its free calls the function).
        _CAPSULE_PARTS.append((self._function, self._name))
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        capsule = new_capsule(ctypes.cast(self._function, ctypes.c_void_p), self._name, None)

        def set_allocator(allocator: object) -> None:
            fake.allocator = allocator

        self.cuda: Any = type(
            "cuda",
            (),
            {
                "UnownedMemory": UnownedMemory,
                "MemoryPointer": MemoryPointer,
                "ExternalStream": ExternalStream,
                "get_current_stream": staticmethod(get_current_stream),
                "set_allocator": staticmethod(set_allocator),
                "stream": type("stream", (), {"__pyx_capi__": {"get_current_stream_ptr": capsule}}),
            },
        )

    def current(self) -> int:
        return self.streams.get(threading.get_ident(), self.stream)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeCupy, object]]:
    """A stand-in for CuPy in sys.modules, and streampool.allocators.cupy imported over it."""
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delitem(sys.modules, "streampool.allocators.cupy", raising=False)
    module = importlib.import_module("streampool.allocators.cupy")
    yield fake, module
    sys.modules.pop("streampool.allocators.cupy", None)
    gc.collect()


def logged(stats: mr.MemoryResource) -> tuple[mr.LoggingResourceAdaptor, list[str]]:
    """A logging adaptor over `stats`, current for the device, and its lines."""
    lines: list[str] = []
    logging = mr.LoggingResourceAdaptor(stats, callback=lines.append)
    streampool.set_current_device_resource(logging)
    return logging, lines


@pytest.mark.parametrize("lookup", ["native", "python"])
def test_cupy_allocator_allocates_on_cupys_current_stream_and_frees_on_that_one(
    fake_cupy: tuple[FakeCupy, object], stats: mr.StatisticsResourceAdaptor, lookup: str
) -> None:
    fake, module = fake_cupy
    allocator = module.streampool_cupy_allocator  # type: ignore[attr-defined]
    assert module.rmm_cupy_allocator is allocator  # type: ignore[attr-defined]
    if lookup == "python":  # the way taken where CuPy exports no capsule
        allocator = streampool._native.CupyAllocator(
            fake.cuda.UnownedMemory, fake.cuda.MemoryPointer, fake.cuda.get_current_stream
        )
    assert allocator.native_stream_lookup == (lookup == "native")
    _, lines = logged(stats)
    made, released = streampool.Stream(), streampool.Stream()
    fake.stream = made.handle
    pointer = allocator(3000)
    assert pointer.ptr != 0 and pointer.mem.size == 3000 and pointer.mem.device_id == 0
    assert stats.allocation_counts.current_bytes == 3000
    fake.stream = released.handle  # another stream current when CuPy lets go
    del pointer
    gc.collect()
    assert stats.allocation_counts.current_bytes == 0
    # Once CuPy has destroyed the stream, on the stream current when CuPy lets go (as CuPy).
    fake.stream = made.handle
    pointer = allocator(2000)
    fake.stream = released.handle
    del fake.objects[made.handle], pointer
    gc.collect()
    events = streampool.logs.parse_log("\n".join(lines))
    assert [(e.action, e.size, e.stream) for e in events] == [
        ("allocate", 3000, made.handle),
        ("free", 3000, made.handle),
        ("allocate", 2000, made.handle),
        ("free", 2000, released.handle),
    ]


@pytest.mark.nosim
def test_cupy_frees_are_ordered_after_the_work_on_the_allocation_stream(
    fake_cupy: tuple[FakeCupy, object],
) -> None:
    fake, module = fake_cupy
    allocator = module.streampool_cupy_allocator  # type: ignore[attr-defined]
    with SimulatedDevice(capacity_bytes="64MiB", devices=2) as dev:
        streampool.set_current_device_resource(mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()))
        a, b = streampool.Stream(), streampool.Stream()
        fake.stream = a.handle
        first = allocator(1 << 20)
        dev.write(a, first.ptr, 1 << 20, label="kernel on A writes")
        fake.stream = b.handle  # leaving `with A:` for `with B:`
        del first
        second = allocator(1 << 20)  # the pool may reuse the block only once A's write is done
        dev.write(b, second.ptr, 1 << 20, label="kernel on B writes")
        dev.run()
        assert dev.races() == []
        del second
        # On another device's current stream, with the allocation stream gone: the legacy
        # stream of the memory's device, not a leak.
        stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
        streampool.set_current_device_resource(stats)
        failures = allocators.failure_count()
        fake.stream = a.handle
        third = allocator(4096)
        other = streampool.Stream(device=1)
        fake.stream = other.handle
        del fake.objects[a.handle], third
        gc.collect()
        assert stats.allocation_counts.current_bytes == 0
        assert allocators.failure_count() == failures, allocators.last_error()


@pytest.mark.nosim
@pytest.mark.parametrize("destroyed", [False, True])
def test_cupy_memory_of_an_external_stream_is_freed_after_its_work(
    fake_cupy: tuple[FakeCupy, object], destroyed: bool
) -> None:
    # `with cupy.cuda.ExternalStream(torch_stream_ptr):` is how CuPy runs on PyTorch's
    # streams: the object goes with the block, the (non-blocking) stream stays, with the
    # kernel still on it. Freed on the current (legacy) stream, the block was handed out
    # again while that kernel could still write it. `destroyed`: the stream's owner has
    # destroyed it, the kernel still queued, before CuPy lets go of the memory, which
    # cannot be freed on it then.
    fake, module = fake_cupy
    allocator = module.streampool_cupy_allocator  # type: ignore[attr-defined]
    with SimulatedDevice(capacity_bytes="64MiB") as dev:
        streampool.set_current_device_resource(mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()))
        theirs = streampool.Stream()
        with fake.cuda.ExternalStream(theirs.handle):
            first = allocator(1 << 20)
            dev.write(theirs, first.ptr, 1 << 20, label="kernel on the external stream writes")
        if destroyed:
            del theirs
            gc.collect()
        failures = allocators.failure_count()
        del first
        gc.collect()
        assert allocators.failure_count() == failures, allocators.last_error()
        second = allocator(1 << 20)  # on the legacy default stream, current again
        dev.write(0, second.ptr, 1 << 20, label="kernel on the legacy stream writes")
        dev.run()
        assert dev.races() == []
        del second


@pytest.mark.nosim
def test_cupy_memory_of_a_per_thread_stream_let_go_on_another_thread_is_ordered(
    fake_cupy: tuple[FakeCupy, object],
) -> None:
    # With CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 every thread's current stream is handle 2,
    # its own: memory let go of on another thread was freed on that thread's stream.
    fake, module = fake_cupy
    allocator = module.streampool_cupy_allocator  # type: ignore[attr-defined]
    with SimulatedDevice(capacity_bytes="64MiB") as dev:
        streampool.set_current_device_resource(mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()))
        fake.stream = 2
        made, done, box = threading.Event(), threading.Event(), {}

        def allocating_thread() -> None:
            box["a"] = allocator(1 << 20)
            dev.write(2, box["a"].ptr, 1 << 20, label="thread A's kernel on its per-thread stream")
            made.set()
            done.wait(60)  # alive throughout

        thread = threading.Thread(target=allocating_thread)
        thread.start()
        made.wait(60)
        del box["a"]
        gc.collect()
        second = allocator(1 << 20)
        dev.write(2, second.ptr, 1 << 20, label="this thread's kernel on its per-thread stream")
        dev.run()
        done.set()
        thread.join()
        assert dev.races() == []
        del second


def test_cupy_memory_is_freed_through_the_resource_that_made_it(
    fake_cupy: tuple[FakeCupy, object], stats: mr.StatisticsResourceAdaptor
) -> None:
    _, module = fake_cupy
    pointer = module.streampool_cupy_allocator(1 << 20)  # type: ignore[attr-defined]
    other = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    streampool.set_current_device_resource(other)
    del pointer
    assert stats.allocation_counts.current_bytes == 0
    assert other.allocation_counts.total_count == 0


def test_cupy_allocator_zero_bytes_and_out_of_memory(
    fake_cupy: tuple[FakeCupy, object], stats: mr.StatisticsResourceAdaptor
) -> None:
    _, module = fake_cupy
    allocator = module.streampool_cupy_allocator  # type: ignore[attr-defined]
    empty = allocator(0)
    assert (empty.ptr, empty.mem.owner) == (0, None)
    assert stats.allocation_counts.total_count == 0
    limited = mr.LimitingResourceAdaptor(stats, 1 << 20)
    streampool.set_current_device_resource(limited)
    held = allocator(1 << 19)
    with pytest.raises(streampool.OutOfMemoryError):
        allocator(1 << 20)
    del held
    again = allocator(1 << 20)  # the resource is still usable
    assert stats.allocation_counts.current_bytes == 1 << 20
    del again
    assert stats.allocation_counts.current_bytes == 0


def test_cupy_allocator_bad_input(fake_cupy: tuple[FakeCupy, object]) -> None:
    fake, module = fake_cupy
    with pytest.raises(TypeError, match="get_current_stream_ptr capsule"):
        streampool._native.CupyAllocator(
            fake.cuda.UnownedMemory, fake.cuda.MemoryPointer, fake.cuda.get_current_stream, object()
        )
    fake.stream = 0x3039  # a handle that names no stream
    with pytest.raises(streampool.InvalidStreamError, match="0x3039"):
        module.streampool_cupy_allocator(64)  # type: ignore[attr-defined]
    with pytest.raises(OverflowError):
        module.streampool_cupy_allocator(-1)  # type: ignore[attr-defined]
    fake.stream = 0
    assert module.streampool_cupy_allocator(64).ptr != 0  # type: ignore[attr-defined]  # still usable


def test_cupy_use_sets_the_allocator(
    fake_cupy: tuple[FakeCupy, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, module = fake_cupy
    before = fake.allocator
    # On the simulated device its memory is host memory: CuPy is left alone.
    assert module.use() == allocators.SIMULATED  # type: ignore[attr-defined]
    assert fake.allocator is before
    monkeypatch.setattr(streampool._native, "using_simulated_device", lambda: False)
    assert "set_allocator" in module.use()  # type: ignore[attr-defined]
    assert fake.allocator is module.streampool_cupy_allocator  # type: ignore[attr-defined]


def test_use_everywhere_skips_a_stand_in_module_without_a_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    # Test suites and doc builds put bare modules in sys.modules: find_spec raises ValueError.
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    assert allocators.use_everywhere()["cupy"] == "skipped: cupy is not installed"


def test_cupy_allocator_threads_streams_and_the_gil(
    fake_cupy: tuple[FakeCupy, object], sim: SimulatedDevice
) -> None:
    """Threads, each on a CuPy stream of its own, allocate through the sharded pool and free
    on another thread's stream: the fast path keeps the GIL, nothing overlaps, and the race
    detector (the fixture's simulated device) sees every reuse ordered."""
    fake, module = fake_cupy
    allocator = module.streampool_cupy_allocator  # type: ignore[attr-defined]
    pool = mr.ShardedPoolMemoryResource(streampool.get_current_device_resource())
    stats = mr.StatisticsResourceAdaptor(pool)
    streampool.set_current_device_resource(stats)
    streams = [streampool.Stream() for _ in range(4)]
    handed: list[object] = []
    lock = threading.Lock()
    fast_before = streampool._native._fast_path_calls()

    def work(t: int) -> None:
        fake.streams[threading.get_ident()] = streams[t].handle
        live = []
        for i in range(300):
            pointer = allocator(256 + 64 * ((i * 7 + t) % 50))
            sim.write(streams[t], pointer.ptr, pointer.mem.size, f"thread {t}")
            live.append(pointer)
            if len(live) > 8:
                first = live.pop(0)
                if i % 3 == 0:
                    # Another thread lets go of it, on its own stream: this stream's work on
                    # it is ordered before (as a CuPy program must, with any of CuPy's pools).
                    streams[t].synchronize()
                    with lock:
                        handed.append(first)
                else:
                    del first
            with lock:
                if handed and i % 5 == 0:
                    handed.pop()
        live.clear()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    handed.clear()
    gc.collect()
    sim.run()
    assert stats.allocation_counts.current_bytes == 0
    assert stats.allocation_counts.total_count == 1200
    assert streampool._native._fast_path_calls() - fast_before >= 600


# ---------------------------------------------------------------------------------------
# RMM (cuDF) sharing streampool's driver pool, over stand-ins for RMM and cuda.bindings


@pytest.fixture
def fake_rmm(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, object]]:
    """Stand-ins for ``rmm``, ``rmm.mr`` and ``cuda.bindings.driver`` in sys.modules, and
    streampool.allocators.rmm imported over them."""
    import types

    mr_module: Any = types.ModuleType("rmm.mr")

    class CudaMemoryResource:
        pass

    class PoolMemoryResource:
        pass

    class CudaAsyncViewMemoryResource:
        def __init__(self, pool_handle: Any) -> None:
            assert isinstance(pool_handle, CUmemoryPool)  # the handle type RMM requires
            self.handle = int(pool_handle)

    class CUmemoryPool:
        def __init__(self, value: int) -> None:
            self.value = value

        def __int__(self) -> int:
            return self.value

    resources: dict[int, Any] = {}
    mr_module.CudaMemoryResource = CudaMemoryResource
    mr_module.PoolMemoryResource = PoolMemoryResource
    mr_module.CudaAsyncViewMemoryResource = CudaAsyncViewMemoryResource
    mr_module.get_per_device_resource = lambda device: resources.setdefault(device, CudaMemoryResource())
    mr_module.set_per_device_resource = resources.__setitem__
    rmm_module: Any = types.ModuleType("rmm")
    rmm_module.mr = mr_module
    driver: Any = types.ModuleType("cuda.bindings.driver")
    driver.CUmemoryPool = CUmemoryPool
    bindings: Any = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    cuda: Any = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in [
        ("rmm", rmm_module),
        ("rmm.mr", mr_module),
        ("cuda", cuda),
        ("cuda.bindings", bindings),
        ("cuda.bindings.driver", driver),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "streampool.allocators.rmm", raising=False)
    # The simulated device's pools stand in for the GPU's here (RMM is a stand-in too).
    monkeypatch.setattr(streampool._native, "using_simulated_device", lambda: False)
    yield mr_module, importlib.import_module("streampool.allocators.rmm")
    sys.modules.pop("streampool.allocators.rmm", None)


def test_rmm_shares_the_default_resources_driver_pool(fake_rmm: tuple[Any, object]) -> None:
    rmm_mr, module = fake_rmm
    handle = module.pool_handle()  # type: ignore[attr-defined]
    assert handle == int(streampool.mr.CudaAsyncMemoryResource().pool_handle) != 0
    assert handle == int(streampool.get_current_device_resource().pool_handle)  # type: ignore[attr-defined]
    done = module.use()  # type: ignore[attr-defined]
    assert done.startswith("rmm.mr.set_per_device_resource(0, CudaAsyncViewMemoryResource(pool ")
    view = rmm_mr.get_per_device_resource(0)
    assert isinstance(view, rmm_mr.CudaAsyncViewMemoryResource) and view.handle == handle
    assert module.use().startswith("left as it is")  # type: ignore[attr-defined]


def test_rmm_keeps_a_resource_the_program_set(fake_rmm: tuple[Any, object]) -> None:
    rmm_mr, module = fake_rmm
    chosen = rmm_mr.PoolMemoryResource()
    rmm_mr.set_per_device_resource(0, chosen)
    done = module.use()  # type: ignore[attr-defined]
    assert "already PoolMemoryResource" in done and "replace=True" in done
    assert rmm_mr.get_per_device_resource(0) is chosen
    module.use(replace=True)  # type: ignore[attr-defined]
    assert isinstance(rmm_mr.get_per_device_resource(0), rmm_mr.CudaAsyncViewMemoryResource)
    with pytest.raises(streampool.InvalidArgumentError, match="device 5 does not exist"):
        module.use(5)  # type: ignore[attr-defined]
    assert module.use(replace=True).startswith("rmm.mr.set_per_device_resource(0, ")  # type: ignore[attr-defined]


def test_gpu_libraries_are_left_alone_on_the_simulated_device(
    monkeypatch: pytest.MonkeyPatch, fake_rmm: tuple[Any, object]
) -> None:
    """The simulated device's memory is host memory: no GPU library is pointed at it."""
    rmm_mr, module = fake_rmm
    monkeypatch.setattr(streampool._native, "using_simulated_device", lambda: True)
    assert module.use().startswith("skipped: streampool runs on the simulated device")  # type: ignore[attr-defined]
    assert type(rmm_mr.get_per_device_resource(0)) is rmm_mr.CudaMemoryResource
    monkeypatch.setattr(allocators.importlib.util, "find_spec", lambda name: object())
    done = allocators.use_everywhere()
    assert set(done) == {"torch", "cupy", "numba", "rmm"}
    assert all(what.startswith("skipped: streampool runs on the simulated device") for what in done.values())


# --- PyTorch's memory statistics (streampool_alloc_cxx / streampool_free_cxx) -------------

ALLOC_CXX = getattr(LIB, allocators.CXX_ALLOC_FUNCTION)
ALLOC_CXX.restype, ALLOC_CXX.argtypes = ALLOC.restype, ALLOC.argtypes
FREE_CXX = getattr(LIB, allocators.FREE_CXX_FUNCTION)
FREE_CXX.restype, FREE_CXX.argtypes = FREE.restype, FREE.argtypes

# What torch.cuda.memory_summary() reads of torch.cuda.memory_stats() (PyTorch 2.x).
SUMMARY_STATS = [
    f"{metric}.{pool}.{field}"
    for metric in (
        "allocated_bytes",
        "active_bytes",
        "requested_bytes",
        "reserved_bytes",
        "inactive_split_bytes",
        "allocation",
        "active",
        "segment",
        "inactive_split",
    )
    for pool in ("all", "large_pool", "small_pool")
    for field in ("current", "peak", "allocated", "freed")
] + [
    *(
        f"{metric}.{field}"
        for metric in ("oversize_allocations", "oversize_segments")
        for field in ("current", "peak")
    ),
    "num_ooms",
    "num_alloc_retries",
]


def flattened(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """torch.cuda.memory_stats()'s flattening of the nested form."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def stat(current: int, peak: int, allocated: int, freed: int) -> dict[str, int]:
    """One of PyTorch's statistics, as memory_stats_as_nested_dict() gives it."""
    return {"current": current, "peak": peak, "allocated": allocated, "freed": freed}


def test_the_cxx_pair_keeps_pytorchs_memory_statistics(
    stats: mr.StatisticsResourceAdaptor, cxx_call: Any
) -> None:
    sp_torch = importlib.import_module("streampool.allocators.torch")
    sp_torch.reset_accumulated_memory_stats()
    sp_torch.reset_peak_memory_stats(0)
    before = sp_torch.memory_stats("cuda:0")
    live, count = before["allocated_bytes"]["all"]["current"], before["allocation"]["all"]["current"]
    assert before["allocated_bytes"]["all"] == stat(live, live, 0, 0)
    a, b = ALLOC_CXX(1000, 0, None), ALLOC_CXX(3000, 0, None)
    FREE_CXX(a, 1000, 0, None)
    # Frees the resource refuses count nothing: a double free, a pointer inside an
    # allocation, a size no allocation has.
    failures = allocators.failure_count()
    for pointer, size in ((a, 1000), (b + 256, 3000), (b, 1 << 63)):
        FREE_CXX(pointer, size, 0, None)
    assert allocators.failure_count() == failures + 3
    now = sp_torch.memory_stats()
    assert now["allocated_bytes"]["all"] == stat(live + 3000, live + 4000, 4000, 1000)
    assert now["allocation"]["all"] == stat(count + 1, count + 2, 2, 1)
    assert now["active_bytes"] == now["requested_bytes"] == now["allocated_bytes"]
    assert (now["num_device_alloc"], now["num_device_free"]) == (2, 1)
    # What the resource holds from its upstream (here the statistics adaptor's driver pool).
    reserved = now["reserved_bytes"]["all"]
    assert (
        reserved["current"] >= stats.allocation_counts.current_bytes > 0
        and reserved["peak"] >= reserved["current"]
    )
    # Out of memory is counted; the peaks and the totals reset as PyTorch's do.
    assert cxx_call(1 << 40)[0] == 1
    assert sp_torch.memory_stats()["num_ooms"] == 1
    sp_torch.reset_peak_memory_stats()
    assert sp_torch.memory_stats()["allocated_bytes"]["all"]["peak"] == live + 3000
    sp_torch.reset_accumulated_memory_stats()
    after = sp_torch.memory_stats()
    assert after["allocated_bytes"]["all"] == stat(live + 3000, live + 3000, 0, 0)
    assert after["num_ooms"] == 0
    FREE_CXX(b, 3000, 0, None)
    # The form torch.cuda.memory_stats() flattens and memory_summary() reads; only "all"
    # is filled, as PyTorch's cudaMallocAsync backend does.
    flat = flattened(sp_torch.memory_stats(torch_device(0)))
    assert set(SUMMARY_STATS) <= set(flat) and all(isinstance(v, int) for v in flat.values())
    assert flat["allocated_bytes.all.current"] == live and flat["allocated_bytes.large_pool.peak"] == 0
    # A device the machine does not have, or one that is not a CUDA device, is refused by
    # name, as PyTorch refuses it; the statistics are left as they were.
    for bad in (99, -1, "cuda:99", "cuda:x", "cuda:", "cpu", "cpu:0", torch_device(99), 1.5, True):
        with pytest.raises(streampool.InvalidArgumentError, match=r"streampool: .*CUDA device"):
            sp_torch.memory_stats(bad)
        with pytest.raises(streampool.InvalidArgumentError):
            sp_torch.reset_peak_memory_stats(bad)
    cpu = types.SimpleNamespace(type="cpu", index=None)
    with pytest.raises(streampool.InvalidArgumentError, match="namespace"):
        sp_torch.reset_accumulated_memory_stats(cpu)
    assert flattened(sp_torch.memory_stats("cuda"))["allocated_bytes.all.current"] == live


def torch_device(index: int) -> Any:
    """A stand-in for ``torch.device("cuda", index)``: what the statistics read of one."""
    return types.SimpleNamespace(type="cuda", index=index)


def test_use_makes_pytorchs_statistics_answer_from_streampool() -> None:
    sp_torch = importlib.import_module("streampool.allocators.torch")

    def raising(device: int) -> None:
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    names = (
        "_cuda_memoryStats",
        "_cuda_resetPeakMemoryStats",
        "_cuda_resetAccumulatedMemoryStats",
        "_cuda_emptyCache",
    )
    torch_c = types.SimpleNamespace(**dict.fromkeys(names, raising))
    assert sp_torch._answer_memory_stats(torch_c)
    assert (
        torch_c._cuda_memoryStats is sp_torch.memory_stats
        and torch_c._cuda_emptyCache is sp_torch._empty_cache_of_torch
    )
    assert torch_c._cuda_memoryStats(0)["allocation"]["all"]["current"] >= 0  # as torch.cuda calls it
    torch_c._cuda_resetPeakMemoryStats(0)
    torch_c._cuda_resetAccumulatedMemoryStats(0)
    # A PyTorch without one of them is left as it is.
    partial = types.SimpleNamespace(_cuda_memoryStats=raising)
    assert not sp_torch._answer_memory_stats(partial) and partial._cuda_memoryStats is raising


def test_use_makes_torch_compiles_graph_trees_say_why_they_cannot_run() -> None:
    """Under a pluggable allocator PyTorch's CUDA graph trees fail at their first pool
    check ("pluggable does not yet support checkPoolLiveAllocations"); the functions they
    call then raise an error that says why and what works instead."""
    sp_torch = importlib.import_module("streampool.allocators.torch")

    def raising(*args: object) -> None:
        raise RuntimeError("pluggable does not yet support checkPoolLiveAllocations")

    names = ("_cuda_checkPoolLiveAllocations", "_cuda_getCheckpointState", "_cuda_setCheckpointPoolState")
    torch_c = types.SimpleNamespace(**dict.fromkeys(names, raising), _cuda_emptyCache=raising)
    assert sp_torch._refuse_graph_trees(torch_c)
    for name in names:
        with pytest.raises(RuntimeError, match="max-autotune-no-cudagraphs") as e:
            getattr(torch_c, name)(0, (1, 2), set())  # as cudagraph_trees calls it
        assert "torch.cuda.graph" in str(e.value) and "reduce-overhead" in str(e.value)
    assert torch_c._cuda_emptyCache is raising  # nothing else replaced
    # A PyTorch without them is left as it is.
    assert not sp_torch._refuse_graph_trees(types.SimpleNamespace(_cuda_emptyCache=raising))


def test_use_again_with_memory_stats_makes_the_statistics_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    sp_torch = importlib.import_module("streampool.allocators.torch")

    def raising(device: int) -> None:
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    names = list(sp_torch._STATS_FUNCTIONS)
    torch_c = types.SimpleNamespace(**dict.fromkeys(names, raising))
    # After use(memory_stats=False): streampool allocates, PyTorch's statistics raise.
    monkeypatch.setattr(sp_torch, "torch", types.SimpleNamespace(_C=torch_c))
    monkeypatch.setattr(sp_torch, "_need_torch", lambda: None)
    monkeypatch.setattr(sp_torch, "_IN_USE", True)
    assert sp_torch.use(memory_stats=False) == "already allocating through streampool"
    assert torch_c._cuda_memoryStats is raising
    said = sp_torch.use()
    assert said.startswith("already allocating through streampool; torch.cuda.memory_stats() and the")
    assert torch_c._cuda_memoryStats is sp_torch.memory_stats
    assert sp_torch.use() == "already allocating through streampool"  # nothing more to do
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="memory_stats must be True or False"):
            sp_torch.use(memory_stats=bad)


def test_empty_cache_hands_back_what_the_resources_hold_free(sim: SimulatedDevice) -> None:
    """torch.cuda.empty_cache() after use(): down the current resource's chain, a pool gives
    back its free chunks and the driver's pool beneath is trimmed to what is in use."""
    sp_torch = importlib.import_module("streampool.allocators.torch")
    top = mr.CudaAsyncMemoryResource()
    pool = mr.ShardedPoolMemoryResource(top)
    stats = mr.StatisticsResourceAdaptor(pool)
    stream = streampool.Stream()
    ptrs = [stats.allocate(4 << 20, stream) for _ in range(8)]
    kept = ptrs.pop()
    for ptr in ptrs:
        stats.deallocate(ptr, 4 << 20, stream)
    held = pool.stats["reserved_bytes"]
    assert held >= 8 * (4 << 20) and top.reserved_bytes >= held
    synchronized: list[bool] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pool's advice to trim is taken, not shown
        sp_torch._hand_back(stats, lambda: synchronized.append(True))
    assert pool.stats["reserved_bytes"] < held and top.reserved_bytes == pool.stats["reserved_bytes"]
    assert synchronized == []  # the pool's release synchronised the device itself
    stats.deallocate(kept, 4 << 20, stream)
    with pytest.warns(UserWarning, match="trim_to"):  # what empty_cache takes care of
        pool.release()
    # The driver's pool alone: synchronised first, then trimmed.
    sp_torch._hand_back(top, lambda: synchronized.append(True))
    assert synchronized == [True] and top.reserved_bytes == 0


class CupysOutOfMemoryError(MemoryError):
    """CuPy's ``cupy.cuda.memory.OutOfMemoryError``, as CuPy defines it."""

    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        self._size, self._total, self._limit = size, total, limit
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")

    def __reduce__(self) -> tuple[type[CupysOutOfMemoryError], tuple[int, int, int]]:
        return (type(self), (self._size, self._total, self._limit))


def test_cupy_out_of_memory_is_cupys_error_too(
    monkeypatch: pytest.MonkeyPatch, stats: mr.StatisticsResourceAdaptor
) -> None:
    fake = FakeCupy()
    fake.cuda.memory = types.SimpleNamespace(OutOfMemoryError=CupysOutOfMemoryError)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delitem(sys.modules, "streampool.allocators.cupy", raising=False)
    module: Any = importlib.import_module("streampool.allocators.cupy")
    try:
        streampool.set_current_device_resource(mr.LimitingResourceAdaptor(stats, 1 << 20))
        with pytest.raises(CupysOutOfMemoryError) as raised:  # caught as CuPy's own pools' error
            module.streampool_cupy_allocator(2 << 20)
        error = raised.value
        assert isinstance(error, streampool.OutOfMemoryError) and type(error) is module.OutOfMemoryError
        assert (error.requested, error.available) == (2 << 20, 1 << 20)
        assert str(error).startswith("out of memory: LimitingResourceAdaptor") and "2097152" in str(error)
        assert error._size == 2 << 20  # what CuPy's error keeps
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is module.OutOfMemoryError and (str(copy), copy.requested) == (str(error), 2 << 20)
        # Any other error stays as it was.
        fake.stream = 0x3039
        with pytest.raises(streampool.InvalidStreamError):
            module.streampool_cupy_allocator(16)
        fake.stream = 0
        held = module.streampool_cupy_allocator(1 << 19)  # the resource is still usable
        assert stats.allocation_counts.current_bytes == 1 << 19
        del held
        # Only a subclass of streampool's OutOfMemoryError may be given.
        with pytest.raises(
            TypeError, match=r"subclass of streampool\.OutOfMemoryError, not CupysOutOfMemoryError"
        ):
            streampool._native.CupyAllocator(
                fake.cuda.UnownedMemory,
                fake.cuda.MemoryPointer,
                fake.cuda.get_current_stream,
                None,
                None,
                CupysOutOfMemoryError,
            )
    finally:
        sys.modules.pop("streampool.allocators.cupy", None)
        gc.collect()
