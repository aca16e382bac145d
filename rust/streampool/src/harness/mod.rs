//! The harness's native parts: workloads whose own cost must stay out of what they
//! measure, so they run in Rust threads (the Python package drives them through
//! `streampool._native`, with the GIL released).
//!
//! * [`replay`]: replays an allocation log, one thread per recorded thread and one stream
//!   per recorded stream, with the recorded gaps scaled.
//! * [`pipeline`]: the producer/consumer pipeline across streams (the workload of the
//!   context issue: pipeline bubbles).
//! * [`NullMemoryResource`]: a resource that hands out no memory, to measure what a
//!   workload itself costs.
//!
//! Both workloads report per-call latency percentiles ([`Percentiles`]), the time spent
//! inside allocator calls, and reserved against live bytes where the resource reports
//! its [`Footprint`](crate::Footprint).
//!
//! Workload code drives resources from outside and is not model-checked: it takes its
//! atomics and channels from `std` directly, not from `crate::sync`.

use std::cell::Cell;
use std::fmt;

use crate::clock;
use crate::device::{BackendRef, DevPtr};
use crate::error::Result;
use crate::resource::{MemoryKind, MemoryResource, ALIGNMENT};
use crate::stream::Stream;

mod long_calls;
pub mod pipeline;
pub mod replay;

/// Latency percentiles of a set of calls, in nanoseconds (nearest rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Percentiles {
    /// Calls measured.
    pub count: u64,
    /// Median.
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// The slowest call.
    pub max: u64,
    /// Sum of all calls.
    pub total: u64,
}

impl Percentiles {
    /// The percentiles of `samples`, durations in ticks of the crate's clock (sorted
    /// here), in nanoseconds.
    pub(crate) fn of_ticks(mut samples: Vec<u64>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        let ns_per_tick = clock::ns_per_tick();
        let ns = |t: u64| (t as f64 * ns_per_tick) as u64;
        samples.sort_unstable();
        let n = samples.len();
        let rank = |p: f64| ns(samples[((p * n as f64).ceil() as usize).clamp(1, n) - 1]);
        Percentiles {
            count: n as u64,
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            p999: rank(0.999),
            max: ns(samples[n - 1]),
            total: ns(samples.iter().sum()),
        }
    }
}

/// A resource that hands out no memory: every allocation gets a distinct address (a
/// per-thread counter, aligned to [`ALIGNMENT`]) that must never be used, and frees do
/// nothing. For benchmarks only: it measures what a workload that never touches the
/// memory (the replayer) costs around the allocator, the allocator's time being zero. Not
/// for the pipeline, whose kernels fill and read every chunk (the simulated device refuses
/// them; on a GPU they would fault).
#[derive(Debug)]
pub struct NullMemoryResource {
    backend: BackendRef,
    device: i32,
}

impl NullMemoryResource {
    /// A null resource on the current backend's `device` (default: the current device).
    pub fn new(device: Option<i32>) -> Result<Self> {
        let (backend, device) = crate::resources::bind(device)?;
        Ok(Self::on(backend, device))
    }

    /// A null resource bound to `device` of `backend` (whose streams it accepts).
    pub fn on(backend: BackendRef, device: i32) -> Self {
        NullMemoryResource { backend, device }
    }
}

thread_local! {
    static NEXT_NULL: Cell<u64> = const { Cell::new(0) };
}

impl MemoryResource for NullMemoryResource {
    fn backend(&self) -> &BackendRef {
        &self.backend
    }
    fn device(&self) -> i32 {
        self.device
    }
    fn name(&self) -> &str {
        "NullMemoryResource"
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }
    fn do_allocate(&self, _bytes: usize, _stream: &Stream) -> Result<DevPtr> {
        // Addresses in the top half of the space, never mapped on the host or a device.
        Ok(NEXT_NULL.with(|n| {
            let a = n.get().wrapping_add(ALIGNMENT as u64);
            n.set(a);
            (1 << 63) | a
        }))
    }
    fn do_deallocate(&self, _ptr: DevPtr, _bytes: usize, _stream: &Stream) -> Result<()> {
        Ok(())
    }
}

/// Ticks of the crate's clock since `start` (a reading of [`clock::now`]): how each
/// allocator call is timed.
#[inline]
pub(crate) fn ticks_since(start: u64) -> u64 {
    clock::now().wrapping_sub(start)
}

/// A resource's counters before a run, to report the run's own (see [`Footprint`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FootprintBaseline(Option<crate::Footprint>);

impl FootprintBaseline {
    /// Resets the peak where the resource can, and remembers its counters.
    pub(crate) fn start(mr: &dyn MemoryResource) -> Self {
        mr.reset_peak_footprint();
        FootprintBaseline(mr.footprint())
    }

    /// The resource's peak reserved bytes and what it counted since [`Self::start`].
    pub(crate) fn finish(self, mr: &dyn MemoryResource) -> RunFootprint {
        let Some(now) = mr.footprint() else { return RunFootprint::default() };
        let before = self.0.unwrap_or_default();
        let diff = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b.unwrap_or(0)));
        let synchronizations = diff(now.synchronizations, before.synchronizations);
        let waits = diff(now.waits, before.waits);
        let calls = (|| {
            Some(DriverCalls {
                event_records: diff(now.events_recorded, before.events_recorded)?,
                event_queries: diff(now.event_queries, before.event_queries)?,
                stream_waits: waits?,
                synchronizations: synchronizations?,
                growths: diff(now.growths, before.growths)?,
            })
        })();
        RunFootprint {
            peak_reserved_bytes: Some(now.peak_reserved_bytes),
            synchronizations,
            waits,
            driver_calls: calls,
        }
    }
}

/// What a resource reported over one run ([`FootprintBaseline::finish`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RunFootprint {
    pub peak_reserved_bytes: Option<usize>,
    pub synchronizations: Option<u64>,
    pub waits: Option<u64>,
    pub driver_calls: Option<DriverCalls>,
}

/// The driver calls a resource made of its own over a run, by kind, where it counts them
/// all (the sharded pool does): besides the upstream's own allocations, these are what its
/// allocations and frees cost beyond its lock-protected bookkeeping.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCalls {
    /// Events recorded in frees (`cuEventRecord`), so that other streams can tell when
    /// those frees have completed.
    pub event_records: u64,
    /// Queries of those events (`cuEventQuery`).
    pub event_queries: u64,
    /// Waits inserted into one stream on another's event (`cuStreamWaitEvent`).
    pub stream_waits: u64,
    /// Device synchronisations (`cuCtxSynchronize`).
    pub synchronizations: u64,
    /// Growths from the upstream (one upstream allocation each).
    pub growths: u64,
}

impl DriverCalls {
    /// Every call, of every kind.
    pub fn total(&self) -> u64 {
        self.event_records + self.event_queries + self.stream_waits + self.synchronizations + self.growths
    }
}

impl fmt::Display for Percentiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p50 {} p99 {} p99.9 {} max {} ns", self.p50, self.p99, self.p999, self.max)
    }
}
