//! The CUDA driver backend: [`CudaBackend`].
//!
//! # Loading and the probe
//!
//! `libcuda` is loaded at run time (cudarc's `dynamic-loading`), so this crate builds
//! and loads on machines with no GPU, driver or toolkit. [`CudaBackend::get`] probes the
//! driver once per process: library present, every symbol this backend calls
//! unconditionally present, `cuInit(0)`, `cuDriverGetVersion`, `cuDeviceGetCount` (zero
//! devices is a failure), and per device its name, total memory and three attributes
//! (memory pools, concurrent managed access, pool IPC handle types). Any failure is
//! [`Error::DriverNotFound`] with a plain reason, and is remembered: later calls return
//! the same error at once. Nothing here prints or panics.
//!
//! Symbols that older drivers lack (`cuStreamGetId` 12.0, `cuMemPrefetchAsync_v2` and
//! `cuMemAdvise_v2` 12.2, `cuStreamGetDevice` 12.8, `cuMemGetMemPool`/`cuMemGetDefaultMemPool` 13.0) are looked
//! up once by the probe; a call that needs a missing one returns
//! [`Error::Unsupported`] naming the driver version it needs and the one found, instead
//! of reaching cudarc's panic for a missing symbol. So are the virtual memory management
//! calls (`VMM_SYMBOLS`): a library without them still loads, and only the `vmm_` calls
//! are refused.
//!
//! # Contexts
//!
//! Each device's primary context is retained on first use and never released: at
//! process exit the driver may already be torn down, and releasing then would fail or
//! crash. Every call that needs a context makes the device's primary context current on
//! the calling thread if another one is current, and restores the caller's afterwards (a
//! guard, as RMM's PyTorch hook does), so callers that manage their own contexts find
//! theirs unchanged. A thread with no current context keeps device 0's primary one, as
//! the runtime API (and so PyTorch, CuPy and Numba) would give it; after work on another
//! device it has none again, so that allocating on device 1 never changes which device a
//! thread calls current. Any thread may so use any device without managing contexts.
//! When the primary context is current this costs one `cuCtxGetCurrent`. Calls that need
//! no context (device queries, pool attributes, `stream_device`) do not touch the current
//! context.
//!
//! # Handles
//!
//! Handles cross the seam as integers: a stream, event, pool or context handle is the
//! driver's pointer value, 0 is the legacy default stream and 2 is `CU_STREAM_PER_THREAD`.
//! The driver reports many stale handles as errors, but not all, and a value that was
//! never a handle can crash the process inside the driver (driver 580 segfaults in
//! `cuStreamGetDevice` for `0xdead0000`). So a borrowed stream handle cannot be
//! *validated* here, only asked about; objects above the seam own their handles so that
//! safe code passes only live ones.
//!
//! # Edge cases, as driver 580 (CUDA 13.0) behaves
//!
//! * `mem_alloc(0)` fails with `CUDA_ERROR_INVALID_VALUE`; `pool_alloc_async(0)` returns
//!   0; `mem_free(0)` and `free_async(0)` succeed. Resources handle size 0 themselves.
//! * `pointer_pool` is `None` for `cuMemAlloc` and `cuMemAllocManaged` memory and an
//!   error (`CUDA_ERROR_INVALID_VALUE`) for pointers the driver does not know.

mod raw;

use std::collections::HashSet;
use std::ffi::{c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::panic::catch_unwind;
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;

use super::{
    Advice, Backend, BackendKind, DevPtr, DeviceInfo, Location, PoolAttr, PoolProps, PtrExportData, RawEvent,
    RawFunction, RawModule, RawPool, RawStream, RawVmm, LEGACY_STREAM, LEGACY_STREAM_ALIAS,
    PER_THREAD_STREAM,
};
use crate::error::{Error, Result, CUDA_ERROR_INVALID_CONTEXT};

/// Symbols this backend calls without asking: all exported by every driver since CUDA
/// 11.3 (the stream-ordered pools and their IPC attribute are the newest). The probe
/// refuses a library that lacks one, so no call below reaches cudarc's panic for a
/// missing symbol. Names are the ones cudarc's wrappers load.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuGetErrorName",
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocManaged",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemsetD8Async",
    "cuMemcpyAsync",
    "cuPointerGetAttribute",
    "cuMemGetAddressRange_v2",
    "cuMemRangeGetAttribute",
    "cuDeviceGetDefaultMemPool",
    "cuDeviceGetMemPool",
    "cuDeviceSetMemPool",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolGetAttribute",
    "cuMemPoolSetAttribute",
    "cuMemPoolTrimTo",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemPoolExportToShareableHandle",
    "cuMemPoolImportFromShareableHandle",
    "cuMemPoolExportPointer",
    "cuMemPoolImportPointer",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamGetCtx",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    // Several devices.
    "cuDeviceCanAccessPeer",
    "cuCtxEnablePeerAccess",
    "cuMemPoolSetAccess",
    "cuMemPoolGetAccess",
    "cuMemcpyPeerAsync",
];

/// The virtual memory management calls (`Backend::vmm_*`), all or none of which a driver
/// exports. Every driver this backend loads has them (CUDA 10.2); they are still looked up
/// rather than required, so that a library lacking them loads and refuses only those calls.
const VMM_SYMBOLS: &[&str] = &[
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemRelease",
];

/// The first driver version with managed (unified) stream-ordered pools.
const MANAGED_POOLS_VERSION: i32 = 13000;

/// Symbols newer than [`REQUIRED_SYMBOLS`], found (or not) once by the probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OptionalSymbols {
    /// `cuStreamGetId` (CUDA 12.0).
    stream_get_id: bool,
    /// `cuMemPrefetchAsync_v2` (CUDA 12.2).
    prefetch_v2: bool,
    /// `cuMemAdvise_v2` (CUDA 12.2).
    advise_v2: bool,
    /// `cuStreamGetDevice` (CUDA 12.8).
    stream_get_device: bool,
    /// `cuMemGetMemPool` and `cuMemGetDefaultMemPool` (CUDA 13.0).
    managed_pool_queries: bool,
    /// Every one of [`VMM_SYMBOLS`] (CUDA 10.2).
    vmm: bool,
}

/// The CUDA driver, probed once per process (see the module docs).
///
/// Obtain it with [`CudaBackend::get`]; use it through [`Backend`]. All methods may be
/// called from any thread.
#[derive(Debug)]
pub struct CudaBackend {
    driver_version: i32,
    devices: Vec<Device>,
    symbols: OptionalSymbols,
    /// Handles of streams this backend destroyed (and has not handed out again, nor seen
    /// vouched for by another library: `stream_vouched`). The driver cannot check a handle
    /// (it dereferences it), so a destroyed one is refused here rather than crashing the
    /// process; a made-up value cannot be caught at all.
    destroyed_streams: Mutex<HashSet<RawStream>>,
}

/// Beyond this many remembered destroyed handles, forget them (detection is best effort).
const MAX_DESTROYED_STREAMS: usize = 1 << 16;

#[derive(Debug)]
struct Device {
    /// `CUdevice` from `cuDeviceGet` (in practice equal to the ordinal, but not promised).
    handle: sys::CUdevice,
    info: DeviceInfo,
    /// The retained primary context's address, set on first use. (`CUcontext` is a raw
    /// pointer, neither `Send` nor `Sync`; the context itself may be used from any thread.)
    primary: OnceLock<usize>,
}

static CUDA: OnceLock<Result<Arc<CudaBackend>>> = OnceLock::new();

impl CudaBackend {
    /// The process-wide CUDA backend, probing the driver on first call.
    ///
    /// Returns [`Error::DriverNotFound`] when `libcuda` cannot be loaded, is too old,
    /// `cuInit` fails or there is no device; the outcome of the first probe is kept, so
    /// later calls return the same backend or the same error without probing again.
    pub fn get() -> Result<Arc<CudaBackend>> {
        CUDA.get_or_init(|| match catch_unwind(probe) {
            Ok(probed) => probed.map(Arc::new),
            // Not expected (the probe checks what cudarc would panic on); caught so that a
            // surprise in the library never unwinds into callers (or across FFI).
            Err(_) => {
                Err(not_found("the CUDA driver library could not be used (it failed while being probed)"))
            }
        })
        .clone()
    }

    /// The driver, when it was probed already and found usable.
    pub fn ready() -> Option<Arc<CudaBackend>> {
        CUDA.get()?.as_ref().ok().cloned()
    }

    fn device(&self, dev: i32) -> Result<&Device> {
        usize::try_from(dev).ok().and_then(|i| self.devices.get(i)).ok_or_else(|| {
            Error::invalid(format!(
                "CUDA device {dev} does not exist ({})",
                device_count_words(self.devices.len())
            ))
        })
    }

    /// The ordinal of a `CUdevice` handle the driver returned.
    fn ordinal_of(&self, handle: sys::CUdevice) -> i32 {
        self.devices.iter().position(|d| d.handle == handle).map_or(handle, |i| i as i32)
    }

    /// The device's primary context, retained on first use and never released.
    fn primary_ctx(&self, device: &Device) -> Result<sys::CUcontext> {
        if let Some(&ctx) = device.primary.get() {
            return Ok(ctx as sys::CUcontext);
        }
        // SAFETY: a `CudaBackend` exists, so the driver is loaded and initialised with this
        // symbol; `device.handle` came from `cuDeviceGet`.
        let ctx = unsafe { raw::device_primary_ctx_retain(device.handle) }?;
        // Two threads may both retain here. The driver counts retains and hands both the
        // same context; as none is ever released, the extra count costs nothing.
        let _ = device.primary.set(ctx as usize);
        Ok(ctx)
    }

    /// Asks `ask` of `stream`. A stream's handle names its context, so for a stream of its
    /// own no context is made current first (the C entry points ask at every call, and
    /// that would cost a `cuCtxGetCurrent` more); should a driver want one, or for a
    /// default stream handle (which refers to the current context's), `ask` is called
    /// with `dev`'s context current.
    fn ask_stream<T>(
        &self,
        dev: i32,
        stream: RawStream,
        ask: impl Fn(sys::CUstream) -> Result<T>,
    ) -> Result<T> {
        if !is_default_stream(stream) {
            match ask(cu_stream(stream)) {
                Err(Error::Driver { code: CUDA_ERROR_INVALID_CONTEXT, .. }) => {}
                done => return done,
            }
        }
        let _ctx = self.enter(dev)?;
        ask(cu_stream(stream))
    }

    /// Makes `dev`'s primary context current on this thread until the guard drops.
    fn enter(&self, dev: i32) -> Result<CtxGuard> {
        let device = self.device(dev)?;
        self.enter_device(device)
    }

    fn enter_device(&self, device: &Device) -> Result<CtxGuard> {
        crate::device::check_not_forked()?;
        let primary = self.primary_ctx(device)?;
        // SAFETY: loaded and initialised (a `CudaBackend` exists).
        let current = unsafe { raw::ctx_get_current() }?;
        if current == primary {
            return Ok(CtxGuard { restore: None });
        }
        // SAFETY: loaded and initialised; `primary` is live (retained, never released).
        unsafe { raw::ctx_set_current(primary) }?;
        // A thread with no context keeps device 0's primary one, as the runtime API would
        // give it (so later calls on it cost one `cuCtxGetCurrent`); another context is
        // restored, and so is "none" after work on another device: allocating on device 1
        // must not make device 1 the thread's current device (what `current_device`, and
        // so the current resource, go by).
        let restore = match (current.is_null(), device.info.ordinal) {
            (true, 0) => None,
            _ => Some(current),
        };
        Ok(CtxGuard { restore })
    }

    /// `what` ends with its verb: "managed memory pools need".
    fn unsupported(&self, what: &str, needs: &str) -> Error {
        Error::Unsupported(format!(
            "{what} a CUDA {needs} driver (found {})",
            version_string(self.driver_version)
        ))
    }

    fn require_pools(&self, dev: i32, device: &Device) -> Result<()> {
        if device.info.memory_pools {
            Ok(())
        } else {
            Err(Error::Unsupported(format!(
                "CUDA device {dev} ({}) does not support stream-ordered memory pools",
                device.info.name
            )))
        }
    }

    fn require_vmm_symbols(&self) -> Result<()> {
        if self.symbols.vmm {
            return Ok(());
        }
        Err(Error::Unsupported(format!(
            "virtual memory management needs {}, which this CUDA driver's library ({}) lacks",
            VMM_SYMBOLS.join(", "),
            version_string(self.driver_version)
        )))
    }

    fn require_managed_pools(&self, dev: i32, device: &Device) -> Result<()> {
        if device.info.managed_pools {
            return Ok(());
        }
        self.require_pools(dev, device)?;
        if self.driver_version < MANAGED_POOLS_VERSION || !self.symbols.managed_pool_queries {
            return Err(self.unsupported("managed memory pools need", "13"));
        }
        Err(Error::Unsupported(format!(
            "managed memory pools need concurrent managed access, which CUDA device {dev} ({}) lacks",
            device.info.name
        )))
    }
}

/// Restores the calling thread's previous current context on drop, when
/// [`CudaBackend::enter`] replaced it. Holds a raw pointer, so it is neither `Send` nor
/// `Sync`: it is dropped on the thread that made it.
#[must_use = "the context is restored when the guard drops; bind it to a variable"]
struct CtxGuard {
    /// `Some(previous)` when the primary context replaced another context (or none, which
    /// is null) for the call.
    restore: Option<sys::CUcontext>,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.restore.take() {
            // SAFETY: loaded and initialised (the guard comes from a `CudaBackend`);
            // `previous` was current on this thread when the guard was made. If the caller destroyed
            // it meanwhile, that is their bug; nothing here can report a failure.
            let _ = unsafe { raw::ctx_set_current(previous) };
        }
    }
}

fn probe() -> Result<CudaBackend> {
    const NO_LIBRARY: &str = "libcuda.so.1 could not be loaded";
    // SAFETY: loading libcuda runs the NVIDIA driver's initialisers, which is what using
    // the CUDA driver means.
    if !unsafe { raw::library_present() } {
        return Err(not_found(NO_LIBRARY));
    }
    // SAFETY: as above; `library_present` just found a loadable candidate, so cudarc's
    // loader (same names, same order) succeeds.
    if !unsafe { raw::load_library() } {
        return Err(not_found(NO_LIBRARY));
    }
    // SAFETY: the library is loaded (`load_library` returned true).
    let has = |name: &str| unsafe { raw::has_symbol(name) };
    let missing: Vec<&str> = REQUIRED_SYMBOLS.iter().copied().filter(|name| !has(name)).collect();
    if !missing.is_empty() {
        let found = if has("cuDriverGetVersion") {
            // SAFETY: loaded with the symbol; this call needs no `cuInit`.
            unsafe { raw::driver_get_version() }
                .map(|v| format!(" ({})", version_string(v)))
                .unwrap_or_default()
        } else {
            String::new()
        };
        return Err(not_found(format!(
            "the CUDA driver{found} is too old: libcuda lacks {}",
            missing.join(", ")
        )));
    }
    // SAFETY: loaded, and `cuGetErrorName` is among the symbols just checked.
    unsafe { raw::enable_driver_error_names() };
    // SAFETY: loaded, and the symbol is present.
    unsafe { raw::init() }.map_err(|e| match e {
        // The driver is there, but every GPU is hidden from it, or there is none.
        Error::Driver { code: CUDA_ERROR_NO_DEVICE, .. } => not_found(no_device()),
        e => not_found(e.to_string()),
    })?;
    // SAFETY: loaded and initialised, symbols present (for these two calls).
    let driver_version = unsafe { raw::driver_get_version() }.map_err(|e| not_found(e.to_string()))?;
    // SAFETY: as above.
    let count = unsafe { raw::device_get_count() }.map_err(|e| not_found(e.to_string()))?;
    if count <= 0 {
        return Err(not_found(no_device()));
    }
    let symbols = OptionalSymbols {
        stream_get_id: has("cuStreamGetId"),
        prefetch_v2: has("cuMemPrefetchAsync_v2"),
        advise_v2: has("cuMemAdvise_v2"),
        stream_get_device: has("cuStreamGetDevice"),
        managed_pool_queries: has("cuMemGetMemPool") && has("cuMemGetDefaultMemPool"),
        vmm: VMM_SYMBOLS.iter().all(|name| has(name)),
    };
    let devices = (0..count)
        .map(|ordinal| {
            probe_device(ordinal, driver_version, symbols)
                .map_err(|e| not_found(format!("probing CUDA device {ordinal}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    crate::device::watch_fork();
    Ok(CudaBackend { driver_version, devices, symbols, destroyed_streams: Mutex::default() })
}

fn probe_device(ordinal: i32, driver_version: i32, symbols: OptionalSymbols) -> Result<Device> {
    // SAFETY: called by `probe` once the driver is loaded and initialised with every
    // required symbol.
    let handle = unsafe { raw::device_get(ordinal) }?;
    let attribute = |attr: sys::CUdevice_attribute| {
        // SAFETY: as above; `handle` came from `cuDeviceGet`.
        unsafe { raw::device_get_attribute(attr, handle) }
    };
    use sys::CUdevice_attribute as A;
    let memory_pools = attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0;
    let concurrent_managed_access = attribute(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)? != 0;
    let handle_types =
        if memory_pools { attribute(A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)? } else { 0 };
    let posix_fd_bit = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
    let posix_fd_ipc = (handle_types as u32) & posix_fd_bit != 0;
    // SAFETY: as above.
    let name = unsafe { raw::device_get_name(handle) }?;
    // SAFETY: as above.
    let total_bytes = unsafe { raw::device_total_mem(handle) }?;
    let managed_pools = driver_version >= MANAGED_POOLS_VERSION
        && symbols.managed_pool_queries
        && memory_pools
        && concurrent_managed_access;
    let info = DeviceInfo {
        ordinal,
        name,
        total_bytes,
        memory_pools,
        managed_pools,
        concurrent_managed_access,
        posix_fd_ipc,
    };
    Ok(Device { handle, info, primary: OnceLock::new() })
}

fn not_found(reason: impl Into<String>) -> Error {
    Error::DriverNotFound(reason.into())
}

/// `CUDA_ERROR_NO_DEVICE`.
const CUDA_ERROR_NO_DEVICE: i32 = 100;

/// Why a driver that loads sees no device, naming `CUDA_VISIBLE_DEVICES` when it is set
/// (empty or `-1` hides every GPU from the driver).
fn no_device() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!(
            "the CUDA driver sees no device: CUDA_VISIBLE_DEVICES is {v:?}, which hides the GPUs that \
             are not named in it (empty or -1 hides every one)"
        ),
        Err(_) => "the CUDA driver sees no device".to_string(),
    }
}

/// "13.0" for 13000, "12.4" for 12040.
fn version_string(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

fn device_count_words(count: usize) -> String {
    format!("{count} device{}", if count == 1 { "" } else { "s" })
}

fn describe(driver_version: i32, device_count: usize) -> String {
    format!("CUDA driver {} ({})", version_string(driver_version), device_count_words(device_count))
}

fn cu_stream(stream: RawStream) -> sys::CUstream {
    stream as usize as sys::CUstream
}

fn cu_event(event: RawEvent) -> sys::CUevent {
    event as usize as sys::CUevent
}

fn cu_pool(pool: RawPool) -> sys::CUmemoryPool {
    pool as usize as sys::CUmemoryPool
}

fn handle_of<T>(ptr: *mut T) -> u64 {
    ptr as usize as u64
}

fn is_default_stream(stream: RawStream) -> bool {
    matches!(stream, LEGACY_STREAM | LEGACY_STREAM_ALIAS | PER_THREAD_STREAM)
}

fn mem_location(to: Location) -> sys::CUmemLocation {
    match to {
        Location::Device(ordinal) => {
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal }
        }
        Location::Host => {
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 }
        }
    }
}

/// What `vmm_map` creates and `vmm_granularity` asks about: pinned memory on device
/// `dev`, no shareable handle types, no flags.
fn vmm_prop(dev: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: mem_location(Location::Device(dev)),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `CU_DEVICE_CPU`: the host, where the driver answers with a device.
const CU_DEVICE_CPU: i32 = -1;

fn mem_advice(advice: Advice) -> sys::CUmem_advise {
    use sys::CUmem_advise as A;
    match advice {
        Advice::SetReadMostly => A::CU_MEM_ADVISE_SET_READ_MOSTLY,
        Advice::UnsetReadMostly => A::CU_MEM_ADVISE_UNSET_READ_MOSTLY,
        Advice::SetPreferredLocation => A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
        Advice::UnsetPreferredLocation => A::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION,
        Advice::SetAccessedBy => A::CU_MEM_ADVISE_SET_ACCESSED_BY,
        Advice::UnsetAccessedBy => A::CU_MEM_ADVISE_UNSET_ACCESSED_BY,
    }
}

fn pool_attribute(attr: PoolAttr) -> sys::CUmemPool_attribute {
    use sys::CUmemPool_attribute as A;
    match attr {
        PoolAttr::ReleaseThreshold => A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        PoolAttr::ReservedMemCurrent => A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        PoolAttr::ReservedMemHigh => A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        PoolAttr::UsedMemCurrent => A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        PoolAttr::UsedMemHigh => A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
    }
}

// Every `unsafe` block below calls a function of `raw`, whose module-wide preconditions
// ("loaded" and "handles") hold as follows: a `CudaBackend` exists only after a probe that
// loaded and initialised the driver and checked every symbol called without asking
// (optional ones are checked through `self.symbols` first); handles are the caller's, as
// the seam's contract says (see the module docs). The comments name what else each call
// needs, chiefly the current context that `enter` provides.
impl CudaBackend {
    /// The device's default (`default`) or current pool of device or managed memory.
    fn device_pool(&self, dev: i32, managed: bool, default: bool) -> Result<RawPool> {
        let device = self.device(dev)?;
        let _ctx = self.enter_device(device)?;
        let pool = if managed {
            self.require_managed_pools(dev, device)?;
            let location = mem_location(Location::Device(dev));
            let kind = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED;
            if default {
                // SAFETY: the probe found `cuMemGetDefaultMemPool` (`require_managed_pools`).
                unsafe { raw::mem_get_default_mem_pool(location, kind) }?
            } else {
                // SAFETY: the probe found `cuMemGetMemPool` (`require_managed_pools`).
                unsafe { raw::mem_get_mem_pool(location, kind) }?
            }
        } else {
            self.require_pools(dev, device)?;
            if default {
                // SAFETY: `device.handle` came from `cuDeviceGet`.
                unsafe { raw::device_get_default_mem_pool(device.handle) }?
            } else {
                // SAFETY: `device.handle` came from `cuDeviceGet`.
                unsafe { raw::device_get_mem_pool(device.handle) }?
            }
        };
        Ok(handle_of(pool))
    }

    fn destroyed(&self) -> std::sync::MutexGuard<'_, HashSet<RawStream>> {
        self.destroyed_streams.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn id(&self) -> u64 {
        0
    }

    fn describe(&self) -> String {
        describe(self.driver_version, self.devices.len())
    }

    fn driver_version(&self) -> Result<i32> {
        Ok(self.driver_version)
    }

    fn device_count(&self) -> Result<i32> {
        Ok(self.devices.len() as i32)
    }

    fn current_device(&self) -> Result<i32> {
        // SAFETY: loaded and initialised.
        let ctx = unsafe { raw::ctx_get_current() }?;
        if ctx.is_null() {
            return Ok(0);
        }
        // SAFETY: loaded and initialised, and a context is current.
        let handle = unsafe { raw::ctx_get_device() }?;
        Ok(self.ordinal_of(handle))
    }

    fn device_info(&self, dev: i32) -> Result<DeviceInfo> {
        Ok(self.device(dev)?.info.clone())
    }

    fn mem_get_info(&self, dev: i32) -> Result<(usize, usize)> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current.
        unsafe { raw::mem_get_info() }
    }

    fn mem_alloc(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current.
        unsafe { raw::mem_alloc(bytes) }
    }

    fn mem_free(&self, dev: i32, ptr: DevPtr) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; that nothing uses the memory afterwards is
        // the seam's contract with its caller (the resource that owns the allocation).
        unsafe { raw::mem_free(ptr) }
    }

    fn mem_alloc_managed(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current.
        unsafe { raw::mem_alloc_managed(bytes) }
    }

    fn mem_host_alloc(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current.
        let host = unsafe { raw::mem_host_alloc(bytes) }?;
        Ok(handle_of(host))
    }

    fn mem_free_host(&self, dev: i32, ptr: DevPtr) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; that nothing uses the memory afterwards is
        // the seam's contract with its caller.
        unsafe { raw::mem_free_host(ptr as usize as *mut c_void) }
    }

    fn pool_default(&self, dev: i32, managed: bool) -> Result<RawPool> {
        self.device_pool(dev, managed, true)
    }

    fn pool_current(&self, dev: i32, managed: bool) -> Result<RawPool> {
        self.device_pool(dev, managed, false)
    }

    fn pool_set_current(&self, dev: i32, pool: RawPool) -> Result<()> {
        let device = self.device(dev)?;
        let _ctx = self.enter_device(device)?;
        // SAFETY: `device.handle` came from `cuDeviceGet`; the pool is the caller's.
        unsafe { raw::device_set_mem_pool(device.handle, cu_pool(pool)) }
    }

    fn pool_create(&self, dev: i32, props: &PoolProps) -> Result<RawPool> {
        let device = self.device(dev)?;
        if props.managed {
            self.require_managed_pools(dev, device)?;
        } else {
            self.require_pools(dev, device)?;
        }
        if props.posix_fd_ipc && !device.info.posix_fd_ipc {
            return Err(Error::Unsupported(format!(
                "CUDA device {dev} ({}) cannot export pool memory through POSIX file descriptors",
                device.info.name
            )));
        }
        let alloc_type = if props.managed {
            sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED
        } else {
            sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
        };
        let handle_types = if props.posix_fd_ipc {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        // Every field spelled out, reserved bytes zero: older drivers read `maxSize` and
        // `usage` as reserved, where zero is what they expect.
        let cu_props = sys::CUmemPoolProps {
            allocType: alloc_type,
            handleTypes: handle_types,
            location: mem_location(Location::Device(dev)),
            win32SecurityAttributes: ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        };
        let _ctx = self.enter_device(device)?;
        // SAFETY: `cu_props` is fully initialised with zero reserved bytes.
        let pool = unsafe { raw::mem_pool_create(&cu_props) }?;
        Ok(handle_of(pool))
    }

    fn pool_destroy(&self, dev: i32, pool: RawPool) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: that the caller created the pool and stops using it is the seam's
        // contract (the owning pool object calls this once, on drop).
        unsafe { raw::mem_pool_destroy(cu_pool(pool)) }
    }

    fn pool_get_attr(&self, dev: i32, pool: RawPool, attr: PoolAttr) -> Result<u64> {
        // No context: the pool carries its device. Polled for statistics, so kept cheap.
        self.device(dev)?;
        // SAFETY: every `PoolAttr` maps to an attribute whose value is a `cuuint64_t`.
        unsafe { raw::mem_pool_get_attribute_u64(cu_pool(pool), pool_attribute(attr)) }
    }

    fn pool_set_attr(&self, dev: i32, pool: RawPool, attr: PoolAttr, value: u64) -> Result<()> {
        self.device(dev)?;
        // SAFETY: every `PoolAttr` maps to an attribute whose value is a `cuuint64_t`; the
        // driver refuses writes to the counters other than resetting a high-water mark.
        unsafe { raw::mem_pool_set_attribute_u64(cu_pool(pool), pool_attribute(attr), value) }
    }

    fn pool_trim_to(&self, dev: i32, pool: RawPool, keep_bytes: usize) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: only the pool handle is needed.
        unsafe { raw::mem_pool_trim_to(cu_pool(pool), keep_bytes) }
    }

    fn pool_alloc_async(&self, dev: i32, pool: RawPool, bytes: usize, stream: RawStream) -> Result<DevPtr> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current, which default stream handles refer to.
        unsafe { raw::mem_alloc_from_pool_async(bytes, cu_pool(pool), cu_stream(stream)) }
    }

    fn free_async(&self, dev: i32, ptr: DevPtr, stream: RawStream) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; that `ptr` is a live stream-ordered
        // allocation used only in order with this free is the seam's contract.
        unsafe { raw::mem_free_async(ptr, cu_stream(stream)) }
    }

    fn vmm_granularity(&self, dev: i32) -> Result<usize> {
        let device = self.device(dev)?;
        self.require_vmm_symbols()?;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
        // SAFETY: `device.handle` came from `cuDeviceGet`.
        if unsafe { raw::device_get_attribute(attr, device.handle) }? == 0 {
            return Err(Error::Unsupported(format!(
                "CUDA device {dev} ({}) lacks virtual memory management \
                 (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)",
                device.info.name
            )));
        }
        let _ctx = self.enter_device(device)?;
        // SAFETY: the probe found the symbol (`require_vmm_symbols`); `vmm_prop` is fully
        // initialised with zero reserved bytes.
        unsafe { raw::mem_get_allocation_granularity(&vmm_prop(dev)) }
    }

    fn vmm_reserve(&self, dev: i32, bytes: usize) -> Result<DevPtr> {
        self.require_vmm_symbols()?;
        let _ctx = self.enter(dev)?;
        // SAFETY: the probe found the symbol; `dev`'s context is current.
        unsafe { raw::mem_address_reserve(bytes) }
    }

    fn vmm_free(&self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<()> {
        self.require_vmm_symbols()?;
        let _ctx = self.enter(dev)?;
        // SAFETY: the probe found the symbol; `dev`'s context is current; that nothing
        // uses the range afterwards is the seam's contract with its caller.
        unsafe { raw::mem_address_free(ptr, bytes) }
    }

    fn vmm_map(&self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<RawVmm> {
        self.require_vmm_symbols()?;
        let _ctx = self.enter(dev)?;
        // SAFETY: the probe found the symbols; `dev`'s context is current; `vmm_prop` is
        // fully initialised with zero reserved bytes; the handle is released below on
        // failure, else by `vmm_unmap`.
        let handle = unsafe { raw::mem_create(bytes, &vmm_prop(dev)) }?;
        // SAFETY: `handle` was just created for `bytes`.
        if let Err(e) = unsafe { raw::mem_map(ptr, bytes, handle) } {
            // SAFETY: created above, released once; nothing maps it.
            let _ = unsafe { raw::mem_release(handle) };
            return Err(e);
        }
        // SAFETY: `dev` is a device ordinal (`enter` checked it); `[ptr, ptr + bytes)` was
        // just mapped.
        if let Err(e) = unsafe { raw::mem_set_access(ptr, bytes, dev) } {
            // SAFETY: mapped just above and not yet accessible, so nothing uses it; the
            // handle is released once.
            let _ = unsafe { raw::mem_unmap(ptr, bytes) };
            // SAFETY: as above.
            let _ = unsafe { raw::mem_release(handle) };
            return Err(e);
        }
        Ok(handle)
    }

    fn vmm_unmap(&self, dev: i32, ptr: DevPtr, bytes: usize, handle: RawVmm) -> Result<()> {
        self.require_vmm_symbols()?;
        let _ctx = self.enter(dev)?;
        // SAFETY: the probe found the symbols; `dev`'s context is current; that nothing
        // uses the memory afterwards is the seam's contract with its caller.
        unsafe { raw::mem_unmap(ptr, bytes) }?;
        // SAFETY: that `handle` is the one `vmm_map` returned for this mapping, released
        // once, is the seam's contract (the driver cannot check it).
        unsafe { raw::mem_release(handle) }
    }

    fn pointer_pool(&self, dev: i32, ptr: DevPtr) -> Result<Option<RawPool>> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; any pointer value may be asked about.
        let pool = unsafe { raw::pointer_get_mempool(ptr) }?;
        Ok((!pool.is_null()).then(|| handle_of(pool)))
    }

    fn pointer_range(&self, dev: i32, ptr: DevPtr) -> Result<(DevPtr, usize)> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; any pointer value may be asked about.
        unsafe { raw::mem_get_address_range(ptr) }
    }

    fn pointer_device(&self, dev: i32, ptr: DevPtr) -> Result<i32> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; any pointer value may be asked about.
        unsafe { raw::pointer_get_device(ptr) }
    }

    fn stream_create(&self, dev: i32, blocking: bool) -> Result<RawStream> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; the stream belongs to it.
        let stream = unsafe { raw::stream_create(!blocking) }?;
        let handle = handle_of(stream);
        self.destroyed().remove(&handle);
        Ok(handle)
    }

    fn stream_destroy(&self, dev: i32, stream: RawStream) -> Result<()> {
        if is_default_stream(stream) {
            return Err(Error::InvalidStream(format!("default stream {stream:#x} cannot be destroyed")));
        }
        let _ctx = self.enter(dev)?;
        // SAFETY: not a default stream handle; that the caller owns it and stops using it
        // is the seam's contract (the owning `Stream` calls this once, on drop).
        unsafe { raw::stream_destroy(cu_stream(stream)) }?;
        let mut destroyed = self.destroyed();
        if destroyed.len() >= MAX_DESTROYED_STREAMS {
            destroyed.clear();
        }
        destroyed.insert(stream);
        Ok(())
    }

    fn stream_id(&self, dev: i32, stream: RawStream) -> Result<u64> {
        if !self.symbols.stream_get_id {
            return Err(self.unsupported("stream identities (cuStreamGetId) need", "12.0"));
        }
        // SAFETY: the probe found `cuStreamGetId`; a handle the caller vouches for, asked
        // as `ask_stream` says.
        self.ask_stream(dev, stream, |s| unsafe { raw::stream_get_id(s) })
    }

    fn stream_vouched(&self, stream: RawStream) {
        self.destroyed().remove(&stream);
    }

    fn stream_destroyed(&self, stream: RawStream) -> bool {
        self.destroyed().contains(&stream)
    }

    fn stream_device(&self, stream: RawStream) -> Result<i32> {
        if is_default_stream(stream) {
            return Err(Error::InvalidStream(format!(
                "default stream {stream:#x} exists on every device; it names no one device"
            )));
        }
        if self.destroyed().contains(&stream) {
            return Err(Error::InvalidStream(format!(
                "stream {stream:#x} was destroyed (by streampool); if that handle is another \
                 library's live stream now (the driver reuses handle values), pass that library's \
                 stream object rather than its handle"
            )));
        }
        let handle = if self.symbols.stream_get_device {
            // SAFETY: the probe found `cuStreamGetDevice`; not a default stream handle.
            unsafe { raw::stream_get_device(cu_stream(stream)) }?
        } else {
            // SAFETY: not a default stream handle.
            let ctx = unsafe { raw::stream_get_ctx(cu_stream(stream)) }?;
            // SAFETY: `ctx` is the live stream's context; it is popped just below.
            unsafe { raw::ctx_push_current(ctx) }?;
            // SAFETY: a context (the one just pushed) is current.
            let device = unsafe { raw::ctx_get_device() };
            // SAFETY: the top of this thread's stack is the context pushed above.
            let popped = unsafe { raw::ctx_pop_current() };
            let device = device?;
            popped?;
            device
        };
        Ok(self.ordinal_of(handle))
    }

    fn exchange_capture_mode(&self, relaxed: bool, previous: u32) -> Result<u32> {
        // SAFETY: the backend is loaded and initialised.
        unsafe { raw::exchange_capture_mode(relaxed, previous) }
    }

    fn stream_capturing(&self, dev: i32, stream: RawStream) -> Result<bool> {
        // SAFETY: a handle the caller vouches for, asked as `ask_stream` says.
        self.ask_stream(dev, stream, |s| unsafe { raw::stream_is_capturing(s) })
    }

    fn stream_synchronize(&self, dev: i32, stream: RawStream) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current, which default stream handles refer to.
        unsafe { raw::stream_synchronize(cu_stream(stream)) }
    }

    fn stream_query(&self, dev: i32, stream: RawStream) -> Result<bool> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current, which default stream handles refer to.
        unsafe { raw::stream_query(cu_stream(stream)) }
    }

    fn stream_wait_event(&self, dev: i32, stream: RawStream, event: RawEvent) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current, which default stream handles refer to.
        unsafe { raw::stream_wait_event(cu_stream(stream), cu_event(event)) }
    }

    fn event_create(&self, dev: i32) -> Result<RawEvent> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; the event belongs to it.
        let event = unsafe { raw::event_create() }?;
        Ok(handle_of(event))
    }

    fn event_destroy(&self, dev: i32, event: RawEvent) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: that the caller owns the event and stops using it is the seam's
        // contract (the owning `Event` calls this once, on drop).
        unsafe { raw::event_destroy(cu_event(event)) }
    }

    fn event_record(&self, dev: i32, event: RawEvent, stream: RawStream) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current, which default stream handles refer to.
        unsafe { raw::event_record(cu_event(event), cu_stream(stream)) }
    }

    fn event_query(&self, dev: i32, event: RawEvent) -> Result<bool> {
        let _ctx = self.enter(dev)?;
        // SAFETY: only the event handle is needed.
        unsafe { raw::event_query(cu_event(event)) }
    }

    fn event_synchronize(&self, dev: i32, event: RawEvent) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: only the event handle is needed.
        unsafe { raw::event_synchronize(cu_event(event)) }
    }

    fn memset_d8_async(
        &self,
        dev: i32,
        ptr: DevPtr,
        value: u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current, which default stream handles refer to. The
        // driver refuses ranges it did not allocate; ordering the write with other uses of
        // the memory is the seam's contract with its caller.
        unsafe { raw::memset_d8_async(ptr, value, bytes, cu_stream(stream)) }
    }

    unsafe fn memcpy_async(
        &self,
        dev: i32,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current, which default stream handles refer to; host
        // memory on either side stays valid until the copy completes (this method's
        // precondition 1), and the driver's own allocations are valid while allocated.
        unsafe { raw::memcpy_async(dst, src, bytes, cu_stream(stream)) }
    }

    fn prefetch_async(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        to: Location,
        stream: RawStream,
    ) -> Result<()> {
        if !self.symbols.prefetch_v2 {
            return Err(self.unsupported("prefetching managed memory (cuMemPrefetchAsync_v2) needs", "12.2"));
        }
        if let Location::Device(target) = to {
            self.device(target)?;
        }
        let _ctx = self.enter(dev)?;
        // SAFETY: the probe found `cuMemPrefetchAsync_v2`; `dev`'s context is current, which
        // default stream handles refer to; the driver refuses memory that is not managed.
        unsafe { raw::mem_prefetch_async(ptr, bytes, mem_location(to), cu_stream(stream)) }
    }

    fn mem_advise(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        advice: Advice,
        location: Location,
    ) -> Result<()> {
        if !self.symbols.advise_v2 {
            return Err(self.unsupported("advice on managed memory (cuMemAdvise_v2) needs", "12.2"));
        }
        // Advice that ignores the location (the read-mostly pair, unsetting the preferred
        // location): pass a valid one regardless.
        let location = if advice.ignores_location() { Location::Device(dev) } else { location };
        if let Location::Device(target) = location {
            self.device(target)?;
        }
        let _ctx = self.enter(dev)?;
        // SAFETY: the probe found `cuMemAdvise_v2`; `dev`'s context is current; the driver
        // refuses memory that is not managed.
        unsafe { raw::mem_advise(ptr, bytes, mem_advice(advice), mem_location(location)) }
    }

    fn mem_range_last_prefetch_location(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
    ) -> Result<Option<Location>> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `cuMemRangeGetAttribute` is a required symbol; `dev`'s context is current;
        // the driver refuses memory that is not managed.
        let value = unsafe { raw::mem_range_last_prefetch_location(ptr, bytes) }?;
        Ok(match value {
            CU_DEVICE_CPU => Some(Location::Host),
            v if v < 0 => None, // CU_DEVICE_INVALID: never prefetched, or not all to one place
            ordinal => Some(Location::Device(ordinal)),
        })
    }

    fn ctx_synchronize(&self, dev: i32) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current.
        unsafe { raw::ctx_synchronize() }
    }

    fn pool_export_fd(&self, dev: i32, pool: RawPool) -> Result<OwnedFd> {
        let _ctx = self.enter(dev)?;
        // SAFETY: the pool is the caller's (the seam's contract); the driver refuses one
        // without POSIX file-descriptor handles.
        let fd = unsafe { raw::mem_pool_export_to_posix_fd(cu_pool(pool)) }?;
        if fd < 0 {
            return Err(Error::Driver {
                call: "cuMemPoolExportToShareableHandle",
                code: crate::error::CUDA_ERROR_INVALID_VALUE,
                name: "CUDA_ERROR_INVALID_VALUE".into(),
                context: format!("the driver reported success but returned file descriptor {fd}"),
            });
        }
        // SAFETY: on success the driver returns a new descriptor that the caller owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn pool_import_fd(&self, dev: i32, fd: BorrowedFd<'_>) -> Result<RawPool> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; a `BorrowedFd` is open for the call.
        let pool = unsafe { raw::mem_pool_import_from_posix_fd(fd.as_raw_fd()) }?;
        Ok(handle_of(pool))
    }

    fn pool_export_pointer(&self, dev: i32, ptr: DevPtr) -> Result<PtrExportData> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; the driver reports pointers that are not
        // the start of an exportable pool's allocation.
        unsafe { raw::mem_pool_export_pointer(ptr) }
    }

    fn pool_import_pointer(&self, dev: i32, pool: RawPool, data: &PtrExportData) -> Result<DevPtr> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current; the pool is an imported one and the exporter
        // keeps the allocation alive (the seam's contract with its caller, `crate::ipc`).
        unsafe { raw::mem_pool_import_pointer(cu_pool(pool), data) }
    }

    fn module_load_data(&self, dev: i32, image: &CStr) -> Result<RawModule> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s (primary) context is current, so the module belongs to it; the
        // image is NUL-terminated.
        let module = unsafe { raw::module_load_data(image) }?;
        Ok(handle_of(module))
    }

    fn module_get_function(&self, dev: i32, module: RawModule, name: &CStr) -> Result<RawFunction> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `module` came from `module_load_data` (the seam's contract: handles are
        // the caller's), and modules are never unloaded.
        let function = unsafe { raw::module_get_function(module as usize as sys::CUmodule, name) }?;
        Ok(handle_of(function))
    }

    unsafe fn launch_kernel(
        &self,
        dev: i32,
        function: RawFunction,
        grid: u32,
        block: u32,
        params: &[u64],
        stream: RawStream,
    ) -> Result<()> {
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context, where the function's module was loaded, is current;
        // the parameters and memory are the caller's contract (this method's precondition).
        unsafe {
            raw::launch_kernel(function as usize as sys::CUfunction, grid, block, params, cu_stream(stream))
        }
    }

    // Several devices: peer access and copies between devices.

    fn device_can_access_peer(&self, dev: i32, peer: i32) -> Result<bool> {
        let (device, other) = (self.device(dev)?, self.device(peer)?);
        if dev == peer {
            // Not asked: a device is not its own peer, whatever a driver would answer.
            return Ok(false);
        }
        // SAFETY: both handles came from `cuDeviceGet`; no context needed.
        unsafe { raw::device_can_access_peer(device.handle, other.handle) }
    }

    fn ctx_enable_peer_access(&self, dev: i32, peer: i32) -> Result<()> {
        let peer_ctx = self.primary_ctx(self.device(peer)?)?;
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s primary context is current; `peer_ctx` is retained, never released.
        unsafe { raw::ctx_enable_peer_access(peer_ctx) }
    }

    fn pool_set_access(&self, dev: i32, pool: RawPool, accessor: i32, enabled: bool) -> Result<()> {
        self.device(accessor)?;
        let _ctx = self.enter(dev)?;
        // SAFETY: the pool is the caller's; `accessor` is a device ordinal (checked above).
        unsafe { raw::mem_pool_set_access(cu_pool(pool), accessor, enabled) }
    }

    fn pool_get_access(&self, dev: i32, pool: RawPool, accessor: i32) -> Result<bool> {
        self.device(accessor)?;
        let _ctx = self.enter(dev)?;
        // SAFETY: the pool is the caller's; `accessor` is a device ordinal (checked above).
        unsafe { raw::mem_pool_get_access(cu_pool(pool), accessor) }
    }

    unsafe fn memcpy_peer_async(
        &self,
        dev: i32,
        dst: DevPtr,
        dst_dev: i32,
        src: DevPtr,
        src_dev: i32,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        let dst_ctx = self.primary_ctx(self.device(dst_dev)?)?;
        let src_ctx = self.primary_ctx(self.device(src_dev)?)?;
        let _ctx = self.enter(dev)?;
        // SAFETY: `dev`'s context is current, which default stream handles refer to; both
        // contexts are retained primary ones of the devices named; the memory stays valid
        // and ordered (this method's precondition 1).
        unsafe { raw::memcpy_peer_async(dst, dst_ctx, src, src_ctx, bytes, cu_stream(stream)) }
    }
}

#[cfg(test)]
mod tests;
