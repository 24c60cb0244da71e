//! Weighted max-min fair shares (water-filling) and their rounding to whole units.
//!
//! Pure arithmetic, no state: the core calls it per key with each agent's smoothed
//! demand. Property tests below check the sum bound, max-min fairness and rounding.

/// One agent's claim on a key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Claim {
    /// Smoothed demand (admitted + rejected), in units per the rule's period (slots for
    /// concurrency). Non-negative and finite.
    pub demand: f64,
    /// Weight (> 0).
    pub weight: f64,
    /// The agent rejected something in its last report: spare capacity goes to it
    /// first.
    pub rejecting: bool,
}

/// Iterations of the closed-form water level before falling back to a sort.
const MAX_ITERATIONS: usize = 8;

/// The shape of one water-filling: enough to compute one claim's share again without
/// the others (the core re-targets single entries of large keys with it).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Fill {
    /// Demand exceeded capacity: shares are `min(demand, weight * demand * level)`.
    pub overloaded: bool,
    /// The water level (overloaded only): the fraction of its demand a claim of weight
    /// 1 gets.
    pub level: f64,
    /// Spare per unit of weight given to each rejecting claim (underloaded only).
    pub spare_per_weight: f64,
    /// Spare as a fraction of demand given to every claim (headroom).
    pub headroom: f64,
}

impl Fill {
    /// The share `claim` gets under this fill.
    pub fn share(&self, c: &Claim) -> f64 {
        if self.overloaded {
            c.demand.min(c.weight * c.demand * self.level)
        } else if c.rejecting {
            c.demand * (1.0 + self.headroom) + self.spare_per_weight * c.weight
        } else {
            c.demand * (1.0 + self.headroom)
        }
    }
}

/// Writes each claim's fair share of `capacity` into `out` (same order), summing to at
/// most `capacity`, and returns the fill's shape.
///
/// When demand exceeds capacity, shares are weighted max-min over *demand times
/// weight*: `min(demand, weight * demand * λ)` with the water level `λ` chosen so that
/// they sum to `capacity`. With equal weights every claim gets the same fraction
/// `capacity / Σ demand` of its demand, so a request has the same chance on every agent,
/// as under one global bucket. (Plain max-min gave small claims their whole demand: a
/// bucket whose rate equals its Poisson demand is full, and wasting refill, much of the
/// time, while the large claims reject; in the simulator's `zipf` that cost 0.05-0.1 of
/// utilization.) Otherwise everyone
/// gets its demand, and of the spare `capacity - Σ demand` a `reserve` fraction (0..=1)
/// stays unassigned; of the rest, half goes to every claim in proportion to its demand
/// (headroom, so a steady agent keeps a burst for clumpy arrivals) and half to rejecting
/// claims by weight (all of it as headroom if none is rejecting, all of it to rejecting
/// claims if there is no demand yet).
pub fn water_fill(capacity: f64, claims: &[Claim], reserve: f64, out: &mut Vec<f64>) -> Fill {
    out.clear();
    let total: f64 = claims.iter().map(|c| c.demand).sum();
    if total <= capacity {
        out.extend(claims.iter().map(|c| c.demand));
        let mut fill = Fill::default();
        let spare = (capacity - total) * (1.0 - reserve);
        if spare <= 0.0 {
            return fill;
        }
        let w_rej: f64 = claims
            .iter()
            .filter(|c| c.rejecting)
            .map(|c| c.weight)
            .sum();
        match (w_rej > 0.0, total > 0.0) {
            (true, true) => {
                fill.spare_per_weight = spare / 2.0 / w_rej;
                fill.headroom = spare / 2.0 / total;
            }
            (true, false) => fill.spare_per_weight = spare / w_rej,
            (false, true) => fill.headroom = spare / total,
            (false, false) => {}
        }
        for (o, c) in out.iter_mut().zip(claims) {
            *o = fill.share(c);
        }
        return fill;
    }
    // Demand exceeds capacity: find the water level λ. Unsatisfied claims are marked
    // with a negative share until the level is known.
    // The effective weight of a claim is its weight times its demand.
    let ew = |c: &Claim| c.weight * c.demand;
    out.extend(claims.iter().map(|_| -1.0));
    let mut remaining = capacity;
    let mut weight: f64 = claims.iter().map(ew).sum();
    let mut level = remaining / weight;
    let mut settled = false;
    for _ in 0..MAX_ITERATIONS {
        let mut changed = false;
        for (o, c) in out.iter_mut().zip(claims) {
            if *o < 0.0 && c.demand <= ew(c) * level {
                *o = c.demand;
                remaining -= c.demand;
                weight -= ew(c);
                changed = true;
            }
        }
        if !changed || weight <= 0.0 {
            settled = true;
            break;
        }
        level = remaining / weight;
    }
    if !settled {
        // Slow convergence (widely spread demands): sort by demand per weight.
        let mut order: Vec<usize> = (0..claims.len()).collect();
        // Claims are satisfied in order of 1 / weight (demand / effective weight).
        order.sort_by(|&a, &b| {
            let ra = 1.0 / claims[a].weight;
            let rb = 1.0 / claims[b].weight;
            ra.total_cmp(&rb)
        });
        remaining = capacity;
        weight = claims.iter().map(ew).sum();
        out.iter_mut().for_each(|o| *o = -1.0);
        for &i in &order {
            let c = &claims[i];
            level = remaining / weight;
            if c.demand <= ew(c) * level {
                out[i] = c.demand;
                remaining -= c.demand;
                weight -= ew(c);
            } else {
                break;
            }
        }
        if weight > 0.0 {
            level = remaining / weight;
        }
    }
    for (o, c) in out.iter_mut().zip(claims) {
        if *o < 0.0 {
            *o = (ew(c) * level).max(0.0);
        }
    }
    Fill {
        overloaded: true,
        level,
        ..Fill::default()
    }
}

/// 2^63 and 2^53 as `f64`.
const TWO_63: f64 = 9_223_372_036_854_775_808.0;
const TWO_53: u64 = 1 << 53;

/// `(s as u64, whether s's fraction is at least one half)`, as
/// `(s as u64, s.is_finite() && s - (s as u64) as f64 >= 0.5)` gives them, by signed
/// conversions (`cvttsd2si`, `cvtsi2sd`) for `s` in [0, 2^63): `as u64` and `u64 as
/// f64` compile to branchy or multi-instruction sequences on the default x86-64 target,
/// which has no unsigned conversions, and this runs for every entry of a key at each
/// recomputation.
#[inline(always)]
fn floor_half(s: f64) -> (u64, bool) {
    if (0.0..TWO_63).contains(&s) {
        let i = s as i64;
        (i as u64, s - i as f64 >= 0.5)
    } else {
        let u = s as u64;
        (u, s.is_finite() && s - u as f64 >= 0.5)
    }
}

/// Rounds shares down to whole units summing to at most `capacity`, then hands the
/// leftover units (at most one each) to claims with demand that rounded to nothing,
/// then to the largest fractions.
pub fn to_units(capacity: u64, shares: &[f64], out: &mut Vec<u64>) {
    out.clear();
    let mut sum: u64 = 0;
    // Shares with demand that rounded to nothing, and shares with a fraction of at
    // least one half: the two later passes run only if there are any.
    let (mut zeros, mut halves) = (0usize, 0usize);
    for &s in shares {
        // `as` truncates, which is the floor of a positive share (and no call to libm's
        // `floor`, which the default x86-64 target does not inline).
        let (floor, half) = floor_half(s);
        let u = if s.is_finite() && s > 0.0 {
            floor.min(capacity)
        } else {
            0
        };
        zeros += (u == 0 && s > 0.0) as usize;
        // A share above `capacity` (float error) with a fraction under one half is not
        // counted; the last pass would not round it up either.
        halves += half as usize;
        sum = sum.saturating_add(u);
        out.push(u);
    }
    // Float error could overshoot by a unit or two: trim from the largest.
    while sum > capacity {
        let (i, _) = out
            .iter()
            .enumerate()
            .max_by_key(|(_, u)| **u)
            .expect("sum > 0 means some share");
        let cut = (sum - capacity).min(out[i]);
        out[i] -= cut;
        sum -= cut;
        // The counts above are now only hints: look at every share.
        (zeros, halves) = (usize::MAX, usize::MAX);
    }
    let mut left = capacity - sum;
    if left == 0 {
        return;
    }
    if zeros > 0 {
        for (o, &s) in out.iter_mut().zip(shares) {
            if left == 0 {
                return;
            }
            if *o == 0 && s > 0.0 {
                *o = 1;
                left -= 1;
            }
        }
    }
    if halves == 0 {
        return;
    }
    // Branch-free but for the end: whether a fraction is at least one half is a coin
    // toss the branch predictor loses.
    for (o, &s) in out.iter_mut().zip(shares) {
        if left == 0 {
            return;
        }
        // `*o < s`: `*o` is at most the floor (trimmed, or as rounded), or 1 for a
        // share under 1; with a fraction of at least one half that is `*o <= floor`,
        // exactly, where both are exact in an `f64`.
        let (floor, half) = floor_half(s);
        let below = if floor < TWO_53 {
            *o <= floor
        } else {
            (*o as f64) < s
        };
        let up = half & below;
        *o += up as u64;
        left -= up as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn claim(demand: f64) -> Claim {
        Claim {
            demand,
            weight: 1.0,
            rejecting: false,
        }
    }

    /// `to_units` as it was written before `floor_half`, with `as` conversions: the
    /// reference the property test holds it to.
    fn to_units_by_as(capacity: u64, shares: &[f64]) -> Vec<u64> {
        let mut out = Vec::new();
        let mut sum: u64 = 0;
        let (mut zeros, mut halves) = (0usize, 0usize);
        for &s in shares {
            let u = if s.is_finite() && s > 0.0 {
                (s as u64).min(capacity)
            } else {
                0
            };
            zeros += (u == 0 && s > 0.0) as usize;
            halves += (s.is_finite() && s - u as f64 >= 0.5) as usize;
            sum = sum.saturating_add(u);
            out.push(u);
        }
        while sum > capacity {
            let (i, _) = out.iter().enumerate().max_by_key(|(_, u)| **u).unwrap();
            let cut = (sum - capacity).min(out[i]);
            out[i] -= cut;
            sum -= cut;
            (zeros, halves) = (usize::MAX, usize::MAX);
        }
        let mut left = capacity - sum;
        if left == 0 {
            return out;
        }
        if zeros > 0 {
            for (o, &s) in out.iter_mut().zip(shares) {
                if left == 0 {
                    return out;
                }
                if *o == 0 && s > 0.0 {
                    *o = 1;
                    left -= 1;
                }
            }
        }
        if halves == 0 {
            return out;
        }
        for (o, &s) in out.iter_mut().zip(shares) {
            if left == 0 {
                return out;
            }
            let up = s.is_finite() & (s - (s as u64 as f64) >= 0.5) & ((*o as f64) < s);
            *o += up as u64;
            left -= up as u64;
        }
        out
    }

    /// What `floor_half` stands for.
    fn floor_half_by_as(s: f64) -> (u64, bool) {
        (s as u64, s.is_finite() && s - (s as u64) as f64 >= 0.5)
    }

    #[test]
    fn floor_half_gives_what_as_gives() {
        let edge = [
            0.0,
            -0.0,
            0.5,
            0.499_999_999_999_999_94,
            1.0 - f64::EPSILON,
            2.5,
            -1.5,
            4_503_599_627_370_497.0,
            9_223_372_036_854_774_784.0,
            9_223_372_036_854_775_808.0,
            18_446_744_073_709_551_615.0,
            1e300,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
        ];
        for s in edge {
            assert_eq!(floor_half(s), floor_half_by_as(s), "{s}");
        }
    }

    #[test]
    fn overloaded_capacity_is_split_in_proportion_to_demand() {
        let mut out = Vec::new();
        water_fill(
            100.0,
            &[claim(10.0), claim(60.0), claim(130.0)],
            0.0,
            &mut out,
        );
        // Every claim gets half its demand: a small one is not served whole (its bucket
        // would sit full and waste refill while the large ones reject).
        assert_eq!(out, vec![5.0, 30.0, 65.0]);
    }

    #[test]
    fn spare_goes_to_rejecting_agents_and_a_reserve_stays_free() {
        let mut out = Vec::new();
        let mut rej = claim(10.0);
        rej.rejecting = true;
        water_fill(100.0, &[claim(10.0), rej], 0.5, &mut out);
        // 80 spare, 40 stays free; 20 as headroom by demand (10 each), 20 to the
        // rejecting agent.
        assert_eq!(out, vec![20.0, 40.0]);
    }

    #[test]
    fn weights_scale_shares() {
        let mut out = Vec::new();
        let heavy = Claim {
            demand: 1000.0,
            weight: 3.0,
            rejecting: false,
        };
        water_fill(100.0, &[claim(1000.0), heavy], 0.0, &mut out);
        assert_eq!(out, vec![25.0, 75.0]);
    }

    #[test]
    fn rounding_gives_a_unit_to_small_demands_before_large_fractions() {
        let mut out = Vec::new();
        to_units(10, &[0.3, 4.6, 4.6], &mut out);
        assert_eq!(out.iter().sum::<u64>(), 10);
        assert_eq!(out[0], 1);
    }

    fn claims() -> impl Strategy<Value = Vec<Claim>> {
        prop::collection::vec(
            (0.0f64..1e6, 0.1f64..10.0, any::<bool>()).prop_map(|(d, w, r)| Claim {
                demand: d,
                weight: w,
                rejecting: r,
            }),
            1..40,
        )
    }

    proptest! {
        #[test]
        fn floor_half_gives_what_as_gives_for_any_value(s in any::<f64>(), x in 0.0f64..1e7) {
            prop_assert_eq!(floor_half(s), floor_half_by_as(s));
            prop_assert_eq!(floor_half(x), floor_half_by_as(x));
        }

        #[test]
        fn to_units_rounds_as_it_did_with_as_conversions(
            shares in proptest::collection::vec(prop_oneof![0.0f64..5.0, 0.0f64..1e6, Just(0.5), Just(0.0)], 0..40),
            cap in 0u64..2_000_000,
        ) {
            let mut out = Vec::new();
            to_units(cap, &shares, &mut out);
            prop_assert_eq!(out, to_units_by_as(cap, &shares));
        }

        #[test]
        fn shares_never_exceed_capacity_and_are_max_min_fair(
            cs in claims(), cap in 1u64..2_000_000, reserve in 0.0f64..=1.0,
        ) {
            let mut shares = Vec::new();
            let fill = water_fill(cap as f64, &cs, reserve, &mut shares);
            for (s, c) in shares.iter().zip(&cs) {
                prop_assert!((fill.share(c) - s).abs() <= 1e-6 * s.max(1.0), "fill shape");
            }
            let total: f64 = shares.iter().sum();
            prop_assert!(total <= cap as f64 * (1.0 + 1e-9) + 1e-6);
            let demand: f64 = cs.iter().map(|c| c.demand).sum();
            if demand > cap as f64 {
                // Nobody above its demand; the unsatisfied get one water level per unit
                // of weight times demand.
                let mut level = None::<f64>;
                for (s, c) in shares.iter().zip(&cs) {
                    prop_assert!(*s <= c.demand * (1.0 + 1e-9) + 1e-6);
                    if *s < c.demand * (1.0 - 1e-9) - 1e-6 {
                        let l = s / (c.weight * c.demand);
                        if let Some(prev) = level {
                            prop_assert!((prev - l).abs() <= 1e-6 * prev.max(1.0));
                        }
                        level = Some(l);
                    }
                }
                // Satisfied claims sit at or below the level.
                if let Some(l) = level {
                    for (s, c) in shares.iter().zip(&cs) {
                        if c.demand > 0.0 {
                            prop_assert!(s / (c.weight * c.demand) <= l * (1.0 + 1e-9) + 1e-6);
                        }
                    }
                }
                prop_assert!((total - cap as f64).abs() <= 1e-6 * cap as f64 + 1e-6);
            } else {
                for (s, c) in shares.iter().zip(&cs) {
                    prop_assert!(*s >= c.demand);
                }
            }
            let mut units = Vec::new();
            to_units(cap, &shares, &mut units);
            prop_assert!(units.iter().sum::<u64>() <= cap);
            for (u, s) in units.iter().zip(&shares) {
                prop_assert!((*u as f64) <= s.floor() + 1.0);
            }
        }
    }
}
