//! A byte cap.

use std::fmt;

use super::{as_own_oom, try_counted_deallocate, try_upstream_allocate, upstream_properties};
use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::resource::{check_depth, MemoryResource, ResourceRef, ALIGNMENT};
use crate::stream::Stream;
use crate::sync::{AtomicUsize, Ordering};

/// Refuses allocations that would take the bytes it has handed out above a limit (RMM's
/// `limiting_resource_adaptor`).
///
/// Invariant: the bytes allocated through it and not yet freed, each allocation counted
/// rounded up to a multiple of [`ALIGNMENT`] (256 bytes, as RMM counts them: what the
/// upstream hands out at least), never exceed the limit, at any moment and under any
/// number of threads. An allocation first reserves its bytes (a compare-and-swap that
/// fails rather than overshoot), then allocates upstream, and gives the reservation back
/// if the upstream fails; a free gives it back after the upstream free.
///
/// A refusal is [`Error::OutOfMemory`] with `available` = the limit less the bytes in
/// use, and `resource` naming the limit and the bytes in use, e.g.
/// `LimitingResourceAdaptor (limit 1048576 bytes, 524288 in use)`. An out-of-memory of
/// the upstream below the limit is reported with `resource` = `LimitingResourceAdaptor`.
///
/// Sizes: the adaptor keeps no record per allocation, so it cannot check that a free
/// passes the size allocated. A free of more bytes than are allocated through it is
/// certainly wrong: it is refused with [`Error::InvalidPointer`] and the upstream is not
/// called, so nothing changes (the memory stays allocated, and the caller may free it
/// again with the right size; forwarding a size known to be wrong could corrupt an
/// upstream that routes or rounds by size). Any other wrong size reaches the upstream,
/// which refuses it where it can, and the count moves by the size given; it never goes
/// below 0. Over a resource that takes any size (the driver's pool), put a
/// [`TrackingAdaptor`](super::TrackingAdaptor) beneath this one to have wrong sizes
/// refused before they are counted.
///
/// What a reader of [`allocated_bytes`](Self::allocated_bytes) may miss: it counts
/// reservations of allocations still in flight (and of ones about to fail upstream), and
/// frees whose upstream call has not returned yet are still counted.
///
/// ```
/// use std::sync::Arc;
/// use streampool::device::sim::SimDevice;
/// use streampool::{CudaAsyncMemoryResource, Error, LimitingAdaptor, MemoryResource, Stream};
///
/// let sim = SimDevice::new(1 << 30);
/// let upstream = Arc::new(CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?);
/// let mr = LimitingAdaptor::new(upstream, 1 << 20)?;
/// let s = Stream::legacy();
/// let p = mr.allocate(768 << 10, &s)?;
/// let err = mr.allocate(512 << 10, &s).unwrap_err();
/// assert!(matches!(err, Error::OutOfMemory { available: Some(262144), .. }), "{err}");
/// mr.deallocate(p, 768 << 10, &s)?;
/// assert_eq!(mr.allocated_bytes(), 0);
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct LimitingAdaptor {
    upstream: ResourceRef,
    budget: Budget,
}

impl LimitingAdaptor {
    /// Caps the bytes allocated through it from `upstream` at `limit`; a limit of 0 is an
    /// error (nothing could ever be allocated).
    pub fn new(upstream: ResourceRef, limit: usize) -> Result<Self> {
        if limit == 0 {
            return Err(Error::invalid(
                "LimitingResourceAdaptor: allocation_limit must be above 0 bytes (0 would refuse every allocation)",
            ));
        }
        check_depth("LimitingResourceAdaptor", [&upstream])?;
        Ok(LimitingAdaptor { upstream, budget: Budget::new(limit) })
    }

    /// Bytes allocated through it and not yet freed (with reservations in flight).
    pub fn allocated_bytes(&self) -> usize {
        self.budget.used()
    }

    /// The cap, in bytes.
    pub fn limit(&self) -> usize {
        self.budget.limit
    }

    /// The resource this adaptor allocates from.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }
}

impl MemoryResource for LimitingAdaptor {
    upstream_properties!("LimitingResourceAdaptor", passes_through);

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        self.reserve(bytes)?;
        self.upstream.allocate(bytes, stream).map_err(|e| {
            self.budget.release(counted(bytes));
            as_own_oom(e, bytes, self)
        })
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.check_free(ptr, bytes)?;
        // Released only once the upstream has taken the memory back: a refused free (a
        // pointer it does not own) must not make room under the limit.
        self.upstream.deallocate(ptr, bytes, stream)?;
        self.budget.release(counted(bytes));
        Ok(())
    }

    // Forwarded: the reservation is a compare-and-swap, given back when the upstream's
    // fast path does not settle the request (the full path reserves again).
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        if bytes == 0 {
            return Some(Ok(0));
        }
        if let Err(e) = self.reserve(bytes) {
            return Some(Err(e));
        }
        let result = try_upstream_allocate(self, &self.upstream, bytes, stream);
        if !matches!(result, Some(Ok(_))) {
            self.budget.release(counted(bytes));
        }
        result
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        let check = || self.check_free(ptr, bytes);
        try_counted_deallocate(self, &self.upstream, (ptr, bytes, stream), check, || {
            self.budget.release(counted(bytes))
        })
    }
}

impl LimitingAdaptor {
    /// Reserves `bytes` (counted rounded up) under the limit, or the refusal.
    fn reserve(&self, bytes: usize) -> Result<()> {
        self.budget.reserve(counted(bytes)).map_err(|in_use| Error::OutOfMemory {
            requested: bytes,
            available: Some(self.budget.limit.saturating_sub(in_use)),
            resource: format!(
                "{} (limit {} bytes, {in_use} in use{})",
                self.name(),
                self.budget.limit,
                match counted(bytes) {
                    n if n != bytes => {
                        format!("; the request counts as {n} bytes, rounded up to a multiple of 256 as RMM's does")
                    }
                    _ => String::new(),
                }
            ),
        })
    }

    /// Refuses a free of more bytes than are allocated through it (certainly a wrong size,
    /// or a pointer allocated elsewhere). The upstream is not called (see the type's docs).
    fn check_free(&self, ptr: DevPtr, bytes: usize) -> Result<()> {
        let in_use = self.budget.used();
        if counted(bytes) <= in_use {
            return Ok(());
        }
        Err(Error::InvalidPointer(format!(
            "{ptr:#x} freed with {bytes} bytes, but only {in_use} bytes are allocated through this \
             LimitingResourceAdaptor: the size is not the one allocated, or the pointer was not allocated here"
        )))
    }
}

/// What an allocation of `bytes` counts against the limit: rounded up to [`ALIGNMENT`]
/// (a size too large to round counts as `usize::MAX`, and is refused).
fn counted(bytes: usize) -> usize {
    bytes.checked_next_multiple_of(ALIGNMENT).unwrap_or(usize::MAX)
}

impl fmt::Debug for LimitingAdaptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitingAdaptor")
            .field("limit", &self.budget.limit)
            .field("allocated_bytes", &self.budget.used())
            .field("upstream", &self.upstream)
            .finish()
    }
}

/// Bytes reserved under a limit; what the loom model checks.
pub(crate) struct Budget {
    limit: usize,
    used: AtomicUsize,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Self {
        Budget { limit, used: AtomicUsize::new(0) }
    }

    /// Reserves `bytes`, or returns the bytes in use when that would exceed the limit.
    /// A compare-and-swap loop rather than `fetch_add` then roll back: the count itself
    /// never goes above the limit, so a concurrent reservation is never refused because
    /// of one that was about to be rolled back.
    pub(crate) fn reserve(&self, bytes: usize) -> Result<(), usize> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            match used.checked_add(bytes).filter(|&n| n <= self.limit) {
                None => return Err(used),
                Some(next) => {
                    match self.used.compare_exchange_weak(used, next, Ordering::Relaxed, Ordering::Relaxed) {
                        Ok(_) => return Ok(()),
                        Err(actual) => used = actual,
                    }
                }
            }
        }
    }

    /// Gives back a reservation. Saturating: a free checks that its bytes are in use
    /// before its upstream call, but two wrong frees racing may both pass that check, and
    /// the count must then stop at 0 rather than wrap (which would refuse every later
    /// allocation).
    pub(crate) fn release(&self, bytes: usize) {
        let _ =
            self.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_sub(bytes)));
    }

    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::Budget;
    use crate::sync::Arc;

    /// Two threads and the main thread reserve under a limit that fits two of the three,
    /// then give the reservation back (a free, or the roll-back of a failed upstream call:
    /// the same operation). Never above the limit; a reservation is refused only when the
    /// others really held the room; every reservation released at the end.
    #[test]
    fn loom_budget_reserve_and_roll_back() {
        crate::sync::model(|| {
            let budget = Arc::new(Budget::new(100));
            let run = |b: &Budget, bytes: usize| match b.reserve(bytes) {
                Ok(()) => {
                    assert!(b.used() <= 100);
                    b.release(bytes);
                }
                Err(in_use) => assert!(in_use + bytes > 100, "refused with {in_use} in use"),
            };
            let threads: Vec<_> = [60, 40]
                .into_iter()
                .map(|bytes| {
                    let b = budget.clone();
                    loom::thread::spawn(move || run(&b, bytes))
                })
                .collect();
            run(&budget, 30);
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(budget.used(), 0);
        });
    }
}
