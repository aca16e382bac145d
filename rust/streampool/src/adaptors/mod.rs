//! Adaptors: resources that wrap any resource (`upstream`) and add one thing each.
//! They stack: `LoggingAdaptor::new(Arc::new(LimitingAdaptor::new(async_mr, limit)?), sinks)`.
//!
//! | Rust | Python (`streampool.mr`) | adds |
//! |---|---|---|
//! | [`StatisticsAdaptor`] | `StatisticsResourceAdaptor` | current/peak/total bytes and counts, a stack of counters |
//! | [`TrackingAdaptor`] | `TrackingResourceAdaptor` | every outstanding allocation; double/unknown frees and size mismatches are errors |
//! | [`LoggingAdaptor`] | `LoggingResourceAdaptor` | a CSV event log in RMM's format |
//! | [`LimitingAdaptor`] | `LimitingResourceAdaptor` | a byte cap |
//! | [`FailureCallbackAdaptor`] | `FailureCallbackResourceAdaptor` | a callback on out-of-memory that may free and retry |
//! | [`PrefetchAdaptor`] | `PrefetchResourceAdaptor` | prefetches managed memory to the device on the allocating stream |
//! | [`BinningMemoryResource`] | `BinningMemoryResource` | size classes routed to different resources |
//! | [`FixedSizeMemoryResource`] | `FixedSizeMemoryResource` | fixed-size blocks carved from upstream chunks (the binning resource's default bin) |
//! | [`LatencyHistogramAdaptor`] | `LatencyHistogramAdaptor` | per-call latency histograms of allocate and deallocate; NVTX ranges with `STREAMPOOL_NVTX=1` |
//!
//! Every adaptor reports its upstream's backend, device and memory kind, and holds no
//! lock across a call into its upstream or into a callback.
//!
//! An out-of-memory error that passes through an adaptor is reported as the adaptor's
//! own ([`Error::OutOfMemory`] with `resource` = the adaptor's name, then, in brackets,
//! the words of the resource that refused, which name what limited the request: a limit,
//! a pool's maximum, the device; `requested` is the caller's and `available` is kept):
//! the caller asked the adaptor, so the error names what they called.

mod binning;
mod failure_callback;
mod fixed_size;
mod latency;
mod limiting;
mod logging;
mod prefetch;
mod statistics;
mod tracking;

pub use binning::{size_exponent_error, BinningMemoryResource, MAX_SIZE_EXPONENT};
pub use failure_callback::{FailureCallback, FailureCallbackAdaptor};
pub use fixed_size::FixedSizeMemoryResource;
pub use latency::{Histogram, LatencyHistogramAdaptor, LatencyHistograms};
pub use limiting::LimitingAdaptor;
pub use logging::{
    parse_log, LogAction, LogCallback, LogEvent, LogSink, LoggingAdaptor, LOG_HEADER, MAX_LOG_TIME_S,
};
pub use prefetch::PrefetchAdaptor;
pub use statistics::{Statistics, StatisticsAdaptor};
pub use tracking::{AllocationRecord, StackCapture, ThreadLabel, TrackingAdaptor};

use std::collections::HashMap;

use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::resource::{out_of_memory, MemoryResource, ResourceRef};
use crate::stream::Stream;
use crate::sync::{lock, Mutex, MutexGuard};

/// Shards of a [`PtrMap`]: threads freeing different pointers rarely meet on one lock.
const SHARDS: usize = 16;

/// Records keyed by address (the tracking adaptor's allocations, the binning resource's
/// sizes), in 16 shards each behind its own lock. A shard is locked only for one map
/// operation or a copy of its records, never across a call out (an upstream, a callback),
/// so waiting for one is short, and cannot deadlock even with the GIL held.
pub(crate) struct PtrMap<V> {
    shards: [Mutex<HashMap<DevPtr, V>>; SHARDS],
}

impl<V> PtrMap<V> {
    pub(crate) fn new() -> Self {
        PtrMap { shards: std::array::from_fn(|_| Mutex::new(HashMap::new())) }
    }

    /// The locked shard that holds `ptr`'s record.
    fn shard(&self, ptr: DevPtr) -> MutexGuard<'_, HashMap<DevPtr, V>> {
        // Allocations are at least 256-byte aligned: the bits above the alignment spread.
        lock(&self.shards[(ptr >> 8) as usize % SHARDS])
    }

    /// Takes out the record of a free of `ptr` with `bytes`, or refuses the free with
    /// [`Error::InvalidPointer`] and changes nothing: `ptr` has no record (a double free,
    /// or memory not allocated through `owner`) or was allocated with another size.
    /// Taken out *before* the upstream free: once the upstream has the memory back,
    /// another thread may be handed the same address and record it. Put it back with
    /// [`insert`](Self::insert) if that free fails.
    pub(crate) fn take(
        &self,
        ptr: DevPtr,
        bytes: usize,
        size: impl Fn(&V) -> usize,
        owner: &str,
    ) -> Result<V> {
        let mut shard = self.shard(ptr);
        match shard.get(&ptr).map(size) {
            None => Err(Error::InvalidPointer(format!(
                "{ptr:#x} is not an outstanding allocation of this {owner} (double free, or not allocated here)"
            ))),
            Some(had) if had != bytes => Err(Error::InvalidPointer(format!(
                "{ptr:#x} was allocated with {had} bytes but freed with {bytes} bytes"
            ))),
            Some(_) => Ok(shard.remove(&ptr).expect("just found")),
        }
    }

    /// Records `value` for `ptr`.
    pub(crate) fn insert(&self, ptr: DevPtr, value: V) {
        self.shard(ptr).insert(ptr, value);
    }

    /// Every shard, one after another (a union of per-shard snapshots).
    pub(crate) fn shards(&self) -> impl Iterator<Item = MutexGuard<'_, HashMap<DevPtr, V>>> {
        self.shards.iter().map(lock)
    }
}

/// Reports an out-of-memory error from upstream as `mr`'s own (see the module docs);
/// other errors pass through unchanged.
pub(crate) fn as_own_oom(e: Error, requested: usize, mr: &dyn MemoryResource) -> Error {
    match e {
        // The size this caller asked for; the refusing resource's own words stay, after
        // this one's name, with what it was asked for when that was more (a chunk): its
        // `available` is measured against that request, not this one.
        Error::OutOfMemory { requested: asked, available, resource } => {
            let from =
                if asked == requested { resource } else { format!("{resource}, asked for {asked} bytes") };
            Error::OutOfMemory { requested, available, resource: format!("{} (from {from})", mr.name()) }
        }
        e => out_of_memory(e, requested, mr),
    }
}

/// An adaptor's fast path into its upstream's ([`MemoryResource::try_allocate`]): `None`
/// when the upstream does not settle the request, else its answer with an out-of-memory
/// error reported as `mr`'s own (as the full path does). `Some(Ok(0))` is a zero-size
/// request's null pointer, which an adaptor passes on without counting it.
pub(crate) fn try_upstream_allocate(
    mr: &dyn MemoryResource,
    upstream: &ResourceRef,
    bytes: usize,
    stream: &Stream,
) -> Option<Result<DevPtr>> {
    Some(upstream.try_allocate(bytes, stream)?.map_err(|e| as_own_oom(e, bytes, mr)))
}

/// The fast path of a free for an adaptor that keeps counts: `check` refuses a free it can
/// tell is wrong (before the upstream sees it), the upstream's fast path frees, and
/// `settle` updates the counts once that free has succeeded. `None` (the full path's to do)
/// when the upstream has no fast path for it.
pub(crate) fn try_counted_deallocate(
    mr: &dyn MemoryResource,
    upstream: &ResourceRef,
    (ptr, bytes, stream): (DevPtr, usize, &Stream),
    check: impl FnOnce() -> Result<()>,
    settle: impl FnOnce(),
) -> Option<Result<()>> {
    if ptr == 0 || bytes == 0 {
        return crate::resource::settle_deallocate(mr, ptr, bytes, stream);
    }
    if let Err(e) = check() {
        return Some(Err(e));
    }
    Some(upstream.try_deallocate(ptr, bytes, stream)?.map(|()| settle()))
}

/// The `MemoryResource` methods that every adaptor forwards to `self.upstream`, and its
/// RMM name; with `depth`, also its depth (one more than its upstream's: the constructor
/// checked it with [`check_depth`](crate::resource::check_depth)).
macro_rules! upstream_properties {
    // An adaptor that hands out its upstream's allocations as they are.
    ($name:literal, passes_through) => {
        crate::adaptors::upstream_properties!($name, depth);
        fn whole_allocations(&self) -> bool {
            self.upstream.whole_allocations()
        }
        fn serves_capture(&self) -> bool {
            self.upstream.serves_capture()
        }
    };
    ($name:literal, depth) => {
        crate::adaptors::upstream_properties!($name);
        fn depth(&self) -> usize {
            self.upstream.depth() + 1
        }
    };
    ($name:literal) => {
        fn backend(&self) -> &crate::device::BackendRef {
            self.upstream.backend()
        }
        fn device(&self) -> i32 {
            self.upstream.device()
        }
        fn memory_kind(&self) -> crate::resource::MemoryKind {
            self.upstream.memory_kind()
        }
        fn name(&self) -> &str {
            $name
        }
        fn footprint(&self) -> Option<crate::resource::Footprint> {
            self.upstream.footprint()
        }
        fn reset_peak_footprint(&self) {
            self.upstream.reset_peak_footprint()
        }
    };
}
pub(crate) use upstream_properties;
