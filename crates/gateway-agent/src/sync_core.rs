//! The allocator sync client's bookkeeping, without I/O: what the agent knows of each
//! engine key between reports (cumulative counters across slot replacements, the held
//! grant, what the current stream has already been told, the allocator's key handle),
//! which keys a report names and how, grants applied and the acknowledgements they
//! owe (a concurrency shrink only once in-flight work fits).
//!
//! Two drivers share it, through the session that decides what the client does at
//! each of its moments ([`crate::sync_session`]), so the simulator runs the client's
//! logic rather than a copy: the tonic client (`shell::sync`) and `bursar-sim`. Each
//! names keys its own
//! way (`K`): the client by rule and values, the simulator by key number. Keys are
//! kept in order, so reports list them in an order that depends on nothing else (the
//! simulator replays bit for bit).

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::config::RuleLimit;
use crate::engine::{KeyDemand, KeyTotals};
use crate::{Engine, SliceError, SliceUpdate};

/// Longest measurement window an agent honours; the allocator asks for no longer
/// (`AllocatorConfig::measure_window_ms` is bounded by it).
pub const MAX_MEASURE_WINDOW_MS: u32 = 10_000;

/// How long a key may go unnamed before its next line counts from the last time it
/// was named (see [`SyncTracks::set_rebase_after`]) until the allocator's lease is
/// known: half the allocator's default lease (10 s).
pub const DEFAULT_REBASE_AFTER_NS: u64 = 5_000_000_000;

/// A key as the agent's sync client tracks it (its `K`): ordered and compared by the
/// engine's 128-bit identity of the key (two integers, where names were compared
/// string by string in every search of the tracks), and named by the rule's name and
/// the key's values, shared with the engine's key (reference counts): reading every
/// key at a report copies no string. It built a `String` and a `Vec<String>` per key
/// per read; `benches/control.rs` keeps that as its baseline.
#[derive(Clone, Debug)]
pub struct TrackedKey {
    identity: (u64, u64),
    rule: Arc<str>,
    values: Arc<[Box<str>]>,
}

impl TrackedKey {
    /// The key of one engine key's demand.
    pub fn of(d: &KeyDemand) -> TrackedKey {
        TrackedKey {
            identity: d.identity(),
            rule: Arc::clone(&d.rule),
            values: d.shared_values(),
        }
    }

    /// A key named on the wire (a grant). A rule `engine` does not have gets identity
    /// (0, 0), which names none of its keys (the engine refuses such a grant).
    pub fn named(engine: &Engine, rule: &str, values: &[String]) -> TrackedKey {
        let vals: Vec<&str> = values.iter().map(String::as_str).collect();
        TrackedKey {
            identity: engine.key_identity(rule, &vals).unwrap_or((0, 0)),
            rule: Arc::from(rule),
            values: values
                .iter()
                .map(|v| Box::<str>::from(v.as_str()))
                .collect(),
        }
    }

    /// The rule's name.
    pub fn rule(&self) -> &str {
        &self.rule
    }

    /// The rule's `*` values, in match-key order.
    pub fn values(&self) -> &[Box<str>] {
        &self.values
    }
}

impl PartialEq for TrackedKey {
    fn eq(&self, other: &TrackedKey) -> bool {
        self.identity == other.identity
    }
}

impl Eq for TrackedKey {}

impl PartialOrd for TrackedKey {
    fn partial_cmp(&self, other: &TrackedKey) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TrackedKey {
    fn cmp(&self, other: &TrackedKey) -> Ordering {
        self.identity.cmp(&other.identity)
    }
}

/// A grant as held by the engine and reported back to the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// The grant's term.
    pub epoch: u64,
    /// Its sequence number.
    pub seq: u64,
    /// Rate in force (its posture's once the lease ended).
    pub rate: u64,
    /// Burst (slots for concurrency rules) in force.
    pub burst: u64,
}

/// One key's line in a report (see [`SyncTracks::report`]).
#[derive(Clone, Copy, Debug)]
pub struct Line<'a, K> {
    /// The key.
    pub key: &'a K,
    /// Non-zero: name the key by this handle, not by name.
    pub key_handle: u64,
    /// Cost admitted since `counting_since_ns`, cumulative.
    pub admitted: u64,
    /// Cost rejected since `counting_since_ns`, cumulative.
    pub rejected: u64,
    /// Engine time the counters started from.
    pub counting_since_ns: u64,
    /// Slots in flight (concurrency rules).
    pub in_flight: u64,
    /// The grant applied, if any.
    pub held: Option<Held>,
}

/// An acknowledgement owed to the allocator for an applied grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack<K> {
    /// The key.
    pub key: K,
    /// The grant's term.
    pub epoch: u64,
    /// Its sequence number.
    pub seq: u64,
    /// Tokens the slice change gave up.
    pub released_tokens: u64,
    /// Slots in flight when it was applied (or drained).
    pub in_flight: u64,
    /// The key's handle from the grant (0: none): the ack may name the key by it.
    pub key_handle: u64,
}

/// What became of one grant given to [`SyncTracks::apply`].
#[derive(Debug)]
pub enum Applied<K> {
    /// Applied; acknowledge now.
    Ack(Ack<K>),
    /// Applied, and neither its rate nor its burst is below the slice it replaced (a
    /// grant that grew, a renewal, a key's first): nothing waits on it, so no ack
    /// message; the key's next report line names it as held, which tells the allocator
    /// the same (at fleet scale acks were half the messages to the allocator, and each
    /// one recomputed its key).
    Held,
    /// A concurrency shrink applied while more work is in flight than it allows:
    /// acknowledged by [`SyncTracks::drained_acks`] once that work fits.
    Draining,
    /// Refused by the engine (stale, unknown rule, lease already ended, ...).
    Refused(SliceError),
}

struct Track {
    /// Cumulative since the key was first read, across slot replacements.
    totals: KeyTotals,
    /// Counted out of `totals` (admitted, rejected) by rebases: lines carry
    /// `totals - base`, counted since `since_ns`.
    base: (u64, u64),
    since_ns: u64,
    in_flight: u64,
    held: Option<Held>,
    /// Last values sent on the current stream (`None`: not yet on this stream).
    sent: Option<(u64, u64, u64, Option<Held>)>,
    /// Refresh generation that last saw the key.
    seen: u64,
    /// The allocator's handle for the key, from a grant on the current stream (0:
    /// none): delta reports name the key by it instead of by name.
    handle: u64,
    /// In [`SyncTracks`]'s dirty list: the line may differ from what was sent.
    dirty: bool,
    /// The slice (rate, burst) in force as last seen: read by a refresh, or applied.
    /// Not `held`, which only a walk updates: of two grants applied between walks, the
    /// second must be compared with the first ([`Applied::Held`]).
    slice: Option<(u64, u64)>,
    /// When the current stream was last sent a line for the key (the read time of
    /// that report, in the counters' clock).
    named_at: u64,
    /// Sent a changed line since the last full report: the next full report names it
    /// even unchanged (the allocator's one sample of it having gone quiet).
    active: bool,
}

impl Track {
    /// What a report line would carry now, to compare with `sent`.
    fn line_values(&self) -> (u64, u64, u64, Option<Held>) {
        (
            self.totals.admitted() - self.base.0,
            self.totals.rejected() - self.base.1,
            self.in_flight,
            self.held,
        )
    }

    /// Whether a delta report would name the key.
    fn unsent(&self) -> bool {
        self.sent != Some(self.line_values())
    }

    /// Whether the allocator's `handles` ([`sorted_handles`]) name this key.
    fn named_by(&self, handles: &[u64]) -> bool {
        self.handle != 0 && handles.binary_search(&self.handle).is_ok()
    }

    /// Counts from the last line sent from now on (see
    /// [`SyncTracks::set_rebase_after`]), and names the key by name: the allocator may
    /// hold no entry for it, and so no base and no handle.
    fn rebase(&mut self) {
        if let Some(s) = self.sent {
            self.base.0 += s.0;
            self.base.1 += s.1;
            self.since_ns = self.named_at;
            self.sent = Some((0, 0, s.2, s.3));
        }
        self.handle = 0;
    }
}

/// Handles the allocator named (a measure request, an unknown-keys notice), sorted for
/// [`Track::named_by`].
fn sorted_handles(handles: &[u64]) -> Vec<u64> {
    let mut h = handles.to_vec();
    h.sort_unstable();
    h.dedup();
    h
}

/// Which report a line is for ([`SyncTracks::line`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Named {
    /// A delta report (with `only_new`, only keys the stream has not heard of).
    Delta { only_new: bool },
    /// A full report.
    Full,
}

struct PendingAck<K> {
    key: K,
    key_handle: u64,
    epoch: u64,
    seq: u64,
    slots: u64,
    released: u64,
}

/// The sync client's per-key state (see the module docs).
pub struct SyncTracks<K> {
    tracks: BTreeMap<K, Track>,
    last_poll_ns: u64,
    generation: u64,
    /// The engine's key-creation cursor ([`Engine::new_key_demand`]) as of the last read.
    created_cursor: u64,
    reports: u64,
    pending_acks: Vec<PendingAck<K>>,
    /// The open requested measurement: its keys (by handle) and when it ends.
    measuring: (Vec<u64>, u64),
    /// The engine's eviction cursor ([`Engine::changed_key_demand`]).
    gone_cursor: u64,
    /// Scratch for the evicted keys of one walk.
    gone: Vec<KeyDemand>,
    /// See [`SyncTracks::set_rebase_after`].
    rebase_after_ns: u64,
    /// Keys whose line may differ from what the stream was last sent (each with its
    /// track's `dirty` flag set; may repeat, or name keys since dropped): a delta
    /// report reads these, not every track.
    dirty: Vec<K>,
    /// The key each handle a grant gave on this stream names: how a grant that names
    /// no key is applied ([`SyncTracks::key_of_handle`]). Checked against the track on
    /// every lookup (a key dropped or rebased since leaves a stale entry, never a wrong
    /// answer), cleared with the stream, rebuilt when stale entries outgrow the tracks.
    by_handle: HashMap<u64, K>,
}

impl<K: Ord + Clone> SyncTracks<K> {
    /// Nothing tracked yet; counters of keys met from here on count from `now`.
    pub fn new(now: u64) -> SyncTracks<K> {
        SyncTracks {
            tracks: BTreeMap::new(),
            last_poll_ns: now,
            generation: 0,
            created_cursor: 0,
            reports: 0,
            pending_acks: Vec::new(),
            measuring: (Vec::new(), 0),
            gone_cursor: 0,
            gone: Vec::new(),
            rebase_after_ns: DEFAULT_REBASE_AFTER_NS,
            dirty: Vec::new(),
            by_handle: HashMap::new(),
        }
    }

    /// The key a grant's handle names on this stream, if this client holds a track with
    /// that handle: a grant without a name (the allocator names a key once per stream
    /// to clients whose hello says they find keys by handle) is applied to it. `None`:
    /// the key was dropped (evicted) or rebased since, and the grant cannot be applied
    /// (the client's next line for the key names it by name, and the allocator names
    /// it in the grant after).
    pub fn key_of_handle(&self, handle: u64) -> Option<&K> {
        let k = self.by_handle.get(&handle)?;
        (handle != 0 && self.tracks.get(k).is_some_and(|t| t.handle == handle)).then_some(k)
    }

    /// A key not named for `ns` (in the counters' clock) is counted, in its next line,
    /// from the last time it was named instead of from when it was first read, and named
    /// by name: the allocator forgets an entry that had no sample for a lease (and a
    /// key left with none), and would read counters that include everything since the
    /// key was first read as one sample, seconds of past demand as if current. For an
    /// allocator that still holds the entry the line means the same: its base is the
    /// last line. Give it half the allocator's lease (its welcome says it).
    pub fn set_rebase_after(&mut self, ns: u64) {
        self.rebase_after_ns = ns.max(1);
    }

    /// Whether `key` is tracked.
    pub fn contains(&self, key: &K) -> bool {
        self.tracks.contains_key(key)
    }

    /// Concurrency shrinks waiting for in-flight work to drain.
    pub fn draining(&self) -> usize {
        self.pending_acks.len()
    }

    /// Reads every engine key into the tracks (`buf` is scratch); keys the engine
    /// evicted are dropped. `key_of` names an engine key (`None`: not tracked). One
    /// `SyncTracks` per engine: its walks mark the engine's keys (see
    /// [`SyncTracks::refresh_changed`]).
    pub fn refresh(
        &mut self,
        engine: &Engine,
        now: u64,
        buf: &mut Vec<KeyDemand>,
        mut key_of: impl FnMut(&KeyDemand) -> Option<K>,
    ) {
        let since = self.last_poll_ns.min(now);
        self.last_poll_ns = now;
        self.generation += 1;
        let generation = self.generation;
        // Keys created from here on are new to the next poll, even if this walk sees
        // them too (a second sighting only updates the track).
        self.created_cursor = engine.created_seq();
        buf.clear();
        engine.sync_key_demand(&mut self.gone_cursor, buf);
        for d in buf.drain(..) {
            if let Some(k) = key_of(&d) {
                self.track(k, d, since, generation);
            }
        }
        self.tracks.retain(|_, t| t.seen == generation);
    }

    /// What [`SyncTracks::refresh`] does, reading only the keys that changed since the
    /// last walk (counts, in-flight slots, slice; new keys) and dropping those evicted
    /// since: the report tick's read. A key that did not change would be observed
    /// unchanged, so the tracks come out the same; an engine of 10,000 keys with a few
    /// hundred busy no longer looks up, names and compares every key each interval.
    /// Falls back to the whole walk when the engine cannot say what changed (no walk
    /// yet, or more evictions than it remembers).
    pub fn refresh_changed(
        &mut self,
        engine: &Engine,
        now: u64,
        buf: &mut Vec<KeyDemand>,
        mut key_of: impl FnMut(&KeyDemand) -> Option<K>,
    ) {
        let created = engine.created_seq();
        buf.clear();
        let mut gone = std::mem::take(&mut self.gone);
        gone.clear();
        if !engine.changed_key_demand(&mut self.gone_cursor, buf, &mut gone) {
            self.gone = gone;
            self.refresh(engine, now, buf, key_of);
            return;
        }
        let since = self.last_poll_ns.min(now);
        self.last_poll_ns = now;
        self.created_cursor = created;
        for d in gone.drain(..) {
            if let Some(k) = key_of(&d) {
                self.tracks.remove(&k);
            }
        }
        self.gone = gone;
        let generation = self.generation;
        for d in buf.drain(..) {
            if let Some(k) = key_of(&d) {
                self.track(k, d, since, generation);
            }
        }
    }

    /// Reads only the keys the engine created since the last read (the new-key poll:
    /// a walk of every key there cost a cache miss per key, 50 times a second while
    /// new keys keep coming); a whole [`SyncTracks::refresh`] when the engine has
    /// forgotten some of them.
    pub fn refresh_new(
        &mut self,
        engine: &Engine,
        now: u64,
        buf: &mut Vec<KeyDemand>,
        mut key_of: impl FnMut(&KeyDemand) -> Option<K>,
    ) {
        buf.clear();
        if !engine.new_key_demand(&mut self.created_cursor, buf) {
            self.refresh(engine, now, buf, key_of);
            return;
        }
        let since = self.last_poll_ns.min(now);
        self.last_poll_ns = now;
        let generation = self.generation;
        for d in buf.drain(..) {
            if let Some(k) = key_of(&d) {
                self.track(k, d, since, generation);
            }
        }
    }

    fn track(&mut self, k: K, d: KeyDemand, since: u64, generation: u64) {
        let held = d.slice.map(|s| Held {
            epoch: s.epoch,
            seq: s.seq,
            rate: s.rate,
            burst: s.burst,
        });
        match self.tracks.get_mut(&k) {
            Some(t) => {
                let before = t.line_values();
                t.totals.observe(d.counters);
                t.in_flight = d.in_flight;
                t.held = held;
                t.slice = held.map(|h| (h.rate, h.burst));
                t.seen = generation;
                if !t.dirty && t.line_values() != before {
                    t.dirty = true;
                    self.dirty.push(k);
                }
            }
            None => {
                self.dirty.push(k.clone());
                self.tracks.insert(
                    k,
                    Track {
                        totals: KeyTotals::new(d.counters),
                        base: (0, 0),
                        since_ns: since,
                        in_flight: d.in_flight,
                        held,
                        sent: None,
                        seen: generation,
                        handle: 0,
                        dirty: true,
                        slice: held.map(|h| (h.rate, h.burst)),
                        named_at: 0,
                        active: false,
                    },
                );
            }
        }
    }

    /// A new stream: every key is new to it, counted from its last line on the old
    /// stream, and the last stream's handles mean nothing to it.
    pub fn new_stream(&mut self) {
        self.dirty.clear();
        self.by_handle.clear();
        for (k, t) in self.tracks.iter_mut() {
            // Counted from the last line the old stream was sent: the new one's
            // allocator (a new leader, or this one without the entry) would read the
            // key's counters since it was first read as one sample, hours of past
            // demand as if current (and for a key busy for days, more units than a
            // line may carry). An allocator that kept the entry reads the same: its
            // base was that line.
            t.rebase();
            t.sent = None;
            t.handle = 0;
            t.active = false;
            t.dirty = true;
            self.dirty.push(k.clone());
        }
        self.measuring = (Vec::new(), 0);
        // A concurrency shrink still draining was the last stream's: its ack names the
        // key by that stream's handle, and a new leader refuses an ack of an older
        // term whole (the other keys' acks in the message with it). The hello and the
        // next report carry the grant held, which the allocator reads as the ack once
        // the work in flight fits.
        self.pending_acks.clear();
    }

    /// The allocator did not know these handles (its `UnknownKeys`): it ignored the
    /// lines that named keys by them and holds no entry for those keys (forgotten, or
    /// its rule replaced by a reload). Each such key is named in the next report, by
    /// name from then on (until a grant gives it a handle again), counting from when
    /// it was last named: not everything since it was first read, which the allocator
    /// would take as one sample. Handles this stream does not hold are ignored.
    pub fn forget_handles(&mut self, handles: &[u64]) {
        if handles.is_empty() {
            return;
        }
        let wanted = sorted_handles(handles);
        for (k, t) in self.tracks.iter_mut() {
            if !t.named_by(&wanted) {
                continue;
            }
            t.rebase();
            // Named in the next report, changed or not: as a key new to the stream.
            t.sent = None;
            if !t.dirty {
                t.dirty = true;
                self.dirty.push(k.clone());
            }
        }
    }

    /// Every held grant, for the hello.
    pub fn held(&self) -> impl Iterator<Item = (&K, Held)> {
        self.tracks
            .iter()
            .filter_map(|(k, t)| t.held.map(|h| (k, h)))
    }

    /// Counts a regular report; true if it is a full one (every `every`-th).
    pub fn next_report_is_full(&mut self, every: u64) -> bool {
        self.reports += 1;
        self.reports.is_multiple_of(every.max(1))
    }

    /// The lines of one report, each marked sent: keys whose counters, in-flight count
    /// or held grant changed since the stream last heard of them, by handle where a
    /// grant gave one; with `only_new` only the keys the stream has not heard of yet;
    /// `full` adds every key that holds a grant and every key that changed
    /// since the last full report, changed or not now (see `SyncTracks::line`).
    pub fn report(&mut self, full: bool, only_new: bool, mut f: impl FnMut(Line<'_, K>)) {
        let mut dirty = std::mem::take(&mut self.dirty);
        let (now, rebase_after) = (self.last_poll_ns, self.rebase_after_ns);
        // Few keys to look at: only those (in key order, as the walk below). Otherwise,
        // or for a full report, every track.
        if !full && dirty.len() * 4 <= self.tracks.len() {
            dirty.sort_unstable();
            dirty.dedup();
            for k in dirty.drain(..) {
                let Some(t) = self.tracks.get_mut(&k) else {
                    continue;
                };
                Self::line(&k, t, Named::Delta { only_new }, now, rebase_after, &mut f);
                t.dirty = t.unsent();
                if t.dirty {
                    self.dirty.push(k);
                }
            }
        } else {
            let how = if full {
                Named::Full
            } else {
                Named::Delta { only_new }
            };
            for (k, t) in self.tracks.iter_mut() {
                Self::line(k, t, how, now, rebase_after, &mut f);
                t.dirty = t.unsent();
                if t.dirty {
                    self.dirty.push(k.clone());
                }
            }
        }
        dirty.clear();
        // Reuse the larger allocation.
        if dirty.capacity() > self.dirty.capacity() {
            dirty.append(&mut self.dirty);
            self.dirty = dirty;
        }
    }

    /// The last report's lines may not have reached the allocator (a message of it was
    /// dropped at a full queue): every key it named is named again in the next report,
    /// as if new to the stream. Its counters are cumulative, so a line that did arrive
    /// and is sent again says nothing new. Without this a new key whose first line was
    /// dropped went unnamed until its counts moved, and a rebase later took the dropped
    /// line's values as the allocator's base, losing their demand.
    pub fn unsend_last_report(&mut self) {
        let now = self.last_poll_ns;
        for (k, t) in self.tracks.iter_mut() {
            if t.sent.is_some() && t.named_at == now {
                t.sent = None;
                if !t.dirty {
                    t.dirty = true;
                    self.dirty.push(k.clone());
                }
            }
        }
    }

    /// One track's line of a report read at `now`, if it has one; marks it sent.
    ///
    /// What full reports are for: an unchanged line is the allocator's sample of a key
    /// gone quiet (a holder's grant then shrinks, an estimate decays). They named every
    /// key by name (which also corrected a handle the allocator no longer knew; it now
    /// says so, [`SyncTracks::forget_handles`]), and they named every key the
    /// engine held, which kept every entry alive (the allocator forgot one only after a
    /// lease unnamed): at fleet scale most report lines were full reports' unchanged
    /// keys, and the allocator kept an entry per key and gateway for as long as the
    /// gateway kept the key (`key_idle_ms`). Now a full report names holders (each
    /// unchanged line still shrinks a grant no longer used) and keys that changed
    /// since the last one (their quiet sample, once); an entry with nothing granted
    /// and no sample for a lease is forgotten, and the line that revives it is
    /// rebased (see [`SyncTracks::set_rebase_after`]).
    fn line(
        k: &K,
        t: &mut Track,
        how: Named,
        now: u64,
        rebase_after: u64,
        f: &mut impl FnMut(Line<'_, K>),
    ) {
        let changed = t.unsent();
        let include = match (t.sent, how) {
            (None, _) => true,
            (Some(_), Named::Delta { only_new: true }) => false,
            (Some(_), Named::Delta { only_new: false }) => changed,
            // A grant shrunk to nothing is not held: its entry may be forgotten.
            (Some(_), Named::Full) => {
                changed || t.active || t.held.is_some_and(|h| h.rate > 0 || h.burst > 0)
            }
        };
        if !include {
            return;
        }
        t.active = match how {
            Named::Full => changed,
            Named::Delta { .. } => t.active || changed,
        };
        if t.sent.is_some() && now.saturating_sub(t.named_at) >= rebase_after {
            t.rebase();
        }
        let now_vals = t.line_values();
        t.sent = Some(now_vals);
        t.named_at = now;
        // By handle where a grant gave one, full reports too: a handle the allocator no
        // longer knows makes it ignore the line and say so (`forget_handles`).
        f(Line {
            key: k,
            key_handle: t.handle,
            admitted: now_vals.0,
            rejected: now_vals.1,
            counting_since_ns: t.since_ns,
            in_flight: t.in_flight,
            held: t.held,
        });
    }

    /// Opens a requested measurement of `handles` at `now` (the caller's clock, in ns)
    /// for `window_ms` (at most [`MAX_MEASURE_WINDOW_MS`]), at most `max` keys: one is
    /// open at a time, and a request while one is open joins it and ends at the later
    /// time. Returns the end to (re)arm a timer for, if it moved. The start's report is
    /// the caller's ([`SyncTracks::measure_report`]).
    pub fn open_measurement(
        &mut self,
        handles: &[u64],
        now: u64,
        window_ms: u32,
        max: usize,
    ) -> Option<u64> {
        let end = now + u64::from(window_ms.min(MAX_MEASURE_WINDOW_MS)) * 1_000_000;
        let (keys, at) = &mut self.measuring;
        let moved = keys.is_empty() || end > *at;
        if moved {
            *at = end;
        }
        keys.extend_from_slice(handles);
        keys.sort_unstable();
        keys.dedup();
        keys.truncate(max);
        moved.then_some(*at)
    }

    /// When the open measurement ends, if one is open.
    pub fn measurement_end(&self) -> Option<u64> {
        (!self.measuring.0.is_empty()).then_some(self.measuring.1)
    }

    /// Closes the open measurement if it has ended at `now`, returning its keys for
    /// the end's report.
    pub fn take_ended_measurement(&mut self, now: u64) -> Option<Vec<u64>> {
        let end = self.measurement_end()?;
        (now >= end).then(|| std::mem::take(&mut self.measuring.0))
    }

    /// The lines of a measurement the allocator asked for (a `MeasureRequest`): the
    /// tracked keys whose handle on this stream is among `handles` (others are
    /// skipped), by handle, with counters re-read from the slot each track holds (grants
    /// applied since were folded in by [`SyncTracks::apply`]), each marked sent as read
    /// at `now`.
    pub fn measure_report(&mut self, now: u64, handles: &[u64], mut f: impl FnMut(Line<'_, K>)) {
        if handles.is_empty() {
            return;
        }
        let wanted = sorted_handles(handles);
        for (k, t) in self.tracks.iter_mut() {
            if !t.named_by(&wanted) {
                continue;
            }
            t.totals.reread();
            let vals = t.line_values();
            t.active |= t.sent != Some(vals);
            t.sent = Some(vals);
            // Read now, not at the last walk: a rebase counts from here (thirty-first
            // session; it counted from the walk, with a base that held newer counts).
            t.named_at = now;
            let (admitted, rejected) = (vals.0, vals.1);
            f(Line {
                key: k,
                key_handle: t.handle,
                admitted,
                rejected,
                counting_since_ns: t.since_ns,
                in_flight: t.in_flight,
                held: t.held,
            });
        }
    }

    /// Applies grants to the engine at `now`: `keys[i]` names `updates[i]`, whose
    /// grant carried key handle `handles[i]` (0: none). Every slot a slice replaced is
    /// folded into its key's totals, in order: a track keeps the slot it last read,
    /// and a key whose slot was replaced twice before the next refresh would otherwise
    /// lose the middle slot's counts (under grant churn, most of the demand).
    pub fn apply(
        &mut self,
        engine: &Engine,
        now: u64,
        updates: Vec<SliceUpdate>,
        keys: Vec<K>,
        handles: &[u64],
    ) -> Vec<Applied<K>> {
        let results = engine.apply_slices(now, &updates);
        if self.by_handle.len() > 2 * self.tracks.len() + 1024 {
            // Stale handles (keys dropped or rebased since) outgrew the live ones.
            let tracks = &self.tracks;
            self.by_handle
                .retain(|h, k| tracks.get(k).is_some_and(|t| t.handle == *h));
        }
        // Whether each grant left rate and burst at least where they were.
        let mut grew = vec![false; updates.len()];
        for (i, ((k, r), &handle)) in keys.iter().zip(&results).zip(handles).enumerate() {
            let Some(t) = self.tracks.get_mut(k) else {
                continue;
            };
            if r.is_ok() {
                let u = &updates[i];
                grew[i] = t
                    .slice
                    .is_none_or(|(rate, burst)| u.rate >= rate && u.burst >= burst);
                t.slice = Some((u.rate, u.burst));
            }
            if handle != 0 {
                t.handle = handle;
                self.by_handle.insert(handle, k.clone());
            }
            if let Ok(a) = r {
                if let Some(old) = &a.replaced {
                    t.totals.observe(old.clone());
                }
                if let Some(new) = &a.current {
                    t.totals.observe(new.clone());
                }
                if !t.dirty {
                    t.dirty = true;
                    self.dirty.push(k.clone());
                }
            }
        }
        let mut out = Vec::with_capacity(updates.len());
        for ((((u, k), r), &key_handle), grew) in updates
            .into_iter()
            .zip(keys)
            .zip(results)
            .zip(handles)
            .zip(grew)
        {
            let applied = match r {
                Ok(a) => a,
                Err(e) => {
                    out.push(Applied::Refused(e));
                    continue;
                }
            };
            let concurrency = engine
                .rules()
                .by_name(&u.rule)
                .is_some_and(|(_, r)| matches!(r.limit, RuleLimit::Concurrency { .. }));
            if concurrency && applied.in_flight > u.burst {
                // Drains first: acknowledged once in-flight fits.
                self.pending_acks.retain(|p| p.key != k);
                self.pending_acks.push(PendingAck {
                    key: k,
                    key_handle,
                    epoch: u.epoch,
                    seq: u.seq,
                    slots: u.burst,
                    released: applied.released_tokens,
                });
                out.push(Applied::Draining);
                continue;
            }
            if !concurrency && grew && applied.released_tokens == 0 {
                out.push(Applied::Held);
                continue;
            }
            out.push(Applied::Ack(Ack {
                key: k,
                epoch: u.epoch,
                seq: u.seq,
                released_tokens: applied.released_tokens,
                in_flight: applied.in_flight,
                key_handle,
            }));
        }
        out
    }

    /// Acks for concurrency shrinks whose in-flight work now fits (read by the last
    /// refresh).
    pub fn drained_acks(&mut self) -> Vec<Ack<K>> {
        let mut acks = Vec::new();
        let tracks = &self.tracks;
        self.pending_acks.retain(|p| {
            let Some(t) = tracks.get(&p.key) else {
                return false;
            };
            // Superseded by a newer grant: that one is acknowledged on its own.
            if t.held.is_none_or(|h| (h.epoch, h.seq) != (p.epoch, p.seq)) {
                return false;
            }
            if t.in_flight > p.slots {
                return true;
            }
            acks.push(Ack {
                key: p.key.clone(),
                epoch: p.epoch,
                seq: p.seq,
                released_tokens: p.released,
                in_flight: t.in_flight,
                key_handle: p.key_handle,
            });
            false
        });
        acks
    }
}
