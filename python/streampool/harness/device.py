"""The device the harness runs on: the CUDA driver, else (said plainly) a simulated device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._env import simulated_device
from .._errors import CudaDriverNotFoundError, InvalidArgumentError, StreampoolError
from .._native import (
    backend_description,
    device_info,
    driver_version,
    get_current_device,
    using_simulated_device,
)
from ..sim import SimulatedDevice
from .output import human_bytes

SIMULATED_NOTE = (
    "simulated device: these figures measure the simulator on the host, not a GPU; "
    "run on a machine with a CUDA GPU for real ones"
)


@dataclass
class Device:
    """``description`` of the device; ``simulated`` (True on the simulated device, whose
    ``sim`` gives its race detector); ``reason`` why no GPU is used, if none is; ``name``
    and ``total_bytes`` of the current device, the one measured (None where the driver
    cannot say), so that a report says which GPU its figures are of."""

    description: str
    simulated: bool
    sim: SimulatedDevice | None = None
    reason: str | None = None
    name: str | None = None
    total_bytes: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "simulated": self.simulated,
            "driver_version": driver_version(),
            "note": SIMULATED_NOTE if self.simulated else None,
            "name": self.name,
            "total_bytes": self.total_bytes,
        }

    def headline(self) -> str:
        """``NAME, SIZE; description``, or the description alone where the name is not
        known: what the commands print as ``Device:`` on a GPU."""
        if self.name is None or self.total_bytes is None:
            return self.description
        return f"{self.name}, {human_bytes(self.total_bytes)}; {self.description}"


def _current() -> dict[str, Any]:
    """The current device's ``name`` and ``total_bytes`` (Device's fields); none where the
    driver cannot say."""
    try:
        info = device_info(get_current_device())
    except StreampoolError:
        return {}
    return {"name": str(info["name"]), "total_bytes": int(info["total_bytes"])}


@contextlib.contextmanager
def device(capacity_bytes: int | str | None = None) -> Iterator[Device]:
    """The CUDA device when the driver works and ``STREAMPOOL_DEVICE=sim`` is not set;
    otherwise a fresh simulated device with its race detector, of ``capacity_bytes``
    (default: ``STREAMPOOL_SIM_CAPACITY`` when set, else the simulator's default), and
    ``STREAMPOOL_SIM_DEVICES`` devices (:func:`streampool._env.simulated_device`).
    ValueError (bad usage) naming the variable when ``STREAMPOOL_DEVICE`` names no backend
    (the library's InvalidArgumentError: falling back to the simulated device would pass
    the simulator's figures off as the GPU's for a typo), or when a simulated device's
    variable holds a value the library would refuse."""
    reason = "selected by STREAMPOOL_DEVICE=sim"
    if not using_simulated_device():
        try:
            description = backend_description()
        except CudaDriverNotFoundError as e:
            reason = str(e).split(". ")[0]
        except InvalidArgumentError:
            raise  # STREAMPOOL_DEVICE names no backend: bad usage, not a driver to fall back from
        except StreampoolError as e:
            reason = f"the CUDA driver is unusable: {e}"
        else:
            yield Device(description, simulated=False, **_current())
            return
    with simulated_device(capacity_bytes) as sim:
        yield Device(sim.describe(), simulated=True, sim=sim, reason=reason, **_current())
