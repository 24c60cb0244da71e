//! Errors at the core's one boundary: messages from agents.
//!
//! Every message is validated whole before any state changes, so **no variant changes
//! state**: the message was ignored. Each variant says whose fault it is.

use crate::msg::KeyName;

/// A hello, report or ack that was refused. State is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The agent id is empty or longer than [`crate::MAX_AGENT_ID_BYTES`] (peer bug).
    #[error("agent id must be 1 to {max} bytes")]
    InvalidAgentId {
        /// The bound.
        max: usize,
    },
    /// A report or ack from an agent that sent no hello (peer: it must say hello first,
    /// e.g. after an allocator failover).
    #[error("agent {0:?} is not registered: send a hello first")]
    UnknownAgent(String),
    /// A report or ack from an incarnation other than the registered one (peer: an old
    /// process, or the message was delayed across a restart).
    #[error("agent {agent:?}: incarnation {got} is not the registered {registered}")]
    StaleIncarnation {
        /// Agent.
        agent: String,
        /// Registered incarnation.
        registered: u64,
        /// The message's.
        got: u64,
    },
    /// A hello claims an id whose registered incarnation is still live (operator: two
    /// agents configured with one id). The registered agent keeps its grants; the
    /// claimant may retry once the registered one has been silent for
    /// `agent_silence_ms`.
    #[error("agent {agent:?}: two live agents claim this id (incarnations {registered} and {got})")]
    DuplicateAgent {
        /// Agent.
        agent: String,
        /// The live incarnation.
        registered: u64,
        /// The claimant's.
        got: u64,
    },
    /// The agent table is full (operator: raise `max_agents`).
    #[error("agent table full ({max} agents)")]
    AgentTableFull {
        /// The bound.
        max: usize,
    },
    /// The key table is full (operator: raise `max_keys`).
    #[error("key table full ({max} keys)")]
    KeyTableFull {
        /// The bound.
        max: usize,
    },
    /// The key-agent entry table is full (operator: raise `max_entries`).
    #[error("entry table full ({max} key-agent entries)")]
    EntryTableFull {
        /// The bound.
        max: usize,
    },
    /// More keys in one message than `max_keys_per_message` (peer: split it).
    #[error("message names {got} keys, more than {max}")]
    MessageTooLarge {
        /// Keys in the message.
        got: usize,
        /// The bound.
        max: usize,
    },
    /// A rule not in the allocator's config (operator: agent and allocator run different
    /// rule files).
    #[error("unknown rule {0:?} (not in the allocator's rules)")]
    UnknownRule(String),
    /// Wrong number of `*` values for the rule, or an empty or oversized value (peer
    /// bug).
    #[error("key {key}: rule has {expected} `*` entries of 1 to 256 bytes")]
    InvalidKey {
        /// The key.
        key: KeyName,
        /// Wildcards in the rule.
        expected: usize,
    },
    /// One key appears twice in one message (peer bug).
    #[error("key {0} appears twice in one message")]
    DuplicateKey(KeyName),
    /// A demand counter went backwards without a new `counting_since_ns`: negative
    /// demand (peer bug).
    #[error("key {key}: {counter} went backwards from {was} to {now}")]
    NegativeDemand {
        /// The key.
        key: KeyName,
        /// `admitted` or `rejected`.
        counter: &'static str,
        /// Last accepted value.
        was: u64,
        /// This report's.
        now: u64,
    },
    /// Demand no agent can report: counters starting in the agent's future, or
    /// in-flight counts above `bursar_agent::MAX_COST` (peer bug). (Counts that grew by
    /// more than `MAX_COST` in one report are read as `MAX_COST`, not refused.)
    #[error("key {key}: absurd demand ({reason})")]
    AbsurdDemand {
        /// The key.
        key: KeyName,
        /// What is absurd.
        reason: &'static str,
    },
    /// A held grant no allocator could have issued (peer bug): from this term, above
    /// the largest limit the rule has had; from an earlier term, above `MAX_COST` (an
    /// earlier term may have run larger rules: such a grant is learned, and its excess
    /// over the limit counts in the bound).
    #[error("key {0}: held grant above the rule's limit")]
    AbsurdGrant(KeyName),
    /// The message is from a newer term: this allocator has been superseded and must
    /// step down (the shell's election decides; the core changes nothing).
    #[error("message from term {theirs}, newer than this allocator's {ours}: step down")]
    NewerTerm {
        /// This allocator's term.
        ours: u64,
        /// The message's.
        theirs: u64,
    },
    /// An ack of a grant from an older term (peer: delayed across a failover; harmless).
    #[error("ack for term {theirs}, older than this allocator's {ours}")]
    StaleTerm {
        /// This allocator's term.
        ours: u64,
        /// The ack's.
        theirs: u64,
    },
    /// An ack of a sequence number this allocator never issued (peer bug).
    #[error("key {key}: ack of seq {seq}, which was never issued")]
    UnknownSeq {
        /// The key.
        key: KeyName,
        /// The seq.
        seq: u64,
    },
    /// A report not newer (by the agent's clock) than one already accepted (peer:
    /// reordered or replayed; harmless, its counters are cumulative).
    #[error("report at agent time {got} is not newer than {last}")]
    StaleReport {
        /// The last accepted agent time.
        last: u64,
        /// This report's.
        got: u64,
    },
}
