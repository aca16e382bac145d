//! Per-call latency histograms of allocate and deallocate, cheap enough to leave on.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use super::{try_upstream_allocate, upstream_properties};
use crate::clock;
use crate::device::DevPtr;
use crate::error::Result;
use crate::nvtx;
use crate::resource::{check_depth, MemoryResource, ResourceRef};
use crate::stream::Stream;
use crate::sync::{lock, AtomicU64, Mutex, Ordering};

/// Buckets of a histogram: 4 per power of two of the clock's ticks, up to 2^64.
pub const BUCKETS: usize = 252;

/// The bucket of a duration of `t` ticks: exact below 4, then 4 per power of two (each
/// bucket at most 25 % wide).
#[inline]
fn bucket(t: u64) -> usize {
    if t < 4 {
        return t as usize;
    }
    let e = 63 - t.leading_zeros() as usize; // >= 2
    let sub = ((t >> (e - 2)) & 3) as usize;
    4 * (e - 1) + sub
}

/// The first tick count past bucket `i` (its exclusive upper bound).
fn bucket_end(i: usize) -> u128 {
    if i < 4 {
        return i as u128 + 1;
    }
    let (e, sub) = (i / 4 + 1, (i % 4) as u128);
    (5 + sub) << (e - 2)
}

/// One histogram's counters.
struct Counters {
    buckets: Box<[AtomicU64]>,
    ticks: AtomicU64,
    max: AtomicU64,
}

impl Counters {
    fn new() -> Self {
        Counters {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            ticks: AtomicU64::new(0),
            max: AtomicU64::new(0),
        }
    }

    #[inline]
    fn record(&self, t: u64) {
        self.buckets[bucket(t)].fetch_add(1, Ordering::Relaxed);
        self.ticks.fetch_add(t, Ordering::Relaxed);
        // A new maximum is rare once calls have been seen: read first, and pay for the
        // read-modify-write only then.
        if t > self.max.load(Ordering::Relaxed) {
            self.max.fetch_max(t, Ordering::Relaxed);
        }
    }

    /// [`Self::record`] by the one thread that writes these counters: plain loads and
    /// stores, no read-modify-write (readers see each counter whole, relaxed).
    #[inline]
    fn record_exclusive(&self, t: u64) {
        let add =
            |a: &AtomicU64, n: u64| a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
        add(&self.buckets[bucket(t)], 1);
        add(&self.ticks, t);
        if t > self.max.load(Ordering::Relaxed) {
            self.max.store(t, Ordering::Relaxed);
        }
    }

    /// Adds `other`'s counts to these (which any thread may write: read-modify-writes).
    fn absorb(&self, other: &Counters) {
        for (mine, theirs) in self.buckets.iter().zip(other.buckets.iter()) {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.ticks.fetch_add(other.ticks.load(Ordering::Relaxed), Ordering::Relaxed);
        self.max.fetch_max(other.max.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn clear(&self) {
        self.buckets.iter().for_each(|b| b.store(0, Ordering::Relaxed));
        self.ticks.store(0, Ordering::Relaxed);
        self.max.store(0, Ordering::Relaxed);
    }
}

/// The counters of one thread's calls through one adaptor (or the adaptor's shared set).
struct CallCounters {
    allocate: Counters,
    deallocate: Counters,
    /// The adaptor's reset epoch these counters belong to (written by the owner only).
    epoch: AtomicU64,
}

impl CallCounters {
    fn new() -> Self {
        CallCounters { allocate: Counters::new(), deallocate: Counters::new(), epoch: AtomicU64::new(0) }
    }

    fn pick(&self, deallocate: bool) -> &Counters {
        if deallocate {
            &self.deallocate
        } else {
            &self.allocate
        }
    }
}

/// Ids of adaptors, for the threads' lists of their counter sets. (A plain std atomic:
/// it hands out numbers and guards no data.)
static NEXT_ADAPTOR: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

thread_local! {
    /// This thread's counter sets, by adaptor id.
    static MINE: RefCell<Vec<(u64, Arc<CallCounters>)>> = const { RefCell::new(Vec::new()) };
}

/// The latencies of one kind of call, as [`LatencyHistogramAdaptor::histogram`] reports
/// them (nanoseconds).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Non-empty buckets: (upper bound in ns, exclusive; calls).
    pub buckets: Vec<(f64, u64)>,
    /// Calls.
    pub count: u64,
    /// Sum of their latencies, in ns.
    pub total_ns: f64,
    /// The slowest, in ns (exact).
    pub max_ns: f64,
    /// Median, 90th, 99th and 99.9th percentiles: the upper bound of the bucket holding
    /// that rank (so at most 25 % above the true value), capped at `max_ns`.
    pub p50_ns: f64,
    /// See `p50_ns`.
    pub p90_ns: f64,
    /// See `p50_ns`.
    pub p99_ns: f64,
    /// See `p50_ns`.
    pub p999_ns: f64,
}

/// Both histograms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencyHistograms {
    /// Allocate calls (failed ones included).
    pub allocate: Histogram,
    /// Deallocate calls (refused ones included).
    pub deallocate: Histogram,
}

/// Records how long each allocate and deallocate call takes, in histograms of
/// log-spaced buckets (4 per power of two), lock-free: each thread writes counters of its
/// own (made at its first call through the adaptor, the only time a lock is taken), with
/// plain loads and stores. With `STREAMPOOL_NVTX=1` each call is also one NVTX
/// range (see [`crate::nvtx`]); the fast path is then not taken, so from Python each call
/// releases the GIL.
///
/// What it measures: the time inside the upstream's call, read from the time-stamp
/// counter on x86-64 (calibrated against the system clock once), so the adaptor adds two
/// counter reads, a thread-local look-up, a read of the reset count and three counter
/// updates to a call, no atomic read-modify-write (a few nanoseconds; the window bench's
/// `latency-sharded` measures it beside the bare pool). The fast path (with the GIL held, from Python)
/// is forwarded and timed like the full one; a request the fast path passes on is timed
/// on the full path only. What a reader may miss: calls in flight; and the histogram is
/// read counter by counter while others add to it.
///
/// ```
/// use std::sync::Arc;
/// use streampool::adaptors::LatencyHistogramAdaptor;
/// use streampool::device::sim::SimDevice;
/// use streampool::{CudaAsyncMemoryResource, MemoryResource, Stream};
///
/// let sim = SimDevice::new(1 << 30);
/// let mr = LatencyHistogramAdaptor::new(Arc::new(CudaAsyncMemoryResource::on(sim, 0, Default::default())?))?;
/// let p = mr.allocate(1 << 20, &Stream::legacy())?;
/// mr.deallocate(p, 1 << 20, &Stream::legacy())?;
/// let h = mr.histogram();
/// assert_eq!((h.allocate.count, h.deallocate.count), (1, 1));
/// assert!(h.allocate.p50_ns <= h.allocate.max_ns);
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct LatencyHistogramAdaptor {
    upstream: ResourceRef,
    id: u64,
    /// Every thread's counter set (each written by its thread only).
    threads: Mutex<Vec<Arc<CallCounters>>>,
    /// For calls on a thread whose thread-locals are gone (calls from their destructors):
    /// read-modify-writes, as any thread may write it.
    shared: CallCounters,
    ns_per_tick: f64,
    /// Resets so far. A thread's set counts calls since the reset its `epoch` names: its
    /// owner clears it at its first call after a reset (no other thread writes it, so no
    /// reset can land between an owner's load and store), and a reader skips it until then.
    epoch: AtomicU64,
}

impl LatencyHistogramAdaptor {
    /// Times the calls made through it to `upstream`; an error when the chain would be
    /// deeper than [`MAX_DEPTH`](crate::resource::MAX_DEPTH).
    pub fn new(upstream: ResourceRef) -> Result<Self> {
        check_depth("LatencyHistogramAdaptor", [&upstream])?;
        Ok(LatencyHistogramAdaptor {
            upstream,
            id: NEXT_ADAPTOR.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            threads: Mutex::new(Vec::new()),
            shared: CallCounters::new(),
            ns_per_tick: clock::ns_per_tick(),
            epoch: AtomicU64::new(0),
        })
    }

    /// The resource this adaptor allocates from.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }

    /// The histograms so far.
    pub fn histogram(&self) -> LatencyHistograms {
        LatencyHistograms { allocate: self.summarise(false), deallocate: self.summarise(true) }
    }

    /// Forgets every call recorded so far (a call recorded at the same moment on another
    /// thread may be forgotten too).
    pub fn reset(&self) {
        let _threads = lock(&self.threads);
        // Thread sets are never written here: their owners clear them at their next call.
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.shared.allocate.clear();
        self.shared.deallocate.clear();
    }

    fn summarise(&self, deallocate: bool) -> Histogram {
        let mut counts = vec![0u64; BUCKETS];
        let (mut ticks, mut max) = (0u64, 0u64);
        let threads = lock(&self.threads);
        let epoch = self.epoch.load(Ordering::Acquire);
        for s in threads
            .iter()
            .map(|c| &**c)
            .filter(|c| c.epoch.load(Ordering::Acquire) == epoch)
            .chain([&self.shared])
        {
            let c = s.pick(deallocate);
            for (n, b) in counts.iter_mut().zip(c.buckets.iter()) {
                *n += b.load(Ordering::Relaxed);
            }
            ticks = ticks.wrapping_add(c.ticks.load(Ordering::Relaxed));
            max = max.max(c.max.load(Ordering::Relaxed));
        }
        let ns = |t: u128| t as f64 * self.ns_per_tick;
        let count: u64 = counts.iter().sum();
        let max_ns = ns(max as u128);
        let rank = |p: f64| {
            if count == 0 {
                return 0.0;
            }
            let target = ((p * count as f64).ceil() as u64).clamp(1, count);
            let mut seen = 0;
            for (i, &n) in counts.iter().enumerate() {
                seen += n;
                if seen >= target {
                    return ns(bucket_end(i)).min(max_ns);
                }
            }
            max_ns
        };
        Histogram {
            buckets: counts
                .iter()
                .enumerate()
                .filter(|(_, &n)| n > 0)
                .map(|(i, &n)| (ns(bucket_end(i)), n))
                .collect(),
            count,
            total_ns: ns(ticks as u128),
            max_ns,
            p50_ns: rank(0.5),
            p90_ns: rank(0.9),
            p99_ns: rank(0.99),
            p999_ns: rank(0.999),
        }
    }

    /// Records a call in the calling thread's own set `c`, first clearing it if a reset
    /// came since its last call (only the owner writes it: no reset can race a store).
    #[inline]
    fn record_owned(&self, c: &CallCounters, deallocate: bool, t: u64) {
        let e = self.epoch.load(Ordering::Acquire);
        if c.epoch.load(Ordering::Relaxed) != e {
            c.allocate.clear();
            c.deallocate.clear();
            c.epoch.store(e, Ordering::Release);
        }
        c.pick(deallocate).record_exclusive(t);
    }

    /// Records a call of `t` ticks in this thread's set (made at its first call here).
    #[inline]
    fn record(&self, deallocate: bool, t: u64) {
        let mine = MINE.try_with(|m| {
            let Ok(mut sets) = m.try_borrow_mut() else { return false };
            if let Some((_, c)) = sets.iter().find(|(id, _)| *id == self.id) {
                self.record_owned(c, deallocate, t);
                return true;
            }
            // This thread's first call here. Sets whose adaptor is gone (only this list
            // holds them) are dropped now.
            sets.retain(|(_, c)| Arc::strong_count(c) > 1);
            let c = Arc::new(CallCounters::new());
            let mut threads = lock(&self.threads);
            c.epoch.store(self.epoch.load(Ordering::Relaxed), Ordering::Relaxed);
            // Sets of threads that have exited (only the adaptor holds them; nothing writes
            // them any more) are added to the shared set, so that the list holds no more
            // sets than there are threads alive. Readers take the same lock, and see each
            // call counted once.
            threads.retain(|t| {
                let gone = Arc::strong_count(t) == 1;
                // The count is read without ordering: see the exited thread's last writes.
                std::sync::atomic::fence(Ordering::Acquire);
                if gone && t.epoch.load(Ordering::Acquire) == self.epoch.load(Ordering::Relaxed) {
                    self.shared.allocate.absorb(&t.allocate);
                    self.shared.deallocate.absorb(&t.deallocate);
                }
                !gone
            });
            threads.push(c.clone());
            drop(threads);
            c.pick(deallocate).record_exclusive(t);
            sets.push((self.id, c));
            true
        });
        if mine != Ok(true) {
            self.shared.pick(deallocate).record(t);
        }
    }
}

const ALLOCATE: &std::ffi::CStr = c"streampool allocate";
const DEALLOCATE: &std::ffi::CStr = c"streampool deallocate";

impl MemoryResource for LatencyHistogramAdaptor {
    upstream_properties!("LatencyHistogramAdaptor", passes_through);

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let _range = nvtx::Range::new(ALLOCATE);
        let start = clock::now();
        let r = self.upstream.allocate(bytes, stream).map_err(|e| super::as_own_oom(e, bytes, self));
        self.record(false, clock::now().wrapping_sub(start));
        r
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        let _range = nvtx::Range::new(DEALLOCATE);
        let start = clock::now();
        let r = self.upstream.deallocate(ptr, bytes, stream);
        self.record(true, clock::now().wrapping_sub(start));
        r
    }

    // Forwarded: the counters are atomics, never a lock. With NVTX ranges on, every call
    // takes the full path: a range opened here could not be taken back when the upstream
    // passes the request on, and the call would show as two ranges.
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        if nvtx::enabled() {
            return None;
        }
        let start = clock::now();
        let r = try_upstream_allocate(self, &self.upstream, bytes, stream)?;
        self.record(false, clock::now().wrapping_sub(start));
        Some(r)
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        if nvtx::enabled() {
            return None;
        }
        let start = clock::now();
        let r = self.upstream.try_deallocate(ptr, bytes, stream)?;
        self.record(true, clock::now().wrapping_sub(start));
        Some(r)
    }
}

impl fmt::Debug for LatencyHistogramAdaptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = self.histogram();
        f.debug_struct("LatencyHistogramAdaptor")
            .field("allocate_calls", &h.allocate.count)
            .field("deallocate_calls", &h.deallocate.count)
            .field("upstream", &self.upstream)
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn every_thread_counts_in_its_own_set_and_none_is_lost() {
        let sim = crate::device::sim::SimDevice::new(1 << 30);
        let mr = LatencyHistogramAdaptor::new(Arc::new(
            crate::CudaAsyncMemoryResource::on(sim, 0, Default::default()).unwrap(),
        ))
        .unwrap();
        // Eight threads alive at once: eight sets.
        let all_counted = std::sync::Barrier::new(9);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    (0..1000).for_each(|i| mr.record(i % 2 == 0, i));
                    all_counted.wait();
                    all_counted.wait();
                });
            }
            all_counted.wait();
            assert_eq!(lock(&mr.threads).len(), 8);
            all_counted.wait();
        });
        let h = mr.histogram();
        assert_eq!((h.allocate.count, h.deallocate.count), (4000, 4000));
        // Threads come and go: the sets of those gone are folded into the shared set at
        // the next thread's first call, and no count or maximum is lost.
        for round in 0..50u64 {
            std::thread::scope(|s| {
                // Joined, not only ended with the scope: a join returns once the thread's
                // thread-locals (its hold on its set) are gone.
                s.spawn(|| mr.record(false, 1_000_000 + round)).join().unwrap();
            });
        }
        let h = mr.histogram();
        assert_eq!((h.allocate.count, h.deallocate.count), (4050, 4000));
        assert_eq!(h.allocate.max_ns, (1_000_049.0 * mr.ns_per_tick));
        assert!(lock(&mr.threads).len() <= 1, "{}", lock(&mr.threads).len());
        // Another adaptor on a thread that used a dropped one: the stale set goes.
        let id = mr.id;
        drop(mr);
        MINE.with(|m| m.borrow_mut().push((id, Arc::new(CallCounters::new()))));
        let other = LatencyHistogramAdaptor::new(Arc::new(crate::harness::NullMemoryResource::on(
            crate::device::sim::SimDevice::new(1 << 20),
            0,
        )))
        .unwrap();
        other.record(false, 5);
        MINE.with(|m| assert!(m.borrow().iter().all(|(i, _)| *i == other.id)));
    }

    #[test]
    fn buckets_are_monotonic_and_hold_their_values() {
        let mut last = 0;
        for t in (0..10_000u64).chain([1 << 20, (1 << 40) + 12345, u64::MAX]) {
            let b = bucket(t);
            assert!(b >= last, "{t}");
            assert!(b < BUCKETS);
            assert!((t as u128) < bucket_end(b), "{t} in bucket {b} ending at {}", bucket_end(b));
            if b > 0 {
                assert!((t as u128) >= bucket_end(b - 1), "{t}");
            }
            last = b;
        }
    }
}

/// Models of `reset` racing a thread's call: the owner's plain load-then-store of its own
/// counters must not bring back what the reset forgot.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    fn adaptor_with_one_thread_set() -> (Arc<LatencyHistogramAdaptor>, Arc<CallCounters>) {
        let mr = LatencyHistogramAdaptor::new(std::sync::Arc::new(crate::harness::NullMemoryResource::on(
            crate::device::sim::SimDevice::new(1 << 20),
            0,
        )))
        .unwrap();
        // The owner thread's set, registered as `record` registers it at a first call
        // (std thread-locals are not per loom thread, so the set is handed over directly).
        let c = Arc::new(CallCounters::new());
        lock(&mr.threads).push(c.clone());
        (Arc::new(mr), c)
    }

    /// The owner thread has made calls (one slow, then 100 fast); it makes one more while
    /// another thread resets. `reset` "forgets every call recorded so far (a call recorded
    /// at the same moment on another thread may be forgotten too)": afterwards at most that
    /// one call is counted, with no earlier time in the sum, and the slowest call counted
    /// is the histogram's maximum (the owner's plain load-then-store of its own counters,
    /// raced by a reset that cleared them, brought back the whole bucket and sum, with the
    /// maximum cleared).
    #[test]
    fn loom_a_reset_racing_a_call_forgets_every_earlier_call() {
        crate::sync::model(|| {
            let (mr, c) = adaptor_with_one_thread_set();
            mr.record_owned(&c, false, 1000);
            for _ in 0..100 {
                mr.record_owned(&c, false, 7);
            }
            let owner = {
                let (c, mr) = (c.clone(), mr.clone());
                loom::thread::spawn(move || mr.record_owned(&c, false, 7))
            };
            mr.reset();
            owner.join().unwrap();
            let h = mr.histogram().allocate;
            let one_call = 7.0 * mr.ns_per_tick;
            assert!(h.count <= 1, "after reset: {} calls counted (1 made since)", h.count);
            assert!(
                h.total_ns <= one_call * 1.0001,
                "after reset: {} calls' worth of time",
                h.total_ns / one_call
            );
            assert!(h.count == 0 || h.max_ns > 0.0, "count {} with a max of {}", h.count, h.max_ns);
        });
    }
}
