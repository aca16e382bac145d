//! Managed memory against the real driver (run with `STREAMPOOL_GPU_TESTS=1` on a GPU
//! machine; without it these tests return at once, see DEVELOPERS.md): prefetch moves
//! pages (checked through `cuMemRangeGetAttribute`'s last prefetch location), advice is
//! accepted on managed memory and refused elsewhere, and the CUDA 13 managed pool
//! allocates with the release threshold it should have.
//!
//! Managed allocations stay small (at most 64 MiB here): asking for more managed memory
//! than the card has free can hang the GPU.

use std::sync::Arc;

use streampool::device::cuda::CudaBackend;
use streampool::device::{Advice, BackendRef, Location, PoolAttr};
use streampool::resource::ResourceRef;
use streampool::{
    Allocation, AsyncPoolOptions, CudaAsyncManagedMemoryResource, CudaAsyncMemoryResource, Error,
    ManagedMemoryResource, MemoryKind, MemoryResource, Stream,
};

const MIB: usize = 1 << 20;

fn gpu() -> Option<BackendRef> {
    if std::env::var("STREAMPOOL_GPU_TESTS").as_deref() != Ok("1") {
        return None;
    }
    Some(CudaBackend::get().expect("STREAMPOOL_GPU_TESTS=1 but no CUDA driver"))
}

/// The managed pool resource, or `None` (after printing why) where the driver or GPU has
/// none: the probe's own error message says which requirement is missing.
fn managed_pool(b: &BackendRef, options: AsyncPoolOptions) -> Option<CudaAsyncManagedMemoryResource> {
    match CudaAsyncManagedMemoryResource::on(b.clone(), 0, options) {
        Ok(mr) => Some(mr),
        Err(Error::Unsupported(why)) => {
            eprintln!("skipped: {why}");
            None
        }
        Err(e) => panic!("{e:?}"),
    }
}

fn read_back(b: &BackendRef, ptr: u64, bytes: usize, stream: &Stream) -> Vec<u8> {
    let mut host = vec![0u8; bytes];
    // SAFETY: `host` outlives the copy: the stream is synchronised before it is read.
    unsafe { b.memcpy_async(0, host.as_mut_ptr() as u64, ptr, bytes, stream.handle()) }.unwrap();
    b.stream_synchronize(0, stream.handle()).unwrap();
    host
}

/// Prefetches `a` to the device, then to the host, checking the last prefetch location
/// and the data after each.
fn prefetch_round_trip(b: &BackendRef, a: &Allocation, stream: &Stream) {
    let bytes = a.bytes();
    let name = a.resource().name().to_owned();
    a.prefetch(None, Some(stream)).unwrap();
    assert_eq!(a.last_prefetch_location().unwrap(), Some(Location::Device(0)), "{name}");
    b.memset_d8_async(0, a.ptr(), 0x5a, bytes, stream.handle()).unwrap();
    a.prefetch(Some(Location::Host), Some(stream)).unwrap();
    b.stream_synchronize(0, stream.handle()).unwrap();
    assert_eq!(a.last_prefetch_location().unwrap(), Some(Location::Host), "{name}");
    // SAFETY: managed memory is host-accessible once the stream that used it is idle, and
    // the allocation outlives this slice.
    let seen = unsafe { std::slice::from_raw_parts(a.ptr() as usize as *const u8, bytes) };
    assert!(seen.iter().all(|&x| x == 0x5a), "{name}: the data moved with its pages");
    a.prefetch(Some(Location::Device(0)), Some(stream)).unwrap();
    assert_eq!(a.last_prefetch_location().unwrap(), Some(Location::Device(0)), "{name}");
    assert!(read_back(b, a.ptr(), bytes, stream).iter().all(|&x| x == 0x5a), "{name}");
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn prefetch_moves_managed_memory_to_the_device_and_back() {
    let Some(b) = gpu() else { return };
    if !b.device_info(0).unwrap().concurrent_managed_access {
        eprintln!("skipped: device 0 has no concurrent managed access (prefetch to a device needs it)");
        return;
    }
    let stream = Stream::create(&b, 0, false).unwrap();
    let plain: ResourceRef = Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap());
    let a = Allocation::new(plain, 64 * MIB, stream.clone()).unwrap();
    assert_eq!(a.last_prefetch_location().unwrap(), None, "fresh managed memory was never prefetched");
    prefetch_round_trip(&b, &a, &stream);
    a.free().unwrap();
    if let Some(pool) = managed_pool(&b, Default::default()) {
        let pool: ResourceRef = Arc::new(pool);
        let a = Allocation::new(pool, 64 * MIB, stream.clone()).unwrap();
        prefetch_round_trip(&b, &a, &stream);
        a.free().unwrap();
    }
    stream.synchronize(&b, 0).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn advice_is_accepted_on_managed_memory_and_refused_elsewhere() {
    let Some(b) = gpu() else { return };
    let stream = Stream::create(&b, 0, false).unwrap();
    let managed: ResourceRef = Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap());
    let a = Allocation::new(managed, 4 * MIB, stream.clone()).unwrap();
    for (advice, location) in [
        (Advice::SetReadMostly, Location::Device(0)),
        (Advice::UnsetReadMostly, Location::Device(0)),
        (Advice::SetPreferredLocation, Location::Device(0)),
        (Advice::UnsetPreferredLocation, Location::Device(0)),
        (Advice::SetPreferredLocation, Location::Host),
        (Advice::UnsetPreferredLocation, Location::Host),
        (Advice::SetAccessedBy, Location::Device(0)),
        (Advice::UnsetAccessedBy, Location::Device(0)),
    ] {
        a.advise(advice, location).unwrap_or_else(|e| panic!("{advice:?} for {location:?}: {e}"));
    }
    assert!(matches!(a.advise(Advice::SetAccessedBy, Location::Device(99)), Err(Error::InvalidArgument(_))));
    a.free().unwrap();

    // Device memory: refused before the driver is asked, naming the resource ...
    let device: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let d = Allocation::new(device.clone(), 4 * MIB, stream.clone()).unwrap();
    match d.advise(Advice::SetReadMostly, Location::Device(0)) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("CudaAsyncMemoryResource (device memory)"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(d.prefetch(None, None), Err(Error::InvalidArgument(_))));
    // ... and by the driver itself, when asked directly: its error, as data.
    let err = b.mem_advise(0, d.ptr(), 4 * MIB, Advice::SetReadMostly, Location::Device(0)).unwrap_err();
    assert!(matches!(err, Error::Driver { call: "cuMemAdvise", .. }), "{err:?}");
    let err = b.prefetch_async(0, d.ptr(), 4 * MIB, Location::Host, stream.handle()).unwrap_err();
    assert!(matches!(err, Error::Driver { call: "cuMemPrefetchAsync", .. }), "{err:?}");
    eprintln!("the driver on device memory: {err}");
    d.free().unwrap();
    stream.synchronize(&b, 0).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn the_default_managed_pool_keeps_its_memory() {
    let Some(b) = gpu() else { return };
    let Some(mr) = managed_pool(&b, Default::default()) else { return };
    assert_eq!(mr.memory_kind(), MemoryKind::Managed);
    assert!(!mr.owns_pool());
    assert_eq!(mr.pool_handle(), b.pool_current(0, true).unwrap());
    assert_ne!(mr.pool_handle(), b.pool_current(0, false).unwrap());
    if mr.pool_handle() == b.pool_default(0, true).unwrap() {
        assert_eq!(mr.release_threshold().unwrap(), u64::MAX);
        assert_eq!(b.pool_get_attr(0, mr.pool_handle(), PoolAttr::ReleaseThreshold).unwrap(), u64::MAX);
    }
    let stream = Stream::create(&b, 0, false).unwrap();
    let p = mr.allocate(16 * MIB, &stream).unwrap();
    assert_eq!(b.pointer_pool(0, p).unwrap(), Some(mr.pool_handle()));
    assert!(mr.used_bytes().unwrap() >= 16 * MIB);
    mr.deallocate(p, 16 * MIB, &stream).unwrap();
    stream.synchronize(&b, 0).unwrap();
    assert!(mr.reserved_bytes().unwrap() >= 16 * MIB, "kept across a synchronisation");
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn an_own_managed_pool_allocates_and_its_memory_reads_back() {
    let Some(b) = gpu() else { return };
    let opts = AsyncPoolOptions {
        initial_pool_size: Some(32 * MIB),
        release_threshold: Some(64 * MIB),
        enable_ipc: false,
        ..Default::default()
    };
    let Some(mr) = managed_pool(&b, opts) else { return };
    assert!(mr.owns_pool());
    assert_eq!(mr.release_threshold().unwrap(), 64 * MIB as u64);
    assert!(mr.reserved_bytes().unwrap() >= 32 * MIB, "primed");
    let pool = mr.pool_handle();
    assert!(![b.pool_default(0, true).unwrap(), b.pool_current(0, false).unwrap()].contains(&pool));
    let (s1, s2) = (Stream::create(&b, 0, false).unwrap(), Stream::create(&b, 0, false).unwrap());
    for round in 0..4u8 {
        let bytes = 32 * MIB;
        let p = mr.allocate(bytes, &s1).unwrap();
        assert_eq!(p % 256, 0);
        b.memset_d8_async(0, p, 0x30 + round, bytes, s1.handle()).unwrap();
        assert!(read_back(&b, p, bytes, &s1).iter().all(|&x| x == 0x30 + round));
        mr.deallocate(p, bytes, &s1).unwrap();
        let q = mr.allocate(bytes, &s2).unwrap();
        b.memset_d8_async(0, q, 0x11, bytes, s2.handle()).unwrap();
        let host = read_back(&b, q, bytes, &s2);
        assert_eq!(host.iter().filter(|&&x| x != 0x11).count(), 0, "round {round}");
        mr.deallocate(q, bytes, &s2).unwrap();
    }
    s1.synchronize(&b, 0).unwrap();
    s2.synchronize(&b, 0).unwrap();
    mr.trim_to(0).unwrap();
    assert_eq!(mr.reserved_bytes().unwrap(), 0);
    // Dropping destroys it (not asked about afterwards: a destroyed pool's handle is
    // dangling, and the driver may crash on it).
    drop(mr);
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn ipc_on_a_managed_pool_is_refused() {
    let Some(b) = gpu() else { return };
    let opts = AsyncPoolOptions { enable_ipc: true, ..Default::default() };
    match CudaAsyncManagedMemoryResource::on(b, 0, opts) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("IPC"), "{m}"),
        Err(Error::Unsupported(why)) => eprintln!("skipped: {why}"),
        other => panic!("{other:?}"),
    }
}
