//! Which source positions are safe to commit, and which positions a boundary covers.
//!
//! A position may be committed once every boundary built from events at or before it is
//! durable (held in a stored cache snapshot: queued, requeued, or counted as fired and
//! acknowledged). For a stateless
//! accumulator that is "everything before the oldest non-durable boundary", per
//! partition. A stateful accumulator's state mixes all events it has seen, so its
//! positions are committed only together with a state that every pending boundary came
//! before: its state when nothing it emitted is pending, or one marked earlier, once
//! what it had emitted then is durable (under a steady backlog something always is
//! pending).

use std::collections::{BTreeMap, VecDeque};

use serde_json::Value;

use super::Positions;
use crate::transport::Position;

#[derive(Debug, Default)]
pub struct CommitTracker {
    /// Emitted boundaries not yet durable: sequence and the emitting event's position.
    pending: VecDeque<(u64, Option<Position>)>,
    /// Highest processed offset per partition.
    processed: BTreeMap<i32, i64>,
    /// Highest committed offset per partition.
    committed: BTreeMap<i32, i64>,
    /// Highest offset per partition of the events taken in since the last emission,
    /// by partition: what the next boundary covers. Handed over whole at each emission,
    /// so kept in the form the boundary holds it.
    uncovered: Positions,
    /// A stateful accumulator's mark: the last boundary emitted when its state was
    /// marked, the highest offset per partition folded into that state, and the state.
    mark: Option<(u64, BTreeMap<i32, i64>, Option<Value>)>,
}

/// Positions to commit now.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitPoint {
    pub positions: Vec<Position>,
    /// The state they go with, for a stateful accumulator.
    pub state: PointState,
}

/// Which state a stateful accumulator's commit point goes with.
#[derive(Debug, Clone, PartialEq)]
pub enum PointState {
    /// The state as it is now.
    Current,
    /// The state [`CommitTracker::mark`] was given.
    Marked(Option<Value>),
}

impl CommitTracker {
    /// Starts from the committed positions of a checkpoint. With `state_restored`, the
    /// restored state stands for every event up to those positions, so the first
    /// boundary built from it covers them too.
    pub fn new(committed: &[Position], state_restored: bool) -> Self {
        let offsets: BTreeMap<i32, i64> =
            committed.iter().map(|p| (p.partition, p.offset)).collect();
        Self {
            uncovered: if state_restored {
                offsets
                    .iter()
                    .map(|(&partition, &offset)| Position { partition, offset })
                    .collect()
            } else {
                Positions::new()
            },
            committed: offsets.clone(),
            processed: offsets,
            pending: VecDeque::new(),
            mark: None,
        }
    }

    /// Whether a position is at or before the last one taken in from its partition: a
    /// redelivery (JetStream delivers again what is not acknowledged in time) of what
    /// this run, or the checkpoint it started from, already holds, to be skipped. A
    /// source reads each partition in order, and one reopened for a run carried on
    /// starts after what the run took in, so nothing before that position is new.
    pub fn seen(&self, position: Position) -> bool {
        self.processed
            .get(&position.partition)
            .is_some_and(|&p| position.offset <= p)
    }

    /// Records an event taken in, whether or not it produced a boundary.
    pub fn processed(&mut self, position: Position) {
        let processed = self.processed.entry(position.partition).or_insert(i64::MIN);
        *processed = (*processed).max(position.offset);
        match self
            .uncovered
            .binary_search_by_key(&position.partition, |p| p.partition)
        {
            Ok(i) => {
                let uncovered = &mut self.uncovered[i].offset;
                *uncovered = (*uncovered).max(position.offset);
            }
            Err(i) => self.uncovered.insert(i, position),
        }
    }

    /// Records an emitted boundary; returns the positions it covers.
    pub fn emitted(&mut self, sequence: u64, position: Option<Position>) -> Positions {
        self.pending.push_back((sequence, position));
        std::mem::take(&mut self.uncovered)
    }

    /// Every partition's committed offset.
    pub fn committed(&self) -> Vec<Position> {
        self.committed
            .iter()
            .map(|(&partition, &offset)| Position { partition, offset })
            .collect()
    }

    /// The highest offset taken in per partition (the checkpoint's to begin with).
    pub fn processed_offsets(&self) -> &BTreeMap<i32, i64> {
        &self.processed
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Gives up the oldest pending boundaries past `most`: their positions no longer
    /// hold commits back. For a source that keeps nothing unread, which cannot be held
    /// and whose positions cannot be read again, so that through a store outage the
    /// list does not grow with everything it delivers.
    pub fn forget_pending_past(&mut self, most: usize) {
        let excess = self.pending.len().saturating_sub(most);
        self.pending.drain(..excess);
    }

    /// Marks where a stateful accumulator's state stands now, while boundaries it
    /// emitted are pending: once they are durable, [`CommitTracker::durable`] commits
    /// the positions folded into it with `state()`, however many boundaries are pending
    /// by then. False, and `state` not called, when a mark waits already or nothing is
    /// pending (the state as it is then can be committed whole).
    pub fn mark(&mut self, state: impl FnOnce() -> Option<Value>) -> bool {
        if self.mark.is_some() {
            return false;
        }
        let Some(&(sequence, _)) = self.pending.back() else {
            return false;
        };
        self.mark = Some((sequence, self.processed.clone(), state()));
        true
    }

    /// Everything up to `sequence` is durable. Returns what may be committed now, if it
    /// moves any partition forward.
    ///
    /// A stateful accumulator whose last pending boundaries just became durable gets a
    /// commit point even when no position moves: emitting changed its state (an interval
    /// flush emptied its batch), and the stored state, still holding what was emitted,
    /// would be emitted again after a restart. So does one whose mark's boundaries just
    /// became durable while later ones are pending.
    pub fn durable(&mut self, sequence: u64, stateful: bool) -> Option<CommitPoint> {
        let pending_before = self.pending.len();
        while self.pending.front().is_some_and(|(s, _)| *s <= sequence) {
            self.pending.pop_front();
        }
        let drained = self.pending.len() < pending_before;
        if stateful && !self.pending.is_empty() {
            let (_, folded, state) = self.mark.take_if(|(marked, ..)| *marked <= sequence)?;
            let mut positions = Vec::new();
            for (partition, offset) in folded {
                let committed = self.committed.entry(partition).or_insert(i64::MIN);
                if offset > *committed {
                    *committed = offset;
                    positions.push(Position { partition, offset });
                }
            }
            return Some(CommitPoint {
                positions,
                state: PointState::Marked(state),
            });
        }
        // The state as it is now, if stateful, supersedes a mark.
        self.mark = None;
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
            return (stateful && drained).then(|| CommitPoint {
                positions: Vec::new(),
                state: PointState::Current,
            });
        }
        for p in &positions {
            self.committed.insert(p.partition, p.offset);
        }
        Some(CommitPoint {
            positions,
            state: PointState::Current,
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
        let mut t = CommitTracker::new(&[], false);
        for (seq, off) in [(1, 0), (2, 1), (3, 2)] {
            t.processed(pos(0, off));
            let _ = t.emitted(seq, Some(pos(0, off)));
        }
        assert_eq!(
            t.durable(1, false),
            Some(CommitPoint {
                positions: vec![pos(0, 0)],
                state: PointState::Current,
            })
        );
        // Nothing new becomes safe.
        assert_eq!(t.durable(1, false), None);
        assert_eq!(
            t.durable(3, false),
            Some(CommitPoint {
                positions: vec![pos(0, 2)],
                state: PointState::Current,
            })
        );
    }

    #[test]
    fn filtered_events_are_committed_with_their_neighbours() {
        let mut t = CommitTracker::new(&[], false);
        t.processed(pos(0, 0));
        let _ = t.emitted(1, Some(pos(0, 0)));
        t.processed(pos(0, 1)); // produced no boundary
        t.processed(pos(0, 2));
        let _ = t.emitted(2, Some(pos(0, 2)));
        let point = t.durable(1, false).unwrap();
        assert_eq!(point.positions, vec![pos(0, 1)]);
    }

    #[test]
    fn partitions_are_tracked_separately() {
        let mut t = CommitTracker::new(&[], false);
        t.processed(pos(0, 5));
        let _ = t.emitted(1, Some(pos(0, 5)));
        t.processed(pos(1, 9));
        let _ = t.emitted(2, Some(pos(1, 9)));
        t.processed(pos(0, 6));
        let _ = t.emitted(3, Some(pos(0, 6)));
        let point = t.durable(2, false).unwrap();
        // Partition 0 stops before offset 6 (pending); partition 1 is done.
        assert_eq!(point.positions, vec![pos(0, 5), pos(1, 9)]);
    }

    #[test]
    fn stateful_commits_only_when_caught_up() {
        let mut t = CommitTracker::new(&[pos(0, 99)], true);
        t.processed(pos(0, 100));
        let _ = t.emitted(11, Some(pos(0, 100)));
        t.processed(pos(0, 101));
        let _ = t.emitted(12, Some(pos(0, 101)));
        t.processed(pos(0, 102)); // folded into state, nothing emitted
        assert_eq!(t.durable(11, true), None);
        assert_eq!(
            t.durable(12, true),
            Some(CommitPoint {
                positions: vec![pos(0, 102)],
                state: PointState::Current,
            })
        );
    }

    #[test]
    fn a_stateful_mark_commits_once_its_boundaries_are_durable_though_later_ones_are_not() {
        let mut t = CommitTracker::new(&[pos(0, 9)], true);
        assert!(
            !t.mark(|| unreachable!()),
            "nothing pending: the state is committed whole"
        );
        t.processed(pos(0, 10));
        let _ = t.emitted(1, Some(pos(0, 10)));
        t.processed(pos(0, 11)); // folded in, nothing emitted yet
        assert!(t.mark(|| Some(Value::from(11))));
        assert!(!t.mark(|| unreachable!()), "one mark at a time");
        t.processed(pos(0, 12));
        let _ = t.emitted(2, Some(pos(0, 12)));
        t.processed(pos(1, 3));
        let _ = t.emitted(3, Some(pos(1, 3)));
        assert_eq!(
            t.durable(0, true),
            None,
            "the mark's boundary is not durable"
        );
        assert_eq!(
            t.durable(2, true),
            Some(CommitPoint {
                positions: vec![pos(0, 11)],
                state: PointState::Marked(Some(Value::from(11))),
            }),
            "what the marked state had folded in, not what came after"
        );
        assert_eq!(t.durable(2, true), None, "the mark is used");
        assert_eq!(t.committed(), vec![pos(0, 11)]);
        // Nothing pending any more: the state as it is now, superseding a mark.
        t.processed(pos(0, 13));
        let _ = t.emitted(4, Some(pos(0, 13)));
        assert!(t.mark(|| None));
        assert_eq!(
            t.durable(4, true),
            Some(CommitPoint {
                positions: vec![pos(0, 13), pos(1, 3)],
                state: PointState::Current,
            })
        );
    }

    #[test]
    fn stateful_state_is_stored_when_an_emission_without_new_positions_is_durable() {
        let mut t = CommitTracker::new(&[], true);
        t.processed(pos(0, 1));
        t.processed(pos(0, 2));
        let _ = t.emitted(1, None);
        assert_eq!(t.durable(1, true).unwrap().positions, vec![pos(0, 2)]);
        // An interval flush: no new position, but the state it emptied must be stored.
        let _ = t.emitted(2, None);
        assert_eq!(t.durable(2, true).unwrap().positions, vec![]);
        // Nothing became durable: nothing to store.
        assert_eq!(t.durable(2, true), None);
        // A stateless accumulator's positions say everything.
        let mut t = CommitTracker::new(&[pos(0, 2)], false);
        let _ = t.emitted(1, None);
        assert_eq!(t.durable(1, false), None);
    }

    #[test]
    fn pending_boundaries_given_up_past_a_bound_hold_nothing_back() {
        let mut t = CommitTracker::new(&[], false);
        for offset in 0..5 {
            t.processed(pos(0, offset));
            let _ = t.emitted(offset as u64 + 1, Some(pos(0, offset)));
        }
        t.forget_pending_past(2);
        assert_eq!(t.pending(), 2);
        // Boundaries 4 and 5 (offsets 3 and 4) are left: offsets before 3 may go.
        assert_eq!(t.durable(0, false).unwrap().positions, vec![pos(0, 2)]);
        t.forget_pending_past(2);
        assert_eq!(t.pending(), 2, "nothing past the bound");
        assert_eq!(t.durable(5, false).unwrap().positions, vec![pos(0, 4)]);
    }

    #[test]
    fn redeliveries_of_what_was_taken_in_are_seen() {
        let mut t = CommitTracker::new(&[pos(0, 7)], false);
        assert!(t.seen(pos(0, 7)));
        assert!(t.seen(pos(0, 3)));
        assert!(!t.seen(pos(0, 8)));
        assert!(!t.seen(pos(1, 0)));
        t.processed(pos(0, 8));
        t.processed(pos(1, 2));
        assert!(t.seen(pos(0, 8)), "taken in, not yet committed");
        assert!(t.seen(pos(1, 0)));
        assert!(!t.seen(pos(1, 3)));
    }

    #[test]
    fn restored_positions_are_not_committed_again() {
        let mut t = CommitTracker::new(&[pos(0, 7)], false);
        assert_eq!(t.durable(4, false), None);
        t.processed(pos(0, 8));
        assert_eq!(t.durable(4, false).unwrap().positions, vec![pos(0, 8)]);
    }

    #[test]
    fn a_boundary_covers_every_partition_taken_in_since_the_last() {
        let mut t = CommitTracker::new(&[], false);
        t.processed(pos(1, 4));
        t.processed(pos(0, 8));
        t.processed(pos(1, 5));
        assert_eq!(
            t.emitted(1, Some(pos(1, 5))).to_vec(),
            vec![pos(0, 8), pos(1, 5)]
        );
        t.processed(pos(0, 9));
        assert_eq!(t.emitted(2, Some(pos(0, 9))).to_vec(), vec![pos(0, 9)]);
        assert_eq!(t.emitted(3, None).to_vec(), vec![]);
    }

    #[test]
    fn restored_state_covers_its_checkpoint() {
        let mut t = CommitTracker::new(&[pos(0, 7), pos(-1, 30)], true);
        assert_eq!(t.emitted(1, None).to_vec(), vec![pos(-1, 30), pos(0, 7)]);
        let mut t = CommitTracker::new(&[pos(0, 7)], false);
        assert_eq!(t.emitted(1, None).to_vec(), vec![]);
    }
}
