//! The redb backend: one file, `ledger.redb`, in the data directory.
//!
//! Tables:
//! - `event_chunks`: (hour, tenant, arrival sequence number of the chunk's first
//!   event) -> a **chunk**: the canonical encodings of one or more events of that
//!   bucket, each with its own arrival sequence number (`seq u64 LE, len u32 LE,
//!   bytes`), in arrival order. One commit appends one chunk per bucket it touches
//!   (a new chunk past [`CHUNK_BYTES_MAX`]), so a batch of 1,000 events over 8 tenants
//!   is 8 B-tree inserts here, not 1,000. Events stay clustered by bucket, appended
//!   within each bucket, read in order by queries and export. The chunks of a bucket
//!   hold disjoint, increasing ranges of sequence numbers, so the chunk holding
//!   event `seq` is the last one whose key is at most `seq`;
//! - `id_blocks` and `id_runs`: the dedupe index, request id -> where its event is
//!   (hour, sequence number, tenant), as immutable sorted runs with a Bloom filter
//!   each ([`crate::id_runs`]): a commit writes its new ids as one run whatever their
//!   order, so random request ids (UUIDv4) cost about what time-ordered ones do
//!   (measured in docs/BENCHMARKS.md, "Ledger");
//! - `digests`: (hour, tenant) -> digest (80 bytes);
//! - `conflicts`: (event key, element hash of the loser) -> the loser's encoding;
//! - `meta`: `format` (a marker naming this layout), `root` (the root digest),
//!   `next_seq` and `store_id` ([`Store::store_id`]: made with the file, so a node
//!   whose data is gone comes back under a new one).
//!
//! Files of earlier layouts are converted at open, each step in one durable
//! transaction (all or nothing): format 3 (one `events` row per event) into chunks,
//! then format 4 (the dedupe index as one B-tree, `ids`) into one run of the index.
//!
//! [`Store::apply`] is one write transaction with `Durability::Immediate`: every event
//! of the batch, the indexes, the digests and the root are committed together with
//! one fsync, and `apply` returns only after the commit. That is group commit: the
//! shell batches concurrent requests into one `apply`.
//!
//! Opening refuses, with [`StoreError::Open`], a file that is not a redb database, is
//! damaged (every page checksum is verified at open), or is a redb database without
//! this ledger's format marker. It never recreates or truncates an existing file.

use std::collections::BTreeMap;
use std::ops::{ControlFlow, Range};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
    TableHandle,
};

use crate::digest::{Bucket, Digest, DigestSet};
use crate::event::{Event, EventKey};
use crate::id_runs::{self, BLOCKS, LEVEL_FROZEN, MERGE, RUNS, Runs, Tables};
use crate::merge::{ApplyReport, Conflict};
use crate::store::{Cursor, ReadView, Store, StoreError, TxnOps, apply_batch};

// Byte-string keys, not &str: redb would re-validate UTF-8 on every comparison.
const CHUNKS: TableDefinition<(u64, &[u8], u64), &[u8]> = TableDefinition::new("event_chunks");
/// Format 3's table of one event per row, (hour, tenant, seq) -> encoding; converted
/// into `event_chunks` at open.
const EVENTS_V3: TableDefinition<(u64, &[u8], u64), &[u8]> = TableDefinition::new("events");
/// Format 4's dedupe index, request id -> location; converted into a run at open.
const IDS_V4: TableDefinition<&[u8], &[u8]> = TableDefinition::new("ids");
const DIGESTS: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("digests");
const CONFLICTS: TableDefinition<([u8; 16], u128), &[u8]> = TableDefinition::new("conflicts");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// The value of `meta["format"]`.
pub const FORMAT: &[u8] = b"bursar-ledger/redb/6";

/// Format 5's marker (the dedupe index without merges spread over commits, so no
/// `id_merge` table); upgraded at open. Format 6 has a marker of its own because a
/// format 5 binary would not know a merge under way: it would take the output's
/// run id for a new run.
const FORMAT_V5: &[u8] = b"bursar-ledger/redb/5";

/// Format 4's marker (the dedupe index as one B-tree); upgraded at open.
const FORMAT_V4: &[u8] = b"bursar-ledger/redb/4";

/// Format 3's marker (one `events` row per event); upgraded at open.
const FORMAT_V3: &[u8] = b"bursar-ledger/redb/3";

/// A chunk grows to at most this many bytes (or one event, if larger); the next event
/// of the bucket in the same commit starts a new chunk. Bounds the bytes read to find
/// one event by request id (a duplicate check) and rewritten to remove one (a
/// conflict's loser).
pub const CHUNK_BYTES_MAX: usize = 32 * 1024;

/// Bytes in front of each event in a chunk: its sequence number and length.
const ENTRY_HEADER: usize = 12;

/// The data file's name inside the data directory.
pub const FILE_NAME: &str = "ledger.redb";

/// The marker file [`RedbStore::open_dir`] writes beside the data file.
pub const MARKER_NAME: &str = "ledger.marker";

/// A ledger store in a redb file. Cheap to clone (shares the database).
#[derive(Clone)]
pub struct RedbStore {
    db: Arc<Database>,
    path: PathBuf,
    chunk_bytes_max: usize,
    /// The dedupe index's runs with their filters, as of the last commit (`None`:
    /// read them again, after a commit that failed). Locked for a whole `apply`.
    index: Arc<Mutex<Option<Runs>>>,
    index_params: id_runs::Params,
    /// `meta["store_id"]`: made at the file's creation (or at the first open of a
    /// file from before store ids), kept for the file's life.
    store_id: String,
}

impl std::fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbStore")
            .field("path", &self.path)
            .finish()
    }
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl RedbStore {
    /// Opens (or creates) `FILE_NAME` in `dir`, which must exist.
    ///
    /// The first start writes a marker file, [`MARKER_NAME`], beside the data file. A
    /// later start that finds the marker but no data file refuses to start empty: the
    /// data file was deleted or the wrong volume is mounted, and starting over would
    /// silently lose every event.
    pub fn open_dir(dir: &Path) -> Result<RedbStore, StoreError> {
        let path = dir.join(FILE_NAME);
        let marker = dir.join(MARKER_NAME);
        if !path.exists() && marker.exists() {
            return Err(StoreError::Open {
                path: path.display().to_string(),
                reason: format!(
                    "the data file is missing but {} says this directory held a ledger; \
                     refusing to start empty (restore the file, or remove the marker to \
                     start a new ledger on purpose)",
                    marker.display()
                ),
            });
        }
        if !marker.exists() && std::fs::metadata(&path).is_ok_and(|m| m.len() == 0) {
            // An empty data file and no marker: a first start killed before it wrote
            // the file's header, and before the marker (written before anything is
            // served), so nothing was ever acknowledged from it. Start it afresh
            // rather than refuse forever.
            std::fs::remove_file(&path).map_err(|e| StoreError::Open {
                path: path.display().to_string(),
                reason: format!(
                    "cannot remove the empty data file of an unfinished first start: {e}"
                ),
            })?;
        }
        let store = RedbStore::open(&path)?;
        if !marker.exists() {
            let write = || -> std::io::Result<()> {
                let f = std::fs::File::create(&marker)?;
                std::io::Write::write_all(&mut &f, FORMAT)?;
                f.sync_all()?;
                // The marker's directory entry must be durable too.
                std::fs::File::open(dir)?.sync_all()
            };
            write().map_err(|e| StoreError::Open {
                path: marker.display().to_string(),
                reason: format!("cannot write the ledger marker: {e}"),
            })?;
        }
        Ok(store)
    }

    /// Opens the file at `path`, creating it if absent. A file that exists and is not
    /// a valid ledger database is refused (see the module docs).
    pub fn open(path: &Path) -> Result<RedbStore, StoreError> {
        let open_err = |reason: String| StoreError::Open {
            path: path.display().to_string(),
            reason,
        };
        let existed = path.exists();
        if existed && std::fs::metadata(path).map(|m| m.len()).unwrap_or(0) == 0 {
            // redb would silently initialise an empty file; an empty file where a
            // ledger should be means data went missing, so say so.
            return Err(open_err(
                "the file is empty; refusing to start over it (move it aside to start a new ledger)"
                    .into(),
            ));
        }
        let mut db = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => open_err(
                "another process holds it open (is another bursar-ledger running on this \
                 data dir?); nothing was changed"
                    .into(),
            ),
            e => open_err(format!(
                "{e}; the file is corrupt or not a redb database; nothing was changed"
            )),
        })?;
        if existed {
            // Verify every page checksum before serving anything: a damaged page must
            // stop the start, not surface as a wrong total later. Reads the whole file.
            let problem = match db.check_integrity() {
                Ok(true) => None,
                Ok(false) => Some(
                    "the file failed its integrity check and redb repaired it by rolling \
                     back to an earlier commit: acknowledged events may be missing; \
                     restore this node from a peer or a backup"
                        .to_string(),
                ),
                Err(e) => Some(format!(
                    "{e}; the file failed its integrity check and cannot be repaired; \
                     restore this node from a peer or a backup"
                )),
            };
            if let Some(reason) = problem {
                // redb 3.1.3 panics in `Database::drop` after a failed integrity check
                // (its drop commits while recovery is pending). Leak the handle
                // instead: the caller is about to report the error and stop.
                std::mem::forget(db);
                return Err(open_err(reason));
            }
        }
        let mut store = RedbStore {
            db: Arc::new(db),
            path: path.to_path_buf(),
            chunk_bytes_max: CHUNK_BYTES_MAX,
            index: Arc::new(Mutex::new(None)),
            index_params: id_runs::Params::default(),
            store_id: String::new(),
        };
        store
            .check_format(existed)
            .map_err(|e| open_err(e.to_string()))?;
        store.store_id = store.load_store_id().map_err(|e| open_err(e.to_string()))?;
        Ok(store)
    }

    /// The data file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The same store with chunks of at most `bytes` (tests: many chunks per bucket).
    #[cfg(test)]
    fn with_chunk_bytes_max(mut self, bytes: usize) -> RedbStore {
        self.chunk_bytes_max = bytes;
        self
    }

    /// The same store with another shape of dedupe index (tests: tiny blocks and
    /// frequent merges).
    #[cfg(test)]
    fn with_index_params(mut self, params: id_runs::Params) -> RedbStore {
        self.index_params = params;
        self
    }

    /// Reads `meta["store_id"]`, writing a new one (durably) if the file has none.
    fn load_store_id(&self) -> Result<String, StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        let stored = r
            .open_table(META)
            .map_err(backend)?
            .get("store_id")
            .map_err(backend)?
            .map(|v| v.value().to_vec());
        drop(r);
        if let Some(id) = stored {
            return String::from_utf8(id)
                .map_err(|_| StoreError::Backend("meta[\"store_id\"] is not UTF-8".into()));
        }
        let id = crate::store::new_store_id();
        let mut w = self.db.begin_write().map_err(backend)?;
        w.set_durability(Durability::Immediate).map_err(backend)?;
        w.open_table(META)
            .map_err(backend)?
            .insert("store_id", id.as_bytes())
            .map_err(backend)?;
        w.commit().map_err(backend)?;
        Ok(id)
    }

    fn check_format(&self, existed: bool) -> Result<(), StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        let names: Vec<String> = r
            .list_tables()
            .map_err(backend)?
            .map(|t| t.name().to_string())
            .collect();
        let format = if names.iter().any(|n| n == "meta") {
            r.open_table(META)
                .map_err(backend)?
                .get("format")
                .map_err(backend)?
                .map(|v| v.value().to_vec())
        } else {
            None
        };
        // Upgrades write: no read transaction may stay open.
        drop(r);
        match format.as_deref() {
            Some(FORMAT) => return Ok(()),
            Some(FORMAT_V5) => return self.upgrade_from_v5(),
            Some(FORMAT_V4) => return self.upgrade_from_v4(),
            Some(FORMAT_V3) => {
                // Two durable steps: a crash between them leaves a format 4 file,
                // which the next open converts.
                self.upgrade_from_v3()?;
                return self.upgrade_from_v4();
            }
            Some(v) => {
                return Err(StoreError::Backend(format!(
                    "format marker {:?} is not {:?}; refusing to open",
                    String::from_utf8_lossy(v),
                    String::from_utf8_lossy(FORMAT)
                )));
            }
            None => {}
        }
        if existed && !names.is_empty() {
            return Err(StoreError::Backend(format!(
                "a redb database without the ledger format marker (tables: {names:?}); refusing to open"
            )));
        }
        // A new file: create every table and the marker in one durable commit.
        let mut w = self.db.begin_write().map_err(backend)?;
        w.set_durability(Durability::Immediate).map_err(backend)?;
        {
            w.open_table(CHUNKS).map_err(backend)?;
            w.open_table(BLOCKS).map_err(backend)?;
            w.open_table(RUNS).map_err(backend)?;
            w.open_table(MERGE).map_err(backend)?;
            w.open_table(DIGESTS).map_err(backend)?;
            w.open_table(CONFLICTS).map_err(backend)?;
            let mut meta = w.open_table(META).map_err(backend)?;
            meta.insert("format", FORMAT).map_err(backend)?;
            meta.insert("root", Digest::default().to_bytes().as_slice())
                .map_err(backend)?;
            meta.insert("next_seq", 0u64.to_le_bytes().as_slice())
                .map_err(backend)?;
        }
        w.commit().map_err(backend)
    }

    /// Converts format 3 (one `events` row per event) into chunks, in one durable
    /// transaction: either the whole file is converted and marked format 4, or nothing
    /// changed. Sequence numbers, the id index, digests and conflicts are kept as
    /// they are (the id index names (hour, seq, tenant), which chunks still resolve).
    fn upgrade_from_v3(&self) -> Result<(), StoreError> {
        let mut w = self.db.begin_write().map_err(backend)?;
        w.set_durability(Durability::Immediate).map_err(backend)?;
        {
            let old = w.open_table(EVENTS_V3).map_err(backend)?;
            let mut chunks = w.open_table(CHUNKS).map_err(backend)?;
            let mut current: Option<(u64, Vec<u8>, u64)> = None;
            let mut bytes = Vec::new();
            for row in old.iter().map_err(backend)? {
                let (k, v) = row.map_err(backend)?;
                let (hour, tenant, seq) = k.value();
                let same = current
                    .as_ref()
                    .is_some_and(|(h, t, _)| *h == hour && t.as_slice() == tenant);
                if !same || bytes.len() + ENTRY_HEADER + v.value().len() > self.chunk_bytes_max {
                    if let Some((h, t, first)) = current.take() {
                        chunks
                            .insert((h, t.as_slice(), first), bytes.as_slice())
                            .map_err(backend)?;
                    }
                    bytes.clear();
                    current = Some((hour, tenant.to_vec(), seq));
                }
                push_entry(&mut bytes, seq, v.value());
            }
            if let Some((h, t, first)) = current {
                chunks
                    .insert((h, t.as_slice(), first), bytes.as_slice())
                    .map_err(backend)?;
            }
        }
        w.delete_table(EVENTS_V3).map_err(backend)?;
        {
            let mut meta = w.open_table(META).map_err(backend)?;
            meta.insert("format", FORMAT_V4).map_err(backend)?;
        }
        w.commit().map_err(backend)
    }

    /// Converts format 4 (the dedupe index as one B-tree, `ids`) into one run of the
    /// index, never merged, in one durable transaction. The B-tree is already in
    /// request-id order, so this is one sequential pass.
    fn upgrade_from_v4(&self) -> Result<(), StoreError> {
        let mut w = self.db.begin_write().map_err(backend)?;
        w.set_durability(Durability::Immediate).map_err(backend)?;
        {
            let ids = w.open_table(IDS_V4).map_err(backend)?;
            let mut blocks = w.open_table(BLOCKS).map_err(backend)?;
            let mut runs = w.open_table(RUNS).map_err(backend)?;
            let mut merge = w.open_table(MERGE).map_err(backend)?;
            let mut index = Runs::load(&runs, &merge, &blocks)?;
            let count = ids.len().map_err(backend)?;
            let rows = ids.iter().map_err(backend)?.map(|row| {
                let (k, v) = row.map_err(backend)?;
                Ok((k.value().to_vec(), v.value().to_vec()))
            });
            let mut t = Tables {
                blocks: &mut blocks,
                runs: &mut runs,
                merge: &mut merge,
            };
            index.add_run(&mut t, count, LEVEL_FROZEN, rows, &self.index_params)?;
        }
        w.delete_table(IDS_V4).map_err(backend)?;
        {
            let mut meta = w.open_table(META).map_err(backend)?;
            meta.insert("format", FORMAT).map_err(backend)?;
        }
        w.commit().map_err(backend)
    }

    /// The dedupe index at a glance, once a commit has loaded it (`None` before the
    /// first commit since the store was opened). Waits for a commit in progress.
    pub fn index_stats(&self) -> Option<id_runs::IndexStats> {
        let index = self.index.lock().ok()?;
        index.as_ref().map(Runs::stats)
    }

    /// Format 5 into 6: the table of the merge under way (none), and the marker.
    fn upgrade_from_v5(&self) -> Result<(), StoreError> {
        let mut w = self.db.begin_write().map_err(backend)?;
        w.set_durability(Durability::Immediate).map_err(backend)?;
        {
            w.open_table(MERGE).map_err(backend)?;
            let mut meta = w.open_table(META).map_err(backend)?;
            meta.insert("format", FORMAT).map_err(backend)?;
        }
        w.commit().map_err(backend)
    }

    /// Number of stored events (the root digest's count: one per stored event).
    pub fn len(&self) -> Result<u64, StoreError> {
        Ok(self.root()?.events)
    }

    /// True when no event is stored.
    pub fn is_empty(&self) -> Result<bool, StoreError> {
        Ok(self.len()? == 0)
    }
}

fn decode(seq: u64, bytes: &[u8]) -> Result<Event, StoreError> {
    Event::decode(bytes).map_err(|source| StoreError::Corrupt {
        what: format!("event at log position {seq}"),
        source,
    })
}

fn missing(seq: u64) -> StoreError {
    StoreError::Backend(format!(
        "the id index names event position {seq}, which is not stored (damaged file?)"
    ))
}

/// Appends one event (its sequence number and canonical encoding) to a chunk.
fn push_entry(chunk: &mut Vec<u8>, seq: u64, encoded: &[u8]) {
    chunk.extend_from_slice(&seq.to_le_bytes());
    chunk.extend_from_slice(&(encoded.len() as u32).to_le_bytes());
    chunk.extend_from_slice(encoded);
}

/// One event in a chunk: its sequence number, the byte range of its whole entry and
/// the byte range of its encoding.
type Entry = (u64, Range<usize>, Range<usize>);

/// The events of a chunk, in order. A chunk that does not parse is an error (a damaged
/// file), never a panic.
fn entries(chunk: &[u8]) -> impl Iterator<Item = Result<Entry, StoreError>> + '_ {
    let mut at = 0usize;
    std::iter::from_fn(move || {
        if at >= chunk.len() {
            return None;
        }
        let start = at;
        let bad = || {
            StoreError::Backend(format!(
                "corrupt event chunk ({} bytes, entry at byte {start})",
                chunk.len()
            ))
        };
        if chunk.len() - at < ENTRY_HEADER {
            at = chunk.len();
            return Some(Err(bad()));
        }
        let seq = u64::from_le_bytes(chunk[at..at + 8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(chunk[at + 8..at + 12].try_into().expect("4 bytes")) as usize;
        let body = at + ENTRY_HEADER;
        if chunk.len() - body < len {
            at = chunk.len();
            return Some(Err(bad()));
        }
        at = body + len;
        Some(Ok((seq, start..at, body..at)))
    })
}

/// The byte ranges (entry, encoding) of event `seq` in `chunk`, if it is there.
fn find_entry(chunk: &[u8], seq: u64) -> Result<Option<Entry>, StoreError> {
    for e in entries(chunk) {
        let e = e?;
        if e.0 == seq {
            return Ok(Some(e));
        }
    }
    Ok(None)
}

/// The key of the chunk of bucket (`hour`, `tenant`) that holds event `seq` (the last
/// chunk of the bucket whose key is at most `seq`), if any.
fn chunk_key_of<T: ReadableTable<(u64, &'static [u8], u64), &'static [u8]>>(
    chunks: &T,
    hour: u64,
    tenant: &[u8],
    seq: u64,
) -> Result<Option<u64>, StoreError> {
    let mut range = chunks
        .range((hour, tenant, 0u64)..=(hour, tenant, seq))
        .map_err(backend)?;
    match range.next_back() {
        Some(row) => Ok(Some(row.map_err(backend)?.0.value().2)),
        None => Ok(None),
    }
}

/// The encoding of the stored event `seq` of bucket (`hour`, `tenant`).
fn stored_event<T: ReadableTable<(u64, &'static [u8], u64), &'static [u8]>>(
    chunks: &T,
    hour: u64,
    tenant: &[u8],
    seq: u64,
) -> Result<Vec<u8>, StoreError> {
    let first = chunk_key_of(chunks, hour, tenant, seq)?.ok_or_else(|| missing(seq))?;
    let chunk = chunks
        .get((hour, tenant, first))
        .map_err(backend)?
        .ok_or_else(|| missing(seq))?;
    let (_, _, body) = find_entry(chunk.value(), seq)?.ok_or_else(|| missing(seq))?;
    Ok(chunk.value()[body].to_vec())
}

/// The `ids` value: hour, sequence number, tenant.
fn location(hour: u64, seq: u64, tenant: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + tenant.len());
    v.extend_from_slice(&hour.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(tenant.as_bytes());
    v
}

fn parse_location(v: &[u8]) -> Result<(u64, u64, &[u8]), StoreError> {
    if v.len() < 16 {
        return Err(StoreError::Backend(format!(
            "corrupt id index record ({} bytes)",
            v.len()
        )));
    }
    let hour = u64::from_le_bytes(v[..8].try_into().expect("8 bytes"));
    let seq = u64::from_le_bytes(v[8..16].try_into().expect("8 bytes"));
    Ok((hour, seq, &v[16..]))
}

fn tenant_str(t: &[u8]) -> Result<String, StoreError> {
    String::from_utf8(t.to_vec())
        .map_err(|_| StoreError::Backend("corrupt tenant in the event index".into()))
}

fn digest_of(what: &str, bytes: &[u8]) -> Result<Digest, StoreError> {
    Digest::from_bytes(bytes).ok_or_else(|| {
        StoreError::Backend(format!(
            "corrupt digest record {what}: {} bytes",
            bytes.len()
        ))
    })
}

/// The chunk a commit is filling for one bucket.
struct Pending {
    /// Its key's sequence number (at most that of its first event).
    first_seq: u64,
    bytes: Vec<u8>,
}

struct Txn<'t, 'r> {
    chunks: redb::Table<'t, (u64, &'static [u8], u64), &'static [u8]>,
    /// The dedupe index's blocks and runs as of the last commit.
    blocks: redb::Table<'t, (u64, &'static [u8]), &'static [u8]>,
    runs: &'r Runs,
    /// The ids this commit adds (location) or removes (empty): its new run.
    new_ids: BTreeMap<Vec<u8>, Vec<u8>>,
    conflicts: redb::Table<'t, ([u8; 16], u128), &'static [u8]>,
    next_seq: u64,
    /// Chunks being filled, one per bucket touched; written by [`Txn::flush`] (or
    /// when one reaches `chunk_bytes_max`).
    pending: std::collections::BTreeMap<Bucket, Pending>,
    chunk_bytes_max: usize,
}

impl Txn<'_, '_> {
    /// Where `rid`'s event is (its `location`), if it is stored: in this commit's new
    /// ids, else in the newest run that has it.
    fn find(&self, rid: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(loc) = self.new_ids.get(rid) {
            return Ok((!loc.is_empty()).then(|| loc.clone()));
        }
        self.runs.lookup(&self.blocks, rid, id_runs::rid_hash(rid))
    }

    /// Writes every chunk being filled. Called once, before the commit.
    fn flush(&mut self) -> Result<(), StoreError> {
        for (b, p) in std::mem::take(&mut self.pending) {
            if !p.bytes.is_empty() {
                self.chunks
                    .insert(
                        (b.hour, b.tenant.as_bytes(), p.first_seq),
                        p.bytes.as_slice(),
                    )
                    .map_err(backend)?;
            }
        }
        Ok(())
    }

    /// The encoding of stored event `seq` of bucket (`hour`, `tenant`): in a chunk this
    /// commit is filling, or in the table.
    fn stored(&self, hour: u64, tenant: &[u8], seq: u64) -> Result<Vec<u8>, StoreError> {
        let bucket = Bucket {
            hour,
            tenant: tenant_str(tenant)?,
        };
        if let Some(p) = self.pending.get(&bucket)
            && p.first_seq <= seq
            && let Some((_, _, body)) = find_entry(&p.bytes, seq)?
        {
            return Ok(p.bytes[body].to_vec());
        }
        stored_event(&self.chunks, hour, tenant, seq)
    }
}

impl TxnOps for Txn<'_, '_> {
    fn insert_new(
        &mut self,
        rid: &str,
        bucket: &Bucket,
        encoded: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(old) = self.find(rid.as_bytes())? {
            let (hour, old_seq, tenant) = parse_location(&old)?;
            return self.stored(hour, tenant, old_seq).map(Some);
        }
        let seq = self.next_seq;
        self.new_ids.insert(
            rid.as_bytes().to_vec(),
            location(bucket.hour, seq, &bucket.tenant),
        );
        self.next_seq += 1;
        let p = match self.pending.get_mut(bucket) {
            Some(p) => p,
            // No room reserved up front: a commit may touch as many buckets as it has
            // events (an import, a peer's sync), and its chunks then hold one each.
            None => self.pending.entry(bucket.clone()).or_insert(Pending {
                first_seq: seq,
                bytes: Vec::new(),
            }),
        };
        if !p.bytes.is_empty()
            && p.bytes.len() + ENTRY_HEADER + encoded.len() > self.chunk_bytes_max
        {
            self.chunks
                .insert(
                    (bucket.hour, bucket.tenant.as_bytes(), p.first_seq),
                    p.bytes.as_slice(),
                )
                .map_err(backend)?;
            p.bytes.clear();
        }
        if p.bytes.is_empty() {
            p.first_seq = seq;
        }
        push_entry(&mut p.bytes, seq, encoded);
        Ok(None)
    }
    fn remove(&mut self, rid: &str, bucket: &Bucket) -> Result<(), StoreError> {
        let loc = self
            .find(rid.as_bytes())?
            .ok_or_else(|| StoreError::Backend(format!("remove of {rid:?}, not stored")))?;
        let (_, seq, _) = parse_location(&loc)?;
        // A tombstone: shadows the id in older runs.
        self.new_ids.insert(rid.as_bytes().to_vec(), Vec::new());
        if let Some(p) = self.pending.get_mut(bucket)
            && p.first_seq <= seq
            && let Some((_, entry, _)) = find_entry(&p.bytes, seq)?
        {
            p.bytes.drain(entry);
            return Ok(());
        }
        let t = bucket.tenant.as_bytes();
        let first = chunk_key_of(&self.chunks, bucket.hour, t, seq)?.ok_or_else(|| missing(seq))?;
        let mut chunk = self
            .chunks
            .get((bucket.hour, t, first))
            .map_err(backend)?
            .ok_or_else(|| missing(seq))?
            .value()
            .to_vec();
        let (_, entry, _) = find_entry(&chunk, seq)?.ok_or_else(|| missing(seq))?;
        chunk.drain(entry);
        if chunk.is_empty() {
            self.chunks
                .remove((bucket.hour, t, first))
                .map_err(backend)?;
        } else {
            self.chunks
                .insert((bucket.hour, t, first), chunk.as_slice())
                .map_err(backend)?;
        }
        Ok(())
    }
    fn put_conflict(&mut self, key: &EventKey, h: u128, loser: &[u8]) -> Result<(), StoreError> {
        self.conflicts.insert((key.0, h), loser).map_err(backend)?;
        Ok(())
    }
}

/// A read transaction is a view of one commit.
impl ReadView for redb::ReadTransaction {
    fn root(&self) -> Result<Digest, StoreError> {
        let meta = self.open_table(META).map_err(backend)?;
        match meta.get("root").map_err(backend)? {
            Some(v) => digest_of("root", v.value()),
            None => Ok(Digest::default()),
        }
    }

    fn visit_bucket(&self, bucket: &Bucket, f: &mut dyn FnMut(&Event)) -> Result<(), StoreError> {
        let chunks = self.open_table(CHUNKS).map_err(backend)?;
        let t = bucket.tenant.as_bytes();
        for row in chunks
            .range((bucket.hour, t, 0u64)..=(bucket.hour, t, u64::MAX))
            .map_err(backend)?
        {
            let (_, v) = row.map_err(backend)?;
            let chunk = v.value();
            for e in entries(chunk) {
                let (seq, _, body) = e?;
                f(&decode(seq, &chunk[body])?);
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
        Ok(self
            .digests_at_most(from_hour, to_hour, tenant, usize::MAX)?
            .unwrap_or_default())
    }

    fn digests_at_most(
        &self,
        from_hour: u64,
        to_hour: u64,
        tenant: Option<&str>,
        max: usize,
    ) -> Result<Option<Vec<(Bucket, Digest)>>, StoreError> {
        let mut out = Vec::new();
        if from_hour >= to_hour {
            return Ok(Some(out));
        }
        let t = self.open_table(DIGESTS).map_err(backend)?;
        for row in t.range((from_hour, "")..).map_err(backend)? {
            let (k, v) = row.map_err(backend)?;
            let (hour, ten) = k.value();
            if hour >= to_hour {
                break;
            }
            if tenant.is_some_and(|want| want != ten) {
                continue;
            }
            if out.len() == max {
                return Ok(None);
            }
            let d = digest_of(&format!("({hour}, {ten:?})"), v.value())?;
            out.push((
                Bucket {
                    hour,
                    tenant: ten.to_string(),
                },
                d,
            ));
        }
        Ok(Some(out))
    }

    fn newest_digests(
        &self,
        to: &Bucket,
        max: usize,
        bytes_max: usize,
    ) -> Result<(Vec<(Bucket, Digest)>, Bucket), StoreError> {
        let mut out: Vec<(Bucket, Digest)> = Vec::new();
        let t = self.open_table(DIGESTS).map_err(backend)?;
        let mut taken = crate::store::NewestTaken::new(max, bytes_max);
        // Backwards from `to`; stops at the first that does not fit.
        for row in t
            .range(..(to.hour, to.tenant.as_str()))
            .map_err(backend)?
            .rev()
        {
            let (k, v) = row.map_err(backend)?;
            let (hour, ten) = k.value();
            let b = Bucket {
                hour,
                tenant: ten.to_string(),
            };
            if !taken.take(&b) {
                // Older buckets remain: the range starts at the oldest taken.
                out.reverse();
                let from = out[0].0.clone();
                return Ok((out, from));
            }
            let d = digest_of(&format!("({hour}, {ten:?})"), v.value())?;
            out.push((b, d));
        }
        out.reverse();
        Ok((out, Bucket::default()))
    }
}

impl Store for RedbStore {
    fn apply(&self, events: &[Event]) -> Result<ApplyReport, StoreError> {
        // Held until the commit is done: the index's filters must match the file.
        let mut index = self
            .index
            .lock()
            .map_err(|_| StoreError::Backend("the id index lock is poisoned".into()))?;
        let mut w = self.db.begin_write().map_err(backend)?;
        w.set_durability(Durability::Immediate).map_err(backend)?;
        let mut runs_table = w.open_table(RUNS).map_err(backend)?;
        let mut merge_table = w.open_table(MERGE).map_err(backend)?;
        let blocks = w.open_table(BLOCKS).map_err(backend)?;
        if index.is_none() {
            // The committed state, whatever this commit does.
            *index = Some(Runs::load(&runs_table, &merge_table, &blocks)?);
        }
        let runs = index.as_ref().expect("loaded above");
        let (report, next) = {
            let mut meta = w.open_table(META).map_err(backend)?;
            let next_seq = match meta.get("next_seq").map_err(backend)? {
                Some(v) => u64::from_le_bytes(
                    v.value()
                        .try_into()
                        .map_err(|_| StoreError::Backend("corrupt next_seq record".into()))?,
                ),
                None => 0,
            };
            let mut txn = Txn {
                chunks: w.open_table(CHUNKS).map_err(backend)?,
                blocks,
                runs,
                new_ids: BTreeMap::new(),
                conflicts: w.open_table(CONFLICTS).map_err(backend)?,
                next_seq,
                pending: std::collections::BTreeMap::new(),
                chunk_bytes_max: self.chunk_bytes_max,
            };
            let mut delta = DigestSet::default();
            let report = apply_batch(&mut txn, events, &mut delta)?;
            txn.flush()?;
            let Txn {
                mut blocks,
                new_ids,
                next_seq,
                ..
            } = txn;
            // The committed state is taken, not copied (a merge under way steps
            // without copying its filter): from here on, a failure leaves none, and
            // the next commit reads it again from the file.
            let mut next = index.take().expect("loaded above");
            let mut t = Tables {
                blocks: &mut blocks,
                runs: &mut runs_table,
                merge: &mut merge_table,
            };
            next.add_run(
                &mut t,
                new_ids.len() as u64,
                0,
                new_ids
                    .iter()
                    .map(|(k, v)| Ok((k.as_slice(), v.as_slice()))),
                &self.index_params,
            )?;
            let mut digests = w.open_table(DIGESTS).map_err(backend)?;
            for (bucket, d) in delta.buckets() {
                let k = (bucket.hour, bucket.tenant.as_str());
                let mut cur = match digests.get(k).map_err(backend)? {
                    Some(v) => digest_of(&format!("{k:?}"), v.value())?,
                    None => Digest::default(),
                };
                cur.add(d);
                if cur.is_empty() {
                    digests.remove(k).map_err(backend)?;
                } else {
                    digests
                        .insert(k, cur.to_bytes().as_slice())
                        .map_err(backend)?;
                }
            }
            meta.insert("next_seq", next_seq.to_le_bytes().as_slice())
                .map_err(backend)?;
            let mut root = match meta.get("root").map_err(backend)? {
                Some(v) => digest_of("root", v.value())?,
                None => Digest::default(),
            };
            root.add(&delta.root());
            meta.insert("root", root.to_bytes().as_slice())
                .map_err(backend)?;
            (report, next)
        };
        drop((runs_table, merge_table));
        // Durability::Immediate: persistent when commit returns (one fsync).
        match w.commit() {
            Ok(()) => *index = Some(next),
            Err(e) => {
                *index = None;
                return Err(backend(e));
            }
        }
        Ok(report)
    }

    fn event(&self, request_id: &str) -> Result<Option<Event>, StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        let runs = r.open_table(RUNS).map_err(backend)?;
        let blocks = r.open_table(BLOCKS).map_err(backend)?;
        let Some(loc) = id_runs::lookup_snapshot(&runs, &blocks, request_id.as_bytes())? else {
            return Ok(None);
        };
        let (hour, seq, tenant) = parse_location(&loc)?;
        let chunks = r.open_table(CHUNKS).map_err(backend)?;
        decode(seq, &stored_event(&chunks, hour, tenant, seq)?).map(Some)
    }

    fn read_view(&self, f: &mut dyn FnMut(&dyn ReadView)) -> Result<(), StoreError> {
        // One read transaction: redb's snapshot of the last commit.
        let r = self.db.begin_read().map_err(backend)?;
        f(&r);
        Ok(())
    }

    fn scan(
        &self,
        from_hour: u64,
        to_hour: u64,
        after: Option<&Cursor>,
        f: &mut dyn FnMut(&Cursor, &Event) -> ControlFlow<()>,
    ) -> Result<(), StoreError> {
        if from_hour >= to_hour {
            return Ok(());
        }
        let r = self.db.begin_read().map_err(backend)?;
        let chunks = r.open_table(CHUNKS).map_err(backend)?;
        let range = match after {
            Some((b, seq)) if b.hour >= from_hour => {
                // Start at the chunk holding the cursor (entries up to it are skipped
                // below), or at the cursor's position if no chunk of its bucket does.
                let t = b.tenant.as_bytes();
                let first = chunk_key_of(&chunks, b.hour, t, *seq)?.unwrap_or(*seq);
                chunks.range((b.hour, t, first)..)
            }
            _ => chunks.range((from_hour, b"".as_slice(), 0u64)..),
        }
        .map_err(backend)?;
        for row in range {
            let (k, v) = row.map_err(backend)?;
            let (hour, tenant, _) = k.value();
            if hour >= to_hour {
                break;
            }
            let mut bucket: Option<Bucket> = None;
            let chunk = v.value();
            for e in entries(chunk) {
                let (seq, _, body) = e?;
                if let Some((b, aseq)) = after
                    && (hour, tenant, seq) <= (b.hour, b.tenant.as_bytes(), *aseq)
                {
                    continue;
                }
                let b = match bucket.take() {
                    Some(b) => b,
                    None => Bucket {
                        hour,
                        tenant: tenant_str(tenant)?,
                    },
                };
                let cursor = (b, seq);
                let flow = f(&cursor, &decode(seq, &chunk[body])?);
                bucket = Some(cursor.0);
                if flow.is_break() {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn root(&self) -> Result<Digest, StoreError> {
        ReadView::root(&self.db.begin_read().map_err(backend)?)
    }

    fn store_id(&self) -> &str {
        &self.store_id
    }

    fn conflicts(&self, limit: usize) -> Result<Vec<Conflict>, StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        let t = r.open_table(CONFLICTS).map_err(backend)?;
        let mut out = Vec::new();
        for row in t.iter().map_err(backend)?.take(limit) {
            let (k, v) = row.map_err(backend)?;
            let key = EventKey(k.value().0);
            out.push(Conflict {
                key,
                loser: Event::decode(v.value()).map_err(|source| StoreError::Corrupt {
                    what: format!("conflict {key}"),
                    source,
                })?,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance;

    /// Runs the conformance suite on fresh files in a temporary directory, every store
    /// (opened and reopened) shaped by `configure`.
    fn conformance_with(configure: impl Fn(RedbStore) -> RedbStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = 0;
        conformance::run(
            &mut || {
                n += 1;
                configure(RedbStore::open(&dir.path().join(format!("c{n}.redb"))).expect("open"))
            },
            &mut |s| {
                let path = s.path().to_path_buf();
                drop(s);
                configure(RedbStore::open(&path).expect("reopen"))
            },
        );
    }

    /// Regression (review, twenty-fifth session): `usage_totals` read the digests,
    /// the corrections and the usage in three read transactions, so a commit landing
    /// between them (an event and its void) gave totals of neither state. A view reads
    /// one commit, whatever lands meanwhile; `usage_totals` reads through one.
    #[test]
    fn a_read_view_sees_one_commit_while_another_lands() {
        use crate::event::HOUR_MS;
        use crate::store::usage_totals;
        use crate::totals::TotalsLimits;
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RedbStore::open(&dir.path().join("v.redb")).expect("open");
        let hour = 490_000;
        let now = hour * HOUR_MS;
        let at = |mut v: Vec<Event>| {
            v.iter_mut().for_each(|e| {
                e.time_ms = now;
                e.tenant = "acme".into();
            });
            v
        };
        store
            .apply(&at(crate::testing::usage_stream(1, "old", "a", 20, now)))
            .expect("apply");
        let before = usage_totals(
            &store,
            "acme",
            hour,
            hour + 1,
            false,
            TotalsLimits::default(),
        )
        .expect("totals");
        let landing = at(crate::testing::usage_stream(2, "new", "a", 5, now));
        let mut seen = None;
        store
            .read_view(&mut |v| {
                let digests = v.digests(hour, hour + 1, Some("acme")).expect("digests");
                store.apply(&landing).expect("a commit lands meanwhile");
                let mut n = 0u64;
                for (b, _) in &digests {
                    v.visit_bucket(b, &mut |_| n += 1).expect("visit");
                }
                let again = v.digests(hour, hour + 1, Some("acme")).expect("digests");
                seen = Some((digests, again, n));
            })
            .expect("view");
        let (first, again, n) = seen.expect("the view ran");
        assert_eq!(first, again, "the view's digests moved");
        assert_eq!(n, 20, "the view saw events of a later commit");
        let after = usage_totals(
            &store,
            "acme",
            hour,
            hour + 1,
            false,
            TotalsLimits::default(),
        )
        .expect("totals");
        assert_eq!(before.total.requests, 20);
        assert_eq!(after.total.requests, 25);
        assert_eq!(after.digest.events, 25);
    }

    #[test]
    fn the_redb_backend_passes_the_conformance_suite() {
        conformance_with(|s| s);
    }

    #[test]
    fn the_redb_backend_passes_the_conformance_suite_with_tiny_chunks() {
        // One or two events per chunk: lookups, removals (conflicts) and cursors
        // cross chunk boundaries everywhere.
        for max in [1, 300] {
            conformance_with(|s| s.with_chunk_bytes_max(max));
        }
    }

    #[test]
    fn the_redb_backend_passes_the_conformance_suite_with_a_tiny_merging_index() {
        // A few ids per block and merges every second commit: every lookup, conflict
        // removal and reopen crosses blocks, runs and levels.
        let params = id_runs::Params {
            block_bytes: 80,
            fanout: 2,
            merge_entries_max: 64,
            merge_step_entries: 16,
        };
        conformance_with(|s| s.with_index_params(params));
    }

    /// Rewrites the dedupe index of the file at `path` into format 4's one B-tree
    /// (`ids`) and marks the file `format`, as a file written before the runs.
    fn rewrite_index_as_format_4(path: &Path, format: &[u8]) {
        let db = Database::create(path).expect("db");
        let w = db.begin_write().expect("write");
        {
            let runs = w.open_table(RUNS).expect("runs");
            let blocks = w.open_table(BLOCKS).expect("blocks");
            let mut ids = w.open_table(IDS_V4).expect("ids");
            // Oldest run first, so newer entries (and tombstones) overwrite.
            for run in runs.iter().expect("runs") {
                let run = run.expect("run").0.value();
                let upper: &[u8] = &[];
                for row in blocks
                    .range((run, upper)..(run + 1, upper))
                    .expect("blocks")
                {
                    let (_, block) = row.expect("block");
                    for e in id_runs::block_entries(block.value()) {
                        let (rid, loc) = e.expect("entry");
                        if loc.is_empty() {
                            ids.remove(rid).expect("remove");
                        } else {
                            ids.insert(rid, loc).expect("insert");
                        }
                    }
                }
            }
            let mut meta = w.open_table(META).expect("meta");
            meta.insert("format", format).expect("format");
        }
        w.delete_table(RUNS).expect("delete");
        w.delete_table(BLOCKS).expect("delete");
        w.commit().expect("commit");
    }

    /// The format marker of the file at `path`, and whether it still has `ids`.
    fn format_of(path: &Path) -> (Vec<u8>, bool) {
        let db = Database::create(path).expect("db");
        let r = db.begin_read().expect("read");
        let meta = r.open_table(META).expect("meta");
        let f = meta
            .get("format")
            .expect("get")
            .expect("format")
            .value()
            .to_vec();
        (f, r.open_table(IDS_V4).is_ok())
    }

    #[test]
    fn a_format_4_file_is_converted_at_open_and_keeps_every_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let now = 490_000 * crate::event::HOUR_MS;
        let mut events = crate::testing::usage_stream(8, "d", "a", 2_000, now);
        let mut loser = events[10].clone();
        loser.seq += 1_000_000;
        events.push(loser);
        let params = id_runs::Params {
            block_bytes: 200,
            fanout: 2,
            merge_entries_max: 1_000,
            merge_step_entries: 100,
        };
        let before = {
            let s = RedbStore::open(&path)
                .expect("open")
                .with_index_params(params);
            for part in events.chunks(300) {
                s.apply(part).expect("apply");
            }
            contents(&s, &events)
        };
        rewrite_index_as_format_4(&path, FORMAT_V4);
        assert_eq!(format_of(&path), (FORMAT_V4.to_vec(), true));
        let s = RedbStore::open(&path).expect("a format 4 file opens");
        let after = contents(&s, &events);
        assert_eq!(after.4.len(), 1, "the conflict is still recorded");
        assert_eq!(after, before);
        // New events and resends after the conversion: each resend is a duplicate.
        let more = crate::testing::usage_stream(9, "e", "b", 500, now);
        let report = s.apply(&more).expect("apply");
        assert_eq!(report.new, 500);
        let again = s.apply(&events[..1_000]).expect("resend");
        assert_eq!((again.new, again.duplicate), (0, 1_000));
        assert_eq!(s.len().expect("len"), 2_500);
        drop(s);
        assert_eq!(format_of(&path), (FORMAT.to_vec(), false));
    }

    /// Everything a store answers, for comparing two stores.
    type Contents = (
        Digest,
        Vec<(Bucket, Digest)>,
        Vec<(Cursor, Event)>,
        Vec<Option<Event>>,
        Vec<Conflict>,
    );

    fn contents(s: &RedbStore, events: &[Event]) -> Contents {
        let mut scanned = Vec::new();
        s.scan(0, u64::MAX, None, &mut |c, e| {
            scanned.push((c.clone(), e.clone()));
            ControlFlow::Continue(())
        })
        .expect("scan");
        let by_id = events
            .iter()
            .map(|e| s.event(&e.request_id).expect("event"))
            .collect();
        (
            s.root().expect("root"),
            s.digests(0, u64::MAX, None).expect("digests"),
            scanned,
            by_id,
            s.conflicts(1_000).expect("conflicts"),
        )
    }

    #[test]
    fn a_store_reopened_in_the_middle_of_a_merge_goes_on_from_where_it_was() {
        let dir = tempfile::tempdir().expect("tempdir");
        let reference = tempfile::tempdir().expect("tempdir");
        let now = 490_000 * crate::event::HOUR_MS;
        let events = crate::testing::usage_stream(11, "m", "c", 3_000, now);
        let params = id_runs::Params {
            block_bytes: 200,
            fanout: 2,
            merge_entries_max: 100_000,
            merge_step_entries: 50,
        };
        let open = |d: &Path| {
            RedbStore::open(&d.join(FILE_NAME))
                .expect("open")
                .with_index_params(params)
        };
        let under_way = |s: &RedbStore| {
            let index = s.index.lock().expect("lock");
            index.as_ref().is_some_and(|r| r.merge_under_way())
        };
        let mut s = open(dir.path());
        let mut reopened = 0;
        for part in events.chunks(100) {
            let report = s.apply(part).expect("apply");
            assert_eq!(report.new, part.len() as u64);
            if under_way(&s) {
                // A restart mid-merge: the next commit reads how far it got back
                // from the file and takes the next step.
                drop(s);
                s = open(dir.path());
                reopened += 1;
            }
        }
        assert!(reopened >= 5, "{reopened} restarts mid-merge");
        let r = open(reference.path());
        for part in events.chunks(100) {
            r.apply(part).expect("apply");
        }
        assert_eq!(contents(&s, &events), contents(&r, &events));
        let again = s.apply(&events).expect("resend");
        assert_eq!((again.new, again.duplicate), (0, 3_000));
        assert_eq!(s.len().expect("len"), 3_000);
    }

    #[test]
    fn a_format_5_file_is_marked_format_6_at_open_and_keeps_every_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let now = 490_000 * crate::event::HOUR_MS;
        let events = crate::testing::usage_stream(12, "f", "a", 1_000, now);
        let before = {
            let s = RedbStore::open(&path).expect("open");
            for part in events.chunks(250) {
                s.apply(part).expect("apply");
            }
            contents(&s, &events)
        };
        {
            let db = Database::create(&path).expect("db");
            let w = db.begin_write().expect("write");
            w.delete_table(MERGE).expect("delete");
            w.open_table(META)
                .expect("meta")
                .insert("format", FORMAT_V5)
                .expect("format");
            w.commit().expect("commit");
        }
        assert_eq!(format_of(&path), (FORMAT_V5.to_vec(), false));
        let s = RedbStore::open(&path).expect("a format 5 file opens");
        assert_eq!(contents(&s, &events), before);
        let again = s.apply(&events).expect("resend");
        assert_eq!((again.new, again.duplicate), (0, 1_000));
        drop(s);
        assert_eq!(format_of(&path), (FORMAT.to_vec(), false));
    }

    #[test]
    fn a_format_3_file_is_converted_at_open_and_keeps_every_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let now = 490_000 * crate::event::HOUR_MS;
        let mut events = crate::testing::usage_stream(7, "d", "a", 3_000, now);
        // A conflict: a second payload for a stored request id.
        let mut loser = events[10].clone();
        loser.seq += 1_000_000;
        events.push(loser);
        let before = {
            let s = RedbStore::open(&path)
                .expect("open")
                .with_chunk_bytes_max(2_000);
            for part in events.chunks(700) {
                s.apply(part).expect("apply");
            }
            contents(&s, &events)
        };
        // Rewrite the file into format 3: one `events` row per event.
        {
            let db = Database::create(&path).expect("db");
            let w = db.begin_write().expect("write");
            {
                let chunks = w.open_table(CHUNKS).expect("chunks");
                let mut old = w.open_table(EVENTS_V3).expect("events");
                for row in chunks.iter().expect("iter") {
                    let (k, v) = row.expect("row");
                    let (hour, tenant, _) = k.value();
                    for e in entries(v.value()) {
                        let (seq, _, body) = e.expect("entry");
                        old.insert((hour, tenant, seq), &v.value()[body])
                            .expect("insert");
                    }
                }
            }
            w.delete_table(CHUNKS).expect("delete");
            w.commit().expect("commit");
        }
        rewrite_index_as_format_4(&path, FORMAT_V3);
        let s = RedbStore::open(&path).expect("a format 3 file opens");
        let after = contents(&s, &events);
        assert_eq!(after.4.len(), 1, "the conflict is still recorded");
        assert_eq!(after, before);
        assert_eq!(s.len().expect("len"), 3_000);
        // Converted once: the marker says the current format and the old tables
        // are gone.
        drop(s);
        assert_eq!(format_of(&path), (FORMAT.to_vec(), false));
        let db = Database::create(&path).expect("db");
        let r = db.begin_read().expect("read");
        assert!(
            r.open_table(EVENTS_V3).is_err(),
            "the format 3 table is gone"
        );
    }

    #[test]
    fn a_damaged_chunk_is_an_error_not_a_panic() {
        let mut chunk = Vec::new();
        push_entry(&mut chunk, 7, b"abc");
        push_entry(&mut chunk, 9, b"de");
        let seqs: Vec<u64> = entries(&chunk).map(|e| e.expect("entry").0).collect();
        assert_eq!(seqs, [7, 9]);
        for cut in 1..chunk.len() {
            let all: Vec<_> = entries(&chunk[..cut]).collect();
            if cut != ENTRY_HEADER + 3 {
                assert!(all.last().expect("an entry").is_err(), "cut at {cut}");
            }
        }
    }

    #[test]
    fn a_file_of_garbage_is_refused_with_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let garbage: Vec<u8> = (0..64 * 1024u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        std::fs::write(&path, &garbage).expect("write");
        let err = RedbStore::open(&path).expect_err("garbage must be refused");
        let msg = err.to_string();
        assert!(matches!(err, StoreError::Open { .. }), "{msg}");
        assert!(msg.contains("cannot open ledger data file"), "{msg}");
        assert_eq!(
            std::fs::read(&path).expect("read"),
            garbage,
            "the file was changed"
        );
    }

    #[test]
    fn a_data_dir_whose_file_was_deleted_is_refused_rather_than_started_over() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let s = RedbStore::open_dir(dir.path()).expect("open");
            let e = crate::testing::usage("r", "t", "m", 3_600_000, 1, 0, 1);
            s.apply(&[e]).expect("apply");
        }
        std::fs::remove_file(dir.path().join(FILE_NAME)).expect("remove");
        let err = RedbStore::open_dir(dir.path()).expect_err("refused");
        assert!(err.to_string().contains("refusing to start empty"), "{err}");
        assert!(
            !dir.path().join(FILE_NAME).exists(),
            "a new file was created"
        );
    }

    /// Review, twenty-fifth session: a first start killed before redb wrote the file's
    /// header left a 0-byte file and no marker, and every later start refused it.
    #[test]
    fn an_empty_file_without_a_marker_is_a_first_start_that_died_and_starts_afresh() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(FILE_NAME), b"").expect("write");
        let s = RedbStore::open_dir(dir.path()).expect("a fresh start");
        assert_eq!(s.root().expect("root").events, 0);
        assert!(dir.path().join(MARKER_NAME).exists());
        drop(s);
        // With the marker, an empty file is data gone missing: refused.
        std::fs::write(dir.path().join(FILE_NAME), b"").expect("truncate");
        let err = RedbStore::open_dir(dir.path()).expect_err("refused");
        assert!(err.to_string().contains("the file is empty"), "{err}");
    }

    #[test]
    fn an_empty_file_is_refused_rather_than_started_over() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        std::fs::write(&path, b"").expect("write");
        let err = RedbStore::open(&path).expect_err("refused");
        assert!(err.to_string().contains("the file is empty"), "{err}");
    }

    #[test]
    fn a_ledger_file_with_a_changed_record_is_refused_not_misread() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        let now = 490_000 * crate::event::HOUR_MS;
        let events = crate::testing::usage_stream(3, "d", "a", 2_000, now);
        {
            let s = RedbStore::open(&path).expect("open");
            s.apply(&events).expect("apply");
        }
        let mut bytes = std::fs::read(&path).expect("read");
        // Change one token count inside a stored record: the damage a bad disk or a
        // stray write does, and the one that would silently change a bill.
        let victim = events[1234].encode();
        let at = bytes
            .windows(victim.len())
            .position(|w| w == victim.as_slice())
            .expect("the record is in the file");
        bytes[at + victim.len() - 1] ^= 0x01;
        std::fs::write(&path, &bytes).expect("write");
        // Never a silently changed bill: the start is refused with a clear error.
        let err = RedbStore::open(&path).expect_err("a changed record must be refused");
        assert!(matches!(err, StoreError::Open { .. }), "{err}");
        assert!(err.to_string().contains("integrity check"), "{err}");
    }

    #[test]
    fn a_redb_file_from_another_program_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(FILE_NAME);
        {
            let db = Database::create(&path).expect("create");
            let w = db.begin_write().expect("write");
            {
                let mut t = w
                    .open_table(TableDefinition::<&str, u64>::new("other"))
                    .expect("table");
                t.insert("x", 1).expect("insert");
            }
            w.commit().expect("commit");
        }
        let err = RedbStore::open(&path).expect_err("refused");
        assert!(
            err.to_string().contains("without the ledger format marker"),
            "{err}"
        );
    }
}
