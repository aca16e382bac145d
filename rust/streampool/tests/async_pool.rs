//! `CudaAsyncMemoryResource`'s choice of pool and its settings, on the simulated device.

use streampool::device::PoolAttr;
use streampool::{AsyncPoolOptions, CudaAsyncMemoryResource, Error, MemoryResource, Stream};

mod common;
use common::sim;

#[test]
fn no_options_use_the_default_pool_and_raise_its_threshold() {
    let (_sim, b) = sim();
    let default = b.pool_default(0, false).unwrap();
    assert_eq!(b.pool_get_attr(0, default, PoolAttr::ReleaseThreshold).unwrap(), 0);
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    assert_eq!(mr.pool_handle(), default);
    assert!(!mr.owns_pool());
    assert_eq!(mr.release_threshold().unwrap(), u64::MAX);
    let ptr = mr.allocate(1 << 20, &Stream::legacy()).unwrap();
    assert_eq!(b.pointer_pool(0, ptr).unwrap(), Some(default));
    mr.deallocate(ptr, 1 << 20, &Stream::legacy()).unwrap();
}

#[test]
fn a_current_pool_someone_else_set_is_used_and_left_alone() {
    let (_sim, b) = sim();
    let theirs = b.pool_create(0, &Default::default()).unwrap();
    b.pool_set_attr(0, theirs, PoolAttr::ReleaseThreshold, 12345).unwrap();
    b.pool_set_current(0, theirs).unwrap();
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    assert_eq!(mr.pool_handle(), theirs);
    assert_eq!(b.pool_get_attr(0, theirs, PoolAttr::ReleaseThreshold).unwrap(), 12345);
    let default = b.pool_default(0, false).unwrap();
    assert_eq!(b.pool_get_attr(0, default, PoolAttr::ReleaseThreshold).unwrap(), 0);
    drop(mr);
    // Not ours: dropping the resource does not destroy it.
    assert_eq!(b.pool_get_attr(0, theirs, PoolAttr::ReleaseThreshold).unwrap(), 12345);
}

#[test]
fn options_make_an_owned_pool_primed_and_kept() {
    let (_sim, b) = sim();
    let opts = AsyncPoolOptions {
        initial_pool_size: Some(32 << 20),
        release_threshold: None,
        enable_ipc: true,
        ..Default::default()
    };
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, opts).unwrap();
    let pool = mr.pool_handle();
    assert!(mr.owns_pool());
    assert_ne!(pool, b.pool_default(0, false).unwrap());
    assert_eq!(mr.release_threshold().unwrap(), u64::MAX);
    assert!(mr.reserved_bytes().unwrap() >= 32 << 20, "primed");
    assert_eq!(mr.used_bytes().unwrap(), 0);
    b.ctx_synchronize(0).unwrap();
    assert!(mr.reserved_bytes().unwrap() >= 32 << 20, "kept across a synchronisation");
    mr.trim_to(0).unwrap();
    assert_eq!(mr.reserved_bytes().unwrap(), 0);
    drop(mr);
    assert!(b.pool_get_attr(0, pool, PoolAttr::ReleaseThreshold).is_err(), "an owned pool is destroyed");
}

#[test]
fn a_release_threshold_is_honoured() {
    let (_sim, b) = sim();
    let opts = AsyncPoolOptions { release_threshold: Some(0), ..Default::default() };
    let mr = CudaAsyncMemoryResource::on(b.clone(), 0, opts).unwrap();
    let s = Stream::legacy();
    let ptr = mr.allocate(8 << 20, &s).unwrap();
    mr.deallocate(ptr, 8 << 20, &s).unwrap();
    b.stream_synchronize(0, s.handle()).unwrap();
    assert_eq!(
        mr.reserved_bytes().unwrap(),
        0,
        "a threshold of 0 gives everything back at a synchronisation"
    );
}

#[test]
fn views_refuse_bad_handles_and_never_destroy() {
    let (_sim, b) = sim();
    assert!(matches!(CudaAsyncMemoryResource::view(b.clone(), Some(0), 0), Err(Error::InvalidArgument(_))));
    let err = CudaAsyncMemoryResource::view(b.clone(), Some(0), 0x1234).unwrap_err();
    assert!(err.to_string().contains("0x1234"), "{err}");
    let pool = b.pool_create(0, &Default::default()).unwrap();
    let view = CudaAsyncMemoryResource::view(b.clone(), Some(0), pool).unwrap();
    assert_eq!(view.name(), "CudaAsyncViewMemoryResource");
    drop(view);
    b.pool_get_attr(0, pool, PoolAttr::ReleaseThreshold).unwrap();
}

#[test]
fn out_of_memory_retries_after_synchronising_the_stream() {
    let (_sim, b) = sim();
    // A pool with threshold 0 keeps freed memory reserved until the next synchronisation.
    let eager = AsyncPoolOptions { release_threshold: Some(0), ..Default::default() };
    let first = CudaAsyncMemoryResource::on(b.clone(), 0, eager).unwrap();
    let s = Stream::create(&b, 0, false).unwrap();
    let big = 200 << 20;
    let p = first.allocate(big, &s).unwrap();
    first.deallocate(p, big, &s).unwrap();
    assert!(first.reserved_bytes().unwrap() >= big);
    // The device is full of `first`'s reservation: the second pool's first try fails, it
    // synchronises the stream (which lets `first` release), and the retry succeeds.
    let second = CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap();
    let q = second.allocate(big, &s).unwrap();
    assert_eq!(first.reserved_bytes().unwrap(), 0);
    second.deallocate(q, big, &s).unwrap();
    // Beyond the device even after the retry: a clear error naming the size.
    let err = second.allocate(300 << 20, &s).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { requested, .. } if requested == 300 << 20), "{err:?}");
}

/// An allocation whose (borrowed) stream was destroyed before it is freed on the legacy
/// default stream once the device is synchronised, instead of leaking: the order a
/// collector breaking a reference cycle may drop a buffer and its stream in.
#[test]
fn an_allocation_outliving_its_stream_is_still_freed() {
    let (_sim, b) = sim();
    let mr: streampool::resource::ResourceRef =
        std::sync::Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let owned = Stream::create(&b, 0, false).unwrap();
    let borrowed = Stream::borrowed(&b, owned.handle()).unwrap();
    let alloc = streampool::Allocation::new(mr.clone(), 1 << 20, borrowed).unwrap();
    let ptr = alloc.ptr();
    drop(owned);
    alloc.free().unwrap();
    assert_eq!(b.pointer_pool(0, ptr).ok().flatten(), None, "{ptr:#x} is still allocated");
    let again = mr.allocate(1 << 20, &Stream::legacy()).unwrap();
    mr.deallocate(again, 1 << 20, &Stream::legacy()).unwrap();
}
