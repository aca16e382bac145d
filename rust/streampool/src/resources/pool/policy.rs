//! The slow path of the pool: policy steps 2 to 7 (`IMPLEMENTATION.md`), frees across
//! streams, the footprint budget, gathering free blocks and retiring shards.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use super::chunks::{Chunk, MAX_GROWTH_STEP, MIN_CHUNK};
use super::common::CommonGuard;
use super::freelist::{FreeBlock, FreeList};
use super::shard::{Shard, ShardState};
use super::ShardedPoolMemoryResource;
use crate::device::DevPtr;
use crate::error::{Error, Result};
use crate::resource::MemoryResource;
use crate::stream::Stream;
use crate::sync::{lock, try_read, write, Ordering, ShardGuard};

/// Growth past the footprint budget within `gather_interval` of a gathering stops at this
/// many times the budget's allowance (`IMPLEMENTATION.md`, step 6): without a ceiling the
/// chunks grown so piled up, and the peak reserved on the hand-off soak kept rising. Twice
/// the allowance held 2.2 times the peak live bytes on the H200 at 16 threads but gathered
/// so often that the window ran at 7-10 M allocations/s; 3 times, 30-34 M/s; 4 times (this
/// code, 8ba5d69), 97-107 M/s at 3.9 times (its step 6 has the figures;
/// `benchmarks/RESULTS.md`, "Commits 85cb897 and 8ba5d69").
const CEILING: usize = 4;

impl ShardedPoolMemoryResource {
    /// Steps 2 to 7 of the policy; returns the address, recorded live in the shard of
    /// `stream` (key `key`).
    pub(super) fn allocate_slow(&self, size: usize, stream: &Stream, key: u64) -> Result<DevPtr> {
        // The live bytes with this request, once growth was considered: the footprint
        // budget's base, raised only when the request is served (a refused request, say
        // of more than the device holds, would otherwise size every later growth).
        let mut live = None;
        let result = self.allocate_steps(size, stream, key, &mut live);
        if let (Ok(_), Some(live)) = (&result, live) {
            self.peak_live.fetch_max(live, Ordering::Relaxed);
        }
        result
    }

    fn allocate_steps(
        &self,
        size: usize,
        stream: &Stream,
        key: u64,
        live: &mut Option<usize>,
    ) -> Result<DevPtr> {
        let found = |(ptr, chunk): (DevPtr, u64)| {
            self.record_live(ptr, size, chunk, stream, key);
            Ok(ptr)
        };
        // Never to be served: say so before gathering or giving anything back (an arena
        // asked for more than itself once gave its whole reservation back first).
        if size > self.maximum {
            return Err(self.beyond_maximum(size));
        }
        // 2. completed blocks in the common list
        if let Some(ptr) = self.import_common(size, stream, key) {
            return Ok(ptr);
        }
        // 3. completed blocks of other streams; retired shards give all theirs to the
        // common list
        if let Some(ptr) = self.take_completed_live(size, stream, key, true) {
            return Ok(ptr);
        }
        if let Some(ptr) = self.import_common(size, stream, key) {
            return Ok(ptr);
        }
        // 4. grow on this stream, within the footprint budget
        let (want, allowed, now) = self.growth(size);
        *live = Some(now);
        match self.grow_under(size, want, allowed, stream, Some(key)) {
            Ok(Some(chunk)) => return found((self.place_chunk(&chunk, size, stream, key), chunk.id)),
            Ok(None) => {}
            Err(e) if e.is_out_of_memory() => {}
            Err(e) => return Err(e),
        }
        // Memory is short: ask every stream to record an event at its next free, so that
        // what it frees from now on can be taken by others.
        self.demand.fetch_add(1, Ordering::Relaxed);
        // 5. wait on another stream's recorded event
        let others = self.other_shards(key);
        if let Some(taken) = self.take_covered(size, stream, key, &others)? {
            return found(taken);
        }
        // A pool that grows in place, where no other stream holds free memory, grows past
        // the budget at once: a gathering could find nothing this stream cannot take now,
        // and would give back only the free end it then maps again (the one consolidation
        // it offers, of whole chunks, means nothing in one range); it would also reorder
        // this stream's blocks (on the simulated device, the window bench at one thread held
        // 1.31-1.50 times the peak live bytes gathering at every shortage, 1.31 growing:
        // `benchmarks/RESULTS.md`, "Commits b4d5e5c and 2213714").
        if self.region.is_some() && !self.others_hold_free(&others) {
            match self.grow(size, size, stream, Some(key)) {
                Ok(chunk) => return found((self.place_chunk(&chunk, size, stream, key), chunk.id)),
                Err(e) if e.is_out_of_memory() => {}
                Err(e) => return Err(e),
            }
        }
        // 6. synchronise, gather, coalesce, release, retry (past the budget, not the
        // maximum). At the maximum, other threads may have taken what was freed in the
        // meantime: look again a few times before saying out of memory.
        const ATTEMPTS: usize = 3;
        // Past the budget, growth is the request rounded up to the driver's 2 MiB pages:
        // a step there is memory that no stream asked for, and a chunk of the request's
        // exact size serves later requests only when wholly free (`IMPLEMENTATION.md`,
        // "Growth, the footprint budget and release").
        let mut want = if self.options.headroom.is_some() { size.next_multiple_of(MIN_CHUNK) } else { want };
        // A gathering stops every thread that needs memory meanwhile (a device
        // synchronisation, one gatherer at a time). Within `gather_interval` of the last
        // one, growth past the budget comes first (`PoolOptions::gather_interval` has the
        // measured trade). At the maximum the gathering still happens.
        let interval = self.options.gather_interval.as_nanos().min(u64::MAX as u128) as u64;
        // And only up to a ceiling: beyond `CEILING` times the budget's allowance, a thread
        // short of memory gathers, however recent the last gathering.
        if self.options.headroom.is_some() && self.gathered_within(interval) {
            match self.grow_under(size, want, allowed.saturating_mul(CEILING), stream, Some(key)) {
                Ok(Some(chunk)) => return found((self.place_chunk(&chunk, size, stream, key), chunk.id)),
                Ok(None) => {}
                Err(e) if e.is_out_of_memory() => {}
                Err(e) => return Err(e),
            }
        }
        let mut seen = *lock(&self.counters.gathers);
        for attempt in 1..=ATTEMPTS {
            if let Some(ptr) = self.gather_for(size, stream, key, &mut seen)? {
                return Ok(ptr);
            }
            if attempt == 1 {
                // Whole free chunks cannot serve the request: give them back, and grow one
                // chunk as large as they were together (fewer, larger chunks fragment less).
                want = want.max(self.trim(0)?);
            }
            if let Some(ptr) = self.import_common(size, stream, key) {
                return Ok(ptr);
            }
            if let Some(ptr) = self.take_completed_live(size, stream, key, true) {
                return Ok(ptr);
            }
            match self.grow(size, want, stream, Some(key)) {
                Ok(chunk) => return found((self.place_chunk(&chunk, size, stream, key), chunk.id)),
                Err(e) if e.is_out_of_memory() && attempt < ATTEMPTS => {}
                Err(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Step 2: moves every block of the common list (all complete, so usable by this
    /// stream, and by other streams as completed blocks of this shard: epoch 0) into the
    /// shard of `stream`, and allocates there. The free space of a chunk is then in one
    /// list, where it merges, rather than split between the common list and a shard (with
    /// it split, neither part merges with the other, and one stream alone held more on the
    /// window workload). Most of the time the list is empty, and its lock is not taken
    /// (`Common::bytes_hint`).
    fn import_common(&self, size: usize, stream: &Stream, key: u64) -> Option<DevPtr> {
        if self.common.bytes_hint() < size {
            return None;
        }
        self.with_shard(key, stream, |shard| {
            // The common list stays locked until its blocks are in the shard: a gathering
            // (which locks it to harvest the shards) never misses blocks in transit.
            let mut common = self.common.lock();
            if common.bytes() < size {
                return None;
            }
            let mut st = shard.state.lock();
            st.free.insert_all(common.drain(|_| true), 0);
            drop(common);
            let ptr = st.free.allocate(size)?;
            st.used += size as i64;
            Some(ptr)
        })
    }

    /// Step 3: a block of another shard whose free has completed, for `stream` (key `key`).
    /// Each shard that holds free blocks has its recorded events queried first, oldest
    /// first, up to the first still running, so that its frees completed since are known
    /// (with only the query of the oldest event covering a fitting block, the window at 16
    /// threads on the H200, no ceiling, ended 640 shortages a round in a wait on another
    /// stream against 123-241, and ran at 26-46 M allocations/s against 31-92:
    /// `benchmarks/RESULTS.md`, "Commits 85cb897 and 8ba5d69").
    /// Retired shards (their stream is gone) give every completed block to the common list
    /// on the way, and leave the pool once empty. A shard that holds no live block of its
    /// own (a consumer's stream, which frees what others allocate and never reuses it) gives
    /// every completed block to this stream's shard at once (complete, epoch 0): one look,
    /// with its event queries, then serves the next allocations from the own shard.
    /// The shard that last gave this stream blocks is looked at first (`source_hint`: in a
    /// pipeline, a producer's memory comes back through its consumer's shard), then the
    /// others; only when it has none are the others' handles gathered.
    ///
    /// With `!blocking` (the binding's fast path, which keeps Python's GIL), it never waits
    /// for the device (the events it queries are calls into the driver that do not wait),
    /// and tries the other shards', the common list's and the shard map's locks: a shard
    /// whose lock is taken is passed over, and `None` when the shard map's is, or this
    /// stream's at the first look at its hint. It still waits for its own shard's lock to
    /// record the source and to put moved blocks there (held by other threads for list
    /// operations only, or a free's due event), and for the shard map's on the stream's
    /// first use in this thread (`with_shard`).
    ///
    /// `own` is borrowed from the thread's shard cache, not cloned: an owner that counted
    /// references to its own shard on every call would pull that count's cache line back
    /// from the threads whose hints upgrade it (a consumer's free, a producer's look).
    fn take_completed(&self, size: usize, own: &Shard, key: u64, blocking: bool) -> Option<(DevPtr, u64)> {
        let hint = other_shard(&lock_shard(own, blocking)?.source_hint, key);
        if let Some(shard) = &hint {
            if let Some(taken) = self.look_completed(size, own, shard, blocking) {
                return Some(taken);
            }
        }
        let others = if blocking { self.other_shards(key) } else { others(&*try_read(&self.shards)?, key) };
        for shard in &others {
            if hint.as_ref().is_some_and(|h| Arc::ptr_eq(h, shard)) {
                continue;
            }
            if let Some(taken) = self.look_completed(size, own, shard, blocking) {
                own.state.lock().source_hint = Some(Arc::downgrade(shard));
                return Some(taken);
            }
        }
        None
    }

    /// [`Self::take_completed`] for `stream`, the block taken recorded live in its own
    /// shard under its lock (as a free across streams does: held by this stream's threads
    /// only for list operations). With `!blocking` it is step 3 for the binding's fast path
    /// (which keeps Python's GIL): `None` when that finds no block or would wait, and the
    /// caller takes the full path. Looking at the last source alone is not enough: in a
    /// pipeline from Python threads a third of the producers' allocations then gave the GIL
    /// back, to find a block in another consumer's shard.
    pub(super) fn take_completed_live(
        &self,
        size: usize,
        stream: &Stream,
        key: u64,
        blocking: bool,
    ) -> Option<DevPtr> {
        self.with_shard(key, stream, |own| {
            let (ptr, chunk) = self.take_completed(size, own, key, blocking)?;
            own.state.lock().put_live(ptr, size, chunk);
            Some(ptr)
        })
    }

    /// One shard's part of step 3, for the shard `own` of the looking stream. `None` too
    /// when `!blocking` and a lock is taken.
    fn look_completed(
        &self,
        size: usize,
        own: &Shard,
        shard: &Arc<Shard>,
        blocking: bool,
    ) -> Option<(DevPtr, u64)> {
        // Blocks may move from a retired shard or one that gives all: the common list is
        // locked too. Tried while the shard is held (a try never waits, so the locks' order
        // holds), which spares locking the shard twice.
        let may_move = |st: &ShardState| st.free.bytes() > 0 && (st.retired || st.gives_all());
        let mut st = lock_shard(shard, blocking)?;
        let mut common = None;
        if may_move(&st) {
            common = match self.common.try_lock() {
                Some(c) => Some(c),
                None if !blocking => return None,
                None => {
                    // Waited for in the locks' order; the shard is looked at afresh.
                    drop(st);
                    let c = self.common.lock();
                    st = shard.state.lock();
                    Some(c)
                }
            };
        }
        let (taken, moved, empty) = {
            if st.free.bytes() == 0 {
                (None, Vec::new(), st.is_spent())
            } else {
                self.count_queries(st.refresh());
                let done = st.completed;
                match (st.retired, common.as_mut()) {
                    (true, Some(common)) => {
                        common.insert_all(st.free.drain(|e| e < done), 0);
                        (None, Vec::new(), st.is_spent())
                    }
                    // Its free blocks came after the look without the common list.
                    (true, None) => (None, Vec::new(), false),
                    _ => {
                        // The block taken: the front `size` bytes of a fitting block, or
                        // with `steal_whole_blocks` the whole block, whose rest (split off
                        // below) then joins this stream's shard.
                        let taken = if self.options.steal_whole_blocks {
                            st.free.take_whole(size, |e| e < done)
                        } else {
                            st.free.take(size, |e| e < done)
                        };
                        let bulk = taken.is_some() && st.gives_all() && common.is_some();
                        let mut moved = if bulk { st.free.drain(|e| e < done) } else { Vec::new() };
                        let taken = taken.map(|(ptr, b)| {
                            if b.size > size {
                                moved.push((ptr + size as u64, FreeBlock { size: b.size - size, ..b }));
                            }
                            (ptr, FreeBlock { size, ..b })
                        });
                        if bulk {
                            // This stream's memory is wanted again once the blocks taken
                            // now are used up: it records an event at its n-th free from
                            // now, n the blocks taken, so that the event covers about as
                            // many blocks for the next look (one record and one query per
                            // n chunks in a steady pipeline).
                            let n = (1 + moved.len()).max(st.batch);
                            st.interval = st.interval.min(st.unevented.saturating_add(n));
                            st.wanted = false;
                            st.drawn = true;
                        } else {
                            // Wanted: it records an event at its next free (its interval
                            // may have grown long), so that what it frees can be taken next
                            // time rather than memory grown anew.
                            st.wanted = true;
                        }
                        (taken, moved, false)
                    }
                }
            }
        };
        drop(st);
        if !moved.is_empty() {
            own.state.lock().free.insert_all(moved, 0);
        }
        drop(common);
        if empty {
            self.forget(shard);
        }
        let (ptr, b) = taken?;
        self.counters.completed_steals.fetch_add(1, Ordering::Relaxed);
        Some((ptr, b.chunk))
    }

    /// Step 5: a block of another shard that a recorded event covers; `stream` waits on
    /// that event (unless the block is known complete). A shard that holds no live block
    /// of its own (a consumer's), whose stream streampool owns and that has blocks no event
    /// covers yet (freed since its last event), gets an event recorded on its stream now,
    /// under its lock (the stream is alive while the shard is not retired): one record and
    /// one wait in place of a device synchronisation (step 6), which would stall this
    /// thread on every stream's work; and it gives every block the event covers to this
    /// stream's shard, as in step 3.
    /// Retired shards come first, the emptiest first: taking their last blocks lets them
    /// leave the pool (on a device that has not finished their work yet, such shards
    /// would otherwise pile up, one per stream that came and went).
    fn take_covered(
        &self,
        size: usize,
        stream: &Stream,
        key: u64,
        others: &[Arc<Shard>],
    ) -> Result<Option<(DevPtr, u64)>> {
        let mut order: Vec<(bool, usize, &Arc<Shard>)> = others
            .iter()
            .map(|s| {
                let st = s.state.lock();
                (!st.retired, st.free.bytes(), s)
            })
            .filter(|(_, bytes, _)| *bytes >= size)
            .collect();
        order.sort_by_key(|(live, bytes, _)| (*live, *bytes));
        for (_, _, shard) in order {
            // Blocks may move from a shard that gives all (the wait on the way is enqueued,
            // not waited for).
            let common = self.lock_common_if(shard, ShardState::gives_all);
            let (taken, moved) = {
                let mut st = shard.state.lock();
                // No queries: step 3 has just made them, and waiting on an event that has
                // completed costs the device nothing.
                // Only blocks an event covers (or known complete): blocks of an epoch that
                // a concurrent synchronisation closed without an event are neither.
                let mut covered = st.covered();
                let mut taken = st.free.take(size, |e| e < covered);
                if taken.is_none() && st.gives_all() && st.has_uncovered() {
                    if let Some(owner) = shard.owner {
                        if let Ok(true) = st.record_event(self.backend(), self.device(), owner, false) {
                            self.counters.events.fetch_add(1, Ordering::Relaxed);
                            covered = st.covered();
                            taken = st.free.take(size, |e| e < covered);
                        }
                    }
                }
                let moved = if taken.is_some() && st.gives_all() && common.is_some() {
                    st.free.drain(|e| e < covered)
                } else {
                    Vec::new()
                };
                let newest = taken.iter().chain(&moved).map(|(_, b)| b.epoch).max();
                // The wait is enqueued under the shard's lock (it blocks nothing), so that
                // a failed one leaves every block where it was, with its epoch: nowhere
                // else are they known to be ordered (the common list holds only blocks
                // complete for every stream).
                if let (Some((ptr, b)), Some(event)) = (taken, newest.and_then(|e| st.covering(e))) {
                    if let Err(e) = stream.wait(&event) {
                        for (at, block) in moved.into_iter().chain([(ptr, b)]) {
                            st.free.insert(at, block);
                        }
                        return Err(e);
                    }
                    self.counters.waits.fetch_add(1, Ordering::Relaxed);
                }
                (taken, moved)
            };
            let Some((ptr, b)) = taken else { continue };
            if !moved.is_empty() {
                // Ordered for this stream now (after the wait): as if freed on it.
                let own = self.shard_slow(key, stream);
                let mut st = own.state.lock();
                let epoch = st.entry_epoch();
                let n = st.free.insert_all(moved, epoch);
                st.unevented += n;
            }
            drop(common);
            self.forget_if_done(shard);
            return Ok(Some((ptr, b.chunk)));
        }
        Ok(None)
    }

    /// Whether the common list or any of `others` (every shard but the caller's) holds
    /// free blocks: memory a gathering could make the caller's.
    fn others_hold_free(&self, others: &[Arc<Shard>]) -> bool {
        self.common.bytes_hint() > 0 || others.iter().any(|s| s.state.lock().free.bytes() > 0)
    }

    /// How much to grow by for a request of `size` bytes, and the most the pool may then
    /// hold (the footprint budget's allowance, or the maximum without a headroom): the
    /// request, or a step of an eighth of the peak live bytes (between [`MIN_CHUNK`] and
    /// [`MAX_GROWTH_STEP`]) when that is more, rounded to [`MIN_CHUNK`]. The allowance is
    /// the peak live bytes plus the headroom of them, at least [`MIN_CHUNK`]. Also the live
    /// bytes with the request, for the peak once it is served.
    pub(super) fn growth(&self, size: usize) -> (usize, usize, usize) {
        // The budget follows the most ever live (as seen here, on growth), not what is live
        // now: the target is peak reserved against peak live, and a pool sized for its
        // peak needs no growth when the peak comes back.
        let now = self.used_now().saturating_add(size);
        let live = self.peak_live.load(Ordering::Relaxed).max(now);
        let step = (live / 8).clamp(MIN_CHUNK, MAX_GROWTH_STEP);
        let want = size.max(step).next_multiple_of(MIN_CHUNK);
        let allowed = match self.options.headroom {
            Some(headroom) => live.saturating_add(((live as f64 * headroom) as usize).max(MIN_CHUNK)),
            // No budget: grow, unless the shards of streams that have ended hold as much as
            // the request. Their blocks may wait for a gathering (a thread's per-thread
            // stream ends with no last event): growing instead would hold a chunk for
            // every thread that came and went, until the upstream ran out.
            None if self.ended_streams_hold(size) => 0,
            None => usize::MAX,
        };
        (want, allowed, now)
    }

    /// Whether the retired shards (of streams that have ended) hold at least `size` free
    /// bytes.
    fn ended_streams_hold(&self, size: usize) -> bool {
        let mut held = 0usize;
        self.all_shards().iter().any(|s| {
            let st = s.state.lock();
            held += if st.retired { st.free.bytes() } else { 0 };
            held >= size
        })
    }

    /// The bytes handed out now (rounded), summed over the shards (off the hot path: on
    /// growth only).
    fn used_now(&self) -> usize {
        let used: i64 = self.all_shards().iter().map(|s| s.state.lock().used_bytes()).sum();
        used.max(0) as usize + self.heap.used()
    }

    /// A fresh chunk grown on `stream` (key `key`): the first `size` bytes are handed out,
    /// the rest goes to that stream's shard (memory from an async upstream is ordered for
    /// the growing stream only, so it is treated as freed there).
    fn place_chunk(&self, chunk: &Chunk, size: usize, stream: &Stream, key: u64) -> DevPtr {
        if chunk.size > size {
            let shard = self.shard_slow(key, stream);
            let mut st = shard.state.lock();
            let epoch = st.entry_epoch();
            st.free.insert(
                chunk.start + size as u64,
                FreeBlock { size: chunk.size - size, chunk: chunk.id, epoch },
            );
            st.unevented += 1;
        }
        chunk.start
    }

    /// Records an allocation of the slow path (steps 2 to 6) as live in its stream's shard.
    pub(super) fn record_live(&self, ptr: DevPtr, size: usize, chunk: u64, stream: &Stream, key: u64) {
        self.with_shard(key, stream, |shard| shard.state.lock().put_live(ptr, size, chunk));
    }

    /// A free on one stream of a block allocated on another: the block leaves the shard it
    /// was allocated from and enters this stream's (its memory is now last used here). The
    /// shard where this stream's last such free found its block is looked at first (a
    /// consumer frees what one producer allocated, again and again); the others only when
    /// it is not there: going through every shard costs a lock each, 15 at 8 pairs, locks
    /// that the producers' looks and the other consumers' frees take too.
    ///
    /// `None` when `!blocking` (the binding's fast path, which keeps Python's GIL) and the
    /// free would wait for a lock or look beyond that first shard: the caller then takes
    /// the full path. An event due on this stream is recorded on the way (a driver call
    /// that does not wait). In a pipeline, a consumer's free of a producer's chunk is
    /// settled without giving the GIL back. `own` is the shard of `stream`.
    pub(super) fn free_foreign(
        &self,
        own: &Shard,
        ptr: DevPtr,
        size: usize,
        bytes: usize,
        stream: &Stream,
        blocking: bool,
    ) -> Option<Result<()>> {
        let key = own.key;
        let demand = self.demand.load(Ordering::Relaxed);
        let hint = {
            let st = lock_shard(own, blocking)?;
            other_shard(&st.foreign_hint, key)
        };
        let mut found = None;
        if let Some(shard) = &hint {
            match lock_shard(shard, blocking)?.take_live(ptr, size, bytes) {
                Ok(chunk) => found = chunk.map(|c| (c, None)),
                Err(e) => return Some(Err(e)),
            }
        }
        if found.is_none() {
            if !blocking {
                return None;
            }
            for shard in self.other_shards(key) {
                let taken = shard.state.lock().take_live(ptr, size, bytes);
                match taken {
                    Ok(Some(c)) => {
                        found = Some((c, Some(shard)));
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => return Some(Err(e)),
                }
            }
        }
        let Some((chunk, source)) = found else {
            return Some(Err(self.not_outstanding(ptr, size, bytes)));
        };
        // The record is out of its shard: the block goes into this stream's now, waiting
        // for the lock if it must (held only for list operations, or a driver call in a
        // free that found an event due).
        let mut st = own.state.lock();
        if let Some(shard) = source {
            st.foreign_hint = Some(Arc::downgrade(&shard));
        }
        let epoch = st.entry_epoch();
        st.free.insert(ptr, FreeBlock { size, chunk, epoch });
        self.after_free(&mut st, stream, demand);
        Some(Ok(()))
    }

    /// The error for a free of `ptr` (`bytes` asked, `size` as rounded) that no live block
    /// of the pool matches.
    pub(super) fn not_outstanding(&self, ptr: DevPtr, size: usize, bytes: usize) -> Error {
        Error::InvalidPointer(if self.table().containing(ptr, size).is_some() {
            format!(
                "{ptr:#x} is not an outstanding allocation of this ShardedPoolMemoryResource (double free?)"
            )
        } else {
            format!("{ptr:#x} (+{bytes} bytes) does not lie in memory of this ShardedPoolMemoryResource")
        })
    }

    /// Drops a retired shard that holds nothing (threads may still hold it in their
    /// caches: its key is never used again, so they never look at it).
    /// Its events go too: threads' caches keep the shard, not the backend behind them.
    fn forget(&self, shard: &Arc<Shard>) {
        {
            let mut map = write(&self.shards);
            // Checked again under the map's lock (callers checked under the shard's alone,
            // since released): a block that reached the retired shard meanwhile (memory
            // asked for on a thread's per-thread stream from one of its thread-local
            // destructors) keeps it in the pool, where its free finds it. Tried, as in
            // `sweep_borrowed`: the locks' order puts a shard's before the map's, and a
            // shard whose lock is held is in use, so it stays (a later look forgets it).
            if !shard.state.try_lock().is_some_and(|st| st.is_spent()) {
                return;
            }
            if map.get(&shard.key).is_some_and(|s| Arc::ptr_eq(s, shard)) {
                map.remove(&shard.key);
            }
        }
        let mut st = shard.state.lock();
        st.events.clear();
        st.spare_events.clear();
    }

    fn forget_if_done(&self, shard: &Arc<Shard>) {
        let spent = shard.state.lock().is_spent();
        if spent {
            self.forget(shard);
        }
    }

    /// The common list, locked when blocks of `shard` may move out of it (`may_move`, asked
    /// under the shard's lock): moved blocks stay under the common list's lock until they
    /// are in their new shard, as in `import_common`, so that a gathering never misses them.
    /// Taken before the shard's lock is taken again (the locks' order).
    fn lock_common_if(
        &self,
        shard: &Shard,
        may_move: impl FnOnce(&ShardState) -> bool,
    ) -> Option<CommonGuard<'_>> {
        let moves = may_move(&shard.state.lock());
        moves.then(|| self.common.lock())
    }

    /// Moves every block known complete from every shard to the common list (locked by the
    /// caller, so that no thread takes the common list's blocks into its shard behind the
    /// harvest), and drops retired shards left empty.
    fn harvest_completed(&self, common: &mut FreeList) {
        for shard in self.all_shards() {
            let empty = {
                let mut st = shard.state.lock();
                self.count_queries(st.refresh());
                let done = st.completed;
                common.insert_all(st.free.drain(|e| e < done), 0);
                st.is_spent()
            };
            if empty {
                self.forget(&shard);
            }
        }
    }

    /// Whether a gathering started less than `interval` ns ago.
    fn gathered_within(&self, interval: u64) -> bool {
        let last = self.counters.last_gather_ns.load(Ordering::Relaxed);
        last != 0 && crate::clock::monotonic_ns().saturating_sub(last) < interval
    }

    /// Closes every shard's open epoch, synchronises the device, and gathers every free
    /// block in the common list (all complete now, but those freed meanwhile); returns the
    /// common list, still locked.
    pub(super) fn synchronize_and_harvest(&self) -> Result<CommonGuard<'_>> {
        self.counters.last_gather_ns.store(crate::clock::monotonic_ns(), Ordering::Relaxed);
        // Close every shard's open epoch first: blocks freed before the synchronisation
        // starts are complete after it; blocks freed meanwhile get the next epoch.
        let shards = self.all_shards();
        let closed: Vec<u64> = shards
            .iter()
            .map(|s| {
                let mut st = s.state.lock();
                st.unevented = 0;
                st.close_epoch()
            })
            .collect();
        let pending = self.heap.mark();
        self.backend().ctx_synchronize(self.device())?;
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        self.heap.forget_before(pending);
        for (shard, e) in shards.iter().zip(closed) {
            shard.state.lock().complete_through(e);
        }
        drop(shards); // held no more here: the sweep below drops the shards nobody holds
        let mut common = self.common.lock();
        common.gathering();
        self.harvest_completed(&mut common);
        self.sweep_borrowed();
        Ok(common)
    }

    /// Step 6's gathering, one thread at a time: synchronises, gathers every free block in
    /// the common list, and takes a block of `size` bytes from it for the caller in the same
    /// critical section, before any other thread can take the gathered blocks into its
    /// shard (where its frees would merge with them into blocks of its open epoch, which
    /// no other stream may take). Concurrent gatherers would find each other's blocks in
    /// transit and grow; so a thread that waited for another's gathering (`seen`, the count
    /// of gatherings it last saw, moved) first looks in what that one gathered.
    fn gather_for(&self, size: usize, stream: &Stream, key: u64, seen: &mut u64) -> Result<Option<DevPtr>> {
        let mine = {
            let mut gathers = lock(&self.counters.gathers);
            let mut mine = None;
            if *gathers != *seen {
                *seen = *gathers;
                if let Some(ptr) = self.import_common(size, stream, key) {
                    return Ok(Some(ptr));
                }
                // Another thread may have taken the gathered blocks into its shard.
                mine = self.with_shard(key, stream, |own| self.take_completed(size, own, key, true));
            }
            if mine.is_none() {
                let mut common = self.synchronize_and_harvest()?;
                *gathers += 1;
                *seen = *gathers;
                mine = common.take(size, |_| true).map(|(ptr, b)| (ptr, b.chunk));
            }
            mine
        };
        self.keep_under_threshold()?;
        Ok(mine.map(|(ptr, chunk)| {
            self.record_live(ptr, size, chunk, stream, key);
            ptr
        }))
    }

    fn keep_under_threshold(&self) -> Result<()> {
        if let Some(threshold) = self.options.release_threshold {
            if self.stats().free_bytes > threshold {
                self.trim(threshold)?;
            }
        }
        Ok(())
    }

    /// An `OutOfMemory` for `requested` bytes, naming what limited it: the maximum, or
    /// the upstream (which could still give `upstream_available`, where it said).
    pub(super) fn out_of_memory(&self, requested: usize, upstream_available: Option<usize>) -> Error {
        let stats = self.stats();
        let room = self.maximum.saturating_sub(stats.reserved_bytes);
        let at_maximum = self.maximum != usize::MAX && requested > room;
        let growable = match (self.maximum == usize::MAX, upstream_available) {
            (true, a) => a,
            (false, Some(a)) => Some(a.min(room)),
            (false, None) => Some(room),
        };
        let limit = if at_maximum {
            format!(", maximum_pool_size {} reached", self.maximum)
        } else {
            format!(", the upstream {} had no more", self.upstream.name())
        };
        Error::OutOfMemory {
            requested,
            available: growable.map(|g| g.saturating_add(stats.free_bytes)),
            resource: format!(
                "ShardedPoolMemoryResource ({} bytes reserved, {} in use, {} free in blocks too small or not yet reusable{limit})",
                stats.reserved_bytes, stats.used_bytes, stats.free_bytes
            ),
        }
    }

    /// The error for a request served with `size` bytes (its class size), more than the
    /// maximum: never to be served, whatever is free. Where the request alone would fit,
    /// the message names the rounding.
    pub(super) fn beyond_maximum(&self, size: usize) -> Error {
        let why = if size - size / 16 <= self.maximum {
            format!(
                "maximum_pool_size {} is below the {size} bytes this request is served with: requests \
                 from 4 KiB to 64 MiB are rounded up to one of 16 sizes per power of two (at most \
                 6.25 % more); raise the maximum to {size}",
                self.maximum
            )
        } else {
            format!("maximum_pool_size {}", self.maximum)
        };
        // As `out_of_memory` reports it: the room under the maximum and the free blocks.
        let stats = self.stats();
        let available = self.maximum.saturating_sub(stats.reserved_bytes).saturating_add(stats.free_bytes);
        Error::OutOfMemory {
            requested: size,
            available: Some(available),
            resource: format!("ShardedPoolMemoryResource ({why})"),
        }
    }

    /// The error for a growth of `size` bytes that the upstream refused with `e`.
    pub(super) fn out_of_memory_after(&self, size: usize, e: Error) -> Error {
        match e {
            Error::OutOfMemory { available, .. } => self.out_of_memory(size, available),
            other => other,
        }
    }
}

/// `shard`'s lock, or, when `!blocking`, the lock if it is free now.
#[inline]
pub(super) fn lock_shard(shard: &Shard, blocking: bool) -> Option<ShardGuard<'_, ShardState>> {
    if blocking {
        Some(shard.state.lock())
    } else {
        shard.state.try_lock()
    }
}

/// Every shard of `map` but the one of `key`.
pub(super) fn others(map: &BTreeMap<u64, Arc<Shard>>, key: u64) -> Vec<Arc<Shard>> {
    map.values().filter(|s| s.key != key).cloned().collect()
}

/// The shard a hint names, while it is in the pool and is not the stream's own (`key`).
fn other_shard(hint: &Option<Weak<Shard>>, key: u64) -> Option<Arc<Shard>> {
    hint.as_ref().and_then(Weak::upgrade).filter(|h| h.key != key)
}
