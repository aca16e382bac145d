//! Simulated memory: real host allocations standing in for device, managed and pinned
//! memory, and the map of live allocations that every call is validated against.

use std::alloc::Layout;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::{host_refused, oom, State};
use crate::device::{DevPtr, Location, RawPool};
use crate::error::{Error, Result, CUDA_ERROR_INVALID_VALUE};

/// Alignment of every simulated allocation (and the rounding of its accounted size).
pub(super) const ALIGN: usize = 256;

/// Rounds `bytes` up to [`ALIGN`]; `None` on overflow.
pub(super) fn round_up(bytes: usize, to: usize) -> Option<usize> {
    bytes.checked_add(to - 1).map(|b| b / to * to)
}

/// Blocks from this size up are mapped (see [`HostBlock::new`]).
const LAZY_BYTES: usize = 1 << 20;

/// Host memory standing in for device memory, released on drop: a zeroed heap allocation
/// aligned to [`ALIGN`] (a private anonymous mapping from [`LAZY_BYTES`] up), or a shared mapping of a file (an exportable pool's chunk, or
/// memory imported from another process; see module `ipc`).
///
/// The address is kept as an integer (device pointers are integers on the host); its
/// provenance is exposed so that the executing operations can turn it back into a
/// pointer.
#[derive(Debug)]
pub(super) struct HostBlock {
    addr: u64,
    len: usize,
    backing: Backing,
}

#[derive(Debug)]
enum Backing {
    Heap(Layout),
    /// `munmap(start, len)` on drop.
    Mapped {
        start: u64,
        len: usize,
    },
}

impl HostBlock {
    /// `None` when the host cannot provide `bytes`. Zeroed. From `LAZY_BYTES` up, an
    /// anonymous mapping, whose pages the host provides (zeroed) when first touched: an
    /// arena of gigabytes costs nothing until used, as on a GPU (an aligned heap allocation
    /// is zeroed by writing every page at once).
    pub(super) fn new(bytes: usize) -> Option<Self> {
        if bytes >= LAZY_BYTES {
            // SAFETY: a new private mapping chosen by the kernel (no address given)
            // overlaps nothing; no file is mapped.
            let start = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if start == libc::MAP_FAILED {
                return None;
            }
            let start = start.expose_provenance() as u64;
            return Some(HostBlock {
                addr: start,
                len: bytes,
                backing: Backing::Mapped { start, len: bytes },
            });
        }
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return None;
        }
        Some(HostBlock {
            addr: ptr.expose_provenance() as u64,
            len: layout.size(),
            backing: Backing::Heap(layout),
        })
    }

    /// `len` bytes of `fd` from byte `offset`, mapped shared (writes reach every process
    /// that maps them). The file must hold them: a mapping past its end faults on access.
    pub(super) fn map(fd: BorrowedFd<'_>, offset: u64, len: usize) -> std::io::Result<Self> {
        // SAFETY: `sysconf` has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let start_offset = offset / page * page;
        let skip = (offset - start_offset) as usize;
        let map_len = skip + len.max(1);
        let file_offset =
            libc::off_t::try_from(start_offset).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        // SAFETY: a new mapping chosen by the kernel (no address given) overlaps nothing;
        // the descriptor is open for the call (`BorrowedFd`).
        let start = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                file_offset,
            )
        };
        if start == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let start = start.expose_provenance() as u64;
        Ok(HostBlock { addr: start + skip as u64, len, backing: Backing::Mapped { start, len: map_len } })
    }

    pub(super) fn addr(&self) -> u64 {
        self.addr
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostBlock {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: `addr` came from `alloc_zeroed` with `layout` (its provenance exposed
            // there), and a `HostBlock` is dropped once.
            Backing::Heap(layout) => unsafe {
                std::alloc::dealloc(std::ptr::with_exposed_provenance_mut(self.addr as usize), layout)
            },
            // SAFETY: `start` and `len` are the mapping `new` or `map` made (provenance exposed
            // there), unmapped once; nothing runs on it after the block is dropped (every
            // executing operation checks that its memory is still backed).
            Backing::Mapped { start, len } => unsafe {
                libc::munmap(std::ptr::with_exposed_provenance_mut::<libc::c_void>(start as usize), len);
            },
        }
    }
}

/// What kind of memory an allocation is, i.e. which call frees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AllocKind {
    /// `cuMemAlloc`.
    Device,
    /// `cuMemAllocManaged`.
    Managed,
    /// `cuMemHostAlloc`.
    Pinned,
    /// `cuMemAllocFromPoolAsync` from this pool (inside one of its chunks).
    Pool(RawPool),
    /// `cuMemPoolImportPointer` from this imported pool: another process's memory, mapped
    /// here; freed with `cuMemFree`, not counted against this device's capacity.
    Imported(RawPool),
    /// Adjacent mappings of `cuMemMap` in one reservation (module `vmm`), one allocation
    /// for as long as they stay mapped; unmapped with `cuMemUnmap`, one mapping at a time.
    Mapped,
}

/// A live allocation.
#[derive(Debug)]
pub(super) struct Alloc {
    /// Bytes asked for: accesses must stay inside them.
    pub(super) bytes: usize,
    /// Bytes accounted (rounded up to [`ALIGN`]).
    pub(super) size: usize,
    pub(super) kind: AllocKind,
    pub(super) dev: i32,
    /// The backing memory, except for pool allocations (their pool's chunk holds it) and
    /// mapped memory (its reservation holds it).
    pub(super) block: Option<HostBlock>,
    /// Where parts of it were last asked to be prefetched (managed memory only).
    pub(super) prefetched: Prefetched,
}

/// The last prefetch location of byte ranges of one allocation, as the driver keeps it
/// per page: disjoint `(start, end, location)` ranges, in no order.
#[derive(Debug, Default)]
pub(super) struct Prefetched(Vec<(u64, u64, Location)>);

impl Prefetched {
    /// Records that `[start, end)` was last asked to go to `to`.
    pub(super) fn record(&mut self, start: u64, end: u64, to: Location) {
        let mut kept = Vec::with_capacity(self.0.len() + 2);
        for &(s, e, at) in &self.0 {
            if e <= start || s >= end {
                kept.push((s, e, at));
                continue;
            }
            if s < start {
                kept.push((s, start, at));
            }
            if e > end {
                kept.push((end, e, at));
            }
        }
        kept.push((start, end, to));
        self.0 = kept;
    }

    /// Where all of `[start, end)` was last asked to go: `None` when some byte never was,
    /// or its bytes went to different places (`CU_DEVICE_INVALID`).
    pub(super) fn location(&self, start: u64, end: u64) -> Option<Location> {
        let mut parts: Vec<(u64, u64, Location)> =
            self.0.iter().copied().filter(|&(s, e, _)| s < end && e > start).collect();
        parts.sort_by_key(|&(s, _, _)| s);
        let first = parts.first()?.2;
        let mut covered = start;
        for (s, e, at) in parts {
            if s > covered || at != first {
                return None;
            }
            covered = covered.max(e);
        }
        (covered >= end).then_some(first)
    }
}

/// `CUDA_ERROR_INVALID_DEVICE` from `call`.
pub(super) fn invalid_device(call: &'static str) -> Error {
    Error::Driver {
        call,
        code: crate::error::CUDA_ERROR_INVALID_DEVICE,
        name: "CUDA_ERROR_INVALID_DEVICE".into(),
        context: String::new(),
    }
}

/// `CUDA_ERROR_INVALID_VALUE` from `call`.
pub(super) fn invalid_value(call: &'static str) -> Error {
    Error::Driver {
        call,
        code: CUDA_ERROR_INVALID_VALUE,
        name: "CUDA_ERROR_INVALID_VALUE".into(),
        context: String::new(),
    }
}

impl State {
    /// `cuMemAlloc`, `cuMemAllocManaged`, `cuMemHostAlloc`.
    pub(super) fn alloc_plain(&mut self, dev: i32, bytes: usize, kind: AllocKind) -> Result<DevPtr> {
        let call = match kind {
            AllocKind::Device => "cuMemAlloc",
            AllocKind::Managed => "cuMemAllocManaged",
            AllocKind::Pinned => "cuMemHostAlloc",
            AllocKind::Pool(_) | AllocKind::Imported(_) | AllocKind::Mapped => {
                unreachable!("pool, imported and mapped memory are made by their own models")
            }
        };
        if bytes == 0 {
            return Err(invalid_value(call));
        }
        let size = round_up(bytes, ALIGN).ok_or_else(|| oom(call))?;
        let counted = kind != AllocKind::Pinned;
        if counted && size > self.free_bytes(dev) {
            return Err(oom(call));
        }
        let block = HostBlock::new(size).ok_or_else(|| match kind {
            // Pinned memory is the host's own, not the device's capacity.
            AllocKind::Pinned => Error::OutOfMemory {
                requested: size,
                available: None,
                resource: format!("the host's pinned memory (for {})", self.name),
            },
            _ => host_refused(self, size),
        })?;
        let addr = block.addr();
        if counted {
            self.devices[dev as usize].allocated += size;
        }
        self.allocs.insert(
            addr,
            Alloc { bytes, size, kind, dev, block: Some(block), prefetched: Prefetched::default() },
        );
        Ok(addr)
    }

    /// `cuMemFree` (`pinned` false) and `cuMemFreeHost` (`pinned` true). Validates
    /// before anything else, so that a bad pointer changes nothing.
    pub(super) fn free_plain(&mut self, ptr: DevPtr, pinned: bool) -> Result<()> {
        let call = if pinned { "cuMemFreeHost" } else { "cuMemFree" };
        let Some(a) = self.allocs.get(&ptr) else {
            return Err(Error::InvalidPointer(format!(
                "{call}({ptr:#x}): not the start of a live allocation of {} (double free, or foreign pointer)",
                self.name
            )));
        };
        let ok = match a.kind {
            AllocKind::Device | AllocKind::Managed | AllocKind::Imported(_) | AllocKind::Pool(_) => !pinned,
            AllocKind::Pinned => pinned,
            AllocKind::Mapped => false,
        };
        if !ok {
            let what = match a.kind {
                AllocKind::Device => "device memory from cuMemAlloc (free it with cuMemFree)".to_string(),
                AllocKind::Managed => "managed memory from cuMemAllocManaged (free it with cuMemFree)".into(),
                AllocKind::Pinned => {
                    "pinned host memory from cuMemHostAlloc (free it with cuMemFreeHost)".into()
                }
                AllocKind::Pool(p) => format!("from memory pool {p:#x} (free it with cuMemFreeAsync)"),
                AllocKind::Imported(p) => format!("imported from pool {p:#x} (free it with cuMemFree)"),
                AllocKind::Mapped => "mapped with cuMemMap (unmap it with cuMemUnmap)".into(),
            };
            return Err(Error::InvalidPointer(format!("{call}({ptr:#x}): the pointer is {what}")));
        }
        if let AllocKind::Pool(handle) = a.kind {
            // As the driver documents it: no synchronisation for stream-ordered memory.
            self.free_to_pool(ptr, handle, None);
            return Ok(());
        }
        if let AllocKind::Imported(_) = a.kind {
            // The driver does not wait for the work on memory of a pool (imported memory
            // too): freed with work on it still queued, the exporter could free and reuse
            // it while that work runs, in another process, where no detector sees it. The
            // simulated device refuses that, changing nothing, rather than model it.
            let end = ptr + a.size as u64;
            if self.pending_ranges().iter().any(|&(s, e)| s < end && ptr < e) {
                return Err(Error::InvalidArgument(format!(
                    "{call}({ptr:#x}): imported memory freed while work on it is still queued (the \
                     simulated device refuses this): the driver does not wait for that work, so \
                     the exporter could reuse the memory while it runs; synchronise first"
                )));
            }
        } else {
            // Synchronous (rule 4 of "ordered"): the driver's implicit synchronisation is of
            // a context, as `cuCtxSynchronize`, not of every device. Modelled as waiting for
            // the work of the memory's device: device memory's own; for pinned host memory,
            // which is the host's, the device whose context allocated it (normally the one
            // current when it is freed). Other devices' work stays queued.
            self.run_all(a.dev);
        }
        let a = self.allocs.remove(&ptr).expect("checked above");
        if matches!(a.kind, AllocKind::Device | AllocKind::Managed) {
            self.devices[a.dev as usize].allocated -= a.size;
        }
        drop(a.block);
        Ok(())
    }

    /// Device bytes not taken by allocations or pool reservations.
    pub(super) fn free_bytes(&self, dev: i32) -> usize {
        let d = &self.devices[dev as usize];
        self.capacity.saturating_sub(d.allocated + d.reserved)
    }

    /// The live allocation that holds all of `[ptr, ptr + bytes)`, if any.
    pub(super) fn alloc_containing(&self, ptr: DevPtr, bytes: usize) -> Option<(DevPtr, &Alloc)> {
        let (&start, a) = self.allocs.range(..=ptr).next_back()?;
        let end = ptr.checked_add(bytes as u64)?;
        (end <= start + a.bytes as u64).then_some((start, a))
    }

    /// The live allocation `ptr` lies in (its start and record), as the driver's pointer
    /// queries find it; InvalidPointer for a pointer inside none.
    pub(super) fn live_alloc_at(&self, ptr: DevPtr) -> Result<(DevPtr, &Alloc)> {
        self.alloc_containing(ptr, 1).ok_or_else(|| {
            Error::InvalidPointer(format!("{ptr:#x} is not inside a live allocation of {}", self.name))
        })
    }

    /// Whether any byte of `[ptr, ptr + bytes)` is simulated memory: a live allocation, a
    /// pool chunk, or reserved address space (mapped or not).
    pub(super) fn overlaps_sim_memory(&self, ptr: DevPtr, bytes: usize) -> bool {
        let end = ptr.saturating_add(bytes as u64);
        let hits = |start: u64, len: usize| start + len as u64 > ptr;
        self.allocs.range(..end).next_back().is_some_and(|(&s, a)| hits(s, a.size))
            || self.chunks.range(..end).next_back().is_some_and(|(&s, &(len, _))| hits(s, len))
            || self.overlaps_reservation(ptr, bytes)
    }

    /// Whether `[ptr, ptr + bytes)` is still backed by host memory this device owns (a
    /// live non-pool allocation, a chunk of a pool, or mapped memory). Checked before every
    /// write or read of simulated memory, so that no executing operation touches freed
    /// memory.
    pub(super) fn backed(&self, ptr: DevPtr, bytes: usize) -> bool {
        let end = ptr.saturating_add(bytes as u64);
        let inside = |start: u64, len: usize| end <= start + len as u64;
        self.allocs.range(..=ptr).next_back().is_some_and(|(&s, a)| match &a.block {
            Some(b) => inside(s, b.len()),
            // Mapped memory is mapped exactly while its allocation lives.
            None => a.kind == AllocKind::Mapped && inside(s, a.size),
        }) || self.chunks.range(..=ptr).next_back().is_some_and(|(&s, &(len, _))| inside(s, len))
    }

    /// Validates a range that a safe operation touches: it must lie inside one live
    /// allocation.
    pub(super) fn check_range(&self, ptr: DevPtr, bytes: usize, what: &str) -> Result<()> {
        if self.alloc_containing(ptr, bytes).is_some() {
            return Ok(());
        }
        // A range that starts inside a live allocation runs past its end (an overrun); one
        // that starts inside none touches memory that is not, or no longer, allocated.
        let name = &self.name;
        let why = match self.alloc_containing(ptr, 1) {
            Some((start, a)) => format!(
                "runs {} bytes past the end of the live allocation [{start:#x}, +{}) of {name} that it \
                 starts in (an overrun)",
                (ptr - start).saturating_add(bytes as u64).saturating_sub(a.bytes as u64),
                a.bytes
            ),
            None => format!("is not inside a live allocation of {name} (use after free?)"),
        };
        Err(Error::InvalidPointer(format!("{what}: [{ptr:#x}, +{bytes}) {why}")))
    }

    /// Whether an allocation is managed memory: `cuMemAllocManaged`, or a managed pool's.
    pub(super) fn is_managed(&self, a: &Alloc) -> bool {
        match a.kind {
            AllocKind::Managed => true,
            AllocKind::Pool(p) => self.pools.get(&p).is_some_and(|p| p.managed),
            AllocKind::Device | AllocKind::Pinned | AllocKind::Imported(_) | AllocKind::Mapped => false,
        }
    }

    /// Validates a range that a call for managed memory names (`cuMemPrefetchAsync`,
    /// `cuMemAdvise`, `cuMemRangeGetAttribute`): outside a live allocation it is
    /// [`Error::InvalidPointer`], like every range; inside one that is not managed, the
    /// driver's `CUDA_ERROR_INVALID_VALUE` from `call`. Returns the allocation's start.
    pub(super) fn check_managed_range(
        &self,
        ptr: DevPtr,
        bytes: usize,
        call: &'static str,
    ) -> Result<DevPtr> {
        self.check_range(ptr, bytes, call)?;
        let (start, a) = self.alloc_containing(ptr, bytes).expect("checked above");
        if self.is_managed(a) {
            Ok(start)
        } else {
            Err(invalid_value(call))
        }
    }

    /// Classifies one side of a copy: `Ok(true)` for simulated memory (validated like
    /// [`Self::check_range`]), `Ok(false)` for host memory the device knows nothing of
    /// (pageable memory, which the driver copies too). Memory that is neither, an address
    /// the process has not mapped, is [`Error::InvalidPointer`]: the copy would otherwise
    /// fault when it runs, taking the process with it.
    pub(super) fn classify_copy_side(&self, ptr: DevPtr, bytes: usize, what: &str) -> Result<bool> {
        if self.overlaps_sim_memory(ptr, bytes) {
            self.check_range(ptr, bytes, what)?;
            Ok(true)
        } else if ptr == 0 {
            Err(Error::InvalidPointer(format!("{what}: null pointer")))
        } else if !host_mapped(ptr, bytes) {
            Err(Error::InvalidPointer(format!(
                "{what}: [{ptr:#x}, +{bytes}) is neither memory of {} nor host memory this process has mapped",
                self.name
            )))
        } else {
            Ok(false)
        }
    }
}

/// Whether every page of `[ptr, ptr + bytes)` is mapped in this process (`mincore`, which
/// reads no memory and fails with `ENOMEM` for a page that is not mapped). `bytes` > 0.
fn host_mapped(ptr: DevPtr, bytes: usize) -> bool {
    // SAFETY: `sysconf` has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let Some(end) = ptr.checked_add(bytes as u64) else { return false };
    let start = ptr / page * page;
    let pages = (end - start).div_ceil(page) as usize;
    let mut residency = vec![0u8; pages];
    // SAFETY: `mincore` only reads the page tables of the range (any address may be asked
    // about) and writes one byte per page into `residency`, which has room for them.
    let rc = unsafe {
        libc::mincore(
            std::ptr::with_exposed_provenance_mut::<libc::c_void>(start as usize),
            (end - start) as usize,
            residency.as_mut_ptr(),
        )
    };
    rc == 0
}
