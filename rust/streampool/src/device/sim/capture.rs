//! Stream capture (CUDA graphs), as far as the simulated device models it: which calls a
//! capture forbids and what they do to it, as a 13.0 driver does in the capture mode
//! PyTorch uses by default (`CU_STREAM_CAPTURE_MODE_GLOBAL`). Work enqueued on a capturing
//! stream still runs here (there are no graphs to launch): the model is of the driver's
//! refusals, not of graph execution.
//!
//! - Asking a capturing stream's identity (`cuStreamGetId`, `cuStreamGetDevice`), querying
//!   or synchronising it: `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, and the capture is
//!   invalidated.
//! - Querying or synchronising an event last recorded in a capture:
//!   `CUDA_ERROR_CAPTURED_EVENT`, invalidated; a capturing stream waiting on an event
//!   recorded outside it: `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`, invalidated.
//! - "Potentially unsafe" calls while any stream of the device captures (global mode: from
//!   any thread): synchronous allocation and free, allocation and free on another stream, the
//!   pool's attributes, queries and synchronisations of other streams, events and the
//!   context: `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, and every capture of the device is
//!   invalidated.
//! - `cuMemAllocAsync` on the capturing stream is legal (the driver makes a graph node);
//!   `cuMemFreeAsync` on it of memory allocated before the capture is
//!   `CUDA_ERROR_INVALID_VALUE`, and the capture goes on.

use crate::device::{DevPtr, RawStream};
use crate::error::{Error, Result};

use super::State;

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
pub const UNSUPPORTED: i32 = 900;
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
pub const INVALIDATED: i32 = 901;
/// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`.
const ISOLATION: i32 = 905;
/// `CUDA_ERROR_CAPTURED_EVENT`.
const CAPTURED_EVENT: i32 = 907;

fn driver(call: &'static str, code: i32, name: &str) -> Error {
    Error::Driver { call, code, name: name.into(), context: String::new() }
}

impl State {
    pub(super) fn begin_capture(&mut self, sid: u64, handle: RawStream) -> Result<()> {
        let s = self.streams.get_mut(&sid).expect("resolved");
        if s.legacy {
            return Err(driver("cuStreamBeginCapture", UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"));
        }
        if s.capture.is_some() {
            return Err(Error::InvalidStream(format!("stream {handle:#x} is already capturing")));
        }
        s.capture = Some(false);
        Ok(())
    }

    pub(super) fn end_capture(&mut self, sid: u64, handle: RawStream) -> Result<()> {
        let s = self.streams.get_mut(&sid).expect("resolved");
        match s.capture.take() {
            None => Err(Error::InvalidStream(format!("stream {handle:#x} is not capturing"))),
            Some(true) => {
                Err(driver("cuStreamEndCapture", INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"))
            }
            Some(false) => {
                // What the capture allocated belongs to the graph now; its frees outside
                // are legal.
                Ok(())
            }
        }
    }

    pub(super) fn capturing(&self, sid: u64) -> bool {
        self.streams.get(&sid).is_some_and(|s| s.capture.is_some())
    }

    fn invalidate(&mut self, sid: u64) {
        if let Some(c) = self.streams.get_mut(&sid).and_then(|s| s.capture.as_mut()) {
            *c = true;
        }
    }

    /// A call the driver refuses on a capturing stream, invalidating its capture.
    pub(super) fn refuse_on_capturing(&mut self, sid: u64, call: &'static str) -> Result<()> {
        if !self.capturing(sid) {
            return Ok(());
        }
        self.invalidate(sid);
        Err(driver(call, UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"))
    }

    /// A potentially unsafe call, refused (and every capture of `dev` invalidated) while
    /// any stream of `dev` captures.
    pub(super) fn refuse_while_capturing(&mut self, dev: i32, call: &'static str) -> Result<()> {
        let capturing: Vec<u64> = self
            .streams
            .iter()
            .filter(|(_, s)| s.dev == dev && s.capture.is_some())
            .map(|(&id, _)| id)
            .collect();
        if capturing.is_empty() {
            return Ok(());
        }
        for sid in capturing {
            self.invalidate(sid);
        }
        Err(driver(call, UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"))
    }

    /// An event query or synchronisation: refused for an event last recorded in a capture
    /// (its capture invalidated), and as a potentially unsafe call otherwise.
    pub(super) fn check_event_use(&mut self, dev: i32, event: u64, call: &'static str) -> Result<()> {
        let captured_on = self
            .event(event)?
            .recorded
            .as_ref()
            .map(|(sid, _, _)| *sid)
            .filter(|_| self.events.get(&event).is_some_and(|e| e.captured));
        if let Some(sid) = captured_on {
            self.invalidate(sid);
            return Err(driver(call, CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT"));
        }
        self.refuse_while_capturing(dev, call)
    }

    /// A capturing stream may wait only on events recorded in its capture.
    pub(super) fn check_capture_wait(&mut self, sid: u64, event: u64) -> Result<()> {
        if !self.capturing(sid) {
            return Ok(());
        }
        let e = self.event(event)?;
        if e.recorded.is_some() && !e.captured {
            self.invalidate(sid);
            return Err(driver("cuStreamWaitEvent", ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"));
        }
        Ok(())
    }

    /// `cuMemAllocAsync` on `sid`: a graph allocation on a capturing stream, potentially
    /// unsafe on another while the device captures.
    pub(super) fn check_capture_alloc(&mut self, dev: i32, sid: u64) -> Result<bool> {
        if self.capturing(sid) {
            return Ok(true);
        }
        self.refuse_while_capturing(dev, "cuMemAllocFromPoolAsync").map(|()| false)
    }

    /// `cuMemFreeAsync` on a capturing stream takes only what a capture allocated; on
    /// another stream it is potentially unsafe while the device captures (seen on a 13.0
    /// driver: PyTorch freeing a tensor on its own stream during a global capture).
    pub(super) fn check_capture_free(&mut self, dev: i32, sid: u64, ptr: DevPtr) -> Result<()> {
        if !self.capturing(sid) {
            return self.refuse_while_capturing(dev, "cuMemFreeAsync");
        }
        if !self.captured_allocs.contains(&ptr) {
            return Err(driver(
                "cuMemFreeAsync",
                crate::error::CUDA_ERROR_INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
            ));
        }
        Ok(())
    }
}
