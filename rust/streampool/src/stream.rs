//! Streams and events.
//!
//! A [`Stream`] is one of:
//! * the legacy default stream (handle 0; the driver's `CU_STREAM_LEGACY` = 1 is the same
//!   stream and is normalised to 0) or the per-thread default stream (handle 2: a
//!   different stream on every host thread). These exist on every backend and device,
//!   so they are not bound to one;
//! * one thread's per-thread default stream, remembered ([`Stream::resolved`]): what memory
//!   made on the per-thread default stream keeps, so that a use from another thread is
//!   ordered with the thread that made it, not with the user's own;
//! * a stream this crate created and owns (non-blocking unless asked), destroyed when the
//!   last clone is dropped;
//! * a borrowed handle that someone else owns (PyTorch's, CuPy's), checked to be a live
//!   stream when it is wrapped and never destroyed here.

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::ThreadId;

use crate::device::{BackendRef, RawEvent, RawStream, LEGACY_STREAM, LEGACY_STREAM_ALIAS, PER_THREAD_STREAM};
use crate::error::{record_if_failed, Error, Result};

/// A CUDA stream handle with its provenance. Cheap to clone.
#[derive(Clone)]
pub struct Stream {
    handle: RawStream,
    origin: Origin,
}

#[derive(Clone)]
enum Origin {
    Default,
    /// The per-thread default stream of this thread, resolved (`handle` is 2).
    PerThreadOf(ThreadId),
    Owned(Arc<OwnedStream>),
    Borrowed {
        backend: BackendRef,
        device: i32,
        key: u64,
        /// Capturing a CUDA graph when wrapped ([`Stream::capturing`]).
        capturing: bool,
    },
}

struct OwnedStream {
    backend: BackendRef,
    device: i32,
    handle: RawStream,
    key: u64,
    /// Run with the stream, still alive, just before it is destroyed ([`Stream::on_destroy`]).
    on_destroy: std::sync::Mutex<Vec<Hooked<DestroyHook>>>,
    syncs: Arc<SyncMarks>,
}

/// A stream's host synchronisations through [`Stream::synchronize`], counted so that a pool
/// learns that frees on the stream have completed without asking the driver: work
/// enqueued on the stream before [`SyncMarks::started`] read `n` has completed once
/// [`SyncMarks::done`] is above `n`. Kept for the streams streampool owns
/// ([`Stream::sync_marks`]).
#[derive(Debug, Default)]
pub struct SyncMarks {
    started: AtomicU64,
    done: AtomicU64,
}

impl SyncMarks {
    /// Synchronisations started so far.
    ///
    /// Sequentially consistent, against the increment that starts a synchronisation: a
    /// caller that enqueued work and then read `n` has its work ordered before every
    /// synchronisation numbered above `n` (the driver's enqueue and its synchronisation
    /// are themselves ordered by its own lock).
    #[inline]
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::SeqCst)
    }

    /// The highest number of a synchronisation that has returned (synchronisations are
    /// numbered from 1 as they start).
    #[inline]
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Acquire)
    }

    /// Runs `sync` as the next synchronisation: counted as started before it and as done
    /// once it returns successfully.
    fn around(&self, sync: impl FnOnce() -> Result<()>) -> Result<()> {
        let n = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        sync()?;
        self.done.fetch_max(n, Ordering::Release);
        Ok(())
    }
}

/// See [`Stream::on_destroy`].
pub type DestroyHook = Box<dyn FnOnce(&Stream) + Send>;

/// Whether a hook still has something to do (its owner, say a pool, is still there).
pub type HookAlive = Box<dyn Fn() -> bool + Send>;

/// A hook kept until it runs, or until `alive` says its owner has gone: such hooks are
/// dropped as others are added, so that a long-lived stream (or thread) used by many
/// short-lived pools keeps only the live pools' hooks.
struct Hooked<H> {
    hook: H,
    alive: Option<HookAlive>,
}

/// Adds `hook` to `hooks`, dropping those whose owner has gone.
fn add_hook<H>(hooks: &mut Vec<Hooked<H>>, hook: H, alive: Option<HookAlive>) {
    hooks.retain(|h| h.alive.as_ref().is_none_or(|alive| alive()));
    hooks.push(Hooked { hook, alive });
}

/// Keys handed out where the driver cannot name a stream (`cuStreamGetId` needs CUDA 12):
/// unique per wrapper, which is conservative (one stream may get two keys, never the
/// reverse). They start high, above any id the driver hands out.
static NEXT_FALLBACK_KEY: AtomicU64 = AtomicU64::new(1 << 62);

fn stream_key(backend: &BackendRef, device: i32, handle: RawStream) -> u64 {
    backend.stream_id(device, handle).unwrap_or_else(|_| NEXT_FALLBACK_KEY.fetch_add(1, Ordering::Relaxed))
}

thread_local! {
    /// This thread's keys of its per-thread default stream: (backend id, device, handle) -> key.
    static DEFAULT_KEYS: RefCell<Vec<(u64, i32, RawStream, u64)>> = const { RefCell::new(Vec::new()) };
    /// This thread's id, looked up once (`thread::current` clones a handle each time).
    static THREAD: ThreadId = std::thread::current().id();
    /// Run as this thread exits (see [`Stream::on_thread_exit`]).
    static EXIT_HOOKS: ExitHooks = const { ExitHooks(RefCell::new(Vec::new())) };
}

/// Whether the calling thread is exiting, its hooks run or running (see
/// [`Stream::on_thread_exit`]): what its thread-local destructors do on its per-thread
/// default stream comes after the state kept for that stream was retired.
pub(crate) fn thread_exiting() -> bool {
    EXIT_HOOKS.try_with(|_| ()).is_err()
}

/// Hooks run when the thread that registered them exits.
struct ExitHooks(RefCell<Vec<Hooked<ExitHook>>>);

/// What [`Stream::on_thread_exit`] runs.
type ExitHook = Box<dyn FnOnce() + Send>;

impl Drop for ExitHooks {
    fn drop(&mut self) {
        for Hooked { hook, .. } in self.0.get_mut().drain(..) {
            hook();
        }
    }
}

/// True on `owner` itself. False where this thread's storage is already torn down (a
/// value dropped by a thread-local destructor): the legacy stream, which the answer then
/// leads to, is ordered with the owner's per-thread stream from its own thread too.
#[inline]
fn on_thread(owner: ThreadId) -> bool {
    THREAD.try_with(|me| *me == owner).unwrap_or(false)
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        let hooks = std::mem::take(self.on_destroy.get_mut().unwrap_or_else(|e| e.into_inner()));
        if !hooks.is_empty() {
            // The last clone is gone; the hooks see the stream as a borrowed handle.
            let view = Stream {
                handle: self.handle,
                origin: Origin::Borrowed {
                    backend: self.backend.clone(),
                    device: self.device,
                    key: self.key,
                    capturing: false,
                },
            };
            for Hooked { hook, .. } in hooks {
                hook(&view);
            }
        }
        // Work already enqueued still runs (the driver's rule); a failure here (driver
        // torn down at exit) has nobody to report to: it is recorded.
        let (device, handle) = (self.device, self.handle);
        record_if_failed(
            || format!("destroying stream {handle:#x} of device {device}"),
            self.backend.stream_destroy(device, handle),
        );
    }
}

impl Stream {
    /// The legacy default stream (handle 0). What `stream=None` means.
    pub const fn legacy() -> Self {
        Stream { handle: LEGACY_STREAM, origin: Origin::Default }
    }

    /// The per-thread default stream (handle 2): a different stream on each host thread.
    pub const fn per_thread() -> Self {
        Stream { handle: PER_THREAD_STREAM, origin: Origin::Default }
    }

    /// Creates and owns a new stream on `device` of `backend`; non-blocking (it does not
    /// synchronise with the legacy default stream) unless `blocking`.
    pub fn create(backend: &BackendRef, device: i32, blocking: bool) -> Result<Self> {
        let handle = backend.stream_create(device, blocking)?;
        let key = stream_key(backend, device, handle);
        let owned = OwnedStream {
            backend: backend.clone(),
            device,
            handle,
            key,
            on_destroy: Default::default(),
            syncs: Default::default(),
        };
        Ok(Stream { handle, origin: Origin::Owned(Arc::new(owned)) })
    }

    /// Wraps a handle someone else owns. Handles 0, 1 and 2 name the default streams;
    /// any other must name a live stream of `backend`. The simulated device checks that
    /// always; the CUDA driver cannot check a made-up value (it dereferences the handle,
    /// and a garbage one crashes the process), so on CUDA a raw handle is trusted. A stream
    /// that is capturing a CUDA graph is asked its device, which invalidates the capture:
    /// [`Stream::borrowed_for_call`] asks first, of a stream known to be alive.
    pub fn borrowed(backend: &BackendRef, handle: RawStream) -> Result<Self> {
        match handle {
            LEGACY_STREAM | LEGACY_STREAM_ALIAS => Ok(Self::legacy()),
            PER_THREAD_STREAM => Ok(Self::per_thread()),
            _ => {
                let device = backend.stream_device(handle).map_err(|e| match e {
                    e @ Error::InvalidStream(_) => e, // already says so, naming the device
                    e => Error::InvalidStream(format!(
                        "handle {handle:#x} does not name a live stream on {} ({e})",
                        backend.describe()
                    )),
                })?;
                let key = stream_key(backend, device, handle);
                Ok(Stream {
                    handle,
                    origin: Origin::Borrowed { backend: backend.clone(), device, key, capturing: false },
                })
            }
        }
    }

    /// [`Stream::borrowed_live`] for the length of one call, of a handle the caller knows to
    /// be alive (another library's stream object it holds): asks whether the stream captures
    /// a CUDA graph (`cuStreamIsCapturing`, the one question that never harms a capture,
    /// but that crashed the process on a destroyed stream's handle on an H100), and wraps a
    /// capturing one as [`Stream::capturing`], on the calling thread's current device (asking
    /// the stream its own would invalidate the capture). The mark is the stream's state at
    /// this call: a wrapper kept past the capture would keep it.
    pub fn borrowed_for_call(backend: &BackendRef, handle: RawStream) -> Result<Self> {
        if !matches!(handle, LEGACY_STREAM | LEGACY_STREAM_ALIAS) {
            let current = backend.current_device().unwrap_or(0);
            if backend.stream_capturing(current, handle).unwrap_or(false) {
                return Ok(Self::capturing(backend, current, handle));
            }
        }
        Self::borrowed_live(backend, handle)
    }

    /// A stream of `device` that is capturing a CUDA graph (the caller asked
    /// [`Backend::stream_capturing`](crate::device::Backend::stream_capturing)), wrapped
    /// without asking the driver its identity or device, which would invalidate the
    /// capture. Resources read the mark ([`Stream::is_capturing`]): those that can serve a
    /// capture ([`MemoryResource::serves_capture`](crate::MemoryResource::serves_capture))
    /// allocate graph memory on it, the others refuse. Any handle, the per-thread default
    /// stream's (2) included; its key is its own (never a shard's or a list's).
    pub fn capturing(backend: &BackendRef, device: i32, handle: RawStream) -> Self {
        let key = NEXT_FALLBACK_KEY.fetch_add(1, Ordering::Relaxed);
        Stream { handle, origin: Origin::Borrowed { backend: backend.clone(), device, key, capturing: true } }
    }

    /// Whether this stream was wrapped as capturing a CUDA graph ([`Stream::capturing`]): a
    /// mark, not a question to the driver.
    #[inline]
    pub fn is_capturing(&self) -> bool {
        matches!(self.origin, Origin::Borrowed { capturing: true, .. })
    }

    /// [`Stream::borrowed`] for a handle known to be live (another library's stream object
    /// handed it over, or an entry point whose contract is a live stream, as PyTorch's
    /// allocator's): a stream this crate destroyed earlier may have had the same handle
    /// value, which the driver reuses, and that is not held against it.
    pub fn borrowed_live(backend: &BackendRef, handle: RawStream) -> Result<Self> {
        backend.stream_vouched(handle);
        Self::borrowed(backend, handle)
    }

    /// Runs `hook` with this stream, still alive, just before the stream is destroyed (when
    /// its last clone is dropped), so that state kept per stream (a pool's shard) can
    /// record a last event on it and be retired. Only for streams this crate owns: for the
    /// default streams and borrowed handles, whose end cannot be seen, `hook` is dropped
    /// and the answer is false. The hook is handed the stream: it must not keep a clone of
    /// it (move one into the closure), or the stream's last clone is never dropped and the
    /// stream never destroyed.
    pub fn on_destroy(&self, hook: DestroyHook) -> bool {
        self.add_destroy_hook(hook, None)
    }

    /// [`Stream::on_destroy`] for a hook that matters only while `alive` says so (its
    /// owner is still there): once it says no, the hook is dropped when another is added,
    /// so that a stream used by many short-lived pools does not keep a hook for each.
    pub fn on_destroy_while(&self, alive: HookAlive, hook: DestroyHook) -> bool {
        self.add_destroy_hook(hook, Some(alive))
    }

    fn add_destroy_hook(&self, hook: DestroyHook, alive: Option<HookAlive>) -> bool {
        match &self.origin {
            Origin::Owned(o) => {
                add_hook(&mut o.on_destroy.lock().unwrap_or_else(|e| e.into_inner()), hook, alive);
                true
            }
            _ => false,
        }
    }

    /// Runs `hook` when the calling thread exits, where this stream is the calling thread's
    /// per-thread default stream, which ends with the thread: state kept for that stream
    /// (a pool's shard) can then be retired. `hook` runs among the thread's thread-local
    /// destructors, where the driver's own state for the thread may be gone: it must not
    /// use the stream. For any other stream (or a thread already exiting), `hook` is dropped
    /// and the answer is false.
    pub fn on_thread_exit(&self, hook: Box<dyn FnOnce() + Send>) -> bool {
        self.add_exit_hook(hook, None)
    }

    /// [`Stream::on_thread_exit`] for a hook that matters only while `alive` says so:
    /// dropped, once it says no, when another is added (as [`Stream::on_destroy_while`]).
    pub fn on_thread_exit_while(&self, alive: HookAlive, hook: Box<dyn FnOnce() + Send>) -> bool {
        self.add_exit_hook(hook, Some(alive))
    }

    fn add_exit_hook(&self, hook: ExitHook, alive: Option<HookAlive>) -> bool {
        if !self.is_per_thread() {
            return false;
        }
        EXIT_HOOKS.try_with(|hooks| add_hook(&mut hooks.0.borrow_mut(), hook, alive)).is_ok()
    }

    /// This stream made independent of the thread that uses it: the per-thread default
    /// stream becomes the calling thread's own, remembered; any other stream is itself.
    ///
    /// Handle 2 always names the calling thread's per-thread default stream: no other
    /// thread can enqueue work onto a thread's per-thread stream or record an event there.
    /// What another thread can do is use the legacy default stream, which synchronises
    /// with every blocking stream, per-thread default streams included: its work is
    /// ordered after all the work enqueued before on the owner's per-thread stream, and
    /// before all the work enqueued there after. So a resolved per-thread stream is that
    /// stream on its own thread and the legacy default stream on every other thread:
    /// [`Stream::handle`], [`Stream::key`], [`Stream::is_legacy`] and
    /// [`Stream::is_per_thread`] answer for the calling thread, and so does everything
    /// built on them (copies, events, waits, frees, a pool's shards). Whatever keeps a
    /// stream to order later work on (an [`Allocation`](crate::Allocation)) keeps it
    /// resolved.
    pub fn resolved(self) -> Stream {
        if self.is_per_thread() {
            let me = THREAD.try_with(|me| *me).unwrap_or_else(|_| std::thread::current().id());
            return Stream { handle: PER_THREAD_STREAM, origin: Origin::PerThreadOf(me) };
        }
        self
    }

    /// The handle value to pass to the driver (0 for the legacy default stream). For
    /// another thread's resolved per-thread stream, the legacy default stream's (see
    /// [`Stream::resolved`]).
    #[inline]
    pub fn handle(&self) -> RawStream {
        match self.origin {
            Origin::PerThreadOf(owner) if !on_thread(owner) => LEGACY_STREAM,
            _ => self.handle,
        }
    }

    /// True for the legacy default stream (and, on another thread, for a resolved
    /// per-thread stream, which stands for it there).
    pub fn is_legacy(&self) -> bool {
        match self.origin {
            Origin::Default => self.handle == LEGACY_STREAM,
            Origin::PerThreadOf(owner) => !on_thread(owner),
            _ => false,
        }
    }

    /// True for the per-thread default stream (a resolved one: on its own thread only).
    pub fn is_per_thread(&self) -> bool {
        match self.origin {
            Origin::Default => self.handle == PER_THREAD_STREAM,
            Origin::PerThreadOf(owner) => on_thread(owner),
            _ => false,
        }
    }

    /// The thread whose per-thread default stream this is, for a resolved one.
    pub fn owner_thread(&self) -> Option<ThreadId> {
        match self.origin {
            Origin::PerThreadOf(owner) => Some(owner),
            _ => None,
        }
    }

    /// The count of this stream's synchronisations, for a stream streampool owns (`None`
    /// for the default streams and borrowed handles, which others synchronise unseen).
    pub fn sync_marks(&self) -> Option<Arc<SyncMarks>> {
        match &self.origin {
            Origin::Owned(o) => Some(o.syncs.clone()),
            _ => None,
        }
    }

    /// True when this stream was created by streampool and is destroyed with its last clone.
    pub fn is_owned(&self) -> bool {
        matches!(self.origin, Origin::Owned(_))
    }

    /// True for a borrowed handle (another library's stream, or a handle given as a
    /// number): neither streampool's own nor a default stream. Its end is not seen here.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.origin, Origin::Borrowed { .. })
    }

    /// Whether this is a borrowed handle whose stream its backend knows to be destroyed
    /// (see [`Backend::stream_destroyed`](crate::device::Backend::stream_destroyed)): a
    /// stream this crate made and destroyed, wrapped again by a stream object that outlived
    /// it. Streams this crate owns live as long as any clone, and default streams always.
    pub fn known_destroyed(&self) -> bool {
        match &self.origin {
            Origin::Borrowed { backend, .. } => backend.stream_destroyed(self.handle),
            _ => false,
        }
    }

    /// The device this stream is of: its own, or `default` for a default stream (which every
    /// device has: the caller says whose it means).
    pub fn device_or(&self, default: i32) -> i32 {
        self.binding().map_or(default, |(_, d)| d)
    }

    /// The backend and device this stream is bound to; `None` for the default streams,
    /// which exist everywhere.
    pub fn binding(&self) -> Option<(&BackendRef, i32)> {
        match &self.origin {
            Origin::Default | Origin::PerThreadOf(_) => None,
            Origin::Owned(o) => Some((&o.backend, o.device)),
            Origin::Borrowed { backend, device, .. } => Some((backend, *device)),
        }
    }

    /// True when this stream is certainly usable by an object of `backend`, device
    /// `device` (a default stream, or one bound to exactly that backend object and device):
    /// the test of a hot path, whose `false` leads to [`Stream::check`] for the answer.
    /// False for a stream wrapped as capturing a CUDA graph ([`Stream::capturing`]): the
    /// hot paths leave it to the full path, which looks at the mark.
    #[inline]
    pub fn is_bound_to(&self, backend: &BackendRef, device: i32) -> bool {
        match &self.origin {
            Origin::Owned(o) => Arc::ptr_eq(&o.backend, backend) && o.device == device,
            Origin::Borrowed { backend: mine, device: my_device, capturing, .. } => {
                !*capturing && Arc::ptr_eq(mine, backend) && *my_device == device
            }
            Origin::Default | Origin::PerThreadOf(_) => true,
        }
    }

    /// Refuses this stream for use by an object of `backend`, device `device`, when it
    /// belongs to another backend or device.
    #[inline]
    pub fn check(&self, backend: &BackendRef, device: i32) -> Result<()> {
        if self.is_bound_to(backend, device) {
            return Ok(());
        }
        self.check_slow(backend, device)
    }

    #[cold]
    fn check_slow(&self, backend: &BackendRef, device: i32) -> Result<()> {
        let Some((mine, my_device)) = self.binding() else { return Ok(()) };
        if !Arc::ptr_eq(mine, backend) && mine.id() != backend.id() {
            crate::device::check_same_backend(backend, mine, &format!("stream {:#x}", self.handle))?;
        }
        if my_device != device {
            return Err(Error::InvalidStream(format!(
                "stream {:#x} belongs to device {my_device}, but is used here with device {device} (the \
                 device of the resource, buffer or event it is given with): give a stream of device \
                 {device}, or a resource of device {my_device} (in Python, \
                 streampool.get_per_device_resource({my_device}))",
                self.handle
            )));
        }
        Ok(())
    }

    /// Waits on the host until all work enqueued on this stream has completed. On a stream
    /// this crate owns it is counted ([`Stream::sync_marks`]): a pool learns from it that
    /// the frees made on the stream before it have completed.
    pub fn synchronize(&self, backend: &BackendRef, device: i32) -> Result<()> {
        self.check(backend, device)?;
        if self.owner_thread().is_some() && self.is_legacy() {
            // Another thread's per-thread stream. Synchronising the legacy stream waits for
            // its own work, which need not cover the owner's: an event recorded there does
            // (it is ordered after all earlier work of the blocking streams).
            let event = Event::new(backend, device)?;
            event.record(self)?;
            return event.synchronize();
        }
        match &self.origin {
            Origin::Owned(o) => o.syncs.around(|| backend.stream_synchronize(device, self.handle)),
            _ => backend.stream_synchronize(device, self.handle()),
        }
    }

    /// A key that names this stream and no other, ever, for as long as the process lives
    /// (the driver's `cuStreamGetId`, looked up once: handle values are reused once a
    /// stream is destroyed, keys are not). For the per-thread default stream, the calling
    /// thread's; for a resolved one, its owner's on the owner's thread and the legacy
    /// stream's elsewhere (as [`Stream::handle`]). Pools key their per-stream state by it.
    #[inline]
    pub fn key(&self, backend: &BackendRef, device: i32) -> u64 {
        match &self.origin {
            Origin::Owned(o) => o.key,
            Origin::Borrowed { key, .. } => *key,
            Origin::Default => default_key(backend, device, self.handle),
            Origin::PerThreadOf(_) => default_key(backend, device, self.handle()),
        }
    }

    /// Makes all later work on this stream wait for `event`'s recorded work. The event
    /// may be of another device (`cuStreamWaitEvent` takes them); a default stream is
    /// taken as the event's device's.
    pub fn wait(&self, event: &Event) -> Result<()> {
        let device = self.device_or(event.device);
        self.check(&event.backend, device)?; // the same backend
        event.backend.stream_wait_event(device, self.handle(), event.raw)
    }

    /// Orders all later work on this stream, a stream of `device`, after the work enqueued
    /// on `on` (a stream of `on_device`, which may be another device: `cuStreamWaitEvent`
    /// takes events of other devices) so far.
    pub fn wait_for(&self, backend: &BackendRef, device: i32, on: &Stream, on_device: i32) -> Result<()> {
        self.check(backend, device)?;
        let event = Event::new(backend, on_device)?;
        event.record(on)?;
        backend.stream_wait_event(device, self.handle(), event.raw)
    }
}

/// The legacy default stream's key on every backend and device: it is one stream per
/// device, named by handle 0 everywhere, so it needs no look-up (and no thread-local
/// storage, which a call through a shared library pays a `__tls_get_addr` for). Above
/// every key the driver hands out and every fallback key.
pub const LEGACY_KEY: u64 = u64::MAX;

/// The calling thread's key of the default stream `handle`: the legacy one's, or its own
/// per-thread one.
#[inline]
fn default_key(backend: &BackendRef, device: i32, handle: RawStream) -> u64 {
    if handle == LEGACY_STREAM {
        return LEGACY_KEY;
    }
    per_thread_key(backend, device, handle)
}

fn per_thread_key(backend: &BackendRef, device: i32, handle: RawStream) -> u64 {
    DEFAULT_KEYS
        .try_with(|keys| {
            let id = backend.id();
            let mut keys = keys.borrow_mut();
            if let Some(&(.., key)) = keys.iter().find(|k| (k.0, k.1, k.2) == (id, device, handle)) {
                return key;
            }
            let key = stream_key(backend, device, handle);
            keys.push((id, device, handle, key));
            key
        })
        // A thread-local destructor that frees memory after this thread's keys went: the
        // driver names the stream again (the same key), unremembered.
        .unwrap_or_else(|_| stream_key(backend, device, handle))
}

impl Default for Stream {
    fn default() -> Self {
        Self::legacy()
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match (&self.origin, self.handle) {
            (Origin::Default, PER_THREAD_STREAM) => "per-thread default",
            (Origin::Default, _) => "legacy default",
            (Origin::PerThreadOf(owner), _) => {
                return write!(f, "Stream({:#x}, per-thread default of {owner:?})", self.handle)
            }
            (Origin::Owned(_), _) => "owned",
            (Origin::Borrowed { .. }, _) => "borrowed",
        };
        write!(f, "Stream({:#x}, {kind})", self.handle)
    }
}

/// An event (timing disabled), destroyed on drop.
pub struct Event {
    backend: BackendRef,
    device: i32,
    raw: RawEvent,
}

impl Event {
    /// `cuEventCreate` on `device` of `backend`.
    pub fn new(backend: &BackendRef, device: i32) -> Result<Self> {
        let raw = backend.event_create(device)?;
        Ok(Event { backend: backend.clone(), device, raw })
    }

    /// Captures the work enqueued on `stream` so far.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        stream.check(&self.backend, self.device)?;
        self.backend.event_record(self.device, self.raw, stream.handle())
    }

    /// True when the recorded work has completed.
    pub fn query(&self) -> Result<bool> {
        self.backend.event_query(self.device, self.raw)
    }

    /// Waits on the host for the recorded work.
    pub fn synchronize(&self) -> Result<()> {
        self.backend.event_synchronize(self.device, self.raw)
    }

    /// The raw handle.
    pub fn raw(&self) -> RawEvent {
        self.raw
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let (device, raw) = (self.device, self.raw);
        record_if_failed(
            || format!("destroying event {raw:#x} of device {device}"),
            self.backend.event_destroy(device, raw),
        );
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Event({:#x})", self.raw)
    }
}
