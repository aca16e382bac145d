//! The pool's chunks: what it took from the upstream, how it grows, and how it gives
//! whole chunks back.

use std::sync::Arc;

use super::freelist::FreeBlock;
use super::region::{InPlace, REGION_CHUNK};
use super::ShardedPoolMemoryResource;
use crate::device::DevPtr;
use crate::error::Result;
use crate::resource::ALIGNMENT;
use crate::stream::Stream;
use crate::sync::{read, write, Ordering};

/// Growth never asks the upstream for less than this (unless the request, the footprint
/// budget or the maximum leave less): the driver's pools map memory in 2 MiB pages.
pub const MIN_CHUNK: usize = 2 << 20;
/// Growth asks for at most this beyond the request.
pub const MAX_GROWTH_STEP: usize = 1 << 30;

/// The chunk table: every upstream allocation, sorted by start. Replaced (never changed
/// in place) on growth and release; read off the hot path only.
#[derive(Debug, Default)]
pub(super) struct ChunkTable {
    pub sorted: Vec<Chunk>,
}

impl ChunkTable {
    /// The chunk that `[ptr, ptr + size)` lies in, if `ptr` is on a 256-byte boundary of it.
    pub fn containing(&self, ptr: DevPtr, size: usize) -> Option<&Chunk> {
        let after = self.sorted.partition_point(|c| c.start <= ptr);
        let c = &self.sorted[after.checked_sub(1)?];
        let end = ptr.checked_add(size as u64)?;
        let fits = end <= c.start + c.size as u64 && (ptr - c.start).is_multiple_of(ALIGNMENT as u64);
        fits.then_some(c)
    }

    pub fn by_id(&self, id: u64) -> Option<&Chunk> {
        self.sorted.iter().find(|c| c.id == id)
    }
}

#[derive(Debug, Clone)]
pub(super) struct Chunk {
    pub start: u64,
    pub size: usize,
    pub id: u64,
}

impl ShardedPoolMemoryResource {
    /// The chunk table now (off the hot path).
    pub(super) fn table(&self) -> Arc<ChunkTable> {
        read(&self.chunks).clone()
    }

    /// Takes `want` bytes (at least `size`; less when the maximum leaves less) from the
    /// upstream on `stream` as a new chunk, not yet listed as free anywhere. When the
    /// upstream cannot give `want` but `want > size`, asks again for `size` alone: the
    /// step beyond the request is a convenience, never a reason to fail. The reservation is
    /// made before the upstream call and rolled back if it fails, so concurrent growths
    /// never pass the maximum.
    pub(super) fn grow(&self, size: usize, want: usize, stream: &Stream, key: Option<u64>) -> Result<Chunk> {
        match self.grow_under(size, want, self.maximum, stream, key)? {
            Some(chunk) => Ok(chunk),
            None => Err(self.out_of_memory(size.next_multiple_of(ALIGNMENT), None)),
        }
    }

    /// [`grow`](Self::grow), keeping the reserved bytes at or under `cap` (the maximum, or
    /// the footprint budget's allowance): `None` when not even `size` fits under it. The
    /// cap is applied in the reservation itself, so that threads growing at once stay
    /// within it together (checked apart from the reservation, threads growing at once
    /// each took the whole allowance: the window workload at 16 threads on the H200 held
    /// 6.4-6.5 times its peak live bytes, against 5.3-6.1 with the check in the
    /// reservation; `benchmarks/RESULTS.md`, "Commits f72ca39, 1e2e633 and cd217fe").
    ///
    /// An expandable pool grows in place first, for the shard of `key` (`region.rs`):
    /// the chunk returned then starts at the free block that ended the range, and `want`
    /// beyond `size` does not apply (in place, a step ahead would be memory no one asked
    /// for; the next growth joins this one anyway). Where the range cannot hold it, or a
    /// whole piece of the granularity would pass the maximum, the upstream serves it.
    pub(super) fn grow_under(
        &self,
        size: usize,
        want: usize,
        cap: usize,
        stream: &Stream,
        key: Option<u64>,
    ) -> Result<Option<Chunk>> {
        let size = size.next_multiple_of(ALIGNMENT);
        let cap = cap.min(self.maximum);
        match self.grow_in_place(size, cap, stream, key)? {
            InPlace::Grown(chunk) => return Ok(Some(chunk)),
            // Under the footprint budget: no growth now (the caller looks elsewhere first).
            InPlace::OverCap if cap < self.maximum => return Ok(None),
            // Under the maximum, which the granularity's pieces overshoot (a maximum that is
            // not a multiple of it, or room for less than a piece): the upstream serves it.
            InPlace::OverCap | InPlace::Unavailable => {}
        }
        let mut want = want.max(size);
        loop {
            let Some(chunk) = self.reserve(size, want, cap) else { return Ok(None) };
            match self.upstream.allocate(chunk, stream) {
                Ok(start) => return Ok(Some(self.add_chunk(start, chunk))),
                Err(e) => {
                    self.reserved.fetch_sub(chunk, Ordering::AcqRel);
                    if !(e.is_out_of_memory() && chunk > size) {
                        return Err(self.out_of_memory_after(size, e));
                    }
                    want = size;
                }
            }
        }
    }

    /// Reserves up to `want` bytes (at least `size`) under `cap`; returns how many, or
    /// `None` when `size` does not fit.
    pub(super) fn reserve(&self, size: usize, want: usize, cap: usize) -> Option<usize> {
        let mut reserved = self.reserved.load(Ordering::Relaxed);
        loop {
            let room = cap.saturating_sub(reserved);
            if size > room {
                return None;
            }
            let chunk = want.min(room / ALIGNMENT * ALIGNMENT).max(size);
            match self.reserved.compare_exchange_weak(
                reserved,
                reserved + chunk,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(chunk),
                Err(now) => reserved = now,
            }
        }
    }

    /// Replaces the chunk table by a copy that `change` edited (kept sorted by start).
    pub(super) fn replace_table(&self, change: impl FnOnce(&mut Vec<Chunk>)) {
        let mut table = write(&self.chunks);
        let mut next = table.sorted.clone();
        change(&mut next);
        *table = Arc::new(ChunkTable { sorted: next });
    }

    fn add_chunk(&self, start: DevPtr, size: usize) -> Chunk {
        let c = Chunk { start, size, id: self.next_chunk.fetch_add(1, Ordering::Relaxed) };
        self.replace_table(|sorted| sorted.insert(sorted.partition_point(|x| x.start < start), c.clone()));
        self.count_growth(size);
        c
    }

    /// Counts a growth of `bytes` (reserved already, by [`reserve`](Self::reserve)), now
    /// held: the peak is of memory held, never of a reservation whose growth failed.
    pub(super) fn count_growth(&self, bytes: usize) {
        let c = &self.counters;
        c.growths.fetch_add(1, Ordering::Relaxed);
        // Released bytes read after the growth is counted: never more than is held then
        // (less, when another thread grew and gave back in between).
        let grown = c.grown_bytes.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        let held = grown.saturating_sub(c.released_bytes.load(Ordering::Relaxed));
        c.peak_reserved.fetch_max(held as usize, Ordering::Relaxed);
    }

    /// Counts `bytes` given back to the device, no longer reserved.
    pub(super) fn count_release(&self, bytes: usize) {
        self.reserved.fetch_sub(bytes, Ordering::AcqRel);
        self.counters.released_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Gives whole free chunks of the common list back to the upstream (and, in an
    /// expandable pool, unmaps the free end of its range) until at most `keep` free bytes
    /// remain; returns the bytes released.
    pub(super) fn trim(&self, keep: usize) -> Result<usize> {
        let in_place = self.trim_in_place(keep)?;
        let whole = {
            let table = self.table();
            // With one heap, a chunk freed whole may still be in use on the streams that
            // freed it: it goes back once their frees are known complete.
            let is_whole = |ptr: u64, b: &FreeBlock| {
                b.chunk != REGION_CHUNK
                    && table.by_id(b.chunk).is_some_and(|c| c.start == ptr && c.size == b.size)
                    && self.heap.settled(ptr, b.size)
            };
            let mut common = self.common.lock();
            let free_now = common.bytes();
            let mut candidates = common.take_free_where(is_whole);
            // Largest first: the fewest upstream calls for the excess (a chunk larger than
            // what is left of the excess stays).
            candidates.sort_by_key(|(_, b)| std::cmp::Reverse(b.size));
            let mut excess = free_now.saturating_sub(keep);
            let mut release = Vec::new();
            for (ptr, b) in candidates {
                if excess >= b.size {
                    excess -= b.size;
                    release.push((ptr, b));
                } else {
                    common.insert(ptr, b);
                }
            }
            release
        };
        // Out of the table (by id) before the upstream has them back: once it has, it may
        // hand the same addresses to other threads' growth at once, and those chunks (same
        // start, other ids) stay.
        self.replace_table(|sorted| sorted.retain(|c| !whole.iter().any(|(_, b)| b.chunk == c.id)));
        let mut released = in_place;
        for (i, &(ptr, b)) in whole.iter().enumerate() {
            // Complete, so any stream orders the free; the legacy one always exists.
            if let Err(e) = self.upstream.deallocate(ptr, b.size, &Stream::legacy()) {
                // The pool still holds this chunk and the rest: free again, as they were.
                let rest = &whole[i..];
                self.replace_table(|sorted| {
                    sorted.extend(rest.iter().map(|&(start, b)| Chunk { start, size: b.size, id: b.chunk }));
                    sorted.sort_by_key(|c| c.start);
                });
                self.common.lock().insert_all(rest.iter().copied(), 0);
                return Err(e);
            }
            self.count_release(b.size);
            released += b.size;
        }
        Ok(released)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The chunk look-up finds the same chunk as a scan of every chunk, for chunks of
        /// any size and alignment.
        #[test]
        fn chunk_lookup_matches_a_scan(
            gaps in proptest::collection::vec((0u64..20_000, 1usize..40_000), 1..12),
            probes in proptest::collection::vec((0u64..600_000, 1usize..4), 1..64),
        ) {
            let (mut at, mut chunks) = (1u64 << 40, Vec::new());
            for (i, (gap, granules)) in gaps.into_iter().enumerate() {
                at += gap * 256;
                chunks.push(Chunk { start: at, size: granules * 256, id: i as u64 + 1 });
                at += granules as u64 * 256;
            }
            let table = ChunkTable { sorted: chunks.clone() };
            for (offset, granules) in probes {
                let ptr = (1u64 << 40) + offset * 64;
                let size = granules * 256;
                let scan = chunks.iter().find(|c| {
                    c.start <= ptr && ptr + size as u64 <= c.start + c.size as u64 && (ptr - c.start).is_multiple_of(256)
                });
                prop_assert_eq!(table.containing(ptr, size).map(|c| c.id), scan.map(|c| c.id));
            }
            for c in &chunks {
                prop_assert_eq!(table.by_id(c.id).map(|c| c.start), Some(c.start));
            }
        }
    }
}
