//! The lease table: reservations in flight, and tombstones of finished request ids.
//!
//! Sharded by request-id hash; each shard is a mutex around maps whose capacity is
//! reserved up front, so inserting a lease never allocates. A lease stores its request
//! id inline (at most [`MAX_REQUEST_ID_BYTES`]).
//!
//! Tombstones make completion idempotent: a completed id is remembered for
//! `tombstone_ttl_ms` (bounded by `max_tombstones`, oldest forgotten first), so a
//! duplicate completion is recognised and refunds nothing; an expired lease is kept
//! whole in its tombstone so that a late completion still produces its usage record.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::bucket::Slot;
use crate::config::{Dimension, MAX_LIMITS_PER_REQUEST, MAX_REQUEST_ID_BYTES, Mode};
use crate::key::{LimitKey, PassThroughState};

const SHARDS: usize = 32;

/// A request id stored inline.
#[derive(Clone)]
pub(crate) struct InlineId {
    len: u8,
    bytes: [u8; MAX_REQUEST_ID_BYTES],
}

impl InlineId {
    /// `id` must be at most [`MAX_REQUEST_ID_BYTES`] (checked by the caller).
    pub(crate) fn new(id: &str) -> InlineId {
        assert!(id.len() <= MAX_REQUEST_ID_BYTES);
        let mut bytes = [0u8; MAX_REQUEST_ID_BYTES];
        bytes[..id.len()].copy_from_slice(id.as_bytes());
        InlineId {
            len: id.len() as u8,
            bytes,
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        // Built from a &str and never modified.
        std::str::from_utf8(&self.bytes[..self.len as usize]).expect("inline id is UTF-8")
    }
}

/// One limit a lease holds a reservation on.
#[derive(Clone)]
pub struct LeaseLimit {
    pub(crate) slot: Arc<Slot>,
    pub(crate) dimension: Dimension,
    pub(crate) mode: Mode,
    /// Units reserved (tokens, requests, or 1 slot).
    pub(crate) reserved: u64,
    /// Raw amount debited from `slot` (ns for rate buckets, slots for concurrency).
    pub(crate) debited: u64,
    /// Units counted in the key's `held` until settled (token dimensions: `reserved`;
    /// requests and concurrency: 0).
    pub(crate) held: u64,
}

impl LeaseLimit {
    /// The limit key.
    pub fn key(&self) -> &LimitKey {
        &self.slot.key
    }

    /// The dimension.
    pub fn dimension(&self) -> Dimension {
        self.dimension
    }

    /// Units reserved at admission.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Enforce or shadow.
    pub fn mode(&self) -> Mode {
        self.mode
    }
}

/// A reservation in flight.
#[derive(Clone)]
pub(crate) struct Lease {
    pub(crate) id: InlineId,
    pub(crate) admitted_at_ns: u64,
    pub(crate) expires_at_ns: u64,
    pub(crate) input_tokens: u64,
    pub(crate) max_output_tokens: Option<u64>,
    pub(crate) limits: [Option<LeaseLimit>; MAX_LIMITS_PER_REQUEST],
    pub(crate) len: u8,
}

impl Lease {
    pub(crate) fn limits(&self) -> impl Iterator<Item = &LeaseLimit> {
        self.limits[..self.len as usize].iter().flatten()
    }
}

enum Tomb {
    Completed { at_ns: u64 },
    Expired { at_ns: u64, lease: Box<Lease> },
}

impl Tomb {
    fn at_ns(&self) -> u64 {
        match self {
            Tomb::Completed { at_ns } | Tomb::Expired { at_ns, .. } => *at_ns,
        }
    }
}

struct Shard {
    leases: HashMap<u128, Lease, PassThroughState>,
    tombs: HashMap<u128, Tomb, PassThroughState>,
    order: VecDeque<(u128, u64)>,
    max_leases: usize,
    max_tombs: usize,
}

impl Shard {
    fn tombstone(&mut self, hash: u128, tomb: Tomb) {
        let at = tomb.at_ns();
        if self.order.len() >= self.max_tombs {
            self.forget_oldest();
        }
        self.tombs.insert(hash, tomb);
        self.order.push_back((hash, at));
    }

    fn forget_oldest(&mut self) {
        if let Some((h, at)) = self.order.pop_front()
            && self.tombs.get(&h).is_some_and(|t| t.at_ns() == at)
        {
            self.tombs.remove(&h);
        }
    }
}

/// What removing a lease for completion found.
// The lease moves out by value once per completion; boxing it would allocate on the
// completion path.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Removed {
    /// The live lease (now tombstoned as completed).
    Live(Lease),
    /// Already completed (a duplicate).
    Completed,
    /// Expired earlier, not yet completed: the lease as it was (now tombstoned as
    /// completed, so a second late completion is a duplicate).
    Expired(Box<Lease>),
    /// Never seen, or forgotten.
    Unknown,
}

/// Why a lease could not be inserted. The lease is handed back for rollback.
pub(crate) enum InsertError {
    /// The table (this shard) is at its bound.
    Full(Lease),
    /// A live lease with the same id exists (a concurrent retry won).
    Exists(Lease),
}

pub(crate) struct LeaseTable {
    shards: Box<[Mutex<Shard>]>,
}

impl LeaseTable {
    pub(crate) fn new(max_leases: usize, max_tombstones: usize) -> LeaseTable {
        let per_shard = max_leases.div_ceil(SHARDS).max(1);
        let tombs_per_shard = max_tombstones.div_ceil(SHARDS).max(1);
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    leases: HashMap::with_capacity_and_hasher(per_shard, Default::default()),
                    tombs: HashMap::with_capacity_and_hasher(tombs_per_shard, Default::default()),
                    order: VecDeque::with_capacity(tombs_per_shard),
                    max_leases: per_shard,
                    max_tombs: tombs_per_shard,
                })
            })
            .collect();
        LeaseTable { shards }
    }

    fn shard(&self, hash: u128) -> MutexGuard<'_, Shard> {
        let i = (hash >> 64) as usize % SHARDS;
        // A poisoned shard means a bug panicked mid-update; the maps are still
        // structurally valid, so keep serving.
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the live lease for `id`, if any.
    pub(crate) fn with_live<R>(
        &self,
        hash: u128,
        id: &str,
        f: impl FnOnce(&Lease) -> R,
    ) -> Option<R> {
        let shard = self.shard(hash);
        shard
            .leases
            .get(&hash)
            .filter(|l| l.id.as_str() == id)
            .map(f)
    }

    // The lease is handed back by value so the caller can roll back without a copy or
    // an allocation.
    #[allow(clippy::result_large_err)]
    pub(crate) fn insert(&self, hash: u128, lease: Lease) -> Result<(), InsertError> {
        let mut shard = self.shard(hash);
        if shard.leases.contains_key(&hash) {
            return Err(InsertError::Exists(lease));
        }
        if shard.leases.len() >= shard.max_leases {
            return Err(InsertError::Full(lease));
        }
        shard.leases.insert(hash, lease);
        Ok(())
    }

    pub(crate) fn remove_for_completion(&self, hash: u128, id: &str, now: u64) -> Removed {
        let mut shard = self.shard(hash);
        if shard.leases.get(&hash).is_some_and(|l| l.id.as_str() == id) {
            let lease = shard.leases.remove(&hash).expect("checked above");
            shard.tombstone(hash, Tomb::Completed { at_ns: now });
            return Removed::Live(lease);
        }
        match shard.tombs.get(&hash) {
            Some(Tomb::Completed { .. }) => Removed::Completed,
            Some(Tomb::Expired { lease, .. }) if lease.id.as_str() == id => {
                let Some(Tomb::Expired { lease, .. }) = shard.tombs.remove(&hash) else {
                    unreachable!("matched above")
                };
                shard.tombstone(hash, Tomb::Completed { at_ns: now });
                Removed::Expired(lease)
            }
            _ => Removed::Unknown,
        }
    }

    /// Sets a live lease's expiry; returns false if there is no live lease.
    pub(crate) fn extend(&self, hash: u128, id: &str, expires_at_ns: u64) -> bool {
        let mut shard = self.shard(hash);
        match shard.leases.get_mut(&hash) {
            Some(l) if l.id.as_str() == id => {
                l.expires_at_ns = expires_at_ns;
                true
            }
            _ => false,
        }
    }

    /// Moves every lease expired at `now` into `out` and tombstones it; forgets
    /// tombstones older than `tomb_ttl_ns`.
    pub(crate) fn expire(&self, now: u64, tomb_ttl_ns: u64, out: &mut Vec<Lease>) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            let expired: Vec<u128> = shard
                .leases
                .iter()
                .filter(|(_, l)| l.expires_at_ns <= now)
                .map(|(h, _)| *h)
                .collect();
            for h in expired {
                let lease = shard.leases.remove(&h).expect("collected above");
                shard.tombstone(
                    h,
                    Tomb::Expired {
                        at_ns: now,
                        lease: Box::new(lease.clone()),
                    },
                );
                out.push(lease);
            }
            while let Some(&(_, at)) = shard.order.front() {
                if at.saturating_add(tomb_ttl_ns) > now {
                    break;
                }
                shard.forget_oldest();
            }
        }
    }

    /// Number of live leases.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).leases.len())
            .sum()
    }

    /// Visits every live lease (tests and invariant checks).
    pub(crate) fn for_each(&self, mut f: impl FnMut(&Lease)) {
        for shard in self.shards.iter() {
            let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            shard.leases.values().for_each(&mut f);
        }
    }
}
