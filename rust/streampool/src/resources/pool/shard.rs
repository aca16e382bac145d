//! One stream's shard: its free blocks, its epochs and the events that cover them
//! (`IMPLEMENTATION.md`, "Epochs"), and its retirement when its stream is destroyed.

use std::collections::VecDeque;

use super::freelist::{FreeList, NotFreed};
use super::wrong_size;
use crate::device::{BackendRef, DevPtr, RawStream};
use crate::error::Result;
use crate::stream::{Event, Stream, SyncMarks};
use crate::sync::ShardLock;
use std::sync::{Arc, Weak};

/// Events a shard keeps in flight at most.
pub(super) const MAX_EVENTS: usize = 16;
/// Epochs closed by a synchronisation's start that a shard keeps waiting for it at most
/// (beyond, the newest entry stands for the ones before it).
const MAX_SYNC_CLOSED: usize = 8;
/// While no stream is short of memory, a shard's interval between events doubles after
/// each event, up to this many times `events_every`.
pub(super) const MAX_EVENT_BACKOFF: usize = 64;

/// One stream's free blocks. On cache lines of its own: threads on different streams
/// share nothing on the hot path.
#[derive(Debug)]
#[repr(align(128))]
pub(super) struct Shard {
    pub key: u64,
    /// The stream's handle when streampool owns the stream: it is then alive for as long
    /// as this shard's lock is held and the shard is not retired (its destroy hook retires
    /// the shard, under that lock, before the stream goes), so another stream's call may
    /// record an event on it (policy step 5). None for the default streams and borrowed
    /// handles, whose end the pool cannot see.
    pub owner: Option<RawStream>,
    /// The stream is a borrowed handle (another library's, or an int), whose end the pool
    /// cannot see: the shard leaves the pool when it holds nothing and no thread holds it
    /// (`ShardedPoolMemoryResource::sweep_borrowed`), and comes back on the stream's next use.
    pub borrowed: bool,
    pub state: ShardLock<ShardState>,
}

#[derive(Debug, Default)]
pub(super) struct ShardState {
    pub free: FreeList,
    /// The open epoch: blocks entering the shard now get it.
    pub epoch: u64,
    /// Blocks that entered since the last event recorded here (in the open epoch, or in
    /// epochs a synchronisation closed).
    pub unevented: usize,
    /// Recorded events, oldest first: `(e, event)` covers every block of epoch <= e.
    pub events: VecDeque<(u64, Arc<Event>)>,
    /// Every block of an epoch below this has completed.
    pub completed: u64,
    /// The pool's demand count this shard last answered.
    pub seen_demand: u64,
    /// Another stream's look for completed blocks here (policy step 3) did not take this
    /// shard's whole batch: it found no block that fits, or took one block only (the shard
    /// holds live blocks of its own, or the common list was not held). Record an event at
    /// the next free, so that what this stream frees can be taken next time.
    pub wanted: bool,
    /// A look took this shard's completed blocks and shortened `interval` to when it will
    /// want more: the event then starts the interval again from `events_every`.
    pub drawn: bool,
    /// Frees between events now: `events_every`, doubled after each event recorded while
    /// nobody was short of memory (up to `MAX_EVENT_BACKOFF` times), reset on demand;
    /// shortened by a look that took the shard's blocks (`drawn`).
    pub interval: usize,
    /// `PoolOptions::event_batch`: an ask is answered after this many frees at least.
    pub batch: usize,
    pub spare_events: Vec<Arc<Event>>,
    /// The shard in which this stream's last free of a block allocated on another stream
    /// found the block's record: where the next such free looks first (a consumer frees
    /// what one producer allocated, again and again). Weak: shards that leave the pool go.
    pub foreign_hint: Option<Weak<Shard>>,
    /// The shard from which this stream last took completed blocks (policy step 3): where
    /// its next look starts.
    pub source_hint: Option<Weak<Shard>>,
    /// Bytes of the live blocks whose records this shard holds (allocated on this stream,
    /// not yet freed). Signed: see [`ShardState::used_bytes`].
    pub used: i64,
    /// The stream's synchronisations, for a stream streampool owns: one that starts after a
    /// block entered completes the block once it returns, with no event and no query
    /// (`IMPLEMENTATION.md`, "Epochs").
    pub syncs: Option<Arc<SyncMarks>>,
    /// `syncs.started()` as the open epoch's blocks saw it: a block that sees another value
    /// closes the epoch first.
    pub open_syncs: u64,
    /// A block entered the open epoch (with `syncs` only).
    pub open_used: bool,
    /// Epochs closed as a synchronisation started, oldest first: `(e, n)`, every block of
    /// an epoch up to `e` is complete once `syncs.done() >= n`.
    pub sync_closed: VecDeque<(u64, u64)>,
    /// `syncs.done()` when an event was last due: a synchronisation that returned since
    /// then stands in for the next event.
    pub due_syncs: u64,
    /// The stream was destroyed: nothing enters this shard any more, an event recorded
    /// just before the destruction covers every free block, and the shard leaves the pool
    /// once those blocks have gone to the common list and its live blocks are freed.
    pub retired: bool,
}

impl Shard {
    /// Epochs start at 1: epoch 0 tags blocks known complete everywhere (from the common
    /// list), which every shard's `completed` is past.
    pub fn new(
        key: u64,
        options: &super::PoolOptions,
        owner: Option<RawStream>,
        borrowed: bool,
        syncs: Option<Arc<SyncMarks>>,
    ) -> Self {
        let state = ShardState {
            interval: options.events_every,
            batch: options.event_batch,
            epoch: 1,
            completed: 1,
            syncs,
            free: FreeList::new(options.expandable),
            ..Default::default()
        };
        Shard { key, owner, borrowed, state: ShardLock::new(state) }
    }

    /// Called as `stream` (this shard's, still alive) is destroyed: covers every free block
    /// with one last event, so that other streams may take them once it completes (or wait
    /// on it), and marks the shard retired. A failure to record (the driver torn down at
    /// exit) leaves the blocks to the next synchronisation; on a simulated device since
    /// closed there is nothing to order, and nothing is recorded.
    pub fn retire(&self, backend: &BackendRef, device: i32, stream: &Stream) {
        let mut st = self.state.lock();
        st.retired = true;
        // Not `unevented` alone: an event skipped for a synchronisation, or for the most
        // events in flight, left the open epoch's blocks uncovered with it at 0.
        if st.has_uncovered() && backend.check_open().is_ok() {
            let recorded = st.record_event(backend, device, stream.handle(), true).map(|_| ());
            crate::error::record_if_failed(|| "a retiring pool shard's last event".into(), recorded);
        }
    }

    /// Called as the thread whose per-thread default stream this shard's is exits: the
    /// shard is retired without a last event (the stream is going, and the driver may have
    /// torn it down already), so its free blocks wait for the next synchronisation, and
    /// the shard leaves the pool once they have gone.
    pub fn retire_at_thread_exit(&self) {
        self.state.lock().retired = true;
    }
}

impl ShardState {
    /// Whether another stream asked for this stream's memory since its last event (it
    /// looked into this shard, or the pool's demand count moved).
    #[inline]
    pub fn asked(&self, demand: u64) -> bool {
        self.wanted || demand != self.seen_demand
    }

    /// Whether the next free is to record an event: asked for, or the interval is up.
    #[inline]
    pub fn event_due(&self, demand: u64) -> bool {
        let n = self.unevented + 1;
        n >= self.interval || (n >= self.batch && self.asked(demand))
    }

    /// Retired and holding nothing: the shard may leave the pool.
    pub fn is_spent(&self) -> bool {
        self.retired && self.free.bytes() == 0 && self.used == 0
    }

    /// Its stream alive, and no live block of its own recorded here (a consumer's stream,
    /// which frees what others allocated): its free blocks may all move to another shard.
    pub fn gives_all(&self) -> bool {
        !self.retired && self.used == 0
    }

    /// The bytes of live blocks recorded here. A block allocated on this stream and freed
    /// on another leaves this shard's records, so each shard's figure is exact; it is
    /// signed only so that a bookkeeping slip would show as a negative sum, never wrap.
    pub fn used_bytes(&self) -> i64 {
        self.used
    }

    /// Records `ptr` (`size` rounded, in chunk `chunk`) live in this shard.
    pub fn put_live(&mut self, ptr: DevPtr, size: usize, chunk: u64) {
        self.free.insert_live(ptr, size, chunk);
        self.used += size as i64;
    }

    /// Takes the live record of `ptr` (`size` rounded, `bytes` as the caller passed it)
    /// out of this shard: its chunk, `None` when there is no record there, an error when
    /// the record has another size.
    pub fn take_live(&mut self, ptr: DevPtr, size: usize, bytes: usize) -> Result<Option<u64>> {
        match self.free.take_live(ptr, size) {
            Ok(chunk) => {
                self.used -= size as i64;
                Ok(Some(chunk))
            }
            Err(NotFreed::Unknown) => Ok(None),
            Err(NotFreed::WrongSize(had)) => Err(wrong_size(ptr, had, bytes)),
        }
    }

    /// The epoch of a block entering the shard now (freed here, grown for this stream, or
    /// moved in ordered after this stream's work). When the stream was synchronised since
    /// the open epoch's blocks entered (a synchronisation started: its count moved), the
    /// epoch is closed first, to complete once that synchronisation returns.
    #[inline]
    pub fn entry_epoch(&mut self) -> u64 {
        if let Some(syncs) = &self.syncs {
            let started = syncs.started();
            if started != self.open_syncs {
                self.close_for_sync(started);
            }
            self.open_used = true;
        }
        self.epoch
    }

    #[cold]
    #[inline(never)]
    fn close_for_sync(&mut self, started: u64) {
        if self.open_used {
            let closed = (self.epoch, self.open_syncs + 1);
            if self.sync_closed.len() >= MAX_SYNC_CLOSED {
                // Coarser, never wrong: the newer epoch's synchronisation covers the older.
                *self.sync_closed.back_mut().expect("full") = closed;
            } else {
                self.sync_closed.push_back(closed);
            }
            self.close_epoch();
        }
        self.open_syncs = started;
    }

    /// Marks complete the epochs whose closing synchronisation has returned, and the open
    /// one when a synchronisation started after its blocks has returned.
    fn complete_synced(&mut self, done: u64, started: u64) {
        let mut through = None;
        while let Some(&(e, n)) = self.sync_closed.front() {
            if n > done {
                break;
            }
            through = Some(e);
            self.sync_closed.pop_front();
        }
        if self.open_used && done > self.open_syncs {
            through = Some(self.close_epoch());
            self.open_syncs = started;
        }
        if let Some(e) = through {
            self.complete_through(e);
        }
    }

    /// Closes the open epoch (its blocks keep their tag; the next block gets a new one);
    /// returns the closed epoch.
    pub fn close_epoch(&mut self) -> u64 {
        self.open_used = false;
        self.epoch += 1;
        self.epoch - 1
    }

    /// Whether blocks may have entered since the last event without one covering them
    /// yet: in the open epoch, or in epochs a synchronisation closed and has not completed.
    pub fn has_uncovered(&self) -> bool {
        self.unevented > 0 || self.open_used || !self.sync_closed.is_empty()
    }

    /// Whether the stream was synchronised (a synchronisation returned) since an event was
    /// last due here; notes the count either way. Such a stream's blocks complete at its
    /// synchronisations, so the event that is due now need not be recorded.
    pub fn synced_since_due(&mut self) -> bool {
        let Some(syncs) = &self.syncs else { return false };
        let done = syncs.done();
        let synced = done > self.due_syncs;
        self.due_syncs = done;
        synced
    }

    /// Advances `completed` past every epoch a synchronisation of the stream completed and
    /// every recorded event that has finished; returns the queries it made (the pool
    /// counts them).
    pub fn refresh(&mut self) -> u64 {
        if let Some(syncs) = &self.syncs {
            // `started` read now, before any later entry: at worst older than the entries'
            // view, which only closes their epoch sooner.
            let (done, started) = (syncs.done(), syncs.started());
            self.complete_synced(done, started);
        }
        let mut queries = 0;
        while let Some((e, ev)) = self.events.front() {
            queries += 1;
            if !ev.query().unwrap_or(false) {
                break;
            }
            self.completed = self.completed.max(e + 1);
            let (_, ev) = self.events.pop_front().expect("checked");
            self.spare(ev);
        }
        queries
    }

    /// Every block of an epoch below this is covered by a recorded event or known complete.
    pub fn covered(&self) -> u64 {
        self.events.back().map_or(0, |(e, _)| e + 1).max(self.completed)
    }

    /// The event that covers blocks of `epoch`, or None when they are known complete.
    pub fn covering(&self, epoch: u64) -> Option<Arc<Event>> {
        if epoch < self.completed {
            return None;
        }
        self.events.iter().find(|(e, _)| *e >= epoch).map(|(_, ev)| ev.clone())
    }

    /// Marks every epoch up to `e` complete (a device synchronisation saw it finish).
    pub fn complete_through(&mut self, e: u64) {
        self.completed = self.completed.max(e + 1);
        while self.events.front().is_some_and(|(ev, _)| *ev <= e) {
            let (_, ev) = self.events.pop_front().expect("checked");
            self.spare(ev);
        }
    }

    fn spare(&mut self, event: Arc<Event>) {
        // Reused only when no waiter still holds it (a re-record would make it wait longer).
        if Arc::strong_count(&event) == 1 && self.spare_events.len() < 8 {
            self.spare_events.push(event);
        }
    }

    /// Records an event on `stream` covering the open epoch, and opens the next; false
    /// when `MAX_EVENTS` are in flight (as last refreshed) and `!force` (more would not make
    /// blocks takeable sooner: the open epoch stays open, and the next record covers it).
    pub fn record_event(
        &mut self,
        backend: &BackendRef,
        device: i32,
        stream: RawStream,
        force: bool,
    ) -> Result<bool> {
        if self.events.len() >= MAX_EVENTS && !force {
            self.unevented = 0;
            return Ok(false);
        }
        let event = match self.spare_events.pop() {
            Some(e) => e,
            None => Arc::new(Event::new(backend, device)?),
        };
        backend.event_record(device, event.raw(), stream)?;
        let closed = self.close_epoch();
        self.events.push_back((closed, event));
        self.unevented = 0;
        Ok(true)
    }
}
