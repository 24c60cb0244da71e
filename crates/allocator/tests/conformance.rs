//! End-to-end conformance: the real agent budget engines (`bursar_agent::Engine`,
//! `slice_source = "allocated"`), one per simulated agent, and the allocation core, in
//! one process under a virtual clock.
//!
//! Skewed synthetic demand shifts between agents; each agent reports every 250 ms
//! (virtual) and at once for a new key; grants and acks cross a network with a fixed
//! latency. A verifier token bucket `(R, B)` over the sum of every agent's admitted
//! costs must never go below zero (`O = 0`): that is the overshoot contract. The test
//! prints utilization against one ideal global bucket offered the same requests, and
//! the time it took to move a slice to the agent demand moved to.
//!
//! Run with `cargo test -p bursar-allocator --test conformance -- --nocapture` to see
//! the figures.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bursar_agent::{
    AdmitRequest, CompletionStatus, Config, Cost, Decision, DiscardSink, Engine, SliceExtension,
    Usage,
};
use bursar_allocator::{
    Ack, Allocator, AllocatorConfig, Grant, HeldGrant, Hello, KeyName, KeyReport, LeaseExtension,
    Measure, Report, SliceAck,
};

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;

/// Tokens per second and burst of the one limit under test.
const R: u64 = 20_000;
const B: u64 = 4_000;

const RULES: &str = r#"
[engine]
slice_source = "allocated"

[[rule]]
name = "org-itps"
match = { org = "*" }
dimension = "input_tokens"
rate = 20_000
per = "second"
burst = 4_000
posture = "conservative"
"#;

const AGENTS: usize = 4;
const LATENCY_NS: u64 = 2 * MS;
const REPORT_EVERY_NS: u64 = 250 * MS;

/// A seeded xorshift generator: the test names its seed and replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// An exact token bucket in units of token-nanoseconds (no rounding at all).
struct ExactBucket {
    level: i128,
    cap: i128,
    rate: i128,
    at: u64,
    min_level: i128,
}

impl ExactBucket {
    fn full(rate: u64, burst: u64, at: u64) -> ExactBucket {
        let cap = burst as i128 * SEC as i128;
        ExactBucket {
            level: cap,
            cap,
            rate: rate as i128,
            at,
            min_level: cap,
        }
    }

    fn refill(&mut self, now: u64) {
        let dt = (now - self.at) as i128;
        self.level = (self.level + self.rate * dt).min(self.cap);
        self.at = now;
    }

    /// The verifier: debits whatever was admitted, even past zero, and remembers how
    /// deep it went.
    fn debit(&mut self, now: u64, cost: u64) {
        self.refill(now);
        self.level -= cost as i128 * SEC as i128;
        self.min_level = self.min_level.min(self.level);
    }

    /// The ideal limiter: admits if the cost fits.
    fn try_take(&mut self, now: u64, cost: u64) -> bool {
        self.refill(now);
        let c = cost as i128 * SEC as i128;
        if self.level >= c {
            self.level -= c;
            true
        } else {
            false
        }
    }
}

struct SimAgent {
    name: String,
    engine: Arc<Engine>,
    /// Agent clock = virtual time + offset (agents' clocks are unrelated).
    offset: u64,
    held: Option<HeldGrant>,
    admitted: u64,
    rejected: u64,
    next_report: u64,
    reported_cold: bool,
    next_id: u64,
    /// (virtual time, rate) whenever a grant was applied.
    applied: Vec<(u64, u64)>,
}

enum Msg {
    ToAgent(Grant),
    Extend(LeaseExtension),
    Report(Report),
    Ack(Ack),
}

fn key() -> KeyName {
    KeyName::new("org-itps", &["acme"])
}

/// Offered load (tokens per second) per agent in each 6-second phase: demand moves,
/// goes nearly idle, then bursts everywhere at once.
fn offered(phase: usize) -> [f64; AGENTS] {
    let r = R as f64;
    match phase % 6 {
        0 => [0.9 * r, 0.1 * r, 0.1 * r, 0.1 * r],
        1 => [0.1 * r, 0.1 * r, 0.9 * r, 0.1 * r],
        2 => [0.02 * r, 0.02 * r, 0.02 * r, 0.02 * r],
        3 => [0.5 * r, 0.5 * r, 0.5 * r, 0.5 * r],
        4 => [0.0, 0.0, 0.0, 1.2 * r],
        _ => [0.2 * r, 0.6 * r, 0.05 * r, 0.05 * r],
    }
}

const PHASE_NS: u64 = 6 * SEC;
const PHASES: usize = 6;

struct Outcome {
    /// Lowest level of the verifier bucket `(R, B)`, in tokens.
    min_level_tokens: f64,
    /// Lowest level of a verifier `(R + O, B)`.
    min_level_with_overdraft_tokens: f64,
    fleet_admitted: u64,
    ideal_admitted: u64,
    offered: u64,
    move_times_ms: Vec<(usize, u64)>,
}

fn run(seed: u64, overdraft_permille: u32) -> Outcome {
    let config = Config::from_toml(RULES).unwrap();
    let start = 0;
    let acfg = AllocatorConfig {
        lease_ms: 2_000,
        reclaim_margin_ms: 500,
        overdraft_permille,
        ..AllocatorConfig::default()
    };
    let mut alloc = Allocator::new(&config, acfg, 1, start).unwrap();
    // A fresh term learns for one lease before it grants: start the traffic after it.
    let t0 = start + 3 * SEC;
    alloc.handle_timeout(t0);
    let mut rng = Rng(seed);
    let mut agents: Vec<SimAgent> = (0..AGENTS)
        .map(|i| SimAgent {
            name: format!("agent-{i}"),
            engine: Arc::new(Engine::new(config.clone(), Arc::new(DiscardSink))),
            offset: 1_000 * SEC + i as u64 * 7_777 * MS,
            held: None,
            admitted: 0,
            rejected: 0,
            next_report: t0 + i as u64 * 61 * MS,
            reported_cold: false,
            next_id: 0,
            applied: Vec::new(),
        })
        .collect();
    let mut net: BTreeMap<(u64, u64), Msg> = BTreeMap::new();
    let mut msg_seq = 0u64;
    let mut send = |net: &mut BTreeMap<(u64, u64), Msg>, at: u64, m: Msg| {
        msg_seq += 1;
        net.insert((at + LATENCY_NS, msg_seq), m);
    };
    for a in &agents {
        alloc
            .handle_hello(
                t0,
                &Hello {
                    agent: a.name.clone(),
                    incarnation: 1,
                    agent_time_ns: t0 + a.offset,
                    weight: 1,
                    report_interval_ms: 250,
                    held: vec![],
                    grants_by_handle: false,
                    rule_shapes: Vec::new(),
                },
            )
            .unwrap();
    }
    let mut verifier = ExactBucket::full(R, B, t0);
    let mut verifier_o = ExactBucket::full(R + R * overdraft_permille as u64 / 1000, B, t0);
    let mut ideal = ExactBucket::full(R, B, t0);
    let mut fleet_admitted = 0u64;
    let mut ideal_admitted = 0u64;
    let mut offered_total = 0u64;
    // Per agent, fractional requests carried between ticks.
    let mut carry = [0.0f64; AGENTS];
    let mean_cost = 110.0;
    let end = t0 + PHASE_NS * PHASES as u64;
    let mut now = t0;
    let mut pending: VecDeque<(usize, u64)> = VecDeque::new();
    while now < end {
        // Network and allocator.
        while let Some(entry) = net.first_entry() {
            if entry.key().0 > now {
                break;
            }
            match entry.remove() {
                Msg::ToAgent(g) => {
                    let i: usize = g.agent["agent-".len()..].parse().unwrap();
                    let a = &mut agents[i];
                    let at = now + a.offset;
                    let r = a.engine.apply_slices(at, &[g.to_slice_update()]);
                    if let Ok(applied) = &r[0] {
                        a.held = Some(g.held());
                        a.applied.push((now, g.rate));
                        let ack = Ack {
                            agent: a.name.clone(),
                            incarnation: 1,
                            slices: vec![SliceAck {
                                key: key(),
                                epoch: g.epoch,
                                seq: g.seq,
                                released_tokens: applied.released_tokens,
                                in_flight: applied.in_flight,
                                key_handle: 0,
                            }],
                        };
                        send(&mut net, now, Msg::Ack(ack));
                    }
                }
                Msg::Extend(x) => {
                    let i: usize = x.agent["agent-".len()..].parse().unwrap();
                    let a = &mut agents[i];
                    let ext = SliceExtension {
                        epoch: x.epoch,
                        through_seq: x.through_seq,
                        lease_expires_at_ns: x.lease_expires_at_ns,
                    };
                    a.engine.extend_slices(now + a.offset, ext).unwrap();
                }
                Msg::Report(r) => alloc.handle_report(now, &r).unwrap(),
                Msg::Ack(a) => alloc.handle_ack(now, &a).unwrap(),
            }
        }
        if alloc.poll_timeout() <= now {
            alloc.handle_timeout(now);
        }
        alloc.check_invariants().unwrap();
        for g in alloc.drain_grants() {
            send(&mut net, now, Msg::ToAgent(g));
        }
        for x in alloc.drain_extensions() {
            send(&mut net, now, Msg::Extend(x));
        }

        // Offered load this millisecond, agent by agent, in one global order.
        let phase = ((now - t0) / PHASE_NS) as usize;
        let load = offered(phase);
        for i in 0..AGENTS {
            carry[i] += load[i] / mean_cost / 1_000.0;
            while carry[i] >= 1.0 {
                carry[i] -= 1.0;
                pending.push_back((i, 20 + rng.next() % 181));
            }
        }
        while let Some((i, cost)) = pending.pop_front() {
            offered_total += cost;
            if ideal.try_take(now, cost) {
                ideal_admitted += cost;
            }
            let a = &mut agents[i];
            let at = now + a.offset;
            a.next_id += 1;
            let id = format!("{}-{}", a.name, a.next_id);
            let d = a
                .engine
                .admit(
                    at,
                    &AdmitRequest {
                        request_id: &id,
                        domain: None,
                        descriptors: &[("org", "acme")],
                        cost: Cost {
                            requests: 1,
                            input_tokens: cost,
                            max_output_tokens: Some(0),
                        },
                        ttl_ms: None,
                    },
                )
                .unwrap();
            match d {
                Decision::Admitted(_) => {
                    a.admitted += cost;
                    fleet_admitted += cost;
                    verifier.debit(now, cost);
                    verifier_o.debit(now, cost);
                    a.engine
                        .complete(
                            at,
                            &id,
                            Usage {
                                input_tokens: cost,
                                ..Usage::default()
                            },
                            CompletionStatus::Ok,
                        )
                        .unwrap();
                }
                Decision::Rejected(_) => {
                    a.rejected += cost;
                    // A new key is reported at once, out of band.
                    if a.held.is_none() && !a.reported_cold {
                        a.reported_cold = true;
                        a.next_report = now;
                    }
                }
            }
        }

        // Reports and maintenance.
        for a in agents.iter_mut() {
            if now.is_multiple_of(100 * MS) {
                a.engine.maintain(now + a.offset);
            }
            if now >= a.next_report && (a.admitted + a.rejected > 0 || a.held.is_some()) {
                let r = Report {
                    agent: a.name.clone(),
                    incarnation: 1,
                    agent_time_ns: now + a.offset,
                    keys: vec![KeyReport {
                        key: key(),
                        admitted: a.admitted,
                        rejected: a.rejected,
                        counting_since_ns: t0 + a.offset,
                        in_flight: 0,
                        held: a.held,
                        key_handle: 0,
                    }],
                    measure: Measure::None,
                };
                send(&mut net, now, Msg::Report(r));
                a.next_report = now + REPORT_EVERY_NS;
            }
        }
        now += MS;
    }

    // Time to move a slice: from each phase start until the agent with the most demand
    // first holds 90 % of the rate it holds at the end of the phase.
    let mut move_times_ms = Vec::new();
    for phase in 0..PHASES {
        let load = offered(phase);
        let mut order: Vec<usize> = (0..AGENTS).collect();
        order.sort_by(|&x, &y| load[y].total_cmp(&load[x]));
        let hot = order[0];
        if load[hot] < 1.5 * load[order[1]] {
            continue; // no single agent to move a slice to
        }
        let p0 = t0 + phase as u64 * PHASE_NS;
        let p1 = p0 + PHASE_NS;
        let applied = &agents[hot].applied;
        let Some(&(_, final_rate)) = applied.iter().rev().find(|(t, _)| *t < p1) else {
            continue;
        };
        let before = applied
            .iter()
            .rev()
            .find(|(t, _)| *t < p0)
            .map_or(0, |x| x.1);
        if final_rate * 9 / 10 <= before {
            continue; // the hot agent already held its share
        }
        if let Some(&(t, _)) = applied
            .iter()
            .find(|(t, r)| *t >= p0 && *t < p1 && *r * 10 >= final_rate * 9)
        {
            move_times_ms.push((phase, (t - p0) / MS));
        }
    }
    Outcome {
        min_level_tokens: verifier.min_level as f64 / SEC as f64,
        min_level_with_overdraft_tokens: verifier_o.min_level as f64 / SEC as f64,
        fleet_admitted,
        ideal_admitted,
        offered: offered_total,
        move_times_ms,
    }
}

#[test]
fn real_agents_and_the_allocator_never_overshoot_a_global_bucket_while_demand_moves() {
    for seed in [0x5EED_0001u64, 0x5EED_0002] {
        let o = run(seed, 0);
        let utilization = o.fleet_admitted as f64 / o.ideal_admitted as f64;
        println!(
            "seed {seed:#x}: offered {} tokens; ideal global bucket admitted {}; fleet of {AGENTS} \
             admitted {} (utilization {:.3}); verifier minimum level {:.3} tokens \
             (>= 0: no overshoot); time to move a slice per phase (ms): {:?}",
            o.offered,
            o.ideal_admitted,
            o.fleet_admitted,
            utilization,
            o.min_level_tokens,
            o.move_times_ms,
        );
        assert!(
            o.min_level_tokens >= 0.0,
            "overshoot: the verifier bucket went {:.3} tokens below zero (replay: seed {seed:#x})",
            -o.min_level_tokens
        );
        // The fleet admits nearly what one global bucket would (it starts empty and
        // follows demand with a report interval's lag).
        assert!(
            utilization > 0.85,
            "utilization {utilization:.3} (seed {seed:#x})"
        );
        assert!(!o.move_times_ms.is_empty(), "no slice moved");
        assert!(
            o.move_times_ms.iter().all(|&(_, ms)| ms < 3_000),
            "a slice took over 3 s to move: {:?}",
            o.move_times_ms
        );
    }
}

#[test]
fn the_verifier_catches_an_overdraft_and_the_overdraft_is_the_only_excess() {
    // Negative control: with O = 20 % of R the fleet admits above (R, B) and the
    // verifier sees it; against (R + O, B) it conforms.
    let o = run(0x5EED_0003, 200);
    println!(
        "overdraft 20 %: verifier (R, B) minimum {:.1} tokens; verifier (R + O, B) minimum {:.1}",
        o.min_level_tokens, o.min_level_with_overdraft_tokens
    );
    assert!(
        o.min_level_tokens < 0.0,
        "the verifier must detect the overdraft"
    );
    assert!(o.min_level_with_overdraft_tokens >= 0.0);
}
