//! What the sharded pool's cross-stream reuse costs in driver calls: producers allocate
//! chunks on their streams and hand them (after an event) to consumers, which free them on
//! theirs (the pipeline workload, `streampool::harness::pipeline`, in one thread, so that
//! the counts do not depend on timing). Counts, not timings: event records and queries, stream
//! waits, device synchronisations and growths per chunk once warm, and the footprint. On
//! a device that does not run work until told, the race detector checks the orderings.
//! The simulated device's memory is the host's, so the addresses of the chunks (and so
//! which block a best fit takes, and which shard's events a look queries) differ between
//! runs: the counts may differ by about one in a thousand chunks.

use std::collections::VecDeque;
use std::sync::Arc;

mod common;
use common::{assert_accounting, assert_no_races, stream, write_and_free_two};

use streampool::device::sim::SimDevice;
use streampool::device::{BackendRef, DevPtr};
use streampool::resource::ResourceRef;
use streampool::{
    CudaAsyncMemoryResource, Event, MemoryResource, PoolOptions, PoolStats, ShardedPoolMemoryResource, Stream,
};

const MIB: usize = 1 << 20;

/// The pool's driver calls between two snapshots of its statistics, per chunk.
#[derive(Debug)]
struct PerChunk {
    records: f64,
    queries: f64,
    waits: f64,
    syncs: u64,
    growths: u64,
}

impl PerChunk {
    fn between(a: &PoolStats, b: &PoolStats, chunks: usize) -> Self {
        let per = |x: u64, y: u64| (y - x) as f64 / chunks as f64;
        PerChunk {
            records: per(a.events_recorded, b.events_recorded),
            queries: per(a.event_queries, b.event_queries),
            waits: per(a.cross_stream_waits, b.cross_stream_waits),
            syncs: b.synchronizations - a.synchronizations,
            growths: b.upstream_growths - a.upstream_growths,
        }
    }

    fn total(&self) -> f64 {
        self.records + self.queries + self.waits
    }
}

struct Pair {
    producer: Stream,
    consumer: Stream,
    queue: VecDeque<(DevPtr, Event)>,
}

/// `pairs` producer/consumer pairs, interleaved in one thread: each round, every producer
/// allocates a chunk on its stream, writes it and records an event; once `depth` chunks
/// are queued, its consumer waits on the oldest one's event, reads it and frees it on its
/// own stream; with `sync`, it synchronises its stream before each free (as a program that
/// reads each chunk's result on the host does). Unless 0, the device runs its work every
/// `lag` rounds. Returns the pool's calls per chunk over the rounds after `warm`, and the
/// peak live bytes.
#[allow(clippy::too_many_arguments)]
fn pipeline(
    sim: &SimDevice,
    b: &BackendRef,
    pool: &ShardedPoolMemoryResource,
    pairs: usize,
    warm: usize,
    rounds: usize,
    lag: usize,
    sync: bool,
) -> (PerChunk, usize) {
    const CHUNK: usize = MIB;
    const DEPTH: usize = 4;
    let mut ps: Vec<Pair> = (0..pairs)
        .map(|_| Pair { producer: stream(b), consumer: stream(b), queue: VecDeque::new() })
        .collect();
    let (mut live, mut peak) = (0, 0);
    let mut before = None;
    for round in 0..warm + rounds {
        if round == warm {
            before = Some(pool.stats());
        }
        if lag > 0 && round % lag == 0 {
            sim.run();
        }
        for p in &mut ps {
            let x = pool.allocate(CHUNK, &p.producer).unwrap();
            live += CHUNK;
            peak = peak.max(live);
            // Kernels touch the first KiB (the detector checks those).
            sim.write(p.producer.handle(), x, 1024).unwrap();
            let ready = Event::new(b, 0).unwrap();
            ready.record(&p.producer).unwrap();
            p.queue.push_back((x, ready));
            if p.queue.len() > DEPTH {
                let (x, ready) = p.queue.pop_front().unwrap();
                p.consumer.wait(&ready).unwrap();
                sim.read(p.consumer.handle(), x, 1024).unwrap();
                if sync {
                    p.consumer.synchronize(b, 0).unwrap();
                }
                pool.deallocate(x, CHUNK, &p.consumer).unwrap();
                live -= CHUNK;
            }
        }
    }
    let calls = PerChunk::between(&before.expect("rounds > 0"), &pool.stats(), pairs * rounds);
    for p in &mut ps {
        for (x, ready) in p.queue.drain(..) {
            p.consumer.wait(&ready).unwrap();
            pool.deallocate(x, CHUNK, &p.consumer).unwrap();
        }
    }
    (calls, peak)
}

fn setup(headroom: f64) -> (Arc<SimDevice>, BackendRef, ShardedPoolMemoryResource) {
    setup_with(PoolOptions { headroom: Some(headroom), ..Default::default() })
}

/// A pool with `headroom=2` and an event batch of `event_batch` (the batched hand-off).
fn batched(event_batch: usize) -> (Arc<SimDevice>, BackendRef, ShardedPoolMemoryResource) {
    setup_with(PoolOptions { headroom: Some(2.0), event_batch, ..Default::default() })
}

fn setup_with(options: PoolOptions) -> (Arc<SimDevice>, BackendRef, ShardedPoolMemoryResource) {
    let sim = SimDevice::new(1 << 30);
    let b: BackendRef = sim.clone();
    let upstream: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let pool = ShardedPoolMemoryResource::new(upstream, options).unwrap();
    (sim, b, pool)
}

/// On a device that keeps up (eager), a warm producer/consumer pipeline never
/// synchronises nor grows, and amortises its driver calls: a producer that finds its shard
/// empty takes every completed block of a consumer's shard at once, and asks that stream
/// for an event after as many frees as it took blocks, so that each look (one query) and
/// each event (one record) serve a batch of chunks; blocks that no event covers yet are
/// covered by an event recorded on the consumer's stream and a wait (no device
/// synchronisation). The batch is the free memory beyond the live bytes, which the
/// footprint budget bounds: with the default headroom (2 MiB over 5 MiB live at 1 pair)
/// 2 chunks of 1 MiB, so at most 1 call per chunk (0.75 measured); 1.5 at 4 pairs and
/// 1.75-1.9 at 8, whose consumers share the budget (less than a chunk each, and at 8 pairs
/// a few waits); with a headroom of 1, 3 chunks and 0.62 calls. With an event record and
/// a query for every chunk it was 2 calls per chunk at 1, 4 and 8 pairs (the same
/// footprints).
#[test]
fn a_warm_pipeline_amortises_its_driver_calls_and_never_synchronises() {
    for (pairs, headroom, most) in [(1, 0.15, 1.05), (4, 0.15, 1.6), (8, 0.15, 2.0), (1, 1.0, 0.7)] {
        let (sim, b, pool) = setup(headroom);
        sim.set_eager(true);
        let (calls, peak_live) = pipeline(&sim, &b, &pool, pairs, 50, 400, 0, false);
        let st = pool.stats();
        eprintln!("{pairs} pairs, headroom {headroom}: {calls:?} ({:.3} per chunk); {st:?}", calls.total());
        assert!(calls.total() <= most, "{pairs} pairs, headroom {headroom}: {calls:?}");
        assert_eq!((calls.syncs, calls.growths), (0, 0), "{pairs} pairs, warm: {calls:?}");
        // Footprint: the budget (peak live + the headroom, at least 2 MiB) and a 2 MiB chunk.
        let budget = peak_live + ((peak_live as f64 * headroom) as usize).max(2 * MIB) + 2 * MIB;
        assert!(st.peak_reserved_bytes <= budget, "{pairs} pairs: {st:?}, peak live {peak_live}");
        assert_eq!(st.used_bytes, 0);
        assert_accounting(&st);
    }
}

/// `event_batch` trades memory for driver calls: a consumer asked for its memory records
/// only once `event_batch` frees are in the open epoch, so each event covers that many
/// chunks at least, and the producers grow (within a budget that allows for it) until the
/// events come. Warm, with a batch of 8 and a headroom of 2: at most 1/8 records per chunk
/// and 0.3 driver calls in all (a few waits where the consumers share the budget), no
/// synchronisation, at 1, 4 and 8 pairs (1.5-2 calls with a batch of 1, above), within
/// 3 times the peak live bytes; on a device that lags, every reuse still ordered.
#[test]
fn an_event_batch_bounds_the_records_per_chunk() {
    for pairs in [1, 4, 8] {
        let (sim, b, pool) = batched(8);
        sim.set_eager(true);
        let (calls, peak_live) = pipeline(&sim, &b, &pool, pairs, 300, 400, 0, false);
        let st = pool.stats();
        eprintln!("{pairs} pairs, batch 8: {calls:?} ({:.3} per chunk); {st:?}", calls.total());
        assert!(calls.records <= 1.0 / 8.0 + 1e-9, "{pairs} pairs: {calls:?}");
        // About one query per event; a few more where a look queries an event that a
        // block of another epoch needed (one in 1,600 chunks on a 2-core machine).
        assert!(calls.queries <= calls.records + 0.01, "{pairs} pairs: {calls:?}");
        assert!(calls.total() <= 0.3, "{pairs} pairs: {calls:?}");
        assert_eq!(calls.syncs, 0, "{pairs} pairs, warm: {calls:?}");
        let budget = peak_live * 3 + 2 * MIB;
        assert!(st.peak_reserved_bytes <= budget, "{pairs} pairs: {st:?}, peak live {peak_live}");
        assert_accounting(&st);
    }
    let (sim, b, pool) = batched(8);
    pipeline(&sim, &b, &pool, 4, 20, 200, 4, false);
    assert_accounting(&pool.stats());
    assert_no_races(&sim);
    // The default batch of 1 is the policy without it (the test above); 0 is refused.
    let upstream: ResourceRef =
        Arc::new(CudaAsyncMemoryResource::on(b.clone(), 0, Default::default()).unwrap());
    let err = ShardedPoolMemoryResource::new(upstream, PoolOptions { event_batch: 0, ..Default::default() })
        .unwrap_err();
    assert!(err.to_string().contains("event_batch must be at least 1"), "{err}");
}

/// The same on a device that runs work only when told (here: every 4 rounds, so most
/// frees have not completed when their memory is wanted): every reuse across streams is
/// ordered by an event (the detector finds no race), without a device synchronisation.
/// 1.75 calls per chunk at 1 pair and 5.0 at 4 pairs (4.0 and 6.3 with an event recorded
/// at every free). Each look at a shard, and each event recorded, queries that shard's
/// events up to the first still running: querying only the event a fitting block needed
/// made 1.25 and 3.8 here, but the window workload at 16 threads on the H200 then waited
/// on other streams 2.7-5 times as often, at 26-46 M allocations/s against 31-92
/// (`policy.rs`, `take_completed`).
#[test]
fn a_pipeline_on_a_device_that_lags_reuses_memory_in_stream_order() {
    for (pairs, most) in [(1, 2.0), (4, 5.5)] {
        let (sim, b, pool) = setup(0.15);
        let (calls, peak_live) = pipeline(&sim, &b, &pool, pairs, 20, 200, 4, false);
        let st = pool.stats();
        eprintln!("{pairs} pairs, lagging device: {calls:?} ({:.3} per chunk); {st:?}", calls.total());
        assert!(calls.total() <= most, "{pairs} pairs: {calls:?}");
        assert_eq!(calls.syncs, 0, "{pairs} pairs: {calls:?}");
        let budget = peak_live + (peak_live * 15 / 100).max(2 * MIB) + 2 * MIB;
        assert!(st.peak_reserved_bytes <= budget, "{st:?}");
        assert_accounting(&st);
        assert_no_races(&sim);
    }
}

/// A new stream each round allocates 4 MiB and frees it after a small block, so that the
/// last free of each round is covered by no event (`footprint.rs`, the gathering interval,
/// runs the same on borrowed handles, where the pool must synchronise the device): on
/// streams streampool owns, the next round covers it with an event recorded on the
/// previous stream and waits on it, without a device synchronisation, reusing the block.
#[test]
fn blocks_no_event_covers_are_reused_by_a_wait_on_streams_the_pool_can_see() {
    let (sim, b, pool) = setup(0.15);
    let streams: Vec<Stream> = (0..8).map(|_| stream(&b)).collect();
    for s in &streams {
        write_and_free_two(&sim, &pool, s);
    }
    let st = pool.stats();
    assert_eq!(st.synchronizations, 0, "{st:?}");
    assert!(st.cross_stream_waits >= 7, "{st:?}");
    assert_eq!(st.peak_reserved_bytes, 6 * MIB, "reused, not grown: {st:?}");
    assert_accounting(&st);
    assert_no_races(&sim);
}

/// A consumer that synchronises its stream (a program that reads each result on the
/// host) completes its frees at each synchronisation: with an event batch, such a stream
/// records no event at all, so producers take the consumers' blocks with no driver call of
/// the pool's (no event recorded or queried, no wait, no device synchronisation), within
/// the footprint the batch allows. With the default batch of 1 the pool still records the
/// events its producers ask for (they complete sooner than the next synchronisation), and
/// the synchronisations add none. Every reuse stays ordered on a device that lags (the
/// detector finds no race).
#[test]
fn a_synchronised_consumer_hands_memory_over_without_driver_calls() {
    for pairs in [1, 4, 8] {
        let (sim, b, pool) = batched(8);
        sim.set_eager(true);
        let (calls, peak_live) = pipeline(&sim, &b, &pool, pairs, 50, 400, 0, true);
        let st = pool.stats();
        eprintln!("{pairs} pairs, batch 8, synchronised: {calls:?}; {st:?}");
        assert_eq!(calls.total(), 0.0, "{pairs} pairs: {calls:?}");
        assert_eq!((calls.syncs, calls.growths), (0, 0), "{pairs} pairs: {calls:?}");
        assert!(st.peak_reserved_bytes <= peak_live * 3 + 2 * MIB, "{st:?}, peak live {peak_live}");
        assert_accounting(&st);
    }
    for pairs in [1, 4] {
        let (sim, b, pool) = setup(0.15);
        sim.set_eager(true);
        let (calls, _) = pipeline(&sim, &b, &pool, pairs, 50, 400, 0, true);
        assert!(calls.total() <= 1.6, "{pairs} pairs, batch 1: {calls:?}");
        assert_eq!((calls.syncs, calls.growths), (0, 0), "{pairs} pairs: {calls:?}");
    }
    for batch in [1, 8] {
        let (sim, b, pool) = batched(batch);
        pipeline(&sim, &b, &pool, 4, 20, 200, 4, true);
        assert_accounting(&pool.stats());
        assert_no_races(&sim);
    }
}
