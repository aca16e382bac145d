//! Free blocks of one shard (or of the common list). Two tiers:
//!
//! * a cache of freed blocks by size class, a stack per class with a bitmap of non-empty
//!   classes: a free pushes, an allocation of the same class pops, O(1) and no coalescing
//!   (the common case: a stream freeing and reallocating similar sizes);
//! * a tree of blocks by address (to coalesce neighbours within one upstream chunk) and by
//!   (size, address) (best fit), which serves misses. When the tree cannot serve a
//!   request, the cache is flushed into it (coalescing everything) and the tree tried again.
//!
//! Sizes are rounded to classes by [`class_size`], so that a block's size follows from
//! the size it was asked with. Addresses are integers; nothing here is `unsafe`.

use std::collections::{BTreeMap, BTreeSet};

use crate::size::align_up;

/// Blocks of this size or more are not cached (nor rounded beyond 256 bytes).
pub(crate) const CACHE_MAX: usize = 64 << 20;
const CLASSES: usize = 128;
/// How many of a class's most recently cached blocks a free compares itself with.
const RECENT: usize = 8;

/// The size a request of `bytes` is served with: a multiple of 256 up to 4 KiB, then one
/// of 8 classes per power of two (at most 12.5 % more than asked) up to 64 MiB, then a
/// multiple of 256 again.
pub(crate) fn class_size(bytes: usize) -> usize {
    let b = align_up(bytes.max(1), 256);
    if b <= 4096 || b >= CACHE_MAX {
        return b;
    }
    let k = usize::BITS - 1 - b.leading_zeros();
    align_up(b, 1 << (k - 3))
}

/// The cache class of a block of exactly `size` bytes, if it is a class size.
fn class_index(size: usize) -> Option<usize> {
    if size == 0 || size % 256 != 0 || size >= CACHE_MAX {
        return None;
    }
    if size <= 4096 {
        return Some(size / 256 - 1);
    }
    let k = (usize::BITS - 1 - size.leading_zeros()) as usize;
    let step = 1usize << (k - 3);
    (size % step == 0).then(|| 16 + (k - 12) * 8 + (size / step - 8))
}

/// A free block: its size, the upstream chunk it belongs to, and the epoch it was freed
/// in (see `shard.rs`: a block may go to another stream only once its epoch is known to
/// have completed, or after that stream waited on the epoch's event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FreeBlock {
    pub size: usize,
    pub chunk: u64,
    pub epoch: u64,
}

/// Free blocks: the class cache in front of the tree (see the module docs).
#[derive(Debug)]
pub(crate) struct FreeList {
    cache: Vec<Vec<(u64, FreeBlock)>>,
    cache_bits: u128,
    cached_bytes: usize,
    by_addr: BTreeMap<u64, FreeBlock>,
    by_size: BTreeSet<(usize, u64)>,
    bytes: usize,
}

impl Default for FreeList {
    fn default() -> Self {
        FreeList {
            cache: (0..CLASSES).map(|_| Vec::new()).collect(),
            cache_bits: 0,
            cached_bytes: 0,
            by_addr: BTreeMap::new(),
            by_size: BTreeSet::new(),
            bytes: 0,
        }
    }
}

impl FreeList {
    /// Free bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes + self.cached_bytes
    }

    /// Takes a block of at least `size` bytes whose epoch satisfies `ok`: a cached block
    /// of exactly `size` (the most recently freed first), else the smallest fitting block
    /// of the tree (the rest of it stays free, same chunk and epoch), else the same after
    /// flushing the cache into the tree. Returns (address, epoch).
    pub fn take(&mut self, size: usize, ok: impl Fn(u64) -> bool) -> Option<(u64, u64)> {
        if let Some(c) = class_index(size) {
            if self.cache_bits & (1 << c) != 0 {
                let stack = &mut self.cache[c];
                if let Some(i) = stack.iter().rposition(|(_, b)| ok(b.epoch)) {
                    let (ptr, b) = stack.remove(i);
                    if stack.is_empty() {
                        self.cache_bits &= !(1 << c);
                    }
                    self.cached_bytes -= b.size;
                    return Some((ptr, b.epoch));
                }
            }
        }
        if let Some(found) = self.take_from_tree(size, &ok) {
            return Some(found);
        }
        if self.cached_bytes == 0 {
            return None;
        }
        if let Some(found) = self.split_larger_cached(size, &ok) {
            return Some(found);
        }
        self.flush();
        self.take_from_tree(size, &ok)
    }

    /// The most recently freed block of the smallest larger cached class: its front is
    /// handed out, the rest goes to the tree. Cheaper than flushing the whole cache.
    fn split_larger_cached(&mut self, size: usize, ok: &impl Fn(u64) -> bool) -> Option<(u64, u64)> {
        let above = match class_index(size) {
            Some(c) if c + 1 < CLASSES => self.cache_bits & !((1u128 << (c + 1)) - 1),
            Some(_) => 0,
            None => self.cache_bits,
        };
        let mut bits = above;
        while bits != 0 {
            let c = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let stack = &mut self.cache[c];
            let Some(i) = stack.iter().rposition(|(_, b)| ok(b.epoch) && b.size >= size) else { continue };
            let (ptr, b) = stack.remove(i);
            if stack.is_empty() {
                self.cache_bits &= !(1 << c);
            }
            self.cached_bytes -= b.size;
            if b.size > size {
                let rest = FreeBlock { size: b.size - size, ..b };
                let inserted = self.insert_into_tree(ptr + size as u64, rest);
                debug_assert!(inserted, "a cached block's remainder is not free elsewhere");
            }
            return Some((ptr, b.epoch));
        }
        None
    }

    /// Moves every cached block into the tree, coalescing.
    fn flush(&mut self) {
        for c in 0..CLASSES {
            if self.cache_bits & (1 << c) != 0 {
                for (ptr, b) in std::mem::take(&mut self.cache[c]) {
                    // A cached double free shows up here as an overlap; it is dropped (the
                    // block is free already), so the lists stay consistent.
                    let _ = self.insert_into_tree(ptr, b);
                }
            }
        }
        self.cache_bits = 0;
        self.cached_bytes = 0;
    }

    fn take_from_tree(&mut self, size: usize, ok: &impl Fn(u64) -> bool) -> Option<(u64, u64)> {
        let (found_size, ptr) =
            *self.by_size.range((size, 0)..).find(|&&(_, ptr)| ok(self.by_addr[&ptr].epoch))?;
        let block = self.remove(ptr, found_size);
        if found_size > size {
            self.put(ptr + size as u64, FreeBlock { size: found_size - size, ..block });
        }
        Some((ptr, block.epoch))
    }

    /// Adds a freed block: to the cache when its size is a class size, else to the tree.
    /// Returns false, changing nothing, for a double free it can see: a block overlapping
    /// one in the tree, or the same block among the last few cached of its class (debug
    /// builds of the pool check every free against their live allocations).
    #[must_use]
    pub fn insert(&mut self, ptr: u64, block: FreeBlock) -> bool {
        if let Some(c) = class_index(block.size) {
            // An immediate double free finds the block among the last few of its class
            // (a bounded look, so that long stacks stay O(1) to push).
            if self.cache[c].iter().rev().take(RECENT).any(|&(p, _)| p == ptr) {
                return false;
            }
            self.cache[c].push((ptr, block));
            self.cache_bits |= 1 << c;
            self.cached_bytes += block.size;
            return true;
        }
        self.insert_into_tree(ptr, block)
    }

    /// Adds a block to the tree, merging it with free neighbours of the same chunk; a
    /// merged block carries the later of the two epochs (it is usable where both parts
    /// are). False, changing nothing, when it overlaps a block already free.
    fn insert_into_tree(&mut self, ptr: u64, mut block: FreeBlock) -> bool {
        let end = ptr + block.size as u64;
        let prev = self.by_addr.range(..=ptr).next_back().map(|(&p, &b)| (p, b));
        if prev.is_some_and(|(p, b)| p + b.size as u64 > ptr) || self.by_addr.range(ptr..end).next().is_some()
        {
            return false;
        }
        let mut start = ptr;
        if let Some((prev, p)) = prev {
            if prev + p.size as u64 == ptr && p.chunk == block.chunk {
                self.remove(prev, p.size);
                start = prev;
                block = FreeBlock {
                    size: p.size + block.size,
                    chunk: block.chunk,
                    epoch: p.epoch.max(block.epoch),
                };
            }
        }
        if let Some(&n) = self.by_addr.get(&end) {
            if n.chunk == block.chunk {
                self.remove(end, n.size);
                block = FreeBlock {
                    size: block.size + n.size,
                    chunk: block.chunk,
                    epoch: block.epoch.max(n.epoch),
                };
            }
        }
        self.put(start, block);
        true
    }

    /// [`Self::insert`] of a block the pool knows is not free anywhere.
    pub fn insert_fresh(&mut self, ptr: u64, block: FreeBlock) {
        let inserted = self.insert(ptr, block);
        debug_assert!(inserted, "pool bookkeeping: {ptr:#x} is already free");
    }

    /// Removes and returns every block whose epoch satisfies `pred`.
    pub fn drain(&mut self, pred: impl Fn(u64) -> bool) -> Vec<(u64, FreeBlock)> {
        self.flush();
        let taken: Vec<(u64, FreeBlock)> =
            self.by_addr.iter().filter(|(_, b)| pred(b.epoch)).map(|(&p, &b)| (p, b)).collect();
        for &(ptr, b) in &taken {
            self.remove(ptr, b.size);
        }
        taken
    }

    /// Removes the blocks that are whole chunks (`is_whole(ptr, block)`), and returns them.
    pub fn take_whole_chunks(&mut self, is_whole: impl Fn(u64, &FreeBlock) -> bool) -> Vec<(u64, FreeBlock)> {
        self.flush();
        let whole: Vec<(u64, FreeBlock)> =
            self.by_addr.iter().filter(|(&p, b)| is_whole(p, b)).map(|(&p, &b)| (p, b)).collect();
        for &(ptr, b) in &whole {
            self.remove(ptr, b.size);
        }
        whole
    }

    fn put(&mut self, ptr: u64, block: FreeBlock) {
        self.bytes += block.size;
        self.by_size.insert((block.size, ptr));
        let previous = self.by_addr.insert(ptr, block);
        debug_assert!(previous.is_none(), "block {ptr:#x} is already free");
    }

    fn remove(&mut self, ptr: u64, size: usize) -> FreeBlock {
        self.bytes -= size;
        self.by_size.remove(&(size, ptr));
        self.by_addr.remove(&ptr).expect("a listed block")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(size: usize, chunk: u64, epoch: u64) -> FreeBlock {
        FreeBlock { size, chunk, epoch }
    }

    #[test]
    fn classes() {
        assert_eq!(class_size(1), 256);
        assert_eq!(class_size(4096), 4096);
        assert_eq!(class_size(4097), 4608);
        assert_eq!(class_size(1 << 20), 1 << 20);
        assert_eq!(class_size((1 << 20) + 1), (1 << 20) + (1 << 17));
        assert_eq!(class_size(CACHE_MAX + 1), CACHE_MAX + 256);
        let mut seen = std::collections::HashSet::new();
        for bytes in (1..CACHE_MAX).step_by(4093) {
            let size = class_size(bytes);
            assert!(size >= bytes && size - bytes <= bytes / 8 + 255, "{bytes} -> {size}");
            if size >= CACHE_MAX {
                assert_eq!(class_index(size), None);
                continue;
            }
            let c = class_index(size).expect("a class size has a class");
            assert!(c < CLASSES);
            seen.insert((c, size));
        }
        let by_class: std::collections::HashMap<usize, usize> = seen.iter().copied().collect();
        assert_eq!(by_class.len(), seen.len(), "one size per class");
        assert_eq!(class_index(5000), None);
        assert_eq!(class_index(CACHE_MAX), None);
    }

    #[test]
    fn cache_hits_are_lifo_and_flush_coalesces() {
        let mut f = FreeList::default();
        // A chunk remainder (not a class size) lives in the tree.
        assert!(f.insert(0x10000, block(3 * 4096 + 256, 1, 0)));
        let a = f.take(4096, |_| true).unwrap().0;
        let b = f.take(4096, |_| true).unwrap().0;
        assert_eq!((a, b), (0x10000, 0x11000));
        assert!(f.insert(a, block(4096, 1, 2)));
        assert!(f.insert(b, block(4096, 1, 3)));
        assert_eq!(f.bytes(), 3 * 4096 + 256);
        assert_eq!(f.take(4096, |_| true), Some((b, 3)), "the most recently freed");
        assert!(f.insert(b, block(4096, 1, 3)));
        assert!(!f.insert(b, block(4096, 1, 3)), "an immediate double free is refused");
        // A larger cached block is split rather than flushing the cache.
        assert!(f.insert(0x20000, block(8192, 2, 4)));
        assert_eq!(f.take(4096 + 512, |_| true), Some((0x20000, 4)));
        assert_eq!(f.take(3584, |_| true), Some((0x21200, 4)), "the rest went to the tree");
        // 3 pages + 256 only fit after the cache is flushed and everything coalesces.
        assert_eq!(f.take(3 * 4096 + 256, |_| true), Some((0x10000, 3)));
        assert_eq!(f.bytes(), 0);
    }

    #[test]
    fn chunks_do_not_merge_epochs_filter_and_overlaps_are_refused() {
        let mut f = FreeList::default();
        assert!(f.insert(0x1000, block(256, 1, 5)));
        assert!(f.insert(0x1100, block(256, 2, 1)));
        assert_eq!(f.take(256, |e| e < 2), Some((0x1100, 1)));
        assert_eq!(f.take(256, |e| e < 2), None);
        assert_eq!(f.take_whole_chunks(|_, b| b.chunk == 1).len(), 1);
        assert_eq!(f.bytes(), 0);
        assert!(f.insert(0x8000, block(5000 / 256 * 256, 3, 0)));
        assert!(!f.insert(0x8100, block(4864, 3, 0)), "overlap in the tree is refused");
        assert_eq!(f.bytes(), 4864);
    }
}
