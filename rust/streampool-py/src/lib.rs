//! `streampool._native`: the Python binding of the streampool crate.
//!
//! Thin, frozen `#[pyclass]` wrappers around `Arc`s of the core's `Send + Sync` types:
//!
//! * [`errors`]: the core error as a Python exception (one `match`), and the helper that
//!   releases the GIL around every call that can block;
//! * [`gil`]: the fast path's hand-over of the GIL to waiting threads;
//! * [`streams`]: `Stream`, the default streams, and the conversion behind every
//!   `stream=` argument (our streams, ints, cuda.core, PyTorch, CuPy, Numba);
//! * [`resources`]: `MemoryResource` and its subclasses, the current resource per device;
//! * [`buffer`] and [`dlpack`]: `DeviceBuffer` with the CUDA array interface and DLPack;
//! * [`adaptors`]: the adaptors (statistics, tracking, logging, limiting, failure callback,
//!   prefetch, binning, fixed-size), `CallbackMemoryResource`, and the Python callbacks
//!   they call;
//! * [`pool`]: the sharded pool, and `ArenaMemoryResource` over it;
//! * [`sim`]: the simulated device, for tests and machines without a GPU;
//! * [`capi`]: the C entry points that other libraries' allocators call (PyTorch's);
//! * [`cupy`]: CuPy's allocator function, on the C entry points' path;
//! * [`ipc`]: sharing a buffer with another process (`streampool.ipc`).
//! * [`harness`]: the harness's native parts: the fill/check/compute kernels, the log
//!   replayer and the producer/consumer pipeline.
//!
//! Importing the module never touches the driver: a machine without one imports fine and
//! raises `CudaDriverNotFoundError` at the first use of a GPU resource.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};
use streampool::device::{self, DevPtr};

mod adaptors;
mod buffer;
mod capi;
mod cupy;
mod dlpack;
mod errors;
mod gil;
mod harness;
mod ipc;
mod pool;
mod resources;
mod sim;
mod streams;

use errors::{detached, OrRaise};

/// A byte count from Python: an int >= 0, or a string such as "1GiB" (2**30) or "1GB" (10**9).
///
/// The common case, a plain non-negative int, is inlined into the caller: a `PyResult`
/// returned through memory and read back costs a store-forwarding stall.
#[inline]
pub(crate) fn size_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    match plain_int(obj).and_then(|n| usize::try_from(n).ok()) {
        Some(n) => Ok(n),
        None => any_size(obj, what),
    }
}

fn any_size(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    if let Ok(text) = obj.cast::<PyString>() {
        // The argument named, as for the other ways a size can be wrong.
        return streampool::parse_size(&text.to_cow()?)
            .map_err(|e| match e {
                streampool::Error::InvalidArgument(m) => {
                    streampool::Error::InvalidArgument(format!("{what}: {m}"))
                }
                e => e,
            })
            .or_raise(obj.py());
    }
    let int = index(obj, what, "a size in bytes (an int, or a string such as \"1GiB\")")?;
    if int.lt(0)? {
        return Err(PyValueError::new_err(format!("{what} must be >= 0, got {int}")));
    }
    int.extract::<usize>().map_err(|_| PyValueError::new_err(format!("{what} = {int} is too large")))
}

/// A whole number from Python that counts something (devices, blocks, frees): an int (or
/// any object with `__index__`, but not a bool) in `min..=max`. TypeError for anything
/// else, ValueError naming `what` and the value when out of range (where pyo3's own
/// conversion would raise OverflowError for a negative or huge int). The one conversion
/// behind every count argument of the binding; sizes in bytes take [`size_arg`].
pub(crate) fn count_arg(obj: &Bound<'_, PyAny>, what: &str, min: u64, max: u64) -> PyResult<u64> {
    let int = index(obj, what, "an int")?;
    if int.lt(min)? {
        return Err(PyValueError::new_err(format!("{what} must be >= {min}, got {int}")));
    }
    if int.gt(max)? {
        return Err(PyValueError::new_err(format!("{what} must be <= {max}, got {int}")));
    }
    int.extract::<u64>()
}

/// A device ordinal from Python (`what` names the argument): None (the current device),
/// or an int (or any object with `__index__`, but not a bool) from 0 to `i32::MAX`.
/// TypeError for anything else; ValueError naming `what`, the value and the valid range
/// (the backend's devices, where it is known already) when out of range, where pyo3's own
/// conversion would raise OverflowError. Whether the device exists is checked where the
/// backend is (an InvalidArgumentError naming the devices there are).
pub(crate) fn device_arg(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<i32>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(None) };
    ordinal(obj, what, "a device ordinal (an int) or None").map(Some)
}

/// A yes/no argument as RMM's C `bool` arguments take it (`what` names it), by the rule
/// `reinitialize`'s flags follow (`streampool._setup._flag`: True or False, a NumPy bool,
/// or the int 0 or 1; TypeError naming `what` otherwise); None (the default) is False.
pub(crate) fn flag_arg(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<bool> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(false) };
    static FLAG: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let py = obj.py();
    let flag =
        FLAG.get_or_try_init(py, || py.import("streampool._setup")?.getattr("_flag").map(Bound::unbind))?;
    flag.bind(py).call1((what, obj))?.extract()
}

/// A device ordinal from Python that must be given (None is refused: there is no
/// default), as [`device_arg`] checks it otherwise.
pub(crate) fn required_device_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i32> {
    if obj.is_none() {
        return Err(PyTypeError::new_err(format!("{what} must be a device ordinal (an int), not None")));
    }
    ordinal(obj, what, "a device ordinal (an int)")
}

fn ordinal(obj: &Bound<'_, PyAny>, what: &str, expected: &str) -> PyResult<i32> {
    let int = index(obj, what, expected)?;
    match int.extract::<i32>() {
        Ok(d) if d >= 0 => Ok(d),
        _ => {
            let range = match device::backend_ready().map(|b| (b.device_count(), b.describe())) {
                Some((Ok(n), name)) => format!("from 0 to {} (the {n} device{} of {name})", n - 1, plural(n)),
                _ => format!("from 0 to {}", i32::MAX),
            };
            Err(PyValueError::new_err(format!("{what} must be a device ordinal {range}, got {int}")))
        }
    }
}

fn plural(n: i32) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// A driver handle given as an object: `obj` itself when it is an int, else what its type's
/// `__int__` gives (the handle objects of `cuda.bindings`, `CUstream` and `CUmemoryPool`,
/// convert so); None when it has no `__int__`.
pub(crate) fn handle_int<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    if obj.is_instance_of::<PyInt>() {
        return Ok(Some(obj.clone()));
    }
    match obj.get_type().getattr_opt("__int__")? {
        Some(_) => Ok(Some(obj.call_method0("__int__")?)),
        None => Ok(None),
    }
}

/// Writes one of streampool's records to the `streampool` logger at Python's `level`
/// (`logging.ERROR`, `logging.WARNING`), through `streampool.pylibrmm.logger`, which also
/// flushes the handlers at RMM's flush level.
pub(crate) fn log_record(py: Python<'_>, level: i32, text: &str) -> PyResult<()> {
    py.import("streampool.pylibrmm.logger")?.call_method1("_emit", (level, text))?;
    Ok(())
}

/// An address from Python: an int in `0..2**64` (a plain int inlined, as in [`size_arg`]).
#[inline]
pub(crate) fn ptr_arg(obj: &Bound<'_, PyAny>) -> PyResult<DevPtr> {
    match plain_int(obj) {
        Some(p) => Ok(p),
        None => any_ptr(obj),
    }
}

fn any_ptr(obj: &Bound<'_, PyAny>) -> PyResult<DevPtr> {
    let int = index(obj, "ptr", "an address (an int)")?;
    int.extract::<DevPtr>()
        .map_err(|_| PyValueError::new_err(format!("ptr = {int} is not an address (must be in 0..2**64)")))
}

/// The value of a plain `int` (not a subclass, not a bool) in `0..=c_long::MAX`; `None` for
/// anything else, which takes the general conversion. This is every size and address the
/// hot calls get, and `PyLong_AsLongAndOverflow` reads it in a few instructions, where
/// `PyLong_AsUnsignedLongLong` goes through `_PyLong_AsByteArray` for any value of more than
/// one 30-bit digit (every device address).
#[inline]
fn plain_int(obj: &Bound<'_, PyAny>) -> Option<u64> {
    if !obj.is_exact_instance_of::<PyInt>() {
        return None;
    }
    let mut overflow = 0;
    // SAFETY: `obj` is an int, alive for the call, and the thread is attached. For an int
    // this call cannot fail: a value beyond a C long is reported in `overflow`, not raised.
    let value = unsafe { pyo3::ffi::PyLong_AsLongAndOverflow(obj.as_ptr(), &mut overflow) };
    if overflow != 0 {
        return None;
    }
    u64::try_from(value).ok()
}

/// `obj` as an int, as `operator.index` takes it: an int, or what its type's `__index__`
/// returns; None for a bool and for an object whose type has no `__index__`. An exception
/// `__index__` raises (KeyboardInterrupt too) is the caller's, as it is; an `__index__`
/// that returns something other than an int is a TypeError saying so.
pub(crate) fn as_index<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    if obj.is_instance_of::<PyBool>() {
        return Ok(None);
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(Some(obj.clone()));
    }
    // SAFETY: `obj` is a live object and the thread is attached; `PyIndex_Check` only
    // reads its type's number slots.
    if unsafe { pyo3::ffi::PyIndex_Check(obj.as_ptr()) } == 0 {
        return Ok(None);
    }
    // SAFETY: as above; `PyNumber_Index` returns a new reference (an exact int: a subclass
    // such as a bool is converted, with Python's DeprecationWarning), or NULL with the
    // exception set (the one `__index__` raised, or a TypeError for a result not an int).
    let int = unsafe { Bound::from_owned_ptr_or_err(obj.py(), pyo3::ffi::PyNumber_Index(obj.as_ptr())) }?;
    Ok(Some(int))
}

/// `operator.index(obj)`, refusing bools and naming the argument in the TypeError.
pub(crate) fn index<'py>(obj: &Bound<'py, PyAny>, what: &str, expected: &str) -> PyResult<Bound<'py, PyAny>> {
    if let Some(int) = as_index(obj)? {
        return Ok(int);
    }
    let ty = obj.get_type().fully_qualified_name()?;
    Err(PyTypeError::new_err(format!("{what} must be {expected}, not {ty}")))
}

/// Parses a byte size: "4096", "512MiB", "1.5 GiB". Binary units (powers of 1024): KiB,
/// MiB, GiB, TiB, PiB, EiB, and the bare K, M, G, T, P, E ("1G" is "1GiB", 2**30). Decimal
/// units (powers of 1000): kB, MB, GB, TB, PB, EB ("1GB" is 10**9). Case-insensitive; a
/// fraction of a byte is dropped ("1.5" is 1), as RMM's `parse_bytes` does. An int is
/// returned as it is (after checking it is >= 0).
///
/// Example::
///
///     print(streampool.parse_size("1.5 GiB"))  # 1610612736
///     print(streampool.parse_size("1GB"))  # 1000000000
#[pyfunction]
fn parse_size(size: &Bound<'_, PyAny>) -> PyResult<usize> {
    size_arg(size, "size")
}

/// What new objects run on now, e.g. "CUDA driver 13.0" or "simulated device #1 (16 GiB)".
/// Raises CudaDriverNotFoundError without a driver or an active simulated device.
#[pyfunction]
fn backend_description(py: Python<'_>) -> PyResult<String> {
    detached(py, || Ok(device::backend()?.describe()))
}

/// The driver's version (`cuDriverGetVersion`), e.g. 13000 for CUDA 13.0.
#[pyfunction]
fn driver_version(py: Python<'_>) -> PyResult<i32> {
    detached(py, || device::backend()?.driver_version())
}

/// The number of devices of the current backend.
#[pyfunction]
fn device_count(py: Python<'_>) -> PyResult<i32> {
    detached(py, || device::backend()?.device_count())
}

/// What a device can do: name, total_bytes, memory_pools, managed_pools,
/// concurrent_managed_access, posix_fd_ipc.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn device_info<'py>(py: Python<'py>, device: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyDict>> {
    let device = device_arg(device, "device")?;
    let info = detached(py, move || {
        let backend = device::backend()?;
        let device = streampool::resources::check_device(&backend, device)?;
        backend.device_info(device)
    })?;
    let d = PyDict::new(py);
    d.set_item("device", info.ordinal)?;
    d.set_item("name", info.name)?;
    d.set_item("total_bytes", info.total_bytes)?;
    d.set_item("memory_pools", info.memory_pools)?;
    d.set_item("managed_pools", info.managed_pools)?;
    d.set_item("concurrent_managed_access", info.concurrent_managed_access)?;
    d.set_item("posix_fd_ipc", info.posix_fd_ipc)?;
    Ok(d)
}

/// True when new objects run on a simulated device (one is active, or STREAMPOOL_DEVICE=sim).
#[pyfunction]
fn using_simulated_device() -> bool {
    device::active_sim().is_some() || device::env_selects_sim()
}

/// The driver pool (`CUmemoryPool` as an int) that `ptr` came from, or None for memory not
/// from a pool (`cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)`): any library's
/// pointer may be asked, to see which allocations share one pool.
#[pyfunction]
#[pyo3(signature = (ptr, device=None))]
fn pointer_pool(
    py: Python<'_>,
    ptr: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<u64>> {
    let ptr = ptr_arg(ptr)?;
    let device = device_arg(device, "device")?;
    detached(py, move || {
        let backend = device::backend()?;
        let device = streampool::resources::check_device(&backend, device)?;
        backend.pointer_pool(device, ptr)
    })
}

/// Two device arguments, both required, checked to exist on the current backend.
fn device_pair(
    py: Python<'_>,
    device: &Bound<'_, PyAny>,
    peer: &Bound<'_, PyAny>,
) -> PyResult<(device::BackendRef, i32, i32)> {
    let (device, peer) = (required_device_arg(device, "device")?, required_device_arg(peer, "peer")?);
    detached(py, move || {
        let backend = device::backend()?;
        streampool::resources::check_device(&backend, Some(device))?;
        streampool::resources::check_device(&backend, Some(peer))?;
        Ok((backend, device, peer))
    })
}

/// Whether work on `device` can access memory of `peer` directly (`cuDeviceCanAccessPeer`;
/// False for `device == peer`).
#[pyfunction]
fn device_can_access_peer(
    py: Python<'_>,
    device: &Bound<'_, PyAny>,
    peer: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let (backend, device, peer) = device_pair(py, device, peer)?;
    detached(py, move || backend.device_can_access_peer(device, peer))
}

/// Lets work on `device` access memory that `peer` allocated with `cudaMalloc`
/// (`CudaMemoryResource`): `cuCtxEnablePeerAccess` between their primary contexts. Pool
/// memory does not follow it: grant that with `CudaAsyncMemoryResource(peer_access=[...])`
/// or `set_peer_access`. Enabling it again does nothing; InvalidArgumentError naming both
/// devices when they cannot reach each other, or are the same device.
#[pyfunction]
fn enable_peer_access(py: Python<'_>, device: &Bound<'_, PyAny>, peer: &Bound<'_, PyAny>) -> PyResult<()> {
    let (backend, device, peer) = device_pair(py, device, peer)?;
    detached(py, move || {
        if device == peer {
            return Err(streampool::Error::invalid(format!(
                "device {device} and peer {peer} are the same device, which always reaches its own memory"
            )));
        }
        if !backend.device_can_access_peer(device, peer)? {
            return Err(streampool::Error::invalid(format!(
                "device {device} cannot access memory of device {peer} (the driver reports no peer path between \
                 them: cuDeviceCanAccessPeer); copy the data instead (DeviceBuffer.copy_to_device)"
            )));
        }
        backend.ctx_enable_peer_access(device, peer)
    })
}

/// Failures that happened where nobody could be told (freeing memory or destroying a
/// stream or event when its last reference went away, a resource giving its memory back,
/// clean-up after another error): `(count since the process started, the most recent
/// messages, oldest first)`. Some are expected at interpreter exit.
#[pyfunction]
fn drop_errors() -> (u64, Vec<String>) {
    let errors = streampool::drop_errors();
    (errors.count, errors.recent)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;

    m.add_class::<streams::PyStream>()?;
    m.add("DEFAULT_STREAM", streams::default_stream(py)?.clone_ref(py))?;
    m.add("LEGACY_DEFAULT_STREAM", streams::default_stream(py)?.clone_ref(py))?;
    m.add("PER_THREAD_DEFAULT_STREAM", streams::per_thread_stream(py)?.clone_ref(py))?;

    m.add_class::<resources::PyMemoryResource>()?;
    m.add_class::<resources::PyCudaAsyncMemoryResource>()?;
    m.add_class::<resources::PyCudaAsyncManagedMemoryResource>()?;
    m.add_class::<resources::PyCudaAsyncViewMemoryResource>()?;
    m.add_class::<resources::PyCudaMemoryResource>()?;
    m.add_class::<resources::PyManagedMemoryResource>()?;
    m.add_class::<resources::PyPinnedHostMemoryResource>()?;
    m.add_function(wrap_pyfunction!(resources::get_current_device_resource, m)?)?;
    m.add_function(wrap_pyfunction!(resources::set_current_device_resource, m)?)?;
    m.add_function(wrap_pyfunction!(resources::get_per_device_resource, m)?)?;
    m.add_function(wrap_pyfunction!(resources::set_per_device_resource, m)?)?;
    m.add_function(wrap_pyfunction!(resources::get_current_device, m)?)?;
    m.add_function(wrap_pyfunction!(resources::available_device_memory, m)?)?;
    m.add_function(wrap_pyfunction!(resources::_reset_device_resources, m)?)?;
    m.add_function(wrap_pyfunction!(resources::_set_profile_log, m)?)?;

    m.add_class::<adaptors::PyUpstreamResourceAdaptor>()?;
    m.add_class::<adaptors::PyStatisticsResourceAdaptor>()?;
    m.add_class::<adaptors::PyLatencyHistogramResourceAdaptor>()?;
    m.add_class::<adaptors::PyTrackingResourceAdaptor>()?;
    m.add_class::<adaptors::PyAllocationRecord>()?;
    m.add_class::<adaptors::PyLoggingResourceAdaptor>()?;
    m.add_class::<adaptors::PyLogEvent>()?;
    m.add("LOG_HEADER", streampool::adaptors::LOG_HEADER)?;
    m.add("MAX_LOG_TIME_S", streampool::adaptors::MAX_LOG_TIME_S)?;
    m.add_function(wrap_pyfunction!(adaptors::_parse_log, m)?)?;
    m.add_class::<adaptors::PyLimitingResourceAdaptor>()?;
    m.add_class::<adaptors::PyFailureCallbackResourceAdaptor>()?;
    m.add_class::<adaptors::PyPrefetchResourceAdaptor>()?;
    m.add_class::<adaptors::PyFixedSizeMemoryResource>()?;
    m.add_class::<adaptors::PyBinningMemoryResource>()?;
    m.add_class::<pool::PyShardedPool>()?;
    m.add_class::<pool::PyArenaMemoryResource>()?;
    m.add_class::<adaptors::PyCallbackMemoryResource>()?;

    m.add_class::<buffer::DeviceBuffer>()?;
    m.add_function(wrap_pyfunction!(buffer::_rebuild_device_buffer, m)?)?;

    m.add_class::<sim::PySimDevice>()?;

    m.add_class::<ipc::PyIpcImportedMemoryResource>()?;
    m.add_function(wrap_pyfunction!(ipc::_ipc_export, m)?)?;
    m.add_function(wrap_pyfunction!(harness::_kernel_fill, m)?)?;
    m.add_function(wrap_pyfunction!(harness::_kernel_check, m)?)?;
    m.add_function(wrap_pyfunction!(harness::_kernel_compute, m)?)?;
    m.add_function(wrap_pyfunction!(harness::replay, m)?)?;
    m.add_function(wrap_pyfunction!(harness::pipeline, m)?)?;
    m.add_class::<harness::PyNullMemoryResource>()?;

    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(backend_description, m)?)?;
    m.add_function(wrap_pyfunction!(driver_version, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(device_info, m)?)?;
    m.add_function(wrap_pyfunction!(using_simulated_device, m)?)?;
    m.add_function(wrap_pyfunction!(pointer_pool, m)?)?;
    m.add_function(wrap_pyfunction!(device_can_access_peer, m)?)?;
    m.add_function(wrap_pyfunction!(enable_peer_access, m)?)?;
    m.add_function(wrap_pyfunction!(drop_errors, m)?)?;
    m.add_function(wrap_pyfunction!(capi::_capi_last_error, m)?)?;
    m.add_function(wrap_pyfunction!(capi::_capture_hook_calls, m)?)?;
    m.add_function(wrap_pyfunction!(capi::_capture_hooks_open_a_region, m)?)?;
    m.add_function(wrap_pyfunction!(capi::_use_torch_out_of_memory, m)?)?;
    m.add_function(wrap_pyfunction!(capi::_torch_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(capi::_torch_reset_memory_stats, m)?)?;
    m.add_class::<cupy::CupyAllocator>()?;
    m.add_class::<cupy::CupyMemory>()?;
    m.add_function(wrap_pyfunction!(gil::_fast_path_calls, m)?)?;
    m.add("MAX_RESOURCE_DEPTH", streampool::MAX_DEPTH)?;
    Ok(())
}
