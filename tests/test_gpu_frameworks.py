"""On a real GPU (STREAMPOOL_GPU_TESTS=1): PyTorch, CuPy and Numba allocating through
streampool, one driver pool shared by the three, and DLPack round trips with data checks.

PyTorch's allocator is fixed once PyTorch has allocated, so every PyTorch allocator test
runs in a fresh interpreter (the suite's own process has used PyTorch already)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import streampool
from streampool import mr

pytestmark = pytest.mark.gpu


def run_python(code: str, env: dict[str, str] | None = None) -> str:
    """Runs `code` in a fresh interpreter; fails with its output unless it exits with 0."""
    import os

    full_env = dict(os.environ, **(env or {}))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        env=full_env,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def streampool_command(*args: str) -> subprocess.CompletedProcess[str]:
    """The `streampool` command, with this interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "streampool", *args], capture_output=True, text=True, timeout=300
    )


def run_under_use(answer: str, code: str) -> str:
    """Runs `code` in a fresh interpreter after ``sp_torch.use()``, whose answer must contain
    `answer`, and ``import torch``."""
    prologue = "from streampool.allocators import torch as sp_torch\n"
    prologue += f"said = sp_torch.use()\nassert {answer!r} in said, said\nimport torch\n"
    return run_python(prologue + textwrap.dedent(code))


def test_torch_tensors_come_from_streampool_and_are_right_on_many_streams() -> None:
    pytest.importorskip("torch")
    out = run_python(
        """
        import threading
        import streampool
        from streampool import mr
        from streampool.allocators import torch as sp_torch

        pool = mr.ShardedPoolMemoryResource(streampool.get_current_device_resource())
        stats = mr.StatisticsResourceAdaptor(pool)
        streampool.set_current_device_resource(stats)
        print(sp_torch.use())
        assert sp_torch.use() == "already allocating through streampool"
        import torch

        x = torch.ones(1 << 20, device="cuda")               # 4 MiB through streampool
        assert stats.allocation_counts.current_bytes >= 4 << 20, stats.allocation_counts
        assert int(x.sum()) == 1 << 20
        del x
        torch.cuda.synchronize()

        wrong = []
        def work(t):
            stream = torch.cuda.Stream()
            other = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for i in range(200):
                    n = 1024 * (1 + (i * 7 + t) % 2048)
                    a = torch.full((n,), float(i + t), device="cuda")
                    b = a * 2 + 1
                    if i % 5 == 0:                            # handed to another stream
                        other.wait_stream(stream)
                        with torch.cuda.stream(other):
                            c = b + 1
                        b.record_stream(other)
                        stream.wait_stream(other)             # the free is ordered after other's use
                        if float(c[-1]) != 2.0 * (i + t) + 2.0:
                            wrong.append((t, i, "c"))
                        del c
                    if float(b[n // 2]) != 2.0 * (i + t) + 1.0:
                        wrong.append((t, i, "b"))
                    del a, b
            stream.synchronize()
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads: th.start()
        for th in threads: th.join()
        torch.cuda.synchronize()
        assert not wrong, wrong[:5]
        counts = stats.allocation_counts
        assert counts.total_count >= 8 * 200 * 2, counts
        assert counts.current_bytes == 0, counts
        assert streampool.allocators.failure_count() == 0, streampool.allocators.last_error()
        print("OK", counts)
        """
    )
    assert "OK" in out


def test_torch_out_of_memory_is_an_error_and_the_context_lives_on() -> None:
    # PyTorch's pluggable allocator does not check for NULL: streampool_alloc_cxx throws
    # PyTorch's own out-of-memory error, and PyTorch raises it as torch.OutOfMemoryError,
    # with streampool's message. The context is not poisoned: kernels run after it.
    pytest.importorskip("torch")
    out = run_under_use(
        "; out of memory raises torch.OutOfMemoryError;",
        """
        from streampool import allocators
        x = torch.ones(1 << 20, device="cuda")
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")   # 1 PiB
        except torch.cuda.OutOfMemoryError as e:
            message = str(e)
        else:
            raise AssertionError("a 1 PiB tensor was made")
        assert message.startswith("CUDA out of memory. streampool: streampool_alloc(size=1125899906842624"), message
        try:
            torch.empty(16, device="cuda:7" if torch.cuda.device_count() < 8 else "cuda:99")
        except torch.cuda.OutOfMemoryError as e:
            raise AssertionError(f"not out of memory: {e}")
        except RuntimeError:
            pass                                        # another failure: a RuntimeError
        assert "size=1125899906842624" in allocators.last_error()
        y = x * 2 + 1                                   # a kernel after the failure
        torch.cuda.synchronize()
        assert float(y.sum()) == 3.0 * (1 << 20)
        print("OK", message.splitlines()[0])
        """,
    )
    assert "OK" in out


def test_torch_memory_statistics_answer_under_streampool() -> None:
    # PyTorch's pluggable allocator keeps no statistics (torch.cuda.memory_stats() raises
    # under it); use() makes them answer from what streampool_alloc_cxx/free_cxx counted.
    pytest.importorskip("torch")
    out = run_under_use(
        "memory_stats() and the functions built on it answer from streampool's counts",
        """
        x = torch.empty(16, device="cuda")
        before = torch.cuda.memory_allocated()
        y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_allocated() == before + (1 << 20), torch.cuda.memory_stats()
        assert torch.cuda.max_memory_allocated() >= before + (1 << 20)
        del y
        assert torch.cuda.memory_allocated() == before
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == before
        assert torch.cuda.memory_reserved() >= before and torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
        assert torch.cuda.memory_stats()["num_ooms"] == 0
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            pass
        assert torch.cuda.memory_stats()["num_ooms"] == 1
        assert "PyTorch CUDA memory summary" in torch.cuda.memory_summary()
        z = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del z
        reserved = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()                        # the driver's pool trimmed
        assert torch.cuda.memory_reserved() < reserved, (reserved, torch.cuda.memory_reserved())
        print("OK")
        """,
    )
    assert "OK" in out


def test_torch_use_after_the_first_tensor_names_the_fix() -> None:
    pytest.importorskip("torch")
    out = run_python(
        """
        import torch
        from streampool.allocators import torch as sp_torch
        torch.ones(1, device="cuda")
        try:
            sp_torch.use()
        except RuntimeError as e:
            assert "before the first CUDA tensor" in str(e), e
            print("OK")
        """
    )
    assert "OK" in out


def test_torch_mem_pool_routes_a_region() -> None:
    torch = pytest.importorskip("torch")
    if not hasattr(torch.cuda, "MemPool"):
        pytest.skip("this PyTorch has no torch.cuda.MemPool")
    out = run_python(
        """
        import torch, streampool
        from streampool import mr
        from streampool.allocators import torch as sp_torch
        stats = mr.StatisticsResourceAdaptor(streampool.get_current_device_resource())
        streampool.set_current_device_resource(stats)
        outside = torch.ones(1 << 20, device="cuda")         # PyTorch's own allocator
        assert stats.allocation_counts.total_count == 0
        pool = sp_torch.mem_pool()
        with torch.cuda.use_mem_pool(pool):
            inside = torch.ones(1 << 20, device="cuda")
        assert stats.allocation_counts.total_count >= 1, stats.allocation_counts
        assert int(inside.sum()) == 1 << 20 and int(outside.sum()) == 1 << 20
        # A failure in the pool is PyTorch's own out-of-memory error, and the device lives on.
        # PyTorch frees what it caches and tries again: no attempt is said on stderr.
        import os, tempfile
        from streampool import allocators
        said, stderr = tempfile.TemporaryFile(), os.dup(2)
        os.dup2(said.fileno(), 2)
        with torch.cuda.use_mem_pool(pool):
            try:
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")   # 1 PiB
            except torch.cuda.OutOfMemoryError:
                pass
            else:
                raise AssertionError("a 1 PiB tensor was made")
            again = torch.ones(1 << 20, device="cuda")
        os.dup2(stderr, 2)
        said.seek(0)
        assert b"streampool" not in said.read()
        assert "out of memory" in allocators.last_error()   # recorded all the same
        assert int(again.sum()) == 1 << 20
        print("OK")
        """
    )
    assert "OK" in out


# CUDA graphs: what a capture allocates through streampool is graph memory of the driver's
# pool (docs/frameworks.md, "CUDA graphs"). Each case captures a graph with an intermediate
# freed in the capture and an output that lives on, allocates eight tensors after the
# capture (which must not share the graph's memory), then replays and checks all of them.
_TORCH_GRAPH = """
    import streampool
    from streampool import mr
    from streampool.allocators import torch as sp_torch
    RESOURCE
    said = sp_torch.use()
    assert "CUDA graph captures are announced" in said, said
    import torch
    x = torch.randn(1 << 20, device="cuda")
    before = torch.ones(1 << 18, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            y = x * 2 + 1
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="MODE"):
        del before  # memory from before the capture, freed first thing during it
        tmp = x * 2
        y = tmp + 1
        del tmp
    # A second capture on another stream, while the first one's put-off free waits.
    later = torch.ones(1 << 18, device="cuda")
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=torch.cuda.Stream(), capture_error_mode="MODE"):
        del later
        z = x * 3
    others = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]
    for value in (1.0, 2.0, 3.0):
        x.fill_(value)
        g.replay()
        g2.replay()
        torch.cuda.synchronize()
        assert bool((y == 2 * value + 1).all()), value
        assert bool((z == 3 * value).all()), value
        assert all(bool((o == 7.0).all()) for o in others)
    del g, y, g2, z
    w = torch.ones(1 << 22, device="cuda")
    torch.cuda.synchronize()
    assert float(w.sum()) == 1 << 22
    from streampool import allocators
    print("failures", allocators.failure_count(), allocators.last_error())
"""


@pytest.mark.parametrize(
    "resource",
    [
        "pass  # the default: the device's driver pool",
        "streampool.set_current_device_resource(mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource()))",
        "streampool.set_current_device_resource(mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()))",
    ],
    ids=["async", "stats-async", "pool-async"],
)
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_torch_captures_and_replays_a_cuda_graph(resource: str, mode: str) -> None:
    pytest.importorskip("torch")
    out = run_python(_TORCH_GRAPH.replace("RESOURCE", resource).replace("MODE", mode))
    assert "failures 0" in out, out


_TORCH_COMPILE = """
    import streampool
    from streampool import mr
    from streampool.allocators import torch as sp_torch
    RESOURCE
    said = sp_torch.use()
    assert "CUDA graph captures are announced" in said, said
    import torch

    def step(x, w):
        h = torch.relu(x @ w)  # an intermediate
        return h * 2 + 1

    w = torch.randn(256, 256, device="cuda")
    # CUDA graph trees: refused, saying why and what works instead.
    try:
        torch.compile(step, mode="reduce-overhead")(torch.randn(64, 256, device="cuda"), w)
    except Exception as e:
        assert "max-autotune-no-cudagraphs" in str(e), repr(e)
        print("graph trees refused")
    # The default mode (Inductor's kernels, no graphs), with a recompilation for a shape.
    compiled = torch.compile(step)
    for n in (64, 64, 128, 128, 64):
        x = torch.randn(n, 256, device="cuda")
        torch.testing.assert_close(compiled(x, w), torch.relu(x @ w) * 2 + 1)
    # torch.cuda.make_graphed_callables: a forward and a backward graph, trained.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).cuda()
    reference = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).cuda()
    reference.load_state_dict(model.state_dict())
    sample = torch.randn(32, 64, device="cuda", requires_grad=False)
    graphed = torch.cuda.make_graphed_callables(model, (sample,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    kept = []
    for i in range(5):
        x, target = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
        for net, o in ((graphed, opt), (reference, ref_opt)):
            o.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(x), target)
            loss.backward()
            o.step()
        kept.append(torch.full((1 << 18,), float(i), device="cuda"))
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert all(bool((k == i).all()) for i, k in enumerate(kept))
    from streampool import allocators
    print("failures", allocators.failure_count(), allocators.last_error())
"""


@pytest.mark.parametrize(
    "resource",
    [
        "pass  # the default: the device's driver pool",
        "streampool.set_current_device_resource(mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()))",
    ],
    ids=["async", "pool-async"],
)
def test_torch_compile_and_graphed_callables_through_streampool(resource: str) -> None:
    """`torch.compile`'s default mode runs on streampool's memory; its CUDA graph trees
    (`mode="reduce-overhead"`) need PyTorch's own allocator and are refused, saying what
    works instead; `torch.cuda.make_graphed_callables` captures a forward and a backward
    graph that train as the eager model does."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    out = run_python(_TORCH_COMPILE.replace("RESOURCE", resource))
    assert "graph trees refused" in out and "failures 0" in out, out


def test_frees_in_a_use_mem_pool_region_do_not_wait_for_its_end() -> None:
    """PyTorch calls the pool hooks around a `torch.cuda.use_mem_pool` region as around a
    capture; the region announces nothing, so what is freed in it is freed at once."""
    pytest.importorskip("torch")
    out = run_python(
        """
        import streampool
        from streampool import mr
        from streampool.allocators import torch as sp_torch
        stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
        streampool.set_current_device_resource(stats)
        sp_torch.use()
        import torch
        try:
            pool = torch.cuda.MemPool()
        except RuntimeError as e:
            print("no MemPool under a pluggable allocator:", e)
            raise SystemExit(0)
        most = 0
        with torch.cuda.use_mem_pool(pool):
            for _ in range(20):
                t = torch.ones(1 << 24, device="cuda")  # 64 MiB
                del t
                most = max(most, stats.allocation_counts.current_bytes)
        print("most live", most)
        """
    )
    if "no MemPool" in out:
        pytest.skip(out.strip())
    assert "most live " in out and int(out.split("most live ")[1].split()[0]) <= 2 << 26, out


def test_torch_capture_on_a_resource_that_cannot_serve_it_is_a_clear_error() -> None:
    pytest.importorskip("torch")
    out = run_python(
        """
        import streampool
        from streampool import mr
        from streampool.allocators import torch as sp_torch
        streampool.set_current_device_resource(
            mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), block_size=1 << 22))
        sp_torch.use()
        import torch
        x = torch.ones(1 << 10, device="cuda")
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                y = x * 2
        except RuntimeError as e:
            print("refused:", e)
        z = torch.ones(1 << 10, device="cuda") * 3  # the process goes on
        assert float(z.sum()) == 3 << 10
        """
    )
    assert "refused:" in out and "capturing a CUDA graph" in out, out


@pytest.mark.parametrize("resource", [mr.CudaAsyncMemoryResource, "pool"])
def test_cupy_captures_and_launches_a_cuda_graph(resource: object) -> None:
    pytest.importorskip("cupy")
    out = run_python(
        f"""
        import streampool
        from streampool import mr
        from streampool.allocators import cupy as sp_cupy
        if {resource == "pool"!r}:
            streampool.set_current_device_resource(mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource()))
        sp_cupy.use()
        import cupy as cp
        x = cp.ones(1 << 20, dtype=cp.float32)
        before = cp.ones(1 << 18, dtype=cp.float32)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            before *= 2
            s.begin_capture()  # CuPy's default: relaxed mode
            tmp = x * 2
            y = tmp + 1
            del tmp, before
            g = s.end_capture()
        others = [cp.full((1 << 20,), 7.0, dtype=cp.float32) for _ in range(8)]
        x.fill(1.0)
        cp.cuda.Device().synchronize()
        g.launch(s)
        s.synchronize()
        assert bool((y == 3.0).all()) and all(bool((o == 7.0).all()) for o in others)
        # CuPy instantiates without auto-free on launch: y's graph memory is freed before
        # the graph is launched again (the driver's rule).
        del y
        cp.cuda.Device().synchronize()
        from streampool import allocators
        print("failures", allocators.failure_count(), allocators.last_error())
        """
    )
    assert "failures 0" in out, out


def test_cupy_arrays_come_from_streampool() -> None:
    cupy = pytest.importorskip("cupy")
    from streampool.allocators import cupy as sp_cupy

    stats = mr.StatisticsResourceAdaptor(streampool.get_current_device_resource())
    lines: list[str] = []
    previous = streampool.set_current_device_resource(mr.LoggingResourceAdaptor(stats, callback=lines.append))
    old_allocator = cupy.cuda.get_allocator()
    try:
        assert sp_cupy.rmm_cupy_allocator is sp_cupy.streampool_cupy_allocator
        # CuPy's current stream is read through its C function, not through Python.
        assert sp_cupy.streampool_cupy_allocator.native_stream_lookup
        sp_cupy.use()
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            a = cupy.arange(1 << 20, dtype=cupy.int64)
            assert stats.allocation_counts.current_bytes >= 8 << 20
            made = [e for e in streampool.logs.parse_log("\n".join(lines)) if e.action == "allocate"]
            assert any(e.size >= 8 << 20 and e.stream == stream.ptr for e in made), made
            assert int((a * 2).sum()) == (1 << 20) * ((1 << 20) - 1)
        # Freed on the stream it was allocated on, though the null stream is current now.
        ptr = a.data.ptr
        del a
        frees = [
            e for e in streampool.logs.parse_log("\n".join(lines)) if e.action == "free" and e.ptr == ptr
        ]
        assert [e.stream for e in frees] == [stream.ptr], frees
        stream.synchronize()
        errors: list[BaseException] = []

        def work() -> None:
            try:
                with cupy.cuda.Stream(non_blocking=True) as s:
                    for i in range(100):
                        b = cupy.full(1000 + i, i, dtype=cupy.int32)
                        assert int(b.sum()) == i * (1000 + i)
                    s.synchronize()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors[0]
        gc.collect()
        stream.synchronize()
        assert stats.allocation_counts.current_bytes == 0
    finally:
        cupy.cuda.set_allocator(old_allocator)
        streampool.set_current_device_resource(previous)


def test_cupy_out_of_memory_is_cupys_error() -> None:
    cupy = pytest.importorskip("cupy")
    from streampool.allocators import cupy as sp_cupy

    old_allocator = cupy.cuda.get_allocator()
    try:
        sp_cupy.use()
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as raised:
            cupy.empty(1 << 50, dtype=cupy.uint8)  # 1 PiB
        assert (
            isinstance(raised.value, streampool.OutOfMemoryError) and (raised.value.requested or 0) >= 1 << 50
        )
        assert int(cupy.arange(10).sum()) == 45  # the device is still usable
    finally:
        cupy.cuda.set_allocator(old_allocator)


def test_numba_kernels_run_on_streampool_memory() -> None:
    pytest.importorskip("numba")
    out = run_python(
        """
        import numpy as np, streampool
        from streampool import mr
        stats = mr.StatisticsResourceAdaptor(streampool.get_current_device_resource())
        streampool.set_current_device_resource(stats)
        from numba import cuda
        from numba.cuda.cudadrv import driver

        # Device arrays and copies between them, no JIT kernel: what is tested is where the
        # memory comes from (a numba-cuda that cannot compile against the installed NumPy
        # still allocates).
        d = cuda.to_device(np.arange(1 << 16, dtype=np.float32))
        assert driver._memory_manager.__name__ == "StreampoolNumbaManager", driver._memory_manager
        assert stats.allocation_counts.current_bytes >= 4 << 16, stats.allocation_counts
        e = cuda.device_array_like(d)
        assert stats.allocation_counts.current_bytes >= 8 << 16, stats.allocation_counts
        e.copy_to_device(d)
        assert (e.copy_to_host() == np.arange(1 << 16, dtype=np.float32)).all()
        free, total = cuda.current_context().get_memory_info()
        assert 0 < free <= total
        del d, e
        import gc; gc.collect()
        cuda.synchronize()
        assert stats.allocation_counts.current_bytes == 0, stats.allocation_counts
        print("OK")
        """,
        env={"NUMBA_CUDA_MEMORY_MANAGER": "streampool.allocators.numba"},
    )
    assert "OK" in out


def test_an_unknown_numba_memory_manager_is_numbas_clear_error() -> None:
    pytest.importorskip("numba")
    out = run_python(
        """
        from numba import cuda
        try:
            cuda.device_array(10)
        except Exception as e:
            assert "streampool.allocators.nonesuch" in str(e), e
            print("OK")
        """,
        env={"NUMBA_CUDA_MEMORY_MANAGER": "streampool.allocators.nonesuch"},
    )
    assert "OK" in out


def test_use_everywhere_configures_every_installed_library() -> None:
    pytest.importorskip("torch")
    out = run_python(
        """
        import streampool
        from streampool import allocators
        done = allocators.use_everywhere(verbose=True)
        import torch
        stats = streampool.mr.StatisticsResourceAdaptor(streampool.get_current_device_resource())
        streampool.set_current_device_resource(stats)
        t = torch.ones(1 << 20, device="cuda")
        assert stats.allocation_counts.current_bytes >= 4 << 20
        for name, what in done.items():
            assert not what.startswith("skipped") or "not installed" in what, (name, what)
        print("OK")
        """
    )
    assert "OK" in out and "streampool.allocators: torch:" in out


def test_profile_logs_what_an_unchanged_torch_program_allocates(tmp_path: Path) -> None:
    """`streampool profile` routes PyTorch at its first CUDA use: the program, which never
    names streampool, has its tensors logged, and still forks a child that uses CUDA
    (routing touched no device before); recommend's code routes PyTorch too."""
    pytest.importorskip("torch")
    program = tmp_path / "prog.py"
    program.write_text(
        textwrap.dedent(
            """
            import os
            import torch
            pid = os.fork()
            if pid == 0:  # CUDA is usable in a child forked before the parent's first use
                os._exit(0 if torch.ones(8, device="cuda").sum().item() == 8 else 3)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                kept = [torch.ones(1 << 16, device="cuda") for _ in range(50)]
                del kept[::2]
            torch.cuda.synchronize()
            print("done", torch.cuda.memory_allocated() > 0)
            """
        )
    )
    log = tmp_path / "app.log"
    done = streampool_command("profile", "-o", str(log), "--", sys.executable, str(program))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["done", "True"]
    assert "PyTorch allocated through the logged resource" in done.stderr
    events = log.read_text().splitlines()[1:]
    assert len(events) >= 50, done.stderr  # the tensors of the parent (the child is not logged)
    rec = streampool_command("recommend", "--quick", "--json", "--", sys.executable, str(program))
    assert rec.returncode == 0, rec.stderr
    import json

    assert "allocators.use_on_import('torch')" in json.loads(rec.stdout)["recommendation"]["code"]


def test_profile_says_when_a_program_replaces_cupys_routed_allocator(tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    program = tmp_path / "prog.py"
    program.write_text(
        "import cupy\n"
        "a = cupy.ones(1 << 16)  # through the logged resource\n"
        "cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)  # the program's own from here\n"
        "b = cupy.ones(1 << 16)\n"
        "print(int(a.sum() + b.sum()))\n"
    )
    done = streampool_command("profile", "-o", str(tmp_path / "app.log"), "--", sys.executable, str(program))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(2 << 16)]
    assert (
        "not all of what CuPy allocated is logged: replaced: the program set its own allocator" in done.stderr
    )


def test_rmm_allocates_from_streampools_driver_pool() -> None:
    """RMM (cuDF's allocator), after streampool.allocators.rmm.use(), allocates from the
    driver pool of streampool's default resource, and the memory reads back right."""
    pytest.importorskip("rmm")
    out = run_python(
        """
        import rmm
        import streampool
        from streampool.allocators import rmm as sp_rmm
        print(sp_rmm.use())
        data = bytes(range(256)) * 4096
        buf = rmm.DeviceBuffer.to_device(data)
        ours = streampool.DeviceBuffer(size=1 << 20)
        pools = {streampool.pointer_pool(p) for p in (buf.ptr, ours.ptr)}
        assert pools == {sp_rmm.pool_handle()}, pools
        assert bytes(buf.copy_to_host()) == data
        assert sp_rmm.use().startswith("left as it is")
        print("OK")
        """
    )
    assert "OK" in out and "CudaAsyncViewMemoryResource" in out


def test_one_pool_across_libraries() -> None:
    """streampool's default resource, PyTorch's cudaMallocAsync backend and CuPy's
    MemoryAsyncPool allocate from the same driver pool: the device's current pool."""
    pytest.importorskip("torch")
    pytest.importorskip("cupy")
    out = run_python(
        """
        import streampool, torch, cupy
        buf = streampool.DeviceBuffer(size=1 << 20)
        t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync"
        cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
        a = cupy.empty(1 << 20, dtype=cupy.uint8)
        ours = streampool.pointer_pool(buf.ptr)
        theirs = (streampool.pointer_pool(t.data_ptr()), streampool.pointer_pool(a.data.ptr))
        current = int(streampool.get_current_device_resource().pool_handle)
        print("pools", hex(ours), [hex(p) for p in theirs], hex(current))
        assert ours == current and theirs == (ours, ours)
        plain = streampool.DeviceBuffer(size=256, mr=streampool.mr.CudaMemoryResource())
        assert streampool.pointer_pool(plain.ptr) is None
        print("OK")
        """,
        env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    )
    assert "OK" in out


def test_torch_reads_and_writes_through_dlpack() -> None:
    torch = pytest.importorskip("torch")
    data = bytes(range(256)) * 16
    buf = streampool.DeviceBuffer.to_device(data, stream=streampool.Stream())
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        t = torch.from_dlpack(buf)  # ts waits for the buffer's stream
        assert t.dtype == torch.uint8 and t.numel() == len(data) and t.device.type == "cuda"
        assert bytes(t.cpu().numpy()) == data
        t[:4] = 9
    ts.synchronize()
    assert buf.tobytes()[:4] == b"\x09" * 4  # one memory: the write shows in the buffer
    del buf
    gc.collect()
    assert int(t[255]) == 255 and int(t[256]) == 0  # the tensor keeps the memory alive


@pytest.mark.parametrize("resource", [mr.CudaAsyncMemoryResource, mr.ManagedMemoryResource])
def test_cupy_reads_through_dlpack(resource: type[mr.MemoryResource]) -> None:
    cupy = pytest.importorskip("cupy")
    data = bytes(range(256)) * 16
    buf = streampool.DeviceBuffer.to_device(data, stream=streampool.Stream(), mr=resource())
    with cupy.cuda.Stream(non_blocking=True):
        c = cupy.from_dlpack(buf)  # CuPy's stream waits for the buffer's stream
        assert c.dtype == cupy.uint8 and bytes(cupy.asnumpy(c)) == data
        c[:4] = 9
        cupy.cuda.get_current_stream().synchronize()
    assert buf.tobytes()[:4] == b"\x09" * 4
    del buf
    gc.collect()
    assert int(c[255]) == 255 and int(c[256]) == 0  # the array keeps the memory alive


def test_cupy_arrays_outlive_the_stream_they_were_made_on() -> None:
    """``with cupy.cuda.Stream(): c = cupy.from_dlpack(buf)``: CuPy destroys its stream at
    the end of the block, while ``c`` lives on. When ``c`` dies, the buffer's free follows
    that stream's work: the export keeps CuPy's stream object alive until then (ordering
    after the destroyed stream's handle crashed the process). In a fresh interpreter, so
    that a crash fails this test alone."""
    pytest.importorskip("cupy")
    out = run_python(
        """
        import gc, cupy, streampool
        from streampool import mr
        data = bytes(range(256)) * 16
        for resource in (mr.CudaAsyncMemoryResource(), mr.ManagedMemoryResource()):
            for _ in range(300):
                buf = streampool.DeviceBuffer.to_device(data, stream=streampool.Stream(), mr=resource)
                with cupy.cuda.Stream(non_blocking=True):
                    c = cupy.from_dlpack(buf)
                    c[:4] = 9
                    cupy.cuda.get_current_stream().synchronize()  # before reading c elsewhere
                del buf
                # Other streams, made and destroyed, take the place of the one that ended.
                others = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
                del others
                gc.collect()
                assert int(c[255]) == 255 and int(c[0]) == 9
                del c
                gc.collect()
        assert streampool.drop_errors()[0] == 0, streampool.drop_errors()
        print("OK")
        """
    )
    assert "OK" in out


def test_a_consumer_on_another_device_is_refused() -> None:
    if streampool.device_count() < 2:
        pytest.skip("needs two GPUs")
    buf = streampool.DeviceBuffer(size=64)
    with pytest.raises(BufferError, match="consumer is on device 1"):
        buf.__dlpack__(dl_device=(2, 1), stream=1)


def test_numpy_reads_managed_memory_and_refuses_device_memory() -> None:
    np = pytest.importorskip("numpy")
    managed = streampool.DeviceBuffer.to_device(
        b"abc" * 100, mr=mr.ManagedMemoryResource(), stream=streampool.Stream()
    )
    assert np.from_dlpack(managed).tobytes() == b"abc" * 100
    device = streampool.DeviceBuffer.to_device(b"abc")
    with pytest.raises(BufferError, match="host cannot read"):
        np.from_dlpack(device, device="cpu")


def test_jax_reads_our_buffers() -> None:
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    buf = streampool.DeviceBuffer.to_device(bytes(range(100)))
    array = jax.dlpack.from_dlpack(buf)
    assert int(array.sum()) == sum(range(100))
