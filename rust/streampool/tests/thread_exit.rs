//! Memory freed as a thread exits: an allocation kept in a thread-local (a per-thread buffer
//! cache) is dropped by that thread-local's destructor. When the thread-local was first
//! touched before the pool, the pool's own thread-locals are gone by then (destructors run
//! newest first); the free still succeeds (it aborted the process).

use std::cell::RefCell;
use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::device::BackendRef;
use streampool::resource::ResourceRef;
use streampool::{Allocation, CudaAsyncMemoryResource, PoolOptions, ShardedPoolMemoryResource, Stream};

thread_local! {
    static HELD: RefCell<Option<Allocation>> = const { RefCell::new(None) };
}

fn freed_at_thread_exit(stream: fn() -> Stream) {
    let sim = SimDevice::new(256 << 20);
    let b: BackendRef = sim.clone();
    let upstream: ResourceRef = Arc::new(CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap());
    let pool = Arc::new(ShardedPoolMemoryResource::new(upstream, PoolOptions::default()).unwrap());
    let errors = streampool::drop_errors().count;
    let mr: ResourceRef = pool.clone();
    std::thread::spawn(move || {
        HELD.with(|h| assert!(h.borrow().is_none())); // first touched: destroyed last
        let a = Allocation::new(mr, 1 << 20, stream()).unwrap();
        HELD.with(|h| *h.borrow_mut() = Some(a));
    })
    .join()
    .unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
    assert_eq!(streampool::drop_errors().count, errors, "{:?}", streampool::drop_errors());
}

#[test]
fn freed_on_the_legacy_stream_by_a_thread_local_destructor() {
    freed_at_thread_exit(Stream::legacy);
}

#[test]
fn freed_on_the_per_thread_stream_by_a_thread_local_destructor() {
    freed_at_thread_exit(Stream::per_thread);
}
