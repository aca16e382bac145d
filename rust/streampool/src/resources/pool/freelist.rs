//! The blocks of one shard (or of the common list): a two-level segregated fit (TLSF)
//! free list with its headers on the host, since the memory it manages is the device's,
//! and with boundary tags, so that the hot path hashes once per allocation and once per
//! free.
//!
//! * **Records**: every block the shard knows is a record in a slab (reused, so after
//!   warm-up nothing is allocated): its address, size, chunk, and the epoch it was freed in
//!   when it is free. A record links to the records just before and after it in memory
//!   (`left`, `right`) when the shard owns those too: a block split here stays linked to
//!   its parts.
//! * **Lists by size**: free records sit in one list per size range, 16 ranges per power of
//!   two (one per 256 bytes below 4 KiB), with a bitmap of the non-empty lists. A request of
//!   `size` bytes takes the head of the first non-empty list whose every block fits: a few
//!   bit operations, whatever the number of blocks.
//! * **Live blocks** are found by address in a small open-addressing map ([`AddrMap`]): one
//!   insert per allocation, one removal per free. That map is also the check on frees: a
//!   double free, a pointer never handed out, or a wrong size is refused exactly.
//! * **Merging at once**: a freed block merges with the free records it links to, with no
//!   look-up at all.
//! * **Loose blocks**: a block that enters from elsewhere (freed on this stream after being
//!   allocated on another, taken from another shard, or grown) has no links. Such blocks
//!   are merged by address, in one sort of the records, when a request finds no fit (the
//!   only time merging more can matter; in a pool that grows in place, before the fit),
//!   not on every free. That sort links every record, live ones too, to its neighbours,
//!   and marks a side with none of this list's records next to it (`EDGE`), so that later
//!   frees merge at once again.
//!
//! Requests are rounded by [`class_size`] to a list boundary (at most 6.25 % more than
//! asked), so that the first block of the first non-empty list at or above the request's
//! own list always fits. Addresses are integers; nothing here is `unsafe`.
//!
//! The operations of the hot path are `#[inline(always)]`, so that the pool's `allocate`
//! and `deallocate` become one function each with no calls inside (68 ns per window
//! operation at one thread against 70-71 ns leaving it to the inliner, on a 2-core AMD
//! EPYC VM, on the simulated device: `benchmarks/RESULTS.md`, "Commit f68cb39").

use super::addrmap::AddrMap;
use crate::size::align_up;

/// Sizes of this or more are rounded to 256 bytes only (not to a list boundary).
const ROUND_MAX: usize = 64 << 20;
/// Lists per power of two (log2). 16, not TLSF's usual 8 or 32: rounding to 8 steps wastes
/// up to 12.5 % of a request (16 steps, 6.25 %), which the pool's footprint target (a peak
/// reserved of at most 1.25 times the peak live bytes) cannot afford; 32 would make the
/// bitmap scan longer for little.
const SUB_BITS: u32 = 4;
const SUB: usize = 1 << SUB_BITS;
/// Lists: 15 below 4 KiB, then `SUB` per power of two up to 2^64.
const LISTS: usize = 15 + 52 * SUB;
const WORDS: usize = LISTS.div_ceil(64);
const NIL: u32 = u32::MAX;
/// `Rec::left` or `Rec::right` where no record of this list lies next to the block (as of
/// the last merge by address, or since the neighbour left): unlike `NIL` (not known), a free
/// there has nothing to merge with by address.
const EDGE: u32 = u32::MAX - 1;
/// `Rec::list` of a live record (handed out, in the live map).
const LIVE: u32 = u32::MAX;
/// `Rec::list` of a record in the slab's spare stack.
const SPARE: u32 = u32::MAX - 1;

/// The size a request of `bytes` is served with: a multiple of 256 up to 4 KiB, then the
/// next of 16 boundaries per power of two (at most 6.25 % more than asked) below 64 MiB,
/// then a multiple of 256 again. (`bytes` is at most `isize::MAX`.)
#[inline(always)]
pub(crate) fn class_size(bytes: usize) -> usize {
    let b = align_up(bytes.max(1), 256);
    let k = usize::BITS - 1 - b.leading_zeros();
    let rounded = align_up(b, 1 << (k - SUB_BITS));
    select(b <= 4096 || b >= ROUND_MAX, b, rounded)
}

/// The list of a block of `size` bytes (a multiple of 256): the one whose range holds it.
#[inline(always)]
fn list_of(size: usize) -> usize {
    let k = (usize::BITS - 1 - size.leading_zeros()) as usize;
    let large = k
        .wrapping_sub(12)
        .wrapping_mul(SUB)
        .wrapping_add(15 + ((size >> (k - SUB_BITS as usize)) & (SUB - 1)));
    select(size < 4096, size / 256 - 1, large)
}

/// The smallest size list `l` holds.
#[inline(always)]
fn list_floor(l: usize) -> usize {
    let (k, sub) = (12 + l.wrapping_sub(15) / SUB, l.wrapping_sub(15) % SUB);
    let large = (SUB + sub).checked_shl((k.wrapping_sub(SUB_BITS as usize)) as u32).unwrap_or(0);
    select(l < 15, (l + 1) * 256, large)
}

/// Whether a link names a record (not `NIL` or `EDGE`).
#[inline(always)]
fn is_rec(link: u32) -> bool {
    link < EDGE
}

/// `if c { a } else { b }` without a branch: the size functions above run on every
/// operation with random sizes, where a branch on `size < 4096` is mispredicted often.
#[inline(always)]
fn select(c: bool, a: usize, b: usize) -> usize {
    let mask = (c as usize).wrapping_neg();
    (a & mask) | (b & !mask)
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

/// Why a free was refused (nothing changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotFreed {
    /// No live block of this list starts there.
    Unknown,
    /// The live block there has this size.
    WrongSize(usize),
}

#[derive(Debug, Clone, Copy)]
struct Rec {
    ptr: u64,
    size: usize,
    chunk: u64,
    epoch: u64,
    /// The records just before and after this one in memory, when this list owns them;
    /// else `EDGE` (none of this list there) or `NIL` (not known).
    left: u32,
    right: u32,
    /// Links in the size list (free records).
    prev: u32,
    next: u32,
    /// The size list (free), `LIVE` or `SPARE`.
    list: u32,
}

impl Rec {
    /// A record of a block that entered from elsewhere: linked to nothing, in no list yet
    /// (`list` is `LIVE` until [`FreeList::link`] lists a free one).
    fn loose(ptr: u64, b: FreeBlock) -> Rec {
        let FreeBlock { size, chunk, epoch } = b;
        Rec { ptr, size, chunk, epoch, left: NIL, right: NIL, prev: NIL, next: NIL, list: LIVE }
    }
}

/// The blocks of a shard (see the module docs).
#[derive(Debug)]
pub(crate) struct FreeList {
    recs: Vec<Rec>,
    spare: Vec<u32>,
    heads: [u32; LISTS],
    bits: [u64; WORDS],
    /// Live records by address.
    live: AddrMap,
    /// Free bytes.
    bytes: usize,
    /// A free record may have an unlinked free neighbour: merging by address may help.
    loose: bool,
    /// The free records' indices while merging, kept: a shard that gets blocks from
    /// elsewhere merges often, and need not allocate each time.
    scratch: Vec<u32>,
    /// Of the heads of the first two lists that fit, take the lower address (see
    /// [`FreeList::new`]).
    lower_first: bool,
}

impl Default for FreeList {
    fn default() -> Self {
        FreeList {
            recs: Vec::new(),
            spare: Vec::new(),
            heads: [NIL; LISTS],
            bits: [0; WORDS],
            live: AddrMap::default(),
            bytes: 0,
            loose: false,
            scratch: Vec::new(),
            lower_first: false,
        }
    }
}

impl FreeList {
    /// An empty list. `lower_first`, for a pool that grows in place: a request takes the
    /// head of the first list that fits or of the next non-empty one, whichever lies lower
    /// in memory, so that blocks gather at the start of the range and its end stays free
    /// to grow into. On a model of the window workload at one thread over many passes
    /// (`python3 benchmarks/window_fit.py --growth`), growth in place with the first list's
    /// head alone held 1.27 to 1.31 times the peak live bytes, with the lower of two heads
    /// 1.19 to 1.22, the same as a first fit over every block (`benchmarks/RESULTS.md`,
    /// "Commits b4d5e5c and 2213714"). Without a range to grow, preferring low
    /// addresses held more (1.59 against 1.41 times: `IMPLEMENTATION.md`), so it is off.
    pub fn new(lower_first: bool) -> Self {
        FreeList { lower_first, ..FreeList::default() }
    }

    /// Free bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Hands out `size` bytes (a class size) from the free blocks, and records them live
    /// here (to be given back by [`free`](Self::free) or [`take_live`](Self::take_live)).
    #[inline(always)]
    pub fn allocate(&mut self, size: usize) -> Option<u64> {
        let i = self.find(size, &|_| true)?;
        let a = self.carve(i, size);
        let ptr = self.recs[a as usize].ptr;
        self.live.insert(ptr, a);
        Some(ptr)
    }

    /// Takes the front `size` bytes of a free block whose epoch satisfies `ok` out of this
    /// list (for another shard; the rest stays free, same chunk and epoch). Returns the
    /// address and the block taken (its size is `size`).
    pub fn take(&mut self, size: usize, ok: impl Fn(u64) -> bool) -> Option<(u64, FreeBlock)> {
        let i = self.find(size, &ok)?;
        let a = self.carve(i, size);
        let Rec { ptr, chunk, epoch, .. } = self.recs[a as usize];
        self.detach(a);
        self.retire(a);
        Some((ptr, FreeBlock { size, chunk, epoch }))
    }

    /// Takes a whole free block of at least `size` bytes whose epoch satisfies `ok` out of
    /// this list (for another shard, which carves it: see `policy.rs`, step 3). Returns
    /// its address and the block.
    pub fn take_whole(&mut self, size: usize, ok: impl Fn(u64) -> bool) -> Option<(u64, FreeBlock)> {
        let i = self.find(size, &ok)?;
        Some(self.remove_free(i))
    }

    /// Removes free record `i` from this list: its address and block.
    fn remove_free(&mut self, i: u32) -> (u64, FreeBlock) {
        let Rec { ptr, size, chunk, epoch, .. } = self.recs[i as usize];
        self.unlink(i);
        self.detach(i);
        self.retire(i);
        self.bytes -= size;
        (ptr, FreeBlock { size, chunk, epoch })
    }

    /// Frees the live block at `ptr` of `size` bytes into epoch `epoch`, merging it with
    /// the free blocks it links to. Refused, changing nothing, when no live block of this
    /// list starts at `ptr` or it has another size.
    #[inline(always)]
    pub fn free(&mut self, ptr: u64, size: usize, epoch: u64) -> Result<(), NotFreed> {
        let i = self.unlive(ptr, size)?;
        self.recs[i as usize].epoch = epoch;
        self.bytes += size;
        self.settle(i);
        Ok(())
    }

    /// Removes the live block at `ptr` of `size` bytes from this list (it was freed on
    /// another stream); returns its chunk. Refused as [`free`](Self::free) is.
    pub fn take_live(&mut self, ptr: u64, size: usize) -> Result<u64, NotFreed> {
        let i = self.unlive(ptr, size)?;
        let chunk = self.recs[i as usize].chunk;
        self.detach(i);
        self.retire(i);
        Ok(chunk)
    }

    /// Records a live block handed out from elsewhere (another shard, the common list, a
    /// new chunk) as this list's.
    pub fn insert_live(&mut self, ptr: u64, size: usize, chunk: u64) {
        let i = self.new_rec(Rec::loose(ptr, FreeBlock { size, chunk, epoch: 0 }));
        self.live.insert(ptr, i);
    }

    /// Adds a free block from elsewhere (not live here). It is merged with its neighbours
    /// by address when a request next finds no fit.
    pub fn insert(&mut self, ptr: u64, block: FreeBlock) {
        debug_assert!(self.live.get(ptr).is_none(), "pool bookkeeping: {ptr:#x} is live here");
        let i = self.new_rec(Rec::loose(ptr, block));
        self.bytes += block.size;
        self.loose = true;
        self.link(i);
    }

    /// Adds free blocks from elsewhere, each tagged `epoch` (0: known complete); returns
    /// how many.
    pub fn insert_all(&mut self, blocks: impl IntoIterator<Item = (u64, FreeBlock)>, epoch: u64) -> usize {
        let mut n = 0;
        for (ptr, b) in blocks {
            self.insert(ptr, FreeBlock { epoch, ..b });
            n += 1;
        }
        n
    }

    /// Removes and returns every free block whose epoch satisfies `pred`.
    pub fn drain(&mut self, pred: impl Fn(u64) -> bool) -> Vec<(u64, FreeBlock)> {
        self.remove_where(|_, b| pred(b.epoch))
    }

    /// Removes and returns the free blocks for which `pred(ptr, block)` holds, after
    /// merging every free neighbour (off the hot path: a look at every record).
    pub fn take_free_where(&mut self, pred: impl Fn(u64, &FreeBlock) -> bool) -> Vec<(u64, FreeBlock)> {
        self.remove_where(pred)
    }

    /// Free blocks held, once merged.
    #[cfg(test)]
    pub fn merged_len(&mut self) -> usize {
        self.merge_loose();
        self.recs.iter().filter(|r| Self::is_free_list(r.list)).count()
    }

    /// The live record at `ptr`, out of the live map, if it has `size` bytes.
    #[inline(always)]
    fn unlive(&mut self, ptr: u64, size: usize) -> Result<u32, NotFreed> {
        let i = self.live.remove(ptr).ok_or(NotFreed::Unknown)?;
        let had = self.recs[i as usize].size;
        if had != size {
            self.live.insert(ptr, i);
            return Err(NotFreed::WrongSize(had));
        }
        Ok(i)
    }

    #[inline(always)]
    fn is_free_list(list: u32) -> bool {
        (list as usize) < LISTS
    }

    #[inline(always)]
    fn is_free(&self, i: u32) -> bool {
        Self::is_free_list(self.recs[i as usize].list)
    }

    /// A free record of at least `size` bytes whose epoch satisfies `ok`; merges loose
    /// blocks first when none fits as they are.
    #[inline(always)]
    fn find(&mut self, size: usize, ok: &impl Fn(u64) -> bool) -> Option<u32> {
        // In a range that grows in place, blocks that entered loose are merged before the
        // fit, not only when nothing fits: the fit then chooses among merged blocks, as
        // the model it was chosen on does. Merged only on a miss, one thread held 1.31
        // times its peak live bytes on the window workload; merged first, 1.22, the
        // model's figure. Without a range it made no consistent difference (IMPLEMENTATION.md,
        // "The fit, in a range"), so there it waits for a miss.
        if self.lower_first && self.loose {
            self.merge_loose();
        }
        if let Some(i) = self.find_listed(size, ok) {
            return Some(i);
        }
        if !self.loose {
            return None;
        }
        self.merge_loose();
        self.find_listed(size, ok)
    }

    /// The head of the first non-empty list whose blocks all fit, else (only when `ok`
    /// refuses heads, or for sizes that are not a list boundary) the first fitting block
    /// found list by list.
    #[inline(always)]
    fn find_listed(&self, size: usize, ok: &impl Fn(u64) -> bool) -> Option<u32> {
        let own = list_of(size);
        let first = if list_floor(own) == size { own } else { own + 1 };
        let mut l = first;
        while let Some(found) = self.next_nonempty(l) {
            let head = self.heads[found];
            if ok(self.recs[head as usize].epoch) {
                if self.lower_first {
                    if let Some(next) = self.next_nonempty(found + 1) {
                        let other = self.heads[next];
                        let r = &self.recs[other as usize];
                        if r.ptr < self.recs[head as usize].ptr && ok(r.epoch) {
                            return Some(other);
                        }
                    }
                }
                return Some(head);
            }
            if let Some(i) = self.find_in(found, |r| ok(r.epoch)) {
                return Some(i);
            }
            l = found + 1;
        }
        // Blocks of the request's own list may fit too when it is not a boundary.
        self.find_in(own, |r| r.size >= size && ok(r.epoch))
    }

    #[inline(always)]
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

    fn find_in(&self, list: usize, ok: impl Fn(&Rec) -> bool) -> Option<u32> {
        let mut i = self.heads[list];
        while i != NIL {
            let r = &self.recs[i as usize];
            if ok(r) {
                return Some(i);
            }
            i = r.next;
        }
        None
    }

    /// Splits the front `size` bytes of free record `i` into a record of their own (or
    /// takes `i` whole when it has exactly `size`), linked in its place, marked live and in
    /// no size list; returns that record.
    #[inline(always)]
    fn carve(&mut self, i: u32, size: usize) -> u32 {
        let r = self.recs[i as usize];
        debug_assert!(r.size >= size);
        self.bytes -= size;
        if r.size == size {
            self.unlink(i);
            self.recs[i as usize].list = LIVE;
            return i;
        }
        let a = self.new_rec(Rec { size, right: i, prev: NIL, next: NIL, list: LIVE, ..r });
        if is_rec(r.left) {
            self.recs[r.left as usize].right = a;
        }
        let rest = &mut self.recs[i as usize];
        (rest.left, rest.ptr, rest.size) = (a, r.ptr + size as u64, r.size - size);
        self.relink(i);
        a
    }

    /// Lists record `i` (just freed, in no list), merged with the free records it links to.
    #[inline(always)]
    fn settle(&mut self, i: u32) {
        let Rec { left, right, .. } = self.recs[i as usize];
        if left == NIL || right == NIL {
            // A neighbour this list does not link to may be free here too.
            self.loose = true;
        }
        let right_free = is_rec(right) && self.is_free(right);
        if is_rec(left) && self.is_free(left) {
            self.absorb(left, i);
            if right_free {
                self.absorb(left, right);
            }
            self.relink(left);
        } else {
            if right_free {
                self.absorb(i, right);
            }
            self.link(i);
        }
    }

    /// Record `keep` takes in `gone`, the record just after it in memory (free or just
    /// freed); `gone` goes back to the slab.
    #[inline(always)]
    fn absorb(&mut self, keep: u32, gone: u32) {
        let g = self.recs[gone as usize];
        if Self::is_free_list(g.list) {
            self.unlink(gone);
        }
        if is_rec(g.right) {
            self.recs[g.right as usize].left = keep;
        }
        let k = &mut self.recs[keep as usize];
        (k.size, k.epoch, k.right) = (k.size + g.size, k.epoch.max(g.epoch), g.right);
        self.retire(gone);
    }

    /// Links every record (free and live) to its neighbours in memory, by sorting them by
    /// address, and merges the free ones that are neighbours (of one chunk). A side with
    /// no record of this list next to it becomes `EDGE`, so that a free there later does
    /// not call for another merge; a live block's links matter as much as a free one's,
    /// since a block that entered loose would otherwise stay apart from its neighbours
    /// through every allocation and free carved from it.
    fn merge_loose(&mut self) {
        self.loose = false;
        let mut all = std::mem::take(&mut self.scratch);
        all.extend((0..self.recs.len() as u32).filter(|&i| self.recs[i as usize].list != SPARE));
        all.sort_unstable_by_key(|&i| self.recs[i as usize].ptr);
        let mut before = EDGE;
        for &i in &all {
            let r = self.recs[i as usize];
            let next_to = is_rec(before) && {
                let b = &self.recs[before as usize];
                b.ptr + b.size as u64 == r.ptr && b.chunk == r.chunk
            };
            let left = if next_to { before } else { EDGE };
            if is_rec(before) {
                self.recs[before as usize].right = if next_to { i } else { EDGE };
            }
            self.recs[i as usize].left = left;
            before = i;
        }
        if is_rec(before) {
            self.recs[before as usize].right = EDGE;
        }
        for &i in &all {
            if !self.is_free(i) {
                continue; // live, or absorbed just now
            }
            let mut merged = false;
            while is_rec(self.recs[i as usize].right) && self.is_free(self.recs[i as usize].right) {
                self.absorb(i, self.recs[i as usize].right);
                merged = true;
            }
            if merged {
                self.relink(i);
            }
        }
        all.clear();
        self.scratch = all;
    }

    /// Unlinks record `i` from its neighbours in memory (it leaves this list, so none of
    /// this list lies there now).
    fn detach(&mut self, i: u32) {
        let Rec { left, right, .. } = self.recs[i as usize];
        if is_rec(left) {
            self.recs[left as usize].right = EDGE;
        }
        if is_rec(right) {
            self.recs[right as usize].left = EDGE;
        }
        (self.recs[i as usize].left, self.recs[i as usize].right) = (NIL, NIL);
    }

    fn remove_where(&mut self, pred: impl Fn(u64, &FreeBlock) -> bool) -> Vec<(u64, FreeBlock)> {
        if self.loose {
            self.merge_loose();
        }
        let mut found = std::mem::take(&mut self.scratch);
        found.extend((0..self.recs.len() as u32).filter(|&i| {
            let r = &self.recs[i as usize];
            Self::is_free_list(r.list)
                && pred(r.ptr, &FreeBlock { size: r.size, chunk: r.chunk, epoch: r.epoch })
        }));
        let removed = found.drain(..).map(|i| self.remove_free(i)).collect();
        self.scratch = found;
        removed
    }

    #[inline(always)]
    fn new_rec(&mut self, rec: Rec) -> u32 {
        match self.spare.pop() {
            Some(i) => {
                self.recs[i as usize] = rec;
                i
            }
            None => {
                self.recs.push(rec);
                u32::try_from(self.recs.len() - 1)
                    .ok()
                    .filter(|&i| i < SPARE)
                    .expect("fewer than 2^32 - 2 blocks")
            }
        }
    }

    #[inline(always)]
    fn retire(&mut self, i: u32) {
        self.recs[i as usize].list = SPARE;
        self.spare.push(i);
    }

    /// Moves free record `i` to the list of its (changed) size.
    #[inline(always)]
    fn relink(&mut self, i: u32) {
        if list_of(self.recs[i as usize].size) != self.recs[i as usize].list as usize {
            self.unlink(i);
            self.link(i);
        }
    }

    /// Pushes record `i` (in no list) on the list of its size.
    #[inline(always)]
    fn link(&mut self, i: u32) {
        let l = list_of(self.recs[i as usize].size);
        let head = self.heads[l];
        if head != NIL {
            self.recs[head as usize].prev = i;
        }
        let r = &mut self.recs[i as usize];
        (r.list, r.prev, r.next) = (l as u32, NIL, head);
        self.heads[l] = i;
        self.bits[l / 64] |= 1 << (l % 64);
    }

    /// Takes free record `i` off its size list (its `list` still names it).
    #[inline(always)]
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
        assert_eq!(class_size(4097), 4352);
        assert_eq!(class_size(1 << 20), 1 << 20);
        assert_eq!(class_size((1 << 20) + 1), (1 << 20) + (1 << 16));
        assert_eq!(class_size(ROUND_MAX + 1), ROUND_MAX + 256);
        for bytes in (1..ROUND_MAX).step_by(4093) {
            let size = class_size(bytes);
            assert!(size >= bytes && size - bytes <= bytes / 16 + 255, "{bytes} -> {size}");
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
    fn allocations_split_and_frees_merge() {
        let mut f = FreeList::default();
        f.insert(0x10000, block(3 * 4096 + 256, 1, 0));
        let a = f.allocate(4096).unwrap();
        let b = f.allocate(4096).unwrap();
        assert_eq!((a, b), (0x10000, 0x11000));
        f.free(a, 4096, 2).unwrap();
        assert_eq!(f.merged_len(), 2, "a is not next to the free rest");
        f.free(b, 4096, 3).unwrap();
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

    /// A merge by address links live records too: a block carved from one that entered
    /// loose merges with its neighbour, which entered apart, as soon as it is freed.
    #[test]
    fn a_merge_links_live_blocks_so_that_their_frees_merge_at_once() {
        let mut f = FreeList::default();
        f.insert(0x10000, block(4096, 1, 0));
        f.insert(0x11000, block(8192, 1, 0)); // the same chunk, entered apart
        let a = f.allocate(4096).unwrap();
        assert_eq!(a, 0x10000, "fits as it is: no merge yet");
        assert_eq!(f.allocate(1 << 20), None, "a miss merges by address");
        assert!(!f.loose);
        f.free(a, 4096, 1).unwrap();
        let listed = f.recs.iter().filter(|r| FreeList::is_free_list(r.list)).count();
        assert_eq!((listed, f.loose), (1, false), "merged with its neighbour at once");
        assert_eq!(f.take(3 * 4096, |_| true), Some((0x10000, block(3 * 4096, 1, 1))));
    }

    /// With `lower_first`, a request takes the head of the first list that fits or of the
    /// next non-empty one, whichever lies lower; without, the first list's head.
    #[test]
    fn lower_first_takes_the_lower_of_two_heads() {
        for (lower_first, want) in [(false, 0x40000), (true, 0x10000)] {
            let mut f = FreeList::new(lower_first);
            f.insert(0x10000, block(8192, 1, 0)); // a higher list, lower in memory
            f.insert(0x40000, block(4096, 1, 0)); // the request's own list
            f.insert(0x08000, block(1 << 20, 1, 0)); // a third list: not looked at
            assert_eq!(f.allocate(4096), Some(want), "lower_first {lower_first}");
        }
    }

    #[test]
    fn bad_frees_change_nothing() {
        let mut f = FreeList::default();
        f.insert(0x10000, block(8192, 1, 0));
        let a = f.allocate(4096).unwrap();
        assert_eq!(f.free(a + 256, 4096, 1), Err(NotFreed::Unknown));
        assert_eq!(f.free(a, 4352, 1), Err(NotFreed::WrongSize(4096)));
        assert_eq!(f.take_live(a, 256), Err(NotFreed::WrongSize(4096)));
        assert_eq!(f.bytes(), 4096);
        f.free(a, 4096, 1).unwrap();
        assert_eq!(f.free(a, 4096, 1), Err(NotFreed::Unknown), "double free");
        assert_eq!(f.merged_len(), 1);
        assert_eq!(f.bytes(), 8192);
    }

    #[test]
    fn chunks_do_not_merge_and_epochs_filter() {
        let mut f = FreeList::default();
        f.insert(0x1000, block(256, 1, 5));
        f.insert(0x1100, block(256, 2, 1));
        assert_eq!(f.merged_len(), 2, "adjacent blocks of two chunks stay apart");
        assert_eq!(f.take(256, |e| e < 2), Some((0x1100, block(256, 2, 1))));
        assert_eq!(f.take(256, |e| e < 2), None);
        assert_eq!(f.take_free_where(|_, b| b.chunk == 1).len(), 1);
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

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum G {
        Free(u64),
        Live,
        Out,
    }

    proptest! {
        /// Against a model (the state of every 256-byte granule of two adjacent chunks):
        /// allocations, takes, frees here, frees of blocks allocated elsewhere, blocks moved
        /// out as live and back in as live or free, bad frees. Every block handed out was
        /// free and of one chunk, nothing is lost, a request fails only when no run of free
        /// granules fits it, and once merged the free blocks are exactly the runs.
        #[test]
        fn matches_a_model(ops in proptest::collection::vec((0u8..8, 1usize..64, 0u64..4), 1..250), lower_first in any::<bool>()) {
            const G0: u64 = 0x100000 / 256;
            let mut f = FreeList::new(lower_first);
            let mut g: BTreeMap<u64, G> = BTreeMap::new();
            let chunk_of = |gr: u64| (gr - G0) / 64;
            for c in 0..2u64 {
                f.insert((G0 + c * 64) * 256, block(64 * 256, c, 0));
                for i in 0..64 { g.insert(G0 + c * 64 + i, G::Free(c)); }
            }
            let longest = |g: &BTreeMap<u64, G>| {
                let (mut best, mut run, mut last) = (0, 0, None);
                for (&gr, &s) in g.iter() {
                    match s {
                        G::Free(c) if last == Some(c) && g.get(&(gr - 1)) == Some(&G::Free(c)) => run += 1,
                        G::Free(c) => { run = 1; last = Some(c) }
                        _ => { run = 0; last = None }
                    }
                    best = best.max(run);
                }
                best
            };
            let mut live: Vec<(u64, usize)> = Vec::new();
            let mut out: Vec<(u64, usize)> = Vec::new();
            for (op, n, epoch) in ops {
                let size = n * 256;
                match op {
                    0 | 1 => {
                        let got = if op == 0 { f.allocate(size) } else { f.take(size, |e| e <= epoch).map(|(p, b)| { assert_eq!(b.size, size); p }) };
                        match got {
                            Some(ptr) => {
                                let c = chunk_of(ptr / 256);
                                for gr in ptr / 256..ptr / 256 + n as u64 {
                                    prop_assert_eq!(g.insert(gr, if op == 0 { G::Live } else { G::Out }), Some(G::Free(c)), "granule {:#x}", gr);
                                }
                                if op == 0 { live.push((ptr, size)) } else { out.push((ptr, size)) }
                            }
                            None if op == 0 || epoch == 3 => prop_assert!(longest(&g) < n, "{} free in a row, {} asked", longest(&g), n),
                            None => {}
                        }
                    }
                    2 if !live.is_empty() => {
                        let (ptr, size) = live.swap_remove(n % live.len());
                        prop_assert_eq!(f.free(ptr, size, epoch), Ok(()));
                        for gr in ptr / 256..(ptr + size as u64) / 256 { g.insert(gr, G::Free(chunk_of(gr))); }
                    }
                    3 if !out.is_empty() => {
                        let (ptr, size) = out.swap_remove(n % out.len());
                        f.insert(ptr, block(size, chunk_of(ptr / 256), epoch));
                        for gr in ptr / 256..(ptr + size as u64) / 256 { g.insert(gr, G::Free(chunk_of(gr))); }
                    }
                    4 if !out.is_empty() => {
                        let (ptr, size) = out.swap_remove(n % out.len());
                        f.insert_live(ptr, size, chunk_of(ptr / 256));
                        for gr in ptr / 256..(ptr + size as u64) / 256 { g.insert(gr, G::Live); }
                        live.push((ptr, size));
                    }
                    5 if !live.is_empty() => {
                        let (ptr, size) = live.swap_remove(n % live.len());
                        prop_assert_eq!(f.take_live(ptr, size), Ok(chunk_of(ptr / 256)));
                        for gr in ptr / 256..(ptr + size as u64) / 256 { g.insert(gr, G::Out); }
                        out.push((ptr, size));
                    }
                    6 => {
                        // A pointer where no live block starts, or a live one with the wrong size.
                        let ptr = (G0 + (n as u64 * 2 + epoch) % 128) * 256;
                        let bytes = f.bytes();
                        match live.iter().find(|(p, _)| *p == ptr) {
                            Some(&(_, size)) => prop_assert_eq!(f.free(ptr, size + 256, epoch), Err(NotFreed::WrongSize(size))),
                            None => prop_assert_eq!(f.free(ptr, 256, epoch), Err(NotFreed::Unknown)),
                        }
                        prop_assert_eq!(f.bytes(), bytes);
                    }
                    _ => {}
                }
                let free = g.values().filter(|s| matches!(s, G::Free(_))).count();
                prop_assert_eq!(f.bytes(), free * 256);
                if op == 7 {
                    // Merged: the free blocks are the runs of free granules within a chunk.
                    let runs = g.iter().filter(|(&gr, &s)| matches!(s, G::Free(_)) && ((gr - G0).is_multiple_of(64) || g.get(&(gr - 1)) != Some(&s))).count();
                    prop_assert_eq!(f.merged_len(), runs);
                }
            }
            // Everything live can be freed, and then all of it is one block per chunk.
            for (ptr, size) in live { prop_assert_eq!(f.free(ptr, size, 0), Ok(())); }
            for (ptr, size) in out { f.insert(ptr, block(size, chunk_of(ptr / 256), 0)); }
            prop_assert_eq!(f.merged_len(), 2);
            prop_assert_eq!(f.bytes(), 128 * 256);
        }
    }
}
