//! The dedupe index of the redb backend: request id -> where its event is, kept as
//! immutable **sorted runs** (a small log-structured merge tree inside the same redb
//! file) instead of one B-tree.
//!
//! Why: a B-tree keyed by request id copies one 4 KiB leaf per inserted id once the
//! tree is larger than a commit, when ids are random (UUIDv4): ~20 µs of the writer's
//! time per event (docs/BENCHMARKS.md, "Random request ids"). Here a commit writes the
//! ids it added as one new run, sorted, packed into blocks of about [`BLOCK_BYTES`]:
//! ~60 bytes written per id, whatever their order. Runs are merged in the commit that
//! makes [`Params::fanout`] of them at one level (tiered: each id is rewritten about
//! once per level, `log_fanout(N / batch)` times), until a merge would exceed
//! [`Params::merge_entries_max`]; runs that large are left as they are.
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
//! - [`BLOCKS`]: (run, last request id of the block) -> block: entries
//!   `rid_len u16 LE, loc_len u16 LE, rid, loc` in request-id order;
//! - [`RUNS`]: run -> meta: `version u8 (1), level u8, entries u64 LE, filter words
//!   (u64 LE)`.
//!
//! Runs are numbered in creation order, and a merge always takes every run of the
//! lowest levels at once (the newest runs), so a larger run number is always newer
//! data; levels never increase from older to newer runs.

use std::ops::{Bound, Range};
use std::sync::Arc;

use redb::{ReadableTable, TableDefinition};

use crate::store::StoreError;

/// (run, last request id in the block) -> block.
pub(crate) const BLOCKS: TableDefinition<(u64, &[u8]), &[u8]> = TableDefinition::new("id_blocks");
/// run -> meta (level, entries, filter).
pub(crate) const RUNS: TableDefinition<u64, &[u8]> = TableDefinition::new("id_runs");

/// A block is closed before it would pass this many bytes: with its key it fits one
/// 4 KiB redb leaf page.
pub const BLOCK_BYTES: usize = 3_800;

/// The level of a run converted from an earlier file's B-tree index: never merged.
pub const LEVEL_FROZEN: u8 = u8::MAX;

const META_VERSION: u8 = 1;
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
}

impl Default for Params {
    fn default() -> Params {
        Params {
            block_bytes: BLOCK_BYTES,
            fanout: 4,
            merge_entries_max: 1 << 20,
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

/// Every run, as the writer holds them: oldest first. Cheap to clone (runs are
/// shared); a commit works on a clone and the store keeps it only once the commit is
/// durable.
#[derive(Debug, Clone, Default)]
pub struct Runs {
    list: Vec<Arc<Run>>,
    next_id: u64,
}

impl Runs {
    /// Reads every run's meta from `runs`.
    pub(crate) fn load<R>(runs: &R) -> Result<Runs, StoreError>
    where
        R: ReadableTable<u64, &'static [u8]>,
    {
        let mut list = Vec::new();
        for row in runs.iter().map_err(backend)? {
            let (k, v) = row.map_err(backend)?;
            list.push(Arc::new(Run::decode_meta(k.value(), v.value())?));
        }
        let next_id = list.last().map_or(0, |r| r.id + 1);
        Ok(Runs { list, next_id })
    }

    /// The runs, oldest first.
    pub fn runs(&self) -> &[Arc<Run>] {
        &self.list
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
    /// the id) as a new run at `level`, then merges while some level holds
    /// `params.fanout` runs that fit `params.merge_entries_max` together.
    pub(crate) fn add_run<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &mut self,
        blocks: &mut redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
        runs: &mut redb::Table<'_, u64, &'static [u8]>,
        count: u64,
        level: u8,
        entries: impl Iterator<Item = Result<(K, V), StoreError>>,
        params: &Params,
    ) -> Result<(), StoreError> {
        if count == 0 {
            return Ok(());
        }
        let mut w = RunWriter::new(self.next_id, count, params.block_bytes);
        self.next_id += 1;
        for e in entries {
            let (rid, loc) = e?;
            w.push(blocks, rid.as_ref(), loc.as_ref())?;
        }
        self.list.push(Arc::new(w.finish(blocks, runs, level)?));
        self.compact(blocks, runs, params)
    }

    fn compact(
        &mut self,
        blocks: &mut redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
        runs: &mut redb::Table<'_, u64, &'static [u8]>,
        params: &Params,
    ) -> Result<(), StoreError> {
        let fanout = params.fanout.max(2);
        loop {
            // The newest runs share the lowest level (levels never increase from
            // older to newer): merge them when there are enough and they fit.
            let Some(newest) = self.list.last() else {
                return Ok(());
            };
            let level = newest.level;
            if level >= LEVEL_FROZEN - 1 {
                return Ok(());
            }
            let same = self
                .list
                .iter()
                .rev()
                .take_while(|r| r.level == level)
                .count();
            let total: u64 = self.list[self.list.len() - same..]
                .iter()
                .map(|r| r.entries)
                .sum();
            if same < fanout || total > params.merge_entries_max {
                return Ok(());
            }
            let inputs = self.list.split_off(self.list.len() - same);
            let merged = self.merge(blocks, runs, &inputs, total, level + 1, params)?;
            self.list.push(Arc::new(merged));
        }
    }

    /// Merges `inputs` (oldest first) into one new run; for an id in several, the
    /// newest input's entry wins. Deletes the inputs' blocks and metas.
    fn merge(
        &mut self,
        blocks: &mut redb::Table<'_, (u64, &'static [u8]), &'static [u8]>,
        runs: &mut redb::Table<'_, u64, &'static [u8]>,
        inputs: &[Arc<Run>],
        capacity: u64,
        level: u8,
        params: &Params,
    ) -> Result<Run, StoreError> {
        let mut out = RunWriter::new(self.next_id, capacity, params.block_bytes);
        self.next_id += 1;
        let mut readers: Vec<RunReader> = inputs.iter().map(|r| RunReader::new(r.id)).collect();
        for r in &mut readers {
            r.advance(blocks)?;
        }
        let mut key: Vec<u8> = Vec::new();
        loop {
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
            key.clear();
            key.extend_from_slice(rid);
            for r in &mut readers {
                if r.head().is_some_and(|(rid, _)| rid == key.as_slice()) {
                    r.advance(blocks)?;
                }
            }
        }
        for r in &readers {
            for last in &r.read {
                blocks.remove((r.run, last.as_slice())).map_err(backend)?;
            }
        }
        for r in inputs {
            runs.remove(r.id).map_err(backend)?;
        }
        out.finish(blocks, runs, level)
    }
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

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    /// Applies `commits` (each a set of id -> location; empty removes) through runs in
    /// a real redb file, checking every id after every commit against a model.
    fn check(commits: &[Model], params: Params) -> Runs {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Database::create(dir.path().join("i.redb")).expect("db");
        let mut state = Runs::default();
        let mut model = Model::new();
        for c in commits {
            let w = db.begin_write().expect("write");
            {
                let mut blocks = w.open_table(BLOCKS).expect("blocks");
                let mut runs = w.open_table(RUNS).expect("runs");
                state
                    .add_run(
                        &mut blocks,
                        &mut runs,
                        c.len() as u64,
                        0,
                        c.iter().map(|(k, v)| Ok((k.as_slice(), v.as_slice()))),
                        &params,
                    )
                    .expect("add");
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
            let reloaded = Runs::load(&runs).expect("load");
            assert_eq!(
                reloaded
                    .list
                    .iter()
                    .map(|r| (**r).clone())
                    .collect::<Vec<_>>(),
                state.list.iter().map(|r| (**r).clone()).collect::<Vec<_>>(),
                "the stored metas are the writer's"
            );
            let mut probe: Vec<&Vec<u8>> = model.keys().collect();
            let absent: Vec<Vec<u8>> = commits.iter().flat_map(|c| c.keys().cloned()).collect();
            probe.extend(absent.iter());
            for k in probe {
                let want = model.get(k).cloned();
                assert_eq!(state.lookup(&blocks, k, rid_hash(k)).expect("lookup"), want);
                assert_eq!(lookup_snapshot(&runs, &blocks, k).expect("snapshot"), want);
            }
            for w in state.list.windows(2) {
                assert!(
                    w[0].id < w[1].id && w[0].level >= w[1].level,
                    "{:?}",
                    state.list
                );
            }
        }
        state
    }

    #[test]
    fn commits_merge_into_levels_and_every_id_stays_found() {
        let params = Params {
            block_bytes: 64,
            fanout: 3,
            merge_entries_max: 1_000,
        };
        let commits: Vec<Model> = (0..40u32)
            .map(|c| {
                (0..20u32)
                    .map(|i| {
                        let k = format!("{:08x}", (c * 20 + i).wrapping_mul(2_654_435_761));
                        (k.into_bytes(), format!("loc{c}").into_bytes())
                    })
                    .collect()
            })
            .collect();
        let state = check(&commits, params);
        // 800 ids: merges up to 1,000 ids per run happened, larger ones did not.
        assert!(state.list.iter().any(|r| r.level >= 2), "{:?}", state.list);
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
        ) {
            check(&commits, Params { block_bytes, fanout, merge_entries_max });
        }
    }
}
