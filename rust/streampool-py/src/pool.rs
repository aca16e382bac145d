//! `streampool.mr.ShardedPoolMemoryResource` (and `PoolMemoryResource`, RMM's name for it).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use streampool::{PoolOptions, ShardedPoolMemoryResource};

use crate::adaptors::{init, upstream_ref, PyUpstreamResourceAdaptor};
use crate::errors::detached;
use crate::resources::{PyCudaAsyncMemoryResource, PyMemoryResource};
use crate::size_arg;

/// The lock-sharded stream-ordered pool: suballocates memory from `upstream_mr` with one
/// shard of free blocks per stream, so that threads on different streams do not wait for
/// one another (RMM's `PoolMemoryResource`, without its one lock).
///
/// `initial_pool_size=None` reserves nothing up front (the pool grows on demand);
/// `maximum_pool_size=None` means no limit but the upstream's. Sizes take ints or
/// strings such as "4GiB" and are rounded to 256 bytes. `release_threshold`: free bytes
/// the pool may keep before it gives whole free chunks back after a synchronisation.
/// `events_every`: a stream records an event after this many frees, so that other streams
/// can reuse what it freed. `headroom`: the footprint budget, free memory the pool may
/// hold beyond the peak live bytes as a fraction of them (at least 2 MiB) before it reuses
/// another stream's memory by waiting rather than growing; `None` grows whenever no
/// completed block fits. The policy and its reasons: the pool's IMPLEMENTATION.md.
///
/// Example::
///
///     pool = mr.ShardedPoolMemoryResource(mr.CudaAsyncMemoryResource(), maximum_pool_size="8GiB")
///     streampool.set_current_device_resource(pool)
#[derive(Debug)]
#[pyclass(frozen, subclass, extends = PyUpstreamResourceAdaptor, module = "streampool.mr", name = "ShardedPoolMemoryResource")]
pub struct PyShardedPool {
    inner: Arc<ShardedPoolMemoryResource>,
}

fn optional_size(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<usize>> {
    obj.filter(|o| !o.is_none()).map(|o| size_arg(o, what)).transpose()
}

#[pymethods]
impl PyShardedPool {
    #[new]
    #[pyo3(signature = (upstream_mr, initial_pool_size=None, maximum_pool_size=None, release_threshold=None, events_every=64, headroom=PoolOptions::default().headroom))]
    fn new(
        upstream_mr: &Bound<'_, PyMemoryResource>,
        initial_pool_size: Option<&Bound<'_, PyAny>>,
        maximum_pool_size: Option<&Bound<'_, PyAny>>,
        release_threshold: Option<&Bound<'_, PyAny>>,
        events_every: usize,
        headroom: Option<f64>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let options = PoolOptions {
            initial_pool_size: optional_size(initial_pool_size, "initial_pool_size")?,
            maximum_pool_size: optional_size(maximum_pool_size, "maximum_pool_size")?,
            release_threshold: optional_size(release_threshold, "release_threshold")?,
            events_every,
            headroom,
        };
        let upstream = upstream_ref(upstream_mr);
        let inner =
            Arc::new(detached(upstream_mr.py(), move || ShardedPoolMemoryResource::new(upstream, options))?);
        Ok(init(inner.clone(), upstream_mr, Self { inner }))
    }

    /// Bytes the pool holds from its upstream (RMM's `pool_size()`).
    fn pool_size(&self) -> usize {
        self.inner.stats().reserved_bytes
    }

    /// What the pool holds and how often each step of its policy ran: reserved_bytes,
    /// peak_reserved_bytes, used_bytes, free_bytes, common_free_bytes, shard_free_bytes
    /// ({stream key: bytes}), retired_shards, grown_bytes, released_bytes,
    /// upstream_growths, completed_steals, cross_stream_waits, synchronizations,
    /// events_recorded.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
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
        Ok(d)
    }

    /// Gives back to the upstream every byte that is not live: synchronises the device,
    /// gathers every free block and returns every entirely free chunk; returns the bytes
    /// released. Over the device's default pool (`CudaAsyncMemoryResource()`), which keeps
    /// what is freed into it, warns how much that pool still holds: its `trim_to(0)` hands
    /// it to the system.
    fn release(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let py = slf.py();
        let inner = slf.get().inner.clone();
        let released = detached(py, move || inner.release())?;
        let upstream = slf.getattr("upstream")?;
        if upstream.is_instance_of::<PyCudaAsyncMemoryResource>()
            && !upstream.getattr("owns_pool")?.extract::<bool>()?
        {
            let held: usize = upstream.getattr("reserved_bytes")?.extract()?;
            if held > 0 {
                let msg = format!(
                    "ShardedPoolMemoryResource.release() gave {released} bytes back to the device's default \
                     pool, which still holds {held} bytes (its release threshold is the maximum, so it keeps \
                     freed memory for reuse); call upstream.trim_to(0) to hand it to the system"
                );
                let msg = std::ffi::CString::new(msg).expect("no NUL in the message");
                PyErr::warn(py, &py.get_type::<pyo3::exceptions::PyUserWarning>(), &msg, 1)?;
            }
        }
        Ok(released)
    }
}
