//! The budget engine: admit, complete, extend, slices and maintenance.
//!
//! Sans-IO: every operation takes `now` (nanoseconds of a monotonic clock the caller
//! owns) and nothing here reads a clock, spawns a task or touches a socket.
//!
//! # Concurrency
//!
//! Limit keys live in a copy-on-write table (`arc-swap`) mapping a seeded 64-bit key id
//! to an `Arc<Slot>`. The decision path for a known key reads the table, hashes the
//! descriptor values and CASes the slot's atomic: no lock, no allocation. A key that is
//! not in the table, or whose slot has been sealed (replaced by a slice update, or
//! evicted), takes the slow path: a mutex around the pending slots, which are folded
//! into a new table in batches (at most every `64 + n/16` new keys, and on every
//! [`Engine::maintain`] and [`Engine::apply_slices`]), so that a fan-out of new keys
//! costs amortised O(1) per key rather than a table copy each.
//!
//! A lease names its keys by their hashes and the generation of the bucket it debited,
//! with no reference to the slots (no reference count on the decision path); a
//! completion finds them again in its table snapshot. Keys that may leave the table
//! while a lease names them give the lease their names first (see
//! `LeaseTable::insert` and `LeaseTable::keep_names`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::{ArcSwap, Cache};

use crate::bucket::{self, Params, RateLimit, Shape, Slot, State, Take};
use crate::config::{
    Config, Dimension, MAX_COST, MAX_DESCRIPTOR_BYTES, MAX_DESCRIPTORS, MAX_LIMITS_PER_REQUEST,
    MAX_REQUEST_ID_BYTES, Mode, Pattern, Posture, Rule, RuleLimit, RuleSet, SliceSource, Unmatched,
};
use crate::error::{AdmitError, CompleteError, ExtendError, HandleError, ReloadError, SliceError};
use crate::key::{KeyHashing, KeyMemo, LimitKey, PassThroughState};
use crate::lease::{InsertError, Lease, LeaseHead, LeaseLimit, LeaseTable, Removed};
use crate::usage::{CompletionStatus, Outcome, RecordLimit, Usage, UsageRecord, UsageSink};

/// A per-thread table cache: the engine that claimed it (its `ArcSwap`'s address) and
/// the cache ([`Engine::with_table`]).
type TableCache = Option<(usize, Cache<Arc<ArcSwap<KeyTable>>, Arc<KeyTable>>)>;

thread_local! {
    /// [`Engine::complete`]'s copy of the lease it finishes (a [`Worker`] has its own).
    static COMPLETION_BUFFER: std::cell::RefCell<Box<Lease>> =
        std::cell::RefCell::new(Box::new(Lease::EMPTY));
    static TABLE_CACHE: std::cell::RefCell<TableCache> = const { std::cell::RefCell::new(None) };
}

/// How many consecutive ids a colliding key may probe. 64-bit seeded ids collide with
/// probability ~n^2/2^65 (3e-8 at a million keys); this is insurance, not a hot path.
const MAX_PROBE: u64 = 4;

/// Nanoseconds per millisecond.
const MS: u64 = 1_000_000;

/// What a request costs, before each rule picks its dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cost {
    /// Requests (usually 1; 0 with zero tokens makes the admit a pure check:
    /// [`Cost::is_check`]).
    pub requests: u64,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// `max_tokens` as the request names it; `None` lets each rule reserve its
    /// `max_output_tokens_default`. Each rule reserves `min(this, its cap)`.
    pub max_output_tokens: Option<u64>,
}

impl Cost {
    /// One request with no tokens.
    pub const ONE_REQUEST: Cost = Cost {
        requests: 1,
        input_tokens: 0,
        max_output_tokens: Some(0),
    };

    /// A pure check: costs nothing, admitted while every matching bucket has budget left.
    pub const CHECK: Cost = Cost {
        requests: 0,
        input_tokens: 0,
        max_output_tokens: Some(0),
    };

    /// Whether this cost is a pure check: no request, no tokens and no output
    /// reserved (`None` counts as no output only where no rule reserves a default).
    /// Only a check is answered without a lease; anything else gets one even when the
    /// rules it matched count none of it, so that its completion is recorded.
    pub fn is_check(&self) -> bool {
        self.requests == 0 && self.input_tokens == 0 && self.max_output_tokens.unwrap_or(0) == 0
    }
}

/// One admission request. Borrowed: building it allocates nothing.
#[derive(Clone, Copy, Debug)]
pub struct AdmitRequest<'a> {
    /// Caller's id for the request: 1 to [`MAX_REQUEST_ID_BYTES`] bytes. A retry with
    /// the same id while its lease is live gets the same lease, never a second charge.
    pub request_id: &'a str,
    /// Envoy RLS domain; `None` for the HTTP API and the library.
    pub domain: Option<&'a str>,
    /// Descriptor entries (key, value): 1 to [`MAX_DESCRIPTORS`], keys unique.
    pub descriptors: &'a [(&'a str, &'a str)],
    /// The cost.
    pub cost: Cost,
    /// Lease TTL; `None` for the engine's `lease_ttl_ms`.
    pub ttl_ms: Option<u64>,
}

/// State of one limit at decision time. Plain data; the accessors do the arithmetic
/// (off the decision path).
#[derive(Clone, Copy, Debug)]
pub struct LimitStatus {
    rule: u32,
    /// The rule's dimension.
    pub dimension: Dimension,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Units this request costs on this limit.
    pub cost: u64,
    /// True when this limit (a shadow rule) would have rejected.
    pub shadow_rejected: bool,
    params: Shape,
    state: State,
    now: u64,
}

impl LimitStatus {
    /// Index of the rule.
    pub fn rule_index(&self) -> usize {
        self.rule as usize
    }

    /// Capacity of the slice in force: burst, or slots.
    pub fn limit(&self) -> u64 {
        self.params.capacity()
    }

    /// Whole units left after this decision.
    pub fn remaining(&self) -> u64 {
        Slot::level(&self.params.params(), self.state, self.now).clamp(0, self.limit() as i128)
            as u64
    }

    /// Nanoseconds until the limit is whole again, if nothing more is admitted and the
    /// reservations held settle with no refund (slots: unknown, reported as 0).
    pub fn reset_after_ns(&self) -> u64 {
        match self.params.params() {
            Params::Rate(p) => {
                let owed =
                    self.limit() as i128 - Slot::level(&Params::Rate(p), self.state, self.now);
                p.debit_ns(owed.max(0) as u64)
            }
            Params::Closed(_) | Params::Slots(_) => 0,
        }
    }

    /// The rate in force, for rate buckets: (rate, period in ns).
    pub fn rate(&self) -> Option<(u64, u64)> {
        match &self.params {
            Shape::Rate(l) => Some((l.rate, l.period_ns)),
            Shape::Closed(l) => Some((0, l.period_ns)),
            Shape::Slots(_) => None,
        }
    }
}

/// Statuses of every limit a request matched, in rule order. Fixed capacity.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    items: [Option<LimitStatus>; MAX_LIMITS_PER_REQUEST],
    len: usize,
}

impl Limits {
    const EMPTY: Limits = Limits {
        items: [None; MAX_LIMITS_PER_REQUEST],
        len: 0,
    };

    fn push(&mut self, s: LimitStatus) {
        self.items[self.len] = Some(s);
        self.len += 1;
    }

    /// Empties the list in place (the items past `len` are never read).
    fn clear(&mut self) {
        self.len = 0;
    }

    /// The statuses.
    pub fn iter(&self) -> impl Iterator<Item = &LimitStatus> {
        self.items[..self.len].iter().flatten()
    }

    /// Number of limits.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the request matched no rule.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Why a request was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// Not now. `retry_after_ns` is when the tripped bucket would fit this cost, if the
    /// slice stays as it is; `None` when that cannot be known (concurrency slots, or a
    /// key with no budget granted yet).
    RetryLater {
        /// Nanoseconds to wait.
        retry_after_ns: Option<u64>,
    },
    /// The cost is above the rule's whole burst: it will never fit, whatever the wait.
    NeverFits {
        /// The cost asked.
        cost: u64,
        /// The rule's burst.
        burst: u64,
    },
}

/// An admitted request.
#[derive(Clone, Copy, Debug)]
pub struct Admitted {
    /// When the lease expires (engine ns); `None` for a pure check, which holds nothing.
    pub lease_expires_at_ns: Option<u64>,
    /// True when this was a retry of a request id with a live lease: nothing was charged.
    pub replayed: bool,
    /// Every matched limit.
    pub limits: Limits,
}

/// A rejected request. Nothing was debited.
#[derive(Clone, Copy, Debug)]
pub struct Rejected {
    /// Index of the rule that tripped.
    pub rule: usize,
    /// Why.
    pub reason: RejectReason,
    /// The limits evaluated up to and including the one that tripped.
    pub limits: Limits,
}

/// The answer to an admit.
#[derive(Clone, Copy, Debug)]
pub enum Decision {
    /// Admitted; a lease holds the reservation until completion or expiry.
    Admitted(Admitted),
    /// Rejected.
    Rejected(Rejected),
}

impl Decision {
    /// An admission with no limits: a starting value for [`Worker::admit_into`].
    pub const EMPTY: Decision = Decision::Admitted(Admitted {
        lease_expires_at_ns: None,
        replayed: false,
        limits: Limits::EMPTY,
    });

    /// Makes `self` an admission with no limits yet, in place: for a decision reused
    /// from an earlier request, that is three stores, not a 600-byte write.
    fn reset(&mut self) {
        match self {
            Decision::Admitted(a) => {
                a.lease_expires_at_ns = None;
                a.replayed = false;
                a.limits.clear();
            }
            Decision::Rejected(_) => *self = Decision::EMPTY,
        }
    }

    /// The statuses being built (the decision is an admission until it turns into a
    /// rejection).
    fn limits_mut(&mut self) -> &mut Limits {
        match self {
            Decision::Admitted(a) => &mut a.limits,
            Decision::Rejected(r) => &mut r.limits,
        }
    }

    /// Turns the decision built so far into a rejection (its limits move once).
    fn reject(&mut self, rule: usize, reason: RejectReason) {
        let limits = *self.limits_mut();
        *self = Decision::Rejected(Rejected {
            rule,
            reason,
            limits,
        });
    }

    /// True when admitted.
    pub fn is_admitted(&self) -> bool {
        matches!(self, Decision::Admitted(_))
    }

    /// The limit statuses.
    pub fn limits(&self) -> &Limits {
        match self {
            Decision::Admitted(a) => &a.limits,
            Decision::Rejected(r) => &r.limits,
        }
    }
}

/// What a completion did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Settled a live lease: refunded the unused reservation, released slots, recorded.
    Settled,
    /// The lease had expired: recorded for billing, nothing refunded.
    Late,
    /// Already completed: nothing done.
    Duplicate,
}

/// A resolved limit key, for callers that check one key repeatedly
/// ([`Worker::try_acquire`]) without matching descriptors each time.
///
/// 32 bytes, aligned to 32, the two words a check reads first: a handle never straddles
/// two cache lines (at 40 bytes, three in eight did: one more miss for a caller walking
/// many handles).
#[derive(Clone, Debug)]
#[repr(C, align(32))]
pub struct KeyHandle {
    id: u64,
    check: u64,
    /// The key's values, boxed twice: a thin pointer keeps the handle at 32 bytes. Read
    /// only on the slow path.
    values: Box<Box<[Box<str>]>>,
    rule: u32,
    /// The engine that made it ([`Engine`]'s tag): a handle is refused by any other.
    engine: u32,
}

/// A slice update for one limit key, from the allocator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceUpdate {
    /// The rule's name.
    pub rule: String,
    /// Values of the rule's `*` entries, in match-key order.
    pub values: Vec<String>,
    /// Rate per the rule's period (for concurrency rules: unused, 0).
    pub rate: u64,
    /// Burst (for concurrency rules: slots).
    pub burst: u64,
    /// The allocator's term. Lower terms are ignored (invariant 4).
    pub epoch: u64,
    /// Sequence within the term. Not above the last applied: ignored.
    pub seq: u64,
    /// When the lease ends, in engine ns (already the agent's report timestamp plus
    /// `lease_ms` minus the drift margin: invariant 3).
    pub lease_expires_at_ns: u64,
    /// Agents holding this key, for the `conservative` posture's `limit / N`.
    pub fleet_size: u32,
    /// Tokens handed over from another agent's shrink, added to the level up to the new
    /// capacity.
    pub transfer_tokens: u64,
}

/// What applying one slice did.
#[derive(Clone, Debug)]
pub struct SliceApplied {
    /// Whole units the shrink's clamp gave up (to report for transfer).
    pub released_tokens: u64,
    /// Slots in flight on the key (a concurrency shrink may be acknowledged only once
    /// this is at or below the new slot count).
    pub in_flight: u64,
    /// The key's slot this slice replaced (sealed), with its final counts; `None` for
    /// a new key or a renewal (same slice: the slot is kept). A sync client folds it
    /// into its [`KeyTotals`] in order: a key replaced twice in one batch, or between
    /// two [`Engine::key_demand`] walks, then loses no counts.
    pub replaced: Option<SlotCounters>,
    /// The key's new slot, when the slice installed one (`None` for a renewal): folded
    /// in after `replaced`, a client's totals then follow the live slot, and a read of
    /// one key ([`KeyTotals::reread`]) sees what it counts, not the sealed slot.
    pub current: Option<SlotCounters>,
}

/// What one [`Engine::maintain`] pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaintainReport {
    /// Leases expired (slots released, no refund).
    pub leases_expired: usize,
    /// Idle keys evicted.
    pub keys_evicted: usize,
    /// Slices whose lease ended and whose posture was applied.
    pub slices_expired: usize,
}

/// One live limit key as the allocator sync client reads it ([`Engine::key_demand`]).
#[derive(Clone, Debug)]
pub struct KeyDemand {
    /// The rule's name (shared, not copied per key: a report walks every key).
    pub rule: Arc<str>,
    /// The live slot's counters. A slice change (or eviction at rest) replaces the
    /// slot and its counters start again from 0: compare slots with
    /// [`SlotCounters::same_slot`] and read the old one's final counts.
    pub counters: SlotCounters,
    /// Slots in flight (concurrency rules; 0 otherwise).
    pub in_flight: u64,
    /// The allocator slice applied to the key, if any.
    pub slice: Option<AppliedSlice>,
}

impl KeyDemand {
    /// The rule's `*` values, in match-key order (borrowed from the slot's key).
    pub fn values(&self) -> &[Box<str>] {
        &self.counters.0.key.values
    }

    /// The same values, shared with the key (a reference count, no copy): for a caller
    /// that keeps them past the walk, such as the sync client naming its tracks.
    pub fn shared_values(&self) -> Arc<[Box<str>]> {
        Arc::clone(&self.counters.0.key.values)
    }

    /// The key's identity in this engine (see [`Engine::key_identity`]).
    pub(crate) fn identity(&self) -> (u64, u64) {
        let k = &self.counters.0.key;
        (k.id, k.check)
    }
}

/// An allocator slice as the engine holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppliedSlice {
    /// The grant's term.
    pub epoch: u64,
    /// The grant's sequence number.
    pub seq: u64,
    /// The grant's rate, or its posture's once the lease ended (0 when the strict
    /// posture closed the key, and for concurrency rules).
    pub rate: u64,
    /// The grant's burst (slots for concurrency rules), or its posture's once the lease
    /// ended.
    pub burst: u64,
    /// The grant's lease end, engine ns.
    pub lease_expires_at_ns: u64,
    /// The lease ended and the rule's posture applies.
    pub expired: bool,
}

/// Read-only view of one slot's demand counters.
#[derive(Clone)]
pub struct SlotCounters(Arc<Slot>);

impl SlotCounters {
    /// Cost admitted through this slot.
    pub fn admitted(&self) -> u64 {
        self.0.admitted.load(Ordering::Relaxed)
    }

    /// Cost of matching requests not admitted: rejected by this slot, or by another rule
    /// the request also matched (demand all the same).
    pub fn rejected(&self) -> u64 {
        // Counters wrap (as `fetch_add` does); their growth is read modulo 2^64.
        (self.0.rejected.load(Ordering::Relaxed))
            .wrapping_add(self.0.blocked.load(Ordering::Relaxed))
    }

    /// Of [`SlotCounters::rejected`], the cost another rule rejected.
    pub fn blocked(&self) -> u64 {
        self.0.blocked.load(Ordering::Relaxed)
    }

    /// Both views read the same slot (not a replacement).
    pub fn same_slot(&self, other: &SlotCounters) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for SlotCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotCounters")
            .field("admitted", &self.admitted())
            .field("rejected", &self.rejected())
            .finish()
    }
}

/// One key's demand counters accumulated across slot replacements. A slice change (or
/// an eviction at rest) replaces a key's slot, whose counters start again from 0; a key
/// replaced twice between two reads would lose the middle slot's counts. Feed it every
/// view of the key's slots: each [`KeyDemand::counters`], and each
/// [`SliceApplied::replaced`] of a slice applied to the key, in order. What the sync
/// client (and the simulator, which drives the same engine) reports as demand.
#[derive(Clone, Debug)]
pub struct KeyTotals {
    /// The slot last read, and its counts then.
    slot: SlotCounters,
    slot_admitted: u64,
    slot_rejected: u64,
    admitted: u64,
    rejected: u64,
}

impl KeyTotals {
    /// Totals starting with what `slot` has counted so far.
    pub fn new(slot: SlotCounters) -> KeyTotals {
        let (a, r) = (slot.admitted(), slot.rejected());
        KeyTotals {
            slot,
            slot_admitted: a,
            slot_rejected: r,
            admitted: a,
            rejected: r,
        }
    }

    /// Folds in the key's live slot: the growth of the slot last read, or, if a slice
    /// change replaced it, the old slot's final counts and then the new one's.
    pub fn observe(&mut self, c: SlotCounters) {
        let (a, r) = (c.admitted(), c.rejected());
        if self.slot.same_slot(&c) {
            self.admitted = self
                .admitted
                .saturating_add(a.wrapping_sub(self.slot_admitted));
            self.rejected = self
                .rejected
                .saturating_add(r.wrapping_sub(self.slot_rejected));
        } else {
            let old_a = self.slot.admitted().wrapping_sub(self.slot_admitted);
            let old_r = self.slot.rejected().wrapping_sub(self.slot_rejected);
            self.admitted = self.admitted.saturating_add(old_a).saturating_add(a);
            self.rejected = self.rejected.saturating_add(old_r).saturating_add(r);
            self.slot = c;
        }
        self.slot_admitted = a;
        self.slot_rejected = r;
    }

    /// Folds in the growth of the slot last read (a read of one key between walks of
    /// all of them: a slice applied since must have been observed through
    /// [`SliceApplied::replaced`]).
    pub fn reread(&mut self) {
        self.observe(self.slot.clone());
    }

    /// Cost admitted since [`KeyTotals::new`].
    pub fn admitted(&self) -> u64 {
        self.admitted
    }

    /// Cost rejected (or blocked by another rule) since [`KeyTotals::new`].
    pub fn rejected(&self) -> u64 {
        self.rejected
    }
}

/// How often the slow path may do work that grows with the key table (a publish
/// copies its chunk array, an eviction walk reads every key): 1 ms plus 1 us per key,
/// i.e. a few percent of a core at most.
fn walk_interval_ns(keys: usize) -> u64 {
    1_000_000 + keys as u64 * 1_000
}

/// Adds a slot's counts to per-rule totals (admitted, rejected, blocked), saturating.
fn retire_counts(totals: &mut (u64, u64, u64), s: &Slot) {
    totals.0 = totals.0.saturating_add(s.admitted.load(Ordering::Relaxed));
    totals.1 = totals.1.saturating_add(s.rejected.load(Ordering::Relaxed));
    totals.2 = totals.2.saturating_add(s.blocked.load(Ordering::Relaxed));
}

/// Per-rule totals, for summaries and metrics. Approximate under concurrent slice
/// changes (a count landing on a slot being retired can be missed); never used for
/// billing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleStats {
    /// Rule name.
    pub rule: String,
    /// Enforce or shadow.
    pub shadow: bool,
    /// Units admitted (tokens, requests or slots).
    pub admitted: u64,
    /// Units rejected by this rule (for a shadow rule: would have been rejected).
    pub rejected: u64,
    /// Units of matching requests another rule rejected.
    pub blocked: u64,
    /// Keys currently held.
    pub keys: usize,
}

/// A compiled match entry: descriptor key and `Some(exact)`, or `None` for `*`.
type MatchEntry = (Box<str>, Option<Box<str>>);

/// A limit key (rule index and `*` values) as the slice map holds it: the key of the
/// slot the slice was applied to (a replacement slot keeps it). The map hashes the
/// key's check hash (computed once, when the key was made) and compares pointers
/// first, content only on a mismatch; it is searched through [`KeyView`], from a
/// slot's [`LimitKey`] or from borrowed values, without building anything. A report
/// walks every key: no allocation, no string hashing per key.
#[derive(Clone, Debug)]
struct SliceKey(Arc<LimitKey>);

/// A limit key seen as check hash, rule index and `*` values, whatever holds it.
trait KeyView {
    /// [`KeyHashing::key_check`] of the key.
    fn check(&self) -> u64;
    fn rule(&self) -> u32;
    fn count(&self) -> usize;
    fn value(&self, i: usize) -> &str;
    /// The shared key, if the view is one (pointer equality short-cuts the compare).
    fn shared(&self) -> Option<&LimitKey> {
        None
    }
}

impl KeyView for LimitKey {
    fn check(&self) -> u64 {
        self.check
    }
    fn rule(&self) -> u32 {
        self.rule
    }
    fn count(&self) -> usize {
        self.values.len()
    }
    fn value(&self, i: usize) -> &str {
        &self.values[i]
    }
    fn shared(&self) -> Option<&LimitKey> {
        Some(self)
    }
}

/// Borrowed values: rule index, `*` values and their check hash.
struct Named<'a, S> {
    check: u64,
    rule: u32,
    values: &'a [S],
}

impl<'a, S: AsRef<str>> Named<'a, S> {
    fn new(hashing: &KeyHashing, rule: u32, values: &'a [S]) -> Self {
        Named {
            check: hashing.key_check(rule, values.iter().map(|v| v.as_ref())),
            rule,
            values,
        }
    }
}

impl<S: AsRef<str>> KeyView for Named<'_, S> {
    fn check(&self) -> u64 {
        self.check
    }
    fn rule(&self) -> u32 {
        self.rule
    }
    fn count(&self) -> usize {
        self.values.len()
    }
    fn value(&self, i: usize) -> &str {
        self.values[i].as_ref()
    }
}

impl std::hash::Hash for dyn KeyView + '_ {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write_u64(self.check());
    }
}

impl PartialEq for dyn KeyView + '_ {
    fn eq(&self, other: &Self) -> bool {
        if let (Some(a), Some(b)) = (self.shared(), other.shared())
            && std::ptr::eq(a, b)
        {
            return true;
        }
        self.check() == other.check()
            && self.rule() == other.rule()
            && self.count() == other.count()
            && (0..self.count()).all(|i| self.value(i) == other.value(i))
    }
}

impl Eq for dyn KeyView + '_ {}

// A `SliceKey` is its `LimitKey` seen through `KeyView`: hashed, compared and borrowed
// as that, so that map lookups by any view agree with it.
impl std::hash::Hash for SliceKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (&*self.0 as &dyn KeyView).hash(h)
    }
}

impl PartialEq for SliceKey {
    fn eq(&self, other: &Self) -> bool {
        (&*self.0 as &dyn KeyView) == (&*other.0 as &dyn KeyView)
    }
}

impl Eq for SliceKey {}

impl<'a> std::borrow::Borrow<dyn KeyView + 'a> for SliceKey {
    fn borrow(&self) -> &(dyn KeyView + 'a) {
        &*self.0
    }
}

struct CompiledRule {
    index: u32,
    /// Descriptor key and `Some(exact)` or `None` for `*`, sorted by key.
    matches: Box<[MatchEntry]>,
    dimension: Dimension,
    enforce: bool,
    /// The whole limit (standalone slice).
    whole: Params,
    /// Burst (or slots) of the whole limit: above it a cost never fits.
    whole_capacity: u64,
    rule: Rule,
    /// The rule's name, shared by every [`KeyDemand`] of its keys.
    name: Arc<str>,
}

impl CompiledRule {
    /// What one request of `cost` counts as demand: at most the whole limit's capacity
    /// (a cost no slice could ever admit is not demand a fleet could serve, and one
    /// absurd request must not pull the rule's slices toward this agent or wrap its
    /// counters).
    #[inline]
    fn demand(&self, cost: u64) -> u64 {
        cost.min(self.whole_capacity.max(1))
    }

    /// If the rule matches, writes the `*` values into `out` and returns how many.
    #[inline]
    fn matches<'a>(
        &self,
        descriptors: &[(&'a str, &'a str)],
        out: &mut [&'a str],
    ) -> Option<usize> {
        let mut n = 0;
        for (key, exact) in self.matches.iter() {
            let value = descriptors.iter().find(|(k, _)| *k == &**key)?.1;
            match exact {
                Some(e) if **e != *value => return None,
                Some(_) => {}
                None => {
                    out[n] = value;
                    n += 1;
                }
            }
        }
        Some(n)
    }

    #[inline]
    fn cost(&self, c: &Cost) -> u64 {
        match self.dimension {
            Dimension::Requests => c.requests,
            Dimension::InputTokens => c.input_tokens,
            Dimension::OutputTokens => self.rule.reserved_output(c.max_output_tokens),
            Dimension::TotalTokens => c
                .input_tokens
                .saturating_add(self.rule.reserved_output(c.max_output_tokens)),
            Dimension::Concurrency => c.requests.min(1),
        }
    }

    /// Token dimensions may be partly refunded at completion; their reservations are
    /// held (bucket.rs) until settled.
    #[inline]
    fn refundable(&self) -> bool {
        matches!(
            self.dimension,
            Dimension::InputTokens | Dimension::OutputTokens | Dimension::TotalTokens
        )
    }

    fn actual(&self, reserved: u64, u: &Usage) -> u64 {
        match self.dimension {
            Dimension::Requests | Dimension::Concurrency => reserved,
            Dimension::InputTokens => u.input_tokens,
            Dimension::OutputTokens => u.output_tokens,
            Dimension::TotalTokens => u.input_tokens.saturating_add(u.output_tokens),
        }
    }
}

fn whole_params(rule: &Rule) -> Params {
    match rule.limit {
        RuleLimit::Rate { rate, per, burst } => Params::rate(RateLimit {
            rate,
            burst,
            period_ns: per.as_ns(),
        }),
        RuleLimit::Concurrency { max_in_flight } => Params::Slots(max_in_flight),
    }
}

/// Which keys changed since the sync client's last walk, coarsely: one flag per
/// bucket of key ids (the top [`CHANGE_BUCKET_BITS`] bits of the id a key is stored
/// under), set by whatever changes what the walk reports (a count, the slots in
/// flight, a slice) and cleared by the walk, which then reads only the slots of keys
/// in buckets that were set ([`Engine::changed_key_demand`]). Before, the walk of
/// changed keys visited every slot to compare its counts with its walk mark: two cache
/// misses a key, every report interval, on an agent holding 10,000 keys of which a
/// hundred moved (a tenth of the simulator's fleet-scale run). 4 KiB an engine.
///
/// Ordering: a change (a count's add, a state's compare-and-swap: locked instructions
/// either way) and the flag's load after it are sequentially consistent, and the walk
/// clears the flags and then issues a sequentially consistent fence before it reads any
/// slot; so either the walk that clears a flag reads the change, or the change's load
/// sees the flag cleared and sets it again (a release store) for the next walk. On x86
/// the orderings cost nothing over relaxed ones: a load and, only when the flag is
/// clear, a plain store (no locked instruction on the decision path).
struct ChangeMarks(Box<[AtomicBool]>);

/// Bits of a key id that name its [`ChangeMarks`] bucket.
const CHANGE_BUCKET_BITS: u32 = 12;

/// Every how many walks of changed keys visits every slot regardless of the marks (what
/// the walk compares against each slot's own walk mark, as before): a backstop for a
/// change marked under another id than the key's cell (a key stored past an id
/// collision), reported at worst this many report intervals late. Counts are
/// cumulative, so nothing is lost meanwhile.
const FULL_WALK_EVERY: u32 = 16;

impl ChangeMarks {
    fn new() -> ChangeMarks {
        ChangeMarks(
            (0..1 << CHANGE_BUCKET_BITS)
                .map(|_| AtomicBool::new(true))
                .collect(),
        )
    }

    #[inline]
    fn bucket(id: u64) -> usize {
        (id >> (64 - CHANGE_BUCKET_BITS)) as usize
    }

    /// Notes a change to the key stored under `id`, after the change itself (a
    /// sequentially consistent add or swap; see the type's docs).
    #[inline(always)]
    fn mark(&self, id: u64) {
        let f = &self.0[Self::bucket(id)];
        if !f.load(Ordering::SeqCst) {
            f.store(true, Ordering::Release);
        }
    }

    /// Adds `n` to `counter` (one of the counts of the key stored under `id`) and marks
    /// the key changed: the one way a count moves, so that no add goes unmarked.
    #[inline(always)]
    fn count(&self, counter: &AtomicU64, id: u64, n: u64) {
        counter.fetch_add(n, Ordering::SeqCst);
        self.mark(id);
    }

    /// Clears every flag, returning which were set (a bit per bucket); the slots read
    /// after it show every change whose mark it cleared.
    fn take(&self) -> ChangedBuckets {
        let mut set = ChangedBuckets([0; (1 << CHANGE_BUCKET_BITS) / 64]);
        for (b, f) in self.0.iter().enumerate() {
            if f.load(Ordering::Relaxed) {
                f.store(false, Ordering::Relaxed);
                set.0[b / 64] |= 1 << (b % 64);
            }
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        set
    }
}

/// The buckets a walk found marked ([`ChangeMarks::take`]).
struct ChangedBuckets([u64; (1 << CHANGE_BUCKET_BITS) / 64]);

impl ChangedBuckets {
    const ALL: ChangedBuckets = ChangedBuckets([u64::MAX; (1 << CHANGE_BUCKET_BITS) / 64]);

    #[inline]
    fn has(&self, id: u64) -> bool {
        let b = ChangeMarks::bucket(id);
        self.0[b / 64] & (1 << (b % 64)) != 0
    }
}

/// Four table cells: one cache line.
#[derive(Clone, Default)]
#[repr(align(64))]
struct KeyLine([Option<(u64, Arc<Slot>)>; 4]);

/// Lines per chunk of the key table (64 cells, 1 KiB).
const CHUNK_LINES: usize = 16;
const CHUNK_CELLS: usize = CHUNK_LINES * 4;

/// A run of table lines, shared between successive tables until one changes it.
#[derive(Clone, Default)]
struct Chunk([KeyLine; CHUNK_LINES]);

/// The published key table: immutable once built, open addressing with linear probing
/// over 16-byte cells (key id, slot), four to a cache line, at most three quarters
/// full. A lookup of a known key touches the chunk pointer (a small array that stays
/// in cache), one table line and then the slot; `std`'s map kept its control bytes
/// apart from its entries, one more dependent cache miss per decision once the table
/// outgrew the cache.
///
/// A publish that adds or replaces a few slots ([`KeyTable::with_updates`]) copies
/// only the chunks those slots land in and shares the rest with the previous table:
/// an agent holding 10,000 keys that applies a grant batch of a few keys does not
/// rebuild (and touch every slot of) the whole table. Slots sealed without a
/// replacement (evicted at rest) stay in their cells, where every reader already
/// treats a sealed slot as absent, until the garbage passes a quarter of the table
/// and a publish rebuilds it whole ([`KeyTable::build`]).
struct KeyTable {
    chunks: Box<[Arc<Chunk>]>,
    /// Cells - 1.
    mask: usize,
    len: usize,
    /// The rules' numbers in force with these slots (a rules reload publishes a table
    /// with its new ones: [`Engine::reload`]). A decision reads its rules from the
    /// snapshot it reads its slots from, at no extra load.
    compiled: Arc<[CompiledRule]>,
}

impl KeyTable {
    fn empty() -> KeyTable {
        KeyTable::build(0, std::iter::empty())
    }

    fn sized(cells: usize) -> KeyTable {
        KeyTable {
            chunks: (0..cells.div_ceil(CHUNK_CELLS))
                .map(|_| Arc::new(Chunk::default()))
                .collect(),
            mask: cells - 1,
            len: 0,
            compiled: Arc::from(Vec::new()),
        }
    }

    fn cells_for(capacity: usize) -> usize {
        (capacity.max(2) * 4 / 3 + 1).next_power_of_two().max(8)
    }

    /// A table of `slots` (ids unique, or a later one replaces an earlier one), sized
    /// for `capacity` of them.
    fn build(capacity: usize, slots: impl Iterator<Item = (u64, Arc<Slot>)>) -> KeyTable {
        let mut t = KeyTable::sized(KeyTable::cells_for(capacity));
        for (id, slot) in slots {
            if t.len * 4 >= (t.mask + 1) * 3 {
                // More than promised: rebuild larger (never on the decision path).
                let items: Vec<(u64, Arc<Slot>)> =
                    t.iter().map(|(i, s)| (i, Arc::clone(s))).collect();
                t = KeyTable::build((t.mask + 1) * 2, items.into_iter());
            }
            t.insert(id, slot);
        }
        t
    }

    /// This table with `slots` added (a slot replaces the one under its id), sharing
    /// every chunk none of them lands in; the slots back if they could fill it past
    /// three quarters (then rebuild it whole).
    fn with_updates(
        &self,
        slots: Vec<(u64, Arc<Slot>)>,
    ) -> Result<KeyTable, Vec<(u64, Arc<Slot>)>> {
        if !self.fits(slots.len()) {
            return Err(slots);
        }
        let mut t = KeyTable {
            chunks: self.chunks.clone(),
            mask: self.mask,
            len: self.len,
            compiled: Arc::clone(&self.compiled),
        };
        for (id, slot) in slots {
            t.insert(id, slot);
        }
        Ok(t)
    }

    /// `spare`, the table published before `current` (lacking `lag`, the updates that
    /// made `current`), brought up to `current` plus `more` in place, or `None` if
    /// something still holds it (a reader's guard, a worker's cache) or it is not of
    /// `current`'s size (a rebuild came between). The same inserts in the same order
    /// on the same cells as `current.with_updates(more)`, so the same table, without
    /// cloning `current`'s chunk references.
    fn caught_up(
        mut spare: Arc<KeyTable>,
        lag: TableUpdates,
        more: &[(u64, Arc<Slot>)],
        current: &KeyTable,
    ) -> Option<Arc<KeyTable>> {
        let t = Arc::get_mut(&mut spare).filter(|t| t.mask == current.mask)?;
        for (id, s) in lag.into_iter().chain(more.iter().cloned()) {
            t.insert(id, s);
        }
        debug_assert_eq!(
            t.len(),
            current.len()
                + more
                    .iter()
                    .filter(|(id, _)| current.get(*id).is_none())
                    .count(),
            "caught up to a table of another length"
        );
        Some(spare)
    }

    /// True if `more` slots (all new keys, at worst) keep it under three quarters full.
    fn fits(&self, more: usize) -> bool {
        (self.len + more) * 4 < (self.mask + 1) * 3
    }

    #[inline]
    fn cell(&self, i: usize) -> &Option<(u64, Arc<Slot>)> {
        &self.chunks[i / CHUNK_CELLS].0[(i % CHUNK_CELLS) >> 2].0[i & 3]
    }

    /// Stores `slot` under `id`, replacing the slot there; copies the chunk first if
    /// an older table shares it.
    fn insert(&mut self, id: u64, slot: Arc<Slot>) {
        let mut i = id as usize & self.mask;
        loop {
            match self.cell(i) {
                None => {
                    self.len += 1;
                    break;
                }
                Some((other, _)) if *other == id => break,
                Some(_) => i = (i + 1) & self.mask,
            }
        }
        let chunk = Arc::make_mut(&mut self.chunks[i / CHUNK_CELLS]);
        chunk.0[(i % CHUNK_CELLS) >> 2].0[i & 3] = Some((id, slot));
    }

    fn len(&self) -> usize {
        self.len
    }

    /// The slot stored under `id`, if any.
    #[inline]
    fn get(&self, id: u64) -> Option<&Arc<Slot>> {
        let mut i = id as usize & self.mask;
        loop {
            match self.cell(i) {
                Some((other, s)) if *other == id => return Some(s),
                Some(_) => i = (i + 1) & self.mask,
                None => return None,
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = (u64, &Arc<Slot>)> {
        self.chunks
            .iter()
            .flat_map(|c| c.0.iter())
            .flat_map(|l| l.0.iter())
            .flatten()
            .map(|(id, s)| (*id, s))
    }

    /// The slot of the key with this id and check hash, if published. Touches the
    /// table and the slot only (no key strings).
    #[inline]
    fn lookup(&self, id: u64, check: u64) -> Option<&Arc<Slot>> {
        // The common case first: the key under its own id (64-bit ids all but never
        // collide; the loop over probed ids is for when they do).
        match self.get(id) {
            Some(s) if s.check == check => Some(s),
            Some(_) => self.probe(id, check),
            None => None,
        }
    }

    /// [`KeyTable::lookup`] past the key's own id: another key took it (an id
    /// collision), so the key was stored under one of the next ids.
    #[cold]
    fn probe(&self, id: u64, check: u64) -> Option<&Arc<Slot>> {
        for p in 1..MAX_PROBE {
            match self.get(id.wrapping_add(p)) {
                Some(s) if s.check == check => return Some(s),
                Some(_) => continue,
                None => return None,
            }
        }
        None
    }
}

#[derive(Clone, Copy, Debug)]
struct SliceState {
    epoch: u64,
    seq: u64,
    /// What is in force: the grant, or its posture fallback once its lease ended.
    grant: Params,
    lease_expires_at_ns: u64,
    fleet_size: u32,
    expired: bool,
}

/// The latest lease extension applied ([`Engine::extend_slices`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceExtension {
    /// The allocator's term: only slices of this epoch are extended.
    pub epoch: u64,
    /// Slices with a seq up to this one are extended.
    pub through_seq: u64,
    /// Their lease ends no earlier than this (engine clock).
    pub lease_expires_at_ns: u64,
}

impl SliceExtension {
    fn covers(&self, st: &SliceState) -> bool {
        st.epoch == self.epoch && st.seq <= self.through_seq
    }
}

/// When `st`'s lease ends, extension `ext` included.
fn lease_end(st: &SliceState, ext: Option<SliceExtension>) -> u64 {
    match ext {
        Some(x) if x.covers(st) => st.lease_expires_at_ns.max(x.lease_expires_at_ns),
        _ => st.lease_expires_at_ns,
    }
}

/// Slots to store in a key table, by key id, in order.
type TableUpdates = Vec<(u64, Arc<Slot>)>;

struct Slow {
    /// The rules' numbers in force: every table published carries these.
    compiled: Arc<[CompiledRule]>,
    /// Reloads applied ([`Engine::reload`]).
    reloads: u64,
    /// Slots newer than the published table (new keys and replacements).
    pending: HashMap<u64, Arc<Slot>, PassThroughState>,
    /// Slots sealed without a replacement since the table was last rebuilt whole
    /// (they stay in their cells until then; see [`KeyTable`]).
    table_garbage: usize,
    /// The table published before the current one, and the updates it lacks (the last
    /// publish's). The next publish applies those and its own to it in place and
    /// publishes it, when no reader still holds it (a guard, a worker's cache):
    /// copying the current table instead clones a reference to every chunk, and to
    /// every slot of each chunk it changes (a few hundred reference counts a publish
    /// at 10,000 keys, 6-9 % of a fleet-scale simulation). Same cells either way: the
    /// same inserts, in the same order, on the same table.
    spare: Option<(Arc<KeyTable>, TableUpdates)>,
    /// Allocator grants by key (rule, values).
    slices: HashMap<SliceKey, SliceState, PassThroughState>,
    /// Live keys (table + pending, not counting sealed slots).
    keys: usize,
    /// Admitted/rejected/blocked of retired slots, per rule.
    retired: Vec<(u64, u64, u64)>,
    /// Engine time of the last publish.
    published_at_ns: u64,
    /// Engine time of the last walk of a full key table that found nothing to evict
    /// for a new key: until [`Slow::walk_interval_ns`] has passed, new keys are refused
    /// at once instead of each walking every key again under the slow-path lock.
    full_walk_at_ns: Option<u64>,
    /// Keys created lately, numbered (the sync client's new-key poll reads only these:
    /// [`Engine::new_key_demand`]); at most [`CREATED_MAX`], oldest dropped. The key,
    /// not the slot: an evicted slot is not kept alive by it.
    created: VecDeque<(u64, Arc<LimitKey>)>,
    /// Number of the last key created.
    created_seq: u64,
    /// Slots evicted since the sync client's last walk, numbered (its walk of changed
    /// keys drops their tracks: [`Engine::changed_key_demand`]); at most [`GONE_MAX`],
    /// oldest dropped. Kept only once a sync walk has run (a standalone engine has no
    /// reader), and only until that reader has read them.
    gone: VecDeque<(u64, Arc<Slot>)>,
    /// Number of the last slot evicted.
    gone_seq: u64,
    /// A sync walk ran: log evictions in `gone`.
    gone_tracking: bool,
    /// No slice's lease ends before this (a lower bound: the earliest lease end of
    /// the slices not yet expired when [`Engine::maintain`] last looked, lowered by
    /// every slice applied since). Maintenance scans the slices only once it is due.
    next_slice_end_ns: u64,
    /// When [`Engine::maintain`] next walks the keys for idle ones (every
    /// `key_idle_ms / 16`: a key goes at most that long after its idle time; a full
    /// table evicts at once, whatever this says).
    next_idle_scan_ns: u64,
    /// Walks of changed keys so far ([`FULL_WALK_EVERY`]).
    changed_walks: u32,
    /// The latest lease extension (one per allocator term; see
    /// [`Engine::extend_slices`]).
    extension: Option<SliceExtension>,
}

/// Keys remembered by [`Engine::new_key_demand`] between two reads (a new-key poll every
/// 20 ms sees at most this many at 50,000 new keys a second); a reader that falls
/// further behind is told to read every key.
pub const CREATED_MAX: usize = 1_024;

/// Evictions remembered for the sync client's walk of changed keys (one walk a report
/// interval); a reader that falls further behind is told to walk every key.
pub const GONE_MAX: usize = 16_384;

/// What a walk of the keys reads and marks (see [`Engine::key_demand`],
/// [`Engine::sync_key_demand`], [`Engine::changed_key_demand`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Walk {
    /// Every live key; marks nothing.
    Read,
    /// Every live key, each marked walked (the sync client's full read).
    Mark,
    /// Only the keys whose counts, in-flight slots or slice changed since their last
    /// mark (new slots included), each marked walked.
    Changed,
}

/// Table chunks (64 cells, at most 48 keys each) that [`Engine::key_demand`] reads under
/// one hold of the slow-path lock: ~750 keys, tens of microseconds.
const WALK_CHUNKS: usize = 16;

/// The budget engine. Share it (`Arc<Engine>`) across threads; give each thread a
/// [`Worker`] for the cheapest reads.
pub struct Engine {
    /// The rules in force (a reload swaps them; their numbers, compiled, are in the
    /// key table snapshot and in [`Slow`]).
    rules: ArcSwap<RuleSet>,
    by_domain: HashMap<Box<str>, Box<[u32]>>,
    domainless: Box<[u32]>,
    cfg: crate::config::EngineConfig,
    hashing: KeyHashing,
    table: Arc<ArcSwap<KeyTable>>,
    slow: Mutex<Slow>,
    leases: LeaseTable,
    /// What changed since the sync client's last walk, by bucket of key ids.
    changed: ChangeMarks,
    sink: Arc<dyn UsageSink>,
    /// Unique among the process's engines: a [`KeyHandle`] carries its engine's, since
    /// its hashes mean nothing to another (seeds are per engine).
    tag: u32,
}

/// The next [`Engine`]'s tag.
static NEXT_ENGINE_TAG: AtomicU32 = AtomicU32::new(1);

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rules", &self.rules.load().len())
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// What a rules reload changed ([`Engine::reload`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReloadSummary {
    /// The rules whose numbers changed, in file order (none: the file is the rules in
    /// force, and nothing was done).
    pub changed: Vec<String>,
    /// Keys that took a changed rule's new whole limit (standalone), or show it while
    /// closed (allocated).
    pub keys_updated: usize,
}

/// The first `[engine]` setting that differs, if any (every field, by name).
fn engine_setting_differs(
    a: &crate::config::EngineConfig,
    b: &crate::config::EngineConfig,
) -> Option<&'static str> {
    let crate::config::EngineConfig {
        max_keys,
        max_leases,
        lease_ttl_ms,
        max_lease_ttl_ms,
        tombstone_ttl_ms,
        max_tombstones,
        key_idle_ms,
        unmatched,
        slice_source,
    } = a;
    [
        (*max_keys != b.max_keys, "max_keys"),
        (*max_leases != b.max_leases, "max_leases"),
        (*lease_ttl_ms != b.lease_ttl_ms, "lease_ttl_ms"),
        (*max_lease_ttl_ms != b.max_lease_ttl_ms, "max_lease_ttl_ms"),
        (*tombstone_ttl_ms != b.tombstone_ttl_ms, "tombstone_ttl_ms"),
        (*max_tombstones != b.max_tombstones, "max_tombstones"),
        (*key_idle_ms != b.key_idle_ms, "key_idle_ms"),
        (*unmatched != b.unmatched, "unmatched"),
        (*slice_source != b.slice_source, "slice_source"),
    ]
    .into_iter()
    .find_map(|(differs, field)| differs.then_some(field))
}

/// The first field of a rule that decides what its keys are and changed, if any (the
/// file's name for it).
fn structural_change(a: &Rule, b: &Rule) -> Option<&'static str> {
    if a.domain != b.domain {
        return Some("domain");
    }
    if a.matches != b.matches {
        return Some("match");
    }
    if a.dimension != b.dimension {
        return Some("dimension");
    }
    if a.parent != b.parent {
        return Some("parent");
    }
    match (&a.limit, &b.limit) {
        (RuleLimit::Rate { per: p, .. }, RuleLimit::Rate { per: q, .. }) if p != q => Some("per"),
        (RuleLimit::Rate { .. }, RuleLimit::Rate { .. })
        | (RuleLimit::Concurrency { .. }, RuleLimit::Concurrency { .. }) => None,
        _ => Some("dimension"),
    }
}

/// The engine's form of each rule, by index.
fn compile(rules: &RuleSet) -> Arc<[CompiledRule]> {
    rules
        .rules()
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let whole = whole_params(r);
            CompiledRule {
                index: i as u32,
                matches: r
                    .matches
                    .iter()
                    .map(|(k, p)| {
                        let exact = match p {
                            Pattern::Each => None,
                            Pattern::Exact(v) => Some(v.clone()),
                        };
                        (k.as_str().into(), exact)
                    })
                    .collect(),
                dimension: r.dimension,
                enforce: r.mode == Mode::Enforce,
                whole_capacity: whole.capacity(),
                whole,
                rule: r.clone(),
                name: r.name.as_str().into(),
            }
        })
        .collect()
}

impl Engine {
    /// An engine for a validated config, handing usage records to `sink`.
    pub fn new(config: Config, sink: Arc<dyn UsageSink>) -> Engine {
        let Config {
            engine: cfg, rules, ..
        } = config;
        let compiled = compile(&rules);
        let domainless: Box<[u32]> = compiled
            .iter()
            .filter(|c| c.rule.domain.is_none())
            .map(|c| c.index)
            .collect();
        let mut by_domain: HashMap<Box<str>, Vec<u32>> = HashMap::new();
        for c in compiled.iter() {
            if let Some(d) = &c.rule.domain {
                by_domain.entry(d.as_str().into()).or_default();
            }
        }
        for (d, list) in by_domain.iter_mut() {
            // Rules of the domain and domainless rules, in file order.
            list.extend(
                compiled
                    .iter()
                    .filter(|c| c.rule.domain.as_deref().is_none_or(|x| x == &**d))
                    .map(|c| c.index),
            );
        }
        let retired = vec![(0, 0, 0); compiled.len()];
        let mut table = KeyTable::empty();
        table.compiled = Arc::clone(&compiled);
        Engine {
            by_domain: by_domain
                .into_iter()
                .map(|(k, v)| (k, v.into_boxed_slice()))
                .collect(),
            domainless,
            rules: ArcSwap::from_pointee(rules),
            leases: LeaseTable::new(cfg.max_leases, cfg.max_tombstones),
            changed: ChangeMarks::new(),
            cfg,
            hashing: KeyHashing::new(),
            table: Arc::new(ArcSwap::from_pointee(table)),
            slow: Mutex::new(Slow {
                compiled,
                reloads: 0,
                pending: HashMap::default(),
                table_garbage: 0,
                spare: None,
                slices: HashMap::default(),
                keys: 0,
                retired,
                published_at_ns: 0,
                full_walk_at_ns: None,
                created: VecDeque::new(),
                created_seq: 0,
                gone: VecDeque::new(),
                gone_seq: 0,
                gone_tracking: false,
                next_slice_end_ns: 0,
                extension: None,
                next_idle_scan_ns: 0,
                changed_walks: 0,
            }),
            sink,
            tag: NEXT_ENGINE_TAG.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The rules in force (a snapshot: [`Engine::reload`] may replace them).
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules.load_full()
    }

    /// The engine settings in force.
    pub fn config(&self) -> &crate::config::EngineConfig {
        &self.cfg
    }

    /// Applies a rules file's new numbers to the rules in force, or refuses it having
    /// changed nothing. The file must have the same `[engine]` settings and the same
    /// rules in the same order, each matching and limiting what it did; a rule may
    /// change its `rate`, `burst`, `max_in_flight`, `mode`, `posture`, output-token
    /// settings and `typical_cost` (the rest decides what its keys are: a restart
    /// changes it).
    ///
    /// Decisions from now on read the new numbers. A standalone engine's keys of a
    /// changed limit take it as a slice change does (invariant 2: a shrink clamps the
    /// level, a growth does not raise it; reservations held carry over), so a reload
    /// never hands out a fresh burst; an allocated engine's granted keys keep their
    /// grants (the allocator's own reload sends new ones) and its closed keys show the
    /// new limit. A decision already under way when the reload lands finishes under
    /// the rules it started with.
    pub fn reload(&self, now: u64, config: Config) -> Result<ReloadSummary, ReloadError> {
        let Config {
            engine: cfg, rules, ..
        } = config;
        if let Some(field) = engine_setting_differs(&self.cfg, &cfg) {
            return Err(ReloadError::EngineSettings { field });
        }
        let mut slow = self.slow();
        let old = self.rules.load_full();
        let (was, will) = (old.rules(), rules.rules());
        for i in 0..was.len().max(will.len()) {
            let name = |r: Option<&Rule>| match r {
                Some(r) => format!("rule #{} `{}`", i + 1, r.name),
                None => format!("no rule #{}", i + 1),
            };
            match (was.get(i), will.get(i)) {
                (Some(a), Some(b)) if a.name == b.name => {
                    if let Some(field) = structural_change(a, b) {
                        return Err(ReloadError::Structure {
                            rule: a.name.clone(),
                            field,
                        });
                    }
                }
                (a, b) => {
                    return Err(ReloadError::RulesDiffer {
                        found: name(b),
                        in_force: name(a),
                    });
                }
            }
        }
        let changed: Vec<String> = was
            .iter()
            .zip(will)
            .filter(|(a, b)| format!("{a:?}") != format!("{b:?}"))
            .map(|(a, _)| a.name.clone())
            .collect();
        if changed.is_empty() {
            return Ok(ReloadSummary::default());
        }
        let compiled = compile(&rules);
        let before = std::mem::replace(&mut slow.compiled, Arc::clone(&compiled));
        self.rules.store(Arc::new(rules));
        // Each live key of a changed limit, and what it holds from now on.
        let table = self.table.load();
        let mut moves: Vec<(u32, Vec<String>, Params)> = Vec::new();
        for (_, s) in live_slots(&slow, &table) {
            let ri = s.key.rule as usize;
            let (old_whole, new_whole) = (before[ri].whole, compiled[ri].whole);
            if old_whole == new_whole {
                continue;
            }
            let params = match self.cfg.slice_source {
                SliceSource::Standalone if s.params == old_whole => new_whole,
                SliceSource::Allocated => match (s.params, new_whole) {
                    (Params::Closed(_), Params::Rate(p))
                        if !slow.slices.contains_key(&*s.key as &dyn KeyView) =>
                    {
                        Params::Closed(p.limit)
                    }
                    _ => continue,
                },
                SliceSource::Standalone => continue,
            };
            let values = s.key.values().map(String::from).collect();
            moves.push((s.key.rule, values, params));
        }
        drop(table);
        let mut keys_updated = 0;
        for (ri, values, params) in moves {
            // Every one has a live slot: nothing new is created, so nothing can fill.
            match self.install_locked(&mut slow, now, ri, &values, params, 0) {
                Ok(_) => keys_updated += 1,
                Err(e) => debug_assert!(false, "reload could not move a key: {e}"),
            }
        }
        self.publish_locked(&mut slow, now);
        slow.reloads += 1;
        Ok(ReloadSummary {
            changed,
            keys_updated,
        })
    }

    /// Rules reloads applied since start ([`Engine::reload`]).
    pub fn reloads(&self) -> u64 {
        self.slow().reloads
    }

    /// A per-thread handle with a cached table snapshot (the cheapest decision path).
    pub fn worker(self: &Arc<Self>) -> Worker {
        Worker {
            cache: Cache::new(Arc::clone(&self.table)),
            engine: Arc::clone(self),
            lease: Box::new(Lease::EMPTY),
            demand: BufferedDemand::default(),
        }
    }

    fn slow(&self) -> MutexGuard<'_, Slow> {
        self.slow.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn candidates(&self, domain: Option<&str>) -> &[u32] {
        match domain {
            None => &self.domainless,
            Some(d) => self
                .by_domain
                .get(d)
                .map(|v| &**v)
                .unwrap_or(&self.domainless),
        }
    }

    /// Admits or rejects one request, all-or-nothing over every matching rule.
    pub fn admit(&self, now: u64, req: &AdmitRequest<'_>) -> Result<Decision, AdmitError> {
        let mut d = Decision::EMPTY;
        self.admit_into(now, req, &mut d)?;
        Ok(d)
    }

    /// [`Engine::admit`] writing the decision into `out` (left unspecified on an error):
    /// a caller that reuses one `Decision` across requests saves the copies of its ~600
    /// bytes that returning it by value costs.
    pub fn admit_into(
        &self,
        now: u64,
        req: &AdmitRequest<'_>,
        out: &mut Decision,
    ) -> Result<(), AdmitError> {
        self.with_table(|table| self.admit_in(table, now, req, out))
    }

    /// Runs `f` on the current table snapshot through a per-thread `arc_swap::Cache`
    /// claimed by the first engine that uses the thread (a server's one engine: its
    /// front doors' admissions and completions then take no locked instruction to read
    /// the table, where `ArcSwap::load` takes two, ~21 ns here:
    /// `cargo run --release -p bursar-agent --example locked_ops`). Other engines on
    /// the thread (the simulator's, tests'), and a call nested in `f` (a usage sink
    /// that completes), load the snapshot as before.
    #[inline]
    fn with_table<R>(&self, f: impl FnOnce(&KeyTable) -> R) -> R {
        let me = Arc::as_ptr(&self.table) as usize;
        TABLE_CACHE.with(|c| {
            if let Ok(mut c) = c.try_borrow_mut() {
                if c.is_none() {
                    // The cache keeps this engine's `ArcSwap` alive, so no later engine
                    // can take its address.
                    *c = Some((me, Cache::new(Arc::clone(&self.table))));
                }
                if let Some((owner, cache)) = c.as_mut()
                    && *owner == me
                {
                    return f(cache.load());
                }
            }
            f(&self.table.load())
        })
    }

    // Inlined into its callers; the decision is built in place in `out`.
    #[inline(always)]
    fn admit_in(
        &self,
        table: &KeyTable,
        now: u64,
        req: &AdmitRequest<'_>,
        out: &mut Decision,
    ) -> Result<(), AdmitError> {
        validate_request(req)?;
        let ttl_ms = req.ttl_ms.unwrap_or(self.cfg.lease_ttl_ms);
        if ttl_ms == 0 || ttl_ms > self.cfg.max_lease_ttl_ms {
            return Err(AdmitError::InvalidTtl {
                ttl_ms,
                max_ms: self.cfg.max_lease_ttl_ms,
            });
        }
        // A retry of a live lease is answered from the lease. The common case (a new
        // id) learns it only at insert time, so admission takes one lock, not two; a
        // rejection checks first (below) so a retry is never answered 429.
        let hash = self.hashing.request_hash(req.request_id);

        out.reset();
        // What each limit took, and from which slot (borrowed from the table: no
        // reference count; the lease keeps only the key's hashes).
        let mut held: [Option<LeaseLimit>; MAX_LIMITS_PER_REQUEST] = [None; MAX_LIMITS_PER_REQUEST];
        let mut slots: [Option<SlotRef<'_>>; MAX_LIMITS_PER_REQUEST] =
            [const { None }; MAX_LIMITS_PER_REQUEST];
        let mut n_held = 0usize;
        let mut matched = false;
        let mut any_cost = false;
        let mut values: [&str; MAX_DESCRIPTORS] = [""; MAX_DESCRIPTORS];
        let mut memo = KeyMemo::default();

        let candidates = self.candidates(req.domain);
        'rules: for (pos, &ri) in candidates.iter().enumerate() {
            let rule = &table.compiled[ri as usize];
            let Some(nv) = rule.matches(req.descriptors, &mut values) else {
                continue;
            };
            let values = &values[..nv];
            matched = true;
            if out.limits_mut().len == MAX_LIMITS_PER_REQUEST {
                if !rule.enforce {
                    // A shadow rule never fails a request: past the limits one
                    // request may hold, it is not evaluated.
                    continue;
                }
                self.rollback(now, &held, &slots);
                return Err(AdmitError::TooManyLimits {
                    max: MAX_LIMITS_PER_REQUEST,
                });
            }
            let cost = rule.cost(&req.cost);
            any_cost |= cost > 0;
            if rule.dimension != Dimension::Concurrency
                && cost > rule.whole_capacity
                && rule.enforce
            {
                self.rollback(now, &held, &slots);
                // A retry of a live lease (admitted before a reload shrank the rule) is
                // answered with its lease, as on a busy bucket.
                if let Some(l) = self.leases.with_live(hash, req.request_id, Lease::clone) {
                    *out = self.replay(table, &l, now);
                    return Ok(());
                }
                out.reject(
                    ri as usize,
                    RejectReason::NeverFits {
                        cost,
                        burst: rule.whole_capacity,
                    },
                );
                return Ok(());
            }
            let mut first = true;
            loop {
                let (slot, key_id) = match self.slot_for(table, now, ri, values, first, &mut memo) {
                    Ok(s) => s,
                    // A shadow rule never fails a request: without a key (the table
                    // full of busy keys) it is not evaluated.
                    Err(AdmitError::KeyTableFull { .. }) if !rule.enforce => continue 'rules,
                    Err(e) => {
                        self.rollback(now, &held, &slots);
                        return Err(e);
                    }
                };
                first = false;
                let hold = rule.refundable();
                match slot.try_take(now, cost, hold) {
                    Take::Taken { amount, after } => {
                        out.limits_mut()
                            .push(status(rule, cost, false, &slot.params, after, now));
                        held[n_held] = Some(LeaseLimit {
                            id: key_id,
                            check: slot.check,
                            generation: slot.generation(),
                            reserved: cost,
                            debited: amount,
                            rule: ri,
                            dimension: rule.dimension,
                            mode: rule.rule.mode,
                            holds: hold && amount > 0,
                        });
                        slots[n_held] = Some(slot);
                        n_held += 1;
                        break;
                    }
                    Take::Busy {
                        retry_after_ns,
                        after,
                    } => {
                        self.count(&slot.rejected, key_id, rule.demand(cost));
                        out.limits_mut().push(status(
                            rule,
                            cost,
                            !rule.enforce,
                            &slot.params,
                            after,
                            now,
                        ));
                        if rule.enforce {
                            self.rollback(now, &held, &slots);
                            if let Some(l) =
                                self.leases.with_live(hash, req.request_id, Lease::clone)
                            {
                                *out = self.replay(table, &l, now);
                                return Ok(());
                            }
                            // The other rules this request matched saw demand too.
                            for (l, s) in taken(&held, &slots) {
                                self.count(&s.blocked, l.id, l.reserved);
                            }
                            self.block_later(
                                table,
                                now,
                                &candidates[pos + 1..],
                                req.descriptors,
                                |r| r.cost(&req.cost),
                            );
                            out.reject(ri as usize, RejectReason::RetryLater { retry_after_ns });
                            return Ok(());
                        }
                        break;
                    }
                    Take::Sealed => continue,
                }
            }
        }
        if !matched && self.cfg.unmatched == Unmatched::Reject {
            return Err(AdmitError::NoMatchingRule);
        }
        if !any_cost && matched && req.cost.is_check() {
            // A pure check: nothing was debited, nothing is held (`out` is already
            // that admission). A request that costs something its rules happen not to
            // count (one request under token rules, a prompt estimated at zero tokens)
            // still takes a lease, with nothing reserved: its completion is recorded,
            // and charges what it used.
            return Ok(());
        }
        let expires = now.saturating_add(ttl_ms * MS);
        // Count admitted cost before the lease is published (undone if it is not).
        for (l, s) in taken(&held, &slots) {
            self.count(&s.admitted, l.id, l.reserved);
        }
        let head = LeaseHead {
            admitted_at_ns: now,
            expires_at_ns: expires,
            input_tokens: req.cost.input_tokens,
            max_output_tokens: req.cost.max_output_tokens,
        };
        // A key whose slot was sealed since it was debited (evicted, or replaced) may
        // leave the table; so may one the table snapshot did not show (found or made on
        // the slow path: a completion's snapshot may not show it either, and an eviction
        // then drops it from pending before the record is written). Those leases keep
        // the key's name (see `LeaseTable::insert`). A key this lease reserved nothing
        // on may be evicted at rest before its completion charges what was used: while
        // the lease is live the eviction names it (`keep_names`); after, the
        // completion's snapshot still shows it (`charge_units`). Naming it here cost an
        // allocation per admission (an embeddings request under an output rule).
        let sealed = |j: usize| {
            slots[j]
                .as_ref()
                .filter(|s| matches!(s, SlotRef::Owned(_)) || s.is_sealed())
                .map(|s| &s.key)
        };
        match self
            .leases
            .insert(hash, req.request_id, head, &held, n_held, sealed)
        {
            Ok(()) => {}
            Err(InsertError::Full) => {
                uncount(&held, &slots);
                self.rollback(now, &held, &slots);
                return Err(AdmitError::LeaseTableFull {
                    max: self.cfg.max_leases,
                });
            }
            Err(InsertError::Exists) => {
                // A concurrent retry of the same id won the race: undo ours, answer
                // with theirs.
                uncount(&held, &slots);
                self.rollback(now, &held, &slots);
                let l = self
                    .leases
                    .with_live(hash, req.request_id, Lease::clone)
                    .ok_or(AdmitError::RequestIdCollision)?;
                *out = self.replay(table, &l, now);
                return Ok(());
            }
            Err(InsertError::Finished { expired }) => {
                uncount(&held, &slots);
                self.rollback(now, &held, &slots);
                return Err(AdmitError::RequestIdFinished { expired });
            }
        }
        if let Decision::Admitted(a) = out {
            a.lease_expires_at_ns = Some(expires);
        }
        // Only the first `n_held` can hold a slot (and only a slow-path one owns it):
        // drop those, not eight (the array's own drop checks every entry).
        for s in &mut slots[..n_held] {
            drop(s.take());
        }
        std::mem::forget(slots);
        Ok(())
    }

    /// A live lease as a decision (a retried request id is answered with its lease): each
    /// limit as its key's slot shows it now (from `table`, else from pending: a key new
    /// since the snapshot), or, for a key evicted since, as its rule's whole limit, full.
    fn replay(&self, table: &KeyTable, l: &Lease, now: u64) -> Decision {
        let mut limits = Limits::EMPTY;
        for ll in l.limits() {
            let slot = match table.lookup(ll.id, ll.check) {
                Some(s) if !s.is_sealed() => Some(Arc::clone(s)),
                _ => self.current_of(ll),
            };
            let (params, state) = match slot {
                Some(s) => (s.params.shape(), s.load()),
                None => {
                    let whole = &table.compiled[ll.rule as usize].whole;
                    (whole.shape(), Slot::full_state(whole, now))
                }
            };
            limits.push(LimitStatus {
                rule: ll.rule,
                dimension: ll.dimension,
                mode: ll.mode,
                cost: ll.reserved,
                shadow_rejected: false,
                params,
                state,
                now,
            });
        }
        Decision::Admitted(Admitted {
            lease_expires_at_ns: Some(l.expires_at_ns),
            replayed: true,
            limits,
        })
    }

    /// The key's live slot: from the table snapshot when `first` (the decision path:
    /// no lock, no allocation), else, after meeting a sealed slot, from the slow path.
    /// Also returns the key's id as hashed (what a lease keeps to find the key again).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn slot_for<'t>(
        &self,
        table: &'t KeyTable,
        now: u64,
        rule: u32,
        values: &[&str],
        first: bool,
        memo: &mut KeyMemo,
    ) -> Result<(SlotRef<'t>, u64), AdmitError> {
        let (id, check) = KeyHashing::ids_from(memo.hashes(&self.hashing, values), rule);
        if first && let Some(s) = table.lookup(id, check) {
            return Ok((SlotRef::Table(s), id));
        }
        self.resolve_slow(now, id, check, rule, values)
            .map(|s| (SlotRef::Owned(s), id))
    }

    /// Adds `n` to one of a key's counts (`counter`, a count of its slot) and marks the
    /// key, stored under `id`, changed for the sync client's next walk
    /// ([`ChangeMarks`]: the add is sequentially consistent, a locked add either way).
    #[inline(always)]
    fn count(&self, counter: &AtomicU64, id: u64, n: u64) {
        self.changed.count(counter, id, n);
    }

    /// Counts `cost(rule)` as blocked demand on every later candidate rule the request
    /// matches (they were never evaluated because an earlier rule rejected it). Creates
    /// keys it has not seen (a new key's demand is what gets it a grant); a full key
    /// table just loses the count.
    fn block_later(
        &self,
        table: &KeyTable,
        now: u64,
        later: &[u32],
        descriptors: &[(&str, &str)],
        cost: impl Fn(&CompiledRule) -> u64,
    ) {
        let mut values: [&str; MAX_DESCRIPTORS] = [""; MAX_DESCRIPTORS];
        let mut memo = KeyMemo::default();
        for &ri in later {
            let rule = &table.compiled[ri as usize];
            let Some(nv) = rule.matches(descriptors, &mut values) else {
                continue;
            };
            let c = cost(rule);
            if c == 0 {
                continue;
            }
            if let Ok((slot, id)) = self.slot_for(table, now, ri, &values[..nv], true, &mut memo) {
                self.count(&slot.blocked, id, rule.demand(c));
            }
        }
    }

    /// Undoes every debit in `held`, taken from `slots` (a rejection or a failed insert).
    fn rollback(&self, now: u64, held: &[Option<LeaseLimit>], slots: &[Option<SlotRef<'_>>]) {
        for (l, s) in taken(held, slots) {
            if !s.settle(now, l.debited, l.held()) {
                // Sealed since: settle on the current slot, in units.
                self.settle_current(now, l, l.reserved);
            }
            if l.dimension == Dimension::Concurrency {
                self.changed.mark(l.id);
            }
        }
    }

    /// Settles `l` on the key's *current* slot (the one it was debited on has been
    /// sealed by a slice change; its held units carried over): gives back `refund`
    /// units (one slot, for concurrency) and releases what `l` held.
    fn settle_current(&self, now: u64, l: &LeaseLimit, refund: u64) {
        self.settle_live(now, || self.current_of(l), refund, l.held());
    }

    /// Gives `refund` units back and releases `held` on the key's live slot, as
    /// `live` finds it, again if a slice change seals it meanwhile.
    fn settle_live(&self, now: u64, live: impl Fn() -> Option<Arc<Slot>>, refund: u64, held: u64) {
        for _ in 0..8 {
            let Some(slot) = live() else {
                return; // evicted at rest: it held nothing
            };
            let amount = match &slot.params {
                Params::Slots(_) => refund.min(1),
                Params::Rate(p) => p.refund_ns(refund),
                Params::Closed(_) => refund,
            };
            if slot.settle(now, amount, held) {
                return;
            }
        }
    }

    /// Charges `units` beyond `l`'s reservation to its key: on `found` (the key's slot
    /// in the table), else on its current one.
    fn charge_units(
        &self,
        now: u64,
        l: &LeaseLimit,
        units: u64,
        found: Option<&Slot>,
        name: Option<&Arc<LimitKey>>,
    ) {
        if found.is_some_and(|s| s.charge(now, units)) {
            return;
        }
        for _ in 0..8 {
            let slot = match self.current_of(l) {
                Some(s) => s,
                // Evicted at rest since (a lease that holds nothing, or one that
                // expired, does not keep its key): recreated as it was, full, and
                // charged, named by the lease, else by the completion's table
                // snapshot (a key evicted after its lease left the lease table, too
                // late to name it, was still in a snapshot taken before). Lost only if
                // neither shows it or the key table is full.
                None => match self.recreate(now, l, name.or(found.map(|s| &s.key))) {
                    Some(s) => s,
                    None => return,
                },
            };
            if slot.charge(now, units) {
                return;
            }
        }
    }

    /// Gives `units` back on the live slot of `sealed`'s key (found by its hashes): a
    /// debit taken on a slot that a slice change or a reload sealed since was carried
    /// over to its successor (a rejected RLS decision undoes it there, as
    /// `settle_current` does for a lease).
    fn undo_on_current(&self, now: u64, sealed: &Slot, units: u64) {
        let k = &sealed.key;
        let live = || {
            let slow = self.slow();
            find_live(&slow, &self.table.load(), k.id, k.check).map(|(_, s)| s)
        };
        self.settle_live(now, live, units, 0);
    }

    /// `l`'s key made again after an eviction, from the name the lease kept or a
    /// sealed slot still shows.
    fn recreate(
        &self,
        now: u64,
        l: &LeaseLimit,
        name: Option<&Arc<LimitKey>>,
    ) -> Option<Arc<Slot>> {
        let key = name.cloned().or_else(|| self.name_of(l))?;
        let values: Vec<&str> = key.values.iter().map(|v| &**v).collect();
        self.resolve_slow(now, l.id, l.check, l.rule, &values).ok()
    }

    /// The live slot of `l`'s key, from pending or the table, without creating one.
    fn current_of(&self, l: &LeaseLimit) -> Option<Arc<Slot>> {
        let slow = self.slow();
        let table = self.table.load();
        find_by_hashes(&slow, &table, l, true).map(Arc::clone)
    }

    /// The name of `l`'s key from pending or the table (a sealed slot's will do), for
    /// a usage record whose key the table snapshot did not show.
    fn name_of(&self, l: &LeaseLimit) -> Option<Arc<LimitKey>> {
        name_by_hashes(&self.slow(), &self.table.load(), l)
    }

    /// The live slot for a key, from pending or the table, without creating one.
    fn current_slot(&self, rule: u32, values: &[&str]) -> Option<Arc<Slot>> {
        let (id, check) = self.key_hashes(rule, values);
        let slow = self.slow();
        let table = self.table.load();
        find_live(&slow, &table, id, check).map(|(_, s)| s)
    }

    /// The slow path: find the key's live slot, or create it. `id` and `check`: the
    /// key's hashes ([`Engine::key_hashes`]).
    fn resolve_slow(
        &self,
        now: u64,
        id: u64,
        check: u64,
        rule: u32,
        values: &[&str],
    ) -> Result<Arc<Slot>, AdmitError> {
        let mut slow = self.slow();
        let table = self.table.load();
        if let Some((_, s)) = find_live(&slow, &table, id, check) {
            // A key still waiting in `pending` is used again: publish soon, so it
            // leaves the slow path. The interval grows with the table (a publish copies
            // its chunk array, and all of it when it rebuilds).
            let interval = walk_interval_ns(table.len());
            if now.saturating_sub(slow.published_at_ns) >= interval {
                drop(table);
                self.publish_locked(&mut slow, now);
            }
            return Ok(s);
        }
        if slow.keys >= self.cfg.max_keys {
            // A table full of keys in use: one walk per interval looks for keys at rest
            // (a clock that went back walks at once); a new key meanwhile is refused
            // without one, or a stream of new keys would make each pay for them all.
            let interval = walk_interval_ns(table.len());
            drop(table);
            let recent = slow
                .full_walk_at_ns
                .is_some_and(|t| now.wrapping_sub(t) < interval);
            let evicted = if recent {
                0
            } else {
                self.evict_locked(&mut slow, now, 0, self.cfg.max_keys / 16 + 1)
            };
            slow.full_walk_at_ns = match (evicted, recent) {
                (0, false) => Some(now),
                (0, true) => slow.full_walk_at_ns,
                _ => None,
            };
            if evicted == 0 {
                return Err(AdmitError::KeyTableFull {
                    max: self.cfg.max_keys,
                });
            }
            self.publish_locked(&mut slow, now);
        }
        let table = self.table.load();
        let slot_id = free_id(&slow, &table, id).ok_or(AdmitError::KeyTableFull {
            max: self.cfg.max_keys,
        })?;
        let c = &slow.compiled[rule as usize];
        let named = Named {
            check,
            rule,
            values,
        };
        let (params, state) = match slow.slices.get(&named as &dyn KeyView) {
            // A granted key whose slot was evicted at rest: recreate it full, as it was.
            Some(s) => (s.grant, Slot::full_state(&s.grant, now)),
            None => match self.cfg.slice_source {
                SliceSource::Standalone => (c.whole, Slot::full_state(&c.whole, now)),
                SliceSource::Allocated => {
                    let closed = match c.whole {
                        Params::Slots(_) => Params::Slots(0),
                        Params::Rate(p) => Params::Closed(p.limit),
                        Params::Closed(l) => Params::Closed(l),
                    };
                    (closed, Slot::full_state(&closed, now))
                }
            },
        };
        let key = Arc::new(LimitKey {
            id: slot_id,
            check: named.check,
            rule,
            display: display_key(&c.rule, values).into(),
            values: values.iter().map(|v| Box::<str>::from(*v)).collect(),
        });
        let slot = Arc::new(Slot::new(key, params, state, now));
        slow.pending.insert(slot_id, Arc::clone(&slot));
        self.changed.mark(slot_id);
        slow.keys += 1;
        slow.created_seq += 1;
        let seq = slow.created_seq;
        slow.created.push_back((seq, Arc::clone(&slot.key)));
        if slow.created.len() > CREATED_MAX {
            slow.created.pop_front();
        }
        if slow.pending.len() > 64 + table.len() / 16 {
            drop(table);
            self.publish_locked(&mut slow, now);
        }
        Ok(slot)
    }

    /// Folds pending slots into a new table and drops sealed ones.
    fn publish_locked(&self, slow: &mut Slow, now: u64) {
        slow.published_at_ns = slow.published_at_ns.max(now);
        let old = self.table.load();
        let pending: Vec<(u64, Arc<Slot>)> = slow
            .pending
            .drain()
            .filter(|(_, s)| !s.is_sealed())
            .collect();
        let capacity = old.len() + pending.len();
        // Few changes: update the spare in place, or copy only the chunks they touch (a
        // replacement takes the cell of the slot it sealed). Past a quarter of evicted
        // garbage, or full: rebuild.
        let fits = slow.table_garbage * 4 <= old.len() && old.fits(pending.len());
        let caught_up = match slow.spare.take() {
            Some((spare, lag)) if fits => KeyTable::caught_up(spare, lag, &pending, &old),
            _ => None,
        };
        let table = match caught_up {
            Some(t) => Some(t),
            None if fits => old.with_updates(pending.clone()).ok().map(Arc::new),
            None => None,
        };
        if let Some(mut t) = table {
            drop(old);
            if let Some(t) = Arc::get_mut(&mut t)
                && !Arc::ptr_eq(&t.compiled, &slow.compiled)
            {
                t.compiled = Arc::clone(&slow.compiled);
            }
            debug_assert!(
                Arc::ptr_eq(&t.compiled, &slow.compiled),
                "a table of old rules"
            );
            slow.spare = Some((self.table.swap(t), pending));
            return;
        }
        slow.table_garbage = 0;
        slow.spare = None;
        let kept = old
            .iter()
            .filter(|(_, s)| !s.is_sealed())
            .map(|(id, s)| (id, Arc::clone(s)));
        // Pending slots come last: a replacement wins over the slot it sealed.
        let mut table = KeyTable::build(capacity, kept.chain(pending));
        table.compiled = Arc::clone(&slow.compiled);
        self.table.store(Arc::new(table));
    }

    /// Seals up to `max` slots at rest for `idle_ns`; returns how many.
    fn evict_locked(&self, slow: &mut Slow, now: u64, idle_ns: u64, max: usize) -> usize {
        let table = self.table.load();
        let mut evicted = 0;
        let retire = |slow_retired: &mut Vec<(u64, u64, u64)>, s: &Slot| {
            let r = &mut slow_retired[s.key.rule as usize];
            retire_counts(r, s);
        };
        let candidates: Vec<Arc<Slot>> = live_slots(slow, &table)
            .map(|(_, s)| Arc::clone(s))
            .collect();
        // The names of the keys evicted, by check hash: live leases that name them keep
        // them (a lease refers to its keys by hashes only).
        let mut gone: HashMap<u64, Arc<LimitKey>> = HashMap::new();
        for s in candidates {
            if evicted >= max {
                break;
            }
            // A key under a live grant is the allocator's to manage (an allocated agent
            // keeps it). Once the grant's lease has ended (the allocator reclaims it
            // after the lease plus its margin), an idle key goes with its slice, or an
            // agent whose keys churn would fill its tables with keys granted long ago
            // and refuse every new one; if it comes back it is a new key (closed until
            // granted, reported at once). A closed one goes with any debt it carried:
            // else one that closed in debt and never came back would stay for good.
            let ended = slow
                .slices
                .get(&*s.key as &dyn KeyView)
                .map(|st| st.expired);
            if self.cfg.slice_source == SliceSource::Allocated && ended == Some(false) {
                continue;
            }
            if s.seal_if_at_rest(now, idle_ns, ended == Some(true)) {
                if ended == Some(true) {
                    slow.slices.remove(&*s.key as &dyn KeyView);
                }
                if slow.gone_tracking {
                    slow.gone_seq += 1;
                    let seq = slow.gone_seq;
                    slow.gone.push_back((seq, Arc::clone(&s)));
                    if slow.gone.len() > GONE_MAX {
                        slow.gone.pop_front();
                    }
                }
                slow.table_garbage += 1;
                retire(&mut slow.retired, &s);
                slow.keys -= 1;
                evicted += 1;
                gone.insert(s.check, Arc::clone(&s.key));
            }
        }
        // Every slot above is sealed by now; a lease inserted after this walk passes its
        // shard sees that at insert and keeps the name itself (`LeaseTable::insert`).
        self.leases.keep_names(&gone);
        evicted
    }

    /// Settles a request: refunds `reserved - actual` once, releases its slots and emits
    /// one usage record. Idempotent on the request id.
    pub fn complete(
        &self,
        now: u64,
        request_id: &str,
        usage: Usage,
        status: CompletionStatus,
    ) -> Result<Completion, CompleteError> {
        // The lease is copied out into a per-thread buffer (a fresh one is 440 bytes to
        // initialise per call); a sink that completes from inside `record` gets its own.
        self.with_table(|table| {
            COMPLETION_BUFFER.with(|b| match b.try_borrow_mut() {
                Ok(mut lease) => {
                    self.complete_in(table, now, request_id, usage, status, &mut lease)
                }
                Err(_) => {
                    let mut lease = Lease::EMPTY;
                    self.complete_in(table, now, request_id, usage, status, &mut lease)
                }
            })
        })
    }

    // Inlined into its two callers (the engine's, and the worker's with its cached
    // table snapshot).
    #[inline(always)]
    fn complete_in(
        &self,
        table: &KeyTable,
        now: u64,
        request_id: &str,
        usage: Usage,
        status: CompletionStatus,
        lease: &mut Lease,
    ) -> Result<Completion, CompleteError> {
        validate_id(request_id).map_err(CompleteError::Invalid)?;
        validate_usage(&usage)?;
        let hash = self.hashing.request_hash(request_id);
        let (lease, live, outcome, done) = match self
            .leases
            .remove_for_completion(hash, request_id, now, lease)
        {
            Removed::Live => (
                &*lease,
                true,
                Outcome::Completed(status),
                Completion::Settled,
            ),
            Removed::Expired(expired) => {
                *lease = expired.lease;
                (
                    &*lease,
                    false,
                    Outcome::LateCompleted(status),
                    Completion::Late,
                )
            }
            Removed::Completed => return Ok(Completion::Duplicate),
            Removed::Unknown => return Err(CompleteError::UnknownRequest),
        };
        let found = self.found(table, lease);
        for (j, (l, f)) in lease.limit_slots().iter().zip(&found).enumerate() {
            if let Some(l) = l {
                let name = lease.name(j);
                self.settle(now, &table.compiled, l, f.map(|s| &**s), name, &usage, live);
            }
        }
        self.record(request_id, outcome, Some(usage), now, lease, &found);
        Ok(done)
    }

    /// Each limit's key as the table snapshot shows it (a sealed slot included).
    #[inline]
    fn found<'t>(
        &self,
        table: &'t KeyTable,
        lease: &Lease,
    ) -> [Option<&'t Arc<Slot>>; MAX_LIMITS_PER_REQUEST] {
        let mut found = [None; MAX_LIMITS_PER_REQUEST];
        for (f, l) in found.iter_mut().zip(lease.limit_slots()) {
            if let Some(l) = l {
                *f = table.lookup(l.id, l.check);
            }
        }
        found
    }

    /// Hands one usage record for `lease` to the sink, each limit named by the name the
    /// lease kept, else by its slot in the snapshot (`found`), else (rare: a key new
    /// since the snapshot) from the slow path.
    fn record(
        &self,
        request_id: &str,
        outcome: Outcome,
        usage: Option<Usage>,
        now: u64,
        lease: &Lease,
        found: &[Option<&Arc<Slot>>; MAX_LIMITS_PER_REQUEST],
    ) {
        let known = |j: usize| lease.name(j).or(found[j].map(|s| &s.key));
        if self.emit(request_id, outcome, usage, now, lease, known, false) {
            return;
        }
        let named: Vec<Option<Arc<LimitKey>>> = lease
            .limit_slots()
            .iter()
            .enumerate()
            .map(|(j, l)| match l {
                Some(l) if known(j).is_none() => self.name_of(l),
                _ => None,
            })
            .collect();
        let all = |j: usize| known(j).or(named[j].as_ref());
        self.emit(request_id, outcome, usage, now, lease, all, true);
    }

    /// [`Engine::record`]'s record: limit `j` named by `key_of(j)`. A limit without a
    /// name sends nothing and returns false, unless `partial` (then it is left out).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn emit<'k>(
        &self,
        request_id: &str,
        outcome: Outcome,
        usage: Option<Usage>,
        now: u64,
        lease: &Lease,
        key_of: impl Fn(usize) -> Option<&'k Arc<LimitKey>>,
        partial: bool,
    ) -> bool {
        let mut limits: [Option<RecordLimit<'k>>; MAX_LIMITS_PER_REQUEST] =
            [None; MAX_LIMITS_PER_REQUEST];
        for (j, (slot, l)) in limits.iter_mut().zip(lease.limit_slots()).enumerate() {
            let Some(l) = l else { continue };
            let Some(key) = key_of(j) else {
                debug_assert!(!partial, "a lease lost the name of its key");
                if partial {
                    continue;
                }
                return false;
            };
            *slot = Some(RecordLimit {
                key,
                dimension: l.dimension,
                mode: l.mode,
                reserved: l.reserved,
            });
        }
        self.sink.record(&UsageRecord {
            request_id,
            outcome,
            usage,
            reserved_input_tokens: lease.input_tokens,
            max_output_tokens: lease.max_output_tokens,
            admitted_at_ns: lease.admitted_at_ns,
            at_ns: now,
            limits: &limits[..lease.len as usize],
        });
        true
    }

    /// Reconciles one limit. `live`: the lease was live (refund and release);
    /// otherwise it expired earlier (slots and held units already released, nothing
    /// refunded), and only usage beyond the reservation is charged. `found`: the key's
    /// slot in the table snapshot, if it showed one: the refund is exact on the bucket
    /// debited (same generation), else in units on the key's current slot.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &self,
        now: u64,
        compiled: &[CompiledRule],
        l: &LeaseLimit,
        found: Option<&Slot>,
        name: Option<&Arc<LimitKey>>,
        usage: &Usage,
        live: bool,
    ) {
        if l.dimension == Dimension::Concurrency {
            if live && l.debited > 0 && !found.is_some_and(|s| s.settle(now, l.debited, 0)) {
                self.settle_current(now, l, l.debited);
            }
            // The slots in flight changed: the sync client reports them.
            self.changed.mark(l.id);
            return;
        }
        let rule = &compiled[l.rule as usize];
        let actual = rule.actual(l.reserved, usage);
        if live && (l.holds || actual < l.reserved) {
            let used = actual.min(l.reserved);
            let settled = match found {
                Some(s) if s.generation() == l.generation => {
                    let exact_ns = match &s.params {
                        Params::Rate(p) => l.debited.saturating_sub(p.debit_ns(used)),
                        // Unreachable (a closed bucket debits nothing, so no lease
                        // names its generation); in units, as `settle_current`.
                        Params::Closed(_) => l.reserved - used,
                        Params::Slots(_) => 0,
                    };
                    s.settle(now, exact_ns, l.held())
                }
                _ => false,
            };
            if !settled {
                self.settle_current(now, l, l.reserved - used);
            }
        }
        if actual > l.reserved {
            self.charge_units(now, l, actual - l.reserved, found, name);
        }
    }

    /// Sets a live lease's expiry to `now + ttl_ms` (`None`: the default TTL).
    pub fn extend(
        &self,
        now: u64,
        request_id: &str,
        ttl_ms: Option<u64>,
    ) -> Result<u64, ExtendError> {
        validate_id(request_id).map_err(ExtendError::Invalid)?;
        let ttl_ms = ttl_ms.unwrap_or(self.cfg.lease_ttl_ms);
        if ttl_ms == 0 || ttl_ms > self.cfg.max_lease_ttl_ms {
            return Err(ExtendError::InvalidTtl {
                ttl_ms,
                max_ms: self.cfg.max_lease_ttl_ms,
            });
        }
        let hash = self.hashing.request_hash(request_id);
        let at = now.saturating_add(ttl_ms * MS);
        if self.leases.extend(hash, request_id, now, at) {
            Ok(at)
        } else {
            Err(ExtendError::NotLive)
        }
    }

    /// [`Engine::decide_hits`]'s checks of `descriptors` alone, charging nothing: a
    /// caller deciding several (Envoy's RLS) checks them all first, so that a bad one
    /// refuses the call before any is charged.
    pub fn validate_descriptors(
        &self,
        domain: Option<&str>,
        descriptors: &[(&str, &str)],
    ) -> Result<(), AdmitError> {
        validate_request(&AdmitRequest {
            request_id: "check",
            domain,
            descriptors,
            cost: Cost::ONE_REQUEST,
            ttl_ms: None,
        })
    }

    /// Decides one Envoy RLS descriptor: a single number of `hits` and no lease (Envoy
    /// never completes). Per matched rule: `requests` rules take `hits` all-or-nothing
    /// (0: a check); token rules are checked when `hits` is 0 (Envoy's AI gateway asks
    /// before the request) and otherwise charged *after* the request rules pass, past
    /// zero if need be (the AI gateway reports tokens already spent, on stream end);
    /// concurrency rules do not apply (nothing would release the slot).
    pub fn decide_hits(
        &self,
        now: u64,
        domain: Option<&str>,
        descriptors: &[(&str, &str)],
        hits: u64,
    ) -> Result<Decision, AdmitError> {
        self.with_table(|table| self.decide_hits_in(table, now, domain, descriptors, hits))
    }

    fn decide_hits_in(
        &self,
        table: &KeyTable,
        now: u64,
        domain: Option<&str>,
        descriptors: &[(&str, &str)],
        hits: u64,
    ) -> Result<Decision, AdmitError> {
        validate_request(&AdmitRequest {
            request_id: "rls",
            domain,
            descriptors,
            cost: Cost {
                requests: hits,
                input_tokens: 0,
                max_output_tokens: Some(0),
            },
            ttl_ms: None,
        })?;
        let mut limits = Limits::EMPTY;
        // Each with the key's id (for its change mark).
        let mut taken: [Option<(SlotRef<'_>, u64, u64)>; MAX_LIMITS_PER_REQUEST] =
            [const { None }; MAX_LIMITS_PER_REQUEST];
        let mut charges: [Option<(u32, SlotRef<'_>, u64)>; MAX_LIMITS_PER_REQUEST] =
            [const { None }; MAX_LIMITS_PER_REQUEST];
        let (mut n_taken, mut n_charges) = (0, 0);
        let mut matched = false;
        let mut values: [&str; MAX_DESCRIPTORS] = [""; MAX_DESCRIPTORS];
        let mut memo = KeyMemo::default();
        let undo = |taken: &[Option<(SlotRef<'_>, u64, u64)>]| {
            for (slot, amount, _) in taken.iter().flatten() {
                if !slot.settle(now, *amount, 0) {
                    // Sealed since (a slice change or a reload carried the debit over
                    // to the key's new slot): give the units back there.
                    self.undo_on_current(now, slot, hits);
                }
            }
        };
        let candidates = self.candidates(domain);
        'rules: for (pos, &ri) in candidates.iter().enumerate() {
            let rule = &table.compiled[ri as usize];
            if rule.dimension == Dimension::Concurrency {
                continue;
            }
            let Some(nv) = rule.matches(descriptors, &mut values) else {
                continue;
            };
            let values = &values[..nv];
            matched = true;
            // Deferred charges (token rules, counted after the decision) take a place of
            // the eight too: their array has room for eight (thirty-first session: it
            // was checked against the other limits only, and a ninth token rule
            // indexed past it).
            if limits.len + n_charges >= MAX_LIMITS_PER_REQUEST {
                if !rule.enforce {
                    // A shadow rule never fails a decision (as in `admit_in`).
                    continue;
                }
                undo(&taken);
                return Err(AdmitError::TooManyLimits {
                    max: MAX_LIMITS_PER_REQUEST,
                });
            }
            let deferred = rule.refundable() && hits > 0;
            let cost = if deferred { 0 } else { hits };
            if !deferred && cost > rule.whole_capacity && rule.enforce {
                undo(&taken);
                return Ok(Decision::Rejected(Rejected {
                    rule: ri as usize,
                    reason: RejectReason::NeverFits {
                        cost,
                        burst: rule.whole_capacity,
                    },
                    limits,
                }));
            }
            let mut first = true;
            loop {
                let (slot, id) = match self.slot_for(table, now, ri, values, first, &mut memo) {
                    Ok(s) => s,
                    Err(AdmitError::KeyTableFull { .. }) if !rule.enforce => continue 'rules,
                    Err(e) => {
                        undo(&taken);
                        return Err(e);
                    }
                };
                first = false;
                if deferred {
                    charges[n_charges] = Some((ri, slot, id));
                    n_charges += 1;
                    break;
                }
                match slot.try_take(now, cost, false) {
                    Take::Taken { amount, after } => {
                        limits.push(status(rule, cost, false, &slot.params, after, now));
                        taken[n_taken] = Some((slot, amount, id));
                        n_taken += 1;
                        break;
                    }
                    Take::Busy {
                        retry_after_ns,
                        after,
                    } => {
                        self.count(&slot.rejected, id, rule.demand(cost.max(1)));
                        limits.push(status(rule, cost, !rule.enforce, &slot.params, after, now));
                        if rule.enforce {
                            undo(&taken);
                            for (slot, _, id) in taken.iter().flatten() {
                                self.count(&slot.blocked, *id, hits);
                            }
                            for (ri, slot, id) in charges.iter().flatten() {
                                let demand = table.compiled[*ri as usize].demand(hits);
                                self.count(&slot.blocked, *id, demand);
                            }
                            self.block_later(
                                table,
                                now,
                                &candidates[pos + 1..],
                                descriptors,
                                |r| {
                                    if r.dimension == Dimension::Concurrency {
                                        0
                                    } else {
                                        hits
                                    }
                                },
                            );
                            return Ok(Decision::Rejected(Rejected {
                                rule: ri as usize,
                                reason: RejectReason::RetryLater { retry_after_ns },
                                limits,
                            }));
                        }
                        break;
                    }
                    Take::Sealed => continue,
                }
            }
        }
        if !matched && self.cfg.unmatched == Unmatched::Reject {
            return Err(AdmitError::NoMatchingRule);
        }
        for (slot, _, id) in taken.iter().flatten() {
            self.count(&slot.admitted, *id, hits);
        }
        for (ri, slot, id) in charges.iter().flatten() {
            let rule = &table.compiled[*ri as usize];
            let mut slot = Arc::clone(&**slot);
            for _ in 0..8 {
                if slot.charge(now, hits) {
                    break;
                }
                let k = Arc::clone(&slot.key);
                let vals: Vec<&str> = k.values().collect();
                // By the key's hashes: its `id` is the cell it sits in, which probing
                // may have moved past the hashed one.
                let (id, check) = self.key_hashes(k.rule, &vals);
                match self.resolve_slow(now, id, check, k.rule, &vals) {
                    Ok(s) => slot = s,
                    Err(_) => break,
                }
            }
            self.count(&slot.admitted, *id, hits);
            if limits.len < MAX_LIMITS_PER_REQUEST {
                limits.push(status(rule, hits, false, &slot.params, slot.load(), now));
            }
        }
        Ok(Decision::Admitted(Admitted {
            lease_expires_at_ns: None,
            replayed: false,
            limits,
        }))
    }

    /// Charges a cost that was already spent (Envoy's post-hoc `hits_addend`), past zero
    /// if need be: the buckets go into debt and later requests wait. Holds no lease.
    /// Returns how many limits were charged. A limit whose key cannot be made (the key
    /// table full) does not stop the others: a cost already spent is charged wherever
    /// it can be, and then the first such error is returned.
    pub fn charge(&self, now: u64, req: &AdmitRequest<'_>) -> Result<usize, AdmitError> {
        validate_request(req)?;
        let table = self.table.load();
        let mut values: [&str; MAX_DESCRIPTORS] = [""; MAX_DESCRIPTORS];
        let mut memo = KeyMemo::default();
        let mut charged = 0;
        let mut failed = None;
        for &ri in self.candidates(req.domain) {
            let rule = &table.compiled[ri as usize];
            let Some(nv) = rule.matches(req.descriptors, &mut values) else {
                continue;
            };
            if rule.dimension == Dimension::Concurrency {
                continue;
            }
            let values = &values[..nv];
            let cost = rule.cost(&req.cost);
            for attempt in 0..8 {
                let (slot, id) =
                    match self.slot_for(&table, now, ri, values, attempt == 0, &mut memo) {
                        Ok(s) => s,
                        Err(e) => {
                            failed.get_or_insert(e);
                            break;
                        }
                    };
                if slot.charge(now, cost) {
                    // As demand, at most the rule's whole capacity a request, as at
                    // admission: a charge may be up to `MAX_COST`, and a few such made
                    // one report line carry more than the allocator reads.
                    self.count(&slot.admitted, id, rule.demand(cost));
                    charged += 1;
                    break;
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(charged),
        }
    }

    /// Applies allocator grants. Each update is fenced by (epoch, seq); a changed slice
    /// seals the key's slot and installs a converted one (invariant 2).
    pub fn apply_slices(
        &self,
        now: u64,
        updates: &[SliceUpdate],
    ) -> Vec<Result<SliceApplied, SliceError>> {
        let mut slow = self.slow();
        let out = updates
            .iter()
            .map(|u| self.apply_one_locked(&mut slow, now, u))
            .collect();
        self.publish_locked(&mut slow, now);
        out
    }

    fn apply_one_locked(
        &self,
        slow: &mut Slow,
        now: u64,
        u: &SliceUpdate,
    ) -> Result<SliceApplied, SliceError> {
        let rules = self.rules.load();
        let (ri, rule) = rules
            .by_name(&u.rule)
            .ok_or_else(|| SliceError::UnknownRule(u.rule.clone()))?;
        let wildcards = rule.wildcards();
        if u.values.len() != wildcards {
            return Err(SliceError::WrongValues {
                rule: u.rule.clone(),
                expected: wildcards,
                got: u.values.len(),
            });
        }
        if u.lease_expires_at_ns <= now {
            // A grant that arrives after its own lease ended (a slow link, a replay):
            // applying it would put a lapsed grant in force until the next maintenance.
            return Err(SliceError::LeaseEnded {
                rule: u.rule.clone(),
                expired_ns_ago: now - u.lease_expires_at_ns,
            });
        }
        if u.rate > MAX_COST || u.burst > MAX_COST || u.transfer_tokens > MAX_COST {
            return Err(SliceError::Absurd {
                rule: u.rule.clone(),
            });
        }
        let ri = ri as u32;
        let named = Named::new(&self.hashing, ri, &u.values);
        if let Some(s) = slow.slices.get(&named as &dyn KeyView)
            && (u.epoch < s.epoch || (u.epoch == s.epoch && u.seq <= s.seq))
        {
            return Err(SliceError::Stale {
                epoch: u.epoch,
                seq: u.seq,
                held_epoch: s.epoch,
                held_seq: s.seq,
            });
        }
        // The length first: the lookup only near the bound.
        if slow.slices.len() >= self.cfg.max_keys
            && !slow.slices.contains_key(&named as &dyn KeyView)
        {
            return Err(SliceError::TableFull {
                max: self.cfg.max_keys,
            });
        }
        let c = &slow.compiled[ri as usize];
        let grant = match c.whole {
            Params::Slots(_) => Params::Slots(u.burst),
            Params::Rate(p) => Params::rate(RateLimit {
                rate: u.rate,
                burst: u.burst,
                period_ns: p.limit.period_ns,
            }),
            Params::Closed(l) => Params::rate(RateLimit {
                rate: u.rate,
                burst: u.burst,
                period_ns: l.period_ns,
            }),
        };
        let (applied, key) =
            self.install_locked(slow, now, ri, &u.values, grant, u.transfer_tokens)?;
        let state = SliceState {
            epoch: u.epoch,
            seq: u.seq,
            grant,
            lease_expires_at_ns: u.lease_expires_at_ns,
            fleet_size: u.fleet_size.max(1),
            expired: false,
        };
        // Keyed by the live slot's key, so that report walks match it by pointer (a
        // key recreated after an eviction is a new `LimitKey`).
        slow.slices.remove(&named as &dyn KeyView);
        slow.slices.insert(SliceKey(key), state);
        slow.next_slice_end_ns = slow.next_slice_end_ns.min(u.lease_expires_at_ns);
        Ok(applied)
    }

    /// Applies a lease extension from the allocator: every slice of term `x.epoch` with a
    /// seq up to `x.through_seq` keeps its grant until `x.lease_expires_at_ns` at least
    /// (the allocator counts those grants as in force until then, plus its margin). A
    /// slice whose lease has already ended stays on its posture: the allocator may have
    /// reclaimed that grant already, and the extension cannot say; the agent's next
    /// report shows the posture's slice, and the allocator sends the grant again if it
    /// still counts it. Extensions of one term only move forward (a reordered older one
    /// changes nothing); a newer term's replaces the last, whose slices keep the lease it
    /// gave them. Returns how many live slices it covers.
    pub fn extend_slices(&self, now: u64, x: SliceExtension) -> Result<usize, SliceError> {
        if x.lease_expires_at_ns <= now {
            return Err(SliceError::ExtensionEnded {
                expired_ns_ago: now - x.lease_expires_at_ns,
            });
        }
        let mut slow = self.slow();
        // A slice whose lease has ended but which maintenance has not reached yet goes
        // to its posture first: the new extension must not carry it on.
        if self.expire_slices_locked(&mut slow, now) > 0 {
            self.publish_locked(&mut slow, now);
        }
        let ext = match slow.extension {
            Some(cur) if cur.epoch > x.epoch => {
                return Err(SliceError::StaleExtension {
                    epoch: x.epoch,
                    held_epoch: cur.epoch,
                });
            }
            Some(cur) if cur.epoch == x.epoch => SliceExtension {
                epoch: x.epoch,
                through_seq: cur.through_seq.max(x.through_seq),
                lease_expires_at_ns: cur.lease_expires_at_ns.max(x.lease_expires_at_ns),
            },
            _ => x,
        };
        // A newer term's extension replaces the last one: the slices that one covered
        // keep what it gave them (the old term's allocator counted them so).
        let old = slow.extension.filter(|o| o.epoch != ext.epoch);
        slow.extension = Some(ext);
        let mut covered = 0;
        for st in slow.slices.values_mut() {
            if let Some(o) = old {
                st.lease_expires_at_ns = lease_end(st, Some(o));
            }
            if ext.covers(st) && !st.expired {
                covered += 1;
            }
        }
        Ok(covered)
    }

    /// Applies a revocation from the allocator: the grant on each of `keys` (rule name
    /// and `*` values) that term `epoch` issued with a seq up to `through_seq`, or an
    /// earlier term issued, ends its lease now. The key goes to its rule's posture, as
    /// when a lease ends, and no extension carries the grant on afterwards (a slice on
    /// its posture stays there until a new grant). The allocator sends this for grants
    /// it no longer counts: a reload removed the key's rule, or gave it another meaning
    /// than this agent's file does. A newer grant (another reload may have brought the
    /// rule back), a key without a slice, an unknown rule and a wrong number of values
    /// are left alone. Returns how many slices went to their posture.
    pub fn revoke_slices<S: AsRef<str>>(
        &self,
        now: u64,
        epoch: u64,
        through_seq: u64,
        keys: &[(&str, &[S])],
    ) -> usize {
        let rules = self.rules.load();
        let mut slow = self.slow();
        let mut revoked = 0;
        for (rule, values) in keys {
            let Some((ri, r)) = rules.by_name(rule) else {
                continue;
            };
            if values.len() != r.wildcards() {
                continue;
            }
            let named = Named::new(&self.hashing, ri as u32, values);
            let Some((key, st)) = slow.slices.get_key_value(&named as &dyn KeyView) else {
                continue;
            };
            if st.expired || (st.epoch, st.seq) > (epoch, through_seq) {
                continue;
            }
            let (key, st) = (key.clone(), *st);
            self.to_posture_locked(&mut slow, now, key, st);
            revoked += 1;
        }
        if revoked > 0 {
            self.publish_locked(&mut slow, now);
        }
        revoked
    }

    /// Seals the key's live slot (if any) and installs one with `params`, converting
    /// its state; a key without a slot starts empty plus `transfer`.
    fn install_locked(
        &self,
        slow: &mut Slow,
        now: u64,
        rule: u32,
        values: &[String],
        params: Params,
        transfer: u64,
    ) -> Result<(SliceApplied, Arc<LimitKey>), SliceError> {
        let vals: Vec<&str> = values.iter().map(|s| s.as_str()).collect();
        let (id, check) = self.key_hashes(rule, &vals);
        let table = self.table.load();
        let existing = find_live(slow, &table, id, check);
        if let Some((old_id, old)) = &existing
            && old.params == params
            && transfer == 0
        {
            // A renewal: same slice. Keep the slot (and its pending refunds); its new
            // epoch and seq are the sync client's to report.
            old.walk_unseen();
            self.changed.mark(*old_id);
            let state = old.load();
            let applied = SliceApplied {
                released_tokens: 0,
                in_flight: if matches!(params, Params::Slots(_)) {
                    state.tat
                } else {
                    0
                },
                replaced: None,
                current: None,
            };
            return Ok((applied, Arc::clone(&old.key)));
        }
        let (slot_id, key, state, released, replaced) = match existing {
            Some((slot_id, old)) => match old.seal() {
                Some(final_state) => {
                    retire_counts(&mut slow.retired[rule as usize], &old);
                    let (state, released) =
                        bucket::convert(&old.params, final_state, &params, now, transfer);
                    let key = Arc::clone(&old.key);
                    (slot_id, key, state, released, Some(SlotCounters(old)))
                }
                None => unreachable!("find_live returns unsealed slots; sealing needs the lock"),
            },
            None => {
                if slow.keys >= self.cfg.max_keys {
                    return Err(SliceError::TableFull {
                        max: self.cfg.max_keys,
                    });
                }
                let slot_id = free_id(slow, &table, id).ok_or(SliceError::TableFull {
                    max: self.cfg.max_keys,
                })?;
                let c = &slow.compiled[rule as usize];
                let key = Arc::new(LimitKey {
                    id: slot_id,
                    check,
                    rule,
                    display: display_key(&c.rule, &vals).into(),
                    values: vals.iter().map(|v| Box::<str>::from(*v)).collect(),
                });
                slow.keys += 1;
                (
                    slot_id,
                    key,
                    Slot::state_with(&params, now, transfer),
                    0,
                    None,
                )
            }
        };
        let in_flight = match params {
            Params::Slots(_) => state.tat,
            _ => 0,
        };
        let slot = Arc::new(Slot::new(Arc::clone(&key), params, state, now));
        slow.pending.insert(slot_id, Arc::clone(&slot));
        self.changed.mark(slot_id);
        let applied = SliceApplied {
            released_tokens: released,
            in_flight,
            replaced,
            current: Some(SlotCounters(slot)),
        };
        Ok((applied, key))
    }

    /// Periodic upkeep; the shell calls it every ~100 ms. Expires leases (releasing their
    /// slots, refunding nothing, recording each), applies the partition posture to
    /// slices whose lease ended, evicts keys at rest for `key_idle_ms`, and publishes.
    pub fn maintain(&self, now: u64) -> MaintainReport {
        let mut report = MaintainReport {
            leases_expired: self.expire_leases(now, now),
            ..MaintainReport::default()
        };
        let mut slow = self.slow();
        report.slices_expired = self.expire_slices_locked(&mut slow, now);
        if now >= slow.next_idle_scan_ns {
            let idle_ns = self.cfg.key_idle_ms * MS;
            slow.next_idle_scan_ns = now.saturating_add((idle_ns / 16).max(1));
            report.keys_evicted = self.evict_locked(&mut slow, now, idle_ns, usize::MAX);
        }
        // A publish copies the table: only when something changed.
        if !slow.pending.is_empty() || report.keys_evicted > 0 || report.slices_expired > 0 {
            self.publish_locked(&mut slow, now);
        }
        report
    }

    /// Expires every live lease now, recording each as `expired` (as [`Engine::maintain`]
    /// does at a lease's TTL), and returns how many: for a shutdown, after which no completion can
    /// reach them (the engine's state goes with the process). Before, a restart ended
    /// the leases in flight with no usage record at all.
    pub fn expire_all_leases(&self, now: u64) -> usize {
        self.expire_leases(now, u64::MAX)
    }

    /// Expires the leases whose expiry is at or before `until`, at time `now`.
    fn expire_leases(&self, now: u64, until: u64) -> usize {
        let mut expired = Vec::new();
        {
            // Expired leases keep their keys' names (a late completion may come after
            // the key is evicted). The slow-path lock first, then the shards', as
            // everywhere.
            let slow = self.slow();
            let table = self.table.load();
            self.leases.expire(
                now,
                until,
                self.cfg.tombstone_ttl_ms * MS,
                &mut expired,
                |l| name_by_hashes(&slow, &table, l),
            );
        }
        let table = self.table.load();
        for (id, lease) in &expired {
            let found = self.found(&table, lease);
            for (j, l) in lease.limit_slots().iter().enumerate() {
                let Some(l) = l else { continue };
                // Release slots and held units; refund nothing (the reservation is
                // charged in full: nobody said what was used). Held units carried over
                // to a replacement slot, so any live slot of the key releases them.
                let slots = if l.dimension == Dimension::Concurrency {
                    l.debited
                } else {
                    0
                };
                if (slots > 0 || l.holds)
                    && !found[j].is_some_and(|s| s.settle(now, slots, l.held()))
                {
                    self.settle_current(now, l, slots);
                }
                if slots > 0 {
                    self.changed.mark(l.id);
                }
            }
            self.record(id.as_str(), Outcome::Expired, None, now, lease, &found);
        }
        expired.len()
    }

    /// Puts every slice whose lease ended (by `now`, extension included) on its rule's
    /// posture; returns how many. The caller publishes.
    fn expire_slices_locked(&self, slow: &mut Slow, now: u64) -> usize {
        let mut expired = 0;
        // Posture for slices whose lease ended: a walk of every slice, only once one
        // can have ended (every 100 ms over 100,000 keys it was most of an idle agent's
        // maintenance).
        let mut ended: Vec<(SliceKey, SliceState)> = Vec::new();
        if now >= slow.next_slice_end_ns {
            let mut next = u64::MAX;
            let ext = slow.extension;
            for (k, st) in slow.slices.iter() {
                if st.expired {
                    continue;
                }
                let end = lease_end(st, ext);
                if end <= now {
                    ended.push((k.clone(), *st));
                } else {
                    next = next.min(end);
                }
            }
            slow.next_slice_end_ns = next;
        }
        for (key, s) in ended {
            self.to_posture_locked(slow, now, key, s);
            expired += 1;
        }
        expired
    }

    /// Puts one slice on its rule's posture, as when its lease ends: the slot takes the
    /// fallback, the slice is marked expired (no extension carries it on), and the sync
    /// client's next walk sees it. The caller publishes.
    fn to_posture_locked(&self, slow: &mut Slow, now: u64, key: SliceKey, s: SliceState) {
        let rule = key.0.rule;
        let c = &slow.compiled[rule as usize];
        let fallback = match (c.rule.posture, s.grant, c.whole) {
            (Posture::Open, g, _) => g,
            (Posture::Strict, Params::Slots(_), _) => Params::Slots(0),
            (Posture::Strict, Params::Rate(p), _) => Params::Closed(p.limit),
            (Posture::Strict, g, _) => g,
            (Posture::Conservative, Params::Slots(g), Params::Slots(w)) => {
                Params::Slots(g.min(w / s.fleet_size as u64))
            }
            (Posture::Conservative, Params::Rate(g), Params::Rate(w)) => {
                let n = s.fleet_size as u64;
                Params::rate(RateLimit {
                    rate: g.limit.rate.min(w.limit.rate / n),
                    burst: g.limit.burst.min(w.limit.burst / n),
                    period_ns: g.limit.period_ns,
                })
            }
            (Posture::Conservative, g, _) => g,
        };
        if fallback != s.grant {
            let vals: Vec<String> = key.0.values.iter().map(|v| v.to_string()).collect();
            let _ = self.install_locked(slow, now, rule, &vals, fallback, 0);
        }
        if let Some(st) = slow.slices.get_mut(&key) {
            st.expired = true;
            st.grant = fallback;
        }
        // The slice the sync client reports changed, whether or not the slot did.
        let vals: Vec<&str> = key.0.values().collect();
        let (id, check) = self.key_hashes(rule, &vals);
        let table = self.table.load();
        if let Some((live_id, live)) = find_live(slow, &table, id, check) {
            live.walk_unseen();
            self.changed.mark(live_id);
        }
    }

    /// Per-rule totals.
    pub fn stats(&self) -> Vec<RuleStats> {
        let slow = self.slow();
        let table = self.table.load();
        let mut out: Vec<RuleStats> = slow
            .compiled
            .iter()
            .map(|c| RuleStats {
                rule: c.rule.name.clone(),
                shadow: !c.enforce,
                admitted: slow.retired[c.index as usize].0,
                rejected: slow.retired[c.index as usize].1,
                blocked: slow.retired[c.index as usize].2,
                keys: 0,
            })
            .collect();
        for (_, s) in live_slots(&slow, &table) {
            let r = &mut out[s.key.rule as usize];
            let mut counts = (r.admitted, r.rejected, r.blocked);
            retire_counts(&mut counts, s);
            (r.admitted, r.rejected, r.blocked) = counts;
            r.keys += 1;
        }
        out
    }

    /// Every live key with its demand counters, in-flight count and applied allocator
    /// slice, appended to `out`: what the allocator sync client reports
    /// (`shell::sync`). Changes nothing.
    ///
    /// The slow-path lock (which a request for a new key waits on) is held for
    /// `WALK_CHUNKS` chunks of the table at a time, not for the whole walk: at
    /// 100,000 keys the walk takes milliseconds, every report interval. What changed
    /// between two batches is read again at the end under one lock: the keys waiting
    /// to be published, and the chunks the current table no longer shares with the one
    /// walked. A key whose slot was replaced meanwhile can appear twice, its old slot
    /// first; a reader that keeps the last sighting of each key (the sync client does)
    /// sees every live key.
    pub fn key_demand(&self, out: &mut Vec<KeyDemand>) {
        self.walk(Walk::Read, out);
    }

    /// [`Engine::key_demand`] for the allocator sync client: also marks every key
    /// walked, so that its next [`Engine::changed_key_demand`] reads only what changed
    /// since, and moves `gone_cursor` past every eviction so far (their keys are not in
    /// this walk). One sync client per engine: a second one's marks would hide changes
    /// from the first.
    pub fn sync_key_demand(&self, gone_cursor: &mut u64, out: &mut Vec<KeyDemand>) {
        {
            let mut slow = self.slow();
            slow.gone_tracking = true;
            slow.gone.clear();
            *gone_cursor = slow.gone_seq;
        }
        self.walk(Walk::Mark, out);
    }

    /// The sync client's walk of what changed since its last walk: into `out`, the
    /// live keys whose counts, in-flight slots or applied slice changed (new keys and
    /// replaced slots included), each marked walked; into `gone`, the keys evicted
    /// since `gone_cursor` (which it advances) that have no live slot now, read from
    /// their final slot. The walk reads the table's cells, and the slots only of keys in
    /// a bucket of ids marked since the last walk (every change a walk reports marks
    /// its key's bucket; every slot at every sixteenth walk), and of those appends only
    /// the ones whose counts differ from their walk mark. Returns false, appending
    /// nothing, if evictions since `gone_cursor` were forgotten ([`GONE_MAX`]) or no
    /// [`Engine::sync_key_demand`] came first: then read every key with that.
    pub fn changed_key_demand(
        &self,
        gone_cursor: &mut u64,
        out: &mut Vec<KeyDemand>,
        gone: &mut Vec<KeyDemand>,
    ) -> bool {
        {
            let mut slow = self.slow();
            let missed = !slow.gone_tracking
                || *gone_cursor > slow.gone_seq
                || (slow.gone.is_empty() && *gone_cursor < slow.gone_seq)
                || slow
                    .gone
                    .front()
                    .is_some_and(|(seq, _)| *seq > *gone_cursor + 1);
            if missed {
                return false;
            }
            *gone_cursor = slow.gone_seq;
            let table = self.table.load();
            let mut values: Vec<&str> = Vec::with_capacity(MAX_DESCRIPTORS);
            for (_, s) in &slow.gone {
                let key = &s.key;
                values.clear();
                values.extend(key.values());
                let id = self.hashing.key_id(key.rule, values.iter().copied());
                if find_live(&slow, &table, id, key.check).is_none() {
                    gone.push(KeyDemand {
                        rule: Arc::clone(&slow.compiled[key.rule as usize].name),
                        counters: SlotCounters(Arc::clone(s)),
                        in_flight: 0,
                        slice: None,
                    });
                }
            }
            slow.gone.clear();
        }
        self.walk(Walk::Changed, out);
        true
    }

    fn walk(&self, mode: Walk, out: &mut Vec<KeyDemand>) {
        let table = self.table.load_full();
        let n = table.chunks.len();
        let mut slow = self.slow();
        // The buckets to read: those marked since the last walk that cleared the marks
        // (a walk of changed keys; every bucket at every `FULL_WALK_EVERY`th), or all.
        let only = match mode {
            Walk::Read => ChangedBuckets::ALL,
            Walk::Mark => {
                self.changed.take();
                ChangedBuckets::ALL
            }
            Walk::Changed => {
                let marked = self.changed.take();
                slow.changed_walks = slow.changed_walks.wrapping_add(1);
                if slow.changed_walks.is_multiple_of(FULL_WALK_EVERY) {
                    ChangedBuckets::ALL
                } else {
                    marked
                }
            }
        };
        self.pending_demand(&slow, mode, out);
        let mut at = 0;
        loop {
            let end = (at + WALK_CHUNKS).min(n);
            for c in &table.chunks[at..end] {
                self.chunk_demand(&slow, mode, &only, c, out);
            }
            at = end;
            if at == n {
                break;
            }
            drop(slow);
            slow = self.slow();
        }
        // Under the last batch's lock: what changed since the first one (nothing when
        // the walk took one batch, or no other thread ran meanwhile).
        let current = self.table.load();
        let republished = !Arc::ptr_eq(&*current, &table);
        if republished {
            let same_shape = current.chunks.len() == n;
            for (i, c) in current.chunks.iter().enumerate() {
                if !same_shape || !Arc::ptr_eq(c, &table.chunks[i]) {
                    self.chunk_demand(&slow, mode, &only, c, out);
                }
            }
        }
        if republished || n > WALK_CHUNKS {
            // Keys created or replaced during the walk, not yet published.
            self.pending_demand(&slow, mode, out);
        }
    }

    /// [`Engine::key_demand`] for the live keys waiting to be published.
    fn pending_demand(&self, slow: &Slow, mode: Walk, out: &mut Vec<KeyDemand>) {
        for s in slow.pending.values() {
            self.slot_demand(slow, mode, s, out);
        }
    }

    /// [`Engine::key_demand`] for one chunk of a table: the slots of keys in `only`'s
    /// buckets (the others are not touched).
    fn chunk_demand(
        &self,
        slow: &Slow,
        mode: Walk,
        only: &ChangedBuckets,
        c: &Chunk,
        out: &mut Vec<KeyDemand>,
    ) {
        for (id, s) in c.0.iter().flat_map(|l| l.0.iter()).flatten() {
            if only.has(*id) {
                self.slot_demand(slow, mode, s, out);
            }
        }
    }

    /// One slot of a walk: appended if live (and, for [`Walk::Changed`], changed).
    #[inline]
    fn slot_demand(&self, slow: &Slow, mode: Walk, s: &Arc<Slot>, out: &mut Vec<KeyDemand>) {
        if mode != Walk::Read {
            // The mark is the counts (the slot's second line) and, for concurrency
            // slots only, the slots in flight (the state, its first line): an unchanged
            // rate bucket is skipped without touching its first line. A sealed slot's
            // counts no longer move, so it is skipped below once its last change is
            // marked.
            let in_flight = if s.marks_in_flight() { s.load().tat } else { 0 };
            if !s.walk_mark(in_flight) && mode == Walk::Changed {
                return;
            }
        }
        if !s.load().sealed() {
            out.push(self.demand_of(slow, s));
        }
    }

    /// The number of the last key created (a cursor for [`Engine::new_key_demand`] that
    /// skips every key created so far).
    pub fn created_seq(&self) -> u64 {
        self.slow().created_seq
    }

    /// Like [`Engine::key_demand`], but only the keys created since `cursor` (0 at
    /// first), which it advances: what a new-key poll needs, without walking every key.
    /// Returns false, appending nothing, when more than [`CREATED_MAX`] keys were
    /// created since `cursor`: then read them all with [`Engine::key_demand`]. A key
    /// created and since evicted is left out; one whose slot a grant replaced is read
    /// from its live slot.
    pub fn new_key_demand(&self, cursor: &mut u64, out: &mut Vec<KeyDemand>) -> bool {
        let slow = self.slow();
        let last = slow.created_seq;
        // Keys dropped from the front since `cursor`, or a cursor this engine never gave.
        let missed = slow
            .created
            .front()
            .is_some_and(|(seq, _)| *seq > *cursor + 1)
            || *cursor > last;
        let from = *cursor;
        *cursor = last;
        if missed {
            return false;
        }
        let table = self.table.load();
        // Numbered in order: start after `from` (a poll every 20 ms walked up to
        // `CREATED_MAX` read entries to find the few new ones).
        let start = slow.created.partition_point(|(seq, _)| *seq <= from);
        for (_, key) in slow.created.range(start..) {
            // The key's live slot: the one created, or the one a grant replaced it with.
            if let Some((_, s)) = find_live(&slow, &table, key.id, key.check) {
                out.push(self.demand_of(&slow, &s));
            }
        }
        true
    }

    /// One key's entry for [`Engine::key_demand`].
    fn demand_of(&self, slow: &Slow, s: &Arc<Slot>) -> KeyDemand {
        let c = &slow.compiled[s.key.rule as usize];
        let slice = slow.slices.get(&*s.key as &dyn KeyView).map(|st| {
            let (rate, burst) = match st.grant {
                Params::Rate(p) => (p.limit.rate, p.limit.burst),
                // A grant with a zero rate or burst admits nothing but is the grant as
                // sent; closed by the strict posture, it is (0, 0): the allocator tells
                // a posture from the grant by these two.
                Params::Closed(l) if !st.expired => (l.rate, l.burst),
                Params::Closed(_) => (0, 0),
                Params::Slots(n) => (0, n),
            };
            AppliedSlice {
                epoch: st.epoch,
                seq: st.seq,
                rate,
                burst,
                lease_expires_at_ns: lease_end(st, slow.extension),
                expired: st.expired,
            }
        });
        KeyDemand {
            rule: Arc::clone(&c.name),
            in_flight: match s.params {
                Params::Slots(_) => s.load().tat,
                _ => 0,
            },
            counters: SlotCounters(Arc::clone(s)),
            slice,
        }
    }

    /// Level of one limit key at `now`, in whole units (negative: debt), or `None` if
    /// the key is not held (never used, or evicted at rest: then it is full). `values`
    /// are the rule's `*` values in match-key order (keys sorted).
    /// For concurrency rules: free slots.
    pub fn level(&self, now: u64, rule: &str, values: &[&str]) -> Option<i128> {
        let (ri, _) = self.rules.load().by_name(rule)?;
        let slot = self.current_slot(ri as u32, values)?;
        let state = slot.load();
        (!slot.is_sealed()).then(|| Slot::level(&slot.params, state, now))
    }

    /// The demand counters of one limit key's live slot, or `None` if the key is not
    /// held (one key's [`KeyDemand::counters`], without walking every key).
    pub fn key_counters(&self, rule: &str, values: &[&str]) -> Option<SlotCounters> {
        let (ri, _) = self.rules.load().by_name(rule)?;
        self.current_slot(ri as u32, values).map(SlotCounters)
    }

    /// Live leases.
    pub fn leases_in_flight(&self) -> usize {
        self.leases.len()
    }

    /// Live keys.
    pub fn key_count(&self) -> usize {
        self.slow().keys
    }

    /// The engine's 128-bit identity of a limit key (its id and check hashes, seeded
    /// per engine), `None` if no rule has that name: what [`KeyDemand::identity`] gives
    /// for the same key, computed from its names (a grant off the wire).
    pub(crate) fn key_identity(&self, rule: &str, values: &[&str]) -> Option<(u64, u64)> {
        let (ri, _) = self.rules.load().by_name(rule)?;
        Some(self.key_hashes(ri as u32, values))
    }

    /// The id and check hash of rule `ri`'s key with these values.
    fn key_hashes(&self, ri: u32, values: &[&str]) -> (u64, u64) {
        (
            self.hashing.key_id(ri, values.iter().copied()),
            self.hashing.key_check(ri, values.iter().copied()),
        )
    }

    /// A handle for one limit key, for [`Worker::try_acquire`]: the rule's name and
    /// the values of its `*` entries, in match-key order. Refused for an unknown rule,
    /// the wrong number of values, and concurrency rules (their slots are released by
    /// completing a lease, which a bare check has none of).
    pub fn key_handle(&self, rule: &str, values: &[&str]) -> Result<KeyHandle, HandleError> {
        let rules = self.rules.load();
        let (ri, r) = rules
            .by_name(rule)
            .ok_or_else(|| HandleError::UnknownRule(rule.to_string()))?;
        if matches!(r.limit, RuleLimit::Concurrency { .. }) {
            return Err(HandleError::Concurrency(rule.to_string()));
        }
        let wild = r.wildcards();
        if wild != values.len() {
            return Err(HandleError::WrongValues {
                rule: rule.to_string(),
                expected: wild,
                got: values.len(),
            });
        }
        let (id, check) = self.key_hashes(ri as u32, values);
        Ok(KeyHandle {
            rule: ri as u32,
            engine: self.tag,
            id,
            check,
            values: Box::new(values.iter().map(|v| Box::<str>::from(*v)).collect()),
        })
    }

    #[inline(always)]
    fn try_acquire_in(
        &self,
        table: &KeyTable,
        now: u64,
        key: &KeyHandle,
        cost: u64,
        demand: &mut BufferedDemand,
    ) -> Result<bool, AdmitError> {
        if cost > MAX_COST {
            return Err(AdmitError::CostTooLarge { max: MAX_COST });
        }
        if key.engine != self.tag {
            // Its id and check were hashed with another engine's seeds, and its rule
            // index may not exist here: a key made from them would sit at the wrong id.
            return Err(AdmitError::Invalid("key handle made by another engine"));
        }
        if let Some(slot) = table.lookup(key.id, key.check)
            && let Some(admitted) = self.acquire_on(
                slot,
                key.id,
                now,
                &table.compiled[key.rule as usize],
                cost,
                |slot| demand.count(&self.changed, table, slot, key, now, cost),
            )
        {
            return Ok(admitted);
        }
        self.try_acquire_slow(table, now, key, cost, demand)
    }

    /// [`Engine::try_acquire_in`] for a key not in the table snapshot, or whose slot
    /// was sealed: resolved under the slow-path lock (created if new).
    #[cold]
    fn try_acquire_slow(
        &self,
        table: &KeyTable,
        now: u64,
        key: &KeyHandle,
        cost: u64,
        demand: &mut BufferedDemand,
    ) -> Result<bool, AdmitError> {
        // The key's slot is changing or new: what is buffered goes to its counts now.
        if demand.pending > 0 {
            demand.flush(&self.changed, table);
        }
        let vals: Vec<&str> = key.values.iter().map(|v| &**v).collect();
        for _ in 0..8 {
            let slot = self.resolve_slow(now, key.id, key.check, key.rule, &vals)?;
            let admit = |slot: &Slot| self.count(&slot.admitted, key.id, cost);
            if let Some(admitted) = self.acquire_on(
                &slot,
                key.id,
                now,
                &table.compiled[key.rule as usize],
                cost,
                admit,
            ) {
                return Ok(admitted);
            }
        }
        Ok(false)
    }

    /// One bare check on `slot`, counted as the slot's demand like an admission's
    /// (admitted or rejected cost: the sync client reports both, so a caller of
    /// [`Worker::try_acquire`] gets its share of a fleet's limit): `count_admitted`
    /// counts an admission (on the slot, or in the worker's [`BufferedDemand`]), a
    /// rejection is counted here. A shadow rule's rejection admits. `None` if the slot
    /// was sealed. `id`: the key's, for its change mark.
    #[inline(always)]
    fn acquire_on(
        &self,
        slot: &Slot,
        id: u64,
        now: u64,
        rule: &CompiledRule,
        cost: u64,
        count_admitted: impl FnOnce(&Slot),
    ) -> Option<bool> {
        match slot.try_take(now, cost, false) {
            Take::Taken { .. } => {
                count_admitted(slot);
                Some(true)
            }
            Take::Busy { .. } => {
                self.count(&slot.rejected, id, rule.demand(cost));
                Some(!rule.enforce)
            }
            Take::Sealed => None,
        }
    }

    /// Checks internal invariants; call it when no operation is in flight. Returns the
    /// first violation found. Checked: table bounds; every concurrency slot's in-flight
    /// count equals the live leases holding one of its slots; no rate bucket above full.
    pub fn check_invariants(&self, now: u64) -> Result<(), String> {
        let slow = self.slow();
        let table = self.table.load();
        if slow.keys > self.cfg.max_keys {
            return Err(format!(
                "{} keys > max_keys {}",
                slow.keys, self.cfg.max_keys
            ));
        }
        // A decision reads its rules from the table snapshot: the published one must
        // carry the rules in force (a reload publishes them).
        if !Arc::ptr_eq(&table.compiled, &slow.compiled) {
            return Err("the published table carries rules other than those in force".into());
        }
        let mut live: HashMap<u64, Arc<Slot>> = HashMap::new();
        for (id, s) in live_slots(&slow, &table) {
            if live.insert(id, Arc::clone(s)).is_some() {
                return Err(format!("{}: live both in the table and pending", s.key));
            }
        }
        if live.len() != slow.keys {
            return Err(format!(
                "{} live slots but {} keys counted",
                live.len(),
                slow.keys
            ));
        }
        // Per key: slots taken and token units held by live leases.
        // (By the keys' check hashes: a lease names its keys by their hashes.)
        let mut held: HashMap<u64, (u64, u64)> = HashMap::new();
        self.leases.for_each(|l| {
            for ll in l.limits() {
                let e = held.entry(ll.check).or_default();
                if ll.dimension == Dimension::Concurrency {
                    e.0 += ll.debited;
                } else {
                    e.1 += ll.held();
                }
            }
        });
        // Every key a lease names can be named in its usage record: by the name the
        // lease kept, or by a slot (sealed or not) in pending or the table; an expired
        // lease, which waits for a late completion, keeps all its names.
        let mut unnamed: Option<String> = None;
        self.leases.for_each(|l| {
            for (j, ll) in l.limit_slots().iter().enumerate() {
                if let Some(ll) = ll
                    && l.name(j).is_none()
                    && find_by_hashes(&slow, &table, ll, false).is_none()
                {
                    unnamed = Some(format!("a live lease names a key gone (rule {})", ll.rule));
                }
            }
        });
        self.leases.for_each_expired(|l| {
            for (j, ll) in l.limit_slots().iter().enumerate() {
                if let Some(ll) = ll
                    && l.name(j).is_none()
                {
                    unnamed = Some(format!("an expired lease kept no name (rule {})", ll.rule));
                }
            }
        });
        if let Some(e) = unnamed {
            return Err(e);
        }
        let leases = self.leases.len();
        if leases > self.cfg.max_leases.div_ceil(32) * 32 {
            return Err(format!("{leases} leases > bound"));
        }
        for s in live.values() {
            let state = s.load();
            let (slots, units) = held.get(&s.check).copied().unwrap_or((0, 0));
            match s.params {
                Params::Slots(_) => {
                    if state.tat != slots {
                        return Err(format!(
                            "{}: {} slots in flight but {} held by leases",
                            s.key, state.tat, slots
                        ));
                    }
                }
                Params::Rate(_) | Params::Closed(_) => {
                    if state.held != units {
                        return Err(format!(
                            "{}: {} units held but leases hold {}",
                            s.key, state.held, units
                        ));
                    }
                    let with_held = Slot::level(&s.params, state, now) + state.held as i128;
                    if matches!(s.params, Params::Rate(_))
                        && with_held > s.params.capacity() as i128
                    {
                        return Err(format!("{}: level plus held above capacity", s.key));
                    }
                }
            }
        }
        Ok(())
    }
}

/// A per-thread handle: the engine plus a cached table snapshot (`arc_swap::Cache`), so
/// a decision for a known key costs one generation check instead of a guard.
pub struct Worker {
    cache: Cache<Arc<ArcSwap<KeyTable>>, Arc<KeyTable>>,
    engine: Arc<Engine>,
    /// Where a completion copies the lease it finishes (reused: no copy of a whole
    /// lease on the way out).
    lease: Box<Lease>,
    /// Admitted demand of bare checks on the key checked last, not yet added to its
    /// slot ([`Worker::try_acquire`]).
    demand: BufferedDemand,
}

/// How long (engine time) a worker may keep the admitted cost of repeated bare checks
/// on one key before adding it to the key's slot: 1 ms, far below any report interval
/// (the sync client reads the counts every few hundred milliseconds).
pub const DEMAND_BUFFER_NS: u64 = 1_000_000;

/// The admitted cost of a worker's bare checks on the key it checked last, counted in
/// the worker instead of with a locked add on the slot each time: on this generation
/// of AMD guests that add was a quarter of a one-key check (docs/BENCHMARKS.md). The
/// key's first check after another key (or after [`DEMAND_BUFFER_NS`]) adds at once,
/// as before; only repeats are buffered, so checks that move from key to key cost
/// what they did.
#[derive(Clone, Copy, Debug, Default)]
struct BufferedDemand {
    /// The key (id and check hash, as [`KeyHandle`]); meaningful while `live`.
    id: u64,
    check: u64,
    /// Engine time of the key's last direct add.
    since_ns: u64,
    /// Admitted cost since then, not yet on the slot.
    pending: u64,
    live: bool,
}

impl BufferedDemand {
    /// Counts `cost` admitted on `key`, whose slot in `table` is `slot`: buffered if
    /// this holds the key and its time is not up, else added to the slot at once (what
    /// was buffered for another key flushed first), and the key is held from now.
    #[inline(always)]
    fn count(
        &mut self,
        marks: &ChangeMarks,
        table: &KeyTable,
        slot: &Slot,
        key: &KeyHandle,
        now: u64,
        cost: u64,
    ) {
        if self.live
            && self.id == key.id
            && self.check == key.check
            // A clock that went back gives a huge difference: add at once.
            && now.wrapping_sub(self.since_ns) < DEMAND_BUFFER_NS
            && self.pending < 1 << 60
        {
            self.pending += cost;
            return;
        }
        if self.pending > 0 {
            self.flush(marks, table);
        }
        marks.count(&slot.admitted, key.id, cost);
        *self = BufferedDemand {
            id: key.id,
            check: key.check,
            since_ns: now,
            pending: 0,
            live: true,
        };
    }

    /// Adds what is buffered to the key's slot in `table` and forgets the key. Lost
    /// only if the key left the table meanwhile (evicted, or its replacement not yet
    /// published): at most [`DEMAND_BUFFER_NS`] of one key's admitted demand.
    #[cold]
    fn flush(&mut self, marks: &ChangeMarks, table: &KeyTable) {
        if self.pending > 0
            && let Some(slot) = table.lookup(self.id, self.check)
        {
            marks.count(&slot.admitted, self.id, self.pending);
        }
        *self = BufferedDemand::default();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.flush_demand();
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").finish_non_exhaustive()
    }
}

impl Worker {
    /// [`Engine::admit`] through the cached snapshot.
    #[inline]
    pub fn admit(&mut self, now: u64, req: &AdmitRequest<'_>) -> Result<Decision, AdmitError> {
        let mut d = Decision::EMPTY;
        self.admit_into(now, req, &mut d)?;
        Ok(d)
    }

    /// [`Engine::admit_into`] through the cached snapshot: the cheapest admission, for
    /// a caller that keeps one `Decision` per thread and reads it after each call.
    #[inline]
    pub fn admit_into(
        &mut self,
        now: u64,
        req: &AdmitRequest<'_>,
        out: &mut Decision,
    ) -> Result<(), AdmitError> {
        let table = self.cache.load();
        self.engine.admit_in(table, now, req, out)
    }

    /// [`Engine::complete`] through the cached snapshot (a completion looks its keys up
    /// in the table; the engine's own call loads the snapshot, two locked instructions).
    #[inline]
    pub fn complete(
        &mut self,
        now: u64,
        request_id: &str,
        usage: Usage,
        status: CompletionStatus,
    ) -> Result<Completion, CompleteError> {
        let table = self.cache.load();
        self.engine
            .complete_in(table, now, request_id, usage, status, &mut self.lease)
    }

    /// Takes `cost` from one resolved key's bucket, with no lease: the bare bucket check
    /// (what `governor` does), for callers that settle nothing. True if admitted (always
    /// for a shadow rule, which counts what it would have rejected). The cost counts as
    /// the key's demand, admitted or rejected, as an admission's does, so the sync client
    /// reports it and the allocator sizes this agent's slice to it. A cost above
    /// [`MAX_COST`] is refused.
    ///
    /// Admitted cost of repeated checks on the key this worker checked last is counted
    /// in the worker and reaches the key's counts within [`DEMAND_BUFFER_NS`] of engine
    /// time while the worker keeps checking, at its next check of another key, at
    /// [`Worker::flush_demand`], or when the worker is dropped (rejections are counted
    /// at once).
    #[inline]
    pub fn try_acquire(
        &mut self,
        now: u64,
        key: &KeyHandle,
        cost: u64,
    ) -> Result<bool, AdmitError> {
        let table = self.cache.load();
        self.engine
            .try_acquire_in(table, now, key, cost, &mut self.demand)
    }

    /// Adds the admitted cost this worker's bare checks still buffer to their key's
    /// counts (see [`Worker::try_acquire`]); dropping the worker does the same.
    pub fn flush_demand(&mut self) {
        if self.demand.pending > 0 {
            let table = self.cache.load();
            self.demand.flush(&self.engine.changed, table);
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }
}

/// Every live (unsealed) slot with its id: pending ones (newer) and published ones. A
/// key is live in exactly one of the two, because installing a newer slot seals the
/// older one (`check_invariants` checks it).
fn live_slots<'a>(
    slow: &'a Slow,
    table: &'a KeyTable,
) -> impl Iterator<Item = (u64, &'a Arc<Slot>)> {
    slow.pending
        .iter()
        .map(|(id, s)| (*id, s))
        .chain(table.iter())
        .filter(|(_, s)| !s.is_sealed())
}

/// The live slot of the key with hashes `id` and `check`, from pending or the table.
/// Matched by the two hashes on the slot's first line, as a decision matches it
/// (`KeyTable::lookup`), not by comparing the key's names.
fn find_live(slow: &Slow, table: &KeyTable, id: u64, check: u64) -> Option<(u64, Arc<Slot>)> {
    for p in 0..MAX_PROBE {
        let i = id.wrapping_add(p);
        for s in [slow.pending.get(&i), table.get(i)].into_iter().flatten() {
            if s.check == check && !s.is_sealed() {
                return Some((i, Arc::clone(s)));
            }
        }
    }
    None
}

/// The slot of a lease limit's key (by its hashes and rule), from pending or the table:
/// only a live one if `live`, else the first found (a sealed slot still names its key).
fn find_by_hashes<'a>(
    slow: &'a Slow,
    table: &'a KeyTable,
    l: &LeaseLimit,
    live: bool,
) -> Option<&'a Arc<Slot>> {
    for p in 0..MAX_PROBE {
        let i = l.id.wrapping_add(p);
        for s in [slow.pending.get(&i), table.get(i)].into_iter().flatten() {
            if s.check == l.check && s.key.rule == l.rule && (!live || !s.is_sealed()) {
                return Some(s);
            }
        }
    }
    None
}

/// The name of a lease limit's key from pending or the table (a sealed slot's will do).
fn name_by_hashes(slow: &Slow, table: &KeyTable, l: &LeaseLimit) -> Option<Arc<LimitKey>> {
    find_by_hashes(slow, table, l, false).map(|s| Arc::clone(&s.key))
}

/// A slot as a decision holds it: borrowed from the table snapshot (the decision path:
/// no reference count touched), or owned when the slow path found or made it.
enum SlotRef<'t> {
    Table(&'t Arc<Slot>),
    Owned(Arc<Slot>),
}

impl std::ops::Deref for SlotRef<'_> {
    type Target = Arc<Slot>;

    #[inline]
    fn deref(&self) -> &Arc<Slot> {
        match self {
            SlotRef::Table(s) => s,
            SlotRef::Owned(s) => s,
        }
    }
}

fn free_id(slow: &Slow, table: &KeyTable, id: u64) -> Option<u64> {
    (0..MAX_PROBE).map(|p| id.wrapping_add(p)).find(|i| {
        let in_pending = slow.pending.get(i).is_some_and(|s| !s.is_sealed());
        let in_table = table.get(*i).is_some_and(|s| !s.is_sealed());
        !in_pending && !in_table
    })
}

fn display_key(rule: &Rule, values: &[&str]) -> String {
    let mut s = String::with_capacity(rule.name.len() + 16);
    s.push_str(&rule.name);
    s.push('{');
    let mut wild = values.iter();
    for (i, (k, p)) in rule.matches.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(k);
        s.push('=');
        match p {
            Pattern::Each => s.push_str(wild.next().copied().unwrap_or("")),
            Pattern::Exact(v) => s.push_str(v),
        }
    }
    s.push('}');
    s
}

#[inline]
fn status(
    rule: &CompiledRule,
    cost: u64,
    shadow_rejected: bool,
    params: &Params,
    state: State,
    now: u64,
) -> LimitStatus {
    LimitStatus {
        rule: rule.index,
        dimension: rule.dimension,
        mode: rule.rule.mode,
        cost,
        shadow_rejected,
        params: params.shape(),
        state,
        now,
    }
}

fn uncount(held: &[Option<LeaseLimit>], slots: &[Option<SlotRef<'_>>]) {
    for (l, s) in taken(held, slots) {
        s.admitted.fetch_sub(l.reserved, Ordering::Relaxed);
    }
}

/// What an admission took so far: each limit with the slot it debited (the two arrays
/// are filled together, position by position).
#[inline]
fn taken<'a, 't>(
    held: &'a [Option<LeaseLimit>],
    slots: &'a [Option<SlotRef<'t>>],
) -> impl Iterator<Item = (&'a LeaseLimit, &'a SlotRef<'t>)> {
    held.iter()
        .zip(slots)
        .filter_map(|(l, s)| Some((l.as_ref()?, s.as_ref()?)))
}

fn validate_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() {
        return Err("request_id is empty");
    }
    if id.len() > MAX_REQUEST_ID_BYTES {
        return Err("request_id is longer than 128 bytes");
    }
    if id.ends_with(RESERVED_ID_SUFFIX) {
        return Err("request_id ends with #late-completion, which is reserved");
    }
    Ok(())
}

/// Request ids may not end with this: the usage outbox names a late completion's
/// correction by the request's id and it, and a request of that id would collide with
/// it in the ledger (a conflict, one of the two lost).
pub const RESERVED_ID_SUFFIX: &str = "#late-completion";

fn validate_request(req: &AdmitRequest<'_>) -> Result<(), AdmitError> {
    validate_id(req.request_id).map_err(AdmitError::Invalid)?;
    if req.descriptors.is_empty() {
        return Err(AdmitError::Invalid("descriptors are empty"));
    }
    if req.descriptors.len() > MAX_DESCRIPTORS {
        return Err(AdmitError::Invalid("more than 16 descriptors"));
    }
    for (i, (k, v)) in req.descriptors.iter().enumerate() {
        if k.is_empty() || v.is_empty() {
            return Err(AdmitError::Invalid("a descriptor key or value is empty"));
        }
        if k.len() > MAX_DESCRIPTOR_BYTES || v.len() > MAX_DESCRIPTOR_BYTES {
            return Err(AdmitError::Invalid(
                "a descriptor key or value is longer than 256 bytes",
            ));
        }
        if req.descriptors[..i].iter().any(|(k2, _)| k2 == k) {
            return Err(AdmitError::Invalid("a descriptor key appears twice"));
        }
    }
    let c = &req.cost;
    if c.requests > MAX_COST
        || c.input_tokens > MAX_COST
        || c.max_output_tokens.is_some_and(|m| m > MAX_COST)
    {
        return Err(AdmitError::CostTooLarge { max: MAX_COST });
    }
    Ok(())
}

fn validate_usage(u: &Usage) -> Result<(), CompleteError> {
    if u.input_tokens > MAX_COST || u.output_tokens > MAX_COST {
        return Err(CompleteError::UsageTooLarge { max: MAX_COST });
    }
    if u.cached_input_tokens > u.input_tokens {
        return Err(CompleteError::Invalid(
            "cached_input_tokens is above input_tokens",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod key_table_tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap as Model;

    fn slot() -> Arc<Slot> {
        let p = Params::Slots(1);
        Arc::new(Slot::new(
            Arc::new(LimitKey::for_tests("k")),
            p,
            Slot::full_state(&p, 0),
            0,
        ))
    }

    #[test]
    fn a_key_handle_is_half_a_line_and_never_straddles_two() {
        assert_eq!(std::mem::size_of::<KeyHandle>(), 32);
        assert_eq!(std::mem::align_of::<KeyHandle>(), 32);
        assert_eq!(std::mem::offset_of!(KeyHandle, id), 0);
        assert_eq!(std::mem::offset_of!(KeyHandle, check), 8);
    }

    fn contents(t: &KeyTable) -> Model<u64, usize> {
        let all: Vec<(u64, usize)> = t
            .iter()
            .map(|(id, s)| (id, Arc::as_ptr(s) as usize))
            .collect();
        let m: Model<u64, usize> = all.iter().copied().collect();
        assert_eq!(m.len(), all.len(), "an id stored twice");
        assert_eq!(t.len(), all.len());
        m
    }

    proptest! {
        /// Publishing by `with_updates` (copying only the chunks touched) gives the
        /// same table as a model map, whatever the ids (colliding ones included), and
        /// never changes an earlier table that shares its chunks.
        #[test]
        fn incremental_publishes_match_a_model_and_leave_older_tables_alone(
            batches in prop::collection::vec(
                prop::collection::vec(0u64..600, 0..40), 1..30),
        ) {
            let mut model: Model<u64, usize> = Model::new();
            let mut t = KeyTable::empty();
            let mut history: Vec<(KeyTable, Model<u64, usize>)> = Vec::new();
            for ids in batches {
                let slots: Vec<(u64, Arc<Slot>)> = ids.iter().map(|&id| (id, slot())).collect();
                for (id, s) in &slots {
                    model.insert(*id, Arc::as_ptr(s) as usize);
                }
                let next = match t.with_updates(slots) {
                    Ok(next) => next,
                    Err(slots) => {
                        // Full: rebuilt whole, as `publish_locked` does.
                        let kept: Vec<(u64, Arc<Slot>)> =
                            t.iter().map(|(id, s)| (id, Arc::clone(s))).collect();
                        let n = kept.len() + slots.len();
                        KeyTable::build(n, kept.into_iter().chain(slots))
                    }
                };
                prop_assert_eq!(contents(&next), model.clone());
                for &id in model.keys() {
                    prop_assert_eq!(next.get(id).map(|s| Arc::as_ptr(s) as usize), model.get(&id).copied());
                }
                prop_assert!(next.get(10_000).is_none());
                history.push((std::mem::replace(&mut t, next), model.clone()));
            }
            // Every earlier table still holds exactly what it held when published.
            let mut expected: Model<u64, usize> = Model::new();
            for (i, (old, _)) in history.iter().enumerate() {
                if i > 0 {
                    expected = history[i - 1].1.clone();
                }
                prop_assert_eq!(contents(old), expected.clone());
            }
        }
    }

    proptest! {
        /// A spare caught up in place (as `publish_locked` does when nothing holds it)
        /// is cell for cell the table a copy would give, publish after publish; one a
        /// reader still holds is left alone.
        #[test]
        fn a_spare_caught_up_in_place_is_the_table_a_copy_gives(
            batches in prop::collection::vec(
                prop::collection::vec(0u64..400, 0..20), 1..30),
        ) {
            let cells = |t: &KeyTable| -> Vec<(u64, usize)> {
                t.iter().map(|(id, s)| (id, Arc::as_ptr(s) as usize)).collect()
            };
            let mut current = Arc::new(KeyTable::build(1_024, std::iter::empty()));
            let mut spare: Option<(Arc<KeyTable>, TableUpdates)> = None;
            let (mut in_place, mut publishes) = (0, 0);
            for ids in batches {
                publishes += 1;
                let mut seen = std::collections::HashSet::new();
                let more: Vec<(u64, Arc<Slot>)> = ids
                    .into_iter()
                    .filter(|id| seen.insert(*id))
                    .map(|id| (id, slot()))
                    .collect();
                prop_assert!(current.fits(more.len()));
                let copy = current.with_updates(more.clone()).ok().unwrap();
                let next = match spare.take() {
                    Some((t, lag)) => KeyTable::caught_up(t, lag, &more, &current),
                    None => None,
                };
                let next = match next {
                    Some(t) => {
                        in_place += 1;
                        t
                    }
                    None => Arc::new(current.with_updates(more.clone()).ok().unwrap()),
                };
                prop_assert_eq!(cells(&next), cells(&copy));
                prop_assert_eq!(next.len(), copy.len());
                spare = Some((std::mem::replace(&mut current, next), more));
            }
            // From the second publish on, every one was made in place.
            prop_assert_eq!(in_place, publishes - 1);
            // A spare someone still holds is not touched.
            let (held, lag) = spare.take().unwrap();
            let reader = Arc::clone(&held);
            let before = cells(&reader);
            prop_assert!(KeyTable::caught_up(held, lag, &[(999, slot())], &current).is_none());
            prop_assert_eq!(cells(&reader), before);
        }
    }

    /// The slice map finds a key by pointer, and by content from another `LimitKey` of
    /// the same key (recreated after an eviction) or from borrowed values; a key that
    /// differs in a value is not found even with the same check hash.
    #[test]
    fn the_slice_map_finds_keys_by_pointer_or_content_only() {
        let hashing = KeyHashing::new();
        let make = |vals: &[&str], check: u64| {
            Arc::new(LimitKey {
                id: 1,
                check,
                rule: 2,
                values: vals.iter().map(|v| Box::<str>::from(*v)).collect(),
                display: "k".into(),
            })
        };
        let check = hashing.key_check(2, ["acme", "gpt"].into_iter());
        let first = make(&["acme", "gpt"], check);
        let mut map: HashMap<SliceKey, u32, PassThroughState> = HashMap::default();
        map.insert(SliceKey(Arc::clone(&first)), 5);
        assert_eq!(map.get(&*first as &dyn KeyView), Some(&5));
        let again = make(&["acme", "gpt"], check);
        assert_eq!(map.get(&*again as &dyn KeyView), Some(&5));
        let vals = ["acme".to_string(), "gpt".to_string()];
        assert_eq!(
            map.get(&Named::new(&hashing, 2, &vals) as &dyn KeyView),
            Some(&5)
        );
        assert_eq!(
            map.get(&Named::new(&hashing, 3, &vals) as &dyn KeyView),
            None
        );
        let forged = make(&["acme", "gpu"], check);
        assert_eq!(map.get(&*forged as &dyn KeyView), None);
    }

    #[test]
    fn a_publish_of_a_few_slots_shares_the_chunks_it_does_not_touch() {
        let t = KeyTable::build(10_000, (0..10_000u64).map(|id| (id * 7_919, slot())));
        let next = t.with_updates(vec![(7_919, slot())]).ok().unwrap();
        let shared = t
            .chunks
            .iter()
            .zip(next.chunks.iter())
            .filter(|(a, b)| Arc::ptr_eq(a, b))
            .count();
        assert_eq!(shared, t.chunks.len() - 1, "one chunk copied");
        assert_eq!(next.len(), 10_000);
    }
}
