//! Reloading the rules into a running core ([`Allocator::reload`]).
//!
//! The new rules arrive parsed and validated (`bursar_agent::Config`: a file that does
//! not parse or validate never reaches the core, and the old rules stay in force).
//! Rules are matched by name:
//!
//! - **unchanged**: nothing happens;
//! - **changed** (same dimension, match, period and kind; a new rate, burst or
//!   posture): every key of the rule takes the new limit and is recomputed at once.
//!   When a limit shrinks, grants already sent may exceed it; they keep counting
//!   (revoke before grant): the excess is recorded as the key's `inherited` excess,
//!   nothing grows until acknowledged shrinks or expired leases bring the commitments
//!   under the new limit, and the excess counts in the key's overshoot bound meanwhile.
//!   The shrinks are sent in the same call;
//! - **removed**: every key of the rule is released (its grants stop counting: the
//!   limit no longer exists), and each agent holding a grant on one is told to revoke
//!   it ([`crate::Revocation`]): its key falls to the rule's posture at once;
//! - **replaced** (same name, but another dimension, match, period or kind: its keys
//!   mean something else): released like a removed rule, then the new rule starts
//!   with no keys;
//! - **added**: known from now on.
//!
//! Agents reload their own copy of the rules on their own schedule. Until they do,
//! their report, hello and ack lines naming a removed rule (or a replaced rule in its
//! old form, e.g. with another number of `*` values) are ignored and counted
//! ([`Allocator::ignored_lines`]) instead of refusing the whole message, so their other
//! keys keep being allocated and renewed. A held grant up to the largest limit the rule
//! has had in this process is accepted (an agent may hold one sent before a shrink).
//! For the same reason the overshoot bound, once a lease ends, assumes the most
//! permissive posture and the largest `(R, B)` the rule has had in this process: an
//! agent on the old file falls back by the old rule, and the bound must not understate
//! it (it may overstate it once every agent runs the new file, until a restart).

use std::sync::Arc;

use bursar_agent::{Config, Posture};

use super::{Allocator, Slice, build_rules};

/// Most names of removed or replaced rules remembered for ignoring old lines (the
/// latest are kept).
pub(crate) const MAX_RELOADED_RULES: usize = 1_024;

/// The posture that lets a partitioned agent keep more (`open` > `conservative` >
/// `strict`).
fn more_permissive(a: Posture, b: Posture) -> Posture {
    let rank = |p| match p {
        Posture::Strict => 0,
        Posture::Conservative => 1,
        Posture::Open => 2,
    };
    if rank(a) >= rank(b) { a } else { b }
}

/// What one [`Allocator::reload`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReloadSummary {
    /// Rules new in this file.
    pub added: Vec<String>,
    /// Rules no longer in the file (their keys were released).
    pub removed: Vec<String>,
    /// Rules with a new rate, burst or posture (their keys were recomputed).
    pub changed: Vec<String>,
    /// Rules whose dimension, match, period or kind changed (their keys were released).
    pub replaced: Vec<String>,
    /// Keys recomputed under a changed limit.
    pub keys_recomputed: usize,
    /// Keys left marked for recomputation because the outbox was full (done once the
    /// shell drains it).
    pub keys_deferred: usize,
    /// Keys released (removed or replaced rules).
    pub keys_released: usize,
}

impl ReloadSummary {
    /// True when the reload changed no rule.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
            && self.replaced.is_empty()
    }
}

impl std::fmt::Display for ReloadSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_empty() {
            return f.write_str("no rule changed");
        }
        let mut first = true;
        for (what, names) in [
            ("added", &self.added),
            ("changed", &self.changed),
            ("replaced", &self.replaced),
            ("removed", &self.removed),
        ] {
            if names.is_empty() {
                continue;
            }
            if !first {
                f.write_str("; ")?;
            }
            first = false;
            write!(f, "{what}: {}", names.join(", "))?;
        }
        write!(
            f,
            " ({} keys recomputed, {} deferred, {} released)",
            self.keys_recomputed, self.keys_deferred, self.keys_released
        )
    }
}

/// One rule as the core applies it (the admin endpoint lists them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleStatus {
    /// The rule's name.
    pub name: String,
    /// `(R, B)` (concurrency: `(0, slots)`).
    pub limit: Slice,
    /// `R + O` (concurrency: 0).
    pub rate_capacity: u64,
    /// The rate's period in ns (0 for concurrency).
    pub period_ns: u64,
    /// A concurrency rule (slots, no rate).
    pub concurrency: bool,
    /// Its partition posture.
    pub posture: Posture,
}

impl Allocator {
    /// The rules in force, in file order.
    pub fn rules(&self) -> impl Iterator<Item = RuleStatus> + '_ {
        self.rules
            .iter()
            .zip(&self.rule_meta)
            .map(|(info, meta)| RuleStatus {
                name: meta.name.clone(),
                limit: Slice {
                    rate: info.rate,
                    burst: info.burst,
                },
                rate_capacity: info.rate_cap,
                period_ns: info.period_ns,
                concurrency: info.concurrency,
                posture: info.posture,
            })
    }

    /// Report, hello and ack lines ignored because they name a rule a reload removed
    /// or replaced (agents still on the old rules).
    pub fn ignored_lines(&self) -> u64 {
        self.ignored_lines
    }

    /// Applies new rules (see the module docs): changed limits are recomputed at once
    /// under budget conservation (revoke before grant), removed and replaced rules'
    /// keys are released. The shell drains the grants it issues as after any call.
    pub fn reload(&mut self, now: u64, rules: &Config) -> ReloadSummary {
        let (mut infos, meta, index) =
            build_rules(rules, self.cfg.overdraft_permille, self.cfg.clock_drift_ppm);
        let mut summary = ReloadSummary::default();
        // What changes now may bring back a key revoked before: revoke afresh.
        for ag in self.agents.iter_mut().flatten() {
            ag.revoked.clear();
        }
        // Per old rule: its new index and whether its numbers changed, or None (its
        // keys are released).
        let mut fate: Vec<Option<(u32, bool)>> = Vec::with_capacity(self.rules.len());
        for (old, old_meta) in self.rules.iter().zip(&self.rule_meta) {
            let Some(&j) = index.get(&old_meta.name) else {
                summary.removed.push(old_meta.name.clone());
                fate.push(None);
                continue;
            };
            let new = &mut infos[j as usize];
            // A held grant may come from before the reload, under the old limit; an
            // agent still on the old file falls back by its posture and limit.
            new.held_cap = new.held_cap.max(old.held_cap);
            new.fallback_limit = new.fallback_limit.max(old.fallback_limit);
            new.fallback_posture = more_permissive(new.fallback_posture, old.fallback_posture);
            new.pool_quiet_until_ns = new.pool_quiet_until_ns.max(old.pool_quiet_until_ns);
            if meta[j as usize] != *old_meta {
                summary.replaced.push(old_meta.name.clone());
                fate.push(None);
                continue;
            }
            let changed = (old.rate, old.rate_cap, old.burst, old.posture)
                != (new.rate, new.rate_cap, new.burst, new.posture);
            if changed {
                summary.changed.push(old_meta.name.clone());
            }
            fate.push(Some((j, changed)));
        }
        for m in &meta {
            if !self.rule_index.contains_key(&m.name) {
                summary.added.push(m.name.clone());
            }
        }
        for name in summary.removed.iter().chain(&summary.replaced) {
            self.reloaded_rules.retain(|r| r != name);
            self.reloaded_rules.push(name.clone());
        }
        let over = self.reloaded_rules.len().saturating_sub(MAX_RELOADED_RULES);
        self.reloaded_rules.drain(..over);

        // Release the keys of removed and replaced rules, renumber the others.
        let mut changed_keys = Vec::new();
        for k in 0..self.keys.len() as u32 {
            let Some(key) = self.keys[k as usize].as_mut() else {
                continue;
            };
            match fate[key.rule as usize] {
                None => {
                    self.release_key(now, k);
                    summary.keys_released += 1;
                }
                Some((j, changed)) => {
                    key.rule = j;
                    if changed {
                        changed_keys.push(k);
                    }
                }
            }
        }
        self.rules = infos;
        self.rule_meta = meta;
        self.rule_index = index;
        // Which rules each agent's file gives another meaning, against the new rules.
        for i in 0..self.agents.len() {
            let Some(shapes) = self.agents[i].as_ref().map(|ag| Arc::clone(&ag.shapes)) else {
                continue;
            };
            let stale = self.stale_rules_of(&shapes);
            if let Some(ag) = self.agents[i].as_mut() {
                ag.stale_rules = stale;
            }
        }

        // New limits: grants already sent keep counting; what exceeds a shrunk limit
        // is inherited excess (nothing grows meanwhile, and it counts in the bound).
        for &k in &changed_keys {
            let limit = self.rules[self.key(k).rule as usize].limit();
            let key = self.key_mut(k);
            let old = key.limit;
            key.limit = limit;
            let excess = key.excess();
            key.inherited = Slice {
                rate: if limit.rate < old.rate {
                    excess.rate
                } else {
                    key.inherited.rate.min(excess.rate)
                },
                burst: if limit.burst < old.burst {
                    excess.burst
                } else {
                    key.inherited.burst.min(excess.burst)
                },
            };
            key.pool = key
                .pool
                .min(limit.burst.saturating_sub(key.committed.burst));
        }
        // Then recomputed (on two threads if they hold many entries).
        let recomputed = self.recompute_now_all(now, &changed_keys);
        summary.keys_recomputed += recomputed;
        summary.keys_deferred += changed_keys.len() - recomputed;
        summary
    }

    /// Drops every entry of key `k` and the key itself: its grants stop counting.
    /// Each agent holding a grant on it is told to stop using it
    /// ([`Revocation`](crate::Revocation)).
    fn release_key(&mut self, _now: u64, k: u32) {
        let n = self.key(k).entries.len();
        for pos in (0..n).rev() {
            let key = self.key(k);
            let e = &key.entries[pos];
            if e.commitment() != Slice::ZERO {
                let (agent, name, fp) = (e.agent, Arc::clone(&key.name), key.fp.hash);
                self.revoke(agent, name, fp);
            }
            self.remove_entry(k, pos as u32);
        }
        self.remove_key(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{Grant, HeldGrant};
    use crate::testing::*;

    fn rules_with(rps_rate: u64, rps_burst: u64, extra: &str) -> Config {
        Config::from_toml(&format!(
            r#"
[[rule]]
name = "rps"
match = {{ org = "*" }}
dimension = "requests"
rate = {rps_rate}
per = "second"
burst = {rps_burst}
posture = "conservative"
{extra}
"#
        ))
        .unwrap()
    }

    const OPEN: &str = r#"
[[rule]]
name = "open-rps"
match = { org = "*" }
dimension = "requests"
rate = 1000
per = "second"
burst = 500
posture = "open"
"#;

    /// Two agents each granted about half of `rps` (1,000/s) for org x, grants applied.
    fn two_halves() -> (Allocator, u64, Vec<Grant>) {
        let mut now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.reload(now, &rules_with(1000, 1000, OPEN));
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        a.handle_hello(now, &hello("b", 1, 1)).unwrap();
        let mut held: Vec<Option<HeldGrant>> = vec![None, None];
        let mut last = Vec::new();
        for round in 1..=8u64 {
            for (i, agent) in ["a", "b"].iter().enumerate() {
                a.handle_report(
                    now,
                    &report(
                        agent,
                        1,
                        round * 250 * MS,
                        vec![line(key("rps", "x"), round * 300, round * 100, held[i])],
                    ),
                )
                .unwrap();
            }
            now += 250 * MS;
            a.handle_timeout(now);
            a.check_invariants().unwrap();
            let gs: Vec<Grant> = a.drain_grants().collect();
            for g in &gs {
                let i = if &*g.agent == "a" { 0 } else { 1 };
                held[i] = Some(g.held());
                a.handle_ack(now, &ack(g, 1, 0)).unwrap();
                a.check_invariants().unwrap();
            }
            if !gs.is_empty() {
                last = gs;
            }
        }
        (a, now, last)
    }

    #[test]
    fn a_shrunk_limit_revokes_before_it_grants_and_bounds_the_excess_meanwhile() {
        let (mut a, now, _) = two_halves();
        let k = key("rps", "x");
        let before = a.key_status(&k).unwrap();
        assert!(before.committed.rate > 900, "{before:?}");

        let s = a.reload(now, &rules_with(400, 400, OPEN));
        assert_eq!(s.changed, vec!["rps".to_string()]);
        assert!(s.removed.is_empty() && s.added.is_empty() && s.replaced.is_empty());
        assert_eq!((s.keys_recomputed, s.keys_released), (1, 0));
        a.check_invariants().unwrap();
        let st = a.key_status(&k).unwrap();
        assert_eq!(
            st.limit,
            Slice {
                rate: 400,
                burst: 400
            }
        );
        // The old grants still count until acknowledged: the excess is in the bound.
        assert_eq!(st.committed, before.committed);
        assert_eq!(st.bound.rate, before.committed.rate - 400);
        assert_eq!(st.bound.burst, before.committed.burst - 400);
        // Only shrinks were sent, summing to at most the new limit.
        let gs: Vec<Grant> = a.drain_grants().collect();
        assert_eq!(gs.len(), 2, "{gs:?}");
        let (r, b) = gs
            .iter()
            .fold((0, 0), |(r, b), g| (r + g.rate, b + g.burst));
        assert!(r <= 400 && b <= 400, "({r}, {b})");
        for g in &gs {
            let was = before.agents.iter().find(|x| x.agent == g.agent).unwrap();
            assert!(g.rate < was.granted.rate, "{g:?} grows from {was:?}");
        }
        // Acknowledged: the commitments fall under the new limit, the excess is gone.
        for g in &gs {
            a.handle_ack(now, &ack(g, 1, 0)).unwrap();
            a.check_invariants().unwrap();
        }
        let st = a.key_status(&k).unwrap();
        assert!(
            st.committed.rate <= 400 && st.committed.burst <= 400,
            "{st:?}"
        );
        assert_eq!((st.bound.rate, st.bound.burst), (0, 0));
        // The agents still hold grants from before the shrink: not absurd.
        a.handle_report(
            now + MS,
            &report(
                "a",
                1,
                9 * 250 * MS,
                vec![line(
                    k.clone(),
                    2700,
                    900,
                    Some(HeldGrant {
                        epoch: 1,
                        seq: 1,
                        rate: 900,
                        burst: 900,
                    }),
                )],
            ),
        )
        .unwrap();
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_grown_limit_is_granted_at_once() {
        let (mut a, now, _) = two_halves();
        let s = a.reload(now, &rules_with(3000, 3000, OPEN));
        assert_eq!(s.changed, vec!["rps".to_string()]);
        a.check_invariants().unwrap();
        let gs: Vec<Grant> = a.drain_grants().collect();
        let (r, b) = gs
            .iter()
            .fold((0, 0), |(r, b), g| (r + g.rate, b + g.burst));
        assert!(r > 1000 && r <= 3000 && b <= 3000, "({r}, {b}) {gs:?}");
        let st = a.key_status(&key("rps", "x")).unwrap();
        assert_eq!(
            st.limit,
            Slice {
                rate: 3000,
                burst: 3000
            }
        );
        assert_eq!((st.bound.rate, st.bound.burst), (0, 0));
    }

    #[test]
    fn a_removed_rule_releases_its_keys_and_old_lines_are_ignored_not_refused() {
        let (mut a, now, _) = two_halves();
        a.handle_report(
            now,
            &report(
                "a",
                1,
                10 * SEC,
                vec![line(key("open-rps", "y"), 10, 10, None)],
            ),
        )
        .unwrap();
        assert_eq!(a.key_count(), 2);
        // open-rps removed; rps unchanged.
        let s = a.reload(now, &rules_with(1000, 1000, ""));
        assert_eq!(s.removed, vec!["open-rps".to_string()]);
        assert!(s.changed.is_empty());
        assert_eq!(s.keys_released, 1);
        a.check_invariants().unwrap();
        assert_eq!(a.key_count(), 1);
        assert!(a.key_status(&key("open-rps", "y")).is_none());
        assert!(a.rules().all(|r| r.name != "open-rps"));
        // An agent still on the old rules: its line for open-rps is ignored, its rps
        // line still counts.
        let before = a.key_status(&key("rps", "x")).unwrap();
        a.handle_report(
            now,
            &report(
                "a",
                1,
                11 * SEC,
                vec![
                    line(key("open-rps", "y"), 20, 20, None),
                    line(key("rps", "x"), 9_000, 3_000, None),
                ],
            ),
        )
        .unwrap();
        assert_eq!(a.ignored_lines(), 1);
        assert!(a.key_status(&key("open-rps", "y")).is_none());
        assert_ne!(
            a.key_status(&key("rps", "x")).unwrap().demand,
            before.demand
        );
        // A rule never known is still refused whole.
        let e = a
            .handle_report(
                now,
                &report("a", 1, 12 * SEC, vec![line(key("nope", "x"), 1, 1, None)]),
            )
            .unwrap_err();
        assert!(matches!(e, crate::AllocError::UnknownRule(_)), "{e}");
        a.check_invariants().unwrap();
    }

    /// `rps` re-matched on two `*` entries: the rule replaced, its keys released.
    fn keyed_rps() -> Config {
        Config::from_toml(
            r#"
[[rule]]
name = "rps"
match = { org = "*", key = "*" }
dimension = "requests"
rate = 1000
per = "second"
"#,
        )
        .unwrap()
    }

    /// Review (twenty-sixth session's open item): the grants of a released key stayed
    /// in force on the agents holding them, uncounted, for as long as they reported
    /// (lease extensions cover every grant of the term up to a seq). Each holder is now
    /// told to revoke them, once per stream; one that names such a key with a grant
    /// again (a report line, a hello on a new stream) is told again.
    #[test]
    fn a_released_key_is_revoked_at_each_holder_and_again_when_a_holder_names_it() {
        let (mut a, now, _) = two_halves();
        assert!(a.drain_revocations().is_empty());
        let k = key("rps", "x");
        let keyed = keyed_rps();
        a.reload(now, &keyed);
        let last_seq = {
            let mut revs = a.drain_revocations();
            revs.sort_by(|x, y| x.agent.cmp(&y.agent));
            assert_eq!(revs.len(), 2, "one per holder: {revs:?}");
            for (r, agent) in revs.iter().zip(["a", "b"]) {
                assert_eq!((&*r.agent, r.incarnation, r.epoch), (agent, 1, a.term()));
                assert_eq!(r.keys, vec![Arc::new(k.clone())]);
            }
            revs[0].through_seq
        };
        assert!(last_seq > 0);
        assert_eq!(a.pending_revocations(), 0);
        let grant = HeldGrant {
            epoch: a.term(),
            seq: last_seq,
            rate: 400,
            burst: 400,
        };
        let held = Some(grant);
        // a's next report still names x with a grant (the posture's): already revoked
        // on this stream, nothing more; a line without a grant revokes nothing.
        a.handle_report(
            now,
            &report("a", 1, 10 * SEC, vec![line(k.clone(), 1, 1, held)]),
        )
        .unwrap();
        a.handle_report(
            now,
            &report("b", 1, 10 * SEC, vec![line(k.clone(), 1, 1, None)]),
        )
        .unwrap();
        assert_eq!(a.ignored_lines(), 2);
        assert!(a.drain_revocations().is_empty());
        // a reconnects (a new stream: the revocation may have been lost) and lists the
        // grant in its hello: revoked again; so is a later report's line after that.
        let mut h = hello("a", 1, 1);
        h.agent_time_ns = 11 * SEC;
        h.held = vec![crate::msg::HeldSlice {
            key: k.clone(),
            grant,
        }];
        a.handle_hello(now, &h).unwrap();
        let revs = a.drain_revocations();
        assert_eq!(revs.len(), 1, "{revs:?}");
        assert_eq!(&*revs[0].agent, "a");
        a.check_invariants().unwrap();
        // Another reload forgets what was revoked: b, whose line holds a grant, is told
        // again.
        a.reload(now, &keyed);
        a.handle_report(
            now,
            &report("b", 1, 12 * SEC, vec![line(k.clone(), 2, 2, held)]),
        )
        .unwrap();
        let revs = a.drain_revocations();
        assert_eq!(revs.len(), 1, "{revs:?}");
        assert_eq!(&*revs[0].agent, "b");
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_rule_whose_match_changes_is_replaced_and_its_keys_start_afresh() {
        let (mut a, now, _) = two_halves();
        let keyed = keyed_rps();
        let s = a.reload(now, &keyed);
        assert_eq!(s.replaced, vec!["rps".to_string()]);
        assert_eq!(s.removed, vec!["open-rps".to_string()]);
        assert_eq!(s.keys_released, 1);
        assert_eq!(a.key_count(), 0);
        a.check_invariants().unwrap();
        // Old-form lines (one value) are ignored; new-form lines are allocated.
        a.handle_report(
            now,
            &report(
                "a",
                1,
                10 * SEC,
                vec![
                    line(key("rps", "x"), 1, 1, None),
                    line(KeyName::new("rps", &["x", "k1"]), 1, 1, None),
                ],
            ),
        )
        .unwrap();
        assert_eq!(a.ignored_lines(), 1);
        assert_eq!(a.key_count(), 1);
        a.check_invariants().unwrap();
    }

    fn shapes(c: &Config) -> Vec<(String, u64)> {
        c.rules
            .rules()
            .iter()
            .map(|r| (r.name.clone(), r.shape()))
            .collect()
    }

    /// Review (twenty-fifth session's open item): a rule replaced in place with keys of
    /// the same shape (here per second -> per minute) was read from an agent still on
    /// the old file as the new rule, and its grants, meant per minute, were applied
    /// per second there. Agents now send their rules' shapes; lines of a rule whose
    /// shape differs are ignored, and the agent is granted nothing on it until it says
    /// hello with the new file.
    #[test]
    fn an_agent_whose_file_gives_a_rule_another_meaning_gets_no_grant_on_it() {
        let old = rules_with(1000, 500, OPEN);
        let per_minute = Config::from_toml(&format!(
            "{}\n{OPEN}",
            r#"
[[rule]]
name = "rps"
match = { org = "*" }
dimension = "requests"
rate = 1000
per = "minute"
burst = 500
"#
        ))
        .unwrap();
        assert_ne!(shapes(&old), shapes(&per_minute));
        let mut now = 5 * SEC;
        let mut a = warm_allocator_with(&old, quick_config(), 1, 5 * SEC);
        let mut h = hello("a", 1, 1);
        h.rule_shapes = shapes(&old);
        a.handle_hello(now, &h).unwrap();
        let s = a.reload(now, &per_minute);
        assert_eq!(s.replaced, vec!["rps".to_string()]);
        // Agent a still runs the old file: its rps lines are ignored, its open-rps
        // lines (same shape) are allocated.
        for round in 1..=4u64 {
            now += 250 * MS;
            a.handle_report(
                now,
                &report(
                    "a",
                    1,
                    round * 250 * MS,
                    vec![
                        line(key("rps", "x"), round * 300, round * 100, None),
                        line(key("open-rps", "x"), round * 30, 0, None),
                    ],
                ),
            )
            .unwrap();
            a.handle_timeout(now);
            a.check_invariants().unwrap();
        }
        assert_eq!(a.ignored_lines(), 4);
        let grants: Vec<Grant> = a.drain_grants().collect();
        assert!(
            grants.iter().all(|g| g.key.rule == "open-rps"),
            "a grant for the rule a's file reads otherwise: {grants:?}"
        );
        assert!(!grants.is_empty(), "the unchanged rule is still allocated");
        assert!(a.key_status(&key("rps", "x")).is_none());
        // A grant on it that a says it holds (from before the reload) is revoked.
        assert!(a.drain_revocations().is_empty());
        let held = HeldGrant {
            epoch: a.term(),
            seq: 1,
            rate: 10,
            burst: 10,
        };
        a.handle_report(
            now,
            &report(
                "a",
                1,
                5 * 250 * MS,
                vec![line(key("rps", "x"), 1500, 500, Some(held))],
            ),
        )
        .unwrap();
        let revs = a.drain_revocations();
        assert_eq!(revs.len(), 1, "{revs:?}");
        assert_eq!(*revs[0].keys[0], key("rps", "x"));
        // Restarted onto the new file, a's lines of rps count again.
        let mut h = hello("a", 2, 1);
        h.rule_shapes = shapes(&per_minute);
        now += 5 * SEC;
        a.handle_hello(now, &h).unwrap();
        now += 250 * MS;
        a.handle_report(
            now,
            &report(
                "a",
                2,
                250 * MS,
                vec![line(key("rps", "x"), 300, 100, None)],
            ),
        )
        .unwrap();
        a.handle_timeout(now + 250 * MS);
        assert_eq!(a.ignored_lines(), 5);
        assert!(a.key_status(&key("rps", "x")).is_some());
        assert!(a.drain_grants().any(|g| g.key.rule == "rps"));
        a.check_invariants().unwrap();
        // An agent of the new file that says hello before the allocator reloads is
        // ignored on rps until it does, then read.
        let mut b = warm_allocator_with(&old, quick_config(), 1, 5 * SEC);
        let mut h = hello("b", 1, 1);
        h.rule_shapes = shapes(&per_minute);
        b.handle_hello(5 * SEC, &h).unwrap();
        b.handle_report(
            5 * SEC,
            &report("b", 1, 250 * MS, vec![line(key("rps", "x"), 3, 1, None)]),
        )
        .unwrap();
        assert_eq!(b.ignored_lines(), 1);
        b.reload(5 * SEC, &per_minute);
        b.handle_report(
            5 * SEC,
            &report("b", 1, 500 * MS, vec![line(key("rps", "x"), 6, 2, None)]),
        )
        .unwrap();
        assert_eq!(b.ignored_lines(), 1);
        assert!(b.key_status(&key("rps", "x")).is_some());
    }

    #[test]
    fn the_bound_keeps_what_an_agent_on_the_old_rules_falls_back_to() {
        let (mut a, mut now, _) = two_halves();
        let strict = Config::from_toml(
            r#"
[[rule]]
name = "rps"
match = { org = "*" }
dimension = "requests"
rate = 400
per = "second"
burst = 400
posture = "strict"
"#,
        )
        .unwrap();
        let s = a.reload(now, &strict);
        assert_eq!(s.changed, vec!["rps".to_string()]);
        a.drain_grants().for_each(drop);
        // Agent b goes silent (partitioned) while a keeps reporting; b's lease ends.
        let mut t = 20 * SEC;
        for i in 1..=12u64 {
            now += 250 * MS;
            t += 250 * MS;
            let counters = line(key("rps", "x"), 2400 + i * 300, 800 + i * 100, None);
            a.handle_report(now, &report("a", 1, t, vec![counters]))
                .unwrap();
            a.handle_timeout(now);
            a.check_invariants().unwrap();
            for g in a.drain_grants().collect::<Vec<_>>() {
                if &*g.agent == "a" {
                    a.handle_ack(now, &ack(&g, 1, 0)).unwrap();
                }
            }
        }
        let st = a.key_status(&key("rps", "x")).unwrap();
        let b = st.agents.iter().find(|x| &*x.agent == "b").unwrap();
        // b still runs the old rules (conservative, R = 1,000, two agents): it keeps
        // min(grant, 500), though the new rule says strict.
        let fb = b.fallback.expect("b is partitioned");
        assert!(fb.rate > 0 && fb.rate <= 500, "{st:?}");
        assert_eq!(st.bound.partitioned_agents, 1);
        assert!(st.bound.rate >= fb.rate);
    }

    #[test]
    fn the_same_rules_again_change_nothing() {
        let (mut a, now, _) = two_halves();
        let before = a.key_status(&key("rps", "x")).unwrap();
        let s = a.reload(now, &rules_with(1000, 1000, OPEN));
        assert!(s.is_empty(), "{s}");
        assert_eq!(s.to_string(), "no rule changed");
        assert_eq!(a.pending_grants(), 0);
        assert_eq!(a.key_status(&key("rps", "x")).unwrap(), before);
    }

    use crate::msg::KeyName;
}
