//! The allocator sync client's session, without I/O: what the client does at each of
//! its moments (a stream opens, the welcome arrives, the report tick, the new-key
//! poll, grants, a measure request and its end, an unknown-handles notice, the stream
//! breaks) and what it sends for each, over the per-key bookkeeping of
//! [`crate::sync_core`].
//!
//! Two drivers run it: the tonic client (`shell::sync`, with the `shell` feature), on
//! tokio's timers and a gRPC stream, and `bursar-sim`, on virtual time and simulated
//! links. Each owns only the *when* (its timers, its transport) and the encoding of a
//! message (`L`: the driver's report line); *what* happens at each moment, which
//! report is full, when a poll has anything to do, how acks and lines are split into
//! messages, how long to wait before reconnecting, is this module's, so the simulator
//! measures the client that ships rather than a copy of it.
//!
//! Times: `now` is the agent's clock (the engine's), except for a measurement's
//! timer, which is on the caller's timer clock (`timer_now`), as
//! [`SyncTracks::open_measurement`] documents.

use crate::engine::KeyDemand;
use crate::sync_core::{Ack, Applied, Held, Line, SyncTracks};
use crate::{Engine, SliceError, SliceExtension, SliceUpdate};

/// Most lines (or acks) in one message: the protocol's bound
/// (`bursar_proto::allocator::MAX_KEYS_PER_MESSAGE`, which this crate's engine does not
/// depend on; a test in the shell holds them equal). A welcome may lower it.
pub const MAX_KEYS_PER_MESSAGE: usize = 10_000;

/// What the session decides by (the sync client's settings; durations in
/// nanoseconds). The report period and the new-key poll's are the driver's timers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    /// Every n-th regular report is a full one.
    pub full_report_every: u32,
    /// First reconnect delay.
    pub backoff_min_ns: u64,
    /// Longest reconnect delay.
    pub backoff_max_ns: u64,
    /// Most lines (or acks, or held grants in a hello) this agent puts in one message,
    /// whatever the welcome allows: [`keys_per_message`] of its rules, so that a
    /// message of its longest key names stays under the protocol's byte bound.
    pub max_keys: usize,
}

/// Bytes of one report line besides its key name (its counters, held grant, handle
/// and protobuf framing, every number at its longest varint), rounded up.
pub const LINE_FIXED_BYTES: usize = 128;

/// Room kept in each message for its own fields and framing.
const MESSAGE_SLACK_BYTES: usize = 64 * 1024;

/// Most lines of keys named in up to `max_key_name_bytes` each
/// ([`crate::RuleSet::max_key_name_bytes`]) that fit in one message of
/// `max_message_bytes`, capped at [`MAX_KEYS_PER_MESSAGE`]. A key count alone is not
/// a bound: a rule matching 16 `*` descriptors of 256 bytes names keys of ~4 KiB, and
/// 10,000 of them are 40 MiB, ten times what either end accepts.
pub fn keys_per_message(max_key_name_bytes: usize, max_message_bytes: usize) -> usize {
    let room = max_message_bytes.saturating_sub(MESSAGE_SLACK_BYTES);
    (room / (max_key_name_bytes + LINE_FIXED_BYTES)).clamp(1, MAX_KEYS_PER_MESSAGE)
}

impl Default for SessionConfig {
    /// The sync client's defaults: every 8th report full, reconnects after 100 ms
    /// doubling to 5 s.
    fn default() -> SessionConfig {
        SessionConfig {
            full_report_every: 8,
            backoff_min_ns: 100_000_000,
            backoff_max_ns: 5_000_000_000,
            max_keys: MAX_KEYS_PER_MESSAGE,
        }
    }
}

/// Which report a message is: a regular one, or a requested measurement's start or
/// end (the allocator's `Measure`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MeasureMark {
    /// A regular report (or a new-key poll's).
    None,
    /// A measurement's start.
    Start,
    /// A measurement's end.
    End,
}

/// One message the session asks its driver to send to the allocator, in order.
#[derive(Debug)]
pub enum Outgoing<L, K> {
    /// A report of at most the welcome's `max_keys` lines (one message, empty, for a
    /// regular report with nothing to say: it renews the agent's leases).
    Report {
        /// Strictly increasing over the session ([`SyncSession::stamp`]).
        agent_time_ns: u64,
        /// The lines, encoded by the driver.
        lines: Vec<L>,
        /// Which report it is.
        measure: MeasureMark,
    },
    /// Acknowledgements, at most `max_keys`.
    Acks(Vec<Ack<K>>),
}

/// What became of a grants message ([`SyncSession::grants`]).
#[derive(Debug)]
pub struct Granted<L, K> {
    /// The acks to send now.
    pub out: Vec<Outgoing<L, K>>,
    /// Grants applied (acknowledged, held, or draining).
    pub applied: u64,
    /// Why each refused grant was refused.
    pub refused: Vec<SliceError>,
}

/// Where the session's stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stream {
    /// No stream: waiting to (re)connect.
    Down,
    /// A hello was sent; no welcome yet.
    Opening,
    /// Welcomed: reports flow, at most `max_keys` lines a message.
    Up { max_keys: usize },
}

/// The sync client's session (see the module docs): its tracks, its stream's state,
/// its message stamps and its reconnect backoff.
pub struct SyncSession<K> {
    tracks: SyncTracks<K>,
    cfg: SessionConfig,
    stream: Stream,
    /// Streams opened so far (a driver's timeout names the stream it was armed for).
    opened: u64,
    /// When the current stream was welcomed (the session's clock), if it was: a stream
    /// that stays up for `backoff_max_ns` starts the backoff again when it ends.
    welcomed_at: Option<u64>,
    /// The delay the next reconnect waits (jittered over its upper half).
    backoff_ns: u64,
    /// The engine's creation counter ([`Engine::created_seq`]) at the last poll that
    /// read it. (The key count until the thirty-first session: a key created while
    /// another was evicted left it unchanged, and waited for the next report tick.)
    created_seen: u64,
    last_ts: u64,
    /// The welcome's lease, in ns (0: it did not say).
    lease_ns: u64,
}

impl<K: Ord + Clone> SyncSession<K> {
    /// A session with no stream yet; counters of keys met from here on count from
    /// `now`.
    pub fn new(now: u64, cfg: SessionConfig) -> SyncSession<K> {
        SyncSession {
            tracks: SyncTracks::new(now),
            cfg,
            stream: Stream::Down,
            opened: 0,
            welcomed_at: None,
            backoff_ns: cfg.backoff_min_ns,
            created_seen: 0,
            last_ts: 0,
            lease_ns: 0,
        }
    }

    /// The per-key bookkeeping.
    pub fn tracks(&self) -> &SyncTracks<K> {
        &self.tracks
    }

    /// Its settings.
    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    /// Welcomed: reports flow.
    pub fn is_up(&self) -> bool {
        matches!(self.stream, Stream::Up { .. })
    }

    /// A hello was sent and no welcome has come yet.
    pub fn is_opening(&self) -> bool {
        self.stream == Stream::Opening
    }

    /// Streams opened so far: the current one's number while one is open.
    pub fn streams_opened(&self) -> u64 {
        self.opened
    }

    /// Lines a message may carry on this stream (the welcome's bound; the protocol's
    /// before one).
    pub fn max_keys(&self) -> usize {
        let own = self.cfg.max_keys.clamp(1, MAX_KEYS_PER_MESSAGE);
        match self.stream {
            Stream::Up { max_keys } => max_keys.min(own),
            _ => own,
        }
    }

    /// A strictly increasing agent timestamp for a message sent at `now`.
    pub fn stamp(&mut self, now: u64) -> u64 {
        let t = now.max(self.last_ts + 1);
        self.last_ts = t;
        t
    }

    /// A stream opens: every key is new to it, and the engine is read whole. Returns
    /// the hello's timestamp; its held grants are [`SyncSession::hello_held`].
    pub fn open(
        &mut self,
        engine: &Engine,
        now: u64,
        buf: &mut Vec<KeyDemand>,
        key_of: impl FnMut(&KeyDemand) -> Option<K>,
    ) -> u64 {
        self.opened += 1;
        self.stream = Stream::Opening;
        self.tracks.new_stream();
        self.tracks.refresh(engine, now, buf, key_of);
        self.stamp(now)
    }

    /// The grants the hello names, at most one message's worth: the rest follow in the
    /// first (full) report, which names every held grant too.
    pub fn hello_held(&self) -> impl Iterator<Item = (&K, Held)> {
        self.tracks.held().take(self.max_keys())
    }

    /// The welcome arrived: the allocator's lease (`lease_ms`, 0 if it did not say)
    /// and its bound on lines per message. Reports everything at once: a full report.
    /// The reconnect backoff starts again if this stream stays up ([`SyncSession::lost`]).
    #[allow(clippy::too_many_arguments)]
    pub fn welcome<L>(
        &mut self,
        engine: &Engine,
        now: u64,
        lease_ms: u64,
        max_keys: usize,
        buf: &mut Vec<KeyDemand>,
        key_of: impl FnMut(&KeyDemand) -> Option<K>,
        line: impl FnMut(Line<'_, K>) -> L,
    ) -> Vec<Outgoing<L, K>> {
        // The allocator forgets an entry after a lease without a sample: lines of keys
        // unnamed for half of one count from when they were last named.
        self.lease_ns = lease_ms.saturating_mul(1_000_000);
        if lease_ms > 0 {
            self.tracks.set_rebase_after(self.lease_ns / 2);
        }
        self.stream = Stream::Up {
            max_keys: max_keys.clamp(1, MAX_KEYS_PER_MESSAGE),
        };
        self.welcomed_at = Some(now);
        self.tracks.refresh(engine, now, buf, key_of);
        self.created_seen = engine.created_seq();
        self.reports(now, true, false, line)
    }

    /// The report tick: reads what changed since the last walk, and reports it (every
    /// `full_report_every`-th report a full one), then acks concurrency shrinks that
    /// have drained. Nothing while the stream is not up.
    pub fn report_tick<L>(
        &mut self,
        engine: &Engine,
        now: u64,
        buf: &mut Vec<KeyDemand>,
        key_of: impl FnMut(&KeyDemand) -> Option<K>,
        line: impl FnMut(Line<'_, K>) -> L,
    ) -> Vec<Outgoing<L, K>> {
        if !self.is_up() {
            return Vec::new();
        }
        self.tracks.refresh_changed(engine, now, buf, key_of);
        let full = self
            .tracks
            .next_report_is_full(u64::from(self.cfg.full_report_every.max(1)));
        let mut out = self.reports(now, full, false, line);
        self.drained_acks(&mut out);
        out
    }

    /// Whether a new-key poll now would do anything: the stream is up, and the
    /// engine created a key since the last poll or a concurrency shrink waits to
    /// drain. A driver that does not tick every new-key poll period (the simulator, which
    /// schedules a poll only when this turns true) sends what a ticking one would.
    pub fn wants_poll(&self, engine: &Engine) -> bool {
        self.is_up() && (self.tracks.draining() > 0 || engine.created_seq() != self.created_seen)
    }

    /// The new-key poll: when [`SyncSession::wants_poll`], reads the keys created since
    /// the last read (every key while a concurrency shrink drains) and reports those
    /// the stream has not heard of, then acks shrinks that have drained.
    pub fn poll_tick<L>(
        &mut self,
        engine: &Engine,
        now: u64,
        buf: &mut Vec<KeyDemand>,
        key_of: impl FnMut(&KeyDemand) -> Option<K>,
        line: impl FnMut(Line<'_, K>) -> L,
    ) -> Vec<Outgoing<L, K>> {
        if !self.wants_poll(engine) {
            return Vec::new();
        }
        self.created_seen = engine.created_seq();
        if self.tracks.draining() == 0 {
            self.tracks.refresh_new(engine, now, buf, key_of);
        } else {
            // A concurrency shrink waits for its in-flight count to fit: read every
            // key's count (rare: shrinks of draining slots).
            self.tracks.refresh(engine, now, buf, key_of);
        }
        let mut out = self.reports(now, false, true, line);
        self.drained_acks(&mut out);
        out
    }

    /// A report message from the last call was not sent (the driver's queue was
    /// full): its keys are named again in the next report
    /// ([`SyncTracks::unsend_last_report`]).
    pub fn report_dropped(&mut self) {
        self.tracks.unsend_last_report();
    }

    /// Concurrency shrinks waiting for in-flight work to drain (a driver that does
    /// not tick keeps polling while there are any).
    pub fn draining(&self) -> usize {
        self.tracks.draining()
    }

    /// The key a grant that names no key is for: the one its handle was given to on
    /// this stream, if this client still tracks it under that handle
    /// ([`SyncTracks::key_of_handle`]). The driver builds that grant's update from it,
    /// or counts the grant refused.
    pub fn key_of_handle(&self, handle: u64) -> Option<&K> {
        self.tracks.key_of_handle(handle)
    }

    /// One grants message: applied to the engine with one `apply_slices`; the acks
    /// owed now, in messages of at most `max_keys`.
    pub fn grants<L>(
        &mut self,
        engine: &Engine,
        now: u64,
        updates: Vec<SliceUpdate>,
        keys: Vec<K>,
        handles: &[u64],
    ) -> Granted<L, K> {
        let mut updates = updates;
        for u in &mut updates {
            u.lease_expires_at_ns = self.lease_cap(u.lease_expires_at_ns);
        }
        let outcomes = self.tracks.apply(engine, now, updates, keys, handles);
        let mut acks = Vec::new();
        let (mut applied, mut refused) = (0, Vec::new());
        for outcome in outcomes {
            match outcome {
                Applied::Ack(a) => {
                    applied += 1;
                    acks.push(a);
                }
                Applied::Draining | Applied::Held => applied += 1,
                Applied::Refused(e) => refused.push(e),
            }
        }
        let mut out = Vec::new();
        self.push_acks(acks, &mut out);
        Granted {
            out,
            applied,
            refused,
        }
    }

    /// A lease extension: extends every slice of its term up to its seq (no answer).
    pub fn extension(
        &self,
        engine: &Engine,
        now: u64,
        x: SliceExtension,
    ) -> Result<usize, SliceError> {
        let mut x = x;
        x.lease_expires_at_ns = self.lease_cap(x.lease_expires_at_ns);
        engine.extend_slices(now, x)
    }

    /// Invariant 3 on this side: a lease runs from a report this client sent (its
    /// stamp, echoed) for the welcome's lease, so none ends after the latest stamp
    /// plus the lease. A later end (an allocator's bug: its own clock, or `u64::MAX`)
    /// would keep a grant past the allocator's reclaim and never apply the posture; it
    /// is cut to that. Before a welcome that named a lease, as sent.
    fn lease_cap(&self, lease_expires_at_ns: u64) -> u64 {
        if self.lease_ns == 0 {
            return lease_expires_at_ns;
        }
        lease_expires_at_ns.min(self.last_ts.saturating_add(self.lease_ns))
    }

    /// A revocation: the grants on `keys` (rule, `*` values) of term `epoch` up to
    /// `through_seq`, or of an earlier term, go to their posture now (no answer: the
    /// next report shows the posture's slice). Returns how many did.
    pub fn revoke<S: AsRef<str>>(
        &self,
        engine: &Engine,
        now: u64,
        epoch: u64,
        through_seq: u64,
        keys: &[(&str, &[S])],
    ) -> usize {
        engine.revoke_slices(now, epoch, through_seq, keys)
    }

    /// A measure request for `handles`' keys (at most `max_keys` of them): their
    /// start report now, and the measurement opened for `window_ms` on the timer clock
    /// (`timer_now`). Returns the reports and, if it moved, when to call
    /// [`SyncSession::measure_end`] (on the timer clock).
    pub fn measure_request<L>(
        &mut self,
        now: u64,
        timer_now: u64,
        handles: &[u64],
        window_ms: u32,
        line: impl FnMut(Line<'_, K>) -> L,
    ) -> (Vec<Outgoing<L, K>>, Option<u64>) {
        let max = self.max_keys();
        let handles = &handles[..handles.len().min(max)];
        let out = self.measure_reports(now, handles, MeasureMark::Start, line);
        let end = self
            .tracks
            .open_measurement(handles, timer_now, window_ms, max);
        (out, end)
    }

    /// When the open measurement ends (timer clock), if one is open.
    pub fn measurement_end(&self) -> Option<u64> {
        self.tracks.measurement_end()
    }

    /// The measurement timer fired at `timer_now`: the end's report if the open
    /// measurement has ended (a request since may have moved its end).
    pub fn measure_end<L>(
        &mut self,
        now: u64,
        timer_now: u64,
        line: impl FnMut(Line<'_, K>) -> L,
    ) -> Vec<Outgoing<L, K>> {
        match self.tracks.take_ended_measurement(timer_now) {
            Some(handles) => self.measure_reports(now, &handles, MeasureMark::End, line),
            None => Vec::new(),
        }
    }

    /// The allocator did not know these handles ([`SyncTracks::forget_handles`]).
    pub fn unknown_handles(&mut self, handles: &[u64]) {
        self.tracks.forget_handles(handles);
    }

    /// The stream ended without a welcome to a new one (a redirect to the leader):
    /// reconnect at once.
    pub fn closed(&mut self) {
        self.stream = Stream::Down;
    }

    /// The stream broke at `now`, or one could not be opened: returns how long to wait
    /// before the next attempt, from `draw` (any random number: the wait is jittered
    /// over the upper half of the backoff). The backoff doubles with each failure up
    /// to `backoff_max_ns`, and starts again from `backoff_min_ns` after a stream that
    /// was welcomed and stayed up for `backoff_max_ns`. (Until the thirtieth session a
    /// welcome alone started it again: an allocator that welcomed each stream and then
    /// dropped it had the whole fleet reconnecting every 50-100 ms.)
    pub fn lost(&mut self, now: u64, draw: u64) -> u64 {
        self.stream = Stream::Down;
        if let Some(at) = self.welcomed_at.take()
            && now.saturating_sub(at) >= self.cfg.backoff_max_ns
        {
            self.backoff_ns = self.cfg.backoff_min_ns;
        }
        let half = self.backoff_ns / 2;
        let wait = half + draw % half.max(1);
        self.backoff_ns = self
            .backoff_ns
            .saturating_mul(2)
            .min(self.cfg.backoff_max_ns)
            .max(self.cfg.backoff_min_ns);
        wait
    }

    /// Reports: `full` names every key; otherwise changed keys, or only keys the
    /// stream has not heard of (`only_new`: nothing at all when there are none).
    fn reports<L>(
        &mut self,
        now: u64,
        full: bool,
        only_new: bool,
        mut line: impl FnMut(Line<'_, K>) -> L,
    ) -> Vec<Outgoing<L, K>> {
        let mut lines = Vec::new();
        self.tracks.report(full, only_new, |l| lines.push(line(l)));
        if lines.is_empty() && only_new {
            return Vec::new();
        }
        self.chunked(now, lines, MeasureMark::None)
    }

    fn measure_reports<L>(
        &mut self,
        now: u64,
        handles: &[u64],
        measure: MeasureMark,
        mut line: impl FnMut(Line<'_, K>) -> L,
    ) -> Vec<Outgoing<L, K>> {
        let mut lines = Vec::new();
        self.tracks
            .measure_report(now, handles, |l| lines.push(line(l)));
        if lines.is_empty() {
            return Vec::new();
        }
        self.chunked(now, lines, measure)
    }

    /// Lines in messages of at most `max_keys` (one, empty, for none).
    fn chunked<L>(
        &mut self,
        now: u64,
        mut lines: Vec<L>,
        measure: MeasureMark,
    ) -> Vec<Outgoing<L, K>> {
        let max = self.max_keys();
        let mut out = Vec::with_capacity(lines.len().div_ceil(max).max(1));
        loop {
            let rest = lines.split_off(lines.len().min(max));
            out.push(Outgoing::Report {
                agent_time_ns: self.stamp(now),
                lines,
                measure,
            });
            if rest.is_empty() {
                break;
            }
            lines = rest;
        }
        out
    }

    fn drained_acks<L>(&mut self, out: &mut Vec<Outgoing<L, K>>) {
        let acks = self.tracks.drained_acks();
        self.push_acks(acks, out);
    }

    fn push_acks<L>(&self, mut acks: Vec<Ack<K>>, out: &mut Vec<Outgoing<L, K>>) {
        let max = self.max_keys();
        while !acks.is_empty() {
            let rest = acks.split_off(acks.len().min(max));
            out.push(Outgoing::Acks(acks));
            acks = rest;
        }
    }
}
