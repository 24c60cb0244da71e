//! Baseline allocation policies to compare the real allocator with (`--policy`).
//!
//! These are deliberately simple models of other designs, written here, not
//! re-implementations of those systems; the real allocator is `bursar`.

use std::collections::BTreeMap;
use std::sync::Arc;

use bursar_allocator::{Grant, KeyName};

/// Which allocator the fleet talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The real `bursar_allocator::Allocator`.
    Bursar,
    /// Every agent holds `(R/N, B/N)` of every key from the start, forever; no
    /// allocator traffic.
    Static,
    /// Doorman-like: every report interval each agent gets a share of `(R, B)`
    /// proportional to its reported demand, sent to every agent at once, **without**
    /// revoke-before-grant (growth does not wait for shrinks to be applied).
    Doorman,
    /// Gubernator-GLOBAL-like: every agent holds the full `(R, B)` of every key, and
    /// every report interval sends the hits it admitted since its last sync to every
    /// other agent, which debits its own bucket by them (`Engine::charge`, past zero
    /// if need be). No allocator.
    Gubernator,
}

/// Names accepted by `--policy`.
pub const POLICIES: &[(&str, Policy)] = &[
    ("bursar", Policy::Bursar),
    ("static", Policy::Static),
    ("doorman", Policy::Doorman),
    ("gubernator", Policy::Gubernator),
];

impl Policy {
    /// By name.
    pub fn parse(name: &str) -> Option<Policy> {
        POLICIES.iter().find(|p| p.0 == name).map(|p| p.1)
    }

    /// True for the policies whose agents hold fixed slices from the start and never
    /// talk to an allocator (`static`, `gubernator`).
    pub fn fixed_slices(self) -> bool {
        matches!(self, Policy::Static | Policy::Gubernator)
    }

    /// The name.
    pub fn name(self) -> &'static str {
        POLICIES
            .iter()
            .find(|p| p.1 == self)
            .map(|p| p.0)
            .unwrap_or("bursar")
    }
}

struct Entry {
    incarnation: u64,
    since_ns: u64,
    total: u64,
    last_ts: u64,
    rate_per_s: f64,
    lease_base: u64,
    sent: Option<(u64, u64)>,
}

/// The Doorman-like allocator: proportional shares from smoothed demand.
pub(crate) struct Proportional {
    rate: u64,
    burst: u64,
    lease_ns: u64,
    entries: BTreeMap<(u32, u32), Entry>,
    /// The allocator's term, stamped as every grant's epoch: a restarted allocator's
    /// grants (its `seq` from 0 again) must outrank the old term's, which the agents
    /// still hold, or they are refused as stale until the count passes the old one.
    epoch: u64,
    seq: u64,
}

impl Proportional {
    /// `epoch` is the allocator's term (1 for the first).
    pub(crate) fn new(rate: u64, burst: u64, lease_ns: u64, epoch: u64) -> Proportional {
        Proportional {
            rate,
            burst,
            lease_ns,
            entries: BTreeMap::new(),
            epoch,
            seq: 0,
        }
    }

    /// A new incarnation forgets the old one's entries.
    pub(crate) fn hello(&mut self, agent: u32, incarnation: u64) {
        self.entries
            .retain(|&(a, _), e| a != agent || e.incarnation >= incarnation);
    }

    /// One key of a report: cumulative counters since `since_ns` at agent time `ts`.
    pub(crate) fn report(
        &mut self,
        agent: u32,
        key: u32,
        incarnation: u64,
        ts: u64,
        since_ns: u64,
        total: u64,
    ) {
        let e = self.entries.entry((key, agent)).or_insert(Entry {
            incarnation,
            since_ns,
            total: 0,
            last_ts: since_ns,
            rate_per_s: 0.0,
            lease_base: ts,
            sent: None,
        });
        if e.incarnation != incarnation || e.since_ns != since_ns {
            e.incarnation = incarnation;
            e.since_ns = since_ns;
            e.total = 0;
            e.last_ts = since_ns;
        }
        let dt = ts.saturating_sub(e.last_ts).max(1_000_000) as f64 / 1e9;
        let sample = total.saturating_sub(e.total) as f64 / dt;
        e.rate_per_s = 0.5 * e.rate_per_s + 0.5 * sample;
        e.total = total;
        e.last_ts = ts;
        e.lease_base = ts;
    }

    /// Every interval: new shares for every key, sent at once.
    pub(crate) fn tick(&mut self, names: &[Arc<str>], keys: &[Arc<KeyName>], out: &mut Vec<Grant>) {
        let mut by_key: BTreeMap<u32, (f64, u32)> = BTreeMap::new();
        for (&(k, _), e) in &self.entries {
            let s = by_key.entry(k).or_default();
            s.0 += e.rate_per_s;
            s.1 += 1;
        }
        for (&(k, a), e) in self.entries.iter_mut() {
            let (total, n) = by_key[&k];
            let frac = if total > 0.0 {
                e.rate_per_s / total
            } else {
                1.0 / n as f64
            };
            let rate = (self.rate as f64 * frac) as u64;
            let burst = ((self.burst as f64 * frac) as u64).max(1);
            self.seq += 1;
            e.sent = Some((rate, burst));
            out.push(Grant {
                agent: names[a as usize].clone(),
                incarnation: e.incarnation,
                key: keys[k as usize].clone(),
                rate,
                burst,
                epoch: self.epoch,
                seq: self.seq,
                lease_expires_at_ns: e.lease_base + self.lease_ns,
                fleet_size: n,
                transfer_tokens: 0,
                key_handle: 0,
                named: true,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_reported_demand_and_add_up_to_the_limit() {
        let mut p = Proportional::new(1_000, 100, 2_000_000_000, 1);
        let sec = 1_000_000_000;
        p.hello(0, 1);
        p.hello(1, 1);
        p.report(0, 0, 1, sec, 0, 3_000);
        p.report(1, 0, 1, sec, 0, 1_000);
        let names: Vec<Arc<str>> = vec!["gw-0".into(), "gw-1".into()];
        let keys = vec![Arc::new(KeyName::new("tenant", &["t0"]))];
        let mut out = Vec::new();
        p.tick(&names, &keys, &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].rate, 750);
        assert_eq!(out[1].rate, 250);
        assert!(out.iter().map(|g| g.rate).sum::<u64>() <= 1_000);
        assert_eq!(Policy::parse("doorman"), Some(Policy::Doorman));
        assert_eq!(Policy::Static.name(), "static");
        assert_eq!(Policy::parse("gubernator"), Some(Policy::Gubernator));
        assert!(Policy::Gubernator.fixed_slices() && !Policy::Doorman.fixed_slices());
    }
}
