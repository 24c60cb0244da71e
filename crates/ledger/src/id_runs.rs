//! The dedupe index of the redb backend: request id -> where its event is, kept as
//! immutable **sorted runs** (a small log-structured merge tree inside the same redb
//! file) instead of one B-tree.
//!
//! Why: a B-tree keyed by request id copies one 4 KiB leaf per inserted id once the
//! tree is larger than a commit, when ids are random (UUIDv4): ~20 µs of the writer's
//! time per event (docs/BENCHMARKS.md, "Random request ids"). Here a commit writes the
//! ids it added as one new run, sorted, packed into blocks of about [`BLOCK_BYTES`]:
//! ~60 bytes written per id, whatever their order. Runs are merged once
//! [`Params::fanout`] of them sit at one level (tiered: each id is rewritten about once
//! per level, `log_fanout(N / batch)` times), until a merge would exceed
//! [`Params::merge_entries_max`]; runs that large are left as they are.
//!
//! **A large merge is spread over the commits that follow** instead of stalling one:
//! a merge of up to [`Params::merge_step_entries`] ids is done in the commit that
//! calls for it, a larger one is begun there and each commit rewrites its share
//! (at least `merge_step_entries` ids, and [`STEP_PER_ID`] for each id the commit
//! adds, so merges keep up with any ingest rate). Until its last step the merge's
//! output is not a run (no meta in `RUNS`): every lookup still reads its inputs, and
//! a reader's snapshot never sees half a merge. The last step publishes the output and
//! drops the inputs' metas in one transaction; their blocks, which nothing reads any
//! more, are deleted over the commits after it. One such merge is under way
//! at a time (recorded in `MERGE`); merges of lower levels go on beside it, and a
//! merge that would make a run of a higher level than its output waits for it.
//!
//! Lookups stay exact at any time distance: every run has a blocked Bloom filter
//! (about 10 bits per id, one cache line probed) held in memory by the writer, so a new
//! id usually reads no block at all; a filter hit reads the one block whose last id is
//! at or past the id (blocks are keyed by (run, last id)). Newer runs shadow older
//! ones; removing an id (a conflict's loser) writes a **tombstone** (an empty
//! location) into the newer run. Readers outside the writer (`Store::event`) probe
//! every run of their own snapshot without filters, newest first; they are rare
//! (conflicts, tests).
//!
//! Tables:
//! - `BLOCKS`: (run, last request id of the block) -> block: entries
//!   `rid_len u16 LE, loc_len u16 LE, rid, loc` in request-id order;
//! - `RUNS`: run -> meta: `version u8 (1), level u8, entries u64 LE, filter words
//!   (u64 LE)`;
//! - `MERGE`: 0 -> the merge under way, if any: `version u8 (1), level u8 (of its
//!   output), output run u64 LE, input runs u64 LE...` (oldest first). How far it got
//!   is the output's blocks themselves: a restart reads them back (the last id, the
//!   count, the filter) and goes on from there. 1 -> the runs merged that way whose
//!   blocks are still to be deleted, if any: `run u64 LE...`.
//!
//! Runs are numbered in creation order, and a merge always takes a suffix of the runs
//! (those newer than the merge under way, if one is): a level's runs and every run
//! newer than them. Its output takes the next number when it begins, newer than its
//! inputs and older than every run made after, so a larger run number is always newer
//! data; levels never increase from older to newer runs (counting the inputs of the
//! merge under way as the run they will be).

use std::ops::{Bound, Range};
use std::sync::Arc;

use redb::{ReadableTable, TableDefinition};

use crate::store::StoreError;

/// (run, last request id in the block) -> block.
pub(crate) const BLOCKS: TableDefinition<(u64, &[u8]), &[u8]> = TableDefinition::new("id_blocks");
/// run -> meta (level, entries, filter).
pub(crate) const RUNS: TableDefinition<u64, &[u8]> = TableDefinition::new("id_runs");
/// The merge under way, and the merged runs whose blocks are still to be deleted
/// (see the module docs).
pub(crate) const MERGE: TableDefinition<u8, &[u8]> = TableDefinition::new("id_merge");
/// `MERGE`'s key of the merge under way.
const UNDER_WAY: u8 = 0;
/// `MERGE`'s key of the merged runs whose blocks are still to be deleted.
const GARBAGE: u8 = 1;

/// A merge under way rewrites at least this many ids for each id its commit adds.
/// Merges above the lowest levels rewrite each id once or twice in all (the lower
/// levels merge within their commit), so this keeps the one under way well ahead of
/// the next one due.
pub const STEP_PER_ID: u64 = 4;

/// A block is closed before it would pass this many bytes: with its key it fits one
/// 4 KiB redb leaf page.
pub const BLOCK_BYTES: usize = 3_800;

/// The level of a run converted from an earlier file's B-tree index: never merged.
pub const LEVEL_FROZEN: u8 = u8::MAX;

const META_VERSION: u8 = 1;
const MERGE_VERSION: u8 = 1;
const FILTER_BITS_PER_ENTRY: u64 = 10;
const FILTER_BLOCK_WORDS: usize = 8; // 512 bits: one cache line
const FILTER_PROBES: u32 = 6;

/// Shape of the index. The defaults are what the store uses; tests shrink them so that
/// a few events cross block boundaries and merge often.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Bytes per block (at least one entry per block whatever its size).
    pub block_bytes: usize,
    /// Runs of one level merged into one of the next.
    pub fanout: usize,
    /// A merge whose output would hold more ids than this is not done.
    pub merge_entries_max: u64,
    /// A merge of more ids than this is spread over several commits (see the module
    /// docs); each rewrites at least this many of its ids.
    pub merge_step_entries: u64,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            block_bytes: BLOCK_BYTES,
            fanout: 4,
            merge_entries_max: 1 << 20,
            // ~2 MB of blocks: a few tens of milliseconds of a commit.
            merge_step_entries: 1 << 15,
        }
    }
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("corrupt id index: {what}"))
}

/// A stable 64-bit hash of a request id (the filters are stored, so it must never
/// change). Not keyed: a client that crafts ids to collide costs the writer block
/// reads, never a wrong answer.
pub fn rid_hash(rid: &[u8]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64 ^ (rid.len() as u64);
    let mut words = rid.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 29;
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    }
    mix(h)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A blocked Bloom filter: every probe of one id falls in one 512-bit block.
#[derive(Clone, PartialEq, Eq)]
pub struct Filter {
    words: Vec<u64>,
}

impl std::fmt::Debug for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Filter({} bytes)", self.words.len() * 8)
    }
}

impl Filter {
    /// An empty filter sized for `entries` ids.
    pub fn for_entries(entries: u64) -> Filter {
        let bits = entries.max(1) * FILTER_BITS_PER_ENTRY;
        let blocks = bits.div_ceil(512).max(1) as usize;
        Filter {
            words: vec![0; blocks * FILTER_BLOCK_WORDS],
        }
    }

    fn blocks(&self) -> usize {
        self.words.len() / FILTER_BLOCK_WORDS
    }

    fn place(&self, h: u64) -> (usize, u64) {
        let block = (((h >> 32) * self.blocks() as u64) >> 32) as usize;
        (block * FILTER_BLOCK_WORDS, mix(h ^ 0xA076_1D64_78BD_642F))
    }

    /// Adds the id whose [`rid_hash`] is `h`.
    pub fn insert(&mut self, h: u64) {
        let (base, bits) = self.place(h);
        for i in 0..FILTER_PROBES {
            let bit = (bits >> (9 * i)) & 511;
            self.words[base + (bit >> 6) as usize] |= 1 << (bit & 63);
        }
    }

    /// False only if the id whose hash is `h` was never added.
    pub fn may_contain(&self, h: u64) -> bool {
        let (base, bits) = self.place(h);
        (0..FILTER_PROBES).all(|i| {
            let bit = (bits >> (9 * i)) & 511;
            self.words[base + (bit >> 6) as usize] & (1 << (bit & 63)) != 0
        })
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.words.len() * 8
    }
}

/// One run as the writer knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// Creation order: larger is newer.
    pub id: u64,
    /// 0 for a commit's own run; a merge of level `l` makes one of `l + 1`.
    pub level: u8,
    /// Entries, tombstones included.
    pub entries: u64,
    /// Every id of the run.
    pub filter: Filter,
}

impl Run {
    fn encode_meta(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(10 + self.filter.bytes());
        v.push(META_VERSION);
        v.push(self.level);
        v.extend_from_slice(&self.entries.to_le_bytes());
        for w in &self.filter.words {
            v.extend_from_slice(&w.to_le_bytes());
        }
        v
    }

    fn decode_meta(id: u64, v: &[u8]) -> Result<Run, StoreError> {
        let bad = || corrupt(format!("run {id} has a {}-byte header", v.len()));
        if v.len() < 10 || v[0] != META_VERSION {
            return Err(bad());
        }
        let filter = &v[10..];
        if filter.is_empty() || !filter.len().is_multiple_of(8 * FILTER_BLOCK_WORDS) {
            return Err(bad());
        }
        Ok(Run {
            id,
            level: v[1],
            entries: u64::from_le_bytes(v[2..10].try_into().expect("8 bytes")),
            filter: Filter {
                words: filter
                    .chunks_exact(8)
                    .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                    .collect(),
            },
        })
    }
}

/// Parses the entries of a block, in order: (request id, location; empty = removed).
/// A block that does not parse is an error, never a panic.
pub(crate) fn block_entries(
    block: &[u8],
) -> impl Iterator<Item = Result<(&[u8], &[u8]), StoreError>> + '_ {
    let mut at = 0usize;
    std::iter::from_fn(move || {
        if at >= block.len() {
            return None;
        }
        let bad = |at: usize| corrupt(format!("a {}-byte block breaks at byte {at}", block.len()));
        if block.len() - at < 4 {
            let e = bad(at);
            at = block.len();
            return Some(Err(e));
        }
        let rid_len = u16::from_le_bytes([block[at], block[at + 1]]) as usize;
        let loc_len = u16::from_le_bytes([block[at + 2], block[at + 3]]) as usize;
        let body = at + 4;
        if block.len() - body < rid_len + loc_len {
            let e = bad(at);
            at = block.len();
            return Some(Err(e));
        }
        at = body + rid_len + loc_len;
        Some(Ok((
            &block[body..body + rid_len],
            &block[body + rid_len..at],
        )))
    })
}

/// The location `rid` has in `block` (empty for a tombstone), if it is there.
fn block_find<'b>(block: &'b [u8], rid: &[u8]) -> Result<Option<&'b [u8]>, StoreError> {
    for e in block_entries(block) {
        let (r, loc) = e?;
        match r.cmp(rid) {
            std::cmp::Ordering::Less => {}
            std::cmp::Ordering::Equal => return Ok(Some(loc)),
            std::cmp::Ordering::Greater => return Ok(None),
        }
    }
    Ok(None)
}

/// Looks `rid` up in run `run` only: the location (empty for a tombstone), if the run
/// holds the id.
fn lookup_in_run<T>(blocks: &T, run: u64, rid: &[u8]) -> Result<Option<Vec<u8>>, StoreError>
where
    T: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
{
    let upper: &[u8] = &[];
    let mut range = blocks
        .range((run, rid)..(run + 1, upper))
        .map_err(backend)?;
    let Some(row) = range.next() else {
        return Ok(None);
    };
    let (_, block) = row.map_err(backend)?;
    Ok(block_find(block.value(), rid)?.map(<[u8]>::to_vec))
}

/// Where `rid`'s event is, for a reader holding its own snapshot: every run of the
/// snapshot, newest first, without filters. `None` when absent or removed.
pub(crate) fn lookup_snapshot<R, B>(
    runs: &R,
    blocks: &B,
    rid: &[u8],
) -> Result<Option<Vec<u8>>, StoreError>
where
    R: ReadableTable<u64, &'static [u8]>,
    B: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
{
    for row in runs.iter().map_err(backend)?.rev() {
        let (k, _) = row.map_err(backend)?;
        if let Some(loc) = lookup_in_run(blocks, k.value(), rid)? {
            return Ok((!loc.is_empty()).then_some(loc));
        }
    }
    Ok(None)
}

/// Builds the blocks of one run from entries in strictly increasing request-id order.
struct RunWriter {
    id: u64,
    block: Vec<u8>,
    last: Vec<u8>,
    entries: u64,
    filter: Filter,
    block_bytes: usize,
}

impl RunWriter {
    fn new(id: u64, capacity: u64, block_bytes: usize) -> RunWriter {
        RunWriter {
            id,
            block: Vec::with_capacity(block_bytes),
            last: Vec::new(),
            entries: 0,
            filter: Filter::for_entries(capacity),
            block_bytes,
        }
    }

    /// Goes on with merge `m`'s output where its last step left it: takes the last id
    /// written and the filter so far out of `m` until [`RunWriter::suspend`] puts them
    /// back.
    fn resume(m: &mut Merging, block_bytes: usize) -> RunWriter {
        RunWriter {
            id: m.out,
            block: Vec::with_capacity(block_bytes),
            last: std::mem::take(&mut m.last),
            entries: m.entries,
            // An empty filter holds the place: `m` is not read until it is back.
            filter: std::mem::replace(&mut m.filter, Filter { words: Vec::new() }),
            block_bytes,
        }
    }

    /// Closes the open block and puts into `m` what a later step needs to go on: the
    /// ids written, the last of them, the filter.
    fn suspend(
        mut self,
        blocks: &mut redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
        m: &mut Merging,
    ) -> Result<(), StoreError> {
        self.close_block(blocks)?;
        (m.entries, m.last, m.filter) = (self.entries, self.last, self.filter);
        Ok(())
    }

    fn push(
        &mut self,
        blocks: &mut redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
        rid: &[u8],
        loc: &[u8],
    ) -> Result<(), StoreError> {
        if self.entries > 0 && rid <= self.last.as_slice() {
            return Err(StoreError::Backend(
                "id index run written out of order (a bug)".into(),
            ));
        }
        let (Ok(rl), Ok(ll)) = (u16::try_from(rid.len()), u16::try_from(loc.len())) else {
            return Err(StoreError::Backend(format!(
                "request id of {} bytes is too long for the id index",
                rid.len()
            )));
        };
        if !self.block.is_empty() && self.block.len() + 4 + rid.len() + loc.len() > self.block_bytes
        {
            self.close_block(blocks)?;
        }
        self.block.extend_from_slice(&rl.to_le_bytes());
        self.block.extend_from_slice(&ll.to_le_bytes());
        self.block.extend_from_slice(rid);
        self.block.extend_from_slice(loc);
        self.last.clear();
        self.last.extend_from_slice(rid);
        self.entries += 1;
        self.filter.insert(rid_hash(rid));
        Ok(())
    }

    fn close_block(
        &mut self,
        blocks: &mut redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
    ) -> Result<(), StoreError> {
        if !self.block.is_empty() {
            blocks
                .insert((self.id, self.last.as_slice()), self.block.as_slice())
                .map_err(backend)?;
            self.block.clear();
        }
        Ok(())
    }

    fn finish(
        mut self,
        blocks: &mut redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
        runs: &mut redb::Table<'_, u64, &'static [u8]>,
        level: u8,
    ) -> Result<Run, StoreError> {
        self.close_block(blocks)?;
        let run = Run {
            id: self.id,
            level,
            entries: self.entries,
            filter: self.filter,
        };
        runs.insert(run.id, run.encode_meta().as_slice())
            .map_err(backend)?;
        Ok(run)
    }
}

/// Reads one input run of a merge block by block (one range query per block: the
/// table is written between reads). Its current entry is a pair of ranges into its own
/// copy of the block, so a merge allocates per block, not per id.
struct RunReader {
    run: u64,
    block: Vec<u8>,
    /// Where the entry after the current one starts.
    at: usize,
    /// The current entry: request id and location, as ranges of `block`.
    head: Option<(Range<usize>, Range<usize>)>,
    /// The keys of the blocks read so far (deleted once the merge is written).
    read: Vec<Vec<u8>>,
    done: bool,
}

impl RunReader {
    fn new(run: u64) -> RunReader {
        RunReader {
            run,
            block: Vec::new(),
            at: 0,
            head: None,
            read: Vec::new(),
            done: false,
        }
    }

    /// Reads run `run` from its first id past `last` (from its start if `None`): where
    /// a merge's earlier steps stopped.
    fn past(
        run: u64,
        last: Option<&[u8]>,
        blocks: &redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
    ) -> Result<RunReader, StoreError> {
        let mut r = RunReader::new(run);
        if let Some(last) = last {
            // The block holding the first id at or past `last` (blocks are keyed by
            // their last id): entries up to `last` in it are skipped below.
            let upper: &[u8] = &[];
            let mut range = blocks
                .range((run, last)..(run + 1, upper))
                .map_err(backend)?;
            match range.next() {
                None => r.done = true,
                Some(row) => {
                    let (k, v) = row.map_err(backend)?;
                    r.read.push(k.value().1.to_vec());
                    r.block.extend_from_slice(v.value());
                }
            }
        }
        r.advance(blocks)?;
        if let Some(last) = last {
            while r.head().is_some_and(|(rid, _)| rid <= last) {
                r.advance(blocks)?;
            }
        }
        Ok(r)
    }

    /// The current entry, `None` once the run is exhausted.
    fn head(&self) -> Option<(&[u8], &[u8])> {
        self.head
            .as_ref()
            .map(|(r, l)| (&self.block[r.clone()], &self.block[l.clone()]))
    }

    /// Moves to the next entry, reading the next block when this one is done.
    fn advance(
        &mut self,
        blocks: &redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
    ) -> Result<(), StoreError> {
        self.head = None;
        while !self.done {
            if self.at < self.block.len() {
                let (rid, loc) = block_entries(&self.block[self.at..])
                    .next()
                    .expect("not empty")?;
                let (rl, ll) = (rid.len(), loc.len());
                let r = self.at + 4..self.at + 4 + rl;
                let l = r.end..r.end + ll;
                self.at = l.end;
                self.head = Some((r, l));
                return Ok(());
            }
            let upper: &[u8] = &[];
            let mut range = match self.read.last() {
                None => blocks.range((self.run, upper)..(self.run + 1, upper)),
                Some(last) => blocks.range::<(u64, &[u8])>((
                    Bound::Excluded((self.run, last.as_slice())),
                    Bound::Excluded((self.run + 1, upper)),
                )),
            }
            .map_err(backend)?;
            match range.next() {
                None => self.done = true,
                Some(row) => {
                    let (k, v) = row.map_err(backend)?;
                    if v.value().is_empty() {
                        return Err(corrupt(format!("run {} has an empty block", self.run)));
                    }
                    self.read.push(k.value().1.to_vec());
                    self.block.clear();
                    self.block.extend_from_slice(v.value());
                    self.at = 0;
                }
            }
        }
        Ok(())
    }
}

/// The dedupe index at a glance (the ledger's `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Runs (each costs a filter probe per new id).
    pub runs: u64,
    /// Bytes of Bloom filters held in memory.
    pub filter_bytes: u64,
    /// Input ids the merge spread over commits has still to rewrite (0: none under way;
    /// an id it dropped, shadowed by a newer input, counts until the merge ends).
    pub merge_ids_left: u64,
    /// Runs merged whose blocks are still to be deleted.
    pub merged_runs_to_delete: u64,
}

/// The merge under way (see the module docs): its inputs are still runs, its output
/// not yet.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Merging {
    /// The output's run id, taken when the merge began: newer than its inputs, older
    /// than every run made since.
    out: u64,
    /// The output's level.
    level: u8,
    /// The input runs, oldest first: consecutive in [`Runs::list`].
    inputs: Vec<u64>,
    /// Ids written to the output so far.
    entries: u64,
    /// The last of them (empty while there are none).
    last: Vec<u8>,
    /// The output's filter so far, sized for every input id.
    filter: Filter,
}

impl Merging {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(10 + 8 * self.inputs.len());
        v.push(MERGE_VERSION);
        v.push(self.level);
        v.extend_from_slice(&self.out.to_le_bytes());
        v.extend_from_slice(&encode_ids(&self.inputs));
        v
    }

    /// The record and how far the output got, from its blocks; checked against `list`.
    fn load<B>(v: &[u8], list: &[Arc<Run>], blocks: &B) -> Result<Merging, StoreError>
    where
        B: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
    {
        let bad = |why: &str| corrupt(format!("the merge record ({} bytes) {why}", v.len()));
        if v.len() < 10 || v[0] != MERGE_VERSION || !(v.len() - 10).is_multiple_of(8) {
            return Err(bad("does not parse"));
        }
        let out = u64::from_le_bytes(v[2..10].try_into().expect("8 bytes"));
        let inputs = decode_ids(&v[10..]);
        let first = inputs
            .first()
            .and_then(|i| list.iter().position(|r| r.id == *i))
            .ok_or_else(|| bad("names no run"))?;
        let runs = list
            .get(first..first + inputs.len())
            .filter(|rs| rs.iter().map(|r| r.id).eq(inputs.iter().copied()))
            .ok_or_else(|| bad("names runs that are not consecutive"))?;
        if list.iter().any(|r| r.id == out) || out <= inputs[inputs.len() - 1] {
            return Err(bad("names an output that is already a run"));
        }
        let mut m = Merging {
            out,
            level: v[1],
            inputs,
            entries: 0,
            last: Vec::new(),
            filter: Filter::for_entries(runs.iter().map(|r| r.entries).sum()),
        };
        let upper: &[u8] = &[];
        for row in blocks
            .range((out, upper)..(out + 1, upper))
            .map_err(backend)?
        {
            let (_, block) = row.map_err(backend)?;
            for e in block_entries(block.value()) {
                let (rid, _) = e?;
                m.filter.insert(rid_hash(rid));
                m.entries += 1;
                m.last.clear();
                m.last.extend_from_slice(rid);
            }
        }
        Ok(m)
    }
}

/// Every run, as the writer holds them: oldest first, and the merge under way. A
/// commit works on them and the store keeps them only once the commit is durable (a
/// failed commit makes the store read them again from the file).
#[derive(Debug, Clone, Default)]
pub struct Runs {
    list: Vec<Arc<Run>>,
    next_id: u64,
    merging: Option<Merging>,
    /// Runs merged by a merge spread over commits whose blocks are still to be
    /// deleted, oldest first (no longer runs: nothing reads them).
    garbage: Vec<u64>,
}

/// The dedupe index's tables in one write transaction.
pub(crate) struct Tables<'a, 't> {
    pub blocks: &'a mut redb::Table<'t, (u64, &'static [u8]), &'static [u8]>,
    pub runs: &'a mut redb::Table<'t, u64, &'static [u8]>,
    pub merge: &'a mut redb::Table<'t, u8, &'static [u8]>,
}

impl Runs {
    /// Reads every run's meta from `runs`, and the merge under way from `merge` and
    /// its output's blocks.
    pub(crate) fn load<R, M, B>(runs: &R, merge: &M, blocks: &B) -> Result<Runs, StoreError>
    where
        R: ReadableTable<u64, &'static [u8]>,
        M: ReadableTable<u8, &'static [u8]>,
        B: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
    {
        let mut list = Vec::new();
        for row in runs.iter().map_err(backend)? {
            let (k, v) = row.map_err(backend)?;
            list.push(Arc::new(Run::decode_meta(k.value(), v.value())?));
        }
        let merging = match merge.get(UNDER_WAY).map_err(backend)? {
            Some(v) => Some(Merging::load(v.value(), &list, blocks)?),
            None => None,
        };
        let garbage = match merge.get(GARBAGE).map_err(backend)? {
            Some(v) if v.value().len().is_multiple_of(8) => decode_ids(v.value()),
            Some(v) => {
                return Err(corrupt(format!(
                    "the list of merged runs has {} bytes",
                    v.value().len()
                )));
            }
            None => Vec::new(),
        };
        if let Some(g) = garbage.iter().find(|g| list.iter().any(|r| r.id == **g)) {
            return Err(corrupt(format!("run {g} is listed as merged")));
        }
        let next_id = list
            .last()
            .map(|r| r.id)
            .max(merging.as_ref().map(|m| m.out))
            .max(garbage.iter().copied().max())
            .map_or(0, |id| id + 1);
        Ok(Runs {
            list,
            next_id,
            merging,
            garbage,
        })
    }

    /// The runs, oldest first.
    pub fn runs(&self) -> &[Arc<Run>] {
        &self.list
    }

    /// Whether a merge spread over commits is under way.
    pub fn merge_under_way(&self) -> bool {
        self.merging.is_some()
    }

    /// What `/metrics` shows of the index.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            runs: self.list.len() as u64,
            filter_bytes: self
                .list
                .iter()
                .map(|r| r.filter.bytes() as u64)
                .sum::<u64>()
                + self.merging.as_ref().map_or(0, |m| m.filter.bytes() as u64),
            merge_ids_left: self.merging.as_ref().map_or(0, |m| {
                let total: u64 = self
                    .list
                    .iter()
                    .filter(|r| m.inputs.contains(&r.id))
                    .map(|r| r.entries)
                    .sum();
                total.saturating_sub(m.entries)
            }),
            merged_runs_to_delete: self.garbage.len() as u64,
        }
    }

    /// Where `rid` (whose [`rid_hash`] is `h`) is: the location from the newest run
    /// that holds it, `None` if no run does or the newest says it was removed.
    pub(crate) fn lookup<T>(
        &self,
        blocks: &T,
        rid: &[u8],
        h: u64,
    ) -> Result<Option<Vec<u8>>, StoreError>
    where
        T: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
    {
        for run in self.list.iter().rev() {
            if !run.filter.may_contain(h) {
                continue;
            }
            if let Some(loc) = lookup_in_run(blocks, run.id, rid)? {
                return Ok((!loc.is_empty()).then_some(loc));
            }
        }
        Ok(None)
    }

    /// Writes `entries` (strictly increasing request ids; an empty location removes
    /// the id) as a new run at `level`, then merges: the merge under way takes its
    /// step, and runs of a level merge once `params.fanout` of them fit
    /// `params.merge_entries_max` together (see the module docs). Returns how many ids
    /// the steps of merges spread over commits rewrote.
    pub(crate) fn add_run<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &mut self,
        t: &mut Tables<'_, '_>,
        count: u64,
        level: u8,
        entries: impl Iterator<Item = Result<(K, V), StoreError>>,
        params: &Params,
    ) -> Result<u64, StoreError> {
        if count == 0 {
            return Ok(0);
        }
        let mut w = RunWriter::new(self.next_id, count, params.block_bytes);
        self.next_id += 1;
        for e in entries {
            let (rid, loc) = e?;
            w.push(t.blocks, rid.as_ref(), loc.as_ref())?;
        }
        self.list.push(Arc::new(w.finish(t.blocks, t.runs, level)?));
        let budget = params
            .merge_step_entries
            .max(count.saturating_mul(STEP_PER_ID));
        self.compact(t, budget, params)
    }

    /// Merges while some level has `params.fanout` runs: the merge under way first
    /// takes its step, then, oldest level first, a level's runs merge with every run
    /// newer than them (fewer and smaller: levels never increase from older to newer
    /// runs), so a merge always takes a suffix of the runs newer than the one under
    /// way and its output sits where they were. Within this commit if it is small,
    /// else begun here and spread over the commits that follow.
    fn compact(
        &mut self,
        t: &mut Tables<'_, '_>,
        budget: u64,
        params: &Params,
    ) -> Result<u64, StoreError> {
        let mut stepped = 0;
        // Deleting an id's share of a block costs less than writing it: the same
        // budget keeps the deletions ahead of the merges that leave them.
        self.collect(t, budget)?;
        if self.merging.is_some() {
            stepped += self.step(t, budget, params)?;
        }
        let fanout = params.fanout.max(2);
        loop {
            let after = match &self.merging {
                Some(m) => {
                    let last = m.inputs[m.inputs.len() - 1];
                    1 + self
                        .list
                        .iter()
                        .position(|r| r.id == last)
                        .expect("the inputs of the merge under way are runs")
                }
                None => 0,
            };
            let below = self.merging.as_ref().map_or(LEVEL_FROZEN - 1, |m| m.level);
            let Some((from, level, total)) =
                merge_due(&self.list[after..], fanout, below, params.merge_entries_max)
            else {
                return Ok(stepped);
            };
            let from = after + from;
            if total <= params.merge_step_entries {
                let inputs = self.list.split_off(from);
                let merged = self.merge_whole(t, &inputs, total, level + 1, params)?;
                self.list.push(Arc::new(merged));
                continue;
            }
            if self.merging.is_some() {
                // One merge is spread over commits at a time.
                return Ok(stepped);
            }
            // Begin a merge spread over commits; this commit takes its first step.
            let m = Merging {
                out: self.next_id,
                level: level + 1,
                inputs: self.list[from..].iter().map(|r| r.id).collect(),
                entries: 0,
                last: Vec::new(),
                filter: Filter::for_entries(total),
            };
            self.next_id += 1;
            t.merge
                .insert(UNDER_WAY, m.encode().as_slice())
                .map_err(backend)?;
            self.merging = Some(m);
            stepped += self.step(t, budget.saturating_sub(stepped), params)?;
            if self.merging.is_some() {
                return Ok(stepped);
            }
        }
    }

    /// Deletes the blocks of merged runs, oldest first, until it has deleted those of
    /// `ids` ids (or of every merged run).
    fn collect(&mut self, t: &mut Tables<'_, '_>, ids: u64) -> Result<(), StoreError> {
        let mut left = ids;
        while let Some(&run) = self.garbage.first() {
            let upper: &[u8] = &[];
            let mut keys = Vec::new();
            let mut finished = true;
            for row in t
                .blocks
                .range((run, upper)..(run + 1, upper))
                .map_err(backend)?
            {
                if left == 0 {
                    finished = false;
                    break;
                }
                let (k, v) = row.map_err(backend)?;
                left = left.saturating_sub(block_entries(v.value()).count() as u64);
                keys.push(k.value().1.to_vec());
            }
            for k in &keys {
                t.blocks.remove((run, k.as_slice())).map_err(backend)?;
            }
            if !finished {
                return Ok(());
            }
            self.garbage.remove(0);
            if self.garbage.is_empty() {
                t.merge.remove(GARBAGE).map_err(backend)?;
            } else {
                t.merge
                    .insert(GARBAGE, encode_ids(&self.garbage).as_slice())
                    .map_err(backend)?;
            }
        }
        Ok(())
    }

    /// Rewrites up to `budget` more ids of the merge under way into its output; once
    /// its inputs are exhausted, publishes the output in their place. Returns how many
    /// ids it wrote.
    fn step(
        &mut self,
        t: &mut Tables<'_, '_>,
        budget: u64,
        params: &Params,
    ) -> Result<u64, StoreError> {
        let mut m = self.merging.take().expect("a merge under way");
        let past = (m.entries > 0).then_some(m.last.as_slice());
        let mut readers = m
            .inputs
            .iter()
            .map(|&run| RunReader::past(run, past, t.blocks))
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = RunWriter::resume(&mut m, params.block_bytes);
        let done = merge_some(t.blocks, &mut readers, &mut out, budget.max(1))?;
        let written = out.entries - m.entries;
        if !done {
            out.suspend(t.blocks, &mut m)?;
            self.merging = Some(m);
            return Ok(written);
        }
        let (level, inputs) = (m.level, m.inputs);
        let merged = out.finish(t.blocks, t.runs, level)?;
        // The inputs stop being runs now; their blocks go over the next commits
        // (deleting a million ids' blocks at once took ~0.35 s).
        for &id in &inputs {
            t.runs.remove(id).map_err(backend)?;
        }
        self.garbage.extend_from_slice(&inputs);
        t.merge
            .insert(GARBAGE, encode_ids(&self.garbage).as_slice())
            .map_err(backend)?;
        t.merge.remove(UNDER_WAY).map_err(backend)?;
        let first = self
            .list
            .iter()
            .position(|r| r.id == inputs[0])
            .expect("the inputs of the merge under way are runs");
        self.list
            .splice(first..first + inputs.len(), [Arc::new(merged)]);
        Ok(written)
    }

    /// Merges `inputs` (oldest first) into one new run within this commit; for an id
    /// in several, the newest input's entry wins. Deletes the inputs' blocks and metas.
    fn merge_whole(
        &mut self,
        t: &mut Tables<'_, '_>,
        inputs: &[Arc<Run>],
        capacity: u64,
        level: u8,
        params: &Params,
    ) -> Result<Run, StoreError> {
        let mut out = RunWriter::new(self.next_id, capacity, params.block_bytes);
        self.next_id += 1;
        let mut readers = inputs
            .iter()
            .map(|r| RunReader::past(r.id, None, t.blocks))
            .collect::<Result<Vec<_>, _>>()?;
        merge_some(t.blocks, &mut readers, &mut out, u64::MAX)?;
        for r in &readers {
            for last in &r.read {
                t.blocks.remove((r.run, last.as_slice())).map_err(backend)?;
            }
        }
        for r in inputs {
            t.runs.remove(r.id).map_err(backend)?;
        }
        out.finish(t.blocks, t.runs, level)
    }
}

fn encode_ids(ids: &[u64]) -> Vec<u8> {
    ids.iter().flat_map(|i| i.to_le_bytes()).collect()
}

fn decode_ids(v: &[u8]) -> Vec<u64> {
    v.chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect()
}

/// The oldest level among `runs` (oldest first, levels never increasing) with
/// `fanout` runs whose merge with every run newer than them fits `max` ids and makes a
/// run below level `below`: where that suffix starts, the level, its ids.
fn merge_due(runs: &[Arc<Run>], fanout: usize, below: u8, max: u64) -> Option<(usize, u8, u64)> {
    let mut from = 0;
    while from < runs.len() {
        let level = runs[from].level;
        let same = runs[from..].iter().take_while(|r| r.level == level).count();
        if same >= fanout && level < below && level < LEVEL_FROZEN - 1 {
            let total: u64 = runs[from..].iter().map(|r| r.entries).sum();
            if total <= max {
                return Some((from, level, total));
            }
        }
        from += same;
    }
    None
}

/// Moves up to `limit` entries from `readers` (oldest input first) into `out`,
/// smallest id first; for an id in several inputs the newest one's entry, once. True
/// once every input is exhausted.
fn merge_some(
    blocks: &mut redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
    readers: &mut [RunReader],
    out: &mut RunWriter,
    limit: u64,
) -> Result<bool, StoreError> {
    let mut key: Vec<u8> = Vec::new();
    let mut written = 0u64;
    while written < limit {
        // The smallest id among the heads; on a tie the newest input (last) wins.
        let mut pick: Option<(usize, &[u8])> = None;
        for (i, r) in readers.iter().enumerate() {
            if let Some((rid, _)) = r.head() {
                match pick {
                    Some((_, best)) if best < rid => {}
                    _ => pick = Some((i, rid)),
                }
            }
        }
        let Some((p, _)) = pick else { break };
        let (rid, loc) = readers[p].head().expect("picked head");
        out.push(blocks, rid, loc)?;
        written += 1;
        key.clear();
        key.extend_from_slice(rid);
        for r in readers.iter_mut() {
            if r.head().is_some_and(|(rid, _)| rid == key.as_slice()) {
                r.advance(blocks)?;
            }
        }
    }
    Ok(readers.iter().all(|r| r.head().is_none()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use redb::{Database, ReadableDatabase};
    use std::collections::BTreeMap;

    #[test]
    fn a_filter_never_forgets_and_rarely_lies() {
        let mut f = Filter::for_entries(10_000);
        for i in 0..10_000u64 {
            f.insert(rid_hash(format!("req-{i}").as_bytes()));
        }
        for i in 0..10_000u64 {
            assert!(f.may_contain(rid_hash(format!("req-{i}").as_bytes())));
        }
        let false_hits = (0..100_000u64)
            .filter(|i| f.may_contain(rid_hash(format!("other-{i}").as_bytes())))
            .count();
        // 10 bits per id, 6 probes in one 512-bit block: ~1-2 %.
        assert!(false_hits < 3_000, "{false_hits} false hits in 100,000");
        assert_eq!(f.bytes(), 10_000 * 10 / 512 * 64 + 64);
    }

    #[test]
    fn the_hash_is_stable() {
        // Filters are stored: this value must never change.
        assert_eq!(rid_hash(b""), rid_hash(b""));
        assert_ne!(rid_hash(b"a"), rid_hash(b"a\0"));
        assert_eq!(rid_hash(b"0123456789abcdef-request"), 0xcd8e_ddc0_8113_e2c2);
    }

    #[test]
    fn a_damaged_block_or_meta_is_an_error_not_a_panic() {
        let mut block = Vec::new();
        block.extend_from_slice(&3u16.to_le_bytes());
        block.extend_from_slice(&2u16.to_le_bytes());
        block.extend_from_slice(b"abcxy");
        assert_eq!(block_find(&block, b"abc").expect("find"), Some(&b"xy"[..]));
        for cut in 1..block.len() {
            assert!(block_find(&block[..cut], b"abc").is_err(), "cut at {cut}");
        }
        assert!(Run::decode_meta(1, &[1, 0, 0]).is_err());
        assert!(Run::decode_meta(1, &[9; 74]).is_err());
    }

    #[test]
    fn a_damaged_merge_record_is_an_error_not_a_guess() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Database::create(dir.path().join("i.redb")).expect("db");
        let w = db.begin_write().expect("write");
        {
            let mut blocks = w.open_table(BLOCKS).expect("blocks");
            let mut runs = w.open_table(RUNS).expect("runs");
            let mut merge = w.open_table(MERGE).expect("merge");
            let mut state = Runs::default();
            for c in 0..3u8 {
                let mut t = Tables {
                    blocks: &mut blocks,
                    runs: &mut runs,
                    merge: &mut merge,
                };
                let ids = [[c, 1], [c, 2]];
                let entries = ids.iter().map(|k| Ok((&k[..], &b"loc"[..])));
                state
                    .add_run(&mut t, 2, 0, entries, &Params::default())
                    .expect("add");
            }
            assert!(Runs::load(&runs, &merge, &blocks).is_ok());
            let mut record = |key: u8, v: &[u8]| {
                merge.insert(key, v).expect("insert");
                let e = Runs::load(&runs, &merge, &blocks).expect_err("refused");
                merge.remove(key).expect("remove");
                e.to_string()
            };
            let merging = |level: u8, out: u64, inputs: &[u64]| {
                let mut v = vec![MERGE_VERSION, level];
                v.extend_from_slice(&out.to_le_bytes());
                v.extend_from_slice(&encode_ids(inputs));
                v
            };
            for (v, why) in [
                (vec![MERGE_VERSION, 1, 0], "does not parse"),
                (merging(1, 9, &[]), "names no run"),
                (merging(1, 9, &[7]), "names no run"),
                (merging(1, 9, &[0, 2]), "not consecutive"),
                (merging(1, 2, &[0, 1]), "already a run"),
                (merging(1, 1, &[0]), "already a run"),
            ] {
                let e = record(UNDER_WAY, &v);
                assert!(e.contains("corrupt id index") && e.contains(why), "{e}");
            }
            assert!(record(GARBAGE, &[1, 2, 3]).contains("merged runs has 3 bytes"));
            let e = record(GARBAGE, &encode_ids(&[1]));
            assert!(e.contains("run 1 is listed as merged"), "{e}");
        }
        w.commit().expect("commit");
    }

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    /// Applies `commits` (each a set of id -> location; empty removes) through runs in
    /// a real redb file, checking every id after every commit against a model, and the
    /// state read back from the file against the writer's; every second commit goes on
    /// from the state read back (a restart, mid-merge or not). Returns the final state
    /// and, per commit, the ids the merge under way rewrote in it.
    fn check(commits: &[Model], params: Params) -> (Runs, Vec<u64>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Database::create(dir.path().join("i.redb")).expect("db");
        let mut state = Runs::default();
        let mut model = Model::new();
        let mut stepped = Vec::new();
        for (i, c) in commits.iter().enumerate() {
            let w = db.begin_write().expect("write");
            {
                let mut blocks = w.open_table(BLOCKS).expect("blocks");
                let mut runs = w.open_table(RUNS).expect("runs");
                let mut merge = w.open_table(MERGE).expect("merge");
                let mut t = Tables {
                    blocks: &mut blocks,
                    runs: &mut runs,
                    merge: &mut merge,
                };
                stepped.push(
                    state
                        .add_run(
                            &mut t,
                            c.len() as u64,
                            0,
                            c.iter().map(|(k, v)| Ok((k.as_slice(), v.as_slice()))),
                            &params,
                        )
                        .expect("add"),
                );
            }
            w.commit().expect("commit");
            for (k, v) in c {
                if v.is_empty() {
                    model.remove(k);
                } else {
                    model.insert(k.clone(), v.clone());
                }
            }
            let r = db.begin_read().expect("read");
            let blocks = r.open_table(BLOCKS).expect("blocks");
            let runs = r.open_table(RUNS).expect("runs");
            let merge = r.open_table(MERGE).expect("merge");
            let reloaded = Runs::load(&runs, &merge, &blocks).expect("load");
            assert_eq!(
                reloaded
                    .list
                    .iter()
                    .map(|r| (**r).clone())
                    .collect::<Vec<_>>(),
                state.list.iter().map(|r| (**r).clone()).collect::<Vec<_>>(),
                "the stored metas are the writer's"
            );
            assert_eq!(reloaded.merging, state.merging, "the merge under way");
            assert_eq!(reloaded.next_id, state.next_id);
            let mut probe: Vec<&Vec<u8>> = model.keys().collect();
            let absent: Vec<Vec<u8>> = commits.iter().flat_map(|c| c.keys().cloned()).collect();
            probe.extend(absent.iter());
            for k in probe {
                let want = model.get(k).cloned();
                assert_eq!(state.lookup(&blocks, k, rid_hash(k)).expect("lookup"), want);
                assert_eq!(lookup_snapshot(&runs, &blocks, k).expect("snapshot"), want);
            }
            // Ids grow and levels never do, from older to newer runs (the inputs of
            // the merge under way count as the run they will be).
            let shape: Vec<(u64, u8)> = state
                .list
                .iter()
                .filter_map(|r| match &state.merging {
                    Some(m) if m.inputs.contains(&r.id) => {
                        (r.id == m.inputs[0]).then_some((m.out, m.level))
                    }
                    _ => Some((r.id, r.level)),
                })
                .collect();
            for w in shape.windows(2) {
                assert!(
                    w[0].0 < w[1].0 && w[0].1 >= w[1].1,
                    "{:?} {:?}",
                    state.list,
                    state.merging.as_ref().map(|m| (m.out, m.level, &m.inputs))
                );
            }
            // Every block belongs to a run or to the merge's output: nothing leaks.
            assert_eq!(reloaded.garbage, state.garbage, "the merged runs to delete");
            let mut owners: Vec<u64> = state.list.iter().map(|r| r.id).collect();
            owners.extend(&state.garbage);
            if let Some(m) = &state.merging {
                owners.push(m.out);
                assert!(
                    state
                        .list
                        .iter()
                        .all(|r| (r.id < m.out) == (r.id <= m.inputs[m.inputs.len() - 1]))
                );
                assert!(
                    m.level > 0
                        && state
                            .list
                            .iter()
                            .filter(|r| r.id > m.out)
                            .all(|r| r.level <= m.level)
                );
            }
            for row in blocks.iter().expect("blocks") {
                let run = row.expect("block").0.value().0;
                assert!(owners.contains(&run), "a block of run {run}, not a run");
            }
            if i % 2 == 1 {
                state = reloaded;
            }
        }
        (state, stepped)
    }

    fn spread_ids(commits: u32, per: u32) -> Vec<Model> {
        (0..commits)
            .map(|c| {
                (0..per)
                    .map(|i| {
                        let k = format!("{:08x}", (c * per + i).wrapping_mul(2_654_435_761));
                        (k.into_bytes(), format!("loc{c}").into_bytes())
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn commits_merge_into_levels_and_every_id_stays_found() {
        let params = Params {
            block_bytes: 64,
            fanout: 3,
            merge_entries_max: 1_000,
            merge_step_entries: u64::MAX,
        };
        let (state, stepped) = check(&spread_ids(40, 20), params);
        // 800 ids: merges up to 1,000 ids per run happened, larger ones did not.
        assert!(state.list.iter().any(|r| r.level >= 2), "{:?}", state.list);
        assert!(state.list.len() < 12, "{} runs", state.list.len());
        assert!(
            stepped.iter().all(|&n| n == 0),
            "every merge within its commit"
        );
    }

    #[test]
    fn a_large_merge_is_spread_over_the_commits_after_it_and_each_takes_a_bounded_step() {
        let params = Params {
            block_bytes: 64,
            fanout: 3,
            merge_entries_max: 1_000,
            merge_step_entries: 50,
        };
        let per = 10u64;
        let (state, stepped) = check(&spread_ids(90, per as u32), params);
        assert!(state.list.iter().any(|r| r.level >= 3), "{:?}", state.list);
        // Merges of 90 and 270 ids went over commits, none rewrote more than its step.
        let budget = params.merge_step_entries.max(per * STEP_PER_ID);
        assert!(stepped.iter().all(|&n| n <= budget), "{stepped:?}");
        assert!(
            stepped.iter().filter(|&&n| n > 0).count() >= 8,
            "{stepped:?}"
        );
        let st = state.stats();
        assert_eq!(st.runs, state.list.len() as u64);
        assert_eq!(st.merged_runs_to_delete, state.garbage.len() as u64);
        assert!(st.filter_bytes >= 64 * st.runs, "{st:?}");
        // The blocks merges leave are deleted as fast as they come: what is left is
        // the last merge's inputs (its group of three and the runs newer than them).
        assert!(state.garbage.len() <= 5, "{:?}", state.garbage);
        assert!(state.list.len() < 12, "{} runs", state.list.len());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Any sequence of commits that add, re-add and remove ids: the newest entry
        /// of every id is what a lookup finds, through any merges.
        #[test]
        fn lookups_always_see_the_newest_entry(
            commits in proptest::collection::vec(
                proptest::collection::btree_map(
                    proptest::collection::vec(0u8..6, 1..4),
                    proptest::collection::vec(0u8..3, 0..3),
                    0..8,
                ),
                1..25,
            ),
            fanout in 2usize..5,
            block_bytes in 1usize..40,
            merge_entries_max in 1u64..60,
            merge_step_entries in 1u64..30,
        ) {
            check(&commits, Params { block_bytes, fanout, merge_entries_max, merge_step_entries });
        }
    }
}
