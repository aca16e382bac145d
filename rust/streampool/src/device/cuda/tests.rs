//! Tests of the CUDA backend.
//!
//! The first group runs everywhere, with or without a driver. The `gpu_` tests run only
//! with `STREAMPOOL_GPU_TESTS=1` (they pass, doing nothing, otherwise), and then insist
//! on a working driver and device 0.

use std::sync::Arc;
use std::thread;

use cudarc::driver::sys;

use super::*;
use crate::error::{
    CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
};

// ---------------------------------------------------------------------------------------
// Without a GPU
// ---------------------------------------------------------------------------------------

#[test]
fn get_is_stable_and_never_panics() {
    let first = CudaBackend::get();
    let second = CudaBackend::get();
    match (&first, &second) {
        (Ok(a), Ok(b)) => assert!(Arc::ptr_eq(a, b), "get() made two backends"),
        (Err(a), Err(b)) => {
            assert_eq!(a, b, "the probe's error is kept");
            assert!(matches!(a, Error::DriverNotFound(_)), "{a:?}");
        }
        _ => panic!("get() changed its mind: {first:?} then {second:?}"),
    }
}

#[test]
fn no_library_is_driver_not_found() {
    // SAFETY: loading libcuda runs the driver's initialisers, as `get` does anyway.
    if unsafe { raw::library_present() } {
        return; // a driver is installed here: covered by the GPU tests
    }
    let err = CudaBackend::get().expect_err("no libcuda, yet a backend");
    assert_eq!(err, Error::DriverNotFound("libcuda.so.1 could not be loaded".into()));
    let message = err.to_string();
    assert!(message.starts_with("no CUDA driver found: libcuda.so.1 could not be loaded."), "{message}");
    assert!(message.contains("STREAMPOOL_DEVICE=sim"), "{message}");
}

#[test]
fn driver_errors_carry_call_code_and_name() {
    let err = raw::driver_error("cuMemAlloc", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(
        err,
        Error::Driver {
            call: "cuMemAlloc",
            code: CUDA_ERROR_OUT_OF_MEMORY,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            context: String::new(),
        }
    );
    assert!(err.is_out_of_memory());
    assert_eq!(err.to_string(), "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)");
    let err = err.context("allocating 4096 bytes");
    assert_eq!(
        err.to_string(),
        "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2) while allocating 4096 bytes"
    );
}

#[test]
fn codes_match_the_crates_constants() {
    let code = |r: sys::CUresult| match raw::driver_error("cuX", r) {
        Error::Driver { code, .. } => code,
        other => panic!("{other:?}"),
    };
    assert_eq!(code(sys::CUresult::CUDA_ERROR_INVALID_VALUE), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(code(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(code(sys::CUresult::CUDA_ERROR_DEINITIALIZED), CUDA_ERROR_DEINITIALIZED);
    assert_eq!(code(sys::CUresult::CUDA_ERROR_INVALID_HANDLE), CUDA_ERROR_INVALID_HANDLE);
    assert_eq!(code(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED), CUDA_ERROR_NOT_SUPPORTED);
    assert_eq!(code(sys::CUresult::CUDA_ERROR_NOT_READY), 600);
    assert!(!raw::driver_error("cuX", sys::CUresult::CUDA_ERROR_INVALID_VALUE).is_out_of_memory());
}

#[test]
fn error_names_are_the_drivers_spelling() {
    assert_eq!(raw::error_name(sys::CUresult::CUDA_ERROR_NO_DEVICE), "CUDA_ERROR_NO_DEVICE");
    assert_eq!(raw::error_name(sys::CUresult::CUDA_ERROR_NOT_READY), "CUDA_ERROR_NOT_READY");
}

#[test]
fn check_and_check_ready() {
    assert_eq!(raw::check("cuX", sys::CUresult::CUDA_SUCCESS), Ok(()));
    assert!(matches!(
        raw::check("cuX", sys::CUresult::CUDA_ERROR_NOT_READY),
        Err(Error::Driver { call: "cuX", code: 600, .. })
    ));
    assert_eq!(raw::check_ready("cuStreamQuery", sys::CUresult::CUDA_SUCCESS), Ok(true));
    assert_eq!(raw::check_ready("cuStreamQuery", sys::CUresult::CUDA_ERROR_NOT_READY), Ok(false));
    assert!(matches!(
        raw::check_ready("cuStreamQuery", sys::CUresult::CUDA_ERROR_INVALID_HANDLE),
        Err(Error::Driver { call: "cuStreamQuery", code: 400, .. })
    ));
}

#[test]
fn versions_and_descriptions() {
    assert_eq!(version_string(13000), "13.0");
    assert_eq!(version_string(12040), "12.4");
    assert_eq!(version_string(12020), "12.2");
    assert_eq!(version_string(11080), "11.8");
    assert_eq!(describe(13000, 1), "CUDA driver 13.0 (1 device)");
    assert_eq!(describe(12080, 8), "CUDA driver 12.8 (8 devices)");
}

#[test]
fn handles_round_trip_through_pointers() {
    for h in [0u64, 1, 2, 0x7f00_dead_beef] {
        assert_eq!(handle_of(cu_stream(h)), h);
        assert_eq!(handle_of(cu_event(h)), h);
        assert_eq!(handle_of(cu_pool(h)), h);
    }
    assert!(is_default_stream(0) && is_default_stream(1) && is_default_stream(2));
    assert!(!is_default_stream(3));
}

#[test]
fn locations_and_attributes_map_to_the_drivers() {
    let device = mem_location(Location::Device(3));
    assert_eq!(device.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
    assert_eq!(device.id, 3);
    let host = mem_location(Location::Host);
    assert_eq!(host.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST);
    assert_eq!(host.id, 0);
    assert_eq!(pool_attribute(PoolAttr::ReleaseThreshold) as u32, 4);
    assert_eq!(pool_attribute(PoolAttr::ReservedMemCurrent) as u32, 5);
    assert_eq!(pool_attribute(PoolAttr::ReservedMemHigh) as u32, 6);
    assert_eq!(pool_attribute(PoolAttr::UsedMemCurrent) as u32, 7);
    assert_eq!(pool_attribute(PoolAttr::UsedMemHigh) as u32, 8);
}

// ---------------------------------------------------------------------------------------
// On a GPU (STREAMPOOL_GPU_TESTS=1)
// ---------------------------------------------------------------------------------------

const MIB: usize = 1 << 20;

/// The backend when GPU tests are enabled; `None` (skip) otherwise.
fn gpu() -> Option<Arc<CudaBackend>> {
    if std::env::var("STREAMPOOL_GPU_TESTS").as_deref() != Ok("1") {
        return None;
    }
    match CudaBackend::get() {
        Ok(cuda) => Some(cuda),
        Err(e) => panic!("STREAMPOOL_GPU_TESTS=1 but the CUDA backend is unavailable: {e}"),
    }
}

fn current_ctx() -> sys::CUcontext {
    // SAFETY: only called once `gpu()` returned a backend (driver loaded and initialised).
    unsafe { raw::ctx_get_current() }.expect("cuCtxGetCurrent")
}

/// Copies `bytes` bytes at `src` (device or host memory) into a new vector, on `stream`,
/// and waits for it.
fn read_back(cuda: &CudaBackend, src: DevPtr, bytes: usize, stream: RawStream) -> Vec<u8> {
    let mut host = vec![0u8; bytes];
    // SAFETY: `host` is valid and writable for `bytes` bytes and outlives the copy: the
    // stream is synchronised before it is returned.
    unsafe { cuda.memcpy_async(0, host.as_mut_ptr() as usize as u64, src, bytes, stream) }.expect("memcpy");
    cuda.stream_synchronize(0, stream).expect("sync");
    host
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_probe_describes_the_machine() {
    let Some(cuda) = gpu() else { return };
    let version = cuda.driver_version().unwrap();
    assert!(version >= 12000, "driver {version}");
    let count = cuda.device_count().unwrap();
    assert!(count >= 1);
    assert!(
        cuda.describe().starts_with(&format!("CUDA driver {}", version_string(version))),
        "{}",
        cuda.describe()
    );
    assert_eq!(cuda.kind(), BackendKind::Cuda);
    assert_eq!(cuda.id(), 0);
    let info = cuda.device_info(0).unwrap();
    assert_eq!(info.ordinal, 0);
    assert!(!info.name.is_empty());
    assert!(info.total_bytes > 0);
    assert!(info.memory_pools, "{info:?}");
    if version >= 13000 && info.concurrent_managed_access {
        assert!(info.managed_pools, "{info:?}");
    }
    let (free, total) = cuda.mem_get_info(0).unwrap();
    assert!(free <= total && total > 0);
    assert!(matches!(cuda.device_info(count), Err(Error::InvalidArgument(_))));
    assert!(matches!(cuda.mem_alloc(-1, 16), Err(Error::InvalidArgument(_))));
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_each_allocation_kind_round_trips() {
    let Some(cuda) = gpu() else { return };
    let bytes = MIB;

    let plain = cuda.mem_alloc(0, bytes).unwrap();
    assert_ne!(plain, 0);
    assert_eq!(plain % 256, 0);
    cuda.memset_d8_async(0, plain, 0x11, bytes, LEGACY_STREAM).unwrap();
    assert!(read_back(&cuda, plain, bytes, LEGACY_STREAM).iter().all(|&b| b == 0x11));
    cuda.mem_free(0, plain).unwrap();

    let managed = cuda.mem_alloc_managed(0, bytes).unwrap();
    assert_ne!(managed, 0);
    cuda.memset_d8_async(0, managed, 0x22, bytes, LEGACY_STREAM).unwrap();
    assert!(read_back(&cuda, managed, bytes, LEGACY_STREAM).iter().all(|&b| b == 0x22));
    cuda.mem_free(0, managed).unwrap();

    let pinned = cuda.mem_host_alloc(0, bytes).unwrap();
    assert_ne!(pinned, 0);
    let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    // SAFETY: `pattern` outlives the copy (synchronised below); `pinned` holds `bytes`.
    unsafe { cuda.memcpy_async(0, pinned, pattern.as_ptr() as usize as u64, bytes, LEGACY_STREAM) }.unwrap();
    cuda.stream_synchronize(0, LEGACY_STREAM).unwrap();
    // SAFETY: pinned memory is host memory, `bytes` long, and no copy into it is pending.
    let seen = unsafe { std::slice::from_raw_parts(pinned as usize as *const u8, bytes) };
    assert_eq!(seen, &pattern[..]);
    cuda.mem_free_host(0, pinned).unwrap();

    let pool = cuda.pool_current(0, false).unwrap();
    let pooled = cuda.pool_alloc_async(0, pool, bytes, LEGACY_STREAM).unwrap();
    cuda.memset_d8_async(0, pooled, 0x33, bytes, LEGACY_STREAM).unwrap();
    assert!(read_back(&cuda, pooled, bytes, LEGACY_STREAM).iter().all(|&b| b == 0x33));
    cuda.free_async(0, pooled, LEGACY_STREAM).unwrap();
    cuda.stream_synchronize(0, LEGACY_STREAM).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_memset_on_a_stream_then_copy_back() {
    let Some(cuda) = gpu() else { return };
    let stream = cuda.stream_create(0, false).unwrap();
    assert!(!is_default_stream(stream));
    let bytes = 4 * MIB;
    let ptr = cuda.mem_alloc(0, bytes).unwrap();
    cuda.memset_d8_async(0, ptr, 0xAB, bytes, stream).unwrap();
    cuda.memset_d8_async(0, ptr + MIB as u64, 0xCD, MIB, stream).unwrap();
    let host = read_back(&cuda, ptr, bytes, stream);
    assert!(host[..MIB].iter().all(|&b| b == 0xAB));
    assert!(host[MIB..2 * MIB].iter().all(|&b| b == 0xCD));
    assert!(host[2 * MIB..].iter().all(|&b| b == 0xAB));
    assert!(cuda.stream_query(0, stream).unwrap());
    cuda.mem_free(0, ptr).unwrap();
    cuda.stream_destroy(0, stream).unwrap();
    assert!(matches!(cuda.stream_destroy(0, LEGACY_STREAM), Err(Error::InvalidStream(_))));
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_async_alloc_from_the_current_pool() {
    let Some(cuda) = gpu() else { return };
    let current = cuda.pool_current(0, false).unwrap();
    let default = cuda.pool_default(0, false).unwrap();
    assert_ne!(current, 0);
    assert_ne!(default, 0);
    let stream = cuda.stream_create(0, false).unwrap();
    let ptr = cuda.pool_alloc_async(0, current, 3 * MIB, stream).unwrap();
    assert_eq!(ptr % 256, 0);
    assert_eq!(cuda.pointer_pool(0, ptr).unwrap(), Some(current));
    let used = cuda.pool_get_attr(0, current, PoolAttr::UsedMemCurrent).unwrap();
    assert!(used >= 3 * MIB as u64, "used {used}");
    let plain = cuda.mem_alloc(0, MIB).unwrap();
    assert_eq!(cuda.pointer_pool(0, plain).unwrap(), None);
    assert_eq!((cuda.pointer_device(0, ptr).unwrap(), cuda.pointer_device(0, plain).unwrap()), (0, 0));
    cuda.mem_free(0, plain).unwrap();
    cuda.free_async(0, ptr, stream).unwrap();
    cuda.stream_synchronize(0, stream).unwrap();
    cuda.stream_destroy(0, stream).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_own_pool_release_threshold_and_trim() {
    let Some(cuda) = gpu() else { return };
    let pool = cuda.pool_create(0, &PoolProps::default()).unwrap();
    assert_eq!(cuda.pool_get_attr(0, pool, PoolAttr::ReleaseThreshold).unwrap(), 0);
    cuda.pool_set_attr(0, pool, PoolAttr::ReleaseThreshold, 64 * MIB as u64).unwrap();
    assert_eq!(cuda.pool_get_attr(0, pool, PoolAttr::ReleaseThreshold).unwrap(), 64 * MIB as u64);
    cuda.pool_set_attr(0, pool, PoolAttr::ReleaseThreshold, u64::MAX).unwrap();
    assert_eq!(cuda.pool_get_attr(0, pool, PoolAttr::ReleaseThreshold).unwrap(), u64::MAX);

    let stream = cuda.stream_create(0, false).unwrap();
    let ptr = cuda.pool_alloc_async(0, pool, 8 * MIB, stream).unwrap();
    assert_eq!(cuda.pointer_pool(0, ptr).unwrap(), Some(pool));
    let used = cuda.pool_get_attr(0, pool, PoolAttr::UsedMemCurrent).unwrap();
    let reserved = cuda.pool_get_attr(0, pool, PoolAttr::ReservedMemCurrent).unwrap();
    assert!(used >= 8 * MIB as u64 && reserved >= used, "used {used}, reserved {reserved}");
    cuda.free_async(0, ptr, stream).unwrap();
    cuda.stream_synchronize(0, stream).unwrap();
    assert_eq!(cuda.pool_get_attr(0, pool, PoolAttr::UsedMemCurrent).unwrap(), 0);
    // The threshold keeps the memory reserved after a synchronise; trimming releases it.
    assert!(cuda.pool_get_attr(0, pool, PoolAttr::ReservedMemCurrent).unwrap() >= 8 * MIB as u64);
    cuda.pool_trim_to(0, pool, 0).unwrap();
    assert_eq!(cuda.pool_get_attr(0, pool, PoolAttr::ReservedMemCurrent).unwrap(), 0);
    assert!(cuda.pool_get_attr(0, pool, PoolAttr::ReservedMemHigh).unwrap() >= 8 * MIB as u64);
    cuda.pool_set_attr(0, pool, PoolAttr::UsedMemHigh, 0).unwrap();
    assert_eq!(cuda.pool_get_attr(0, pool, PoolAttr::UsedMemHigh).unwrap(), 0);
    assert!(cuda.pool_set_attr(0, pool, PoolAttr::UsedMemCurrent, 1).is_err());

    // Set as the device's current pool and back.
    let previous = cuda.pool_current(0, false).unwrap();
    cuda.pool_set_current(0, pool).unwrap();
    assert_eq!(cuda.pool_current(0, false).unwrap(), pool);
    cuda.pool_set_current(0, previous).unwrap();
    assert_eq!(cuda.pool_current(0, false).unwrap(), previous);

    cuda.pool_destroy(0, pool).unwrap();
    cuda.stream_destroy(0, stream).unwrap();

    if cuda.device_info(0).unwrap().posix_fd_ipc {
        let ipc = cuda.pool_create(0, &PoolProps { posix_fd_ipc: true, managed: false }).unwrap();
        let ptr = cuda.pool_alloc_async(0, ipc, MIB, LEGACY_STREAM).unwrap();
        cuda.free_async(0, ptr, LEGACY_STREAM).unwrap();
        cuda.stream_synchronize(0, LEGACY_STREAM).unwrap();
        cuda.pool_destroy(0, ipc).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_pool_memory_exports_only_from_an_ipc_pool() {
    let Some(cuda) = gpu() else { return };
    if !cuda.device_info(0).unwrap().posix_fd_ipc {
        return;
    }
    let ipc = cuda.pool_create(0, &PoolProps { posix_fd_ipc: true, managed: false }).unwrap();
    let ptr = cuda.pool_alloc_async(0, ipc, MIB, LEGACY_STREAM).unwrap();
    cuda.stream_synchronize(0, LEGACY_STREAM).unwrap();
    let fd = cuda.pool_export_fd(0, ipc).unwrap();
    // A real descriptor of this process.
    // SAFETY: `fcntl(F_GETFD)` only asks about the descriptor.
    assert_ne!(unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::F_GETFD) }, -1);
    let data = cuda.pool_export_pointer(0, ptr).unwrap();
    assert_ne!(data, [0u8; 64], "export data names the allocation");
    // The device's default pool has no IPC handles; cuMemAlloc memory is no pool's.
    let default = cuda.pool_default(0, false).unwrap();
    assert!(cuda.pool_export_fd(0, default).is_err());
    let plain = cuda.mem_alloc(0, MIB).unwrap();
    assert!(cuda.pool_export_pointer(0, plain).is_err());
    cuda.mem_free(0, plain).unwrap();
    drop(fd);
    cuda.free_async(0, ptr, LEGACY_STREAM).unwrap();
    cuda.stream_synchronize(0, LEGACY_STREAM).unwrap();
    cuda.pool_destroy(0, ipc).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_context_guard_restores_the_callers_context() {
    let Some(cuda) = gpu() else { return };
    thread::spawn(move || {
        // A fresh thread has no current context; it keeps the primary one afterwards (as
        // the runtime API would give it).
        assert!(current_ctx().is_null());
        assert_eq!(cuda.current_device().unwrap(), 0);
        cuda.mem_get_info(0).unwrap();
        let ptr = cuda.mem_alloc(0, MIB).unwrap();
        cuda.mem_free(0, ptr).unwrap();
        let primary = cuda.primary_ctx(cuda.device(0).unwrap()).unwrap();
        assert_eq!(current_ctx(), primary, "a context-less thread keeps the primary context");
        // SAFETY: null pops the primary context off this thread's stack.
        unsafe { raw::ctx_set_current(ptr::null_mut()) }.unwrap();

        // With the primary context already current, it stays current.
        // SAFETY: `primary` is retained and never released.
        unsafe { raw::ctx_set_current(primary) }.unwrap();
        cuda.mem_get_info(0).unwrap();
        assert_eq!(current_ctx(), primary);
        assert_eq!(cuda.current_device().unwrap(), 0);
        // SAFETY: null pops the primary context off this thread's stack.
        unsafe { raw::ctx_set_current(ptr::null_mut()) }.unwrap();

        // With a context of someone else's current, it is restored.
        // SAFETY: driver loaded (a backend exists).
        let can_create = unsafe { raw::has_symbol("cuCtxCreate_v4") };
        assert!(can_create || cuda.driver_version().unwrap() < 12050);
        if can_create {
            let handle = cuda.device(0).unwrap().handle;
            // SAFETY: the symbol is present; `handle` came from `cuDeviceGet`; destroyed below.
            let other = unsafe { raw::ctx_create(handle) }.unwrap();
            assert_eq!(current_ctx(), other);
            let ptr = cuda.mem_alloc(0, MIB).unwrap();
            cuda.memset_d8_async(0, ptr, 7, MIB, LEGACY_STREAM).unwrap();
            cuda.ctx_synchronize(0).unwrap();
            cuda.mem_free(0, ptr).unwrap();
            assert_eq!(current_ctx(), other, "the caller's context was not restored");
            assert_eq!(cuda.current_device().unwrap(), 0);
            // A stream of the other context still names device 0.
            let primary_stream = cuda.stream_create(0, false).unwrap();
            assert_eq!(cuda.stream_device(primary_stream).unwrap(), 0);
            cuda.stream_destroy(0, primary_stream).unwrap();
            // SAFETY: made above; nothing of it is used afterwards.
            unsafe { raw::ctx_destroy(other) }.unwrap();
        }
    })
    .join()
    .unwrap();
}

/// The driver reuses handle values: another library's new stream may carry the handle of
/// a stream this backend destroyed. Refused as destroyed when only its value is given;
/// taken when the caller vouches for it (a live stream object, PyTorch's allocator).
#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_a_destroyed_streams_handle_carried_by_another_librarys_stream() {
    let Some(cuda) = gpu() else { return };
    let backend: crate::device::BackendRef = cuda.clone();
    let theirs = cuda.stream_create(0, false).unwrap();
    // As if a stream of ours with that value had been destroyed before theirs was made.
    cuda.destroyed().insert(theirs);
    let refused = crate::stream::Stream::borrowed(&backend, theirs).unwrap_err();
    assert!(refused.to_string().contains("was destroyed"), "{refused}");
    let stream = crate::stream::Stream::borrowed_live(&backend, theirs).unwrap();
    stream.synchronize(&backend, 0).unwrap();
    drop(stream);
    cuda.stream_destroy(0, theirs).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_streams_and_events() {
    let Some(cuda) = gpu() else { return };
    let a = cuda.stream_create(0, false).unwrap();
    let b = cuda.stream_create(0, true).unwrap();
    let id_a = cuda.stream_id(0, a).unwrap();
    let id_b = cuda.stream_id(0, b).unwrap();
    assert_ne!(id_a, id_b);
    cuda.stream_id(0, LEGACY_STREAM).unwrap();
    assert_eq!(cuda.stream_device(a).unwrap(), 0);
    assert!(matches!(cuda.stream_device(PER_THREAD_STREAM), Err(Error::InvalidStream(_))));

    // The per-thread default stream is a different stream on each thread.
    let here = cuda.stream_id(0, PER_THREAD_STREAM).unwrap();
    let there = {
        let cuda = cuda.clone();
        thread::spawn(move || {
            // A stream's id needs no current context, and none is made current for it
            // (the C entry points ask it at every call on a stream of their own).
            assert_eq!(cuda.stream_id(0, a).unwrap(), id_a);
            // SAFETY: loaded and initialised (a `CudaBackend` exists).
            assert!(unsafe { raw::ctx_get_current() }.unwrap().is_null(), "a context was made current");
            // Also: `stream_device` works on a thread with no current context.
            assert_eq!(cuda.stream_device(a).unwrap(), 0);
            cuda.stream_id(0, PER_THREAD_STREAM).unwrap()
        })
        .join()
        .unwrap()
    };
    assert_ne!(here, there);

    let event = cuda.event_create(0).unwrap();
    assert!(cuda.event_query(0, event).unwrap(), "an unrecorded event is complete");
    let ptr = cuda.mem_alloc(0, 16 * MIB).unwrap();
    cuda.memset_d8_async(0, ptr, 1, 16 * MIB, a).unwrap();
    cuda.event_record(0, event, a).unwrap();
    cuda.stream_wait_event(0, b, event).unwrap();
    cuda.memset_d8_async(0, ptr, 2, 16 * MIB, b).unwrap();
    cuda.event_synchronize(0, event).unwrap();
    assert!(cuda.event_query(0, event).unwrap());
    assert!(read_back(&cuda, ptr, 16 * MIB, b).iter().all(|&x| x == 2));
    cuda.ctx_synchronize(0).unwrap();
    assert!(cuda.stream_query(0, a).unwrap() && cuda.stream_query(0, b).unwrap());
    cuda.mem_free(0, ptr).unwrap();
    cuda.event_destroy(0, event).unwrap();
    cuda.stream_destroy(0, a).unwrap();
    cuda.stream_destroy(0, b).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_managed_memory_prefetch_and_pools() {
    let Some(cuda) = gpu() else { return };
    let info = cuda.device_info(0).unwrap();
    let bytes = 4 * MIB;
    let stream = cuda.stream_create(0, false).unwrap();
    let managed = cuda.mem_alloc_managed(0, bytes).unwrap();
    if info.concurrent_managed_access {
        cuda.prefetch_async(0, managed, bytes, Location::Device(0), stream).unwrap();
        cuda.memset_d8_async(0, managed, 9, bytes, stream).unwrap();
        cuda.prefetch_async(0, managed, bytes, Location::Host, stream).unwrap();
        cuda.stream_synchronize(0, stream).unwrap();
        // SAFETY: managed memory is host-accessible once the stream using it is idle.
        let seen = unsafe { std::slice::from_raw_parts(managed as usize as *const u8, bytes) };
        assert!(seen.iter().all(|&x| x == 9));
    }
    cuda.mem_free(0, managed).unwrap();
    let not_managed = cuda.mem_alloc(0, MIB).unwrap();
    assert!(cuda.prefetch_async(0, not_managed, MIB, Location::Host, stream).is_err());
    cuda.mem_free(0, not_managed).unwrap();
    assert!(matches!(
        cuda.prefetch_async(0, 0x1000, 1, Location::Device(99), stream),
        Err(Error::InvalidArgument(_))
    ));

    if info.managed_pools {
        let default = cuda.pool_default(0, true).unwrap();
        let current = cuda.pool_current(0, true).unwrap();
        assert_ne!(default, 0);
        assert_ne!(current, 0);
        let pool = cuda.pool_create(0, &PoolProps { posix_fd_ipc: false, managed: true }).unwrap();
        let ptr = cuda.pool_alloc_async(0, pool, bytes, stream).unwrap();
        assert_eq!(cuda.pointer_pool(0, ptr).unwrap(), Some(pool));
        cuda.prefetch_async(0, ptr, bytes, Location::Device(0), stream).unwrap();
        cuda.memset_d8_async(0, ptr, 5, bytes, stream).unwrap();
        assert!(read_back(&cuda, ptr, bytes, stream).iter().all(|&x| x == 5));
        cuda.free_async(0, ptr, stream).unwrap();
        cuda.stream_synchronize(0, stream).unwrap();
        cuda.pool_destroy(0, pool).unwrap();
    } else {
        assert!(matches!(cuda.pool_default(0, true), Err(Error::Unsupported(_))));
        assert!(matches!(
            cuda.pool_create(0, &PoolProps { posix_fd_ipc: false, managed: true }),
            Err(Error::Unsupported(_))
        ));
    }
    cuda.stream_destroy(0, stream).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_errors_are_data() {
    let Some(cuda) = gpu() else { return };
    let total = cuda.device_info(0).unwrap().total_bytes;
    let too_much = total.saturating_mul(4);
    let err = cuda.mem_alloc(0, too_much).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
    assert!(matches!(err, Error::Driver { call: "cuMemAlloc", .. }));
    let pool = cuda.pool_current(0, false).unwrap();
    let err = cuda.pool_alloc_async(0, pool, too_much, LEGACY_STREAM).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
    let err = cuda.mem_free(0, 0xdead_0000).unwrap_err();
    assert!(matches!(err, Error::Driver { call: "cuMemFree", .. }), "{err:?}");
    let err = cuda.pointer_pool(0, 0xdead_0000);
    assert!(matches!(err, Ok(None) | Err(Error::Driver { .. })), "{err:?}");
    let err = cuda.pointer_device(0, 0xdead_0000);
    assert!(matches!(err, Err(Error::Driver { .. })), "{err:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_threads_allocate_on_their_own_streams() {
    let Some(cuda) = gpu() else { return };
    let pool = cuda.pool_current(0, false).unwrap();
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let cuda = cuda.clone();
            thread::spawn(move || {
                for i in 0..200 {
                    let bytes = 256 * (1 + (i * 7 + t) % 64);
                    let ptr = cuda.pool_alloc_async(0, pool, bytes, PER_THREAD_STREAM).unwrap();
                    cuda.memset_d8_async(0, ptr, t as u8, bytes, PER_THREAD_STREAM).unwrap();
                    cuda.free_async(0, ptr, PER_THREAD_STREAM).unwrap();
                }
                cuda.stream_synchronize(0, PER_THREAD_STREAM).unwrap();
                // A thread that had no context keeps the primary one.
                assert!(!current_ctx().is_null());
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_fallbacks_for_older_drivers() {
    let Some(cuda) = gpu() else { return };
    // A second backend, as a CUDA 12.4 driver without the newer symbols would probe.
    let mut old = probe().expect("probe");
    old.driver_version = 12040;
    old.symbols = OptionalSymbols {
        stream_get_id: false,
        prefetch_v2: false,
        advise_v2: false,
        stream_get_device: false,
        managed_pool_queries: false,
        vmm: false,
    };
    for device in &mut old.devices {
        device.info.managed_pools = false;
    }
    let stream = cuda.stream_create(0, false).unwrap();
    // `cuStreamGetCtx` + push / `cuCtxGetDevice` / pop, from a thread with no context.
    let on_thread = thread::spawn(move || {
        let device = old.stream_device(stream);
        assert!(current_ctx().is_null(), "the fallback left a context current");
        (old, device)
    });
    let (old, device) = on_thread.join().unwrap();
    assert_eq!(device.unwrap(), 0);
    let unsupported = |r: Result<u64>| match r {
        Err(Error::Unsupported(message)) => message,
        other => panic!("{other:?}"),
    };
    let message = unsupported(old.stream_id(0, stream));
    assert!(message.contains("need a CUDA 12.0 driver (found 12.4)"), "{message}");
    let message = unsupported(old.pool_default(0, true));
    assert_eq!(message, "managed memory pools need a CUDA 13 driver (found 12.4)");
    let message = unsupported(old.pool_current(0, true));
    assert!(message.contains("found 12.4"), "{message}");
    let message = match old.prefetch_async(0, 0x1000, 1, Location::Host, stream) {
        Err(Error::Unsupported(message)) => message,
        other => panic!("{other:?}"),
    };
    assert!(message.contains("needs a CUDA 12.2 driver (found 12.4)"), "{message}");
    let message = match old.mem_advise(0, 0x1000, 1, Advice::SetReadMostly, Location::Host) {
        Err(Error::Unsupported(message)) => message,
        other => panic!("{other:?}"),
    };
    assert!(message.contains("cuMemAdvise_v2) needs a CUDA 12.2 driver (found 12.4)"), "{message}");
    // Without the virtual memory management symbols, their calls are refused, not reached.
    let message = match old.vmm_granularity(0) {
        Err(Error::Unsupported(message)) => message,
        other => panic!("{other:?}"),
    };
    assert!(message.contains("virtual memory management needs cuMemGetAllocationGranularity"), "{message}");
    assert!(message.ends_with("which this CUDA driver's library (12.4) lacks"), "{message}");
    assert!(matches!(old.vmm_reserve(0, 2 * MIB), Err(Error::Unsupported(_))));
    assert!(matches!(old.vmm_map(0, 0x1000, 2 * MIB), Err(Error::Unsupported(_))));
    assert!(matches!(old.vmm_unmap(0, 0x1000, 2 * MIB, 1), Err(Error::Unsupported(_))));
    assert!(matches!(old.vmm_free(0, 0x1000, 2 * MIB), Err(Error::Unsupported(_))));
    // What does not depend on the newer symbols still works.
    let ptr = old.pool_alloc_async(0, old.pool_current(0, false).unwrap(), MIB, stream).unwrap();
    old.free_async(0, ptr, stream).unwrap();
    old.stream_synchronize(0, stream).unwrap();
    cuda.stream_destroy(0, stream).unwrap();
}

// ---------------------------------------------------------------------------------------
// Virtual memory management
// ---------------------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_vmm_adjacent_mappings_are_one_range() {
    let Some(cuda) = gpu() else { return };
    let g = cuda.vmm_granularity(0).unwrap();
    assert!(g.is_power_of_two() && g >= 4096, "granularity {g}");
    let base = cuda.vmm_reserve(0, 4 * g).unwrap();
    assert_ne!(base, 0);
    assert_eq!(base % g as u64, 0, "a reservation starts on a granule");
    // Two granules, then two more right after them.
    let boundary = base + 2 * g as u64;
    let first = cuda.vmm_map(0, base, 2 * g).unwrap();
    let second = cuda.vmm_map(0, boundary, 2 * g).unwrap();
    assert_ne!(first, second);
    let stream = cuda.stream_create(0, false).unwrap();
    // A memset over both, a copy from the host across the boundary, and a copy on the
    // device from across the boundary into the last granule.
    cuda.memset_d8_async(0, base, 0x11, 4 * g, stream).unwrap();
    let pattern: Vec<u8> = (0..g).map(|i| (i % 251) as u8).collect();
    let at = boundary - (g / 2) as u64;
    // SAFETY: `pattern` outlives the copy (the stream is synchronised in `read_back`);
    // `[at, at + g)` is mapped, half in each mapping.
    unsafe { cuda.memcpy_async(0, at, pattern.as_ptr() as usize as u64, g, stream) }.unwrap();
    // SAFETY: both ranges are mapped memory of device 0, ordered on `stream`.
    unsafe { cuda.memcpy_async(0, base + 3 * g as u64, at, g, stream) }.unwrap();
    cuda.memset_d8_async(0, boundary - 64, 0x22, 128, stream).unwrap();
    let seen = read_back(&cuda, base, 4 * g, stream);
    assert!(seen[..g + g / 2].iter().all(|&b| b == 0x11));
    assert_eq!(&seen[g + g / 2..2 * g - 64], &pattern[..g / 2 - 64]);
    assert!(seen[2 * g - 64..2 * g + 64].iter().all(|&b| b == 0x22));
    assert_eq!(&seen[2 * g + 64..2 * g + g / 2], &pattern[g / 2 + 64..]);
    assert!(seen[2 * g + g / 2..3 * g].iter().all(|&b| b == 0x11));
    assert_eq!(&seen[3 * g..], &pattern[..]);
    cuda.vmm_unmap(0, base, 2 * g, first).unwrap();
    cuda.vmm_unmap(0, boundary, 2 * g, second).unwrap();
    cuda.vmm_free(0, base, 4 * g).unwrap();
    cuda.stream_destroy(0, stream).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_vmm_bad_input_is_refused_and_harmless() {
    let Some(cuda) = gpu() else { return };
    let g = cuda.vmm_granularity(0).unwrap();
    // A size that is not a multiple of the granularity: refused for memory (cuMemCreate),
    // and the reservation stays usable. (Reservations are made with whole granules only;
    // the simulated device's tests cover refusing other sizes.)
    let base = cuda.vmm_reserve(0, 4 * g).unwrap();
    let err = cuda.vmm_map(0, base, g + 1).unwrap_err();
    assert!(matches!(err, Error::Driver { call: "cuMemCreate", .. }), "{err:?}");
    let handle = cuda.vmm_map(0, base, 2 * g).unwrap();
    // Not on a granule, over the mapping. (Not past the reservation's end: driver 580 maps
    // there, into address space it has not reserved for anyone, and a context created
    // later in the process then fails with CUDA_ERROR_ALREADY_MAPPED. The pool maps inside
    // its reservation only; the simulated device refuses such a mapping.)
    for (ptr, bytes) in [(base + 4096, g), (base + g as u64, g)] {
        let err = cuda.vmm_map(0, ptr, bytes).unwrap_err();
        assert!(matches!(err, Error::Driver { call: "cuMemMap", .. }), "{err:?}");
    }
    // Unmapping with the wrong size: less than the mapping, on a granule or not. (More is
    // not refused: driver 580 unmaps every whole mapping inside the range given. The
    // simulated device refuses that too, as the seam unmaps one mapping.)
    for bytes in [g, g / 2] {
        let err = cuda.vmm_unmap(0, base, bytes, handle).unwrap_err();
        assert!(matches!(err, Error::Driver { call: "cuMemUnmap", .. }), "{bytes}: {err:?}");
    }
    // Freeing the reservation with the mapping in it.
    let err = cuda.vmm_free(0, base, 4 * g).unwrap_err();
    assert!(matches!(err, Error::Driver { call: "cuMemAddressFree", .. }), "{err:?}");
    // The mapping is still there and works, and so does the rest of the process.
    cuda.memset_d8_async(0, base, 0x5a, 2 * g, LEGACY_STREAM).unwrap();
    assert!(read_back(&cuda, base, 2 * g, LEGACY_STREAM).iter().all(|&b| b == 0x5a));
    cuda.vmm_unmap(0, base, 2 * g, handle).unwrap();
    cuda.vmm_free(0, base, 4 * g).unwrap();
    let plain = cuda.mem_alloc(0, MIB).unwrap();
    cuda.memset_d8_async(0, plain, 1, MIB, LEGACY_STREAM).unwrap();
    assert!(read_back(&cuda, plain, MIB, LEGACY_STREAM).iter().all(|&b| b == 1));
    cuda.mem_free(0, plain).unwrap();
}

// ---------------------------------------------------------------------------------------
// Several devices: peer access and copies between devices
// ---------------------------------------------------------------------------------------

/// `bytes` bytes at `src` (memory device `dev` may read), copied to the host on `dev`'s
/// legacy stream and waited for.
fn read_back_on(cuda: &CudaBackend, dev: i32, src: DevPtr, bytes: usize) -> Vec<u8> {
    let mut host = vec![0u8; bytes];
    // SAFETY: `host` is valid and writable for `bytes` bytes and outlives the copy: the
    // stream is synchronised before it is returned.
    unsafe { cuda.memcpy_async(dev, host.as_mut_ptr() as usize as u64, src, bytes, LEGACY_STREAM) }.unwrap();
    cuda.stream_synchronize(dev, LEGACY_STREAM).unwrap();
    host
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_peer_calls_on_one_device() {
    let Some(cuda) = gpu() else { return };
    let count = cuda.device_count().unwrap();
    assert!(!cuda.device_can_access_peer(0, 0).unwrap(), "a device is not its own peer");
    assert!(matches!(cuda.device_can_access_peer(0, count), Err(Error::InvalidArgument(_))));
    let pool = cuda.pool_create(0, &PoolProps::default()).unwrap();
    assert!(cuda.pool_get_access(0, pool, 0).unwrap(), "the owner has access");
    // `cuMemcpyPeerAsync` within one device is a plain copy.
    let src = cuda.pool_alloc_async(0, pool, MIB, LEGACY_STREAM).unwrap();
    let dst = cuda.mem_alloc(0, MIB).unwrap();
    cuda.memset_d8_async(0, src, 0x5a, MIB, LEGACY_STREAM).unwrap();
    // SAFETY: both are live allocations of MIB bytes, ordered on the legacy stream.
    unsafe { cuda.memcpy_peer_async(0, dst, 0, src, 0, MIB, LEGACY_STREAM) }.unwrap();
    assert!(read_back_on(&cuda, 0, dst, MIB).iter().all(|&b| b == 0x5a));
    cuda.free_async(0, src, LEGACY_STREAM).unwrap();
    cuda.mem_free(0, dst).unwrap();
    cuda.stream_synchronize(0, LEGACY_STREAM).unwrap();
    cuda.pool_destroy(0, pool).unwrap();
}

#[test]
#[ignore = "needs two CUDA GPUs: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn gpu_two_devices_pool_access_and_copies() {
    let Some(cuda) = gpu() else { return };
    if cuda.device_count().unwrap() < 2 {
        eprintln!("skipped: needs two GPUs, found {}", cuda.device_count().unwrap());
        return;
    }
    // Work on device 1 from a thread with no context leaves it with none.
    {
        let cuda = cuda.clone();
        thread::spawn(move || {
            assert!(current_ctx().is_null());
            let p = cuda.mem_alloc(1, MIB).unwrap();
            cuda.mem_free(1, p).unwrap();
            assert!(current_ctx().is_null(), "device 1's context stayed current");
            assert_eq!(cuda.current_device().unwrap(), 0);
        })
        .join()
        .unwrap();
    }
    // A pool of device 0, its memory written there and copied to device 1 with
    // `cuMemcpyPeerAsync`, which needs no access.
    let pool = cuda.pool_create(0, &PoolProps::default()).unwrap();
    let src = cuda.pool_alloc_async(0, pool, MIB, LEGACY_STREAM).unwrap();
    cuda.memset_d8_async(0, src, 0x3c, MIB, LEGACY_STREAM).unwrap();
    cuda.stream_synchronize(0, LEGACY_STREAM).unwrap();
    let dst = cuda.mem_alloc(1, MIB).unwrap();
    // SAFETY: both live, MIB bytes; the source was synchronised above.
    unsafe { cuda.memcpy_peer_async(1, dst, 1, src, 0, MIB, LEGACY_STREAM) }.unwrap();
    assert!(read_back_on(&cuda, 1, dst, MIB).iter().all(|&b| b == 0x3c));
    // Granted to device 1, the pool's memory is read by device 1's own copy.
    if cuda.device_can_access_peer(1, 0).unwrap() {
        assert!(!cuda.pool_get_access(0, pool, 1).unwrap());
        cuda.pool_set_access(0, pool, 1, true).unwrap();
        assert!(cuda.pool_get_access(0, pool, 1).unwrap());
        assert!(read_back_on(&cuda, 1, src, MIB).iter().all(|&b| b == 0x3c));
        cuda.pool_set_access(0, pool, 1, false).unwrap();
        assert!(!cuda.pool_get_access(0, pool, 1).unwrap());
        // Peer access between contexts, enabled twice (the second is no error).
        cuda.ctx_enable_peer_access(1, 0).unwrap();
        cuda.ctx_enable_peer_access(1, 0).unwrap();
    } else {
        eprintln!("devices 1 and 0 cannot reach each other: pool access not tested");
    }
    cuda.free_async(0, src, LEGACY_STREAM).unwrap();
    cuda.stream_synchronize(0, LEGACY_STREAM).unwrap();
    cuda.mem_free(1, dst).unwrap();
    cuda.pool_destroy(0, pool).unwrap();
}
