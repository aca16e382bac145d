//! A callback on out-of-memory that may free memory and ask for a retry.

use std::fmt;
use std::sync::Arc;

use super::{as_own_oom, upstream_properties};
use crate::device::DevPtr;
use crate::error::Result;
use crate::resource::{check_depth, MemoryResource, ResourceRef};
use crate::stream::Stream;

/// Called with the size of an allocation that failed for lack of memory: `Ok(true)`
/// retries it, `Ok(false)` gives up with the out-of-memory error, and an error is
/// returned to the caller as it is.
pub type FailureCallback = Arc<dyn Fn(usize) -> Result<bool> + Send + Sync>;

/// Calls a function when the upstream is out of memory, and retries while it asks to
/// (RMM's `failure_callback_resource_adaptor`).
///
/// Invariant: an allocation returns either memory from the upstream, the upstream's
/// out-of-memory error (once the callback has said `false`; reported with `resource` =
/// `FailureCallbackResourceAdaptor`), the callback's own error (never lost or replaced),
/// or an upstream error that is not out-of-memory (the callback is not called for it).
/// No lock is held while the callback runs, so it may free memory into this adaptor, or
/// anything else in the same stack, before asking for a retry. A callback that always
/// says `true` without freeing anything retries forever, as RMM's does: count the calls
/// in it.
///
/// Sizes: frees are forwarded as given; the upstream checks them where it can.
///
/// What a reader may miss: nothing is counted here; the callback sees every failure.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use streampool::device::sim::SimDevice;
/// use streampool::{CudaAsyncMemoryResource, Error, FailureCallbackAdaptor, LimitingAdaptor, MemoryResource, Stream};
///
/// let sim = SimDevice::new(1 << 30);
/// let upstream = Arc::new(CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?);
/// let limited = Arc::new(LimitingAdaptor::new(upstream, 1 << 20)?);
/// let calls = Arc::new(Mutex::new(Vec::new()));
/// let seen = calls.clone();
/// let mr = FailureCallbackAdaptor::new(limited, Arc::new(move |bytes| {
///     seen.lock().unwrap().push(bytes);
///     Ok(false)
/// }))?;
/// let err = mr.allocate(2 << 20, &Stream::legacy()).unwrap_err();
/// assert!(matches!(err, Error::OutOfMemory { .. }));
/// assert_eq!(*calls.lock().unwrap(), vec![2 << 20]);
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct FailureCallbackAdaptor {
    upstream: ResourceRef,
    callback: FailureCallback,
}

impl FailureCallbackAdaptor {
    /// Calls `callback` when `upstream` is out of memory; an error when the chain would
    /// be deeper than [`MAX_DEPTH`](crate::resource::MAX_DEPTH).
    pub fn new(upstream: ResourceRef, callback: FailureCallback) -> Result<Self> {
        check_depth("FailureCallbackResourceAdaptor", [&upstream])?;
        Ok(FailureCallbackAdaptor { upstream, callback })
    }

    /// The resource this adaptor allocates from.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }
}

impl MemoryResource for FailureCallbackAdaptor {
    upstream_properties!("FailureCallbackResourceAdaptor", passes_through);

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        loop {
            match self.upstream.allocate(bytes, stream) {
                Err(e) if e.is_out_of_memory() => {
                    if !(self.callback)(bytes)? {
                        return Err(as_own_oom(e, bytes, self));
                    }
                }
                result => return result,
            }
        }
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.upstream.deallocate(ptr, bytes, stream)
    }

    // Forwarded, except an out-of-memory: the callback then runs on the full path (from
    // Python, with the GIL released first, as a callback that frees memory may wait).
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        match self.upstream.try_allocate(bytes, stream)? {
            Err(e) if e.is_out_of_memory() => None,
            result => Some(result),
        }
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        self.upstream.try_deallocate(ptr, bytes, stream)
    }
}

impl fmt::Debug for FailureCallbackAdaptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FailureCallbackAdaptor").field("upstream", &self.upstream).finish_non_exhaustive()
    }
}
