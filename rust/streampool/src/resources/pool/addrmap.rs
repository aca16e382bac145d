//! A small hash map from device addresses to block records, for the live blocks of a
//! shard: open addressing, linear probing, deletion by backward shift (no tombstones, so a
//! map with constant churn stays as fast as a fresh one), at most a quarter full (runs stay
//! short: most look-ups probe one slot). One insert per allocation and one removal per free
//! are the only hashing on the pool's hot path.

const EMPTY: u64 = u64::MAX;

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
        AddrMap::with_capacity_log2(6)
    }
}

impl AddrMap {
    fn with_capacity_log2(bits: u32) -> Self {
        AddrMap { slots: vec![(EMPTY, 0); 1 << bits], len: 0, shift: 64 - bits }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Fibonacci hashing of the address with its alignment bits rotated to the top.
    fn home(&self, key: u64) -> usize {
        (key.rotate_right(8).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

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
    pub fn insert(&mut self, key: u64, value: u32) {
        debug_assert_ne!(key, EMPTY);
        match self.find(key) {
            Ok(i) => self.slots[i].1 = value,
            Err(i) => {
                self.slots[i] = (key, value);
                self.len += 1;
                if self.len * 4 > self.slots.len() {
                    self.grow();
                }
            }
        }
    }

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
