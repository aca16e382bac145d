"""streampool: stream-ordered GPU memory.

Memory resources with RAPIDS RMM's names (:mod:`streampool.mr`), a ``DeviceBuffer`` with
the CUDA array interface and DLPack, streams from any library, the current resource of
each device, and a simulated device (:mod:`streampool.sim`) that runs everything without
a GPU and finds stream-ordering races.

Importing never touches the driver; on a machine without one, the first use of a GPU
resource raises :class:`CudaDriverNotFoundError`.
"""

from __future__ import annotations

from . import allocators, ipc, kernels, logs, mr, pylibrmm, sim, statistics
from ._errors import (
    CudaDriverNotFoundError,
    CudaError,
    InvalidArgumentError,
    InvalidPointerError,
    InvalidStreamError,
    OutOfMemoryError,
    RMMError,
    SimulatedDeviceActiveError,
    StreampoolError,
    UnsupportedError,
)
from ._native import (
    DEFAULT_STREAM,
    LEGACY_DEFAULT_STREAM,
    PER_THREAD_DEFAULT_STREAM,
    DeviceBuffer,
    Stream,
    __version__,
    backend_description,
    device_can_access_peer,
    device_count,
    device_info,
    driver_version,
    drop_errors,
    enable_peer_access,
    get_current_device,
    get_current_device_resource,
    get_per_device_resource,
    parse_size,
    pointer_pool,
    set_current_device_resource,
    set_per_device_resource,
    using_simulated_device,
)
from ._setup import (
    is_initialized,
    register_reinitialize_hook,
    reinitialize,
    setup,
    unregister_reinitialize_hook,
)
from ._types import CudaStreamFlags
from .mr import disable_logging, enable_logging, get_log_filenames
from .pylibrmm.logger import (
    flush_logger,
    get_flush_level,
    get_logging_level,
    level_enum,
    set_flush_level,
    set_logging_level,
    should_log,
)

__all__ = [
    "DEFAULT_STREAM",
    "LEGACY_DEFAULT_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "CudaDriverNotFoundError",
    "CudaError",
    "CudaStreamFlags",
    "DeviceBuffer",
    "InvalidArgumentError",
    "InvalidPointerError",
    "InvalidStreamError",
    "OutOfMemoryError",
    "RMMError",
    "SimulatedDeviceActiveError",
    "Stream",
    "StreampoolError",
    "UnsupportedError",
    "__version__",
    "allocators",
    "backend_description",
    "device_can_access_peer",
    "device_count",
    "device_info",
    "disable_logging",
    "driver_version",
    "drop_errors",
    "enable_logging",
    "enable_peer_access",
    "flush_logger",
    "get_current_device",
    "get_current_device_resource",
    "get_flush_level",
    "get_log_filenames",
    "get_logging_level",
    "get_per_device_resource",
    "ipc",
    "is_initialized",
    "kernels",
    "level_enum",
    "logs",
    "mr",
    "parse_size",
    "pointer_pool",
    "pylibrmm",
    "register_reinitialize_hook",
    "reinitialize",
    "set_current_device_resource",
    "set_flush_level",
    "set_logging_level",
    "set_per_device_resource",
    "setup",
    "should_log",
    "sim",
    "statistics",
    "unregister_reinitialize_hook",
    "using_simulated_device",
]
