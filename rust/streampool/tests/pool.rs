//! The sharded pool's own behaviour on the simulated device: each step of its policy,
//! its accounting, growth and release, bad input, and concurrency.

use std::sync::{Arc, Barrier};

mod common;
use common::{assert_accounting, assert_no_races, stream, XorShift};

use proptest::prelude::*;
use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr};
use streampool::resource::ResourceRef;
use streampool::{
    CudaAsyncMemoryResource, CudaMemoryResource, Error, MemoryResource, PoolOptions,
    ShardedPoolMemoryResource, Stream,
};

const MIB: usize = 1 << 20;

fn setup(capacity: usize) -> (Arc<SimDevice>, BackendRef) {
    let sim = SimDevice::new(capacity);
    let backend: BackendRef = sim.clone();
    (sim, backend)
}

fn pool(b: &BackendRef, options: PoolOptions) -> ShardedPoolMemoryResource {
    let upstream: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    ShardedPoolMemoryResource::new(upstream, options).unwrap()
}

#[test]
fn same_stream_reuse_needs_no_event_and_no_growth() {
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions::default());
    let s = stream(&b);
    let first = p.allocate(MIB, &s).unwrap();
    p.deallocate(first, MIB, &s).unwrap();
    for _ in 0..100 {
        let ptr = p.allocate(MIB, &s).unwrap();
        assert_eq!(ptr, first, "best fit in the own shard returns the same block");
        sim.write(s.handle(), ptr, MIB).unwrap();
        p.deallocate(ptr, MIB, &s).unwrap();
    }
    let st = p.stats();
    assert_eq!(st.upstream_growths, 1);
    assert_eq!((st.cross_stream_waits, st.synchronizations), (0, 0));
    assert!(st.events_recorded <= 2, "events are recorded per batch of frees: {st:?}");
    assert_accounting(&st);
    assert_no_races(&sim);
}

/// Within the footprint budget (here: none), growing is preferred to making one stream
/// wait on another.
#[test]
fn growth_is_preferred_to_waiting_on_another_stream() {
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions { events_every: 1, headroom: None, ..Default::default() });
    let (a, c) = (stream(&b), stream(&b));
    let x = p.allocate(4 * MIB, &a).unwrap();
    sim.write(a.handle(), x, 4 * MIB).unwrap(); // still pending
    p.deallocate(x, 4 * MIB, &a).unwrap();
    let y = p.allocate(4 * MIB, &c).unwrap();
    assert_ne!(x, y, "a's block is not complete: c must not get it without ordering");
    sim.write(c.handle(), y, 4 * MIB).unwrap();
    let st = p.stats();
    assert_eq!((st.upstream_growths, st.cross_stream_waits), (2, 0), "{st:?}");
    assert_no_races(&sim);
}

#[test]
fn completed_blocks_of_other_streams_are_taken_without_waiting() {
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions { events_every: 1, ..Default::default() });
    let (a, c) = (stream(&b), stream(&b));
    let x = p.allocate(4 * MIB, &a).unwrap();
    sim.write(a.handle(), x, 4 * MIB).unwrap();
    p.deallocate(x, 4 * MIB, &a).unwrap(); // records an event (events_every = 1)
    sim.run(); // ... which completes
    let y = p.allocate(4 * MIB, &c).unwrap();
    assert_eq!(x, y);
    sim.write(c.handle(), y, 4 * MIB).unwrap();
    let st = p.stats();
    assert_eq!((st.completed_steals, st.cross_stream_waits, st.upstream_growths), (1, 0, 1), "{st:?}");
    assert_no_races(&sim);
}

/// A producer stream allocates what a consumer stream frees, with no maximum. The consumer
/// would record events rarely while nobody needs its memory; the producer's look into its
/// shard asks it to record at its next free, so the producer takes completed blocks instead
/// of growing the pool (3-6 MiB for a 1 MiB working set, against 1.1 GiB when nobody asks).
#[test]
fn a_stream_that_only_frees_what_another_allocates_does_not_make_the_pool_grow() {
    let (sim, b) = setup(8 << 30);
    let p = pool(&b, PoolOptions::default());
    let (producer, consumer) = (stream(&b), stream(&b));
    for i in 0..2000 {
        let x = p.allocate(MIB, &producer).unwrap();
        p.deallocate(x, MIB, &consumer).unwrap();
        if i % 4 == 0 {
            sim.run();
        }
    }
    let st = p.stats();
    assert_accounting(&st);
    assert!(st.reserved_bytes <= 16 * MIB, "the pool grew to {} MiB: {st:?}", st.reserved_bytes / MIB);
    // Reused, a batch at a time: taken once complete (every completed block of the
    // consumer at once), or at the budget with a wait on the consumer's event; never
    // after a device synchronisation.
    assert!(st.upstream_growths <= 4 && st.completed_steals + st.cross_stream_waits >= 500, "{st:?}");
    assert_eq!(st.synchronizations, 0, "{st:?}");
}

/// A consumer frees blocks allocated on several producers' streams, in runs from one
/// producer and then mixed: each free finds its block whichever shard holds it (the shard
/// where the last such free found one is looked at first), a wrong size or a second free
/// is refused whether or not that shard is the one looked at first, and the accounting
/// stays exact.
#[test]
fn frees_on_another_stream_find_their_blocks_in_any_shard() {
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions::default());
    let producers: Vec<Stream> = (0..4).map(|_| stream(&b)).collect();
    let consumer = stream(&b);
    let mut rng = XorShift::new(7);
    for round in 0..50 {
        let mut blocks = Vec::new();
        for (i, s) in producers.iter().enumerate() {
            for _ in 0..3 {
                let bytes = 4096 * (1 + i) + round;
                let ptr = p.allocate(bytes, s).unwrap();
                sim.write(s.handle(), ptr, 256).unwrap();
                blocks.push((ptr, bytes, s));
            }
        }
        if round % 2 == 1 {
            // Mixed: the shard looked at first is rarely the one that holds the block.
            for i in (1..blocks.len()).rev() {
                blocks.swap(i, rng.next() as usize % (i + 1));
            }
        }
        for (n, &(ptr, bytes, s)) in blocks.iter().enumerate() {
            let ready = streampool::Event::new(&b, 0).unwrap();
            ready.record(s).unwrap();
            consumer.wait(&ready).unwrap();
            sim.read(consumer.handle(), ptr, 256).unwrap();
            if n == 0 {
                let err = p.deallocate(ptr, bytes + (1 << 20), &consumer).unwrap_err();
                assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
            }
            p.deallocate(ptr, bytes, &consumer).unwrap();
            if n == 1 {
                let err = p.deallocate(ptr, bytes, &consumer).unwrap_err();
                assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
            }
        }
        sim.run();
    }
    let st = p.stats();
    assert_eq!(st.used_bytes, 0, "{st:?}");
    assert_accounting(&st);
    assert_no_races(&sim);
}

/// The binding's fast path (`try_deallocate`, which keeps Python's GIL) settles a free on
/// a consumer's stream of a block allocated on a producer's once the consumer's shard knows
/// where such blocks come from (recording an event when one is due); the first such free
/// and a block found elsewhere go to the full path (`None`). A wrong size found there is
/// refused and leaves the block live.
#[test]
fn the_fast_path_settles_a_free_across_streams_once_its_source_is_known() {
    let (sim, b) = setup(256 * MIB);
    for events_every in [64, 1] {
        let p = pool(&b, PoolOptions { events_every, ..Default::default() });
        let (producer, other, consumer) = (stream(&b), stream(&b), stream(&b));
        let blocks: Vec<DevPtr> = (0..3).map(|_| p.allocate(MIB, &producer).unwrap()).collect();
        let elsewhere = p.allocate(MIB, &other).unwrap();
        for &x in blocks.iter().chain([&elsewhere]) {
            sim.write(producer.handle(), x, 256).unwrap();
        }
        sim.run();
        assert!(p.try_deallocate(blocks[0], MIB, &consumer).is_none(), "no source known yet");
        p.deallocate(blocks[0], MIB, &consumer).unwrap();
        if events_every == 1 {
            // The event just recorded doubled the interval (nobody asked for this stream's
            // memory): the next free is not due, the one after is, and records it (a
            // driver call that does not wait).
            assert!(matches!(p.try_deallocate(blocks[1], MIB, &consumer), Some(Ok(()))));
            let recorded = p.stats().events_recorded;
            assert!(matches!(p.try_deallocate(blocks[2], MIB, &consumer), Some(Ok(()))));
            assert_eq!(p.stats().events_recorded, recorded + 1, "the due event is recorded");
        } else {
            assert!(matches!(p.try_deallocate(blocks[1], MIB, &consumer), Some(Ok(()))));
            let err = p.try_deallocate(blocks[2], 2 * MIB, &consumer).unwrap();
            assert!(matches!(err, Err(Error::InvalidPointer(_))), "{err:?}");
            assert!(p.try_deallocate(elsewhere, MIB, &consumer).is_none(), "not where the last one was");
            assert!(p.try_deallocate(blocks[1], MIB, &consumer).is_none(), "a second free");
            let err = p.deallocate(blocks[1], MIB, &consumer).unwrap_err();
            assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
        }
        for &x in &blocks[1..] {
            let _ = p.deallocate(x, MIB, &consumer);
        }
        p.deallocate(elsewhere, MIB, &consumer).unwrap();
        let st = p.stats();
        assert_eq!(st.used_bytes, 0, "{st:?}");
        assert_accounting(&st);
    }
    assert_no_races(&sim);
}

#[test]
fn at_the_maximum_a_stream_waits_on_another_streams_event() {
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions { maximum_pool_size: Some(8 * MIB), events_every: 1, ..Default::default() });
    let (a, c) = (stream(&b), stream(&b));
    let x = p.allocate(8 * MIB, &a).unwrap();
    sim.write_labeled(a.handle(), x, 8 * MIB, "a's last write").unwrap();
    p.deallocate(x, 8 * MIB, &a).unwrap();
    let y = p.allocate(8 * MIB, &c).unwrap();
    assert_eq!(x, y);
    sim.write_labeled(c.handle(), y, 8 * MIB, "c's first write").unwrap();
    let st = p.stats();
    assert_eq!((st.cross_stream_waits, st.synchronizations), (1, 0), "{st:?}");
    assert_no_races(&sim);
    assert_accounting(&p.stats());
}

#[test]
fn blocks_without_an_event_are_reclaimed_by_a_synchronisation() {
    let (sim, b) = setup(256 * MIB);
    // Events only every 1000 frees: a's free has none.
    let p =
        pool(&b, PoolOptions { maximum_pool_size: Some(8 * MIB), events_every: 1000, ..Default::default() });
    // A borrowed handle: the pool cannot see its end, so it records nothing on it outside
    // its calls (on a stream it owns, it would cover the free with an event and a wait:
    // `handoff_calls.rs`).
    let (owned, c) = (stream(&b), stream(&b));
    let a = Stream::borrowed(&b, owned.handle()).unwrap();
    let x = p.allocate(8 * MIB, &a).unwrap();
    sim.write(a.handle(), x, 8 * MIB).unwrap();
    p.deallocate(x, 8 * MIB, &a).unwrap();
    let y = p.allocate(8 * MIB, &c).unwrap();
    assert_eq!(x, y);
    sim.write(c.handle(), y, 8 * MIB).unwrap();
    assert_eq!(p.stats().synchronizations, 1);
    assert_no_races(&sim);
}

#[test]
fn a_fresh_chunk_from_an_async_upstream_is_ordered_for_its_stream_only() {
    // The driver's pool may hand the chunk to `a` by making `a` wait on `z`'s free; the
    // rest of the chunk must not go to `c` as if it were free everywhere.
    let (sim, b) = setup(64 * MIB);
    let upstream = Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let (z, a, c) = (stream(&b), stream(&b), stream(&b));
    let big = upstream.allocate(32 * MIB, &z).unwrap();
    sim.write_labeled(z.handle(), big, 32 * MIB, "z's write before its free").unwrap();
    upstream.deallocate(big, 32 * MIB, &z).unwrap();
    let p =
        ShardedPoolMemoryResource::new(upstream, PoolOptions { events_every: 1000, ..Default::default() })
            .unwrap();
    let first = p.allocate(MIB, &a).unwrap(); // grows on `a`
    sim.write(a.handle(), first, MIB).unwrap();
    let second = p.allocate(MIB, &c).unwrap();
    sim.write_labeled(c.handle(), second, MIB, "c's write").unwrap();
    assert_no_races(&sim);
}

#[test]
fn release_gives_whole_chunks_back_and_accounting_is_exact() {
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions { initial_pool_size: Some(16 * MIB), ..Default::default() });
    let s = stream(&b);
    assert_eq!(p.stats().reserved_bytes, 16 * MIB);
    let ptrs: Vec<DevPtr> = (0..8).map(|_| p.allocate(5 * MIB, &s).unwrap()).collect();
    assert_accounting(&p.stats());
    for &ptr in &ptrs {
        p.deallocate(ptr, 5 * MIB, &s).unwrap();
    }
    s.synchronize(&b, 0).unwrap();
    // Blocks freed with no event are not known complete to the pool: release()
    // synchronises, gathers them, and gives back every chunk, the first one included.
    let released = p.release().unwrap();
    let st = p.stats();
    assert_accounting(&st);
    assert_eq!(st.released_bytes as usize, released);
    assert_eq!((st.used_bytes, st.reserved_bytes), (0, 0), "{st:?}");
    assert_no_races(&sim);
}

#[test]
fn a_release_threshold_keeps_the_pool_from_hoarding() {
    let (_sim, b) = setup(256 * MIB);
    let p = pool(
        &b,
        PoolOptions {
            maximum_pool_size: Some(64 * MIB),
            release_threshold: Some(0),
            events_every: 1,
            ..Default::default()
        },
    );
    let (a, c) = (stream(&b), stream(&b));
    let x = p.allocate(40 * MIB, &a).unwrap();
    p.deallocate(x, 40 * MIB, &a).unwrap();
    // c cannot fit beside a's chunk without the synchronisation step, which gathers and
    // then releases what is free beyond the threshold.
    let y = p.allocate(60 * MIB, &c).unwrap();
    let st = p.stats();
    assert_eq!(st.synchronizations, 1, "{st:?}");
    assert!(st.released_bytes >= 40 * MIB as u64, "{st:?}");
    assert_accounting(&st);
    p.deallocate(y, 60 * MIB, &c).unwrap();
}

#[test]
fn bad_options_and_bad_frees() {
    let (_sim, b) = setup(64 * MIB);
    let upstream: ResourceRef = Arc::new(CudaMemoryResource::on(b.clone(), 0).unwrap());
    let err = ShardedPoolMemoryResource::new(
        upstream.clone(),
        PoolOptions {
            initial_pool_size: Some(8 * MIB),
            maximum_pool_size: Some(4 * MIB),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("maximum_pool_size"),
        "{err}"
    );
    let err = ShardedPoolMemoryResource::new(
        upstream.clone(),
        PoolOptions { events_every: 0, ..Default::default() },
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // Sizes that are not multiples of 256 are rounded up, the maximum too: equal sizes stay
    // equal, and a maximum holds an allocation of its own size.
    let tight = ShardedPoolMemoryResource::new(
        upstream.clone(),
        PoolOptions { initial_pool_size: Some(1000), maximum_pool_size: Some(1000), ..Default::default() },
    )
    .unwrap();
    let q = tight.allocate(1000, &Stream::legacy()).unwrap();
    tight.deallocate(q, 1000, &Stream::legacy()).unwrap();
    let p = ShardedPoolMemoryResource::new(
        upstream.clone(),
        PoolOptions {
            initial_pool_size: Some(1000),
            maximum_pool_size: Some(4 * MIB + 100),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(p.stats().reserved_bytes, 1024);
    let err = p.allocate(4 * MIB + 1, &Stream::legacy()).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { requested, .. } if requested == 4 * MIB + 1), "{err:?}");
    let s = stream(&b);
    let ptr = p.allocate(1000, &s).unwrap();
    assert!(matches!(p.deallocate(ptr + (8 << 20), 1000, &s), Err(Error::InvalidPointer(_))));
    p.deallocate(ptr, 1000, &s).unwrap();
    assert!(matches!(p.deallocate(ptr, 1000, &s), Err(Error::InvalidPointer(_))), "double free");
    let again = p.allocate(1000, &s).unwrap();
    p.deallocate(again, 1000, &s).unwrap();
    // A size that does not round to the allocation's, on its stream or on another: refused
    // in every build, nothing changes.
    let ptr = p.allocate(1000, &s).unwrap();
    let other = stream(&b);
    for on in [&s, &other] {
        let err = p.deallocate(ptr, 5000, on).unwrap_err();
        assert!(
            matches!(err, Error::InvalidPointer(_)) && err.to_string().contains("allocated with 1024"),
            "{err}"
        );
    }
    assert_eq!(p.stats().used_bytes, 1024);
    // Freed on another stream than its allocation's, then freed again on either.
    p.deallocate(ptr, 1000, &other).unwrap();
    for on in [&s, &other] {
        let err = p.deallocate(ptr, 1000, on).unwrap_err();
        assert!(matches!(err, Error::InvalidPointer(_)) && err.to_string().contains("double free"), "{err}");
    }
    assert_accounting(&p.stats());
    assert_eq!(p.stats().used_bytes, 0);
}

/// An upstream that fails every other growth.
#[derive(Debug)]
struct Flaky {
    inner: CudaMemoryResource,
    calls: std::sync::atomic::AtomicUsize,
}

impl MemoryResource for Flaky {
    fn backend(&self) -> &BackendRef {
        self.inner.backend()
    }
    fn device(&self) -> i32 {
        0
    }
    fn name(&self) -> &str {
        "Flaky"
    }
    fn memory_kind(&self) -> streampool::MemoryKind {
        streampool::MemoryKind::Device
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> streampool::Result<DevPtr> {
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 2 == 1 {
            return Err(Error::Driver {
                call: "cuMemAlloc",
                code: 999,
                name: "CUDA_ERROR_UNKNOWN".into(),
                context: String::new(),
            });
        }
        self.inner.allocate(bytes, stream)
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> streampool::Result<()> {
        self.inner.deallocate(ptr, bytes, stream)
    }
}

#[test]
fn an_upstream_failing_mid_growth_leaves_exact_accounting() {
    let (_sim, b) = setup(256 * MIB);
    let flaky =
        Arc::new(Flaky { inner: CudaMemoryResource::on(b.clone(), 0).unwrap(), calls: Default::default() });
    let p = ShardedPoolMemoryResource::new(flaky, PoolOptions::default()).unwrap();
    let s = stream(&b);
    let mut live = vec![];
    let mut failures = 0;
    for i in 0..12 {
        match p.allocate((i + 1) * 3 * MIB, &s) {
            Ok(ptr) => live.push((ptr, (i + 1) * 3 * MIB)),
            Err(e) => {
                assert!(matches!(e, Error::Driver { code: 999, .. }), "{e:?}");
                failures += 1;
            }
        }
        assert_accounting(&p.stats());
    }
    assert!(failures > 0);
    for (ptr, n) in live {
        p.deallocate(ptr, n, &s).unwrap();
    }
    let st = p.stats();
    assert_accounting(&st);
    assert_eq!(st.used_bytes, 0);
}

/// An upstream that keeps the last chunk given back and hands that same address out again
/// at once (as the driver's pool may, to another thread, while the pool is still giving the
/// chunk back); the first time it is given a chunk back, it runs `during_free` first. While
/// `refuse` is set, it refuses to take chunks back.
#[derive(Debug, Default)]
struct Recycling {
    inner: Option<CudaMemoryResource>,
    refuse: std::sync::atomic::AtomicBool,
    kept: std::sync::Mutex<Option<(DevPtr, usize)>>,
    during_free: std::sync::OnceLock<std::sync::Weak<ShardedPoolMemoryResource>>,
    fired: std::sync::atomic::AtomicBool,
}

impl MemoryResource for Recycling {
    fn backend(&self) -> &BackendRef {
        self.inner.as_ref().unwrap().backend()
    }
    fn device(&self) -> i32 {
        0
    }
    fn name(&self) -> &str {
        "Recycling"
    }
    fn memory_kind(&self) -> streampool::MemoryKind {
        streampool::MemoryKind::Device
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> streampool::Result<DevPtr> {
        let mut kept = self.kept.lock().unwrap();
        match *kept {
            Some((ptr, n)) if n == bytes => {
                *kept = None;
                Ok(ptr)
            }
            _ => self.inner.as_ref().unwrap().allocate(bytes, stream),
        }
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, _stream: &Stream) -> streampool::Result<()> {
        if self.refuse.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Error::Driver {
                call: "cuMemFreeAsync",
                code: 999,
                name: "CUDA_ERROR_UNKNOWN".into(),
                context: String::new(),
            });
        }
        let old = self.kept.lock().unwrap().replace((ptr, bytes));
        if let Some((p, n)) = old {
            self.inner.as_ref().unwrap().deallocate(p, n, &Stream::legacy())?;
        }
        if !self.fired.swap(true, std::sync::atomic::Ordering::Relaxed) {
            let pool = self.during_free.get().and_then(|w| w.upgrade()).unwrap();
            // Another stream grows the pool while this chunk is on its way back.
            let other = stream(self.backend());
            let ptr = pool.allocate(bytes, &other).unwrap();
            pool.deallocate(ptr, bytes, &other).unwrap();
        }
        Ok(())
    }
}

/// A chunk given back while another thread grows the pool, and handed that same address by
/// the upstream: the chunk given back leaves the pool's table, the new one stays, and
/// `release()` then gives it back too (it was kept, reserved and unreleasable, when chunks
/// left the table by address: the hand-off soak left 2-4 MiB after `release()` now and then).
#[test]
fn a_chunk_given_back_while_its_address_is_grown_again_is_released_later() {
    let (sim, b) = setup(256 * MIB);
    let upstream = Arc::new(Recycling {
        inner: Some(CudaMemoryResource::on(b.clone(), 0).unwrap()),
        ..Default::default()
    });
    let p = Arc::new(ShardedPoolMemoryResource::new(upstream.clone(), PoolOptions::default()).unwrap());
    upstream.during_free.set(Arc::downgrade(&p)).unwrap();
    let s = stream(&b);
    let ptr = p.allocate(2 * MIB, &s).unwrap();
    p.deallocate(ptr, 2 * MIB, &s).unwrap();
    p.release().unwrap();
    assert!(upstream.fired.load(std::sync::atomic::Ordering::Relaxed));
    let st = p.stats();
    assert_accounting(&st);
    assert_eq!((st.used_bytes, st.upstream_growths), (0, 2), "{st:?}");
    p.release().unwrap();
    assert_eq!(p.stats().reserved_bytes, 0, "{:?}", p.stats());
    // The address serves again.
    let again = p.allocate(2 * MIB, &s).unwrap();
    p.deallocate(again, 2 * MIB, &s).unwrap();
    assert_no_races(&sim);
}

/// An upstream that refuses to take chunks back: `release()` says so, and the pool keeps
/// them, free and whole, with exact accounting; a later `release()` gives them back.
#[test]
fn a_refused_give_back_keeps_the_chunks_free() {
    let (sim, b) = setup(256 * MIB);
    let upstream = Arc::new(Recycling {
        inner: Some(CudaMemoryResource::on(b.clone(), 0).unwrap()),
        ..Default::default()
    });
    upstream.fired.store(true, std::sync::atomic::Ordering::Relaxed);
    let p = ShardedPoolMemoryResource::new(upstream.clone(), PoolOptions::default()).unwrap();
    let s = stream(&b);
    let ptrs: Vec<_> = (1..=3).map(|i| p.allocate(i * 3 * MIB, &s).unwrap()).collect();
    for (i, ptr) in ptrs.into_iter().enumerate() {
        p.deallocate(ptr, (i + 1) * 3 * MIB, &s).unwrap();
    }
    let held = p.stats().reserved_bytes;
    upstream.refuse.store(true, std::sync::atomic::Ordering::Relaxed);
    let err = p.release().unwrap_err();
    assert!(matches!(err, Error::Driver { code: 999, .. }), "{err:?}");
    let st = p.stats();
    assert_accounting(&st);
    assert_eq!((st.reserved_bytes, st.free_bytes, st.released_bytes), (held, held, 0), "{st:?}");
    // Still usable, and the chunks still go back once the upstream takes them.
    let x = p.allocate(9 * MIB, &s).unwrap();
    p.deallocate(x, 9 * MIB, &s).unwrap();
    upstream.refuse.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(p.release().unwrap(), held);
    assert_eq!(p.stats().reserved_bytes, 0);
    assert_no_races(&sim);
}

/// RMM's draft fine-grained-locking patch lost a freed block when two threads used a new
/// stream for the first time at once. Here both get the same shard, every time.
#[test]
fn first_use_of_a_new_stream_by_two_threads_loses_nothing() {
    let (sim, b) = setup(512 * MIB);
    let p = Arc::new(pool(&b, PoolOptions::default()));
    for round in 0..50 {
        let s = stream(&b);
        let barrier = Arc::new(Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|t| {
                let (p, s, barrier) = (p.clone(), s.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let n = (t + 1) * 4096 + round * 256;
                    let ptr = p.allocate(n, &s).unwrap();
                    barrier.wait();
                    p.deallocate(ptr, n, &s).unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let st = p.stats();
        assert_accounting(&st);
        assert_eq!(st.used_bytes, 0);
        let key = s.key(&b, 0);
        let in_shard = st.shard_free_bytes.iter().filter(|(k, _)| *k == key).count();
        assert_eq!(in_shard, 1, "one shard per stream");
    }
    assert_no_races(&sim);
}

#[test]
fn eight_threads_on_several_streams() {
    let (sim, b) = setup(1 << 30);
    let p = Arc::new(pool(
        &b,
        PoolOptions { maximum_pool_size: Some(256 * MIB), events_every: 8, ..Default::default() },
    ));
    let streams: Vec<Stream> = (0..4).map(|_| stream(&b)).collect();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (p, sim, streams) = (p.clone(), sim.clone(), streams.clone());
            std::thread::spawn(move || {
                let mut window: std::collections::VecDeque<(DevPtr, usize, usize)> = Default::default();
                let mut rng = XorShift::new(t as u64);
                for i in 0..600 {
                    let x = rng.next();
                    let n = 1024 << (x % 10);
                    let si = if i % 5 == 0 { (t + 1) % 4 } else { t % 4 };
                    let s = if t == 7 { Stream::per_thread() } else { streams[si].clone() };
                    let ptr = p.allocate(n, &s).unwrap();
                    sim.write(s.handle(), ptr, n).unwrap();
                    window.push_back((ptr, n, si));
                    if window.len() > 16 {
                        let (ptr, n, si) = window.pop_front().unwrap();
                        let s = if t == 7 { Stream::per_thread() } else { streams[si].clone() };
                        p.deallocate(ptr, n, &s).unwrap();
                    }
                    if i % 97 == 0 {
                        sim.step_any();
                    }
                }
                for (ptr, n, si) in window {
                    let s = if t == 7 { Stream::per_thread() } else { streams[si].clone() };
                    p.deallocate(ptr, n, &s).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let st = p.stats();
    assert_accounting(&st);
    assert_eq!(st.used_bytes, 0);
    assert_no_races(&sim);
}

/// Eight threads on one stream: every operation contends for the same shard's lock. A lock
/// that let two threads in would corrupt the free list, and a block would be handed out
/// twice (debug builds assert on the live bits) or the accounting would drift.
#[test]
fn eight_threads_on_one_stream() {
    let (_sim, b) = setup(1 << 30);
    let p = Arc::new(pool(&b, PoolOptions::default()));
    let s = stream(&b);
    std::thread::scope(|scope| {
        for t in 0..8u64 {
            let (p, s) = (p.clone(), s.clone());
            scope.spawn(move || {
                let mut window = std::collections::VecDeque::new();
                let mut rng = XorShift::new(t + 1);
                for _ in 0..5000 {
                    let x = rng.next();
                    let n = 256 << (x % 12);
                    window.push_back((p.allocate(n, &s).unwrap(), n));
                    if window.len() > 8 {
                        let (ptr, n) = window.pop_front().unwrap();
                        p.deallocate(ptr, n, &s).unwrap();
                    }
                }
                for (ptr, n) in window {
                    p.deallocate(ptr, n, &s).unwrap();
                }
            });
        }
    });
    let st = p.stats();
    assert_accounting(&st);
    assert_eq!(st.used_bytes, 0);
}

/// Four streams under a maximum that cannot hold what they ask together: growth fails,
/// streams take each other's blocks (completed, waited for, or after a synchronisation)
/// while others free; an allocation may fail cleanly, and every byte stays accounted for.
#[test]
fn four_streams_under_a_tight_maximum() {
    let (sim, b) = setup(1 << 30);
    let p = Arc::new(pool(
        &b,
        PoolOptions { maximum_pool_size: Some(6 * MIB), events_every: 1, ..Default::default() },
    ));
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (p, b, sim) = (p.clone(), b.clone(), sim.clone());
            scope.spawn(move || {
                let s = stream(&b);
                let mut rng = XorShift::new(t + 1);
                for i in 0..300 {
                    let x = rng.next();
                    let n = MIB + (x % (2 * MIB as u64)) as usize;
                    match p.allocate(n, &s) {
                        Ok(ptr) => {
                            sim.write(s.handle(), ptr, n).unwrap();
                            p.deallocate(ptr, n, &s).unwrap();
                        }
                        Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                    }
                    if i % 7 == 0 {
                        sim.step_any();
                    }
                }
            });
        }
    });
    let st = p.stats();
    assert_accounting(&st);
    assert_eq!(st.used_bytes, 0);
    assert!(st.reserved_bytes <= 6 * MIB);
    assert!(st.cross_stream_waits + st.synchronizations + st.completed_steals > 0, "{st:?}");
    assert_no_races(&sim);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random interleavings of streams, sizes, frees on other streams, steps of the
    /// simulated device, host synchronisations of a stream and a small maximum (so every policy step runs), with an event
    /// batch from 1 to 11: no race, no overlap, exact accounting after every operation.
    #[test]
    fn random_interleavings(
        ops in proptest::collection::vec((0u8..7, 0usize..1 << 22, 0usize..4), 1..120),
        event_batch in 1usize..12,
    ) {
        let (sim, b) = setup(256 * MIB);
        let options = PoolOptions { maximum_pool_size: Some(24 * MIB), events_every: 3, event_batch, ..Default::default() };
        let p = pool(&b, options);
        let streams: Vec<Stream> = (0..4).map(|_| stream(&b)).collect();
        let mut live: Vec<(DevPtr, usize, usize)> = vec![];
        for (op, n, si) in ops {
            let s = &streams[si];
            match op {
                0..=2 => {
                    let n = n % (6 * MIB) + 1;
                    match p.allocate(n, s) {
                        Ok(ptr) => {
                            for &(q, m, _) in &live {
                                prop_assert!(ptr + n as u64 <= q || q + m as u64 <= ptr, "overlap");
                            }
                            sim.write(s.handle(), ptr, n).unwrap();
                            live.push((ptr, n, si));
                        }
                        Err(e) => prop_assert!(e.is_out_of_memory(), "{e:?}"),
                    }
                }
                3 | 4 if !live.is_empty() => {
                    // Used last on its own stream, freed there (op 3), or handed to another
                    // stream through an event first and freed on that one (op 4).
                    let (ptr, n, home) = live.swap_remove(n % live.len());
                    let home = &streams[home];
                    sim.read(home.handle(), ptr, n).unwrap();
                    if op == 4 {
                        let ev = streampool::Event::new(&b, 0).unwrap();
                        ev.record(home).unwrap();
                        s.wait(&ev).unwrap();
                        sim.read(s.handle(), ptr, n).unwrap();
                        p.deallocate(ptr, n, s).unwrap();
                    } else {
                        p.deallocate(ptr, n, home).unwrap();
                    }
                }
                // A host synchronisation completes the stream's frees so far without an event.
                6 => s.synchronize(&b, 0).unwrap(),
                _ => { sim.step(s.handle()).unwrap(); }
            }
            let st = p.stats();
            prop_assert_eq!(st.reserved_bytes, st.used_bytes + st.free_bytes);
            prop_assert!(st.reserved_bytes <= 24 * MIB);
        }
        sim.run();
        prop_assert!(sim.races().is_empty(), "{}", sim.races()[0]);
    }
}

/// The binding's fast path (`try_allocate`, which keeps Python's GIL) takes completed
/// blocks from other streams' shards (step 3, every lock tried, never waited for: its
/// event queries never wait for the device), so that a producer whose chunks a consumer
/// frees neither grows nor gives the GIL back. When no block is known complete, the full
/// path decides (`None`).
#[test]
fn the_fast_path_takes_completed_blocks_of_other_streams() {
    const SIZE: usize = 2 * MIB;
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions { events_every: 1, ..Default::default() });
    let (producer, consumer) = (stream(&b), stream(&b));
    let hand_over = |xs: &[DevPtr]| {
        for &x in xs {
            sim.write(producer.handle(), x, 256).unwrap();
            p.deallocate(x, SIZE, &consumer).unwrap();
        }
    };
    let xs: Vec<DevPtr> = (0..4).map(|_| p.allocate(SIZE, &producer).unwrap()).collect();
    hand_over(&xs);
    assert!(p.try_allocate(SIZE, &producer).is_none(), "the consumer's work has not run");
    sim.run();
    let before = p.stats();
    let mut live = Vec::new();
    while let Some(Ok(x)) = p.try_allocate(SIZE, &producer) {
        sim.write(producer.handle(), x, SIZE).unwrap();
        live.push(x);
    }
    let st = p.stats();
    assert!(!live.is_empty(), "{st:?}");
    assert_eq!(st.used_bytes, live.len() * SIZE, "{st:?}");
    assert_eq!(st.upstream_growths, before.upstream_growths, "{st:?}");
    assert_eq!((st.cross_stream_waits, st.synchronizations), (0, 0), "{st:?}");
    assert!(st.completed_steals > before.completed_steals, "{st:?}");
    // Again, once the consumer's work on them has run.
    hand_over(&live);
    assert!(p.try_allocate(SIZE, &producer).is_none(), "the consumer's work has not run");
    sim.run();
    let y = p.try_allocate(SIZE, &producer).expect("settled on the fast path").unwrap();
    sim.write(producer.handle(), y, SIZE).unwrap();
    // A wrong size is refused on the fast path too, and leaves the pool usable.
    assert!(matches!(p.try_deallocate(y, SIZE + MIB, &producer), Some(Err(Error::InvalidPointer(_)))));
    p.deallocate(y, SIZE, &producer).unwrap();
    assert_eq!(p.stats().used_bytes, 0);
    assert_accounting(&p.stats());
    assert_no_races(&sim);
}

/// With several consumers, the fast path finds completed blocks in a shard other than the
/// one it last took from (a producer's chunks come back through whichever consumer
/// freed them): before, only that one shard was looked at, and a third of the allocations
/// of the Python pipeline at 8 pairs gave the GIL back for the full path.
#[test]
fn the_fast_path_looks_beyond_the_shard_it_last_took_from() {
    const SIZE: usize = 2 * MIB;
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions { events_every: 1, ..Default::default() });
    let (producer, first, second) = (stream(&b), stream(&b), stream(&b));
    let x = p.allocate(SIZE, &producer).unwrap();
    let y = p.allocate(SIZE, &producer).unwrap();
    p.deallocate(x, SIZE, &first).unwrap();
    sim.run();
    // Taken from the first consumer's shard: that is now the producer's source.
    let x = p.try_allocate(SIZE, &producer).expect("settled on the fast path").unwrap();
    p.deallocate(y, SIZE, &second).unwrap();
    sim.run();
    let before = p.stats();
    let y = p.try_allocate(SIZE, &producer).expect("found in the second consumer's shard").unwrap();
    let st = p.stats();
    assert_eq!(st.upstream_growths, before.upstream_growths, "{st:?}");
    assert_eq!(st.completed_steals, before.completed_steals + 1, "{st:?}");
    for z in [x, y] {
        sim.write(producer.handle(), z, SIZE).unwrap();
        p.deallocate(z, SIZE, &producer).unwrap();
    }
    assert_accounting(&p.stats());
    assert_no_races(&sim);
}

/// A host synchronisation of a stream (`Stream::synchronize`) completes the frees made on
/// it before the synchronisation started, with no event and no query: another stream then
/// takes those blocks at once. A free made after it is not complete for that
/// synchronisation: the block is handed out only ordered (here, at the pool's maximum, by
/// an event and a wait), and the detector finds no race.
#[test]
fn a_synchronisation_completes_the_frees_made_before_it() {
    const SIZE: usize = 2 * MIB;
    let (sim, b) = setup(256 * MIB);
    let options = PoolOptions { events_every: 4096, maximum_pool_size: Some(8 * MIB), ..Default::default() };
    let p = pool(&b, options);
    let (producer, consumer) = (stream(&b), stream(&b));
    let xs: Vec<DevPtr> = (0..4).map(|_| p.allocate(SIZE, &producer).unwrap()).collect();
    let handed = streampool::Event::new(&b, 0).unwrap();
    handed.record(&producer).unwrap();
    consumer.wait(&handed).unwrap();
    // Work of the consumer's on each block, pending until the device runs it.
    let use_and_free = |x: DevPtr| {
        sim.write(consumer.handle(), x, 256).unwrap();
        p.deallocate(x, SIZE, &consumer).unwrap();
    };
    use_and_free(xs[0]);
    use_and_free(xs[1]);
    consumer.synchronize(&b, 0).unwrap();
    use_and_free(xs[2]);
    let before = p.stats();
    let mut got: Vec<DevPtr> = (0..2).map(|_| p.allocate(SIZE, &producer).unwrap()).collect();
    got.sort_unstable();
    let mut first = vec![xs[0], xs[1]];
    first.sort_unstable();
    assert_eq!(got, first);
    let st = p.stats();
    let calls = |s: &streampool::PoolStats| {
        (s.event_queries, s.events_recorded, s.cross_stream_waits, s.synchronizations)
    };
    assert_eq!(calls(&st), calls(&before), "taken with no driver call: {st:?}");
    // The block freed after the synchronisation: only after its free is ordered.
    let x = p.allocate(SIZE, &producer).unwrap();
    assert_eq!(x, xs[2]);
    let st = p.stats();
    assert!(
        st.cross_stream_waits + st.synchronizations > before.cross_stream_waits + before.synchronizations,
        "{st:?}"
    );
    sim.write(producer.handle(), x, 256).unwrap();
    for x in got.into_iter().chain([x, xs[3]]) {
        p.deallocate(x, SIZE, &producer).unwrap();
    }
    sim.run();
    assert_no_races(&sim);
    assert_accounting(&p.stats());
}

/// A growth the upstream refuses leaves nothing counted: the peak reserved bytes are of
/// memory held, not of a reservation that failed (on a 16 MiB device, a 1 GiB request
/// once showed a 1 GiB peak for nothing held).
#[test]
fn refused_growth_is_not_counted_as_reserved() {
    let (_sim, b) = setup(16 * MIB);
    for expandable in [false, true] {
        let p = pool(&b, PoolOptions { expandable, ..Default::default() });
        let s = stream(&b);
        let err = p.allocate(1 << 30, &s).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        let st = p.stats();
        assert_eq!((st.reserved_bytes, st.peak_reserved_bytes, st.grown_bytes), (0, 0, 0), "{st:?}");
        let ptr = p.allocate(MIB, &s).unwrap();
        let st = p.stats();
        assert!(st.peak_reserved_bytes >= MIB && st.peak_reserved_bytes <= 16 * MIB, "{st:?}");
        assert_eq!(st.peak_reserved_bytes, st.reserved_bytes, "{st:?}");
        p.deallocate(ptr, MIB, &s).unwrap();
    }
}

/// A request larger than the maximum fails at once: nothing is gathered, synchronised or
/// given back first (an arena, whose initial size is its maximum, keeps its reservation).
#[test]
fn request_over_the_maximum_fails_at_once() {
    let (_sim, b) = setup(64 * MIB);
    let p = pool(
        &b,
        PoolOptions {
            initial_pool_size: Some(8 * MIB),
            maximum_pool_size: Some(8 * MIB),
            ..Default::default()
        },
    );
    let s = stream(&b);
    let ptr = p.allocate(MIB, &s).unwrap();
    p.deallocate(ptr, MIB, &s).unwrap();
    let err = p.allocate(16 * MIB, &s).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { requested, .. } if requested == 16 * MIB), "{err:?}");
    assert!(err.to_string().contains("maximum_pool_size"), "{err}");
    let st = p.stats();
    assert_eq!((st.reserved_bytes, st.synchronizations, st.released_bytes), (8 * MIB, 0, 0), "{st:?}");
    let again = p.allocate(4 * MIB, &s).unwrap();
    p.deallocate(again, 4 * MIB, &s).unwrap();
}

/// Requests and frees no resource could serve are refused, and leave nothing behind: a
/// request larger than the device does not size later growth; a free of an address or a
/// size beyond any allocation is `InvalidPointer` (no overflow); options at the edge of
/// their types are refused or bounded.
#[test]
fn input_at_the_edges_is_refused_and_changes_nothing() {
    let (_sim, b) = setup(1 << 30);
    let p = pool(&b, PoolOptions::default());
    let s = stream(&b);
    for huge in [2 << 30, isize::MAX as usize] {
        assert!(p.allocate(huge, &s).unwrap_err().is_out_of_memory());
    }
    let small = p.allocate(4096, &s).unwrap();
    let st = p.stats();
    assert!(st.reserved_bytes <= 2 * MIB, "a refused request sized this growth: {st:?}");
    for (ptr, bytes) in [(u64::MAX - 255, 4096), (small, usize::MAX), (small, isize::MAX as usize + 1)] {
        let err = p.deallocate(ptr, bytes, &s).unwrap_err();
        assert!(matches!(err, Error::InvalidPointer(_)), "{err:?}");
    }
    p.deallocate(small, 4096, &s).unwrap();

    let upstream: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let err = ShardedPoolMemoryResource::new(
        upstream.clone(),
        PoolOptions { initial_pool_size: Some(usize::MAX), ..Default::default() },
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("initial_pool_size"),
        "{err}"
    );

    // The largest event batch: a hand-off from a producer's stream to a consumer's.
    let p = pool(&b, PoolOptions { event_batch: usize::MAX, ..Default::default() });
    let (producer, consumer) = (stream(&b), stream(&b));
    let ptr = p.allocate(MIB, &producer).unwrap();
    p.deallocate(ptr, MIB, &consumer).unwrap();
    b.stream_synchronize(0, consumer.handle()).unwrap();
    let again = p.allocate(MIB, &producer).unwrap();
    p.deallocate(again, MIB, &producer).unwrap();
}

/// `release()` answers every byte it gave back, also where a release threshold gave some
/// back in the same call.
#[test]
fn release_counts_what_the_threshold_gave_back() {
    let (_sim, b) = setup(64 * MIB);
    let p = pool(&b, PoolOptions { release_threshold: Some(MIB), ..Default::default() });
    let s = stream(&b);
    let ptr = p.allocate(2 * MIB, &s).unwrap();
    p.deallocate(ptr, 2 * MIB, &s).unwrap();
    let held = p.stats().reserved_bytes;
    assert!(held >= 2 * MIB);
    assert_eq!(p.release().unwrap(), held);
    assert_eq!(p.stats().reserved_bytes, 0);
}

/// A pool dropped with allocations never freed says so (`drop_errors`): their memory goes
/// back to the upstream, where it is handed out again.
#[test]
fn dropping_a_pool_with_live_allocations_is_recorded() {
    let (_sim, b) = setup(64 * MIB);
    let p = pool(&b, PoolOptions::default());
    let s = stream(&b);
    let _leaked = p.allocate(4096, &s).unwrap();
    drop(p);
    let errors = streampool::drop_errors();
    assert!(
        errors
            .recent
            .iter()
            .any(|m| m.contains("dropping a ShardedPoolMemoryResource") && m.contains("4096 bytes")),
        "{errors:?}"
    );
}

/// Threads keep the shards they used in a cache; a dropped pool's shards there hold no
/// event, so the device (a simulated device's memory) goes with the last object made on
/// it, whether the pool or its stream goes first.
#[test]
fn a_dropped_pool_leaves_its_device_to_go() {
    for stream_outlives_pool in [false, true] {
        let (sim, b) = setup(256 * MIB);
        let weak = Arc::downgrade(&sim);
        drop(sim);
        let p = pool(&b, PoolOptions { events_every: 1, ..Default::default() });
        let s = stream(&b);
        for _ in 0..4 {
            let ptr = p.allocate(MIB, &s).unwrap();
            p.deallocate(ptr, MIB, &s).unwrap();
        }
        assert!(p.stats().events_recorded > 0);
        if stream_outlives_pool {
            drop(p);
            drop(s);
        } else {
            drop(s);
            drop(p);
        }
        drop(b);
        assert_eq!(
            weak.strong_count(),
            0,
            "the device outlived everything made on it (stream last: {stream_outlives_pool})"
        );
    }
}

/// Resources dropped after their simulated device was exited, with everything freed, record
/// nothing (`drop_errors` is where leaks show): the device has no work left to wait for.
#[test]
fn resources_dropped_after_the_simulation_record_nothing() {
    let sim = SimDevice::new(64 * MIB);
    use streampool::device::Backend;
    let name = sim.describe();
    let closed = format!("{} is closed", name.split(" (").next().unwrap());
    let guard = sim.activate().unwrap();
    let upstream: ResourceRef = Arc::new(CudaAsyncMemoryResource::new(None, Default::default()).unwrap());
    let p = ShardedPoolMemoryResource::new(upstream.clone(), PoolOptions::default()).unwrap();
    let fixed = streampool::FixedSizeMemoryResource::new(upstream, 4096, 4).unwrap();
    for mr in [&p as &dyn MemoryResource, &fixed] {
        let ptr = mr.allocate(4096, &Stream::legacy()).unwrap();
        mr.deallocate(ptr, 4096, &Stream::legacy()).unwrap();
    }
    drop(guard);
    drop(p);
    drop(fixed);
    let errors = streampool::drop_errors();
    assert!(!errors.recent.iter().any(|m| m.contains(&closed)), "{errors:?}");
}

/// A program that makes a stream per task and hands the pool its handle (another
/// library's streams): the pool cannot see those streams end, but their shards leave once
/// they hold nothing and no thread holds them, so shards stay bounded and a new stream's
/// look through the others does not grow with every task.
#[test]
fn shards_of_borrowed_streams_that_hold_nothing_leave_the_pool() {
    let (sim, b) = setup(256 * MIB);
    let p = pool(&b, PoolOptions::default());
    // A stream used by this thread throughout, borrowed too: its shard is in this thread's
    // cache, so it stays while held, with its free block.
    let kept = stream(&b);
    let kept_view = Stream::borrowed(&b, kept.handle()).unwrap();
    let held = p.allocate(4096, &kept_view).unwrap();
    let mut most = 0;
    for task in 0..3000 {
        let own = stream(&b);
        let view = Stream::borrowed(&b, own.handle()).unwrap();
        let ptr = p.allocate(4096 + 256 * (task % 4), &view).unwrap();
        sim.write(view.handle(), ptr, 256).unwrap();
        p.deallocate(ptr, 4096 + 256 * (task % 4), &view).unwrap();
        own.synchronize(&b, 0).unwrap();
        most = most.max(p.stats().shard_free_bytes.len());
        drop((view, own));
    }
    let st = p.stats();
    assert!(most < 1000, "shards peaked at {most}");
    assert_accounting(&st);
    // The kept stream's shard is still there and works.
    p.deallocate(held, 4096, &kept_view).unwrap();
    let again = p.allocate(4096, &kept_view).unwrap();
    p.deallocate(again, 4096, &kept_view).unwrap();
    assert_accounting(&p.stats());
    assert_no_races(&sim);
}

/// Threads that each keep one borrowed stream in use while they make a borrowed stream per
/// task: the sweeps that the tasks' new shards start never take a shard a thread holds
/// (the kept ones keep their blocks and records), the accounting stays exact, and a
/// gathering leaves no shard of a borrowed stream that nobody holds.
#[test]
fn sweeping_borrowed_shards_under_threads_loses_nothing() {
    let (sim, b) = setup(256 * MIB);
    let p = Arc::new(pool(&b, PoolOptions::default()));
    let barrier = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (p, b, barrier) = (p.clone(), b.clone(), barrier.clone());
            std::thread::spawn(move || {
                let kept = stream(&b);
                let view = Stream::borrowed(&b, kept.handle()).unwrap();
                let mut live = Vec::new();
                barrier.wait();
                for task in 0..600 {
                    let size = 512 * (1 + (task + t) % 8);
                    live.push((p.allocate(size, &view).unwrap(), size));
                    if live.len() > 4 {
                        let (ptr, size) = live.remove(0);
                        p.deallocate(ptr, size, &view).unwrap();
                    }
                    let own = stream(&b);
                    let v = Stream::borrowed(&b, own.handle()).unwrap();
                    let q = p.allocate(4096, &v).unwrap();
                    p.deallocate(q, 4096, &v).unwrap();
                }
                for (ptr, size) in live {
                    p.deallocate(ptr, size, &view).unwrap();
                }
                kept.synchronize(&b, 0).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let st = p.stats();
    assert_eq!(st.used_bytes, 0);
    assert_accounting(&st);
    // The tasks' streams were never synchronised: their blocks wait in their shards for a
    // gathering. After one (and with the threads, and their caches, gone) none is left.
    p.release().unwrap();
    let st = p.stats();
    assert!(st.shard_free_bytes.len() <= 1, "{} shards", st.shard_free_bytes.len());
    assert_accounting(&st);
    assert_no_races(&sim);
}

#[path = "common/failing.rs"]
mod failing;

/// A wait on another stream's event that fails (step 5) hands nothing out and leaves the
/// blocks where they were: neither in the common list, where every stream takes them as
/// complete (it put them there after a device synchronisation whose failure it ignored),
/// nor lost. The next stream at the maximum waits on the event and takes them, ordered.
#[test]
fn a_failed_wait_on_another_streams_event_moves_nothing() {
    let sim = SimDevice::new(256 * MIB);
    let failing = failing::FailingSyncs::new(sim.clone());
    let b: BackendRef = failing.clone();
    let p = pool(&b, PoolOptions { maximum_pool_size: Some(8 * MIB), events_every: 1, ..Default::default() });
    let (a, c, d) = (stream(&b), stream(&b), stream(&b));
    let x = p.allocate(8 * MIB, &a).unwrap();
    sim.write_labeled(a.handle(), x, 8 * MIB, "a's write before its free").unwrap();
    p.deallocate(x, 8 * MIB, &a).unwrap();
    failing.fail_waits.store(1, std::sync::atomic::Ordering::SeqCst);
    failing.fail_ctx_syncs.store(1, std::sync::atomic::Ordering::SeqCst);
    let err = p.allocate(8 * MIB, &c).unwrap_err();
    assert!(err.to_string().contains("cuStreamWaitEvent"), "{err}");
    assert!(sim.pending() > 0, "a's write is still queued");
    let st = p.stats();
    assert_accounting(&st);
    assert_eq!((st.reserved_bytes, st.used_bytes, st.common_free_bytes), (8 * MIB, 0, 0), "{st:?}");
    let y = p.allocate(8 * MIB, &d).unwrap();
    assert_eq!(y, x);
    sim.write_labeled(d.handle(), y, 8 * MIB, "d's write").unwrap();
    assert_eq!(p.stats().cross_stream_waits, 1);
    p.deallocate(y, 8 * MIB, &d).unwrap();
    sim.run();
    assert_no_races(&sim);
}

/// A destroyed stream's last event covers every free block of its shard, also when an
/// event due at its last free was skipped (a synchronisation of the stream stood in for it
/// with an event batch above 1; or the most events were in flight): another stream at the
/// maximum then waits on that event rather than synchronising the device.
#[test]
fn a_destroyed_streams_last_event_covers_blocks_whose_event_was_skipped() {
    let mib8 = 8 * MIB;
    let at_maximum = |event_batch: usize| {
        let (sim, b) = setup(256 * MIB);
        let options =
            PoolOptions { maximum_pool_size: Some(mib8), events_every: 1, event_batch, ..Default::default() };
        (sim, b.clone(), pool(&b, options))
    };
    let take_after_destroy =
        |sim: &SimDevice, b: &BackendRef, p: &ShardedPoolMemoryResource, a: Stream, x| {
            drop(a);
            let c = stream(b);
            let y = p.allocate(mib8, &c).unwrap();
            assert_eq!(y, x);
            sim.write(c.handle(), y, mib8).unwrap();
            let st = p.stats();
            assert_eq!((st.cross_stream_waits, st.synchronizations), (1, 0), "{st:?}");
            p.deallocate(y, mib8, &c).unwrap();
            sim.run();
            assert_no_races(sim);
        };
    // A synchronisation since the event was last due, with an event batch of 2.
    for event_batch in [1, 2] {
        let (sim, b, p) = at_maximum(event_batch);
        let a = stream(&b);
        let x = p.allocate(mib8, &a).unwrap();
        a.synchronize(&b, 0).unwrap();
        sim.write(a.handle(), x, mib8).unwrap();
        p.deallocate(x, mib8, &a).unwrap();
        take_after_destroy(&sim, &b, &p, a, x);
    }
    // The most events in flight (16, none complete), then 64 more frees (the interval
    // between events has doubled to its longest): the 64th's event is due and refused.
    let (sim, b, p) = at_maximum(1);
    let a = stream(&b);
    let round = || {
        let x = p.allocate(mib8, &a).unwrap();
        sim.write(a.handle(), x, 256).unwrap();
        p.deallocate(x, mib8, &a).unwrap();
        x
    };
    while p.stats().events_recorded < 16 {
        round();
    }
    let mut x = 0;
    for _ in 0..64 {
        x = round();
    }
    assert_eq!(p.stats().events_recorded, 16);
    take_after_destroy(&sim, &b, &p, a, x);
}
