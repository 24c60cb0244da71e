//! The atomic bucket: GCRA with variable cost in one `AtomicU64`, and concurrency slots.
//!
//! A rate bucket keeps the *theoretical arrival time* (TAT) in nanoseconds of the
//! engine's clock. With emission interval `I = per / rate` and tolerance
//! `tau = burst * I`, a cost `c` is admitted at `now` when
//! `max(tat, now) + c*I - now <= tau`, and the TAT moves there. The bucket's level is
//! `(tau - (tat - now)) / I` tokens, capped at `burst` once `tat <= now`.
//!
//! **Arithmetic.** `I` is kept as a 32.32 fixed-point number of nanoseconds rounded
//! *up*, and every debit `c*I` is rounded *up* to a whole nanosecond, so the bucket
//! never charges less than the exact cost. `tau` is the debit of `burst` (so a cost of
//! exactly `burst` fits a full bucket). Refunds round *down*. The only excess this
//! rounding allows over an exact (rate, burst) bucket is `tau - burst*I`, under
//! `1 + burst / 2^32` nanoseconds of refill per window: below one token for any
//! emission interval above `1 + burst/2^32` ns. The property tests check conformance
//! against an exact rational bucket with exactly that slack.
//!
//! **Reservations held.** A reservation of `c` tokens that may be partly refunded is
//! debited from the level *and* counted in `held` until it settles. The level may
//! refill only up to `burst - held`: the TAT never falls below `now + held*I`. A
//! refund of `u` then raises the level by `u` while `held` falls by `c`, so
//! `level + held` moves exactly as a bucket that charges the *actual* cost at
//! completion. Without this cap a bucket near full keeps refilling while a large
//! reservation is out, and the refund then lifts it above what an exact bucket over
//! the actual costs would hold (the property test found an instant where 429 tokens
//! were admitted against a burst of 330). Conformance, with `V` the exact bucket that
//! charges actual cost at admission, `W = level + held`, and `A` the actual costs not
//! yet settled: `W - A <= V` is preserved by every step, and `level <= W - A` because
//! `held >= A`, so the engine admits only what `V` would.
//!
//! TAT and held live together in one 128-bit atomic (`portable_atomic::AtomicU128`,
//! `cmpxchg16b` on x86_64) so that they change in one CAS.
//!
//! **Changing parameters.** A slot's parameters never change. A slice update *seals*
//! the old slot (CAS its state to [`SEALED`], which no operation leaves) and installs a
//! new slot whose state is converted from the sealed one under invariant 2: shrinking
//! clamps the level, growing does not raise it. A thread that finds a sealed slot looks
//! the key up again. Sealing makes the hand-over atomic: no debit can land on the old
//! slot after its final state was read, and no ABA is possible because a sealed slot
//! stays sealed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use portable_atomic::AtomicU128;

use crate::key::LimitKey;

/// State value of a slot that has been replaced or evicted. Terminal.
pub(crate) const SEALED: u64 = u64::MAX;

/// Largest TAT a debit may produce (one below [`SEALED`]).
const TAT_MAX: u64 = SEALED - 1;

/// Fixed-point fraction bits of the emission interval.
const FP_BITS: u32 = 32;

/// Rate and burst of one slice, in the rule's units per the rule's period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// Units per period. Zero closes the bucket.
    pub rate: u64,
    /// Capacity. Zero closes the bucket.
    pub burst: u64,
    /// Period length in nanoseconds.
    pub period_ns: u64,
}

/// Precomputed GCRA parameters of an open rate bucket. `repr(C)`, the fields the
/// decision reads first, so that in a [`Slot`] they share the state's cache line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct RateParams {
    /// Emission interval in ns, 32.32 fixed point, rounded up; as two words so the
    /// struct needs no 16-byte alignment and a slot fits one 128-byte block.
    interval_fp: [u64; 2],
    /// `debit_ns(burst)`.
    pub(crate) tau_ns: u64,
    pub(crate) limit: RateLimit,
}

impl RateParams {
    /// Parameters for `limit`, or `None` if the limit admits nothing (rate or burst 0).
    pub(crate) fn new(limit: RateLimit) -> Option<RateParams> {
        if limit.rate == 0 || limit.burst == 0 {
            return None;
        }
        let num = (limit.period_ns as u128) << FP_BITS;
        let interval_fp = num.div_ceil(limit.rate as u128);
        // A burst whose refill time passes `MAX_REFILL_NS` is cut to the largest that
        // does not (rules are refused at load beyond it; a grant of a tiny rate with a
        // large burst, as an allocator may send, is not): a tolerance at the TAT's
        // ceiling would let every take through, however empty the bucket.
        let burst_max = ((crate::config::MAX_REFILL_NS << FP_BITS) / interval_fp).max(1);
        let limit = RateLimit {
            burst: limit
                .burst
                .min(u64::try_from(burst_max).unwrap_or(u64::MAX)),
            ..limit
        };
        let mut p = RateParams {
            limit,
            interval_fp: [(interval_fp >> 64) as u64, interval_fp as u64],
            tau_ns: 0,
        };
        p.tau_ns = p.debit_ns(limit.burst);
        Some(p)
    }

    #[inline]
    fn interval_fp(&self) -> u128 {
        ((self.interval_fp[0] as u128) << 64) | self.interval_fp[1] as u128
    }

    /// Nanoseconds charged for `cost` units: `ceil(cost * I)`, saturating.
    #[inline]
    pub(crate) fn debit_ns(&self, cost: u64) -> u64 {
        let ns = self.product(cost).div_ceil(1u128 << FP_BITS);
        u64::try_from(ns).unwrap_or(TAT_MAX)
    }

    /// `cost * I` (32.32 fixed point), saturating. An interval under 2^32 ns (any rate
    /// of at least one unit per 4.3 s of its period) has no high word, and a 64 x 64-bit
    /// product cannot overflow 128 bits: one `mul`, where the general `u128`
    /// saturating multiply costs a multiply per word pair and overflow checks (three of
    /// them per settlement).
    #[inline]
    fn product(&self, cost: u64) -> u128 {
        if self.interval_fp[0] == 0 {
            cost as u128 * self.interval_fp[1] as u128
        } else {
            (cost as u128).saturating_mul(self.interval_fp())
        }
    }

    /// The lowest TAT allowed at `now` with `held` units held: the level refills only
    /// up to `burst - held`.
    #[inline]
    pub(crate) fn floor(&self, now: u64, held: u64) -> u64 {
        if held == 0 {
            now
        } else {
            now.saturating_add(self.debit_ns(held))
        }
    }

    /// Nanoseconds given back for `tokens` units: `floor(tokens * I)`.
    #[inline]
    pub(crate) fn refund_ns(&self, tokens: u64) -> u64 {
        let x = self.product(tokens) >> FP_BITS;
        u64::try_from(x).unwrap_or(TAT_MAX)
    }

    /// Tokens that `ns` of deficit represents, rounded up: `ceil(ns / I)`.
    fn tokens_owed(&self, ns: u64) -> u64 {
        ((ns as u128) << FP_BITS).div_ceil(self.interval_fp()) as u64
    }
}

/// Parameters of one slot. `repr(C)`: a fixed layout, for [`Slot`]'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub(crate) enum Params {
    /// An open rate bucket.
    Rate(RateParams),
    /// A rate bucket whose slice is zero: admits nothing. Its state's `tat` is the debt
    /// it carries, in whole units (see [`Slot::level`]): a bucket that closes in debt
    /// and reopens is still in debt (invariant 2: growing never raises the level).
    Closed(RateLimit),
    /// Concurrency slots.
    Slots(u64),
}

/// A slot's parameters without the derived GCRA constants (24 + 8 bytes instead of 56):
/// what a decision reports, rebuilt into [`Params`] only when a caller asks for
/// remaining or reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    Rate(RateLimit),
    Closed(RateLimit),
    Slots(u64),
}

impl Shape {
    /// The full parameters (one division for a rate bucket).
    pub(crate) fn params(&self) -> Params {
        match *self {
            Shape::Rate(l) => Params::rate(l),
            Shape::Closed(l) => Params::Closed(l),
            Shape::Slots(n) => Params::Slots(n),
        }
    }

    /// Capacity in units: burst for a rate bucket, slots for concurrency.
    pub(crate) fn capacity(&self) -> u64 {
        match self {
            Shape::Rate(l) => l.burst,
            Shape::Closed(_) => 0,
            Shape::Slots(n) => *n,
        }
    }
}

impl Params {
    /// The parameters without their derived constants.
    #[inline]
    pub(crate) fn shape(&self) -> Shape {
        match self {
            Params::Rate(p) => Shape::Rate(p.limit),
            Params::Closed(l) => Shape::Closed(*l),
            Params::Slots(n) => Shape::Slots(*n),
        }
    }

    pub(crate) fn rate(limit: RateLimit) -> Params {
        match RateParams::new(limit) {
            Some(p) => Params::Rate(p),
            None => Params::Closed(limit),
        }
    }

    /// Capacity in units: burst for a rate bucket, slots for concurrency.
    pub(crate) fn capacity(&self) -> u64 {
        match self {
            Params::Rate(p) => p.limit.burst,
            Params::Closed(_) => 0,
            Params::Slots(n) => *n,
        }
    }
}

/// Result of a take attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Take {
    /// Taken: `amount` is what was debited (ns for rate, slots for concurrency); `after`
    /// is the state after the take.
    Taken { amount: u64, after: State },
    /// Not now: `retry_after_ns` until it would fit if nothing else changed (`None`:
    /// unknown, e.g. slots or a closed bucket). `after` is the state observed.
    Busy {
        retry_after_ns: Option<u64>,
        after: State,
    },
    /// The slot was sealed; look the key up again.
    Sealed,
}

/// A slot's state: TAT (rate) or in-flight count (slots), and units held by
/// refundable reservations (rate only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct State {
    pub(crate) tat: u64,
    pub(crate) held: u64,
}

impl State {
    #[inline]
    fn pack(self) -> u128 {
        ((self.held as u128) << 64) | self.tat as u128
    }

    #[inline]
    fn unpack(v: u128) -> State {
        State {
            tat: v as u64,
            held: (v >> 64) as u64,
        }
    }

    pub(crate) fn sealed(self) -> bool {
        self.tat == SEALED
    }
}

/// Per-key state: two cache lines, aligned to a line, so that neighbours never share
/// one (FIELD-NOTES: false sharing doubled the cost of adjacent limiters). Aligned to
/// 64 bytes, not 128: with 128 an `Arc`'s two counts took a padded 128-byte block of
/// their own (256 bytes an allocation, 192 now), and in cachegrind's model of a 2 MiB
/// 16-way L2 a keyed check over 10,000 keys missed it 0.40 times a check, against none
/// at 64 (the over-aligned blocks crowded into a fraction of the cache's sets).
#[repr(C, align(64))]
pub(crate) struct Slot {
    // The first cache line holds what a decision reads: the state, the check hash
    // and the GCRA parameters (a keyed check over 10,000 keys then misses on one slot
    // line, not two), and the admitted count it writes with the state. The other
    // counters and the key follow on the second.
    state: AtomicU128,
    /// Second, independent hash of the key: the decision path matches a key by its id
    /// (the table's key) and this, without touching the key's strings (a false match
    /// needs a 128-bit collision).
    pub(crate) check: u64,
    /// Cost admitted through this slot (demand reporting and summaries). On the first
    /// line, beside the state every admission writes anyway: counting an admission
    /// then dirties no second line (the bare keyed check over 10,000 keys missed on it
    /// once a check).
    pub(crate) admitted: AtomicU64,
    pub(crate) params: Params,
    /// Cost rejected by this slot (rejections are demand).
    pub(crate) rejected: AtomicU64,
    /// Cost of requests matching this key that another rule rejected: demand this key
    /// never saw admitted (without it, two rules on one key starve each other's demand,
    /// found by the local cluster).
    pub(crate) blocked: AtomicU64,
    /// Slots: engine time of the last take. Open rate buckets derive idleness from
    /// their TAT and hold [`RATE_MARK`] plus their generation here
    /// ([`Slot::generation`]); closed ones, both marks and the time they were made.
    touched: AtomicU64,
    pub(crate) key: Arc<LimitKey>,
    /// The sync client's last walk of this slot ([`Slot::walk_mark`];
    /// [`WALK_UNSEEN`]: never walked, or a slice change to report). A walk of changed
    /// keys skips a slot whose mark still matches. Written only under the engine's
    /// slow-path lock; never read by a decision. One word: the slot has 8 bytes to
    /// spare in its 128.
    walked: AtomicU64,
}

/// The top bit of [`Slot`]'s `touched` in a rate bucket, which never takes a time
/// there (a concurrency slot's times stay below it): tells the kinds apart on the
/// slot's second line ([`Slot::marks_in_flight`]). The other bits are the bucket's
/// generation.
const RATE_MARK: u64 = 1 << 63;

/// The next bit of a closed bucket's `touched`, whose other bits are the engine time it
/// was made at: it debits nothing, so no lease names its generation, and with this bit
/// its generation ([`Slot::generation`]) matches no open bucket's.
const CLOSED_MARK: u64 = 1 << 62;

/// Generations of rate buckets, unique in the process: a lease names the bucket it was
/// debited on by its key and generation ([`Slot::generation`]), without a reference.
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

/// [`Slot`]'s walk mark before any walk (and after a slice change the counts do not
/// show): the next walk of changed keys reads the slot.
const WALK_UNSEEN: u64 = u64::MAX;

impl Slot {
    /// A new slot at engine time `now` (a closed bucket's age counts from it).
    pub(crate) fn new(key: Arc<LimitKey>, params: Params, state: State, now: u64) -> Slot {
        debug_assert!(!state.sealed());
        Slot {
            state: AtomicU128::new(state.pack()),
            admitted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            blocked: AtomicU64::new(0),
            touched: AtomicU64::new(match params {
                Params::Slots(_) => 0,
                Params::Rate(_) => RATE_MARK | NEXT_GENERATION.fetch_add(1, Ordering::Relaxed),
                Params::Closed(_) => RATE_MARK | CLOSED_MARK | now.min(CLOSED_MARK - 1),
            }),
            params,
            check: key.check,
            key,
            walked: AtomicU64::new(WALK_UNSEEN),
        }
    }

    /// For the sync client's walks (under the slow-path lock): records what the slot
    /// shows now and says whether it differs from the last walk's mark (or the slot
    /// was never walked, or [`Slot::walk_unseen`] marked it). The mark is the low 40
    /// bits of `admitted + rejected + blocked` (each only grows) and the low 24 of the
    /// slots in flight: a change goes unseen only if the counts grew by a multiple of
    /// 2^40 (10^12 units) between two walks while in-flight came back to its value;
    /// then the key's next change shows it, counts included (they are cumulative).
    pub(crate) fn walk_mark(&self, in_flight: u64) -> bool {
        let counts = self
            .admitted
            .load(Ordering::Relaxed)
            .wrapping_add(self.rejected.load(Ordering::Relaxed))
            .wrapping_add(self.blocked.load(Ordering::Relaxed));
        let mark = (counts & ((1 << 40) - 1)) | (in_flight << 40);
        // A load, and a store only on a change: the walker is the only writer (under the
        // slow-path lock, as `walk_unseen`'s callers), so no locked swap, and a walk of
        // unchanged keys leaves their lines clean (a swap made the whole-key walk 35 %
        // slower).
        let last = self.walked.load(Ordering::Relaxed);
        if last != mark {
            self.walked.store(mark, Ordering::Relaxed);
        }
        last != mark || mark == WALK_UNSEEN
    }

    /// True for concurrency slots, whose walk mark includes the slots in flight (in the
    /// state, the first line). A rate bucket's mark is its counts alone, so a walk of
    /// changed keys decides on them (the admitted count on the first line since the
    /// seventeenth session, beside the state every admission writes; the others, this
    /// and the mark on the second) without reading the state or the parameters: the
    /// simulator's fleet-scale run took the same time either way.
    #[inline]
    pub(crate) fn marks_in_flight(&self) -> bool {
        self.touched.load(Ordering::Relaxed) < RATE_MARK
    }

    /// A rate bucket's generation, unique among the slots of the process (never reused);
    /// 0 for concurrency slots, whose settlements are whole slots on whichever slot is
    /// live. A lease settles its exact debit only on the bucket of the generation it
    /// was debited on; on a replacement, in units.
    #[inline]
    pub(crate) fn generation(&self) -> u64 {
        let t = self.touched.load(Ordering::Relaxed);
        if t >= RATE_MARK { t & !RATE_MARK } else { 0 }
    }

    /// Makes the next walk of changed keys read this slot: its key's slice changed
    /// without a new slot (a renewal, a lease ending on an unchanged posture).
    pub(crate) fn walk_unseen(&self) {
        self.walked.store(WALK_UNSEEN, Ordering::Relaxed);
    }

    /// The current state.
    #[inline]
    pub(crate) fn load(&self) -> State {
        State::unpack(self.state.load(Ordering::Acquire))
    }

    #[inline]
    fn cas(&self, cur: State, new: State) -> Result<(), State> {
        self.state
            // Sequentially consistent (the same locked instruction on x86): the engine's
            // change marks rely on it (`ChangeMarks` in engine.rs).
            .compare_exchange_weak(cur.pack(), new.pack(), Ordering::SeqCst, Ordering::Acquire)
            .map(|_| ())
            .map_err(State::unpack)
    }

    /// State of a full bucket (rate), nothing in flight (slots) or no debt (closed),
    /// nothing held.
    pub(crate) fn full_state(params: &Params, now: u64) -> State {
        let tat = match params {
            // TAT <= now means full; `now` itself is the canonical full state.
            Params::Rate(_) => now,
            Params::Closed(_) | Params::Slots(_) => 0,
        };
        State { tat, held: 0 }
    }

    /// State of a bucket holding `tokens` (at most its capacity), nothing held.
    pub(crate) fn state_with(params: &Params, now: u64, tokens: u64) -> State {
        match params {
            Params::Rate(p) => {
                let owed = p.limit.burst - tokens.min(p.limit.burst);
                State {
                    tat: now.saturating_add(p.debit_ns(owed)).min(TAT_MAX),
                    held: 0,
                }
            }
            Params::Closed(_) | Params::Slots(_) => State { tat: 0, held: 0 },
        }
    }

    /// Takes `cost` units (rate) or one slot (concurrency; `cost` 0 only checks). A cost
    /// of zero only checks that the bucket is not exhausted (at least one token, or one
    /// free slot) and debits nothing. `hold`: the cost may be partly refunded later, so
    /// it is counted in `held` until [`Slot::settle`].
    #[inline(always)]
    pub(crate) fn try_take(&self, now: u64, cost: u64, hold: bool) -> Take {
        match &self.params {
            Params::Rate(p) => {
                let inc = p.debit_ns(cost);
                let probe = if cost == 0 { p.debit_ns(1) } else { inc };
                let mut cur = self.load();
                loop {
                    if cur.sealed() {
                        return Take::Sealed;
                    }
                    let floor = p.floor(now, cur.held);
                    let base = cur.tat.max(floor);
                    let new = base.saturating_add(probe).min(TAT_MAX);
                    if new - now > p.tau_ns {
                        return Take::Busy {
                            retry_after_ns: Some(new - now - p.tau_ns),
                            after: cur,
                        };
                    }
                    if inc == 0 {
                        return Take::Taken {
                            amount: 0,
                            after: cur,
                        };
                    }
                    let next = State {
                        tat: base.saturating_add(inc).min(TAT_MAX),
                        held: if hold { cur.held + cost } else { cur.held },
                    };
                    match self.cas(cur, next) {
                        Ok(()) => {
                            return Take::Taken {
                                amount: inc,
                                after: next,
                            };
                        }
                        Err(actual) => cur = actual,
                    }
                }
            }
            Params::Closed(_) => {
                let cur = self.load();
                if cur.sealed() {
                    Take::Sealed
                } else {
                    Take::Busy {
                        retry_after_ns: None,
                        after: cur,
                    }
                }
            }
            Params::Slots(max) => {
                let max = *max;
                let mut cur = self.load();
                loop {
                    if cur.sealed() {
                        return Take::Sealed;
                    }
                    if cur.tat >= max {
                        return Take::Busy {
                            retry_after_ns: None,
                            after: cur,
                        };
                    }
                    if cost == 0 {
                        return Take::Taken {
                            amount: 0,
                            after: cur,
                        };
                    }
                    let next = State {
                        tat: cur.tat + 1,
                        held: 0,
                    };
                    match self.cas(cur, next) {
                        Ok(()) => {
                            self.touched
                                .store(now.min(RATE_MARK - 1), Ordering::Relaxed);
                            return Take::Taken {
                                amount: 1,
                                after: next,
                            };
                        }
                        Err(actual) => cur = actual,
                    }
                }
            }
        }
    }

    /// Settles part of a reservation: gives back `refund_ns` of debit (rate),
    /// `refund_ns` units (closed) or `refund_ns` slots (concurrency), and releases
    /// `release` held units. The level
    /// never rises above `burst - held`. Returns false if sealed (nothing changed; the
    /// caller re-resolves the key and settles on the current slot in units).
    pub(crate) fn settle(&self, now: u64, refund_ns: u64, release: u64) -> bool {
        let mut cur = self.load();
        loop {
            if cur.sealed() {
                return false;
            }
            let next = match &self.params {
                Params::Rate(p) => {
                    assert!(cur.held >= release, "released more than was held");
                    let held = cur.held - release;
                    // Start from the capped TAT (refill behind the cap was never
                    // available), then give back and re-apply the cap for what is
                    // still held.
                    let base = cur.tat.max(now.saturating_add(p.debit_ns(cur.held)));
                    let floor = now.saturating_add(p.debit_ns(held));
                    State {
                        tat: base.saturating_sub(refund_ns).max(floor),
                        held,
                    }
                }
                Params::Closed(_) => {
                    // `refund_ns` is in units here. As in a rate bucket, `level + held`
                    // (minus the debt) moves by `refund - release`, and never rises
                    // above the capacity, zero.
                    assert!(cur.held >= release, "released more than was held");
                    State {
                        tat: cur
                            .tat
                            .saturating_add(release)
                            .saturating_sub(refund_ns)
                            .min(TAT_MAX),
                        held: cur.held - release,
                    }
                }
                Params::Slots(_) => {
                    assert!(cur.tat >= refund_ns, "released more slots than were taken");
                    State {
                        tat: cur.tat - refund_ns,
                        held: 0,
                    }
                }
            };
            if next == cur {
                return true;
            }
            match self.cas(cur, next) {
                Ok(()) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Charges `cost` whatever the level: the bucket may go into debt and later requests
    /// wait. For tokens already spent (post-hoc debits, output beyond the reservation).
    /// Returns false if sealed.
    pub(crate) fn charge(&self, now: u64, cost: u64) -> bool {
        let mut cur = self.load();
        loop {
            if cur.sealed() {
                return false;
            }
            let next = match &self.params {
                Params::Rate(p) => State {
                    tat: cur
                        .tat
                        .max(p.floor(now, cur.held))
                        .saturating_add(p.debit_ns(cost))
                        .min(TAT_MAX),
                    held: cur.held,
                },
                // A closed bucket's debt grows: it is owed when the slice reopens.
                Params::Closed(_) => State {
                    tat: cur.tat.saturating_add(cost).min(TAT_MAX),
                    held: cur.held,
                },
                Params::Slots(_) => return true,
            };
            match self.cas(cur, next) {
                Ok(()) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Seals the slot and returns its final state, or `None` if it was already sealed.
    pub(crate) fn seal(&self) -> Option<State> {
        let prev = State::unpack(
            self.state.swap(
                State {
                    tat: SEALED,
                    held: 0,
                }
                .pack(),
                Ordering::AcqRel,
            ),
        );
        (!prev.sealed()).then_some(prev)
    }

    /// Seals the slot only if it is at rest: a rate bucket full, holding nothing, with
    /// no take for `idle_ns` (a take leaves the TAT above its time); or no slot in
    /// flight and none taken for `idle_ns`. Evicting such a slot is invisible: it is
    /// recreated identical. A closed bucket is at rest when it holds nothing, owes
    /// nothing and was made `idle_ns` ago (a bucket in debt repays it only once it
    /// reopens); with `forgive_debt`, whatever it owes: the engine passes it for a key
    /// whose grant's lease ended, which the allocator has taken back and which, if it
    /// returns, comes back new and closed until granted (else a key that closed in
    /// debt and never returned would hold its table entry for good).
    pub(crate) fn seal_if_at_rest(&self, now: u64, idle_ns: u64, forgive_debt: bool) -> bool {
        let cur = self.load();
        let at_rest = !cur.sealed()
            && match self.params {
                Params::Rate(_) => cur.held == 0 && cur.tat.saturating_add(idle_ns) <= now,
                Params::Closed(_) => {
                    let made = self.touched.load(Ordering::Relaxed) & !(RATE_MARK | CLOSED_MARK);
                    cur.held == 0
                        && (cur.tat == 0 || forgive_debt)
                        && made.saturating_add(idle_ns) <= now
                }
                Params::Slots(_) => {
                    cur.tat == 0
                        && self.touched.load(Ordering::Relaxed).saturating_add(idle_ns) <= now
                }
            };
        at_rest
            && self
                .state
                .compare_exchange(
                    cur.pack(),
                    State {
                        tat: SEALED,
                        held: 0,
                    }
                    .pack(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// True once sealed.
    pub(crate) fn is_sealed(&self) -> bool {
        self.load().sealed()
    }

    /// Admissible level in whole units at `now` (negative: debt): tokens a request could
    /// take now, or free slots. A closed bucket's is minus what it holds and owes.
    pub(crate) fn level(params: &Params, state: State, now: u64) -> i128 {
        match params {
            Params::Rate(p) => {
                let floor = now.saturating_add(p.debit_ns(state.held));
                let deficit = state.tat.max(floor) - now;
                p.limit.burst as i128 - p.tokens_owed(deficit) as i128
            }
            Params::Closed(_) => -(state.held as i128) - state.tat as i128,
            Params::Slots(max) => *max as i128 - state.tat as i128,
        }
    }
}

/// Converts a sealed slot's final state to the state of a slot with new parameters,
/// under invariant 2, adding `transfer` units (tokens handed over by the allocator from
/// another agent's shrink) without exceeding the new capacity. Held reservations carry
/// over: the clamp applies to `level + held` (see the module docs), so a refund after
/// a shrink or a growth cannot lift the level above what an exact bucket would hold.
///
/// Returns the new state and the whole units the clamp gave up (which the agent reports
/// so that the allocator can hand them on).
pub(crate) fn convert(
    old: &Params,
    state: State,
    new: &Params,
    now: u64,
    transfer: u64,
) -> (State, u64) {
    match (old, new) {
        (Params::Slots(_), Params::Slots(_)) => (state, 0),
        (_, Params::Slots(_)) | (Params::Slots(_), _) => (Slot::full_state(new, now), 0),
        (old, new) => {
            let held = state.held as i128;
            let with_held = Slot::level(old, state, now) + held;
            let cap = new.capacity() as i128;
            let released = (with_held - cap).max(0) as u64;
            let kept = with_held.min(cap).saturating_add(transfer as i128).min(cap);
            match new {
                Params::Rate(p) => {
                    // Owed below full, in whole units: the held units and any debt.
                    let owed = (cap - kept + held).max(0) as u64;
                    let tat = now.saturating_add(p.debit_ns(owed)).min(TAT_MAX);
                    (
                        State {
                            tat,
                            held: state.held,
                        },
                        released,
                    )
                }
                // Closed: the capacity is zero, so `kept` is minus the debt carried.
                _ => (
                    State {
                        tat: u64::try_from(-kept).unwrap_or(TAT_MAX).min(TAT_MAX),
                        held: state.held,
                    },
                    released,
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_decision_reads_sits_in_the_slot_s_first_cache_line() {
        assert_eq!(std::mem::size_of::<Slot>(), 128);
        assert!(std::mem::offset_of!(Slot, check) + 8 <= 64);
        // The admitted count too: every admission writes it with the state.
        assert!(std::mem::offset_of!(Slot, admitted) + 8 <= 64);
        // The rest of what a walk of changed keys reads sits in the second.
        for field in [
            std::mem::offset_of!(Slot, rejected),
            std::mem::offset_of!(Slot, blocked),
            std::mem::offset_of!(Slot, walked),
            std::mem::offset_of!(Slot, touched),
        ] {
            assert!((64..128).contains(&field), "{field}");
        }
        // The rate parameters a take reads: the interval and tau (the limit's rate,
        // burst and period are for reports).
        let params = std::mem::offset_of!(Slot, params);
        let payload = params + std::mem::size_of::<Params>() - std::mem::size_of::<RateParams>();
        assert!(payload + std::mem::offset_of!(RateParams, tau_ns) + 8 <= 64);
    }

    fn key() -> Arc<LimitKey> {
        Arc::new(LimitKey::for_tests("r"))
    }

    #[test]
    fn only_concurrency_slots_mark_their_slots_in_flight_whatever_they_took() {
        let slots = full(Params::Slots(2), 0);
        assert!(slots.marks_in_flight());
        assert!(matches!(slots.try_take(5, 1, false), Take::Taken { .. }));
        assert!(slots.marks_in_flight(), "a take's time is not the marker");
        assert!(matches!(
            slots.try_take(u64::MAX, 1, false),
            Take::Taken { .. }
        ));
        assert!(slots.marks_in_flight(), "not even the last instant");
        let bucket = full(rate(10, 10), 0);
        assert!(!bucket.marks_in_flight());
        assert!(matches!(bucket.try_take(5, 3, true), Take::Taken { .. }));
        assert!(!bucket.marks_in_flight());
        assert!(!full(rate(0, 0), 0).marks_in_flight(), "closed");
    }

    fn rate(rate: u64, burst: u64) -> Params {
        Params::rate(RateLimit {
            rate,
            burst,
            period_ns: 1_000_000_000,
        })
    }

    fn full(p: Params, now: u64) -> Slot {
        Slot::new(key(), p, Slot::full_state(&p, now), now)
    }

    fn level(s: &Slot, now: u64) -> i128 {
        Slot::level(&s.params, s.load(), now)
    }

    #[test]
    fn a_full_bucket_admits_exactly_its_burst_then_refills_at_the_rate() {
        let slot = full(rate(10, 5), 0);
        for _ in 0..5 {
            assert!(matches!(slot.try_take(0, 1, false), Take::Taken { .. }));
        }
        let Take::Busy { retry_after_ns, .. } = slot.try_take(0, 1, false) else {
            panic!("sixth token must be refused");
        };
        assert_eq!(retry_after_ns, Some(100_000_000));
        assert!(matches!(
            slot.try_take(99_999_999, 1, false),
            Take::Busy { .. }
        ));
        assert!(matches!(
            slot.try_take(100_000_000, 1, false),
            Take::Taken { .. }
        ));
    }

    #[test]
    fn a_cost_equal_to_burst_fits_even_when_the_interval_is_not_whole() {
        // I = 1e9/3 ns, not a whole number of ns.
        let slot = full(rate(3, 7), 0);
        assert!(matches!(slot.try_take(0, 7, false), Take::Taken { .. }));
        assert!(matches!(slot.try_take(0, 1, false), Take::Busy { .. }));
    }

    #[test]
    fn settling_never_raises_the_level_above_full() {
        let slot = full(rate(10, 5), 1_000);
        let Take::Taken { amount, .. } = slot.try_take(1_000, 2, true) else {
            panic!()
        };
        assert_eq!(level(&slot, 1_000), 3);
        assert!(slot.settle(1_000, amount * 10, 2));
        assert_eq!(level(&slot, 1_000), 5);
    }

    #[test]
    fn a_held_reservation_caps_refill_so_a_refund_cannot_overfill() {
        // burst 10 at 10/s: reserve 8 (held), then 1 s passes.
        let slot = full(rate(10, 10), 0);
        let Take::Taken { amount, .. } = slot.try_take(0, 8, true) else {
            panic!()
        };
        let later = 1_000_000_000;
        assert_eq!(level(&slot, later), 2, "refill stops at burst - held");
        // All 8 unused: the refund restores them; level + held never exceeded 10.
        let p = match slot.params {
            Params::Rate(p) => p,
            _ => unreachable!(),
        };
        assert!(slot.settle(later, amount - p.debit_ns(0), 8));
        assert_eq!(level(&slot, later), 10);
        // Had 5 been used, level + held would be 10 - 5 after settling.
        let slot = full(rate(10, 10), 0);
        let Take::Taken { amount, .. } = slot.try_take(0, 8, true) else {
            panic!()
        };
        assert!(slot.settle(later, amount - p.debit_ns(5), 8));
        assert_eq!(level(&slot, later), 5);
    }

    #[test]
    fn zero_cost_checks_without_debiting() {
        let slot = full(rate(10, 1), 0);
        assert!(matches!(
            slot.try_take(0, 0, false),
            Take::Taken { amount: 0, .. }
        ));
        assert!(matches!(slot.try_take(0, 1, false), Take::Taken { .. }));
        assert!(matches!(slot.try_take(0, 0, false), Take::Busy { .. }));
    }

    #[test]
    fn charge_goes_into_debt_and_later_requests_wait() {
        let slot = full(rate(10, 10), 0);
        assert!(slot.charge(0, 30));
        assert_eq!(level(&slot, 0), -20);
        // 20 tokens of debt plus 1 token: 2.1 s.
        let Take::Busy { retry_after_ns, .. } = slot.try_take(0, 1, false) else {
            panic!()
        };
        assert_eq!(retry_after_ns, Some(2_100_000_000));
    }

    #[test]
    fn sealed_slots_refuse_everything() {
        let slot = full(rate(10, 10), 0);
        assert_eq!(slot.seal(), Some(State { tat: 0, held: 0 }));
        assert_eq!(slot.seal(), None);
        assert_eq!(slot.try_take(0, 1, false), Take::Sealed);
        assert!(!slot.settle(0, 1, 0));
        assert!(!slot.charge(0, 1));
    }

    #[test]
    fn shrinking_clamps_and_reports_what_it_gave_up_growing_keeps_the_level() {
        let big = rate(100, 100);
        let small = rate(10, 10);
        let (state, released) = convert(&big, Slot::full_state(&big, 0), &small, 0, 0);
        assert_eq!(released, 90);
        assert_eq!(Slot::level(&small, state, 0), 10);
        let (state, released) = convert(&small, state, &big, 0, 0);
        assert_eq!(released, 0);
        assert_eq!(
            Slot::level(&big, state, 0),
            10,
            "growth must not raise the level"
        );
        let (state, _) = convert(&big, state, &big, 0, 500);
        assert_eq!(
            Slot::level(&big, state, 0),
            100,
            "transfer is capped at capacity"
        );
    }

    #[test]
    fn held_units_carry_over_a_slice_change_and_count_against_the_clamp() {
        let big = rate(100, 100);
        let small = rate(10, 10);
        let slot = full(big, 0);
        assert!(matches!(slot.try_take(0, 30, true), Take::Taken { .. }));
        // level 70 + held 30 = 100, clamped to 10: level -20, held 30.
        let (state, released) = convert(&big, slot.load(), &small, 0, 0);
        assert_eq!(released, 90);
        assert_eq!(state.held, 30);
        assert_eq!(Slot::level(&small, state, 0), -20);
    }

    #[test]
    fn a_closed_bucket_keeps_its_debt_and_reopens_owing_it() {
        let open = rate(10, 10);
        let closed = rate(0, 0);
        assert!(matches!(closed, Params::Closed(_)));
        let slot = full(open, 0);
        assert!(slot.charge(0, 40));
        assert_eq!(level(&slot, 0), -30);
        let (state, released) = convert(&open, slot.seal().unwrap(), &closed, 0, 0);
        assert_eq!(released, 0);
        assert_eq!(Slot::level(&closed, state, 0), -30);
        // More spent while closed (output beyond a reservation) adds to it; a refund
        // of a debit carried over takes from it, never below zero.
        let slot = Slot::new(key(), closed, state, 0);
        assert!(slot.charge(5, 5));
        assert_eq!(level(&slot, 5), -35);
        assert!(slot.settle(5, 3, 0));
        assert_eq!(level(&slot, 5), -32);
        let (state, _) = convert(&closed, slot.seal().unwrap(), &open, 7, 0);
        assert_eq!(Slot::level(&open, state, 7), -32, "growth keeps the debt");
        let (state, _) = convert(&closed, State { tat: 3, held: 0 }, &open, 7, 5);
        assert_eq!(
            Slot::level(&open, state, 7),
            2,
            "a transfer pays it off first"
        );
        let slot = Slot::new(key(), closed, State { tat: 2, held: 0 }, 0);
        assert!(slot.settle(0, 9, 0));
        assert_eq!(level(&slot, 0), 0, "capacity zero: no credit");
    }

    #[test]
    fn a_closed_bucket_holding_a_reservation_owes_what_it_used() {
        let open = rate(10, 10);
        let closed = rate(0, 0);
        let slot = full(open, 0);
        assert!(matches!(slot.try_take(0, 8, true), Take::Taken { .. }));
        let (state, released) = convert(&open, slot.seal().unwrap(), &closed, 0, 0);
        // As on any shrink, the clamp counts held units as returnable (level 2 + held
        // 8); what the reservation then uses becomes debt.
        assert_eq!(released, 10);
        assert_eq!(state.held, 8);
        let slot = Slot::new(key(), closed, state, 0);
        assert_eq!(level(&slot, 0), -8);
        // 3 of the 8 used: refund 5, release 8.
        assert!(slot.settle(0, 5, 8));
        assert_eq!(slot.load().held, 0);
        assert_eq!(level(&slot, 0), -3);
    }

    #[test]
    fn a_closed_bucket_rests_once_idle_since_it_was_made_and_holding_nothing() {
        let closed = rate(0, 0);
        let slot = Slot::new(key(), closed, State { tat: 0, held: 1 }, 1_000);
        assert!(
            !slot.seal_if_at_rest(5_000, 1_000, true),
            "holds a reservation"
        );
        assert!(slot.settle(5_000, 1, 1));
        assert!(
            !slot.seal_if_at_rest(1_500, 1_000, false),
            "made 500 ns ago"
        );
        assert!(slot.settle(5_000, 1, 0));
        assert_eq!(level(&slot, 5_000), 0);
        assert!(slot.seal_if_at_rest(2_000, 1_000, false));
        let owing = Slot::new(key(), closed, State { tat: 4, held: 0 }, 1_000);
        assert!(!owing.seal_if_at_rest(9_000, 1_000, false), "debt pins it");
        assert!(owing.seal_if_at_rest(9_000, 1_000, true), "unless forgiven");
        // Its generation is no open bucket's.
        let made = Slot::new(key(), closed, State { tat: 0, held: 0 }, 3);
        assert!(made.generation() >= CLOSED_MARK);
        assert!(!made.marks_in_flight());
    }

    #[test]
    fn the_one_word_product_agrees_with_the_general_one() {
        // Intervals with and without a high word (1 a day over a day's period is
        // 8.64e13 ns), costs up to saturation.
        let limits = [(1_000_000_000, 1_000_000), (7, 3), (1, 1), (3, 1 << 40)];
        let periods = [1_000_000_000u64, 60_000_000_000, 86_400_000_000_000];
        for (rate, burst) in limits {
            for period_ns in periods {
                let p = RateParams::new(RateLimit {
                    rate,
                    burst,
                    period_ns,
                })
                .unwrap();
                for cost in [0, 1, 2, 999, 1 << 31, 1 << 33, u64::MAX / 3, u64::MAX] {
                    let x = (cost as u128).saturating_mul(p.interval_fp());
                    let debit = u64::try_from(x.div_ceil(1 << FP_BITS)).unwrap_or(TAT_MAX);
                    let refund = u64::try_from(x >> FP_BITS).unwrap_or(TAT_MAX);
                    assert_eq!(p.debit_ns(cost), debit, "{rate}/{period_ns} x {cost}");
                    assert_eq!(p.refund_ns(cost), refund, "{rate}/{period_ns} x {cost}");
                }
            }
        }
    }

    #[test]
    fn a_walk_mark_sees_counts_in_flight_and_slice_changes_once_each() {
        let slot = full(Params::Slots(4), 0);
        assert!(slot.walk_mark(0), "a slot never walked is new");
        assert!(!slot.walk_mark(0));
        slot.admitted.fetch_add(1, Ordering::Relaxed);
        assert!(slot.walk_mark(0));
        assert!(!slot.walk_mark(0));
        slot.blocked.fetch_add(3, Ordering::Relaxed);
        assert!(slot.walk_mark(0));
        assert!(slot.walk_mark(1), "in flight went up");
        assert!(slot.walk_mark(0), "and back down");
        assert!(!slot.walk_mark(0));
        slot.walk_unseen();
        assert!(slot.walk_mark(0), "a slice change without a new slot");
        assert!(!slot.walk_mark(0));
    }

    #[test]
    fn a_slot_fits_one_128_byte_block() {
        assert_eq!(std::mem::size_of::<Slot>(), 128);
    }

    #[test]
    fn slots_admit_up_to_max_and_release() {
        let slot = full(Params::Slots(2), 0);
        assert!(matches!(
            slot.try_take(0, 1, false),
            Take::Taken {
                amount: 1,
                after: State { tat: 1, .. }
            }
        ));
        assert!(matches!(
            slot.try_take(0, 1, false),
            Take::Taken { amount: 1, .. }
        ));
        assert!(matches!(slot.try_take(0, 1, false), Take::Busy { .. }));
        assert!(slot.settle(0, 1, 0));
        assert!(matches!(slot.try_take(0, 1, false), Take::Taken { .. }));
    }
}
