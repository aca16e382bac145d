"""Several devices: per-device resources, peer access, copies between devices, and the
errors for a device that does not exist or memory used on the wrong device.

Most tests run on a simulated backend of two or three devices, which enforces peer access
as the driver does; the ``gpu`` ones run on the machine's GPUs (on one GPU where they can,
skipping with the reason where they need two).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

from .test_readme import Example, examples

pytestmark = pytest.mark.nosim


@pytest.fixture
def dev() -> Iterator[SimulatedDevice]:
    with SimulatedDevice(capacity_bytes="64MiB", devices=2) as d:
        yield d
        assert not d.races(), d.races()


def pattern(seed: int, nbytes: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(nbytes))


def test_resources_streams_and_buffers_belong_to_their_device(dev: SimulatedDevice) -> None:
    assert streampool.device_count() == 2
    for device in (0, 1):
        s = streampool.Stream(device=device)
        for res in (
            mr.CudaAsyncMemoryResource(device=device),
            mr.CudaAsyncMemoryResource(device=device, initial_pool_size="4MiB"),
            mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(device=device)),
            mr.StatisticsResourceAdaptor(mr.CudaMemoryResource(device=device)),
        ):
            assert res.device == device
            buf = streampool.DeviceBuffer.to_device(pattern(device, 4096), stream=s, mr=res)
            assert buf.device == device
            assert bytes(buf) == pattern(device, 4096)
        assert streampool.get_per_device_resource(device).device == device
        assert mr.available_device_memory(device)[1] == 64 << 20
    # Each device has its own memory: filling device 1 leaves device 0's free.
    free0, free1 = mr.available_device_memory(0)[0], mr.available_device_memory(1)[0]
    big = streampool.DeviceBuffer(size="32MiB", mr=mr.CudaMemoryResource(device=1))
    assert mr.available_device_memory(1)[0] == free1 - (32 << 20)
    assert mr.available_device_memory(0)[0] == free0
    del big


def test_threads_allocate_on_every_device_at_once(dev: SimulatedDevice) -> None:
    pools = {d: mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(device=d)) for d in (0, 1)}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            device = t % 2
            s = streampool.Stream(device=device)
            for i in range(20):
                data = pattern(t * 100 + i, 512 + 64 * i)
                buf = streampool.DeviceBuffer.to_device(data, stream=s, mr=pools[device])
                assert buf.device == device and bytes(buf) == data
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_copy_to_device_copies_between_devices_in_order(dev: SimulatedDevice) -> None:
    s0, s1 = streampool.Stream(device=0), streampool.Stream(device=1)
    src = streampool.DeviceBuffer.to_device(pattern(1, 8192), stream=s0)
    # A kernel on device 0 writes it after the upload; the copy must be ordered after that.
    dev.write(s0, src.ptr, 8192, label="producer on device 0")
    written = bytes(src)
    copied = src.copy_to_device(1, stream=s1)
    assert copied.device == 1 and copied.stream is s1 and copied.mr.device == 1
    assert bytes(copied) == written
    # Back to device 0, into a resource given; and to the same device (a plain copy).
    pool0 = mr.CudaAsyncMemoryResource(device=0, initial_pool_size="2MiB")
    back = copied.copy_to_device(0, mr=pool0)
    assert back.device == 0 and back.mr is pool0 and bytes(back) == written
    assert bytes(back.copy_to_device(0)) == written
    # copy_from_device between devices, into part of a larger buffer.
    target = streampool.DeviceBuffer(size=16384, stream=s1, mr=streampool.get_per_device_resource(1))
    target.copy_from_device(src)
    assert bytes(target)[:8192] == written
    # The source's owner may free it in its own order once the copy is enqueued.
    src2 = streampool.DeviceBuffer.to_device(pattern(2, 4096), stream=s0)
    far = src2.copy_to_device(1, stream=s1)
    src2.close()
    assert bytes(far) == pattern(2, 4096)
    empty = streampool.DeviceBuffer(size=0).copy_to_device(1)
    assert empty.size == 0 and empty.device == 1


def test_copies_need_no_peer_access(dev: SimulatedDevice) -> None:
    dev.set_peer_capable(0, 1, False)
    assert not streampool.device_can_access_peer(1, 0)
    src = streampool.DeviceBuffer.to_device(pattern(3, 4096))
    assert bytes(src.copy_to_device(1)) == pattern(3, 4096)


def test_pool_memory_needs_a_grant_to_be_used_on_another_device(dev: SimulatedDevice) -> None:
    s1 = streampool.Stream(device=1)
    private = mr.CudaAsyncMemoryResource(device=0, initial_pool_size="2MiB")
    shared = mr.CudaAsyncMemoryResource(device=0, peer_access=[1])
    assert private.peer_access == [] and shared.peer_access == [1]
    mine = streampool.DeviceBuffer(size=4096, mr=private)
    theirs = streampool.DeviceBuffer.to_device(pattern(4, 4096), mr=shared)
    with pytest.raises(streampool.InvalidPointerError) as refused:
        dev.read(s1, mine.ptr, 4096, label="kernel on device 1")
    for words in ("on device 1", "memory of device 0", "device 1 cannot access", "peer_access=[1]"):
        assert words in str(refused.value), refused.value
    dev.read(s1, theirs.ptr, 4096, label="kernel on device 1")  # granted
    # Granted later, to memory allocated before; then withdrawn.
    private.set_peer_access(1)
    assert private.peer_access == [1]
    dev.read(s1, mine.ptr, 4096)
    private.set_peer_access(1, enabled=False)
    assert private.peer_access == []
    # peer_access=[] (say, computed from device_can_access_peer) is a pool of its own too:
    # a grant on it leaves the device's shared pool closed.
    none_yet = mr.CudaAsyncMemoryResource(device=0, peer_access=[])
    assert "owns_pool=true" in repr(none_yet)
    none_yet.set_peer_access(1)
    assert mr.CudaAsyncMemoryResource(device=0).peer_access == []
    assert streampool.get_per_device_resource(0).peer_access == []
    with pytest.raises(streampool.InvalidPointerError, match="does not grant device 1 access"):
        dev.write(s1, mine.ptr, 4096)
    # The device's shared default pool is not opened by another resource's grant.
    default = streampool.DeviceBuffer(size=4096)
    with pytest.raises(streampool.InvalidPointerError, match="memory of device 0"):
        dev.read(s1, default.ptr, 4096)
    # Managed memory is every device's.
    managed = streampool.DeviceBuffer(size=4096, mr=mr.ManagedMemoryResource(device=0))
    dev.read(s1, managed.ptr, 4096)
    dev.run()


def test_a_view_allocates_for_the_device_its_pool_lies_on(dev: SimulatedDevice) -> None:
    # Device 1's default pool, and a pool of device 1's own: with no device given, the view
    # takes device 1; given device 0, it is refused naming device 1.
    owners = [
        mr.CudaAsyncMemoryResource(device=1),
        mr.CudaAsyncMemoryResource(device=1, initial_pool_size="2MiB"),
    ]
    for pool in (owner.pool_handle for owner in owners):
        view = mr.CudaAsyncViewMemoryResource(pool)
        assert view.device == 1
        buf = streampool.DeviceBuffer.to_device(pattern(5, 4096), mr=view, stream=streampool.Stream(device=1))
        assert buf.device == 1 and buf.__dlpack_device__() == (2, 1)
        assert buf.tobytes() == pattern(5, 4096)
        with pytest.raises(streampool.InvalidArgumentError, match="lies on device 1: give device=1"):
            mr.CudaAsyncViewMemoryResource(pool, device=0)
    # Device 1's default pool open to device 0 still lies on device 1.
    shared = mr.CudaAsyncMemoryResource(device=1)
    shared.set_peer_access(0)
    try:
        with pytest.raises(streampool.InvalidArgumentError, match="lies on device 1"):
            mr.CudaAsyncViewMemoryResource(shared.pool_handle, device=0)
        assert mr.CudaAsyncViewMemoryResource(shared.pool_handle).device == 1
    finally:
        shared.set_peer_access(0, enabled=False)
    assert mr.CudaAsyncViewMemoryResource(mr.CudaAsyncMemoryResource(device=0).pool_handle).device == 0


def foreign_array(ptr: int, nbytes: int, stream: int) -> SimpleNamespace:
    """Another library's array of ``nbytes`` bytes at ``ptr``, ordered on ``stream`` (its
    CUDA array interface, version 3)."""
    return SimpleNamespace(
        __cuda_array_interface__={
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "stream": stream,
        }
    )


def test_a_foreign_array_on_another_device_copies_after_its_own_stream(dev: SimulatedDevice) -> None:
    # A CUDA array interface whose stream is another device's: the copy waits for that stream
    # (an event of its device), and nothing is refused for the stream's device.
    s0, s1 = streampool.Stream(device=0), streampool.Stream(device=1)
    src = streampool.DeviceBuffer.to_device(
        pattern(6, 4096), mr=mr.CudaAsyncMemoryResource(device=0, peer_access=[1]), stream=s0
    )
    dev.write(s0, src.ptr, 4096, label="producer on device 0")  # pending on s0 until run

    foreign = foreign_array(src.ptr, 4096, s0.handle)
    dst = streampool.DeviceBuffer(size=4096, stream=s1, mr=mr.CudaAsyncMemoryResource(device=1))
    dst.copy_from_device(foreign)
    dev.run()
    assert not dev.races(), dev.races()


@pytest.mark.parametrize("dst_stream", ["own", "legacy"])
def test_a_foreign_arrays_default_stream_is_its_own_devices(dev: SimulatedDevice, dst_stream: str) -> None:
    # Stream 1 in a CUDA array interface is the legacy default stream of the producer's
    # device (each device has its own): the copy into device 1 waits for device 0's, and
    # device 0's later work waits for the copy (device 1's legacy stream, the same handle,
    # orders nothing of device 0's).
    src = streampool.DeviceBuffer(size=4096, mr=mr.CudaAsyncMemoryResource(device=0, peer_access=[1]))
    stream = streampool.Stream(device=1) if dst_stream == "own" else None
    dst = streampool.DeviceBuffer(size=4096, stream=stream, mr=mr.CudaAsyncMemoryResource(device=1))
    dev.run()
    foreign = foreign_array(src.ptr, 4096, 1)
    dev.write(None, src.ptr, 4096, label="producer on device 0's legacy stream")
    dst.copy_from_device(foreign)
    dev.write(None, src.ptr, 4096, label="the producer's next write, on the same stream")
    dev.run()
    assert not dev.races(), dev.races()


def test_a_buffer_of_an_exited_simulated_device_is_not_a_copy_source() -> None:
    with SimulatedDevice(capacity_bytes="64MiB"):
        old = streampool.DeviceBuffer.to_device(b"old!" * 1024)
    assert old.closed
    with SimulatedDevice(capacity_bytes="64MiB"):
        new = streampool.DeviceBuffer(size=4096)
        with pytest.raises(ValueError, match=r"simulated device #[0-9]+ is closed"):
            new.copy_from_device(old)
        new.copy_from_host(b"new!" * 1024)
        assert new.tobytes() == b"new!" * 1024


def test_cudamalloc_memory_follows_context_peer_access(dev: SimulatedDevice) -> None:
    s1 = streampool.Stream(device=1)
    plain = streampool.DeviceBuffer(size=4096, mr=mr.CudaMemoryResource(device=0))
    with pytest.raises(streampool.InvalidPointerError, match="peer access from device 1 to device 0"):
        dev.read(s1, plain.ptr, 4096)
    assert streampool.device_can_access_peer(1, 0) and not streampool.device_can_access_peer(1, 1)
    streampool.enable_peer_access(1, 0)
    streampool.enable_peer_access(1, 0)  # again: nothing happens
    dev.read(s1, plain.ptr, 4096)
    # Pool memory does not follow it.
    pooled = streampool.DeviceBuffer(size=4096, mr=mr.CudaAsyncMemoryResource(device=0, initial_pool_size=0))
    with pytest.raises(streampool.InvalidPointerError, match="cuMemPoolSetAccess"):
        dev.read(s1, pooled.ptr, 4096)
    dev.run()


def test_peer_access_that_cannot_be_given_is_refused_naming_the_devices() -> None:
    with SimulatedDevice(capacity_bytes="64MiB", devices=3) as dev:
        dev.set_peer_capable(0, 2, False)
        with pytest.raises(
            streampool.InvalidArgumentError, match="device 2 cannot access memory of device 0"
        ):
            mr.CudaAsyncMemoryResource(device=0, peer_access=[1, 2])
        res = mr.CudaAsyncMemoryResource(device=0, peer_access=[1, 1])
        assert res.peer_access == [1]
        with pytest.raises(TypeError, match="each device of peer_access must be a device ordinal"):
            mr.CudaAsyncMemoryResource(device=0, peer_access=[None])  # type: ignore[list-item]
        with pytest.raises(
            streampool.InvalidArgumentError, match="device 2 cannot access memory of device 0"
        ):
            res.set_peer_access(2)
        assert res.peer_access == [1], "a refused grant changes nothing"
        with pytest.raises(streampool.InvalidArgumentError, match="device 0 is the pool's own device"):
            res.set_peer_access(0)
        with pytest.raises(streampool.InvalidArgumentError, match=r"peer device 3 does not exist.*3 devices"):
            res.set_peer_access(3)
        with pytest.raises(
            streampool.InvalidArgumentError, match="device 2 cannot access memory of device 0"
        ):
            streampool.enable_peer_access(2, 0)
        with pytest.raises(streampool.InvalidArgumentError, match="the same device"):
            streampool.enable_peer_access(1, 1)
        with pytest.raises(TypeError, match="peer_access must be a list of device ordinals, such as \\[1\\]"):
            mr.CudaAsyncMemoryResource(peer_access=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="each device of peer_access must be a device ordinal"):
            mr.CudaAsyncMemoryResource(peer_access=[-1])
        streampool.DeviceBuffer(size=256, mr=res)  # still usable


def test_memory_and_streams_of_another_device_are_refused(dev: SimulatedDevice) -> None:
    s0, s1 = streampool.Stream(device=0), streampool.Stream(device=1)
    res0 = mr.CudaAsyncMemoryResource(device=0)
    buf0 = streampool.DeviceBuffer(size=4096, mr=res0)
    with pytest.raises(
        streampool.InvalidStreamError, match="belongs to device 1, but is used here with device 0"
    ):
        streampool.DeviceBuffer(size=4096, stream=s1, mr=res0)
    # With the current device's resource, not given: the error names the way out.
    with pytest.raises(
        streampool.InvalidStreamError,
        match=r"give a stream of device 0, or a resource of device 1 \(in Python, "
        r"streampool\.get_per_device_resource\(1\)\)",
    ):
        streampool.DeviceBuffer(size=4096, stream=s1)
    with pytest.raises(streampool.InvalidStreamError, match="belongs to device 1"):
        buf0.copy_to_host(stream=s1)
    with pytest.raises(streampool.InvalidStreamError, match="belongs to device 1"):
        buf0.resize(8192, stream=s1)
    with pytest.raises(
        streampool.InvalidStreamError, match="belongs to device 0, but is used here with device 1"
    ):
        buf0.copy_to_device(1, stream=s0)
    with pytest.raises(ValueError, match="mr is a resource of device 0, but copy_to_device\\(1\\)"):
        buf0.copy_to_device(1, mr=res0)
    with pytest.raises(ValueError, match=r"belongs to device 0 .* cannot be the resource of device 1"):
        streampool.set_per_device_resource(1, res0)
    with pytest.raises(streampool.InvalidStreamError, match="belongs to device 1"):
        mr.ShardedPoolMemoryResource(res0).allocate(256, s1)
    assert bytes(buf0.copy_to_device(1)) == bytes(4096), "still usable"


def test_managed_memory_is_prefetched_on_a_stream_of_the_device_that_reads_it(dev: SimulatedDevice) -> None:
    # Managed memory belongs to no device: the driver takes a prefetch on a stream of any
    # device, and the reader's own stream orders the move before the reader's work.
    buf = streampool.DeviceBuffer(size=4096, mr=mr.ManagedMemoryResource(device=1))
    reader = streampool.Stream(device=0)
    buf.prefetch(0, reader)
    assert buf.last_prefetch_location == 0
    buf.prefetch("host", streampool.Stream(device=1))
    assert buf.last_prefetch_location == "host"
    # Memory that is not managed: nothing to move, and the stream is taken all the same.
    streampool.DeviceBuffer(size=4096, mr=mr.CudaAsyncMemoryResource(device=1)).prefetch(0, reader)
    reader.synchronize()


DEVICE_TAKERS: dict[str, Callable[[Any], object]] = {
    "CudaAsyncMemoryResource": lambda d: mr.CudaAsyncMemoryResource(device=d),
    "CudaAsyncManagedMemoryResource": lambda d: mr.CudaAsyncManagedMemoryResource(device=d),
    "CudaMemoryResource": lambda d: mr.CudaMemoryResource(device=d),
    "ManagedMemoryResource": lambda d: mr.ManagedMemoryResource(device=d),
    "PinnedHostMemoryResource": lambda d: mr.PinnedHostMemoryResource(device=d),
    "Stream": lambda d: streampool.Stream(device=d),
    "device_info": lambda d: streampool.device_info(d),
    "available_device_memory": lambda d: mr.available_device_memory(d),
    "get_per_device_resource": lambda d: streampool.get_per_device_resource(d),
    "copy_to_device": lambda d: streampool.DeviceBuffer(size=16).copy_to_device(d),
    "set_peer_access": lambda d: mr.CudaAsyncMemoryResource(initial_pool_size=0).set_peer_access(d),
    "device_can_access_peer": lambda d: streampool.device_can_access_peer(0, d),
    "enable_peer_access": lambda d: streampool.enable_peer_access(d, 0),
}


@pytest.mark.parametrize("name", sorted(DEVICE_TAKERS))
def test_every_device_argument_names_its_range(dev: SimulatedDevice, name: str) -> None:
    take = DEVICE_TAKERS[name]
    for huge in (2**31, 2**40, 2**70):
        with pytest.raises(ValueError, match=f"must be a device ordinal from 0 to 1 .*2 devices.*got {huge}"):
            take(huge)
    with pytest.raises(ValueError, match="must be a device ordinal from 0 to 1"):
        take(-1)
    with pytest.raises(streampool.InvalidArgumentError, match="does not exist on simulated device"):
        take(2)
    with pytest.raises(TypeError, match="must be a device ordinal"):
        take(True)
    with pytest.raises(TypeError, match="must be a device ordinal"):
        take("1")


def test_the_simulators_peer_capability_names_its_arguments_range(dev: SimulatedDevice) -> None:
    for a, b, name in ((-1, 0, "a"), (0, 2**31, "b")):
        with pytest.raises(ValueError, match=f"{name} must be a device ordinal from 0 to 1 .*2 devices"):
            dev.set_peer_capable(a, b, False)
    with pytest.raises(streampool.InvalidArgumentError, match="does not exist on simulated device"):
        dev.set_peer_capable(2, 0, False)
    with pytest.raises(TypeError, match="must be a device ordinal"):
        dev.set_peer_capable(True, 0, False)
    assert streampool.device_can_access_peer(0, 1), "refused calls change nothing"


def test_the_environment_picks_the_number_of_simulated_devices() -> None:
    def run(devices: str) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, STREAMPOOL_DEVICE="sim", STREAMPOOL_SIM_DEVICES=devices)
        code = "import streampool; print(streampool.device_count())"
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )

    assert run("3").stdout.strip() == "3"
    env = dict(os.environ, STREAMPOOL_DEVICE="sim", STREAMPOOL_SIM_DEVICES="2")
    report = subprocess.run(
        [sys.executable, "-m", "streampool"], env=env, capture_output=True, text=True, timeout=60
    )
    assert "Devices:       2\nPeer access:   between every pair\n" in report.stdout, report.stdout
    bad = run("0")
    assert bad.returncode != 0 and 'STREAMPOOL_SIM_DEVICES is "0"' in bad.stderr, bad.stderr
    assert "from 1 to 1024" in bad.stderr


GUIDE = Path(__file__).resolve().parent.parent / "docs" / "multi-gpu.md"
GUIDE_EXAMPLES = examples(GUIDE.read_text(encoding="utf-8"))


def run_example(example: Example, env: dict[str, str], cwd: Path) -> None:
    for module in example.modules:
        pytest.importorskip(module)
    base = {k: v for k, v in os.environ.items() if not k.startswith("STREAMPOOL_")}
    done = subprocess.run(
        [sys.executable, "-c", example.code],
        cwd=cwd,
        env=dict(base, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"docs/multi-gpu.md line {example.line} failed:\n{done.stderr}"


@pytest.mark.parametrize(
    "example", [pytest.param(e, id=f"line{e.line}") for e in GUIDE_EXAMPLES if e.mode != "gpu"]
)
def test_guide_example_runs_on_two_simulated_devices(example: Example, tmp_path: Path) -> None:
    env = {"STREAMPOOL_DEVICE": "sim", "STREAMPOOL_SIM_DEVICES": "2"} if example.mode == "sim" else {}
    run_example(example, env, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "example", [pytest.param(e, id=f"line{e.line}") for e in GUIDE_EXAMPLES if e.mode != "anywhere"]
)
def test_gpu_guide_example_runs_on_two_gpus(example: Example, tmp_path: Path) -> None:
    if streampool.device_count() < 2:
        pytest.skip(f"the guide's examples use two GPUs, found {streampool.device_count()}")
    run_example(example, {}, tmp_path)


SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_multi.py")


def run_script(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, SCRIPT], env=dict(os.environ, **env), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all parts that ran passed" in done.stdout, done.stdout
    return done.stdout


def test_the_multi_gpu_script_passes_on_two_simulated_devices() -> None:
    out = run_script(
        {"STREAMPOOL_DEVICE": "sim", "STREAMPOOL_SIM_DEVICES": "2", "STREAMPOOL_SIM_CAPACITY": "1GiB"}
    )
    parts = ["8 threads per GPU", "pool on GPU 0 read on GPU 1", "copies between GPUs"]
    if importlib.util.find_spec("distributed") is not None:
        parts.append("Dask")
    for part in parts:
        assert f"PASS  {part}" in out, out


# ---------------------------------------------------------------------------------------
# On the GPUs


@pytest.mark.gpu
def test_gpu_the_multi_gpu_script() -> None:
    """Its two-GPU parts skip, saying so, on a machine with one."""
    out = run_script({"STREAMPOOL_DEVICE": "cuda"})
    if streampool.device_count() < 2:
        assert "SKIP  copies between GPUs (copy_to_device): needs 2 GPUs, found 1" in out, out


def gpu_pattern_check(device: int) -> None:
    s = streampool.Stream(device=device)
    data = pattern(device, 1 << 20)
    buf = streampool.DeviceBuffer.to_device(data, stream=s, mr=mr.CudaAsyncMemoryResource(device=device))
    assert buf.device == device and bytes(buf) == data


@pytest.mark.gpu
def test_gpu_threads_allocate_on_every_gpu() -> None:
    count = streampool.device_count()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            gpu_pattern_check(t % count)
            # Work on another device never changes this thread's current device.
            assert streampool.get_current_device() == 0
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8 * count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.gpu
def test_gpu_device_arguments_and_peer_queries() -> None:
    count = streampool.device_count()
    assert not streampool.device_can_access_peer(0, 0)
    with pytest.raises(streampool.InvalidArgumentError, match=f"device {count} does not exist"):
        mr.CudaAsyncMemoryResource(device=count)
    with pytest.raises(ValueError, match=f"device must be a device ordinal from 0 to {count - 1}"):
        mr.CudaAsyncMemoryResource(device=2**40)
    res = mr.CudaAsyncMemoryResource(initial_pool_size="1MiB")
    assert res.peer_access == []
    with pytest.raises(streampool.InvalidArgumentError, match="the pool's own device"):
        res.set_peer_access(0)
    # To the same device, copy_to_device is a copy on it.
    src = streampool.DeviceBuffer.to_device(pattern(5, 1 << 20))
    assert bytes(src.copy_to_device(0)) == pattern(5, 1 << 20)


@pytest.mark.gpu
def test_gpu_two_gpus_copies_and_peer_access() -> None:
    if streampool.device_count() < 2:
        pytest.skip(f"needs two GPUs, found {streampool.device_count()}")
    data = pattern(6, 4 << 20)
    src = streampool.DeviceBuffer.to_device(data, mr=mr.CudaAsyncMemoryResource(device=0))
    there = src.copy_to_device(1)
    assert there.device == 1 and bytes(there) == data
    assert bytes(there.copy_to_device(0)) == data
    # Managed memory of device 0 prefetched to device 1 on a stream of device 1 (the
    # reader's), which the driver takes where device 1 has concurrent managed access.
    if streampool.device_info(1)["concurrent_managed_access"]:
        managed = streampool.DeviceBuffer.to_device(data, mr=mr.ManagedMemoryResource(device=0))
        reader = streampool.Stream(device=1)
        managed.prefetch(1, reader)
        reader.synchronize()
        assert managed.last_prefetch_location == 1 and bytes(managed) == data
    if not streampool.device_can_access_peer(1, 0):
        pytest.skip("GPUs 1 and 0 have no peer path: pool access cannot be granted")
    shared = mr.CudaAsyncMemoryResource(device=0, peer_access=[1])
    assert shared.peer_access == [1]
    buf = streampool.DeviceBuffer.to_device(data, mr=shared)
    # Device 1 copies out of device 0's pool memory on its own stream.
    into = streampool.DeviceBuffer(size=len(data), stream=streampool.Stream(device=1))
    into.copy_from_device(buf)
    assert bytes(into) == data
