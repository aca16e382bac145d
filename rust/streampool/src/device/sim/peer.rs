//! Several devices: which device's work may touch which memory, as the driver decides it.
//!
//! * `cuMemAlloc` memory of device A is accessible to work on device B once B's context
//!   enabled peer access to A's (`cuCtxEnablePeerAccess`), which needs the pair to be
//!   peer-capable (`cuDeviceCanAccessPeer`; every pair of distinct devices is, unless
//!   [`SimDevice::set_peer_capable`](super::SimDevice::set_peer_capable) says otherwise).
//! * Pool memory does not follow that: a pool's memory is accessible to its own device and
//!   to the devices it was granted to with `cuMemPoolSetAccess`.
//! * Managed and pinned host memory are accessible everywhere.
//! * Memory mapped with `cuMemMap` (module `vmm`) is accessible to its own device alone
//!   (`cuMemcpyAsync` copies included): the mapping grants no other (`cuMemSetAccess`).
//! * Copies with `cuMemcpyPeerAsync` need no access (the driver stages them through the
//!   host where the devices cannot reach each other), nor do `cuMemcpyAsync` copies of
//!   another device's `cuMemAlloc` memory (unified addressing makes them peer copies).
//! * Kernels and memsets touching another device's memory without access, and
//!   `cuMemcpyAsync` copies of another device's pool memory that was not granted, are
//!   refused when enqueued, naming both devices and the grant that is missing (on a GPU
//!   they would fault, later and less clearly).

use std::collections::HashSet;

use super::memory::{invalid_device, AllocKind};
use super::State;
use crate::device::DevPtr;
use crate::error::{Error, Result};

/// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`.
const CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: i32 = 217;

/// What the device knows of peer access.
#[derive(Debug, Default)]
pub(super) struct Peers {
    /// Pairs `(a, b)` that cannot reach each other (either way).
    unreachable: HashSet<(i32, i32)>,
    /// `(accessor, owner)`: `accessor`'s context enabled peer access to `owner`'s.
    enabled: HashSet<(i32, i32)>,
}

fn driver(call: &'static str, code: i32, name: &str) -> Error {
    Error::Driver { call, code, name: name.into(), context: String::new() }
}

impl Peers {
    fn key(a: i32, b: i32) -> (i32, i32) {
        (a.min(b), a.max(b))
    }

    pub(super) fn set_capable(&mut self, a: i32, b: i32, yes: bool) {
        if yes {
            self.unreachable.remove(&Self::key(a, b));
        } else {
            self.unreachable.insert(Self::key(a, b));
            self.enabled.remove(&(a, b));
            self.enabled.remove(&(b, a));
        }
    }

    /// `cuDeviceCanAccessPeer`.
    pub(super) fn can_access(&self, dev: i32, peer: i32) -> bool {
        dev != peer && !self.unreachable.contains(&Self::key(dev, peer))
    }
}

impl State {
    /// `cuCtxEnablePeerAccess` from `dev`'s context to `peer`'s.
    pub(super) fn enable_peer_access(&mut self, dev: i32, peer: i32) -> Result<()> {
        const CALL: &str = "cuCtxEnablePeerAccess";
        if dev == peer {
            return Err(invalid_device(CALL));
        }
        if !self.peers.can_access(dev, peer) {
            return Err(driver(
                CALL,
                CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
                "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
            ));
        }
        self.peers.enabled.insert((dev, peer));
        Ok(())
    }

    /// `cuMemPoolSetAccess` for one device.
    pub(super) fn set_pool_access(&mut self, pool: u64, accessor: i32, enabled: bool) -> Result<()> {
        const CALL: &str = "cuMemPoolSetAccess";
        let owner = self.pool(pool)?.dev;
        if accessor == owner {
            // The owner's access cannot be taken away; granting it is a no-op.
            return if enabled { Ok(()) } else { Err(super::memory::invalid_value(CALL)) };
        }
        if enabled && !self.peers.can_access(accessor, owner) {
            return Err(invalid_device(CALL));
        }
        let access = &mut self.pools.get_mut(&pool).expect("checked above").access;
        if enabled {
            access.insert(accessor);
        } else {
            access.remove(&accessor);
        }
        Ok(())
    }

    /// `cuMemPoolGetAccess`.
    pub(super) fn pool_access(&self, pool: u64, accessor: i32) -> Result<bool> {
        let p = self.pool(pool)?;
        Ok(accessor == p.dev || p.access.contains(&accessor))
    }

    /// Refuses work on device `dev` that touches `[ptr, ptr + bytes)` (inside a live
    /// allocation, already checked) when that memory is another device's and `dev` was
    /// given no access to it. A `copy` (`cuMemcpyAsync`) of `cuMemAlloc` memory needs none.
    pub(super) fn check_access(
        &self,
        dev: i32,
        ptr: DevPtr,
        bytes: usize,
        what: &str,
        copy: bool,
    ) -> Result<()> {
        let Some((_, a)) = self.alloc_containing(ptr, bytes) else { return Ok(()) };
        if a.dev == dev {
            return Ok(());
        }
        let missing = match a.kind {
            AllocKind::Managed | AllocKind::Pinned => return Ok(()),
            AllocKind::Device if copy => return Ok(()),
            AllocKind::Device if self.peers.enabled.contains(&(dev, a.dev)) => return Ok(()),
            AllocKind::Device => format!(
                "peer access from device {dev} to device {} was not enabled (cuCtxEnablePeerAccess)",
                a.dev
            ),
            // Memory imported from another process's pool follows its imported pool's grants.
            AllocKind::Pool(p) | AllocKind::Imported(p)
                if self.pools.get(&p).is_some_and(|p| p.access.contains(&dev)) =>
            {
                return Ok(())
            }
            AllocKind::Pool(p) | AllocKind::Imported(p) => format!(
                "pool {p:#x} of device {} does not grant device {dev} access (cuMemPoolSetAccess; \
                 peer_access=[{dev}] on its resource)",
                a.dev
            ),
            AllocKind::Mapped => {
                "memory mapped with cuMemMap is accessible only to its own device (cuMemSetAccess)".into()
            }
        };
        Err(Error::InvalidPointer(format!(
            "{what} on device {dev}: [{ptr:#x}, +{bytes}) is memory of device {} of {}, which device \
             {dev} cannot access: {missing}",
            a.dev, self.name
        )))
    }

    /// Validates one side of `cuMemcpyPeerAsync`: simulated memory must be device `dev`'s
    /// (managed and pinned memory belong to every device); other host memory passes.
    /// Returns whether it is simulated memory.
    pub(super) fn check_peer_side(&self, ptr: DevPtr, dev: i32, bytes: usize, what: &str) -> Result<bool> {
        if !self.classify_copy_side(ptr, bytes, what)? {
            return Ok(false);
        }
        let (_, a) = self.alloc_containing(ptr, bytes).expect("classified as simulated memory");
        if a.dev != dev && matches!(a.kind, AllocKind::Device | AllocKind::Pool(_) | AllocKind::Mapped) {
            return Err(Error::InvalidPointer(format!(
                "{what}: [{ptr:#x}, +{bytes}) is memory of device {}, not of device {dev}",
                a.dev
            )));
        }
        Ok(true)
    }
}
