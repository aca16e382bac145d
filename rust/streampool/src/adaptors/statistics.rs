//! Current, peak and total bytes and counts, with a stack of counters.

use std::fmt;

use super::{as_own_oom, try_counted_deallocate, try_upstream_allocate, upstream_properties};
use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::resource::{check_depth, MemoryResource, ResourceRef};
use crate::stream::Stream;
use crate::sync::{read, write, AtomicI64, Ordering, RwLock};

/// What a [`StatisticsAdaptor`] counted (RMM's `statistics_resource_adaptor` counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Statistics {
    /// Bytes allocated and not yet freed.
    pub current_bytes: usize,
    /// Allocations not yet freed.
    pub current_count: usize,
    /// The highest `current_bytes` seen.
    pub peak_bytes: usize,
    /// The highest `current_count` seen.
    pub peak_count: usize,
    /// Bytes ever allocated.
    pub total_bytes: usize,
    /// Allocations ever made.
    pub total_count: usize,
}

/// Counts what passes through it (RMM's `statistics_resource_adaptor`).
///
/// Invariant: after every completed call, the top counters' `current` is the sum of the
/// sizes allocated minus those freed while they were on top, `total` the sum of the
/// sizes allocated, and `peak` at least every value `current` took.
///
/// The counters form a stack: [`push_counters`](Self::push_counters) starts a fresh set
/// (a profiling scope) and [`pop_counters`](Self::pop_counters) merges it into the one
/// below, as RMM does. An allocation and a free are counted on the counters that are on
/// top *at that moment*, so a scope that frees memory allocated before it began sees its
/// `current` fall below zero; [`statistics`](Self::statistics) reports such a value as 0
/// (the fields are unsigned), and the merge at the pop still adds it correctly.
///
/// Sizes: the adaptor keeps no record per allocation, so it cannot check that a free
/// passes the size allocated. It refuses, with [`Error::InvalidPointer`] and without
/// calling the upstream (so nothing changes, and the caller may free again with the right
/// size), a free that is certainly wrong: of more bytes than are in use through it, all
/// scopes together, or when nothing is. Any other wrong size reaches the upstream, which
/// refuses it where it can (a pool, the tracking adaptor), and is counted as given: over
/// a resource that takes any size (the driver's pool), put a [`TrackingAdaptor`](super::TrackingAdaptor)
/// beneath this one to have wrong sizes refused before they are counted. (Two
/// wrong frees racing on two threads may both pass the check; the counters are signed and
/// read as 0 below zero, so they never wrap.)
///
/// What a reader of the numbers may miss: allocations and frees in flight on other
/// threads (counted only once their upstream call has returned). The six numbers are one
/// moment's: [`statistics`](Self::statistics) takes the stack's lock exclusively, which
/// waits for the updates in flight and holds off new ones while it reads (RMM's adaptor
/// locks every call instead).
///
/// Hot path: one shared (read) lock of the stack and a few atomic adds; the exclusive
/// lock is taken only to read the numbers, push and pop.
///
/// ```
/// use std::sync::Arc;
/// use streampool::device::sim::SimDevice;
/// use streampool::{CudaAsyncMemoryResource, MemoryResource, StatisticsAdaptor, Stream};
///
/// let sim = SimDevice::new(1 << 30);
/// let mr = StatisticsAdaptor::new(Arc::new(CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?))?;
/// let s = Stream::legacy();
/// let p = mr.allocate(1000, &s)?;
/// mr.push_counters();
/// let q = mr.allocate(24, &s)?;
/// assert_eq!(mr.statistics().current_bytes, 24);
/// let inner = mr.pop_counters()?;
/// assert_eq!(inner.total_count, 1);
/// assert_eq!(mr.statistics().current_bytes, 1024);
/// mr.deallocate(q, 24, &s)?;
/// mr.deallocate(p, 1000, &s)?;
/// assert_eq!(mr.statistics().peak_bytes, 1024);
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct StatisticsAdaptor {
    upstream: ResourceRef,
    /// Never empty: the base counters are at index 0.
    stack: RwLock<Vec<Counters>>,
}

impl StatisticsAdaptor {
    /// Counts the allocations made through it from `upstream`; an error when the chain
    /// would be deeper than [`MAX_DEPTH`](crate::resource::MAX_DEPTH).
    pub fn new(upstream: ResourceRef) -> Result<Self> {
        check_depth("StatisticsResourceAdaptor", [&upstream])?;
        Ok(StatisticsAdaptor { upstream, stack: RwLock::new(vec![Counters::default()]) })
    }

    /// The counters on top of the stack, as one moment has them (see the type's docs).
    pub fn statistics(&self) -> Statistics {
        write(&self.stack).last().expect("the base counters are never popped").snapshot()
    }

    /// Pushes a fresh set of counters and returns the previous top.
    pub fn push_counters(&self) -> Statistics {
        let mut stack = write(&self.stack);
        let previous = stack.last().expect("never empty").snapshot();
        stack.push(Counters::default());
        previous
    }

    /// Pops the top counters, merges them into the new top and returns them; an error
    /// when only the base counters remain.
    pub fn pop_counters(&self) -> Result<Statistics> {
        let mut stack = write(&self.stack);
        if stack.len() < 2 {
            return Err(Error::invalid(
                "pop_counters: only the base counters remain (every pop needs an earlier push)",
            ));
        }
        let child = stack.pop().expect("checked");
        stack.last().expect("checked").merge(&child);
        Ok(child.snapshot())
    }

    /// The resource this adaptor allocates from.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }
}

impl MemoryResource for StatisticsAdaptor {
    upstream_properties!("StatisticsResourceAdaptor", passes_through);

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let ptr = self.upstream.allocate(bytes, stream).map_err(|e| as_own_oom(e, bytes, self))?;
        read(&self.stack).last().expect("never empty").record(bytes as i64);
        Ok(ptr)
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.check_free(ptr, bytes)?;
        self.upstream.deallocate(ptr, bytes, stream)?;
        self.unrecord(bytes);
        Ok(())
    }

    // Forwarded: the counters are atomics under the stack's shared lock, which only
    // `push_counters`/`pop_counters` take exclusively, for a moment and without calling
    // out, so waiting for it with the GIL held is short and cannot deadlock.
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        let ptr = match try_upstream_allocate(self, &self.upstream, bytes, stream)? {
            Ok(0) => return Some(Ok(0)),
            Ok(ptr) => ptr,
            Err(e) => return Some(Err(e)),
        };
        read(&self.stack).last().expect("never empty").record(bytes as i64);
        Some(Ok(ptr))
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        let check = || self.check_free(ptr, bytes);
        try_counted_deallocate(self, &self.upstream, (ptr, bytes, stream), check, || self.unrecord(bytes))
    }
}

impl StatisticsAdaptor {
    /// Refuses a free that is certainly wrong: of more bytes than are in use through this
    /// adaptor (all scopes together), or with no allocation outstanding. The upstream is
    /// not called (see the type's docs).
    fn check_free(&self, ptr: DevPtr, bytes: usize) -> Result<()> {
        let (in_use, count) = read(&self.stack)
            .iter()
            .fold((0i64, 0i64), |(b, c), k| (b + k.bytes.value(), c + k.count.value()));
        if count >= 1 && i64::try_from(bytes).is_ok_and(|b| b <= in_use) {
            return Ok(());
        }
        Err(Error::InvalidPointer(format!(
            "{ptr:#x} freed with {bytes} bytes, but {} bytes in {} allocation(s) are in use through this \
             StatisticsResourceAdaptor: the size is not the one allocated, or the pointer was not allocated here",
            in_use.max(0),
            count.max(0)
        )))
    }

    fn unrecord(&self, bytes: usize) {
        read(&self.stack).last().expect("never empty").unrecord(bytes as i64);
    }
}

impl fmt::Debug for StatisticsAdaptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatisticsAdaptor")
            .field("statistics", &self.statistics())
            .field("depth", &read(&self.stack).len())
            .field("upstream", &self.upstream)
            .finish()
    }
}

/// One set of counters: bytes and allocations.
#[derive(Default)]
pub(crate) struct Counters {
    bytes: Counter,
    count: Counter,
}

impl Counters {
    pub(crate) fn record(&self, bytes: i64) {
        self.bytes.add(bytes);
        self.count.add(1);
    }

    pub(crate) fn unrecord(&self, bytes: i64) {
        self.bytes.sub(bytes);
        self.count.sub(1);
    }

    fn merge(&self, child: &Counters) {
        self.bytes.merge(&child.bytes);
        self.count.merge(&child.count);
    }

    pub(crate) fn snapshot(&self) -> Statistics {
        let (current_bytes, peak_bytes, total_bytes) = self.bytes.snapshot();
        let (current_count, peak_count, total_count) = self.count.snapshot();
        Statistics { current_bytes, current_count, peak_bytes, peak_count, total_bytes, total_count }
    }
}

/// RMM's `counter`: value, peak and total. Signed, because a scope may free what an
/// outer scope allocated.
#[derive(Default)]
struct Counter {
    value: AtomicI64,
    peak: AtomicI64,
    total: AtomicI64,
}

impl Counter {
    fn add(&self, n: i64) {
        // Relaxed suffices: each number is its own sum, and no other memory is published
        // through them. The peak is raised to the value this add produced, so it is at
        // least every value `current` took (a concurrent higher value raises it itself).
        let now = self.value.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(now, Ordering::Relaxed);
        self.total.fetch_add(n, Ordering::Relaxed);
    }

    fn sub(&self, n: i64) {
        self.value.fetch_sub(n, Ordering::Relaxed);
    }

    fn value(&self) -> i64 {
        self.value.load(Ordering::Relaxed)
    }

    /// RMM's `counter::operator+=`; called under the exclusive lock, so nothing else
    /// touches either counter meanwhile.
    fn merge(&self, child: &Counter) {
        let value = self.value.load(Ordering::Relaxed);
        let child_peak = child.peak.load(Ordering::Relaxed);
        self.peak.fetch_max(value + child_peak, Ordering::Relaxed);
        self.value.fetch_add(child.value.load(Ordering::Relaxed), Ordering::Relaxed);
        self.total.fetch_add(child.total.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// (current, peak, total), current clamped at 0 and peak at least current.
    fn snapshot(&self) -> (usize, usize, usize) {
        let clamp = |v: i64| usize::try_from(v).unwrap_or(0);
        let value = clamp(self.value.load(Ordering::Relaxed));
        let peak = clamp(self.peak.load(Ordering::Relaxed)).max(value);
        (value, peak, clamp(self.total.load(Ordering::Relaxed)))
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::{Counter, Counters};
    use crate::sync::{read, write, Arc, Ordering, RwLock};

    /// Two threads each allocate and free while the main thread allocates and keeps it.
    /// Whatever the interleaving: current never negative (a thread sees at least its own
    /// allocation), totals exact, peak between the final current and the sum of all
    /// allocations.
    #[test]
    fn loom_counter_add_and_sub() {
        crate::sync::model(|| {
            let c = Arc::new(Counter::default());
            let threads: Vec<_> = [100, 10]
                .into_iter()
                .map(|n| {
                    let c = c.clone();
                    loom::thread::spawn(move || {
                        c.add(n);
                        assert!(c.value.load(Ordering::Relaxed) >= n);
                        c.sub(n);
                    })
                })
                .collect();
            c.add(1);
            for t in threads {
                t.join().unwrap();
            }
            let (current, peak, total) = c.snapshot();
            assert_eq!((current, total), (1, 111));
            assert!((1..=111).contains(&peak), "peak {peak}");
        });
    }

    /// A pop merges while another thread records on the top of the stack: the allocation
    /// is counted exactly once in the base, on whichever counters it landed.
    #[test]
    fn loom_pop_under_concurrent_allocation() {
        crate::sync::model(|| {
            let stack = Arc::new(RwLock::new(vec![Counters::default(), Counters::default()]));
            let s2 = stack.clone();
            let t = loom::thread::spawn(move || read(&s2).last().unwrap().record(5));
            {
                let mut st = write(&stack);
                let child = st.pop().unwrap();
                st.last().unwrap().merge(&child);
            }
            t.join().unwrap();
            let base = read(&stack)[0].snapshot();
            assert_eq!(
                (base.current_bytes, base.total_bytes, base.peak_bytes, base.total_count),
                (5, 5, 5, 1)
            );
        });
    }

    /// A snapshot under the exclusive lock (as `statistics()` takes it) while two threads
    /// allocate and free under the shared one (as the hot path does): bytes and counts
    /// agree, and totals are at least the current numbers.
    #[test]
    fn loom_snapshot_is_one_moment() {
        crate::sync::model(|| {
            let stack = Arc::new(RwLock::new(vec![Counters::default()]));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let s = stack.clone();
                    loom::thread::spawn(move || {
                        read(&s).last().unwrap().record(256);
                        read(&s).last().unwrap().unrecord(256);
                    })
                })
                .collect();
            let st = write(&stack).last().unwrap().snapshot();
            assert_eq!(st.current_bytes, 256 * st.current_count, "{st:?}");
            assert_eq!(st.total_bytes, 256 * st.total_count, "{st:?}");
            assert!(st.total_count >= st.current_count, "{st:?}");
            for t in threads {
                t.join().unwrap();
            }
        });
    }
}
