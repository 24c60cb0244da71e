//! The narrow storage trait, the merge algorithm every backend shares, an in-memory
//! reference backend, and the queries built on the trait.
//!
//! A backend supplies a handful of primitive operations inside one transaction
//! ([`TxnOps`]); [`apply_batch`] runs merge and digest bookkeeping over them, so the
//! conflict rule and the digests are the same code on every backend. The
//! conformance suite ([`crate::conformance`]) checks a backend against this contract.

use std::collections::{BTreeMap, BTreeSet, HashMap};
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

/// Where an event sits in a scan: its bucket and the backend's arrival sequence
/// number. Within a bucket, scans run in arrival order on that node (so cursors are
/// per node; digests, not scan order, are what nodes compare).
pub type Cursor = (Bucket, u64);

/// The narrow storage interface. All methods take `&self`: writes are serialized by
/// the caller (the shell's single writer task) or by the backend.
pub trait Store: Send + Sync {
    /// Merges a batch, all or nothing. For a durable backend, when this returns `Ok`
    /// every event of the batch is on stable storage; only then may it be
    /// acknowledged.
    fn apply(&self, events: &[Event]) -> Result<ApplyReport, StoreError>;

    /// The event stored for `request_id` (whose key is
    /// `EventKey::from_request_id(request_id)`).
    fn event(&self, request_id: &str) -> Result<Option<Event>, StoreError>;

    /// Calls `f` for each event of `bucket`, in arrival order (through a view of the
    /// last commit).
    fn visit_bucket(&self, bucket: &Bucket, f: &mut dyn FnMut(&Event)) -> Result<(), StoreError> {
        let mut out = Ok(());
        self.read_view(&mut |v| out = v.visit_bucket(bucket, f))?;
        out
    }

    /// Calls `f` for each event whose hour is in `from_hour..to_hour`, in
    /// (hour, tenant, arrival) order, starting strictly after `after` if given, until
    /// `f` returns `Break`.
    fn scan(
        &self,
        from_hour: u64,
        to_hour: u64,
        after: Option<&Cursor>,
        f: &mut dyn FnMut(&Cursor, &Event) -> ControlFlow<()>,
    ) -> Result<(), StoreError>;

    /// Non-empty bucket digests with hour in `from_hour..to_hour` (and of `tenant`, if
    /// given), in (hour, tenant) order (through a view of the last commit).
    fn digests(
        &self,
        from_hour: u64,
        to_hour: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<(Bucket, Digest)>, StoreError> {
        let mut out = Ok(Vec::new());
        self.read_view(&mut |v| out = v.digests(from_hour, to_hour, tenant))?;
        out
    }

    /// As [`Store::digests`], or `None` when more than `max` buckets match (found
    /// without collecting them all).
    #[allow(clippy::type_complexity)]
    fn digests_at_most(
        &self,
        from_hour: u64,
        to_hour: u64,
        tenant: Option<&str>,
        max: usize,
    ) -> Result<Option<Vec<(Bucket, Digest)>>, StoreError> {
        let mut out = Ok(None);
        self.read_view(&mut |v| out = v.digests_at_most(from_hour, to_hour, tenant, max))?;
        out
    }

    /// As [`ReadView::newest_digests`].
    #[allow(clippy::type_complexity)]
    fn newest_digests(
        &self,
        to: &Bucket,
        max: usize,
        bytes_max: usize,
    ) -> Result<(Vec<(Bucket, Digest)>, Bucket), StoreError> {
        let mut out = Ok((Vec::new(), Bucket::default()));
        self.read_view(&mut |v| out = v.newest_digests(to, max, bytes_max))?;
        out
    }

    /// The root digest (the sum of every bucket's).
    fn root(&self) -> Result<Digest, StoreError>;

    /// Up to `limit` recorded conflicts, in key order.
    fn conflicts(&self, limit: usize) -> Result<Vec<Conflict>, StoreError>;

    /// Calls `f` with a read-only view of one committed state: every read through it
    /// sees the same commits, whatever lands meanwhile (exact totals are computed from
    /// several reads, and must match the digest they report).
    fn read_view(&self, f: &mut dyn FnMut(&dyn ReadView)) -> Result<(), StoreError>;

    /// This store's identity: made once when the store is created, kept by every
    /// reopen, and new when the data is gone and the node starts empty under the same
    /// node id. Writers that count which nodes hold their events (the agent's outbox)
    /// credit a node id together with its store id, so a wiped node is never counted
    /// as holding what it held before.
    fn store_id(&self) -> &str;
}

/// A fresh store identity: 128 bits as 32 hex digits, from the process's random
/// hash keys (seeded by the operating system) over the time and process id.
pub fn new_store_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let half = || {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        h.finish()
    };
    format!("{:016x}{:016x}", half(), half())
}

/// Reads from one committed state of a store ([`Store::read_view`]); the same
/// contracts as the [`Store`] methods of the same names.
pub trait ReadView {
    /// As [`Store::root`].
    fn root(&self) -> Result<Digest, StoreError>;

    /// As [`Store::visit_bucket`].
    fn visit_bucket(&self, bucket: &Bucket, f: &mut dyn FnMut(&Event)) -> Result<(), StoreError>;

    /// As [`Store::digests`].
    fn digests(
        &self,
        from_hour: u64,
        to_hour: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<(Bucket, Digest)>, StoreError>;

    /// As [`Store::digests_at_most`]. The default collects them all first (fine for a
    /// store in memory); a store on disk stops reading past `max`.
    #[allow(clippy::type_complexity)]
    fn digests_at_most(
        &self,
        from_hour: u64,
        to_hour: u64,
        tenant: Option<&str>,
        max: usize,
    ) -> Result<Option<Vec<(Bucket, Digest)>>, StoreError> {
        let all = self.digests(from_hour, to_hour, tenant)?;
        Ok((all.len() <= max).then_some(all))
    }

    /// The newest bucket digests before bucket `to` (exclusive; an empty tenant is the
    /// hour's start, hour `u64::MAX` past every bucket), in (hour, tenant) order, and
    /// the bucket they start at: all of them, from `Bucket::default()` (hour 0, no
    /// tenant), when they are at most `max` (at least 1) and take at most `bytes_max`
    /// ([`crate::reconcile::offer_entry_bytes`]; at least one is given); else the
    /// newest that fit, from the oldest of them. (Reconciliation's offer: it was every
    /// digest of the store, read and copied each round, and then cut; then whole
    /// hours, which one busy hour could make larger than a frame.) The default reads
    /// them all (fine for a store in memory); a store on disk reads backwards and stops.
    #[allow(clippy::type_complexity)]
    fn newest_digests(
        &self,
        to: &Bucket,
        max: usize,
        bytes_max: usize,
    ) -> Result<(Vec<(Bucket, Digest)>, Bucket), StoreError> {
        let mut all = self.digests(0, to.hour.saturating_add(1), None)?;
        all.retain(|(b, _)| b < to);
        let mut taken = NewestTaken::new(max, bytes_max);
        let start = all
            .iter()
            .rposition(|(b, _)| !taken.take(b))
            .map_or(0, |i| i + 1);
        let from = if start == 0 {
            Bucket::default()
        } else {
            all[start].0.clone()
        };
        Ok((all[start..].to_vec(), from))
    }
}

/// The count and bytes [`ReadView::newest_digests`] has taken, newest first.
pub struct NewestTaken {
    max: usize,
    bytes_max: usize,
    n: usize,
    bytes: usize,
}

impl NewestTaken {
    /// Room for `max` buckets (at least 1) and `bytes_max` bytes (at least one bucket).
    pub fn new(max: usize, bytes_max: usize) -> NewestTaken {
        NewestTaken {
            max: max.max(1),
            bytes_max,
            n: 0,
            bytes: 0,
        }
    }

    /// Takes `b` if it fits (the first always does); false once one does not.
    pub fn take(&mut self, b: &Bucket) -> bool {
        let size = crate::reconcile::offer_entry_bytes(b);
        if self.n > 0 && (self.n == self.max || self.bytes + size > self.bytes_max) {
            return false;
        }
        self.n += 1;
        self.bytes += size;
        true
    }
}

/// The primitive operations a backend offers inside one write transaction. Events are
/// found by request id (equivalent to their key, which derives from it): an index by
/// request id keeps time-ordered ids (UUIDv7, `node-counter`) clustered, where an
/// index by hash would touch pages all over the tree on every commit.
pub trait TxnOps {
    /// If nothing is stored for `request_id`, stores `encoded` under `bucket` and
    /// returns `None`; otherwise changes nothing and returns the stored encoding. (One
    /// index operation for the common case, a new event, instead of a lookup and an
    /// insert.)
    fn insert_new(
        &mut self,
        request_id: &str,
        bucket: &Bucket,
        encoded: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError>;
    /// Removes the event stored for `request_id`, which sits in `bucket`.
    fn remove(&mut self, request_id: &str, bucket: &Bucket) -> Result<(), StoreError>;
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
///
/// Events are applied in request-id order (stable, so repeats of one id keep their
/// batch order and get the same outcomes as in batch order); the final state does not
/// depend on order anyway, and sorted inserts touch fewer pages.
pub fn apply_batch(
    ops: &mut impl TxnOps,
    events: &[Event],
    delta: &mut DigestSet,
) -> Result<ApplyReport, StoreError> {
    let mut order: Vec<usize> = (0..events.len()).collect();
    order.sort_by(|&a, &b| events[a].request_id.cmp(&events[b].request_id));
    let mut outcomes = vec![Outcome::Duplicate; events.len()];
    let mut buf = Vec::with_capacity(256);
    for i in order {
        let e = &events[i];
        buf.clear();
        e.encode_into(&mut buf);
        let bucket = Bucket::of(e);
        let existing = ops.insert_new(&e.request_id, &bucket, &buf)?;
        outcomes[i] = match resolve(existing.as_deref(), &buf) {
            Merge::New => {
                delta.add(&bucket, &Digest::of_event(e, element_hash(&buf)));
                Outcome::New
            }
            Merge::Duplicate => Outcome::Duplicate,
            Merge::KeepExisting => {
                ops.put_conflict(&e.key(), element_hash(&buf), &buf)?;
                Outcome::Conflict
            }
            Merge::Replace => {
                let key = e.key();
                let old_bytes = existing.expect("Replace implies an existing event");
                let old = Event::decode(&old_bytes).map_err(|source| StoreError::Corrupt {
                    what: format!("event {key}"),
                    source,
                })?;
                let old_hash = element_hash(&old_bytes);
                let old_bucket = Bucket::of(&old);
                ops.remove(&e.request_id, &old_bucket)?;
                delta.sub(&old_bucket, &Digest::of_event(&old, old_hash));
                ops.put_conflict(&key, old_hash, &old_bytes)?;
                let stored = ops.insert_new(&e.request_id, &bucket, &buf)?;
                assert!(stored.is_none(), "insert after remove found an event");
                delta.add(&bucket, &Digest::of_event(e, element_hash(&buf)));
                Outcome::Conflict
            }
        };
    }
    let mut report = ApplyReport::default();
    report.outcomes.reserve(events.len());
    for o in outcomes {
        report.push(o);
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
    let mut result = Ok(UsageTotals::default());
    // One committed state for every read: a commit landing between the digests, the
    // corrections pass and the usage pass (say an event and its void) would otherwise
    // give totals that match neither state, nor the digest they report.
    store.read_view(&mut |view| {
        result = totals_in(view, tenant, from_hour, to_hour, group_by_model, limits);
    })?;
    result
}

fn totals_in(
    view: &dyn ReadView,
    tenant: &str,
    from_hour: u64,
    to_hour: u64,
    group_by_model: bool,
    limits: TotalsLimits,
) -> Result<UsageTotals, QueryError> {
    let mut out = UsageTotals::default();
    for (bucket, digest) in view.digests(from_hour, to_hour, Some(tenant))? {
        let mut pass = BucketPass::new(&mut out, &digest, group_by_model, limits);
        view.visit_bucket(&bucket, &mut |e| pass.correction(e))?;
        view.visit_bucket(&bucket, &mut |e| pass.usage(e))?;
        pass.finish()?;
    }
    Ok(out)
}

/// The in-memory reference backend: the model the conformance suite and property
/// tests compare real backends against. Not durable.
#[derive(Debug)]
pub struct MemStore {
    inner: Mutex<MemInner>,
    store_id: String,
}

impl Default for MemStore {
    fn default() -> MemStore {
        MemStore {
            inner: Mutex::default(),
            store_id: new_store_id(),
        }
    }
}

#[derive(Debug, Default, Clone)]
struct MemInner {
    log: BTreeMap<u64, Vec<u8>>,
    ids: HashMap<String, u64>,
    index: BTreeSet<Cursor>,
    digests: DigestSet,
    conflicts: BTreeMap<(EventKey, u128), Vec<u8>>,
    next_seq: u64,
}

impl TxnOps for MemInner {
    fn insert_new(
        &mut self,
        rid: &str,
        bucket: &Bucket,
        encoded: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(seq) = self.ids.get(rid) {
            return Ok(Some(self.log[seq].clone()));
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.log.insert(seq, encoded.to_vec());
        self.ids.insert(rid.to_string(), seq);
        self.index.insert((bucket.clone(), seq));
        Ok(None)
    }
    fn remove(&mut self, rid: &str, bucket: &Bucket) -> Result<(), StoreError> {
        let seq = self.ids.remove(rid).expect("remove of a stored event");
        self.log.remove(&seq);
        assert!(
            self.index.remove(&(bucket.clone(), seq)),
            "index entry missing"
        );
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
        assert_eq!(g.index.len(), g.log.len(), "index and log differ in size");
        assert_eq!(g.ids.len(), g.log.len(), "ids and log differ in size");
        let mut fresh = DigestSet::default();
        for (bucket, seq) in &g.index {
            let bytes = &g.log[seq];
            let e = Event::decode(bytes).expect("stored events decode");
            assert_eq!(
                &Bucket::of(&e),
                bucket,
                "event indexed under the wrong bucket"
            );
            assert_eq!(
                g.ids.get(&e.request_id),
                Some(seq),
                "ids does not point here"
            );
            fresh.add(bucket, &Digest::of_event(&e, element_hash(bytes)));
        }
        assert_eq!(
            fresh, g.digests,
            "incremental digests differ from a recount"
        );
    }
}

impl ReadView for MemInner {
    fn root(&self) -> Result<Digest, StoreError> {
        Ok(self.digests.root())
    }

    fn visit_bucket(&self, bucket: &Bucket, f: &mut dyn FnMut(&Event)) -> Result<(), StoreError> {
        for (b, seq) in self.index.range((bucket.clone(), 0)..) {
            if b != bucket {
                break;
            }
            f(&decode(*seq, &self.log[seq])?);
        }
        Ok(())
    }

    fn digests(
        &self,
        from_hour: u64,
        to_hour: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<(Bucket, Digest)>, StoreError> {
        Ok(self
            .digests
            .buckets()
            .iter()
            .filter(|(b, _)| b.hour >= from_hour && b.hour < to_hour)
            .filter(|(b, _)| tenant.is_none_or(|t| b.tenant == t))
            .map(|(b, d)| (b.clone(), *d))
            .collect())
    }
}

fn decode(seq: u64, bytes: &[u8]) -> Result<Event, StoreError> {
    Event::decode(bytes).map_err(|source| StoreError::Corrupt {
        what: format!("event at log position {seq}"),
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

    fn event(&self, request_id: &str) -> Result<Option<Event>, StoreError> {
        let g = self.lock();
        g.ids
            .get(request_id)
            .map(|seq| decode(*seq, &g.log[seq]))
            .transpose()
    }

    fn scan(
        &self,
        from_hour: u64,
        to_hour: u64,
        after: Option<&Cursor>,
        f: &mut dyn FnMut(&Cursor, &Event) -> ControlFlow<()>,
    ) -> Result<(), StoreError> {
        let g = self.lock();
        let lo = (
            Bucket {
                hour: from_hour,
                tenant: String::new(),
            },
            0,
        );
        for entry in g.index.range(lo..) {
            if entry.0.hour >= to_hour {
                break;
            }
            if after.is_some_and(|a| entry <= a) {
                continue;
            }
            if f(entry, &decode(entry.1, &g.log[&entry.1])?).is_break() {
                break;
            }
        }
        Ok(())
    }

    fn root(&self) -> Result<Digest, StoreError> {
        Ok(self.lock().digests.root())
    }

    fn read_view(&self, f: &mut dyn FnMut(&dyn ReadView)) -> Result<(), StoreError> {
        // The lock held for the whole view: writers wait (this is the reference model,
        // not a server's store).
        f(&*self.lock());
        Ok(())
    }

    fn store_id(&self) -> &str {
        &self.store_id
    }

    fn conflicts(&self, limit: usize) -> Result<Vec<Conflict>, StoreError> {
        let g = self.lock();
        g.conflicts
            .iter()
            .take(limit)
            .map(|((key, _), bytes)| {
                Ok(Conflict {
                    key: *key,
                    loser: Event::decode(bytes).map_err(|source| StoreError::Corrupt {
                        what: format!("conflict {key}"),
                        source,
                    })?,
                })
            })
            .collect()
    }
}
