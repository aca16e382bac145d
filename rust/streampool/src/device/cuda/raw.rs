//! The raw layer: one function per CUDA driver call, each returning [`Result`].
//!
//! Every function here is `unsafe` and lists its preconditions. Two hold for all of them
//! and are not repeated:
//!
//! * **Loaded.** `libcuda` is loaded, `cuInit` succeeded and the probe found the
//!   function's symbol (a [`CudaBackend`](super::CudaBackend) exists, or the probe is
//!   the caller and has checked this much). cudarc's wrappers panic on a missing
//!   library or symbol; these preconditions are what keep them from doing so.
//! * **Handles.** A handle argument (stream, event, pool, context, pointer) is one the
//!   driver made and has not destroyed or freed, unless the function says otherwise.
//!   The driver detects many stale handles and reports `CUDA_ERROR_INVALID_HANDLE` or
//!   `CUDA_ERROR_INVALID_VALUE`, but not all: a dangling handle is undefined behaviour
//!   inside the driver. Above the seam, handles are owned by objects (`Stream`,
//!   `Event`, pools, allocations) that keep them live while they are used.
//!
//! Stream arguments may also be `0` (the legacy default stream, also spelled
//! `CU_STREAM_LEGACY` = 1) or `CU_STREAM_PER_THREAD` = 2; those name a stream of the
//! calling thread's *current context*, so calls that take them need one current.
//!
//! The symbols loaded are the plain (not `_ptsz`/`_ptds`) ones, so handle 0 means the
//! legacy default stream, as the crate's stream model says.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use crate::error::{Error, Result};

const SUCCESS: sys::CUresult = sys::CUresult::CUDA_SUCCESS;
const NOT_READY: sys::CUresult = sys::CUresult::CUDA_ERROR_NOT_READY;

/// Set once the probe has found `cuGetErrorName`: from then on error names come from
/// the driver. Before (and in tests on machines without a driver) they come from the
/// bindings' enum names, which are the same strings.
static ERROR_NAMES_FROM_DRIVER: AtomicBool = AtomicBool::new(false);

/// Lets [`driver_error`] ask the driver for error names.
///
/// # Safety
/// 1. The library is loaded and exports `cuGetErrorName`.
pub(super) unsafe fn enable_driver_error_names() {
    ERROR_NAMES_FROM_DRIVER.store(true, Ordering::Release);
}

/// The crate's error for a failed driver call.
pub(super) fn driver_error(call: &'static str, result: sys::CUresult) -> Error {
    Error::Driver { call, code: result as u32 as i32, name: error_name(result), context: String::new() }
}

/// `Ok` for `CUDA_SUCCESS`, else the crate's error for `call`.
pub(super) fn check(call: &'static str, result: sys::CUresult) -> Result<()> {
    if result == SUCCESS {
        Ok(())
    } else {
        Err(driver_error(call, result))
    }
}

/// `CUDA_ERROR_NOT_READY` as `Ok(false)`, success as `Ok(true)`, anything else an error.
pub(super) fn check_ready(call: &'static str, result: sys::CUresult) -> Result<bool> {
    match result {
        SUCCESS => Ok(true),
        NOT_READY => Ok(false),
        _ => Err(driver_error(call, result)),
    }
}

/// [`cuGetErrorName`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__ERROR.html),
/// falling back to the bindings' name for the value.
pub(super) fn error_name(result: sys::CUresult) -> String {
    if ERROR_NAMES_FROM_DRIVER.load(Ordering::Acquire) {
        let mut name: *const c_char = ptr::null();
        // SAFETY: the flag is set only once the library is loaded with `cuGetErrorName`
        // (see `enable_driver_error_names`); `name` is a valid out-pointer. The call needs
        // neither `cuInit` nor a context.
        let r = unsafe { sys::cuGetErrorName(result, &mut name) };
        if r == SUCCESS && !name.is_null() {
            // SAFETY: on success the driver points `name` at a static NUL-terminated string.
            return unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        }
    }
    format!("{result:?}")
}

// ---------------------------------------------------------------------------------------
// Loading and probing
// ---------------------------------------------------------------------------------------

/// True when some candidate name of the driver library (`libcuda.so`, `libcuda.so.1`, ...)
/// can be loaded. Loads and unloads it; nothing is kept.
///
/// # Safety
/// 1. Loading the library runs its initialisers; the caller accepts running those of
///    whatever `libcuda` the dynamic loader finds (the NVIDIA driver's).
pub(super) unsafe fn library_present() -> bool {
    // SAFETY: the caller accepts running the library's initialisers (precondition 1).
    unsafe { sys::is_culib_present() }
}

/// Loads the driver library for the rest of the process (cudarc keeps it). False when
/// loading failed (cudarc panics then; the panic is caught here).
///
/// # Safety
/// 1. As for [`library_present`], which should have returned true: cudarc tries the same
///    names in the same order, so loading then succeeds without a panic (and its message).
pub(super) unsafe fn load_library() -> bool {
    // SAFETY: the caller accepts running the library's initialisers (precondition 1).
    catch_unwind(AssertUnwindSafe(|| unsafe { sys::culib() })).is_ok()
}

/// True when the loaded library exports `name` (a C function name, without NUL).
///
/// # Safety
/// 1. [`load_library`] returned true.
pub(super) unsafe fn has_symbol(name: &str) -> bool {
    // SAFETY: the library is loaded (precondition 1), so `culib` returns it without
    // loading or panicking. The symbol is looked up as an opaque pointer, never read or
    // called, so its real type does not matter. (Bytes, as cudarc's own loader passes.)
    unsafe { sys::culib().get::<*const ()>(name.as_bytes()).is_ok() }
}

/// [`cuInit`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__INITIALIZE.html)`(0)`.
///
/// # Safety
/// 1. The library is loaded and exports the symbol (the "Initialised" part of the
///    module's first precondition does not apply, as this is what initialises it).
pub(super) unsafe fn init() -> Result<()> {
    // SAFETY: loaded with the symbol (precondition 1); flags must be 0.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// [`cuDriverGetVersion`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VERSION.html):
/// e.g. 13000 for CUDA 13.0.
///
/// # Safety
/// 1. The library is loaded and exports the symbol (no `cuInit` needed).
pub(super) unsafe fn driver_get_version() -> Result<i32> {
    let mut version = 0;
    // SAFETY: loaded (precondition 1); `version` is a valid out-pointer.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) })?;
    Ok(version)
}

/// [`cuDeviceGetCount`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
///
/// # Safety
/// 1. Loaded and initialised.
pub(super) unsafe fn device_get_count() -> Result<i32> {
    let mut count = 0;
    // SAFETY: initialised (precondition 1); `count` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) })?;
    Ok(count)
}

/// [`cuDeviceGet`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html):
/// the device handle of an ordinal.
///
/// # Safety
/// 1. Loaded and initialised. (An ordinal out of range is reported, not undefined.)
pub(super) unsafe fn device_get(ordinal: i32) -> Result<sys::CUdevice> {
    let mut device = 0;
    // SAFETY: initialised (precondition 1); `device` is a valid out-pointer.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, ordinal) })?;
    Ok(device)
}

/// [`cuDeviceGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `device` came from [`device_get`].
pub(super) unsafe fn device_get_attribute(
    attr: sys::CUdevice_attribute,
    device: sys::CUdevice,
) -> Result<i32> {
    let mut value = 0;
    // SAFETY: initialised, valid device (preconditions 1-2); `value` is a valid out-pointer.
    check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut value, attr, device) })?;
    Ok(value)
}

/// [`cuDeviceGetName`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `device` came from [`device_get`].
pub(super) unsafe fn device_get_name(device: sys::CUdevice) -> Result<String> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: initialised, valid device (preconditions 1-2); the driver writes at most
    // `len` bytes, NUL included, into `buf`, which holds that many.
    check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, device) })?;
    // Read up to the first NUL, and never past the buffer even if the driver wrote none.
    let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// [`cuDeviceTotalMem`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
/// (`_v2`, the 64-bit one).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `device` came from [`device_get`].
pub(super) unsafe fn device_total_mem(device: sys::CUdevice) -> Result<usize> {
    let mut bytes = 0;
    // SAFETY: initialised, valid device (preconditions 1-2); `bytes` is a valid out-pointer.
    check("cuDeviceTotalMem", unsafe { sys::cuDeviceTotalMem_v2(&mut bytes, device) })?;
    Ok(bytes)
}

// ---------------------------------------------------------------------------------------
// Contexts
// ---------------------------------------------------------------------------------------

/// [`cuDevicePrimaryCtxRetain`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html):
/// the device's primary context, created (and initialised) on first retain.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `device` came from [`device_get`].
pub(super) unsafe fn device_primary_ctx_retain(device: sys::CUdevice) -> Result<sys::CUcontext> {
    let mut ctx = ptr::null_mut();
    // SAFETY: initialised, valid device (preconditions 1-2); `ctx` is a valid out-pointer.
    check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) })?;
    Ok(ctx)
}

/// [`cuCtxGetCurrent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html):
/// the calling thread's current context, null when it has none.
///
/// # Safety
/// 1. Loaded and initialised.
pub(super) unsafe fn ctx_get_current() -> Result<sys::CUcontext> {
    let mut ctx = ptr::null_mut();
    // SAFETY: initialised (precondition 1); `ctx` is a valid out-pointer.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    Ok(ctx)
}

/// [`cuCtxSetCurrent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html):
/// replaces the top of the calling thread's context stack (pushes onto an empty stack);
/// null pops it.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `ctx` is null or a live context.
pub(super) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: initialised (precondition 1); `ctx` is null or live (precondition 2).
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
}

/// [`cuCtxPushCurrent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `ctx` is a live context.
/// 3. The caller pops it again with [`ctx_pop_current`] on this thread.
pub(super) unsafe fn ctx_push_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: initialised, live context (preconditions 1-2).
    check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })
}

/// [`cuCtxPopCurrent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html):
/// pops the calling thread's current context and returns it.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. The context on top of this thread's stack is one the caller pushed.
pub(super) unsafe fn ctx_pop_current() -> Result<sys::CUcontext> {
    let mut ctx = ptr::null_mut();
    // SAFETY: initialised (precondition 1); the caller owns the top of the stack
    // (precondition 2); `ctx` is a valid out-pointer.
    check("cuCtxPopCurrent", unsafe { sys::cuCtxPopCurrent_v2(&mut ctx) })?;
    Ok(ctx)
}

/// [`cuCtxGetDevice`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html):
/// the device of the current context.
///
/// # Safety
/// 1. Loaded and initialised. (No current context is reported as an error.)
pub(super) unsafe fn ctx_get_device() -> Result<sys::CUdevice> {
    let mut device = 0;
    // SAFETY: initialised (precondition 1); `device` is a valid out-pointer.
    check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut device) })?;
    Ok(device)
}

/// [`cuCtxSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html):
/// waits for all work of the current context.
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
pub(super) unsafe fn ctx_synchronize() -> Result<()> {
    // SAFETY: initialised with a current context (precondition 1).
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

// ---------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------

/// [`cuMemGetInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
/// (`_v2`): (free, total) bytes of the current context's device.
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
pub(super) unsafe fn mem_get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: initialised with a current context (precondition 1); valid out-pointers.
    check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
    Ok((free, total))
}

/// [`cuMemAlloc`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (`_v2`).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (the memory belongs to it).
pub(super) unsafe fn mem_alloc(bytes: usize) -> Result<sys::CUdeviceptr> {
    let mut dptr = 0;
    // SAFETY: initialised with a current context (precondition 1); valid out-pointer.
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut dptr, bytes) })?;
    Ok(dptr)
}

/// [`cuMemFree`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (`_v2`).
/// Synchronous: waits for work on the device that may use the memory.
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
/// 2. No work still to run uses the memory after this call (the call itself orders the
///    free after work already enqueued).
pub(super) unsafe fn mem_free(dptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: preconditions 1-2; the driver rejects pointers it did not allocate.
    check("cuMemFree", unsafe { sys::cuMemFree_v2(dptr) })
}

/// [`cuMemAllocManaged`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
/// with `CU_MEM_ATTACH_GLOBAL`.
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
pub(super) unsafe fn mem_alloc_managed(bytes: usize) -> Result<sys::CUdeviceptr> {
    let mut dptr = 0;
    let flags = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32;
    // SAFETY: initialised with a current context (precondition 1); valid out-pointer.
    check("cuMemAllocManaged", unsafe { sys::cuMemAllocManaged(&mut dptr, bytes, flags) })?;
    Ok(dptr)
}

/// [`cuMemHostAlloc`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
/// with `CU_MEMHOSTALLOC_PORTABLE` (pinned for every context, not only the current one).
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
pub(super) unsafe fn mem_host_alloc(bytes: usize) -> Result<*mut c_void> {
    let mut host = ptr::null_mut();
    // SAFETY: initialised with a current context (precondition 1); valid out-pointer.
    check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut host, bytes, sys::CU_MEMHOSTALLOC_PORTABLE) })?;
    Ok(host)
}

/// [`cuMemFreeHost`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
/// 2. Nothing (host or device work still to run) uses the memory after this call.
pub(super) unsafe fn mem_free_host(host: *mut c_void) -> Result<()> {
    // SAFETY: preconditions 1-2; the driver rejects pointers it did not allocate.
    check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(host) })
}

/// [`cuMemsetD8Async`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream.
/// 3. `[dptr, dptr + bytes)` is memory the driver knows (it reports other ranges) and
///    nothing else accesses it unordered with this write.
pub(super) unsafe fn memset_d8_async(
    dptr: sys::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: preconditions 1-3.
    check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(dptr, value, bytes, stream) })
}

/// [`cuMemcpyAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html):
/// unified addressing infers the direction, so either side may be host memory.
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream.
/// 3. `src` is readable and `dst` writable for `bytes` bytes until the copy has
///    completed (device memory, memory the driver allocated, or host memory the caller
///    keeps alive), and nothing accesses `dst` unordered with the copy.
pub(super) unsafe fn memcpy_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: preconditions 1-3.
    check("cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) })
}

/// [`cuMemPrefetchAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html)
/// in its CUDA 12.2+ form (`cuMemPrefetchAsync_v2`, the one CUDA 13's header names
/// `cuMemPrefetchAsync`), with a location and flags 0.
///
/// # Safety
/// 1. Loaded and initialised, and the probe found `cuMemPrefetchAsync_v2`; a context is
///    current (for the default stream handles: the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream.
/// 3. `[dptr, dptr + bytes)` is managed memory (the driver reports other memory).
pub(super) unsafe fn mem_prefetch_async(
    dptr: sys::CUdeviceptr,
    bytes: usize,
    location: sys::CUmemLocation,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: preconditions 1-3; `location` is passed by value.
    check("cuMemPrefetchAsync", unsafe { sys::cuMemPrefetchAsync_v2(dptr, bytes, location, 0, stream) })
}

/// [`cuMemAdvise`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html)
/// in its CUDA 12.2+ form (`cuMemAdvise_v2`, the one CUDA 13's header names
/// `cuMemAdvise`), with a location.
///
/// # Safety
/// 1. Loaded and initialised, and the probe found `cuMemAdvise_v2`; a context is current.
/// 2. `[dptr, dptr + bytes)` is managed memory (the driver reports other memory). Advice
///    changes where pages live, never their contents.
pub(super) unsafe fn mem_advise(
    dptr: sys::CUdeviceptr,
    bytes: usize,
    advice: sys::CUmem_advise,
    location: sys::CUmemLocation,
) -> Result<()> {
    // SAFETY: preconditions 1-2; `location` is passed by value.
    check("cuMemAdvise", unsafe { sys::cuMemAdvise_v2(dptr, bytes, advice, location) })
}

/// [`cuMemRangeGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html)`(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION)`:
/// a device ordinal, `CU_DEVICE_CPU` (-1) or `CU_DEVICE_INVALID` (-2).
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
/// 2. `[dptr, dptr + bytes)` is managed memory (the driver reports other memory).
pub(super) unsafe fn mem_range_last_prefetch_location(dptr: sys::CUdeviceptr, bytes: usize) -> Result<i32> {
    let mut value: i32 = 0;
    let attr = sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION;
    // SAFETY: preconditions 1-2; this attribute's value is a 32-bit int, `value` has room
    // for exactly that, and its size is passed.
    check("cuMemRangeGetAttribute", unsafe {
        sys::cuMemRangeGetAttribute(
            (&mut value as *mut i32).cast::<c_void>(),
            std::mem::size_of::<i32>(),
            attr,
            dptr,
            bytes,
        )
    })?;
    Ok(value)
}

/// [`cuPointerGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html)`(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)`:
/// the pool an allocation came from; null for memory not from a pool.
///
/// # Safety
/// 1. Loaded and initialised; a context is current. (Any pointer value may be asked
///    about: the driver reports those it does not know.)
pub(super) unsafe fn pointer_get_mempool(dptr: sys::CUdeviceptr) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = ptr::null_mut();
    let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE;
    // SAFETY: precondition 1; this attribute's value is a `CUmemoryPool`, which `pool`
    // has room for.
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute((&mut pool as *mut sys::CUmemoryPool).cast::<c_void>(), attr, dptr)
    })?;
    Ok(pool)
}

/// [`cuPointerGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html)`(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`:
/// the device whose context allocated the memory.
///
/// # Safety
/// 1. Loaded and initialised; a context is current. (Any pointer value may be asked
///    about: the driver reports those it does not know.)
pub(super) unsafe fn pointer_get_device(dptr: sys::CUdeviceptr) -> Result<i32> {
    let mut ordinal: c_int = 0;
    let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL;
    // SAFETY: precondition 1; this attribute's value is an `int`, which `ordinal` is.
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute((&mut ordinal as *mut c_int).cast::<c_void>(), attr, dptr)
    })?;
    Ok(ordinal)
}

/// [`cuMemGetAddressRange`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html):
/// the start and size of the allocation `dptr` lies in.
///
/// # Safety
/// 1. Loaded and initialised; a context is current. (Any pointer value may be asked
///    about: the driver reports those it does not know.)
pub(super) unsafe fn mem_get_address_range(dptr: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: precondition 1; both out-pointers point to live locals of the right types.
    check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr) })?;
    Ok((base, size))
}

// ---------------------------------------------------------------------------------------
// Virtual memory management
// ---------------------------------------------------------------------------------------

/// [`cuMemGetAllocationGranularity`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
/// with `CU_MEM_ALLOC_GRANULARITY_MINIMUM`: the multiple that sizes and addresses of
/// memory described by `prop` must be of.
///
/// # Safety
/// 1. Loaded and initialised, and the probe found the virtual memory management symbols.
/// 2. `prop` is fully initialised with its reserved bytes zero (the driver reports
///    values it does not support).
pub(super) unsafe fn mem_get_allocation_granularity(prop: &sys::CUmemAllocationProp) -> Result<usize> {
    let mut granularity = 0;
    let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: preconditions 1-2; `prop` outlives the call; valid out-pointer.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut granularity, prop, option)
    })?;
    Ok(granularity)
}

/// [`cuMemAddressReserve`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html):
/// `bytes` of virtual address space with no memory behind it, where and as aligned as the
/// driver chooses (alignment 0, address 0, flags 0).
///
/// # Safety
/// 1. Loaded and initialised, and the probe found the virtual memory management symbols;
///    a context is current.
pub(super) unsafe fn mem_address_reserve(bytes: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: precondition 1; valid out-pointer; the driver reports a size it refuses.
    check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, 0, 0, 0) })?;
    Ok(ptr)
}

/// [`cuMemAddressFree`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
///
/// # Safety
/// 1. Loaded and initialised, and the probe found the virtual memory management symbols;
///    a context is current.
/// 2. Nothing uses the range after this call (the driver reports a range that is not one
///    whole reservation).
pub(super) unsafe fn mem_address_free(ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(ptr, bytes) })
}

/// [`cuMemCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (flags
/// 0): `bytes` of memory as `prop` describes it, not yet mapped anywhere.
///
/// # Safety
/// 1. Loaded and initialised, and the probe found the virtual memory management symbols;
///    a context is current.
/// 2. `prop` is fully initialised with its reserved bytes zero.
/// 3. The caller releases the handle with [`mem_release`].
pub(super) unsafe fn mem_create(
    bytes: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle = 0;
    // SAFETY: preconditions 1-2; `prop` outlives the call; valid out-pointer. The driver
    // reports a size that is not a multiple of the granularity.
    check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, bytes, prop, 0) })?;
    Ok(handle)
}

/// [`cuMemMap`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html): all of
/// `handle`'s memory (offset 0, flags 0) at `ptr`, not yet accessible ([`mem_set_access`]).
///
/// # Safety
/// 1. Loaded and initialised, and the probe found the virtual memory management symbols;
///    a context is current.
/// 2. `handle` came from [`mem_create`] of `bytes` and was not released. (The driver
///    reports a range that is unaligned, outside a reservation or over a mapping.)
pub(super) unsafe fn mem_map(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuMemMap", unsafe { sys::cuMemMap(ptr, bytes, 0, handle, 0) })
}

/// [`cuMemSetAccess`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
/// for one device: read-write access from device `accessor` to mapped memory.
///
/// # Safety
/// 1. Loaded and initialised, and the probe found the virtual memory management symbols;
///    a context is current.
/// 2. `accessor` is a device ordinal. (The driver reports a range that is not mapped.)
pub(super) unsafe fn mem_set_access(ptr: sys::CUdeviceptr, bytes: usize, accessor: i32) -> Result<()> {
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: accessor,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: preconditions 1-2; one valid descriptor.
    check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, bytes, &desc, 1) })
}

/// [`cuMemUnmap`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html): the
/// range becomes reserved address space again. Synchronous, as the driver documents it.
///
/// # Safety
/// 1. Loaded and initialised, and the probe found the virtual memory management symbols;
///    a context is current.
/// 2. No work still to run uses the memory after this call. (The driver reports a range
///    that is not one whole mapping.)
pub(super) unsafe fn mem_unmap(ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, bytes) })
}

/// [`cuMemRelease`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html): the
/// memory is freed once no mapping of it is left.
///
/// # Safety
/// 1. Loaded and initialised, and the probe found the virtual memory management symbols.
/// 2. `handle` came from [`mem_create`] and is released once: the driver documents a
///    handle that is not valid as undefined behaviour.
pub(super) unsafe fn mem_release(handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

// ---------------------------------------------------------------------------------------
// Stream-ordered pools
// ---------------------------------------------------------------------------------------

/// [`cuDeviceGetDefaultMemPool`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `device` came from [`device_get`].
pub(super) unsafe fn device_get_default_mem_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool = ptr::null_mut();
    // SAFETY: preconditions 1-2; valid out-pointer.
    check("cuDeviceGetDefaultMemPool", unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, device) })?;
    Ok(pool)
}

/// [`cuDeviceGetMemPool`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html):
/// the pool `cuMemAllocAsync` uses on the device.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `device` came from [`device_get`].
pub(super) unsafe fn device_get_mem_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool = ptr::null_mut();
    // SAFETY: preconditions 1-2; valid out-pointer.
    check("cuDeviceGetMemPool", unsafe { sys::cuDeviceGetMemPool(&mut pool, device) })?;
    Ok(pool)
}

/// [`cuDeviceSetMemPool`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `device` came from [`device_get`]; `pool` is a live pool (the driver refuses a
///    pool of another device).
pub(super) unsafe fn device_set_mem_pool(device: sys::CUdevice, pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuDeviceSetMemPool", unsafe { sys::cuDeviceSetMemPool(device, pool) })
}

/// [`cuMemGetDefaultMemPool`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// (CUDA 13).
///
/// # Safety
/// 1. Loaded and initialised, and the probe found `cuMemGetDefaultMemPool`.
pub(super) unsafe fn mem_get_default_mem_pool(
    mut location: sys::CUmemLocation,
    kind: sys::CUmemAllocationType,
) -> Result<sys::CUmemoryPool> {
    let mut pool = ptr::null_mut();
    // SAFETY: precondition 1; `pool` and `location` are valid pointers (the driver only
    // reads `location`).
    check("cuMemGetDefaultMemPool", unsafe { sys::cuMemGetDefaultMemPool(&mut pool, &mut location, kind) })?;
    Ok(pool)
}

/// [`cuMemGetMemPool`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// (CUDA 13).
///
/// # Safety
/// 1. Loaded and initialised, and the probe found `cuMemGetMemPool`.
pub(super) unsafe fn mem_get_mem_pool(
    mut location: sys::CUmemLocation,
    kind: sys::CUmemAllocationType,
) -> Result<sys::CUmemoryPool> {
    let mut pool = ptr::null_mut();
    // SAFETY: precondition 1; `pool` and `location` are valid pointers (the driver only
    // reads `location`).
    check("cuMemGetMemPool", unsafe { sys::cuMemGetMemPool(&mut pool, &mut location, kind) })?;
    Ok(pool)
}

/// [`cuMemPoolCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `props` is fully initialised with its reserved bytes zero (the driver reports
///    values it does not support).
pub(super) unsafe fn mem_pool_create(props: &sys::CUmemPoolProps) -> Result<sys::CUmemoryPool> {
    let mut pool = ptr::null_mut();
    // SAFETY: preconditions 1-2; `props` outlives the call; valid out-pointer.
    check("cuMemPoolCreate", unsafe { sys::cuMemPoolCreate(&mut pool, props) })?;
    Ok(pool)
}

/// [`cuMemPoolDestroy`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
/// Outstanding allocations keep the pool's memory until they are freed.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `pool` is a live pool that the caller created and nobody uses after this call
///    (the driver refuses to destroy a device's default pool).
pub(super) unsafe fn mem_pool_destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuMemPoolDestroy", unsafe { sys::cuMemPoolDestroy(pool) })
}

/// [`cuMemPoolGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// for an attribute whose value is a `cuuint64_t`.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `pool` is a live pool.
/// 3. `attr`'s value type is `cuuint64_t` (the release threshold and the reserved/used
///    memory counters are).
pub(super) unsafe fn mem_pool_get_attribute_u64(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
) -> Result<u64> {
    let mut value: sys::cuuint64_t = 0;
    // SAFETY: preconditions 1-2; `value` has the attribute's type (precondition 3).
    check("cuMemPoolGetAttribute", unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut sys::cuuint64_t).cast::<c_void>())
    })?;
    Ok(value)
}

/// [`cuMemPoolSetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// for an attribute whose value is a `cuuint64_t`.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `pool` is a live pool.
/// 3. `attr`'s value type is `cuuint64_t`. (Of the counters, only a high-water mark may
///    be set, and only to 0; the driver reports other writes.)
pub(super) unsafe fn mem_pool_set_attribute_u64(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    value: u64,
) -> Result<()> {
    let mut value: sys::cuuint64_t = value;
    // SAFETY: preconditions 1-2; `value` has the attribute's type (precondition 3) and the
    // driver only reads it.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(pool, attr, (&mut value as *mut sys::cuuint64_t).cast::<c_void>())
    })
}

/// [`cuMemPoolTrimTo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `pool` is a live pool.
pub(super) unsafe fn mem_pool_trim_to(pool: sys::CUmemoryPool, keep_bytes: usize) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuMemPoolTrimTo", unsafe { sys::cuMemPoolTrimTo(pool, keep_bytes) })
}

/// [`cuMemAllocFromPoolAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `pool` is a live pool; `stream` is a default stream handle or a live stream.
pub(super) unsafe fn mem_alloc_from_pool_async(
    bytes: usize,
    pool: sys::CUmemoryPool,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    let mut dptr = 0;
    // SAFETY: preconditions 1-2; valid out-pointer.
    check("cuMemAllocFromPoolAsync", unsafe {
        sys::cuMemAllocFromPoolAsync(&mut dptr, bytes, pool, stream)
    })?;
    Ok(dptr)
}

/// [`cuMemFreeAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream.
/// 3. `dptr` came from a stream-ordered allocation that is not freed yet, and no work is
///    enqueued after this call, unordered with it, that uses the memory.
pub(super) unsafe fn mem_free_async(dptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: preconditions 1-3.
    check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(dptr, stream) })
}

// ---------------------------------------------------------------------------------------
// Sharing pools between processes
// ---------------------------------------------------------------------------------------

/// [`cuMemPoolExportToShareableHandle`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` (flags 0): a new file descriptor that
/// the caller owns and must close.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `pool` is a live pool (the driver refuses one created without POSIX file-descriptor
///    handles).
pub(super) unsafe fn mem_pool_export_to_posix_fd(pool: sys::CUmemoryPool) -> Result<i32> {
    let mut fd: i32 = -1;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: preconditions 1-2; for this handle type the driver writes an `int` through
    // `handle_out`, which `fd` is.
    check("cuMemPoolExportToShareableHandle", unsafe {
        sys::cuMemPoolExportToShareableHandle((&mut fd as *mut i32).cast::<c_void>(), pool, kind, 0)
    })?;
    Ok(fd)
}

/// [`cuMemPoolImportFromShareableHandle`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` (flags 0). The driver reads the pool
/// through the descriptor and does not take it: the caller still closes it.
///
/// # Safety
/// 1. Loaded and initialised; a context is current (the device the pool lives on).
/// 2. `fd` is an open file descriptor (the driver refuses one that names no exported pool).
pub(super) unsafe fn mem_pool_import_from_posix_fd(fd: i32) -> Result<sys::CUmemoryPool> {
    let mut pool = ptr::null_mut();
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // For this handle type the descriptor is passed by value, cast to a pointer (as the
    // CUDA samples do), not through a pointer to it.
    let handle = fd as isize as *mut c_void;
    // SAFETY: preconditions 1-2; valid out-pointer; `handle` is never dereferenced.
    check("cuMemPoolImportFromShareableHandle", unsafe {
        sys::cuMemPoolImportFromShareableHandle(&mut pool, handle, kind, 0)
    })?;
    Ok(pool)
}

/// [`cuMemPoolExportPointer`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
/// 2. `dptr` is the start of a live allocation of an exportable pool (the driver reports
///    other pointers).
pub(super) unsafe fn mem_pool_export_pointer(dptr: sys::CUdeviceptr) -> Result<[u8; 64]> {
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: preconditions 1-2; `data` is a valid out-pointer of the right type.
    check("cuMemPoolExportPointer", unsafe { sys::cuMemPoolExportPointer(&mut data, dptr) })?;
    Ok(data.reserved)
}

/// [`cuMemPoolImportPointer`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html):
/// the imported allocation's address in this process, freed with [`mem_free`] before the
/// exporting process frees the allocation.
///
/// # Safety
/// 1. Loaded and initialised; a context is current.
/// 2. `pool` is a pool imported with [`mem_pool_import_from_posix_fd`]; the driver reports
///    data that names no allocation of it.
/// 3. The exporting process keeps the allocation alive until this process has freed the
///    returned pointer, and work here uses it only after its allocation completed there.
pub(super) unsafe fn mem_pool_import_pointer(
    pool: sys::CUmemoryPool,
    data: &[u8; 64],
) -> Result<sys::CUdeviceptr> {
    let mut dptr = 0;
    let mut share = sys::CUmemPoolPtrExportData { reserved: *data };
    // SAFETY: preconditions 1-3; valid out-pointer; the driver only reads `share`.
    check("cuMemPoolImportPointer", unsafe { sys::cuMemPoolImportPointer(&mut dptr, pool, &mut share) })?;
    Ok(dptr)
}

// ---------------------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------------------

/// [`cuStreamCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (the stream belongs to it).
pub(super) unsafe fn stream_create(non_blocking: bool) -> Result<sys::CUstream> {
    let flags = if non_blocking {
        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32
    } else {
        sys::CUstream_flags::CU_STREAM_DEFAULT as u32
    };
    let mut stream = ptr::null_mut();
    // SAFETY: precondition 1; valid out-pointer.
    check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut stream, flags) })?;
    Ok(stream)
}

/// [`cuStreamDestroy`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
/// (`_v2`). Work already enqueued still runs; the handle is dead on return.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `stream` is a live stream (not a default stream handle) that nobody uses after this.
pub(super) unsafe fn stream_destroy(stream: sys::CUstream) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(stream) })
}

/// [`cuStreamGetId`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
/// (CUDA 12.0+).
///
/// # Safety
/// 1. Loaded and initialised, and the probe found `cuStreamGetId`; a context is current
///    (for the default stream handles: the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream.
pub(super) unsafe fn stream_get_id(stream: sys::CUstream) -> Result<u64> {
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: preconditions 1-2; valid out-pointer.
    check("cuStreamGetId", unsafe { sys::cuStreamGetId(stream, &mut id) })?;
    Ok(id)
}

/// [`cuStreamGetDevice`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
/// (CUDA 12.8+).
///
/// # Safety
/// 1. Loaded and initialised, and the probe found `cuStreamGetDevice`.
/// 2. `stream` is a live stream (not a default stream handle).
pub(super) unsafe fn stream_get_device(stream: sys::CUstream) -> Result<sys::CUdevice> {
    let mut device = 0;
    // SAFETY: preconditions 1-2; valid out-pointer.
    check("cuStreamGetDevice", unsafe { sys::cuStreamGetDevice(stream, &mut device) })?;
    Ok(device)
}

/// [`cuStreamGetCtx`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `stream` is a live stream (not a default stream handle).
pub(super) unsafe fn stream_get_ctx(stream: sys::CUstream) -> Result<sys::CUcontext> {
    let mut ctx = ptr::null_mut();
    // SAFETY: preconditions 1-2; valid out-pointer.
    check("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(stream, &mut ctx) })?;
    Ok(ctx)
}

/// [`cuStreamSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream.
pub(super) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) })
}

/// [`cuStreamQuery`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html):
/// true when all work on the stream has completed (`CUDA_ERROR_NOT_READY` is false).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream.
pub(super) unsafe fn stream_query(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: preconditions 1-2.
    check_ready("cuStreamQuery", unsafe { sys::cuStreamQuery(stream) })
}

/// [`cuStreamIsCapturing`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html):
/// whether `stream` is capturing a CUDA graph (an invalidated capture counts: the stream
/// stays in capture mode until `cuStreamEndCapture`). Legal during any capture, unlike
/// `cuStreamGetId` and `cuStreamQuery`, which invalidate one.
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream.
pub(super) unsafe fn stream_is_capturing(stream: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: preconditions 1-2; valid out-pointer.
    check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream, &mut status) })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// [`cuThreadExchangeStreamCaptureMode`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html):
/// sets the calling thread's capture mode to `relaxed` (true) or the one given back
/// (`previous`); returns the mode it had, as a raw value for the call that restores it.
///
/// # Safety
/// Loaded and initialised.
pub(super) unsafe fn exchange_capture_mode(relaxed: bool, previous: u32) -> Result<u32> {
    use sys::CUstreamCaptureMode as M;
    let mut mode = match (relaxed, previous) {
        (true, _) | (false, 2) => M::CU_STREAM_CAPTURE_MODE_RELAXED,
        (false, 1) => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        (false, _) => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
    };
    // SAFETY: the precondition; valid in-out pointer.
    check("cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) })?;
    Ok(mode as u32)
}

/// [`cuStreamWaitEvent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
/// (flags 0).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream; `event` is a live event.
pub(super) unsafe fn stream_wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream, event, 0) })
}

/// [`cuEventCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
/// with `CU_EVENT_DISABLE_TIMING` (the cheap kind, for ordering only).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (the event belongs to it).
pub(super) unsafe fn event_create() -> Result<sys::CUevent> {
    let mut event = ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: precondition 1; valid out-pointer.
    check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
    Ok(event)
}

/// [`cuEventDestroy`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
/// (`_v2`). Safe while recorded work is pending: the driver releases it afterwards.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `event` is a live event that nobody uses after this call.
pub(super) unsafe fn event_destroy(event: sys::CUevent) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event) })
}

/// [`cuEventRecord`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles:
///    the one whose stream is meant).
/// 2. `event` is a live event; `stream` a default stream handle or a live stream of the
///    event's context.
pub(super) unsafe fn event_record(event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuEventRecord", unsafe { sys::cuEventRecord(event, stream) })
}

/// [`cuEventQuery`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html):
/// true when the recorded work has completed (or nothing was recorded).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `event` is a live event.
pub(super) unsafe fn event_query(event: sys::CUevent) -> Result<bool> {
    // SAFETY: preconditions 1-2.
    check_ready("cuEventQuery", unsafe { sys::cuEventQuery(event) })
}

/// [`cuEventSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `event` is a live event.
pub(super) unsafe fn event_synchronize(event: sys::CUevent) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event) })
}

// ---------------------------------------------------------------------------------------
// Several devices: peer access and copies between devices
// ---------------------------------------------------------------------------------------

/// [`cuDeviceCanAccessPeer`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `device` and `peer` came from [`device_get`].
pub(super) unsafe fn device_can_access_peer(device: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut can = 0;
    // SAFETY: preconditions 1-2; valid out-pointer.
    check("cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut can, device, peer) })?;
    Ok(can != 0)
}

/// [`cuCtxEnablePeerAccess`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html)
/// from the current context to `peer` (flags 0). `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`
/// is success.
///
/// # Safety
/// 1. Loaded and initialised; a context is current (the one that gains access).
/// 2. `peer` is a live context of another device.
pub(super) unsafe fn ctx_enable_peer_access(peer: sys::CUcontext) -> Result<()> {
    // SAFETY: preconditions 1-2.
    match unsafe { sys::cuCtxEnablePeerAccess(peer, 0) } {
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        result => check("cuCtxEnablePeerAccess", result),
    }
}

/// [`cuMemPoolSetAccess`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// for one device: read-write access, or none.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `pool` is a live pool; `accessor` is a device ordinal.
pub(super) unsafe fn mem_pool_set_access(
    pool: sys::CUmemoryPool,
    accessor: i32,
    enabled: bool,
) -> Result<()> {
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: accessor,
        },
        flags: if enabled {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE
        },
    };
    // SAFETY: preconditions 1-2; one valid descriptor.
    check("cuMemPoolSetAccess", unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) })
}

/// [`cuMemPoolGetAccess`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html):
/// true for read-write access from device `accessor`.
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `pool` is a live pool; `accessor` is a device ordinal.
pub(super) unsafe fn mem_pool_get_access(pool: sys::CUmemoryPool, accessor: i32) -> Result<bool> {
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    let mut location =
        sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: accessor };
    // SAFETY: preconditions 1-2; valid out- and in-pointers.
    check("cuMemPoolGetAccess", unsafe { sys::cuMemPoolGetAccess(&mut flags, pool, &mut location) })?;
    Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
}

/// [`cuMemcpyPeerAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
///
/// # Safety
/// 1. Loaded and initialised; a context is current (for the default stream handles: the
///    one whose stream is meant).
/// 2. `dst_ctx` and `src_ctx` are live contexts, of the devices that own `dst` and `src`;
///    `stream` is a default stream handle or a live stream.
/// 3. `src` is readable and `dst` writable for `bytes` bytes until the copy has completed,
///    and nothing accesses `dst` unordered with the copy.
pub(super) unsafe fn memcpy_peer_async(
    dst: sys::CUdeviceptr,
    dst_ctx: sys::CUcontext,
    src: sys::CUdeviceptr,
    src_ctx: sys::CUcontext,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: preconditions 1-3.
    check("cuMemcpyPeerAsync", unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, stream) })
}

// ---------------------------------------------------------------------------------------
// Only for tests
// ---------------------------------------------------------------------------------------

/// [`cuCtxCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html)
/// (`_v4`, CUDA 12.5+, no parameters): a new context, made current on this thread.
///
/// # Safety
/// 1. Loaded and initialised, and the library exports `cuCtxCreate_v4`.
/// 2. `device` came from [`device_get`].
/// 3. The caller destroys the context with [`ctx_destroy`].
#[cfg(test)]
pub(super) unsafe fn ctx_create(device: sys::CUdevice) -> Result<sys::CUcontext> {
    let mut ctx = ptr::null_mut();
    // SAFETY: preconditions 1-2; null parameters mean none; valid out-pointer.
    check("cuCtxCreate", unsafe { sys::cuCtxCreate_v4(&mut ctx, ptr::null_mut(), 0, device) })?;
    Ok(ctx)
}

/// [`cuCtxDestroy`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html) (`_v2`).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `ctx` came from [`ctx_create`] and nobody uses it (or anything in it) afterwards.
#[cfg(test)]
pub(super) unsafe fn ctx_destroy(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: preconditions 1-2.
    check("cuCtxDestroy", unsafe { sys::cuCtxDestroy_v2(ctx) })
}

// ---------------------------------------------------------------------------------------
// Modules and kernels (the harness's fill, check and compute kernels, PTX through the JIT)
// ---------------------------------------------------------------------------------------

/// [`cuModuleLoadData`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html):
/// loads a module image (here PTX text, which the driver JIT-compiles for the device)
/// into the current context.
///
/// # Safety
/// 1. Loaded and initialised; a context is current (the module belongs to it).
/// 2. `image` is NUL-terminated PTX text (the driver reads up to the NUL; a malformed
///    image is reported, as `CUDA_ERROR_INVALID_PTX` or `CUDA_ERROR_INVALID_IMAGE`).
pub(super) unsafe fn module_load_data(image: &CStr) -> Result<sys::CUmodule> {
    let mut module = ptr::null_mut();
    // SAFETY: preconditions 1-2; `module` is a valid out-pointer.
    check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) })?;
    Ok(module)
}

/// [`cuModuleGetFunction`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html).
///
/// # Safety
/// 1. Loaded and initialised.
/// 2. `module` came from [`module_load_data`] and was not unloaded. (A name the module
///    lacks is reported, as `CUDA_ERROR_NOT_FOUND`.)
pub(super) unsafe fn module_get_function(module: sys::CUmodule, name: &CStr) -> Result<sys::CUfunction> {
    let mut function = ptr::null_mut();
    // SAFETY: preconditions 1-2; `function` is a valid out-pointer, `name` NUL-terminated.
    check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut function, module, name.as_ptr()) })?;
    Ok(function)
}

/// [`cuLaunchKernel`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html)
/// on a 1-D grid of `grid` blocks of `block` threads, no dynamic shared memory, with
/// `params` as the kernel's parameters, each a 64-bit value.
///
/// # Safety
/// 1. Loaded and initialised; the context `function`'s module was loaded in is current
///    (for the default stream handles: the one whose stream is meant).
/// 2. `stream` is a default stream handle or a live stream; `function` came from
///    [`module_get_function`] of a module still loaded.
/// 3. The kernel takes exactly `params.len()` parameters, each 8 bytes (`.u64`): the
///    driver copies 8 bytes from each pointer it is given and cannot check the count.
/// 4. Every address among `params` that the kernel accesses is device-accessible memory of
///    the size the kernel assumes, and nothing else accesses it unordered with the kernel
///    (an illegal address faults the context, which the driver reports afterwards).
pub(super) unsafe fn launch_kernel(
    function: sys::CUfunction,
    grid: u32,
    block: u32,
    params: &[u64],
    stream: sys::CUstream,
) -> Result<()> {
    // The driver reads each parameter through its pointer during the call only.
    let mut values: Vec<u64> = params.to_vec();
    let mut pointers: Vec<*mut c_void> = values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
    // SAFETY: preconditions 1-4; `pointers` holds one valid pointer per parameter, alive
    // for the call; `extra` is null (parameters come through `kernelParams`).
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            function,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            stream,
            pointers.as_mut_ptr(),
            ptr::null_mut(),
        )
    })
}
