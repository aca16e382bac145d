//! Plain, synchronous resources: each allocation is one driver call and each free
//! another. The frees (`cuMemFree`, `cuMemFreeHost`) wait for the whole device, which
//! orders them after every use on every stream, so the stream argument needs no event.

use std::fmt;
use std::marker::PhantomData;

use crate::device::{BackendRef, DevPtr};
use crate::error::Result;
use crate::resource::{out_of_memory, MemoryKind, MemoryResource};
use crate::stream::Stream;

/// What distinguishes one plain resource from another: its driver calls.
pub trait PlainKind: Send + Sync + 'static {
    /// RMM's class name.
    const NAME: &'static str;
    /// What kind of memory it hands out.
    const KIND: MemoryKind;
    /// The allocating driver call.
    fn alloc(backend: &BackendRef, dev: i32, bytes: usize) -> Result<DevPtr>;
    /// The freeing driver call.
    fn free(backend: &BackendRef, dev: i32, ptr: DevPtr) -> Result<()>;
}

/// A resource that calls the driver for every allocation and free. Use it through its
/// aliases: [`CudaMemoryResource`], [`ManagedMemoryResource`], [`PinnedHostMemoryResource`].
///
/// Sizes are not checked on free: the driver's frees (`cuMemFree`, `cuMemFreeHost`) take
/// no size and the resource keeps no record per allocation, so a wrong size is accepted
/// and the whole allocation freed. Wrap it in a [`TrackingAdaptor`](crate::TrackingAdaptor)
/// to have wrong sizes refused.
pub struct PlainMemoryResource<K: PlainKind> {
    backend: BackendRef,
    device: i32,
    kind: PhantomData<K>,
}

/// Device memory from `cuMemAlloc` / `cuMemFree` (RMM's `cuda_memory_resource`).
/// Synchronous: every free waits for the device.
pub type CudaMemoryResource = PlainMemoryResource<Device>;
/// Managed memory from `cuMemAllocManaged` (RMM's `managed_memory_resource`), for work
/// larger than the device's memory.
pub type ManagedMemoryResource = PlainMemoryResource<Managed>;
/// Page-locked host memory from `cuMemHostAlloc` (RMM's `pinned_host_memory_resource`).
pub type PinnedHostMemoryResource = PlainMemoryResource<PinnedHost>;

/// Marker for [`CudaMemoryResource`].
#[derive(Debug)]
pub enum Device {}
/// Marker for [`ManagedMemoryResource`].
#[derive(Debug)]
pub enum Managed {}
/// Marker for [`PinnedHostMemoryResource`].
#[derive(Debug)]
pub enum PinnedHost {}

impl PlainKind for Device {
    const NAME: &'static str = "CudaMemoryResource";
    const KIND: MemoryKind = MemoryKind::Device;
    fn alloc(b: &BackendRef, dev: i32, bytes: usize) -> Result<DevPtr> {
        b.mem_alloc(dev, bytes)
    }
    fn free(b: &BackendRef, dev: i32, ptr: DevPtr) -> Result<()> {
        b.mem_free(dev, ptr)
    }
}

impl PlainKind for Managed {
    const NAME: &'static str = "ManagedMemoryResource";
    const KIND: MemoryKind = MemoryKind::Managed;
    fn alloc(b: &BackendRef, dev: i32, bytes: usize) -> Result<DevPtr> {
        b.mem_alloc_managed(dev, bytes)
    }
    fn free(b: &BackendRef, dev: i32, ptr: DevPtr) -> Result<()> {
        b.mem_free(dev, ptr)
    }
}

impl PlainKind for PinnedHost {
    const NAME: &'static str = "PinnedHostMemoryResource";
    const KIND: MemoryKind = MemoryKind::PinnedHost;
    fn alloc(b: &BackendRef, dev: i32, bytes: usize) -> Result<DevPtr> {
        b.mem_host_alloc(dev, bytes)
    }
    fn free(b: &BackendRef, dev: i32, ptr: DevPtr) -> Result<()> {
        b.mem_free_host(dev, ptr)
    }
}

impl<K: PlainKind> PlainMemoryResource<K> {
    /// On the current backend (see [`crate::device::backend`]) and `device` (the current
    /// device when `None`).
    pub fn new(device: Option<i32>) -> Result<Self> {
        let (backend, device) = super::bind(device)?;
        Self::on(backend, device)
    }

    /// On a given backend and device; [`Error::InvalidArgument`](crate::Error) naming the
    /// devices there are when `device` is not one of them.
    pub fn on(backend: BackendRef, device: i32) -> Result<Self> {
        let device = super::check_device(&backend, Some(device))?;
        Ok(PlainMemoryResource { backend, device, kind: PhantomData })
    }
}

impl<K: PlainKind> MemoryResource for PlainMemoryResource<K> {
    fn whole_allocations(&self) -> bool {
        true
    }
    fn backend(&self) -> &BackendRef {
        &self.backend
    }
    fn device(&self) -> i32 {
        self.device
    }
    fn name(&self) -> &str {
        K::NAME
    }
    fn memory_kind(&self) -> MemoryKind {
        K::KIND
    }
    fn do_allocate(&self, bytes: usize, _stream: &Stream) -> Result<DevPtr> {
        K::alloc(&self.backend, self.device, bytes).map_err(|e| out_of_memory(e, bytes, self))
    }
    fn do_deallocate(&self, ptr: DevPtr, _bytes: usize, _stream: &Stream) -> Result<()> {
        K::free(&self.backend, self.device, ptr)
    }
}

impl<K: PlainKind> fmt::Debug for PlainMemoryResource<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(device={}, {})", K::NAME, self.device, self.backend.describe())
    }
}
