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
    with pytest.raises(streampool.InvalidPointerError, match="not inside a live allocation"):
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
