//! The driver's stream-ordered pool (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`), of
//! device memory ([`CudaAsyncMemoryResource`]) or, with a CUDA 13 driver, of managed memory
//! ([`CudaAsyncManagedMemoryResource`]). One implementation serves both.

use std::fmt;
use std::ops::Deref;

use crate::device::{BackendRef, DevPtr, DeviceInfo, PoolAttr, PoolProps, RawPool};
use crate::error::{Error, Result, CUDA_ERROR_INVALID_VALUE};
use crate::resource::{out_of_memory, Footprint, MemoryKind, MemoryResource};
use crate::stream::Stream;

/// Options that make [`CudaAsyncMemoryResource`] (or [`CudaAsyncManagedMemoryResource`])
/// create a pool of its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AsyncPoolOptions {
    /// Bytes to reserve up front (allocated and freed once at creation).
    pub initial_pool_size: Option<usize>,
    /// Bytes the pool keeps at a synchronisation; default: all of them (`u64::MAX`).
    pub release_threshold: Option<usize>,
    /// Allow exporting the pool's memory to other processes (POSIX file descriptors). Not
    /// for managed pools.
    pub enable_ipc: bool,
    /// Other devices whose work may read and write the pool's memory
    /// ([`CudaAsyncMemoryResource::set_peer_access`]). `Some`, even of no device, makes a
    /// pool of its own: granting access to the device's shared pool later would open it
    /// behind every other library's back.
    pub peer_access: Option<Vec<i32>>,
}

impl AsyncPoolOptions {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// The recommended default resource: the CUDA driver's stream-ordered pool (RMM's
/// `cuda_async_memory_resource`).
///
/// * With no options it allocates from the device's *current* pool, so its memory is
///   shared with every library that uses the driver's pool (PyTorch's and CuPy's async
///   backends, cuDF through RMM's async resource). When that pool is the device's
///   default pool, its release threshold is raised to the maximum: the default of 0
///   hands all free memory back to the system at every synchronisation, which makes the
///   next allocations slow. A current pool that someone else has set is never changed.
/// * With options it creates and owns a pool (release threshold: the maximum unless
///   given; `initial_pool_size` primes it; `enable_ipc` makes it exportable), destroyed
///   with the resource.
/// * [`CudaAsyncMemoryResource::view`] allocates from a pool someone else owns (RMM's
///   `cuda_async_view_memory_resource`) and never destroys it.
///
/// On out-of-memory it synchronises the allocating stream once (so frees still in
/// flight on it return to the pool) and retries before failing.
///
/// Sizes are not checked on free: the driver's free (`cuMemFreeAsync`) takes no size and
/// the resource keeps no record per allocation, so `deallocate(p, n)` with a wrong `n` is
/// accepted and frees the whole allocation. Wrap it in a
/// [`TrackingAdaptor`](crate::TrackingAdaptor) to have wrong sizes refused.
///
/// ```no_run
/// use streampool::{CudaAsyncMemoryResource, MemoryResource, Stream};
/// let mr = CudaAsyncMemoryResource::new(None, Default::default())?;
/// let stream = Stream::legacy();
/// let ptr = mr.allocate(1 << 20, &stream)?;
/// mr.deallocate(ptr, 1 << 20, &stream)?;
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct CudaAsyncMemoryResource {
    backend: BackendRef,
    device: i32,
    pool: RawPool,
    owns_pool: bool,
    managed: bool,
    name: &'static str,
}

/// The first driver version with stream-ordered managed pools.
const MANAGED_POOLS_DRIVER: i32 = 13000;
const MANAGED_NAME: &str = "CudaAsyncManagedMemoryResource";

impl CudaAsyncMemoryResource {
    /// On the current backend and `device` (the current device when `None`).
    pub fn new(device: Option<i32>, options: AsyncPoolOptions) -> Result<Self> {
        let (backend, device) = super::bind(device)?;
        Self::on(backend, device, options)
    }

    /// On a given backend and device.
    pub fn on(backend: BackendRef, device: i32, options: AsyncPoolOptions) -> Result<Self> {
        Self::build(backend, device, options, false)
    }

    /// The driver's stream-ordered pool of managed memory (see
    /// [`CudaAsyncManagedMemoryResource`], which wraps what this returns).
    pub fn managed(backend: BackendRef, device: i32, options: AsyncPoolOptions) -> Result<Self> {
        Self::build(backend, device, options, true)
    }

    fn build(backend: BackendRef, device: i32, options: AsyncPoolOptions, managed: bool) -> Result<Self> {
        let info = backend.device_info(device)?;
        if managed {
            check_managed_requirements(&backend, &info, &options)?;
        }
        if !info.memory_pools {
            return Err(Error::Unsupported(format!(
                "device {device} ({}) does not support the driver's memory pools; use {}",
                info.name,
                if managed { "ManagedMemoryResource" } else { "CudaMemoryResource" }
            )));
        }
        let name = if managed { MANAGED_NAME } else { "CudaAsyncMemoryResource" };
        if options.is_default() {
            let pool = backend.pool_current(device, managed)?;
            if pool == backend.pool_default(device, managed)? {
                backend.pool_set_attr(device, pool, PoolAttr::ReleaseThreshold, u64::MAX)?;
            }
            return Ok(Self { backend, device, pool, owns_pool: false, managed, name });
        }
        if options.enable_ipc && !info.posix_fd_ipc {
            return Err(Error::Unsupported(format!(
                "device {device} ({}) cannot export pool memory through POSIX file descriptors",
                info.name
            )));
        }
        let props = PoolProps { posix_fd_ipc: options.enable_ipc, managed };
        let pool = backend.pool_create(device, &props)?;
        let mr = Self { backend, device, pool, owns_pool: true, managed, name };
        let threshold = options.release_threshold.map_or(u64::MAX, |t| t as u64);
        mr.backend.pool_set_attr(device, pool, PoolAttr::ReleaseThreshold, threshold)?;
        for &peer in options.peer_access.iter().flatten() {
            mr.set_peer_access(peer, true)?;
        }
        if let Some(init) = options.initial_pool_size.filter(|&n| n > 0) {
            let stream = Stream::legacy();
            let ptr = mr.allocate(init, &stream)?;
            mr.deallocate(ptr, init, &stream)?;
            mr.backend.stream_synchronize(device, stream.handle())?;
        }
        Ok(mr)
    }

    /// A resource over a pool someone else owns (RMM's `cuda_async_view_memory_resource`)
    /// that allocates for `device`; the pool is never destroyed here.
    ///
    /// `device`: the device the pool lies on; with `None`, the one the driver says it lies
    /// on (the only device with access to it, or the one whose current or default pool it
    /// is), else the current device. A device's current or default managed pool makes
    /// a view of managed memory ([`MemoryKind::Managed`]). The pool is checked to be
    /// valid, and a pool of another device than the one given is refused
    /// ([`Error::InvalidArgument`] naming that device), since the view's buffers would say
    /// `device` while their memory lies elsewhere, and so is a pool that `device` cannot use.
    pub fn view(backend: BackendRef, device: Option<i32>, pool: RawPool) -> Result<Self> {
        if pool == 0 {
            return Err(Error::invalid("pool handle 0 (null) is not a memory pool"));
        }
        let asker = super::check_device(&backend, device)?;
        backend.pool_get_attr(asker, pool, PoolAttr::ReleaseThreshold).map_err(|e| {
            Error::invalid(format!("{pool:#x} is not a valid memory pool handle on device {asker} ({e})"))
        })?;
        let managed_home = Self::managed_home(&backend, pool);
        let home = match managed_home {
            Some(d) => Some(d),
            None => Self::home_device(&backend, asker, pool)?,
        };
        let device = home.filter(|_| device.is_none()).unwrap_or(asker);
        let refuse = |lies: String| {
            Err(Error::invalid(format!(
                "memory pool {pool:#x} {lies}, so a view of it cannot allocate for device {device}"
            )))
        };
        match home {
            Some(home) if home != device => {
                return refuse(format!("lies on device {home}: give device={home} (or no device)"));
            }
            None if matches!(backend.pool_get_access(device, pool, device), Ok(false)) => {
                return refuse("is another device's, and not open to this one".to_owned());
            }
            _ => {}
        }
        Ok(Self {
            backend,
            device,
            pool,
            owns_pool: false,
            managed: managed_home.is_some(),
            name: "CudaAsyncViewMemoryResource",
        })
    }

    /// The device whose current or default *managed* pool `pool` is, if any (a CUDA 13
    /// driver's): a view of it hands out managed memory, as RMM's
    /// `cuda_async_managed_memory_resource`, a view of the default one, does. Drivers
    /// without managed pools answer with errors, read as no. Another managed pool (one
    /// someone created) is not recognised: the driver tells a pool's allocation type only
    /// from CUDA 13.2 on.
    fn managed_home(backend: &BackendRef, pool: RawPool) -> Option<i32> {
        let is = |p: Result<RawPool>| p.is_ok_and(|p| p == pool);
        (0..backend.device_count().ok()?)
            .find(|&d| is(backend.pool_current(d, true)) || is(backend.pool_default(d, true)))
    }

    /// The device that device pool `pool` lies on, as far as the driver tells (asked from
    /// `asker`'s context): the one device that can use it (`cuMemPoolGetAccess`), or, where
    /// it is open to peers, the one whose current or default pool it is. None when the
    /// driver does not say (no device can use it, a pool open to peers that no device has
    /// as its current or default, or a pool whose access cannot be read).
    fn home_device(backend: &BackendRef, asker: i32, pool: RawPool) -> Result<Option<i32>> {
        let mut users = Vec::new();
        for device in 0..backend.device_count()? {
            match backend.pool_get_access(asker, pool, device) {
                Ok(true) => users.push(device),
                Ok(false) => {}
                Err(_) => return Ok(None),
            }
        }
        if let [only] = users[..] {
            return Ok(Some(only));
        }
        for &device in &users {
            if backend.pool_current(device, false)? == pool || backend.pool_default(device, false)? == pool {
                return Ok(Some(device));
            }
        }
        Ok(None)
    }

    /// The driver pool handle (`CUmemoryPool` as an integer).
    pub fn pool_handle(&self) -> RawPool {
        self.pool
    }

    /// True when this resource created the pool and destroys it when dropped.
    pub fn owns_pool(&self) -> bool {
        self.owns_pool
    }

    /// Bytes the pool holds from the system (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub fn reserved_bytes(&self) -> Result<usize> {
        self.attr(PoolAttr::ReservedMemCurrent)
    }

    /// Bytes handed out by the pool (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`); for a shared
    /// pool this includes other libraries' allocations.
    pub fn used_bytes(&self) -> Result<usize> {
        self.attr(PoolAttr::UsedMemCurrent)
    }

    /// The pool's release threshold in bytes.
    pub fn release_threshold(&self) -> Result<u64> {
        self.backend.pool_get_attr(self.device, self.pool, PoolAttr::ReleaseThreshold)
    }

    /// Releases free memory back to the system until the pool holds at most `keep_bytes`
    /// (`cuMemPoolTrimTo`), so that allocators that do not use the pool (cuBLAS
    /// workspaces, NCCL, plain `cudaMalloc` users) can have it.
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        self.backend.pool_trim_to(self.device, self.pool, keep_bytes)
    }

    /// Grants (or withdraws) read-write access to the pool's memory, present and future, from
    /// work on device `peer` (`cuMemPoolSetAccess`), so that kernels and copies there may use
    /// it. Pool memory does not follow the context-wide `cuCtxEnablePeerAccess`: this is the
    /// switch. `peer` must exist, differ from the pool's own device (which always has access)
    /// and, to be granted, be able to reach it (`cuDeviceCanAccessPeer`); otherwise
    /// [`Error::InvalidArgument`] naming both devices.
    pub fn set_peer_access(&self, peer: i32, enabled: bool) -> Result<()> {
        let count = self.backend.device_count()?;
        let device = self.device;
        if !(0..count).contains(&peer) {
            return Err(Error::invalid(format!(
                "peer device {peer} {}; the pool is on device {device}",
                super::no_such_device(&self.backend.describe(), count)
            )));
        }
        if peer == device {
            return Err(Error::invalid(format!(
                "device {peer} is the pool's own device, which always has access; peer access names other devices"
            )));
        }
        if enabled && !self.backend.device_can_access_peer(peer, device)? {
            return Err(Error::invalid(format!(
                "device {peer} cannot access memory of device {device} (the driver reports no peer path \
                 between them: cuDeviceCanAccessPeer); copy the data to device {peer} instead \
                 (DeviceBuffer.copy_to_device)"
            )));
        }
        self.backend.pool_set_access(device, self.pool, peer, enabled)
    }

    /// The devices other than the pool's own that may read and write its memory
    /// (`cuMemPoolGetAccess`), in order.
    pub fn peer_access(&self) -> Result<Vec<i32>> {
        let mut peers = Vec::new();
        for peer in (0..self.backend.device_count()?).filter(|&d| d != self.device) {
            if self.backend.pool_get_access(self.device, self.pool, peer)? {
                peers.push(peer);
            }
        }
        Ok(peers)
    }

    fn attr(&self, attr: PoolAttr) -> Result<usize> {
        let v = self.backend.pool_get_attr(self.device, self.pool, attr)?;
        Ok(usize::try_from(v).unwrap_or(usize::MAX))
    }
}

impl MemoryResource for CudaAsyncMemoryResource {
    fn backend(&self) -> &BackendRef {
        &self.backend
    }
    fn device(&self) -> i32 {
        self.device
    }
    fn name(&self) -> &str {
        self.name
    }
    fn memory_kind(&self) -> MemoryKind {
        if self.managed {
            MemoryKind::Managed
        } else {
            MemoryKind::Device
        }
    }
    fn whole_allocations(&self) -> bool {
        true
    }
    /// Device memory: an allocation on a capturing stream is a node of the graph. (Graph
    /// allocations are device memory; a managed pool refuses.)
    fn serves_capture(&self) -> bool {
        !self.managed
    }

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let (b, dev, s) = (&self.backend, self.device, stream.handle());
        match b.pool_alloc_async(dev, self.pool, bytes, s) {
            // A capture may not synchronise its stream (that would invalidate it), nor
            // trim the pool.
            Err(e) if e.is_out_of_memory() && stream.is_capturing() => Err(out_of_memory(e, bytes, self)),
            Err(e) if e.is_out_of_memory() => {
                // Frees still in flight on this stream return to the pool once it drains.
                b.stream_synchronize(dev, s)?;
                b.pool_alloc_async(dev, self.pool, bytes, s).map_err(|e| {
                    if e.is_out_of_memory() {
                        // A failed request can leave the pool holding what it reserved
                        // while trying (seen on the H200: all of the card, kept by the
                        // maximum release threshold). Under such pressure, free memory
                        // belongs to the system: give back all the pool does not use.
                        let _ = b.pool_trim_to(dev, self.pool, 0);
                    }
                    out_of_memory(e, bytes, self)
                })
            }
            r => r,
        }
    }

    fn do_deallocate(&self, ptr: DevPtr, _bytes: usize, stream: &Stream) -> Result<()> {
        self.backend.free_async(self.device, ptr, stream.handle()).map_err(|e| match e {
            // During a capture the driver frees only what the capture allocated: the memory
            // is still allocated, and the same free succeeds once the capture has ended.
            Error::Driver { code: CUDA_ERROR_INVALID_VALUE, .. } if stream.is_capturing() => {
                Error::InvalidStream(format!(
                    "{ptr:#x} was not allocated in the CUDA graph capture of stream {:#x} (allocated \
                     before it, or not by this {}): on a capturing stream the driver frees only what \
                     the capture allocated; free it once the capture has ended",
                    stream.handle(),
                    self.name
                ))
            }
            e => e,
        })
    }

    /// The pool's reserved bytes and their high-water mark (the driver counts neither
    /// synchronisations nor waits; for a shared pool, other users' memory is included).
    fn footprint(&self) -> Option<Footprint> {
        Some(Footprint {
            reserved_bytes: self.attr(PoolAttr::ReservedMemCurrent).ok()?,
            peak_reserved_bytes: self.attr(PoolAttr::ReservedMemHigh).ok()?,
            ..Default::default()
        })
    }

    fn reset_peak_footprint(&self) {
        // Setting the high-water mark to 0 resets it to the current value (the driver's rule).
        let _ = self.backend.pool_set_attr(self.device, self.pool, PoolAttr::ReservedMemHigh, 0);
    }
}

impl Drop for CudaAsyncMemoryResource {
    fn drop(&mut self) {
        if self.owns_pool {
            // Outstanding allocations keep the pool's memory until they are freed (the
            // driver's rule); a failure at process exit has nobody to report to: it is
            // recorded.
            let (device, pool) = (self.device, self.pool);
            crate::error::record_if_failed(
                || format!("destroying the memory pool {pool:#x} of device {device}"),
                self.backend.pool_destroy(device, pool),
            );
        }
    }
}

impl fmt::Debug for CudaAsyncMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}(device={}, pool={:#x}, owns_pool={}, {})",
            self.name,
            self.device,
            self.pool,
            self.owns_pool,
            self.backend.describe()
        )
    }
}

/// Refuses a managed pool where the driver or GPU cannot have one, naming what is missing,
/// and options a managed pool cannot have.
fn check_managed_requirements(
    backend: &BackendRef,
    info: &DeviceInfo,
    options: &AsyncPoolOptions,
) -> Result<()> {
    let version = backend.driver_version()?;
    if version < MANAGED_POOLS_DRIVER {
        return Err(Error::Unsupported(format!(
            "{MANAGED_NAME} needs a CUDA 13 driver (found {}.{}); use ManagedMemoryResource",
            version / 1000,
            (version % 1000) / 10
        )));
    }
    if !info.concurrent_managed_access {
        return Err(Error::Unsupported(format!(
            "{MANAGED_NAME} needs a GPU with concurrent managed access (device {}: {} has none); use ManagedMemoryResource",
            info.ordinal, info.name
        )));
    }
    if info.memory_pools && !info.managed_pools {
        return Err(Error::Unsupported(format!(
            "{MANAGED_NAME} needs a driver with managed memory pools (cuMemGetMemPool), which {} lacks; use ManagedMemoryResource",
            backend.describe()
        )));
    }
    if options.enable_ipc {
        return Err(Error::invalid(format!(
            "{MANAGED_NAME} cannot export its memory to other processes: the driver has no IPC for managed pools (leave enable_ipc off)"
        )));
    }
    Ok(())
}

/// The CUDA 13 driver's stream-ordered pool of *managed* memory (`cuMemAllocFromPoolAsync`
/// from a pool of `CU_MEM_ALLOCATION_TYPE_MANAGED`), for work larger than the GPU: memory
/// usable from host and device that can be prefetched (the driver takes no advice on it:
/// `cuMemAdvise` is refused, seen with driver 580 on an H200), handed out in stream
/// order as [`CudaAsyncMemoryResource`] hands out device memory, by the same rules:
///
/// * With no options, the device's *current* managed pool (`cuMemGetMemPool`); when that
///   is the default managed pool (`cuMemGetDefaultMemPool`) its release threshold is
///   raised to the maximum, since the default of 0 returns the memory at every
///   synchronisation and the next allocations (and prefetches) pay for it again. A
///   current managed pool someone else set is used as it is.
/// * With options (`initial_pool_size`, `release_threshold`), a managed pool of its own,
///   destroyed with the resource. `enable_ipc` is refused: managed pools have no IPC.
///
/// It needs a CUDA 13 driver and a GPU with concurrent managed access; without either,
/// constructing it returns [`Error::Unsupported`] saying which is missing (use
/// [`crate::ManagedMemoryResource`] there). Keep what it hands out well below the GPU's
/// free memory where the work does not need to oversubscribe it.
///
/// It is a [`CudaAsyncMemoryResource`] underneath (it derefs to one, for `pool_handle`,
/// `release_threshold`, `trim_to` and the rest) whose memory kind is
/// [`MemoryKind::Managed`] and whose name is `CudaAsyncManagedMemoryResource`.
///
/// ```no_run
/// use streampool::{CudaAsyncManagedMemoryResource, MemoryResource, Stream};
/// let mr = CudaAsyncManagedMemoryResource::new(None, Default::default())?;
/// assert_eq!(mr.release_threshold()?, u64::MAX);
/// let ptr = mr.allocate(1 << 20, &Stream::legacy())?;
/// mr.deallocate(ptr, 1 << 20, &Stream::legacy())?;
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct CudaAsyncManagedMemoryResource {
    inner: CudaAsyncMemoryResource,
}

impl CudaAsyncManagedMemoryResource {
    /// On the current backend and `device` (the current device when `None`).
    pub fn new(device: Option<i32>, options: AsyncPoolOptions) -> Result<Self> {
        let (backend, device) = super::bind(device)?;
        Self::on(backend, device, options)
    }

    /// On a given backend and device.
    pub fn on(backend: BackendRef, device: i32, options: AsyncPoolOptions) -> Result<Self> {
        CudaAsyncMemoryResource::managed(backend, device, options).map(|inner| Self { inner })
    }

    /// The pool resource underneath (for code that holds either kind as one type).
    pub fn into_inner(self) -> CudaAsyncMemoryResource {
        self.inner
    }
}

impl Deref for CudaAsyncManagedMemoryResource {
    type Target = CudaAsyncMemoryResource;
    fn deref(&self) -> &CudaAsyncMemoryResource {
        &self.inner
    }
}

impl MemoryResource for CudaAsyncManagedMemoryResource {
    fn backend(&self) -> &BackendRef {
        self.inner.backend()
    }
    fn device(&self) -> i32 {
        self.inner.device()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn memory_kind(&self) -> MemoryKind {
        self.inner.memory_kind()
    }
    fn whole_allocations(&self) -> bool {
        true
    }
    fn serves_capture(&self) -> bool {
        self.inner.serves_capture()
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        self.inner.do_allocate(bytes, stream)
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.inner.do_deallocate(ptr, bytes, stream)
    }
    fn footprint(&self) -> Option<Footprint> {
        self.inner.footprint()
    }
    fn reset_peak_footprint(&self) {
        self.inner.reset_peak_footprint()
    }
}

impl fmt::Debug for CudaAsyncManagedMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}
