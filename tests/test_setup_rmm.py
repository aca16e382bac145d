"""RMM's initialisation API (streampool._setup) at its edges: the devices reinitialize()
configured belong to the backend they were configured on, is_initialized() answers a bool
whatever the backend's settings, and the arguments take what RMM's take (NumPy integers as
device ordinals, C bools as flags)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import streampool
from streampool import mr
from streampool.sim import SimulatedDevice

from .conftest import SIM_CAPACITY


@pytest.fixture(autouse=True)
def _forget_the_configuration() -> Iterator[None]:
    yield
    streampool._setup._configured_devices = None


class Ordinal:
    """An integer type that is not int, as NumPy's integers are: it has ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


# --- the configured devices and their backend -------------------------------------------


@pytest.mark.nosim
def test_devices_configured_under_an_exited_simulated_device_are_forgotten(tmp_path: Path) -> None:
    with SimulatedDevice(capacity_bytes=SIM_CAPACITY, devices=2):
        streampool.reinitialize(devices=[0, 1])
        assert mr.get_log_filenames() == {0: None, 1: None}
    with SimulatedDevice(capacity_bytes=SIM_CAPACITY):  # one device
        assert mr.get_log_filenames() == {0: None}
        streampool.enable_logging(tmp_path / "after.log")
        assert mr.get_log_filenames() == {0: str(tmp_path / "after.dev0.log")}
        streampool.disable_logging()
        assert type(mr.get_current_device_resource()) is mr.CudaAsyncMemoryResource
        # A reinitialize() under this device is its own again.
        streampool.reinitialize(devices=0)
        assert mr.get_log_filenames() == {0: None}


@pytest.mark.nosim
def test_the_same_backend_keeps_its_configured_devices() -> None:
    with SimulatedDevice(capacity_bytes=SIM_CAPACITY, devices=3):
        streampool.reinitialize(devices=[0, 2])
        assert mr.get_log_filenames() == {0: None, 2: None}


@pytest.mark.nosim
def test_enable_logging_that_fails_on_one_device_changes_no_device(tmp_path: Path) -> None:
    (tmp_path / "alloc.dev1.log").mkdir()  # device 1's log cannot be created
    with SimulatedDevice(capacity_bytes=SIM_CAPACITY, devices=2):
        streampool.reinitialize(devices=[0, 1])
        before = {d: mr.get_per_device_resource(d) for d in (0, 1)}
        with pytest.raises(OSError, match=r"alloc\.dev1\.log"):
            streampool.enable_logging(tmp_path / "alloc.log")
        assert {d: mr.get_per_device_resource(d) for d in (0, 1)} == before
        assert mr.get_log_filenames() == {0: None, 1: None}


# --- is_initialized ---------------------------------------------------------------------


@pytest.mark.parametrize("devices", ["0", "two", "-1"])
def test_is_initialized_is_false_when_the_backend_setting_is_refused(devices: str) -> None:
    env = dict(os.environ, STREAMPOOL_DEVICE="sim", STREAMPOOL_SIM_DEVICES=devices)
    code = "import streampool; print(repr(streampool.is_initialized()), repr(streampool.mr.is_initialized()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_is_initialized_is_true_on_a_usable_backend() -> None:
    assert streampool.is_initialized() is True


# --- devices: ints and integer types, never bools ---------------------------------------


@pytest.mark.nosim
@pytest.mark.parametrize(
    ("devices", "configured"),
    [(Ordinal(1), {1}), ([Ordinal(1)], {1}), ([0, Ordinal(1)], {0, 1})],
    ids=["index", "list-of-index", "mixed"],
)
def test_devices_take_integer_types(devices: object, configured: set[int]) -> None:
    with SimulatedDevice(capacity_bytes=SIM_CAPACITY, devices=2):
        streampool.reinitialize(pool_allocator=True, devices=devices)  # type: ignore[arg-type]
        assert type(mr.get_per_device_resource(1)) is mr.PoolMemoryResource
        assert set(mr.get_log_filenames()) == configured


@pytest.mark.nosim
def test_devices_take_numpy_integers() -> None:
    np = pytest.importorskip("numpy")
    with SimulatedDevice(capacity_bytes=SIM_CAPACITY, devices=2):
        streampool.reinitialize(devices=np.int64(1))
        assert mr.get_log_filenames() == {1: None}
        streampool.reinitialize(devices=[np.int64(1), np.uint8(0)])
        assert mr.get_log_filenames() == {1: None, 0: None}
        streampool.reinitialize(devices=np.array([0, 1]))
        assert mr.get_log_filenames() == {0: None, 1: None}


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        (True, "devices must be a device ordinal or a list of them, not bool"),
        ([False], "False is not a device ordinal"),
        (1.0, "not float"),
        (["0"], "'0' is not a device ordinal"),
        ([Ordinal(3)], "device 3 does not exist"),
    ],
)
def test_devices_refuse_bools_and_non_integers(devices: object, match: str) -> None:
    before = mr.get_current_device_resource()
    with pytest.raises((TypeError, ValueError), match=match):
        streampool.reinitialize(devices=devices)  # type: ignore[arg-type]
    assert mr.get_current_device_resource() is before


def test_devices_refuse_numpy_bools_naming_their_type() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"not numpy\.bool"):
        streampool.reinitialize(devices=np.True_)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is not a device ordinal"):
        streampool.reinitialize(devices=[np.False_])  # type: ignore[list-item]


# --- flags: RMM's C bools ---------------------------------------------------------------


@pytest.mark.parametrize(("yes", "no"), [(True, False), (1, 0)], ids=["bool", "int"])
def test_flags_take_rmms_bools(yes: object, no: object) -> None:
    streampool.reinitialize(pool_allocator=yes, managed_memory=yes, logging=no)  # type: ignore[arg-type]
    pool = mr.get_current_device_resource()
    assert type(pool) is mr.PoolMemoryResource
    assert type(pool.upstream) is mr.ManagedMemoryResource
    streampool.reinitialize(pool_allocator=no, managed_memory=no)  # type: ignore[arg-type]
    assert type(mr.get_current_device_resource()) is mr.CudaAsyncMemoryResource


def test_flags_take_numpy_bools(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    streampool.reinitialize(
        pool_allocator=np.True_, managed_memory=np.False_, logging=np.True_, log_file_name=tmp_path / "a.log"
    )
    logged = mr.get_current_device_resource()
    assert isinstance(logged, mr.LoggingResourceAdaptor)
    assert type(logged.upstream) is mr.PoolMemoryResource
    assert type(logged.upstream.upstream) is mr.CudaAsyncMemoryResource
    assert streampool.setup(larger_than_memory=np.False_) is mr.get_current_device_resource()
    assert type(streampool.setup(larger_than_memory=np.True_)) is mr.PrefetchResourceAdaptor


@pytest.mark.parametrize("value", [2, -1, "yes", None, 1.0, [True]])
def test_flags_refuse_anything_else(value: object) -> None:
    before = mr.get_current_device_resource()
    with pytest.raises(TypeError, match=r"pool_allocator must be True or False \(or 1 or 0\), not "):
        streampool.reinitialize(pool_allocator=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="larger_than_memory must be True or False"):
        streampool.setup(larger_than_memory=value)  # type: ignore[arg-type]
    assert mr.get_current_device_resource() is before


def test_resources_take_rmms_bools_for_their_flags() -> None:
    # RMM declares these C bools: any truthy object is read; streampool takes bools, NumPy
    # bools, 0 and 1, as reinitialize's flags.
    upstream = mr.CudaAsyncMemoryResource()
    for yes, no in [(True, False), (1, 0)]:
        tracked = mr.TrackingResourceAdaptor(upstream, capture_stacks=yes)  # type: ignore[arg-type]
        buf = streampool.DeviceBuffer(size=256, mr=tracked)
        assert "test_resources_take_rmms_bools" in tracked.get_outstanding_allocations_str()
        del buf
        untracked = mr.TrackingResourceAdaptor(upstream, capture_stacks=no)  # type: ignore[arg-type]
        buf = streampool.DeviceBuffer(size=256, mr=untracked)
        assert "test_resources_take_rmms_bools" not in untracked.get_outstanding_allocations_str()
        del buf
        assert mr.ArenaMemoryResource(upstream, dump_log_on_failure=yes).dump_log_on_failure is True  # type: ignore[arg-type]
        assert mr.CudaAsyncMemoryResource(enable_ipc=no).memory_kind == "device"  # type: ignore[arg-type]
    for value in (2, "yes", 1.0):
        with pytest.raises(TypeError, match=r"capture_stacks must be True or False \(or 1 or 0\), not "):
            mr.TrackingResourceAdaptor(upstream, capture_stacks=value)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="dump_log_on_failure must be True or False"):
            mr.ArenaMemoryResource(upstream, dump_log_on_failure=value)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="enable_ipc must be True or False"):
            mr.CudaAsyncMemoryResource(enable_ipc=value)  # type: ignore[arg-type]


def test_a_refused_numpy_value_is_named_with_its_module() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"logging must be .*, not np\.float64\(1\.0\) \(a numpy\.float64\)"):
        streampool.reinitialize(logging=np.float64(1.0))  # type: ignore[arg-type]
