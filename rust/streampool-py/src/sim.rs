//! `_SimDevice`: the simulated device, for tests and machines without a GPU. The Python
//! package wraps it as `streampool.sim.SimulatedDevice` (a context manager).

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use streampool::device::sim::{self, SimDevice, SimGuard};
use streampool::device::{self, Backend, BackendRef, DevPtr, RawStream};

use crate::errors::{detached, sim_active_error, OrRaise};
use crate::resources::forget_backend;
use crate::streams::to_stream;
use crate::{count_arg, ptr_arg, size_arg};

/// A simulated device: host memory standing in for device memory, streams as queues that
/// run only when told, and a happens-before race detector. Pointers it hands out are host
/// addresses, useless to real GPU libraries.
#[derive(Debug)]
#[pyclass(frozen, module = "streampool._native", name = "_SimDevice")]
pub struct PySimDevice {
    sim: Arc<SimDevice>,
    guard: Mutex<Option<SimGuard>>,
}

impl PySimDevice {
    fn guard(&self) -> MutexGuard<'_, Option<SimGuard>> {
        self.guard.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn backend(&self) -> BackendRef {
        self.sim.clone()
    }

    /// The raw handle of a stream argument, checked to be a stream of this device.
    fn handle(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<RawStream> {
        self.handle_and_device(py, stream).map(|(handle, _)| handle)
    }

    /// [`Self::handle`] and the stream's device (0 for a default stream).
    fn handle_and_device(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(RawStream, i32)> {
        let backend = self.backend();
        let stream = to_stream(py, stream, || &backend)?;
        let mut dev = 0;
        if let Some((theirs, d)) = stream.binding() {
            device::check_same_backend(&backend, theirs, &format!("stream {:#x}", stream.handle()))
                .or_raise(py)?;
            dev = d;
        }
        Ok((stream.handle(), dev))
    }

    /// A simulated kernel that writes (or reads) `[ptr, ptr + nbytes)` on `stream`.
    fn kernel(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        label: Option<String>,
        writes: bool,
    ) -> PyResult<()> {
        let (stream, ptr, bytes) = (self.handle(py, stream)?, ptr_arg(ptr)?, size_arg(nbytes, "nbytes")?);
        let sim = self.sim.clone();
        detached(py, move || sim.kernel(stream, ptr, bytes, label.as_deref().unwrap_or(""), writes))
    }
}

#[pymethods]
impl PySimDevice {
    /// `capacity_bytes`: device memory of each device (None: sized from the host's
    /// available memory, at most 16 GiB); `devices`: how many, 1 to 1024.
    #[new]
    #[pyo3(signature = (capacity_bytes=None, devices=None), text_signature = "(capacity_bytes=None, devices=1)")]
    fn new(capacity_bytes: Option<&Bound<'_, PyAny>>, devices: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let capacity = match capacity_bytes.filter(|c| !c.is_none()) {
            Some(c) => size_arg(c, "capacity_bytes")?,
            None => sim::default_capacity(),
        };
        let devices = match devices {
            Some(d) => count_arg(d, "devices", 1, sim::MAX_DEVICES as u64)? as i32,
            None => 1,
        };
        Ok(PySimDevice { sim: SimDevice::with_devices(capacity, devices), guard: Mutex::new(None) })
    }

    /// Makes this device what new objects run on, until `deactivate()`. Raises
    /// SimulatedDeviceActiveError when a simulated device is already active.
    fn activate(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self.guard();
        if let Some(active) = device::active_sim() {
            let which = if active.id() == self.sim.id() { "this device" } else { "another simulated device" };
            let message = format!(
                "{} is already active ({which}); exit it before entering {}",
                active.describe(),
                self.sim.describe()
            );
            // The exception is made after the lock: making it runs Python code, during which
            // another thread may take the GIL and wait for this lock in `deactivate`.
            drop(guard);
            return Err(sim_active_error(py, message));
        }
        match self.sim.activate() {
            Ok(active) => {
                *guard = Some(active);
                Ok(())
            }
            Err(e) => {
                drop(guard);
                Err(e).or_raise(py)
            }
        }
    }

    /// Stops this device being what new objects run on, and closes it: objects made under
    /// it refuse to work from now on (their frees succeed silently). Idempotent.
    fn deactivate(&self) {
        let guard = self.guard().take();
        drop(guard);
        self.sim.deactivate();
        forget_backend(self.sim.id());
        crate::capi::live::forget(); // the memory counted went with the device
    }

    /// True while this device is the active one.
    #[getter]
    fn active(&self) -> bool {
        device::active_sim().is_some_and(|a| a.id() == self.sim.id())
    }

    /// True once deactivated.
    #[getter]
    fn closed(&self) -> bool {
        self.sim.is_closed()
    }

    /// A simulated kernel that writes `[ptr, ptr + nbytes)` on `stream`, named `label` in
    /// race reports. It runs later: at `step`, `run`, or a host synchronisation.
    #[pyo3(signature = (stream, ptr, nbytes, label=None))]
    fn write(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        label: Option<String>,
    ) -> PyResult<()> {
        self.kernel(py, stream, ptr, nbytes, label, true)
    }

    /// A simulated kernel that reads `[ptr, ptr + nbytes)` on `stream`, named `label` in
    /// race reports.
    #[pyo3(signature = (stream, ptr, nbytes, label=None))]
    fn read(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        label: Option<String>,
    ) -> PyResult<()> {
        self.kernel(py, stream, ptr, nbytes, label, false)
    }

    /// Runs the operation at the head of `stream`'s queue if it may run now; False when the
    /// queue is empty or its head waits for other work.
    fn step(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let stream = self.handle(py, stream)?;
        let sim = self.sim.clone();
        detached(py, move || sim.step(stream))
    }

    /// Begins capturing a CUDA graph on `stream` (the driver's global mode): until
    /// `end_capture`, the calls a capture forbids fail as the driver's do and invalidate it.
    fn begin_capture(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let (handle, dev) = self.handle_and_device(py, Some(stream))?;
        self.sim.begin_capture(dev, handle).or_raise(py)
    }

    /// Ends `stream`'s capture; raises (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) when a
    /// forbidden call invalidated it.
    fn end_capture(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let (handle, dev) = self.handle_and_device(py, Some(stream))?;
        self.sim.end_capture(dev, handle).or_raise(py)
    }

    /// Runs one operation that may run now, taking streams in turn; False when none can.
    fn step_any(&self, py: Python<'_>) -> bool {
        let sim = self.sim.clone();
        py.detach(move || sim.step_any())
    }

    /// Runs everything queued until no stream has work. Ctrl-C stops it between two
    /// operations (what is left stays queued).
    fn run(&self, py: Python<'_>) -> PyResult<()> {
        loop {
            let sim = self.sim.clone();
            // About 50 ms at a time, then a look for signals with the GIL held.
            let more = py.detach(move || {
                let start = std::time::Instant::now();
                while sim.step_any() {
                    if start.elapsed() > std::time::Duration::from_millis(50) {
                        return true;
                    }
                }
                false
            });
            if !more {
                return Ok(());
            }
            py.check_signals()?;
        }
    }

    /// Operations queued on all streams and not yet run.
    #[getter]
    fn pending(&self, py: Python<'_>) -> usize {
        let sim = self.sim.clone();
        py.detach(move || sim.pending())
    }

    /// Operations queued on `stream` and not yet run.
    fn queued(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
        let stream = self.handle(py, stream)?;
        let sim = self.sim.clone();
        detached(py, move || sim.queued(stream))
    }

    /// The races found so far, as sentences naming both operations.
    fn races(&self, py: Python<'_>) -> Vec<String> {
        let sim = self.sim.clone();
        py.detach(move || sim.races().iter().map(ToString::to_string).collect())
    }

    /// The races found so far as tuples:
    /// `(text, earlier, earlier_writes, later, later_writes, start, end)`.
    #[allow(clippy::type_complexity)]
    fn race_records(&self, py: Python<'_>) -> Vec<(String, String, bool, String, bool, DevPtr, DevPtr)> {
        let sim = self.sim.clone();
        py.detach(move || {
            sim.races()
                .iter()
                .map(|r| {
                    let (earlier, later) = (r.earlier.to_string(), r.later.to_string());
                    (r.to_string(), earlier, r.earlier_writes, later, r.later_writes, r.range.0, r.range.1)
                })
                .collect()
        })
    }

    /// Forgets the races found so far.
    fn clear_races(&self, py: Python<'_>) {
        let sim = self.sim.clone();
        py.detach(move || drop(sim.take_races()));
    }

    /// Races found beyond the number kept, which were not recorded.
    #[getter]
    fn races_dropped(&self, py: Python<'_>) -> usize {
        let sim = self.sim.clone();
        py.detach(move || sim.races_dropped())
    }

    /// Operations run early because too much work waited unrun (more than 65,536
    /// operations, or their clocks over two million entries, never synchronised).
    #[getter]
    fn ran_early(&self, py: Python<'_>) -> u64 {
        let sim = self.sim.clone();
        py.detach(move || sim.ran_early())
    }

    /// Device memory of each simulated device, in bytes.
    #[getter]
    fn capacity_bytes(&self) -> usize {
        self.sim.capacity()
    }

    /// Makes the device report driver `version` (e.g. 12040 for CUDA 12.4) from now on;
    /// below 13000 it has no managed pools, as such a driver has none.
    fn set_driver_version(&self, version: i32) {
        self.sim.set_driver_version(version);
    }

    /// Makes the device report (or not) concurrent managed access from now on; without it
    /// there are no managed pools.
    fn set_concurrent_managed_access(&self, enabled: bool) {
        self.sim.set_concurrent_managed_access(enabled);
    }

    /// Makes devices `a` and `b` able (or not) to reach each other's memory from now on
    /// (`cuDeviceCanAccessPeer` both ways; every pair can until told otherwise).
    #[pyo3(signature = (a, b, capable))]
    fn set_peer_capable(
        &self,
        py: Python<'_>,
        a: &Bound<'_, PyAny>,
        b: &Bound<'_, PyAny>,
        capable: bool,
    ) -> PyResult<()> {
        let (a, b) = (crate::required_device_arg(a, "a")?, crate::required_device_arg(b, "b")?);
        self.sim.set_peer_capable(a, b, capable).or_raise(py)
    }

    /// E.g. "simulated device #3 (16 GiB)".
    fn describe(&self) -> String {
        self.sim.describe()
    }

    fn __repr__(&self) -> String {
        let state = if self.active() {
            "active"
        } else if self.sim.is_closed() {
            "closed"
        } else {
            "inactive"
        };
        format!("<_SimDevice {} {state}>", self.sim.describe())
    }
}

impl Drop for PySimDevice {
    fn drop(&mut self) {
        // Collected while active (never exited): the guard's drop closes the device; its
        // resources in the current-resource registry must not keep it alive.
        if self.guard.get_mut().map(|g| g.take()).ok().flatten().is_some() {
            forget_backend(self.sim.id());
            crate::capi::live::forget(); // the memory counted went with the device
        }
    }
}
