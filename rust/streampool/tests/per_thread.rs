//! The per-thread default stream across threads: memory allocated on one thread's
//! per-thread stream stays ordered with that stream when another thread copies it, orders
//! a consumer after it, synchronises it or frees it.

use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::device::{LEGACY_STREAM, PER_THREAD_STREAM};
use streampool::{
    Allocation, CudaAsyncMemoryResource, CudaMemoryResource, Event, PoolOptions, ResourceRef,
    ShardedPoolMemoryResource, Stream,
};

mod common;
use common::{assert_no_races, sim};

const SIZE: usize = 4096;

/// Runs `f` on a new thread named "maker".
fn on_maker<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new().name("maker".into()).spawn(f).unwrap().join().unwrap()
}

/// `bytes` from `mr` on the per-thread stream of a new thread, written there (the write
/// left in flight).
fn made_elsewhere(sim: &Arc<SimDevice>, mr: &ResourceRef, bytes: usize) -> Allocation {
    let (sim, mr) = (sim.clone(), mr.clone());
    let check = sim.clone();
    let alloc = on_maker(move || {
        let alloc = Allocation::new(mr, bytes, Stream::per_thread()).unwrap();
        sim.write_labeled(PER_THREAD_STREAM, alloc.ptr(), bytes, "maker's write").unwrap();
        alloc
    });
    assert_eq!(check.pending(), 1, "the maker's write is in flight");
    alloc
}

#[test]
fn a_resolved_per_thread_stream_is_its_owners_there_and_the_legacy_stream_elsewhere() {
    let (_sim, b) = sim();
    let mine = Stream::per_thread().resolved();
    let here = std::thread::current().id();
    assert_eq!(mine.owner_thread(), Some(here));
    assert_eq!((mine.handle(), mine.is_per_thread(), mine.is_legacy()), (PER_THREAD_STREAM, true, false));
    assert_eq!(mine.key(&b, 0), Stream::per_thread().key(&b, 0));
    let theirs = mine.clone();
    let b2 = b.clone();
    let (handle, per_thread, legacy, key, legacy_key, resolved_again) = on_maker(move || {
        let again = theirs.clone().resolved();
        (
            theirs.handle(),
            theirs.is_per_thread(),
            theirs.is_legacy(),
            theirs.key(&b2, 0),
            Stream::legacy().key(&b2, 0),
            again.owner_thread(),
        )
    });
    assert_eq!((handle, per_thread, legacy), (LEGACY_STREAM, false, true));
    assert_eq!(key, legacy_key);
    assert_eq!(resolved_again, Some(here), "resolving elsewhere keeps the owner");
    assert_ne!(Stream::per_thread().key(&b, 0), Stream::legacy().key(&b, 0));
    // The legacy stream's key is one constant (no look-up), apart from every other key.
    assert_eq!(key, streampool::stream::LEGACY_KEY);
    let created = Stream::create(&b, 0, false).unwrap();
    assert!(![mine.key(&b, 0), created.key(&b, 0)].contains(&streampool::stream::LEGACY_KEY));
    // Other streams are themselves.
    let owned = Stream::create(&b, 0, false).unwrap();
    assert_eq!(owned.clone().resolved().handle(), owned.handle());
    assert!(Stream::legacy().resolved().is_legacy());
    assert_eq!(owned.owner_thread(), None);
}

#[test]
fn copies_and_consumers_on_another_thread_are_ordered_after_the_maker() {
    let (sim, b) = sim();
    let mr: ResourceRef = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let alloc = made_elsewhere(&sim, &mr, SIZE);
    let stream = alloc.stream();

    // A copy to the host on the allocation's stream, as this thread names it.
    let mut host = vec![0u8; SIZE];
    // SAFETY: `host` outlives the copy, which completes in the synchronisation below.
    unsafe { b.memcpy_async(0, host.as_mut_ptr() as u64, alloc.ptr(), SIZE, stream.handle()).unwrap() };
    b.stream_synchronize(0, stream.handle()).unwrap();
    assert!(host[0] != 0 && host.iter().all(|&x| x == host[0]), "copied after the maker's write");

    // A consumer stream ordered after it through an event.
    let consumer = Stream::create(&b, 0, false).unwrap();
    let event = Event::new(&b, 0).unwrap();
    event.record(stream).unwrap();
    consumer.wait(&event).unwrap();
    sim.read_labeled(consumer.handle(), alloc.ptr(), SIZE, "consumer's read").unwrap();
    assert_no_races(&sim);
}

#[test]
fn synchronising_another_threads_per_thread_stream_waits_for_its_work() {
    let (sim, b) = sim();
    let alloc =
        made_elsewhere(&sim, &(Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap()) as ResourceRef), SIZE);
    alloc.stream().synchronize(&b, 0).unwrap();
    assert_eq!(sim.pending(), 0, "the maker's write has run");
    assert_no_races(&sim);
}

#[test]
fn dropped_on_another_thread_it_is_freed_in_order_without_waiting() {
    let (sim, b) = sim();
    // The driver's pool: another stream may take the block before the free completes.
    let mr: ResourceRef = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let alloc = made_elsewhere(&sim, &mr, SIZE);
    let ptr = alloc.ptr();
    drop(alloc);
    // The free (on the legacy stream, as this thread names the maker's stream) did not wait
    // for the device: the maker's write is queued, and the free's legacy-stream barrier.
    assert_eq!(sim.pending(), 2, "the free did not wait for the device");
    let s = Stream::create(&b, 0, false).unwrap();
    let again = mr.allocate(SIZE, &s).unwrap();
    assert_eq!(again, ptr);
    sim.write_labeled(s.handle(), again, SIZE, "reuse").unwrap();
    assert_no_races(&sim);
    mr.deallocate(again, SIZE, &s).unwrap();
}

#[test]
fn a_pool_block_freed_on_another_thread_is_reused_in_order() {
    let (sim, b) = sim();
    let upstream: ResourceRef = Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap());
    let options = PoolOptions {
        initial_pool_size: Some(64 << 10),
        maximum_pool_size: Some(64 << 10),
        ..Default::default()
    };
    let pool: ResourceRef = Arc::new(ShardedPoolMemoryResource::new(upstream, options).unwrap());
    for reuse_on in [Stream::per_thread(), Stream::legacy(), Stream::create(&b, 0, false).unwrap()] {
        let alloc = made_elsewhere(&sim, &pool, 64 << 10);
        let ptr = alloc.ptr();
        drop(alloc);
        // The pool cannot grow: this is the block just freed.
        let again = pool.allocate(64 << 10, &reuse_on).unwrap();
        assert_eq!(again, ptr);
        sim.write_labeled(reuse_on.handle(), again, 64 << 10, "reuse").unwrap();
        assert_no_races(&sim);
        pool.deallocate(again, 64 << 10, &reuse_on).unwrap();
        b.ctx_synchronize(0).unwrap();
    }
}

/// The CUDA driver, when `STREAMPOOL_GPU_TESTS=1` (see DEVELOPERS.md).
fn gpu() -> Option<streampool::device::BackendRef> {
    if std::env::var("STREAMPOOL_GPU_TESTS").as_deref() != Ok("1") {
        return None;
    }
    Some(streampool::device::cuda::CudaBackend::get().expect("STREAMPOOL_GPU_TESTS=1 but no CUDA driver"))
}

#[test]
#[ignore = "needs a CUDA GPU: STREAMPOOL_GPU_TESTS=1 and --include-ignored"]
fn on_a_gpu_another_thread_reads_and_reuses_per_thread_memory_in_order() {
    const BYTES: usize = 256 << 20;
    let Some(b) = gpu() else { return };
    let mr: ResourceRef = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    // The maker keeps its per-thread stream busy with memsets, the last of `value`, and
    // hands the allocation over with them still running. It stays alive until the round is
    // done: a thread that exits with work pending on its per-thread stream can make a later
    // synchronisation of the device never return on driver 580 (reproduced without
    // streampool: scripts/gpu_hang_probe.py, variant a), which is not what this test is about.
    let made = |value: u8, keep: std::sync::mpsc::Receiver<()>| {
        let (b, mr) = (b.clone(), mr.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let maker = std::thread::Builder::new()
            .name("maker".into())
            .spawn(move || {
                let alloc = Allocation::new(mr, BYTES, Stream::per_thread()).unwrap();
                for i in 0..32 {
                    b.memset_d8_async(0, alloc.ptr(), i, BYTES, PER_THREAD_STREAM).unwrap();
                }
                b.memset_d8_async(0, alloc.ptr(), value, BYTES, PER_THREAD_STREAM).unwrap();
                tx.send(alloc).unwrap();
                let _ = keep.recv();
                b.stream_synchronize(0, PER_THREAD_STREAM).unwrap();
            })
            .unwrap();
        (rx.recv().unwrap(), maker)
    };
    let read_back = |ptr: u64, stream: &Stream| {
        let mut host = vec![0u8; BYTES];
        // SAFETY: `host` outlives the copy, which completes in the synchronisation below.
        unsafe { b.memcpy_async(0, host.as_mut_ptr() as u64, ptr, BYTES, stream.handle()) }.unwrap();
        b.stream_synchronize(0, stream.handle()).unwrap();
        host
    };
    let other = Stream::create(&b, 0, false).unwrap();
    for round in 0..4u8 {
        // Read here, on the allocation's stream as this thread names it.
        let (done, keep) = std::sync::mpsc::channel();
        let (alloc, maker) = made(0xC0 + round, keep);
        let host = read_back(alloc.ptr(), alloc.stream());
        assert!(host.iter().all(|&x| x == 0xC0 + round), "round {round}: read before the maker's memsets");
        drop(alloc);
        // Dropped here with the maker's memsets running, then reused on another stream:
        // none of them may land over the new contents.
        let (done2, keep2) = std::sync::mpsc::channel();
        let (alloc, maker2) = made(0xD0 + round, keep2);
        drop(alloc);
        let again = mr.allocate(BYTES, &other).unwrap();
        b.memset_d8_async(0, again, 0x11, BYTES, other.handle()).unwrap();
        let host = read_back(again, &other);
        assert!(host.iter().all(|&x| x == 0x11), "round {round}: the maker's memsets landed after the reuse");
        mr.deallocate(again, BYTES, &other).unwrap();
        for (d, m) in [(done, maker), (done2, maker2)] {
            d.send(()).unwrap();
            m.join().unwrap();
        }
    }
}
