//! The pool's background thread (`PoolOptions::background`): the driver calls that let
//! one stream reuse what another freed, made off the threads that allocate and free
//! (`IMPLEMENTATION.md`, "The background thread").
//!
//! It records the event a shard of a stream streampool owns is due (after its frees, or
//! because another stream asked for its memory), in place of the free that found it due.
//! The stream is kept alive by the shard's `recorder` lock, which its destroy hook takes
//! before it retires the shard. No shard lock is held across the record. It sleeps until
//! a record is wanted.
//!
//! It does not query events: a version that also polled every shard's events, so that
//! looks need not query, let producers learn of completed frees later and wait on other
//! streams 5 times as often; on the H200 the pipeline's allocator share went up, not down
//! (`IMPLEMENTATION.md`).

use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicBool, Ordering as StdOrdering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use super::shard::{Shard, MAX_EVENTS};
use super::Counters;
use crate::device::BackendRef;
use crate::stream::Event;
use crate::sync::{lock, read, Ordering, RwLock};

/// A record that waits for room (a shard with its most events in flight) is tried again
/// after this long.
const RETRY: Duration = Duration::from_micros(50);
/// With no record wanted it sleeps until woken, or this long at most.
const IDLE: Duration = Duration::from_millis(10);

/// What the thread shares with the pool.
pub(super) struct Shared {
    pub shards: Arc<RwLock<HashMap<u64, Arc<Shard>>>>,
    pub counters: Arc<Counters>,
    pub backend: BackendRef,
    pub device: i32,
    stop: AtomicBool,
    sleeping: AtomicBool,
    thread: Mutex<Option<Thread>>,
}

/// The pool's handle on its thread: stops and joins it when dropped.
pub(super) struct Reclaimer {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
}

impl Reclaimer {
    /// Starts the thread. `None` when the system refuses a thread: the pool then makes
    /// these calls itself, in its frees and looks.
    pub fn start(
        shards: Arc<RwLock<HashMap<u64, Arc<Shard>>>>,
        counters: Arc<Counters>,
        backend: BackendRef,
        device: i32,
    ) -> Option<Self> {
        let shared = Arc::new(Shared {
            shards,
            counters,
            backend,
            device,
            stop: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let theirs = shared.clone();
        let handle =
            match std::thread::Builder::new().name("streampool-reclaim".into()).spawn(move || theirs.run()) {
                Ok(h) => h,
                Err(e) => {
                    let e = crate::error::Error::invalid(e.to_string());
                    crate::error::record_drop_error(
                        "starting a pool's background thread (the pool makes its calls itself)",
                        &e,
                    );
                    return None;
                }
            };
        *shared.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle.thread().clone());
        Some(Reclaimer { shared, handle: Some(handle) })
    }

    /// Wakes the thread if it sleeps: a shard now wants a record. Called after the shard's
    /// lock was given back.
    #[inline]
    pub fn wake(&self) {
        // Pairs with the fence in `run`: either the thread sees the wanted record in its
        // last look before sleeping, or this sees it asleep.
        fence(StdOrdering::SeqCst);
        if self.shared.sleeping.load(StdOrdering::Relaxed) {
            self.shared.unpark();
        }
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        self.shared.stop.store(true, StdOrdering::SeqCst);
        self.shared.unpark();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Shared {
    fn unpark(&self) {
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            t.unpark();
        }
    }

    fn run(&self) {
        while !self.stop.load(StdOrdering::Relaxed) {
            if self.pass() {
                // Records still wanted (a shard had its most events in flight): again soon.
                std::thread::sleep(RETRY);
                continue;
            }
            self.sleeping.store(true, StdOrdering::Relaxed);
            fence(StdOrdering::SeqCst);
            if !self.wanted() && !self.stop.load(StdOrdering::Relaxed) {
                std::thread::park_timeout(IDLE);
            }
            self.sleeping.store(false, StdOrdering::Relaxed);
        }
    }

    fn shards(&self) -> Vec<Arc<Shard>> {
        read(&self.shards).values().cloned().collect()
    }

    /// Whether any shard wants a record (looked at before sleeping).
    fn wanted(&self) -> bool {
        self.shards().iter().any(|s| s.state.lock().record_wanted)
    }

    /// Records every wanted event; true when one is still wanted.
    fn pass(&self) -> bool {
        let mut again = false;
        for shard in self.shards() {
            let Some(owner) = shard.owner else { continue };
            if shard.state.lock().record_wanted {
                again |= !self.record(&shard, owner);
            }
        }
        again
    }

    /// Records the event `shard` wants on its stream `owner`; false when it is still
    /// wanted (the shard has its most events in flight).
    fn record(&self, shard: &Shard, owner: crate::device::RawStream) -> bool {
        // Held across the record: the stream's destroy hook takes it before it retires the
        // shard, so the stream is alive while the shard is not retired.
        let _alive = lock(&shard.recorder);
        let (epoch, spare) = {
            let mut st = shard.state.lock();
            if st.retired || !st.record_wanted || st.pending {
                return true;
            }
            if st.unevented == 0 {
                st.record_wanted = false;
                return true;
            }
            if st.events.len() >= MAX_EVENTS {
                let queries = st.refresh();
                self.counters.queries.fetch_add(queries, Ordering::Relaxed);
                if st.events.len() >= MAX_EVENTS {
                    // Still full: the record stays wanted, tried again shortly.
                    return false;
                }
            }
            st.record_wanted = false;
            st.pending = true;
            let epoch = st.epoch;
            st.epoch += 1;
            st.unevented = 0;
            (epoch, st.spare_events.pop())
        };
        let recorded = match spare {
            Some(e) => Ok(e),
            None => Event::new(&self.backend, self.device).map(Arc::new),
        }
        .and_then(|event| self.backend.event_record(self.device, event.raw(), owner).map(|()| event));
        let mut st = shard.state.lock();
        st.pending = false;
        match recorded {
            Ok(event) => {
                st.events.push_back((epoch, event));
                self.counters.events.fetch_add(1, Ordering::Relaxed);
            }
            // The closed epoch's blocks wait for the next event (which covers every older
            // epoch) or a synchronisation, as when a free fails to record; said in
            // `drop_errors`, since no caller is there to tell.
            Err(e) => {
                crate::error::record_drop_error("the pool's background thread recording an event", &e);
            }
        }
        true
    }
}
