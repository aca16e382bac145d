//! Vector clocks over simulated streams.
//!
//! A clock maps a stream's internal id (never reused) to a sequence number on that
//! stream: "everything enqueued on stream `s` up to op `n`". Clocks only hold entries
//! that have not completed yet; completed work is covered by the global completion
//! order instead (see [`super::exec`]), which keeps clocks as small as the set of
//! streams that still have work in flight.

use std::collections::BTreeMap;

/// A vector clock: stream id -> sequence number.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct VClock(BTreeMap<u64, u64>);

impl VClock {
    /// The entry for `stream`, 0 when absent.
    pub(super) fn get(&self, stream: u64) -> u64 {
        self.0.get(&stream).copied().unwrap_or(0)
    }

    /// Raises the entry for `stream` to at least `seq`.
    pub(super) fn raise(&mut self, stream: u64, seq: u64) {
        let e = self.0.entry(stream).or_insert(0);
        *e = (*e).max(seq);
    }

    /// Pointwise maximum with `other`.
    pub(super) fn join(&mut self, other: &VClock) {
        for (&s, &n) in &other.0 {
            self.raise(s, n);
        }
    }

    /// Keeps only the entries for which `keep(stream, seq)` holds.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(u64, u64) -> bool) {
        self.0.retain(|&s, &mut n| keep(s, n));
    }

    /// The entries, by stream id.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().map(|(&s, &n)| (s, n))
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::VClock;

    #[test]
    fn join_is_pointwise_max() {
        let mut a = VClock::default();
        a.raise(1, 3);
        a.raise(2, 1);
        let mut b = VClock::default();
        b.raise(2, 5);
        b.raise(3, 2);
        a.join(&b);
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![(1, 3), (2, 5), (3, 2)]);
        a.raise(1, 2);
        assert_eq!(a.get(1), 3);
        assert_eq!(a.get(9), 0);
        a.retain(|s, _| s != 2);
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![(1, 3), (3, 2)]);
    }
}
