//! The producer/consumer pipeline across streams, driven from Rust threads.
//!
//! `pairs` producer threads, each on a stream of its own, allocate a chunk, fill it with a
//! kernel ([`crate::kernels::fill`]), record an event and hand the chunk to their consumer
//! thread (a bounded queue of `queue_depth` chunks). The consumer, on a stream of its own,
//! waits on the event, runs the compute kernel on the chunk (about `kernel_us` of kernel
//! time, calibrated once on the device), checks every `check_every`-th chunk against its
//! fill pattern ([`crate::kernels::check`], which synchronises the consumer's stream), and
//! frees the chunk on its stream. Memory therefore moves from the consumers' streams to the
//! producers' through the allocator, which must order that reuse (the pipeline bubbles of
//! pools that wait or synchronise show up as long allocator calls).
//!
//! Measured: chunks per second (all streams synchronised at the end), the share of host
//! time spent inside allocator calls (summed over the threads, against their wall time),
//! per-call latency and the longest call, peak live bytes (chunks allocated and not yet
//! freed) against the resource's peak reserved bytes, and the check's mismatches, which
//! must be 0.
//!
//! With [`PipelineOptions::long_call_ns`] set, each call over that threshold is also
//! classified by what the calling thread did meanwhile ([`LongCalls`]): switched out by the
//! operating system, asleep (a lock, a driver wait), robbed of its CPU by the host, or
//! running, and what a watchdog saw it doing once the call ran past the threshold; with
//! [`PipelineOptions::null_call_ns`] too, spans that only spin are classified beside them.
//! It tells a long call the allocator caused from one the host did.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Instant;

use super::long_calls::{CallTimer, LongCallLog};
pub use super::long_calls::{LongCalls, RunningIn, Sampled};
use super::{DriverCalls, FootprintBaseline, Percentiles, RunFootprint};
use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::kernels;
use crate::resource::MemoryResource;
use crate::stream::{Event, Stream};

/// The most producer/consumer pairs (each pair is two threads and two streams).
pub const MAX_PAIRS: usize = 512;

/// The most chunks a producer may be ahead of its consumer (its queue's slots are made up
/// front).
pub const MAX_QUEUE_DEPTH: usize = 1 << 16;

/// The most chunks a pair may pass (2^32: far beyond any run's length; `pairs` times this
/// cannot overflow).
pub const MAX_CHUNKS_PER_PAIR: usize = 1 << 32;

/// The pipeline's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PipelineOptions {
    /// Producer/consumer pairs (threads: twice as many).
    pub pairs: usize,
    /// Bytes of each chunk.
    pub chunk_bytes: usize,
    /// Chunks each producer makes.
    pub chunks_per_pair: usize,
    /// Kernel time per chunk on the consumer, in microseconds (0: no compute kernel).
    pub kernel_us: f64,
    /// Chunks a producer may be ahead of its consumer.
    pub queue_depth: usize,
    /// Check every n-th chunk of each pair (0: never).
    pub check_every: usize,
    /// Classify the allocator calls longer than this many nanoseconds ([`LongCalls`]; 0:
    /// off). Each call then reads the thread's context switches and CPU clock before it
    /// (and after it, when long), outside its timed span: two system calls more per
    /// allocator call; and a watchdog thread looks at the threads in a call every 100 µs.
    pub long_call_ns: u64,
    /// With `long_call_ns`: after every allocator call, the same thread also times a span
    /// that only spins for this many nanoseconds (a call of an allocator that does nothing),
    /// classified like the calls in [`PipelineReport::null_calls`]. Its long spans are the
    /// machine's, whatever the allocator (0: off; at most [`MAX_NULL_CALL_NS`]).
    pub null_call_ns: u64,
}

/// The longest null call ([`PipelineOptions::null_call_ns`]).
pub const MAX_NULL_CALL_NS: u64 = 100_000;

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            pairs: 1,
            chunk_bytes: 1 << 20,
            chunks_per_pair: 1000,
            kernel_us: 20.0,
            queue_depth: 4,
            check_every: 1,
            long_call_ns: 0,
            null_call_ns: 0,
        }
    }
}

/// What a pipeline run measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PipelineReport {
    /// Chunks made and consumed.
    pub chunks: u64,
    /// Wall time, until every stream had finished its work.
    pub seconds: f64,
    /// `chunks / seconds`.
    pub chunks_per_second: f64,
    /// Time inside allocate and deallocate calls, summed over the threads.
    pub alloc_seconds: f64,
    /// `alloc_seconds` against the threads' wall time (`seconds × 2 × pairs`).
    pub alloc_share: f64,
    /// Latency of the producers' allocate calls.
    pub allocate: Percentiles,
    /// Latency of the consumers' deallocate calls.
    pub free: Percentiles,
    /// The longest single allocator call (allocate or deallocate), in nanoseconds.
    pub longest_call_ns: u64,
    /// The most bytes live at once (chunks allocated and not yet freed).
    pub peak_live_bytes: u64,
    /// The resource's peak reserved bytes over the run, where it reports them.
    pub peak_reserved_bytes: Option<usize>,
    /// Device synchronisations the resource made, where it counts them.
    pub synchronizations: Option<u64>,
    /// Cross-stream waits the resource inserted, where it counts them.
    pub waits: Option<u64>,
    /// The resource's own driver calls over the run, by kind, where it counts them (see
    /// [`PipelineReport::driver_calls_per_chunk`]).
    pub driver_calls: Option<DriverCalls>,
    /// Chunks checked.
    pub checked: u64,
    /// Words that did not match their fill pattern (must be 0).
    pub mismatches: u64,
    /// Passes of the compute kernel per chunk (from `kernel_us` and the calibration).
    pub compute_iterations: u32,
    /// The calls over [`PipelineOptions::long_call_ns`], classified (`None`: not asked).
    pub long_calls: Option<LongCalls>,
    /// The null calls over `long_call_ns` ([`PipelineOptions::null_call_ns`]), classified
    /// (nothing sampled; `None`: not asked). There are as many null calls as allocator calls.
    pub null_calls: Option<LongCalls>,
}

impl PipelineReport {
    /// The resource's own driver calls per chunk (all kinds), where it counts them.
    pub fn driver_calls_per_chunk(&self) -> Option<f64> {
        Some(self.driver_calls?.total() as f64 / self.chunks.max(1) as f64)
    }
}

/// A chunk on its way from a producer to its consumer.
struct Chunk {
    ptr: DevPtr,
    seed: u64,
    index: usize,
    ready: Event,
}

/// Counters shared by the threads.
#[derive(Default)]
struct Shared {
    live: AtomicU64,
    peak_live: AtomicU64,
    checked: AtomicU64,
    mismatches: AtomicU64,
    allocs: Mutex<Vec<u64>>,
    frees: Mutex<Vec<u64>>,
    error: Mutex<Option<Error>>,
}

impl Shared {
    fn fail(&self, e: Error) {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
    }
}

fn check_options(o: &PipelineOptions) -> Result<()> {
    let bad = |what: &str| Err(Error::invalid(what.to_string()));
    if o.pairs == 0 || o.pairs > MAX_PAIRS {
        return Err(Error::invalid(format!("pairs must be in 1..={MAX_PAIRS}, got {}", o.pairs)));
    }
    if o.chunks_per_pair > MAX_CHUNKS_PER_PAIR {
        return Err(Error::invalid(format!(
            "chunks_per_pair must be at most {MAX_CHUNKS_PER_PAIR}, got {}",
            o.chunks_per_pair
        )));
    }
    if o.chunk_bytes < 8 {
        return bad("chunk_bytes must be >= 8 (the kernels work on 8-byte words)");
    }
    if o.queue_depth == 0 || o.queue_depth > MAX_QUEUE_DEPTH {
        return Err(Error::invalid(format!(
            "queue_depth must be in 1..={MAX_QUEUE_DEPTH}, got {}",
            o.queue_depth
        )));
    }
    if !(0.0..=1e6).contains(&o.kernel_us) {
        return bad(
            "kernel_us must be a number from 0 (no compute kernel) to 1000000 (1 s of kernel per chunk)",
        );
    }
    if o.null_call_ns > 0 && o.long_call_ns == 0 {
        return bad("null_call_ns needs long_call_ns: the null calls are counted against its threshold");
    }
    if o.null_call_ns > MAX_NULL_CALL_NS {
        return Err(Error::invalid(format!(
            "null_call_ns must be at most {MAX_NULL_CALL_NS} (0.1 ms), got {}",
            o.null_call_ns
        )));
    }
    Ok(())
}

/// Passes of the compute kernel over a chunk that take about `kernel_us`: one timed
/// launch of a few passes (with its synchronisation, so slightly over-estimated).
fn calibrate(mr: &dyn MemoryResource, o: &PipelineOptions) -> Result<u32> {
    if o.kernel_us == 0.0 {
        return Ok(0);
    }
    let (b, dev) = (mr.backend(), mr.device());
    let s = Stream::create(b, dev, false)?;
    let p = mr.allocate(o.chunk_bytes, &s)?;
    let run = || -> Result<f64> {
        // SAFETY: `p` is `chunk_bytes` of `mr`'s device memory, allocated just above for
        // this calibration alone and freed after it; its work is all on `s`.
        unsafe { kernels::fill(b, dev, p, o.chunk_bytes, 0, &s) }?;
        // SAFETY: as above.
        unsafe { kernels::compute(b, dev, p, o.chunk_bytes, &s, 1) }?; // JIT and warm-up
        s.synchronize(b, dev)?;
        const PASSES: u32 = 8;
        let t = Instant::now();
        // SAFETY: as above.
        unsafe { kernels::compute(b, dev, p, o.chunk_bytes, &s, PASSES) }?;
        s.synchronize(b, dev)?;
        Ok(t.elapsed().as_secs_f64() * 1e6 / PASSES as f64)
    };
    let per_pass_us = run();
    mr.deallocate(p, o.chunk_bytes, &s)?;
    let per_pass_us = per_pass_us?.max(1e-3);
    Ok((o.kernel_us / per_pass_us).round().clamp(1.0, u32::MAX as f64) as u32)
}

/// Runs the pipeline (see the module docs) on `mr`.
pub fn pipeline(mr: &dyn MemoryResource, o: &PipelineOptions) -> Result<PipelineReport> {
    pipeline_until(mr, o, &AtomicBool::new(false))
}

/// [`pipeline`], stopped early when `stop` is set (by another thread: Ctrl-C, say): the
/// producers stop at their next chunk, the consumers free what was sent, and an error says
/// that the pipeline was stopped.
pub fn pipeline_until(
    mr: &dyn MemoryResource,
    o: &PipelineOptions,
    stop: &AtomicBool,
) -> Result<PipelineReport> {
    check_options(o)?;
    let iterations = calibrate(mr, o)?;
    let (b, dev) = (mr.backend().clone(), mr.device());
    let streams: Vec<(Stream, Stream)> = (0..o.pairs)
        .map(|_| Ok((Stream::create(&b, dev, false)?, Stream::create(&b, dev, false)?)))
        .collect::<Result<_>>()?;
    let shared = Shared::default();
    let long = (o.long_call_ns > 0).then(|| LongCallLog::new(o.long_call_ns, o.null_call_ns, 2 * o.pairs));
    let long = long.as_ref();
    let baseline = FootprintBaseline::start(mr);
    let start = Instant::now();
    std::thread::scope(|scope| {
        let watchdog = long.map(|log| scope.spawn(move || log.watch()));
        let mut workers = Vec::with_capacity(2 * o.pairs);
        for (pair, (ps, cs)) in streams.iter().enumerate() {
            let (tx, rx) = mpsc::sync_channel::<Chunk>(o.queue_depth);
            let (back_tx, back_rx) = mpsc::channel::<Event>();
            let (shared, b) = (&shared, &b);
            let timer = move |i: usize| CallTimer::new(o.chunks_per_pair, long.map(|log| (log, i)));
            workers.push(
                std::thread::Builder::new()
                    .name(format!("producer-{pair}"))
                    .spawn_scoped(scope, move || {
                        let mut timer = timer(2 * pair);
                        if let Err(e) = produce(mr, b, o, pair, ps, &tx, &back_rx, shared, &mut timer, stop) {
                            shared.fail(e);
                        }
                        shared.allocs.lock().unwrap_or_else(|p| p.into_inner()).extend(timer.finish());
                    })
                    .expect("spawn a producer"),
            );
            workers.push(
                std::thread::Builder::new()
                    .name(format!("consumer-{pair}"))
                    .spawn_scoped(scope, move || {
                        let mut timer = timer(2 * pair + 1);
                        consume(mr, b, o, iterations, cs, rx, back_tx, shared, &mut timer);
                        shared.frees.lock().unwrap_or_else(|p| p.into_inner()).extend(timer.finish());
                    })
                    .expect("spawn a consumer"),
            );
        }
        // The watchdog stops once every worker has, a worker's panic included.
        let panicked = workers.into_iter().filter_map(|w| w.join().err()).next();
        if let (Some(log), Some(w)) = (long, watchdog) {
            log.finish();
            let _ = w.join();
        }
        if let Some(p) = panicked {
            std::panic::resume_unwind(p);
        }
    });
    for (ps, cs) in &streams {
        ps.synchronize(&b, dev)?;
        cs.synchronize(&b, dev)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    if let Some(e) = shared.error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if stop.load(Ordering::Relaxed) {
        return Err(Error::invalid("the pipeline was stopped before its end"));
    }
    let RunFootprint { peak_reserved_bytes, synchronizations, waits, driver_calls } = baseline.finish(mr);
    let long_calls = long.map(LongCallLog::totals);
    let null_calls = long.filter(|_| o.null_call_ns > 0).map(LongCallLog::null_totals);
    let allocate = Percentiles::of_ticks(shared.allocs.into_inner().unwrap_or_else(|p| p.into_inner()));
    let free = Percentiles::of_ticks(shared.frees.into_inner().unwrap_or_else(|p| p.into_inner()));
    let chunks = (o.pairs * o.chunks_per_pair) as u64;
    let alloc_seconds = (allocate.total + free.total) as f64 * 1e-9;
    Ok(PipelineReport {
        chunks,
        seconds,
        chunks_per_second: chunks as f64 / seconds,
        alloc_seconds,
        alloc_share: alloc_seconds / (seconds * 2.0 * o.pairs as f64),
        allocate,
        free,
        longest_call_ns: allocate.max.max(free.max),
        peak_live_bytes: shared.peak_live.load(Ordering::Relaxed),
        peak_reserved_bytes,
        synchronizations,
        waits,
        driver_calls,
        checked: shared.checked.load(Ordering::Relaxed),
        mismatches: shared.mismatches.load(Ordering::Relaxed),
        compute_iterations: iterations,
        long_calls,
        null_calls,
    })
}

#[allow(clippy::too_many_arguments)]
fn produce(
    mr: &dyn MemoryResource,
    b: &crate::device::BackendRef,
    o: &PipelineOptions,
    pair: usize,
    s: &Stream,
    tx: &mpsc::SyncSender<Chunk>,
    back: &mpsc::Receiver<Event>,
    shared: &Shared,
    timer: &mut CallTimer<'_>,
    stop: &AtomicBool,
) -> Result<()> {
    let dev = mr.device();
    (|| {
        for index in 0..o.chunks_per_pair {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            let ptr = timer.time(|| mr.allocate(o.chunk_bytes, s))?;
            let live = shared.live.fetch_add(o.chunk_bytes as u64, Ordering::Relaxed) + o.chunk_bytes as u64;
            shared.peak_live.fetch_max(live, Ordering::Relaxed);
            let seed = ((pair as u64) << 32) | index as u64;
            let sent = (|| {
                // SAFETY: `ptr` is `chunk_bytes` of `mr`'s memory, just allocated on `s` for
                // this chunk; its consumer uses it only after the event recorded below.
                unsafe { kernels::fill(b, dev, ptr, o.chunk_bytes, seed, s) }?;
                let ready = match back.try_recv() {
                    Ok(e) => e,
                    Err(_) => Event::new(b, dev)?,
                };
                ready.record(s)?;
                Ok(Chunk { ptr, seed, index, ready })
            })();
            let chunk = match sent {
                Ok(c) => c,
                Err(e) => {
                    let _ = mr.deallocate(ptr, o.chunk_bytes, s);
                    return Err(e);
                }
            };
            if let Err(mpsc::SendError(c)) = tx.send(chunk) {
                // The consumer stopped (it failed): free the chunk here.
                let _ = mr.deallocate(c.ptr, o.chunk_bytes, s);
                return Ok(());
            }
        }
        Ok(())
    })()
}

#[allow(clippy::too_many_arguments)]
fn consume(
    mr: &dyn MemoryResource,
    b: &crate::device::BackendRef,
    o: &PipelineOptions,
    iterations: u32,
    s: &Stream,
    rx: mpsc::Receiver<Chunk>,
    back: mpsc::Sender<Event>,
    shared: &Shared,
    timer: &mut CallTimer<'_>,
) {
    let dev = mr.device();
    let mut failed = false;
    // Runs until the producer is done; after a failure it only frees what arrives.
    for chunk in rx.iter() {
        let work = || -> Result<()> {
            s.wait(&chunk.ready)?;
            // SAFETY: the chunk is `chunk_bytes` of `mr`'s memory, handed over by its
            // producer (whose fill `s` now waits for), this consumer's until it frees it.
            unsafe { kernels::compute(b, dev, chunk.ptr, o.chunk_bytes, s, iterations) }?;
            if o.check_every > 0 && chunk.index % o.check_every == 0 {
                // SAFETY: as above.
                let bad = unsafe { kernels::check(b, dev, chunk.ptr, o.chunk_bytes, chunk.seed, s) }?;
                shared.checked.fetch_add(1, Ordering::Relaxed);
                shared.mismatches.fetch_add(bad, Ordering::Relaxed);
            }
            Ok(())
        };
        if failed {
            // Not used here, but its producer's fill may still be queued: the free is
            // ordered after it, as every other free of a handed-over chunk.
            let _ = s.wait(&chunk.ready);
        } else if let Err(e) = work() {
            shared.fail(e);
            failed = true;
            // The chunk may still be in use by queued work: wait for it before the free.
            let _ = s.wait(&chunk.ready);
        }
        shared.live.fetch_sub(o.chunk_bytes as u64, Ordering::Relaxed);
        if let Err(e) = timer.time(|| mr.deallocate(chunk.ptr, o.chunk_bytes, s)) {
            shared.fail(e);
            failed = true;
        }
        let _ = back.send(chunk.ready);
    }
}
