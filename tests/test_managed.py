"""Managed memory on the simulated device: CudaAsyncManagedMemoryResource, prefetch and
advice on DeviceBuffer, and the one-call setup."""

from __future__ import annotations

import re

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

MAX = 2**64 - 1
ADVICE = [
    "read_mostly",
    "unset_read_mostly",
    "preferred_location",
    "unset_preferred_location",
    "accessed_by",
    "unset_accessed_by",
]


def prefetch_adaptor() -> type[mr.MemoryResource]:
    """PrefetchResourceAdaptor, or skip where it is not bound yet."""
    cls = getattr(mr, "PrefetchResourceAdaptor", None)
    if cls is None:
        pytest.skip("streampool.mr.PrefetchResourceAdaptor is not available")
    return cls  # type: ignore[no-any-return]


# --- CudaAsyncManagedMemoryResource ---------------------------------------------------


def test_no_options_use_the_current_managed_pool_with_the_maximum_threshold() -> None:
    managed = mr.CudaAsyncManagedMemoryResource()
    device = mr.CudaAsyncMemoryResource()
    assert managed.memory_kind == "managed"
    assert not managed.owns_pool
    assert managed.pool_handle != device.pool_handle
    assert managed.release_threshold == MAX
    assert isinstance(managed, mr.MemoryResource)
    assert not isinstance(managed, mr.CudaAsyncMemoryResource)
    assert "CudaAsyncManagedMemoryResource(device=0" in repr(managed)
    ptr = managed.allocate("1MiB")
    assert ptr % 256 == 0
    assert streampool._native.pointer_pool(ptr) == managed.pool_handle
    assert managed.used_bytes == 1 << 20
    managed.deallocate(ptr, "1MiB")
    managed.trim_to(0)


def test_options_make_a_managed_pool_of_its_own() -> None:
    own = mr.CudaAsyncManagedMemoryResource(initial_pool_size="8MiB", release_threshold="64MiB")
    assert own.owns_pool
    assert own.pool_handle != mr.CudaAsyncManagedMemoryResource().pool_handle
    assert own.release_threshold == 64 << 20
    assert own.reserved_bytes >= 8 << 20
    assert own.used_bytes == 0
    own.trim_to(0)
    assert own.reserved_bytes == 0
    with pytest.raises(TypeError):
        mr.CudaAsyncManagedMemoryResource(enable_ipc=True)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="initial_pool_size"):
        mr.CudaAsyncManagedMemoryResource(initial_pool_size=-1)


def test_buffers_from_the_managed_pool_round_trip() -> None:
    managed = mr.CudaAsyncManagedMemoryResource()
    s = streampool.Stream()
    payload = bytes(range(256)) * 64
    buf = streampool.DeviceBuffer.to_device(payload, stream=s, mr=managed)
    assert buf.__dlpack_device__() == (13, 0)  # kDLCUDAManaged
    assert buf.tobytes() == payload


def test_missing_requirements_are_named(sim: SimulatedDevice) -> None:
    sim.set_driver_version(12040)
    assert not streampool.device_info()["managed_pools"]
    with pytest.raises(streampool.UnsupportedError, match=r"needs a CUDA 13 driver \(found 12\.4\)"):
        mr.CudaAsyncManagedMemoryResource()
    mr.CudaAsyncMemoryResource()  # the device pool needs no CUDA 13
    sim.set_driver_version(13000)
    sim.set_concurrent_managed_access(False)
    with pytest.raises(streampool.UnsupportedError, match="needs a GPU with concurrent managed access"):
        mr.CudaAsyncManagedMemoryResource(initial_pool_size="1MiB")
    sim.set_concurrent_managed_access(True)
    mr.CudaAsyncManagedMemoryResource()


# --- DeviceBuffer.prefetch, advise, last_prefetch_location ----------------------------

MANAGED = {
    "managed": lambda: mr.ManagedMemoryResource(),
    "async_managed": lambda: mr.CudaAsyncManagedMemoryResource(),
    "async_managed_own": lambda: mr.CudaAsyncManagedMemoryResource(initial_pool_size="4MiB"),
}


@pytest.mark.parametrize("name", sorted(MANAGED))
def test_prefetch_records_where_the_memory_was_sent(name: str, sim: SimulatedDevice) -> None:
    s = streampool.Stream()
    buf = streampool.DeviceBuffer(size=1 << 20, stream=s, mr=MANAGED[name]())
    assert buf.last_prefetch_location is None
    before = sim.queued(s)
    buf.prefetch()
    assert sim.queued(s) == before + 1, "enqueued on the buffer's stream"
    assert buf.last_prefetch_location == 0
    buf.prefetch("host")
    assert buf.last_prefetch_location == "host"
    other = streampool.Stream()
    buf.prefetch(device=0, stream=other)
    assert sim.queued(other) == 1
    assert buf.last_prefetch_location == 0
    sim.write(other, buf.ptr, 4096, label="kernel after the prefetch")
    sim.run()
    assert buf.last_prefetch_location == 0


def test_every_advice_is_accepted_on_managed_memory() -> None:
    buf = streampool.DeviceBuffer(size=8192, mr=MANAGED["managed"]())
    for advice in ADVICE:
        buf.advise(advice)
        buf.advise(advice, device=0)
        buf.advise(advice, device="host")


@pytest.mark.parametrize("name", ["async_managed", "async_managed_own"])
def test_managed_pool_memory_refuses_advice_as_the_driver_does(name: str) -> None:
    # The driver (580, on an H200) answers CUDA_ERROR_NOT_SUPPORTED; the simulator too.
    buf = streampool.DeviceBuffer(size=8192, mr=MANAGED[name]())
    for advice in ADVICE:
        with pytest.raises(
            streampool.UnsupportedError,
            match=rf"does not take '{advice}' advice on memory from CudaAsyncManagedMemoryResource "
            r"\(CUDA_ERROR_NOT_SUPPORTED\)",
        ):
            buf.advise(advice, device=0)
    buf.prefetch("host")  # still usable: prefetches are taken
    assert buf.last_prefetch_location == "host"
    buf.copy_from_host(b"still usable")
    assert buf.tobytes()[:12] == b"still usable"


def test_unsetting_the_preferred_location_ignores_the_location_as_the_driver_does() -> None:
    # cuMemAdvise: "The location argument is ignored for this advice."
    buf = streampool.DeviceBuffer(size=4096, mr=MANAGED["managed"]())
    buf.advise("unset_preferred_location", device=7)
    with pytest.raises(streampool.InvalidArgumentError, match="device 7"):
        buf.advise("preferred_location", device=7)  # used there, so checked


def test_a_view_of_a_managed_pool_hands_out_managed_memory() -> None:
    # RMM's CudaAsyncManagedMemoryResource is a view of the default managed pool.
    managed = mr.CudaAsyncManagedMemoryResource()
    assert mr.CudaAsyncViewMemoryResource(managed.pool_handle).memory_kind == "managed"
    # A managed pool someone created is not recognised (the driver tells a pool's
    # allocation type only from CUDA 13.2 on): taken for device memory, as documented.
    own = mr.CudaAsyncManagedMemoryResource(initial_pool_size=0)
    assert mr.CudaAsyncViewMemoryResource(own.pool_handle).memory_kind == "device"
    view = mr.CudaAsyncViewMemoryResource(managed.pool_handle)
    buf = streampool.DeviceBuffer(size=1 << 16, mr=prefetch_adaptor()(view))
    assert buf.__dlpack_device__()[0] == 13  # kDLCUDAManaged
    assert buf.last_prefetch_location == 0  # the adaptor prefetched it
    buf.prefetch("host")
    assert buf.last_prefetch_location == "host"
    device_view = mr.CudaAsyncViewMemoryResource(mr.CudaAsyncMemoryResource().pool_handle)
    assert device_view.memory_kind == "device"


def test_bad_arguments_are_clear_errors() -> None:
    buf = streampool.DeviceBuffer(size=4096, mr=mr.ManagedMemoryResource())
    with pytest.raises(ValueError, match="unknown advice 'read_only'; expected one of 'read_mostly', "):
        buf.advise("read_only")
    with pytest.raises(ValueError, match='"host" or None'):
        buf.prefetch("gpu")
    with pytest.raises(ValueError, match=r"an int >= 0\), \"host\" or -1"):
        buf.prefetch(-2)
    with pytest.raises(TypeError, match="device must be"):
        buf.prefetch(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device must be"):
        buf.advise("accessed_by", device=True)
    with pytest.raises(streampool.InvalidArgumentError, match="device 7 does not exist"):
        buf.prefetch(7)
    with pytest.raises(streampool.InvalidArgumentError, match="device 7 does not exist"):
        buf.advise("preferred_location", device=7)
    buf.advise("read_mostly", device=7)  # the read-mostly pair ignore the location
    with pytest.raises(streampool.InvalidStreamError):
        buf.prefetch(stream=0xDEAD0)
    assert buf.last_prefetch_location is None, "nothing refused was recorded"
    buf.prefetch(-1)  # cudaCpuDeviceId, as RMM's callers pass the host
    assert buf.last_prefetch_location == "host"


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        (lambda: mr.CudaAsyncMemoryResource(), "CudaAsyncMemoryResource (device memory)"),
        (lambda: mr.CudaMemoryResource(), "CudaMemoryResource (device memory)"),
        (lambda: mr.PinnedHostMemoryResource(), "PinnedHostMemoryResource (pinned host memory)"),
    ],
)
def test_memory_that_is_not_managed_is_refused_naming_its_resource(factory: object, words: str) -> None:
    buf = streampool.DeviceBuffer(size=4096, mr=factory())  # type: ignore[operator]
    origin = re.escape(f"this buffer's memory comes from {words}")
    with pytest.raises(ValueError, match=f"advice needs managed memory; {origin}"):
        buf.advise("read_mostly")
    with pytest.raises(ValueError, match="needs managed memory"):
        _ = buf.last_prefetch_location
    buf.copy_from_host(b"still usable")
    assert buf.tobytes()[:12] == b"still usable"


def test_a_closed_buffer_is_refused() -> None:
    buf = streampool.DeviceBuffer(size=4096, mr=mr.ManagedMemoryResource())
    buf.close()
    with pytest.raises(ValueError, match="DeviceBuffer is closed"):
        buf.prefetch()
    with pytest.raises(ValueError, match="DeviceBuffer is closed"):
        buf.advise("read_mostly")
    with pytest.raises(ValueError, match="DeviceBuffer is closed"):
        _ = buf.last_prefetch_location


def test_an_empty_managed_buffer_has_nothing_to_move() -> None:
    buf = streampool.DeviceBuffer(size=0, mr=mr.ManagedMemoryResource())
    buf.prefetch()
    buf.advise("accessed_by")
    assert buf.last_prefetch_location is None


def test_through_an_adaptor_the_memory_is_still_managed() -> None:
    adaptor = prefetch_adaptor()
    stack = adaptor(mr.CudaAsyncManagedMemoryResource())
    assert stack.memory_kind == "managed"
    buf = streampool.DeviceBuffer(size=1 << 20, mr=stack)
    assert buf.last_prefetch_location == 0, "the adaptor prefetched it to the device"
    buf.prefetch("host")
    with pytest.raises(streampool.UnsupportedError, match=r"PrefetchResourceAdaptor.*NOT_SUPPORTED"):
        buf.advise("preferred_location", device="host")  # the pool's memory, as the driver says
    assert buf.last_prefetch_location == "host"


# --- streampool.setup -----------------------------------------------------------------


def test_setup_by_default_makes_the_driver_pool_current() -> None:
    chosen = streampool.setup()
    assert type(chosen) is mr.CudaAsyncMemoryResource
    assert streampool.get_current_device_resource() is chosen
    assert streampool.DeviceBuffer(size=4096).mr is chosen
    on_device = streampool.setup(device=0)
    assert streampool.get_per_device_resource(0) is on_device


def test_setup_for_larger_than_memory_prefetches_managed_pool_memory() -> None:
    adaptor = prefetch_adaptor()
    chosen = streampool.setup(larger_than_memory=True)
    assert isinstance(chosen, adaptor)
    assert type(chosen.upstream) is mr.CudaAsyncManagedMemoryResource  # type: ignore[attr-defined]
    assert streampool.get_current_device_resource() is chosen
    buf = streampool.DeviceBuffer(size=1 << 20)
    assert buf.mr is chosen
    assert buf.last_prefetch_location == 0


def test_setup_without_managed_pools_falls_back_to_managed_memory(sim: SimulatedDevice) -> None:
    adaptor = prefetch_adaptor()
    sim.set_driver_version(12080)
    chosen = streampool.setup(larger_than_memory=True, device=0)
    assert isinstance(chosen, adaptor)
    assert type(chosen.upstream) is mr.ManagedMemoryResource  # type: ignore[attr-defined]
    assert streampool.get_per_device_resource(0) is chosen
    assert streampool.DeviceBuffer(size=4096).last_prefetch_location == 0


def test_without_concurrent_managed_access_setup_picks_managed_memory_alone(sim: SimulatedDevice) -> None:
    # Windows, WSL and some Jetson boards: the driver takes no prefetch there.
    sim.set_concurrent_managed_access(False)
    chosen = streampool.setup(larger_than_memory=True)
    assert type(chosen) is mr.ManagedMemoryResource
    buf = streampool.DeviceBuffer(size=4096)
    assert buf.mr is chosen
    with pytest.raises(streampool.UnsupportedError, match="device 0 has no concurrent managed access"):
        buf.prefetch()
    with pytest.raises(streampool.UnsupportedError, match="device 0 has no concurrent managed access"):
        buf.advise("preferred_location", 0)
    with pytest.raises(streampool.UnsupportedError, match="device 0 has no concurrent managed access"):
        buf.advise("accessed_by", 0)
    buf.advise("accessed_by", "host")
    with pytest.raises(
        streampool.UnsupportedError, match="PrefetchResourceAdaptor needs a GPU with concurrent"
    ):
        mr.PrefetchResourceAdaptor(chosen)
    # The adaptor over device memory only forwards, so it is made there.
    mr.PrefetchResourceAdaptor(mr.CudaAsyncMemoryResource())


def test_setup_refuses_a_flag_that_is_not_a_bool() -> None:
    with pytest.raises(TypeError, match="larger_than_memory must be True or False"):
        streampool.setup(larger_than_memory="no")  # type: ignore[arg-type]


def test_setup_refuses_a_device_that_does_not_exist() -> None:
    with pytest.raises(ValueError, match="device 3 does not exist"):
        streampool.setup(device=3)
    with pytest.raises(ValueError, match="device 3 does not exist"):
        streampool.setup(larger_than_memory=True, device=3)
