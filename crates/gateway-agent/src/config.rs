//! Rules and engine settings, loaded from TOML and validated at load.
//!
//! The file has an optional `[engine]` table and any number of `[[rule]]` tables. Every
//! error names the rule (by `name`, or by position when the name is missing) and the
//! field at fault, and nothing is half-loaded: a file either becomes a whole [`Config`]
//! or an error.
//!
//! ```toml
//! [engine]
//! max_keys = 100_000
//!
//! [[rule]]
//! name = "org-input-tpm"
//! match = { org = "*" }
//! dimension = "input_tokens"
//! rate = 2_000_000
//! per = "minute"
//!
//! [[rule]]
//! name = "key-input-tpm"
//! parent = "org-input-tpm"
//! match = { org = "*", key = "*" }
//! dimension = "input_tokens"
//! rate = 500_000
//! per = "minute"
//! ```

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use toml::{Table, Value};

/// Largest cost (and burst) one request or one rule may name: 2^40, about 1.1e12
/// tokens. Larger numbers are operator or client errors, and bounding them keeps every
/// bucket computation inside 128-bit integers.
pub const MAX_COST: u64 = 1 << 40;

/// Largest rate a rule may name per period (same bound as [`MAX_COST`]).
pub const MAX_RATE: u64 = MAX_COST;

/// Largest time a bucket may take to refill from empty to full (2^62 ns, ~146 years).
/// A rule whose `burst / rate * per` exceeds it is rejected at load.
pub const MAX_REFILL_NS: u128 = 1 << 62;

/// Most rules one request may match (each matched rule is one bucket in the lease).
pub const MAX_LIMITS_PER_REQUEST: usize = 8;

/// Most descriptor entries a request may carry.
pub const MAX_DESCRIPTORS: usize = 16;

/// Longest descriptor key or value, in bytes.
pub const MAX_DESCRIPTOR_BYTES: usize = 256;

/// Longest request id, in bytes. Leases store the id inline (no allocation per admit).
pub const MAX_REQUEST_ID_BYTES: usize = 128;

/// Parses a cost or usage count given as text (a header, a query parameter, a
/// descriptor value): a whole number from 0 to [`MAX_COST`]. The error names the field
/// and says what was wrong; front doors answer it with HTTP 400.
pub fn parse_units(field: &str, text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err(format!("{field}: empty, expected a whole number"));
    }
    if t.starts_with('-') {
        return Err(format!("{field}: {t:?} is negative"));
    }
    if !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{field}: {t:?} is not a whole number"));
    }
    match t.parse::<u64>() {
        Ok(v) if v <= MAX_COST => Ok(v),
        _ => Err(format!("{field}: {t} is above the maximum of {MAX_COST}")),
    }
}

/// What a rule limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dimension {
    /// Requests; each admit costs `cost.requests` (1 unless the caller says otherwise).
    Requests,
    /// Prompt tokens, known at admission.
    InputTokens,
    /// Completion tokens: reserved as `min(max_tokens, cap)` and reconciled at completion.
    OutputTokens,
    /// Input plus reserved output.
    TotalTokens,
    /// Requests in flight, as slots: taken at admission, released at completion or expiry.
    Concurrency,
}

impl Dimension {
    /// The name used in config files, headers and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Requests => "requests",
            Dimension::InputTokens => "input_tokens",
            Dimension::OutputTokens => "output_tokens",
            Dimension::TotalTokens => "total_tokens",
            Dimension::Concurrency => "concurrency",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "requests" => Dimension::Requests,
            "input_tokens" => Dimension::InputTokens,
            "output_tokens" => Dimension::OutputTokens,
            "total_tokens" => Dimension::TotalTokens,
            "concurrency" => Dimension::Concurrency,
            _ => return None,
        })
    }
}

impl fmt::Display for Dimension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The period a rule's `rate` is counted over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Period {
    /// One second.
    Second,
    /// Sixty seconds.
    Minute,
    /// One hour.
    Hour,
    /// Twenty-four hours.
    Day,
}

impl Period {
    /// Length of the period in nanoseconds.
    pub fn as_ns(self) -> u64 {
        match self {
            Period::Second => 1_000_000_000,
            Period::Minute => 60_000_000_000,
            Period::Hour => 3_600_000_000_000,
            Period::Day => 86_400_000_000_000,
        }
    }

    /// The name used in config files.
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Second => "second",
            Period::Minute => "minute",
            Period::Hour => "hour",
            Period::Day => "day",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "second" => Period::Second,
            "minute" => Period::Minute,
            "hour" => Period::Hour,
            "day" => Period::Day,
            _ => return None,
        })
    }
}

/// Whether a rule rejects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Rejections are enforced.
    Enforce,
    /// The rule is evaluated and its would-be rejections counted, but it never rejects.
    Shadow,
}

/// What an agent does with a key once its allocator lease has ended (DESIGN.md,
/// "Leases and partitions"). Only used when slices come from an allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Posture {
    /// Reject everything on the key: overshoot bound 0 while partitioned.
    Strict,
    /// Keep `min(last grant, limit / fleet size)`.
    Conservative,
    /// Keep the last grant.
    Open,
}

/// How a rule matches one descriptor entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// `"*"`: any value, and each distinct value is its own limit key.
    Each,
    /// Exactly this value.
    Exact(Box<str>),
}

/// The budget a rule grants (before any allocator splits it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleLimit {
    /// A token bucket: `rate` units per `per`, holding at most `burst`.
    Rate {
        /// Units per period.
        rate: u64,
        /// The period.
        per: Period,
        /// Bucket capacity (defaults to `rate`).
        burst: u64,
    },
    /// At most this many requests in flight.
    Concurrency {
        /// Slots.
        max_in_flight: u64,
    },
}

/// One validated rule.
#[derive(Clone, Debug)]
pub struct Rule {
    /// Unique name; appears in decisions, headers, metrics and errors.
    pub name: String,
    /// Envoy RLS domain. `None` matches requests of every domain.
    pub domain: Option<String>,
    /// Descriptor key and pattern pairs, sorted by key. Empty matches every request.
    pub matches: Vec<(String, Pattern)>,
    /// What the rule limits.
    pub dimension: Dimension,
    /// The budget.
    pub limit: RuleLimit,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Partition posture (allocator mode only).
    pub posture: Posture,
    /// Index of the parent rule (`parent = "..."`), whose match keys are a subset.
    pub parent: Option<usize>,
    /// Output tokens reserved when a request does not name `max_tokens`.
    pub max_output_tokens_default: u64,
    /// Output tokens reserved at most, whatever `max_tokens` says. Output beyond the
    /// reservation is charged at completion as debt (see `docs/configuration.md`).
    pub max_output_tokens_cap: u64,
    /// The cost of a typical request on this rule's dimension, for the allocator (0:
    /// unknown). A slice whose burst is below it cannot admit such a request; when a
    /// key's split would make such slices, the allocator concentrates the key's budget
    /// on the agents with the most demand (docs/tuning.md, "Sparse keys"). Default: 1
    /// for `requests`; `max_output_tokens_default` (at most the burst) for
    /// `output_tokens` and `total_tokens`; 0 for `input_tokens` and concurrency.
    pub typical_cost: u64,
}

impl Rule {
    /// A fingerprint of what the rule's keys *mean* (its name, dimension, match, period
    /// and kind; not its rate, burst, posture or mode, which a reload may change under
    /// the same keys): FNV-1a, 64 bit, of a canonical rendering. Agents send one per
    /// rule in their hello; the allocator ignores their lines of a rule whose
    /// fingerprint differs from its own (the agent runs a file where that rule means
    /// something else), so a grant is never applied under another meaning.
    pub fn shape(&self) -> u64 {
        let (per_ns, concurrency) = match self.limit {
            RuleLimit::Rate { per, .. } => (per.as_ns(), false),
            RuleLimit::Concurrency { .. } => (0, true),
        };
        let text = format!(
            "{:?}|{:?}|{:?}|{per_ns}|{concurrency}",
            self.name, self.dimension, self.matches
        );
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in text.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }

    /// How many `*` entries the rule matches on: the values a key of it has.
    pub fn wildcards(&self) -> usize {
        self.matches
            .iter()
            .filter(|(_, p)| *p == Pattern::Each)
            .count()
    }

    /// Output tokens this rule reserves for a request that names `max_tokens`.
    pub fn reserved_output(&self, max_tokens: Option<u64>) -> u64 {
        max_tokens
            .unwrap_or(self.max_output_tokens_default)
            .min(self.max_output_tokens_cap)
    }
}

/// What the engine does with a request that matches no enforce or shadow rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmatched {
    /// Reject it with [`crate::AdmitError::NoMatchingRule`] (the default: an unknown
    /// tenant is not unlimited).
    Reject,
    /// Admit it with no limit.
    Allow,
}

/// Where slices come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SliceSource {
    /// Single node: every key's slice is the rule's whole limit, and a new key starts
    /// with a full bucket (as one global bucket would).
    Standalone,
    /// An allocator grants slices with [`crate::Engine::apply_slices`]; a key without a
    /// grant admits nothing and a new grant starts empty (invariant 2).
    Allocated,
}

/// Engine settings (`[engine]`). Every table and queue in the engine has its bound here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most limit keys held at once. At the bound, idle keys are evicted; if none is
    /// idle, a request for a new key is rejected with `KeyTableFull` (HTTP 503).
    /// Default 100,000. Memory: ~300 bytes per key.
    pub max_keys: usize,
    /// Most leases (reservations in flight) at once. At the bound, admits are rejected
    /// with `LeaseTableFull` (HTTP 503). Default 65,536. Memory: ~400 bytes per lease,
    /// allocated up front so that admission never allocates.
    pub max_leases: usize,
    /// Lease TTL when the caller names none. Default 300,000 ms (5 minutes: long LLM
    /// generations must not expire mid-stream).
    pub lease_ttl_ms: u64,
    /// Longest TTL a caller may ask for, at admission or by extending. Default 3,600,000.
    pub max_lease_ttl_ms: u64,
    /// How long a finished request id is remembered, so that a duplicate or late
    /// completion is recognised. Default 3,600,000 ms.
    pub tombstone_ttl_ms: u64,
    /// Finished request ids remembered; the oldest are forgotten first, by the
    /// maintenance tick (off the completion path), so between ticks the count may run
    /// up to a quarter over (that much is reserved up front). Default 262,144.
    pub max_tombstones: usize,
    /// A key unused for this long, at rest (bucket full, nothing in flight), may be
    /// evicted; it is recreated identically when next used. Default 60,000 ms.
    pub key_idle_ms: u64,
    /// What happens to a request no rule matches.
    pub unmatched: Unmatched,
    /// Where slices come from.
    pub slice_source: SliceSource,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_keys: 100_000,
            max_leases: 65_536,
            lease_ttl_ms: 300_000,
            max_lease_ttl_ms: 3_600_000,
            tombstone_ttl_ms: 3_600_000,
            max_tombstones: 262_144,
            key_idle_ms: 60_000,
            unmatched: Unmatched::Reject,
            slice_source: SliceSource::Standalone,
        }
    }
}

/// A whole, validated configuration file.
#[derive(Clone, Debug)]
pub struct Config {
    /// Engine settings.
    pub engine: EngineConfig,
    /// The rules.
    pub rules: RuleSet,
    /// API keys the OpenAI-compatible proxy accepts (`[[api_key]]`), by hash.
    pub api_keys: Vec<ApiKey>,
}

/// One accepted bearer key of the proxy. Only its SHA-256 is stored; the descriptors
/// say which tenant (and key) its requests are charged to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKey {
    /// SHA-256 of the bearer key.
    pub sha256: [u8; 32],
    /// Descriptors its requests carry, e.g. `org = "acme", key = "k1"`.
    pub descriptors: Vec<(String, String)>,
}

/// Validated rules, addressable by index and by name.
#[derive(Clone, Debug, Default)]
pub struct RuleSet {
    rules: Vec<Rule>,
    by_name: HashMap<String, usize>,
}

impl RuleSet {
    /// The rules, in file order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The longest key name a rule of this set can have, in protobuf bytes (the
    /// rule's name and one value of up to [`MAX_DESCRIPTOR_BYTES`] per `*` entry, each
    /// with its tag and length): what bounds the lines per sync message
    /// ([`crate::sync_session::keys_per_message`]).
    pub fn max_key_name_bytes(&self) -> usize {
        self.rules
            .iter()
            .map(|r| r.name.len() + 3 + r.wildcards() * (MAX_DESCRIPTOR_BYTES + 3))
            .max()
            .unwrap_or(0)
    }

    /// The rule named `name`, with its index.
    pub fn by_name(&self, name: &str) -> Option<(usize, &Rule)> {
        self.by_name.get(name).map(|&i| (i, &self.rules[i]))
    }

    /// Number of rules.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// True when there are no rules.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The rules as one deterministic string (every field of every rule, in file
    /// order): what agents and the allocator hash into the `config_version` they
    /// compare. Not `Debug`, which also prints the name index, a `HashMap` whose order
    /// differs from process to process (two parses of one file gave six different
    /// strings in twenty).
    pub fn canonical(&self) -> String {
        format!("{:?}", self.rules)
    }
}

/// A configuration error. Nothing was loaded; the caller keeps whatever it had.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// The file could not be read (operator).
    #[error("cannot read config file {path}: {reason}")]
    Io {
        /// The path.
        path: String,
        /// The OS error.
        reason: String,
    },
    /// The text is not TOML (operator).
    #[error("config is not valid TOML: {0}")]
    Syntax(String),
    /// A top-level key other than `engine` and `rule` (operator).
    #[error("unknown top-level key `{0}`)")]
    UnknownSection(String),
    /// An `[engine]` field is wrong (operator).
    #[error("[engine] field `{field}`: {reason}")]
    Engine {
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A rule field is wrong (operator).
    #[error("rule {rule}: field `{field}`: {reason}")]
    Rule {
        /// The rule's name, or `#N (unnamed)`.
        rule: String,
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
}

impl Config {
    /// Reads and validates a TOML file.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Config::from_toml(&text)
    }

    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let table: Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Syntax(e.to_string()))?;
        let mut engine = EngineConfig::default();
        let mut raw_rules: Vec<Value> = Vec::new();
        let mut api_keys = Vec::new();
        for (key, value) in table {
            match key.as_str() {
                "engine" => engine = parse_engine(value)?,
                "api_key" => api_keys = parse_api_keys(value)?,
                "rule" => match value {
                    Value::Array(items) => raw_rules = items,
                    _ => {
                        return Err(ConfigError::Rule {
                            rule: "(all)".into(),
                            field: "rule".into(),
                            reason: "must be an array of tables, written [[rule]]".into(),
                        });
                    }
                },
                other => {
                    return Err(ConfigError::UnknownSection(format!(
                        "{other}` (expected `[engine]`, `[[rule]]` or `[[api_key]]`"
                    )));
                }
            }
        }
        let rules = parse_rules(raw_rules)?;
        Ok(Config {
            engine,
            rules,
            api_keys,
        })
    }
}

fn parse_api_keys(value: Value) -> Result<Vec<ApiKey>, ConfigError> {
    let err = |i: usize, field: &str, reason: String| ConfigError::Rule {
        rule: format!("api_key #{}", i + 1),
        field: field.to_string(),
        reason,
    };
    let Value::Array(items) = value else {
        return Err(err(
            0,
            "api_key",
            "must be an array of tables, written [[api_key]]".into(),
        ));
    };
    let mut keys: Vec<ApiKey> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let Value::Table(t) = item else {
            return Err(err(i, "api_key", "must be a table".into()));
        };
        for k in t.keys() {
            if k != "sha256" && k != "descriptors" {
                return Err(err(
                    i,
                    k,
                    "unknown field (known: sha256, descriptors)".into(),
                ));
            }
        }
        let hex = t.get("sha256").and_then(Value::as_str).ok_or_else(|| {
            err(
                i,
                "sha256",
                "is required: the hex SHA-256 of the key (bursar-agent hash-key)".into(),
            )
        })?;
        let sha256 =
            parse_hex32(hex).ok_or_else(|| err(i, "sha256", "must be 64 hex digits".into()))?;
        if keys.iter().any(|k| k.sha256 == sha256) {
            return Err(err(i, "sha256", "duplicate key".into()));
        }
        let Some(Value::Table(d)) = t.get("descriptors") else {
            return Err(err(
                i,
                "descriptors",
                "is required, e.g. { org = \"acme\" }".into(),
            ));
        };
        // The proxy adds the request's `model` unless the key names one: room for it,
        // or every request with the key was a 400 blaming the client.
        let room = if d.contains_key("model") {
            MAX_DESCRIPTORS
        } else {
            MAX_DESCRIPTORS - 1
        };
        if d.is_empty() || d.len() > room {
            return Err(err(
                i,
                "descriptors",
                format!(
                    "1 to {room} entries (the proxy adds the request's `model` to a key's \
                     descriptors that do not name one, and a request has at most \
                     {MAX_DESCRIPTORS})"
                ),
            ));
        }
        let mut descriptors = Vec::with_capacity(d.len());
        for (k, v) in d {
            match v.as_str() {
                Some(v) if !v.is_empty() && v.len() <= MAX_DESCRIPTOR_BYTES && !k.is_empty() => {
                    descriptors.push((k.clone(), v.to_string()))
                }
                _ => {
                    return Err(err(
                        i,
                        "descriptors",
                        format!(
                            "`{k}` must be a non-empty string of at most {MAX_DESCRIPTOR_BYTES} bytes"
                        ),
                    ));
                }
            }
        }
        keys.push(ApiKey {
            sha256,
            descriptors,
        });
    }
    Ok(keys)
}

fn parse_hex32(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

fn parse_engine(value: Value) -> Result<EngineConfig, ConfigError> {
    let Value::Table(table) = value else {
        return Err(ConfigError::Engine {
            field: "engine".into(),
            reason: "must be a table".into(),
        });
    };
    let mut cfg = EngineConfig::default();
    let err = |field: &str, reason: String| ConfigError::Engine {
        field: field.to_string(),
        reason,
    };
    for (key, value) in &table {
        let int = |min: u64, max: u64| positive_int(value, min, max).map_err(|r| err(key, r));
        match key.as_str() {
            "max_keys" => cfg.max_keys = int(1, 100_000_000)? as usize,
            "max_leases" => cfg.max_leases = int(1, 100_000_000)? as usize,
            "lease_ttl_ms" => cfg.lease_ttl_ms = int(1, 86_400_000)?,
            "max_lease_ttl_ms" => cfg.max_lease_ttl_ms = int(1, 7 * 86_400_000)?,
            "tombstone_ttl_ms" => cfg.tombstone_ttl_ms = int(1, 30 * 86_400_000)?,
            "max_tombstones" => cfg.max_tombstones = int(1, 100_000_000)? as usize,
            "key_idle_ms" => cfg.key_idle_ms = int(1, 30 * 86_400_000)?,
            "unmatched" => {
                cfg.unmatched = match value.as_str() {
                    Some("reject") => Unmatched::Reject,
                    Some("allow") => Unmatched::Allow,
                    _ => {
                        return Err(err(
                            key,
                            format!("must be \"reject\" or \"allow\", got {value}"),
                        ));
                    }
                }
            }
            "slice_source" => {
                cfg.slice_source = match value.as_str() {
                    Some("standalone") => SliceSource::Standalone,
                    Some("allocated") => SliceSource::Allocated,
                    _ => {
                        return Err(err(
                            key,
                            format!("must be \"standalone\" or \"allocated\", got {value}"),
                        ));
                    }
                }
            }
            _ => return Err(err(key, "unknown field".into())),
        }
    }
    if cfg.lease_ttl_ms > cfg.max_lease_ttl_ms {
        return Err(err(
            "lease_ttl_ms",
            format!(
                "{} is above max_lease_ttl_ms ({})",
                cfg.lease_ttl_ms, cfg.max_lease_ttl_ms
            ),
        ));
    }
    Ok(cfg)
}

/// An integer in `[min, max]`, with a message that says what was wrong otherwise.
fn positive_int(value: &Value, min: u64, max: u64) -> Result<u64, String> {
    match value {
        Value::Integer(i) if *i < 0 => Err(format!("must be positive, got {i}")),
        Value::Integer(i) if (*i as u64) < min => Err(format!("must be at least {min}, got {i}")),
        Value::Integer(i) if (*i as u64) > max => Err(format!("must be at most {max}, got {i}")),
        Value::Integer(i) => Ok(*i as u64),
        Value::Float(f) if f.is_nan() => Err("must be a whole number, got nan".into()),
        Value::Float(f) => Err(format!("must be a whole number, got {f}")),
        Value::String(s) => Err(format!("must be a number, not the string {s:?}")),
        other => Err(format!("must be a whole number, got {}", other.type_str())),
    }
}

fn parse_rules(raw: Vec<Value>) -> Result<RuleSet, ConfigError> {
    let mut rules: Vec<Rule> = Vec::with_capacity(raw.len());
    let mut parents: Vec<Option<String>> = Vec::with_capacity(raw.len());
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for (index, value) in raw.into_iter().enumerate() {
        let (rule, parent) = parse_rule(index, value)?;
        if by_name.contains_key(&rule.name) {
            return Err(ConfigError::Rule {
                rule: rule.name.clone(),
                field: "name".into(),
                reason: "duplicate rule name: names must be unique".into(),
            });
        }
        by_name.insert(rule.name.clone(), rules.len());
        rules.push(rule);
        parents.push(parent);
    }
    // Resolve and check parents once every name is known.
    for (i, parent) in parents.iter().enumerate() {
        let Some(parent) = parent else { continue };
        let rule_err = |reason: String| ConfigError::Rule {
            rule: rules[i].name.clone(),
            field: "parent".into(),
            reason,
        };
        let Some(&p) = by_name.get(parent) else {
            return Err(rule_err(format!("no rule is named {parent:?}")));
        };
        if p == i {
            return Err(rule_err("a rule cannot be its own parent".into()));
        }
        let (child, par) = (&rules[i], &rules[p]);
        if child.domain != par.domain {
            return Err(rule_err(format!(
                "parent {parent:?} is in domain {:?}, this rule in {:?}: they must match",
                par.domain, child.domain
            )));
        }
        // A parent is a ceiling over its children: every request the child matches must
        // also match the parent, so the parent's match entries must appear in the
        // child's with the same pattern (or the parent's `*` over a child's exact value).
        for (key, pat) in &par.matches {
            let ok = child.matches.iter().any(|(k, c)| {
                k == key
                    && match (pat, c) {
                        (Pattern::Each, _) => true,
                        (Pattern::Exact(a), Pattern::Exact(b)) => a == b,
                        (Pattern::Exact(_), Pattern::Each) => false,
                    }
            });
            if !ok {
                return Err(rule_err(format!(
                    "parent {parent:?} matches `{key}` in a way this rule does not; a \
                     parent's match entries must be a subset of its children's"
                )));
            }
        }
        rules[i].parent = Some(p);
    }
    // Cycles: follow each chain at most rules.len() steps.
    for i in 0..rules.len() {
        let mut at = rules[i].parent;
        let mut steps = 0;
        while let Some(p) = at {
            steps += 1;
            if steps > rules.len() {
                return Err(ConfigError::Rule {
                    rule: rules[i].name.clone(),
                    field: "parent".into(),
                    reason: "parent chain forms a cycle".into(),
                });
            }
            at = rules[p].parent;
        }
    }
    Ok(RuleSet { rules, by_name })
}

const RULE_FIELDS: &[&str] = &[
    "name",
    "domain",
    "match",
    "dimension",
    "rate",
    "per",
    "burst",
    "max_in_flight",
    "mode",
    "posture",
    "parent",
    "max_output_tokens_default",
    "max_output_tokens_cap",
    "typical_cost",
];

fn parse_rule(index: usize, value: Value) -> Result<(Rule, Option<String>), ConfigError> {
    let unnamed = format!("#{} (unnamed)", index + 1);
    let Value::Table(t) = value else {
        return Err(ConfigError::Rule {
            rule: unnamed,
            field: "rule".into(),
            reason: "each [[rule]] must be a table".into(),
        });
    };
    let label = match t.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => unnamed,
    };
    let err = |field: &str, reason: String| ConfigError::Rule {
        rule: label.clone(),
        field: field.to_string(),
        reason,
    };
    for key in t.keys() {
        if !RULE_FIELDS.contains(&key.as_str()) {
            return Err(err(
                key,
                format!("unknown field (known fields: {})", RULE_FIELDS.join(", ")),
            ));
        }
    }
    let string = |field: &str| -> Result<Option<String>, ConfigError> {
        match t.get(field) {
            None => Ok(None),
            Some(Value::String(s)) if s.is_empty() => Err(err(field, "must not be empty".into())),
            Some(Value::String(s)) if s.len() > MAX_DESCRIPTOR_BYTES => Err(err(
                field,
                format!("must be at most {MAX_DESCRIPTOR_BYTES} bytes"),
            )),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(err(
                field,
                format!("must be a string, got {}", other.type_str()),
            )),
        }
    };
    let int = |field: &str, min: u64, max: u64| -> Result<Option<u64>, ConfigError> {
        t.get(field)
            .map(|v| positive_int(v, min, max).map_err(|r| err(field, r)))
            .transpose()
    };

    let name = string("name")?.ok_or_else(|| err("name", "is required".into()))?;
    let domain = string("domain")?;
    let dimension_name =
        string("dimension")?.ok_or_else(|| err("dimension", "is required".into()))?;
    let dimension = Dimension::parse(&dimension_name).ok_or_else(|| {
        err(
            "dimension",
            format!(
                "unknown dimension {dimension_name:?} (expected requests, input_tokens, \
                 output_tokens, total_tokens or concurrency)"
            ),
        )
    })?;

    let mut matches = Vec::new();
    match t.get("match") {
        None => {}
        Some(Value::Table(m)) => {
            if m.len() > MAX_DESCRIPTORS {
                return Err(err("match", format!("at most {MAX_DESCRIPTORS} entries")));
            }
            for (k, v) in m {
                if k.is_empty() || k.len() > MAX_DESCRIPTOR_BYTES {
                    return Err(err(
                        "match",
                        format!("descriptor keys must be 1 to {MAX_DESCRIPTOR_BYTES} bytes"),
                    ));
                }
                let pat = match v {
                    Value::String(s) if s == "*" => Pattern::Each,
                    Value::String(s) if !s.is_empty() && s.len() <= MAX_DESCRIPTOR_BYTES => {
                        Pattern::Exact(s.as_str().into())
                    }
                    Value::String(_) => {
                        return Err(err(
                            "match",
                            format!(
                                "value of `{k}` must be \"*\" or 1 to {MAX_DESCRIPTOR_BYTES} bytes"
                            ),
                        ));
                    }
                    other => {
                        return Err(err(
                            "match",
                            format!(
                                "value of `{k}` must be a string (\"*\" or an exact value), got {}",
                                other.type_str()
                            ),
                        ));
                    }
                };
                matches.push((k.clone(), pat));
            }
            matches.sort_by(|a, b| a.0.cmp(&b.0));
        }
        Some(other) => {
            return Err(err(
                "match",
                format!(
                    "must be a table such as {{ org = \"*\" }}, got {}",
                    other.type_str()
                ),
            ));
        }
    }

    let limit = if dimension == Dimension::Concurrency {
        for f in ["rate", "per", "burst"] {
            if t.contains_key(f) {
                return Err(err(
                    f,
                    "does not apply to a concurrency rule (use max_in_flight)".into(),
                ));
            }
        }
        let slots = int("max_in_flight", 1, MAX_COST)?
            .ok_or_else(|| err("max_in_flight", "is required for a concurrency rule".into()))?;
        RuleLimit::Concurrency {
            max_in_flight: slots,
        }
    } else {
        if t.contains_key("max_in_flight") {
            return Err(err(
                "max_in_flight",
                "only applies to dimension = \"concurrency\"".into(),
            ));
        }
        let rate = int("rate", 1, MAX_RATE)?.ok_or_else(|| err("rate", "is required".into()))?;
        let per_name = string("per")?.ok_or_else(|| err("per", "is required".into()))?;
        let per = Period::parse(&per_name).ok_or_else(|| {
            err(
                "per",
                format!("unknown period {per_name:?} (expected second, minute, hour or day)"),
            )
        })?;
        let burst = int("burst", 1, MAX_COST)?.unwrap_or(rate);
        let refill = burst as u128 * per.as_ns() as u128 / rate as u128;
        if refill > MAX_REFILL_NS {
            return Err(err(
                "burst",
                format!(
                    "burst {burst} at {rate} per {} takes over {} years to refill",
                    per.as_str(),
                    MAX_REFILL_NS / 31_557_600_000_000_000
                ),
            ));
        }
        RuleLimit::Rate { rate, per, burst }
    };

    let mode = match string("mode")?.as_deref() {
        None | Some("enforce") => Mode::Enforce,
        Some("shadow") => Mode::Shadow,
        Some(other) => {
            return Err(err(
                "mode",
                format!("unknown mode {other:?} (expected enforce or shadow)"),
            ));
        }
    };
    let posture = match string("posture")?.as_deref() {
        None | Some("conservative") => Posture::Conservative,
        Some("strict") => Posture::Strict,
        Some("open") => Posture::Open,
        Some(other) => {
            return Err(err(
                "posture",
                format!("unknown posture {other:?} (expected strict, conservative or open)"),
            ));
        }
    };
    let max_output_tokens_cap = int("max_output_tokens_cap", 0, MAX_COST)?.unwrap_or(MAX_COST);
    let max_output_tokens_default =
        int("max_output_tokens_default", 0, MAX_COST)?.unwrap_or(1024.min(max_output_tokens_cap));
    if max_output_tokens_default > max_output_tokens_cap {
        return Err(err(
            "max_output_tokens_default",
            format!(
                "{max_output_tokens_default} is above max_output_tokens_cap \
                 ({max_output_tokens_cap})"
            ),
        ));
    }
    // Default: a request costs 1 on `requests`; on `output_tokens` and `total_tokens` it
    // reserves at least the default output (a request naming no max_tokens), so a slice
    // below that admits no such request; `input_tokens` gives no hint (0: unknown).
    let typical_default = match (dimension, &limit) {
        (Dimension::Requests, _) => 1,
        (Dimension::OutputTokens | Dimension::TotalTokens, RuleLimit::Rate { burst, .. }) => {
            max_output_tokens_default.min(*burst)
        }
        _ => 0,
    };
    let typical_cost = match int("typical_cost", 0, MAX_COST)? {
        None => typical_default,
        Some(_) if dimension == Dimension::Concurrency => {
            return Err(err(
                "typical_cost",
                "does not apply to a concurrency rule (a request takes one slot)".into(),
            ));
        }
        Some(c) => {
            let burst = match limit {
                RuleLimit::Rate { burst, .. } => burst,
                RuleLimit::Concurrency { max_in_flight } => max_in_flight,
            };
            if c > burst {
                return Err(err(
                    "typical_cost",
                    format!("{c} is above the burst ({burst}): no slice could admit it"),
                ));
            }
            c
        }
    };
    let parent = string("parent")?;
    Ok((
        Rule {
            name,
            domain,
            matches,
            dimension,
            limit,
            mode,
            posture,
            parent: None,
            max_output_tokens_default,
            max_output_tokens_cap,
            typical_cost,
        },
        parent,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rules_shape_follows_what_its_keys_mean_not_its_numbers() {
        let shape = |body: &str| {
            let c = Config::from_toml(&format!("[[rule]]\nname = \"r\"\n{body}")).unwrap();
            c.rules.rules()[0].shape()
        };
        let base =
            shape("match = { org = \"*\" }\ndimension = \"requests\"\nrate = 10\nper = \"second\"");
        // Numbers, posture and mode: the same keys, the same shape.
        assert_eq!(
            base,
            shape(
                "match = { org = \"*\" }\ndimension = \"requests\"\nrate = 99\nper = \"second\"\n\
                 burst = 7\nposture = \"open\"\nmode = \"shadow\""
            )
        );
        // Period, dimension, match, kind: another meaning.
        for other in [
            "match = { org = \"*\" }\ndimension = \"requests\"\nrate = 10\nper = \"minute\"",
            "match = { org = \"*\" }\ndimension = \"input_tokens\"\nrate = 10\nper = \"second\"",
            "match = { tenant = \"*\" }\ndimension = \"requests\"\nrate = 10\nper = \"second\"",
            "match = { org = \"acme\" }\ndimension = \"requests\"\nrate = 10\nper = \"second\"",
            "match = { org = \"*\" }\ndimension = \"concurrency\"\nmax_in_flight = 10",
        ] {
            assert_ne!(base, shape(other), "{other}");
        }
    }

    /// An api key's descriptors leave room for the `model` the proxy adds: 16 without
    /// one made every request with the key a 400 blaming the client.
    #[test]
    fn an_api_key_s_descriptors_leave_room_for_the_model() {
        let key = |entries: Vec<String>| {
            format!(
                "[[rule]]\nname = \"r\"\nmatch = {{ org = \"*\" }}\ndimension = \"requests\"\n\
                 rate = 10\nper = \"second\"\n\n[[api_key]]\nsha256 = \"{}\"\n\
                 descriptors = {{ {} }}\n",
                "ab".repeat(32),
                entries.join(", ")
            )
        };
        let d = |n: usize| (0..n).map(|i| format!("k{i} = \"v\"")).collect::<Vec<_>>();
        assert!(Config::from_toml(&key(d(15))).is_ok());
        let e = Config::from_toml(&key(d(16))).unwrap_err().to_string();
        assert!(
            e.contains("descriptors") && e.contains("1 to 15 entries"),
            "{e}"
        );
        let mut with_model = d(15);
        with_model.push("model = \"gpt-4o\"".into());
        assert!(
            Config::from_toml(&key(with_model)).is_ok(),
            "16 naming the model"
        );
    }

    /// Review, thirty-first session: the reference example in docs/configuration.md
    /// was refused by the loader (a child rule outside its parent's domain), and
    /// nothing checked it. Every TOML block there must load.
    #[test]
    fn the_examples_in_the_configuration_doc_load() {
        let doc = include_str!("../../../docs/configuration.md");
        let mut blocks = 0;
        for part in doc.split("```toml\n").skip(1) {
            let block = part.split("```").next().expect("a closed block");
            if let Err(e) = Config::from_toml(block) {
                panic!("docs/configuration.md example does not load: {e}\n{block}");
            }
            blocks += 1;
        }
        assert!(blocks > 0, "no TOML example found");
    }

    fn err(text: &str) -> String {
        Config::from_toml(text).unwrap_err().to_string()
    }

    const GOOD: &str = r#"
        [[rule]]
        name = "org-input-tpm"
        domain = "llm"
        match = { org = "*" }
        dimension = "input_tokens"
        rate = 2_000_000
        per = "minute"
        burst = 2_000_000
        mode = "enforce"
        posture = "conservative"
        max_output_tokens_default = 1024

        [[rule]]
        name = "key-input-tpm"
        domain = "llm"
        parent = "org-input-tpm"
        match = { org = "*", key = "*" }
        dimension = "input_tokens"
        rate = 500_000
        per = "minute"
    "#;

    #[test]
    fn the_design_example_loads_with_defaults_filled_in() {
        let cfg = Config::from_toml(GOOD).unwrap();
        assert_eq!(cfg.rules.len(), 2);
        let (i, key) = cfg.rules.by_name("key-input-tpm").unwrap();
        assert_eq!(i, 1);
        assert_eq!(key.parent, Some(0));
        assert_eq!(
            key.limit,
            RuleLimit::Rate {
                rate: 500_000,
                per: Period::Minute,
                burst: 500_000
            }
        );
        assert_eq!(key.mode, Mode::Enforce);
        assert_eq!(key.max_output_tokens_default, 1024);
        assert_eq!(cfg.engine, EngineConfig::default());
    }

    #[test]
    fn zero_and_nan_rates_are_rejected_naming_rule_and_field() {
        let zero = err(r#"[[rule]]
            name = "r1"
            dimension = "requests"
            rate = 0
            per = "second""#);
        assert_eq!(zero, "rule r1: field `rate`: must be at least 1, got 0");
        let nan = err(r#"[[rule]]
            name = "r2"
            dimension = "requests"
            rate = nan
            per = "second""#);
        assert_eq!(
            nan,
            "rule r2: field `rate`: must be a whole number, got nan"
        );
        let neg = err(r#"[[rule]]
            name = "r3"
            dimension = "requests"
            rate = "-5"
            per = "second""#);
        assert!(neg.contains("rule r3: field `rate`: must be a number, not the string"));
    }

    #[test]
    fn unknown_dimensions_fields_and_periods_are_named() {
        let dim = err(r#"[[rule]]
            name = "d"
            dimension = "spend_usd"
            rate = 1
            per = "second""#);
        assert!(dim.starts_with("rule d: field `dimension`: unknown dimension \"spend_usd\""));
        let field = err(r#"[[rule]]
            name = "f"
            dimension = "requests"
            rate = 1
            per = "second"
            brust = 3"#);
        assert!(field.starts_with("rule f: field `brust`: unknown field"));
        let per = err(r#"[[rule]]
            name = "p"
            dimension = "requests"
            rate = 1
            per = "fortnight""#);
        assert!(per.starts_with("rule p: field `per`: unknown period"));
    }

    #[test]
    fn duplicate_rule_names_are_rejected() {
        let dup = err(r#"[[rule]]
            name = "same"
            dimension = "requests"
            rate = 1
            per = "second"
            [[rule]]
            name = "same"
            dimension = "requests"
            rate = 2
            per = "second""#);
        assert_eq!(
            dup,
            "rule same: field `name`: duplicate rule name: names must be unique"
        );
    }

    #[test]
    fn overflowing_and_absurd_numbers_are_rejected() {
        let big = err(r#"[[rule]]
            name = "big"
            dimension = "requests"
            rate = 9223372036854775807
            per = "second""#);
        assert!(big.starts_with("rule big: field `rate`: must be at most"));
        let slow = err(r#"[[rule]]
            name = "slow"
            dimension = "input_tokens"
            rate = 1
            per = "day"
            burst = 1000000000000"#);
        assert!(slow.contains("years to refill"), "{slow}");
        // TOML itself rejects integers beyond i64 with a syntax error.
        assert!(err("[[rule]]\nname = \"x\"\nrate = 99999999999999999999\n").contains("TOML"));
    }

    #[test]
    fn typical_cost_defaults_by_dimension_and_is_checked_against_the_burst() {
        let cfg = Config::from_toml(
            r#"[[rule]]
            name = "rps"
            dimension = "requests"
            rate = 10
            per = "second"
            [[rule]]
            name = "tpm"
            dimension = "input_tokens"
            rate = 1000
            per = "minute"
            [[rule]]
            name = "tpm-typical"
            dimension = "input_tokens"
            rate = 1000
            per = "minute"
            typical_cost = 200
            [[rule]]
            name = "out"
            dimension = "output_tokens"
            rate = 100000
            per = "minute"
            [[rule]]
            name = "out-small"
            dimension = "total_tokens"
            rate = 100000
            per = "minute"
            burst = 500"#,
        )
        .unwrap();
        let typical = |n: &str| cfg.rules.by_name(n).unwrap().1.typical_cost;
        assert_eq!(
            (typical("rps"), typical("tpm"), typical("tpm-typical")),
            (1, 0, 200)
        );
        // Output and total tokens: the default output reservation, at most the burst.
        assert_eq!((typical("out"), typical("out-small")), (1024, 500));
        let above = err(r#"[[rule]]
            name = "t"
            dimension = "input_tokens"
            rate = 100
            per = "second"
            burst = 100
            typical_cost = 101"#);
        assert_eq!(
            above,
            "rule t: field `typical_cost`: 101 is above the burst (100): no slice could admit it"
        );
        let negative = err(r#"[[rule]]
            name = "t"
            dimension = "input_tokens"
            rate = 100
            per = "second"
            typical_cost = -1"#);
        assert!(
            negative.starts_with("rule t: field `typical_cost`"),
            "{negative}"
        );
        let slots = err(r#"[[rule]]
            name = "c"
            dimension = "concurrency"
            max_in_flight = 4
            typical_cost = 1"#);
        assert!(
            slots.contains("does not apply to a concurrency rule"),
            "{slots}"
        );
    }

    #[test]
    fn unnamed_rules_are_named_by_position() {
        let e = err(r#"[[rule]]
            dimension = "requests""#);
        assert_eq!(e, "rule #1 (unnamed): field `name`: is required");
    }

    #[test]
    fn parents_must_exist_be_acyclic_and_be_a_ceiling() {
        let missing = err(r#"[[rule]]
            name = "c"
            parent = "nope"
            dimension = "requests"
            rate = 1
            per = "second""#);
        assert_eq!(missing, "rule c: field `parent`: no rule is named \"nope\"");
        let not_subset = err(r#"[[rule]]
            name = "p"
            match = { org = "*", team = "*" }
            dimension = "requests"
            rate = 10
            per = "second"
            [[rule]]
            name = "c"
            parent = "p"
            match = { org = "*" }
            dimension = "requests"
            rate = 1
            per = "second""#);
        assert!(not_subset.contains("subset"), "{not_subset}");
        let cycle = err(r#"[[rule]]
            name = "a"
            parent = "b"
            dimension = "requests"
            rate = 1
            per = "second"
            [[rule]]
            name = "b"
            parent = "a"
            dimension = "requests"
            rate = 1
            per = "second""#);
        assert!(cycle.contains("cycle"), "{cycle}");
    }

    #[test]
    fn concurrency_rules_take_slots_not_rates() {
        let cfg = Config::from_toml(
            r#"[[rule]]
            name = "conc"
            match = { org = "*" }
            dimension = "concurrency"
            max_in_flight = 8"#,
        )
        .unwrap();
        assert_eq!(
            cfg.rules.rules()[0].limit,
            RuleLimit::Concurrency { max_in_flight: 8 }
        );
        let e = err(r#"[[rule]]
            name = "conc"
            dimension = "concurrency"
            rate = 8
            per = "second""#);
        assert!(e.starts_with("rule conc: field `rate`: does not apply"));
    }

    #[test]
    fn costs_given_as_text_are_parsed_strictly() {
        assert_eq!(parse_units("input_tokens", "0"), Ok(0));
        assert_eq!(parse_units("input_tokens", " 1200 "), Ok(1200));
        assert_eq!(
            parse_units("input_tokens", "-5"),
            Err("input_tokens: \"-5\" is negative".to_string())
        );
        assert!(
            parse_units("input_tokens", "99999999999999999999")
                .unwrap_err()
                .contains("above")
        );
        assert!(
            parse_units("input_tokens", "1099511627777")
                .unwrap_err()
                .contains("above")
        );
        assert!(
            parse_units("x", "1.5")
                .unwrap_err()
                .contains("not a whole number")
        );
        assert!(
            parse_units("x", "NaN")
                .unwrap_err()
                .contains("not a whole number")
        );
        assert!(parse_units("x", "").unwrap_err().contains("empty"));
    }

    #[test]
    fn engine_settings_are_validated() {
        let e = err("[engine]\nmax_keys = 0\n");
        assert_eq!(e, "[engine] field `max_keys`: must be at least 1, got 0");
        let e = err("[engine]\nfrobnicate = 1\n");
        assert_eq!(e, "[engine] field `frobnicate`: unknown field");
        let e = err("[limits]\n");
        assert!(e.starts_with("unknown top-level key `limits`"), "{e}");
        let cfg = Config::from_toml("[engine]\nunmatched = \"allow\"\nmax_keys = 10\n").unwrap();
        assert_eq!(cfg.engine.unmatched, Unmatched::Allow);
        assert_eq!(cfg.engine.max_keys, 10);
    }

    /// Agents and the allocator hash this into the `config_version` they compare: one
    /// file must give one string in every parse (and process), and a changed number a
    /// different one.
    #[test]
    fn the_canonical_form_of_rules_is_deterministic_and_sees_every_change() {
        let file = |rate: u32| {
            format!(
                "[[rule]]\nname = \"a\"\nmatch = {{ org = \"*\" }}\ndimension = \"requests\"\n\
                 rate = {rate}\nper = \"second\"\n\n\
                 [[rule]]\nname = \"b\"\nmatch = {{ org = \"*\" }}\ndimension = \"input_tokens\"\n\
                 rate = 10\nper = \"second\"\n\n\
                 [[rule]]\nname = \"c\"\nmatch = {{ user = \"*\" }}\ndimension = \"requests\"\n\
                 rate = 10\nper = \"second\"\n"
            )
        };
        let first = Config::from_toml(&file(10)).unwrap().rules.canonical();
        for _ in 0..20 {
            // Each parse builds its name index with its own hasher seeds.
            assert_eq!(
                Config::from_toml(&file(10)).unwrap().rules.canonical(),
                first
            );
        }
        assert_ne!(
            Config::from_toml(&file(11)).unwrap().rules.canonical(),
            first
        );
    }
}
