//! Size classes routed to different resources.

use std::fmt;
use std::sync::Arc;

use super::{as_own_oom, upstream_properties, FixedSizeMemoryResource, PtrMap};
use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::resource::{check_depth, settle_allocate, settle_deallocate, MemoryResource, ResourceRef};
use crate::stream::Stream;
use crate::sync::{lock, read, write, AtomicUsize, Mutex, Ordering, RwLock};

/// The largest size exponent: bins up to 1 TiB.
pub const MAX_SIZE_EXPONENT: u32 = 40;

/// The one refusal of a size exponent out of range (the Python binding gives it too, for
/// values that are not even integers of Rust's size).
pub fn size_exponent_error(what: &str, value: impl fmt::Display) -> Error {
    Error::invalid(format!(
        "BinningMemoryResource: {what} must be in 0..={MAX_SIZE_EXPONENT} (bins of 1 byte to 1 TiB) or None, got {value}"
    ))
}
/// Automatic bins grow in chunks of about this many bytes (at most 128 blocks, RMM's
/// default, and at least one): small bins get RMM's chunks, large ones do not reserve
/// 128 blocks each per stream.
const AUTO_CHUNK_BYTES: usize = 2 << 20;

/// Routes each request to the smallest bin that fits it, and larger ones to the upstream
/// (RMM's `binning_memory_resource`).
///
/// Routing: a request of `bytes` goes to the bin of the smallest size `>= bytes`, or to
/// the upstream when it is larger than every bin. A free is routed by its size with the
/// same rule, as RMM's is, so it reaches the resource that allocated it.
///
/// Bin sizes are rounded up to 256 bytes, as RMM's. Adding a bin of a size that has one
/// already does nothing when no resource is given (as RMM), and with a resource replaces
/// that bin's resource (RMM keeps the old one silently; here the resource asked for is
/// used, rather than ignored).
///
/// Invariant: that a free reaches the resource that allocated it. So every allocation's
/// size is recorded, and a free of an address that is not outstanding (a double free, or
/// memory allocated elsewhere) or with another size than it was allocated with is refused
/// with [`Error::InvalidPointer`], before any resource sees it, and changes nothing: a
/// wrong size would route the free to another bin or to the upstream, which would take
/// back memory that is part of a bin's chunk. And a new bin is refused while the resource
/// it would take sizes from (the next larger bin, or the upstream) has allocations
/// outstanding, and a bin is not replaced while it has allocations outstanding: add bins
/// before allocating. A size of 0, a resource of another backend or device, or one that
/// would make this resource deeper than it was when a resource was built over it (see
/// [`depth`](MemoryResource::depth); this also refuses a bin that calls back into this
/// resource) are refused too, with an [`Error::InvalidArgument`] that leaves the bins as
/// they were.
///
/// The bins live behind a read-write lock, taken shared on every allocation and free
/// (never across the call into a bin) and exclusively by [`add_bin`](Self::add_bin).
/// Each route counts the allocations it has outstanding, for that check. The sizes are
/// kept in 16 shards keyed by address, each behind its own lock (never held across a
/// call into a bin). The fast path ([`MemoryResource::try_allocate`]) is forwarded to the
/// route's resource.
///
/// What a reader may miss: what each bin holds beyond what it hands out (a
/// [`FixedSizeMemoryResource`] keeps its chunks until dropped).
///
/// ```
/// use std::sync::Arc;
/// use streampool::device::sim::SimDevice;
/// use streampool::{BinningMemoryResource, CudaAsyncMemoryResource, MemoryResource, Stream};
///
/// let sim = SimDevice::new(1 << 30);
/// let upstream = Arc::new(CudaAsyncMemoryResource::on(sim.clone(), 0, Default::default())?);
/// let mr = BinningMemoryResource::new(upstream, Some(8), Some(16))?; // 256 B .. 64 KiB
/// assert_eq!(mr.bins().len(), 9);
/// let s = Stream::legacy();
/// let small = mr.allocate(300, &s)?; // the 512-byte bin
/// let large = mr.allocate(1 << 20, &s)?; // the upstream
/// mr.deallocate(small, 300, &s)?;
/// mr.deallocate(large, 1 << 20, &s)?;
/// # Ok::<(), streampool::Error>(())
/// ```
pub struct BinningMemoryResource {
    upstream: ResourceRef,
    /// Allocations outstanding from the upstream route.
    upstream_outstanding: Arc<AtomicUsize>,
    /// Sorted by size; sizes distinct.
    bins: RwLock<Vec<Bin>>,
    /// The size of every outstanding allocation.
    live: PtrMap<usize>,
    depth: Mutex<Depth>,
}

/// [`MemoryResource::depth`], fixed once read: a resource built over this one counted on
/// it, so a bin may no longer make it deeper.
struct Depth {
    value: usize,
    read: bool,
}

struct Bin {
    bytes: usize,
    mr: ResourceRef,
    /// The bin's own [`FixedSizeMemoryResource`], when it made one (not one given).
    fixed: Option<Arc<FixedSizeMemoryResource>>,
    outstanding: Arc<AtomicUsize>,
}

impl BinningMemoryResource {
    /// Bins over `upstream`: with both exponents, one [`FixedSizeMemoryResource`] bin per
    /// power of two from `2^min_size_exponent` to `2^max_size_exponent` bytes; with
    /// neither, none yet (see [`add_bin`](Self::add_bin)).
    pub fn new(
        upstream: ResourceRef,
        min_size_exponent: Option<u32>,
        max_size_exponent: Option<u32>,
    ) -> Result<Self> {
        let depth = check_depth("BinningMemoryResource", [&upstream])?;
        let mr = BinningMemoryResource {
            upstream,
            upstream_outstanding: Arc::new(AtomicUsize::new(0)),
            bins: RwLock::new(Vec::new()),
            live: PtrMap::new(),
            depth: Mutex::new(Depth { value: depth, read: false }),
        };
        match (min_size_exponent, max_size_exponent) {
            (None, None) => {}
            (Some(min), Some(max)) => {
                for (what, e) in [("min_size_exponent", min), ("max_size_exponent", max)] {
                    if e > MAX_SIZE_EXPONENT {
                        return Err(size_exponent_error(what, e));
                    }
                }
                if min > max {
                    return Err(Error::invalid(format!(
                        "BinningMemoryResource: min_size_exponent ({min}) must be <= max_size_exponent ({max})"
                    )));
                }
                for e in min..=max {
                    mr.add_bin(1 << e, None)?;
                }
            }
            (min, max) => {
                let (unset, set, e) = match (min, max) {
                    (None, Some(max)) => ("min_size_exponent", "max_size_exponent", max),
                    (Some(min), _) => ("max_size_exponent", "min_size_exponent", min),
                    (None, None) => unreachable!("matched above"),
                };
                return Err(Error::invalid(format!(
                    "BinningMemoryResource: {set} is {e} but {unset} is not given (None, or RMM's -1): \
                     give both min_size_exponent and max_size_exponent, or neither"
                )));
            }
        }
        Ok(mr)
    }

    /// Adds a bin for requests of up to `allocation_size` bytes (and above the next
    /// smaller bin), served by `resource`, or by a new [`FixedSizeMemoryResource`] over
    /// the upstream when `None`. See the type's docs for what is refused.
    pub fn add_bin(&self, allocation_size: usize, resource: Option<ResourceRef>) -> Result<()> {
        let refuse = |why: String| Err(Error::invalid(format!("BinningMemoryResource::add_bin: {why}")));
        if allocation_size == 0 {
            return refuse("a bin of 0 bytes would serve nothing".into());
        }
        // Sizes are rounded up to the alignment: the rounded size is what must fit.
        let Some(allocation_size) =
            allocation_size.checked_next_multiple_of(crate::ALIGNMENT).filter(|&b| b <= isize::MAX as usize)
        else {
            return refuse(format!("a bin of {allocation_size} bytes is larger than any allocation"));
        };
        if resource.is_none() && read(&self.bins).iter().any(|b| b.bytes == allocation_size) {
            return Ok(()); // as RMM: a bin of that size exists already, so nothing changes
        }
        let (mr, fixed): (ResourceRef, _) = match resource {
            Some(mr) => {
                let (b, d) = (self.upstream.backend(), self.upstream.device());
                if mr.backend().id() != b.id() || mr.device() != d {
                    return refuse(format!(
                        "the bin's {} is on {} device {}, but this resource is on {} device {d}",
                        mr.name(),
                        mr.backend().describe(),
                        mr.device(),
                        b.describe()
                    ));
                }
                let (theirs, ours) = (mr.memory_kind(), self.upstream.memory_kind());
                if theirs != ours {
                    // Every allocation reports the resource's kind (DLPack, the CUDA array
                    // interface, prefetch): one bin of another kind would misreport its memory.
                    return refuse(format!(
                        "the bin's {} hands out {} memory, but this resource's upstream {} hands out {} memory",
                        mr.name(),
                        theirs.words(),
                        self.upstream.name(),
                        ours.words()
                    ));
                }
                (mr, None)
            }
            None => {
                let blocks = (AUTO_CHUNK_BYTES / allocation_size).clamp(1, 128);
                let fixed =
                    Arc::new(FixedSizeMemoryResource::new(self.upstream.clone(), allocation_size, blocks)?);
                (fixed.clone(), Some(fixed))
            }
        };
        // Asked before taking a lock: a bin over this resource asks this resource's depth.
        let depth = check_depth("BinningMemoryResource", [&self.upstream, &mr])?;
        // `mr` and `fixed`, declared before the locks, are dropped after them on a refusal.
        let mut bins = write(&self.bins);
        let mut own = lock(&self.depth);
        if own.read && depth > own.value {
            return refuse(format!(
                "the bin's {} is {} resources deep, which would make this resource {depth} deep, deeper than \
                 the {} it was when a resource was built over it (add bins before wrapping it; a bin that \
                 calls back into this resource is always refused)",
                mr.name(),
                depth - 1,
                own.value
            ));
        }
        let at = bins.partition_point(|b| b.bytes < allocation_size);
        if let Some(bin) = bins.get_mut(at).filter(|b| b.bytes == allocation_size) {
            if fixed.is_some() {
                // Asked for a bin that another thread added meanwhile: nothing changes.
                return Ok(());
            }
            // Replacing the bin's resource: only while nothing it handed out is outstanding,
            // since those frees would then reach the new resource.
            let n = bin.outstanding.load(Ordering::Relaxed);
            if n > 0 {
                return refuse(format!(
                    "the bin of {allocation_size} bytes has {n} allocation(s) outstanding whose frees would \
                     then go to the wrong resource; replace bins before allocating"
                ));
            }
            let replaced = (std::mem::replace(&mut bin.mr, mr), std::mem::replace(&mut bin.fixed, fixed));
            // The replaced resource goes only after the locks: one this binning resource made
            // gives its chunks back when dropped, through an upstream that may call Python,
            // while other threads wait on these locks holding the GIL.
            drop(own);
            drop(bins);
            drop(replaced);
            return Ok(());
        }
        let (donor, outstanding) = match bins.get(at) {
            Some(b) => (format!("the bin of {} bytes", b.bytes), &b.outstanding),
            None => ("the upstream".to_string(), &self.upstream_outstanding),
        };
        let n = outstanding.load(Ordering::Relaxed);
        if n > 0 {
            return refuse(format!(
                "a bin of {allocation_size} bytes would take sizes from {donor}, which has {n} allocation(s) \
                 outstanding whose frees would then go to the wrong resource; add bins before allocating"
            ));
        }
        bins.insert(
            at,
            Bin { bytes: allocation_size, mr, fixed, outstanding: Arc::new(AtomicUsize::new(0)) },
        );
        own.value = own.value.max(depth);
        Ok(())
    }

    /// The bins, smallest first: (largest size served, resource).
    pub fn bins(&self) -> Vec<(usize, ResourceRef)> {
        read(&self.bins).iter().map(|b| (b.bytes, b.mr.clone())).collect()
    }

    /// Gives back to the upstream the wholly free chunks of the bins this resource made
    /// ([`FixedSizeMemoryResource::release_free_chunks`]); returns the bytes given back.
    /// Called when a request finds the upstream out of memory; a failure there (a device
    /// synchronisation that fails) gives nothing back and is left to the request's error.
    pub fn release_free_chunks(&self) -> usize {
        let fixed: Vec<_> = read(&self.bins).iter().filter_map(|b| b.fixed.clone()).collect();
        fixed.iter().map(|f| f.release_free_chunks().unwrap_or(0)).sum()
    }

    /// The resource for requests larger than every bin.
    pub fn upstream(&self) -> &ResourceRef {
        &self.upstream
    }

    /// The route for `bytes` and its count of outstanding allocations. An allocation
    /// raises the count while the read lock is held, so that [`add_bin`](Self::add_bin)
    /// never misses one in flight (the lock orders the two; the counts need no more than
    /// relaxed atomics); it lowers it again if the allocation fails.
    fn route(&self, bytes: usize, allocating: bool) -> (ResourceRef, Arc<AtomicUsize>) {
        let bins = read(&self.bins);
        let (mr, count) = match bins.iter().find(|b| b.bytes >= bytes) {
            Some(b) => (b.mr.clone(), b.outstanding.clone()),
            None => (self.upstream.clone(), self.upstream_outstanding.clone()),
        };
        if allocating {
            count.fetch_add(1, Ordering::Relaxed);
        }
        (mr, count)
    }
}

/// Lowers an outstanding count (every free that lowers one passed the size check, so
/// its allocation raised it).
fn lower(count: &AtomicUsize) {
    count.fetch_sub(1, Ordering::Relaxed);
}

impl BinningMemoryResource {
    /// After the route's allocation: recorded, or the count raised for it lowered again.
    fn allocated(&self, bytes: usize, count: &AtomicUsize, result: Result<DevPtr>) -> Result<DevPtr> {
        match result {
            Ok(ptr) => {
                self.live.insert(ptr, bytes);
                Ok(ptr)
            }
            Err(e) => {
                lower(count);
                Err(as_own_oom(e, bytes, self))
            }
        }
    }

    /// After the route's free of a record taken out: the count lowered, or the record put back.
    fn freed(&self, ptr: DevPtr, bytes: usize, count: &AtomicUsize, result: Result<()>) -> Result<()> {
        match result {
            Ok(()) => lower(count),
            Err(_) => self.live.insert(ptr, bytes),
        }
        result
    }
}

impl MemoryResource for BinningMemoryResource {
    upstream_properties!("BinningMemoryResource");

    fn depth(&self) -> usize {
        let mut own = lock(&self.depth);
        own.read = true;
        own.value
    }

    fn do_allocate(&self, bytes: usize, stream: &Stream) -> Result<DevPtr> {
        let (mr, count) = self.route(bytes, true);
        let result = match mr.allocate(bytes, stream) {
            // The upstream is out of memory: the bins' wholly free chunks (of streams gone,
            // or sizes no longer asked for) go back to it, and the request is tried again.
            Err(e) if e.is_out_of_memory() && self.release_free_chunks() > 0 => mr.allocate(bytes, stream),
            result => result,
        };
        self.allocated(bytes, &count, result)
    }

    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.live.take(ptr, bytes, |&b| b, self.name())?;
        // The allocation's count keeps the route in place until its free has completed.
        let (mr, count) = self.route(bytes, false);
        self.freed(ptr, bytes, &count, mr.deallocate(ptr, bytes, stream))
    }

    // Forwarded to the route's resource; the locks taken (the bins', shared, and a shard
    // of the sizes) are held for a moment, never across a call out, so waiting for them
    // with the GIL held is short and cannot deadlock.
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<Result<DevPtr>> {
        if let Some(settled) = settle_allocate(self, bytes, stream) {
            return Some(settled);
        }
        let (mr, count) = self.route(bytes, true);
        match mr.try_allocate(bytes, stream) {
            // Out of memory: the full path gives the bins' free chunks back first.
            Some(Err(e)) if e.is_out_of_memory() => {
                lower(&count);
                None
            }
            Some(result) => Some(self.allocated(bytes, &count, result)),
            None => {
                lower(&count);
                None
            }
        }
    }

    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<Result<()>> {
        if let Some(settled) = settle_deallocate(self, ptr, bytes, stream) {
            return Some(settled);
        }
        if let Err(e) = self.live.take(ptr, bytes, |&b| b, self.name()) {
            return Some(Err(e));
        }
        let (mr, count) = self.route(bytes, false);
        match mr.try_deallocate(ptr, bytes, stream) {
            Some(result) => Some(self.freed(ptr, bytes, &count, result)),
            None => {
                self.live.insert(ptr, bytes);
                None
            }
        }
    }
}

impl fmt::Debug for BinningMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sizes: Vec<usize> = read(&self.bins).iter().map(|b| b.bytes).collect();
        f.debug_struct("BinningMemoryResource")
            .field("bins", &sizes)
            .field("upstream", &self.upstream)
            .finish()
    }
}
