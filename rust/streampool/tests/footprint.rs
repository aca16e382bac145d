//! The sharded pool's memory footprint on the simulated device: what it reserves against
//! what is live, on the workloads that made an earlier pool hoard (many streams that come
//! and go, one allocation per stream, the window workload on many threads, producers
//! handing blocks to consumers on other streams), and what `release` gives back. The
//! same workloads, timed, are in `benches/window.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier};

mod common;
use common::{assert_accounting, assert_no_races, stream, write_and_free_two, XorShift};

use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr};
use streampool::resource::ResourceRef;
use streampool::{
    CudaAsyncMemoryResource, Error, Event, MemoryResource, PoolOptions, ShardedPoolMemoryResource, Stream,
};

const MIB: usize = 1 << 20;
/// Peak reserved over peak live (bytes asked for) where the workload gives the pool no
/// room for fragmentation to matter (one allocation per stream).
const RATIO: f64 = 1.25;
/// The same on the window and hand-off workloads, where blocks of many sizes fragment the
/// pool's chunks and shards. The pool's aim is 1.25; on the simulated device it measured
/// 1.2-1.6 (debug builds, two cores). This bound catches hoarding: the pool that grew by
/// a quarter of itself per stream reserved 15 and more times the live bytes here.
const MIXED_RATIO: f64 = 3.0;

fn setup(capacity: usize) -> (Arc<SimDevice>, BackendRef, Arc<ShardedPoolMemoryResource>) {
    setup_with(capacity, PoolOptions::default())
}

fn setup_with(
    capacity: usize,
    options: PoolOptions,
) -> (Arc<SimDevice>, BackendRef, Arc<ShardedPoolMemoryResource>) {
    let sim = SimDevice::new(capacity);
    let b: BackendRef = sim.clone();
    let upstream: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let pool = Arc::new(ShardedPoolMemoryResource::new(upstream, options).unwrap());
    (sim, b, pool)
}

fn expandable() -> PoolOptions {
    PoolOptions { expandable: true, ..PoolOptions::default() }
}

/// Live bytes as the program sees them (sizes asked for), and their peak.
#[derive(Default)]
struct Live {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Live {
    fn add(&self, n: usize) {
        let now = self.now.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    fn sub(&self, n: usize) {
        self.now.fetch_sub(n, Ordering::Relaxed);
    }
    fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }
}

fn assert_ratio(p: &ShardedPoolMemoryResource, peak_live: usize, what: &str) {
    let st = p.stats();
    let ratio = st.peak_reserved_bytes as f64 / peak_live as f64;
    assert!(
        ratio <= MIXED_RATIO,
        "{what}: peak reserved {:.1} MiB for peak live {:.1} MiB ({ratio:.3}): {st:?}",
        st.peak_reserved_bytes as f64 / MIB as f64,
        peak_live as f64 / MIB as f64
    );
    eprintln!("{what}: peak reserved / peak live = {ratio:.3} ({st:?})");
}

/// `s = Stream(); p = pool.allocate(256, s); pool.deallocate(p, 256, s)` in a loop: each
/// stream's shard is retired when the stream goes, and its memory serves the next stream.
#[test]
fn short_lived_streams_reuse_one_chunk_and_leave_no_shards() {
    let (sim, b, p) = setup(1 << 30);
    for i in 0..2000 {
        let s = stream(&b);
        let x = p.allocate(256, &s).unwrap();
        sim.write(s.handle(), x, 256).unwrap();
        p.deallocate(x, 256, &s).unwrap();
        // The device finishes work now and then (without that, each new stream is ordered
        // after the last by a wait, and the simulator's clocks grow with the chain).
        if i % 50 == 49 {
            sim.run();
        }
    }
    let st = p.stats();
    assert!(st.peak_reserved_bytes <= 2 * MIB + 256, "{st:?}");
    assert!(
        st.shard_free_bytes.len() <= 4,
        "shards of destroyed streams stay: {}",
        st.shard_free_bytes.len()
    );
    assert_accounting(&st);
    assert_no_races(&sim);
    assert_eq!(p.release().unwrap(), st.reserved_bytes);
    assert_eq!(p.stats().reserved_bytes, 0);
}

/// One 1 MiB allocation on each of 64 streams, freed, synchronised and released (nothing
/// stays), then again on 24 streams.
#[test]
fn one_allocation_per_stream_on_many_streams() {
    let (sim, b, p) = setup(1 << 30);
    for round in [64usize, 24] {
        let streams: Vec<Stream> = (0..round).map(|_| stream(&b)).collect();
        let ptrs: Vec<DevPtr> = streams.iter().map(|s| p.allocate(MIB, s).unwrap()).collect();
        for (s, &x) in streams.iter().zip(&ptrs) {
            sim.write(s.handle(), x, MIB).unwrap();
        }
        let st = p.stats();
        assert!(
            st.reserved_bytes as f64 <= RATIO * (round * MIB) as f64,
            "{round} streams: {} MiB reserved for {round} MiB: {st:?}",
            st.reserved_bytes / MIB
        );
        for (s, &x) in streams.iter().zip(&ptrs) {
            p.deallocate(x, MIB, s).unwrap();
        }
        b.ctx_synchronize(0).unwrap();
        p.release().unwrap();
        let st = p.stats();
        assert_eq!((st.reserved_bytes, st.used_bytes), (0, 0), "after release: {st:?}");
        assert_accounting(&st);
    }
    assert_no_races(&sim);
}

/// A free, a synchronised stream, then `release()`: nothing is kept, the first chunk
/// included (it used to stay).
#[test]
fn release_after_frees_and_a_synchronisation_leaves_nothing() {
    let (_sim, b, p) = setup(1 << 30);
    let s = stream(&b);
    let x = p.allocate(3 * MIB, &s).unwrap();
    let y = p.allocate(100, &s).unwrap();
    p.deallocate(x, 3 * MIB, &s).unwrap();
    p.deallocate(y, 100, &s).unwrap();
    s.synchronize(&b, 0).unwrap();
    p.release().unwrap();
    assert_eq!(p.stats().reserved_bytes, 0, "{:?}", p.stats());
    // And live memory stays where it is: only its chunk is kept.
    let z = p.allocate(MIB, &s).unwrap();
    let w = p.allocate(MIB, &s).unwrap();
    p.deallocate(w, MIB, &s).unwrap();
    p.release().unwrap();
    let st = p.stats();
    assert!(st.reserved_bytes >= MIB && st.reserved_bytes <= 2 * MIB, "{st:?}");
    p.deallocate(z, MIB, &s).unwrap();
}

/// A stream short of memory takes a completed block of another stream's shard: the front
/// of it by default, the rest staying there; with `steal_whole_blocks` the whole block,
/// the rest joining its own shard. Either way it takes and does not grow.
#[test]
fn a_steal_takes_the_bytes_asked_or_with_steal_whole_blocks_the_whole_block() {
    for whole in [false, true] {
        let options = PoolOptions { events_every: 1, steal_whole_blocks: whole, ..PoolOptions::default() };
        let (sim, b, p) = setup_with(1 << 30, options);
        let (a, c) = (stream(&b), stream(&b));
        // One chunk of 4 MiB: x and a block a keeps live (a shard with no live block of its
        // own gives every completed block away at once, as a consumer's does).
        let x = p.allocate(3 * MIB, &a).unwrap();
        let kept = p.allocate(MIB, &a).unwrap();
        p.deallocate(x, 3 * MIB, &a).unwrap();
        sim.run(); // the free (and the event it recorded) completes
        let y = p.allocate(MIB, &c).unwrap();
        let st = p.stats();
        assert_eq!((st.completed_steals, st.upstream_growths), (1, 1), "whole {whole}: {st:?}");
        let free_of = |s: &Stream| {
            let key = s.key(&b, 0);
            st.shard_free_bytes.iter().find(|(k, _)| *k == key).map_or(0, |(_, n)| *n)
        };
        let rest = st.reserved_bytes - 2 * MIB;
        let want = if whole { (0, rest) } else { (rest, 0) };
        assert_eq!((free_of(&a), free_of(&c)), want, "whole {whole}: free in a's shard and c's");
        assert_accounting(&st);
        // The rest serves c's next request from its own shard, with no other steal.
        let z = p.allocate(MIB, &c).unwrap();
        assert_eq!(p.stats().completed_steals, if whole { 1 } else { 2 }, "whole {whole}");
        p.deallocate(z, MIB, &c).unwrap();
        p.deallocate(y, MIB, &c).unwrap();
        p.deallocate(kept, MIB, &a).unwrap();
        b.ctx_synchronize(0).unwrap();
        p.release().unwrap();
        assert_eq!(p.stats().reserved_bytes, 0);
        assert_no_races(&sim);
    }
}

/// On a 60 MiB device, a pool holding 50 MiB in use still serves 6 MiB: growth falls back
/// from its step to what the request needs. Out-of-memory names real figures.
#[test]
fn growth_falls_back_to_the_request_when_the_step_does_not_fit() {
    let (_sim, b, p) = setup(60 * MIB);
    let s = stream(&b);
    let big = p.allocate(50 * MIB, &s).unwrap();
    let x = p.allocate(6 * MIB, &s).unwrap();
    let err = p.allocate(40 * MIB, &s).unwrap_err();
    match &err {
        Error::OutOfMemory { requested, available, .. } => {
            assert_eq!(*requested, 40 * MIB);
            let a = available.expect("the upstream said what it had");
            assert!(a < 60 * MIB, "available {a} is not the device's room: {err}");
        }
        other => panic!("{other:?}"),
    }
    // Still usable.
    p.deallocate(x, 6 * MIB, &s).unwrap();
    p.deallocate(big, 50 * MIB, &s).unwrap();
    let again = p.allocate(20 * MIB, &s).unwrap();
    p.deallocate(again, 20 * MIB, &s).unwrap();
}

/// The window workload: T threads, each on its own stream, keep a ring of 16 live
/// allocations of log-uniform size in [1 KiB, 4 MiB], freeing the oldest before each new
/// one.
fn window(threads: usize, ops: usize) -> f64 {
    window_with(threads, ops, PoolOptions::default()).0
}

/// [`window`] with the pool's `options`; returns its peak reserved over peak live bytes,
/// and its statistics before the release.
fn window_with(threads: usize, ops: usize, options: PoolOptions) -> (f64, streampool::PoolStats) {
    let (sim, b, p) = setup_with(4 << 30, options);
    let live = Arc::new(Live::default());
    let start = Arc::new(Barrier::new(threads));
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (p, b, sim, live, start) = (p.clone(), b.clone(), sim.clone(), live.clone(), start.clone());
            scope.spawn(move || {
                let mut lane = Lane::new(&b, t);
                start.wait();
                for i in 0..ops {
                    lane.step(&p, &live);
                    if i % 512 == 511 && t == 0 {
                        sim.run(); // the device makes progress now and then
                    }
                }
                lane.finish(&p, &live);
            });
        }
    });
    assert_ratio(&p, live.peak(), &format!("window, {threads} threads"));
    let st = p.stats();
    assert_accounting(&st);
    b.ctx_synchronize(0).unwrap();
    p.release().unwrap();
    assert_eq!(p.stats().reserved_bytes, 0);
    assert_no_races(&sim);
    (st.peak_reserved_bytes as f64 / live.peak() as f64, st)
}

/// One stream of the window workload: its sizes (seeded by its index) and its ring of
/// live allocations.
struct Lane {
    stream: Stream,
    rng: XorShift,
    ring: Vec<(DevPtr, usize)>,
}

impl Lane {
    fn new(b: &BackendRef, t: usize) -> Self {
        Lane { stream: stream(b), rng: XorShift::new(t as u64 + 1), ring: Vec::new() }
    }

    /// Frees the oldest allocation once 16 are live, then allocates the next size.
    fn step(&mut self, p: &ShardedPoolMemoryResource, live: &Live) {
        if self.ring.len() == 16 {
            let (x, n) = self.ring.remove(0);
            live.sub(n);
            p.deallocate(x, n, &self.stream).unwrap();
        }
        let n = self.rng.size();
        live.add(n);
        self.ring.push((p.allocate(n, &self.stream).unwrap(), n));
    }

    /// Frees every allocation still live.
    fn finish(self, p: &ShardedPoolMemoryResource, live: &Live) {
        for (x, n) in self.ring {
            live.sub(n);
            p.deallocate(x, n, &self.stream).unwrap();
        }
    }
}

#[test]
fn window_1_thread_footprint() {
    window(1, 20_000);
}

#[test]
fn window_4_threads_footprint() {
    window(4, 5_000);
}

#[test]
fn window_16_threads_footprint() {
    window(16, 1_500);
}

/// Growing in place, one stream holds less than with chunks apart, and within the pool's
/// footprint aim of 1.25 times the peak live bytes: the free block at the range's end and
/// the new memory serve a large request together. On a model of this workload
/// (`benchmarks/window_fit.py --growth`) chunks apart needed 1.6 times the peak live bytes,
/// growth in place 1.22, what this test measures (1.31 while blocks that entered the
/// shard loose were merged only when nothing fitted).
#[test]
fn window_1_thread_expandable_holds_less() {
    // Chunks apart, gathering at every shortage: what the default pool does here on an idle
    // machine (1.40 either way), without its dependence on time (within `gather_interval`
    // of a gathering it grows instead, and a loaded machine changes which shortages those
    // are: in one run of the whole suite this comparison failed).
    let gather_always = PoolOptions { gather_interval: std::time::Duration::ZERO, ..PoolOptions::default() };
    let apart = window_with(1, 20_000, gather_always).0;
    let (in_place, st) = window_with(1, 20_000, expandable());
    eprintln!("window, 1 thread: chunks apart {apart:.3}, in place {in_place:.3}");
    assert!(in_place <= 1.25 && in_place < apart, "in place {in_place:.3}, apart {apart:.3}");
    // With no other stream to take memory from, it grows rather than synchronise.
    assert_eq!(st.synchronizations, 0, "{st:?}");
}

#[test]
fn window_4_threads_expandable_footprint() {
    window_with(4, 5_000, expandable());
}

#[test]
fn window_16_threads_expandable_footprint() {
    window_with(16, 1_500, expandable());
}

/// The window workload on `streams` streams driven in turn from one thread (the same
/// sizes as [`window_with`]'s threads, but the same order in every run, whatever the
/// machine's cores): its peak reserved over peak live bytes.
fn window_interleaved(streams: usize, ops: usize, options: PoolOptions) -> (f64, streampool::PoolStats) {
    let (sim, b, p) = setup_with(4 << 30, options);
    let live = Live::default();
    let mut lanes: Vec<Lane> = (0..streams).map(|t| Lane::new(&b, t)).collect();
    for i in 0..ops {
        for lane in &mut lanes {
            lane.step(&p, &live);
        }
        if i % 128 == 127 {
            sim.run(); // the device makes progress now and then
        }
    }
    for lane in lanes {
        lane.finish(&p, &live);
    }
    let st = p.stats();
    assert_accounting(&st);
    assert_no_races(&sim);
    (st.peak_reserved_bytes as f64 / live.peak() as f64, st)
}

/// The configuration for memory short on many streams (growth in place, whole free blocks
/// between streams, a gathering at every shortfall) holds less than the default on 4
/// streams (on the H200, 4 threads each on its own stream: 1.52-1.60 times the peak live
/// bytes against 2.33-2.36, `benchmarks/RESULTS.md`, "Commits d54cde1 and 939a767").
#[test]
fn window_4_streams_lean_holds_less() {
    let (default, _) = window_interleaved(4, 5_000, PoolOptions::default());
    let lean =
        PoolOptions { steal_whole_blocks: true, gather_interval: std::time::Duration::ZERO, ..expandable() };
    let (lean, st) = window_interleaved(4, 5_000, lean);
    eprintln!("window, 4 streams in turn: default {default:.3}, lean {lean:.3}");
    // Here 1.365 in every run (it gathers at every shortfall: nothing depends on time),
    // the default 2.01-2.11.
    assert!(lean < default && lean <= 1.4, "lean {lean:.3}, default {default:.3}: {st:?}");
}

/// One heap for every stream, growing in place, holds the least on 4 and 16 streams
/// driven in turn: every free merges at once with its free neighbours whichever stream
/// freed them, and a stream handed another's memory waits on that free's event (the
/// simulated device checks every such reuse for races).
#[test]
fn window_many_streams_one_heap_holds_the_least() {
    for streams in [4, 16] {
        let ops = if streams == 4 { 5_000 } else { 1_500 };
        let lean = PoolOptions {
            steal_whole_blocks: true,
            gather_interval: std::time::Duration::ZERO,
            ..expandable()
        };
        let (lean, _) = window_interleaved(streams, ops, lean);
        let (heap, st) = window_interleaved(streams, ops, PoolOptions { one_heap: true, ..expandable() });
        eprintln!("window, {streams} streams in turn: lean {lean:.3}, one heap {heap:.3}");
        assert!(heap < lean && heap <= 1.25, "{streams} streams: one heap {heap:.3}, lean {lean:.3}: {st:?}");
        assert!(st.cross_stream_waits > 0 && st.synchronizations == 0, "{st:?}");
    }
}

/// A block that spans two mappings holds its data; frees, a synchronisation and
/// `release()` unmap everything, and the device's memory is back.
#[test]
fn expandable_blocks_span_mappings_and_release_unmaps_all() {
    let (sim, b, p) = setup_with(1 << 30, expandable());
    let (free_before, _) = b.mem_get_info(0).unwrap();
    let s = stream(&b);
    let x = p.allocate(MIB, &s).unwrap();
    sim.write(s.handle(), x, MIB).unwrap();
    let st = p.stats();
    assert_eq!((st.reserved_bytes, st.upstream_growths), (2 * MIB, 1), "{st:?}");
    // 1 MiB is free at the end; 3 MiB more are asked: one more mapping of 2 MiB, and the
    // block starts in the first.
    let y = p.allocate(3 * MIB, &s).unwrap();
    assert_eq!(y, x + MIB as u64, "the block joins the free end: {:#x} after {:#x}", y, x);
    let st = p.stats();
    assert_eq!((st.reserved_bytes, st.upstream_growths), (4 * MIB, 2), "{st:?}");
    sim.write(s.handle(), y, 3 * MIB).unwrap();
    sim.read(s.handle(), y, 3 * MIB).unwrap();
    p.deallocate(x, MIB, &s).unwrap();
    p.deallocate(y, 3 * MIB, &s).unwrap();
    s.synchronize(&b, 0).unwrap();
    assert_eq!(p.release().unwrap(), 4 * MIB);
    let st = p.stats();
    assert_eq!((st.reserved_bytes, st.used_bytes), (0, 0), "{st:?}");
    assert_accounting(&st);
    assert_eq!(b.mem_get_info(0).unwrap().0, free_before, "the mappings went back to the device");
    // Still usable, and grows again from the range's start.
    let z = p.allocate(5 * MIB, &s).unwrap();
    assert_eq!(z, x);
    p.deallocate(z, 5 * MIB, &s).unwrap();
    assert_no_races(&sim);
}

/// An expandable pool maps device memory itself: over managed memory or an adaptor it is
/// refused with an error that says why, and the upstream stays usable.
#[test]
fn expandable_needs_device_memory_underneath() {
    let sim = SimDevice::new(1 << 30);
    let b: BackendRef = sim.clone();
    let managed: ResourceRef = Arc::new(streampool::ManagedMemoryResource::on(b.clone(), 0).unwrap());
    let stats: ResourceRef = Arc::new(
        streampool::StatisticsAdaptor::new(Arc::new(
            streampool::CudaMemoryResource::on(b.clone(), 0).unwrap(),
        ))
        .unwrap(),
    );
    for up in [managed, stats] {
        let err = ShardedPoolMemoryResource::new(up.clone(), expandable()).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("expandable") && m.contains(up.name())),
            "{err}"
        );
        let s = stream(&b);
        let x = up.allocate(MIB, &s).unwrap();
        up.deallocate(x, MIB, &s).unwrap();
    }
}

/// The maximum holds for growth in place too, and a pool at it says out of memory and
/// stays usable; within the maximum, the free end is given back beyond the release
/// threshold.
#[test]
fn expandable_respects_the_maximum_and_the_release_threshold() {
    let options =
        PoolOptions { maximum_pool_size: Some(8 * MIB), release_threshold: Some(2 * MIB), ..expandable() };
    let (_sim, b, p) = setup_with(1 << 30, options);
    let s = stream(&b);
    let x = p.allocate(7 * MIB, &s).unwrap();
    let err = p.allocate(2 * MIB, &s).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(p.stats().reserved_bytes <= 8 * MIB, "{:?}", p.stats());
    p.deallocate(x, 7 * MIB, &s).unwrap();
    let y = p.allocate(2 * MIB, &s).unwrap();
    p.deallocate(y, 2 * MIB, &s).unwrap();
    s.synchronize(&b, 0).unwrap();
    p.release().unwrap();
    assert_eq!(p.stats().reserved_bytes, 0);
}

/// A maximum that is not a multiple of the mapping's granularity (2 MiB here), or below
/// it, is reached all the same: what a whole piece would overshoot, the upstream serves.
#[test]
fn expandable_reaches_a_maximum_off_the_granularity() {
    for (maximum, initial) in [(MIB, Some(MIB)), (3 * MIB, None), (5 * MIB, None)] {
        let options =
            PoolOptions { maximum_pool_size: Some(maximum), initial_pool_size: initial, ..expandable() };
        let (_sim, b, p) = setup_with(1 << 30, options);
        let s = stream(&b);
        let all = p
            .allocate(maximum, &s)
            .unwrap_or_else(|e| panic!("{maximum} bytes under a maximum of {maximum}: {e}"));
        assert!(p.stats().reserved_bytes <= maximum, "{:?}", p.stats());
        assert!(p.allocate(256, &s).unwrap_err().is_out_of_memory());
        p.deallocate(all, maximum, &s).unwrap();
        let small = p.allocate(256, &s).unwrap(); // and the pool is usable afterwards
        p.deallocate(small, 256, &s).unwrap();
        s.synchronize(&b, 0).unwrap();
        p.release().unwrap();
        assert_eq!(p.stats().reserved_bytes, 0);
    }
}

/// A request whose size class (up to 6.25 % more) passes the maximum, though it alone
/// would fit, is refused naming the rounding; the pool stays usable.
#[test]
fn a_request_rounded_past_the_maximum_names_the_rounding() {
    let maximum = 5 * MIB + 256;
    let (_sim, b, p) =
        setup_with(1 << 30, PoolOptions { maximum_pool_size: Some(maximum), ..PoolOptions::default() });
    let s = stream(&b);
    let err = p.allocate(maximum, &s).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("rounded up") && text.contains(&format!("could not allocate {maximum} bytes")),
        "{text}"
    );
    let x = p.allocate(5 * MIB, &s).unwrap();
    p.deallocate(x, 5 * MIB, &s).unwrap();
}

/// The producer/consumer soak: 16 threads, each on its own stream, allocate 1 KiB to
/// 4 MiB and write it; half the blocks are handed to the next thread after an event,
/// which waits on it, reads, and frees on its own stream. The device completes work now
/// and then. No races, and the footprint stays within the ratio.
#[test]
fn producers_handing_blocks_to_consumers_on_other_streams() {
    const THREADS: usize = 16;
    const OPS: usize = 600;
    let (sim, b, p) = setup(4 << 30);
    let live = Arc::new(Live::default());
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<(DevPtr, usize, Event)>()).unzip();
    let start = Arc::new(Barrier::new(THREADS));
    std::thread::scope(|scope| {
        for (t, inbox) in receivers.into_iter().enumerate() {
            let next = senders[(t + 1) % THREADS].clone();
            let (p, b, sim, live, start) = (p.clone(), b.clone(), sim.clone(), live.clone(), start.clone());
            scope.spawn(move || {
                let s = stream(&b);
                let mut rng = XorShift::new(100 + t as u64);
                let mut ring: Vec<(DevPtr, usize)> = Vec::new();
                // Kernels touch the first 64 KiB of each block (the detector checks those).
                let touch = |n: usize| n.min(64 << 10);
                start.wait();
                for i in 0..OPS {
                    while let Ok((x, n, ev)) = inbox.try_recv() {
                        s.wait(&ev).unwrap();
                        sim.read(s.handle(), x, touch(n)).unwrap();
                        live.sub(n);
                        p.deallocate(x, n, &s).unwrap();
                    }
                    if ring.len() == 16 {
                        let (x, n) = ring.remove(0);
                        if rng.next().is_multiple_of(2) {
                            let ev = Event::new(&b, 0).unwrap();
                            ev.record(&s).unwrap();
                            next.send((x, n, ev)).unwrap();
                        } else {
                            live.sub(n);
                            p.deallocate(x, n, &s).unwrap();
                        }
                    }
                    let n = rng.size();
                    live.add(n);
                    let x = p.allocate(n, &s).unwrap();
                    sim.write(s.handle(), x, touch(n)).unwrap();
                    ring.push((x, n));
                    if i % 64 == 63 && t == 0 {
                        sim.run();
                    }
                }
                for (x, n) in ring {
                    live.sub(n);
                    p.deallocate(x, n, &s).unwrap();
                }
                start.wait();
                // Whatever the previous thread sent after this one stopped reading.
                while let Ok((x, n, ev)) = inbox.try_recv() {
                    s.wait(&ev).unwrap();
                    live.sub(n);
                    p.deallocate(x, n, &s).unwrap();
                }
            });
        }
    });
    drop(senders);
    assert_ratio(&p, live.peak(), "producers and consumers, 16 threads");
    let st = p.stats();
    assert_eq!(st.used_bytes, 0, "{st:?}");
    assert_accounting(&st);
    assert_no_races(&sim);
    p.release().unwrap();
    assert_eq!(p.stats().reserved_bytes, 0);
}

/// The hand-off soak on a device that runs work as soon as it is enqueued (as a GPU runs
/// work with no kernels): 4 threads, each on its own stream, keep 16 blocks of 1 KiB to
/// 4 MiB; half the evicted blocks go to the next thread after an event (at most 16 in
/// flight to a thread), which frees them on its own stream. At the end of every one of 24
/// rounds, the pool's peak reserved bytes stay within `MIXED_RATIO` (3) times the peak live
/// bytes so far, as in the other soaks: 1.2-1.7 measured on two idle cores (with growth past
/// the budget stopped at twice the allowance, 1.4-1.8, and 1.9 once on a loaded CI
/// machine). How far the pool grows depends on how the threads are scheduled; a plateau
/// is not what it promises, a bound is (the ceiling alone stops growth past the budget at
/// 4 times the allowance, 4.6 times the peak live bytes as the pool sees them).
/// (Gatherings that raced with one another or with a thread taking the common list missed
/// the blocks in transit and grew without bound: in a release build, the window bench's
/// hand-off soak on this device held 4.3 times the peak live bytes after 6 s, still
/// growing; the bench, `--sim-eager --handoff --every 3`, shows the plateau.) The eager
/// device finds no races by construction: the stream-ordered contract is checked by the
/// soak above.
#[test]
fn handoff_soak_stays_bounded_on_an_eager_device() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 24;
    const OPS: usize = 1000;
    let (sim, b, p) = setup(4 << 30);
    sim.set_eager(true);
    let live = Arc::new(Live::default());
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::sync_channel::<(DevPtr, usize, Event)>(16)).unzip();
    let round_end = Arc::new(Barrier::new(THREADS));
    let peaks = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for (t, inbox) in receivers.into_iter().enumerate() {
            let next = senders[(t + 1) % THREADS].clone();
            let (p, b, live, round_end, peaks) =
                (p.clone(), b.clone(), live.clone(), round_end.clone(), &peaks);
            scope.spawn(move || {
                let s = stream(&b);
                let mut rng = XorShift::new(200 + t as u64);
                let mut ring: Vec<(DevPtr, usize)> = Vec::new();
                let receive = || {
                    while let Ok((x, n, ev)) = inbox.try_recv() {
                        s.wait(&ev).unwrap();
                        live.sub(n);
                        p.deallocate(x, n, &s).unwrap();
                    }
                };
                for _ in 0..ROUNDS {
                    for _ in 0..OPS {
                        if ring.len() == 16 {
                            let (x, n) = ring.remove(0);
                            let handed = rng.next().is_multiple_of(2) && {
                                let ev = Event::new(&b, 0).unwrap();
                                ev.record(&s).unwrap();
                                next.try_send((x, n, ev)).is_ok()
                            };
                            if !handed {
                                live.sub(n);
                                p.deallocate(x, n, &s).unwrap();
                            }
                        }
                        receive();
                        let n = rng.size();
                        live.add(n);
                        ring.push((p.allocate(n, &s).unwrap(), n));
                    }
                    if round_end.wait().is_leader() {
                        peaks.lock().unwrap().push((p.stats().peak_reserved_bytes, live.peak()));
                    }
                }
                for (x, n) in ring.drain(..) {
                    live.sub(n);
                    p.deallocate(x, n, &s).unwrap();
                }
                round_end.wait();
                receive();
            });
        }
    });
    drop(senders);
    let peaks = peaks.into_inner().unwrap();
    eprintln!("peak reserved (MiB) by round: {:?}", peaks.iter().map(|r| r.0 / MIB).collect::<Vec<_>>());
    eprintln!("peak live (MiB) by round: {:?}", peaks.iter().map(|r| r.1 / MIB).collect::<Vec<_>>());
    for (round, &(reserved, live)) in peaks.iter().enumerate() {
        assert!(
            reserved as f64 <= MIXED_RATIO * live as f64,
            "round {round}: peak reserved {} MiB for peak live {} MiB: {:?}",
            reserved / MIB,
            live / MIB,
            p.stats()
        );
    }
    assert_ratio(&p, live.peak(), "hand-off soak, 4 threads, eager device");
    let st = p.stats();
    assert_eq!(st.used_bytes, 0, "{st:?}");
    assert_accounting(&st);
    p.release().unwrap();
    assert_eq!(p.stats().reserved_bytes, 0);
}

/// The gathering interval trades memory for speed: a new stream each round allocates a
/// 4 MiB block and frees it (the pool at its budget, the last round's free not known
/// complete, and freed after the event it recorded). With an interval of zero every round
/// gathers and the pool holds one block; with a long one the rounds after the first
/// gathering grow past the budget instead, without synchronising, but only up to the
/// ceiling, four times the budget's allowance (here 4 x (4 MiB + 2 MiB), with 256 bytes):
/// beyond it a round gathers again. Without the ceiling, 16 rounds held 62 MiB and
/// synchronised once.
#[test]
fn the_gathering_interval_trades_synchronisations_for_memory() {
    let rounds = 16;
    for long in [false, true] {
        let sim = SimDevice::new(256 * MIB);
        let b: BackendRef = sim.clone();
        let upstream: ResourceRef =
            Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
        let gather_interval =
            if long { std::time::Duration::from_secs(3600) } else { std::time::Duration::ZERO };
        let pool =
            ShardedPoolMemoryResource::new(upstream, PoolOptions { gather_interval, ..Default::default() })
                .unwrap();
        let streams: Vec<Stream> = (0..rounds).map(|_| stream(&b)).collect();
        for owned in &streams {
            // Borrowed handles: the pool cannot see their end, so it never records an event
            // on them outside their own calls (`handoff_calls.rs` has the owned case, which
            // covers the last free with an event and a wait instead of gathering).
            let s = &Stream::borrowed(&b, owned.handle()).unwrap();
            // The second free is covered by no event: the next round cannot take it by a wait.
            write_and_free_two(&sim, &pool, s);
        }
        let st = pool.stats();
        if long {
            assert!(st.peak_reserved_bytes >= 10 * MIB, "grew past the budget: {st:?}");
            assert!(st.peak_reserved_bytes <= 4 * (6 * MIB + 256), "the ceiling: {st:?}");
            assert!(st.synchronizations >= 2, "gathered at the ceiling: {st:?}");
            // Half the rounds grow or take back what an earlier one grew (8 measured).
            assert!(
                (st.synchronizations as usize) <= rounds / 2,
                "growth first, within the interval: {st:?}"
            );
        } else {
            // The 4 MiB block and a 2 MiB chunk for the small ones, reused every round.
            assert_eq!(st.peak_reserved_bytes, 6 * MIB, "reused, not grown: {st:?}");
            assert!(st.synchronizations as usize >= rounds - 1, "a gathering every round: {st:?}");
        }
        assert_accounting(&st);
        sim.run();
        assert_no_races(&sim);
    }
}

/// With no footprint budget (`headroom: None`), threads that come and go (one per task,
/// each allocating on its per-thread stream, which ends with it, retiring its shard with
/// no last event) leave their memory to the next: growth gathers first when the ended
/// streams' shards hold the request (it grew a chunk per thread, to the device's size);
/// and streams destroyed after a synchronisation (an event batch of 2 skips their event)
/// are covered by their last event.
#[test]
fn with_no_budget_ended_streams_memory_is_reused() {
    let (sim, b, p) = setup_with(4 << 30, PoolOptions { headroom: None, ..Default::default() });
    for _ in 0..100 {
        let (pool, device) = (p.clone(), sim.clone());
        std::thread::spawn(move || {
            let s = Stream::per_thread();
            let x = pool.allocate(MIB, &s).unwrap();
            device.write(s.handle(), x, MIB).unwrap();
            pool.deallocate(x, MIB, &s).unwrap();
        })
        .join()
        .unwrap();
        sim.run();
    }
    let st = p.stats();
    assert!(st.peak_reserved_bytes <= 4 * MIB, "{st:?}");
    assert!(st.shard_free_bytes.len() <= 4, "{} shards", st.shard_free_bytes.len());
    assert_accounting(&st);
    assert_no_races(&sim);
    drop(b);
    for event_batch in [1, 2] {
        let options = PoolOptions { headroom: None, events_every: 1, event_batch, ..Default::default() };
        let (sim, b, p) = setup_with(4 << 30, options);
        for _ in 0..100 {
            let s = stream(&b);
            let x = p.allocate(MIB, &s).unwrap();
            s.synchronize(&b, 0).unwrap();
            sim.write(s.handle(), x, MIB).unwrap();
            p.deallocate(x, MIB, &s).unwrap();
            drop(s);
            sim.run();
        }
        let st = p.stats();
        assert!(st.peak_reserved_bytes <= 4 * MIB, "event batch {event_batch}: {st:?}");
        assert_accounting(&st);
        assert_no_races(&sim);
    }
}

/// A stream that outlives many pools (a pool made per task, the stream kept) keeps a
/// destroy hook only for the pools still there: each hook held its pool's backend and
/// shard, one more per pool that came and went.
#[test]
fn a_long_lived_stream_keeps_no_hook_per_pool_gone() {
    let (_sim, b, _) = setup(256 * MIB);
    let s = stream(&b);
    let run = |n: usize| {
        for _ in 0..n {
            let (b, s) = (b.clone(), s.clone());
            // A thread of its own: no thread's cache of shards outlives the pool.
            std::thread::spawn(move || {
                let upstream: ResourceRef =
                    Arc::new(CudaAsyncMemoryResource::on(b, 0, Default::default()).unwrap());
                let pool = ShardedPoolMemoryResource::new(upstream, PoolOptions::default()).unwrap();
                let p = pool.allocate(1024, &s).unwrap();
                pool.deallocate(p, 1024, &s).unwrap();
            })
            .join()
            .unwrap();
        }
    };
    run(1);
    let held = Arc::strong_count(&b);
    run(200);
    assert!(Arc::strong_count(&b) <= held + 1, "{} backend clones held", Arc::strong_count(&b) - held);
}
