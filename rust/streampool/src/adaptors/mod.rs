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
mod limiting;
mod logging;
mod prefetch;
mod statistics;
mod tracking;

pub use binning::{size_exponent_error, BinningMemoryResource, MAX_SIZE_EXPONENT};
pub use failure_callback::{FailureCallback, FailureCallbackAdaptor};
pub use fixed_size::FixedSizeMemoryResource;
pub use limiting::LimitingAdaptor;
pub use logging::{parse_log, LogAction, LogCallback, LogEvent, LogSink, LoggingAdaptor, LOG_HEADER};
pub use prefetch::PrefetchAdaptor;
pub use statistics::{Statistics, StatisticsAdaptor};
pub use tracking::{AllocationRecord, StackCapture, ThreadLabel, TrackingAdaptor};

use crate::error::Error;
use crate::resource::{out_of_memory, MemoryResource};

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

/// The `MemoryResource` methods that every adaptor forwards to `self.upstream`, and its
/// RMM name.
macro_rules! upstream_properties {
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
    };
}
pub(crate) use upstream_properties;
