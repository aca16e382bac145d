"""streampool.kernels: fill, check and compute on the simulated device (and on a GPU)."""

from __future__ import annotations

import threading

import pytest

import streampool
from streampool import kernels, mr
from streampool.sim import SimulatedDevice


def test_fill_check_and_a_planted_word(sim: SimulatedDevice) -> None:
    resource = mr.CudaAsyncMemoryResource()
    s = streampool.Stream()
    size = (1 << 20) + 4
    buf = streampool.DeviceBuffer(size=size, stream=s, mr=resource)
    kernels.fill(buf.ptr, size, 11, s)
    kernels.compute(buf.ptr, size, s, iterations=3)
    assert kernels.check(buf.ptr, size, 11, s) == 0
    assert kernels.check(buf.ptr, size, 12, s) == size // 8
    data = bytearray(buf.tobytes())
    data[8000:8008] = data[0:8]  # word 1000 gets word 0's value: misplaced data
    buf.copy_from_host(bytes(data))
    assert kernels.check(buf.ptr, size, 11, s) == 1
    assert kernels.check(buf.ptr, "1MiB", 11, stream=s) == 1


def test_a_kernel_racing_a_free_is_found(sim: SimulatedDevice) -> None:
    resource = mr.CudaAsyncMemoryResource()
    s1, s2 = streampool.Stream(), streampool.Stream()
    p = resource.allocate(4096, s1)
    kernels.fill(p, 4096, 1, s2)  # wrong: s2 is not ordered after s1's allocation...
    resource.deallocate(p, 4096, s1)  # ...nor is the free ordered after s2's kernel
    q = resource.allocate(4096, s1)
    kernels.fill(q, 4096, 2, s1)
    sim.run()
    races = sim.races()
    sim.clear_races()
    assert races and "kernel 'streampool_fill'" in races[0], races
    resource.deallocate(q, 4096, s1)


def test_bad_arguments_are_refused(sim: SimulatedDevice) -> None:
    resource = mr.CudaMemoryResource()
    p = resource.allocate(1024)
    with pytest.raises(streampool.InvalidArgumentError, match="8-byte aligned"):
        kernels.fill(p + 4, 64, 1)
    with pytest.raises(
        streampool.InvalidPointerError, match="runs 1024 bytes past the end of the live allocation"
    ):
        kernels.fill(p, 2048, 1)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        kernels.fill(p, 64, -1)
    with pytest.raises(ValueError, match="iterations must be >= 0"):
        kernels.compute(p, 64, iterations=-2)
    with pytest.raises(TypeError, match="size must be"):
        kernels.check(p, 1.5, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot use a"):
        kernels.fill(p, 64, 1, stream=object())
    assert kernels.check(p, 7, 1) == 0  # no whole word
    kernels.fill(p, 1024, 5)  # the resource is still usable after all of that
    assert kernels.check(p, 1024, 5) == 0
    resource.deallocate(p, 1024)
    with pytest.raises(streampool.InvalidPointerError):
        kernels.fill(p, 1024, 1)  # freed: use after free


def test_bad_devices_and_iterations_are_refused(sim: SimulatedDevice) -> None:
    p = mr.CudaMemoryResource().allocate(1024)
    with pytest.raises(TypeError, match="device must be a device ordinal"):
        kernels.fill(p, 64, 1, device=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device must be"):
        kernels.fill(p, 64, 1, device=1 << 40)
    with pytest.raises(streampool.InvalidArgumentError, match="device 3 does not exist"):
        kernels.fill(p, 64, 1, device=3)
    with pytest.raises(TypeError, match="iterations must be an int"):
        kernels.compute(p, 64, iterations=None)  # type: ignore[arg-type]
    with pytest.raises(streampool.InvalidStreamError) as e:
        kernels.fill(p, 64, 1, stream=0x3039)
    assert str(e.value).count("0x3039") == 1, e.value  # said once
    kernels.fill(p, 1024, 5, device=0)
    assert kernels.check(p, 1024, 5) == 0
    # A range that runs past the end of the address space (was: wrapped round to nothing).
    for ptr, size in ((p, 2**64 - 256), (2**64 - 8, 8)):
        with pytest.raises(streampool.InvalidPointerError, match="past the end of the address space"):
            kernels.check(ptr, size, 5)
    # A compute kernel's passes run as one on the simulated device (each leaves the data as
    # it was), and its modelled time is at most 10 ms: 2**32 - 1 passes do not hold the
    # device for hours.
    kernels.compute(p, 1024, iterations=2**32 - 1)
    assert kernels.check(p, 1024, 5) == 0


@pytest.mark.nosim
def test_a_kernel_runs_on_its_streams_device_and_needs_access() -> None:
    with SimulatedDevice("64MiB", devices=2) as sim:
        s1 = streampool.Stream(device=1)
        mine = mr.CudaAsyncMemoryResource(device=1).allocate(4096, s1)
        with pytest.raises(
            streampool.InvalidStreamError, match="belongs to device 1, but device=0 was given"
        ):
            kernels.fill(mine, 4096, 1, s1, device=0)
        kernels.fill(mine, 4096, 1, s1, device=1)
        # Memory of device 0's pool, which grants device 1 no access: refused, as on a GPU.
        other = mr.CudaAsyncMemoryResource(device=0).allocate(4096)
        with pytest.raises(streampool.InvalidPointerError, match="device 1 cannot access"):
            kernels.fill(other, 4096, 1, s1)
        assert kernels.check(mine, 4096, 1, s1) == 0
        sim.run()
        assert not sim.races()


@pytest.mark.gpu
def test_kernels_on_a_gpu() -> None:
    resource = mr.CudaAsyncMemoryResource()
    size = 8 << 20
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            s = streampool.Stream()
            for i in range(20):
                buf = streampool.DeviceBuffer(size=size, stream=s, mr=resource)
                # Seeds from 1: word 0 of seed 0's pattern is 0 (a hash of seed + index).
                kernels.fill(buf.ptr, size, t * 100 + i + 1, s)
                kernels.compute(buf.ptr, size, s, iterations=2)
                assert kernels.check(buf.ptr, size, t * 100 + i + 1, s) == 0
                data = bytearray(buf.tobytes())
                assert int.from_bytes(data[0:8], "little") != 0
                data[8:16] = data[0:8]
                buf.copy_from_host(bytes(data))
                assert kernels.check(buf.ptr, size, t * 100 + i + 1, s) == 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
