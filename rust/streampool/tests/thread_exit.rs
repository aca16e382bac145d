//! Memory freed as a thread exits: an allocation kept in a thread-local (a per-thread buffer
//! cache) is dropped by that thread-local's destructor. When the thread-local was first
//! touched before the pool, the pool's own thread-locals are gone by then (destructors run
//! newest first); the free still succeeds (it aborted the process).

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr};
use streampool::resource::ResourceRef;
use streampool::{
    Allocation, CudaAsyncMemoryResource, CudaMemoryResource, MemoryResource, PoolOptions,
    ShardedPoolMemoryResource, Stream,
};

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

/// What the late destructors allocated: (pointer, bytes).
type LateAllocations = Arc<Mutex<Vec<(DevPtr, usize)>>>;

/// A sharded pool over plain device memory of a simulated device of 1 GiB.
fn pool_on_a_sim() -> (Arc<SimDevice>, Arc<ShardedPoolMemoryResource>) {
    let sim = SimDevice::new(1 << 30);
    let b: BackendRef = sim.clone();
    let upstream: ResourceRef = Arc::new(CudaMemoryResource::on(b, 0).unwrap());
    (sim, Arc::new(ShardedPoolMemoryResource::new(upstream, PoolOptions::default()).unwrap()))
}

/// A thread that arms a thread-local destructor which, `pause` after the thread's exit
/// began, allocates `late_bytes` on the thread's per-thread stream (kept in `late`); then
/// allocates and frees `bytes` on that stream itself.
fn spawn_late_allocator(
    pool: &Arc<ShardedPoolMemoryResource>,
    late: &LateAllocations,
    bytes: usize,
    late_bytes: usize,
    pause: Duration,
) -> std::thread::JoinHandle<()> {
    let (pool, late) = (pool.clone(), late.clone());
    std::thread::spawn(move || {
        let in_destructor = pool.clone();
        // Touched first, so destroyed after the pool's thread-locals.
        LATE.with(|l| {
            l.borrow_mut().0 = Some(Box::new(move || {
                if !pause.is_zero() {
                    std::thread::sleep(pause);
                }
                let ptr = in_destructor.allocate(late_bytes, &Stream::per_thread()).unwrap();
                late.lock().unwrap().push((ptr, late_bytes));
            }))
        });
        let s = Stream::per_thread();
        let x = pool.allocate(bytes, &s).unwrap();
        pool.deallocate(x, bytes, &s).unwrap();
    })
}

fn allocated_by_a_late_destructor(pause: Duration, release_meanwhile: bool) {
    let (sim, pool) = pool_on_a_sim();
    let late = LateAllocations::default();
    let threads: Vec<_> =
        (0..8).map(|t| spawn_late_allocator(&pool, &late, 1 << 20, 4096 * (1 + t % 3), pause)).collect();
    if release_meanwhile {
        let start = std::time::Instant::now();
        while start.elapsed() < pause * 3 {
            pool.release().unwrap();
            std::thread::sleep(Duration::from_micros(200));
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
    allocated_by_a_late_destructor(Duration::ZERO, false);
}

#[test]
fn a_late_thread_local_destructor_leaves_no_shard_behind_a_release() {
    allocated_by_a_late_destructor(Duration::from_millis(30), true);
}

/// Many rounds of the same while another thread releases the pool all along (a release
/// forgets spent retired shards): a late allocation never lands in a shard that has left
/// the pool, whose free would then be refused as a double free.
#[test]
fn late_thread_local_destructors_and_a_release_all_along() {
    use std::sync::atomic::{AtomicBool, Ordering};

    let (sim, pool) = pool_on_a_sim();
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
        let late = LateAllocations::default();
        let threads: Vec<_> =
            (0..2).map(|_| spawn_late_allocator(&pool, &late, 4096, 4096, Duration::ZERO)).collect();
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
