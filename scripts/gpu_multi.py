"""Several GPUs: the checks that need real devices, printed plainly.

1. per-device allocation from 8 threads on each GPU at once, with data checks;
2. a pool on GPU 0 made accessible to GPU 1 (``peer_access=[1]``) and read there: a copy
   enqueued on GPU 1 (and, with CuPy installed, a kernel on GPU 1), with data checks;
3. copies between GPUs (``DeviceBuffer.copy_to_device``) both ways, with data checks;
4. the Dask plugin with one worker process per GPU, allocating on each (needs
   ``distributed``).

On a machine with one GPU, the parts that need two print ``SKIP`` with the reason; the
rest still run. ``STREAMPOOL_DEVICE=sim STREAMPOOL_SIM_DEVICES=2`` runs it all on
simulated devices (no GPU needed). Exit status 0 when every part that ran passed.

    python scripts/gpu_multi.py [--probe-ungranted]

``--probe-ungranted`` adds a last part that reports (does not judge) what the driver does
with a copy on GPU 1 from GPU 0 pool memory that GPU 1 was not granted.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

import streampool
from streampool import mr

THREADS_PER_GPU = 8
RESULTS: list[tuple[str, str, str]] = []


def pattern(seed: int, nbytes: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(251)) * (nbytes // 251) + bytes(nbytes % 251)


class Skip(Exception):
    """A part that cannot run here, with the reason."""


def part(name: str, needs_gpus: int = 1) -> Callable[[Callable[[], str]], Callable[[], None]]:
    def wrap(fn: Callable[[], str]) -> Callable[[], None]:
        def run() -> None:
            count = streampool.device_count()
            if count < needs_gpus:
                RESULTS.append((name, "SKIP", f"needs {needs_gpus} GPUs, found {count}"))
                return
            start = time.perf_counter()
            try:
                detail = fn()
            except Skip as why:
                RESULTS.append((name, "SKIP", str(why)))
                return
            except Exception as e:  # a failed part is reported, and the others still run
                traceback.print_exc()
                RESULTS.append((name, "FAIL", f"{type(e).__name__}: {e}"))
                return
            RESULTS.append((name, "PASS", f"{detail} ({time.perf_counter() - start:.2f} s)"))

        return run

    return wrap


@part("8 threads per GPU, all GPUs at once")
def threads_on_every_gpu() -> str:
    count = streampool.device_count()
    pools = [mr.CudaAsyncMemoryResource(device=d) for d in range(count)]
    errors: list[str] = []
    checked = [0] * count
    lock = threading.Lock()

    def work(device: int, t: int) -> None:
        try:
            s = streampool.Stream(device=device)
            for i in range(50):
                nbytes = (1 << 16) * (1 + (i * 7 + t) % 32)
                data = pattern(device * 97 + t + i, nbytes)
                buf = streampool.DeviceBuffer.to_device(data, stream=s, mr=pools[device])
                if buf.device != device or bytes(buf) != data:
                    errors.append(f"GPU {device} thread {t} round {i}: data mismatch")
                    return
                buf.close()
            s.synchronize()
            if streampool.get_current_device() != 0:
                errors.append(
                    f"thread {t} of GPU {device}: its current device became {streampool.get_current_device()}"
                )
            with lock:
                checked[device] += 50
        except Exception as e:
            errors.append(f"GPU {device} thread {t}: {type(e).__name__}: {e}")

    threads = [
        threading.Thread(target=work, args=(d, t)) for d in range(count) for t in range(THREADS_PER_GPU)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise AssertionError("; ".join(errors[:5]))
    return ", ".join(f"GPU {d}: {n} buffers checked" for d, n in enumerate(checked))


class ArrayView:
    """Only a CUDA array interface: copies from it go through cuMemcpyAsync on the
    destination's device, which reads the source memory from there."""

    def __init__(self, buf: streampool.DeviceBuffer) -> None:
        self.__cuda_array_interface__ = dict(buf.__cuda_array_interface__, stream=None)


def cupy_sum_on(device: int, buf: streampool.DeviceBuffer) -> int | str:
    """The sum of the buffer's bytes, computed by a CuPy kernel on ``device``; or why
    there is no kernel check (no CuPy; simulated devices, whose pointers are host
    addresses)."""
    if streampool.using_simulated_device():
        return "no kernel check on simulated devices"
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        return "no kernel check (CuPy not installed)"
    memory = cupy.cuda.UnownedMemory(buf.ptr, buf.size, buf, device_id=device)
    with cupy.cuda.Device(device):
        array = cupy.ndarray((buf.size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        total = int(array.sum(dtype=cupy.uint64))
        cupy.cuda.Device(device).synchronize()
    return total


@part("pool on GPU 0 read on GPU 1 (peer_access=[1])", needs_gpus=2)
def pool_read_on_gpu1() -> str:
    if not streampool.device_can_access_peer(1, 0):
        raise Skip("cuDeviceCanAccessPeer(1, 0) is false on this machine (no peer path)")
    shared = mr.CudaAsyncMemoryResource(device=0, peer_access=[1])
    if shared.peer_access != [1]:
        raise AssertionError(f"peer_access reads {shared.peer_access}")
    nbytes = 32 << 20
    data = pattern(11, nbytes)
    src = streampool.DeviceBuffer.to_device(data, mr=shared)
    s1 = streampool.Stream(device=1)
    into = streampool.DeviceBuffer(size=nbytes, stream=s1, mr=streampool.get_per_device_resource(1))
    into.copy_from_device(ArrayView(src), stream=s1)  # cuMemcpyAsync in GPU 1's context
    if bytes(into) != data:
        raise AssertionError("GPU 1's copy of GPU 0's pool memory differs")
    words = "a copy on GPU 1 read it back right"
    total = cupy_sum_on(1, src)
    if isinstance(total, str):
        words += f"; {total}"
    elif total != sum(data):
        raise AssertionError(f"a CuPy kernel on GPU 1 summed {total}, expected {sum(data)}")
    else:
        words += "; a CuPy kernel on GPU 1 summed it right"
    shared.set_peer_access(1, enabled=False)
    if shared.peer_access != []:
        raise AssertionError("withdrawing access did not take")
    return words


@part("copies between GPUs (copy_to_device)", needs_gpus=2)
def copies_between_gpus() -> str:
    nbytes = 64 << 20
    data = pattern(23, nbytes)
    s0, s1 = streampool.Stream(device=0), streampool.Stream(device=1)
    a = streampool.DeviceBuffer.to_device(data, stream=s0, mr=streampool.get_per_device_resource(0))
    b = a.copy_to_device(1, stream=s1)
    c = b.copy_to_device(0, stream=s0)
    if b.device != 1 or c.device != 0:
        raise AssertionError(f"devices {b.device}, {c.device}")
    if bytes(b) != data or bytes(c) != data:
        raise AssertionError("a copy between GPUs differs")
    # Copies need no peer access: also from a pool no one granted anything.
    private = mr.CudaAsyncMemoryResource(device=0, initial_pool_size="64MiB")
    d = streampool.DeviceBuffer.to_device(data, mr=private).copy_to_device(1)
    if bytes(d) != data:
        raise AssertionError("a copy from an ungranted pool differs")
    return f"{nbytes >> 20} MiB GPU 0 -> 1 -> 0 and from an ungranted pool, all equal"


def dask_task(seed: int, nbytes: int) -> tuple[int, int, bool]:
    import streampool.dask

    data = pattern(seed, nbytes)
    buf = streampool.DeviceBuffer.to_device(data, mr=streampool.dask.worker_resource())
    return streampool.dask.worker_device(), buf.device, bytes(buf) == data


@part("Dask: one worker per GPU, allocating on each")
def dask_workers() -> str:
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise Skip("distributed is not installed (pip install 'streampool[dask]')") from None
    import streampool.dask

    workers = min(2, streampool.device_count())
    with (
        LocalCluster(
            n_workers=workers, threads_per_worker=4, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        streampool.dask.register(client, "pool")
        tasks = 8 * workers
        results = client.gather(client.map(dask_task, range(tasks), [4 << 20] * tasks))
        bad = [r for r in results if not r[2] or r[0] != r[1]]
        if bad:
            raise AssertionError(f"tasks with wrong data or device: {bad}")
        stats = streampool.dask.statistics(client)
    devices = sorted(s["device"] for s in stats.values())
    if devices != list(range(workers)):
        raise AssertionError(f"workers' devices are {devices}, expected one per GPU")
    per = "; ".join(
        f"worker on GPU {s['device']}: {s['total_count']} allocations, peak {s['peak_bytes'] >> 20} MiB"
        for s in sorted(stats.values(), key=lambda s: s["device"])
    )
    return f"{tasks} tasks checked; {per}"


@part("probe: cuMemcpyAsync on GPU 1 from an ungranted pool of GPU 0", needs_gpus=2)
def probe_ungranted() -> str:
    """What the driver does with a copy in GPU 1's context from GPU 0 pool memory that GPU 1
    was not granted (the simulated device refuses it). Last: a fault would end the context."""
    private = mr.CudaAsyncMemoryResource(device=0, initial_pool_size="4MiB")
    data = pattern(31, 1 << 20)
    src = streampool.DeviceBuffer.to_device(data, mr=private)
    into = streampool.DeviceBuffer(size=len(data), mr=streampool.get_per_device_resource(1))
    try:
        into.copy_from_device(ArrayView(src))
        same = bytes(into) == data
    except streampool.StreampoolError as e:
        return f"the driver refused it: {type(e).__name__}: {e}"
    return f"the driver accepted it; data {'equal' if same else 'DIFFERENT'}"


def main() -> int:
    print(f"streampool {streampool.__version__} on {streampool.backend_description()}")
    count = streampool.device_count()
    for d in range(count):
        info = streampool.device_info(d)
        print(f"  GPU {d}: {info['name']}, {info['total_bytes'] >> 30} GiB")
    if count >= 2:
        print(
            f"  peer paths: 0->1 {streampool.device_can_access_peer(0, 1)}, 1->0 {streampool.device_can_access_peer(1, 0)}"
        )
    else:
        print(f"  one GPU: the parts that need two are skipped (found {count})")
    parts = [threads_on_every_gpu, pool_read_on_gpu1, copies_between_gpus, dask_workers]
    if "--probe-ungranted" in sys.argv[1:]:
        parts.append(probe_ungranted)
    for run in parts:
        run()
    print()
    for name, status, detail in RESULTS:
        print(f"{status:4}  {name}: {detail}")
    failed = [name for name, status, _ in RESULTS if status == "FAIL"]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all parts that ran passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
