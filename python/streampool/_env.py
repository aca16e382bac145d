"""The environment variables of the simulated device, read and checked for the command line.

``STREAMPOOL_SIM_CAPACITY`` (each device's memory, a size such as ``2GiB``; by default what
the host can give, at most 16 GiB) and ``STREAMPOOL_SIM_DEVICES`` (how many devices, 1 to
1024; default 1). The library reads them for ``STREAMPOOL_DEVICE=sim``; the environment
report (``streampool info``) and the harness read them here, with the library's rules,
both for ``STREAMPOOL_DEVICE=sim`` and for the simulated device they fall back on without
a CUDA driver, so that a value the library would refuse is refused there too (a ValueError
naming the variable and its value: bad usage) rather than ignored.
"""

from __future__ import annotations

import os
import re

from ._native import parse_size
from .sim import SimulatedDevice

CAPACITY = "STREAMPOOL_SIM_CAPACITY"
DEVICES = "STREAMPOOL_SIM_DEVICES"
#: The most simulated devices (the library's bound, as for ``SimulatedDevice(devices=...)``).
MAX_DEVICES = 1024


def _shown(value: str) -> str:
    """``value`` quoted; as bytes when it is not UTF-8 (the surrogates Python decodes
    undecodable bytes of the environment to would mean nothing to the reader)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return repr(os.fsencode(value))
    return repr(value)


def simulated_capacity() -> int | None:
    """``STREAMPOOL_SIM_CAPACITY`` in bytes (:func:`streampool.parse_size`); None when it is
    not set or blank (the simulator's default). ValueError naming the variable when it is
    not a size."""
    value = os.environ.get(CAPACITY)
    if value is None or not value.strip():
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeError) else str(e).removeprefix("invalid argument: ")
        raise ValueError(
            f"the environment variable {CAPACITY} is {_shown(value)}, which is not a size ({why})"
        ) from None


def simulated_devices() -> int:
    """``STREAMPOOL_SIM_DEVICES``: a whole number from 1 to 1024 (spaces around it allowed,
    as the library allows them); 1 when it is not set or blank. ValueError naming the
    variable otherwise."""
    value = os.environ.get(DEVICES)
    if value is None or not (text := value.strip()):
        return 1
    if re.fullmatch(r"[+-]?[0-9]+", text) and 1 <= int(text) <= MAX_DEVICES:
        return int(text)
    raise ValueError(
        f"the environment variable {DEVICES} is {_shown(value)}; it must be a number of devices "
        f"from 1 to {MAX_DEVICES}"
    )


def simulated_settings() -> tuple[int | None, int]:
    """``(capacity_bytes, devices)`` of the environment's simulated device:
    :func:`simulated_capacity` and :func:`simulated_devices`, both checked."""
    return simulated_capacity(), simulated_devices()


def simulated_device(capacity_bytes: int | str | None = None) -> SimulatedDevice:
    """A new simulated device (not entered) as the environment describes it: of
    ``capacity_bytes`` (default ``STREAMPOOL_SIM_CAPACITY``, else the simulator's default),
    ``STREAMPOOL_SIM_DEVICES`` devices. ValueError naming the variable when one of them
    holds a value the library would refuse; both are checked, whatever ``capacity_bytes``."""
    capacity, devices = simulated_settings()
    return SimulatedDevice(capacity if capacity_bytes is None else capacity_bytes, devices)
