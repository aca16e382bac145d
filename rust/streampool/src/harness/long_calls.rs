//! Where a long allocator call's time went: for the pipeline's calls over a threshold,
//! what the calling thread did meanwhile.
//!
//! Two sources, both Linux's, both read outside the calls' timed spans:
//! * the thread's context switches (`getrusage(RUSAGE_THREAD)`) before and after each
//!   call: switched out while it could run (preempted; a `sched_yield` that gave the CPU
//!   away counts here too), asleep (a voluntary switch: a lock, a condition, a driver call
//!   that blocks), or neither;
//! * a watchdog thread that, once a call has run past the threshold, reads what the thread
//!   is doing at that moment (`/proc/self/task/TID/syscall`): running, or inside which
//!   system call (a `futex` is a lock or a condition, an `ioctl` a driver call).
//!
//! Elsewhere than Linux every long call counts as neither, and none is sampled.

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
    /// Of those, the calls during which the operating system switched the thread out while
    /// it could run (an involuntary context switch: another thread had its CPU).
    pub preempted: u64,
    /// Of the others, the calls during which the thread slept (a voluntary context switch:
    /// it waited on a lock, a condition or the driver).
    pub slept: u64,
    /// What the watchdog saw the thread doing once the call had run past the threshold
    /// (one look per call; a call that ended first is not counted here).
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
}

impl Sampled {
    fn add(&mut self, o: &Sampled) {
        self.running += o.running;
        self.futex += o.futex;
        self.ioctl += o.ioctl;
        self.sched_yield += o.sched_yield;
        self.sleep += o.sleep;
        self.other += o.other;
    }

    /// Counts one look at `/proc/self/task/TID/syscall`: `running`, or the system call's
    /// number followed by its arguments, or `-1 ...` (blocked outside a system call).
    fn count(&mut self, line: &str) {
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
    }

    /// Calls sampled.
    pub fn total(&self) -> u64 {
        self.running + self.futex + self.ioctl + self.sched_yield + self.sleep + self.other
    }
}

impl LongCalls {
    /// The calls during which the thread neither slept nor was switched out: the call's
    /// own work, or time the host took from a virtual machine (which the guest's
    /// counters do not see).
    pub fn on_cpu(&self) -> u64 {
        self.calls - self.preempted - self.slept
    }

    fn add(&mut self, o: &LongCalls) {
        self.calls += o.calls;
        self.preempted += o.preempted;
        self.slept += o.slept;
        self.sampled.add(&o.sampled);
    }
}

/// The calling thread's (voluntary, involuntary) context switches so far.
#[cfg(target_os = "linux")]
fn switches() -> (i64, i64) {
    // SAFETY: rusage is plain integers, for which all zeroes is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes the struct it is given, which lives for the call.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) } != 0 {
        return (0, 0);
    }
    (u.ru_nvcsw, u.ru_nivcsw)
}

#[cfg(not(target_os = "linux"))]
fn switches() -> (i64, i64) {
    (0, 0)
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
    slots: Vec<Slot>,
    done: AtomicBool,
    totals: Mutex<LongCalls>,
}

impl LongCallLog {
    /// A log for `threads` timed threads, calls over `over_ns`.
    pub(crate) fn new(over_ns: u64, threads: usize) -> Self {
        LongCallLog {
            over_ticks: ((over_ns as f64 / clock::ns_per_tick()) as u64).max(1),
            slots: (0..threads).map(|_| Slot::default()).collect(),
            done: AtomicBool::new(false),
            totals: Mutex::new(LongCalls { over_ns, ..LongCalls::default() }),
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
                let tid = slot.tid.load(Ordering::Relaxed);
                let path = format!("/proc/self/task/{tid}/syscall");
                // Read while the call may still run; a call that ended meanwhile still
                // counts what its thread was doing at the read.
                if let Ok(line) = std::fs::read_to_string(path) {
                    sampled.count(&line);
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
}

/// One thread's timing of its allocator calls: every call's ticks, and with a
/// [`LongCallLog`] the long calls classified (counted here, added to the log's totals,
/// which hold the threshold, at the end).
pub(crate) struct CallTimer<'a> {
    lat: Vec<u64>,
    long: Option<(&'a LongCallLog, &'a Slot, LongCalls)>,
}

impl<'a> CallTimer<'a> {
    /// A timer for `calls` calls; `long`: the run's log and this thread's slot in it.
    pub(crate) fn new(calls: usize, long: Option<(&'a LongCallLog, usize)>) -> Self {
        let long = long.map(|(log, i)| {
            let slot = &log.slots[i];
            slot.tid.store(thread_id(), Ordering::Relaxed);
            (log, slot, LongCalls::default())
        });
        CallTimer { lat: Vec::with_capacity(calls), long }
    }

    /// Runs `call`, timed.
    #[inline]
    pub(crate) fn time<T>(&mut self, call: impl FnOnce() -> T) -> T {
        let Some((log, slot, long)) = &mut self.long else {
            let t = clock::now();
            let r = call();
            self.lat.push(ticks_since(t));
            return r;
        };
        let (voluntary, involuntary) = switches();
        let t = clock::now();
        slot.since.store(t.max(1), Ordering::Release);
        let r = call();
        let ticks = ticks_since(t);
        slot.since.store(0, Ordering::Release);
        self.lat.push(ticks);
        if ticks > log.over_ticks {
            let (v, i) = switches();
            long.calls += 1;
            if i > involuntary {
                long.preempted += 1;
            } else if v > voluntary {
                long.slept += 1;
            }
        }
        r
    }

    /// Adds this thread's long calls to the run's totals; returns its latencies.
    pub(crate) fn finish(self) -> Vec<u64> {
        if let Some((log, _, long)) = self.long {
            log.totals.lock().unwrap_or_else(|p| p.into_inner()).add(&long);
        }
        self.lat
    }
}
