//! Sharing a buffer with another process: the native half of `streampool.ipc` (the
//! Python module holds the handle object and the socket helpers).

use std::os::fd::{BorrowedFd, IntoRawFd};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use streampool::ipc::{export_from, IpcImportedMemoryResource};
use streampool::Error;

use crate::buffer::DeviceBuffer;
use crate::errors::{detached, OrRaise};
use crate::resources::PyMemoryResource;
use crate::{count_arg, required_device_arg, size_arg};

/// Exports `buffer`'s memory after synchronising the stream it was made on (as the buffer
/// keeps it: the per-thread default stream of the thread that made it, whichever thread
/// exports): `(fd, export_data, nbytes, device, pid)`, where the caller owns `fd`.
#[pyfunction]
pub(crate) fn _ipc_export<'py>(
    py: Python<'py>,
    buffer: &Bound<'py, DeviceBuffer>,
) -> PyResult<(i32, Bound<'py, PyBytes>, usize, i32, u32)> {
    let (alloc, bytes) = buffer.get().live_exposed()?;
    let shared = detached(py, move || export_from(&**alloc.resource(), alloc.ptr(), bytes, alloc.stream()))?;
    let data = PyBytes::new(py, &shared.data);
    Ok((shared.fd.into_raw_fd(), data, shared.bytes, shared.device, shared.pid))
}

/// The memory another process exported (`streampool.ipc.export`), imported into this
/// one: the resource behind `streampool.ipc.import_buffer`'s buffer. It hands out that one
/// buffer and cannot allocate otherwise; the buffer frees the import (`cuMemFree`) when it
/// is closed or collected, and the imported pool goes with the resource.
#[derive(Debug)]
#[pyclass(frozen, extends = PyMemoryResource, module = "streampool.ipc", name = "IpcImportedMemoryResource")]
pub struct PyIpcImportedMemoryResource {
    inner: Arc<IpcImportedMemoryResource>,
}

#[pymethods]
impl PyIpcImportedMemoryResource {
    /// Imports `nbytes` named by `export_data` (64 bytes) in the pool that `fd` names,
    /// exported by process `pid`, on `device` (default: the exporter's device ordinal as
    /// given). The descriptor stays the caller's.
    #[new]
    #[pyo3(signature = (fd, export_data, nbytes, pid, device))]
    fn new(
        py: Python<'_>,
        fd: &Bound<'_, PyAny>,
        export_data: &[u8],
        nbytes: &Bound<'_, PyAny>,
        pid: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let fd = count_arg(fd, "fd", 0, i32::MAX as u64)? as i32;
        let pid = count_arg(pid, "pid", 0, u32::MAX as u64)? as u32;
        let bytes = size_arg(nbytes, "nbytes")?;
        let device = required_device_arg(device, "device")?;
        // SAFETY: `fcntl(F_GETFD)` only asks whether the descriptor is open.
        if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
            return Err(Error::invalid(format!(
                "fd {fd} is not an open file descriptor: the handle was closed (IpcHandle.close()), or its \
                 descriptor did not come with it (send handles with streampool.ipc.send_handle, which passes \
                 it over a Unix socket)"
            )))
            .or_raise(py);
        }
        let data = export_data.to_vec();
        let mr = detached(py, move || {
            let (backend, device) = streampool::resources::bind(Some(device))?;
            // SAFETY: just checked to be open; it stays open for the call (the handle that
            // owns it is alive in the caller, `streampool.ipc.import_buffer`).
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            IpcImportedMemoryResource::import(backend, device, fd, &data, bytes, pid)
        })?;
        let inner = Arc::new(mr);
        Ok(PyMemoryResource::base(inner.clone()).add_subclass(Self { inner }))
    }

    /// The imported memory's address in this process.
    #[getter]
    fn ptr(&self) -> u64 {
        self.inner.ptr()
    }

    /// Bytes imported.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes()
    }
}
