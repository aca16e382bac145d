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

// Memory asked for on the per-thread stream from a thread-local destructor that runs after
// the pool's exit hook retired the thread's shard: while a release runs on another thread
// (which may drop that spent shard first), the destructor's allocation made a new shard
// for the dead thread's stream that was never retired, and stayed in the pool for ever.

struct Late(Option<Box<dyn FnOnce()>>);

impl Drop for Late {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f()
        }
    }
}

thread_local! {
    static LATE: RefCell<Late> = const { RefCell::new(Late(None)) };
}

fn allocated_by_a_late_destructor(pause: std::time::Duration, release_meanwhile: bool) {
    use std::sync::Mutex;
    use streampool::device::DevPtr;
    use streampool::{CudaMemoryResource, MemoryResource};

    let sim = SimDevice::new(1 << 30);
    let b: BackendRef = sim.clone();
    let upstream: ResourceRef = Arc::new(CudaMemoryResource::on(b, 0));
    let pool = Arc::new(ShardedPoolMemoryResource::new(upstream, PoolOptions::default()).unwrap());
    let late: Arc<Mutex<Vec<(DevPtr, usize)>>> = Arc::default();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (pool, late) = (pool.clone(), late.clone());
            std::thread::spawn(move || {
                let in_destructor = pool.clone();
                // Touched first, so destroyed after the pool's thread-locals.
                LATE.with(|l| {
                    l.borrow_mut().0 = Some(Box::new(move || {
                        std::thread::sleep(pause);
                        let n = 4096 * (1 + t % 3);
                        let ptr = in_destructor.allocate(n, &Stream::per_thread()).unwrap();
                        late.lock().unwrap().push((ptr, n));
                    }))
                });
                let s = Stream::per_thread();
                let x = pool.allocate(1 << 20, &s).unwrap();
                pool.deallocate(x, 1 << 20, &s).unwrap();
            })
        })
        .collect();
    if release_meanwhile {
        let start = std::time::Instant::now();
        while start.elapsed() < pause * 3 {
            pool.release().unwrap();
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    sim.run();
    if !release_meanwhile {
        // The late memory came from the legacy stream, not from the threads' retired
        // per-thread shards: with it still live, a release leaves no shard but the legacy one.
        pool.release().unwrap();
        let shards: Vec<u64> = pool.stats().shard_free_bytes.iter().map(|&(k, _)| k).collect();
        assert!(shards.iter().all(|&k| k == streampool::stream::LEGACY_KEY), "{shards:?}");
    }
    for (ptr, n) in late.lock().unwrap().drain(..) {
        pool.deallocate(ptr, n, &Stream::legacy()).unwrap(); // found: no "double free?"
    }
    pool.release().unwrap();
    let st = pool.stats();
    assert_eq!((st.used_bytes, st.reserved_bytes), (0, st.free_bytes), "{st:?}");
    assert!(st.shard_free_bytes.len() <= 1, "shards left after every thread exited and a release: {st:?}");
}

#[test]
fn memory_asked_for_by_a_late_thread_local_destructor_comes_from_the_legacy_stream() {
    allocated_by_a_late_destructor(std::time::Duration::ZERO, false);
}

#[test]
fn a_late_thread_local_destructor_leaves_no_shard_behind_a_release() {
    allocated_by_a_late_destructor(std::time::Duration::from_millis(30), true);
}

/// Many rounds of the same while another thread releases the pool all along (a release
/// forgets spent retired shards): a late allocation never lands in a shard that has left
/// the pool, whose free would then be refused as a double free.
#[test]
fn late_thread_local_destructors_and_a_release_all_along() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    use streampool::device::DevPtr;
    use streampool::{CudaMemoryResource, MemoryResource};

    let sim = SimDevice::new(1 << 30);
    let b: BackendRef = sim.clone();
    let upstream: ResourceRef = Arc::new(CudaMemoryResource::on(b, 0));
    let pool = Arc::new(ShardedPoolMemoryResource::new(upstream, PoolOptions::default()).unwrap());
    let legacy = Stream::legacy();
    // A live block keeps its chunk: after each release the common list holds the rest of it.
    let pin = pool.allocate(256, &legacy).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let releaser = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                pool.release().unwrap();
            }
        })
    };
    let mut refused = Vec::new();
    for _ in 0..400 {
        let late: Arc<Mutex<Vec<(DevPtr, usize)>>> = Arc::default();
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (pool, late) = (pool.clone(), late.clone());
                std::thread::spawn(move || {
                    let in_destructor = pool.clone();
                    LATE.with(|l| {
                        l.borrow_mut().0 = Some(Box::new(move || {
                            let ptr = in_destructor.allocate(4096, &Stream::per_thread()).unwrap();
                            late.lock().unwrap().push((ptr, 4096));
                        }))
                    });
                    let s = Stream::per_thread();
                    let x = pool.allocate(4096, &s).unwrap();
                    pool.deallocate(x, 4096, &s).unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        sim.run();
        for (ptr, n) in late.lock().unwrap().drain(..) {
            if let Err(e) = pool.deallocate(ptr, n, &legacy) {
                refused.push(e.to_string());
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    releaser.join().unwrap();
    pool.deallocate(pin, 256, &legacy).unwrap();
    sim.run();
    pool.release().unwrap();
    let st = pool.stats();
    assert!(refused.is_empty(), "late frees refused: {refused:?}");
    assert_eq!((st.used_bytes, st.reserved_bytes), (0, 0), "{st:?}");
}
