//! Managed memory: prefetching it and advising the driver about it.
//!
//! Managed (unified) memory lives where it was last used, and moves page by page on
//! demand; for work larger than the GPU that on-demand movement is what makes it slow.
//! Two tools fix that, both for managed memory only:
//!
//! * **Prefetch** ([`Allocation::prefetch`], [`prefetch`]): `cuMemPrefetchAsync` moves the
//!   pages to a device (or the host) in stream order, before the work that needs them.
//! * **Advice** ([`Allocation::advise`], [`advise`]): `cuMemAdvise` says how memory will be
//!   used (read mostly, preferred location, accessed by a device), so the driver places
//!   and maps pages accordingly. The driver takes it on `cuMemAllocManaged` memory
//!   ([`ManagedMemoryResource`](crate::ManagedMemoryResource)) and refuses it on memory of
//!   a managed pool ([`CudaAsyncManagedMemoryResource`](crate::CudaAsyncManagedMemoryResource)):
//!   [`Error::Unsupported`].
//!
//! Memory from a resource whose [`MemoryKind`] is not [`MemoryKind::Managed`] is refused
//! with [`Error::InvalidArgument`] naming the resource, before the driver is asked.

use crate::device::{Advice, DevPtr, Location};
use crate::error::{Error, Result, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_NOT_SUPPORTED};
use crate::resource::{Allocation, MemoryKind, MemoryResource};
use crate::stream::Stream;

/// Refuses memory of `mr` unless it is managed: "`what` needs managed memory; `whose`
/// memory comes from CudaAsyncMemoryResource (device memory)".
pub fn require_managed(mr: &dyn MemoryResource, what: &str, whose: &str) -> Result<()> {
    match mr.memory_kind() {
        MemoryKind::Managed => Ok(()),
        kind => Err(Error::InvalidArgument(format!(
            "{what} needs managed memory; {whose} memory comes from {} ({} memory)",
            mr.name(),
            kind.words()
        ))),
    }
}

/// Prefetches `[ptr, ptr + bytes)`, memory of `mr`, to `to` (`None`: `mr`'s device), in
/// order on `stream` (`cuMemPrefetchAsync`). For 0 bytes, checks the arguments and does
/// nothing more.
pub fn prefetch(
    mr: &dyn MemoryResource,
    ptr: DevPtr,
    bytes: usize,
    to: Option<Location>,
    stream: &Stream,
) -> Result<()> {
    require_managed(mr, "prefetch", "this")?;
    let (backend, device) = (mr.backend(), mr.device());
    let on = prefetch_device(stream, device);
    stream.check(backend, on)?;
    let to = to.unwrap_or(Location::Device(device));
    check_location(backend, to, true)?;
    if bytes == 0 {
        return Ok(());
    }
    backend.prefetch_async(on, ptr, bytes, to, stream.handle()).map_err(|e| no_concurrent_access(e, mr, on))
}

/// The device whose context a prefetch on `stream` runs in: the stream's own. Managed
/// memory belongs to no device, and the driver asks of a prefetch's stream only that its
/// device have concurrent managed access, so a stream of any device will do (moving pages
/// to device 1 on the stream of device 1 that will read them is the usual hand-over); a
/// default stream is that of the memory's device, `device`.
pub fn prefetch_device(stream: &Stream, device: i32) -> i32 {
    stream.device_or(device)
}

/// Refuses a `location` that names a device `backend` does not have, before anything else
/// is asked (so that the arguments are checked for 0 bytes too); `used`: false where the
/// location is ignored (`Advice::ignores_location`).
fn check_location(backend: &crate::device::BackendRef, location: Location, used: bool) -> Result<()> {
    match location {
        Location::Device(d) if used => crate::resources::check_device(backend, Some(d)).map(|_| ()),
        _ => Ok(()),
    }
}

/// The driver's `CUDA_ERROR_INVALID_DEVICE` for prefetch or advice, said plainly when the
/// device has no concurrent managed access (Windows, WSL, some Jetson boards), where the
/// driver takes no prefetch, and no advice naming a GPU as preferred location or as
/// accessed by; `device`: the one the call was made in (the memory's, or a prefetch's
/// stream's).
pub(crate) fn no_concurrent_access(e: Error, mr: &dyn MemoryResource, device: i32) -> Error {
    match e {
        Error::Driver { code: CUDA_ERROR_INVALID_DEVICE, call, .. }
            if mr.backend().device_info(device).is_ok_and(|i| !i.concurrent_managed_access) =>
        {
            Error::Unsupported(format!(
                "{call}: device {} has no concurrent managed access \
                 (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0, as on Windows, WSL and some \
                 Jetson boards), so the driver takes no prefetch and no GPU as preferred location \
                 or as accessed by there; managed memory still works, migrated by the driver at \
                 each kernel launch",
                device
            ))
        }
        e => e,
    }
}

/// Gives `advice` about `[ptr, ptr + bytes)`, memory of `mr`, for `location` (ignored by
/// the read-mostly pair) (`cuMemAdvise`). For 0 bytes, checks the arguments and does
/// nothing more.
pub fn advise(
    mr: &dyn MemoryResource,
    ptr: DevPtr,
    bytes: usize,
    advice: Advice,
    location: Location,
) -> Result<()> {
    require_managed(mr, "advice", "this")?;
    check_location(mr.backend(), location, !advice.ignores_location())?;
    if bytes == 0 {
        return Ok(());
    }
    mr.backend().mem_advise(mr.device(), ptr, bytes, advice, location).map_err(|e| match e {
        // Seen on the H200 (driver 580): memory from a managed memory pool refuses advice
        // that plain managed memory (cuMemAllocManaged) takes.
        Error::Driver { code: CUDA_ERROR_NOT_SUPPORTED, name, .. } => Error::Unsupported(format!(
            "the driver does not take '{}' advice on memory from {} ({name}); memory from \
             ManagedMemoryResource takes it",
            advice.name(),
            mr.name()
        )),
        e => no_concurrent_access(e, mr, mr.device()),
    })
}

/// Where all of `[ptr, ptr + bytes)`, memory of `mr`, was last asked to be prefetched
/// (`CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION`: the request, not its completion);
/// `None` when it never was, or its parts went to different places, or for 0 bytes.
pub fn last_prefetch_location(
    mr: &dyn MemoryResource,
    ptr: DevPtr,
    bytes: usize,
) -> Result<Option<Location>> {
    require_managed(mr, "the last prefetch location", "this")?;
    if bytes == 0 {
        return Ok(None);
    }
    mr.backend().mem_range_last_prefetch_location(mr.device(), ptr, bytes)
}

impl Allocation {
    /// Prefetches the allocation to `to` (`None`: its resource's device) in order on
    /// `stream` (`None`: its own stream). [`Error::InvalidArgument`] unless it is managed
    /// memory.
    pub fn prefetch(&self, to: Option<Location>, stream: Option<&Stream>) -> Result<()> {
        let stream = stream.unwrap_or(self.stream());
        prefetch(self.resource().as_ref(), self.ptr(), self.bytes(), to, stream)
    }

    /// Gives `advice` about the whole allocation, for `location` (ignored where the
    /// driver ignores it: [`Advice::ignores_location`]). [`Error::InvalidArgument`] unless it is managed memory.
    pub fn advise(&self, advice: Advice, location: Location) -> Result<()> {
        advise(self.resource().as_ref(), self.ptr(), self.bytes(), advice, location)
    }

    /// Where the whole allocation was last asked to be prefetched; see
    /// [`last_prefetch_location`].
    pub fn last_prefetch_location(&self) -> Result<Option<Location>> {
        last_prefetch_location(self.resource().as_ref(), self.ptr(), self.bytes())
    }
}
