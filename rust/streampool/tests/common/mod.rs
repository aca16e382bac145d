//! Set-up shared by the integration tests (a module, not a test binary of its own).

use std::sync::Arc;

use streampool::device::sim::SimDevice;
use streampool::device::BackendRef;

/// A simulated device of 256 MiB, and the same as a backend.
pub fn sim() -> (Arc<SimDevice>, BackendRef) {
    let sim = SimDevice::new(256 << 20);
    let backend: BackendRef = sim.clone();
    (sim, backend)
}
