//! Free blocks of one shard (or of the common list): a two-level segregated fit (TLSF)
//! free list with its headers on the host, since the memory it manages is the device's.
//!
//! * **Lists by size**: one list per size range, 8 ranges per power of two (one per 256
//!   bytes below 4 KiB), and a bitmap of the non-empty lists. A request of `size` bytes
//!   takes the head of the first non-empty list whose every block fits: a few bit
//!   operations, whatever the number of blocks.
//! * **Coalescing at once**: two hash maps find the free block that ends where a freed block
//!   starts and the one that starts where it ends; neighbours of the same upstream chunk
//!   merge on the spot, so free memory stays in few large blocks.
//! * **A slab of headers**: block records live in one vector, linked into their list by
//!   index, and are reused; after warm-up an operation allocates nothing.
//! * **The last freed block** waits in a slot before it is merged: an allocation of
//!   exactly its size takes it back without touching the lists or the maps (a stream that
//!   frees and allocates one size in turn, the commonest pattern, does no hashing at all).
//!   The next free pushes it into the lists, so at most one block is ever unmerged.
//!
//! Requests are rounded by [`class_size`] to a list boundary (at most 12.5 % more than
//! asked), so that the first block of the first non-empty list at or above the request's
//! own list always fits. Addresses are integers; nothing here is `unsafe`.

use super::addrmap::AddrMap;
use crate::size::align_up;

/// Sizes of this or more are rounded to 256 bytes only (not to a list boundary).
const ROUND_MAX: usize = 64 << 20;
/// Lists: 15 below 4 KiB, then 8 per power of two up to 2^64.
const LISTS: usize = 15 + 52 * 8;
const WORDS: usize = LISTS.div_ceil(64);
const NIL: u32 = u32::MAX;

/// The size a request of `bytes` is served with: a multiple of 256 up to 4 KiB, then the
/// next of 8 boundaries per power of two (at most 12.5 % more than asked) below 64 MiB,
/// then a multiple of 256 again.
pub(crate) fn class_size(bytes: usize) -> usize {
    let b = align_up(bytes.max(1), 256);
    if b <= 4096 || b >= ROUND_MAX {
        return b;
    }
    let k = usize::BITS - 1 - b.leading_zeros();
    align_up(b, 1 << (k - 3))
}

/// The list of a block of `size` bytes (a multiple of 256): the one whose range holds it.
fn list_of(size: usize) -> usize {
    if size < 4096 {
        return size / 256 - 1;
    }
    let k = (usize::BITS - 1 - size.leading_zeros()) as usize;
    15 + (k - 12) * 8 + ((size >> (k - 3)) & 7)
}

/// The smallest size list `l` holds.
fn list_floor(l: usize) -> usize {
    if l < 15 {
        return (l + 1) * 256;
    }
    let (k, sub) = (12 + (l - 15) / 8, (l - 15) % 8);
    (8 + sub) << (k - 3)
}

/// A free block: its size, the upstream chunk it belongs to, and the epoch it was freed
/// in (see `mod.rs`: a block may go to another stream only once its epoch is known to
/// have completed, or after that stream waited on the epoch's event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FreeBlock {
    pub size: usize,
    pub chunk: u64,
    pub epoch: u64,
}

#[derive(Debug, Clone, Copy)]
struct Rec {
    ptr: u64,
    block: FreeBlock,
    list: u32,
    prev: u32,
    next: u32,
}

/// Free blocks (see the module docs).
#[derive(Debug)]
pub(crate) struct FreeList {
    /// The last freed block, not merged yet (see the module docs).
    recent: Option<(u64, FreeBlock)>,
    recs: Vec<Rec>,
    spare: Vec<u32>,
    heads: Vec<u32>,
    bits: [u64; WORDS],
    /// A free block's record by its start (`start`) and by its end (`end | 1`).
    ends: AddrMap,
    bytes: usize,
}

impl Default for FreeList {
    fn default() -> Self {
        FreeList {
            recent: None,
            recs: Vec::new(),
            spare: Vec::new(),
            heads: vec![NIL; LISTS],
            bits: [0; WORDS],
            ends: AddrMap::default(),
            bytes: 0,
        }
    }
}

impl FreeList {
    /// Free bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes + self.recent.map_or(0, |(_, b)| b.size)
    }

    /// Free blocks held, once the slot's block is merged.
    #[cfg(test)]
    pub fn merged_len(&mut self) -> usize {
        if let Some((p, b)) = self.recent.take() {
            self.merge(p, b);
        }
        self.ends.len() / 2
    }

    /// Takes the front `size` bytes of a free block whose epoch satisfies `ok` (the rest
    /// stays free, same chunk and epoch): the head of the first non-empty list whose blocks
    /// all fit, else (only when `ok` refuses heads, or for sizes that are not a list
    /// boundary) the first fitting block found list by list. Returns the address and the
    /// block taken (its size is `size`).
    pub fn take(&mut self, size: usize, ok: impl Fn(u64) -> bool) -> Option<(u64, FreeBlock)> {
        if let Some((ptr, b)) = self.recent {
            if b.size == size && ok(b.epoch) {
                self.recent = None;
                return Some((ptr, b));
            }
        }
        if let Some(found) = self.take_listed(size, &ok) {
            return Some(found);
        }
        // The unmerged block may fit, or complete a run that does.
        let (ptr, b) = self.recent.take()?;
        self.merge(ptr, b);
        self.take_listed(size, &ok)
    }

    fn take_listed(&mut self, size: usize, ok: &impl Fn(u64) -> bool) -> Option<(u64, FreeBlock)> {
        let own = list_of(size);
        let first = if list_floor(own) == size { own } else { own + 1 };
        let mut l = first;
        while let Some(found) = self.next_nonempty(l) {
            let head = self.heads[found];
            if ok(self.recs[head as usize].block.epoch) {
                return Some(self.carve(head, size));
            }
            if let Some(i) = self.find_in(found, |b| ok(b.epoch)) {
                return Some(self.carve(i, size));
            }
            l = found + 1;
        }
        // Blocks of the request's own list may fit too when it is not a boundary.
        let i = self.find_in(own, |b| b.size >= size && ok(b.epoch))?;
        Some(self.carve(i, size))
    }

    fn next_nonempty(&self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        if w >= WORDS {
            return None;
        }
        let mut word = self.bits[w] & (!0u64 << (from % 64));
        loop {
            if word != 0 {
                return Some(w * 64 + word.trailing_zeros() as usize);
            }
            w += 1;
            if w == WORDS {
                return None;
            }
            word = self.bits[w];
        }
    }

    fn find_in(&self, list: usize, ok: impl Fn(&FreeBlock) -> bool) -> Option<u32> {
        let mut i = self.heads[list];
        while i != NIL {
            let r = &self.recs[i as usize];
            if ok(&r.block) {
                return Some(i);
            }
            i = r.next;
        }
        None
    }

    /// Hands out the front `size` bytes of block `i`; the rest keeps the record.
    fn carve(&mut self, i: u32, size: usize) -> (u64, FreeBlock) {
        let Rec { ptr, block, .. } = self.recs[i as usize];
        debug_assert!(block.size >= size);
        self.ends.remove(ptr);
        self.bytes -= size;
        if block.size == size {
            self.ends.remove((ptr + size as u64) | 1);
            self.unlink(i);
            self.spare.push(i);
        } else {
            let r = &mut self.recs[i as usize];
            r.ptr = ptr + size as u64;
            r.block.size -= size;
            self.ends.insert(ptr + size as u64, i);
            self.relink(i);
        }
        (ptr, FreeBlock { size, ..block })
    }

    /// Adds a freed block. It waits in the slot; the block it displaces there is merged
    /// with its free neighbours of the same chunk, and a merged block carries the later of
    /// the epochs (it is usable where all parts are). The caller guarantees the block is not
    /// free already (the pool checks every free against its live allocations first).
    pub fn insert(&mut self, ptr: u64, block: FreeBlock) {
        debug_assert!(
            self.ends.get(ptr).is_none() && self.recent.is_none_or(|(p, _)| p != ptr),
            "pool bookkeeping: {ptr:#x} is already free"
        );
        if let Some((p, b)) = self.recent.replace((ptr, block)) {
            self.merge(p, b);
        }
    }

    /// Lists a block, merging it with its free neighbours.
    fn merge(&mut self, ptr: u64, block: FreeBlock) {
        let end = ptr + block.size as u64;
        // Neighbours are unhooked from the maps as they are looked up (one hash operation
        // each), and put back if they belong to another chunk (rare).
        let prev = self.ends.remove(ptr | 1).filter(|&p| {
            let same = self.recs[p as usize].block.chunk == block.chunk;
            if !same {
                self.ends.insert(ptr | 1, p);
            }
            same
        });
        let next = self.ends.remove(end).filter(|&n| {
            let same = self.recs[n as usize].block.chunk == block.chunk;
            if !same {
                self.ends.insert(end, n);
            }
            same
        });
        // The merged block keeps a neighbour's record: only the moved end is re-hashed.
        let (keep, new_end) = match (prev, next) {
            (None, None) => return self.add(ptr, block),
            (Some(p), None) => (p, end),
            (None, Some(n)) => {
                self.recs[n as usize].ptr = ptr;
                self.ends.insert(ptr, n);
                let r = &mut self.recs[n as usize].block;
                (r.size, r.epoch) = (r.size + block.size, r.epoch.max(block.epoch));
                self.bytes += block.size;
                self.relink(n);
                return;
            }
            (Some(p), Some(n)) => {
                let next = self.recs[n as usize];
                self.unlink(n);
                self.spare.push(n);
                let r = &mut self.recs[p as usize].block;
                (r.size, r.epoch) = (r.size + next.block.size, r.epoch.max(next.block.epoch));
                (p, next.ptr + next.block.size as u64)
            }
        };
        self.ends.insert(new_end | 1, keep);
        let r = &mut self.recs[keep as usize].block;
        (r.size, r.epoch) = (r.size + block.size, r.epoch.max(block.epoch));
        self.bytes += block.size;
        self.relink(keep);
    }

    /// Moves record `i` to the list of its (changed) size.
    fn relink(&mut self, i: u32) {
        if list_of(self.recs[i as usize].block.size) != self.recs[i as usize].list as usize {
            self.unlink(i);
            self.link(i);
        }
    }

    /// Removes and returns every block whose epoch satisfies `pred`.
    pub fn drain(&mut self, pred: impl Fn(u64) -> bool) -> Vec<(u64, FreeBlock)> {
        self.remove_where(|_, b| pred(b.epoch))
    }

    /// Removes and returns the blocks for which `is_whole(ptr, block)` holds.
    pub fn take_whole_chunks(&mut self, is_whole: impl Fn(u64, &FreeBlock) -> bool) -> Vec<(u64, FreeBlock)> {
        self.remove_where(is_whole)
    }

    fn remove_where(&mut self, pred: impl Fn(u64, &FreeBlock) -> bool) -> Vec<(u64, FreeBlock)> {
        if let Some((p, b)) = self.recent.take() {
            self.merge(p, b);
        }
        let found: Vec<u32> = self
            .ends
            .iter()
            .filter(|&(k, i)| k & 1 == 0 && pred(k, &self.recs[i as usize].block))
            .map(|(_, i)| i)
            .collect();
        found
            .into_iter()
            .map(|i| {
                let r = self.recs[i as usize];
                self.remove(i);
                (r.ptr, r.block)
            })
            .collect()
    }

    fn add(&mut self, ptr: u64, block: FreeBlock) {
        let rec = Rec { ptr, block, list: 0, prev: NIL, next: NIL };
        let i = match self.spare.pop() {
            Some(i) => {
                self.recs[i as usize] = rec;
                i
            }
            None => {
                self.recs.push(rec);
                u32::try_from(self.recs.len() - 1).expect("fewer than 2^32 free blocks")
            }
        };
        self.ends.insert(ptr, i);
        self.ends.insert((ptr + block.size as u64) | 1, i);
        self.bytes += block.size;
        self.link(i);
    }

    fn remove(&mut self, i: u32) {
        let Rec { ptr, block, .. } = self.recs[i as usize];
        self.ends.remove(ptr);
        self.ends.remove((ptr + block.size as u64) | 1);
        self.bytes -= block.size;
        self.unlink(i);
        self.spare.push(i);
    }

    /// Pushes record `i` on the list of its size.
    fn link(&mut self, i: u32) {
        let l = list_of(self.recs[i as usize].block.size);
        let head = self.heads[l];
        if head != NIL {
            self.recs[head as usize].prev = i;
        }
        let r = &mut self.recs[i as usize];
        (r.list, r.prev, r.next) = (l as u32, NIL, head);
        self.heads[l] = i;
        self.bits[l / 64] |= 1 << (l % 64);
    }

    fn unlink(&mut self, i: u32) {
        let Rec { list, prev, next, .. } = self.recs[i as usize];
        let l = list as usize;
        if prev == NIL {
            self.heads[l] = next;
            if next == NIL {
                self.bits[l / 64] &= !(1 << (l % 64));
            }
        } else {
            self.recs[prev as usize].next = next;
        }
        if next != NIL {
            self.recs[next as usize].prev = prev;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn block(size: usize, chunk: u64, epoch: u64) -> FreeBlock {
        FreeBlock { size, chunk, epoch }
    }

    #[test]
    fn classes_are_list_boundaries() {
        assert_eq!(class_size(1), 256);
        assert_eq!(class_size(4096), 4096);
        assert_eq!(class_size(4097), 4608);
        assert_eq!(class_size(1 << 20), 1 << 20);
        assert_eq!(class_size((1 << 20) + 1), (1 << 20) + (1 << 17));
        assert_eq!(class_size(ROUND_MAX + 1), ROUND_MAX + 256);
        for bytes in (1..ROUND_MAX).step_by(4093) {
            let size = class_size(bytes);
            assert!(size >= bytes && size - bytes <= bytes / 8 + 255, "{bytes} -> {size}");
            if size < ROUND_MAX {
                assert_eq!(list_floor(list_of(size)), size, "{size} is a boundary");
            }
        }
        for l in 0..LISTS - 1 {
            assert_eq!(list_of(list_floor(l)), l);
            assert_eq!(list_of(list_floor(l + 1) - 256), l, "list {l} ends where {} starts", l + 1);
        }
        assert_eq!(list_of(usize::MAX / 256 * 256), LISTS - 1);
    }

    #[test]
    fn takes_split_and_frees_coalesce() {
        let mut f = FreeList::default();
        f.insert(0x10000, block(3 * 4096 + 256, 1, 0));
        let a = f.take(4096, |_| true).unwrap().0;
        let b = f.take(4096, |_| true).unwrap().0;
        assert_eq!((a, b), (0x10000, 0x11000));
        f.insert(a, block(4096, 1, 2));
        assert_eq!(f.merged_len(), 2, "a is not next to the free rest");
        f.insert(b, block(4096, 1, 3));
        assert_eq!(f.merged_len(), 1, "a, b and the rest merged");
        assert_eq!(f.bytes(), 3 * 4096 + 256);
        assert_eq!(
            f.take(3 * 4096 + 256, |_| true),
            Some((0x10000, block(3 * 4096 + 256, 1, 3))),
            "the later epoch"
        );
        assert_eq!(f.bytes(), 0);
        assert_eq!(f.merged_len(), 0);
    }

    #[test]
    fn chunks_do_not_merge_and_epochs_filter() {
        let mut f = FreeList::default();
        f.insert(0x1000, block(256, 1, 5));
        f.insert(0x1100, block(256, 2, 1));
        assert_eq!(f.merged_len(), 2, "adjacent blocks of two chunks stay apart");
        assert_eq!(f.take(256, |e| e < 2), Some((0x1100, block(256, 2, 1))));
        assert_eq!(f.take(256, |e| e < 2), None);
        assert_eq!(f.take_whole_chunks(|_, b| b.chunk == 1).len(), 1);
        assert_eq!(f.bytes(), 0);
    }

    #[test]
    fn sizes_beyond_the_boundaries_fit_within_their_list() {
        let mut f = FreeList::default();
        let big = ROUND_MAX + 4096;
        f.insert(1 << 40, block(big, 1, 0));
        assert_eq!(f.take(ROUND_MAX + 8192, |_| true), None, "too big");
        assert_eq!(
            f.take(ROUND_MAX + 256, |_| true),
            Some((1 << 40, block(ROUND_MAX + 256, 1, 0))),
            "same list, fits"
        );
        assert_eq!(f.bytes(), 3840);
    }

    proptest! {
        /// Against a model (a map of free granules): every take returns free memory of the
        /// right chunk, nothing is lost, and neighbours of one chunk are always merged.
        #[test]
        fn matches_a_model(ops in proptest::collection::vec((0u8..3, 1usize..64, 0u64..4), 1..200)) {
            const G: u64 = 256;
            let mut f = FreeList::default();
            // Two adjacent chunks of 64 granules each.
            let mut free: BTreeMap<u64, u64> = BTreeMap::new(); // granule -> chunk
            for c in 0..2u64 {
                f.insert(0x100000 + c * 64 * G, block(64 * G as usize, c, 0));
                for g in 0..64 { free.insert(0x100000 / G + c * 64 + g, c); }
            }
            let mut live: Vec<(u64, usize, u64)> = Vec::new();
            for (op, n, epoch) in ops {
                if op < 2 || live.is_empty() {
                    let size = n * G as usize;
                    match f.take(size, |e| e <= epoch) {
                        Some((ptr, b)) => {
                            let chunk = free[&(ptr / G)];
                            prop_assert_eq!((b.size, b.chunk), (size, chunk));
                            for g in ptr / G..(ptr + size as u64) / G {
                                prop_assert_eq!(free.remove(&g), Some(chunk), "granule {:#x} not free or of another chunk", g);
                            }
                            live.push((ptr, size, chunk));
                        }
                        None => {
                            // Nothing fits under the epoch filter: no run of free granules
                            // of one chunk is long enough, or the filter refused it.
                            if epoch == 3 {
                                let longest = (0..2u64).map(|c| {
                                    let (mut best, mut run) = (0, 0);
                                    for g in 0..64 {
                                        if free.contains_key(&(0x100000 / G + c * 64 + g)) { run += 1; best = best.max(run) } else { run = 0 }
                                    }
                                    best
                                }).max().unwrap();
                                prop_assert!(longest < n as u64, "{} granules free in a row, {} asked", longest, n);
                            }
                        }
                    }
                } else {
                    let (ptr, size, chunk) = live.swap_remove(n % live.len());
                    f.insert(ptr, block(size, chunk, epoch));
                    for g in ptr / G..(ptr + size as u64) / G { free.insert(g, chunk); }
                }
                prop_assert_eq!(f.bytes() as u64, free.len() as u64 * G);
                // Maximal merging: the number of blocks is the number of runs of free
                // granules within a chunk.
                let runs = free.iter().filter(|(&g, &c)| g % 64 == 0 || free.get(&(g - 1)) != Some(&c)).count();
                prop_assert_eq!(f.merged_len(), runs);
            }
        }
    }
}
