//! Usage records: what the engine hands to billing (the ledger consumes them).
//!
//! "The limiter gates, the meter bills": the engine's counters are never read for
//! billing. Each finished lease produces exactly one record through a [`UsageSink`]:
//! a completion (`Completed`), an expiry (`Expired`, no actual usage known), and, for a
//! completion that arrives after its lease expired, a second record (`LateCompleted`)
//! carrying the actual usage. A duplicate completion produces none.

use std::sync::{Arc, Mutex};

use crate::config::{Dimension, Mode};
use crate::key::LimitKey;

/// Actual usage reported at completion. Integers only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens actually processed.
    pub input_tokens: u64,
    /// Of which served from a prompt cache.
    pub cached_input_tokens: u64,
    /// Completion tokens actually generated.
    pub output_tokens: u64,
}

/// How the request ended, as the caller reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionStatus {
    /// Finished normally.
    Ok,
    /// The upstream failed.
    UpstreamError,
    /// The client went away; usage is what was generated.
    ClientGone,
}

/// Why a record was produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Completed while the lease was live.
    Completed(CompletionStatus),
    /// The lease expired without a completion; nothing was refunded.
    Expired,
    /// Completed after the lease expired: recorded for billing, nothing refunded.
    LateCompleted(CompletionStatus),
}

/// One usage record, borrowed for the duration of [`UsageSink::record`].
#[derive(Clone, Copy)]
pub struct UsageRecord<'a> {
    /// The request id (the ledger's `event_key` derives from it).
    pub request_id: &'a str,
    /// Why the record exists.
    pub outcome: Outcome,
    /// Actual usage, when known (not for `Expired`).
    pub usage: Option<Usage>,
    /// Input tokens reserved at admission.
    pub reserved_input_tokens: u64,
    /// `max_tokens` as the request named it, if it did.
    pub max_output_tokens: Option<u64>,
    /// Engine time of admission, ns.
    pub admitted_at_ns: u64,
    /// Engine time of this record, ns.
    pub at_ns: u64,
    /// The limits the lease held (keys carry the tenant's descriptor values).
    pub limits: &'a [Option<RecordLimit<'a>>],
}

impl UsageRecord<'_> {
    /// The limits the lease held.
    pub fn limits(&self) -> impl Iterator<Item = &RecordLimit<'_>> {
        self.limits.iter().flatten()
    }
}

/// One limit of a finished lease, as a usage record names it.
#[derive(Clone, Copy, Debug)]
pub struct RecordLimit<'a> {
    pub(crate) key: &'a Arc<LimitKey>,
    pub(crate) dimension: Dimension,
    pub(crate) mode: Mode,
    pub(crate) reserved: u64,
}

impl RecordLimit<'_> {
    /// The limit key.
    pub fn key(&self) -> &LimitKey {
        self.key
    }

    /// The limit key, shared (for a sink that keeps it past the call).
    pub fn shared_key(&self) -> &Arc<LimitKey> {
        self.key
    }

    /// The dimension.
    pub fn dimension(&self) -> Dimension {
        self.dimension
    }

    /// Units reserved at admission.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Enforce or shadow.
    pub fn mode(&self) -> Mode {
        self.mode
    }
}

/// Receives usage records. Called on the completion path, outside any engine lock;
/// implementations must not block for long. The durable one is the shell's
/// `shell::outbox::Outbox` (it queues the record without allocating; a writer thread
/// commits it to disk).
pub trait UsageSink: Send + Sync {
    /// Takes one record.
    fn record(&self, record: &UsageRecord<'_>);
}

/// Drops every record. For benchmarks and for deployments without billing.
#[derive(Debug, Default)]
pub struct DiscardSink;

impl UsageSink for DiscardSink {
    fn record(&self, _: &UsageRecord<'_>) {}
}

/// An owned copy of a record, as [`MemorySink`] keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedRecord {
    /// The request id.
    pub request_id: String,
    /// Why the record exists.
    pub outcome: Outcome,
    /// Actual usage, when known.
    pub usage: Option<Usage>,
    /// Limit keys (`rule{k=v}`) and units reserved on each.
    pub limits: Vec<(String, u64)>,
}

/// Keeps records in memory, bounded: past `max` records, new ones are counted in
/// `dropped` rather than kept. For tests and the demo.
#[derive(Debug)]
pub struct MemorySink {
    records: Mutex<(Vec<OwnedRecord>, u64)>,
    max: usize,
}

impl MemorySink {
    /// A sink that keeps at most `max` records.
    pub fn new(max: usize) -> MemorySink {
        MemorySink {
            records: Mutex::new((Vec::new(), 0)),
            max,
        }
    }

    /// Takes the records kept so far, and how many were dropped at the bound.
    pub fn take(&self) -> (Vec<OwnedRecord>, u64) {
        let mut g = self.records.lock().unwrap_or_else(|e| e.into_inner());
        let dropped = std::mem::take(&mut g.1);
        (std::mem::take(&mut g.0), dropped)
    }
}

impl UsageSink for MemorySink {
    fn record(&self, r: &UsageRecord<'_>) {
        let mut g = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if g.0.len() >= self.max {
            g.1 += 1;
            return;
        }
        g.0.push(OwnedRecord {
            request_id: r.request_id.to_string(),
            outcome: r.outcome,
            usage: r.usage,
            limits: r
                .limits()
                .map(|l| (l.key().as_str().to_string(), l.reserved()))
                .collect(),
        });
    }
}
