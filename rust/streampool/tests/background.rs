//! The sharded pool's background thread (`PoolOptions::background`): the events that let
//! one stream reuse another's frees are recorded and queried by it, not by the threads
//! that allocate and free; reuse across streams stays ordered (the race detector, on a
//! device that runs work on its own thread); streams destroyed while it records are safe;
//! and the thread ends with its pool.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

mod common;
use common::{assert_accounting, assert_no_races, stream};

use streampool::device::sim::{event_calls_on_this_thread, SimDevice};
use streampool::device::{BackendRef, DevPtr};
use streampool::resource::ResourceRef;
use streampool::{CudaAsyncMemoryResource, Event, MemoryResource, PoolOptions, ShardedPoolMemoryResource};

const MIB: usize = 1 << 20;

fn pool(b: &BackendRef, options: PoolOptions) -> ShardedPoolMemoryResource {
    let upstream: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    ShardedPoolMemoryResource::new(upstream, options).unwrap()
}

/// Runs the device's queued work on a thread of its own until dropped: work completes
/// some time after it is queued, as on a GPU.
struct DeviceThread {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl DeviceThread {
    fn start(sim: &Arc<SimDevice>) -> Self {
        let (stop, sim) = (Arc::new(AtomicBool::new(false)), sim.clone());
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                if !sim.step_any() {
                    std::thread::yield_now();
                }
            }
            sim.run();
        });
        DeviceThread { stop, handle: Some(handle) }
    }
}

impl Drop for DeviceThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            h.join().unwrap();
        }
    }
}

/// `pairs` producer threads allocate 1 MiB chunks on their streams, write them and hand
/// them (after an event) to consumer threads, which read them and free them on their own
/// streams. Returns the event records and queries the consumers made inside their frees.
fn threaded_pipeline(
    sim: &Arc<SimDevice>,
    b: &BackendRef,
    pool: &ShardedPoolMemoryResource,
    pairs: usize,
) -> u64 {
    const CHUNKS: usize = 300;
    let _device = DeviceThread::start(sim);
    let in_frees: u64 = std::thread::scope(|scope| {
        let consumers: Vec<_> = (0..pairs)
            .map(|_| {
                let (tx, rx) = mpsc::sync_channel::<(DevPtr, Event)>(4);
                let (ps, cs) = (stream(b), stream(b));
                scope.spawn(move || {
                    for _ in 0..CHUNKS {
                        let x = pool.allocate(MIB, &ps).unwrap();
                        sim.write(ps.handle(), x, 1024).unwrap();
                        let ready = Event::new(b, 0).unwrap();
                        ready.record(&ps).unwrap();
                        tx.send((x, ready)).unwrap();
                    }
                    ps
                });
                scope.spawn(move || {
                    let mut calls = 0;
                    for (x, ready) in rx {
                        cs.wait(&ready).unwrap();
                        sim.read(cs.handle(), x, 1024).unwrap();
                        let before = event_calls_on_this_thread();
                        pool.deallocate(x, MIB, &cs).unwrap();
                        calls += event_calls_on_this_thread() - before;
                    }
                    calls
                })
            })
            .collect();
        consumers.into_iter().map(|c| c.join().unwrap()).sum()
    });
    in_frees
}

#[test]
fn the_background_thread_makes_the_hand_offs_driver_calls_and_keeps_them_ordered() {
    for background in [false, true] {
        let sim = SimDevice::new(1 << 30);
        let b: BackendRef = sim.clone();
        let pool = pool(&b, PoolOptions { background, headroom: Some(1.0), ..Default::default() });
        let in_frees = threaded_pipeline(&sim, &b, &pool, 4);
        sim.run();
        let st = pool.stats();
        eprintln!("background {background}: {in_frees} event calls in the consumers' frees; {st:?}");
        if background {
            assert_eq!(in_frees, 0, "the consumers' frees called the driver: {st:?}");
        } else {
            // Without it, the consumers record the events the producers ask for.
            assert!(in_frees > 0, "{st:?}");
        }
        assert!(st.events_recorded > 0 && st.completed_steals > 0, "hand-offs through events: {st:?}");
        assert_eq!(st.used_bytes, 0);
        assert_accounting(&st);
        assert_no_races(&sim);
    }
}

/// Streams that come and go while the background thread records on them: every free
/// makes an event due (`events_every` 1), and the streams are destroyed right after. The
/// thread's records never reach a destroyed stream (the sim reuses handles, so such a
/// record would fail or land on a newer stream), the shards of destroyed streams leave,
/// and the memory is reused.
#[test]
fn streams_destroyed_while_the_background_thread_records_are_safe() {
    let failures =
        || streampool::drop_errors().recent.iter().filter(|m| m.contains("background thread")).count();
    let before = failures();
    let sim = SimDevice::new(1 << 30);
    let b: BackendRef = sim.clone();
    let pool = pool(&b, PoolOptions { background: true, events_every: 1, ..Default::default() });
    let _device = DeviceThread::start(&sim);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (pool, b, sim) = (&pool, &b, &sim);
            scope.spawn(move || {
                for round in 0..200 {
                    let s = stream(b);
                    let sizes = [4096, 64 << 10, 1 << 20];
                    let ptrs: Vec<_> =
                        sizes.iter().map(|&n| pool.allocate(n + t * 256, &s).unwrap()).collect();
                    for (&p, &n) in ptrs.iter().zip(&sizes) {
                        sim.write(s.handle(), p, 256).unwrap();
                        pool.deallocate(p, n + t * 256, &s).unwrap();
                    }
                    if round % 7 == 0 {
                        std::thread::yield_now();
                    }
                    drop(s);
                }
            });
        }
    });
    drop(_device);
    pool.release().unwrap();
    let st = pool.stats();
    assert_eq!(failures(), before, "records failed: {:?}", streampool::drop_errors().recent);
    assert!(st.events_recorded > 0, "{st:?}");
    assert_eq!((st.used_bytes, st.reserved_bytes), (0, 0), "{st:?}");
    assert!(st.shard_free_bytes.len() <= 4, "retired shards left: {st:?}");
    assert_accounting(&st);
    assert_no_races(&sim);
}

/// The number of threads of this process (Linux).
fn threads() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/task").ok()?.count())
}

#[test]
fn the_background_thread_ends_with_its_pool() {
    let (_sim, b) = common::sim();
    let Some(start) = threads() else { return };
    for _ in 0..50 {
        let p = pool(&b, PoolOptions { background: true, ..Default::default() });
        let s = stream(&b);
        let x = p.allocate(4096, &s).unwrap();
        p.deallocate(x, 4096, &s).unwrap();
    }
    // Other tests of this binary may run threads meanwhile; 50 pools' threads would show.
    let now = threads().unwrap();
    assert!(now < start + 10, "{start} threads before, {now} after dropping 50 pools");
}
