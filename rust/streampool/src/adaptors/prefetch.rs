//! Prefetches managed memory to the device on the allocating stream.

use std::fmt;

use super::{as_own_oom, try_upstream_allocate, upstream_properties};
use crate::device::{DevPtr, Location};
use crate::error::{record_if_failed, Result};
use crate::resource::{check_depth, MemoryKind, MemoryResource, ResourceRef};
use crate::stream::Stream;

/// After each allocation, prefetches it to the allocating device on the allocating
/// stream (`cuMemPrefetchAsync`), so that the first kernel touching it does not fault
/// page by page (RMM's `prefetch_resource_adaptor`).
///
/// Invariant: an allocation it returns has a prefetch enqueued on its stream when the
/// upstream's memory is managed ([`MemoryKind::Managed`]); on any other memory it does
/// nothing but forward (as RMM's, whose prefetch ignores the driver's refusal of
/// unmanaged memory), so it is safe over any resource. A prefetch the driver refuses is
/// an error, and the memory is freed again first.
///
/// What a reader may miss: the prefetch is asynchronous; the memory is on the device
/// only once the stream reaches it. Frees are forwarded unchanged (sizes included: the
/// upstream checks them where it can).
///
/// ```
/// use std::sync::Arc;
/// use streampool::device::sim::SimDevice;
/// use streampool::{ManagedMemoryResource, MemoryResource, PrefetchAdaptor, Stream};
///
/// let sim = SimDevice::new(1 << 30);
/// let mr = PrefetchAdaptor::new(Arc::new(ManagedMemoryResource::on(sim.clone(), 0)?))?;
/// let p = mr.allocate(1 << 20, &Stream::legacy())?;
/// mr.deallocate(p, 1 << 20, &Stream::legacy())?;
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct PrefetchAdaptor {
    upstream: ResourceRef,
}

impl PrefetchAdaptor {
    /// Prefetches what `upstream` allocates, when its memory is managed; an error when
    /// the chain would be deeper than [`MAX_DEPTH`](crate::resource::MAX_DEPTH), and
    /// [`Error::Unsupported`](crate::Error::Unsupported) over managed memory of a device
    /// without concurrent managed access (Windows, WSL, some Jetson boards), where the
    /// driver takes no prefetch: every allocation would fail there.
    pub fn new(upstream: ResourceRef) -> Result<Self> {
        check_depth("PrefetchResourceAdaptor", [&upstream])?;
        if upstream.memory_kind() == MemoryKind::Managed {
            let info = upstream.backend().device_info(upstream.device())?;
            if !info.concurrent_managed_access {
                return Err(crate::Error::Unsupported(format!(
                    "PrefetchResourceAdaptor needs a GPU with concurrent managed access to prefetch \
                     (device {}: {} has none, as on Windows, WSL and some Jetson boards); use {} \
                     alone, whose memory the driver migrates at each kernel launch there",
                    info.ordinal,
                    info.name,
                    upstream.name()
                )));
            }
        }
        Ok(PrefetchAdaptor { upstream })
    }

    /// The resource this adaptor allocates from.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }
}

impl MemoryResource for PrefetchAdaptor {
    upstream_properties!("PrefetchResourceAdaptor", passes_through);

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let ptr = self.upstream.allocate(bytes, stream).map_err(|e| as_own_oom(e, bytes, self))?;
        if self.upstream.memory_kind() == MemoryKind::Managed {
            let (backend, dev) = (self.upstream.backend(), self.upstream.device());
            if let Err(e) = backend.prefetch_async(dev, ptr, bytes, Location::Device(dev), stream.handle()) {
                let what =
                    || format!("PrefetchResourceAdaptor: freeing an allocation whose prefetch failed ({e})");
                record_if_failed(what, self.upstream.deallocate(ptr, bytes, stream));
                return Err(crate::managed::no_concurrent_access(
                    e,
                    self.upstream.as_ref(),
                    self.upstream.device(),
                ));
            }
        }
        Ok(ptr)
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.upstream.deallocate(ptr, bytes, stream)
    }

    // Forwarded over memory that is not managed, where the adaptor only forwards; over
    // managed memory the prefetch is a driver call, which the fast path never makes.
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        if self.upstream.memory_kind() == MemoryKind::Managed {
            return None;
        }
        try_upstream_allocate(self, &self.upstream, bytes, stream)
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        self.upstream.try_deallocate(ptr, bytes, stream)
    }
}

impl fmt::Debug for PrefetchAdaptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefetchAdaptor").field("upstream", &self.upstream).finish()
    }
}
