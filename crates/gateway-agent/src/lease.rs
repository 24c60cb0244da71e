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

/// One request id's entry: a live lease (by slab index) or a tombstone.
///
/// Keyed by the low 64 bits of the request-id hash: a live entry is verified against
/// the id stored in its lease; a tombstone is not (a 64-bit collision among the
/// tombstones, ~2e-9 at 262,144 of them, at worst answers a stranger's completion as
/// a duplicate: nothing is refunded). Small entries keep the map cache-friendly.
enum Entry {
    Live(u32),
    Completed { at_ns: u64 },
    Expired(Box<(u64, Lease)>),
}

impl Entry {
    fn tomb_at(&self) -> Option<u64> {
        match self {
            Entry::Live(_) => None,
            Entry::Completed { at_ns } => Some(*at_ns),
            Entry::Expired(b) => Some(b.0),
        }
    }
}

/// One shard: a single map from request-id hash to live lease or tombstone (so a
/// completion is one lookup that turns the entry into a tombstone in place), and a slab
/// of leases with a free list. All capacity is reserved up front.
struct Shard {
    map: HashMap<u64, Entry, PassThroughState>,
    slab: Vec<Option<Lease>>,
    free: Vec<u32>,
    /// Tombstones in completion order (stale entries are skipped when popped).
    order: VecDeque<(u64, u64)>,
    tombs: usize,
    max_leases: usize,
    max_tombs: usize,
}

impl Shard {
    fn live(&self) -> usize {
        self.slab.len() - self.free.len()
    }

    /// Records a tombstone for `hash` (the caller has set the entry), forgetting the
    /// oldest if at the bound.
    fn note_tomb(&mut self, hash: u64, at_ns: u64, new_tomb: bool) {
        // Tombstones past `max_tombs` are forgotten by `expire` (the maintenance tick),
        // off the completion path; only past the hard bound (a quarter more, reserved
        // up front) does a completion forget the oldest itself.
        let hard = self.max_tombs + self.max_tombs / 4;
        while self.order.len() >= hard || (new_tomb && self.tombs >= hard) {
            if !self.forget_oldest() && self.order.is_empty() {
                break;
            }
        }
        if new_tomb {
            self.tombs += 1;
        }
        self.order.push_back((hash, at_ns));
    }

    /// Forgets the oldest tombstones until at most `max_tombs` remain.
    fn trim_tombs(&mut self) {
        while self.tombs > self.max_tombs || self.order.len() > self.max_tombs {
            if !self.forget_oldest() && self.order.is_empty() {
                break;
            }
        }
    }

    /// Pops the oldest tombstone record; returns true if it removed a tombstone.
    fn forget_oldest(&mut self) -> bool {
        let Some((h, at)) = self.order.pop_front() else {
            return false;
        };
        if self.map.get(&h).and_then(Entry::tomb_at) == Some(at) {
            self.map.remove(&h);
            self.tombs -= 1;
            return true;
        }
        false
    }

    fn take_live(&mut self, i: u32) -> Lease {
        let lease = self.slab[i as usize]
            .take()
            .expect("live entry has a lease");
        self.free.push(i);
        lease
    }
}

/// The shard map's key: the low word of the request-id hash (the high word picks the
/// shard).
fn key(hash: u128) -> u64 {
    hash as u64
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
    /// Expired earlier, not yet completed: (expiry time, the lease as it was), now
    /// tombstoned as completed, so a second late completion is a duplicate.
    Expired(Box<(u64, Lease)>),
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
                    map: HashMap::with_capacity_and_hasher(
                        per_shard + tombs_per_shard + tombs_per_shard / 4,
                        Default::default(),
                    ),
                    // Reserved, not initialised: pages are touched as leases arrive.
                    slab: Vec::with_capacity(per_shard),
                    free: Vec::with_capacity(per_shard),
                    max_leases: per_shard,
                    order: VecDeque::with_capacity(tombs_per_shard + tombs_per_shard / 4),
                    tombs: 0,
                    max_tombs: tombs_per_shard,
                })
            })
            .collect();
        LeaseTable { shards }
    }

    fn shard(&self, hash: u128) -> MutexGuard<'_, Shard> {
        let i = (hash >> 64) as usize % SHARDS;
        // The map below is keyed by the low word (`key`).
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
        match shard.map.get(&key(hash)) {
            Some(Entry::Live(i)) => shard.slab[*i as usize]
                .as_ref()
                .filter(|l| l.id.as_str() == id)
                .map(f),
            _ => None,
        }
    }

    // The lease is handed back by value so the caller can roll back without a copy or
    // an allocation.
    #[allow(clippy::result_large_err)]
    pub(crate) fn insert(&self, hash: u128, lease: Lease) -> Result<(), InsertError> {
        let mut shard = self.shard(hash);
        let shard = &mut *shard;
        let hash = key(hash);
        // One probe of the map: the entry decides.
        let entry = shard.map.entry(hash);
        if let std::collections::hash_map::Entry::Occupied(e) = &entry
            && matches!(e.get(), Entry::Live(_))
        {
            return Err(InsertError::Exists(lease));
        }
        let i = match shard.free.pop() {
            Some(i) => {
                shard.slab[i as usize] = Some(lease);
                i
            }
            None if shard.slab.len() < shard.max_leases => {
                // Within the reserved capacity: no reallocation.
                shard.slab.push(Some(lease));
                (shard.slab.len() - 1) as u32
            }
            None => return Err(InsertError::Full(lease)),
        };
        match entry {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                // A finished id admitted again: its tombstone gives way to the new lease
                // (its order record goes stale and is skipped).
                e.insert(Entry::Live(i));
                shard.tombs -= 1;
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Entry::Live(i));
            }
        }
        Ok(())
    }

    pub(crate) fn remove_for_completion(&self, hash: u128, id: &str, now: u64) -> Removed {
        let mut shard = self.shard(hash);
        let shard = &mut *shard;
        let hash = key(hash);
        let Some(entry) = shard.map.get_mut(&hash) else {
            return Removed::Unknown;
        };
        match entry {
            Entry::Live(i) => {
                let i = *i;
                if shard.slab[i as usize]
                    .as_ref()
                    .is_none_or(|l| l.id.as_str() != id)
                {
                    return Removed::Unknown;
                }
                *entry = Entry::Completed { at_ns: now };
                let lease = shard.take_live(i);
                shard.note_tomb(hash, now, true);
                Removed::Live(lease)
            }
            Entry::Completed { .. } => Removed::Completed,
            Entry::Expired(b) if b.1.id.as_str() == id => {
                let Entry::Expired(b) = std::mem::replace(entry, Entry::Completed { at_ns: now })
                else {
                    unreachable!("matched above")
                };
                shard.note_tomb(hash, now, false);
                Removed::Expired(b)
            }
            Entry::Expired(_) => Removed::Unknown,
        }
    }

    /// Sets a live lease's expiry; returns false if there is no live lease.
    pub(crate) fn extend(&self, hash: u128, id: &str, expires_at_ns: u64) -> bool {
        let mut shard = self.shard(hash);
        let shard = &mut *shard;
        match shard.map.get(&key(hash)) {
            Some(Entry::Live(i)) => match shard.slab[*i as usize].as_mut() {
                Some(l) if l.id.as_str() == id => {
                    l.expires_at_ns = expires_at_ns;
                    true
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// Moves every lease expired at `now` into `out` and tombstones it; forgets
    /// tombstones older than `tomb_ttl_ns`.
    pub(crate) fn expire(&self, now: u64, tomb_ttl_ns: u64, out: &mut Vec<Lease>) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            let expired: Vec<u64> = shard
                .map
                .iter()
                .filter(|(_, e)| match e {
                    Entry::Live(i) => shard.slab[*i as usize]
                        .as_ref()
                        .is_some_and(|l| l.expires_at_ns <= now),
                    _ => false,
                })
                .map(|(h, _)| *h)
                .collect();
            for h in expired {
                let Some(Entry::Live(i)) = shard.map.get(&h) else {
                    continue;
                };
                let i = *i;
                let lease = shard.take_live(i);
                shard
                    .map
                    .insert(h, Entry::Expired(Box::new((now, lease.clone()))));
                shard.note_tomb(h, now, true);
                out.push(lease);
            }
            while let Some(&(_, at)) = shard.order.front() {
                if at.saturating_add(tomb_ttl_ns) > now {
                    break;
                }
                shard.forget_oldest();
            }
            shard.trim_tombs();
        }
    }

    /// Number of live leases.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).live())
            .sum()
    }

    /// Visits every live lease (tests and invariant checks).
    pub(crate) fn for_each(&self, mut f: impl FnMut(&Lease)) {
        for shard in self.shards.iter() {
            let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            shard.slab.iter().flatten().for_each(&mut f);
        }
    }
}
