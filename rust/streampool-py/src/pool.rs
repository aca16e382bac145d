//! `streampool.mr.ShardedPoolMemoryResource` (and `PoolMemoryResource`, RMM's name for it).

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::PyTraverseError;
use streampool::{PoolOptions, ShardedPoolMemoryResource};

use crate::adaptors::{init, upstream_ref, PyUpstreamResourceAdaptor, Upstream};
use crate::errors::detached;
use crate::resources::PyMemoryResource;
use crate::{count_arg, size_arg};

/// The smallest `maximum_pool_size`: the pool rounds it down to its 256-byte granularity,
/// which would make anything smaller 0.
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
/// can reuse what it freed. The policy and its reasons: the pool's IMPLEMENTATION.md.
///
/// Example::
///
///     pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), maximum_pool_size="8GiB")
///     streampool.set_current_device_resource(pool)
#[derive(Debug)]
#[pyclass(frozen, subclass, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "ShardedPoolMemoryResource")]
pub struct PyShardedPool {
    inner: Arc<ShardedPoolMemoryResource>,
    upstream: Upstream,
}

fn optional_size(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<usize>> {
    obj.filter(|o| !o.is_none()).map(|o| size_arg(o, what)).transpose()
}

#[pymethods]
impl PyShardedPool {
    #[new]
    #[pyo3(
        signature = (upstream_mr, initial_pool_size=None, maximum_pool_size=None, release_threshold=None, events_every=None),
        text_signature = "(upstream_mr, initial_pool_size=None, maximum_pool_size=None, release_threshold=None, events_every=64)"
    )]
    fn new(
        upstream_mr: &Bound<'_, PyMemoryResource>,
        initial_pool_size: Option<&Bound<'_, PyAny>>,
        maximum_pool_size: Option<&Bound<'_, PyAny>>,
        release_threshold: Option<&Bound<'_, PyAny>>,
        events_every: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let maximum_pool_size = optional_size(maximum_pool_size, "maximum_pool_size")?;
        if let Some(max) = maximum_pool_size.filter(|&m| m < MIN_MAXIMUM_POOL_SIZE) {
            return Err(PyValueError::new_err(format!(
                "maximum_pool_size must be at least {MIN_MAXIMUM_POOL_SIZE} bytes (the pool's granularity; \
                 it is rounded down to a multiple of it), got {max}"
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
    /// used_bytes, free_bytes, common_free_bytes, shard_free_bytes ({stream key: bytes}),
    /// grown_bytes, released_bytes, upstream_growths, completed_steals,
    /// cross_stream_waits, synchronizations, events_recorded.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("reserved_bytes", s.reserved_bytes)?;
        d.set_item("used_bytes", s.used_bytes)?;
        d.set_item("free_bytes", s.free_bytes)?;
        d.set_item("common_free_bytes", s.common_free_bytes)?;
        let shards = PyDict::new(py);
        for (key, bytes) in s.shard_free_bytes {
            shards.set_item(key, bytes)?;
        }
        d.set_item("shard_free_bytes", shards)?;
        d.set_item("grown_bytes", s.grown_bytes)?;
        d.set_item("released_bytes", s.released_bytes)?;
        d.set_item("upstream_growths", s.upstream_growths)?;
        d.set_item("completed_steals", s.completed_steals)?;
        d.set_item("cross_stream_waits", s.cross_stream_waits)?;
        d.set_item("synchronizations", s.synchronizations)?;
        d.set_item("events_recorded", s.events_recorded)?;
        Ok(d)
    }

    /// Gives every entirely free chunk whose frees are known complete back to the
    /// upstream; returns the bytes released.
    fn release(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.inner.clone();
        detached(py, move || inner.release())
    }
}
