//! Scenarios: plain data read from TOML (`sim/scenarios/*.toml`, built into the binary
//! by name), with [`Scenario::validate`] naming the field that is wrong.

use std::path::Path;

use bursar_agent::MAX_COST;
use bursar_allocator::AllocatorConfig;
use serde::{Deserialize, Serialize};

/// A scenario could not be read or is impossible (operator error; nothing ran).
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("scenario file {path}: {source}")]
    Io {
        /// The path given.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML is malformed or names an unknown field.
    #[error("scenario {name}: {message}")]
    Parse {
        /// File path or built-in name.
        name: String,
        /// The parser's message (it names an unknown field).
        message: String,
    },
    /// A parameter is impossible.
    #[error("scenario {name}: `{field}` {reason}")]
    Invalid {
        /// File path or built-in name.
        name: String,
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// Neither a file nor a built-in name.
    #[error("no scenario file or built-in named `{0}` (built-ins: {list})", list = BUILT_INS.iter().map(|b| b.0).collect::<Vec<_>>().join(", "))]
    Unknown(String),
}

/// The built-in scenarios: name and TOML (the files in `sim/scenarios/`).
pub const BUILT_INS: &[(&str, &str)] = &[
    ("steady", include_str!("../scenarios/steady.toml")),
    ("zipf", include_str!("../scenarios/zipf.toml")),
    (
        "zipf-default-burst",
        include_str!("../scenarios/zipf-default-burst.toml"),
    ),
    ("llm-zipf", include_str!("../scenarios/llm-zipf.toml")),
    ("whale", include_str!("../scenarios/whale.toml")),
    ("shift", include_str!("../scenarios/shift.toml")),
    ("remote-half", include_str!("../scenarios/remote-half.toml")),
    (
        "shift-overload",
        include_str!("../scenarios/shift-overload.toml"),
    ),
    ("cold-keys", include_str!("../scenarios/cold-keys.toml")),
    ("sparse", include_str!("../scenarios/sparse.toml")),
    ("diurnal", include_str!("../scenarios/diurnal.toml")),
    (
        "partition-one",
        include_str!("../scenarios/partition-one.toml"),
    ),
    (
        "partition-set",
        include_str!("../scenarios/partition-set.toml"),
    ),
    (
        "partition-strict",
        include_str!("../scenarios/partition-strict.toml"),
    ),
    (
        "partition-drift",
        include_str!("../scenarios/partition-drift.toml"),
    ),
    (
        "partition-long",
        include_str!("../scenarios/partition-long.toml"),
    ),
    (
        "allocator-partition",
        include_str!("../scenarios/allocator-partition.toml"),
    ),
    (
        "allocator-crash",
        include_str!("../scenarios/allocator-crash.toml"),
    ),
    ("agent-crash", include_str!("../scenarios/agent-crash.toml")),
    ("churn", include_str!("../scenarios/churn.toml")),
    ("lossy", include_str!("../scenarios/lossy.toml")),
];

/// One simulated fleet, workload and fault schedule.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Name shown in reports.
    pub name: String,
    /// One line on what it exercises.
    #[serde(default)]
    pub description: String,
    /// Gateways (agents), at least 1.
    pub gateways: usize,
    /// Limit keys (tenants), at least 1.
    pub keys: usize,
    /// Virtual seconds of traffic (after the allocator's first learning lease).
    pub duration_s: f64,
    /// The one rule every key is limited by.
    pub limit: LimitSpec,
    /// Allocator and agent sync settings.
    #[serde(default)]
    pub allocator: AllocatorSpec,
    /// The links between every agent and the allocator.
    #[serde(default)]
    pub network: NetworkSpec,
    /// Links that differ from `network` (gateways in another region, a lossy
    /// uplink): each names gateways and the fields it changes; a gateway named by two
    /// takes the later one's.
    #[serde(default, rename = "link")]
    pub links: Vec<LinkSpec>,
    /// Offered load.
    pub workload: WorkloadSpec,
    /// Each agent's clock runs fast or slow by a uniform draw in `[-x, x]` parts per
    /// million (0 to 100,000). The allocator's `drift_margin_ms` (200 ms per 2 s lease
    /// here: 100,000 ppm) is what makes leases safe against it.
    #[serde(default)]
    pub clock_drift_ppm: f64,
    /// Faults, in any order.
    #[serde(default, rename = "fault")]
    pub faults: Vec<FaultSpec>,
}

/// The rule: tokens per second and burst, per key.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    /// `R`, input tokens per second.
    pub rate_per_s: u64,
    /// `B`, tokens.
    pub burst: u64,
    /// `strict`, `conservative` or `open`.
    #[serde(default = "default_posture")]
    pub posture: String,
    /// The rule's `typical_cost` (0: unknown, the default for token rules): lets the
    /// allocator concentrate a sparse key on the gateways with the most demand.
    #[serde(default)]
    pub typical_cost: u64,
}

fn default_posture() -> String {
    "conservative".into()
}

/// Allocator settings the scenario may change (the rest are the core's defaults).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AllocatorSpec {
    /// `AllocatorConfig::lease_ms`.
    pub lease_ms: u64,
    /// `AllocatorConfig::reclaim_margin_ms`.
    pub reclaim_margin_ms: u64,
    /// `AllocatorConfig::overdraft_permille`.
    pub overdraft_permille: u32,
    /// How often each agent reports (the agent's `report_interval`).
    pub report_interval_ms: u64,
    /// Every this many reports is a full one (the agent's `full_report_every`): it
    /// also names the keys holding a grant and those changed since the last full one.
    pub full_report_every: u32,
    /// How soon an agent reports a key it has just seen (the agent's `new_key_poll`).
    pub new_key_poll_ms: u64,
    /// `AllocatorConfig::hysteresis_permille`: a grant moves only when its target is
    /// more than this far from it (fewer grant messages against slower small moves;
    /// docs/tuning.md has the measured trade).
    pub hysteresis_permille: u32,
    /// `AllocatorConfig::measure_window_ms`: the window over which a key's holders
    /// measure their demand afresh when another agent's jumps and nothing is free (0:
    /// never asked).
    pub measure_window_ms: u64,
}

impl AllocatorSpec {
    /// The real allocator's settings for a fleet of `gateways`: these fields, the
    /// core's defaults for the rest.
    pub fn config(&self, gateways: usize) -> AllocatorConfig {
        AllocatorConfig {
            lease_ms: self.lease_ms,
            reclaim_margin_ms: self.reclaim_margin_ms,
            overdraft_permille: self.overdraft_permille,
            hysteresis_permille: self.hysteresis_permille,
            measure_window_ms: self.measure_window_ms,
            max_agents: AllocatorConfig::default().max_agents.max(gateways),
            ..AllocatorConfig::default()
        }
    }
}

impl Default for AllocatorSpec {
    fn default() -> Self {
        AllocatorSpec {
            lease_ms: 2_000,
            reclaim_margin_ms: 500,
            overdraft_permille: 0,
            report_interval_ms: 250,
            full_report_every: 8,
            new_key_poll_ms: 20,
            hysteresis_permille: AllocatorConfig::default().hysteresis_permille,
            measure_window_ms: AllocatorConfig::default().measure_window_ms,
        }
    }
}

/// One-way latency of every agent-allocator link: `latency_ms` plus an exponential
/// jitter of mean `jitter_ms`; each message is lost with probability `loss`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkSpec {
    /// Base one-way latency, ms (>= 0).
    pub latency_ms: f64,
    /// Mean of the exponential jitter added, ms (>= 0).
    pub jitter_ms: f64,
    /// Probability a message is lost, 0 to 1.
    pub loss: f64,
    /// Let messages on one link overtake each other (a real stream is FIFO: false).
    pub reorder: bool,
}

impl Default for NetworkSpec {
    fn default() -> Self {
        NetworkSpec {
            latency_ms: 2.0,
            jitter_ms: 1.0,
            loss: 0.0,
            reorder: false,
        }
    }
}

/// Some gateways' links to the allocator: the fields given replace `[network]`'s for
/// them, the rest stay.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Gateway indices (at least one).
    pub agents: Vec<usize>,
    /// Base one-way latency, ms (>= 0).
    pub latency_ms: Option<f64>,
    /// Mean of the exponential jitter added, ms (>= 0).
    pub jitter_ms: Option<f64>,
    /// Probability a message is lost, 0 to 1.
    pub loss: Option<f64>,
    /// Let messages on these links overtake each other.
    pub reorder: Option<bool>,
}

impl Scenario {
    /// Every gateway's link to the allocator: `[network]` with the `[[link]]` entries
    /// that name it applied in order.
    pub fn link_specs(&self) -> Vec<NetworkSpec> {
        let mut out = vec![self.network.clone(); self.gateways];
        for l in &self.links {
            for &i in &l.agents {
                let Some(n) = out.get_mut(i) else { continue };
                n.latency_ms = l.latency_ms.unwrap_or(n.latency_ms);
                n.jitter_ms = l.jitter_ms.unwrap_or(n.jitter_ms);
                n.loss = l.loss.unwrap_or(n.loss);
                n.reorder = l.reorder.unwrap_or(n.reorder);
            }
        }
        out
    }
}

/// The shape of offered load.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Every key offered `load * R`, spread evenly over all gateways.
    Uniform,
    /// Gateways chosen by Zipf(`zipf_s`), each key's ranking rotated.
    Zipf,
    /// Key 0 (the whale) jumps from `load` to `whale_load` at `whale_at_s`, spread
    /// over every gateway at once; the others stay uniform.
    Whale,
    /// Demand alternates between the first and second half of the gateways every
    /// `shift_every_s` (`shift_share` of it on the busy half, the rest on the other).
    Shift,
    /// Key `k` starts at `k * cold_stagger_ms`: new keys keep arriving.
    Cold,
    /// Uniform over gateways, every key's load following
    /// `load * (1 + diurnal_amplitude * sin(2 pi t / diurnal_period_s))` (in 50 ms steps).
    Diurnal,
}

/// Offered load.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    /// The shape.
    pub kind: WorkloadKind,
    /// Offered tokens per second per key, as a multiple of `R`.
    pub load: f64,
    /// Smallest request cost, tokens.
    #[serde(default = "default_cost_min")]
    pub cost_min: u64,
    /// Largest request cost, tokens (uniform in between).
    #[serde(default = "default_cost_max")]
    pub cost_max: u64,
    /// Zipf exponent (`zipf`).
    #[serde(default = "default_zipf_s")]
    pub zipf_s: f64,
    /// The whale's load, multiple of `R` (`whale`).
    #[serde(default = "default_whale_load")]
    pub whale_load: f64,
    /// When the whale arrives, s after traffic starts (`whale`).
    #[serde(default)]
    pub whale_at_s: f64,
    /// Period of the shift (`shift`).
    #[serde(default = "default_shift_every_s")]
    pub shift_every_s: f64,
    /// Share of the requests the busy half gets (`shift`), 0.5 to 1: below 1 the quiet
    /// half keeps some demand, and with `load` high enough both halves stay over their
    /// shares while the shares move (what a policy without revoke-before-grant
    /// overshoots on).
    #[serde(default = "default_shift_share")]
    pub shift_share: f64,
    /// Delay between two keys' first requests (`cold`).
    #[serde(default = "default_cold_stagger_ms")]
    pub cold_stagger_ms: f64,
    /// Period of the day (`diurnal`), s.
    #[serde(default = "default_diurnal_period_s")]
    pub diurnal_period_s: f64,
    /// Swing around `load`, 0 to 1 (`diurnal`).
    #[serde(default = "default_diurnal_amplitude")]
    pub diurnal_amplitude: f64,
    /// LLM-like costs: the rule limits `total_tokens`; input tokens are lognormal
    /// (median `sqrt(cost_min * cost_max)`, `input_sigma`, clamped to
    /// `[cost_min, cost_max]`); each request reserves `output_max_tokens` and actually
    /// generates a uniform 10-100 % of it, completing `ms_per_output_token` per token
    /// later (the unused reservation is refunded then).
    #[serde(default)]
    pub llm: bool,
    /// Output tokens reserved per request (`llm`).
    #[serde(default = "default_output_max_tokens")]
    pub output_max_tokens: u64,
    /// Sigma of the lognormal input size (`llm`).
    #[serde(default = "default_input_sigma")]
    pub input_sigma: f64,
    /// Generation time per output token, ms (`llm`).
    #[serde(default = "default_ms_per_output_token")]
    pub ms_per_output_token: f64,
}

fn default_diurnal_period_s() -> f64 {
    10.0
}
fn default_diurnal_amplitude() -> f64 {
    0.5
}
fn default_output_max_tokens() -> u64 {
    256
}
fn default_input_sigma() -> f64 {
    1.0
}
fn default_ms_per_output_token() -> f64 {
    2.0
}

fn default_cost_min() -> u64 {
    20
}
fn default_cost_max() -> u64 {
    200
}
fn default_zipf_s() -> f64 {
    1.0
}
fn default_whale_load() -> f64 {
    3.0
}
fn default_shift_share() -> f64 {
    1.0
}
fn default_shift_every_s() -> f64 {
    5.0
}
fn default_cold_stagger_ms() -> f64 {
    10.0
}

/// What goes wrong.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// Messages between `agents` and the allocator are lost.
    Partition,
    /// The allocator loses every agent (all its links are cut) but keeps running; names
    /// no agents.
    AllocatorPartition,
    /// The allocator process dies; a new term starts `for_s` later.
    AllocatorCrash,
    /// `agents` die (their engines are dropped); new incarnations start `for_s` later.
    AgentCrash,
    /// `agents` are absent from the start and join at `at_s` (scale-up; a scale-down
    /// is an `agent-crash` that outlasts the run).
    AgentJoin,
}

/// One fault over `[at_s, at_s + for_s)` (seconds after traffic starts).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// The fault.
    pub kind: FaultKind,
    /// Start, s after traffic starts.
    pub at_s: f64,
    /// Length, s (not used by `agent-join`).
    #[serde(default)]
    pub for_s: f64,
    /// Gateway indices (partition, agent crash).
    #[serde(default)]
    pub agents: Vec<usize>,
}

/// Settings given on the command line over a scenario's own (`run` and `sweep` flags);
/// `None` keeps the scenario's value.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Overrides {
    /// `gateways`.
    pub gateways: Option<usize>,
    /// `keys`.
    pub keys: Option<usize>,
    /// `duration_s`.
    pub duration_s: Option<f64>,
    /// `network.latency_ms` (every agent-allocator link, one way).
    pub latency_ms: Option<f64>,
    /// `network.jitter_ms`.
    pub jitter_ms: Option<f64>,
    /// `allocator.report_interval_ms` (also the Gubernator-like policy's sync interval).
    pub report_interval_ms: Option<u64>,
    /// `allocator.lease_ms` (the grants' TTL).
    pub lease_ms: Option<u64>,
    /// `limit.burst`.
    pub burst: Option<u64>,
    /// `allocator.overdraft_permille`.
    pub overdraft_permille: Option<u32>,
    /// `allocator.hysteresis_permille`.
    pub hysteresis_permille: Option<u32>,
    /// `allocator.measure_window_ms`.
    pub measure_window_ms: Option<u64>,
}

/// An hour in ms: the largest one-way latency, jitter or cold-key stagger.
const HOUR_MS: f64 = 3_600_000.0;
/// A day in s: the longest run, the latest a fault or the whale may start, and the
/// longest shift period.
const DAY_S: f64 = 86_400.0;
/// The most requests per second the workload may offer one key (at its peak: the
/// whale's load, the diurnal crest): past it a run is no longer a simulation of a
/// gateway fleet but a hang.
pub const MAX_REQUESTS_PER_KEY_PER_S: f64 = 1e6;

impl Overrides {
    /// Applies every override given, then validates the result.
    pub fn apply(&self, sc: &mut Scenario) -> Result<(), ScenarioError> {
        if let Some(g) = self.gateways {
            sc.gateways = g;
        }
        if let Some(k) = self.keys {
            sc.keys = k;
        }
        if let Some(d) = self.duration_s {
            sc.duration_s = d;
        }
        if let Some(l) = self.latency_ms {
            sc.network.latency_ms = l;
        }
        if let Some(j) = self.jitter_ms {
            sc.network.jitter_ms = j;
        }
        if let Some(r) = self.report_interval_ms {
            sc.allocator.report_interval_ms = r;
        }
        if let Some(l) = self.lease_ms {
            sc.allocator.lease_ms = l;
        }
        if let Some(b) = self.burst {
            sc.limit.burst = b;
        }
        if let Some(o) = self.overdraft_permille {
            sc.allocator.overdraft_permille = o;
        }
        if let Some(h) = self.hysteresis_permille {
            sc.allocator.hysteresis_permille = h;
        }
        if let Some(m) = self.measure_window_ms {
            sc.allocator.measure_window_ms = m;
        }
        sc.validate()
    }

    /// The flags that give these overrides, in a fixed order (for replay commands).
    pub fn flags(&self) -> String {
        let mut c = String::new();
        let mut flag = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                c += &format!(" --{name} {v}");
            }
        };
        flag("gateways", self.gateways.map(|x| x.to_string()));
        flag("keys", self.keys.map(|x| x.to_string()));
        flag("duration-s", self.duration_s.map(|x| x.to_string()));
        flag("latency-ms", self.latency_ms.map(|x| x.to_string()));
        flag("jitter-ms", self.jitter_ms.map(|x| x.to_string()));
        flag(
            "report-interval-ms",
            self.report_interval_ms.map(|x| x.to_string()),
        );
        flag("lease-ms", self.lease_ms.map(|x| x.to_string()));
        flag("burst", self.burst.map(|x| x.to_string()));
        flag(
            "overdraft-permille",
            self.overdraft_permille.map(|x| x.to_string()),
        );
        flag(
            "hysteresis-permille",
            self.hysteresis_permille.map(|x| x.to_string()),
        );
        flag(
            "measure-window-ms",
            self.measure_window_ms.map(|x| x.to_string()),
        );
        c
    }
}

impl Scenario {
    /// Parses TOML; `name` labels errors.
    pub fn from_toml(name: &str, text: &str) -> Result<Scenario, ScenarioError> {
        let s: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            name: name.to_string(),
            message: e.to_string(),
        })?;
        s.validate_as(name)?;
        Ok(s)
    }

    /// A built-in by name, or else a file by path.
    pub fn load(name_or_path: &str) -> Result<Scenario, ScenarioError> {
        if let Some((_, text)) = BUILT_INS.iter().find(|b| b.0 == name_or_path) {
            return Scenario::from_toml(name_or_path, text);
        }
        let path = Path::new(name_or_path);
        let looks_like_path = name_or_path.ends_with(".toml") || name_or_path.contains('/');
        match std::fs::read_to_string(path) {
            Ok(text) => Scenario::from_toml(name_or_path, &text),
            Err(source) if looks_like_path => Err(ScenarioError::Io {
                path: name_or_path.to_string(),
                source,
            }),
            Err(_) => Err(ScenarioError::Unknown(name_or_path.to_string())),
        }
    }

    /// Checks every documented constraint.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        self.validate_as(&self.name)
    }

    fn validate_as(&self, name: &str) -> Result<(), ScenarioError> {
        let bad = |field: &str, reason: &str| {
            Err(ScenarioError::Invalid {
                name: name.to_string(),
                field: field.to_string(),
                reason: reason.to_string(),
            })
        };
        let finite_nonneg = |x: f64| x.is_finite() && x >= 0.0;
        if self.gateways == 0 || self.gateways > 4_096 {
            return bad(
                "gateways",
                "must be 1 to 4,096 (the allocator's max_agents)",
            );
        }
        if self.keys == 0 || self.keys > 1_000_000 {
            return bad("keys", "must be 1 to 1,000,000");
        }
        if !(self.duration_s.is_finite() && self.duration_s > 0.0 && self.duration_s <= 86_400.0) {
            return bad("duration_s", "must be above 0 and at most 86,400");
        }
        if self.limit.rate_per_s == 0 || self.limit.burst == 0 {
            return bad("limit", "rate_per_s and burst must be at least 1");
        }
        // The agents' rule parser refuses more (so no run could start), and every sum
        // of costs below stays far inside a u64.
        if self.limit.rate_per_s > MAX_COST {
            return bad(
                "limit.rate_per_s",
                &format!("must be at most {MAX_COST} (2^40)"),
            );
        }
        if self.limit.burst > MAX_COST {
            return bad("limit.burst", &format!("must be at most {MAX_COST} (2^40)"));
        }
        if self.limit.typical_cost > self.limit.burst {
            return bad("limit.typical_cost", "must not exceed the burst");
        }
        if !["strict", "conservative", "open"].contains(&self.limit.posture.as_str()) {
            return bad("limit.posture", "must be strict, conservative or open");
        }
        let a = &self.allocator;
        if a.lease_ms <= 200 || a.lease_ms > 3_600_000 {
            return bad(
                "allocator.lease_ms",
                "must be above the allocator's drift margin (200 ms) and at most 3,600,000",
            );
        }
        // The rest of the allocator's settings are checked by the allocator itself, so
        // a scenario accepts exactly what a real allocator would.
        if let Err(e) = a.config(self.gateways).validate() {
            return bad(&format!("allocator.{}", e.field), &e.reason);
        }
        // At most an hour: in ns, a much longer interval overflows the clock's sums.
        for (field, ms) in [
            ("allocator.report_interval_ms", a.report_interval_ms),
            ("allocator.new_key_poll_ms", a.new_key_poll_ms),
        ] {
            if ms == 0 || ms as f64 > HOUR_MS {
                return bad(field, "must be 1 to 3,600,000");
            }
        }
        if a.full_report_every == 0 {
            return bad("allocator.full_report_every", "must be at least 1");
        }
        for l in &self.links {
            if l.agents.is_empty() {
                return bad("link.agents", "a link names at least one gateway");
            }
            if let Some(&i) = l.agents.iter().find(|&&i| i >= self.gateways) {
                return bad(
                    "link.agents",
                    &format!("names gateway {i}, but there are {}", self.gateways),
                );
            }
        }
        // `[network]` first (every link starts from it), then each gateway's as its
        // `[[link]]`s leave it (a value that is bad there came from a link).
        let named = std::iter::once(("network", self.network.clone()))
            .chain(self.link_specs().into_iter().map(|n| ("link", n)));
        for (at, n) in named {
            // At most an hour one way: past that the nanosecond clock's sums overflow
            // long before anything could arrive.
            if !(finite_nonneg(n.latency_ms) && n.latency_ms <= HOUR_MS) {
                return bad(&format!("{at}.latency_ms"), "must be 0 to 3,600,000");
            }
            if !(finite_nonneg(n.jitter_ms) && n.jitter_ms <= HOUR_MS) {
                return bad(&format!("{at}.jitter_ms"), "must be 0 to 3,600,000");
            }
            if !(0.0..=1.0).contains(&n.loss) {
                return bad(&format!("{at}.loss"), "must be 0 to 1");
            }
            if n.reorder && n.jitter_ms == 0.0 {
                return bad(
                    &format!("{at}.reorder"),
                    "needs jitter_ms above 0: with a fixed latency every message takes the \
                     same time and none can overtake another",
                );
            }
        }
        if !(finite_nonneg(self.clock_drift_ppm) && self.clock_drift_ppm <= 100_000.0) {
            return bad("clock_drift_ppm", "must be 0 to 100,000");
        }
        let w = &self.workload;
        if !finite_nonneg(w.load) {
            return bad("workload.load", "must be a number >= 0");
        }
        if !finite_nonneg(w.whale_load) {
            return bad("workload.whale_load", "must be a number >= 0");
        }
        if w.cost_min == 0 || w.cost_max < w.cost_min {
            return bad("workload.cost_min", "need 1 <= cost_min <= cost_max");
        }
        // Checked: both are only bounded by the burst here.
        let largest = w
            .cost_max
            .checked_add(if w.llm { w.output_max_tokens } else { 0 });
        if largest.is_none_or(|l| l > self.limit.burst) {
            return bad(
                "workload.cost_max",
                "the largest request (plus output_max_tokens with llm) must not exceed the burst",
            );
        }
        if !finite_nonneg(w.input_sigma) {
            return bad("workload.input_sigma", "must be a number >= 0");
        }
        // A request's generation time, at most an hour (in ns, much more overflows the
        // completion time).
        let generation_ms = w.output_max_tokens as f64 * w.ms_per_output_token;
        if !(finite_nonneg(w.ms_per_output_token)
            && w.ms_per_output_token <= HOUR_MS
            && (!w.llm || generation_ms <= HOUR_MS))
        {
            return bad(
                "workload.ms_per_output_token",
                "must be a number >= 0 with ms_per_output_token * output_max_tokens at most \
                 3,600,000 (an hour's generation)",
            );
        }
        // The offered requests per second per key at the workload's peak.
        let mean_cost = crate::sim::mean_cost(w);
        let per_s = |load: f64| load * self.limit.rate_per_s as f64 / mean_cost;
        let crest = if w.kind == WorkloadKind::Diurnal {
            1.0 + w.diurnal_amplitude.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let too_many = format!(
            "offers more than {MAX_REQUESTS_PER_KEY_PER_S:e} requests per key per second \
             (load * rate_per_s / the mean request cost)"
        );
        if per_s(w.load * crest) > MAX_REQUESTS_PER_KEY_PER_S {
            return bad("workload.load", &too_many);
        }
        if w.kind == WorkloadKind::Whale && per_s(w.whale_load) > MAX_REQUESTS_PER_KEY_PER_S {
            return bad("workload.whale_load", &too_many);
        }
        if !(w.zipf_s.is_finite() && w.zipf_s >= 0.0) {
            return bad("workload.zipf_s", "must be a number >= 0");
        }
        if !(w.shift_every_s.is_finite() && w.shift_every_s > 0.0 && w.shift_every_s <= DAY_S) {
            return bad(
                "workload.shift_every_s",
                "must be above 0 and at most 86,400",
            );
        }
        if !(0.5..=1.0).contains(&w.shift_share) {
            return bad("workload.shift_share", "must be 0.5 to 1");
        }
        let whale_ok = finite_nonneg(w.whale_at_s) && w.whale_at_s <= DAY_S;
        let stagger_ok = finite_nonneg(w.cold_stagger_ms) && w.cold_stagger_ms <= HOUR_MS;
        if !(whale_ok && stagger_ok) {
            return bad(
                "workload",
                "whale_at_s must be 0 to 86,400 and cold_stagger_ms 0 to 3,600,000",
            );
        }
        let period_ok = w.diurnal_period_s.is_finite() && w.diurnal_period_s > 0.0;
        if !(period_ok && (0.0..=1.0).contains(&w.diurnal_amplitude)) {
            return bad(
                "workload.diurnal_period_s",
                "diurnal_period_s must be above 0 and diurnal_amplitude 0 to 1",
            );
        }
        if w.kind == WorkloadKind::Shift && self.gateways < 2 {
            return bad("gateways", "a shift needs at least 2 gateways");
        }
        for f in &self.faults {
            let length_ok = f.kind == FaultKind::AgentJoin || f.for_s > 0.0;
            let in_a_day = f.at_s <= DAY_S && f.for_s <= DAY_S;
            if !(finite_nonneg(f.at_s) && f.for_s.is_finite() && length_ok && in_a_day) {
                return bad(
                    "fault",
                    "at_s must be 0 to 86,400 and for_s above 0, at most 86,400",
                );
            }
            if let Some(&i) = f.agents.iter().find(|&&i| i >= self.gateways) {
                return bad(
                    "fault.agents",
                    &format!("names gateway {i}, but there are {}", self.gateways),
                );
            }
            let whole_allocator = matches!(
                f.kind,
                FaultKind::AllocatorCrash | FaultKind::AllocatorPartition
            );
            if whole_allocator && !f.agents.is_empty() {
                return bad(
                    "fault.agents",
                    "an allocator crash or allocator partition names no agents",
                );
            }
            if !whole_allocator && f.agents.is_empty() {
                return bad(
                    "fault.agents",
                    "a partition, agent crash or agent join names agents",
                );
            }
        }
        // One down time at a time per target: a second crash inside (or touching) the
        // first restarted the target at the earlier end, or twice; two allocator
        // crashes left agents on a term that had gone. A join is down time from 0.
        // (Partitions may overlap: a link is cut while any cuts it.)
        let mut down: Vec<(Option<usize>, f64, f64, usize)> = Vec::new();
        for (n, f) in self.faults.iter().enumerate() {
            match f.kind {
                FaultKind::AllocatorCrash => down.push((None, f.at_s, f.at_s + f.for_s, n)),
                FaultKind::AgentCrash => down.extend(
                    f.agents
                        .iter()
                        .map(|&i| (Some(i), f.at_s, f.at_s + f.for_s, n)),
                ),
                FaultKind::AgentJoin => {
                    down.extend(f.agents.iter().map(|&i| (Some(i), 0.0, f.at_s, n)))
                }
                FaultKind::Partition | FaultKind::AllocatorPartition => {}
            }
        }
        down.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        for w in down.windows(2) {
            let ((target, _, end, first), (next, start, _, second)) = (w[0], w[1]);
            if target == next && start <= end {
                let what = match target {
                    None => "the allocator".to_string(),
                    Some(i) => format!("gateway {i}"),
                };
                let (first, second) = (first.min(second), first.max(second));
                return bad(
                    "fault.at_s",
                    &format!(
                        "faults #{} and #{} take {what} down over overlapping or touching \
                         times (a crash, or a join's absence from 0 to at_s): one at a \
                         time, each starting after the last has ended",
                        first + 1,
                        second + 1
                    ),
                );
            }
        }
        Ok(())
    }

    /// True if any fault that starts within the run can make an agent admit outside
    /// the allocator's budget.
    pub fn has_partition(&self) -> bool {
        self.faults.iter().any(|f| {
            f.at_s < self.duration_s
                && matches!(
                    f.kind,
                    FaultKind::Partition
                        | FaultKind::AllocatorPartition
                        | FaultKind::AllocatorCrash
                )
        })
    }

    /// A line per fault that starts at or after the run's end (a shortened
    /// `--duration-s` leaves it out): it will not happen.
    pub fn faults_after_end(&self) -> Vec<String> {
        self.faults
            .iter()
            .enumerate()
            .filter(|(_, f)| f.at_s >= self.duration_s)
            .map(|(i, f)| {
                format!(
                    "fault #{} ({:?} at {} s) starts after the run's end ({} s): it will not happen",
                    i + 1,
                    f.kind,
                    f.at_s,
                    self.duration_s
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_parses_and_validates() {
        for (name, _) in BUILT_INS {
            let s = Scenario::load(name).unwrap();
            assert_eq!(&s.name, name);
        }
    }

    #[test]
    fn an_unknown_field_is_named() {
        let text = BUILT_INS[0]
            .1
            .replace("gateways =", "gatewayz = 3\ngateways =");
        let e = Scenario::from_toml("x", &text).unwrap_err();
        assert!(e.to_string().contains("unknown field `gatewayz`"), "{e}");
    }

    #[test]
    fn zero_gateways_is_refused_with_the_field_name() {
        let mut s = Scenario::load("steady").unwrap();
        s.gateways = 0;
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("`gateways`"), "{e}");
    }

    #[test]
    fn a_hysteresis_band_past_the_whole_grant_is_refused_with_the_field_name() {
        let mut s = Scenario::load("zipf").unwrap();
        s.allocator.hysteresis_permille = 1_001;
        let e = s.validate().unwrap_err();
        assert!(
            e.to_string().contains("allocator.hysteresis_permille"),
            "{e}"
        );
        s.allocator.hysteresis_permille = 1_000;
        s.validate().unwrap();
    }

    #[test]
    fn a_typical_cost_above_the_burst_is_refused_with_the_field_name() {
        let mut s = Scenario::load("sparse").unwrap();
        s.limit.typical_cost = s.limit.burst + 1;
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("limit.typical_cost"), "{e}");
        s.limit.typical_cost = s.limit.burst;
        s.validate().unwrap();
    }

    #[test]
    fn links_override_the_network_for_the_gateways_they_name_later_ones_winning() {
        let text = format!(
            "{}\n[network]\nlatency_ms = 3.0\nloss = 0.01\n\n\
             [[link]]\nagents = [1, 2]\nlatency_ms = 50.0\n\n\
             [[link]]\nagents = [2]\nlatency_ms = 80.0\njitter_ms = 5.0\nreorder = true\n",
            include_str!("../scenarios/steady.toml")
        );
        let s = Scenario::from_toml("x", &text).unwrap();
        let l = s.link_specs();
        assert_eq!(l.len(), s.gateways);
        assert_eq!(l[0], s.network);
        assert_eq!(
            (l[1].latency_ms, l[1].jitter_ms, l[1].loss),
            (50.0, 1.0, 0.01)
        );
        assert_eq!(
            (l[2].latency_ms, l[2].jitter_ms, l[2].loss),
            (80.0, 5.0, 0.01)
        );
        assert!(l[2].reorder && !l[1].reorder);
        assert_eq!(l[3], s.network);
    }

    #[test]
    fn a_bad_link_is_refused_with_the_field_name() {
        let base = include_str!("../scenarios/steady.toml"); // 16 gateways
        for (link, field) in [
            ("agents = [16]", "link.agents"),
            ("agents = []", "link.agents"),
            ("agents = [0]\nlatency_ms = -1.0", "link.latency_ms"),
            ("agents = [0]\njitter_ms = nan", "link.jitter_ms"),
            ("agents = [0]\nloss = 1.5", "link.loss"),
            (
                "agents = [0]\njitter_ms = 0.0\nreorder = true",
                "link.reorder",
            ),
            ("agents = [0]\nlatency = 5.0", "unknown field `latency`"),
        ] {
            let text = format!("{base}\n[[link]]\n{link}\n");
            let e = Scenario::from_toml("x", &text).unwrap_err();
            assert!(e.to_string().contains(field), "{link}: {e}");
        }
    }

    #[test]
    fn a_shift_share_outside_half_to_one_is_refused_with_the_field_name() {
        let shift = BUILT_INS.iter().find(|b| b.0 == "shift").unwrap().1;
        for v in ["0.4", "1.5", "nan"] {
            let text = shift.replace(
                "kind = \"shift\"",
                &format!("kind = \"shift\"\nshift_share = {v}"),
            );
            let e = Scenario::from_toml("x", &text).unwrap_err();
            assert!(e.to_string().contains("workload.shift_share"), "{v}: {e}");
        }
    }

    #[test]
    fn negative_latency_is_refused_with_the_field_name() {
        let text = format!("{}\n[network]\nlatency_ms = -1.0\n", BUILT_INS[0].1);
        let e = Scenario::from_toml("x", &text).unwrap_err();
        assert!(e.to_string().contains("network.latency_ms"), "{e}");
    }

    /// Review, twenty-eighth session: times were only checked to be >= 0, so a latency
    /// of 1e14 ms or a fault at 1e11 s saturated the nanosecond clock and its sums
    /// overflowed (a panic in debug, messages delivered in the past in release).
    #[test]
    fn times_past_what_the_clock_can_add_are_refused_with_the_field_name() {
        let text = format!(
            "{}
[network]
latency_ms = 1e14
",
            BUILT_INS[0].1
        );
        let e = Scenario::from_toml("x", &text).unwrap_err();
        assert!(e.to_string().contains("network.latency_ms"), "{e}");
        let mut s = Scenario::load("partition-one").unwrap();
        s.faults[0].at_s = 1e11;
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("fault"), "{e}");
        let mut s = Scenario::load("whale").unwrap();
        s.workload.whale_at_s = 1e11;
        assert!(s.validate().is_err());
    }

    /// Review, thirty-first session: values whose products or sums overflowed the
    /// nanosecond clock or a u64 (an output of 1e15 ms per token, a shift period of
    /// 1e11 s, a report interval of 1e14 ms, a request of u64::MAX tokens), or that
    /// made a run hang (a load of 1e9 R), were accepted.
    #[test]
    fn values_that_overflow_or_hang_a_run_are_refused_with_the_field_name() {
        type Edit = fn(&mut Scenario);
        let cases: &[(&str, Edit, &str)] = &[
            (
                "llm-zipf",
                |s| s.workload.ms_per_output_token = 1e15,
                "workload.ms_per_output_token",
            ),
            // 256 tokens of 15 s: over an hour.
            (
                "llm-zipf",
                |s| s.workload.ms_per_output_token = 15_000.0,
                "workload.ms_per_output_token",
            ),
            (
                "shift",
                |s| s.workload.shift_every_s = 1e11,
                "workload.shift_every_s",
            ),
            (
                "steady",
                |s| s.allocator.report_interval_ms = 20_000_000_000_000,
                "allocator.report_interval_ms",
            ),
            (
                "steady",
                |s| s.allocator.report_interval_ms = 3_600_001,
                "allocator.report_interval_ms",
            ),
            (
                "steady",
                |s| s.allocator.new_key_poll_ms = 20_000_000_000_000,
                "allocator.new_key_poll_ms",
            ),
            (
                "steady",
                |s| s.allocator.full_report_every = 0,
                "allocator.full_report_every",
            ),
            ("steady", |s| s.workload.load = 1e9, "workload.load"),
            // 4,000 R of 110-token requests is 7.3e5 a second, but 1.6 times that at the crest.
            ("diurnal", |s| s.workload.load = 4_000.0, "workload.load"),
            (
                "whale",
                |s| s.workload.whale_load = 1e9,
                "workload.whale_load",
            ),
            (
                "whale",
                |s| s.workload.whale_load = f64::NAN,
                "workload.whale_load",
            ),
            ("steady", |s| s.limit.burst = MAX_COST + 1, "limit.burst"),
            (
                "steady",
                |s| s.limit.rate_per_s = MAX_COST + 1,
                "limit.rate_per_s",
            ),
            (
                "llm-zipf",
                |s| {
                    s.limit.burst = u64::MAX;
                    s.workload.cost_max = u64::MAX;
                },
                "limit.burst",
            ),
        ];
        for (name, edit, field) in cases {
            let mut s = Scenario::load(name).unwrap();
            edit(&mut s);
            let e = s.validate().unwrap_err();
            assert!(
                e.to_string().contains(&format!("`{field}`")),
                "{name}, {field}: {e}"
            );
        }
        // The cost sum is checked, not wrapped, whatever the order of the checks.
        let mut s = Scenario::load("llm-zipf").unwrap();
        s.limit.burst = MAX_COST;
        s.workload.cost_max = MAX_COST;
        s.workload.output_max_tokens = u64::MAX;
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("`workload."), "{e}");
        // Just inside: 1,000 R of 20-200 token requests is 1.8e5 requests a second.
        let mut s = Scenario::load("steady").unwrap();
        s.workload.load = 1_000.0;
        s.validate().unwrap();
        let mut s = Scenario::load("llm-zipf").unwrap();
        s.workload.ms_per_output_token = 14_000.0; // 256 x 14 s: just under an hour
        s.validate().unwrap();
    }

    /// Review, thirty-first session: two crash windows over one target (or a crash
    /// of a gateway before it joins) each restarted it: early, inside the longer
    /// window, or twice; two allocator crashes left the agents on a dead term.
    #[test]
    fn overlapping_down_times_of_one_target_are_refused_with_the_field_name() {
        let crash = |kind, at_s: f64, for_s: f64, agents: Vec<usize>| FaultSpec {
            kind,
            at_s,
            for_s,
            agents,
        };
        use FaultKind::{AgentCrash, AgentJoin, AllocatorCrash, Partition};
        let cases = [
            // Two agent crashes on gateway 1, the second inside the first.
            vec![
                crash(AgentCrash, 1.0, 3.0, vec![0, 1]),
                crash(AgentCrash, 2.0, 1.0, vec![1]),
            ],
            // Listed the other way round, and touching.
            vec![
                crash(AgentCrash, 4.0, 1.0, vec![1]),
                crash(AgentCrash, 1.0, 3.0, vec![1]),
            ],
            // One gateway named twice by one crash.
            vec![crash(AgentCrash, 1.0, 1.0, vec![2, 2])],
            // A crash of a gateway before it joins.
            vec![
                crash(AgentJoin, 3.0, 0.0, vec![5]),
                crash(AgentCrash, 1.0, 1.0, vec![5]),
            ],
            // Two joins of one gateway.
            vec![
                crash(AgentJoin, 3.0, 0.0, vec![5]),
                crash(AgentJoin, 4.0, 0.0, vec![5]),
            ],
            // Two allocator crashes.
            vec![
                crash(AllocatorCrash, 1.0, 3.0, vec![]),
                crash(AllocatorCrash, 2.0, 3.0, vec![]),
            ],
        ];
        for faults in cases {
            let mut s = Scenario::load("steady").unwrap();
            s.faults = faults.clone();
            let e = s.validate().unwrap_err();
            assert!(e.to_string().contains("`fault.at_s`"), "{faults:?}: {e}");
            assert!(e.to_string().contains("overlapping"), "{faults:?}: {e}");
        }
        // Apart, or on different targets, or partitions: fine.
        let mut s = Scenario::load("steady").unwrap();
        s.faults = vec![
            crash(AgentCrash, 1.0, 1.0, vec![1]),
            crash(AgentCrash, 2.5, 1.0, vec![1]),
            crash(AgentCrash, 1.5, 1.0, vec![2]),
            crash(AgentJoin, 3.0, 0.0, vec![3]),
            crash(AgentCrash, 3.5, 1.0, vec![3]),
            crash(AllocatorCrash, 1.0, 1.0, vec![]),
            crash(AllocatorCrash, 2.5, 1.0, vec![]),
            crash(Partition, 1.0, 3.0, vec![1]),
            crash(Partition, 2.0, 3.0, vec![1]),
        ];
        s.validate().unwrap();
    }

    #[test]
    fn a_fault_after_a_shortened_run_is_named_and_is_no_partition() {
        let mut s = Scenario::load("partition-one").unwrap();
        assert!(s.has_partition() && s.faults_after_end().is_empty());
        s.duration_s = s.faults[0].at_s;
        assert!(!s.has_partition(), "a fault at the end never happens");
        let notes = s.faults_after_end();
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("will not happen"), "{notes:?}");
    }

    #[test]
    fn an_allocator_fault_names_no_agents_and_an_agent_fault_names_some() {
        let mut s = Scenario::load("allocator-partition").unwrap();
        assert!(s.has_partition());
        s.faults[0].agents = vec![0];
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("names no agents"), "{e}");
        let mut s = Scenario::load("partition-one").unwrap();
        s.faults[0].agents.clear();
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("names agents"), "{e}");
    }

    #[test]
    fn a_missing_file_says_which_path() {
        let e = Scenario::load("/nonexistent/dir/none.toml").unwrap_err();
        assert!(matches!(e, ScenarioError::Io { .. }));
        assert!(e.to_string().contains("/nonexistent/dir/none.toml"), "{e}");
        let e = Scenario::load("no-such-built-in").unwrap_err();
        assert!(e.to_string().contains("built-ins: steady"), "{e}");
    }
}
