//! The harness's native parts: the fill, check and compute kernels
//! (`streampool.kernels`), the log replayer and the producer/consumer pipeline.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict};
use streampool::device::{self, BackendKind, BackendRef, DevPtr};
use streampool::harness::pipeline::PipelineOptions;
use streampool::harness::{self as core, Percentiles};
use streampool::resource::ResourceRef;
use streampool::{kernels, Error, Stream};

use crate::errors::{detached, OrRaise};
use crate::resources::PyMemoryResource;
use crate::streams::to_stream;
use crate::{count_arg, device_arg, ptr_arg, size_arg};

/// The backend and device that a kernel on `stream` runs on: the stream's own, or for a
/// default stream the current backend's current device (or `device`). A `device` other
/// than a stream's own is refused.
fn kernel_target(
    py: Python<'_>,
    stream: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<(BackendRef, i32, Stream)> {
    let device = device_arg(device, "device")?;
    let backend = match device::backend_ready() {
        Some(b) => b,
        None => detached(py, device::backend)?,
    };
    let stream = to_stream(py, stream, || &backend)?.into_owned();
    if let Some((b, d)) = stream.binding() {
        return match device {
            Some(given) if given != d => Err(Error::InvalidStream(format!(
                "stream {:#x} belongs to device {d}, but device={given} was given (leave device out: a \
                 kernel runs on its stream's device)",
                stream.handle()
            )))
            .or_raise(py),
            _ => Ok((b.clone(), d, stream)),
        };
    }
    let dev = {
        let b = backend.clone();
        detached(py, move || streampool::resources::check_device(&b, device))?
    };
    Ok((backend, dev, stream))
}

/// The address, size and seed of a fill or a check, each checked and named when wrong.
fn pattern_args(
    ptr: &Bound<'_, PyAny>,
    size: &Bound<'_, PyAny>,
    seed: &Bound<'_, PyAny>,
) -> PyResult<(DevPtr, usize, u64)> {
    Ok((ptr_arg(ptr)?, size_arg(size, "size")?, count_arg(seed, "seed", 0, u64::MAX)?))
}

/// Enqueues on `stream` a kernel that fills `size` bytes at `ptr` with the pattern of
/// `seed` (word i is a hash of (seed, i)). See `streampool.kernels.fill`.
#[pyfunction]
#[pyo3(signature = (ptr, size, seed, stream=None, device=None))]
pub(crate) fn _kernel_fill(
    py: Python<'_>,
    ptr: &Bound<'_, PyAny>,
    size: &Bound<'_, PyAny>,
    seed: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let (ptr, size, seed) = pattern_args(ptr, size, seed)?;
    let (b, dev, s) = kernel_target(py, stream, device)?;
    // SAFETY: Python has no unsafe: `streampool.kernels` documents that `ptr` must be
    // device memory the caller owns (as a raw CuPy kernel's arguments must); the
    // simulated device checks it, and the driver faults the context on a bad address.
    detached(py, move || unsafe { kernels::fill(&b, dev, ptr, size, seed, &s) })
}

/// Checks `size` bytes at `ptr` against the pattern of `seed` on `stream`, synchronises
/// the stream, and returns the number of 8-byte words that differ.
#[pyfunction]
#[pyo3(signature = (ptr, size, seed, stream=None, device=None))]
pub(crate) fn _kernel_check(
    py: Python<'_>,
    ptr: &Bound<'_, PyAny>,
    size: &Bound<'_, PyAny>,
    seed: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let (ptr, size, seed) = pattern_args(ptr, size, seed)?;
    let (b, dev, s) = kernel_target(py, stream, device)?;
    // SAFETY: as for `_kernel_fill`.
    detached(py, move || unsafe { kernels::check(&b, dev, ptr, size, seed, &s) })
}

/// Enqueues on `stream` a read-modify-write kernel of `iterations` passes over `size`
/// bytes at `ptr` that leaves the data as it was.
#[pyfunction]
#[pyo3(signature = (ptr, size, iterations, stream=None, device=None))]
pub(crate) fn _kernel_compute(
    py: Python<'_>,
    ptr: &Bound<'_, PyAny>,
    size: &Bound<'_, PyAny>,
    iterations: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let (ptr, size): (DevPtr, usize) = (ptr_arg(ptr)?, size_arg(size, "size")?);
    let iterations = count_arg(iterations, "iterations", 0, u32::MAX as u64)? as u32;
    let (b, dev, s) = kernel_target(py, stream, device)?;
    // SAFETY: as for `_kernel_fill`.
    detached(py, move || unsafe { kernels::compute(&b, dev, ptr, size, &s, iterations) })
}

/// Runs `work` on a thread of its own, with the GIL released, while this thread looks
/// for signals every 50 ms: on Ctrl-C (a KeyboardInterrupt, or any exception a signal
/// handler raises) `work`'s stop flag is set, it is waited for, and the exception raised.
/// A panic in `work` is resumed here (pyo3 raises it as PanicException).
fn interruptible<T, F>(py: Python<'_>, work: F) -> PyResult<T>
where
    T: Send,
    F: Send + FnOnce(&AtomicBool) -> streampool::Result<T>,
{
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let stop = &stop;
        let worker = scope.spawn(move || {
            let _ = tx.send(work(stop));
        });
        let mut rx = Some(rx);
        loop {
            let waiting = rx.take().expect("the receiver is put back after each wait");
            let (got, waiting) =
                py.detach(move || (waiting.recv_timeout(Duration::from_millis(50)), waiting));
            rx = Some(waiting);
            match got {
                Ok(result) => return result.or_raise(py),
                Err(RecvTimeoutError::Timeout) => {
                    if let Err(e) = py.check_signals() {
                        stop.store(true, Ordering::Relaxed);
                        let _ = py.detach(|| worker.join());
                        return Err(e);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => match py.detach(|| worker.join()) {
                    Err(payload) => std::panic::resume_unwind(payload),
                    Ok(()) => unreachable!("the worker sends its result before it ends"),
                },
            }
        }
    })
}

fn percentiles<'py>(py: Python<'py>, p: &Percentiles) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", p.count)?;
    d.set_item("p50", p.p50)?;
    d.set_item("p90", p.p90)?;
    d.set_item("p99", p.p99)?;
    d.set_item("p999", p.p999)?;
    d.set_item("max", p.max)?;
    Ok(d)
}

/// The keys every harness report shares: the resource's name and the backend's words.
fn report_base<'py>(py: Python<'py>, mr: &ResourceRef) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("resource", mr.name())?;
    d.set_item("device", mr.backend().describe())?;
    d.set_item("simulated", mr.backend().kind() == BackendKind::Simulated)?;
    Ok(d)
}

/// Sets the keys that the replayer's and the pipeline's reports share (their fields have
/// the same names and meanings).
macro_rules! set_shared {
    ($d:expr, $py:expr, $r:expr) => {{
        $d.set_item("seconds", $r.seconds)?;
        $d.set_item("alloc_seconds", $r.alloc_seconds)?;
        $d.set_item("allocate_ns", percentiles($py, &$r.allocate)?)?;
        $d.set_item("free_ns", percentiles($py, &$r.free)?)?;
        $d.set_item("peak_live_bytes", $r.peak_live_bytes)?;
        $d.set_item("peak_reserved_bytes", $r.peak_reserved_bytes)?;
        $d.set_item("synchronizations", $r.synchronizations)?;
        $d.set_item("waits", $r.waits)?;
    }};
}

/// [`core::replay::DEFAULT_MAX_LEAD_NS`] in seconds, `replay`'s default `max_lead` (its
/// text signature says 0.001: a test holds them equal).
const MAX_LEAD_S: f64 = core::replay::DEFAULT_MAX_LEAD_NS as f64 * 1e-9;

/// Replays a log of packed 40-byte records (`struct.Struct("<QQQIIB7x")`: t_ns, size,
/// alloc_id, thread, stream, op with 0 = allocate and 1 = free) on `resource`: one native
/// thread per recorded thread, one stream per recorded stream, the recorded gaps scaled
/// by `gap_scale` (0: as fast as possible), no thread more than `max_lead` seconds of
/// recorded time ahead of another (None: no bound). Returns the measurements as a dict.
///
/// Example::
///
///     import struct, streampool
///     rec = struct.Struct("<QQQIIB7x")
///     log = rec.pack(0, 1024, 1, 0, 0, 0) + rec.pack(5000, 1024, 1, 0, 0, 1)
///     report = streampool._native.replay(streampool.mr.CudaAsyncMemoryResource(), log, gap_scale=0)
///     print(report["allocate_ns"]["p50"])
#[pyfunction]
#[pyo3(
    signature = (resource, records, *, gap_scale = 1.0, max_lead = Some(MAX_LEAD_S)),
    text_signature = "(resource, records, *, gap_scale=1.0, max_lead=0.001)"
)]
pub(crate) fn replay<'py>(
    py: Python<'py>,
    resource: &Bound<'py, PyMemoryResource>,
    records: &[u8],
    gap_scale: f64,
    max_lead: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    let max_lead_ns = match max_lead {
        None => None,
        Some(s) if s.is_infinite() && s > 0.0 => None,
        Some(s) if s >= 0.0 => Some((s * 1e9).round() as u64), // saturates
        Some(s) => {
            return Err(PyValueError::new_err(format!(
                "max_lead must be a number of seconds >= 0 (or None: no bound), got {s}"
            )))
        }
    };
    let mr = resource.get().inner.clone();
    let records = core::replay::parse(records).or_raise(py)?;
    let options = core::replay::ReplayOptions { gap_scale, max_lead_ns };
    let r = interruptible(py, |stop| core::replay::replay_until(&*mr, &records, options, stop))?;
    let d = report_base(py, &mr)?;
    d.set_item("events", r.events)?;
    d.set_item("threads", r.threads)?;
    d.set_item("streams", r.streams)?;
    set_shared!(d, py, r);
    d.set_item("oom_events", r.oom_events)?;
    Ok(d)
}

/// The producer/consumer pipeline across streams, driven from native threads (see
/// `streampool._native.pipeline` in the stubs). Returns the measurements as a dict.
///
/// Example::
///
///     pool = streampool.mr.ShardedPoolMemoryResource(streampool.mr.CudaAsyncMemoryResource())
///     report = streampool._native.pipeline(pool, pairs=2, chunks_per_pair=100, kernel_us=0)
///     print(report["mismatches"])  # 0
#[pyfunction]
// The counts are taken as objects (None: the default shown) so that each is checked and
// named by the binding's one count conversion.
#[pyo3(
    signature = (resource, *, pairs = None, chunk_bytes = None, chunks_per_pair = None, kernel_us = 20.0, queue_depth = None, check_every = None, long_call_us = 0.0, null_call_us = 0.0),
    text_signature = "(resource, *, pairs=1, chunk_bytes=None, chunks_per_pair=1000, kernel_us=20.0, queue_depth=4, check_every=1, long_call_us=0.0, null_call_us=0.0)"
)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn pipeline<'py>(
    py: Python<'py>,
    resource: &Bound<'py, PyMemoryResource>,
    pairs: Option<&Bound<'py, PyAny>>,
    chunk_bytes: Option<&Bound<'py, PyAny>>,
    chunks_per_pair: Option<&Bound<'py, PyAny>>,
    kernel_us: f64,
    queue_depth: Option<&Bound<'py, PyAny>>,
    check_every: Option<&Bound<'py, PyAny>>,
    long_call_us: f64,
    null_call_us: f64,
) -> PyResult<Bound<'py, PyDict>> {
    for (name, us) in [("long_call_us", long_call_us), ("null_call_us", null_call_us)] {
        if !(us >= 0.0 && us.is_finite()) {
            return Err(PyValueError::new_err(format!(
                "pipeline: {name} must be a finite number >= 0 (0: off), not {us}"
            )));
        }
    }
    // In the caller's terms (µs), before the options in ns are checked.
    if null_call_us > 0.0 && long_call_us == 0.0 {
        return Err(PyValueError::new_err(
            "pipeline: null_call_us needs long_call_us (the null calls are counted against it)",
        ));
    }
    if null_call_us > 100.0 {
        return Err(PyValueError::new_err(format!(
            "pipeline: null_call_us must be at most 100 (0.1 ms), not {null_call_us}"
        )));
    }
    let count = |obj: Option<&Bound<'py, PyAny>>, what: &str, default: usize, min: u64, max: usize| {
        obj.filter(|o| !o.is_none())
            .map_or(Ok(default), |o| count_arg(o, what, min, max as u64).map(|n| n as usize))
    };
    let pairs = count(pairs, "pairs", 1, 1, core::pipeline::MAX_PAIRS)?;
    let chunks_per_pair =
        count(chunks_per_pair, "chunks_per_pair", 1000, 0, core::pipeline::MAX_CHUNKS_PER_PAIR)?;
    let queue_depth = count(queue_depth, "queue_depth", 4, 1, core::pipeline::MAX_QUEUE_DEPTH)?;
    let check_every = count(check_every, "check_every", 1, 0, usize::MAX)?;
    let mr = resource.get().inner.clone();
    let o = PipelineOptions {
        pairs,
        chunk_bytes: match chunk_bytes {
            Some(c) => size_arg(c, "chunk_bytes")?,
            None => 1 << 20,
        },
        chunks_per_pair,
        kernel_us,
        queue_depth,
        check_every,
        long_call_ns: (long_call_us * 1e3).round() as u64,
        null_call_ns: (null_call_us * 1e3).round() as u64,
    };
    let r = {
        let mr = mr.clone();
        interruptible(py, |stop| core::pipeline::pipeline_until(&*mr, &o, stop))?
    };
    let d = report_base(py, &mr)?;
    d.set_item("pairs", o.pairs)?;
    d.set_item("chunk_bytes", o.chunk_bytes)?;
    d.set_item("chunks", r.chunks)?;
    set_shared!(d, py, r);
    d.set_item("chunks_per_second", r.chunks_per_second)?;
    d.set_item("alloc_share", r.alloc_share)?;
    d.set_item("longest_call_ns", r.longest_call_ns)?;
    let calls = match r.driver_calls {
        Some(c) => {
            let calls = PyDict::new(py);
            calls.set_item("event_records", c.event_records)?;
            calls.set_item("event_queries", c.event_queries)?;
            calls.set_item("stream_waits", c.stream_waits)?;
            calls.set_item("synchronizations", c.synchronizations)?;
            calls.set_item("growths", c.growths)?;
            calls.set_item("total", c.total())?;
            Some(calls)
        }
        None => None,
    };
    d.set_item("driver_calls", calls)?;
    d.set_item("driver_calls_per_chunk", r.driver_calls_per_chunk())?;
    d.set_item("checked", r.checked)?;
    d.set_item("mismatches", r.mismatches)?;
    d.set_item("compute_iterations", r.compute_iterations)?;
    if let Some(l) = r.long_calls {
        let long = long_call_classes(py, &l)?;
        let x = l.sampled;
        let sampled = [
            ("running", x.running),
            ("futex", x.futex),
            ("ioctl", x.ioctl),
            ("sched_yield", x.sched_yield),
            ("sleep", x.sleep),
            ("other", x.other),
        ];
        long.set_item("sampled", sampled.into_py_dict(py)?)?;
        let x = l.sampled.running_in;
        let running_in = [
            ("driver", x.driver),
            ("streampool", x.streampool),
            ("system", x.system),
            ("other", x.other),
            ("ended", x.ended),
            ("unanswered", x.unanswered),
        ];
        long.set_item("running_in", running_in.into_py_dict(py)?)?;
        d.set_item("long_calls", long)?;
    }
    if let Some(l) = r.null_calls {
        d.set_item("null_calls", long_call_classes(py, &l)?)?;
    }
    Ok(d)
}

/// The classes of long calls (`_LongCalls` without what the watchdog saw).
fn long_call_classes<'py>(py: Python<'py>, l: &core::pipeline::LongCalls) -> PyResult<Bound<'py, PyDict>> {
    let long = PyDict::new(py);
    long.set_item("over_ns", l.over_ns)?;
    long.set_item("calls", l.calls)?;
    long.set_item("longest_ns", l.longest_ns)?;
    long.set_item("preempted", l.preempted)?;
    long.set_item("slept", l.slept)?;
    long.set_item("stolen", l.stolen)?;
    long.set_item("on_cpu", l.on_cpu())?;
    Ok(long)
}

/// For benchmarks only: a resource that hands out no memory. Every allocation gets a
/// distinct address that must never be used (nothing is behind it), and frees do nothing;
/// it measures what a workload costs around the allocator (the replayer's own time per
/// event, for one).
#[derive(Debug)]
#[pyclass(frozen, extends = PyMemoryResource, module = "streampool._native", name = "_NullMemoryResource")]
pub struct PyNullMemoryResource;

#[pymethods]
impl PyNullMemoryResource {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(py: Python<'_>, device: Option<i32>) -> PyResult<PyClassInitializer<Self>> {
        let mr = detached(py, move || core::NullMemoryResource::new(device))?;
        Ok(PyMemoryResource::base(std::sync::Arc::new(mr)).add_subclass(Self))
    }
}
