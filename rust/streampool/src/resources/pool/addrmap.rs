//! A small hash map from device addresses to block records, for the live blocks of a
//! shard: open addressing, linear probing, deletion by backward shift (no tombstones, so a
//! map with constant churn stays as fast as a fresh one). One insert per allocation and one
//! removal per free are the only hashing on the pool's hot path.
//!
//! Sparse while small: at most a sixteenth full below [`SPARSE_SLOTS`] slots (64 KiB), a
//! quarter beyond. The loops of a look-up and of a removal end at the first empty slot, and
//! which slot that is depends on the random addresses: the fuller the map, the more often
//! the branch that ends them is mispredicted. On the window bench at one thread (16 live
//! blocks a stream), a quarter-full map cost 63.7 ns per pool operation and a
//! sixteenth-full one 53 ns, on a 2-core AMD EPYC VM, on the simulated device
//! (`benchmarks/RESULTS.md`, "Commit f68cb39").

const EMPTY: u64 = u64::MAX;
/// Below this many slots the map stays at most a sixteenth full; from here on, a quarter.
const SPARSE_SLOTS: usize = 1 << 12;

/// Keys are 256-byte aligned addresses (the hash rotates their zero low bits away);
/// `u64::MAX` is never a key.
#[derive(Debug, Clone)]
pub(crate) struct AddrMap {
    slots: Vec<(u64, u32)>,
    len: usize,
    shift: u32,
}

impl Default for AddrMap {
    fn default() -> Self {
        AddrMap::with_capacity_log2(8)
    }
}

impl AddrMap {
    fn with_capacity_log2(bits: u32) -> Self {
        AddrMap { slots: vec![(EMPTY, 0); 1 << bits], len: 0, shift: 64 - bits }
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Fibonacci hashing of the address with its alignment bits rotated to the top.
    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        (key.rotate_right(8).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    #[inline(always)]
    fn find(&self, key: u64) -> Result<usize, usize> {
        let mut i = self.home(key);
        loop {
            match self.slots[i].0 {
                k if k == key => return Ok(i),
                EMPTY => return Err(i),
                _ => i = (i + 1) & self.mask(),
            }
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn get(&self, key: u64) -> Option<u32> {
        self.find(key).ok().map(|i| self.slots[i].1)
    }

    /// Inserts or replaces.
    #[inline(always)]
    pub fn insert(&mut self, key: u64, value: u32) {
        debug_assert_ne!(key, EMPTY);
        match self.find(key) {
            Ok(i) => self.slots[i].1 = value,
            Err(i) => {
                self.slots[i] = (key, value);
                self.len += 1;
                let most = if self.slots.len() < SPARSE_SLOTS {
                    self.slots.len() / 16
                } else {
                    self.slots.len() / 4
                };
                if self.len > most {
                    self.grow();
                }
            }
        }
    }

    #[inline(always)]
    pub fn remove(&mut self, key: u64) -> Option<u32> {
        let mut hole = self.find(key).ok()?;
        let value = self.slots[hole].1;
        // Backward shift: pull later entries of the run into the hole when their home
        // does not lie cyclically in (hole, j].
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask();
            let k = self.slots[j].0;
            if k == EMPTY {
                break;
            }
            let home = self.home(k);
            let stays = if hole < j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole].0 = EMPTY;
        self.len -= 1;
        Some(value)
    }

    /// Every (key, value).
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.slots.iter().copied().filter(|&(k, _)| k != EMPTY)
    }

    fn grow(&mut self) {
        let bits = 64 - self.shift + 1;
        let old = std::mem::replace(self, AddrMap::with_capacity_log2(bits));
        for (k, v) in old.iter() {
            self.insert(k, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Past the sparse size the map packs a quarter full, and every key stays found through
    /// growth from the sparse to the dense regime and back down by removals.
    #[test]
    fn grows_from_sparse_to_dense() {
        let mut m = AddrMap::default();
        let n = 3 * SPARSE_SLOTS;
        for k in 0..n as u64 {
            m.insert((k + 1) << 8, k as u32);
            let slots = m.slots.len();
            let most = if slots < SPARSE_SLOTS { slots / 16 } else { slots / 4 };
            assert!(m.len() <= most.max(1), "{} keys in {slots} slots", m.len());
        }
        assert!(m.slots.len() <= 8 * n, "dense: at most eight slots a key (a quarter full, then doubled)");
        for k in 0..n as u64 {
            assert_eq!(m.get((k + 1) << 8), Some(k as u32));
        }
        for k in (0..n as u64).step_by(2) {
            assert_eq!(m.remove((k + 1) << 8), Some(k as u32));
        }
        for k in 0..n as u64 {
            assert_eq!(m.get((k + 1) << 8), (k % 2 == 1).then_some(k as u32));
        }
        assert_eq!(m.len(), n / 2);
    }

    proptest! {
        /// Against std's map, with keys crowded into few homes so that runs wrap and shift.
        #[test]
        fn matches_std(ops in proptest::collection::vec((0u8..3, 0u64..96, any::<u32>()), 1..600)) {
            let mut m = AddrMap::default();
            let mut model = HashMap::new();
            for (op, k, v) in ops {
                let key = (k << 8) | (k & 1);
                match op {
                    0 | 1 => {
                        m.insert(key, v);
                        model.insert(key, v);
                    }
                    _ => prop_assert_eq!(m.remove(key), model.remove(&key)),
                }
                prop_assert_eq!(m.len(), model.len());
                for (&k, &v) in &model {
                    prop_assert_eq!(m.get(k), Some(v));
                }
                prop_assert_eq!(m.iter().count(), model.len());
            }
        }
    }
}
