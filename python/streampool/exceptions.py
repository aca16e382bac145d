"""The exceptions streampool raises (also available from the top-level package)."""

from __future__ import annotations

from ._errors import (
    CudaDriverNotFoundError,
    CudaError,
    InvalidArgumentError,
    InvalidPointerError,
    InvalidStreamError,
    OutOfMemoryError,
    SimulatedDeviceActiveError,
    StreampoolError,
    UnsupportedError,
)

__all__ = [
    "CudaDriverNotFoundError",
    "CudaError",
    "InvalidArgumentError",
    "InvalidPointerError",
    "InvalidStreamError",
    "OutOfMemoryError",
    "SimulatedDeviceActiveError",
    "StreampoolError",
    "UnsupportedError",
]
