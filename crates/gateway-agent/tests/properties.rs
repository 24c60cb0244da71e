//! Property tests: for any sequence of admits, completions (live, duplicate, late),
//! expiries, maintenance, clock advances, slice changes and rules reloads, the engine
//! never admits more *actual* cost than an exact token bucket over the slices (and
//! reloaded limits) in force would;
//! rejections leave no partial debit; nothing is refunded twice; every concurrency slot
//! is released; every finished lease yields exactly its usage records.

use std::collections::HashMap;
use std::sync::Arc;

use bursar_agent::testing::{ExactBucket, engine_with_sink};
use bursar_agent::{
    AdmitRequest, Completion, CompletionStatus, Cost, Decision, Engine, MemorySink, Outcome,
    SliceUpdate, Usage,
};
use proptest::prelude::*;

const MS: u64 = 1_000_000;
const PERIOD_NS: u64 = 1_000_000_000;
/// `RULES` with the `rps` rule's rate and burst replaced (a reload's file).
fn rules_with_rps(rate: u64, burst: u64) -> String {
    RULES.replace(
        "rate = 7\nper = \"second\"\nburst = 3",
        &format!("rate = {rate}\nper = \"second\"\nburst = {burst}"),
    )
}

const RULES: &str = r#"
[engine]
key_idle_ms = 700
lease_ttl_ms = 1000
[[rule]]
name = "itpm"
match = { org = "*" }
dimension = "input_tokens"
rate = 1000
per = "second"
burst = 500
[[rule]]
name = "rps"
match = { org = "*" }
dimension = "requests"
rate = 7
per = "second"
burst = 3
[[rule]]
name = "conc"
match = { org = "*" }
dimension = "concurrency"
max_in_flight = 3
"#;
const ORGS: [&str; 2] = ["a", "b"];

#[derive(Clone, Debug)]
enum Op {
    Admit {
        org: usize,
        input: u64,
        ttl_ms: u64,
    },
    Complete {
        pick: usize,
        used_pct: u64,
    },
    Duplicate {
        pick: usize,
    },
    Advance {
        ms: u64,
    },
    Maintain,
    Slice {
        org: usize,
        rate: u64,
        burst: u64,
    },
    /// The `rps` rule reloaded with this rate and burst.
    Reload {
        rate: u64,
        burst: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..2usize, 0..600u64, 50..2_000u64)
            .prop_map(|(org, input, ttl_ms)| Op::Admit { org, input, ttl_ms }),
        // Up to three times the reservation: usage beyond it is charged as debt, which
        // must survive slices closing and reopening.
        3 => (any::<usize>(), 0..=300u64).prop_map(|(pick, used_pct)| Op::Complete { pick, used_pct }),
        1 => any::<usize>().prop_map(|pick| Op::Duplicate { pick }),
        3 => (0..400u64).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Maintain),
        1 => (0..2usize, 0..2_000u64, 0..800u64)
            .prop_map(|(org, rate, burst)| Op::Slice { org, rate, burst }),
        // A closed slice (what a grant of nothing installs), then usually a reopening.
        1 => (0..2usize, any::<bool>())
            .prop_map(|(org, by_rate)| Op::Slice { org, rate: if by_rate { 0 } else { 500 }, burst: if by_rate { 300 } else { 0 } }),
        1 => (1..20u64, 1..8u64).prop_map(|(rate, burst)| Op::Reload { rate, burst }),
    ]
}

/// What the verifier replays, in time order.
enum Event {
    Admitted {
        t: u64,
        org: usize,
        id: u64,
    },
    Slice {
        t: u64,
        org: usize,
        rate: u64,
        burst: u64,
    },
    /// A completion's usage beyond its reservation, charged when it arrives.
    Excess {
        t: u64,
        org: usize,
        units: u64,
    },
    /// The `rps` limit reloaded: for each org, whether the engine held its key then.
    Reload {
        t: u64,
        rate: u64,
        burst: u64,
        held: [bool; 2],
    },
}

struct Run {
    engine: Arc<Engine>,
    sink: Arc<MemorySink>,
    now: u64,
    next_id: u64,
    live: Vec<u64>,
    finished: Vec<u64>,
    /// id -> (org, reserved input, actual input if completed live or late)
    reqs: HashMap<u64, (usize, u64, Option<u64>)>,
    log: Vec<Event>,
    seq: u64,
    records: Vec<bursar_agent::OwnedRecord>,
}

impl Run {
    fn new() -> Run {
        let sink = Arc::new(MemorySink::new(1_000_000));
        Run {
            engine: engine_with_sink(RULES, sink.clone()),
            sink,
            now: 0,
            next_id: 0,
            live: Vec::new(),
            finished: Vec::new(),
            reqs: HashMap::new(),
            log: Vec::new(),
            seq: 0,
            records: Vec::new(),
        }
    }

    fn levels(&self, org: &str) -> [Option<i128>; 3] {
        ["itpm", "rps", "conc"].map(|r| self.engine.level(self.now, r, &[org]))
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Admit { org, input, ttl_ms } => {
                let id = self.next_id;
                self.next_id += 1;
                let rid = id.to_string();
                let desc = [("org", ORGS[org])];
                let before = self.levels(ORGS[org]);
                let d = self
                    .engine
                    .admit(
                        self.now,
                        &AdmitRequest {
                            request_id: &rid,
                            domain: None,
                            descriptors: &desc,
                            cost: Cost {
                                requests: 1,
                                input_tokens: input,
                                max_output_tokens: Some(0),
                            },
                            ttl_ms: Some(ttl_ms),
                        },
                    )
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                match d {
                    Decision::Admitted(a) => {
                        prop_assert!(!a.replayed);
                        self.live.push(id);
                        self.reqs.insert(id, (org, input, None));
                        self.log.push(Event::Admitted {
                            t: self.now,
                            org,
                            id,
                        });
                    }
                    Decision::Rejected(_) => {
                        let after = self.levels(ORGS[org]);
                        for (b, a) in before.iter().zip(after.iter()) {
                            if b.is_some() {
                                prop_assert_eq!(b, a, "a rejection left a partial debit");
                            }
                        }
                    }
                }
            }
            Op::Complete { pick, used_pct } => {
                let all = self.live.len() + self.finished.len();
                if all == 0 {
                    return Ok(());
                }
                // Mostly live leases, sometimes ones that already expired or completed.
                let (id, was_live) = if pick % 4 != 0 && !self.live.is_empty() {
                    (self.live.swap_remove(pick % self.live.len()), true)
                } else if !self.finished.is_empty() {
                    (self.finished[pick % self.finished.len()], false)
                } else {
                    (self.live.swap_remove(pick % self.live.len()), true)
                };
                let entry = self.reqs.get_mut(&id).expect("known id");
                let used = entry.1 * used_pct / 100;
                let r = self
                    .engine
                    .complete(
                        self.now,
                        &id.to_string(),
                        Usage {
                            input_tokens: used,
                            cached_input_tokens: 0,
                            output_tokens: 0,
                        },
                        CompletionStatus::Ok,
                    )
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                match r {
                    Completion::Settled => {
                        prop_assert!(was_live);
                        entry.2 = Some(used);
                    }
                    Completion::Late => {
                        prop_assert!(entry.2.is_none());
                        entry.2 = Some(used);
                    }
                    Completion::Duplicate => prop_assert!(entry.2.is_some() || !was_live),
                }
                if r != Completion::Duplicate && used > entry.1 {
                    self.log.push(Event::Excess {
                        t: self.now,
                        org: entry.0,
                        units: used - entry.1,
                    });
                }
                if was_live || r == Completion::Late {
                    self.finished.push(id);
                }
            }
            Op::Duplicate { pick } => {
                if self.finished.is_empty() {
                    return Ok(());
                }
                let id = self.finished[pick % self.finished.len()];
                let before = self.levels(ORGS[self.reqs[&id].0]);
                let r = self.engine.complete(
                    self.now,
                    &id.to_string(),
                    Usage::default(),
                    CompletionStatus::Ok,
                );
                if self.reqs[&id].2.is_some() {
                    prop_assert_eq!(r, Ok(Completion::Duplicate));
                    prop_assert_eq!(before, self.levels(ORGS[self.reqs[&id].0]));
                } else {
                    // Expired and never completed: this is its late completion.
                    prop_assert_eq!(r, Ok(Completion::Late));
                    self.reqs.get_mut(&id).expect("known").2 = Some(0);
                }
            }
            Op::Advance { ms } => self.now += ms * MS,
            Op::Maintain => self.maintain(),
            Op::Slice { org, rate, burst } => {
                self.seq += 1;
                let r = self.engine.apply_slices(
                    self.now,
                    &[SliceUpdate {
                        rule: "itpm".into(),
                        values: vec![ORGS[org].into()],
                        rate,
                        burst,
                        epoch: 1,
                        seq: self.seq,
                        lease_expires_at_ns: u64::MAX,
                        fleet_size: 1,
                        transfer_tokens: 0,
                    }],
                );
                prop_assert!(r[0].is_ok(), "{:?}", r[0]);
                self.log.push(Event::Slice {
                    t: self.now,
                    org,
                    rate,
                    burst,
                });
            }
            Op::Reload { rate, burst } => {
                let held = [0, 1].map(|o| self.engine.level(self.now, "rps", &[ORGS[o]]).is_some());
                let cfg = bursar_agent::Config::from_toml(&rules_with_rps(rate, burst))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                self.engine
                    .reload(self.now, cfg)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                self.log.push(Event::Reload {
                    t: self.now,
                    rate,
                    burst,
                    held,
                });
            }
        }
        self.engine
            .check_invariants(self.now)
            .map_err(TestCaseError::fail)?;
        Ok(())
    }

    fn maintain(&mut self) {
        let expired_before = self.sink_expired();
        self.engine.maintain(self.now);
        let expired_now = self.sink_expired();
        // Leases the engine expired move from live to finished (completable late).
        let newly: Vec<u64> = expired_now
            .into_iter()
            .filter(|id| !expired_before.contains(id))
            .collect();
        self.live.retain(|id| !newly.contains(id));
        self.finished.extend(newly);
    }

    /// Moves the sink's records into `self.records`; returns ids expired so far.
    fn sink_expired(&mut self) -> Vec<u64> {
        let (records, dropped) = self.sink.take();
        assert_eq!(dropped, 0);
        self.records.extend(records);
        self.records
            .iter()
            .filter(|r| r.outcome == Outcome::Expired)
            .map(|r| r.request_id.parse().expect("numeric id"))
            .collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn admitted_actual_cost_conforms_and_nothing_is_refunded_twice(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        let mut run = Run::new();
        for op in &ops {
            run.step(op)?;
        }
        // Drain: everything still live expires; every slot must come back.
        run.now += 10_000 * MS;
        run.maintain();
        prop_assert_eq!(run.engine.leases_in_flight(), 0);
        for org in ORGS {
            if let Some(free) = run.engine.level(run.now, "conc", &[org]) {
                prop_assert_eq!(free, 3, "a concurrency slot leaked");
            }
        }
        run.engine.check_invariants(run.now).map_err(TestCaseError::fail)?;

        // Usage records: per id, exactly one Completed, or one Expired plus at most one
        // LateCompleted (when a late completion arrived).
        run.sink_expired();
        let records = run.records.clone();
        let mut per_id: HashMap<u64, Vec<Outcome>> = HashMap::new();
        for r in &records {
            per_id.entry(r.request_id.parse().expect("id")).or_default().push(r.outcome);
        }
        for (id, (_, _, actual)) in &run.reqs {
            let outs = per_id.get(id).cloned().unwrap_or_default();
            let ok = matches!(outs.as_slice(), [Outcome::Completed(_)])
                || matches!(outs.as_slice(), [Outcome::Expired])
                || matches!(outs.as_slice(), [Outcome::Expired, Outcome::LateCompleted(_)]);
            prop_assert!(ok, "request {} produced {:?}", id, outs);
            if matches!(outs.as_slice(), [Outcome::Expired]) {
                prop_assert!(actual.is_none());
            }
        }

        // Conformance: replay admissions at their times, charging the actual cost up to
        // the reservation (the reservation when it never completed), and usage beyond
        // it when its completion came, through exact buckets.
        let mut v = [
            ExactBucket::new(1000, 500, PERIOD_NS, 0),
            ExactBucket::new(1000, 500, PERIOD_NS, 0),
        ];
        // And one request a request through the `rps` limit, as reloads set it.
        let mut rps = [
            ExactBucket::new(7, 3, PERIOD_NS, 0),
            ExactBucket::new(7, 3, PERIOD_NS, 0),
        ];
        for ev in &run.log {
            match *ev {
                Event::Admitted { t, org, id } => {
                    let (_, reserved, actual) = run.reqs[&id];
                    v[org].advance(t);
                    v[org].charge(actual.unwrap_or(reserved).min(reserved));
                    rps[org].advance(t);
                    rps[org].charge(1);
                }
                Event::Slice { t, org, rate, burst } => {
                    v[org].advance(t);
                    v[org].reslice(rate, burst);
                }
                Event::Excess { t, org, units } => {
                    v[org].advance(t);
                    v[org].charge_spent(units);
                }
                Event::Reload { t, rate, burst, held } => {
                    for (org, b) in rps.iter_mut().enumerate() {
                        b.advance(t);
                        if held[org] {
                            b.reslice(rate, burst);
                        } else {
                            b.restart_full(rate, burst);
                        }
                    }
                }
            }
        }
        for (org, v) in v.iter().enumerate() {
            prop_assert!(
                v.worst_deficit() <= 0,
                "org {} overshot the exact bucket by {} token-ns", org, v.worst_deficit()
            );
        }
        for (org, b) in rps.iter().enumerate() {
            prop_assert!(
                b.worst_deficit() <= 0,
                "org {} overshot the reloaded request limit by {} request-ns",
                org, b.worst_deficit()
            );
        }
    }
}
