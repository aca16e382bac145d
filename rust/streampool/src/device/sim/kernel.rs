//! Modules and kernels on the simulated device: `cuModuleLoadData` of PTX whose entries
//! are streampool's own kernels ([`crate::kernels`]), `cuModuleGetFunction`, and
//! `cuLaunchKernel` as an operation on its stream that reads and writes the memory as
//! the real kernel does, checked by the race detector like any other.

use std::time::{Duration, Instant};

use super::exec::Work;
use super::memory::invalid_value;
use super::State;
use crate::device::{DevPtr, RawFunction, RawModule};
use crate::error::{Error, Result};
use crate::kernels::{self, pattern_word, SIM_KERNEL_BYTES_PER_NS, SIM_KERNEL_LAUNCH_NS, SIM_KERNEL_MAX_NS};

/// `CUDA_ERROR_NOT_FOUND`: a kernel name the module lacks.
const CUDA_ERROR_NOT_FOUND: i32 = 500;

/// The first module and function handles; later ones count up by 0x10.
pub(super) const FIRST_MODULE: RawModule = 0xd000_0000;
pub(super) const FIRST_FUNCTION: RawFunction = 0xf000_0000;

/// A kernel the simulated device knows how to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    Fill,
    Check,
    Compute,
}

impl Kernel {
    fn by_name(name: &str) -> Option<Kernel> {
        match name {
            kernels::FILL => Some(Kernel::Fill),
            kernels::CHECK => Some(Kernel::Check),
            kernels::COMPUTE => Some(Kernel::Compute),
            _ => None,
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Kernel::Fill => kernels::FILL,
            Kernel::Check => kernels::CHECK,
            Kernel::Compute => kernels::COMPUTE,
        }
    }

    /// How many 64-bit parameters it takes (as the PTX declares them).
    fn params(self) -> usize {
        match self {
            Kernel::Fill => 3,
            Kernel::Check => 4,
            Kernel::Compute => 5,
        }
    }
}

/// A launch, as queued: the kernel and its parameters.
#[derive(Debug, Clone)]
pub(super) struct Launch {
    pub(super) kernel: Kernel,
    pub(super) params: Vec<u64>,
}

impl Launch {
    fn buffer(&self) -> (DevPtr, u64) {
        // Saturating: a range past the end of the address space is refused as one that
        // leaves its allocation, not wrapped round to an empty one.
        (self.params[0], self.params[0].saturating_add(self.params[1].saturating_mul(8)))
    }

    /// The simulated-memory ranges it touches: `(start, end, writes)`.
    pub(super) fn accesses(&self) -> Vec<(u64, u64, bool)> {
        let (start, end) = self.buffer();
        match self.kernel {
            Kernel::Fill | Kernel::Compute => vec![(start, end, true)],
            // The counter's atomic add reads and writes it: a write, for the detector.
            Kernel::Check => {
                vec![(start, end, false), (self.params[3], self.params[3].saturating_add(8), true)]
            }
        }
    }

    /// Its simulated duration (see [`kernels::SIM_KERNEL_LAUNCH_NS`]).
    fn duration(&self) -> Duration {
        let bytes = 8 * self.params[1];
        let touched = match self.kernel {
            Kernel::Fill | Kernel::Check => bytes,
            Kernel::Compute => bytes.saturating_mul(2).saturating_mul(self.params[2]),
        };
        Duration::from_nanos(
            (SIM_KERNEL_LAUNCH_NS + touched / SIM_KERNEL_BYTES_PER_NS).min(SIM_KERNEL_MAX_NS),
        )
    }

    /// Runs it on memory that is still backed (checked by the caller), then waits out the
    /// rest of its duration.
    pub(super) fn run(&self) {
        let started = Instant::now();
        let (ptr, words) = (self.params[0], self.params[1] as usize);
        let data = std::ptr::with_exposed_provenance_mut::<u64>(ptr as usize);
        // SAFETY: `[ptr, ptr + 8 * words)` lies inside a live `HostBlock` of this device
        // (the caller checked it under the state lock that every free takes), whose
        // provenance was exposed when it was allocated; `ptr` is 8-byte aligned (checked
        // at the launch). Nothing else touches simulated memory while the lock is held.
        let words = unsafe { std::slice::from_raw_parts_mut(data, words) };
        match self.kernel {
            Kernel::Fill => {
                let seed = self.params[2];
                for (i, w) in words.iter_mut().enumerate() {
                    *w = pattern_word(seed, i as u64);
                }
            }
            Kernel::Check => {
                let seed = self.params[2];
                let bad =
                    words.iter().enumerate().filter(|&(i, &w)| w != pattern_word(seed, i as u64)).count();
                let counter = std::ptr::with_exposed_provenance_mut::<u64>(self.params[3] as usize);
                // SAFETY: as above for the counter's 8 bytes (checked by the caller too).
                unsafe { *counter = (*counter).wrapping_add(bad as u64) };
            }
            Kernel::Compute => {
                let (m, inv) = (self.params[3], self.params[4]);
                // Every pass multiplies each word by `m` and by its inverse, leaving it as it
                // was: one pass does what all do (the duration models them all).
                let passes = if m.wrapping_mul(inv) == 1 { self.params[2].min(1) } else { self.params[2] };
                for _ in 0..passes {
                    for w in words.iter_mut() {
                        // Volatile, as the PTX's accesses: each pass really goes to memory.
                        let p = w as *mut u64;
                        // SAFETY: `p` points into the slice above.
                        unsafe { p.write_volatile(p.read_volatile().wrapping_mul(m).wrapping_mul(inv)) };
                    }
                }
            }
        }
        let duration = self.duration();
        while started.elapsed() < duration {
            std::hint::spin_loop();
        }
    }
}

/// The `.entry` names of a PTX text.
fn entries(ptx: &str) -> Vec<&str> {
    ptx.split(".entry")
        .skip(1)
        .filter_map(|rest| rest.split(['(', ' ', '\n', '\t']).find(|s| !s.is_empty()))
        .collect()
}

impl State {
    /// `cuModuleLoadData`.
    pub(super) fn module_load(&mut self, image: &[u8]) -> Result<RawModule> {
        let text = std::str::from_utf8(image).map_err(|_| invalid_value("cuModuleLoadData"))?;
        let names = entries(text);
        if names.is_empty() {
            return Err(Error::Driver {
                call: "cuModuleLoadData",
                code: 218, // CUDA_ERROR_INVALID_PTX
                name: "CUDA_ERROR_INVALID_PTX".into(),
                context: String::new(),
            });
        }
        let mut kernels = Vec::new();
        for name in names {
            let Some(k) = Kernel::by_name(name) else {
                return Err(Error::Unsupported(format!(
                    "{} runs only streampool's own kernels ({}, {}, {}); this module has {name:?}",
                    self.name,
                    kernels::FILL,
                    kernels::CHECK,
                    kernels::COMPUTE
                )));
            };
            kernels.push(k);
        }
        let handle = self.next_module;
        self.next_module += 0x10;
        self.modules.insert(handle, kernels);
        Ok(handle)
    }

    /// `cuModuleGetFunction`.
    pub(super) fn module_function(&mut self, module: RawModule, name: &str) -> Result<RawFunction> {
        let kernels = self
            .modules
            .get(&module)
            .ok_or_else(|| Error::invalid(format!("module {module:#x} was not loaded on {}", self.name)))?;
        let Some(&k) = kernels.iter().find(|k| k.name() == name) else {
            return Err(Error::Driver {
                call: "cuModuleGetFunction",
                code: CUDA_ERROR_NOT_FOUND,
                name: "CUDA_ERROR_NOT_FOUND".into(),
                context: String::new(),
            });
        };
        let handle = self.next_function;
        self.next_function += 0x10;
        self.functions.insert(handle, k);
        Ok(handle)
    }

    /// The work of launching `function` on a stream of device `dev`: its parameters,
    /// the ranges it touches, and that `dev` may access them (peer access).
    pub(super) fn kernel_work(
        &self,
        dev: i32,
        function: RawFunction,
        grid: u32,
        block: u32,
        params: &[u64],
    ) -> Result<Work> {
        let &kernel = self.functions.get(&function).ok_or_else(|| {
            Error::invalid(format!("function {function:#x} was not obtained from a module of {}", self.name))
        })?;
        if grid == 0 || block == 0 || params.len() != kernel.params() {
            return Err(invalid_value("cuLaunchKernel"));
        }
        let launch = Launch { kernel, params: params.to_vec() };
        for (start, end, _) in launch.accesses() {
            if start % 8 != 0 {
                return Err(Error::invalid(format!(
                    "cuLaunchKernel ({}): address {start:#x} is not 8-byte aligned (on a GPU: \
                     CUDA_ERROR_MISALIGNED_ADDRESS)",
                    kernel.name()
                )));
            }
            if end > start {
                self.check_range(start, (end - start) as usize, kernel.name())?;
                self.check_access(dev, start, (end - start) as usize, kernel.name(), false)?;
            }
        }
        Ok(Work::Kernel(launch))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn entries_are_found_in_the_crates_ptx() {
        assert_eq!(
            super::entries(crate::kernels::PTX),
            ["streampool_fill", "streampool_check", "streampool_compute"]
        );
    }
}
