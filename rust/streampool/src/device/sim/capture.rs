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
//! - "Potentially unsafe" calls while any stream captures (global mode: from
//!   any thread): synchronous allocation and free, allocation and free on another stream, the
//!   pool's attributes, queries and synchronisations of other streams, events and the
//!   context: `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, and every capture is
//!   invalidated.
//! - Once a capture is invalidated, allocations, frees and event records on its stream are
//!   `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` until it ends; the legacy default stream is
//!   `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` while a blocking stream of its device captures.
//! - A thread whose capture mode is relaxed (`exchange_capture_mode`) may make the
//!   potentially unsafe calls; the calls that necessarily conflict with a capture (on the
//!   capturing stream, its captured events) are refused in every mode.
//! - Not modelled: a stream that waits on an event recorded in a capture joining it (the
//!   driver's `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` at its end), `cuStreamEndCapture` from
//!   another thread, and graph memory kept apart from the pool's.
//! - `cuMemAllocAsync` on the capturing stream is legal (the driver makes a graph node);
//!   `cuMemFreeAsync` on it of memory allocated before the capture is
//!   `CUDA_ERROR_INVALID_VALUE`, and the capture goes on.

use crate::device::{DevPtr, RawStream};
use crate::error::{Error, Result};

use super::State;

thread_local! {
    /// The calling thread's capture mode is relaxed (`exchange_capture_mode`): the calls a
    /// global capture forbids are its to make.
    pub(super) static RELAXED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
pub const UNSUPPORTED: i32 = 900;
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
pub const INVALIDATED: i32 = 901;
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`.
const IMPLICIT: i32 = 906;
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

    /// A potentially unsafe call, refused (and every capture invalidated) while any stream
    /// captures: the global mode bars it from every thread, whatever the device.
    pub(super) fn refuse_while_capturing(&mut self, call: &'static str) -> Result<()> {
        if RELAXED.with(|r| r.get()) {
            return Ok(());
        }
        let capturing: Vec<u64> =
            self.streams.iter().filter(|(_, s)| s.capture.is_some()).map(|(&id, _)| id).collect();
        if capturing.is_empty() {
            return Ok(());
        }
        for sid in capturing {
            self.invalidate(sid);
        }
        Err(driver(call, UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"))
    }

    /// Work on a stream whose capture was invalidated: refused until the capture ends.
    pub(super) fn refuse_if_invalidated(&self, sid: u64, call: &'static str) -> Result<()> {
        match self.streams.get(&sid).and_then(|s| s.capture) {
            Some(true) => Err(driver(call, INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")),
            _ => Ok(()),
        }
    }

    /// The legacy default stream of `dev` while a blocking stream of `dev` captures (it would
    /// depend on the capture implicitly): `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, and those
    /// captures invalidated.
    pub(super) fn refuse_legacy_while_blocking_captures(&mut self, dev: i32) -> Result<()> {
        let blocking: Vec<u64> = self
            .streams
            .iter()
            .filter(|(_, s)| s.dev == dev && s.blocking && !s.legacy && s.capture.is_some())
            .map(|(&id, _)| id)
            .collect();
        if blocking.is_empty() {
            return Ok(());
        }
        for sid in blocking {
            self.invalidate(sid);
        }
        Err(driver("the legacy default stream", IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"))
    }

    /// An event query or synchronisation: refused for an event last recorded in a capture
    /// (its capture invalidated), and as a potentially unsafe call otherwise.
    pub(super) fn check_event_use(&mut self, event: u64, call: &'static str) -> Result<()> {
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
        self.refuse_while_capturing(call)
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
    pub(super) fn check_capture_alloc(&mut self, sid: u64) -> Result<bool> {
        self.refuse_if_invalidated(sid, "cuMemAllocFromPoolAsync")?;
        if self.capturing(sid) {
            return Ok(true);
        }
        self.refuse_while_capturing("cuMemAllocFromPoolAsync").map(|()| false)
    }

    /// `cuMemFreeAsync` on a capturing stream takes only what a capture allocated; on
    /// another stream it is potentially unsafe while the device captures (seen on a 13.0
    /// driver: PyTorch freeing a tensor on its own stream during a global capture).
    pub(super) fn check_capture_free(&mut self, sid: u64, ptr: DevPtr) -> Result<()> {
        self.refuse_if_invalidated(sid, "cuMemFreeAsync")?;
        if !self.capturing(sid) {
            return self.refuse_while_capturing("cuMemFreeAsync");
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
