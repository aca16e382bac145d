//! Virtual memory management, as the driver does it: address space reserved with
//! `cuMemAddressReserve`, device memory made with `cuMemCreate` and mapped into it with
//! `cuMemMap` (and `cuMemSetAccess`), unmapped with `cuMemUnmap` (and `cuMemRelease`),
//! the address space given back with `cuMemAddressFree`.
//!
//! * **Reservations** are host address space: `mmap(PROT_NONE, MAP_NORESERVE)`, aligned to
//!   [`VMM_GRANULARITY`], with nothing behind it. Their size must be a non-zero multiple
//!   of the granularity, and they do not count against the capacity.
//! * **Mappings** make granularity-aligned ranges of one reservation, over nothing mapped,
//!   usable: `mmap(MAP_FIXED)` of fresh zeroed read-write pages, so that mappings next to
//!   each other are one range of real host memory. Each counts against its device's
//!   capacity as `cuMemAlloc` memory does (beyond it, `cuMemCreate`'s
//!   `CUDA_ERROR_OUT_OF_MEMORY`), and gets a fresh handle.
//! * **Accesses.** Each run of adjacent mappings of one reservation and one device is a
//!   live allocation ([`AllocKind::Mapped`]), rebuilt at every map and unmap, so that every
//!   access is validated as for other memory: a range may span mappings, but not reach a
//!   byte that is not mapped. Only the mapping's own device may access it (`cuMemSetAccess`
//!   grants no other). The race detector keys its state by address, so it follows
//!   accesses across mappings unchanged.
//! * **Unmapping** names one mapping exactly (address, size and handle), waits for the
//!   whole device (`cuMemUnmap` is synchronous), gives the pages back to the host and
//!   uncounts them. This is stricter than the driver (580), which refuses a range that
//!   cuts a mapping but unmaps every whole mapping inside a larger one (and accepts one
//!   with nothing mapped): the seam unmaps one mapping, and a size that is not its size is
//!   the caller's bug. **Freeing** a reservation names it exactly and is refused while
//!   anything is mapped in it, as the driver refuses it.
//!
//! Every refusal is the driver's `CUDA_ERROR_INVALID_VALUE` from the call that would
//! refuse it, with the reason as context, and changes nothing. Closing the device (and
//! dropping it) gives every reservation, mapped pages included, back to the host.

use std::collections::BTreeMap;
use std::io;

use super::memory::{invalid_value, Alloc, AllocKind, Prefetched};
use super::{host_refused, oom, State};
use crate::device::{DevPtr, RawVmm};
use crate::error::{Error, Result};

/// What `cuMemGetAllocationGranularity` reports on the simulated device: 2 MiB, the
/// minimum granularity of device memory on current GPUs. Reservation and mapping sizes
/// and mapping addresses are multiples of it.
pub const VMM_GRANULARITY: usize = 2 << 20;

/// The first handle `vmm_map` returns; later ones count up by 0x10.
pub(super) const FIRST_HANDLE: RawVmm = 0x7000_0000;

/// A reservation of address space and what is mapped in it.
#[derive(Debug)]
pub(super) struct Reservation {
    space: AddressSpace,
    /// Mappings by address.
    mappings: BTreeMap<u64, Mapping>,
}

#[derive(Debug, Clone, Copy)]
struct Mapping {
    bytes: usize,
    /// The device whose memory it is (and which alone may access it).
    dev: i32,
    handle: RawVmm,
}

/// `len` bytes of host address space at `addr` (aligned to [`VMM_GRANULARITY`]), mapped
/// with nothing behind it except where [`AddressSpace::remap`] made pages usable; all of
/// it unmapped on drop.
#[derive(Debug)]
struct AddressSpace {
    addr: u64,
    len: usize,
}

fn mmap_anonymous(addr: u64, len: usize, usable: bool) -> io::Result<u64> {
    let (prot, extra) = match usable {
        true => (libc::PROT_READ | libc::PROT_WRITE, 0),
        false => (libc::PROT_NONE, libc::MAP_NORESERVE),
    };
    let fixed = if addr == 0 { 0 } else { libc::MAP_FIXED };
    // SAFETY: anonymous memory, no descriptor. Without an address the kernel places the
    // mapping where nothing is; with one (`MAP_FIXED`), the caller vouches that it owns
    // `[addr, addr + len)` and that nothing refers into what is replaced.
    let start = unsafe {
        libc::mmap(
            std::ptr::with_exposed_provenance_mut(addr as usize),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra | fixed,
            -1,
            0,
        )
    };
    if start == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(start.expose_provenance() as u64)
}

fn munmap(addr: u64, len: usize) {
    // SAFETY: callers own `[addr, addr + len)` (their mapping, or part of it) and nothing
    // refers into it any more.
    unsafe { libc::munmap(std::ptr::with_exposed_provenance_mut::<libc::c_void>(addr as usize), len) };
}

impl AddressSpace {
    /// Reserves `len` bytes (a multiple of the granularity): a mapping one granule larger,
    /// trimmed to the aligned range inside it.
    fn reserve(len: usize) -> io::Result<AddressSpace> {
        let over = len.checked_add(VMM_GRANULARITY).ok_or(io::ErrorKind::OutOfMemory)?;
        let start = mmap_anonymous(0, over, false)?;
        let addr = start.next_multiple_of(VMM_GRANULARITY as u64);
        let head = (addr - start) as usize;
        if head > 0 {
            munmap(start, head);
        }
        if over - head > len {
            munmap(addr + len as u64, over - head - len);
        }
        Ok(AddressSpace { addr, len })
    }

    /// Makes `[ptr, ptr + len)` (inside the space, not mapped) fresh zeroed read-write
    /// pages. On failure the range is left as it was, with nothing behind it.
    fn map(&self, ptr: u64, len: usize) -> io::Result<()> {
        if let Err(e) = mmap_anonymous(ptr, len, true) {
            self.unmap(ptr, len);
            return Err(e);
        }
        Ok(())
    }

    /// Gives the pages of `[ptr, ptr + len)` (inside the space) back to the host: address
    /// space with nothing behind it again.
    fn unmap(&self, ptr: u64, len: usize) {
        if mmap_anonymous(ptr, len, false).is_err() {
            // The kernel could not remap (out of mappings): give the pages back at least.
            // SAFETY: inside this space, which nothing refers into once unmapped.
            unsafe {
                libc::madvise(std::ptr::with_exposed_provenance_mut(ptr as usize), len, libc::MADV_DONTNEED)
            };
        }
    }
}

impl Drop for AddressSpace {
    fn drop(&mut self) {
        // Nothing runs on it once its reservation is gone: every access checks first that
        // its memory is still mapped (`State::backed`), under the state lock.
        munmap(self.addr, self.len);
    }
}

/// `CUDA_ERROR_INVALID_VALUE` from `call`, saying why.
fn refuse(call: &'static str, why: String) -> Error {
    invalid_value(call).context(why)
}

/// `call`'s refusal of a size that is not a non-zero multiple of the granularity.
fn granular(call: &'static str, bytes: usize) -> Result<()> {
    if bytes == 0 || !bytes.is_multiple_of(VMM_GRANULARITY) {
        return Err(refuse(
            call,
            format!("{bytes} bytes is not a multiple of the granularity ({VMM_GRANULARITY} bytes)"),
        ));
    }
    Ok(())
}

impl State {
    /// `cuMemAddressReserve`.
    pub(super) fn vmm_reserve(&mut self, bytes: usize) -> Result<DevPtr> {
        const CALL: &str = "cuMemAddressReserve";
        granular(CALL, bytes)?;
        let space = AddressSpace::reserve(bytes).map_err(|e| {
            oom(CALL).context(format!("the host could not reserve {bytes} bytes of address space: {e}"))
        })?;
        let addr = space.addr;
        self.reservations.insert(addr, Reservation { space, mappings: BTreeMap::new() });
        Ok(addr)
    }

    /// `cuMemAddressFree`.
    pub(super) fn vmm_free(&mut self, ptr: DevPtr, bytes: usize) -> Result<()> {
        const CALL: &str = "cuMemAddressFree";
        let Some(r) = self.reservations.get(&ptr) else {
            return Err(refuse(CALL, format!("{ptr:#x} is not the start of a reservation of {}", self.name)));
        };
        if r.space.len != bytes {
            return Err(refuse(
                CALL,
                format!("the reservation at {ptr:#x} is {} bytes, not {bytes}", r.space.len),
            ));
        }
        if let Some((&at, m)) = r.mappings.iter().next() {
            return Err(refuse(
                CALL,
                format!(
                    "{} mapping(s) are left in the reservation at {ptr:#x}, the first at {at:#x} \
                     ({} bytes): unmap them first",
                    r.mappings.len(),
                    m.bytes
                ),
            ));
        }
        self.reservations.remove(&ptr);
        Ok(())
    }

    /// `cuMemCreate`, `cuMemMap` and `cuMemSetAccess`.
    pub(super) fn vmm_map(&mut self, dev: i32, ptr: DevPtr, bytes: usize) -> Result<RawVmm> {
        const MAP: &str = "cuMemMap";
        granular("cuMemCreate", bytes)?;
        if bytes > self.free_bytes(dev) {
            return Err(oom("cuMemCreate"));
        }
        let end = ptr.checked_add(bytes as u64);
        let Some(base) = end.and_then(|end| self.reservation_holding(ptr, end)) else {
            return Err(refuse(
                MAP,
                format!("[{ptr:#x}, +{bytes}) is not inside one reservation of {}", self.name),
            ));
        };
        if !ptr.is_multiple_of(VMM_GRANULARITY as u64) {
            return Err(refuse(
                MAP,
                format!("{ptr:#x} is not a multiple of the granularity ({VMM_GRANULARITY} bytes)"),
            ));
        }
        let r = &self.reservations[&base];
        let end = ptr + bytes as u64;
        if let Some((&at, m)) =
            r.mappings.range(..end).next_back().filter(|(&at, m)| at + m.bytes as u64 > ptr)
        {
            return Err(refuse(
                MAP,
                format!("[{ptr:#x}, +{bytes}) overlaps the mapping at {at:#x} ({} bytes)", m.bytes),
            ));
        }
        r.space.map(ptr, bytes).map_err(|_| host_refused(self, bytes))?;
        let handle = self.next_vmm;
        self.next_vmm += 0x10;
        self.devices[dev as usize].allocated += bytes;
        let r = self.reservations.get_mut(&base).expect("found above");
        r.mappings.insert(ptr, Mapping { bytes, dev, handle });
        self.rebuild_runs(base);
        Ok(handle)
    }

    /// `cuMemUnmap` and `cuMemRelease`. Validates before anything else, so that a bad
    /// argument changes nothing.
    pub(super) fn vmm_unmap(&mut self, ptr: DevPtr, bytes: usize, handle: RawVmm) -> Result<()> {
        const CALL: &str = "cuMemUnmap";
        let found = self
            .reservation_holding(ptr, ptr.saturating_add(1))
            .and_then(|base| Some((base, *self.reservations[&base].mappings.get(&ptr)?)));
        let Some((base, m)) = found else {
            return Err(refuse(CALL, format!("{ptr:#x} is not the start of a mapping of {}", self.name)));
        };
        if m.bytes != bytes {
            return Err(refuse(
                CALL,
                format!(
                    "the mapping at {ptr:#x} is {} bytes, not {bytes} (one mapping is unmapped at a time)",
                    m.bytes
                ),
            ));
        }
        if m.handle != handle {
            return Err(refuse(
                "cuMemRelease",
                format!("{handle:#x} is not the handle of the mapping at {ptr:#x} ({:#x})", m.handle),
            ));
        }
        // Synchronous: waits for the device of the memory first, as `cuMemFree` does.
        self.run_all(m.dev);
        let r = self.reservations.get_mut(&base).expect("found above");
        r.mappings.remove(&ptr);
        r.space.unmap(ptr, bytes);
        self.devices[m.dev as usize].allocated -= bytes;
        self.rebuild_runs(base);
        Ok(())
    }

    /// Gives every reservation back to the host, with what is mapped in it: for a device
    /// that is closed, where nothing runs any more.
    pub(super) fn release_vmm(&mut self) {
        for (base, r) in std::mem::take(&mut self.reservations) {
            self.forget_runs(base, r.space.len);
            for m in r.mappings.values() {
                self.devices[m.dev as usize].allocated -= m.bytes;
            }
        }
    }

    /// The start of the reservation that holds all of `[ptr, end)`, if one does.
    fn reservation_holding(&self, ptr: u64, end: u64) -> Option<u64> {
        let (&base, r) = self.reservations.range(..=ptr).next_back()?;
        (end <= base + r.space.len as u64).then_some(base)
    }

    /// Whether any byte of `[ptr, ptr + bytes)` is reserved address space (mapped or not).
    pub(super) fn overlaps_reservation(&self, ptr: DevPtr, bytes: usize) -> bool {
        let end = ptr.saturating_add(bytes as u64);
        self.reservations.range(..end).next_back().is_some_and(|(&s, r)| s + r.space.len as u64 > ptr)
    }

    /// Removes the live allocations inside `[base, base + len)`: the runs of a reservation.
    fn forget_runs(&mut self, base: u64, len: usize) {
        let runs: Vec<u64> = self.allocs.range(base..base + len as u64).map(|(&a, _)| a).collect();
        for run in runs {
            self.allocs.remove(&run);
        }
    }

    /// Makes the live allocations inside reservation `base` its runs of adjacent mappings
    /// of one device, one allocation each.
    fn rebuild_runs(&mut self, base: u64) {
        let r = &self.reservations[&base];
        let mut runs: Vec<(u64, usize, i32)> = Vec::new();
        for (&at, m) in &r.mappings {
            match runs.last_mut() {
                Some((start, len, dev)) if *start + *len as u64 == at && *dev == m.dev => *len += m.bytes,
                _ => runs.push((at, m.bytes, m.dev)),
            }
        }
        self.forget_runs(base, r.space.len);
        for (start, len, dev) in runs {
            let run = Alloc {
                bytes: len,
                size: len,
                kind: AllocKind::Mapped,
                dev,
                block: None,
                prefetched: Prefetched::default(),
            };
            self.allocs.insert(start, run);
        }
    }
}
