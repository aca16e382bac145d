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
//! bookkeeping above the seam needs no `unsafe`. The price: the [`Backend`] methods that
//! take a handle or an address are safe functions, and hand what they are given to the
//! driver, which cannot check it. On the CUDA driver a made-up stream, event or pool
//! handle, or an address that is not the caller's device memory, is undefined behaviour
//! (the driver dereferences handles, and a memset writes where it is told), as it is in
//! C; the simulated device checks every one and refuses it. The resources, streams and
//! allocations of this crate only ever pass handles and addresses they made; code that
//! calls the seam itself, or [`Stream::borrowed`](crate::Stream::borrowed) with a handle
//! from elsewhere, must do the same. The functions whose misuse writes memory as a
//! matter of course ([`Backend::memcpy_async`], [`Backend::launch_kernel`], the
//! [`crate::kernels`]) are `unsafe fn`.
//!
//! Which backend new objects use is decided by [`backend()`]: the simulated device that
//! is active in this process (see [`sim::SimDevice::activate`]), else a process-wide
//! simulated device when `STREAMPOOL_DEVICE=sim` (its capacity per device
//! `STREAMPOOL_SIM_CAPACITY`, else [`sim::default_capacity`]; its number of devices
//! `STREAMPOOL_SIM_DEVICES`, else 1), else the CUDA driver. Every object
//! remembers the backend it was made on; mixing objects of two backends is refused.

use std::ffi::CStr;
use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};

pub mod cuda;
pub mod sim;

/// Set in a child process that `fork()` made from one whose backends were in use (see
/// [`watch_fork`]).
static FORKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Notes a `fork()` from now on (once per process): called as a backend is made. Neither
/// the CUDA driver nor a simulated device survives into a child (the driver's context does
/// not; a lock that another thread held at the fork stays held there for ever).
pub(crate) fn watch_fork() {
    extern "C" fn in_child() {
        FORKED.store(true, Ordering::Relaxed);
    }
    static WATCHING: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a handler that only stores an atomic (async-signal-safe).
    WATCHING.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(in_child));
    });
}

/// Whether this process is a child that `fork()` made from one whose backends were in use:
/// nothing of the parent's (memory, streams, pools, locks) may be used or given back here.
#[inline]
pub fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// The error every backend gives in a child of a process that used it (see [`watch_fork`]).
pub(crate) fn check_not_forked() -> Result<()> {
    if !forked() {
        return Ok(());
    }
    Err(Error::Unsupported(
        "this process was made by fork() from one that had used streampool's device, which does not \
         survive into a child (neither the CUDA driver's context nor a simulated device does): start \
         worker processes with the 'spawn' method (multiprocessing.set_start_method(\"spawn\")), or \
         fork before the first use"
            .into(),
    ))
}

/// Waits for `stream` after enqueuing on it a copy into host memory that the caller gives
/// back when this returns. Where the stream's synchronisation fails (a borrowed stream
/// destroyed meanwhile by its owner), the copy may still be queued: the whole device is
/// synchronised then, so that it has run, or, where that fails too (a context broken for
/// good), will never run. The stream's error is returned.
pub fn synchronize_after_copy(backend: &BackendRef, dev: i32, stream: RawStream) -> Result<()> {
    backend.stream_synchronize(dev, stream).inspect_err(|_| {
        let settled = backend.ctx_synchronize(dev);
        crate::error::record_if_failed(
            || "synchronising the device after a failed copy's stream".into(),
            settled,
        );
    })
}

/// A device address (or, for pinned and simulated memory, a host address).
pub type DevPtr = u64;
/// A stream handle as the driver sees it (`CUstream` as an integer).
pub type RawStream = u64;
/// An event handle (`CUevent` as an integer).
pub type RawEvent = u64;
/// A memory pool handle (`CUmemoryPool` as an integer).
pub type RawPool = u64;
/// The handle of memory mapped by [`Backend::vmm_map`] (`CUmemGenericAllocationHandle`).
pub type RawVmm = u64;
/// A loaded module handle (`CUmodule` as an integer).
pub type RawModule = u64;
/// A kernel handle (`CUfunction` as an integer).
pub type RawFunction = u64;

/// What `cuMemPoolExportPointer` writes (`CUmemPoolPtrExportData`): 64 opaque bytes that
/// name one allocation of an exported pool, to be given to `cuMemPoolImportPointer` in
/// another process.
pub type PtrExportData = [u8; PTR_EXPORT_DATA_BYTES];
/// The size of [`PtrExportData`].
pub const PTR_EXPORT_DATA_BYTES: usize = 64;

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
    /// Every advice, in the driver's order.
    pub const ALL: [Advice; 6] = [
        Advice::SetReadMostly,
        Advice::UnsetReadMostly,
        Advice::SetPreferredLocation,
        Advice::UnsetPreferredLocation,
        Advice::SetAccessedBy,
        Advice::UnsetAccessedBy,
    ];

    /// True for the advice whose location the driver ignores: the read-mostly pair and
    /// `UnsetPreferredLocation` (`cuMemAdvise`: "the location argument is ignored for this
    /// advice").
    pub fn ignores_location(self) -> bool {
        matches!(self, Advice::SetReadMostly | Advice::UnsetReadMostly | Advice::UnsetPreferredLocation)
    }

    /// The advice's name in the Python API (`DeviceBuffer.advise`) and in messages:
    /// `"read_mostly"`, `"unset_read_mostly"`, `"preferred_location"`, ...
    pub fn name(self) -> &'static str {
        match self {
            Advice::SetReadMostly => "read_mostly",
            Advice::UnsetReadMostly => "unset_read_mostly",
            Advice::SetPreferredLocation => "preferred_location",
            Advice::UnsetPreferredLocation => "unset_preferred_location",
            Advice::SetAccessedBy => "accessed_by",
            Advice::UnsetAccessedBy => "unset_accessed_by",
        }
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
    /// exited, any backend in a child process that `fork()` made after its use); `Ok` while
    /// it is usable. Cheap: for checks on paths that may not reach the backend otherwise (a
    /// pool's own free lists).
    fn check_open(&self) -> Result<()> {
        check_not_forked()
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
    /// `cuMemFree` (waits for the whole device): of `mem_alloc` and `mem_alloc_managed`
    /// memory, and of a pointer from `pool_import_pointer`. The driver takes pool memory
    /// too, without waiting for anything: its work must have completed.
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
    /// `cuMemGetAllocationGranularity` (minimum, pinned device memory on `dev`): the
    /// multiple that [`vmm_reserve`](Self::vmm_reserve) and [`vmm_map`](Self::vmm_map)
    /// sizes and addresses are of. `Error::Unsupported` where the device does not support
    /// virtual memory management (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`).
    fn vmm_granularity(&self, dev: i32) -> Result<usize>;
    /// `cuMemAddressReserve`: `bytes` (a multiple of the granularity) of address space on
    /// `dev`, with no memory behind it.
    fn vmm_reserve(&self, dev: i32, bytes: usize) -> Result<DevPtr>;
    /// `cuMemAddressFree`: a whole reservation of [`vmm_reserve`](Self::vmm_reserve), once
    /// nothing in it is mapped.
    fn vmm_free(&self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<()>;
    /// `cuMemCreate` (pinned device memory on `dev`), `cuMemMap` at `ptr` (inside a
    /// reservation, on a granularity boundary, over nothing mapped) and `cuMemSetAccess`
    /// (read and write from `dev`): `bytes` of device memory at `ptr`. Returns the
    /// memory's handle, for [`vmm_unmap`](Self::vmm_unmap). Mappings next to each other
    /// in one reservation are one range of memory: an access may span them.
    fn vmm_map(&self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<RawVmm>;
    /// `cuMemUnmap` and `cuMemRelease`: a whole mapping of [`vmm_map`](Self::vmm_map)
    /// (the same `ptr` and `bytes`), its memory given back to the device. Nothing may
    /// use the memory afterwards (the caller orders this, as for `mem_free`).
    fn vmm_unmap(&self, dev: i32, ptr: DevPtr, bytes: usize, handle: RawVmm) -> Result<()>;

    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)`: the pool `ptr` came
    /// from, or `None` for memory not from a pool.
    fn pointer_pool(&self, dev: i32, ptr: DevPtr) -> Result<Option<RawPool>>;

    /// `cuMemGetAddressRange`: the start and size of the allocation `ptr` lies in; an
    /// error for a pointer inside none.
    fn pointer_range(&self, dev: i32, ptr: DevPtr) -> Result<(DevPtr, usize)>;

    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`: the device whose
    /// context allocated `ptr` (for device and pool memory, the device it lies on); an
    /// error for a pointer the driver does not know.
    fn pointer_device(&self, dev: i32, ptr: DevPtr) -> Result<i32>;

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
    /// The caller knows `stream` to be live: another library handed it over with its
    /// stream object, or through an entry point whose contract is a live stream. A backend
    /// that refuses handles of streams it destroyed forgets this one: the driver reuses
    /// handle values, so another library's new stream may carry it.
    fn stream_vouched(&self, _stream: RawStream) {}
    /// Whether `stream` is a handle of a stream this backend destroyed (and no stream made
    /// or vouched for since carries it): work must not be enqueued on it. False where that
    /// is not known (the CUDA driver knows only the streams streampool destroyed).
    fn stream_destroyed(&self, _stream: RawStream) -> bool {
        false
    }
    /// `cuStreamIsCapturing`: whether `stream` is capturing a CUDA graph (begun and not
    /// ended, an invalidated capture included). The one question about a capturing stream
    /// that never harms its capture: asking its identity ([`stream_id`](Self::stream_id),
    /// [`stream_device`](Self::stream_device)), querying or synchronising it, or querying
    /// an event recorded in the capture invalidates the capture (CUDA_ERROR_STREAM_CAPTURE_
    /// UNSUPPORTED, 900, or CUDA_ERROR_CAPTURED_EVENT, 907, on a 13.0 driver).
    fn stream_capturing(&self, dev: i32, stream: RawStream) -> Result<bool>;
    /// `cuThreadExchangeStreamCaptureMode`: with `relaxed`, makes the calling thread's
    /// capture mode relaxed, so that the calls a capture in the global or thread-local mode
    /// forbids ("potentially unsafe": a free on another stream, a synchronous allocation)
    /// are its to make again; returns the mode it had, which a call with `relaxed` false
    /// and that value restores. The same answer (0) where a backend has no modes.
    fn exchange_capture_mode(&self, relaxed: bool, previous: u32) -> Result<u32>;
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

    // Sharing pool memory between processes (POSIX file descriptors). The rules, as the
    // driver states them: only a pool created with `PoolProps::posix_fd_ipc` can be
    // exported; the imported memory must not be used before its allocation has completed
    // in the exporting process; the importer frees its pointer (`mem_free`, which is
    // `cuMemFree`) before the exporter frees the allocation, which stays alive until then.
    // An imported pool allocates nothing; `pool_destroy` releases it.

    /// `cuMemPoolExportToShareableHandle` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`:
    /// a new file descriptor naming the pool, which the caller owns (and closes once it
    /// has been sent). The driver refuses a pool made without `posix_fd_ipc`.
    fn pool_export_fd(&self, dev: i32, pool: RawPool) -> Result<OwnedFd>;
    /// `cuMemPoolImportFromShareableHandle`: the pool that `fd` (from another process's
    /// [`Backend::pool_export_fd`], passed over a Unix socket) names, as a pool handle of
    /// this process. The descriptor stays the caller's.
    fn pool_import_fd(&self, dev: i32, fd: BorrowedFd<'_>) -> Result<RawPool>;
    /// `cuMemPoolExportPointer`: the data that names the allocation starting at `ptr` (of
    /// an exportable pool) to importers of that pool.
    fn pool_export_pointer(&self, dev: i32, ptr: DevPtr) -> Result<PtrExportData>;
    /// `cuMemPoolImportPointer`: the address, in this process, of the allocation that
    /// `data` names in the imported `pool`. Freed with [`Backend::mem_free`].
    fn pool_import_pointer(&self, dev: i32, pool: RawPool, data: &PtrExportData) -> Result<DevPtr>;

    /// `cuModuleLoadData`: loads `image` (PTX text, JIT-compiled by the driver) into
    /// `dev`'s context. Modules are never unloaded (the crate loads each once per device;
    /// see [`crate::kernels`]). The simulated device accepts PTX whose `.entry` kernels
    /// it models (streampool's own), and refuses any other.
    fn module_load_data(&self, dev: i32, image: &CStr) -> Result<RawModule>;
    /// `cuModuleGetFunction`: the kernel `name` of a loaded module.
    fn module_get_function(&self, dev: i32, module: RawModule, name: &CStr) -> Result<RawFunction>;
    /// `cuLaunchKernel` on a 1-D grid of `grid` blocks of `block` threads, no dynamic
    /// shared memory, each of `params` one 64-bit kernel parameter.
    ///
    /// # Safety
    /// 1. `params` are exactly the kernel's parameters (count and meaning), and every
    ///    address among them that the kernel touches is memory of the size it assumes, on
    ///    `dev`, ordered on `stream` (the simulated device checks this and refuses
    ///    anything else; the driver cannot).
    unsafe fn launch_kernel(
        &self,
        dev: i32,
        function: RawFunction,
        grid: u32,
        block: u32,
        params: &[u64],
        stream: RawStream,
    ) -> Result<()>;

    // Several devices: peer access and copies between devices.

    /// `cuDeviceCanAccessPeer`: whether device `dev` can access memory of device `peer`
    /// directly (false for `dev == peer`: a device is not its own peer).
    fn device_can_access_peer(&self, dev: i32, peer: i32) -> Result<bool>;
    /// `cuCtxEnablePeerAccess` from `dev`'s primary context to `peer`'s: memory `peer`
    /// allocated with `cuMemAlloc` becomes accessible to work on `dev`. Pool memory does not
    /// follow it ([`Backend::pool_set_access`] does that). Enabling it again is no error.
    fn ctx_enable_peer_access(&self, dev: i32, peer: i32) -> Result<()>;
    /// `cuMemPoolSetAccess` for one device: read-write access (`enabled`) or none, from
    /// work on device `accessor`, to the memory of `pool` (a pool of device `dev`), current
    /// and future allocations alike.
    fn pool_set_access(&self, dev: i32, pool: RawPool, accessor: i32, enabled: bool) -> Result<()>;
    /// `cuMemPoolGetAccess`: whether work on device `accessor` may read and write the memory
    /// of `pool` (a pool of device `dev`); always true for `accessor == dev`.
    fn pool_get_access(&self, dev: i32, pool: RawPool, accessor: i32) -> Result<bool>;
    /// `cuMemcpyPeerAsync` on `stream` (a stream of device `dev`): `bytes` from `src`, memory
    /// of device `src_dev`, to `dst`, memory of device `dst_dev`. Needs no peer access: the
    /// driver stages the copy through the host where the devices cannot reach each other.
    ///
    /// # Safety
    /// 1. `src` is readable and `dst` writable for `bytes` bytes until the copy has
    ///    completed, and nothing accesses `dst` unordered with the copy.
    #[allow(clippy::too_many_arguments)]
    unsafe fn memcpy_peer_async(
        &self,
        dev: i32,
        dst: DevPtr,
        dst_dev: i32,
        src: DevPtr,
        src_dev: i32,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()>;
}

/// A shared handle to a backend.
pub type BackendRef = Arc<dyn Backend>;

static ACTIVE_SIM: Mutex<Option<Arc<sim::SimDevice>>> = Mutex::new(None);
static ENV_SIM: OnceLock<Option<Arc<sim::SimDevice>>> = OnceLock::new();
/// Counts the changes of the active simulated device (see [`backend_epoch`]).
static BACKEND_EPOCH: AtomicU64 = AtomicU64::new(0);

/// A number that changes whenever what [`backend`] gives may have changed (a simulated
/// device entered or exited): callers that keep the backend (the C entry points, which
/// cannot afford [`backend`]'s lock on every call) read it with one load and look the
/// backend up again when it differs.
#[inline]
pub fn backend_epoch() -> u64 {
    BACKEND_EPOCH.load(Ordering::Acquire)
}

/// The backend that new objects use now (see the module docs for the order). A value of
/// `STREAMPOOL_DEVICE` that names no backend is an [`Error::InvalidArgument`] here, at the
/// first use, naming the variable, its value and the accepted values.
pub fn backend() -> Result<BackendRef> {
    check_not_forked()?;
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

/// The simulated device that [`backend`] gives now: the one
/// [activated](sim::SimDevice::activate), else the one `STREAMPOOL_DEVICE=sim` selects for
/// the whole process (made at the first use); `None` when [`backend`] is the CUDA driver.
/// How a program run with `STREAMPOOL_DEVICE=sim` reaches its device: to run its work
/// (a host loop polling [`crate::Event::query`] waits for ever on a device whose work
/// runs only when told, unless [`sim::SimDevice::set_eager`]) and to read its races.
///
/// ```
/// if let Some(sim) = streampool::device::simulated()? {
///     sim.set_eager(true); // work runs as soon as it may, as on a GPU
/// }
/// # Ok::<(), streampool::Error>(())
/// ```
pub fn simulated() -> Result<Option<Arc<sim::SimDevice>>> {
    match active_sim() {
        Some(active) => Ok(Some(active)),
        None => env_sim(),
    }
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
    // Read once, at the first use: the variables (and the host's memory, for the default
    // capacity) are not read again on every lookup of the backend.
    if let Some(sim) = ENV_SIM.get() {
        return Ok(sim.clone());
    }
    // Unset or blank: None, the default (as STREAMPOOL_DEVICE); set: its value, or, not
    // UTF-8, its bytes as shown in the refusal (as any other value it cannot read).
    let read = |name: &str| match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => None,
        Ok(s) if s.trim().is_empty() => None,
        Ok(s) => Some(Ok(s)),
        Err(std::env::VarError::NotUnicode(v)) => Some(Err(format!("{v:?}"))),
    };
    let capacity = match read("STREAMPOOL_SIM_CAPACITY") {
        None => sim::default_capacity(),
        Some(Ok(s)) => crate::size::parse_size(&s).map_err(|e| {
            let why = match e {
                Error::InvalidArgument(why) => why,
                e => e.to_string(),
            };
            Error::invalid(format!(
                "the environment variable STREAMPOOL_SIM_CAPACITY is {s:?}, which is not a size ({why})"
            ))
        })?,
        Some(Err(v)) => {
            return Err(Error::invalid(format!(
                "the environment variable STREAMPOOL_SIM_CAPACITY is {v}, which is not a size"
            )))
        }
    };
    let devices = match read("STREAMPOOL_SIM_DEVICES") {
        None => 1,
        Some(value) => {
            value.as_ref().ok().and_then(|s| s.trim().parse::<i32>().ok()).filter(|n| (1..=sim::MAX_DEVICES).contains(n)).ok_or_else(|| {
                let shown = value.as_ref().map_or_else(Clone::clone, |s| format!("{s:?}"));
                Error::invalid(format!(
                    "the environment variable STREAMPOOL_SIM_DEVICES is {shown}; it must be a number of devices from 1 to {}",
                    sim::MAX_DEVICES
                ))
            })?
        }
    };
    Ok(ENV_SIM.get_or_init(|| Some(sim::SimDevice::with_devices(capacity, devices))).clone())
}

pub(crate) fn set_active_sim(sim: Option<Arc<sim::SimDevice>>) -> Result<()> {
    let mut slot = ACTIVE_SIM.lock().unwrap_or_else(|e| e.into_inner());
    if let (Some(current), Some(new)) = (slot.as_ref(), sim.as_ref()) {
        let again = if Arc::ptr_eq(current, new) { " (this one: activated twice)" } else { "" };
        return Err(Error::invalid(format!(
            "{} is already active in this process{again}; exit it before entering another",
            current.describe()
        )));
    }
    *slot = sim;
    BACKEND_EPOCH.fetch_add(1, Ordering::AcqRel);
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

/// Runs `f` with the calling thread's capture mode relaxed
/// ([`Backend::exchange_capture_mode`]), restored afterwards: for calls that a CUDA graph
/// capture in another stream (of this thread, or of any thread in the global mode) would
/// otherwise refuse, invalidating it.
pub fn with_relaxed_capture<T>(
    backend: &BackendRef,
    f: impl FnOnce() -> crate::Result<T>,
) -> crate::Result<T> {
    /// Gives the thread its mode back however `f` ends (a panic too).
    struct Restore<'a>(&'a BackendRef, u32);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            let restored = self.0.exchange_capture_mode(false, self.1).map(drop);
            crate::error::record_if_failed(|| "restoring the thread's capture mode".into(), restored);
        }
    }
    let previous = backend.exchange_capture_mode(true, 0)?;
    let _restore = Restore(backend, previous);
    f()
}
