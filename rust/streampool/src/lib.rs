//! # streampool
//!
//! Stream-ordered GPU memory over the CUDA driver API, with a simulated device that
//! makes every resource testable on machines with no GPU.
//!
//! * [`device`]: the one seam to the driver ([`device::cuda`]) or its simulation
//!   ([`device::sim`], with a happens-before race detector).
//! * [`Stream`] and [`Event`]: owned, borrowed and default streams.
//! * [`MemoryResource`]: the stream-ordered contract every resource implements, and
//!   [`Allocation`], the owning guard that frees on drop.
//! * The resources: [`CudaAsyncMemoryResource`] (the recommended default: the driver's
//!   pool), [`CudaAsyncManagedMemoryResource`] (its pool of managed memory),
//!   [`CudaMemoryResource`], [`ManagedMemoryResource`], [`PinnedHostMemoryResource`],
//!   and [`ShardedPoolMemoryResource`], the pool that does not serialise threads and
//!   streams ([`PoolOptions`]).
//! * [`adaptors`]: resources over another that add one thing each (statistics, tracking,
//!   limiting, logging, binning, fixed-size, failure callback, prefetch, latency).
//! * [`managed`]: prefetching and advice for managed memory.
//! * [`ipc`]: memory of an exportable pool shared with another process.
//! * [`harness`] and [`kernels`]: the measurement harness's native workloads (replay,
//!   pipeline) and the fill/check/compute kernels they launch through the seam.
//!
//! ## Quick start (runs on the simulated device; drop the first two lines on a GPU)
//!
//! ```
//! use std::sync::Arc;
//! use streampool::{device::sim::SimDevice, Allocation, CudaAsyncMemoryResource, Stream};
//!
//! let sim = SimDevice::new(1 << 30);
//! let _active = sim.activate()?;
//!
//! let mr = Arc::new(CudaAsyncMemoryResource::new(None, Default::default())?);
//! let stream = Stream::create(&streampool::device::backend()?, 0, false)?;
//! let buf = Allocation::new(mr, 1 << 20, stream.clone())?;
//! assert_eq!(buf.ptr() % 256, 0);
//! drop(buf); // freed on `stream`, reusable by work ordered after it
//! # Ok::<(), streampool::Error>(())
//! ```
//!
//! Activation makes the simulated device the backend of the whole process, and only one
//! may be active at a time: tests, which `cargo test` runs on several threads, give their
//! own device to each resource and stream instead of activating it:
//!
//! ```
//! use std::sync::Arc;
//! use streampool::{device::sim::SimDevice, Allocation, BackendRef, CudaAsyncMemoryResource, Stream};
//!
//! let sim = SimDevice::new(1 << 30);
//! let backend: BackendRef = sim.clone();
//! let mr = Arc::new(CudaAsyncMemoryResource::on(backend.clone(), 0, Default::default())?);
//! let stream = Stream::create(&backend, 0, false)?;
//! drop(Allocation::new(mr, 1 << 20, stream)?);
//! sim.run();
//! assert!(sim.races().is_empty());
//! # Ok::<(), streampool::Error>(())
//! ```

pub mod adaptors;
pub(crate) mod clock;
pub mod device;
pub mod error;
pub mod harness;
pub mod ipc;
pub mod kernels;
pub mod managed;
pub mod nvtx;
pub mod resource;
pub mod resources;
pub mod size;
pub mod stream;
pub(crate) mod sync;

pub use adaptors::{
    parse_log, AllocationRecord, BinningMemoryResource, FailureCallback, FailureCallbackAdaptor,
    FixedSizeMemoryResource, Histogram, LatencyHistogramAdaptor, LatencyHistograms, LimitingAdaptor,
    LogAction, LogCallback, LogEvent, LogSink, LoggingAdaptor, PrefetchAdaptor, StackCapture, Statistics,
    StatisticsAdaptor, ThreadLabel, TrackingAdaptor, LOG_HEADER,
};
pub use device::{Advice, BackendRef, Location};
pub use error::{drop_errors, record_drop_error, DropErrors, Error, Result};
pub use resource::{
    check_depth, Allocation, Footprint, MemoryKind, MemoryResource, ResourceRef, ALIGNMENT, MAX_DEPTH,
};
pub use resources::{
    AsyncPoolOptions, CudaAsyncManagedMemoryResource, CudaAsyncMemoryResource, CudaMemoryResource,
    ManagedMemoryResource, PinnedHostMemoryResource,
};
pub use resources::{PoolOptions, PoolStats, ShardedPoolMemoryResource};
pub use size::parse_size;
pub use stream::{Event, Stream, SyncMarks};
