//! Where a long allocator call's time went: for the pipeline's calls over a threshold,
//! what the calling thread did meanwhile.
//!
//! Three sources, all Linux's; the first two are read outside the calls' timed spans, and
//! the third's signal (below) runs inside a long call, adding a few microseconds to it:
//! * the thread's context switches (`getrusage(RUSAGE_THREAD)`) before and after each
//!   call: switched out while it could run (preempted; a `sched_yield` that gave the CPU
//!   away counts here too), asleep (a voluntary switch: a lock, a condition, a driver call
//!   that blocks), or neither;
//! * the thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID`) before and after each call: a call
//!   that neither slept nor was switched out, yet whose thread's clock ran for less than
//!   half of it, lost its time to the host (a virtual machine's stolen time, which a guest
//!   kernel that accounts for it keeps out of its threads' clocks) or to interrupts;
//! * a watchdog thread that, once a call has run past the threshold, reads what the thread
//!   is doing at that moment (`/proc/self/task/TID/syscall`): running, or inside which
//!   system call (a `futex` is a lock or a condition, an `ioctl` a driver call); and, for a
//!   running thread, where: it sends the thread a signal whose handler records the
//!   interrupted instruction's address, and names the library that holds it (the CUDA
//!   driver, streampool's own code, the C library, another).
//!
//! Elsewhere than Linux every long call counts as neither, and none is sampled; the
//! running threads' addresses are read on x86-64 and AArch64 only.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::ticks_since;
use crate::clock;

/// The allocator calls longer than a threshold, by what the calling thread did during the
/// call (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LongCalls {
    /// The threshold, in nanoseconds.
    pub over_ns: u64,
    /// Calls that took longer.
    pub calls: u64,
    /// The longest of them, in nanoseconds (0: none).
    pub longest_ns: u64,
    /// Of those, the calls during which the operating system switched the thread out while
    /// it could run (an involuntary context switch: another thread had its CPU).
    pub preempted: u64,
    /// Of the others, the calls during which the thread slept (a voluntary context switch:
    /// it waited on a lock, a condition or the driver).
    pub slept: u64,
    /// Of the others, the calls whose thread's CPU clock ran for less than half the call:
    /// neither switched out nor asleep, it still did not run (the host took its virtual
    /// CPU, or interrupts took the time).
    pub stolen: u64,
    /// What the watchdog saw the thread doing once the call had run past the threshold
    /// (one look per call; a call that ended before the look was read is not counted here).
    pub sampled: Sampled,
}

/// What long calls' threads were doing when the watchdog looked (see [`LongCalls`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sampled {
    /// Running, not in a system call.
    pub running: u64,
    /// In `futex`: waiting on a lock or a condition (the pool's, the driver's, the heap's).
    pub futex: u64,
    /// In `ioctl`: inside a driver call that entered the kernel.
    pub ioctl: u64,
    /// In `sched_yield`: a spinning lock's waiter giving its time slice away.
    pub sched_yield: u64,
    /// In `nanosleep` or `clock_nanosleep`.
    pub sleep: u64,
    /// In another system call, or blocked outside one (a page fault).
    pub other: u64,
    /// Where the running ones were running (their count is `running`'s).
    pub running_in: RunningIn,
}

/// Where the watchdog found long calls' running threads: the library holding the
/// instruction the thread was at (see [`Sampled`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunningIn {
    /// In the CUDA driver (`libcuda`).
    pub driver: u64,
    /// In streampool's own code (the library or program that holds this harness).
    pub streampool: u64,
    /// In the C library or the dynamic loader (a system call's wrapper: a running thread
    /// inside the kernel is seen where it will return to).
    pub system: u64,
    /// In another library.
    pub other: u64,
    /// Not placed: the call had ended by the answer.
    pub ended: u64,
    /// Not placed: no answer within 2 ms (the thread ran inside the kernel all that time),
    /// or no reader on this platform.
    pub unanswered: u64,
}

impl RunningIn {
    fn add(&mut self, o: &RunningIn) {
        self.driver += o.driver;
        self.streampool += o.streampool;
        self.system += o.system;
        self.other += o.other;
        self.ended += o.ended;
        self.unanswered += o.unanswered;
    }

    /// Threads counted.
    pub fn total(&self) -> u64 {
        self.driver + self.streampool + self.system + self.other + self.ended + self.unanswered
    }

    /// Counts where a running thread was found: `at`, the library its instruction was in
    /// (None without an answer); `ended`: the call had ended by the answer.
    fn count(&mut self, at: Option<Place>, ended: bool) {
        *match at {
            None => &mut self.unanswered,
            Some(_) if ended => &mut self.ended,
            Some(Place::Driver) => &mut self.driver,
            Some(Place::Streampool) => &mut self.streampool,
            Some(Place::System) => &mut self.system,
            Some(Place::Other) => &mut self.other,
        } += 1;
    }
}

/// The library an instruction belongs to (see [`RunningIn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Driver,
    Streampool,
    System,
    Other,
}

/// Where thread `tid` (of this process) is running: the library of the instruction a signal
/// interrupts. None where there is no answer within 2 ms, or no reader on this platform.
#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
fn where_running(tid: i64) -> Option<Place> {
    pc::of(tid).map(pc::place)
}

#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
fn where_running(_tid: i64) -> Option<Place> {
    None
}

/// The interrupted instruction's address, by a signal to one thread at a time (only the
/// watchdog asks, from one thread).
#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
mod pc {
    use std::ffi::{c_void, CStr};
    use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    use super::Place;

    /// The thread whose address is wanted (0: none); the handler claims it by setting 0.
    static WANTED: AtomicI64 = AtomicI64::new(0);
    /// The address the handler found (0 until it answers).
    static PC: AtomicU64 = AtomicU64::new(0);

    extern "C" fn on_signal(_: libc::c_int, _: *mut libc::siginfo_t, ctx: *mut c_void) {
        // SAFETY: gettid has no preconditions and is async-signal-safe.
        let me = unsafe { libc::gettid() } as i64;
        if WANTED.compare_exchange(me, 0, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return; // a late or stray signal: nobody waits for it
        }
        // SAFETY: the kernel passes an SA_SIGINFO handler the interrupted context.
        let uc = unsafe { &*(ctx as *const libc::ucontext_t) };
        #[cfg(target_arch = "x86_64")]
        let pc = uc.uc_mcontext.gregs[libc::REG_RIP as usize] as u64;
        #[cfg(target_arch = "aarch64")]
        let pc = uc.uc_mcontext.pc;
        PC.store(pc.max(1), Ordering::Release);
    }

    /// The signal, its handler installed once per process; None where the signal already
    /// has another handler (it is left alone) or the handler cannot be installed.
    fn signal() -> Option<libc::c_int> {
        static SIGNAL: OnceLock<Option<libc::c_int>> = OnceLock::new();
        *SIGNAL.get_or_init(|| {
            // A real-time signal from the top of the range, which libraries rarely take.
            let sig = libc::SIGRTMAX() - 3;
            // SAFETY: sigaction reads and writes only the structs it is given; the handler
            // touches only atomics and async-signal-safe calls.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != libc::SIG_DFL
                {
                    return None;
                }
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                (libc::sigaction(sig, &sa, std::ptr::null_mut()) == 0).then_some(sig)
            }
        })
    }

    /// Whether `sig`'s handler is still ours: a program may have replaced it since (and a
    /// real-time signal's default action ends the process).
    fn still_ours(sig: libc::c_int) -> bool {
        // SAFETY: as in `signal`: sigaction only writes the struct it is given.
        unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut now) == 0
                && now.sa_sigaction == on_signal as *const () as usize
        }
    }

    /// The address thread `tid` is at, asked by a signal; None without an answer in 2 ms,
    /// or where the signal's handler is not (or no longer) ours.
    pub(super) fn of(tid: i64) -> Option<u64> {
        // One question at a time (two watchdogs, two pipelines run at once): the handler's
        // answer goes to one place, and a caller that withdrew late waits for it.
        static ASKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ASKING.lock().unwrap_or_else(|e| e.into_inner());
        let sig = signal().filter(|&sig| still_ours(sig))?;
        PC.store(0, Ordering::Release);
        WANTED.store(tid, Ordering::Release);
        // SAFETY: tgkill sends a signal to one thread of this process; its handler is ours.
        if unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, sig) } != 0 {
            WANTED.store(0, Ordering::Release);
            return None;
        }
        let start = Instant::now();
        // Yielding, not spinning: on a small machine the watchdog must not take the CPU the
        // thread it looks at needs to answer.
        while PC.load(Ordering::Acquire) == 0 && start.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        }
        // Withdraw the request; if the handler claimed it already, its answer is on its way.
        if WANTED.swap(0, Ordering::AcqRel) == tid {
            return None;
        }
        loop {
            match PC.load(Ordering::Acquire) {
                0 => std::thread::yield_now(),
                pc => return Some(pc),
            }
        }
    }

    /// The library that holds address `pc`.
    pub(super) fn place(pc: u64) -> Place {
        fn image(addr: *const c_void) -> Option<(*mut c_void, String)> {
            // SAFETY: all zeroes is a valid Dl_info; dladdr only fills it in.
            let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
            // SAFETY: dladdr accepts any address and only fills in the struct it is given.
            if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
                return None;
            }
            // SAFETY: the name dladdr gave is a C string that lives while its library is
            // loaded; it is copied at once.
            let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
            Some((info.dli_fbase, name.rsplit('/').next().unwrap_or("").to_owned()))
        }
        let Some((base, name)) = image(pc as *const c_void) else { return Place::Other };
        if image(place as *const c_void).is_some_and(|(own, _)| own == base) {
            Place::Streampool
        } else if name.starts_with("libcuda.") {
            Place::Driver
        } else if ["libc.", "libpthread.", "ld-linux", "linux-vdso", "linux-gate"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            Place::System
        } else {
            Place::Other
        }
    }
}

impl Sampled {
    fn add(&mut self, o: &Sampled) {
        self.running += o.running;
        self.futex += o.futex;
        self.ioctl += o.ioctl;
        self.sched_yield += o.sched_yield;
        self.sleep += o.sleep;
        self.other += o.other;
        self.running_in.add(&o.running_in);
    }

    /// Counts one look at `/proc/self/task/TID/syscall`: `running`, or the system call's
    /// number followed by its arguments, or `-1 ...` (blocked outside a system call).
    /// Returns whether the thread was running.
    fn count(&mut self, line: &str) -> bool {
        let first = line.split_whitespace().next().unwrap_or("");
        let slot = match (first, first.parse::<i64>().ok()) {
            ("running", _) => &mut self.running,
            #[cfg(target_os = "linux")]
            (_, Some(n)) if n == libc::SYS_futex => &mut self.futex,
            #[cfg(target_os = "linux")]
            (_, Some(n)) if n == libc::SYS_ioctl => &mut self.ioctl,
            #[cfg(target_os = "linux")]
            (_, Some(n)) if n == libc::SYS_sched_yield => &mut self.sched_yield,
            #[cfg(target_os = "linux")]
            (_, Some(n)) if n == libc::SYS_clock_nanosleep || n == libc::SYS_nanosleep => &mut self.sleep,
            _ => &mut self.other,
        };
        *slot += 1;
        first == "running"
    }

    /// Calls sampled.
    pub fn total(&self) -> u64 {
        self.running + self.futex + self.ioctl + self.sched_yield + self.sleep + self.other
    }
}

impl LongCalls {
    /// The calls during which the thread neither slept nor was switched out, and its CPU
    /// clock ran for half the call or more: the call's own work (a spinning wait
    /// included), or time the host took from a virtual machine whose kernel does not
    /// account for it.
    pub fn on_cpu(&self) -> u64 {
        self.calls.saturating_sub(self.preempted).saturating_sub(self.slept).saturating_sub(self.stolen)
    }

    fn add(&mut self, o: &LongCalls) {
        self.calls += o.calls;
        self.longest_ns = self.longest_ns.max(o.longest_ns);
        self.preempted += o.preempted;
        self.slept += o.slept;
        self.stolen += o.stolen;
        self.sampled.add(&o.sampled);
    }

    /// Counts one long call from its thread's readings before and after it.
    fn count(&mut self, before: &Reading, after: &Reading, wall_ns: u64) {
        self.calls += 1;
        self.longest_ns = self.longest_ns.max(wall_ns);
        if after.involuntary > before.involuntary {
            self.preempted += 1;
        } else if after.voluntary > before.voluntary {
            self.slept += 1;
        } else if let (Some(a), Some(b)) = (after.cpu_ns, before.cpu_ns) {
            if a.saturating_sub(b).saturating_mul(2) < wall_ns {
                self.stolen += 1;
            }
        }
    }
}

/// What a thread's own counters say at one moment: its context switches, voluntary and
/// involuntary, and its CPU clock (None where it cannot be read).
#[derive(Debug, Clone, Copy, Default)]
struct Reading {
    voluntary: i64,
    involuntary: i64,
    cpu_ns: Option<u64>,
}

/// The calling thread's counters now.
#[cfg(target_os = "linux")]
fn reading() -> Reading {
    // SAFETY: rusage and timespec are plain integers, for which all zeroes is valid.
    let (mut u, mut t): (libc::rusage, libc::timespec) = unsafe { std::mem::zeroed() };
    // SAFETY: both calls only write the struct they are given, which lives for the call.
    let (ru, ct) = unsafe {
        (
            libc::getrusage(libc::RUSAGE_THREAD, &mut u),
            libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t),
        )
    };
    Reading {
        voluntary: if ru == 0 { u.ru_nvcsw } else { 0 },
        involuntary: if ru == 0 { u.ru_nivcsw } else { 0 },
        cpu_ns: (ct == 0).then(|| t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64),
    }
}

#[cfg(not(target_os = "linux"))]
fn reading() -> Reading {
    Reading::default()
}

/// The calling thread's kernel id (0 where there is none to read `/proc` by).
#[cfg(target_os = "linux")]
fn thread_id() -> i64 {
    // SAFETY: gettid has no preconditions.
    (unsafe { libc::gettid() }) as i64
}

#[cfg(not(target_os = "linux"))]
fn thread_id() -> i64 {
    0
}

/// One timed thread, as the watchdog sees it.
#[derive(Default)]
struct Slot {
    tid: AtomicI64,
    /// Clock ticks at the start of the call in progress; 0 between calls.
    since: AtomicU64,
}

/// The long calls of a run: the threshold, every thread's slot, the watchdog's samples and
/// the totals.
pub(crate) struct LongCallLog {
    over_ticks: u64,
    /// The null calls' length, in clock ticks (0: none).
    null_ticks: u64,
    slots: Vec<Slot>,
    done: AtomicBool,
    totals: Mutex<LongCalls>,
    null_totals: Mutex<LongCalls>,
}

impl LongCallLog {
    /// A log for `threads` timed threads, calls over `over_ns`; with `null_ns` above 0, a
    /// null call of that length after every call (see [`CallTimer::time`]).
    pub(crate) fn new(over_ns: u64, null_ns: u64, threads: usize) -> Self {
        let ticks = |ns: u64| (ns as f64 / clock::ns_per_tick()).ceil() as u64;
        LongCallLog {
            over_ticks: ticks(over_ns).max(1),
            null_ticks: ticks(null_ns),
            slots: (0..threads).map(|_| Slot::default()).collect(),
            done: AtomicBool::new(false),
            totals: Mutex::new(LongCalls { over_ns, ..LongCalls::default() }),
            null_totals: Mutex::new(LongCalls { over_ns, ..LongCalls::default() }),
        }
    }

    /// The watchdog: until [`finish`](Self::finish), looks every 100 µs at the threads whose
    /// call has run past the threshold, once per call. Run it on a thread of its own.
    pub(crate) fn watch(&self) {
        let mut seen = vec![0u64; self.slots.len()];
        let mut sampled = Sampled::default();
        while !self.done.load(Ordering::Acquire) {
            for (slot, seen) in self.slots.iter().zip(seen.iter_mut()) {
                let since = slot.since.load(Ordering::Acquire);
                if since == 0 || since == *seen || ticks_since(since) <= self.over_ticks {
                    continue;
                }
                *seen = since;
                // The call must still run after the read: a watchdog held up between the
                // load and the clock (switched out, its virtual CPU taken) would otherwise
                // look at a thread whose call ended long ago.
                let running = || slot.since.load(Ordering::Acquire) == since;
                let tid = slot.tid.load(Ordering::Relaxed);
                let Ok(line) = std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")) else {
                    continue;
                };
                if running() && sampled.count(&line) {
                    // Where it runs; `ended` if the call has ended by the answer.
                    let at = where_running(tid);
                    sampled.running_in.count(at, !running());
                }
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        self.totals.lock().unwrap_or_else(|p| p.into_inner()).sampled.add(&sampled);
    }

    /// Stops the watchdog.
    pub(crate) fn finish(&self) {
        self.done.store(true, Ordering::Release);
    }

    /// The totals (after [`finish`](Self::finish) and the watchdog's return).
    pub(crate) fn totals(&self) -> LongCalls {
        *self.totals.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The null calls' totals (after every timer's [`CallTimer::finish`]).
    pub(crate) fn null_totals(&self) -> LongCalls {
        *self.null_totals.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs `timed` (a span that returns its result and its clock ticks) between two readings
/// of the thread's counters, and counts it in `into` when it took over `over_ticks`.
fn classified<T>(over_ticks: u64, into: &mut LongCalls, timed: impl FnOnce() -> (T, u64)) -> (T, u64) {
    let before = reading();
    let (r, ticks) = timed();
    if ticks > over_ticks {
        into.count(&before, &reading(), (ticks as f64 * clock::ns_per_tick()) as u64);
    }
    (r, ticks)
}

/// One thread's timing of its allocator calls: every call's ticks, and with a
/// [`LongCallLog`] the long calls classified (counted here, added to the log's totals,
/// which hold the threshold, at the end).
pub(crate) struct CallTimer<'a> {
    lat: Vec<u64>,
    /// The run's log, this thread's slot in it, its long calls and its long null calls.
    long: Option<(&'a LongCallLog, &'a Slot, LongCalls, LongCalls)>,
}

impl<'a> CallTimer<'a> {
    /// A timer for `calls` calls; `long`: the run's log and this thread's slot in it.
    pub(crate) fn new(calls: usize, long: Option<(&'a LongCallLog, usize)>) -> Self {
        let long = long.map(|(log, i)| {
            let slot = &log.slots[i];
            slot.tid.store(thread_id(), Ordering::Relaxed);
            (log, slot, LongCalls::default(), LongCalls::default())
        });
        // Room for the calls up front (no reallocation while timing), up to 8 MiB of them;
        // a longer run grows the list.
        CallTimer { lat: Vec::with_capacity(calls.min(1 << 20)), long }
    }

    /// Runs `call`, timed; with a log, classifies it if long, then times a null call if the
    /// log asks for them: a span of the same thread that only spins (no allocator work at
    /// all), classified the same way, so that the long calls can be read against what the
    /// machine alone gives a call of that length.
    #[inline]
    pub(crate) fn time<T>(&mut self, call: impl FnOnce() -> T) -> T {
        let Some((log, slot, long, null)) = &mut self.long else {
            let t = clock::now();
            let r = call();
            self.lat.push(ticks_since(t));
            return r;
        };
        let (r, ticks) = classified(log.over_ticks, long, || {
            let t = clock::now();
            slot.since.store(t.max(1), Ordering::Release);
            let r = call();
            let ticks = ticks_since(t);
            slot.since.store(0, Ordering::Release);
            (r, ticks)
        });
        self.lat.push(ticks);
        if log.null_ticks > 0 {
            classified(log.over_ticks, null, || {
                let t = clock::now();
                while ticks_since(t) < log.null_ticks {
                    std::hint::spin_loop();
                }
                ((), ticks_since(t))
            });
        }
        r
    }

    /// Adds this thread's long calls to the run's totals; returns its latencies.
    pub(crate) fn finish(self) -> Vec<u64> {
        if let Some((log, _, long, null)) = self.long {
            log.totals.lock().unwrap_or_else(|p| p.into_inner()).add(&long);
            log.null_totals.lock().unwrap_or_else(|p| p.into_inner()).add(&null);
        }
        self.lat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(voluntary: i64, involuntary: i64, cpu_ns: Option<u64>) -> Reading {
        Reading { voluntary, involuntary, cpu_ns }
    }

    #[test]
    fn a_long_call_is_preempted_slept_stolen_or_on_cpu_in_that_order() {
        let mut l = LongCalls::default();
        let before = at(5, 7, Some(1_000));
        l.count(&before, &at(6, 8, Some(1_000)), 1_000_000); // both switches: preempted
        l.count(&before, &at(6, 7, Some(1_000)), 1_000_000); // slept
        l.count(&before, &at(5, 7, Some(400_000)), 1_000_000); // clock ran 0.4 of it: stolen
        l.count(&before, &at(5, 7, Some(600_000)), 1_000_000); // 0.6: on the CPU
        l.count(&before, &at(5, 7, None), 1_000_000); // no clock: on the CPU
        assert_eq!((l.calls, l.preempted, l.slept, l.stolen, l.on_cpu()), (5, 1, 1, 1, 2));
        l.count(&before, &at(5, 7, None), 3_000_000);
        assert_eq!((l.calls, l.longest_ns), (6, 3_000_000));
    }

    #[test]
    fn a_look_at_a_thread_counts_its_system_call_and_says_whether_it_ran() {
        let mut s = Sampled::default();
        assert!(s.count("running"));
        assert!(!s.count("-1 0x7ffd 0x7f00"));
        assert!(!s.count(&format!("{} 0x1 0x2 0x3 0x4 0x5 0x6 0x7ffd 0x7f00", libc::SYS_futex)));
        assert_eq!(
            (s.running, s.futex, s.other),
            (1, u64::from(cfg!(target_os = "linux")), 1 + u64::from(!cfg!(target_os = "linux")))
        );
        let mut r = RunningIn::default();
        for p in [Some(Place::Driver), Some(Place::Streampool), Some(Place::System), Some(Place::Other), None]
        {
            r.count(p, false);
        }
        r.count(Some(Place::Driver), true);
        r.count(None, true);
        assert_eq!(r, RunningIn { driver: 1, streampool: 1, system: 1, other: 1, ended: 1, unanswered: 2 });
    }

    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    #[test]
    fn an_address_is_placed_in_its_library() {
        assert_eq!(
            pc::place(
                a_long_call_is_preempted_slept_stolen_or_on_cpu_in_that_order as *const () as usize as u64
            ),
            Place::Streampool
        );
        assert_eq!(pc::place(libc::getpid as *const () as usize as u64), Place::System);
        assert_eq!(pc::place(8), Place::Other);
    }

    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    #[test]
    fn the_watchdog_finds_a_spinning_thread_in_streampools_code() {
        use std::sync::atomic::AtomicBool;
        // A program that replaced the handler since is left alone: no signal is sent (its
        // handler would run; a default action would end the process).
        static HITS: AtomicU64 = AtomicU64::new(0);
        extern "C" fn theirs(_: libc::c_int) {
            HITS.fetch_add(1, Ordering::Relaxed);
        }
        let (stop, tid) = (AtomicBool::new(false), AtomicI64::new(0));
        // Everything is read before the spinning thread is stopped, and checked after (a
        // failed check inside the scope would leave it spinning, the test hung).
        let (places, replaced, swapped, hits) = std::thread::scope(|s| {
            s.spawn(|| {
                tid.store(thread_id(), Ordering::Release);
                while !stop.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
            });
            while tid.load(Ordering::Acquire) == 0 {
                std::thread::yield_now();
            }
            let tid = tid.load(Ordering::Acquire);
            let places: Vec<_> = (0..20).map(|_| where_running(tid)).collect();
            let sig = libc::SIGRTMAX() - 3;
            // A look that timed out (a loaded machine did not run the thread within 2 ms)
            // left its signal pending: let it reach our handler before swapping theirs in.
            let pending = || {
                let status =
                    std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap_or_default();
                let mask = status.lines().find_map(|l| l.strip_prefix("SigPnd:")).map(str::trim);
                mask.and_then(|m| u64::from_str_radix(m, 16).ok()).is_some_and(|m| m >> (sig - 1) & 1 == 1)
            };
            let start = std::time::Instant::now();
            while pending() && start.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(1));
            }
            // SAFETY: sigaction only reads and writes the structs it is given; the handler
            // installed touches one atomic, and ours is put back as it was.
            let (replaced, swapped) = unsafe {
                let mut ours: libc::sigaction = std::mem::zeroed();
                let mut other: libc::sigaction = std::mem::zeroed();
                other.sa_sigaction = theirs as *const () as usize;
                let swapped = libc::sigaction(sig, &other, &mut ours) == 0;
                let replaced = where_running(tid);
                std::thread::sleep(Duration::from_millis(20));
                (replaced, swapped && libc::sigaction(sig, &ours, std::ptr::null_mut()) == 0)
            };
            stop.store(true, Ordering::Release);
            (places, replaced, swapped, HITS.load(Ordering::Relaxed))
        });
        // A thread spinning in this test binary (streampool's code) is found there at least
        // once in 20 looks, however loaded the machine.
        assert!(places.contains(&Some(Place::Streampool)), "{places:?}");
        assert!(swapped);
        assert_eq!((replaced, hits), (None, 0), "a signal went to the program's handler");
    }

    /// Two watchdogs asking at once (two pipelines with `long_call_us`), of threads that do
    /// not answer in time (the signal blocked, as in a long system call): both give up
    /// after their 2 ms instead of waiting for each other's answer for ever.
    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    #[test]
    fn two_watchdogs_at_once_each_give_up() {
        use std::sync::atomic::AtomicBool;
        use std::sync::{mpsc, Arc, Barrier};
        let sig = libc::SIGRTMAX() - 3;
        let stop = Arc::new(AtomicBool::new(false));
        let (tids, tid_rx) = mpsc::channel();
        let silent: Vec<_> = (0..2)
            .map(|_| {
                let (stop, tids) = (stop.clone(), tids.clone());
                std::thread::spawn(move || {
                    // SAFETY: the set is initialised by sigemptyset before use; the mask is
                    // this thread's own.
                    unsafe {
                        let mut set: libc::sigset_t = std::mem::zeroed();
                        libc::sigemptyset(&mut set);
                        libc::sigaddset(&mut set, sig);
                        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
                    }
                    tids.send(thread_id()).unwrap();
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
            })
            .collect();
        let targets = [tid_rx.recv().unwrap(), tid_rx.recv().unwrap()];
        let barrier = Arc::new(Barrier::new(2));
        let (done, answers) = mpsc::channel();
        for tid in targets {
            let (barrier, done) = (barrier.clone(), done.clone());
            std::thread::spawn(move || {
                barrier.wait();
                done.send(where_running(tid)).unwrap();
            });
        }
        let answered = (0..2).filter(|_| answers.recv_timeout(Duration::from_secs(10)).is_ok()).count();
        stop.store(true, Ordering::Relaxed);
        for t in silent {
            t.join().unwrap();
        }
        assert_eq!(answered, 2, "a watchdog waited for ever for an answer that went to the other");
    }
}
