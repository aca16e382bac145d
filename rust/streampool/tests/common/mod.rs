//! Set-up shared by the integration tests (a module, not a test binary of its own).

// Each test binary uses some of these.
#![allow(dead_code)]

use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::device::BackendRef;
use streampool::{MemoryResource, PoolStats, Stream};

/// A simulated device of 256 MiB, and the same as a backend.
pub fn sim() -> (Arc<SimDevice>, BackendRef) {
    let sim = SimDevice::new(256 << 20);
    let backend: BackendRef = sim.clone();
    (sim, backend)
}

/// The stress tests' sizes: xorshift, the same sequence per seed.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(0x9e3779b97f4a7c15 ^ seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Log-uniform in [1 KiB, 4 MiB], as the window workload of `benches/window.rs`.
    pub fn size(&mut self) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (1024.0 * 4096f64.powf(u)) as usize
    }
}

/// A new non-blocking stream of `b`, device 0.
pub fn stream(b: &BackendRef) -> Stream {
    Stream::create(b, 0, false).unwrap()
}

/// A pool's accounting: reserved = used + free, and grown = reserved + released.
pub fn assert_accounting(s: &PoolStats) {
    assert_eq!(s.reserved_bytes, s.used_bytes + s.free_bytes, "{s:?}");
    assert_eq!(s.grown_bytes, (s.reserved_bytes as u64) + s.released_bytes, "{s:?}");
}

/// Runs everything queued on the simulated device, then checks the detector saw no race.
pub fn assert_no_races(sim: &SimDevice) {
    sim.run();
    let races = sim.races();
    assert!(races.is_empty(), "{} races, first: {}", races.len(), races[0]);
}

/// One round of the gathering tests on `s`: 4 MiB written on `s` and 256 bytes, freed in
/// that order on `s` (the first free records the event the pool asked for; the second is
/// covered by none).
pub fn write_and_free_two(sim: &SimDevice, pool: &dyn MemoryResource, s: &Stream) {
    const MIB: usize = 1 << 20;
    let p = pool.allocate(4 * MIB, s).unwrap();
    let q = pool.allocate(256, s).unwrap();
    sim.write(s.handle(), p, 4 * MIB).unwrap();
    pool.deallocate(q, 256, s).unwrap();
    pool.deallocate(p, 4 * MIB, s).unwrap();
}
