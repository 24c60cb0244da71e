//! The allocation benchmarks' fleet at the design's scale (1,000 agents x 100,000
//! keys, about 1,000,000 key-agent entries, Zipf-spread) and its reporting agents:
//! shared by `benches/allocation.rs` (wall clock) and `examples/report_loop.rs`
//! (cachegrind's deterministic counts of one report, `bench/allocator_instructions.sh`).

use std::collections::HashMap;

use bursar_agent::Config;

use crate::config::AllocatorConfig;
use crate::core::Allocator;
use crate::msg::{Grant, Hello, KeyName, KeyReport, Measure, Report};

/// Agents in the fleet.
pub const AGENTS: usize = 1_000;
/// Keys in the fleet.
pub const KEYS: usize = 100_000;
/// Key-agent entries, about.
pub const ENTRIES: usize = 1_000_000;
const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;

/// The fleet's one rule: a key per `key` value.
pub const RULES: &str = r#"
[[rule]]
name = "key-tpm"
match = { key = "*" }
dimension = "input_tokens"
rate = 100_000
per = "second"
burst = 100_000
"#;

/// Agents per key: Zipf (s = 1) capped at every agent, at least one, summing to about
/// `ENTRIES`.
pub fn zipf_counts() -> Vec<usize> {
    let count = |c: f64| -> Vec<usize> {
        (1..=KEYS)
            .map(|k| ((c / k as f64) as usize).clamp(1, AGENTS))
            .collect()
    };
    let (mut lo, mut hi) = (1.0f64, 1e7f64);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if count(mid).iter().sum::<usize>() < ENTRIES {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    count(hi)
}

/// An allocator that knows the whole fleet.
pub struct Fleet {
    /// The allocator, every agent registered and every key reported once.
    pub alloc: Allocator,
    /// Per agent, the keys it reports.
    pub keys_of: Vec<Vec<u32>>,
    /// The allocator's clock.
    pub now: u64,
}

/// Key `k`'s name.
pub fn name(k: u32) -> KeyName {
    KeyName::new("key-tpm", &[&format!("k{k:06}")])
}

/// Cumulative admitted cost after `round` reports: 50-1,050 tokens per 250 ms,
/// depending on the pair.
pub fn demand(agent: usize, key: u32, round: u64) -> u64 {
    let x = (agent as u64 * 2_654_435_761 + key as u64 * 40_503) % 1_000;
    (round + 1) * (50 + x)
}

/// Agent `agent`'s first report line for key `k`, by name, holding nothing.
fn first_line(agent: usize, k: u32) -> KeyReport {
    KeyReport {
        key: name(k),
        admitted: demand(agent, k, 0),
        rejected: 0,
        counting_since_ns: SEC,
        in_flight: 0,
        held: None,
        key_handle: 0,
    }
}

/// Every agent has said hello and reported all its keys once; nothing is allocated yet.
pub fn fleet(recompute_delay_ms: u64, large_key_entries: usize) -> Fleet {
    fleet_with(AllocatorConfig {
        recompute_delay_ms,
        large_key_entries,
        ..AllocatorConfig::default()
    })
}

/// [`fleet`] with any settings.
pub fn fleet_with(cfg: AllocatorConfig) -> Fleet {
    let rules = Config::from_toml(RULES).unwrap();
    let mut alloc = Allocator::new(&rules, cfg, 1, 0).unwrap();
    let now = 20 * SEC;
    alloc.handle_timeout(now); // past the learning period
    let counts = zipf_counts();
    let mut keys_of = vec![Vec::new(); AGENTS];
    for (k, &n) in counts.iter().enumerate() {
        let start = (k * 7_919) % AGENTS;
        for j in 0..n {
            keys_of[(start + j) % AGENTS].push(k as u32);
        }
    }
    for (i, keys) in keys_of.iter().enumerate() {
        let agent = format!("agent-{i:04}");
        alloc
            .handle_hello(
                now,
                &Hello {
                    agent: agent.clone(),
                    incarnation: 1,
                    agent_time_ns: SEC,
                    weight: 1,
                    report_interval_ms: 250,
                    held: vec![],
                    // As the agents of this build: the routed benchmark's grants then
                    // name a key once per stream.
                    grants_by_handle: true,
                    rule_shapes: Vec::new(),
                },
            )
            .unwrap();
        let report = Report {
            agent,
            incarnation: 1,
            agent_time_ns: SEC + 250 * MS,
            keys: keys.iter().map(|&k| first_line(i, k)).collect(),
            measure: Measure::None,
        };
        alloc.handle_report(now, &report).unwrap();
    }
    assert_eq!(alloc.key_count(), KEYS);
    assert!(alloc.entry_count() >= ENTRIES - 1_000 && alloc.entry_count() <= ENTRIES + 1_000);
    Fleet {
        alloc,
        keys_of,
        now,
    }
}

/// Agents reporting 100 keys each in turn, 4,000 reports per virtual second (each
/// agent every 250 ms); each report carries the grants the agent last received (as an
/// agent that applies and acknowledges does).
pub struct Reporter {
    /// The fleet reported to.
    pub f: Fleet,
    /// Per agent, its next report.
    pub reports: Vec<Report>,
    /// Per agent: position in its report of each reported key.
    slot: Vec<HashMap<u32, usize>>,
    /// Per agent, per line: the key's handle from the last grant (0: none).
    handles: Vec<Vec<u64>>,
    round: Vec<u64>,
    n: usize,
    /// Every 8th report names its keys by name (the sync client before its full
    /// reports named keys by handle too); otherwise every line with a handle uses it.
    full_by_name: bool,
}

impl Reporter {
    /// The fleet, allocated once, each agent holding its grants.
    pub fn new(large_key_entries: usize, recompute_delay_ms: u64) -> Reporter {
        let mut f = fleet(recompute_delay_ms, large_key_entries);
        f.alloc.reallocate_all(f.now);
        let grants: Vec<_> = f.alloc.drain_grants().collect();
        let mut slot = vec![HashMap::new(); AGENTS];
        let reports: Vec<Report> = f
            .keys_of
            .iter()
            .enumerate()
            .map(|(i, keys)| {
                let step = (keys.len() / 100).max(1);
                let keys: Vec<KeyReport> = keys
                    .iter()
                    .step_by(step)
                    .take(100)
                    .enumerate()
                    .map(|(j, &k)| {
                        slot[i].insert(k, j);
                        first_line(i, k)
                    })
                    .collect();
                Report {
                    agent: format!("agent-{i:04}"),
                    incarnation: 1,
                    agent_time_ns: SEC + 250 * MS,
                    keys,
                    measure: Measure::None,
                }
            })
            .collect();
        let handles = reports.iter().map(|r| vec![0; r.keys.len()]).collect();
        let mut r = Reporter {
            f,
            reports,
            slot,
            handles,
            round: vec![0; AGENTS],
            n: 0,
            full_by_name: true,
        };
        r.deliver(&grants);
        r
    }

    /// The same fleet with reports as today's sync client sends them: every line names
    /// its key by the handle a grant gave, full reports too (the earlier figures'
    /// client named every key by name in one report of eight).
    pub fn with_handles_in_full_reports(mut self) -> Reporter {
        self.full_by_name = false;
        self
    }

    /// Applies grants to the agents' next reports (held grants and key handles).
    pub fn deliver(&mut self, grants: &[Grant]) {
        for g in grants {
            let i: usize = g.agent["agent-".len()..].parse().unwrap();
            let k: u32 = g.key.values[0][1..].parse().unwrap();
            if let Some(&j) = self.slot[i].get(&k) {
                self.reports[i].keys[j].held = Some(g.held());
                self.handles[i][j] = g.key_handle;
            }
        }
    }

    /// Prepares the next report (outside the timing); returns its agent.
    pub fn prepare(&mut self) -> usize {
        let i = self.n % AGENTS;
        self.n += 1;
        self.round[i] += 1;
        let round = self.round[i];
        let r = &mut self.reports[i];
        r.agent_time_ns += 250 * MS;
        // As the sync client of the earlier figures: every 8th report names its keys,
        // the others use the handles grants carried (the name stays in memory here,
        // ignored). Today's client uses the handles in full reports too
        // ([`Reporter::with_handles_in_full_reports`]).
        let full = self.full_by_name && round.is_multiple_of(8);
        for (kr, &h) in r.keys.iter_mut().zip(&self.handles[i]) {
            kr.key_handle = if full { 0 } else { h };
            let k: u32 = kr.key.values[0][1..].parse().unwrap();
            kr.admitted = demand(i, k, round);
            // Demand steps every other round: every key in the report changes.
            if round.is_multiple_of(2) {
                kr.rejected += 300;
            }
        }
        self.f.now += 250 * MS / AGENTS as u64;
        i
    }

    /// What the benchmark times: agent `i`'s prepared report handled, the keys it
    /// marked recomputed (`recompute`), grants drained into `out` and extensions
    /// drained. Never inlined, so that cachegrind can count it alone
    /// (`--toggle-collect`).
    #[inline(never)]
    pub fn report(&mut self, i: usize, recompute: bool, out: &mut Vec<Grant>) {
        self.f
            .alloc
            .handle_report(self.f.now, &self.reports[i])
            .expect("the fleet's reports are valid");
        if recompute {
            self.f.alloc.handle_timeout(self.f.now);
        }
        out.extend(self.f.alloc.drain_grants());
        std::hint::black_box(self.f.alloc.drain_extensions());
    }

    /// [`Reporter::report`] with the grants drained as the shell's `route` does
    /// (`shell/driver.rs`): `for_each_grant`, each grant encoded into a protobuf grant
    /// (key strings copied) and batched per agent stream in `batch`, which the shell
    /// then sends and this harness hands to [`Reporter::deliver_routed`]; no owned
    /// `Grant`s.
    #[cfg(feature = "shell")]
    #[inline(never)]
    pub fn report_routed(&mut self, i: usize, batch: &mut RoutedBatch) {
        self.f
            .alloc
            .handle_report(self.f.now, &self.reports[i])
            .expect("the fleet's reports are valid");
        self.f.alloc.handle_timeout(self.f.now);
        self.f.alloc.for_each_grant(|g| {
            batch
                .entry(g.agent_index)
                .or_insert_with(|| (std::sync::Arc::clone(g.agent), Vec::new()))
                .1
                .push(crate::shell::driver::grant_to_pb(&g))
        });
        std::hint::black_box(self.f.alloc.drain_extensions());
    }

    /// Applies routed grants to the agents' next reports (as [`Reporter::deliver`]),
    /// emptying `batch`.
    #[cfg(feature = "shell")]
    pub fn deliver_routed(&mut self, batch: &mut RoutedBatch) {
        for (_, (agent, grants)) in batch.drain() {
            let i: usize = agent["agent-".len()..].parse().unwrap();
            for g in grants {
                // A grant without a name is for a key this agent has the handle of.
                let j = match g.key {
                    Some(key) => {
                        let k: u32 = key.values[0][1..].parse().unwrap();
                        self.slot[i].get(&k).copied()
                    }
                    None => self.handles[i].iter().position(|&h| h == g.key_handle),
                };
                if let Some(j) = j {
                    self.reports[i].keys[j].held = Some(crate::msg::HeldGrant {
                        epoch: g.epoch,
                        seq: g.seq,
                        rate: g.rate,
                        burst: g.burst,
                    });
                    self.handles[i][j] = g.key_handle;
                }
            }
        }
    }
}

/// Grants batched per agent stream as the shell's `route` batches them: by the agent's
/// index, with its name.
#[cfg(feature = "shell")]
pub type RoutedBatch = HashMap<u32, (std::sync::Arc<str>, Vec<bursar_proto::allocator::Grant>)>;
