//! The clock of the latency measurements: the time-stamp counter on x86-64 (a few
//! nanoseconds a read, invariant on every CPU of the last decade), calibrated once against
//! `Instant` (2 ms, at the first [`ns_per_tick`]); `Instant` in nanoseconds elsewhere.
//! Cheaper than `Instant::now` (a `clock_gettime` call, 20 ns or more in a virtual
//! machine), which matters where every call is timed.

use std::sync::OnceLock;
use std::time::Instant;

static NS_PER_TICK: OnceLock<f64> = OnceLock::new();

/// The clock now, in ticks (see [`ns_per_tick`]).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn now() -> u64 {
    // SAFETY: `rdtsc` has no preconditions on x86-64.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// The clock now, in ticks (nanoseconds here).
#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub(crate) fn now() -> u64 {
    monotonic_ns()
}

/// Nanoseconds since the first call in this process, never 0 (`Instant`: no calibration,
/// for callers that read the clock rarely).
pub(crate) fn monotonic_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

/// Nanoseconds per tick of [`now`], measured once per process.
pub(crate) fn ns_per_tick() -> f64 {
    *NS_PER_TICK.get_or_init(|| {
        if cfg!(not(target_arch = "x86_64")) {
            return 1.0;
        }
        let (t0, c0) = (Instant::now(), now());
        while t0.elapsed().as_micros() < 2000 {
            std::hint::spin_loop();
        }
        let (ns, ticks) = (t0.elapsed().as_nanos() as f64, now().wrapping_sub(c0) as f64);
        if ticks > 0.0 {
            ns / ticks
        } else {
            1.0
        }
    })
}
