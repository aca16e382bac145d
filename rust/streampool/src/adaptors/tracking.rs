//! Every outstanding allocation, with the checks that need them.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use super::{as_own_oom, try_upstream_allocate, upstream_properties, PtrMap};
use crate::device::{DevPtr, RawStream};
use crate::error::Result;
use crate::resource::{check_depth, settle_deallocate, MemoryResource, ResourceRef};
use crate::stream::Stream;
use crate::sync::{AtomicUsize, Ordering};

/// Captures the caller's stack as text (e.g. a Python traceback from the binding).
pub type StackCapture = Arc<dyn Fn() -> String + Send + Sync>;

/// Names the calling thread for [`AllocationRecord::thread`] (e.g. the Python thread's
/// name and ident, from the binding).
pub type ThreadLabel = Arc<dyn Fn() -> String + Send + Sync>;

/// One outstanding allocation of a [`TrackingAdaptor`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationRecord {
    /// The address.
    pub ptr: DevPtr,
    /// The size asked for.
    pub bytes: usize,
    /// The stream it was allocated on (its handle).
    pub stream: RawStream,
    /// The allocating thread: its name if it has one, and its id (or what the adaptor's
    /// [`ThreadLabel`] says).
    pub thread: String,
    /// The allocating stack, when the adaptor captures stacks.
    pub stack: Option<String>,
}

/// Knows every allocation made through it and not yet freed (RMM's
/// `tracking_resource_adaptor`), optionally with the allocating stack.
///
/// Invariant: [`outstanding`](Self::outstanding) is exactly the set of allocations made
/// through it whose free has not been accepted, and
/// [`allocated_bytes`](Self::allocated_bytes) their sum. A free of a pointer that is not
/// outstanding (a double free, or one allocated elsewhere) or with another size than it
/// was allocated with is refused with [`Error::InvalidPointer`](crate::Error::InvalidPointer); the upstream is not
/// called and nothing changes.
///
/// What a reader may miss: allocations whose upstream call has not returned yet, and
/// frees in flight (removed from the map before the upstream free, and put back if that
/// fails). Records are kept in 16 shards keyed by pointer, each behind its own lock, so
/// a report taken while other threads allocate is a union of per-shard snapshots.
///
/// ```
/// use std::sync::Arc;
/// use streampool::device::sim::SimDevice;
/// use streampool::{CudaAsyncMemoryResource, Error, MemoryResource, Stream, TrackingAdaptor};
///
/// let sim = SimDevice::new(1 << 30);
/// let mr = TrackingAdaptor::new(Arc::new(CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?), None)?;
/// let s = Stream::legacy();
/// let p = mr.allocate(4096, &s)?;
/// assert_eq!(mr.outstanding()[0].bytes, 4096);
/// assert!(mr.outstanding_report().contains("1 outstanding allocation"));
/// assert!(matches!(mr.deallocate(p, 100, &s), Err(Error::InvalidPointer(_))));
/// mr.deallocate(p, 4096, &s)?;
/// assert!(matches!(mr.deallocate(p, 4096, &s), Err(Error::InvalidPointer(_))));
/// assert_eq!(mr.allocated_bytes(), 0);
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct TrackingAdaptor {
    upstream: ResourceRef,
    capture: Option<StackCapture>,
    label: Option<ThreadLabel>,
    records: PtrMap<AllocationRecord>,
    allocated_bytes: AtomicUsize,
}

impl TrackingAdaptor {
    /// Tracks the allocations made through it from `upstream`; `capture`, when given, is
    /// called (with no lock held) on every allocation to record its stack. An error when
    /// the chain would be deeper than [`MAX_DEPTH`](crate::resource::MAX_DEPTH).
    pub fn new(upstream: ResourceRef, capture: Option<StackCapture>) -> Result<Self> {
        check_depth("TrackingResourceAdaptor", [&upstream])?;
        Ok(TrackingAdaptor {
            upstream,
            capture,
            records: PtrMap::new(),
            label: None,
            allocated_bytes: AtomicUsize::new(0),
        })
    }

    /// Names the allocating thread with `label` (called, with no lock held, on every
    /// allocation) instead of the Rust thread's name and id.
    pub fn with_thread_label(mut self, label: ThreadLabel) -> Self {
        self.label = Some(label);
        self
    }

    /// Tracks with Rust stack traces (`std::backtrace`, captured whatever
    /// `RUST_BACKTRACE` says). Slow: for finding leaks, not for production.
    pub fn with_backtraces(upstream: ResourceRef) -> Result<Self> {
        let capture: StackCapture = Arc::new(|| std::backtrace::Backtrace::force_capture().to_string());
        Self::new(upstream, Some(capture))
    }

    /// The outstanding allocations, sorted by address.
    pub fn outstanding(&self) -> Vec<AllocationRecord> {
        let mut all: Vec<AllocationRecord> =
            self.records.shards().flat_map(|s| s.values().cloned().collect::<Vec<_>>()).collect();
        all.sort_by_key(|r| r.ptr);
        all
    }

    /// Bytes allocated through it and not yet freed.
    pub fn allocated_bytes(&self) -> usize {
        self.allocated_bytes.load(Ordering::Relaxed)
    }

    /// A readable leak report: how many allocations are outstanding and their bytes, then
    /// one line per allocation (address, size, stream, thread), each followed by its
    /// stack when stacks are captured. Empty when nothing is outstanding, as RMM's
    /// `get_outstanding_allocations_str()`.
    pub fn outstanding_report(&self) -> String {
        let records = self.outstanding();
        if records.is_empty() {
            return String::new();
        }
        let bytes: usize = records.iter().map(|r| r.bytes).sum();
        let plural = if records.len() == 1 { "" } else { "s" };
        let mut out = format!(
            "{} outstanding allocation{plural}, {bytes} bytes, in {} over {}\n",
            records.len(),
            self.name(),
            self.upstream.name()
        );
        for r in &records {
            let _ = writeln!(
                out,
                "  {:#x}: {} bytes on stream {:#x}, thread {}",
                r.ptr, r.bytes, r.stream, r.thread
            );
            for line in r.stack.iter().flat_map(|s| s.lines()) {
                let _ = writeln!(out, "      {line}");
            }
        }
        out
    }

    /// The resource this adaptor allocates from.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }
}

fn thread_label() -> String {
    let t = std::thread::current();
    match t.name() {
        Some(name) => format!("{name} ({:?})", t.id()),
        None => format!("{:?}", t.id()),
    }
}

impl MemoryResource for TrackingAdaptor {
    upstream_properties!("TrackingResourceAdaptor", passes_through);

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let stack = self.capture.as_ref().map(|c| c());
        let thread = self.thread_name();
        let ptr = self.upstream.allocate(bytes, stream).map_err(|e| as_own_oom(e, bytes, self))?;
        self.record(ptr, bytes, stream, stack, thread);
        Ok(ptr)
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        let record = self.records.take(ptr, bytes, |r| r.bytes, self.name())?;
        self.settle_free(ptr, bytes, record, self.upstream.deallocate(ptr, bytes, stream))
    }

    // The fast path is forwarded without stack capture only: a capture runs Python code
    // or walks the Rust stack, which is what the full path (with the GIL released) is for,
    // and a capture made here would be made again if the upstream then sent the call there.
    // The shard lock it takes is a `PtrMap`'s: short, and never held across a call out.
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        if self.capture.is_some() {
            return None;
        }
        let ptr = match try_upstream_allocate(self, &self.upstream, bytes, stream)? {
            Ok(0) => return Some(Ok(0)),
            Ok(ptr) => ptr,
            Err(e) => return Some(Err(e)),
        };
        self.record(ptr, bytes, stream, None, self.thread_name());
        Some(Ok(ptr))
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        if ptr == 0 || bytes == 0 {
            return settle_deallocate(self, ptr, bytes, stream);
        }
        let record = match self.records.take(ptr, bytes, |r| r.bytes, self.name()) {
            Ok(record) => record,
            Err(e) => return Some(Err(e)),
        };
        match self.upstream.try_deallocate(ptr, bytes, stream) {
            Some(freed) => Some(self.settle_free(ptr, bytes, record, freed)),
            None => {
                self.records.insert(ptr, record);
                None
            }
        }
    }
}

impl TrackingAdaptor {
    /// The allocating thread's name: the label's, or Rust's.
    fn thread_name(&self) -> String {
        self.label.as_ref().map_or_else(thread_label, |label| label())
    }

    fn record(&self, ptr: DevPtr, bytes: usize, stream: &Stream, stack: Option<String>, thread: String) {
        let record = AllocationRecord { ptr, bytes, stream: stream.handle(), thread, stack };
        self.records.insert(ptr, record);
        self.allocated_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// After the upstream free of a record taken out: counted, or the record put back.
    fn settle_free(
        &self,
        ptr: DevPtr,
        bytes: usize,
        record: AllocationRecord,
        freed: Result<()>,
    ) -> Result<()> {
        match freed {
            Ok(()) => {
                self.allocated_bytes.fetch_sub(bytes, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.records.insert(ptr, record);
                Err(e)
            }
        }
    }
}

impl fmt::Debug for TrackingAdaptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackingAdaptor")
            .field("outstanding", &self.records.shards().map(|s| s.len()).sum::<usize>())
            .field("allocated_bytes", &self.allocated_bytes())
            .field("stacks", &self.capture.is_some())
            .field("thread_label", &self.label.is_some())
            .field("upstream", &self.upstream)
            .finish()
    }
}
