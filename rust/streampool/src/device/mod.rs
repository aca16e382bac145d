//! The device seam: the only place that calls the CUDA driver or simulates it.
//!
//! Everything above this module talks to a [`Backend`]: memory, the driver's
//! stream-ordered pools, streams, events, memset/memcpy and prefetch. Two
//! implementations exist:
//!
//! * [`cuda::CudaBackend`]: the CUDA driver API, loaded at run time (`libcuda.so.1`), so
//!   that this crate builds and loads on machines with no GPU; the first use on such a
//!   machine returns [`Error::DriverNotFound`].
//! * [`sim::SimDevice`]: host memory standing in for device memory, streams as queues
//!   whose work runs only when told, and a happens-before race detector.
//!
//! Handles are plain integers on the host (`u64`), as the driver's are pointers: the
//! bookkeeping above the seam needs no `unsafe`.
//!
//! Which backend new objects use is decided by [`backend()`]: the simulated device that
//! is active in this process (see [`sim::SimDevice::activate`]), else a process-wide
//! simulated device when `STREAMPOOL_DEVICE=sim` (its capacity `STREAMPOOL_SIM_CAPACITY`,
//! else [`sim::default_capacity`]), else the CUDA driver. Every object
//! remembers the backend it was made on; mixing objects of two backends is refused.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};

pub mod cuda;
pub mod sim;

/// A device address (or, for pinned and simulated memory, a host address).
pub type DevPtr = u64;
/// A stream handle as the driver sees it (`CUstream` as an integer).
pub type RawStream = u64;
/// An event handle (`CUevent` as an integer).
pub type RawEvent = u64;
/// A memory pool handle (`CUmemoryPool` as an integer).
pub type RawPool = u64;

/// The legacy default stream (`0`, which the driver also names `CU_STREAM_LEGACY` = 1).
pub const LEGACY_STREAM: RawStream = 0;
/// `CU_STREAM_LEGACY`: the same stream as handle 0.
pub const LEGACY_STREAM_ALIAS: RawStream = 1;
/// `CU_STREAM_PER_THREAD`: one different stream per host thread.
pub const PER_THREAD_STREAM: RawStream = 2;

/// Which kind of backend an object lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The CUDA driver.
    Cuda,
    /// The simulated device.
    Simulated,
}

/// What a device can do, as probed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: i32,
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// Total device memory in bytes.
    pub total_bytes: usize,
    /// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`.
    pub memory_pools: bool,
    /// Stream-ordered managed pools (CUDA 13 driver and concurrent managed access).
    pub managed_pools: bool,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
    pub concurrent_managed_access: bool,
    /// Supported IPC handle types of pools: POSIX file descriptors.
    pub posix_fd_ipc: bool,
}

/// A memory pool attribute (`CUmemPool_attribute`); all are read and written as `u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolAttr {
    /// Bytes the pool keeps reserved at a synchronisation before releasing to the OS.
    ReleaseThreshold,
    /// Bytes currently reserved (backing memory held by the pool).
    ReservedMemCurrent,
    /// High-water mark of reserved bytes.
    ReservedMemHigh,
    /// Bytes currently handed out by the pool.
    UsedMemCurrent,
    /// High-water mark of used bytes.
    UsedMemHigh,
}

/// How a pool the program creates should look (`CUmemPoolProps`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolProps {
    /// Allow exporting allocations to other processes through POSIX file descriptors.
    pub posix_fd_ipc: bool,
    /// Managed (unified) memory rather than device memory (CUDA 13 drivers only).
    pub managed: bool,
}

/// Where memory should live (`CUmemLocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// A device, by ordinal.
    Device(i32),
    /// The host.
    Host,
}

/// Advice about how managed memory will be used (`CUmem_advise`), given with
/// [`Backend::mem_advise`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Advice {
    /// `CU_MEM_ADVISE_SET_READ_MOSTLY`: mostly read, so processors that read it may keep
    /// read-only copies (the location is ignored).
    SetReadMostly,
    /// `CU_MEM_ADVISE_UNSET_READ_MOSTLY` (the location is ignored).
    UnsetReadMostly,
    /// `CU_MEM_ADVISE_SET_PREFERRED_LOCATION`: keep the pages at the location when possible.
    SetPreferredLocation,
    /// `CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION`.
    UnsetPreferredLocation,
    /// `CU_MEM_ADVISE_SET_ACCESSED_BY`: keep the pages mapped for the location, so that its
    /// accesses do not fault.
    SetAccessedBy,
    /// `CU_MEM_ADVISE_UNSET_ACCESSED_BY`.
    UnsetAccessedBy,
}

impl Advice {
    /// True for the read-mostly pair, which ignore the location.
    pub fn ignores_location(self) -> bool {
        matches!(self, Advice::SetReadMostly | Advice::UnsetReadMostly)
    }
}

/// The seam. Every method maps to one driver call (named in its doc), and on the
/// simulated device to its model of that call. `dev` is the ordinal of the device whose
/// context the call runs in.
///
/// Implementations are `Send + Sync`: any thread may call any method.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Which kind of backend this is.
    fn kind(&self) -> BackendKind;
    /// Identity of this backend instance: 0 for CUDA, a process-unique number for each
    /// simulated device. Objects remember it so that mixing backends is refused.
    fn id(&self) -> u64;
    /// Human-readable name, e.g. "CUDA driver 13.0" or "simulated device #3 (16 GiB)".
    fn describe(&self) -> String;
    /// The error every call on a backend that is gone gives (a simulated device that was
    /// exited); `Ok` while it is usable. The CUDA driver never closes. Cheap: for checks
    /// on paths that may not reach the backend otherwise (a pool's own free lists).
    fn check_open(&self) -> Result<()> {
        Ok(())
    }

    /// `cuDriverGetVersion`, e.g. 13000.
    fn driver_version(&self) -> Result<i32>;
    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<i32>;
    /// The device of the calling thread's current context, or 0 when it has none.
    fn current_device(&self) -> Result<i32>;
    /// `cuDeviceGetName`, `cuDeviceTotalMem`, `cuDeviceGetAttribute`.
    fn device_info(&self, dev: i32) -> Result<DeviceInfo>;
    /// `cuMemGetInfo`: (free, total) bytes.
    fn mem_get_info(&self, dev: i32) -> Result<(usize, usize)>;

    /// `cuMemAlloc`.
    fn mem_alloc(&self, dev: i32, bytes: usize) -> Result<DevPtr>;
    /// `cuMemFree` (waits for the whole device).
    fn mem_free(&self, dev: i32, ptr: DevPtr) -> Result<()>;
    /// `cuMemAllocManaged` with `CU_MEM_ATTACH_GLOBAL`.
    fn mem_alloc_managed(&self, dev: i32, bytes: usize) -> Result<DevPtr>;
    /// `cuMemHostAlloc` (portable).
    fn mem_host_alloc(&self, dev: i32, bytes: usize) -> Result<DevPtr>;
    /// `cuMemFreeHost` (waits for the whole device).
    fn mem_free_host(&self, dev: i32, ptr: DevPtr) -> Result<()>;

    /// `cuDeviceGetDefaultMemPool` (or `cuMemGetDefaultMemPool` for managed pools).
    fn pool_default(&self, dev: i32, managed: bool) -> Result<RawPool>;
    /// `cuDeviceGetMemPool` (or `cuMemGetMemPool` for managed pools).
    fn pool_current(&self, dev: i32, managed: bool) -> Result<RawPool>;
    /// `cuDeviceSetMemPool`.
    fn pool_set_current(&self, dev: i32, pool: RawPool) -> Result<()>;
    /// `cuMemPoolCreate`.
    fn pool_create(&self, dev: i32, props: &PoolProps) -> Result<RawPool>;
    /// `cuMemPoolDestroy`.
    fn pool_destroy(&self, dev: i32, pool: RawPool) -> Result<()>;
    /// `cuMemPoolGetAttribute`.
    fn pool_get_attr(&self, dev: i32, pool: RawPool, attr: PoolAttr) -> Result<u64>;
    /// `cuMemPoolSetAttribute`.
    fn pool_set_attr(&self, dev: i32, pool: RawPool, attr: PoolAttr, value: u64) -> Result<()>;
    /// `cuMemPoolTrimTo`.
    fn pool_trim_to(&self, dev: i32, pool: RawPool, keep_bytes: usize) -> Result<()>;
    /// `cuMemAllocFromPoolAsync`.
    fn pool_alloc_async(&self, dev: i32, pool: RawPool, bytes: usize, stream: RawStream) -> Result<DevPtr>;
    /// `cuMemFreeAsync`.
    fn free_async(&self, dev: i32, ptr: DevPtr, stream: RawStream) -> Result<()>;
    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)`: the pool `ptr` came
    /// from, or `None` for memory not from a pool.
    fn pointer_pool(&self, dev: i32, ptr: DevPtr) -> Result<Option<RawPool>>;

    /// `cuStreamCreate` (`CU_STREAM_NON_BLOCKING` unless `blocking`).
    fn stream_create(&self, dev: i32, blocking: bool) -> Result<RawStream>;
    /// `cuStreamDestroy`. Work already enqueued still runs.
    fn stream_destroy(&self, dev: i32, stream: RawStream) -> Result<()>;
    /// `cuStreamGetId`: an identity that, unlike the handle value, is never reused. For
    /// the per-thread default stream, the calling thread's.
    fn stream_id(&self, dev: i32, stream: RawStream) -> Result<u64>;
    /// The device a stream belongs to (`cuStreamGetCtx` then `cuCtxGetDevice`); an error
    /// for a handle that names no live stream, where that is detectable.
    fn stream_device(&self, stream: RawStream) -> Result<i32>;
    /// `cuStreamSynchronize`.
    fn stream_synchronize(&self, dev: i32, stream: RawStream) -> Result<()>;
    /// `cuStreamQuery`: true when all work on the stream has completed.
    fn stream_query(&self, dev: i32, stream: RawStream) -> Result<bool>;
    /// `cuStreamWaitEvent`.
    fn stream_wait_event(&self, dev: i32, stream: RawStream, event: RawEvent) -> Result<()>;
    /// `cuEventCreate` with `CU_EVENT_DISABLE_TIMING`.
    fn event_create(&self, dev: i32) -> Result<RawEvent>;
    /// `cuEventDestroy`.
    fn event_destroy(&self, dev: i32, event: RawEvent) -> Result<()>;
    /// `cuEventRecord`.
    fn event_record(&self, dev: i32, event: RawEvent, stream: RawStream) -> Result<()>;
    /// `cuEventQuery`: true when the recorded work has completed.
    fn event_query(&self, dev: i32, event: RawEvent) -> Result<bool>;
    /// `cuEventSynchronize`.
    fn event_synchronize(&self, dev: i32, event: RawEvent) -> Result<()>;
    /// `cuMemsetD8Async`.
    fn memset_d8_async(
        &self,
        dev: i32,
        ptr: DevPtr,
        value: u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()>;
    /// `cuMemcpyAsync` (unified addressing: either side may be host memory).
    ///
    /// # Safety
    /// 1. Where `dst` or `src` is host memory that the backend did not allocate, it must
    ///    stay valid (and `dst` writable) for `bytes` bytes until the copy has completed
    ///    (synchronise `stream` before releasing it).
    unsafe fn memcpy_async(
        &self,
        dev: i32,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()>;
    /// `cuMemPrefetchAsync` (the CUDA 13 form, with a location) of managed memory; other
    /// memory is the driver's `CUDA_ERROR_INVALID_VALUE`.
    fn prefetch_async(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        to: Location,
        stream: RawStream,
    ) -> Result<()>;
    /// `cuMemAdvise` (the CUDA 12.2+ form with a location, `cuMemAdvise_v2`) on managed
    /// memory; other memory is the driver's `CUDA_ERROR_INVALID_VALUE`.
    fn mem_advise(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        advice: Advice,
        location: Location,
    ) -> Result<()>;
    /// `cuMemRangeGetAttribute(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION)` of managed
    /// memory: where the whole range was last asked to be prefetched (the request, not its
    /// completion), or `None` when it never was or its parts went to different places.
    fn mem_range_last_prefetch_location(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
    ) -> Result<Option<Location>>;
    /// `cuCtxSynchronize`.
    fn ctx_synchronize(&self, dev: i32) -> Result<()>;
}

/// A shared handle to a backend.
pub type BackendRef = Arc<dyn Backend>;

static ACTIVE_SIM: Mutex<Option<Arc<sim::SimDevice>>> = Mutex::new(None);
static ENV_SIM: OnceLock<Option<Arc<sim::SimDevice>>> = OnceLock::new();

/// The backend that new objects use now (see the module docs for the order). A value of
/// `STREAMPOOL_DEVICE` that names no backend is an [`Error::InvalidArgument`] here, at the
/// first use, naming the variable, its value and the accepted values.
pub fn backend() -> Result<BackendRef> {
    if let Some(sim) = active_sim() {
        return Ok(sim);
    }
    if let Some(sim) = env_sim()? {
        return Ok(sim);
    }
    Ok(cuda::CudaBackend::get()?)
}

/// The simulated device entered with [`sim::SimDevice::activate`], if any.
pub fn active_sim() -> Option<Arc<sim::SimDevice>> {
    ACTIVE_SIM.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// True when `STREAMPOOL_DEVICE=sim` selects the simulated device for the whole process
/// (read once, at the first use: reading the environment takes a lock and a copy). False
/// for any other value, including one that names no backend ([`backend`] refuses that).
pub fn env_selects_sim() -> bool {
    matches!(env_device(), Ok(true))
}

/// What `STREAMPOOL_DEVICE` says (case-insensitive), read once: `Ok(true)` for the simulated device,
/// `Ok(false)` for the CUDA driver (`cuda`, empty or unset), the error for anything else.
fn env_device() -> &'static Result<bool> {
    static SELECTS: OnceLock<Result<bool>> = OnceLock::new();
    SELECTS.get_or_init(|| match std::env::var("STREAMPOOL_DEVICE") {
        Err(std::env::VarError::NotPresent) => Ok(false),
        Ok(v) if v.trim().is_empty() || v.trim().eq_ignore_ascii_case("cuda") => Ok(false),
        Ok(v) if v.trim().eq_ignore_ascii_case("sim") => Ok(true),
        Ok(v) => Err(bad_device_env(&format!("{v:?}"))),
        Err(std::env::VarError::NotUnicode(v)) => Err(bad_device_env(&format!("{v:?}"))),
    })
}

fn bad_device_env(value: &str) -> Error {
    Error::invalid(format!(
        "the environment variable STREAMPOOL_DEVICE is {value}, which names no backend; accepted \
         values: \"sim\" (a simulated device for the whole process), \"cuda\" (the CUDA driver, \
         as when it is unset)"
    ))
}

/// What [`backend`] gives, when that needs neither the driver's probe nor a new simulated
/// device (both are done once per process): for callers that hold Python's GIL, which
/// must not wait on anything. `None`: call [`backend`] (with the GIL released).
pub fn backend_ready() -> Option<BackendRef> {
    if let Some(sim) = active_sim() {
        return Some(sim);
    }
    match env_device() {
        Ok(true) => ENV_SIM.get()?.clone().map(|sim| sim as BackendRef),
        Ok(false) => cuda::CudaBackend::ready().map(|cuda| cuda as BackendRef),
        Err(_) => None,
    }
}

fn env_sim() -> Result<Option<Arc<sim::SimDevice>>> {
    if !env_device().clone()? {
        return Ok(None);
    }
    let capacity = match std::env::var("STREAMPOOL_SIM_CAPACITY") {
        Ok(s) => crate::size::parse_size(&s)
            .map_err(|e| Error::invalid(format!("STREAMPOOL_SIM_CAPACITY: {e}")))?,
        Err(_) => sim::default_capacity(),
    };
    Ok(ENV_SIM.get_or_init(|| Some(sim::SimDevice::new(capacity))).clone())
}

pub(crate) fn set_active_sim(sim: Option<Arc<sim::SimDevice>>) -> Result<()> {
    let mut slot = ACTIVE_SIM.lock().unwrap_or_else(|e| e.into_inner());
    if let (Some(current), Some(_)) = (slot.as_ref(), sim.as_ref()) {
        return Err(Error::invalid(format!(
            "{} is already active in this process; exit it before entering another",
            current.describe()
        )));
    }
    *slot = sim;
    Ok(())
}

/// Refuses `other` when it lives on a different backend than `mine`.
pub fn check_same_backend(mine: &BackendRef, other: &BackendRef, what: &str) -> Result<()> {
    if mine.id() == other.id() {
        Ok(())
    } else {
        Err(Error::InvalidStream(format!(
            "{what} belongs to {}, but this object was made on {}",
            other.describe(),
            mine.describe()
        )))
    }
}
