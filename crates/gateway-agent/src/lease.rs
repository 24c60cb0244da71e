//! The lease table: reservations in flight, and tombstones of finished request ids.
//!
//! Sharded by request-id hash; each shard is a mutex around a request-id map, a slab
//! of leases and a tombstone queue, all bounded. The slab and queue are reserved up
//! front; the map doubles from 1 KiB as the shard fills, up to its bound (at most nine
//! doublings per shard at the defaults), and after that inserting a lease never
//! allocates. A lease's request id (at most [`MAX_REQUEST_ID_BYTES`]) is stored beside
//! it, written once.
//!
//! Tombstones make completion idempotent: a completed id is remembered for
//! `tombstone_ttl_ms` (bounded by `max_tombstones`, oldest forgotten first), so a
//! duplicate completion is recognised and refunds nothing; an expired lease is kept
//! whole in its tombstone so that a late completion still produces its usage record.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

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
    // Used by the shell's outbox; the engine alone (no `shell` feature) does not.
    #[cfg_attr(not(feature = "shell"), allow(dead_code))]
    pub(crate) fn new(id: &str) -> InlineId {
        assert!(id.len() <= MAX_REQUEST_ID_BYTES);
        let mut bytes = [0u8; MAX_REQUEST_ID_BYTES];
        bytes[..id.len()].copy_from_slice(id.as_bytes());
        InlineId {
            len: id.len() as u8,
            bytes,
        }
    }

    /// Overwrites the id in place, copying only `id`'s bytes (the rest are stale and
    /// never read). `id` must be at most [`MAX_REQUEST_ID_BYTES`].
    #[inline]
    pub(crate) fn set(&mut self, id: &str) {
        assert!(id.len() <= MAX_REQUEST_ID_BYTES);
        self.bytes[..id.len()].copy_from_slice(id.as_bytes());
        self.len = id.len() as u8;
    }

    pub(crate) const EMPTY: InlineId = InlineId {
        len: 0,
        bytes: [0; MAX_REQUEST_ID_BYTES],
    };

    /// True when this is `id` (bytes compared; no UTF-8 check on the decision path).
    #[inline]
    pub(crate) fn is(&self, id: &str) -> bool {
        &self.bytes[..self.len as usize] == id.as_bytes()
    }

    pub(crate) fn as_str(&self) -> &str {
        // Built from a &str and never modified.
        std::str::from_utf8(&self.bytes[..self.len as usize]).expect("inline id is UTF-8")
    }
}

/// One limit a lease holds a reservation on, named by its key's hashes: a lease keeps
/// no reference to the key's slot (a reference count taken at admission and dropped at
/// completion was three locked instructions each way for three limits, ~100 ns of an
/// admit + complete). Completion looks the key up in the table it reads anyway. The
/// key's names (for the usage record) are the slot's while the key lives; a key
/// evicted while a lease names it gives the lease its names first ([`Lease::names`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LeaseLimit {
    /// The key's id as hashed (before any probing) and its check hash: what
    /// `KeyTable::lookup` takes.
    pub(crate) id: u64,
    pub(crate) check: u64,
    /// The generation of the rate bucket debited (`Slot::generation`; 0 for
    /// concurrency slots): a refund is exact in ns on that bucket, in units on a
    /// replacement.
    pub(crate) generation: u64,
    /// Units reserved (tokens, requests, or 1 slot).
    pub(crate) reserved: u64,
    /// Raw amount debited (ns for rate buckets, slots for concurrency).
    pub(crate) debited: u64,
    pub(crate) rule: u32,
    pub(crate) dimension: Dimension,
    pub(crate) mode: Mode,
    /// True when `reserved` is counted in the key's `held` until settled (token
    /// dimensions that debited something; requests and concurrency never hold).
    pub(crate) holds: bool,
}

impl LeaseLimit {
    /// Units counted in the key's `held` until settled.
    #[inline]
    pub(crate) fn held(&self) -> u64 {
        if self.holds { self.reserved } else { 0 }
    }
}

/// The names of a lease's keys, by limit: set only for keys that may leave the table
/// while the lease needs them (evicted while it was live, or expired leases kept for a
/// late completion).
pub(crate) type LeaseNames = [Option<Arc<LimitKey>>; MAX_LIMITS_PER_REQUEST];

/// A reservation in flight. Its request id is kept beside it in the shard (written
/// once, never moved with the lease).
#[derive(Clone)]
pub(crate) struct Lease {
    pub(crate) admitted_at_ns: u64,
    pub(crate) expires_at_ns: u64,
    pub(crate) input_tokens: u64,
    pub(crate) max_output_tokens: Option<u64>,
    pub(crate) limits: [Option<LeaseLimit>; MAX_LIMITS_PER_REQUEST],
    pub(crate) len: u8,
    /// In a shard's slab: whether the entry holds a live lease (entries are reused in
    /// place, not moved in and out).
    live: bool,
    /// Names of keys that left (or may leave) the table while this lease names them.
    pub(crate) names: Option<Box<LeaseNames>>,
}

/// A lease's fields other than its limits: what admission builds before the insert.
#[derive(Clone, Copy)]
pub(crate) struct LeaseHead {
    pub(crate) admitted_at_ns: u64,
    pub(crate) expires_at_ns: u64,
    pub(crate) input_tokens: u64,
    pub(crate) max_output_tokens: Option<u64>,
}

impl Lease {
    /// No lease: a slab entry before its first use, or a completion's buffer.
    pub(crate) const EMPTY: Lease = Lease {
        admitted_at_ns: 0,
        expires_at_ns: 0,
        input_tokens: 0,
        max_output_tokens: None,
        limits: [None; MAX_LIMITS_PER_REQUEST],
        len: 0,
        live: false,
        names: None,
    };

    pub(crate) fn limits(&self) -> impl Iterator<Item = &LeaseLimit> {
        self.limits[..self.len as usize].iter().flatten()
    }

    /// The lease's limits by position (what `name` is indexed by); past `len` an entry
    /// may hold an earlier lease's limits.
    #[inline]
    pub(crate) fn limit_slots(&self) -> &[Option<LeaseLimit>] {
        &self.limits[..self.len as usize]
    }

    /// Copies `from`'s fields in use into `self` (its names moved) and marks `from` no
    /// longer live: `from` is a slab entry being finished. The unused part of the
    /// limits is not copied.
    #[inline]
    fn take_from(&mut self, from: &mut Lease) {
        self.admitted_at_ns = from.admitted_at_ns;
        self.expires_at_ns = from.expires_at_ns;
        self.input_tokens = from.input_tokens;
        self.max_output_tokens = from.max_output_tokens;
        let n = from.len as usize;
        self.limits[..n].copy_from_slice(&from.limits[..n]);
        self.len = from.len;
        self.live = false;
        self.names = from.names.take();
        from.live = false;
    }

    /// The name kept for limit `j`, if one was.
    #[inline]
    pub(crate) fn name(&self, j: usize) -> Option<&Arc<LimitKey>> {
        self.names.as_ref().and_then(|n| n[j].as_ref())
    }

    /// Keeps the name of limit `j`.
    pub(crate) fn keep_name(&mut self, j: usize, key: &Arc<LimitKey>) {
        let names = self
            .names
            .get_or_insert_with(|| Box::new([const { None }; MAX_LIMITS_PER_REQUEST]));
        if names[j].is_none() {
            names[j] = Some(Arc::clone(key));
        }
    }
}

/// One request id's entry in a shard's [`IdMap`]: a live lease (by slab index) or a
/// tombstone, packed in one word (the top two bits say which).
///
/// Keyed by the low 64 bits of the request-id hash: a live entry is verified against
/// the id stored in its lease; a tombstone is not (a 64-bit collision among the
/// tombstones, ~2e-9 at 262,144 of them, at worst answers a stranger's completion as
/// a duplicate: nothing is refunded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Live(u32),
    Completed {
        at_ns: u64,
    },
    /// Expired and not yet completed; the lease waits in the shard's `expired` map.
    Expired {
        at_ns: u64,
    },
}

const TAG_SHIFT: u32 = 62;
const TIME_MASK: u64 = (1 << TAG_SHIFT) - 1;

impl Entry {
    fn pack(self) -> u64 {
        match self {
            Entry::Live(i) => i as u64,
            Entry::Completed { at_ns } => (1 << TAG_SHIFT) | at_ns.min(TIME_MASK),
            Entry::Expired { at_ns } => (2 << TAG_SHIFT) | at_ns.min(TIME_MASK),
        }
    }

    fn unpack(v: u64) -> Entry {
        match v >> TAG_SHIFT {
            0 => Entry::Live(v as u32),
            1 => Entry::Completed {
                at_ns: v & TIME_MASK,
            },
            _ => Entry::Expired {
                at_ns: v & TIME_MASK,
            },
        }
    }

    fn tomb_at(self) -> Option<u64> {
        match self {
            Entry::Live(_) => None,
            Entry::Completed { at_ns } | Entry::Expired { at_ns } => Some(at_ns),
        }
    }
}

/// The request-id map of one shard: open addressing with linear probing over 16-byte
/// cells (key, entry), the key and its entry side by side, four cells to 64 bytes.
///
/// Why not `std`'s `HashMap`: its control bytes and its entries live in two arrays, so
/// every lookup of a request id never seen before (the common case: the table holds up
/// to `max_tombstones` old ids) paid two cache misses; profiles of admit + complete
/// put ~26 % of the time there. Here a lookup touches one line (two when its probe
/// run crosses a line end). It is kept at most half full, so a probe run ends at an
/// empty cell: it doubles while the shard fills, up to twice the entries the shard
/// may hold, and from there never allocates. (Zeroed up front at full size, 16 MiB an
/// engine at the defaults, it tripled a 1,000-gateway simulation's memory: `calloc`
/// of small blocks touches every page.) Removal shifts later cells of the run back
/// (no deleted markers to pile up).
struct IdMap {
    /// `[key, packed entry]`; key 0 marks an empty cell.
    cells: Box<[[u64; 2]]>,
    /// Cells - 1 (a power of two minus one).
    mask: usize,
    len: usize,
    /// The most cells it grows to: twice the entries the shard may hold.
    max_cells: usize,
}

/// Cells an [`IdMap`] starts with (1 KiB): a shard grows by doubling as it fills,
/// so memory follows use (a simulator runs thousands of engines, most shards lightly
/// used) and stops allocating once its steady state is reached.
const ID_MAP_INITIAL_CELLS: usize = 64;

/// Where a probe ended: at the key's cell, or at the empty cell where it would go.
enum Probe {
    Found(usize),
    Vacant(usize),
}

impl IdMap {
    /// A map for at most `max` entries.
    fn with_max(max: usize) -> IdMap {
        let max_cells = (max.max(2) * 2).next_power_of_two().max(4);
        let cells = max_cells.min(ID_MAP_INITIAL_CELLS);
        IdMap {
            cells: vec![[0u64; 2]; cells].into_boxed_slice(),
            mask: cells - 1,
            len: 0,
            max_cells,
        }
    }

    /// Makes room for one more entry: doubles the cells (rehashing every entry) when
    /// it would pass half full, up to `max_cells`, where the shard's own bounds keep it
    /// at most half full. Call before a probe whose vacant cell will be filled.
    #[inline]
    fn reserve_one(&mut self) {
        let cells = self.mask + 1;
        if (self.len + 1) * 2 > cells && cells < self.max_cells {
            self.grow(cells * 2);
        }
    }

    #[cold]
    fn grow(&mut self, cells: usize) {
        let old = std::mem::replace(&mut self.cells, vec![[0u64; 2]; cells].into_boxed_slice());
        self.mask = cells - 1;
        for [key, val] in old.iter().copied().filter(|c| c[0] != 0) {
            let mut i = key as usize & self.mask;
            while self.cells[i][0] != 0 {
                i = (i + 1) & self.mask;
            }
            self.cells[i] = [key, val];
        }
    }

    /// Keys are uniform hashes; 0 marks an empty cell, so it is folded onto 1 (live
    /// entries are verified against their id anyway).
    #[inline]
    fn norm(key: u64) -> u64 {
        key.max(1)
    }

    #[inline]
    fn key_at(&self, i: usize) -> u64 {
        self.cells[i][0]
    }

    #[inline]
    fn probe(&self, key: u64) -> Probe {
        let key = Self::norm(key);
        let mut i = key as usize & self.mask;
        loop {
            let k = self.key_at(i);
            if k == key {
                return Probe::Found(i);
            }
            if k == 0 {
                return Probe::Vacant(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    #[inline]
    fn get(&self, key: u64) -> Option<Entry> {
        match self.probe(key) {
            Probe::Found(i) => Some(Entry::unpack(self.cells[i][1])),
            Probe::Vacant(_) => None,
        }
    }

    #[inline]
    fn entry_at(&self, i: usize) -> Entry {
        Entry::unpack(self.cells[i][1])
    }

    #[inline]
    fn set_at(&mut self, i: usize, e: Entry) {
        self.cells[i][1] = e.pack();
    }

    /// Fills the vacant cell `i` (from [`IdMap::probe`] with no change in between).
    #[inline]
    fn insert_at(&mut self, i: usize, key: u64, e: Entry) {
        debug_assert!(self.len < self.mask / 2 + 1, "IdMap over half full");
        self.cells[i] = [Self::norm(key), e.pack()];
        self.len += 1;
    }

    /// Inserts or overwrites `key`.
    fn insert(&mut self, key: u64, e: Entry) {
        self.reserve_one();
        match self.probe(key) {
            Probe::Found(i) => self.set_at(i, e),
            Probe::Vacant(i) => self.insert_at(i, key, e),
        }
    }

    /// Empties cell `i` and moves later cells of its probe run back, so that every key
    /// stays reachable from its home cell without passing an empty one.
    fn remove_at(&mut self, mut hole: usize) {
        self.cells[hole] = [0, 0];
        self.len -= 1;
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let c = self.cells[j];
            if c[0] == 0 {
                return;
            }
            let home = c[0] as usize & self.mask;
            // The cell at `j` may move to `hole` unless its home lies cyclically in
            // (hole, j]: then the hole is before its home and it must stay.
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.cells[hole] = c;
                self.cells[j] = [0, 0];
                hole = j;
            }
        }
    }

    #[cfg(test)]
    fn remove(&mut self, key: u64) {
        if let Probe::Found(i) = self.probe(key) {
            self.remove_at(i);
        }
    }
}

/// One shard: a single map from request-id hash to live lease or tombstone (so a
/// completion is one lookup that turns the entry into a tombstone in place), and a slab
/// of leases with a free list. Bounded; see the module docs for what is reserved.
struct Shard {
    map: IdMap,
    slab: Vec<Lease>,
    /// The map key of each slab entry (the maintenance tick walks the slab, not the map).
    slab_keys: Vec<u64>,
    free: Vec<u32>,
    /// The request id of each slab entry.
    slab_ids: Vec<InlineId>,
    /// Expired leases not yet completed, by map key (off the decision path).
    expired: HashMap<u64, Box<Expired>, PassThroughState>,
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
        self.order.push_back((hash, at_ns.min(TIME_MASK)));
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
        let Probe::Found(i) = self.map.probe(h) else {
            return false;
        };
        let e = self.map.entry_at(i);
        if e.tomb_at() != Some(at) {
            return false;
        }
        self.map.remove_at(i);
        if matches!(e, Entry::Expired { .. }) {
            self.expired.remove(&h);
        }
        self.tombs -= 1;
        true
    }

    fn take_live(&mut self, i: u32) -> Lease {
        let mut lease = Lease::EMPTY;
        lease.take_from(&mut self.slab[i as usize]);
        self.free.push(i);
        lease
    }
}

/// The shard map's key: the low word of the request-id hash (the high word picks the
/// shard).
fn key(hash: u128) -> u64 {
    hash as u64
}

/// A lease that expired before it was completed, with its id (its expiry time is in
/// the map entry).
pub(crate) struct Expired {
    pub(crate) id: InlineId,
    pub(crate) lease: Lease,
}

/// What removing a lease for completion found.
pub(crate) enum Removed {
    /// The live lease, moved into the caller's slot (now tombstoned as completed).
    Live,
    /// Already completed (a duplicate).
    Completed,
    /// Expired earlier, not yet completed: the lease as it was, now tombstoned as
    /// completed, so a second late completion is a duplicate.
    Expired(Box<Expired>),
    /// Never seen, or forgotten.
    Unknown,
}

/// Why a lease could not be inserted. Its limits stay with the caller for rollback.
pub(crate) enum InsertError {
    /// The table (this shard) is at its bound.
    Full,
    /// A live lease with the same id exists (a concurrent retry won).
    Exists,
    /// The id finished here and is still remembered: completed, or expired and
    /// waiting for its late completion (`expired`).
    Finished {
        /// Expired rather than completed.
        expired: bool,
    },
}

pub(crate) struct LeaseTable {
    shards: Box<[Mutex<Shard>]>,
}

impl LeaseTable {
    pub(crate) fn new(max_leases: usize, max_tombstones: usize) -> LeaseTable {
        let per_shard = max_leases.div_ceil(SHARDS).max(1);
        let tombs_per_shard = max_tombstones.div_ceil(SHARDS).max(1);
        let hard_tombs = tombs_per_shard + tombs_per_shard / 4;
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    map: IdMap::with_max(per_shard + hard_tombs),
                    // Reserved, not initialised: pages are touched as leases arrive.
                    slab: Vec::with_capacity(per_shard),
                    slab_keys: Vec::with_capacity(per_shard),
                    slab_ids: Vec::with_capacity(per_shard),
                    free: Vec::with_capacity(per_shard),
                    expired: HashMap::default(),
                    max_leases: per_shard,
                    order: VecDeque::with_capacity(hard_tombs),
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
        match shard.map.get(key(hash)) {
            Some(Entry::Live(i)) if shard.slab_ids[i as usize].is(id) => {
                let l = &shard.slab[i as usize];
                l.live.then(|| f(l))
            }
            _ => None,
        }
    }

    /// Inserts a lease for `id`: `head`, and the first `n` of `held`. On an error
    /// nothing changed, for rollback.
    ///
    /// `sealed(j)`: the key of limit `j` if the lease must keep its name: its slot has
    /// been sealed since it was debited (checked here, under the shard's lock), or the
    /// table snapshot did not show it. An eviction seals its slots, then gives their
    /// names to the live leases that name them, shard by shard
    /// ([`LeaseTable::keep_names`]), then publishes a table without them; a lease
    /// inserted after that pass reached this shard finds its slot sealed here (the
    /// shard's lock orders the two) and keeps the name itself. A completion reads a
    /// snapshot loaded before it removed the lease: either the eviction's pass saw the
    /// lease, or the snapshot still shows the sealed slot. A slice change seals a slot
    /// too: its replacement has the same key, so the name kept is just not needed.
    pub(crate) fn insert<'k>(
        &self,
        hash: u128,
        id: &str,
        head: LeaseHead,
        held: &[Option<LeaseLimit>; MAX_LIMITS_PER_REQUEST],
        n: usize,
        sealed: impl Fn(usize) -> Option<&'k Arc<LimitKey>>,
    ) -> Result<(), InsertError> {
        let mut shard = self.shard(hash);
        let shard = &mut *shard;
        let hash = key(hash);
        shard.map.reserve_one();
        // One probe of the map: the entry decides.
        let vacant = match shard.map.probe(hash) {
            Probe::Vacant(p) => p,
            // A finished id is not a new request while it is remembered: an expired
            // lease waits for its late completion (a new lease under its id would take
            // that completion), and a completed one's id is its usage record's (the
            // ledger keeps one event per id).
            Probe::Found(p) => {
                return Err(match shard.map.entry_at(p) {
                    Entry::Live(_) => InsertError::Exists,
                    Entry::Expired { .. } => InsertError::Finished { expired: true },
                    Entry::Completed { .. } => InsertError::Finished { expired: false },
                });
            }
        };
        let i = match shard.free.pop() {
            Some(i) => i,
            None if shard.slab.len() < shard.max_leases => {
                // Within the reserved capacity: no reallocation.
                shard.slab.push(Lease::EMPTY);
                shard.slab_keys.push(0);
                shard.slab_ids.push(InlineId::EMPTY);
                (shard.slab.len() - 1) as u32
            }
            None => return Err(InsertError::Full),
        };
        // Written in place: only the fields and limits in use.
        let lease = &mut shard.slab[i as usize];
        lease.admitted_at_ns = head.admitted_at_ns;
        lease.expires_at_ns = head.expires_at_ns;
        lease.input_tokens = head.input_tokens;
        lease.max_output_tokens = head.max_output_tokens;
        lease.limits[..n].copy_from_slice(&held[..n]);
        lease.len = n as u8;
        lease.live = true;
        lease.names = None;
        for j in 0..n {
            if let Some(key) = sealed(j) {
                lease.keep_name(j, key);
            }
        }
        shard.slab_keys[i as usize] = hash;
        shard.slab_ids[i as usize].set(id);
        shard.map.insert_at(vacant, hash, Entry::Live(i));
        Ok(())
    }

    /// Removes `id`'s live lease for completion into `out` (its fields in use copied
    /// into a buffer the caller owns), or reports what the id's entry says instead.
    pub(crate) fn remove_for_completion(
        &self,
        hash: u128,
        id: &str,
        now: u64,
        out: &mut Lease,
    ) -> Removed {
        let mut shard = self.shard(hash);
        let shard = &mut *shard;
        let hash = key(hash);
        let Probe::Found(p) = shard.map.probe(hash) else {
            return Removed::Unknown;
        };
        match shard.map.entry_at(p) {
            Entry::Live(i) => {
                if !shard.slab_ids[i as usize].is(id) {
                    return Removed::Unknown;
                }
                shard.map.set_at(p, Entry::Completed { at_ns: now });
                out.take_from(&mut shard.slab[i as usize]);
                shard.free.push(i);
                shard.note_tomb(hash, now, true);
                Removed::Live
            }
            Entry::Completed { .. } => Removed::Completed,
            Entry::Expired { .. } => {
                if shard.expired.get(&hash).is_none_or(|b| !b.id.is(id)) {
                    return Removed::Unknown;
                }
                let b = shard.expired.remove(&hash).expect("checked above");
                shard.map.set_at(p, Entry::Completed { at_ns: now });
                shard.note_tomb(hash, now, false);
                Removed::Expired(b)
            }
        }
    }

    /// Sets a live lease's expiry; returns false if there is no live lease.
    /// Moves `id`'s lease end to `expires_at_ns` if it is live at `now`: past its TTL
    /// it is not, reaped or not (the maintenance tick reaps it on its next pass).
    pub(crate) fn extend(&self, hash: u128, id: &str, now: u64, expires_at_ns: u64) -> bool {
        let mut shard = self.shard(hash);
        let shard = &mut *shard;
        match shard.map.get(key(hash)) {
            Some(Entry::Live(i)) if shard.slab_ids[i as usize].is(id) => {
                let l = &mut shard.slab[i as usize];
                let live = l.live && l.expires_at_ns > now;
                if live {
                    l.expires_at_ns = expires_at_ns;
                }
                live
            }
            _ => false,
        }
    }

    /// Moves every lease expired at `now` into `out` (with its id) and tombstones it;
    /// forgets tombstones older than `tomb_ttl_ns`. An expired lease waits for a late
    /// completion with its keys' names (`name_of`), which may leave the table meanwhile.
    pub(crate) fn expire(
        &self,
        now: u64,
        until: u64,
        tomb_ttl_ns: u64,
        out: &mut Vec<(InlineId, Lease)>,
        name_of: impl Fn(&LeaseLimit) -> Option<Arc<LimitKey>>,
    ) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            let shard = &mut *shard;
            for i in 0..shard.slab.len() {
                if !shard.slab[i].live || shard.slab[i].expires_at_ns > until {
                    continue;
                }
                let h = shard.slab_keys[i];
                let id = shard.slab_ids[i].clone();
                let mut lease = shard.take_live(i as u32);
                for j in 0..lease.len as usize {
                    let Some(l) = lease.limits[j] else { continue };
                    if lease.name(j).is_none()
                        && let Some(key) = name_of(&l)
                    {
                        lease.keep_name(j, &key);
                    }
                }
                shard.map.insert(h, Entry::Expired { at_ns: now });
                shard.expired.insert(
                    h,
                    Box::new(Expired {
                        id: id.clone(),
                        lease: lease.clone(),
                    }),
                );
                shard.note_tomb(h, now, true);
                out.push((id, lease));
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

    /// Gives every live lease that names one of `gone`'s keys (by check hash and rule)
    /// that key's name: the keys were just evicted (their slots sealed first; see
    /// [`LeaseTable::insert`] for a lease inserted meanwhile). Off the decision path:
    /// a walk of the live leases, shard by shard, only when keys were evicted.
    pub(crate) fn keep_names(&self, gone: &HashMap<u64, Arc<LimitKey>>) {
        if gone.is_empty() {
            return;
        }
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            for lease in shard.slab.iter_mut().filter(|l| l.live) {
                for j in 0..lease.len as usize {
                    let Some(l) = lease.limits[j] else { continue };
                    if let Some(key) = gone.get(&l.check)
                        && key.rule == l.rule
                    {
                        lease.keep_name(j, key);
                    }
                }
            }
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
            shard.slab.iter().filter(|l| l.live).for_each(&mut f);
        }
    }

    /// Visits every expired lease kept for a late completion (invariant checks).
    pub(crate) fn for_each_expired(&self, mut f: impl FnMut(&Lease)) {
        for shard in self.shards.iter() {
            let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            shard.expired.values().for_each(|b| f(&b.lease));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The map agrees with a `HashMap` model under any mix of inserts, overwrites
        /// and removals, including keys that share a home cell and runs that wrap
        /// around the end of the table (small tables, keys from a small range).
        #[test]
        fn id_map_matches_a_model(
            ops in proptest::collection::vec((0u8..3, 0u64..64, 0u64..1_000), 1..400),
        ) {
            let mut m = IdMap::with_max(16);
            let mut model: HashMap<u64, Entry> = HashMap::new();
            for (op, k, v) in ops {
                // Keys spread over few home cells: long runs, wrap-around.
                let k = k * 8 + 1;
                match op {
                    0 | 1 if model.len() < 16 || model.contains_key(&k) => {
                        let e = if op == 0 {
                            Entry::Live(v as u32)
                        } else {
                            Entry::Completed { at_ns: v }
                        };
                        m.insert(k, e);
                        model.insert(k, e);
                    }
                    0 | 1 => {}
                    _ => {
                        m.remove(k);
                        model.remove(&k);
                    }
                }
                prop_assert_eq!(m.len, model.len());
                for (mk, mv) in &model {
                    prop_assert_eq!(m.get(*mk), Some(*mv));
                }
                for absent in 0..64u64 {
                    let k = absent * 8 + 1;
                    if !model.contains_key(&k) {
                        prop_assert_eq!(m.get(k), None);
                    }
                }
            }
        }
    }

    #[test]
    fn entries_pack_and_unpack() {
        for e in [
            Entry::Live(0),
            Entry::Live(u32::MAX),
            Entry::Completed { at_ns: 0 },
            Entry::Completed { at_ns: TIME_MASK },
            Entry::Expired { at_ns: 12_345 },
        ] {
            assert_eq!(Entry::unpack(e.pack()), e);
        }
        // Times past 2^62 ns (146 years) saturate rather than corrupt the tag.
        assert_eq!(
            Entry::unpack(Entry::Completed { at_ns: u64::MAX }.pack()),
            Entry::Completed { at_ns: TIME_MASK }
        );
    }

    #[test]
    fn the_map_grows_from_small_to_its_bound_and_keeps_every_entry() {
        let mut m = IdMap::with_max(10_000);
        assert_eq!(m.mask + 1, ID_MAP_INITIAL_CELLS);
        for k in 1..=10_000u64 {
            m.insert(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), Entry::Live(k as u32));
        }
        assert_eq!(
            m.mask + 1,
            32_768,
            "twice the bound, rounded up: its final size"
        );
        assert_eq!(m.len, 10_000);
        for k in 1..=10_000u64 {
            assert_eq!(
                m.get(k.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                Some(Entry::Live(k as u32))
            );
        }
    }

    #[test]
    fn key_zero_is_stored() {
        let mut m = IdMap::with_max(4);
        m.insert(0, Entry::Live(7));
        assert_eq!(m.get(0), Some(Entry::Live(7)));
        m.remove(0);
        assert_eq!(m.get(0), None);
        assert_eq!(m.len, 0);
    }
}
