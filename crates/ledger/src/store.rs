//! The narrow storage trait, the merge algorithm every backend shares, an in-memory
//! reference backend, and the queries built on the trait.
//!
//! A backend supplies a handful of primitive operations inside one transaction
//! ([`TxnOps`]); [`apply_batch`] runs merge and digest bookkeeping over them, so the
//! conflict rule and the digests are the same code on every backend. The
//! conformance suite ([`crate::conformance`]) checks a backend against this contract.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::ControlFlow;
use std::sync::Mutex;

use crate::digest::{Bucket, Digest, DigestSet};
use crate::event::{DecodeError, Event, EventKey, element_hash};
use crate::merge::{ApplyReport, Conflict, Merge, Outcome, resolve};
use crate::totals::{BucketPass, TotalsError, TotalsLimits, UsageTotals};

/// A storage failure. Each variant says whether state changed and whose the cause is.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The data file could not be opened: it is corrupt, not a ledger file, from an
    /// incompatible version, or locked by another process. Nothing was read or
    /// changed; the operator must act (restore from a peer or backup, or move the
    /// file aside). The ledger never starts empty over a damaged file.
    #[error("cannot open ledger data file {path}: {reason}")]
    Open {
        /// The file.
        path: String,
        /// What the backend said.
        reason: String,
    },
    /// A stored record failed to decode: the data file is damaged (or a bug wrote it).
    /// Nothing was changed by the failing call.
    #[error("corrupt record in the ledger store ({what}): {source}")]
    Corrupt {
        /// Which record.
        what: String,
        /// The decoding failure.
        source: DecodeError,
    },
    /// The backend failed (I/O, disk full, ...). The batch being applied, if any, was
    /// not committed and none of it is acknowledged; it is safe to retry.
    #[error("ledger store failure (nothing committed): {0}")]
    Backend(String),
}

/// The narrow storage interface. All methods take `&self`: writes are serialized by
/// the caller (the shell's single writer task) or by the backend.
pub trait Store: Send + Sync {
    /// Merges a batch, all or nothing. For a durable backend, when this returns `Ok`
    /// every event of the batch is on stable storage; only then may it be
    /// acknowledged.
    fn apply(&self, events: &[Event]) -> Result<ApplyReport, StoreError>;

    /// The event stored under `key`.
    fn event(&self, key: &EventKey) -> Result<Option<Event>, StoreError>;

    /// Calls `f` for each event of `bucket`, in key order.
    fn visit_bucket(&self, bucket: &Bucket, f: &mut dyn FnMut(&Event)) -> Result<(), StoreError>;

    /// Calls `f` for each event whose hour is in `from_hour..to_hour`, in
    /// (hour, tenant, key) order, starting strictly after `after` if given, until `f`
    /// returns `Break`.
    fn scan(
        &self,
        from_hour: u64,
        to_hour: u64,
        after: Option<&(Bucket, EventKey)>,
        f: &mut dyn FnMut(&Event) -> ControlFlow<()>,
    ) -> Result<(), StoreError>;

    /// Non-empty bucket digests with hour in `from_hour..to_hour` (and of `tenant`, if
    /// given), in (hour, tenant) order.
    fn digests(
        &self,
        from_hour: u64,
        to_hour: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<(Bucket, Digest)>, StoreError>;

    /// The root digest (the sum of every bucket's).
    fn root(&self) -> Result<Digest, StoreError>;

    /// Up to `limit` recorded conflicts, in key order.
    fn conflicts(&self, limit: usize) -> Result<Vec<Conflict>, StoreError>;
}

/// The primitive operations a backend offers inside one write transaction.
pub trait TxnOps {
    /// The stored encoding under `key`.
    fn get(&mut self, key: &EventKey) -> Result<Option<Vec<u8>>, StoreError>;
    /// Stores `encoded` under `key` (replacing any) and indexes it under `bucket`.
    fn put(&mut self, key: &EventKey, bucket: &Bucket, encoded: &[u8]) -> Result<(), StoreError>;
    /// Removes the index entry of `key` under `bucket` (the event itself is replaced
    /// by the following `put`).
    fn unindex(&mut self, key: &EventKey, bucket: &Bucket) -> Result<(), StoreError>;
    /// Records a conflict loser.
    fn put_conflict(
        &mut self,
        key: &EventKey,
        loser_hash: u128,
        loser: &[u8],
    ) -> Result<(), StoreError>;
}

/// Merges `events` through `ops`, adding the digest changes to `delta`. Shared by
/// every backend; the backend commits `ops` and `delta` together.
pub fn apply_batch(
    ops: &mut impl TxnOps,
    events: &[Event],
    delta: &mut DigestSet,
) -> Result<ApplyReport, StoreError> {
    let mut report = ApplyReport::default();
    report.outcomes.reserve(events.len());
    let mut buf = Vec::with_capacity(256);
    for e in events {
        buf.clear();
        e.encode_into(&mut buf);
        let key = e.key();
        let existing = ops.get(&key)?;
        match resolve(existing.as_deref(), &buf) {
            Merge::New => {
                let bucket = Bucket::of(e);
                ops.put(&key, &bucket, &buf)?;
                delta.add(&bucket, &Digest::of_event(e, element_hash(&buf)));
                report.push(Outcome::New);
            }
            Merge::Duplicate => report.push(Outcome::Duplicate),
            Merge::KeepExisting => {
                ops.put_conflict(&key, element_hash(&buf), &buf)?;
                report.push(Outcome::Conflict);
            }
            Merge::Replace => {
                let old_bytes = existing.expect("Replace implies an existing event");
                let old = Event::decode(&old_bytes).map_err(|source| StoreError::Corrupt {
                    what: format!("event {key}"),
                    source,
                })?;
                let old_hash = element_hash(&old_bytes);
                let old_bucket = Bucket::of(&old);
                ops.unindex(&key, &old_bucket)?;
                delta.sub(&old_bucket, &Digest::of_event(&old, old_hash));
                ops.put_conflict(&key, old_hash, &old_bytes)?;
                let bucket = Bucket::of(e);
                ops.put(&key, &bucket, &buf)?;
                delta.add(&bucket, &Digest::of_event(e, element_hash(&buf)));
                report.push(Outcome::Conflict);
            }
        }
    }
    Ok(report)
}

/// Why a query failed.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The query is too large for its bounds.
    #[error(transparent)]
    Totals(#[from] TotalsError),
}

/// Exact totals of `tenant` over hours `from_hour..to_hour`, with corrections applied
/// (see [`crate::totals`]), grouped by model if asked, plus the digest of the buckets
/// they came from.
pub fn usage_totals(
    store: &dyn Store,
    tenant: &str,
    from_hour: u64,
    to_hour: u64,
    group_by_model: bool,
    limits: TotalsLimits,
) -> Result<UsageTotals, QueryError> {
    let mut out = UsageTotals::default();
    for (bucket, digest) in store.digests(from_hour, to_hour, Some(tenant))? {
        let mut pass = BucketPass::new(&mut out, &digest, group_by_model, limits);
        store.visit_bucket(&bucket, &mut |e| pass.correction(e))?;
        store.visit_bucket(&bucket, &mut |e| pass.usage(e))?;
        pass.finish()?;
    }
    Ok(out)
}

/// The in-memory reference backend: the model the conformance suite and property
/// tests compare real backends against. Not durable.
#[derive(Debug, Default)]
pub struct MemStore {
    inner: Mutex<MemInner>,
}

#[derive(Debug, Default, Clone)]
struct MemInner {
    events: BTreeMap<EventKey, Vec<u8>>,
    index: BTreeSet<(Bucket, EventKey)>,
    digests: DigestSet,
    conflicts: BTreeMap<(EventKey, u128), Vec<u8>>,
}

impl TxnOps for MemInner {
    fn get(&mut self, key: &EventKey) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.events.get(key).cloned())
    }
    fn put(&mut self, key: &EventKey, bucket: &Bucket, encoded: &[u8]) -> Result<(), StoreError> {
        self.events.insert(*key, encoded.to_vec());
        self.index.insert((bucket.clone(), *key));
        Ok(())
    }
    fn unindex(&mut self, key: &EventKey, bucket: &Bucket) -> Result<(), StoreError> {
        self.index.remove(&(bucket.clone(), *key));
        Ok(())
    }
    fn put_conflict(&mut self, key: &EventKey, h: u128, loser: &[u8]) -> Result<(), StoreError> {
        self.conflicts.insert((*key, h), loser.to_vec());
        Ok(())
    }
}

impl MemStore {
    /// An empty store.
    pub fn new() -> MemStore {
        MemStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The digests as a set (for tests).
    pub fn digest_set(&self) -> DigestSet {
        self.lock().digests.clone()
    }

    /// Panics if the index, digests and events disagree (bugs).
    pub fn check_invariants(&self) {
        let g = self.lock();
        g.digests.check_invariants();
        assert_eq!(
            g.index.len(),
            g.events.len(),
            "index and events differ in size"
        );
        let mut fresh = DigestSet::default();
        for (bucket, key) in &g.index {
            let bytes = &g.events[key];
            let e = Event::decode(bytes).expect("stored events decode");
            assert_eq!(
                &Bucket::of(&e),
                bucket,
                "event indexed under the wrong bucket"
            );
            fresh.add(bucket, &Digest::of_event(&e, element_hash(bytes)));
        }
        assert_eq!(
            fresh, g.digests,
            "incremental digests differ from a recount"
        );
    }
}

fn decode(key: &EventKey, bytes: &[u8]) -> Result<Event, StoreError> {
    Event::decode(bytes).map_err(|source| StoreError::Corrupt {
        what: format!("event {key}"),
        source,
    })
}

impl Store for MemStore {
    fn apply(&self, events: &[Event]) -> Result<ApplyReport, StoreError> {
        let mut g = self.lock();
        let mut delta = DigestSet::default();
        let report = apply_batch(&mut *g, events, &mut delta)?;
        for (bucket, d) in delta.buckets() {
            g.digests.add(bucket, d);
        }
        Ok(report)
    }

    fn event(&self, key: &EventKey) -> Result<Option<Event>, StoreError> {
        let g = self.lock();
        g.events.get(key).map(|b| decode(key, b)).transpose()
    }

    fn visit_bucket(&self, bucket: &Bucket, f: &mut dyn FnMut(&Event)) -> Result<(), StoreError> {
        let g = self.lock();
        let lo = (bucket.clone(), EventKey([0; 16]));
        for (b, key) in g.index.range(lo..) {
            if b != bucket {
                break;
            }
            f(&decode(key, &g.events[key])?);
        }
        Ok(())
    }

    fn scan(
        &self,
        from_hour: u64,
        to_hour: u64,
        after: Option<&(Bucket, EventKey)>,
        f: &mut dyn FnMut(&Event) -> ControlFlow<()>,
    ) -> Result<(), StoreError> {
        let g = self.lock();
        let lo = (
            Bucket {
                hour: from_hour,
                tenant: String::new(),
            },
            EventKey([0; 16]),
        );
        for entry in g.index.range(lo..) {
            if entry.0.hour >= to_hour {
                break;
            }
            if after.is_some_and(|a| entry <= a) {
                continue;
            }
            if f(&decode(&entry.1, &g.events[&entry.1])?).is_break() {
                break;
            }
        }
        Ok(())
    }

    fn digests(
        &self,
        from_hour: u64,
        to_hour: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<(Bucket, Digest)>, StoreError> {
        let g = self.lock();
        Ok(g.digests
            .buckets()
            .iter()
            .filter(|(b, _)| b.hour >= from_hour && b.hour < to_hour)
            .filter(|(b, _)| tenant.is_none_or(|t| b.tenant == t))
            .map(|(b, d)| (b.clone(), *d))
            .collect())
    }

    fn root(&self) -> Result<Digest, StoreError> {
        Ok(self.lock().digests.root())
    }

    fn conflicts(&self, limit: usize) -> Result<Vec<Conflict>, StoreError> {
        let g = self.lock();
        g.conflicts
            .iter()
            .take(limit)
            .map(|((key, _), bytes)| {
                Ok(Conflict {
                    key: *key,
                    loser: decode(key, bytes)?,
                })
            })
            .collect()
    }
}
