//! Every outstanding allocation, with the checks that need them.

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::Arc;

use super::{as_own_oom, upstream_properties};
use crate::device::{DevPtr, RawStream};
use crate::error::{Error, Result};
use crate::resource::{MemoryResource, ResourceRef};
use crate::stream::Stream;
use crate::sync::{lock, AtomicUsize, Mutex, Ordering};

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

/// Shards of the outstanding map: threads freeing different pointers rarely meet on one
/// lock.
const SHARDS: usize = 16;

/// Knows every allocation made through it and not yet freed (RMM's
/// `tracking_resource_adaptor`), optionally with the allocating stack.
///
/// Invariant: [`outstanding`](Self::outstanding) is exactly the set of allocations made
/// through it whose free has not been accepted, and
/// [`allocated_bytes`](Self::allocated_bytes) their sum. A free of a pointer that is not
/// outstanding (a double free, or one allocated elsewhere) or with another size than it
/// was allocated with is refused with [`Error::InvalidPointer`]; the upstream is not
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
/// let mr = TrackingAdaptor::new(Arc::new(CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?), None);
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
    shards: [Mutex<HashMap<DevPtr, AllocationRecord>>; SHARDS],
    allocated_bytes: AtomicUsize,
}

impl TrackingAdaptor {
    /// Tracks the allocations made through it from `upstream`; `capture`, when given, is
    /// called (with no lock held) on every allocation to record its stack.
    pub fn new(upstream: ResourceRef, capture: Option<StackCapture>) -> Self {
        TrackingAdaptor {
            upstream,
            capture,
            label: None,
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            allocated_bytes: AtomicUsize::new(0),
        }
    }

    /// Names the allocating thread with `label` (called, with no lock held, on every
    /// allocation) instead of the Rust thread's name and id.
    pub fn with_thread_label(mut self, label: ThreadLabel) -> Self {
        self.label = Some(label);
        self
    }

    /// Tracks with Rust stack traces (`std::backtrace`, captured whatever
    /// `RUST_BACKTRACE` says). Slow: for finding leaks, not for production.
    pub fn with_backtraces(upstream: ResourceRef) -> Self {
        let capture: StackCapture = Arc::new(|| std::backtrace::Backtrace::force_capture().to_string());
        Self::new(upstream, Some(capture))
    }

    /// The outstanding allocations, sorted by address.
    pub fn outstanding(&self) -> Vec<AllocationRecord> {
        let mut all: Vec<AllocationRecord> =
            self.shards.iter().flat_map(|s| lock(s).values().cloned().collect::<Vec<_>>()).collect();
        all.sort_by_key(|r| r.ptr);
        all
    }

    /// Bytes allocated through it and not yet freed.
    pub fn allocated_bytes(&self) -> usize {
        self.allocated_bytes.load(Ordering::Relaxed)
    }

    /// A readable leak report: how many allocations are outstanding and their bytes, then
    /// one line per allocation (address, size, stream, thread), each followed by its
    /// stack when stacks are captured.
    pub fn outstanding_report(&self) -> String {
        let records = self.outstanding();
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

    fn shard(&self, ptr: DevPtr) -> &Mutex<HashMap<DevPtr, AllocationRecord>> {
        // Allocations are at least 256-byte aligned: the bits above the alignment spread.
        &self.shards[(ptr >> 8) as usize % SHARDS]
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
    upstream_properties!("TrackingResourceAdaptor");

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let stack = self.capture.as_ref().map(|c| c());
        let thread = self.label.as_ref().map_or_else(thread_label, |label| label());
        let ptr = self.upstream.allocate(bytes, stream).map_err(|e| as_own_oom(e, bytes, self))?;
        let record = AllocationRecord { ptr, bytes, stream: stream.handle(), thread, stack };
        lock(self.shard(ptr)).insert(ptr, record);
        self.allocated_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(ptr)
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        // Taken out before the upstream free: once the upstream has it, another thread may
        // be handed the same address and record it.
        let record = {
            let mut shard = lock(self.shard(ptr));
            match shard.get(&ptr) {
                None => {
                    return Err(Error::InvalidPointer(format!(
                        "{ptr:#x} is not an outstanding allocation of this {} (double free, or not allocated here)",
                        self.name()
                    )))
                }
                Some(r) if r.bytes != bytes => {
                    return Err(Error::InvalidPointer(format!(
                        "{ptr:#x} was allocated with {} bytes but freed with {bytes} bytes",
                        r.bytes
                    )))
                }
                Some(_) => shard.remove(&ptr).expect("just found"),
            }
        };
        match self.upstream.deallocate(ptr, bytes, stream) {
            Ok(()) => {
                self.allocated_bytes.fetch_sub(bytes, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                lock(self.shard(ptr)).insert(ptr, record);
                Err(e)
            }
        }
    }
}

impl fmt::Debug for TrackingAdaptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackingAdaptor")
            .field("outstanding", &self.shards.iter().map(|s| lock(s).len()).sum::<usize>())
            .field("allocated_bytes", &self.allocated_bytes())
            .field("stacks", &self.capture.is_some())
            .field("thread_label", &self.label.is_some())
            .field("upstream", &self.upstream)
            .finish()
    }
}
