//! Set-up shared by the integration tests (a module, not a test binary of its own).

// Each test binary uses some of these.
#![allow(dead_code)]

use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::device::BackendRef;

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
