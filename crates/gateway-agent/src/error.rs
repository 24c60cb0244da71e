//! Errors at the engine's boundary. Each says whether state changed (never, for these:
//! a failed operation leaves every bucket and lease as it was) and whose fault it is.

/// An admit that could not be decided. No bucket was debited and no lease was taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// Malformed request (client): empty or oversized id, empty or duplicate
    /// descriptors. HTTP 400.
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// A cost above [`crate::MAX_COST`] (client). HTTP 400.
    #[error("cost is absurd: each cost must be at most {max}")]
    CostTooLarge {
        /// The bound.
        max: u64,
    },
    /// A TTL of zero or above the configured maximum (client). HTTP 400.
    #[error("ttl_ms {ttl_ms} is out of range 1..={max_ms}")]
    InvalidTtl {
        /// Asked.
        ttl_ms: u64,
        /// Bound.
        max_ms: u64,
    },
    /// No rule matches and the engine rejects unmatched requests (client or operator:
    /// an unknown tenant). HTTP 403.
    #[error("no rule matches these descriptors (unknown tenant?)")]
    NoMatchingRule,
    /// More rules matched than one lease can hold (operator: the rule set).
    #[error("request matches more than {max} rules")]
    TooManyLimits {
        /// The bound.
        max: usize,
    },
    /// The key table is full of keys that are not idle (overload). HTTP 503.
    #[error("key table full ({max} keys, none idle)")]
    KeyTableFull {
        /// The bound.
        max: usize,
    },
    /// The lease table is full (overload). HTTP 503.
    #[error("lease table full ({max} leases in flight)")]
    LeaseTableFull {
        /// The bound.
        max: usize,
    },
    /// Two different request ids share a 128-bit hash (astronomically rare; the client
    /// should retry with a new id).
    #[error("request id collides with another live request id; use a new id")]
    RequestIdCollision,
    /// The request id finished here and is still remembered (client; HTTP 409): a
    /// new request needs a new id. An expired one still takes its late completion.
    #[error(
        "request id already {}; a new request needs a new id",
        if *expired { "expired here (its late completion is still taken)" } else { "completed here" }
    )]
    RequestIdFinished {
        /// Expired (waiting for a late completion) rather than completed.
        expired: bool,
    },
}

/// A completion that could not be applied. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompleteError {
    /// Malformed (client).
    #[error("invalid completion: {0}")]
    Invalid(&'static str),
    /// Token counts above [`crate::MAX_COST`] (client).
    #[error("usage is absurd: each count must be at most {max}")]
    UsageTooLarge {
        /// The bound.
        max: u64,
    },
    /// No live lease, no tombstone: never admitted here, or finished longer ago than
    /// `tombstone_ttl_ms` (client, or a completion sent to the wrong agent).
    #[error("unknown request id (never admitted here, or finished too long ago)")]
    UnknownRequest,
}

/// An extend that could not be applied. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExtendError {
    /// Malformed (client).
    #[error("invalid extend: {0}")]
    Invalid(&'static str),
    /// TTL out of range (client).
    #[error("ttl_ms {ttl_ms} is out of range 1..={max_ms}")]
    InvalidTtl {
        /// Asked.
        ttl_ms: u64,
        /// Bound.
        max_ms: u64,
    },
    /// No live lease for this id (completed, expired or unknown).
    #[error("no live lease for this request id")]
    NotLive,
}

/// A slice update that was not applied. The key's slice is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    /// The rule does not exist here (peer: config versions differ).
    #[error("unknown rule {0:?}")]
    UnknownRule(String),
    /// Wrong number of `*` values for the rule (peer bug).
    #[error("rule {rule:?} has {expected} `*` entries, update names {got} values")]
    WrongValues {
        /// Rule.
        rule: String,
        /// Wildcards in the rule.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// Rate, burst or transfer above [`crate::MAX_COST`] (peer bug).
    #[error("slice for rule {rule:?} has an absurd rate, burst or transfer")]
    Absurd {
        /// Rule.
        rule: String,
    },
    /// Older than the slice held (a lower term, or a replayed sequence): invariant 4.
    #[error(
        "stale slice (epoch {epoch}, seq {seq}) behind held (epoch {held_epoch}, seq {held_seq})"
    )]
    Stale {
        /// Update's term.
        epoch: u64,
        /// Update's sequence.
        seq: u64,
        /// Held term.
        held_epoch: u64,
        /// Held sequence.
        held_seq: u64,
    },
    /// The grant's lease had already ended when it arrived (peer or network: late).
    #[error("slice for rule {rule:?} arrived {expired_ns_ago} ns after its lease ended")]
    LeaseEnded {
        /// Rule.
        rule: String,
        /// How long ago the lease ended.
        expired_ns_ago: u64,
    },
    /// A lease extension arrived after the lease it sets had ended (late).
    #[error("lease extension arrived {expired_ns_ago} ns after the lease it sets ended")]
    ExtensionEnded {
        /// How long ago that lease ended.
        expired_ns_ago: u64,
    },
    /// A lease extension of an older term than the last one applied.
    #[error("lease extension of term {epoch} behind term {held_epoch}")]
    StaleExtension {
        /// Its term.
        epoch: u64,
        /// The term of the last extension applied.
        held_epoch: u64,
    },
    /// The key table is full.
    #[error("key table full ({max} keys)")]
    TableFull {
        /// The bound.
        max: usize,
    },
}

/// Why [`crate::Engine::key_handle`] made no handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    /// No rule has this name.
    #[error("unknown rule {0:?}")]
    UnknownRule(String),
    /// Wrong number of values for the rule's `*` entries.
    #[error("rule {rule:?} has {expected} `*` entries, the handle names {got} values")]
    WrongValues {
        /// Rule.
        rule: String,
        /// Wildcards in the rule.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// A concurrency rule: its slots are held by leases and released on completion,
    /// which a bare check cannot do (use [`crate::Engine::admit`]).
    #[error("rule {0:?} limits concurrency: admit through a lease, not a bare check")]
    Concurrency(String),
}

/// A rules reload refused ([`crate::Engine::reload`]): nothing changed, the rules in
/// force stay (operator). A reload changes the numbers of the rules in force; which
/// rules there are, what they match and what they limit are fixed at start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReloadError {
    /// An `[engine]` setting differs from the one in force.
    #[error(
        "[engine] field `{field}` differs from the one in force; engine settings apply only at start (restart the agent to change them)"
    )]
    EngineSettings {
        /// The first setting that differs.
        field: &'static str,
    },
    /// The file has other rules, or the same ones in another order.
    #[error(
        "the file has {found} where the rules in force have {in_force}; adding, removing, renaming or reordering rules needs a restart of the agent"
    )]
    RulesDiffer {
        /// What the file has at the first difference (a rule's name, or the count).
        found: String,
        /// What is in force there.
        in_force: String,
    },
    /// A rule's field that decides its keys changed.
    #[error(
        "rule {rule}: field `{field}` changed; a reload may change only `rate`, `burst`, `max_in_flight`, `mode`, `posture`, `max_output_tokens_default`, `max_output_tokens_cap` and `typical_cost` (restart the agent for the rest)"
    )]
    Structure {
        /// The rule.
        rule: String,
        /// The field.
        field: &'static str,
    },
}
