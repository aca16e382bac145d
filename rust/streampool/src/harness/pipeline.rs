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
//! operating system, asleep (a lock, a driver wait), or neither. It tells a long call the
//! allocator caused from one the host did: on a machine with as many busy threads as CPUs,
//! a thread descheduled inside a call makes a call of a scheduler's time slice.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Instant;

use super::{ticks_since, DriverCalls, FootprintBaseline, Percentiles, RunFootprint};
use crate::clock;
use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::kernels;
use crate::resource::MemoryResource;
use crate::stream::{Event, Stream};

/// The most producer/consumer pairs (each pair is two threads and two streams).
pub const MAX_PAIRS: usize = 512;

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
    /// off). Each call then reads the thread's context switches before and after it
    /// (outside its timed span: two system calls more per allocator call).
    pub long_call_ns: u64,
}

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
}

/// The allocator calls longer than a threshold, by what the calling thread did during the
/// call, from its context switches (`getrusage(RUSAGE_THREAD)`; Linux only: elsewhere every
/// long call counts as neither).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LongCalls {
    /// The threshold, in nanoseconds.
    pub over_ns: u64,
    /// Calls that took longer.
    pub calls: u64,
    /// Of those, the calls during which the operating system switched the thread out while
    /// it could run (an involuntary context switch: another thread had its CPU).
    pub preempted: u64,
    /// Of the others, the calls during which the thread slept (a voluntary context switch:
    /// it waited on a lock, a condition or the driver).
    pub slept: u64,
}

impl LongCalls {
    /// The calls during which the thread neither slept nor was switched out: the call's
    /// own work, or time the host took from the virtual machine (which the guest's
    /// counters do not see).
    pub fn on_cpu(&self) -> u64 {
        self.calls - self.preempted - self.slept
    }

    fn add(&mut self, o: &LongCalls) {
        self.calls += o.calls;
        self.preempted += o.preempted;
        self.slept += o.slept;
    }
}

/// The calling thread's (voluntary, involuntary) context switches so far.
#[cfg(target_os = "linux")]
fn switches() -> (i64, i64) {
    // SAFETY: rusage is plain integers, for which all zeroes is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes the struct it is given, which lives for the call.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) } != 0 {
        return (0, 0);
    }
    (u.ru_nvcsw, u.ru_nivcsw)
}

#[cfg(not(target_os = "linux"))]
fn switches() -> (i64, i64) {
    (0, 0)
}

/// One thread's timing of its allocator calls: every call's ticks, and the long calls
/// classified when asked.
struct CallTimer {
    lat: Vec<u64>,
    /// The threshold in clock ticks, and the long calls so far (`None`: not asked).
    long: Option<(u64, LongCalls)>,
}

impl CallTimer {
    fn new(o: &PipelineOptions) -> Self {
        let long = (o.long_call_ns > 0).then(|| {
            let ticks = (o.long_call_ns as f64 / clock::ns_per_tick()) as u64;
            (ticks, LongCalls { over_ns: o.long_call_ns, ..LongCalls::default() })
        });
        CallTimer { lat: Vec::with_capacity(o.chunks_per_pair), long }
    }

    /// Runs `call`, timed.
    #[inline]
    fn time<T>(&mut self, call: impl FnOnce() -> T) -> T {
        let before = self.long.is_some().then(switches);
        let t = clock::now();
        let r = call();
        let ticks = ticks_since(t);
        self.lat.push(ticks);
        if let (Some((over, long)), Some((voluntary, involuntary))) = (&mut self.long, before) {
            if ticks > *over {
                let (v, i) = switches();
                long.calls += 1;
                if i > involuntary {
                    long.preempted += 1;
                } else if v > voluntary {
                    long.slept += 1;
                }
            }
        }
        r
    }

    fn merge_into(self, lat: &Mutex<Vec<u64>>, shared: &Shared) {
        lat.lock().unwrap_or_else(|p| p.into_inner()).extend(self.lat);
        if let Some((_, long)) = self.long {
            let mut all = shared.long.lock().unwrap_or_else(|p| p.into_inner());
            all.get_or_insert(LongCalls { over_ns: long.over_ns, ..LongCalls::default() }).add(&long);
        }
    }
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
    long: Mutex<Option<LongCalls>>,
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
    if o.chunk_bytes < 8 {
        return bad("chunk_bytes must be >= 8 (the kernels work on 8-byte words)");
    }
    if o.queue_depth == 0 {
        return bad("queue_depth must be >= 1");
    }
    if !(o.kernel_us >= 0.0 && o.kernel_us.is_finite()) {
        return bad("kernel_us must be a finite number >= 0 (0: no compute kernel)");
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
        kernels::fill(b, dev, p, o.chunk_bytes, 0, &s)?;
        kernels::compute(b, dev, p, o.chunk_bytes, &s, 1)?; // JIT and warm-up
        s.synchronize(b, dev)?;
        const PASSES: u32 = 8;
        let t = Instant::now();
        kernels::compute(b, dev, p, o.chunk_bytes, &s, PASSES)?;
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
    check_options(o)?;
    let iterations = calibrate(mr, o)?;
    let (b, dev) = (mr.backend().clone(), mr.device());
    let streams: Vec<(Stream, Stream)> = (0..o.pairs)
        .map(|_| Ok((Stream::create(&b, dev, false)?, Stream::create(&b, dev, false)?)))
        .collect::<Result<_>>()?;
    let shared = Shared::default();
    let baseline = FootprintBaseline::start(mr);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (pair, (ps, cs)) in streams.iter().enumerate() {
            let (tx, rx) = mpsc::sync_channel::<Chunk>(o.queue_depth);
            let (back_tx, back_rx) = mpsc::channel::<Event>();
            let (shared, b) = (&shared, &b);
            std::thread::Builder::new()
                .name(format!("producer-{pair}"))
                .spawn_scoped(scope, move || {
                    if let Err(e) = produce(mr, b, o, pair, ps, &tx, &back_rx, shared) {
                        shared.fail(e);
                    }
                })
                .expect("spawn a producer");
            std::thread::Builder::new()
                .name(format!("consumer-{pair}"))
                .spawn_scoped(scope, move || consume(mr, b, o, iterations, cs, rx, back_tx, shared))
                .expect("spawn a consumer");
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
    let RunFootprint { peak_reserved_bytes, synchronizations, waits, driver_calls } = baseline.finish(mr);
    let long_calls = shared.long.into_inner().unwrap_or_else(|p| p.into_inner());
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
) -> Result<()> {
    let dev = mr.device();
    let mut timer = CallTimer::new(o);
    let result = (|| {
        for index in 0..o.chunks_per_pair {
            let ptr = timer.time(|| mr.allocate(o.chunk_bytes, s))?;
            let live = shared.live.fetch_add(o.chunk_bytes as u64, Ordering::Relaxed) + o.chunk_bytes as u64;
            shared.peak_live.fetch_max(live, Ordering::Relaxed);
            let seed = ((pair as u64) << 32) | index as u64;
            let sent = (|| {
                kernels::fill(b, dev, ptr, o.chunk_bytes, seed, s)?;
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
    })();
    timer.merge_into(&shared.allocs, shared);
    result
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
) {
    let dev = mr.device();
    let mut timer = CallTimer::new(o);
    let mut failed = false;
    // Runs until the producer is done; after a failure it only frees what arrives.
    for chunk in rx.iter() {
        let work = || -> Result<()> {
            s.wait(&chunk.ready)?;
            kernels::compute(b, dev, chunk.ptr, o.chunk_bytes, s, iterations)?;
            if o.check_every > 0 && chunk.index % o.check_every == 0 {
                let bad = kernels::check(b, dev, chunk.ptr, o.chunk_bytes, chunk.seed, s)?;
                shared.checked.fetch_add(1, Ordering::Relaxed);
                shared.mismatches.fetch_add(bad, Ordering::Relaxed);
            }
            Ok(())
        };
        if !failed {
            if let Err(e) = work() {
                shared.fail(e);
                failed = true;
                // The chunk may still be in use by queued work: wait for it before the free.
                let _ = s.wait(&chunk.ready);
            }
        }
        shared.live.fetch_sub(o.chunk_bytes as u64, Ordering::Relaxed);
        if let Err(e) = timer.time(|| mr.deallocate(chunk.ptr, o.chunk_bytes, s)) {
            shared.fail(e);
            failed = true;
        }
        let _ = back.send(chunk.ready);
    }
    timer.merge_into(&shared.frees, shared);
}
