//! The common list: free blocks whose frees are known complete, usable by any stream,
//! behind one lock, with its size readable without the lock.

use std::ops::{Deref, DerefMut};

use super::freelist::FreeList;
use crate::sync::{lock, try_lock, AtomicUsize, Mutex, MutexGuard, Ordering};

/// The common list and its free bytes as of the last unlock. Every look for memory beyond
/// a stream's own shard (policy step 2) reads the bytes first and locks the list only when
/// they could serve it: most of the time the list is empty (it fills at gatherings and
/// from retired shards), and the lock is one that every stream's look would otherwise take.
#[derive(Default)]
pub(super) struct Common {
    list: Mutex<FreeList>,
    bytes: AtomicUsize,
}

impl Common {
    /// An empty list (`lower_first`: [`FreeList::new`]).
    pub(super) fn new(lower_first: bool) -> Self {
        Common { list: Mutex::new(FreeList::new(lower_first)), bytes: AtomicUsize::new(0) }
    }

    pub(super) fn lock(&self) -> CommonGuard<'_> {
        CommonGuard { list: lock(&self.list), bytes: &self.bytes }
    }

    /// The lock, if it is free now.
    pub(super) fn try_lock(&self) -> Option<CommonGuard<'_>> {
        try_lock(&self.list).map(|list| CommonGuard { list, bytes: &self.bytes })
    }

    /// The list's free bytes when it was last unlocked, or `usize::MAX` while a gathering
    /// fills it ([`CommonGuard::gathering`]). A hint: blocks added since may not be seen
    /// yet, and whoever then misses them finds them at a later look or gathering.
    pub(super) fn bytes_hint(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// The locked common list; unlocking publishes its size.
pub(super) struct CommonGuard<'a> {
    list: MutexGuard<'a, FreeList>,
    bytes: &'a AtomicUsize,
}

impl CommonGuard<'_> {
    /// Marks the list as being filled by a gathering until this guard is dropped: threads
    /// short of memory meanwhile wait for its lock and take what was gathered, as they did
    /// when every look locked the list. Without the mark they passed it by, empty as it
    /// looked, and grew: on a 16-core host the hand-off soak held 3.1-3.9 times its peak
    /// live bytes, against 2.6-2.7 (`benchmarks/RESULTS.md`, "Commits 6200f6c and 99bc588").
    pub(super) fn gathering(&mut self) {
        self.bytes.store(usize::MAX, Ordering::Relaxed);
    }
}

impl Deref for CommonGuard<'_> {
    type Target = FreeList;
    fn deref(&self) -> &FreeList {
        &self.list
    }
}

impl DerefMut for CommonGuard<'_> {
    fn deref_mut(&mut self) -> &mut FreeList {
        &mut self.list
    }
}

impl Drop for CommonGuard<'_> {
    fn drop(&mut self) {
        self.bytes.store(self.list.bytes(), Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::resources::pool::freelist::FreeBlock;

    /// The size read without the lock is the list's at its last unlock, and unbounded while
    /// a gathering fills it: a look for memory then waits for the lock (and what was
    /// gathered) rather than pass the list by as empty.
    #[test]
    fn the_size_is_published_at_unlock_and_unbounded_while_gathering() {
        let common = Common::default();
        assert_eq!(common.bytes_hint(), 0);
        {
            let mut list = common.lock();
            list.insert(1 << 20, FreeBlock { size: 4096, chunk: 1, epoch: 0 });
            assert_eq!(common.bytes_hint(), 0, "published at unlock, not before");
            assert!(common.try_lock().is_none(), "held");
        }
        assert_eq!(common.bytes_hint(), 4096);
        {
            let mut list = common.lock();
            list.gathering();
            assert_eq!(common.bytes_hint(), usize::MAX);
            list.insert(2 << 20, FreeBlock { size: 8192, chunk: 2, epoch: 0 });
        }
        assert_eq!(common.bytes_hint(), 4096 + 8192);
        let taken = common.try_lock().expect("free").take(8192, |_| true);
        assert!(taken.is_some());
        assert_eq!(common.bytes_hint(), 4096);
    }
}
