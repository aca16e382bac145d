//! Managed memory on the simulated device: `CudaAsyncManagedMemoryResource`'s choice of
//! pool, its settings and requirements, and prefetch and advice through `Allocation`.

use std::sync::Arc;

use streampool::device::{Advice, Location, PoolAttr, PoolProps};
use streampool::resource::ResourceRef;
use streampool::{
    Allocation, AsyncPoolOptions, CudaAsyncManagedMemoryResource, CudaAsyncMemoryResource, Error,
    ManagedMemoryResource, MemoryKind, MemoryResource, Stream,
};

mod common;
use common::sim;

#[test]
fn no_options_use_the_default_managed_pool_and_raise_its_threshold() {
    let (_sim, b) = sim();
    let default = b.pool_default(0, true).unwrap();
    assert_ne!(default, b.pool_default(0, false).unwrap());
    assert_eq!(b.pool_get_attr(0, default, PoolAttr::ReleaseThreshold).unwrap(), 0);
    let mr = CudaAsyncManagedMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    assert_eq!(mr.pool_handle(), default);
    assert!(!mr.owns_pool());
    assert_eq!(mr.release_threshold().unwrap(), u64::MAX);
    assert_eq!(mr.name(), "CudaAsyncManagedMemoryResource");
    assert_eq!(mr.memory_kind(), MemoryKind::Managed);
    assert!(format!("{mr:?}").starts_with("CudaAsyncManagedMemoryResource(device=0"), "{mr:?}");
    // The device-memory pool is not touched.
    let device_default = b.pool_default(0, false).unwrap();
    assert_eq!(b.pool_get_attr(0, device_default, PoolAttr::ReleaseThreshold).unwrap(), 0);
    let ptr = mr.allocate(1 << 20, &Stream::legacy()).unwrap();
    assert_eq!(ptr % 256, 0);
    assert_eq!(b.pointer_pool(0, ptr).unwrap(), Some(default));
    assert_eq!(mr.used_bytes().unwrap(), 1 << 20);
    mr.deallocate(ptr, 1 << 20, &Stream::legacy()).unwrap();
}

#[test]
fn a_current_managed_pool_someone_else_set_is_used_and_left_alone() {
    let (_sim, b) = sim();
    let theirs = b.pool_create(0, &PoolProps { posix_fd_ipc: false, managed: true }).unwrap();
    b.pool_set_attr(0, theirs, PoolAttr::ReleaseThreshold, 4321).unwrap();
    b.pool_set_current(0, theirs).unwrap();
    let mr = CudaAsyncManagedMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    assert_eq!(mr.pool_handle(), theirs);
    assert_eq!(mr.release_threshold().unwrap(), 4321);
    let default = b.pool_default(0, true).unwrap();
    assert_eq!(b.pool_get_attr(0, default, PoolAttr::ReleaseThreshold).unwrap(), 0);
    drop(mr);
    assert_eq!(b.pool_get_attr(0, theirs, PoolAttr::ReleaseThreshold).unwrap(), 4321, "not destroyed");
}

#[test]
fn a_view_of_a_current_or_default_managed_pool_hands_out_managed_memory() {
    // RMM's cuda_async_managed_memory_resource is a view of the default managed pool.
    let (_sim, b) = sim();
    let theirs = b.pool_create(0, &PoolProps { posix_fd_ipc: false, managed: true }).unwrap();
    let view = |pool| CudaAsyncMemoryResource::view(b.clone(), None, pool).unwrap().memory_kind();
    assert_eq!(view(b.pool_default(0, true).unwrap()), MemoryKind::Managed);
    assert_eq!(view(b.pool_default(0, false).unwrap()), MemoryKind::Device);
    // Another managed pool is known as such only while it is a device's current one.
    assert_eq!(view(theirs), MemoryKind::Device);
    b.pool_set_current(0, theirs).unwrap();
    assert_eq!(view(theirs), MemoryKind::Managed);
    let mr = CudaAsyncMemoryResource::view(b.clone(), None, theirs).unwrap();
    let a = Allocation::new(Arc::new(mr) as ResourceRef, 4096, Stream::legacy()).unwrap();
    a.prefetch(Some(Location::Host), None).unwrap();
    assert_eq!(a.last_prefetch_location().unwrap(), Some(Location::Host));
}

#[test]
fn options_make_an_owned_managed_pool_primed_and_kept() {
    let (_sim, b) = sim();
    let opts = AsyncPoolOptions { initial_pool_size: Some(16 << 20), ..Default::default() };
    let mr = CudaAsyncManagedMemoryResource::on(b.clone(), 0, opts).unwrap();
    let pool = mr.pool_handle();
    assert!(mr.owns_pool());
    assert!(![b.pool_default(0, true).unwrap(), b.pool_default(0, false).unwrap()].contains(&pool));
    assert_eq!(mr.release_threshold().unwrap(), u64::MAX);
    assert!(mr.reserved_bytes().unwrap() >= 16 << 20, "primed");
    b.ctx_synchronize(0).unwrap();
    assert!(mr.reserved_bytes().unwrap() >= 16 << 20, "kept across a synchronisation");
    // Its memory is managed: prefetches are accepted; advice is refused, as the driver
    // refuses it on a managed pool's memory (CUDA_ERROR_NOT_SUPPORTED), naming both.
    let mr: ResourceRef = Arc::new(mr);
    let a = Allocation::new(mr.clone(), 4096, Stream::legacy()).unwrap();
    match a.advise(Advice::SetPreferredLocation, Location::Device(0)) {
        Err(Error::Unsupported(m)) => {
            assert!(
                m.contains("CudaAsyncManagedMemoryResource") && m.contains("CUDA_ERROR_NOT_SUPPORTED"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
    a.prefetch(None, None).unwrap();
    assert_eq!(a.last_prefetch_location().unwrap(), Some(Location::Device(0)));
    a.free().unwrap();
    drop(mr);
    assert!(b.pool_get_attr(0, pool, PoolAttr::ReleaseThreshold).is_err(), "an owned pool is destroyed");
}

#[test]
fn a_release_threshold_is_honoured() {
    let (_sim, b) = sim();
    let opts = AsyncPoolOptions { release_threshold: Some(0), ..Default::default() };
    let mr = CudaAsyncManagedMemoryResource::on(b.clone(), 0, opts).unwrap();
    assert_eq!(mr.release_threshold().unwrap(), 0);
    let s = Stream::legacy();
    let ptr = mr.allocate(8 << 20, &s).unwrap();
    mr.deallocate(ptr, 8 << 20, &s).unwrap();
    b.stream_synchronize(0, s.handle()).unwrap();
    assert_eq!(mr.reserved_bytes().unwrap(), 0);
    mr.trim_to(0).unwrap();
}

#[test]
fn ipc_is_refused() {
    let (_sim, b) = sim();
    let opts = AsyncPoolOptions { enable_ipc: true, ..Default::default() };
    match CudaAsyncManagedMemoryResource::on(b, 0, opts) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("IPC"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn missing_requirements_are_named() {
    let (sim, b) = sim();
    sim.set_driver_version(12040);
    let unsupported = |r: Result<CudaAsyncManagedMemoryResource, Error>| match r {
        Err(Error::Unsupported(m)) => m,
        other => panic!("{other:?}"),
    };
    let m = unsupported(CudaAsyncManagedMemoryResource::on(b.clone(), 0, Default::default()));
    assert!(m.starts_with("CudaAsyncManagedMemoryResource needs a CUDA 13 driver (found 12.4)"), "{m}");
    let own = AsyncPoolOptions { initial_pool_size: Some(1 << 20), ..Default::default() };
    let m = unsupported(CudaAsyncManagedMemoryResource::on(b.clone(), 0, own.clone()));
    assert!(m.contains("CUDA 13 driver (found 12.4)"), "{m}");
    // The device-memory pool does not need CUDA 13.
    CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    sim.set_driver_version(13000);
    sim.set_concurrent_managed_access(false);
    let m = unsupported(CudaAsyncManagedMemoryResource::on(b.clone(), 0, own));
    assert!(
        m.starts_with(
            "CudaAsyncManagedMemoryResource needs a GPU with concurrent managed access (device 0: streampool simulated device has none)"
        ),
        "{m}"
    );
    sim.set_concurrent_managed_access(true);
    CudaAsyncManagedMemoryResource::on(b, 0, Default::default()).unwrap();
}

#[test]
fn prefetch_and_advice_refuse_memory_that_is_not_managed_naming_its_resource() {
    let (_sim, b) = sim();
    let device: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let a = Allocation::new(device, 4096, Stream::legacy()).unwrap();
    let message = |e: Error| match e {
        Error::InvalidArgument(m) => m,
        other => panic!("{other:?}"),
    };
    let m = message(a.prefetch(None, None).unwrap_err());
    assert_eq!(
        m,
        "prefetch needs managed memory; this memory comes from CudaAsyncMemoryResource (device memory)"
    );
    let m = message(a.advise(Advice::SetReadMostly, Location::Host).unwrap_err());
    assert!(m.starts_with("advice needs managed memory"), "{m}");
    assert!(a.last_prefetch_location().is_err());
    let pinned: ResourceRef = Arc::new(streampool::PinnedHostMemoryResource::on(b.clone(), 0).unwrap());
    let p = Allocation::new(pinned, 4096, Stream::legacy()).unwrap();
    let m = message(p.prefetch(Some(Location::Host), None).unwrap_err());
    assert!(m.ends_with("PinnedHostMemoryResource (pinned host memory)"), "{m}");
}

#[test]
fn prefetch_is_stream_ordered_and_checks_its_stream() {
    let (sim, b) = sim();
    let mr: ResourceRef = Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap());
    let s = Stream::create(&b, 0, false).unwrap();
    let a = Allocation::new(mr.clone(), 1 << 20, s.clone()).unwrap();
    assert_eq!(a.last_prefetch_location().unwrap(), None);
    a.prefetch(None, None).unwrap();
    assert_eq!(sim.queued(s.handle()).unwrap(), 1, "on the allocation's own stream");
    let other = Stream::create(&b, 0, false).unwrap();
    a.prefetch(Some(Location::Host), Some(&other)).unwrap();
    assert_eq!(sim.queued(other.handle()).unwrap(), 1);
    assert_eq!(a.last_prefetch_location().unwrap(), Some(Location::Host));
    // A stream of another backend, or a device that does not exist, is refused.
    let (_sim2, b2) = self::sim();
    let foreign = Stream::create(&b2, 0, false).unwrap();
    assert!(matches!(a.prefetch(None, Some(&foreign)), Err(Error::InvalidStream(_))));
    assert!(matches!(a.prefetch(Some(Location::Device(7)), None), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.advise(Advice::SetAccessedBy, Location::Device(7)), Err(Error::InvalidArgument(_))));
    assert_eq!(a.last_prefetch_location().unwrap(), Some(Location::Host), "refused calls change nothing");
    // An empty allocation: nothing to do.
    let empty = Allocation::new(mr, 0, Stream::legacy()).unwrap();
    empty.prefetch(None, None).unwrap();
    empty.advise(Advice::SetReadMostly, Location::Host).unwrap();
    assert_eq!(empty.last_prefetch_location().unwrap(), None);
    // ... but its arguments are checked all the same (the read-mostly pair ignores the device).
    assert!(matches!(empty.prefetch(Some(Location::Device(7)), None), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        empty.advise(Advice::SetAccessedBy, Location::Device(7)),
        Err(Error::InvalidArgument(_))
    ));
    empty.advise(Advice::SetReadMostly, Location::Device(7)).unwrap();
    assert!(matches!(empty.prefetch(None, Some(&foreign)), Err(Error::InvalidStream(_))));
    drop(a);
    sim.run();
    assert!(sim.races().is_empty());
}

#[test]
fn without_concurrent_managed_access_prefetch_is_refused_plainly_and_the_adaptor_is_not_made() {
    let (sim, b) = sim();
    let mr: ResourceRef = Arc::new(ManagedMemoryResource::on(b.clone(), 0).unwrap());
    let a = Allocation::new(mr.clone(), 1 << 20, Stream::legacy()).unwrap();
    let made_before = streampool::PrefetchAdaptor::new(mr.clone()).unwrap();
    sim.set_concurrent_managed_access(false);
    match made_before.allocate(4096, &Stream::legacy()) {
        Err(Error::Unsupported(m)) => assert!(m.contains("has no concurrent managed access"), "{m}"),
        other => panic!("{other:?}"),
    }
    // As the driver documents: no prefetch, to the device or the host, and no GPU as
    // preferred location or as accessed by; the other advice is taken.
    for to in [None, Some(Location::Host)] {
        match a.prefetch(to, None) {
            Err(Error::Unsupported(m)) => {
                assert!(m.starts_with("cuMemPrefetchAsync: device 0 has no concurrent managed access"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }
    for advice in [Advice::SetPreferredLocation, Advice::SetAccessedBy] {
        match a.advise(advice, Location::Device(0)) {
            Err(Error::Unsupported(m)) => {
                assert!(m.starts_with("cuMemAdvise: device 0 has no concurrent"), "{m}")
            }
            other => panic!("{advice:?}: {other:?}"),
        }
    }
    a.advise(Advice::SetPreferredLocation, Location::Host).unwrap();
    a.advise(Advice::SetAccessedBy, Location::Host).unwrap();
    a.advise(Advice::SetReadMostly, Location::Host).unwrap();
    match streampool::PrefetchAdaptor::new(mr.clone()) {
        Err(Error::Unsupported(m)) => assert_eq!(
            m,
            "PrefetchResourceAdaptor needs a GPU with concurrent managed access to prefetch (device 0: \
             streampool simulated device has none, as on Windows, WSL and some Jetson boards); use \
             ManagedMemoryResource alone, whose memory the driver migrates at each kernel launch there"
        ),
        other => panic!("{other:?}"),
    }
    // Over memory that is not managed it only forwards, so it is made.
    let device: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    streampool::PrefetchAdaptor::new(device).unwrap();
    sim.set_concurrent_managed_access(true);
    a.prefetch(None, None).unwrap();
    streampool::PrefetchAdaptor::new(mr).unwrap();
}
