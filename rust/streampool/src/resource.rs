//! The memory-resource contract and the owning [`Allocation`] guard.
//!
//! # The stream-ordered contract
//!
//! * `allocate(bytes, stream)`: the memory may be used by work enqueued on `stream` after
//!   the call, and by the host after that stream is synchronised.
//! * `deallocate(ptr, bytes, stream)`: the memory may be reused by any work ordered after
//!   everything enqueued on `stream` before the call. Reuse on the same stream is free;
//!   reuse on another stream needs an event wait or the free's completion.
//! * `allocate(0, s)` returns 0 (the null pointer) and `deallocate(0, 0, s)` does nothing.
//!   Every other allocation is aligned to at least [`ALIGNMENT`] bytes.
//! * A resource is bound to one backend and device; a stream of another is refused.
//! * Two live allocations never overlap.
//!
//! Resources implement [`MemoryResource::do_allocate`] and
//! [`MemoryResource::do_deallocate`]; callers use the provided
//! [`MemoryResource::allocate`] and [`MemoryResource::deallocate`], which apply the
//! checks above once for every resource.

use std::fmt;
use std::sync::Arc;

use crate::device::{BackendRef, DevPtr};
use crate::error::{record_if_failed, Error, Result, CUDA_ERROR_INVALID_VALUE};
use crate::stream::Stream;

/// The smallest alignment of every non-empty allocation.
pub const ALIGNMENT: usize = 256;

/// The deepest chain of resources that may be built: [`MemoryResource::depth`] of any
/// resource is at most this.
///
/// Why a limit: every allocation and free recurses through the chain (each level's
/// frame holds what it does after its upstream returns), and so does dropping it; a deep
/// enough chain overflows the thread's stack, which aborts the process. Measured (the
/// test `the_deepest_chain_allowed_allocates_frees_and_drops_on_a_2mib_stack`), a level
/// of an allocation or a free takes at most about 1.2 KiB of stack in a debug build (the
/// logging adaptor; about 0.9 KiB for a mix of every kind), so 256 levels take under
/// 300 KiB: a seventh of the 2 MiB a Rust thread gets by default, leaving room for the
/// caller and for the driver's call at the bottom. A Python thread gets 8 MiB on Linux
/// unless `threading.stack_size` says otherwise; the Python tests run the deepest chain,
/// through the optimised extension and Python's own frames, on a 2 MiB one. No real
/// stack of adaptors comes near 256 levels.
pub const MAX_DEPTH: usize = 256;

/// The depth of a resource over `upstreams` (1 + the deepest), or
/// [`Error::InvalidArgument`] naming `name`, the depth and [`MAX_DEPTH`] when that is
/// too deep. Every resource that calls other resources calls this in its constructor.
pub fn check_depth<'a>(name: &str, upstreams: impl IntoIterator<Item = &'a ResourceRef>) -> Result<usize> {
    let depth = 1 + upstreams.into_iter().map(|u| u.depth()).max().unwrap_or(0);
    if depth > MAX_DEPTH {
        return Err(Error::invalid(format!(
            "{name}: this resource would be {depth} resources deep (itself and the chain below it), \
             above the limit of {MAX_DEPTH}: every call recurses through the chain, and a deeper one \
             could overflow the thread's stack"
        )));
    }
    Ok(depth)
}

/// What kind of memory a resource hands out (DLPack and CUDA array interface exports
/// report it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Device memory.
    Device,
    /// Managed (unified) memory, usable from host and device.
    Managed,
    /// Page-locked host memory.
    PinnedHost,
}

impl MemoryKind {
    /// "device", "managed", "pinned host": for messages.
    pub fn words(self) -> &'static str {
        match self {
            MemoryKind::Device => "device",
            MemoryKind::Managed => "managed",
            MemoryKind::PinnedHost => "pinned host",
        }
    }
}

/// What a resource holds from the device, for reports of reserved against live bytes
/// ([`MemoryResource::footprint`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Bytes held now.
    pub reserved_bytes: usize,
    /// The most bytes held since the resource was made or since
    /// [`MemoryResource::reset_peak_footprint`].
    pub peak_reserved_bytes: usize,
    /// Device synchronisations the resource made so far, where it counts them.
    pub synchronizations: Option<u64>,
    /// Waits it inserted into one stream on another's work so far, where it counts them.
    pub waits: Option<u64>,
    /// Events it recorded so far (`cuEventRecord`), where it counts them.
    pub events_recorded: Option<u64>,
    /// Events it queried so far (`cuEventQuery`), where it counts them.
    pub event_queries: Option<u64>,
    /// Times it grew from its upstream so far, where it counts them.
    pub growths: Option<u64>,
}

/// A source of stream-ordered memory. See the module docs for the contract.
///
/// Implementations are `Send + Sync`: any thread may allocate, and any thread may free
/// what another allocated.
pub trait MemoryResource: Send + Sync + fmt::Debug {
    /// The backend (CUDA driver or a simulated device) the resource is bound to.
    fn backend(&self) -> &BackendRef;
    /// The device ordinal the resource is bound to.
    fn device(&self) -> i32;
    /// The RMM-style class name, e.g. `CudaAsyncMemoryResource`.
    fn name(&self) -> &str;
    /// What kind of memory this resource hands out.
    fn memory_kind(&self) -> MemoryKind;

    /// How many resources a call may pass through, this one included: 1 for a resource
    /// that calls no other, and 1 + the deepest of the resources it calls for one that
    /// does (an adaptor, a pool over an upstream, a binning resource's bins).
    ///
    /// Every call recurses through the chain, so its depth bounds the stack a call takes;
    /// a resource that wraps others refuses, at construction, to be deeper than
    /// [`MAX_DEPTH`] (see [`check_depth`]).
    fn depth(&self) -> usize {
        1
    }

    /// What the resource (for an adaptor: the pool beneath it) holds from the device:
    /// `None` for resources that do not hold memory beyond what they hand out (the plain
    /// ones) or cannot tell. The sharded pool and the driver's pool report it.
    fn footprint(&self) -> Option<Footprint> {
        None
    }

    /// Whether each allocation this resource hands out is a whole allocation of the driver,
    /// not a piece of a larger one that it suballocates: what sharing memory with another
    /// process needs ([`crate::ipc::export_from`]), since the driver shares whole
    /// allocations. The driver's pool: yes; an adaptor that passes allocations through:
    /// as its upstream; pools, bins and others: no (the default).
    fn whole_allocations(&self) -> bool {
        false
    }

    /// Whether the resource can allocate on a stream that is capturing a CUDA graph
    /// ([`Stream::is_capturing`]): the driver's pool can (`cuMemAllocFromPoolAsync` on a
    /// capturing stream makes an allocation node of the graph, whose memory the graph owns
    /// and keeps at one address for every launch), and so can an adaptor over it and the
    /// sharded pool over it (which passes captured allocations to its upstream). Pools,
    /// bins and plain resources cannot: a block freed in the capture would be handed out
    /// again while the graph, launched later, still uses it, and `cuMemAlloc` is refused
    /// during a capture. Those refuse such an allocation, saying so (the default). A stream
    /// is capturing for the resources when it was wrapped so ([`Stream::capturing`],
    /// [`Stream::borrowed_for_call`]): the allocator entry points and the Python binding's
    /// per-call wraps of other libraries' streams ask the driver; a stream wrapped earlier
    /// is not asked again.
    fn serves_capture(&self) -> bool {
        false
    }

    /// Starts a new peak for [`Footprint::peak_reserved_bytes`] where the resource can
    /// (the driver's pool: its reserved high-water mark is reset to what it holds now).
    fn reset_peak_footprint(&self) {}

    /// The implementer's hook behind [`MemoryResource::allocate`], which calls it only
    /// after its checks: `0 < bytes <= isize::MAX`, and `stream` of this resource's backend
    /// and device. Call `allocate`, never this: an implementation may rely on the checks
    /// (the sharded pool rounds `bytes` up without checking for overflow).
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr>;
    /// The implementer's hook behind [`MemoryResource::deallocate`], called only after its
    /// checks (`ptr != 0`, `0 < bytes <= isize::MAX`, `stream` as for `do_allocate`): call
    /// `deallocate`.
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()>;

    /// Allocates without waiting for anything (no contended lock, no driver call that can
    /// wait: an event's record or query never waits for the device, a synchronisation or
    /// an upstream allocation may): `Some(result)` when that settles the request, `None`
    /// when the caller must call
    /// [`MemoryResource::allocate`] (from Python: after releasing the GIL, which the fast
    /// path keeps, since releasing and retaking it costs more than the allocation).
    /// Applies the same checks as `allocate`. The default never settles anything.
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        let _ = (bytes, stream);
        None
    }

    /// [`MemoryResource::try_allocate`]'s counterpart for frees.
    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        let _ = (ptr, bytes, stream);
        None
    }

    /// Allocates `bytes` bytes for use on `stream`; 0 bytes gives the null pointer.
    ///
    /// Resources keep this method; one with a fast path of its own may override it, and
    /// then ends in [`checked_allocate`] for everything that path does not settle.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        checked_allocate(self, bytes, stream)
    }

    /// Frees `ptr` (of `bytes` bytes, as allocated) for reuse after the work enqueued on
    /// `stream` so far. `deallocate(0, 0, s)` does nothing. (Overridden, like `allocate`,
    /// only by a resource with a fast path, which ends in [`checked_deallocate`].)
    fn deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        checked_deallocate(self, ptr, bytes, stream)
    }
}

/// What [`MemoryResource::allocate`] does: the checks of [`settle_allocate`], then
/// `do_allocate`.
pub fn checked_allocate<R: MemoryResource + ?Sized>(mr: &R, bytes: usize, stream: &Stream) -> Result<DevPtr> {
    if let Some(settled) = settle_allocate(mr, bytes, stream) {
        return settled;
    }
    mr.do_allocate(bytes, stream)
}

/// What [`MemoryResource::deallocate`] does: the checks of [`settle_deallocate`], then
/// `do_deallocate`, with the driver's word for a pointer it does not know made plain.
pub fn checked_deallocate<R: MemoryResource + ?Sized>(
    mr: &R,
    ptr: DevPtr,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    if let Some(settled) = settle_deallocate(mr, ptr, bytes, stream) {
        return settled;
    }
    mr.do_deallocate(ptr, bytes, stream).map_err(|e| match e {
        // What the driver says of a pointer it did not hand out, or already freed.
        Error::Driver { call, code: CUDA_ERROR_INVALID_VALUE, name, .. } => Error::InvalidPointer(format!(
            "{ptr:#x} was not allocated by this {}, or was already freed ({call}: {name})",
            mr.name()
        )),
        e => e,
    })
}

/// The checks every allocation passes before a resource sees it: `Some` when they settle
/// it (a zero size gives the null pointer; an impossible size or a stream of another
/// device or backend is an error).
pub fn settle_allocate<R: MemoryResource + ?Sized>(
    mr: &R,
    bytes: usize,
    stream: &Stream,
) -> Option<Result<DevPtr>> {
    if bytes == 0 {
        return Some(Ok(0));
    }
    if bytes > isize::MAX as usize {
        return Some(Err(Error::OutOfMemory {
            requested: bytes,
            available: None,
            resource: mr.name().into(),
        }));
    }
    if stream.is_capturing() && !mr.serves_capture() {
        return Some(Err(capture_refused(mr, "allocate")));
    }
    stream.check(mr.backend(), mr.device()).err().map(Err)
}

/// A resource that cannot serve a CUDA graph capture, asked to on a capturing stream.
#[cold]
pub fn capture_refused<R: MemoryResource + ?Sized>(mr: &R, what: &str) -> Error {
    Error::InvalidStream(format!(
        "{} cannot {what} on a stream that is capturing a CUDA graph: memory it frees is handed \
         out again while the graph, launched later, still uses it. During a capture, make the \
         device's resource the driver's pool (CudaAsyncMemoryResource), an adaptor over it, or a \
         ShardedPoolMemoryResource over it, which passes captured allocations to it \
         (docs/frameworks.md, \"CUDA graphs\")",
        mr.name()
    ))
}

/// The checks every free passes before a resource sees it: `Some` when they settle it.
pub fn settle_deallocate<R: MemoryResource + ?Sized>(
    mr: &R,
    ptr: DevPtr,
    bytes: usize,
    stream: &Stream,
) -> Option<Result<()>> {
    match (ptr, bytes) {
        (0, 0) => Some(Ok(())),
        (0, _) => {
            Some(Err(Error::InvalidPointer(format!("null pointer freed with size {bytes} (expected 0)"))))
        }
        (_, 0) => Some(Err(Error::InvalidPointer(format!(
            "pointer {ptr:#x} freed with size 0; pass the size it was allocated with"
        )))),
        // No allocation is this large (`settle_allocate` refuses them).
        (_, b) if b > isize::MAX as usize => Some(Err(Error::InvalidPointer(format!(
            "pointer {ptr:#x} freed with size {bytes}, larger than any allocation; pass the size it was \
             allocated with"
        )))),
        _ if stream.is_capturing() && !mr.serves_capture() => Some(Err(capture_refused(mr, "free"))),
        _ => stream.check(mr.backend(), mr.device()).err().map(Err),
    }
}

/// A shared handle to any resource.
pub type ResourceRef = Arc<dyn MemoryResource>;

/// Memory from a resource, freed on its stream when dropped (or by [`Allocation::free`]).
///
/// The allocation keeps its stream [resolved](Stream::resolved): one made on the
/// per-thread default stream keeps the allocating thread's, and every later use through
/// [`Allocation::stream`] is ordered with that stream from any thread. On the allocating
/// thread that is the per-thread stream itself; on another thread (which cannot name it)
/// the legacy default stream, whose work is ordered after all earlier work on every
/// blocking stream, per-thread ones included. So dropped on another thread, such an
/// allocation is freed on the legacy default stream, with no wait.
pub struct Allocation {
    mr: ResourceRef,
    ptr: DevPtr,
    bytes: usize,
    stream: Stream,
}

impl Allocation {
    /// Allocates `bytes` from `mr` on `stream`. A resource whose backend is closed (made
    /// under a simulated device that was exited) is refused with the backend's error, even
    /// where the resource could serve the request from memory it holds.
    pub fn new(mr: ResourceRef, bytes: usize, stream: Stream) -> Result<Self> {
        mr.backend().check_open()?;
        let ptr = mr.allocate(bytes, &stream)?;
        Ok(Allocation { mr, ptr, bytes, stream: stream.resolved() })
    }

    /// [`Allocation::new`] without waiting for anything (see
    /// [`MemoryResource::try_allocate`]); `None` when the caller must use `new`.
    pub fn try_new(mr: &ResourceRef, bytes: usize, stream: &Stream) -> Option<Result<Self>> {
        if let Err(closed) = mr.backend().check_open() {
            return Some(Err(closed));
        }
        let ptr = match mr.try_allocate(bytes, stream)? {
            Ok(ptr) => ptr,
            Err(e) => return Some(Err(e)),
        };
        Some(Ok(Allocation { mr: mr.clone(), ptr, bytes, stream: stream.clone().resolved() }))
    }

    /// Frees now without waiting for anything, where the resource can: `Some(result)`
    /// once freed (or refused), `None` when the caller must drop it instead (which may
    /// wait).
    pub fn try_release(&mut self) -> Option<Result<()>> {
        if self.ptr == 0 || crate::device::forked() {
            return Some(self.release());
        }
        // A stream known destroyed is never handed to the resource (which could record an
        // event on it): the full path frees such memory otherwise.
        if self.stream.known_destroyed() {
            return None;
        }
        let result = self.mr.try_deallocate(self.ptr, self.bytes, &self.stream)?;
        self.ptr = 0;
        Some(result)
    }

    /// The address (0 for an empty allocation).
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// The size in bytes, as asked.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The stream the memory is ordered on, resolved (see [`Stream::resolved`]): work
    /// that the calling thread enqueues on it, or orders after it through an event recorded
    /// on it, is ordered with every earlier use of the memory, whichever thread made it.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The resource it came from.
    pub fn resource(&self) -> &ResourceRef {
        &self.mr
    }

    /// Moves the memory to `stream` (RMM's `device_buffer::set_stream`): from now on it is
    /// ordered on `stream`, and freed there. Unlike RMM's, the move is ordered itself:
    /// `stream`'s later work waits for what was enqueued on the old stream so far (an event
    /// recorded there), so a consumer may use the memory and free it on its own stream
    /// with nothing more. An error, and nothing changed, for a stream of another device or
    /// backend. A move to the stream it is on already records nothing.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streampool::{device::{sim::SimDevice, BackendRef}, Allocation, CudaAsyncMemoryResource, Stream};
    /// let sim = SimDevice::new(1 << 30);
    /// let backend: BackendRef = sim.clone();
    /// let mr = Arc::new(CudaAsyncMemoryResource::on(backend.clone(), 0, Default::default())?);
    /// let (producer, consumer) = (Stream::create(&backend, 0, false)?, Stream::create(&backend, 0, false)?);
    /// let mut chunk = Allocation::new(mr, 1 << 20, producer)?;
    /// // ... the producer fills `chunk` on its stream, then hands it over:
    /// chunk.set_stream(consumer)?;
    /// drop(chunk); // freed on the consumer's stream, after the producer's work
    /// sim.run();
    /// assert!(sim.races().is_empty());
    /// # Ok::<(), streampool::Error>(())
    /// ```
    pub fn set_stream(&mut self, stream: Stream) -> Result<()> {
        let (backend, device) = (self.mr.backend(), self.mr.device());
        stream.check(backend, device)?;
        if self.ptr != 0 && stream.handle() != self.stream.handle() {
            stream.wait_for(backend, device, &self.stream, device)?;
        }
        self.stream = stream.resolved();
        Ok(())
    }

    /// Gives the memory up without freeing it: the resource, the address, the size and the
    /// stream, for the caller to free (`mr.deallocate(ptr, bytes, &stream)`) or hand on.
    /// Nothing frees it otherwise.
    pub fn into_raw(mut self) -> (ResourceRef, DevPtr, usize, Stream) {
        let ptr = std::mem::take(&mut self.ptr); // the drop that follows frees nothing
        (self.mr.clone(), ptr, self.bytes, self.stream.clone())
    }

    /// Copies `src` to the start of the memory, on its stream (after the work enqueued
    /// there before), and waits for the copy: `src` may change once this returns. An
    /// error, and nothing copied, when `src` is longer than the allocation.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streampool::{device::{sim::SimDevice, BackendRef}, Allocation, CudaAsyncMemoryResource, Stream};
    /// let sim = SimDevice::new(1 << 30);
    /// let backend: BackendRef = sim.clone();
    /// let mr = Arc::new(CudaAsyncMemoryResource::on(backend.clone(), 0, Default::default())?);
    /// let memory = Allocation::new(mr, 4, Stream::create(&backend, 0, false)?)?;
    /// memory.copy_from_host(&[1, 2, 3, 4])?;
    /// let mut back = [0u8; 4];
    /// memory.copy_to_host(&mut back)?;
    /// assert_eq!(back, [1, 2, 3, 4]);
    /// # Ok::<(), streampool::Error>(())
    /// ```
    pub fn copy_from_host(&self, src: &[u8]) -> Result<()> {
        self.copy_host(src.as_ptr() as DevPtr, src.len(), false)
    }

    /// Copies the first `dst.len()` bytes of the memory into `dst`, on its stream (after
    /// the work enqueued there before), and waits for the copy. An error, and nothing
    /// copied, when `dst` is longer than the allocation.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.copy_host(dst.as_mut_ptr() as DevPtr, dst.len(), true)
    }

    fn copy_host(&self, host: DevPtr, bytes: usize, to_host: bool) -> Result<()> {
        if bytes > self.bytes {
            let what = if to_host { "into" } else { "from" };
            return Err(Error::invalid(format!(
                "a copy of {bytes} bytes {what} host memory is longer than the allocation ({} bytes)",
                self.bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        let (backend, device) = (self.mr.backend(), self.mr.device());
        let (dst, src) = if to_host { (host, self.ptr) } else { (self.ptr, host) };
        // SAFETY: the host side is a slice of `bytes` bytes, borrowed (mutably when it is
        // written) until this returns, after the synchronisation below (of the whole
        // device, should the stream's fail); the device side is this live allocation, at
        // least `bytes` long.
        unsafe { backend.memcpy_async(device, dst, src, bytes, self.stream.handle())? };
        crate::device::synchronize_after_copy(backend, device, self.stream.handle())
    }

    /// Frees now, on its stream, and reports a failure (dropping swallows it).
    pub fn free(mut self) -> Result<()> {
        // `release` leaves a null pointer, so the drop that follows frees nothing again;
        // it does release the resource and the stream (forgetting `self` would leak them).
        self.release()
    }

    /// Frees now, as [`free`](Self::free); on a failure the error, and the allocation
    /// back, not freed (a resource that refuses a free changes nothing), for the caller to
    /// keep and free again. `None` with the error when the resource refused the pointer as
    /// not its own ([`Error::InvalidPointer`]: freed by other means already), which no
    /// retry would change.
    #[allow(clippy::result_large_err)] // the allocation itself comes back in it
    pub fn try_free(mut self) -> std::result::Result<(), (Option<Allocation>, Error)> {
        let ptr = self.ptr;
        self.release().map_err(|e| match e {
            Error::InvalidPointer(_) => (None, e),
            e => {
                self.ptr = ptr;
                (Some(self), e)
            }
        })
    }

    fn release(&mut self) -> Result<()> {
        let ptr = std::mem::take(&mut self.ptr);
        // In a forked child the memory is the parent's: let go of, never given back.
        if ptr == 0 || crate::device::forked() {
            return Ok(());
        }
        // Its stream went first: a borrowed one destroyed by its owner, or one that the
        // collector dropped before the buffer while breaking a reference cycle (the handle is
        // never handed to the driver again). Once the device is synchronised nothing uses
        // the memory any more (the stream's last work included), and the legacy default
        // stream frees it.
        if self.stream.known_destroyed() {
            self.mr.backend().ctx_synchronize(self.mr.device())?;
            return self.mr.deallocate(ptr, self.bytes, &Stream::legacy());
        }
        self.mr.deallocate(ptr, self.bytes, &self.stream)
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // A failure here (the driver torn down at process exit, a closed simulated
        // device) has nobody to report to, and must not panic: it is recorded.
        let (ptr, bytes) = (self.ptr, self.bytes);
        let released = self.release();
        record_if_failed(
            || format!("dropping an Allocation of {bytes} bytes at {ptr:#x} from {}", self.mr.name()),
            released,
        );
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("stream", &self.stream)
            .field("resource", &self.mr.name())
            .finish()
    }
}

/// Turns the driver's out-of-memory error into [`Error::OutOfMemory`], naming the size
/// asked and what the device had free (for device and managed memory: pinned host memory
/// is not limited by the device, so there `available` is unknown); other errors pass
/// through. An [`Error::OutOfMemory`] from the backend itself (the simulated device's
/// host refusing memory) already names what limited the request, and keeps it; a user's
/// allocate function's own error ([`Error::CallbackOutOfMemory`]) passes through, to be
/// raised as it was.
pub(crate) fn out_of_memory(e: Error, requested: usize, mr: &dyn MemoryResource) -> Error {
    if matches!(e, Error::OutOfMemory { .. }) {
        return crate::adaptors::as_own_oom(e, requested, mr);
    }
    if !e.is_out_of_memory() || matches!(e, Error::CallbackOutOfMemory(_)) {
        return e;
    }
    let available = match mr.memory_kind() {
        MemoryKind::Device | MemoryKind::Managed => {
            mr.backend().mem_get_info(mr.device()).ok().map(|(free, _)| free)
        }
        MemoryKind::PinnedHost => None,
    };
    // As much free as asked, yet refused: the driver takes device memory in units of 2 MiB
    // or more (its pools, cuMemAlloc's pages), or the free memory is in pieces.
    let resource = if crate::error::plausible_available(available).is_some_and(|a| a >= requested) {
        format!(
            "{} (the device's free memory is not in a piece of that size that the driver can give: it \
             takes device memory in units of 2 MiB or more)",
            mr.name()
        )
    } else {
        mr.name().to_string()
    };
    Error::OutOfMemory { requested, available, resource }
}
