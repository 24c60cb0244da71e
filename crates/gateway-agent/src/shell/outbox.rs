//! The agent's durable usage outbox: every usage record becomes a ledger event in a
//! local redb file before the completion that produced it is acknowledged, and stays
//! there until enough ledger nodes hold it (see [`super::forward`]).
//!
//! # Shape
//!
//! - **The sink** ([`Outbox`] implements [`UsageSink`]) runs on the engine's completion
//!   path. It copies the record into a fixed-size `Pending` (the request id inline,
//!   the lease's limits as `Arc` clones: no allocation) and pushes it on a bounded queue
//!   whose storage is reserved up front. It never blocks on I/O.
//! - **One writer thread** owns every write. It drains whatever is queued (up to
//!   [`OutboxConfig::commit_records_max`]) into one redb write transaction
//!   (`Durability::Immediate`: one fsync), together with the ledgers' delivery
//!   acknowledgements and the trim they allow, then publishes the queue position it
//!   committed. Concurrent completions share one fsync (group commit).
//! - **The shell** asks [`Outbox::check_room`] before completing (a full outbox is
//!   `503`, and nothing changes in the engine), takes a [`Outbox::ticket`] after the
//!   engine call, and awaits [`Outbox::durable`] before it answers.
//!
//! # Mapping (record -> ledger event)
//!
//! | record | event |
//! |---|---|
//! | `Completed(status)` | `usage`, `status`, actual tokens |
//! | `Expired` | `usage`, status `expired`, the reserved input tokens, 0 cached, 0 output |
//! | `LateCompleted(status)` | `adjust` of the `Expired` event: actual minus what it counted |
//!
//! The ledger keeps one event per request id, so the late completion cannot be a
//! second usage event; an `adjust` whose target is the expired event turns that
//! request's totals into the actual usage exactly (request id `R#late-completion`).
//! Every event of a request carries the time of its admission (so an adjust lands in
//! its target's hour), the tenant (the value of [`OutboxConfig::tenant_descriptor`])
//! and the other descriptors of the limits the request matched (the engine keeps no
//! other descriptors after admission).
//!
//! # File
//!
//! `DIR/outbox.redb`: `events` (seq -> the ledger's canonical encoding), `meta`
//! (`format`, `next_seq`), `cursors` (holder -> highest seq it acknowledged, where a
//! holder is a ledger node id and its store id, see [`Outbox::holder`]),
//! `origin` (the agent id the outbox was created with). Opening verifies every page
//! checksum and refuses an empty file, a file that is not redb, a redb file without
//! the outbox's format marker and a file another process holds open.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use bursar_ledger::{Body, Event, Status, TokenDeltas, Tokens};
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use tokio::sync::watch;

use crate::config::{MAX_LIMITS_PER_REQUEST, Pattern, RuleSet};
use crate::key::LimitKey;
use crate::lease::InlineId;
use crate::usage::{CompletionStatus, Outcome, Usage, UsageRecord, UsageSink};

/// The data file's name inside the outbox directory.
pub const FILE_NAME: &str = "outbox.redb";
/// Suffix of the request id of a late completion's `adjust` event (reserved: the
/// engine refuses request ids that end with it, so no request's own event can take
/// an adjust's id).
pub const LATE_SUFFIX: &str = crate::engine::RESERVED_ID_SUFFIX;

const FORMAT: u64 = 1;
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const CURSORS: TableDefinition<&str, u64> = TableDefinition::new("cursors");
const ORIGIN: TableDefinition<&str, &str> = TableDefinition::new("origin");
/// Events a ledger refused on their own, (seq, holder) -> a JSON line: see
/// [`Outbox::quarantine`].
const QUARANTINE: TableDefinition<(u64, &str), &str> = TableDefinition::new("quarantine");

/// Outbox settings. Plain data; [`OutboxConfig::validate`] at start-up.
#[derive(Clone, Debug)]
pub struct OutboxConfig {
    /// Directory of `outbox.redb` (created if missing). One agent per directory.
    pub dir: PathBuf,
    /// The events' `origin`. `None`: the id stored in the file, or, for a new file,
    /// `agent-<pid>-<unix ms>`.
    pub agent_id: Option<String>,
    /// Records waiting for the writer (memory reserved up front, 256 bytes each).
    /// New work is refused (503) once three quarters are used; the rest, with
    /// `in_flight_max`, is headroom for records of work already under way (completions,
    /// and lease expiries, which have no caller to refuse). Default 16,384.
    pub queue_max: usize,
    /// Events held (on disk, not yet delivered, plus queued) past which completions
    /// are refused with 503. A ledger outage fills it at the completion rate: size it
    /// for the longest outage to ride out. Default 1,000,000 (~300 MB: ~310 B per event on disk).
    pub events_max: u64,
    /// Most records in one write transaction. Default 10,000.
    pub commit_records_max: usize,
    /// How long a completion waits for its commit before it answers 503. Default 5 s.
    pub durable_timeout: Duration,
    /// Descriptor whose value is the ledger's `tenant`. Default `org`.
    pub tenant_descriptor: String,
    /// Descriptor whose value is the ledger's `model`. Default `model`.
    pub model_descriptor: String,
    /// Distinct ledger nodes that must acknowledge an event before it is trimmed:
    /// `min(2, configured ledgers)`.
    pub ledgers_needed: usize,
    /// Records that may still arrive once new work is refused: one per lease in flight
    /// (a completion or an expiry; set it to the engine's `max_leases`). The queue
    /// takes up to `queue_max + in_flight_max` records, the headroom allocated only if
    /// used, so no answered completion is dropped while the disk stalls. Default 65,536.
    pub in_flight_max: usize,
    /// Events set aside because a ledger refused them on their own (see
    /// [`Outbox::quarantine`]) kept at most; past it a refused event stalls that
    /// ledger's delivery as before (logged) until an operator clears the quarantine.
    /// 0: never set aside. Default 10,000.
    pub quarantine_max: u64,
    /// Whether `DELETE /v1/outbox/quarantine` may forget quarantined events over the
    /// agent's HTTP port (which gateways reach: anyone there could erase billing
    /// records). Default false: the request is refused (403).
    pub quarantine_clear_over_http: bool,
}

impl OutboxConfig {
    /// Defaults for `dir`, needing `ledgers_needed` acknowledgements.
    pub fn new(dir: PathBuf, ledgers_needed: usize) -> OutboxConfig {
        OutboxConfig {
            dir,
            agent_id: None,
            queue_max: 16_384,
            events_max: 1_000_000,
            commit_records_max: 10_000,
            durable_timeout: Duration::from_secs(5),
            tenant_descriptor: "org".into(),
            model_descriptor: "model".into(),
            ledgers_needed,
            in_flight_max: 65_536,
            quarantine_max: 10_000,
            quarantine_clear_over_http: false,
        }
    }

    /// Checks the bounds.
    pub fn validate(&self) -> Result<(), OutboxError> {
        let bad = |reason: &str| Err(OutboxError::Config(reason.to_string()));
        if self.queue_max < 16 || self.queue_max > 1 << 22 {
            return bad("queue_max must be in 16..=4194304");
        }
        if self.events_max < self.queue_max as u64 {
            return bad("events_max must be at least queue_max");
        }
        if self.commit_records_max == 0 {
            return bad("commit_records_max must be at least 1");
        }
        if self.ledgers_needed == 0 {
            return bad("at least one ledger must acknowledge each event");
        }
        if let Some(id) = &self.agent_id
            && (id.is_empty() || id.len() > 256)
        {
            return bad("the agent id must be 1 to 256 bytes");
        }
        Ok(())
    }
}

/// Outbox errors. Each says whether anything changed.
#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    /// The outbox file cannot be used (operator: corrupt, foreign, or in use). Nothing
    /// was changed in the file.
    #[error("outbox {path}: {reason}")]
    Open {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// A setting is out of range (operator).
    #[error("outbox config: {0}")]
    Config(String),
    /// No room: the completion was not performed (retry later). Ledgers are down or
    /// slow, or the disk is.
    #[error("the usage outbox is full ({held} events held, limit {max}); nothing was changed")]
    Full {
        /// Events held.
        held: u64,
        /// The bound that was hit.
        max: u64,
    },
    /// The record was taken but its commit did not finish in time (disk failing or
    /// slow). It stays queued; retrying the completion is safe (idempotent).
    #[error("the usage record was not committed within {0:?}; it stays queued, retry later")]
    NotDurable(Duration),
    /// Reading or writing the file failed (disk or bug).
    #[error("outbox storage: {0}")]
    Storage(String),
}

fn storage(e: impl std::fmt::Display) -> OutboxError {
    OutboxError::Storage(e.to_string())
}

/// A usage record as queued: fixed size, no heap allocation to make one.
pub(crate) struct Pending {
    id: InlineId,
    outcome: Outcome,
    usage: Option<Usage>,
    reserved_input_tokens: u64,
    admitted_at_ns: u64,
    /// Engine time of the record (the completion or expiry): with the wall origin,
    /// the agent's idea of the wall clock then.
    at_ns: u64,
    /// The record's limit keys (what the event's descriptors come from).
    keys: [Option<Arc<LimitKey>>; MAX_LIMITS_PER_REQUEST],
}

impl Pending {
    fn from_record(r: &UsageRecord<'_>) -> Pending {
        let mut keys: [Option<Arc<LimitKey>>; MAX_LIMITS_PER_REQUEST] = Default::default();
        for (dst, src) in keys.iter_mut().zip(r.limits.iter()) {
            *dst = src.map(|l| Arc::clone(l.shared_key()));
        }
        Pending {
            id: InlineId::new(r.request_id),
            outcome: r.outcome,
            usage: r.usage,
            reserved_input_tokens: r.reserved_input_tokens,
            admitted_at_ns: r.admitted_at_ns,
            at_ns: r.at_ns,
            keys,
        }
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct OutboxStats {
    /// Records committed to the file.
    pub committed: AtomicU64,
    /// Write transactions committed.
    pub commits: AtomicU64,
    /// Write transactions that failed (retried).
    pub commit_failures: AtomicU64,
    /// Events removed after enough ledgers acknowledged them.
    pub trimmed: AtomicU64,
    /// Completions refused because the outbox was full (503).
    pub refused_full: AtomicU64,
    /// Completions answered 503 because their commit took too long.
    pub not_durable: AtomicU64,
    /// Records dropped at the queue's hard bound (expiries during a long disk stall;
    /// each is also logged). Should stay 0.
    pub dropped: AtomicU64,
    /// Records whose event failed validation (a bug; logged). Should stay 0.
    pub invalid: AtomicU64,
    /// Events whose time was ahead of the wall clock and was replaced by it.
    pub time_clamped: AtomicU64,
    /// Events whose time was moved up because the wall clock read at start was
    /// behind (by more than `BEHIND_TOLERANCE_MS`).
    pub time_shifted: AtomicU64,
    /// Events set aside for a ledger that refused them on their own.
    pub quarantined: AtomicU64,
}

struct Queue {
    items: VecDeque<Pending>,
    /// Records ever pushed (the position of the last one).
    pushed: u64,
    /// Records ever taken by the writer.
    taken: u64,
    /// Cursor changes to persist: holder -> (remove the stored cursor first, then
    /// raise it to this seq; 0: nothing to raise).
    acks: HashMap<String, (bool, u64)>,
    stop: bool,
    /// The writer is parked on the condvar: the next push must wake it. Pushes while
    /// it works skip the wake-up (a futex syscall each: measured ~2 us per completion).
    writer_parked: bool,
}

struct Shared {
    cfg: OutboxConfig,
    db: Arc<Database>,
    path: PathBuf,
    origin: String,
    q: Mutex<Queue>,
    cv: Condvar,
    /// Queue position committed; completions wait on it, forwarders wake on it.
    committed_tx: watch::Sender<u64>,
    pushed: AtomicU64,
    queued: AtomicUsize,
    /// Events in the file not yet trimmed.
    on_disk: AtomicU64,
    /// Highest seq in the file (0: none yet).
    last_seq: AtomicU64,
    /// Per holder, the highest seq it acknowledged, and each node's current holder
    /// (forwarders' view; the file's copy may lag by one commit).
    cursors: Mutex<Holders>,
    stats: OutboxStats,
    /// Rows in the quarantine table.
    quarantine_held: AtomicU64,
}

/// Who holds what: see [`Outbox::holder`].
#[derive(Debug, Default)]
struct Holders {
    /// Holder -> the highest seq it acknowledged.
    cursors: HashMap<String, u64>,
    /// Ledger node id -> its holder as last learned (its current store).
    bound: HashMap<String, String>,
}

/// The ledger node id part of a holder key (`node \n store`; a key from before store
/// ids is the node id alone).
fn node_of(holder: &str) -> &str {
    holder.rsplit_once('\n').map_or(holder, |(node, _)| node)
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Maps records to ledger events (pure; the writer thread runs it).
pub struct Mapper {
    rules: RuleSet,
    origin: String,
    tenant_descriptor: String,
    model_descriptor: String,
    /// Unix ms at engine time 0.
    wall_origin_ms: u64,
}

/// Placeholder for a tenant or model no matched limit named (the ledger needs a value).
pub const UNKNOWN: &str = "unknown";

impl Mapper {
    /// A mapper for an engine running `rules`, whose time 0 is `wall_origin_ms`.
    pub fn new(
        rules: RuleSet,
        origin: String,
        tenant_descriptor: String,
        model_descriptor: String,
        wall_origin_ms: u64,
    ) -> Mapper {
        Mapper {
            rules,
            origin,
            tenant_descriptor,
            model_descriptor,
            wall_origin_ms,
        }
    }

    /// The ledger event for one record, with sequence number `seq`.
    pub fn event(&self, r: &UsageRecord<'_>, seq: u64) -> Event {
        self.map(
            r.request_id,
            r.outcome,
            r.usage,
            r.reserved_input_tokens,
            r.admitted_at_ns,
            r.limits().map(|l| l.key()),
            seq,
        )
    }

    #[allow(clippy::too_many_arguments)] // the record's fields, spelled out once
    fn map<'k>(
        &self,
        request_id: &str,
        outcome: Outcome,
        usage: Option<Usage>,
        reserved_input_tokens: u64,
        admitted_at_ns: u64,
        keys: impl Iterator<Item = &'k LimitKey>,
        seq: u64,
    ) -> Event {
        let mut descriptors: Vec<(String, String)> = Vec::new();
        for key in keys {
            let Some(rule) = self.rules.rules().get(key.rule_index()) else {
                continue;
            };
            let mut values = key.values();
            for (k, p) in &rule.matches {
                let v = match p {
                    Pattern::Each => values.next(),
                    Pattern::Exact(v) => Some(&**v),
                };
                if let Some(v) = v
                    && !descriptors.iter().any(|(dk, _)| dk == k)
                {
                    descriptors.push((k.clone(), v.to_string()));
                }
            }
        }
        let mut take = |name: &str| {
            descriptors
                .iter()
                .position(|(k, _)| k == name)
                .map(|i| descriptors.remove(i).1)
        };
        let tenant = take(&self.tenant_descriptor).unwrap_or_else(|| UNKNOWN.into());
        let model = take(&self.model_descriptor).unwrap_or_else(|| UNKNOWN.into());
        descriptors.sort();
        descriptors.truncate(bursar_ledger::Limits::default().descriptors_max);
        let time_ms = self.wall_origin_ms + admitted_at_ns / 1_000_000;
        let status = |s: CompletionStatus| match s {
            CompletionStatus::Ok => Status::Ok,
            CompletionStatus::UpstreamError => Status::UpstreamError,
            CompletionStatus::ClientGone => Status::ClientGone,
        };
        let actual = usage.unwrap_or_default();
        let tokens = |u: Usage| Tokens {
            input_tokens: u.input_tokens,
            cached_input_tokens: u.cached_input_tokens.min(u.input_tokens),
            output_tokens: u.output_tokens,
        };
        let (request_id, body) = match outcome {
            Outcome::Completed(s) => (
                request_id.to_string(),
                Body::Usage {
                    status: status(s),
                    tokens: tokens(actual),
                },
            ),
            Outcome::Expired => (
                request_id.to_string(),
                Body::Usage {
                    status: Status::Expired,
                    tokens: expired_tokens(reserved_input_tokens),
                },
            ),
            Outcome::LateCompleted(_) => {
                let was = expired_tokens(reserved_input_tokens);
                let now = tokens(actual);
                (
                    format!("{request_id}{LATE_SUFFIX}"),
                    Body::Adjust {
                        target: bursar_ledger::EventKey::from_request_id(request_id),
                        deltas: TokenDeltas {
                            input_tokens: now.input_tokens as i64 - was.input_tokens as i64,
                            cached_input_tokens: now.cached_input_tokens as i64
                                - was.cached_input_tokens as i64,
                            output_tokens: now.output_tokens as i64 - was.output_tokens as i64,
                        },
                    },
                )
            }
        };
        Event {
            request_id,
            origin: self.origin.clone(),
            seq,
            tenant,
            descriptors,
            model,
            time_ms,
            body,
        }
    }
}

/// What an `Expired` event counts: the input tokens the caller declared at admission
/// (the prompt was sent; the proxy counted it), no output (nobody reported any).
fn expired_tokens(reserved_input_tokens: u64) -> Tokens {
    Tokens {
        input_tokens: reserved_input_tokens,
        cached_input_tokens: 0,
        output_tokens: 0,
    }
}

/// The durable outbox. Create with [`Outbox::open`], hand it to the engine as its
/// sink, then [`Outbox::start`] the writer.
pub struct Outbox {
    sh: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("path", &self.sh.path)
            .field("origin", &self.sh.origin)
            .finish_non_exhaustive()
    }
}

impl Outbox {
    /// Opens (or creates) `cfg.dir/outbox.redb`. A damaged, foreign or busy file is
    /// [`OutboxError::Open`]; nothing is changed in it.
    pub fn open(cfg: OutboxConfig) -> Result<Outbox, OutboxError> {
        cfg.validate()?;
        std::fs::create_dir_all(&cfg.dir).map_err(|e| OutboxError::Open {
            path: cfg.dir.display().to_string(),
            reason: format!("cannot create the directory: {e}"),
        })?;
        let path = cfg.dir.join(FILE_NAME);
        let open_err = |reason: String| OutboxError::Open {
            path: path.display().to_string(),
            reason,
        };
        let existed = path.exists();
        if existed && std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0) == 0 {
            return Err(open_err(
                "the file is empty; refusing to start over it (undelivered usage may be \
                 missing; move it aside to start a new outbox)"
                    .into(),
            ));
        }
        let mut db = Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => open_err(
                "another process holds it open (is another bursar-agent using this \
                 --outbox-dir?); nothing was changed"
                    .into(),
            ),
            e => open_err(format!(
                "{e}; the file is corrupt or not a redb database; nothing was changed"
            )),
        })?;
        if existed {
            let problem = match db.check_integrity() {
                Ok(true) => None,
                Ok(false) => Some(
                    "the file failed its integrity check and redb rolled it back to an \
                     earlier commit: acknowledged usage may be missing"
                        .to_string(),
                ),
                Err(e) => Some(format!(
                    "{e}; the file failed its integrity check and cannot be repaired"
                )),
            };
            if let Some(reason) = problem {
                // redb 3.1.3 panics in `Database::drop` after a failed integrity check
                // (bursar-ledger's redb_store.rs saw the same): leak the handle, the
                // caller stops.
                std::mem::forget(db);
                return Err(open_err(reason));
            }
        }
        let (origin, next_seq, on_disk, cursors, quarantined) =
            init(&db, existed, cfg.agent_id.as_deref()).map_err(open_err)?;
        let queue_max = cfg.queue_max;
        let (committed_tx, _) = watch::channel(0u64);
        let sh = Arc::new(Shared {
            db: Arc::new(db),
            path,
            origin,
            q: Mutex::new(Queue {
                items: VecDeque::with_capacity(queue_max),
                pushed: 0,
                taken: 0,
                acks: HashMap::new(),
                stop: false,
                writer_parked: false,
            }),
            cv: Condvar::new(),
            committed_tx,
            pushed: AtomicU64::new(0),
            queued: AtomicUsize::new(0),
            on_disk: AtomicU64::new(on_disk),
            last_seq: AtomicU64::new(next_seq - 1),
            cursors: Mutex::new(Holders {
                bound: cursors
                    .keys()
                    .map(|k| (node_of(k).to_string(), k.clone()))
                    .collect(),
                cursors,
            }),
            stats: OutboxStats::default(),
            quarantine_held: AtomicU64::new(quarantined),
            cfg,
        });
        Ok(Outbox {
            sh,
            writer: Mutex::new(None),
        })
    }

    /// Starts the writer thread. `rules` must be the engine's rule set (limit keys
    /// index into it); `wall_origin_ms` is the unix time, ms, at engine time 0, which
    /// is taken to be about now (the writer measures how far the wall clock has moved
    /// from that reading since, to correct a reading that was behind).
    pub fn start(&self, rules: RuleSet, wall_origin_ms: u64) {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if w.is_some() {
            return;
        }
        let mapper = Mapper::new(
            rules,
            self.sh.origin.clone(),
            self.sh.cfg.tenant_descriptor.clone(),
            self.sh.cfg.model_descriptor.clone(),
            wall_origin_ms,
        );
        let origin = std::time::Instant::now();
        let sh = Arc::clone(&self.sh);
        *w = Some(
            std::thread::Builder::new()
                .name("bursar-outbox".into())
                .spawn(move || writer(sh, mapper, origin))
                .expect("spawn the outbox writer thread"),
        );
    }

    /// Stops the writer after it has committed everything queued.
    pub fn close(&self) {
        self.sh.lock().stop = true;
        self.sh.cv.notify_all();
        if let Some(h) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }

    /// The events' origin (the agent id).
    pub fn origin(&self) -> &str {
        &self.sh.origin
    }

    /// The data file.
    pub fn path(&self) -> &Path {
        &self.sh.path
    }

    /// Acknowledgements each event needs before it is trimmed.
    pub fn ledgers_needed(&self) -> usize {
        self.sh.cfg.ledgers_needed
    }

    /// Counters.
    pub fn stats(&self) -> &OutboxStats {
        &self.sh.stats
    }

    /// Events held: in the file, not yet trimmed, plus queued.
    pub fn held(&self) -> u64 {
        self.sh.on_disk.load(Ordering::Acquire) + self.sh.queued.load(Ordering::Acquire) as u64
    }

    /// Records waiting for the writer.
    pub fn queued(&self) -> usize {
        self.sh.queued.load(Ordering::Acquire)
    }

    /// Highest seq written so far (0: none).
    pub fn last_seq(&self) -> u64 {
        self.sh.last_seq.load(Ordering::Acquire)
    }

    /// `Ok` if a completion may proceed; [`OutboxError::Full`] (counted) if not.
    pub fn check_room(&self) -> Result<(), OutboxError> {
        let queue_soft = (self.sh.cfg.queue_max - self.sh.cfg.queue_max / 4) as u64;
        let queued = self.sh.queued.load(Ordering::Acquire) as u64;
        let held = self.held();
        let full = if queued >= queue_soft {
            Some((queued, queue_soft))
        } else if held >= self.sh.cfg.events_max {
            Some((held, self.sh.cfg.events_max))
        } else {
            None
        };
        match full {
            None => Ok(()),
            Some((held, max)) => {
                self.sh.stats.refused_full.fetch_add(1, Ordering::Relaxed);
                Err(OutboxError::Full { held, max })
            }
        }
    }

    /// Records dropped at the hard bound so far (compare before and after a call).
    pub fn dropped(&self) -> u64 {
        self.sh.stats.dropped.load(Ordering::Acquire)
    }

    /// The queue position of everything recorded so far: once [`Outbox::durable`]
    /// returns for it, every record pushed before this call is in the file.
    pub fn ticket(&self) -> u64 {
        self.sh.pushed.load(Ordering::Acquire)
    }

    /// Waits until `ticket` is committed, at most the configured timeout.
    pub async fn durable(&self, ticket: u64) -> Result<(), OutboxError> {
        let mut rx = self.sh.committed_tx.subscribe();
        let timeout = self.sh.cfg.durable_timeout;
        match tokio::time::timeout(timeout, rx.wait_for(|c| *c >= ticket)).await {
            Ok(Ok(_)) => Ok(()),
            _ => {
                self.sh.stats.not_durable.fetch_add(1, Ordering::Relaxed);
                Err(OutboxError::NotDurable(timeout))
            }
        }
    }

    /// Blocking form of [`Outbox::durable`] (for tests and non-async callers).
    pub fn durable_blocking(&self, ticket: u64, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while *self.sh.committed_tx.borrow() < ticket {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// A receiver that changes after every commit (forwarders wait on it).
    pub fn commits(&self) -> watch::Receiver<u64> {
        self.sh.committed_tx.subscribe()
    }

    /// The holder key of ledger node `node` serving store `store` (both as its
    /// answers name them), made the node's current holder. A store is the node's data
    /// (`bursar-ledger` makes a new store id when it starts with none): if the node was
    /// known under another store, it lost what that store held, so the old holder's
    /// cursor is forgotten (durably, before any acknowledgement from the new one
    /// counts) and delivery to the node starts again from the oldest event held here.
    /// Events already trimmed were held by enough other nodes when they were trimmed.
    pub fn holder(&self, node: &str, store: &str) -> String {
        let key = format!("{node}\n{store}");
        let mut h = self.sh.cursors.lock().unwrap_or_else(|e| e.into_inner());
        let stale: Vec<String> = h
            .cursors
            .keys()
            .filter(|k| node_of(k) == node && **k != key)
            .cloned()
            .collect();
        h.bound.insert(node.to_string(), key.clone());
        if stale.is_empty() {
            return key;
        }
        for k in &stale {
            h.cursors.remove(k);
        }
        let mut q = self.sh.lock();
        for k in stale {
            q.acks.insert(k, (true, 0));
        }
        drop(q);
        drop(h);
        self.sh.cv.notify_one();
        key
    }

    /// The highest seq `holder` acknowledged (0: none).
    pub fn cursor(&self, holder: &str) -> u64 {
        let h = self.sh.cursors.lock().unwrap_or_else(|e| e.into_inner());
        h.cursors.get(holder).copied().unwrap_or(0)
    }

    /// Records that `holder` (from [`Outbox::holder`]) holds every event up to
    /// `seq`. Persisted (and the trim it allows applied) by the writer's next commit.
    /// Returns false, recording nothing, when `holder` is no longer its node's current
    /// one (the node was learned again under another store meanwhile).
    pub fn ack(&self, holder: &str, seq: u64) -> bool {
        {
            let mut h = self.sh.cursors.lock().unwrap_or_else(|e| e.into_inner());
            if h.bound.get(node_of(holder)).map(String::as_str) != Some(holder) {
                return false;
            }
            let e = h.cursors.entry(holder.to_string()).or_insert(0);
            *e = (*e).max(seq);
            // The queue is locked inside the holders' lock (as in `holder`): a forget
            // and a later ack of the same holder reach the queue in their order.
            let mut q = self.sh.lock();
            let e = q.acks.entry(holder.to_string()).or_insert((false, 0));
            e.1 = e.1.max(seq);
        }
        self.sh.cv.notify_one();
        true
    }

    /// Sets event `seq` aside for `holder`, which refused it on its own (a ledger's
    /// 400 or 413 to a batch of that one event, repeated): the event and `reason` are
    /// written durably to the quarantine table, then `holder`'s cursor moves past it,
    /// so the events behind it reach that ledger instead of waiting forever. The event
    /// stays in the outbox for the other ledgers, and counts as held by `holder` for
    /// the trim: its copy in the quarantine is what an operator replays once the
    /// cause is fixed (`GET /v1/outbox/quarantine` gives each as the ledger's JSON).
    /// Returns false, changing nothing, when the quarantine holds `quarantine_max`
    /// events already; the cursor is not moved when `holder` is no longer current.
    pub fn quarantine(&self, holder: &str, seq: u64, reason: &str) -> Result<bool, OutboxError> {
        if self.sh.quarantine_held.load(Ordering::Acquire) >= self.sh.cfg.quarantine_max {
            return Ok(false);
        }
        // Only for the node's current holder: one learned again under another store
        // meanwhile is sent the event afresh instead.
        {
            let h = self.sh.cursors.lock().unwrap_or_else(|e| e.into_inner());
            if h.bound.get(node_of(holder)).map(String::as_str) != Some(holder) {
                return Ok(false);
            }
        }
        let event = {
            let txn = self.sh.db.begin_read().map_err(storage)?;
            let t = txn.open_table(EVENTS).map_err(storage)?;
            let v = t.get(seq).map_err(storage)?;
            v.map(|v| Event::decode(v.value()))
        };
        let event = match event {
            Some(Ok(e)) => bursar_ledger::wire::event_json(&e),
            Some(Err(e)) => {
                return Err(OutboxError::Storage(format!(
                    "event {seq} in the outbox does not decode ({e:?}); the file is damaged"
                )));
            }
            // Trimmed meanwhile: enough other ledgers hold it; nothing to keep.
            None => serde_json::Value::Null,
        };
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let (node, store) = holder.split_once('\n').unwrap_or((holder, ""));
        let line = serde_json::json!({
            "seq": seq,
            "ledger_node": node,
            "ledger_store": store,
            "refused_at_ms": now_ms,
            "reason": reason.chars().take(1024).collect::<String>(),
            "event": event,
        })
        .to_string();
        let txn = self.sh.db.begin_write().map_err(storage)?;
        let (new, held) = {
            let mut t = txn.open_table(QUARANTINE).map_err(storage)?;
            let new = t
                .insert((seq, holder), line.as_str())
                .map_err(storage)?
                .is_none();
            (new, t.len().map_err(storage)?)
        };
        txn.commit().map_err(storage)?;
        // The table's own count as of this commit (write transactions are serial): a
        // clear committed in between cannot make it wrap.
        self.sh.quarantine_held.store(held, Ordering::Release);
        if new {
            self.sh.stats.quarantined.fetch_add(1, Ordering::Relaxed);
        }
        Ok(self.ack(holder, seq))
    }

    /// Events in the quarantine (see [`Outbox::quarantine`]), oldest first, at most
    /// `max`: one JSON object each (`seq`, `ledger_node`, `ledger_store`,
    /// `refused_at_ms`, `reason`, and `event`, the ledger's JSON form of it, `null` if
    /// it was trimmed before it was set aside).
    pub fn quarantined(&self, max: usize) -> Result<Vec<String>, OutboxError> {
        let txn = self.sh.db.begin_read().map_err(storage)?;
        let t = match txn.open_table(QUARANTINE) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(storage(e)),
        };
        let mut out = Vec::new();
        for row in t.iter().map_err(storage)?.take(max) {
            let (_, v) = row.map_err(storage)?;
            out.push(v.value().to_string());
        }
        Ok(out)
    }

    /// Whether the quarantine may be cleared over HTTP
    /// ([`OutboxConfig::quarantine_clear_over_http`]).
    pub fn quarantine_clear_over_http(&self) -> bool {
        self.sh.cfg.quarantine_clear_over_http
    }

    /// How many events the quarantine holds.
    pub fn quarantine_held(&self) -> u64 {
        self.sh.quarantine_held.load(Ordering::Acquire)
    }

    /// Removes the quarantined events with seq up to `through_seq` (an operator has
    /// replayed or written them off); returns how many. Durable when it returns.
    pub fn clear_quarantine(&self, through_seq: u64) -> Result<u64, OutboxError> {
        let txn = self.sh.db.begin_write().map_err(storage)?;
        let removed = {
            let mut t = txn.open_table(QUARANTINE).map_err(storage)?;
            // Bounded by `quarantine_max`: a walk, in seq order.
            let mut keys: Vec<(u64, String)> = Vec::new();
            for row in t.iter().map_err(storage)? {
                let (k, _) = row.map_err(storage)?;
                let (seq, h) = k.value();
                if seq > through_seq {
                    break;
                }
                keys.push((seq, h.to_string()));
            }
            for (seq, h) in &keys {
                t.remove((*seq, h.as_str())).map_err(storage)?;
            }
            (keys.len() as u64, t.len().map_err(storage)?)
        };
        txn.commit().map_err(storage)?;
        let (removed, held) = removed;
        self.sh.quarantine_held.store(held, Ordering::Release);
        Ok(removed)
    }

    /// Up to `max` events with seq above `after`, in seq order (read from the file,
    /// MVCC: never blocks the writer).
    pub fn read_after(&self, after: u64, max: usize) -> Result<Vec<(u64, Event)>, OutboxError> {
        let txn = self.sh.db.begin_read().map_err(storage)?;
        let t = txn.open_table(EVENTS).map_err(storage)?;
        let mut out = Vec::new();
        for row in t.range(after.saturating_add(1)..).map_err(storage)? {
            let (k, v) = row.map_err(storage)?;
            let e = Event::decode(v.value()).map_err(|e| {
                OutboxError::Storage(format!(
                    "event {} in the outbox does not decode ({e:?}); the file is damaged",
                    k.value()
                ))
            })?;
            out.push((k.value(), e));
            if out.len() >= max {
                break;
            }
        }
        Ok(out)
    }
}

impl UsageSink for Outbox {
    fn record(&self, r: &UsageRecord<'_>) {
        let p = Pending::from_record(r);
        let mut q = self.sh.lock();
        // Past three quarters of `queue_max` every front door refuses new work, so at
        // most one record per lease in flight can still come: only a caller that
        // bypasses `check_room` (or more leases than `in_flight_max`) reaches this.
        if q.items.len() >= self.sh.cfg.queue_max + self.sh.cfg.in_flight_max {
            drop(q);
            self.sh.stats.dropped.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "bursar-agent: ERROR usage outbox queue full ({} records): the record of \
                 request {:?} ({:?}) is LOST (counted in bursar_outbox_dropped_total)",
                self.sh.cfg.queue_max + self.sh.cfg.in_flight_max,
                r.request_id,
                r.outcome
            );
            return;
        }
        q.items.push_back(p);
        q.pushed += 1;
        self.sh.pushed.store(q.pushed, Ordering::Release);
        self.sh.queued.store(q.items.len(), Ordering::Release);
        let wake = std::mem::take(&mut q.writer_parked);
        drop(q);
        if wake {
            self.sh.cv.notify_one();
        }
    }
}

type Init = (String, u64, u64, HashMap<String, u64>, u64);

fn init(db: &Database, existed: bool, agent_id: Option<&str>) -> Result<Init, String> {
    let run = || -> Result<Init, redb::Error> {
        let txn = db.begin_write()?;
        let out = {
            let mut meta = txn.open_table(META)?;
            let format = meta.get("format")?.map(|v| v.value());
            match (format, existed) {
                (Some(FORMAT), _) => {}
                (Some(other), _) => {
                    return Ok((format!("\0format {other}"), 0, 0, HashMap::new(), 0));
                }
                (None, true) if meta.len()? > 0 || txn.list_tables()?.count() > 1 => {
                    return Ok(("\0foreign".into(), 0, 0, HashMap::new(), 0));
                }
                (None, _) => {
                    meta.insert("format", FORMAT)?;
                }
            }
            let next_seq = meta.get("next_seq")?.map_or(1, |v| v.value());
            let mut origin_t = txn.open_table(ORIGIN)?;
            let stored = origin_t.get("origin")?.map(|v| v.value().to_string());
            let origin = match (agent_id, stored) {
                (Some(id), _) => id.to_string(),
                (None, Some(s)) => s,
                (None, None) => {
                    let ms = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis());
                    format!("agent-{}-{ms}", std::process::id())
                }
            };
            origin_t.insert("origin", origin.as_str())?;
            let events = txn.open_table(EVENTS)?;
            let on_disk = events.len()?;
            let cur = txn.open_table(CURSORS)?;
            let mut cursors = HashMap::new();
            for row in cur.iter()? {
                let (k, v) = row?;
                cursors.insert(k.value().to_string(), v.value());
            }
            let quarantined = txn.open_table(QUARANTINE)?.len()?;
            (origin, next_seq, on_disk, cursors, quarantined)
        };
        txn.commit()?;
        Ok(out)
    };
    let out = run().map_err(|e| format!("{e}; nothing was changed"))?;
    if let Some(why) = out.0.strip_prefix('\0') {
        return Err(format!(
            "not a bursar-agent outbox ({why}): a redb file without the outbox's format \
             marker; nothing was changed"
        ));
    }
    Ok(out)
}

/// How far the wall clock may run ahead of the start reading plus monotonic time
/// before event times are moved up (ms): NTP slews both clocks alike, so more than
/// this is a step (a start reading that was behind).
const BEHIND_TOLERANCE_MS: u64 = 2_000;

fn writer(sh: Arc<Shared>, mapper: Mapper, origin: std::time::Instant) {
    let max = sh.cfg.commit_records_max;
    let need = sh.cfg.ledgers_needed;
    let mut batch: Vec<Pending> = Vec::with_capacity(max.min(sh.cfg.queue_max));
    let mut encoded: Vec<(u64, Vec<u8>)> = Vec::new();
    let limits = bursar_ledger::Limits::default();
    // An acknowledgement-only commit skipped its fsync (see `commit`).
    let mut acks_not_durable = false;
    // How far ahead of the wall clock the start reading was found to be (ms): event
    // times are shifted back by it (see below).
    let mut ahead_ms = 0u64;
    // Engine time 0, by the monotonic clock, read when `Outbox::start` was called (not
    // when this thread first ran: a late start would read as a clock behind).
    let started = origin;
    loop {
        let (acks, taken, stop) = {
            let mut q = sh.lock();
            while q.items.is_empty() && q.acks.is_empty() && !q.stop {
                q.writer_parked = true;
                q = sh.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            q.writer_parked = false;
            let n = q.items.len().min(max);
            batch.extend(q.items.drain(..n));
            q.taken += n as u64;
            sh.queued.store(q.items.len(), Ordering::Release);
            (std::mem::take(&mut q.acks), q.taken, q.stop)
        };
        if batch.is_empty() && acks.is_empty() {
            if stop {
                if acks_not_durable {
                    let next_seq = sh.last_seq.load(Ordering::Acquire) + 1;
                    if let Err(e) = commit(&sh.db, &[], next_seq, &HashMap::new(), need, true) {
                        eprintln!("bursar-agent: outbox: final commit failed ({e})");
                    }
                }
                return;
            }
            continue;
        }
        let mut next_seq = sh.last_seq.load(Ordering::Acquire) + 1;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        // A start reading that was behind (a machine booted without a real-time clock,
        // the agent started before NTP stepped it) shows as the wall clock running
        // ahead of the start reading plus monotonic time: event times move up by as
        // much, measured now (not from the records, which may have waited in the
        // queue), so billing lands in the right hour and the ledger's oldest
        // accepted time is not crossed by a clock error.
        let agent_wall_ms = mapper.wall_origin_ms + started.elapsed().as_millis() as u64;
        let behind_ms = now_ms.saturating_sub(agent_wall_ms);
        let behind_ms = if behind_ms > BEHIND_TOLERANCE_MS {
            behind_ms
        } else {
            0
        };
        encoded.clear();
        for p in batch.drain(..) {
            let mut e = mapper.map(
                p.id.as_str(),
                p.outcome,
                p.usage,
                p.reserved_input_tokens,
                p.admitted_at_ns,
                p.keys.iter().flatten().map(|k| &**k),
                next_seq,
            );
            // Event times are the wall clock read at start plus monotonic time since.
            // If that start reading was ahead (an agent started before its clock was
            // synchronised), the times would be in the future and refused: shift them
            // back by how far ahead it is found to be, judged by the record's own moment
            // (not its admission, which may be a TTL earlier), and every later event
            // too, so an expired request's late completion lands in the same hour as its
            // expiry (an adjust resolves only in its target's bucket); count it.
            let agent_now_ms = mapper.wall_origin_ms + p.at_ns / 1_000_000;
            if agent_now_ms > now_ms + limits.future_skew_ms / 2 {
                ahead_ms = ahead_ms.max(agent_now_ms - now_ms);
            }
            e.time_ms = e.time_ms.saturating_sub(ahead_ms);
            if behind_ms > 0 && ahead_ms == 0 {
                e.time_ms = e.time_ms.saturating_add(behind_ms).min(now_ms);
                if sh.stats.time_shifted.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!(
                        "bursar-agent: WARNING the wall clock read at start was {behind_ms} ms \
                         behind (stepped forward since?); usage event times are moved up by \
                         as much (counted in bursar_outbox_events_total{{kind=\"time_shifted\"}})"
                    );
                }
            }
            if ahead_ms > 0 || e.time_ms > now_ms + limits.future_skew_ms / 2 {
                e.time_ms = e.time_ms.min(now_ms);
                if sh.stats.time_clamped.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!(
                        "bursar-agent: WARNING usage event times are ahead of the wall \
                         clock (was it stepped back since the agent started?); using the \
                         current time (counted in bursar_outbox_events_total{{kind=\"time_clamped\"}})"
                    );
                }
            }
            if let Err(err) = e.validate(now_ms, &limits) {
                // A bug in the mapping (every field is bounded by the engine's own
                // limits): say so loudly rather than block delivery forever.
                sh.stats.invalid.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "bursar-agent: ERROR usage event for request {:?} is invalid ({err}); \
                     NOT stored (counted in bursar_outbox_events_total{{kind=\"invalid\"}})",
                    p.id.as_str()
                );
                continue;
            }
            encoded.push((next_seq, e.encode()));
            next_seq += 1;
        }
        // Events always commit durably; acknowledgements alone only at the close. A
        // forgotten holder is made durable at once: after a crash, its old cursor
        // must not count toward a trim before its node is learned again.
        let durable = !encoded.is_empty() || stop || acks.values().any(|a| a.0);
        acks_not_durable = !durable;
        let mut backoff = Duration::from_millis(10);
        let trimmed = loop {
            match commit(&sh.db, &encoded, next_seq, &acks, need, durable) {
                Ok(t) => break Some(t),
                Err(e) => {
                    sh.stats.commit_failures.fetch_add(1, Ordering::Relaxed);
                    eprintln!(
                        "bursar-agent: outbox commit of {} records failed ({e}); retrying",
                        encoded.len()
                    );
                    if sh.lock().stop && backoff >= Duration::from_secs(1) {
                        eprintln!(
                            "bursar-agent: ERROR stopping with {} usage records not \
                             committed (their completions were not acknowledged)",
                            encoded.len()
                        );
                        break None;
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        };
        let Some(trimmed) = trimmed else { return };
        let n = encoded.len() as u64;
        sh.last_seq.store(next_seq - 1, Ordering::Release);
        sh.on_disk.fetch_add(n, Ordering::AcqRel);
        sh.on_disk.fetch_sub(trimmed, Ordering::AcqRel);
        sh.stats.committed.fetch_add(n, Ordering::Relaxed);
        sh.stats.commits.fetch_add(1, Ordering::Relaxed);
        sh.stats.trimmed.fetch_add(trimmed, Ordering::Relaxed);
        sh.committed_tx.send_replace(taken);
    }
}

/// One write transaction: new events, `next_seq`, acknowledgements and the trim they
/// allow; with fsync when `durable`. Returns how many events were trimmed.
fn commit(
    db: &Database,
    events: &[(u64, Vec<u8>)],
    next_seq: u64,
    acks: &HashMap<String, (bool, u64)>,
    need: usize,
    durable: bool,
) -> Result<u64, redb::Error> {
    let mut txn = db.begin_write()?;
    if !durable {
        // Acknowledgements alone skip the fsync: the next commit with events (or the
        // close) makes them durable. Lost to a crash, they only cause a resend, which
        // the ledger counts as a duplicate. This keeps one fsync per batch of
        // completions instead of one more per ledger per batch.
        txn.set_durability(redb::Durability::None)?;
    }
    let mut trimmed = 0;
    {
        let mut ev = txn.open_table(EVENTS)?;
        for (seq, bytes) in events {
            ev.insert(*seq, bytes.as_slice())?;
        }
        let mut meta = txn.open_table(META)?;
        meta.insert("next_seq", next_seq)?;
        if !acks.is_empty() {
            let mut cur = txn.open_table(CURSORS)?;
            for (holder, &(reset, seq)) in acks {
                if reset {
                    cur.remove(holder.as_str())?;
                }
                let old = cur.get(holder.as_str())?.map_or(0, |v| v.value());
                if seq > old {
                    cur.insert(holder.as_str(), seq)?;
                }
            }
            let mut all: Vec<u64> = Vec::new();
            for row in cur.iter()? {
                all.push(row?.1.value());
            }
            all.sort_unstable_by(|a, b| b.cmp(a));
            if let Some(&upto) = all.get(need - 1) {
                let before = ev.len()?;
                ev.retain_in(..=upto, |_, _| false)?;
                trimmed = before - ev.len()?;
            }
        }
    }
    txn.commit()?;
    Ok(trimmed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::DEMO_RULES;
    use crate::{AdmitRequest, Config, Cost, Engine};

    fn config(dir: &Path) -> OutboxConfig {
        OutboxConfig::new(dir.to_path_buf(), 2)
    }

    /// A temporary directory removed on drop; derefs to its path.
    struct TempDir(tempfile::TempDir);

    impl std::ops::Deref for TempDir {
        type Target = Path;
        fn deref(&self) -> &Path {
            self.0.path()
        }
    }

    fn tempdir(name: &str) -> TempDir {
        TempDir(
            tempfile::Builder::new()
                .prefix(&format!("bursar-outbox-unit-{name}-"))
                .tempdir()
                .unwrap(),
        )
    }

    const RULES: &str = r#"
        [[rule]]
        name = "org-tpm"
        match = { org = "*", model = "*" }
        dimension = "input_tokens"
        rate = 1000000
        per = "minute"

        [[rule]]
        name = "key-rpm"
        match = { org = "*", key = "*", tier = "gold" }
        dimension = "requests"
        rate = 1000
        per = "minute"
    "#;

    /// The unix time of engine time 0 in these tests: now (the writer takes its start
    /// as engine time 0, as the agent's binary does; a reading floored to the second
    /// was up to a second behind, close to the correction's tolerance under load).
    fn wall_origin_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }

    fn engine_with(outbox: &Arc<Outbox>, rules: &str) -> Engine {
        let cfg = Config::from_toml(rules).unwrap();
        let engine = Engine::new(cfg.clone(), Arc::clone(outbox) as Arc<dyn UsageSink>);
        outbox.start(cfg.rules, wall_origin_ms());
        engine
    }

    fn admit(engine: &Engine, id: &str, input: u64) {
        let d = engine
            .admit(
                0,
                &AdmitRequest {
                    request_id: id,
                    domain: None,
                    descriptors: &[
                        ("org", "acme"),
                        ("key", "k1"),
                        ("model", "gpt-x"),
                        ("tier", "gold"),
                    ],
                    cost: Cost {
                        requests: 1,
                        input_tokens: input,
                        max_output_tokens: Some(100),
                    },
                    ttl_ms: Some(1_000),
                },
            )
            .unwrap();
        assert!(d.is_admitted());
    }

    #[test]
    fn a_completion_becomes_a_usage_event_with_tenant_model_and_descriptors() {
        let dir = tempdir("map");
        let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
        let engine = engine_with(&ob, RULES);
        admit(&engine, "r1", 50);
        let usage = Usage {
            input_tokens: 40,
            cached_input_tokens: 10,
            output_tokens: 7,
        };
        engine
            .complete(5_000_000, "r1", usage, CompletionStatus::Ok)
            .unwrap();
        assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        let evs = ob.read_after(0, 10).unwrap();
        assert_eq!(evs.len(), 1);
        let (seq, e) = &evs[0];
        assert_eq!(*seq, 1);
        assert_eq!(e.request_id, "r1");
        assert_eq!(e.tenant, "acme");
        assert_eq!(e.model, "gpt-x");
        assert_eq!(
            e.descriptors,
            vec![
                ("key".to_string(), "k1".to_string()),
                ("tier".to_string(), "gold".to_string())
            ]
        );
        assert!(
            e.time_ms.abs_diff(wall_origin_ms()) < 60_000,
            "the admission time (engine time 0)"
        );
        assert_eq!(
            e.body,
            Body::Usage {
                status: Status::Ok,
                tokens: Tokens {
                    input_tokens: 40,
                    cached_input_tokens: 10,
                    output_tokens: 7
                }
            }
        );
        ob.close();
    }

    #[test]
    fn an_expiry_and_a_late_completion_add_up_to_the_actual_usage() {
        let dir = tempdir("late");
        let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
        let engine = engine_with(&ob, RULES);
        admit(&engine, "r2", 300);
        // The lease (1 s) expires; then the completion arrives.
        engine.maintain(2_000_000_000);
        let late = Usage {
            input_tokens: 280,
            cached_input_tokens: 0,
            output_tokens: 90,
        };
        let c = engine
            .complete(2_500_000_000, "r2", late, CompletionStatus::Ok)
            .unwrap();
        assert_eq!(c, crate::Completion::Late);
        assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        let evs = ob.read_after(0, 10).unwrap();
        assert_eq!(evs.len(), 2);
        let (exp, adj) = (&evs[0].1, &evs[1].1);
        assert_eq!(
            exp.body,
            Body::Usage {
                status: Status::Expired,
                tokens: Tokens {
                    input_tokens: 300,
                    cached_input_tokens: 0,
                    output_tokens: 0
                }
            }
        );
        assert_eq!(adj.request_id, "r2#late-completion");
        assert_eq!(adj.tenant, exp.tenant);
        assert_eq!(
            adj.time_ms, exp.time_ms,
            "the adjust lands in its target's hour"
        );
        assert_eq!(
            adj.body,
            Body::Adjust {
                target: exp.key(),
                deltas: TokenDeltas {
                    input_tokens: -20,
                    cached_input_tokens: 0,
                    output_tokens: 90
                }
            }
        );
        // Through the ledger's own totals: exactly the actual usage.
        let store = bursar_ledger::MemStore::new();
        use bursar_ledger::Store as _;
        store.apply(&[exp.clone(), adj.clone()]).unwrap();
        let hour = exp.hour();
        let t = bursar_ledger::store::usage_totals(
            &store,
            &exp.tenant,
            hour,
            hour + 1,
            false,
            Default::default(),
        )
        .unwrap();
        assert_eq!(t.total.requests, 1);
        assert_eq!(t.total.input_tokens, 280);
        assert_eq!(t.total.output_tokens, 90);
        assert_eq!(t.adjusted, 1);
        assert_eq!(t.unresolved_corrections, 0);
        ob.close();
    }

    #[test]
    fn seq_survives_a_reopen_and_acks_from_two_ledgers_trim() {
        let dir = tempdir("reopen");
        {
            let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
            let engine = engine_with(&ob, DEMO_RULES);
            for i in 0..5 {
                let id = format!("q{i}");
                engine
                    .admit(
                        0,
                        &AdmitRequest {
                            request_id: &id,
                            domain: None,
                            descriptors: &[("org", "o"), ("key", "k")],
                            cost: Cost::ONE_REQUEST,
                            ttl_ms: None,
                        },
                    )
                    .unwrap();
                engine
                    .complete(1, &id, Usage::default(), CompletionStatus::Ok)
                    .unwrap();
            }
            assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
            let a = ob.holder("ledger-a", "s1");
            assert!(ob.ack(&a, 3));
            ob.close();
        }
        let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
        assert_eq!(ob.last_seq(), 5);
        assert_eq!(ob.held(), 5, "one ledger of two is not enough to trim");
        assert_eq!(ob.cursor("ledger-a\ns1"), 3);
        let _engine = engine_with(&ob, DEMO_RULES);
        let b = ob.holder("ledger-b", "s2");
        assert!(ob.ack(&b, 4));
        let t = ob.ticket();
        // An ack alone commits too; wait for the trim to show.
        for _ in 0..1000 {
            if ob.held() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(ob.durable_blocking(t, Duration::from_secs(1)));
        assert_eq!(ob.held(), 2, "events 1..=3 are held by two ledgers");
        let left: Vec<u64> = ob
            .read_after(0, 10)
            .unwrap()
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(left, vec![4, 5]);
        ob.close();
    }

    fn wait_held(ob: &Outbox, n: u64) {
        for _ in 0..2000 {
            if ob.held() == n {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("held {} events, expected {n}", ob.held());
    }

    #[test]
    fn a_node_back_under_a_new_store_is_not_credited_with_the_old_ones_acks() {
        let dir = tempdir("stores");
        {
            let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
            let engine = engine_with(&ob, DEMO_RULES);
            for i in 0..5 {
                admit(&engine, &format!("s{i}"), 1);
                engine
                    .complete(1, &format!("s{i}"), Usage::default(), CompletionStatus::Ok)
                    .unwrap();
            }
            assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
            let old = ob.holder("ledger-a", "store-1");
            assert!(ob.ack(&old, 5));
            // Node a lost its data: same id, new store.
            let new = ob.holder("ledger-a", "store-2");
            assert_ne!(new, old);
            assert_eq!(ob.cursor(&new), 0, "the new store holds nothing yet");
            assert_eq!(ob.cursor(&old), 0, "the old store's cursor is forgotten");
            assert!(!ob.ack(&old, 5), "a late ack for the old store is refused");
            let b = ob.holder("ledger-b", "store-9");
            assert!(ob.ack(&b, 5));
            assert!(ob.ack(&new, 2));
            wait_held(&ob, 3);
            // A cursor from before store ids: the node id alone, as an older agent
            // wrote it (read at the next open).
            let w = ob.sh.db.begin_write().unwrap();
            w.open_table(CURSORS)
                .unwrap()
                .insert("ledger-c", 5)
                .unwrap();
            w.commit().unwrap();
            ob.close();
        }
        // The forgotten cursor stays forgotten in the file.
        let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
        assert_eq!(ob.held(), 3);
        assert_eq!(ob.cursor("ledger-a\nstore-1"), 0);
        assert_eq!(ob.cursor("ledger-a\nstore-2"), 2);
        assert_eq!(ob.cursor("ledger-b\nstore-9"), 5);
        let _engine = engine_with(&ob, DEMO_RULES);
        // Learned with a store, ledger-c's node-id-only cursor counts for nothing
        // (it would make a trim to 5 here): it is sent everything again.
        let c = ob.holder("ledger-c", "store-5");
        assert_eq!(ob.cursor(&c), 0);
        let a = ob.holder("ledger-a", "store-2");
        assert!(ob.ack(&a, 3));
        wait_held(&ob, 2);
        ob.close();
    }

    #[test]
    fn a_quarantined_event_is_kept_across_a_restart_within_its_bound() {
        let dir = tempdir("quarantine");
        let mut cfg = config(&dir);
        cfg.quarantine_max = 1;
        let ob = Arc::new(Outbox::open(cfg.clone()).unwrap());
        let engine = engine_with(&ob, RULES);
        for id in ["q1", "q2"] {
            admit(&engine, id, 10);
            engine
                .complete(1, id, Usage::default(), CompletionStatus::Ok)
                .unwrap();
        }
        assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        let a = ob.holder("ledger-a", "store-1");
        assert!(ob.quarantine(&a, 1, "400 Bad Request: refused").unwrap());
        assert_eq!(ob.cursor(&a), 1, "the holder moves past it");
        // The bound: nothing changes past it.
        assert!(!ob.quarantine(&a, 2, "400 Bad Request: refused").unwrap());
        assert_eq!(ob.cursor(&a), 1);
        wait_held(&ob, 2); // one ledger of the two needed: nothing trimmed
        ob.close();
        drop(engine);
        drop(ob);
        let ob = Outbox::open(cfg).unwrap();
        assert_eq!(ob.quarantine_held(), 1);
        let lines = ob.quarantined(10).unwrap();
        assert_eq!(lines.len(), 1);
        let v: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!(v["seq"], 1);
        assert_eq!(v["ledger_node"], "ledger-a");
        assert_eq!(v["event"]["request_id"], "q1");
        assert!(v["reason"].as_str().unwrap().contains("refused"));
        assert_eq!(ob.clear_quarantine(1).unwrap(), 1);
        assert_eq!(ob.quarantine_held(), 0);
        assert!(ob.quarantined(10).unwrap().is_empty());
    }

    /// Review, thirty-first session: a wall clock read at start that was behind (a
    /// machine booted without a real-time clock, the agent started before NTP) went
    /// unnoticed: every event was stamped that far in the past, in the wrong hour,
    /// and past the ledger's 400 days, refused by the agent's own check and NOT
    /// stored, while its completion was answered 200.
    #[test]
    fn event_times_behind_the_wall_clock_are_moved_up_to_it_not_dropped() {
        for behind_ms in [2 * 3_600_000, 401 * 24 * 3_600_000] {
            let dir = tempdir("clock-behind");
            let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
            let cfg = Config::from_toml(RULES).unwrap();
            let engine = Engine::new(cfg.clone(), Arc::clone(&ob) as Arc<dyn UsageSink>);
            ob.start(cfg.rules, wall_origin_ms() - behind_ms);
            admit(&engine, "r-behind", 10);
            engine
                .complete(1, "r-behind", Usage::default(), CompletionStatus::Ok)
                .unwrap();
            assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
            let evs = ob.read_after(0, 10).unwrap();
            assert_eq!(evs.len(), 1, "stored, not dropped ({behind_ms} ms behind)");
            assert!(
                evs[0].1.time_ms.abs_diff(wall_origin_ms()) < 60_000,
                "{} ({behind_ms} ms behind)",
                evs[0].1.time_ms
            );
            assert_eq!(ob.stats().time_shifted.load(Ordering::Relaxed), 1);
            assert_eq!(ob.stats().invalid.load(Ordering::Relaxed), 0);
            ob.close();
        }
    }

    #[test]
    fn event_times_ahead_of_the_wall_clock_are_replaced_by_it_not_dropped() {
        let dir = tempdir("clock-ahead");
        let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
        let cfg = Config::from_toml(RULES).unwrap();
        let engine = Engine::new(cfg.clone(), Arc::clone(&ob) as Arc<dyn UsageSink>);
        // The wall clock read at start was two hours ahead (not yet synchronised).
        ob.start(cfg.rules, wall_origin_ms() + 2 * 3_600_000);
        admit(&engine, "r-ahead", 10);
        engine
            .complete(1, "r-ahead", Usage::default(), CompletionStatus::Ok)
            .unwrap();
        assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        let evs = ob.read_after(0, 10).unwrap();
        assert_eq!(evs.len(), 1, "stored, not dropped");
        let now = wall_origin_ms();
        assert!(
            evs[0].1.time_ms.abs_diff(now) < 60_000,
            "{}",
            evs[0].1.time_ms
        );
        assert_eq!(ob.stats().time_clamped.load(Ordering::Relaxed), 1);
        assert_eq!(ob.stats().invalid.load(Ordering::Relaxed), 0);
        ob.close();
    }

    /// Review, twenty-fifth session: with the start reading ahead, each event was
    /// clamped to the time it was mapped, so an expired request's late completion (its
    /// adjust) could land in another hour than its expiry, where it never resolves.
    #[test]
    fn with_the_clock_ahead_an_expiry_and_its_late_completion_share_a_time() {
        let dir = tempdir("clock-ahead-late");
        let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
        let cfg = Config::from_toml(RULES).unwrap();
        let engine = Engine::new(cfg.clone(), Arc::clone(&ob) as Arc<dyn UsageSink>);
        ob.start(cfg.rules, wall_origin_ms() + 2 * 3_600_000);
        admit(&engine, "r-late", 10);
        // Expired by the maintenance tick (TTL 300 s), then completed late.
        engine.maintain(301 * 1_000_000_000);
        assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(30));
        engine
            .complete(
                301 * 1_000_000_000,
                "r-late",
                Usage::default(),
                CompletionStatus::Ok,
            )
            .unwrap();
        assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        let evs = ob.read_after(0, 10).unwrap();
        assert_eq!(evs.len(), 2, "{evs:?}");
        assert_eq!(
            evs[0].1.time_ms, evs[1].1.time_ms,
            "the expiry and its adjust must share an hour bucket"
        );
        ob.close();
    }

    /// Review, twenty-fifth session: the shift was learned from events' own times (their
    /// admission), so an expiry written a TTL after its admission was not "ahead"
    /// enough to shift while a fresh completion after it was, and the late adjust got
    /// another time than its expiry. Ahead is judged at each record's own moment.
    #[test]
    fn a_clock_ahead_by_less_than_a_ttl_plus_the_skew_still_shifts_expiry_and_adjust_alike() {
        let dir = tempdir("clock-ahead-ttl");
        let ob = Arc::new(Outbox::open(config(&dir)).unwrap());
        let cfg = Config::from_toml(RULES).unwrap();
        let engine = Engine::new(cfg.clone(), Arc::clone(&ob) as Arc<dyn UsageSink>);
        let now = wall_origin_ms();
        // Engine time 301 s is now; the start reading was 8 minutes ahead.
        ob.start(cfg.rules, now - 301_000 + 8 * 60_000);
        let sec = 1_000_000_000;
        admit(&engine, "r1", 10);
        engine.maintain(301 * sec);
        assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        // A fresh request, then r1's late completion.
        let d = engine
            .admit(
                301 * sec,
                &AdmitRequest {
                    request_id: "r2",
                    domain: None,
                    descriptors: &[("org", "acme"), ("key", "k1"), ("model", "gpt-x")],
                    cost: Cost::ONE_REQUEST,
                    ttl_ms: None,
                },
            )
            .unwrap();
        assert!(d.is_admitted());
        engine
            .complete(301 * sec, "r2", Usage::default(), CompletionStatus::Ok)
            .unwrap();
        engine
            .complete(301 * sec, "r1", Usage::default(), CompletionStatus::Ok)
            .unwrap();
        assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        let evs = ob.read_after(0, 10).unwrap();
        let time_of = |id: &str| {
            evs.iter()
                .find(|(_, e)| e.request_id == id)
                .map(|(_, e)| e.time_ms)
                .unwrap_or_else(|| panic!("no event {id}: {evs:?}"))
        };
        let late = format!("r1{LATE_SUFFIX}");
        assert_eq!(time_of("r1"), time_of(&late), "expiry and adjust split");
        assert!(
            time_of("r1").abs_diff(now - 301_000) < 60_000,
            "{}",
            time_of("r1")
        );
        ob.close();
    }

    #[test]
    fn a_queued_record_is_a_fixed_size_under_half_a_kib() {
        // The queue reserves queue_max of these up front (the docs quote the size).
        let size = std::mem::size_of::<Pending>();
        println!("size_of::<Pending>() = {size}");
        assert!(size <= 512, "{size}");
    }

    #[test]
    fn a_garbage_or_foreign_file_is_refused_at_open() {
        let dir = tempdir("garbage");
        std::fs::write(dir.join(FILE_NAME), vec![0xA5u8; 8192]).unwrap();
        let e = Outbox::open(config(&dir)).unwrap_err().to_string();
        assert!(e.contains("corrupt or not a redb database"), "{e}");
        let dir = tempdir("empty");
        std::fs::write(dir.join(FILE_NAME), b"").unwrap();
        let e = Outbox::open(config(&dir)).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
        let dir = tempdir("foreign");
        {
            let db = Database::create(dir.join(FILE_NAME)).unwrap();
            let t = db.begin_write().unwrap();
            {
                let def: TableDefinition<&str, &str> = TableDefinition::new("other");
                t.open_table(def).unwrap().insert("a", "b").unwrap();
            }
            t.commit().unwrap();
        }
        let e = Outbox::open(config(&dir)).unwrap_err().to_string();
        assert!(e.contains("not a bursar-agent outbox"), "{e}");
    }

    /// Review, twenty-fifth session: room was checked when a request was admitted,
    /// not when it finished, so with more requests in flight than the queue's last
    /// quarter a stalled disk dropped the records of completions already answered.
    /// Every lease in flight now has room for its record beyond the queue.
    #[test]
    fn records_of_work_in_flight_are_kept_past_the_queue_while_the_writer_stalls() {
        let dir = tempdir("in-flight");
        let mut cfg = config(&dir);
        cfg.queue_max = 16;
        cfg.events_max = 16;
        let ob = Arc::new(Outbox::open(cfg).unwrap());
        // Not started: nothing drains, as with a stalled disk.
        let rules = Config::from_toml(RULES).unwrap();
        let engine = Engine::new(rules, Arc::clone(&ob) as Arc<dyn UsageSink>);
        for i in 0..20 {
            assert!(ob.check_room().is_ok());
            admit(&engine, &format!("w{i}"), 10);
        }
        for i in 0..20 {
            let done = engine
                .complete(1, &format!("w{i}"), Usage::default(), CompletionStatus::Ok)
                .unwrap();
            assert_eq!(done, crate::Completion::Settled);
        }
        assert_eq!(
            ob.dropped(),
            0,
            "records of answered completions were dropped"
        );
        assert!(ob.check_room().is_err(), "new work is refused meanwhile");
        ob.close();
    }

    #[test]
    fn a_full_outbox_refuses_before_anything_changes() {
        let dir = tempdir("full");
        let mut cfg = config(&dir);
        cfg.queue_max = 16;
        cfg.events_max = 16;
        let ob = Arc::new(Outbox::open(cfg).unwrap());
        let engine = engine_with(&ob, DEMO_RULES);
        let mut refused = 0;
        for i in 0..40 {
            let id = format!("f{i}");
            engine
                .admit(
                    0,
                    &AdmitRequest {
                        request_id: &id,
                        domain: None,
                        descriptors: &[("org", "o"), ("key", "k")],
                        cost: Cost::ONE_REQUEST,
                        ttl_ms: None,
                    },
                )
                .unwrap();
            if ob.check_room().is_err() {
                refused += 1;
                continue;
            }
            engine
                .complete(1, &id, Usage::default(), CompletionStatus::Ok)
                .unwrap();
            assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(10)));
        }
        assert_eq!(ob.held(), 16, "nothing is trimmed without ledgers");
        assert_eq!(refused, 24);
        assert_eq!(ob.stats().refused_full.load(Ordering::Relaxed), 24);
        assert_eq!(ob.dropped(), 0);
        ob.close();
    }
}
