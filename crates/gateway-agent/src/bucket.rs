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
//! **Changing parameters.** A slot's parameters never change. A slice update *seals*
//! the old slot (CAS its state to [`SEALED`], which no operation leaves) and installs a
//! new slot whose state is converted from the sealed one under invariant 2: shrinking
//! clamps the level, growing does not raise it. A thread that finds a sealed slot looks
//! the key up again. Sealing makes the hand-over atomic: no debit can land on the old
//! slot after its final state was read, and no ABA is possible because a sealed slot
//! stays sealed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Precomputed GCRA parameters of an open rate bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RateParams {
    pub(crate) limit: RateLimit,
    /// Emission interval in ns, 32.32 fixed point, rounded up.
    interval_fp: u128,
    /// `debit_ns(burst)`.
    pub(crate) tau_ns: u64,
}

impl RateParams {
    /// Parameters for `limit`, or `None` if the limit admits nothing (rate or burst 0).
    pub(crate) fn new(limit: RateLimit) -> Option<RateParams> {
        if limit.rate == 0 || limit.burst == 0 {
            return None;
        }
        let num = (limit.period_ns as u128) << FP_BITS;
        let interval_fp = num.div_ceil(limit.rate as u128);
        let mut p = RateParams {
            limit,
            interval_fp,
            tau_ns: 0,
        };
        p.tau_ns = p.debit_ns(limit.burst);
        Some(p)
    }

    /// Nanoseconds charged for `cost` units: `ceil(cost * I)`, saturating.
    #[inline]
    pub(crate) fn debit_ns(&self, cost: u64) -> u64 {
        let x = (cost as u128).saturating_mul(self.interval_fp);
        let ns = x.div_ceil(1u128 << FP_BITS);
        u64::try_from(ns).unwrap_or(TAT_MAX)
    }

    /// Nanoseconds given back for `tokens` units: `floor(tokens * I)`.
    #[inline]
    pub(crate) fn refund_ns(&self, tokens: u64) -> u64 {
        let x = (tokens as u128).saturating_mul(self.interval_fp) >> FP_BITS;
        u64::try_from(x).unwrap_or(TAT_MAX)
    }

    /// Whole tokens that `ns` of refill time buys: `floor(ns / I)`.
    pub(crate) fn tokens_in(&self, ns: u64) -> u64 {
        (((ns as u128) << FP_BITS) / self.interval_fp) as u64
    }

    /// Tokens that `ns` of deficit represents, rounded up: `ceil(ns / I)`.
    fn tokens_owed(&self, ns: u64) -> u64 {
        ((ns as u128) << FP_BITS).div_ceil(self.interval_fp) as u64
    }
}

/// Parameters of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Params {
    /// An open rate bucket.
    Rate(RateParams),
    /// A rate bucket whose slice is zero: admits nothing, holds nothing.
    Closed(RateLimit),
    /// Concurrency slots.
    Slots(u64),
}

impl Params {
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
    /// is the state after the take (TAT or in-flight count).
    Taken { amount: u64, after: u64 },
    /// Not now: `retry_after_ns` until it would fit (`None`: unknown, e.g. slots or a
    /// closed bucket). `after` is the state observed.
    Busy {
        retry_after_ns: Option<u64>,
        after: u64,
    },
    /// The slot was sealed; look the key up again.
    Sealed,
}

/// Per-key state, padded to two cache lines so that neighbours never share a line
/// (FIELD-NOTES: false sharing doubled the cost of adjacent limiters).
#[repr(align(128))]
pub(crate) struct Slot {
    /// TAT (rate), in-flight count (slots), or [`SEALED`].
    pub(crate) state: AtomicU64,
    /// Cost admitted through this slot (demand reporting and summaries).
    pub(crate) admitted: AtomicU64,
    /// Cost rejected by this slot (rejections are demand).
    pub(crate) rejected: AtomicU64,
    /// Slots only: engine time of the last take (rate buckets derive idleness from
    /// their TAT).
    touched: AtomicU64,
    pub(crate) params: Params,
    pub(crate) key: Arc<LimitKey>,
}

impl Slot {
    pub(crate) fn new(key: Arc<LimitKey>, params: Params, state: u64) -> Slot {
        debug_assert!(state != SEALED);
        Slot {
            state: AtomicU64::new(state),
            admitted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            touched: AtomicU64::new(0),
            params,
            key,
        }
    }

    /// Initial state of a slot for a full bucket (rate) or no work in flight (slots).
    pub(crate) fn full_state(now: u64) -> u64 {
        // TAT <= now means full; `now` itself is the canonical full state.
        now
    }

    /// Initial state of an empty rate bucket.
    pub(crate) fn empty_state(params: &Params, now: u64) -> u64 {
        match params {
            Params::Rate(p) => now.saturating_add(p.tau_ns).min(TAT_MAX),
            Params::Closed(_) => now,
            Params::Slots(_) => 0,
        }
    }

    /// Takes `cost` units (rate) or one slot (concurrency, `cost` ignored). A cost of
    /// zero only checks that the bucket is not exhausted (at least one token, or one free
    /// slot) and debits nothing.
    #[inline]
    pub(crate) fn try_take(&self, now: u64, cost: u64) -> Take {
        match &self.params {
            Params::Rate(p) => {
                let inc = p.debit_ns(cost);
                let probe = if cost == 0 { p.debit_ns(1) } else { inc };
                let mut cur = self.state.load(Ordering::Acquire);
                loop {
                    if cur == SEALED {
                        return Take::Sealed;
                    }
                    let base = cur.max(now);
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
                    let new = base.saturating_add(inc).min(TAT_MAX);
                    match self.state.compare_exchange_weak(
                        cur,
                        new,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => {
                            return Take::Taken {
                                amount: inc,
                                after: new,
                            };
                        }
                        Err(actual) => cur = actual,
                    }
                }
            }
            Params::Closed(_) => {
                let cur = self.state.load(Ordering::Acquire);
                if cur == SEALED {
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
                let mut cur = self.state.load(Ordering::Acquire);
                loop {
                    if cur == SEALED {
                        return Take::Sealed;
                    }
                    if cur >= max {
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
                    match self.state.compare_exchange_weak(
                        cur,
                        cur + 1,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => {
                            self.touched.store(now, Ordering::Relaxed);
                            return Take::Taken {
                                amount: 1,
                                after: cur + 1,
                            };
                        }
                        Err(actual) => cur = actual,
                    }
                }
            }
        }
    }

    /// Gives back `amount` (ns for rate, slots for concurrency). A rate bucket never
    /// rises above full (the TAT never goes below `min(tat, now)`). Returns false if the
    /// slot is sealed (nothing changed; the caller re-resolves the key).
    pub(crate) fn give_back(&self, now: u64, amount: u64) -> bool {
        if amount == 0 {
            return self.state.load(Ordering::Acquire) != SEALED;
        }
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            if cur == SEALED {
                return false;
            }
            let new = match self.params {
                Params::Rate(_) => {
                    if cur <= now {
                        return true; // already full
                    }
                    cur.saturating_sub(amount).max(now)
                }
                Params::Closed(_) => return true,
                Params::Slots(_) => {
                    assert!(cur >= amount, "released more slots than were taken");
                    cur - amount
                }
            };
            match self
                .state
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Charges `cost` whatever the level: the bucket may go into debt and later requests
    /// wait. For tokens already spent (post-hoc debits, output beyond the reservation).
    /// Returns false if sealed.
    pub(crate) fn charge(&self, now: u64, cost: u64) -> bool {
        let Params::Rate(p) = &self.params else {
            return self.state.load(Ordering::Acquire) != SEALED;
        };
        let inc = p.debit_ns(cost);
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            if cur == SEALED {
                return false;
            }
            let new = cur.max(now).saturating_add(inc).min(TAT_MAX);
            match self
                .state
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Seals the slot and returns its final state, or `None` if it was already sealed.
    pub(crate) fn seal(&self) -> Option<u64> {
        let prev = self.state.swap(SEALED, Ordering::AcqRel);
        (prev != SEALED).then_some(prev)
    }

    /// Seals the slot only if it is at rest: a rate bucket full since at least `idle_ns`
    /// before `now` (no take since then, since a take leaves the TAT above its time), or
    /// no slot in flight and none taken for `idle_ns`. Evicting such a slot is invisible: it is recreated identical.
    pub(crate) fn seal_if_at_rest(&self, now: u64, idle_ns: u64) -> bool {
        let cur = self.state.load(Ordering::Acquire);
        let at_rest = match self.params {
            Params::Rate(_) | Params::Closed(_) => {
                cur != SEALED && cur.saturating_add(idle_ns) <= now
            }
            Params::Slots(_) => {
                cur == 0 && self.touched.load(Ordering::Relaxed).saturating_add(idle_ns) <= now
            }
        };
        at_rest
            && self
                .state
                .compare_exchange(cur, SEALED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// True once sealed.
    pub(crate) fn is_sealed(&self) -> bool {
        self.state.load(Ordering::Acquire) == SEALED
    }

    /// Level in whole units at `now` for a given state (may be negative: debt).
    pub(crate) fn level(params: &Params, state: u64, now: u64) -> i128 {
        match params {
            Params::Rate(p) => {
                let deficit = state.saturating_sub(now);
                p.limit.burst as i128 - p.tokens_owed(deficit) as i128
            }
            Params::Closed(_) => 0,
            Params::Slots(max) => *max as i128 - state as i128,
        }
    }
}

/// Converts a sealed slot's final state to the state of a slot with new parameters,
/// under invariant 2, adding `transfer` units (tokens handed over by the allocator from
/// another agent's shrink) without exceeding the new capacity.
///
/// Returns the new state and the whole units the clamp gave up (which the agent reports
/// so that the allocator can hand them on).
pub(crate) fn convert(
    old: &Params,
    state: u64,
    new: &Params,
    now: u64,
    transfer: u64,
) -> (u64, u64) {
    match (old, new) {
        (Params::Slots(_), Params::Slots(_)) => (state, 0),
        (_, Params::Slots(_)) => (0, 0),
        (old, new) => {
            let level = match old {
                Params::Slots(_) => 0,
                _ => Slot::level(old, state, now),
            };
            let cap = new.capacity() as i128;
            let released = (level - cap).max(0) as u64;
            let kept = level.min(cap).saturating_add(transfer as i128).min(cap);
            match new {
                Params::Rate(p) => {
                    // Deficit below full, in whole units; debt (kept < 0) carries over.
                    let owed = (cap - kept).max(0) as u64;
                    let state = now.saturating_add(p.debit_ns(owed)).min(TAT_MAX);
                    (state, released)
                }
                _ => (now, level.max(0) as u64),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Arc<LimitKey> {
        Arc::new(LimitKey::for_tests("r"))
    }

    fn rate(rate: u64, burst: u64) -> Params {
        Params::rate(RateLimit {
            rate,
            burst,
            period_ns: 1_000_000_000,
        })
    }

    #[test]
    fn a_full_bucket_admits_exactly_its_burst_then_refills_at_the_rate() {
        let slot = Slot::new(key(), rate(10, 5), Slot::full_state(0));
        for _ in 0..5 {
            assert!(matches!(slot.try_take(0, 1), Take::Taken { .. }));
        }
        let Take::Busy { retry_after_ns, .. } = slot.try_take(0, 1) else {
            panic!("sixth token must be refused");
        };
        assert_eq!(retry_after_ns, Some(100_000_000));
        assert!(matches!(slot.try_take(99_999_999, 1), Take::Busy { .. }));
        assert!(matches!(slot.try_take(100_000_000, 1), Take::Taken { .. }));
    }

    #[test]
    fn a_cost_equal_to_burst_fits_even_when_the_interval_is_not_whole() {
        // I = 1e9/3 ns, not a whole number of ns.
        let slot = Slot::new(key(), rate(3, 7), Slot::full_state(0));
        assert!(matches!(slot.try_take(0, 7), Take::Taken { .. }));
        assert!(matches!(slot.try_take(0, 1), Take::Busy { .. }));
    }

    #[test]
    fn give_back_never_raises_the_level_above_full() {
        let slot = Slot::new(key(), rate(10, 5), Slot::full_state(1_000));
        let Take::Taken { amount, .. } = slot.try_take(1_000, 2) else {
            panic!()
        };
        assert!(slot.give_back(1_000, amount * 10));
        assert_eq!(
            Slot::level(&slot.params, slot.state.load(Ordering::Relaxed), 1_000),
            5
        );
    }

    #[test]
    fn zero_cost_checks_without_debiting() {
        let slot = Slot::new(key(), rate(10, 1), Slot::full_state(0));
        assert!(matches!(slot.try_take(0, 0), Take::Taken { amount: 0, .. }));
        assert!(matches!(slot.try_take(0, 1), Take::Taken { .. }));
        assert!(matches!(slot.try_take(0, 0), Take::Busy { .. }));
    }

    #[test]
    fn charge_goes_into_debt_and_later_requests_wait() {
        let slot = Slot::new(key(), rate(10, 10), Slot::full_state(0));
        assert!(slot.charge(0, 30));
        assert_eq!(
            Slot::level(&slot.params, slot.state.load(Ordering::Relaxed), 0),
            -20
        );
        // 20 tokens of debt plus 1 token: 2.1 s.
        let Take::Busy { retry_after_ns, .. } = slot.try_take(0, 1) else {
            panic!()
        };
        assert_eq!(retry_after_ns, Some(2_100_000_000));
    }

    #[test]
    fn sealed_slots_refuse_everything() {
        let slot = Slot::new(key(), rate(10, 10), Slot::full_state(0));
        assert_eq!(slot.seal(), Some(0));
        assert_eq!(slot.seal(), None);
        assert_eq!(slot.try_take(0, 1), Take::Sealed);
        assert!(!slot.give_back(0, 1));
        assert!(!slot.charge(0, 1));
    }

    #[test]
    fn shrinking_clamps_and_reports_what_it_gave_up_growing_keeps_the_level() {
        let big = rate(100, 100);
        let small = rate(10, 10);
        let (state, released) = convert(&big, Slot::full_state(0), &small, 0, 0);
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
    fn slots_admit_up_to_max_and_release() {
        let slot = Slot::new(key(), Params::Slots(2), 0);
        assert!(matches!(
            slot.try_take(0, 1),
            Take::Taken {
                amount: 1,
                after: 1
            }
        ));
        assert!(matches!(
            slot.try_take(0, 1),
            Take::Taken {
                amount: 1,
                after: 2
            }
        ));
        assert!(matches!(slot.try_take(0, 1), Take::Busy { .. }));
        assert!(slot.give_back(0, 1));
        assert!(matches!(slot.try_take(0, 1), Take::Taken { .. }));
    }
}
