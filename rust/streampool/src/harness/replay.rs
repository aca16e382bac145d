//! Replays an allocation log on a resource: one thread per recorded thread, one stream
//! per recorded stream, each thread doing its events in recorded order with the recorded
//! gaps scaled.
//!
//! # The records
//! A log is packed little-endian records of [`RECORD_BYTES`] bytes (Python's
//! `struct.Struct("<QQQIIB7x")`): `(t_ns, size, alloc_id, thread, stream, op)`, `op` 0 for
//! an allocation and 1 for a free, in recorded order. `thread` and `stream` are labels:
//! each distinct value gets a thread, and a (non-blocking) stream made for the replay. An
//! id may be allocated again once freed (logs that use addresses as ids do this). A free's
//! size may be 0 (the allocation's is used) or the allocation's.
//!
//! # What a replay does
//! Each thread waits until `t0 + (t_ns - earliest t_ns) × gap_scale` before each event
//! (sleeping, then spinning the last 100 µs), or runs flat out when `gap_scale` is 0.
//! No thread runs more than [`ReplayOptions::max_lead_ns`] of recorded time ahead of
//! another: before an event recorded at `t`, a thread waits until every other thread has
//! done its events recorded before `t - max_lead_ns`. A program's queues, locks and joins
//! are not in the log; that keeps the order they gave across threads to within the lead,
//! so that a producer does not run ahead of its consumer and hold more memory live than
//! the program ever had (a thread's times are taken as never going back, each counting as
//! the latest of its thread so far, and a free's as never before its allocation's). A
//! free of an allocation made by another thread waits until that allocation exists, and
//! when it was made on another stream, the freeing stream waits on an event recorded on
//! the allocating stream just after the allocation, as a real program must order the
//! hand-off. An allocation that runs out of memory is counted and skipped, and so is its
//! free. Allocations the log never frees are freed after the run (untimed).
//!
//! What is timed: each allocate and deallocate call (two reads of the time-stamp counter
//! around it). The
//! replayer's own cost per event, measured against a [`super::NullMemoryResource`], is
//! what the `replay` bench reports.
//!
//! The peak of live bytes is the replay's own: each thread notes, beside its latencies,
//! when each allocation returned and when each free was called, and after the run those
//! notes of every thread are merged in time. On several threads that is what was live at
//! once as they ran, which the log's recorded order does not say (a generated log lists
//! one thread after another).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{ticks_since, FootprintBaseline, Percentiles};
use crate::clock;
use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::stream::{Event, Stream};

/// Bytes of one record.
pub const RECORD_BYTES: usize = 40;

/// The most recorded threads a log may have (each is replayed by a native thread).
pub const MAX_THREADS: usize = 1024;

/// What a record does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `op` 0.
    Allocate,
    /// `op` 1.
    Free,
}

/// One record of a log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Record {
    /// When it happened, in nanoseconds from any origin.
    pub t_ns: u64,
    /// Bytes (of a free: 0, or the allocation's).
    pub size: u64,
    /// Which allocation.
    pub alloc_id: u64,
    /// The recorded thread (a label).
    pub thread: u32,
    /// The recorded stream (a label).
    pub stream: u32,
    /// Allocate or free.
    pub op: Op,
}

impl Record {
    /// The record's 40 bytes.
    pub fn to_bytes(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0..8].copy_from_slice(&self.t_ns.to_le_bytes());
        b[8..16].copy_from_slice(&self.size.to_le_bytes());
        b[16..24].copy_from_slice(&self.alloc_id.to_le_bytes());
        b[24..28].copy_from_slice(&self.thread.to_le_bytes());
        b[28..32].copy_from_slice(&self.stream.to_le_bytes());
        b[32] = match self.op {
            Op::Allocate => 0,
            Op::Free => 1,
        };
        b
    }
}

/// Packs records as [`parse`] reads them.
pub fn encode(records: &[Record]) -> Vec<u8> {
    records.iter().flat_map(|r| r.to_bytes()).collect()
}

/// Reads packed records; an error names the record index of the first bad one.
pub fn parse(bytes: &[u8]) -> Result<Vec<Record>> {
    if !bytes.len().is_multiple_of(RECORD_BYTES) {
        return Err(Error::invalid(format!(
            "records: {} bytes is not a multiple of {RECORD_BYTES} (the record size, \
             struct.Struct(\"<QQQIIB7x\")); the data is truncated or not a replay log",
            bytes.len()
        )));
    }
    let u64_at = |c: &[u8], i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |c: &[u8], i: usize| u32::from_le_bytes(c[i..i + 4].try_into().expect("4 bytes"));
    bytes
        .chunks_exact(RECORD_BYTES)
        .enumerate()
        .map(|(i, c)| {
            let op = match c[32] {
                0 => Op::Allocate,
                1 => Op::Free,
                other => {
                    return Err(Error::invalid(format!(
                        "record {i}: op {other} is neither 0 (allocate) nor 1 (free)"
                    )))
                }
            };
            Ok(Record {
                t_ns: u64_at(c, 0),
                size: u64_at(c, 8),
                alloc_id: u64_at(c, 16),
                thread: u32_at(c, 24),
                stream: u32_at(c, 28),
                op,
            })
        })
        .collect()
}

/// How to replay.
#[derive(Debug, Clone, Copy)]
pub struct ReplayOptions {
    /// The recorded gaps are multiplied by this; 0 runs every thread flat out.
    pub gap_scale: f64,
    /// How far, in recorded nanoseconds, a thread may run ahead of the others (see the
    /// module docs); `None`: no bound, each thread at its own pace. Default
    /// [`DEFAULT_MAX_LEAD_NS`].
    pub max_lead_ns: Option<u64>,
}

/// [`ReplayOptions::max_lead_ns`]'s default: 1 ms of recorded time.
pub const DEFAULT_MAX_LEAD_NS: u64 = 1_000_000;

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions { gap_scale: 1.0, max_lead_ns: Some(DEFAULT_MAX_LEAD_NS) }
    }
}

/// Where each replay thread is in recorded time, for [`ReplayOptions::max_lead_ns`]: the
/// time ([`Step::pace_ns`]) of the event it does or waits to do next, `u64::MAX` once it
/// has finished. A thread's time never goes back, and a free's is never before its
/// allocation's. So no replay waits forever: the thread with the earliest time either goes
/// on, or waits in a free for an allocation whose thread is at that time or before, so at
/// the earliest too, and that chain of frees waiting for allocations ends (each allocation
/// comes before its free in the log).
struct Progress(Vec<PaddedTime>);

/// A thread's recorded time, alone on its cache lines (each thread writes its own often).
#[repr(align(128))]
struct PaddedTime(AtomicU64);

impl Progress {
    /// Waits until no other thread than `me` is at a recorded time before `at - lead` (or
    /// until `stopped`), and returns the time up to which `me` may then go on without
    /// looking again: the others' earliest plus `lead`.
    fn wait_for_others(&self, me: usize, at: u64, lead: u64, stopped: &dyn Fn() -> bool) -> u64 {
        let mut spins = 0u32;
        loop {
            let earliest = self
                .0
                .iter()
                .enumerate()
                .filter(|&(t, _)| t != me)
                .map(|(_, p)| p.0.load(Ordering::Acquire))
                .min()
                .unwrap_or(u64::MAX);
            let allowed = earliest.saturating_add(lead);
            if allowed >= at || stopped() {
                return allowed;
            }
            // Spin briefly (the other thread is usually a call away), then give up the core:
            // the replay may run more threads than the machine has.
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn set(&self, me: usize, at: u64) {
        self.0[me].0.store(at, Ordering::Release);
    }
}

/// What a replay measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayReport {
    /// Records replayed (skipped out-of-memory allocations and their frees included).
    pub events: u64,
    /// Recorded threads (replay threads).
    pub threads: usize,
    /// Recorded streams (streams made for the replay).
    pub streams: usize,
    /// Wall time from the start until every thread had finished.
    pub seconds: f64,
    /// Time inside allocate and deallocate calls, summed over the threads.
    pub alloc_seconds: f64,
    /// Latency of the allocate calls that succeeded.
    pub allocate: Percentiles,
    /// Latency of the deallocate calls.
    pub free: Percentiles,
    /// The most bytes live at once during the replay, over every thread: an allocation is
    /// live from its call's return to its free's call (allocations that failed left out).
    pub peak_live_bytes: u64,
    /// The resource's peak reserved bytes over the run, where it reports them (see
    /// [`crate::Footprint`]).
    pub peak_reserved_bytes: Option<usize>,
    /// Allocations that ran out of memory (skipped, with their frees).
    pub oom_events: u64,
    /// Device synchronisations the resource made during the run, where it counts them.
    pub synchronizations: Option<u64>,
    /// Cross-stream waits the resource inserted during the run, where it counts them.
    pub waits: Option<u64>,
}

/// A slot's state: not allocated yet, live, out of memory (skipped), freed, or its
/// allocation failed otherwise (the replay stops).
const PENDING: u8 = 0;
const LIVE: u8 = 1;
const OOM: u8 = 2;
const FREED: u8 = 3;
const FAILED: u8 = 4;

/// One allocation of the log.
struct Slot {
    size: usize,
    state: AtomicU8,
    ptr: AtomicU64,
    /// Recorded on the allocating stream after the allocation, when the free is on another.
    event: Mutex<Option<Event>>,
    /// The free is on another stream than the allocation.
    cross: bool,
    alloc_stream: usize,
}

/// One event of a thread's plan.
#[derive(Clone, Copy)]
struct Step {
    at_ns: u64,
    /// The time [`Progress`] goes by: the latest of this thread's times so far, and for a
    /// free not before its allocation's.
    pace_ns: u64,
    slot: u32,
    stream: u32,
    free: bool,
    record: usize,
}

/// The log checked and split per thread.
struct Plan {
    slots: Vec<Slot>,
    threads: Vec<Vec<Step>>,
    streams: usize,
}

fn plan(records: &[Record]) -> Result<Plan> {
    use std::collections::HashMap;
    // The earliest time, not the first record's: threads log concurrently, out of order.
    let first = records.iter().map(|r| r.t_ns).min().unwrap_or(0);
    let (mut threads, mut streams): (HashMap<u32, usize>, HashMap<u32, usize>) = Default::default();
    let mut live: HashMap<u64, u32> = HashMap::new();
    let mut slots: Vec<Slot> = Vec::new();
    let mut per_thread: Vec<Vec<Step>> = Vec::new();
    // Each thread's latest time so far, and each slot's allocation's (`Step::pace_ns`).
    let (mut latest, mut alloc_pace): (Vec<u64>, Vec<u64>) = Default::default();
    for (i, r) in records.iter().enumerate() {
        let n = threads.len();
        let t = *threads.entry(r.thread).or_insert(n);
        if t == MAX_THREADS {
            return Err(Error::invalid(format!(
                "record {i}: thread {} is the log's {}th thread; at most {MAX_THREADS} are replayed \
                 (one native thread each)",
                r.thread,
                MAX_THREADS + 1
            )));
        }
        if t == per_thread.len() {
            per_thread.push(Vec::new());
            latest.push(0);
        }
        let at_ns = r.t_ns.saturating_sub(first);
        latest[t] = latest[t].max(at_ns);
        let n = streams.len();
        let s = *streams.entry(r.stream).or_insert(n);
        let slot = match r.op {
            Op::Allocate => {
                let size = usize::try_from(r.size).map_err(|_| {
                    Error::invalid(format!("record {i}: size {} is too large for this machine", r.size))
                })?;
                let slot = slots.len() as u32;
                if live.insert(r.alloc_id, slot).is_some() {
                    return Err(Error::invalid(format!(
                        "record {i}: allocation id {} is allocated again while still live (double \
                         allocation; an id may be reused only after its free)",
                        r.alloc_id
                    )));
                }
                slots.push(Slot {
                    size,
                    state: AtomicU8::new(PENDING),
                    ptr: AtomicU64::new(0),
                    event: Mutex::new(None),
                    cross: false,
                    alloc_stream: s,
                });
                alloc_pace.push(latest[t]);
                slot
            }
            Op::Free => {
                let Some(slot) = live.remove(&r.alloc_id) else {
                    return Err(Error::invalid(format!(
                        "record {i}: free of allocation id {}, which is not live (never allocated \
                         before this record, or already freed)",
                        r.alloc_id
                    )));
                };
                let sl = &mut slots[slot as usize];
                if r.size != 0 && r.size != sl.size as u64 {
                    return Err(Error::invalid(format!(
                        "record {i}: free of allocation id {} with size {}, but it was allocated with {}",
                        r.alloc_id, r.size, sl.size
                    )));
                }
                sl.cross = sl.alloc_stream != s;
                latest[t] = latest[t].max(alloc_pace[slot as usize]);
                slot
            }
        };
        let free = r.op == Op::Free;
        per_thread[t].push(Step { at_ns, pace_ns: latest[t], slot, stream: s as u32, free, record: i });
    }
    Ok(Plan { slots, threads: per_thread, streams: streams.len() })
}

/// Waits until `deadline`, or until `stop` is set: sleeps while it is far (10 ms at a
/// time, looking at `stop` in between), spins the last 100 µs.
fn wait_until(deadline: Instant, stop: &dyn Fn() -> bool) {
    const SPIN: Duration = Duration::from_micros(100);
    const SLICE: Duration = Duration::from_millis(10);
    loop {
        let now = Instant::now();
        if now >= deadline || stop() {
            return;
        }
        let left = deadline - now;
        if left > SPIN {
            std::thread::sleep((left - SPIN).min(SLICE));
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Sets its flag when dropped while its thread panics: the other threads stop waiting for
/// what the panicking one will never do.
struct AbortOnPanic<'a>(&'a AtomicBool);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// Marks its thread finished in [`Progress`] when dropped (at its end, on an error, or
/// in a panic).
struct Finished<'a>(&'a Progress, usize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.set(self.1, u64::MAX);
    }
}

/// What one thread measured.
#[derive(Default)]
struct ThreadResult {
    allocs: Vec<u64>,
    frees: Vec<u64>,
    /// `(tick, bytes)`: when an allocation returned (`+size`) or a free was called
    /// (`-size`), for the peak of live bytes.
    live: Vec<(u64, i64)>,
    ooms: u64,
}

/// The most bytes live at once in the threads' `live` notes merged in time; at the same
/// tick a free counts first (its memory could be the allocation's).
fn peak_live(mut notes: Vec<(u64, i64)>) -> u64 {
    notes.sort_unstable();
    let (mut live, mut peak) = (0i128, 0i128);
    for (_, bytes) in notes {
        live += i128::from(bytes);
        peak = peak.max(live);
    }
    peak.min(i128::from(u64::MAX)) as u64
}

/// `size` as a signed note (no allocation reaches `i64::MAX` bytes).
fn signed(size: usize) -> i64 {
    i64::try_from(size).unwrap_or(i64::MAX)
}

/// Replays `records` (see the module docs) on `mr`. Bad records are refused before
/// anything runs, naming the record; an error from the resource other than out-of-memory
/// stops the replay (every thread) and is returned, naming the record; a panic in a
/// replaying thread (a resource's) stops the others and is resumed here.
pub fn replay(mr: &dyn MemoryResource, records: &[Record], options: ReplayOptions) -> Result<ReplayReport> {
    replay_until(mr, records, options, &AtomicBool::new(false))
}

/// [`replay`], stopped early when `stop` is set (by another thread: Ctrl-C, say): every
/// thread stops at its next record or within 10 ms of a wait, what is live is freed, and
/// an error says that the replay was stopped.
pub fn replay_until(
    mr: &dyn MemoryResource,
    records: &[Record],
    options: ReplayOptions,
    stop: &AtomicBool,
) -> Result<ReplayReport> {
    if !(options.gap_scale >= 0.0 && options.gap_scale.is_finite()) {
        return Err(Error::invalid(format!(
            "gap_scale must be a finite number >= 0 (0: as fast as possible), got {}",
            options.gap_scale
        )));
    }
    let plan = plan(records)?;
    // Times count from the earliest record (`plan`): the last step's is the log's span.
    let span_ns = plan.threads.iter().flatten().map(|s| s.at_ns).max().unwrap_or(0);
    let span_s = span_ns as f64 * options.gap_scale * 1e-9;
    if span_s > crate::adaptors::MAX_LOG_TIME_S {
        return Err(Error::invalid(format!(
            "the replay would take {span_s:.3e} s ({span_ns} ns of log times scaled by gap_scale {}); at \
             most {} s",
            options.gap_scale,
            crate::adaptors::MAX_LOG_TIME_S
        )));
    }
    // Each thread starts at its first event's time: none waits for a thread not yet started.
    let progress = Progress(
        plan.threads
            .iter()
            .map(|steps| PaddedTime(AtomicU64::new(steps.first().map_or(u64::MAX, |s| s.pace_ns))))
            .collect(),
    );
    let lead = options.max_lead_ns;
    let (backend, device) = (mr.backend().clone(), mr.device());
    let streams: Vec<Stream> =
        (0..plan.streams).map(|_| Stream::create(&backend, device, false)).collect::<Result<_>>()?;
    let abort = AtomicBool::new(false);
    let stopped = || abort.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed);
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let fail = |e: Error, record: usize| {
        let mut f = failure.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            *f = Some(at_record(e, record));
        }
        abort.store(true, Ordering::Release);
    };
    let baseline = FootprintBaseline::start(mr);
    clock::ns_per_tick(); // calibrated before the run, not in it
    let scale = options.gap_scale;
    // Every thread counts from the same origin, a little ahead so all have started.
    let t0 = Instant::now() + Duration::from_millis(1);
    let joined: Vec<std::thread::Result<ThreadResult>> = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(plan.threads.len());
        for (t, steps) in plan.threads.iter().enumerate() {
            let (plan, streams, abort, fail, backend, stopped, progress) =
                (&plan, &streams, &abort, &fail, &backend, &stopped, &progress);
            let spawned =
                std::thread::Builder::new().name(format!("replay-{t}")).spawn_scoped(scope, move || {
                    let _guard = AbortOnPanic(abort);
                    // Whatever ends this thread, the others no longer wait for it.
                    let _done = Finished(progress, t);
                    let mut out = ThreadResult::default();
                    // This thread's recorded time (`Step::pace_ns`) and how far it may go
                    // before it looks at the others again.
                    let (mut at, mut allowed) = (0u64, 0u64);
                    let frees = steps.iter().filter(|s| s.free).count();
                    out.allocs.reserve_exact(steps.len() - frees);
                    out.frees.reserve_exact(frees);
                    out.live.reserve_exact(steps.len());
                    wait_until(t0, stopped);
                    for step in steps {
                        if stopped() {
                            break;
                        }
                        if let Some(lead) = lead {
                            if step.pace_ns != at {
                                // Written only when it moves: another thread may be
                                // reading it in a loop.
                                at = step.pace_ns;
                                progress.set(t, at);
                            }
                            if at > allowed {
                                allowed = progress.wait_for_others(t, at, lead, stopped);
                            }
                        }
                        if scale > 0.0 {
                            wait_until(
                                t0 + Duration::from_nanos((step.at_ns as f64 * scale) as u64),
                                stopped,
                            );
                            if stopped() {
                                break;
                            }
                        }
                        let slot = &plan.slots[step.slot as usize];
                        let stream = &streams[step.stream as usize];
                        let r = if step.free {
                            free(mr, slot, stream, stopped, &mut out)
                        } else {
                            allocate(mr, backend, slot, stream, &mut out)
                        };
                        if let Err(e) = r {
                            fail(e, step.record);
                            break;
                        }
                    }
                    out
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // The threads started stop (those waiting for this one's allocations too).
                    let e = Error::invalid(format!(
                        "cannot start replay thread {t} of {}: {e}",
                        plan.threads.len()
                    ));
                    let mut f = failure.lock().unwrap_or_else(|p| p.into_inner());
                    f.get_or_insert(e);
                    abort.store(true, Ordering::Release);
                    break;
                }
            }
        }
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut results = Vec::with_capacity(joined.len());
    let mut panicked = None;
    for r in joined {
        match r {
            Ok(r) => results.push(r),
            Err(payload) => panicked = panicked.or(Some(payload)),
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    // Untimed: free what the log left live (and what an aborted run left).
    for slot in &plan.slots {
        if slot.state.load(Ordering::Acquire) == LIVE {
            let _ = mr.deallocate(slot.ptr.load(Ordering::Relaxed), slot.size, &streams[slot.alloc_stream]);
            slot.state.store(FREED, Ordering::Relaxed);
        }
    }
    if let Some(payload) = panicked {
        std::panic::resume_unwind(payload);
    }
    if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if stop.load(Ordering::Relaxed) {
        return Err(Error::invalid("the replay was stopped before its end"));
    }
    let super::RunFootprint { peak_reserved_bytes, synchronizations, waits, .. } = baseline.finish(mr);
    let (mut allocs, mut frees, mut notes, mut ooms) = (Vec::new(), Vec::new(), Vec::new(), 0);
    for r in results {
        allocs.extend(r.allocs);
        frees.extend(r.frees);
        notes.extend(r.live);
        ooms += r.ooms;
    }
    let (allocate, free) = (Percentiles::of_ticks(allocs), Percentiles::of_ticks(frees));
    Ok(ReplayReport {
        events: records.len() as u64,
        threads: plan.threads.len(),
        streams: plan.streams,
        seconds,
        alloc_seconds: (allocate.total + free.total) as f64 * 1e-9,
        allocate,
        free,
        peak_live_bytes: peak_live(notes),
        peak_reserved_bytes,
        oom_events: ooms,
        synchronizations,
        waits,
    })
}

/// `e` with the record that caused it named (in the message, or a driver error's context).
fn at_record(e: Error, record: usize) -> Error {
    let named = |m: String| format!("record {record}: {m}");
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(named(m)),
        Error::InvalidPointer(m) => Error::InvalidPointer(named(m)),
        Error::InvalidStream(m) => Error::InvalidStream(named(m)),
        Error::Unsupported(m) => Error::Unsupported(named(m)),
        e => e.context(format!("replaying record {record}")),
    }
}

fn allocate(
    mr: &dyn MemoryResource,
    backend: &crate::device::BackendRef,
    slot: &Slot,
    stream: &Stream,
    out: &mut ThreadResult,
) -> Result<()> {
    let start = clock::now();
    let r = mr.allocate(slot.size, stream);
    let took = ticks_since(start);
    match r {
        Ok(ptr) => {
            out.allocs.push(took);
            out.live.push((start.wrapping_add(took), signed(slot.size)));
            slot.ptr.store(ptr, Ordering::Relaxed);
            if slot.cross {
                let event = Event::new(backend, mr.device())?;
                event.record(stream)?;
                *slot.event.lock().unwrap_or_else(|p| p.into_inner()) = Some(event);
            }
            slot.state.store(LIVE, Ordering::Release);
            Ok(())
        }
        Err(e) if e.is_out_of_memory() => {
            out.ooms += 1;
            slot.state.store(OOM, Ordering::Release);
            Ok(())
        }
        Err(e) => {
            // Whoever waits for this allocation must not wait forever.
            slot.state.store(FAILED, Ordering::Release);
            Err(e)
        }
    }
}

fn free(
    mr: &dyn MemoryResource,
    slot: &Slot,
    stream: &Stream,
    stopped: &dyn Fn() -> bool,
    out: &mut ThreadResult,
) -> Result<()> {
    // Another thread's allocation: wait until it exists (or failed). This thread's time
    // (`Step::pace_ns`) is not before the allocation's, so it holds back no thread that
    // has yet to make it.
    let state = loop {
        match slot.state.load(Ordering::Acquire) {
            PENDING if !stopped() => std::thread::yield_now(),
            s => break s,
        }
    };
    if state != LIVE {
        return Ok(());
    }
    if slot.cross {
        // Taken: the event is destroyed once the wait is enqueued (as the driver allows),
        // not kept to the end of the run.
        let event = slot.event.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(event) = event {
            stream.wait(&event)?;
        }
    }
    let ptr: DevPtr = slot.ptr.load(Ordering::Relaxed);
    let start = clock::now();
    let r = mr.deallocate(ptr, slot.size, stream);
    let took = ticks_since(start);
    r?;
    out.frees.push(took);
    out.live.push((start, -signed(slot.size)));
    slot.state.store(FREED, Ordering::Relaxed);
    Ok(())
}
