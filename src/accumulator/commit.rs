//! Which source positions are safe to commit.
//!
//! A position may be committed once every boundary built from events at or before it is
//! durable (fired and acknowledged, or held in a stored cache snapshot). For a stateless
//! accumulator that is "everything before the oldest non-durable boundary", per
//! partition. A stateful accumulator's state mixes all events it has seen, so its
//! positions are committed only when nothing it emitted is pending.

use std::collections::{BTreeMap, VecDeque};

use crate::transport::Position;

#[derive(Debug, Default)]
pub struct CommitTracker {
    /// Emitted boundaries not yet durable: sequence and source position.
    pending: VecDeque<(u64, Option<Position>)>,
    /// Highest processed offset per partition.
    processed: BTreeMap<i32, i64>,
    /// Highest committed offset per partition.
    committed: BTreeMap<i32, i64>,
    last_emitted: u64,
}

/// Positions to commit now, with the sequence number they are consistent with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPoint {
    pub positions: Vec<Position>,
    pub sequence: u64,
}

impl CommitTracker {
    pub fn new(sequence: u64, committed: &[Position]) -> Self {
        Self {
            last_emitted: sequence,
            committed: committed.iter().map(|p| (p.partition, p.offset)).collect(),
            processed: committed.iter().map(|p| (p.partition, p.offset)).collect(),
            ..Self::default()
        }
    }

    /// Whether a position is at or before the committed one: a redelivery of something
    /// already covered by the checkpoint, to be skipped.
    pub fn covered(&self, position: Position) -> bool {
        self.committed
            .get(&position.partition)
            .is_some_and(|&c| position.offset <= c)
    }

    /// Records an event read from the source, whether or not it produced a boundary.
    pub fn processed(&mut self, position: Position) {
        let entry = self.processed.entry(position.partition).or_insert(i64::MIN);
        *entry = (*entry).max(position.offset);
    }

    pub fn emitted(&mut self, sequence: u64, position: Option<Position>) {
        self.last_emitted = sequence;
        self.pending.push_back((sequence, position));
    }

    /// Every partition's committed offset.
    pub fn committed(&self) -> Vec<Position> {
        self.committed
            .iter()
            .map(|(&partition, &offset)| Position { partition, offset })
            .collect()
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Everything up to `sequence` is durable. Returns what may be committed now, if it
    /// moves any partition forward.
    pub fn durable(&mut self, sequence: u64, stateful: bool) -> Option<CommitPoint> {
        while self.pending.front().is_some_and(|(s, _)| *s <= sequence) {
            self.pending.pop_front();
        }
        if stateful && !self.pending.is_empty() {
            return None;
        }
        let mut oldest_pending: BTreeMap<i32, i64> = BTreeMap::new();
        for (_, position) in &self.pending {
            if let Some(p) = position {
                oldest_pending.entry(p.partition).or_insert(p.offset);
            }
        }
        let mut positions = Vec::new();
        for (&partition, &processed) in &self.processed {
            let safe = match oldest_pending.get(&partition) {
                Some(&oldest) => oldest - 1,
                None => processed,
            };
            let committed = self.committed.get(&partition).copied().unwrap_or(i64::MIN);
            if safe > committed && safe >= 0 {
                positions.push(Position {
                    partition,
                    offset: safe,
                });
            }
        }
        if positions.is_empty() {
            return None;
        }
        for p in &positions {
            self.committed.insert(p.partition, p.offset);
        }
        let sequence = match self.pending.front() {
            Some((first, _)) => first - 1,
            None => self.last_emitted,
        };
        Some(CommitPoint {
            positions,
            sequence,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(partition: i32, offset: i64) -> Position {
        Position { partition, offset }
    }

    #[test]
    fn commits_up_to_the_oldest_pending_boundary() {
        let mut t = CommitTracker::new(0, &[]);
        for (seq, off) in [(1, 0), (2, 1), (3, 2)] {
            t.processed(pos(0, off));
            t.emitted(seq, Some(pos(0, off)));
        }
        assert_eq!(
            t.durable(1, false),
            Some(CommitPoint {
                positions: vec![pos(0, 0)],
                sequence: 1
            })
        );
        // Nothing new becomes safe.
        assert_eq!(t.durable(1, false), None);
        assert_eq!(
            t.durable(3, false),
            Some(CommitPoint {
                positions: vec![pos(0, 2)],
                sequence: 3
            })
        );
    }

    #[test]
    fn filtered_events_are_committed_with_their_neighbours() {
        let mut t = CommitTracker::new(0, &[]);
        t.processed(pos(0, 0));
        t.emitted(1, Some(pos(0, 0)));
        t.processed(pos(0, 1)); // produced no boundary
        t.processed(pos(0, 2));
        t.emitted(2, Some(pos(0, 2)));
        let point = t.durable(1, false).unwrap();
        assert_eq!(point.positions, vec![pos(0, 1)]);
    }

    #[test]
    fn partitions_are_tracked_separately() {
        let mut t = CommitTracker::new(0, &[]);
        t.processed(pos(0, 5));
        t.emitted(1, Some(pos(0, 5)));
        t.processed(pos(1, 9));
        t.emitted(2, Some(pos(1, 9)));
        t.processed(pos(0, 6));
        t.emitted(3, Some(pos(0, 6)));
        let point = t.durable(2, false).unwrap();
        // Partition 0 stops before offset 6 (pending); partition 1 is done.
        assert_eq!(point.positions, vec![pos(0, 5), pos(1, 9)]);
        assert_eq!(point.sequence, 2);
    }

    #[test]
    fn stateful_commits_only_when_caught_up() {
        let mut t = CommitTracker::new(10, &[pos(0, 99)]);
        t.processed(pos(0, 100));
        t.emitted(11, Some(pos(0, 100)));
        t.processed(pos(0, 101));
        t.emitted(12, Some(pos(0, 101)));
        t.processed(pos(0, 102)); // folded into state, nothing emitted
        assert_eq!(t.durable(11, true), None);
        assert_eq!(
            t.durable(12, true),
            Some(CommitPoint {
                positions: vec![pos(0, 102)],
                sequence: 12
            })
        );
    }

    #[test]
    fn redeliveries_of_checkpointed_positions_are_covered() {
        let t = CommitTracker::new(4, &[pos(0, 7)]);
        assert!(t.covered(pos(0, 7)));
        assert!(t.covered(pos(0, 3)));
        assert!(!t.covered(pos(0, 8)));
        assert!(!t.covered(pos(1, 0)));
    }

    #[test]
    fn restored_positions_are_not_committed_again() {
        let mut t = CommitTracker::new(4, &[pos(0, 7)]);
        assert_eq!(t.durable(4, false), None);
        t.processed(pos(0, 8));
        assert_eq!(t.durable(4, false).unwrap().positions, vec![pos(0, 8)]);
    }
}
