//! Exact usage totals of a bucket, with corrections applied.
//!
//! A bucket's totals are a function of the set of events in that bucket only:
//! - a usage event counts once (merge guarantees one event per key);
//! - a usage event named by any `void` in its bucket counts nothing (one void or
//!   five, the result is the same);
//! - otherwise the `adjust` deltas naming it are summed and added to its counts, each
//!   clamped at 0 (and cached input at most input);
//! - a correction whose target is not in its bucket (not arrived yet, or sent with
//!   another tenant or hour than its target) changes nothing and is reported as
//!   unresolved, so a billing run can wait for it or flag it.
//!
//! Totals are computed in two passes over the bucket (corrections, then usage), so the
//! memory used is bounded by the corrections in one bucket and the number of groups,
//! never by the number of events.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::{Value, json};

use crate::digest::Digest;
use crate::event::{Body, Event, EventKey};

/// Exact totals of one group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Usage events counted (voided ones are not).
    pub requests: u64,
    /// Input tokens.
    pub input_tokens: u128,
    /// Cached input tokens.
    pub cached_input_tokens: u128,
    /// Output tokens.
    pub output_tokens: u128,
}

impl Totals {
    fn add(&mut self, o: &Totals) {
        self.requests += o.requests;
        self.input_tokens += o.input_tokens;
        self.cached_input_tokens += o.cached_input_tokens;
        self.output_tokens += o.output_tokens;
    }

    /// JSON for the HTTP API.
    pub fn to_json(&self) -> Value {
        json!({
            "requests": self.requests,
            "input_tokens": crate::digest::exact_json(self.input_tokens),
            "cached_input_tokens": crate::digest::exact_json(self.cached_input_tokens),
            "output_tokens": crate::digest::exact_json(self.output_tokens),
        })
    }
}

/// Totals over a set of buckets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageTotals {
    /// Per group (the model when grouping by model; else one group `""`).
    pub groups: BTreeMap<String, Totals>,
    /// Sum over groups.
    pub total: Totals,
    /// Usage events cancelled by a void.
    pub voided: u64,
    /// Usage events changed by at least one adjust (and not voided).
    pub adjusted: u64,
    /// Corrections whose target is not in their bucket.
    pub unresolved_corrections: u64,
    /// The sum of the digests of the buckets the totals came from.
    pub digest: Digest,
    /// How many non-empty buckets were read.
    pub buckets: u64,
}

/// Why totals could not be computed. Nothing changed; the cause is the query's size
/// (an operator can raise the bound).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TotalsError {
    /// One bucket holds more corrections than the bound.
    #[error("a bucket holds more than {0} corrections; raise corrections_max")]
    TooManyCorrections(usize),
    /// More groups than the bound.
    #[error("more than {0} groups; raise groups_max or do not group")]
    TooManyGroups(usize),
}

/// Bounds of a totals query. Plain data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TotalsLimits {
    /// Most corrections in one bucket. Default 1,000,000.
    pub corrections_max: usize,
    /// Most groups. Default 10,000.
    pub groups_max: usize,
}

impl Default for TotalsLimits {
    fn default() -> Self {
        TotalsLimits {
            corrections_max: 1_000_000,
            groups_max: 10_000,
        }
    }
}

/// Accumulates the totals of one bucket at a time: feed every event of the bucket to
/// [`BucketPass::correction`], then every event again to [`BucketPass::usage`], then
/// call [`BucketPass::finish`].
#[derive(Debug)]
pub struct BucketPass<'a> {
    into: &'a mut UsageTotals,
    group_by_model: bool,
    limits: TotalsLimits,
    voids: HashSet<EventKey>,
    adjusts: HashMap<EventKey, [i128; 3]>,
    corrections_per_target: HashMap<EventKey, u64>,
    resolved: HashSet<EventKey>,
    error: Option<TotalsError>,
}

impl<'a> BucketPass<'a> {
    /// Starts a bucket whose digest is `digest`.
    pub fn new(
        into: &'a mut UsageTotals,
        digest: &Digest,
        group_by_model: bool,
        limits: TotalsLimits,
    ) -> BucketPass<'a> {
        into.digest.add(digest);
        into.buckets += 1;
        BucketPass {
            into,
            group_by_model,
            limits,
            voids: HashSet::new(),
            adjusts: HashMap::new(),
            corrections_per_target: HashMap::new(),
            resolved: HashSet::new(),
            error: None,
        }
    }

    /// First pass: records corrections (ignores usage events).
    pub fn correction(&mut self, e: &Event) {
        let Some(target) = e.body.target() else {
            return;
        };
        if self.corrections_per_target.len() >= self.limits.corrections_max
            && !self.corrections_per_target.contains_key(&target)
        {
            self.error = Some(TotalsError::TooManyCorrections(self.limits.corrections_max));
            return;
        }
        *self.corrections_per_target.entry(target).or_default() += 1;
        match &e.body {
            Body::Void { .. } => {
                self.voids.insert(target);
            }
            Body::Adjust { deltas, .. } => {
                let a = self.adjusts.entry(target).or_default();
                a[0] += i128::from(deltas.input_tokens);
                a[1] += i128::from(deltas.cached_input_tokens);
                a[2] += i128::from(deltas.output_tokens);
            }
            Body::Usage { .. } => {}
        }
    }

    /// Second pass: counts usage events (ignores corrections).
    pub fn usage(&mut self, e: &Event) {
        let Body::Usage { tokens, .. } = &e.body else {
            return;
        };
        let key = e.key();
        if self.corrections_per_target.contains_key(&key) {
            self.resolved.insert(key);
        }
        if self.voids.contains(&key) {
            self.into.voided += 1;
            return;
        }
        let mut t = Totals {
            requests: 1,
            input_tokens: u128::from(tokens.input_tokens),
            cached_input_tokens: u128::from(tokens.cached_input_tokens),
            output_tokens: u128::from(tokens.output_tokens),
        };
        if let Some(d) = self.adjusts.get(&key) {
            self.into.adjusted += 1;
            let apply = |v: u128, d: i128| (v as i128 + d).max(0) as u128;
            t.input_tokens = apply(t.input_tokens, d[0]);
            t.cached_input_tokens = apply(t.cached_input_tokens, d[1]).min(t.input_tokens);
            t.output_tokens = apply(t.output_tokens, d[2]);
        }
        let group = if self.group_by_model {
            e.model.as_str()
        } else {
            ""
        };
        if !self.into.groups.contains_key(group) {
            if self.into.groups.len() >= self.limits.groups_max {
                self.error = Some(TotalsError::TooManyGroups(self.limits.groups_max));
                return;
            }
            self.into
                .groups
                .insert(group.to_string(), Totals::default());
        }
        if let Some(g) = self.into.groups.get_mut(group) {
            g.add(&t);
        }
        self.into.total.add(&t);
    }

    /// Ends the bucket.
    pub fn finish(self) -> Result<(), TotalsError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        for (target, n) in &self.corrections_per_target {
            if !self.resolved.contains(target) {
                self.into.unresolved_corrections += n;
            }
        }
        Ok(())
    }
}

impl UsageTotals {
    /// JSON for the HTTP API.
    pub fn to_json(&self) -> Value {
        json!({
            "groups": self.groups.iter().map(|(g, t)| {
                let mut v = t.to_json();
                v["model"] = g.as_str().into();
                v
            }).collect::<Vec<_>>(),
            "total": self.total.to_json(),
            "voided": self.voided,
            "adjusted": self.adjusted,
            "unresolved_corrections": self.unresolved_corrections,
            "buckets": self.buckets,
            "digest": self.digest.to_json(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{HOUR_MS, TokenDeltas};
    use crate::testing::usage;

    fn totals(events: &[Event]) -> UsageTotals {
        let mut t = UsageTotals::default();
        let mut pass = BucketPass::new(&mut t, &Digest::default(), true, TotalsLimits::default());
        events.iter().for_each(|e| pass.correction(e));
        events.iter().for_each(|e| pass.usage(e));
        pass.finish().unwrap();
        t
    }

    #[test]
    fn a_void_cancels_its_target_once_however_many_voids_name_it() {
        let u = usage("r1", "acme", "m", HOUR_MS, 10, 0, 5);
        let u2 = usage("r2", "acme", "m", HOUR_MS, 1, 0, 1);
        let mut v1 = usage("v1", "acme", "", HOUR_MS, 0, 0, 0);
        v1.body = Body::Void { target: u.key() };
        let mut v2 = v1.clone();
        v2.request_id = "v2".into();
        let t = totals(&[u, u2, v1, v2]);
        assert_eq!(t.voided, 1);
        assert_eq!(t.total.requests, 1);
        assert_eq!(t.total.input_tokens, 1);
        assert_eq!(t.unresolved_corrections, 0);
    }

    #[test]
    fn adjusts_add_up_and_clamp_at_zero_and_unknown_targets_are_unresolved() {
        let u = usage("r1", "acme", "m", HOUR_MS, 10, 4, 5);
        let adj = |id: &str, target: EventKey, d: i64| {
            let mut a = usage(id, "acme", "", HOUR_MS, 0, 0, 0);
            a.body = Body::Adjust {
                target,
                deltas: TokenDeltas {
                    input_tokens: d,
                    cached_input_tokens: 0,
                    output_tokens: -100,
                },
            };
            a
        };
        let t = totals(&[
            u.clone(),
            adj("a1", u.key(), 3),
            adj("a2", u.key(), -9),
            adj("a3", EventKey::from_request_id("nope"), 1),
        ]);
        assert_eq!(t.adjusted, 1);
        assert_eq!(t.total.input_tokens, 4);
        assert_eq!(t.total.cached_input_tokens, 4);
        assert_eq!(t.total.output_tokens, 0);
        assert_eq!(t.unresolved_corrections, 1);
    }
}
