//! Growth in place (`PoolOptions::expandable`): one range of addresses, reserved when the
//! pool is made and mapped from its start, that grows by mapping device memory at its end.
//!
//! Why: chunks from the upstream lie apart, and a block never spans two of them, so a pool
//! of chunks cannot serve a request larger than the largest free run of any one chunk,
//! however much is free in all of them; it grows a new chunk instead. In one range that
//! grows at its end, the free block at the end and the new memory are one block: growth
//! maps only what that block lacks. On a model of the window workload at one thread (the
//! pool's size classes, growth as the pool grows; `python3 benchmarks/window_fit.py
//! --growth`), separate chunks needed 1.57 to 1.61 times the peak live bytes and growth in
//! place, with the fit it uses, 1.19 to 1.22 (`benchmarks/RESULTS.md`, "Commits b4d5e5c
//! and 2213714").
//!
//! The range is one chunk of the chunk table, whose size is what is mapped; its blocks
//! merge across mappings, since the memory is contiguous. Mappings are made and unmapped
//! whole (`cuMemUnmap` takes a whole mapping), at the end only, one thread at a time (the
//! region's lock, held across the driver's call; taken before the common list's and a
//! shard's). The end is given back when the free block there covers whole mappings.

use super::chunks::Chunk;
use super::freelist::FreeBlock;
use super::ShardedPoolMemoryResource;
use crate::device::{DevPtr, RawVmm};
use crate::error::{Error, Result};
use crate::resource::{MemoryKind, ResourceRef};
use crate::stream::Stream;
use crate::sync::{lock, Mutex, Ordering};

/// The range's id in the chunk table (the upstream's chunks count from 2).
pub(super) const REGION_CHUNK: u64 = 1;

/// The reserved range and its mappings.
#[derive(Debug)]
pub(super) struct Region {
    pub base: DevPtr,
    capacity: usize,
    granularity: usize,
    /// The mappings, in address order, contiguous from `base`.
    pieces: Mutex<Vec<Piece>>,
}

#[derive(Debug, Clone, Copy)]
struct Piece {
    start: DevPtr,
    size: usize,
    handle: RawVmm,
}

/// What growth in place did.
pub(super) enum InPlace {
    Grown(Chunk),
    /// The cap (the footprint budget's allowance, or the maximum) leaves no room for the
    /// mapping. Under the budget the upstream is not asked either, since a chunk apart
    /// squeezed under the cap is what growth in place is there to avoid (with it, one
    /// stream held 1.30 times its peak live bytes in the window footprint test at one
    /// thread on the simulated device, `tests/footprint.rs`'s
    /// `window_1_thread_expandable_holds_less`, against 1.22 without, when this was
    /// measured); under the maximum it is, for what fits (a maximum that is not a
    /// multiple of the granularity would otherwise never be reached).
    OverCap,
    /// No range, no room left in it, or no device memory for the mapping: the upstream
    /// is asked, as without a range.
    Unavailable,
}

fn end_of(base: DevPtr, pieces: &[Piece]) -> DevPtr {
    pieces.last().map_or(base, |p| p.start + p.size as u64)
}

impl Region {
    /// Reserves the range of a pool over `upstream` that holds at most `maximum` bytes: as
    /// much as the device has (or the maximum, if less), rounded up to the granularity.
    pub fn reserve(upstream: &ResourceRef, maximum: usize) -> Result<Region> {
        if upstream.memory_kind() != MemoryKind::Device || upstream.depth() != 1 {
            return Err(Error::invalid(format!(
                "expandable pools map device memory themselves, so the upstream must be device \
                 memory (CudaMemoryResource or CudaAsyncMemoryResource), not {}",
                upstream.name()
            )));
        }
        let (backend, dev) = (upstream.backend(), upstream.device());
        let granularity = backend.vmm_granularity(dev)?;
        let (_, total) = backend.mem_get_info(dev)?;
        let limit = maximum.min(total);
        // Rounded up to the granularity, or down where that does not fit a `usize`.
        let capacity =
            limit.checked_next_multiple_of(granularity).unwrap_or(limit / granularity * granularity);
        let base = backend.vmm_reserve(dev, capacity)?;
        Ok(Region { base, capacity, granularity, pieces: Mutex::new(Vec::new()) })
    }
}

impl ShardedPoolMemoryResource {
    /// Growth in place for `size` bytes (a class size) on the shard of `key`: maps what
    /// the free block at the range's end lacks (when that shard holds the block), rounded
    /// up to the granularity, within `cap` (at most the maximum). [`InPlace::Grown`] has the block and the new
    /// memory as one span from the block's start, out of every list (for `place_chunk`).
    pub(super) fn grow_in_place(
        &self,
        size: usize,
        cap: usize,
        stream: &Stream,
        key: Option<u64>,
    ) -> Result<InPlace> {
        let Some(r) = &self.region else { return Ok(InPlace::Unavailable) };
        let mut pieces = lock(&r.pieces);
        let end = end_of(r.base, &pieces);
        let shard = key.map(|k| self.shard_slow(k, stream));
        let at_end = |p: u64, b: &FreeBlock| b.chunk == REGION_CHUNK && p + b.size as u64 == end;
        // The free block at the end: in this stream's shard, or in the common list, whose
        // blocks are complete (after a gathering it holds them all).
        let mut from_common = false;
        let mut tail = shard.as_ref().and_then(|s| s.state.lock().free.take_free_where(at_end).pop());
        if tail.is_none() && self.common.bytes_hint() > 0 {
            tail = self.common.lock().take_free_where(at_end).pop();
            from_common = tail.is_some();
        }
        let put_back = || match (&shard, tail) {
            (Some(s), Some((p, b))) if !from_common => s.state.lock().free.insert(p, b),
            (_, Some((p, b))) => self.common.lock().insert(p, b),
            _ => {}
        };
        let have = tail.map_or(0, |(_, b)| b.size);
        let need = size.saturating_sub(have).next_multiple_of(r.granularity);
        let mapped = (end - r.base) as usize;
        if need > r.capacity - mapped {
            put_back();
            return Ok(InPlace::Unavailable);
        }
        if need > 0 {
            if self.reserve(need, need, cap).is_none() {
                put_back();
                return Ok(InPlace::OverCap);
            }
            match self.backend.vmm_map(self.device, end, need) {
                Ok(handle) => pieces.push(Piece { start: end, size: need, handle }),
                Err(e) => {
                    self.reserved.fetch_sub(need, Ordering::AcqRel);
                    put_back();
                    return if e.is_out_of_memory() { Ok(InPlace::Unavailable) } else { Err(e) };
                }
            }
            self.set_region_size(r, mapped + need);
            self.count_growth(need);
        }
        let start = tail.map_or(end, |(p, _)| p);
        Ok(InPlace::Grown(Chunk { start, size: have + need, id: REGION_CHUNK }))
    }

    /// Unmaps the mappings at the range's end that the free block there (in the common
    /// list, where gathering puts every completed block) covers whole, while more than
    /// `keep` bytes of the common list stay free; returns the bytes unmapped.
    pub(super) fn trim_in_place(&self, keep: usize) -> Result<usize> {
        let Some(r) = &self.region else { return Ok(0) };
        let mut pieces = lock(&r.pieces);
        let end = end_of(r.base, &pieces);
        let at_end = |p: u64, b: &FreeBlock| b.chunk == REGION_CHUNK && p + b.size as u64 == end;
        let (at, tail, mut excess) = {
            let mut common = self.common.lock();
            let excess = common.bytes().saturating_sub(keep);
            let Some((at, tail)) = common.take_free_where(at_end).pop() else { return Ok(0) };
            (at, tail, excess)
        };
        // With one heap, the end's free block may hold frees not yet complete: only what
        // lies above them is unmapped.
        let settled = self.heap.clear_from(at, end);
        let mut cut = pieces.len();
        while cut > 0 && pieces[cut - 1].start >= settled && pieces[cut - 1].size <= excess {
            excess -= pieces[cut - 1].size;
            cut -= 1;
        }
        let mut released = 0;
        let mut failed = None;
        while pieces.len() > cut {
            let p = pieces[pieces.len() - 1];
            // Complete (the common list holds completed blocks only): nothing uses it.
            match self.backend.vmm_unmap(self.device, p.start, p.size, p.handle) {
                Ok(()) => {
                    released += p.size;
                    pieces.pop();
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let new_end = end_of(r.base, &pieces);
        if new_end > at {
            self.common.lock().insert(at, FreeBlock { size: (new_end - at) as usize, ..tail });
        }
        if released > 0 {
            self.count_release(released);
            self.set_region_size(r, (new_end - r.base) as usize);
        }
        failed.map_or(Ok(released), Err)
    }

    /// Unmaps everything and frees the range (the pool is being dropped: nothing uses its
    /// memory any more); failures are recorded (`streampool::drop_errors`).
    pub(super) fn drop_region(&self) {
        let Some(r) = &self.region else { return };
        let pieces = std::mem::take(&mut *lock(&r.pieces));
        for p in pieces.iter().rev() {
            let unmapped = self.backend.vmm_unmap(self.device, p.start, p.size, p.handle);
            crate::error::record_if_failed(
                || format!("ShardedPoolMemoryResource's mapping {:#x} on drop", p.start),
                unmapped,
            );
        }
        let freed = self.backend.vmm_free(self.device, r.base, r.capacity);
        crate::error::record_if_failed(|| "ShardedPoolMemoryResource's address range on drop".into(), freed);
    }

    /// The range's entry in the chunk table now maps `mapped` bytes (none: no entry).
    fn set_region_size(&self, r: &Region, mapped: usize) {
        self.replace_table(|sorted| {
            sorted.retain(|c| c.id != REGION_CHUNK);
            if mapped > 0 {
                let c = Chunk { start: r.base, size: mapped, id: REGION_CHUNK };
                sorted.insert(sorted.partition_point(|x| x.start < r.base), c);
            }
        });
    }
}
