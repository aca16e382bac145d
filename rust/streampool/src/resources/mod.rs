//! The resources: the driver's stream-ordered pool, and plain device, managed and pinned
//! host memory. RMM's names are kept (`CudaAsyncMemoryResource` is RMM's
//! `cuda_async_memory_resource`, and so on).

mod async_pool;
mod plain;
mod pool;

pub use async_pool::{AsyncPoolOptions, CudaAsyncManagedMemoryResource, CudaAsyncMemoryResource};
pub use plain::{CudaMemoryResource, ManagedMemoryResource, PinnedHostMemoryResource, PlainMemoryResource};
pub use pool::{PoolOptions, PoolStats, ShardedPoolMemoryResource};

use crate::device::{backend, BackendRef};
use crate::error::{Error, Result};

/// The backend new objects use now, and `device` on it (the current device when `None`),
/// checked to exist.
pub fn bind(device: Option<i32>) -> Result<(BackendRef, i32)> {
    let backend = backend()?;
    let device = check_device(&backend, device)?;
    Ok((backend, device))
}

/// `device` on `backend` (its current device when `None`), checked to exist.
pub fn check_device(backend: &BackendRef, device: Option<i32>) -> Result<i32> {
    let device = match device {
        Some(d) => d,
        None => backend.current_device()?,
    };
    let count = backend.device_count()?;
    if device < 0 || device >= count {
        return Err(Error::invalid(format!(
            "device {device} {}",
            no_such_device(&backend.describe(), count)
        )));
    }
    Ok(device)
}

/// What follows "device N" when N is not a device of the backend `described`, which has
/// `count`.
pub(crate) fn no_such_device(described: &str, count: i32) -> String {
    let devices = match count {
        1 => "its one device is 0".to_string(),
        n => format!("its devices are 0 to {}", n - 1),
    };
    format!("does not exist on {described}: {devices}")
}
