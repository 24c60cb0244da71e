//! The core's own messages: what an agent says (hello, report, ack) and what the
//! allocator answers (grants).
//!
//! These are plain Rust structs, not a wire format: the protocol crate (protobuf over a
//! gRPC stream, not built here) decodes into them and encodes [`Grant`]s from them.
//! Every size is bounded by [`crate::AllocatorConfig`] and checked on entry.
//!
//! # Times
//!
//! Two clocks appear and are never mixed. `agent_time_ns` fields are the agent's own
//! monotonic clock (the `now` its budget engine runs on); the allocator never compares
//! them with its own clock, it only echoes them back (invariant 3). The `now` argument
//! of every `handle_*` call is the allocator's clock.

use std::sync::Arc;

use bursar_agent::SliceUpdate;

/// One limit key by name: a rule and the values of its `*` match entries, in the rule's
/// match-key order (keys sorted), exactly as `bursar_agent::SliceUpdate` names it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyName {
    /// The rule's name.
    pub rule: String,
    /// Values of the rule's `*` entries.
    pub values: Vec<String>,
}

impl KeyName {
    /// A key name from borrowed parts.
    pub fn new(rule: &str, values: &[&str]) -> KeyName {
        KeyName {
            rule: rule.to_string(),
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }
}

impl std::fmt::Display for KeyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{{{}}}", self.rule, self.values.join(","))
    }
}

/// A grant an agent says it holds (in a hello, and per key in each report).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldGrant {
    /// The term of the allocator that issued it.
    pub epoch: u64,
    /// Its sequence number.
    pub seq: u64,
    /// Its rate (units per the rule's period; 0 for concurrency rules).
    pub rate: u64,
    /// Its burst (slots for concurrency rules).
    pub burst: u64,
}

/// A held grant for one key (the hello lists every grant an agent holds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldSlice {
    /// The key.
    pub key: KeyName,
    /// The grant.
    pub grant: HeldGrant,
}

/// The first message on an agent's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The agent's stable id (1 to [`crate::MAX_AGENT_ID_BYTES`] bytes), e.g. its node
    /// name.
    pub agent: String,
    /// Which run of that agent: a restarted agent sends a higher number (for example its
    /// start time in wall-clock milliseconds). A higher incarnation releases every grant
    /// the previous one held, at once: a restarted agent starts empty.
    pub incarnation: u64,
    /// The agent's clock when it sent the hello.
    pub agent_time_ns: u64,
    /// Weight in weighted max-min (1 for equal shares; 0 is read as 1).
    pub weight: u32,
    /// How often the agent reports, ms (0: not said). Demand samples are read over at
    /// least this or the allocator's `min_sample_ms`, the shorter: an agent reporting
    /// more often than `min_sample_ms` is not read as having less demand.
    pub report_interval_ms: u64,
    /// Every grant the agent holds (empty for a new incarnation).
    pub held: Vec<HeldSlice>,
    /// The agent finds a grant's key by its handle when the grant carries no name: the
    /// allocator then names a key only in the first grant for it on this stream (and
    /// again after a report names the key by name, which says the agent has no handle
    /// for it). False for agents that predate it: every grant is named.
    pub grants_by_handle: bool,
    /// Per rule of the agent's file, its name and `bursar_agent::Rule::shape` (what its
    /// keys mean). Lines of a rule whose shape differs from the allocator's are ignored
    /// (counted in `ignored_lines`) for as long as the agent runs that file. Empty from
    /// agents that predate it: every line is read as before.
    pub rule_shapes: Vec<(String, u64)>,
}

/// Demand and holdings for one key, in a report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyReport {
    /// The key.
    pub key: KeyName,
    /// Cost admitted on this key since `counting_since_ns`, cumulative (never reset
    /// while `counting_since_ns` stays the same). Cumulative counters make a lost or
    /// reordered report cost nothing but resolution.
    pub admitted: u64,
    /// Cost rejected on this key since `counting_since_ns`, cumulative. Rejections are
    /// demand.
    pub rejected: u64,
    /// Agent time the two counters started from. A new value restarts them.
    pub counting_since_ns: u64,
    /// Requests in flight on the key (concurrency rules; 0 otherwise).
    pub in_flight: u64,
    /// The grant the agent has applied for this key, if any.
    pub held: Option<HeldGrant>,
    /// Non-zero: the key by the handle a grant carried ([`Grant::key_handle`]), and
    /// `key` is ignored (it may be empty). A handle the allocator no longer knows (its
    /// key was forgotten, or another term issued it) makes the line ignored, counted in
    /// `ignored_lines`; full reports name every key.
    pub key_handle: u64,
}

/// A periodic (every `report_interval`) or out-of-band (a new key) report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The agent's id, as in its hello.
    pub agent: String,
    /// The agent's incarnation, as in its hello.
    pub incarnation: u64,
    /// The agent's clock when it built the report. Every grant answering it leases
    /// until this time plus `lease_ms` minus the drift margin (invariant 3). A report
    /// not newer than the last one accepted is stale and ignored.
    pub agent_time_ns: u64,
    /// Keys whose demand or holding the agent reports (a delta report may omit keys that
    /// did not change).
    pub keys: Vec<KeyReport>,
    /// Part of a measurement the allocator asked for ([`MeasureRequest`]), or not.
    pub measure: Measure,
}

/// What a report's counters are to the demand estimate (see [`MeasureRequest`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Measure {
    /// A regular or new-key report: a demand sample since the entry's last one.
    #[default]
    None,
    /// The start of a requested measurement: the counters become the entry's base and
    /// are not a sample (the time since the last report may be mostly history).
    Start,
    /// The end of a requested measurement: the demand over the window since its start,
    /// read as it is (not over `min_sample_ms`).
    End,
}

/// The agent applied one grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceAck {
    /// The key.
    pub key: KeyName,
    /// The applied grant's term.
    pub epoch: u64,
    /// The applied grant's sequence number.
    pub seq: u64,
    /// Whole units the shrink's clamp gave up (`bursar_agent::SliceApplied::
    /// released_tokens`), handed on to agents that grow (token transfer).
    pub released_tokens: u64,
    /// Slots in flight after applying (`bursar_agent::SliceApplied::in_flight`).
    pub in_flight: u64,
    /// Non-zero: the key by the handle the acknowledged grant carried
    /// ([`Grant::key_handle`]), and `key` is ignored (it may be empty).
    pub key_handle: u64,
}

/// Acknowledgements of applied grants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    /// The agent's id.
    pub agent: String,
    /// The agent's incarnation.
    pub incarnation: u64,
    /// One entry per applied grant.
    pub slices: Vec<SliceAck>,
}

/// A grant for one key to one agent: the allocator's only output.
///
/// # Mapping onto `bursar_agent::SliceUpdate`
///
/// One to one, field by field ([`Grant::to_slice_update`]):
///
/// | `Grant` | `SliceUpdate` | meaning |
/// |---|---|---|
/// | `key.rule` | `rule` | the rule's name |
/// | `key.values` | `values` | the rule's `*` values, in match-key order |
/// | `rate` | `rate` | units per the rule's period (0 for concurrency) |
/// | `burst` | `burst` | bucket capacity (slots for concurrency) |
/// | `epoch` | `epoch` | the allocator's term (invariant 4) |
/// | `seq` | `seq` | increasing within the term, for every key |
/// | `lease_expires_at_ns` | `lease_expires_at_ns` | agent clock: report time + lease - drift margin |
/// | `fleet_size` | `fleet_size` | agents sharing the key (the conservative posture's N) |
/// | `transfer_tokens` | `transfer_tokens` | level handed over from shrinks |
///
/// `agent` and `incarnation` name the stream to send it on and are not part of the
/// update; `key_handle` is for the sync client's reports, not the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The agent it is for.
    pub agent: Arc<str>,
    /// The incarnation it is for. The shell sends a grant only on that incarnation's
    /// stream (and an agent drops grants for another incarnation): a grant issued to a
    /// process that has since restarted must never reach its successor, which starts
    /// empty.
    pub incarnation: u64,
    /// The key.
    pub key: Arc<KeyName>,
    /// Rate per the rule's period (0 for concurrency rules).
    pub rate: u64,
    /// Burst (slots for concurrency rules).
    pub burst: u64,
    /// The allocator's term.
    pub epoch: u64,
    /// Sequence number: one counter per term for all keys, so it increases for every
    /// key, and a key forgotten and recreated never reuses one.
    pub seq: u64,
    /// When the lease ends, in the agent's clock: the agent's timestamp of the last
    /// report it sent that this allocator accepted, plus `lease_ms`, minus
    /// `drift_margin_ms`.
    pub lease_expires_at_ns: u64,
    /// Agents sharing the key.
    pub fleet_size: u32,
    /// Tokens handed over from other agents' shrinks, to add to the level (the agent
    /// caps it at the new burst).
    pub transfer_tokens: u64,
    /// The allocator's handle for the key (non-zero; 0 if the key was forgotten before
    /// the grant was drained): report lines may name the key by it
    /// ([`KeyReport::key_handle`]) instead of by name, on the same stream. No hashing
    /// and no strings on either side.
    pub key_handle: u64,
    /// Send the key's name with the grant: false only when the agent's hello set
    /// [`Hello::grants_by_handle`] and an earlier grant on this stream named the key,
    /// so that the agent finds it by `key_handle` (`key` is still filled in here, for
    /// the shell's logs and counters).
    pub named: bool,
}

impl Grant {
    /// The agent engine's update for this grant (field by field, see the table above).
    pub fn to_slice_update(&self) -> SliceUpdate {
        self.update_for(&self.key)
    }

    /// The update for this grant applied to `key`: what an agent that found the key by
    /// the grant's handle ([`Grant::named`] false) applies.
    pub fn update_for(&self, key: &KeyName) -> SliceUpdate {
        SliceUpdate {
            rule: key.rule.clone(),
            values: key.values.clone(),
            rate: self.rate,
            burst: self.burst,
            epoch: self.epoch,
            seq: self.seq,
            lease_expires_at_ns: self.lease_expires_at_ns,
            fleet_size: self.fleet_size,
            transfer_tokens: self.transfer_tokens,
        }
    }

    /// The grant as the agent will describe it once held.
    pub fn held(&self) -> HeldGrant {
        HeldGrant {
            epoch: self.epoch,
            seq: self.seq,
            rate: self.rate,
            burst: self.burst,
        }
    }
}

/// One message that extends the lease of many grants to one agent: every grant of
/// term `epoch` with a seq up to `through_seq` that the agent holds now has a lease
/// ending no earlier than `lease_expires_at_ns` (agent clock: its latest report's time
/// plus `lease_ms` minus `drift_margin_ms`, as a grant's). Sent while the agent
/// reports, once its earliest grant is down to half of `lease_ms + reclaim_margin_ms`,
/// in place of re-sending each grant (docs/allocator.md, "Protocol"). Grants of other terms are untouched. Like a grant, it goes only to the
/// incarnation it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseExtension {
    /// The agent it is for.
    pub agent: Arc<str>,
    /// The incarnation it is for.
    pub incarnation: u64,
    /// The allocator's term: only grants of this term are extended.
    pub epoch: u64,
    /// Grants with a seq up to this one are extended.
    pub through_seq: u64,
    /// The new lease end, in the agent's clock.
    pub lease_expires_at_ns: u64,
}

/// Tells one agent to stop using its grants on some keys at once: the allocator no
/// longer counts them, because a reload removed the keys' rule or gave it another
/// meaning than the agent's file does (its lines of the rule are ignored). Each key's
/// grant of term `epoch` up to seq `through_seq` (or of an earlier term) ends its lease
/// on arrival: the agent falls to the rule's posture there, as for a lapsed lease, and
/// no lease extension carries the grant on (`bursar_agent::Engine::revoke_slices`). A
/// newer grant of the key is untouched. Without it, lease extensions (which cover every
/// grant of the term up to a seq) kept such grants in force, uncounted, until the agent
/// restarted. One lost is made good when the agent next names a revoked key with a
/// grant (a report line, or its hello on a new stream). Like a grant, it goes only to
/// the incarnation it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revocation {
    /// The agent it is for.
    pub agent: Arc<str>,
    /// The incarnation it is for.
    pub incarnation: u64,
    /// The allocator's term.
    pub epoch: u64,
    /// Grants of this term with a seq up to this one are revoked (and every grant of an
    /// earlier term).
    pub through_seq: u64,
    /// The keys, by name (a released key has no handle any more).
    pub keys: Vec<Arc<KeyName>>,
}

/// Asks one agent to report some keys at once ([`Measure::Start`]) and again
/// `window_ms` later ([`Measure::End`]). Queued for the other holders of a key when
/// one agent's demand for it jumps and nothing is free (docs/allocator.md, "Measure
/// requests"): a holder whose demand moved away is seen within one window, where its
/// regular reports would still cover time before the move for up to two intervals.
/// Like a grant, it goes only to the incarnation it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeasureRequest {
    /// The agent it is for.
    pub agent: Arc<str>,
    /// The incarnation it is for.
    pub incarnation: u64,
    /// The keys, by the handles their grants carried ([`Grant::key_handle`]).
    pub key_handles: Vec<u64>,
    /// How long after the start to send the end.
    pub window_ms: u32,
}

/// Tells one agent that report lines of its named keys by handles this allocator does
/// not know (the key was forgotten, or a reload replaced its rule): they were ignored.
/// The agent names those keys by name from then on, counting from when it last named
/// them (the entry is gone with the key). Like a grant, it goes only to the incarnation
/// it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownHandles {
    /// The agent it is for.
    pub agent: Arc<str>,
    /// The incarnation it is for.
    pub incarnation: u64,
    /// The handles, as the agent's lines carried them.
    pub key_handles: Vec<u64>,
}

/// A grant borrowed from the allocator's outbox ([`crate::Allocator::for_each_grant`]):
/// the same fields as [`Grant`], with the agent and key names borrowed instead of
/// counted. The core queues grants by table index and names them only here, so that a
/// pass issuing a million grants touches no reference count; a shell that encodes
/// straight onto the wire never needs an owned [`Grant`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantRef<'a> {
    /// The agent it is for.
    pub agent: &'a Arc<str>,
    /// The allocator's index of that agent: stable while the agent is known, reused
    /// only after it is forgotten and the outbox holding its grants has been drained.
    /// A shell may batch by it instead of hashing the name.
    pub agent_index: u32,
    /// The incarnation it is for (see [`Grant::incarnation`]).
    pub incarnation: u64,
    /// The key.
    pub key: &'a Arc<KeyName>,
    /// Rate per the rule's period (0 for concurrency rules).
    pub rate: u64,
    /// Burst (slots for concurrency rules).
    pub burst: u64,
    /// The allocator's term.
    pub epoch: u64,
    /// Sequence number (see [`Grant::seq`]).
    pub seq: u64,
    /// When the lease ends, in the agent's clock.
    pub lease_expires_at_ns: u64,
    /// Agents sharing the key.
    pub fleet_size: u32,
    /// Tokens handed over from other agents' shrinks.
    pub transfer_tokens: u64,
    /// The allocator's handle for the key (see [`Grant::key_handle`]).
    pub key_handle: u64,
    /// Send the key's name (see [`Grant::named`]).
    pub named: bool,
}

impl GrantRef<'_> {
    /// The owned grant (two reference counts taken).
    pub fn to_grant(&self) -> Grant {
        Grant {
            agent: Arc::clone(self.agent),
            incarnation: self.incarnation,
            key: Arc::clone(self.key),
            rate: self.rate,
            burst: self.burst,
            epoch: self.epoch,
            seq: self.seq,
            lease_expires_at_ns: self.lease_expires_at_ns,
            fleet_size: self.fleet_size,
            transfer_tokens: self.transfer_tokens,
            key_handle: self.key_handle,
            named: self.named,
        }
    }
}
