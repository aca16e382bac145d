//! `streampool.mr.ShardedPoolMemoryResource` (and `PoolMemoryResource`, RMM's name for it),
//! and `ArenaMemoryResource`, RMM's arena interface over it.

use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::PyTraverseError;
use streampool::device::{BackendRef, DevPtr};
use streampool::{MemoryKind, MemoryResource, PoolOptions, ShardedPoolMemoryResource, Stream};

use crate::adaptors::{init, upstream_ref, PyUpstreamResourceAdaptor, Upstream};
use crate::errors::detached;
use crate::resources::{PyCudaAsyncMemoryResource, PyMemoryResource};
use crate::{count_arg, size_arg};

/// The smallest `maximum_pool_size`: the pool's 256-byte granularity (it rounds sizes up to
/// multiples of it, the maximum too); the pool refuses a smaller maximum, and so does the
/// binding, naming the argument.
const MIN_MAXIMUM_POOL_SIZE: usize = streampool::ALIGNMENT;

/// The lock-sharded stream-ordered pool: suballocates memory from `upstream_mr` with one
/// shard of free blocks per stream, so that threads on different streams do not wait for
/// one another (RMM's `PoolMemoryResource`, without its one lock).
///
/// `initial_pool_size=None` reserves nothing up front (the pool grows on demand);
/// `maximum_pool_size=None` means no limit but the upstream's. Sizes take ints or
/// strings such as "4GiB" and are rounded to 256 bytes. `release_threshold`: free bytes
/// the pool may keep before it gives whole free chunks back after a synchronisation.
/// `events_every`: a stream records an event after this many frees, so that other streams
/// can reuse what it freed. `event_batch` (default 1): the fewest frees one event covers
/// when another stream asks for this stream's memory; more means fewer driver calls per
/// block handed between streams (a pipeline's allocator time) for more memory held.
/// `headroom`: the footprint budget, free memory the pool may
/// hold beyond the peak live bytes as a fraction of them (at least 2 MiB) before it reuses
/// another stream's memory by waiting rather than growing; `None` grows whenever no
/// completed block fits, unless streams that have ended left that much free (gathered
/// first). `gather_interval` (seconds, default 100 µs): at the budget the
/// pool gathers free memory with a device synchronisation, which stops every thread short
/// of memory meanwhile; within this long of the last gathering it grows instead, up to
/// four times the budget's allowance (the peak live bytes plus the headroom). 0 keeps the least memory, larger values the most speed.
/// `expandable=True` grows in place: the pool reserves one range of addresses and maps
/// device memory at its end (the driver's virtual memory calls), so that new memory joins
/// the free block before it and the pool holds less for the same live bytes (like
/// PyTorch's `expandable_segments`); the upstream must then be `CudaMemoryResource` or
/// `CudaAsyncMemoryResource`, and serves only what the range cannot.
/// `steal_whole_blocks=True`: a stream short of memory that takes another stream's
/// completed free block takes all of it, not only what it asked for, so that memory moves
/// between streams whole; on many threads the pool then holds much less, at about half the
/// allocation speed (benchmarks/RESULTS.md). `one_heap=True`: no shards; every free
/// merges at once into one heap for every stream, and a stream handed memory that
/// another stream freed waits on that free's event, as the driver's pool orders reuse:
/// with `expandable=True`, the least memory on many threads, at a fraction of the
/// default's speed (benchmarks/RESULTS.md); `release_threshold` and `steal_whole_blocks`
/// do not apply to it (ValueError). The policy and its reasons: the pool's
/// IMPLEMENTATION.md.
///
/// Example::
///
///     pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), maximum_pool_size="8GiB")
///     streampool.set_current_device_resource(pool)
///     compact = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), expandable=True)
///     lean = mr.ShardedPoolMemoryResource(
///         mr.CudaAsyncMemoryResource(), expandable=True, steal_whole_blocks=True, gather_interval=0
///     )
///     leanest = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), expandable=True, one_heap=True)
#[derive(Debug)]
#[pyclass(frozen, subclass, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "ShardedPoolMemoryResource")]
pub struct PyShardedPool {
    inner: Arc<ShardedPoolMemoryResource>,
    upstream: Upstream,
}

fn optional_size(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<usize>> {
    obj.filter(|o| !o.is_none()).map(|o| size_arg(o, what)).transpose()
}

/// A number for one of the pool's float options (`what`): an int or a float, not a bool
/// (a flag passed in its place); TypeError naming the option otherwise.
fn number_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!("{what} must be a number, not a bool ({obj})")));
    }
    obj.extract::<f64>().map_err(|_| {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        PyTypeError::new_err(format!("{what} must be a number, not {ty}"))
    })
}

fn headroom_arg(obj: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    if obj.is_none() {
        return Ok(None);
    }
    number_arg(obj, "headroom").map(Some)
}

fn gather_interval_arg(obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    number_arg(obj, "gather_interval")
}

#[pymethods]
impl PyShardedPool {
    #[new]
    #[pyo3(
        signature = (upstream_mr, initial_pool_size=None, maximum_pool_size=None, release_threshold=None, events_every=None, headroom=PoolOptions::default().headroom, gather_interval=PoolOptions::default().gather_interval.as_secs_f64(), event_batch=None, expandable=false, steal_whole_blocks=false, one_heap=false),
        text_signature = "(upstream_mr, initial_pool_size=None, maximum_pool_size=None, release_threshold=None, events_every=64, headroom=0.15, gather_interval=0.0001, event_batch=1, expandable=False, steal_whole_blocks=False, one_heap=False)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        upstream_mr: &Bound<'_, PyMemoryResource>,
        initial_pool_size: Option<&Bound<'_, PyAny>>,
        maximum_pool_size: Option<&Bound<'_, PyAny>>,
        release_threshold: Option<&Bound<'_, PyAny>>,
        events_every: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = headroom_arg)] headroom: Option<f64>,
        #[pyo3(from_py_with = gather_interval_arg)] gather_interval: f64,
        event_batch: Option<&Bound<'_, PyAny>>,
        expandable: bool,
        steal_whole_blocks: bool,
        one_heap: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        // Negative, non-finite and too long for a `Duration` (over about 584 billion years).
        let gather_interval = std::time::Duration::try_from_secs_f64(gather_interval).map_err(|_| {
            PyValueError::new_err(format!(
                "gather_interval must be a finite number of seconds >= 0 (0: gather at every shortage), \
                 got {gather_interval}"
            ))
        })?;
        let maximum_pool_size = optional_size(maximum_pool_size, "maximum_pool_size")?;
        if let Some(max) = maximum_pool_size.filter(|&m| m < MIN_MAXIMUM_POOL_SIZE) {
            return Err(PyValueError::new_err(format!(
                "maximum_pool_size must be at least {MIN_MAXIMUM_POOL_SIZE} bytes (the pool's granularity; \
                 it is rounded up to a multiple of it), got {max}"
            )));
        }
        let options = PoolOptions {
            initial_pool_size: optional_size(initial_pool_size, "initial_pool_size")?,
            maximum_pool_size,
            release_threshold: optional_size(release_threshold, "release_threshold")?,
            events_every: match events_every {
                Some(n) => count_arg(n, "events_every", 1, usize::MAX as u64)? as usize,
                None => PoolOptions::default().events_every,
            },
            event_batch: match event_batch {
                Some(n) => count_arg(n, "event_batch", 1, usize::MAX as u64)? as usize,
                None => PoolOptions::default().event_batch,
            },
            headroom,
            gather_interval,
            expandable,
            steal_whole_blocks,
            one_heap,
        };
        let upstream = upstream_ref(upstream_mr);
        let inner =
            Arc::new(detached(upstream_mr.py(), move || ShardedPoolMemoryResource::new(upstream, options))?);
        Ok(init(inner.clone(), upstream_mr, |upstream| Self { inner, upstream }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.upstream.clear();
    }

    /// Bytes the pool holds from its upstream (RMM's `pool_size()`).
    fn pool_size(&self) -> usize {
        self.inner.stats().reserved_bytes
    }

    /// What the pool holds and how often each step of its policy ran: reserved_bytes,
    /// peak_reserved_bytes, used_bytes, free_bytes, common_free_bytes, shard_free_bytes
    /// ({stream key: bytes}), retired_shards, grown_bytes, released_bytes,
    /// upstream_growths, completed_steals, cross_stream_waits, synchronizations,
    /// events_recorded, event_queries.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner)
    }

    /// Gives back to the upstream every chunk that holds no live allocation: synchronises the device,
    /// gathers every free block and returns every entirely free chunk; returns the bytes
    /// released. Over the device's default pool (`CudaAsyncMemoryResource()`), which keeps
    /// what is freed into it, warns how much that pool still holds: its `trim_to(0)` hands
    /// it to the system.
    ///
    /// Example::
    ///
    ///     pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource())
    ///     pool.deallocate(pool.allocate(1 << 20), 1 << 20)
    ///     pool.release()
    ///     pool.upstream.trim_to(0)   # and the device's pool gives it to the system
    fn release(slf: &Bound<'_, Self>) -> PyResult<usize> {
        release_and_warn(slf.as_any(), slf.get().inner.clone(), "ShardedPoolMemoryResource")
    }
}

/// The pool's statistics as a dict (`stats` of the pool and the arena).
fn stats_dict<'py>(py: Python<'py>, pool: &ShardedPoolMemoryResource) -> PyResult<Bound<'py, PyDict>> {
    let s = pool.stats();
    let d = PyDict::new(py);
    d.set_item("reserved_bytes", s.reserved_bytes)?;
    d.set_item("peak_reserved_bytes", s.peak_reserved_bytes)?;
    d.set_item("used_bytes", s.used_bytes)?;
    d.set_item("free_bytes", s.free_bytes)?;
    d.set_item("common_free_bytes", s.common_free_bytes)?;
    let shards = PyDict::new(py);
    for (key, bytes) in s.shard_free_bytes {
        shards.set_item(key, bytes)?;
    }
    d.set_item("shard_free_bytes", shards)?;
    d.set_item("retired_shards", s.retired_shards)?;
    d.set_item("grown_bytes", s.grown_bytes)?;
    d.set_item("released_bytes", s.released_bytes)?;
    d.set_item("upstream_growths", s.upstream_growths)?;
    d.set_item("completed_steals", s.completed_steals)?;
    d.set_item("cross_stream_waits", s.cross_stream_waits)?;
    d.set_item("synchronizations", s.synchronizations)?;
    d.set_item("events_recorded", s.events_recorded)?;
    d.set_item("event_queries", s.event_queries)?;
    Ok(d)
}

/// `release()` of the pool or the arena (`slf`, whose `upstream` is the pool's): over the
/// device's default pool, which keeps what is freed into it, warns how much that pool
/// still holds.
fn release_and_warn(
    slf: &Bound<'_, PyAny>,
    pool: Arc<ShardedPoolMemoryResource>,
    name: &str,
) -> PyResult<usize> {
    let py = slf.py();
    let released = detached(py, move || pool.release())?;
    let upstream = slf.getattr("upstream")?;
    if upstream.is_instance_of::<PyCudaAsyncMemoryResource>()
        && !upstream.getattr("owns_pool")?.extract::<bool>()?
    {
        let held: usize = upstream.getattr("reserved_bytes")?.extract()?;
        let used: usize = upstream.getattr("used_bytes")?.extract()?;
        // What `trim_to(0)` can hand back: the pool's free memory, not what is in use (this
        // pool's live chunks, or other libraries' memory).
        let free = held.saturating_sub(used);
        if free > 0 {
            let msg = format!(
                "{name}.release() gave {released} bytes back to the device's default pool, which keeps {free} \
                 bytes free of the {held} it holds (its release threshold is the maximum, so it keeps freed \
                 memory for reuse); call upstream.trim_to(0) to hand those to the system"
            );
            let msg = std::ffi::CString::new(msg).expect("no NUL in the message");
            PyErr::warn(py, &py.get_type::<pyo3::exceptions::PyUserWarning>(), &msg, 1)?;
        }
    }
    Ok(released)
}

// ---------------------------------------------------------------------------------------
// The arena.

/// The arena's resource: the pool, named as the arena in its errors, and with
/// `dump_log_on_failure` its state written to the `streampool` logger (Python `logging`,
/// level ERROR) on every failed allocation before the error goes on. No lock is held while
/// the logger runs.
#[derive(Debug)]
struct Arena {
    pool: Arc<ShardedPoolMemoryResource>,
    dump: bool,
}

impl Arena {
    fn failed(&self, bytes: usize, e: streampool::Error) -> streampool::Error {
        let e = match e {
            streampool::Error::OutOfMemory { requested, available, resource } => {
                // The pool's maximum is the arena's size: named as the arena's caller gave it.
                let resource =
                    resource.replace("maximum_pool_size", "arena_size").replace("the maximum", "arena_size");
                streampool::Error::OutOfMemory {
                    requested,
                    available,
                    resource: format!("ArenaMemoryResource, a {resource}"),
                }
            }
            other => other,
        };
        if self.dump && e.is_out_of_memory() {
            let text = format!(
                "ArenaMemoryResource: allocating {bytes} bytes failed ({e}); the arena: {:?}",
                self.pool.stats()
            );
            // At interpreter shutdown there is no logger to write to: the error still goes on.
            crate::gil::try_attach(|py| {
                // A failing logger leaves the error to go on; Ctrl-C is not lost with it.
                if let Err(e) = crate::log_record(py, 40, &text) {
                    crate::errors::redeliver_interrupt(py, &e);
                }
            });
        }
        e
    }
}

impl MemoryResource for Arena {
    fn backend(&self) -> &BackendRef {
        self.pool.backend()
    }
    fn device(&self) -> i32 {
        self.pool.device()
    }
    fn name(&self) -> &str {
        "ArenaMemoryResource"
    }
    fn memory_kind(&self) -> MemoryKind {
        self.pool.memory_kind()
    }
    fn do_allocate(&self, bytes: usize, stream: &Stream) -> streampool::Result<DevPtr> {
        self.pool.allocate(bytes, stream).map_err(|e| self.failed(bytes, e))
    }
    fn do_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> streampool::Result<()> {
        self.pool.deallocate(ptr, bytes, stream)
    }
    fn try_allocate(&self, bytes: usize, stream: &Stream) -> Option<streampool::Result<DevPtr>> {
        self.pool.try_allocate(bytes, stream).map(|r| r.map_err(|e| self.failed(bytes, e)))
    }
    fn try_deallocate(&self, ptr: DevPtr, bytes: usize, stream: &Stream) -> Option<streampool::Result<()>> {
        self.pool.try_deallocate(ptr, bytes, stream)
    }
    fn footprint(&self) -> Option<streampool::Footprint> {
        self.pool.footprint() // its pool's: the harness's native drivers read it as the pool's
    }
    fn depth(&self) -> usize {
        self.pool.depth()
    }
}

/// RMM's `ArenaMemoryResource` (its arguments and its shape), built on the sharded pool:
/// one global reservation of `arena_size` bytes taken from `upstream_mr` up front and
/// never grown beyond (RMM's global arena), and free blocks kept per stream, the
/// per-thread default stream per thread (RMM's per-thread and per-stream arenas).
///
/// It is a `ShardedPoolMemoryResource` with `initial_pool_size = maximum_pool_size =
/// arena_size` and no release threshold: not RMM's superblock algorithm. (Not a Python subclass of
/// `ShardedPoolMemoryResource`: a pyo3 class whose base shows the garbage collector its
/// references recursed without end in pyo3 0.30's traversal, so each class that holds
/// its upstream is a leaf.) `arena_size=None`: half of
/// the device's free memory, as RMM. `dump_log_on_failure=True`: a failed allocation
/// writes the arena's state to the `streampool` logger (level ERROR) before raising.
///
/// Example::
///
///     arena = mr.ArenaMemoryResource(mr.CudaAsyncMemoryResource(), arena_size="4GiB")
///     streampool.set_current_device_resource(arena)
#[derive(Debug)]
#[pyclass(frozen, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "ArenaMemoryResource")]
pub struct PyArenaMemoryResource {
    pool: Arc<ShardedPoolMemoryResource>,
    upstream: Upstream,
    arena_size: usize,
    dump_log_on_failure: bool,
}

#[pymethods]
impl PyArenaMemoryResource {
    #[new]
    #[pyo3(
        signature = (upstream_mr, arena_size=None, dump_log_on_failure=None),
        text_signature = "(upstream_mr, arena_size=None, dump_log_on_failure=False)"
    )]
    fn new(
        upstream_mr: &Bound<'_, PyMemoryResource>,
        arena_size: Option<&Bound<'_, PyAny>>,
        dump_log_on_failure: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let dump_log_on_failure = crate::flag_arg(dump_log_on_failure, "dump_log_on_failure")?;
        let py = upstream_mr.py();
        let asked = optional_size(arena_size, "arena_size")?;
        let upstream = upstream_ref(upstream_mr);
        let pool = detached(py, move || {
            let bytes = match asked {
                Some(bytes) => bytes,
                None => upstream.backend().mem_get_info(upstream.device())?.0 / 2,
            };
            // Whole 256-byte units, so that the reservation and the cap agree.
            let bytes = bytes / streampool::ALIGNMENT * streampool::ALIGNMENT;
            if bytes > isize::MAX as usize {
                return Err(streampool::Error::InvalidArgument(format!(
                    "arena_size {bytes} is larger than any device (at most {} bytes)",
                    isize::MAX
                )));
            }
            if bytes == 0 {
                return Err(streampool::Error::InvalidArgument(format!(
                    "arena_size must be at least {} bytes, got {}",
                    streampool::ALIGNMENT,
                    asked
                        .map_or_else(|| "half of the device's free memory: 0".to_string(), |a| a.to_string())
                )));
            }
            let options = PoolOptions {
                initial_pool_size: Some(bytes),
                maximum_pool_size: Some(bytes),
                release_threshold: None,
                ..PoolOptions::default()
            };
            let upstream_name = upstream.name().to_string();
            // The arena's whole reservation is made here: an error names the arena, not
            // the pool inside it.
            let pool = ShardedPoolMemoryResource::new(upstream, options).map_err(|e| match e {
                streampool::Error::OutOfMemory { requested, available, .. } => streampool::Error::OutOfMemory {
                    requested,
                    available,
                    resource: format!(
                        "ArenaMemoryResource (reserving its arena_size of {bytes} bytes from {upstream_name} as it is made)"
                    ),
                },
                other => other,
            })?;
            Ok((Arc::new(pool), bytes))
        })?;
        let (pool, arena_size) = pool;
        let resource: streampool::ResourceRef =
            Arc::new(Arena { pool: pool.clone(), dump: dump_log_on_failure });
        Ok(init(resource, upstream_mr, |upstream| Self { pool, upstream, arena_size, dump_log_on_failure }))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.upstream.traverse(&visit)
    }

    fn __clear__(&self) {
        self.upstream.clear();
    }

    /// Bytes the arena holds from its upstream (RMM's pool's `pool_size()`).
    fn pool_size(&self) -> usize {
        self.pool.stats().reserved_bytes
    }

    /// The pool's statistics (`ShardedPoolMemoryResource.stats`).
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.pool)
    }

    /// Gives back to the upstream every chunk that holds no live allocation, as the pool's `release()`;
    /// returns the bytes released. Afterwards it grows again on demand, up to `arena_size`.
    fn release(slf: &Bound<'_, Self>) -> PyResult<usize> {
        release_and_warn(slf.as_any(), slf.get().pool.clone(), "ArenaMemoryResource")
    }

    /// The bytes of the global arena (as asked, rounded down to 256).
    #[getter]
    fn arena_size(&self) -> usize {
        self.arena_size
    }

    /// Whether a failed allocation logs the arena's state.
    #[getter]
    fn dump_log_on_failure(&self) -> bool {
        self.dump_log_on_failure
    }
}
