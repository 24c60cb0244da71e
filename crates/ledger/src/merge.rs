//! Merge: set union keyed by [`EventKey`], with one deterministic conflict rule.
//!
//! An incoming event whose key is new is added. One whose canonical encoding equals
//! the stored one is a duplicate and changes nothing. One with the same key and a
//! different encoding is a **conflict**: the ledger keeps the event whose canonical
//! encoding is smaller (byte-wise), counts only that one, and records the other for
//! review. "Smaller encoding" is a total order that every node computes the same way,
//! so after seeing the same events every node keeps the same one, whatever the arrival
//! order, and the two are never summed.

use std::cmp::Ordering;

use crate::event::{Event, EventKey};

/// What merging one incoming event does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Merge {
    /// The key is new: store the event.
    New,
    /// Same key, same bytes: nothing changes.
    Duplicate,
    /// Same key, different bytes, and the stored event wins: keep it, record the
    /// incoming one as a conflict loser.
    KeepExisting,
    /// Same key, different bytes, and the incoming event wins: replace the stored one
    /// and record the stored one as a conflict loser.
    Replace,
}

/// Decides the merge of `incoming` against what is stored under its key (both as
/// canonical encodings).
pub fn resolve(existing: Option<&[u8]>, incoming: &[u8]) -> Merge {
    match existing {
        None => Merge::New,
        Some(old) => match incoming.cmp(old) {
            Ordering::Equal => Merge::Duplicate,
            Ordering::Greater => Merge::KeepExisting,
            Ordering::Less => Merge::Replace,
        },
    }
}

/// How one event of a batch was merged, as a store reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Stored; counted for the first time.
    New,
    /// Already held, identical.
    Duplicate,
    /// Same key, different payload: resolved by the conflict rule and recorded. The
    /// key is counted once either way.
    Conflict,
}

/// What a store did with a batch. Durable when returned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// One outcome per event, in batch order.
    pub outcomes: Vec<Outcome>,
    /// Events counted for the first time.
    pub new: u64,
    /// Identical events already held.
    pub duplicate: u64,
    /// Conflicting payloads (recorded; the key is counted once).
    pub conflict: u64,
}

impl ApplyReport {
    /// Appends one outcome.
    pub fn push(&mut self, o: Outcome) {
        match o {
            Outcome::New => self.new += 1,
            Outcome::Duplicate => self.duplicate += 1,
            Outcome::Conflict => self.conflict += 1,
        }
        self.outcomes.push(o);
    }
}

/// A recorded conflict: the payload the rule set aside.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    /// The contested key.
    pub key: EventKey,
    /// The event not counted.
    pub loser: Event,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smaller_encoding_wins_whichever_arrives_first() {
        let a = b"\x01aaa".as_slice();
        let b = b"\x01aab".as_slice();
        assert_eq!(resolve(None, a), Merge::New);
        assert_eq!(resolve(Some(a), a), Merge::Duplicate);
        assert_eq!(resolve(Some(a), b), Merge::KeepExisting);
        assert_eq!(resolve(Some(b), a), Merge::Replace);
    }
}
