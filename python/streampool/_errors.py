"""The exceptions streampool raises.

The native module maps every error of the Rust core onto these classes in one place
(``rust/streampool-py/src/errors.rs``). Bad arguments raise ``ValueError`` (the core's own
checks raise :class:`InvalidArgumentError`, which is both a ``ValueError`` and a
:class:`StreampoolError`) or ``TypeError``; :class:`OutOfMemoryError` is a
``MemoryError``, as RMM users expect.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CudaDriverNotFoundError",
    "CudaError",
    "InvalidArgumentError",
    "InvalidPointerError",
    "InvalidStreamError",
    "OutOfMemoryError",
    "RMMError",
    "SimulatedDeviceActiveError",
    "StreampoolError",
    "UnsupportedError",
]


class StreampoolError(Exception):
    """Base class of the errors streampool raises (other than ``TypeError`` and plain
    ``ValueError`` for arguments of the wrong type or sign)."""


RMMError = StreampoolError
"""RMM's name for its errors' class: ``except streampool.RMMError`` (for code that had
``except rmm.RMMError``) catches every error streampool raises itself. An out-of-memory
error is also a ``MemoryError``, as RMM's are."""


class OutOfMemoryError(StreampoolError, MemoryError):
    """A resource could not meet an allocation.

    Every argument is optional (``raise OutOfMemoryError`` works, as with ``MemoryError``);
    it pickles and copies with its attributes, including notes (``add_note``).

    Attributes:
        requested: bytes asked for, or ``None`` where not given.
        available: bytes the resource that refused had free (what limited the request: a
            limit's room, a pool's room under its maximum, the device's free memory), or
            ``None`` where that is unknown (pinned host memory, the host refusing memory
            to the simulated device). The message names the limiting resource.
    """

    requested: int | None
    available: int | None

    def __init__(self, message: str = "", requested: int | None = None, available: int | None = None) -> None:
        super().__init__(message)
        self.requested = requested
        self.available = available

    def __reduce__(self) -> tuple[type[OutOfMemoryError], tuple[str, int | None, int | None], dict[str, Any]]:
        return (type(self), (str(self), self.requested, self.available), self.__dict__)


class CudaError(StreampoolError):
    """A CUDA driver call failed.

    Every argument is optional (``raise CudaError`` works); it pickles and copies with its
    attributes, including notes (``add_note``).

    Attributes:
        call: the driver function, e.g. ``"cuMemAllocFromPoolAsync"`` (``None`` when no
            call was made).
        code: the ``CUresult`` value, or ``None``.
        name: the ``CUresult`` name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``, or ``None``.
    """

    call: str | None
    code: int | None
    name: str | None

    def __init__(
        self, message: str = "", call: str | None = None, code: int | None = None, name: str | None = None
    ) -> None:
        super().__init__(message)
        self.call = call
        self.code = code
        self.name = name

    def __reduce__(
        self,
    ) -> tuple[type[CudaError], tuple[str, str | None, int | None, str | None], dict[str, Any]]:
        return (type(self), (str(self), self.call, self.code, self.name), self.__dict__)


class CudaDriverNotFoundError(CudaError):
    """No usable CUDA driver on this machine (``libcuda.so.1`` missing, ``cuInit`` failed,
    or no device). Importing streampool never raises it; the first use of a GPU resource
    does. Use :class:`streampool.sim.SimulatedDevice` (or ``STREAMPOOL_DEVICE=sim``) to run
    without a GPU. Its ``call``, ``code`` and ``name`` are ``None``; ``message`` is optional."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)

    def __reduce__(self) -> tuple[type[CudaDriverNotFoundError], tuple[str], dict[str, Any]]:  # type: ignore[override]
        return (type(self), (str(self),), self.__dict__)


class UnsupportedError(StreampoolError):
    """The driver or device lacks something the call needs (e.g. memory pools, IPC)."""


class InvalidArgumentError(StreampoolError, ValueError):
    """A bad argument that the core detected: a device that does not exist, a setting, or
    an object used outside the (closed) simulated device it was made on."""


class InvalidPointerError(StreampoolError, ValueError):
    """A pointer the resource does not own, a double free, or a size that does not match."""


class InvalidStreamError(StreampoolError, ValueError):
    """A stream that is destroyed, unknown, or of another device or backend."""


class SimulatedDeviceActiveError(StreampoolError, RuntimeError):
    """A simulated device is already active in this process; exit it before entering another."""
