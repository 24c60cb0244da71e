//! The one task that owns the allocation core.
//!
//! It drains a bounded channel of [`Input`]s, calls the core with the shell clock's
//! `now`, sleeps until the core's `poll_timeout()`, and after every batch of inputs
//! routes the grants it drains to each agent's bounded outbound channel (only to the
//! stream of the incarnation a grant is for).

use std::collections::HashMap;
use std::sync::Arc;

use bursar_proto::allocator as pb;
use tokio::sync::{mpsc, oneshot, watch};

use super::ShellClock;
use super::grpc::{Charge, Gate, GateStatus};
use crate::{
    Ack, AllocError, Allocator, GrantRef, Hello, KeyStatus, ReloadSummary, Report, RuleStatus,
};

/// What the response stream of one agent carries.
pub type Outbound = mpsc::Sender<Result<pb::AllocatorMessage, tonic::Status>>;

/// Inputs of the core task.
#[derive(Debug)]
pub enum Input {
    /// An agent's hello on a new stream `conn`. On success the welcome is queued on
    /// `tx` first and the stream becomes the agent's route for grants.
    Hello {
        /// The stream.
        conn: u64,
        /// The hello.
        hello: Hello,
        /// The agent's outbound channel.
        tx: Outbound,
        /// Accepted or refused.
        reply: oneshot::Sender<Result<(), AllocError>>,
        /// Its share of the stream port's input budget.
        charge: Charge,
    },
    /// A report from stream `conn`.
    Report {
        /// The stream.
        conn: u64,
        /// The report.
        report: Report,
        /// Its share of the stream port's input budget.
        charge: Charge,
    },
    /// Acks from stream `conn`.
    Ack {
        /// The stream.
        conn: u64,
        /// The acks.
        ack: Ack,
        /// Its share of the stream port's input budget.
        charge: Charge,
    },
    /// Stream `conn` of `agent` ended.
    Disconnect {
        /// The stream.
        conn: u64,
        /// The agent.
        agent: String,
    },
    /// The admin endpoint asks for a snapshot.
    Snapshot {
        /// The answer.
        reply: oneshot::Sender<Snapshot>,
    },
    /// Reload the rules: the file read, parsed and validated (`Ok`), or why not (then
    /// nothing changes but the recorded error).
    Reload {
        /// The new rules, or the error naming file, rule and field.
        rules: Result<bursar_agent::Config, String>,
        /// The outcome.
        reply: oneshot::Sender<Result<Reloaded, String>>,
    },
}

impl Input {
    /// Gives a hello, report or ack its share of the input budget (others hold none).
    pub fn set_charge(&mut self, c: Charge) {
        match self {
            Input::Hello { charge, .. }
            | Input::Report { charge, .. }
            | Input::Ack { charge, .. } => *charge = c,
            _ => {}
        }
    }
}

/// A reload that was applied.
#[derive(Clone, Debug)]
pub struct Reloaded {
    /// The rules version now in force.
    pub version: String,
    /// The version before.
    pub previous_version: String,
    /// What changed.
    pub summary: ReloadSummary,
}

/// Reloads so far, for the admin endpoint.
#[derive(Clone, Debug, Default)]
pub struct ReloadStatus {
    /// The rules file (`None`: embedded rules).
    pub path: Option<String>,
    /// Reloads applied.
    pub applied: u64,
    /// Reloads refused (the rules in force stayed unchanged).
    pub failed: u64,
    /// The last refused reload's error, if the last reload failed.
    pub last_error: Option<String>,
    /// What the last applied reload changed.
    pub last_applied: Option<String>,
    /// `ConfigVersion` messages queued on agents' streams.
    pub versions_sent: u64,
}

/// Counters of the shell, for the admin endpoint.
#[derive(Clone, Copy, Debug, Default)]
pub struct ShellCounters {
    /// Hellos accepted.
    pub hellos: u64,
    /// Hellos refused.
    pub hellos_refused: u64,
    /// Reports accepted.
    pub reports: u64,
    /// Acks accepted.
    pub acks: u64,
    /// Reports and acks the core refused (stale reports included).
    pub refused: u64,
    /// Grants queued on agent streams.
    pub grants_sent: u64,
    /// Grants dropped: no stream for that incarnation, or its queue was full.
    pub grants_dropped: u64,
    /// Lease extensions queued on agent streams.
    pub extensions_sent: u64,
    /// Lease extensions dropped (as grants; safe: the core counts them as sent).
    pub extensions_dropped: u64,
    /// Measure requests queued on agent streams.
    pub measures_sent: u64,
    /// Measure requests dropped (not queued in the core, no stream for that
    /// incarnation, or its queue was full; safe: the holders' regular reports follow).
    pub measures_dropped: u64,
    /// Unknown key handles told to their agents (`UnknownKeys`).
    pub unknown_handles_sent: u64,
    /// Unknown key handles not told (not queued in the core, no stream for that
    /// incarnation, or its queue was full; the agent's lines by them stay ignored
    /// until it next names the keys by name).
    pub unknown_handles_dropped: u64,
    /// Revoked grants told to their agents (`Revoke`, one per key).
    pub revocations_sent: u64,
    /// Revoked grants not told (not queued in the core, no stream for that
    /// incarnation, or its queue was full; told again when the agent next names the
    /// key with a grant).
    pub revocations_dropped: u64,
}

/// What the admin endpoint shows.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The term.
    pub term: u64,
    /// Still learning what agents hold.
    pub learning: bool,
    /// Registered agents.
    pub agents: usize,
    /// Agents with a live stream.
    pub connected: usize,
    /// Tracked keys.
    pub key_count: usize,
    /// Up to `admin_max_keys` keys (the first the core lists), sorted by name.
    pub keys: Vec<KeyStatus>,
    /// More keys exist than listed.
    pub truncated: bool,
    /// Shell counters.
    pub counters: ShellCounters,
    /// The last error the core reported for a message, if any.
    pub last_error: Option<String>,
    /// The rules version in force (what agents are told).
    pub config_version: String,
    /// The rules in force.
    pub rules: Vec<RuleStatus>,
    /// Reloads so far.
    pub reload: ReloadStatus,
    /// Report, hello and ack lines ignored for naming a removed or replaced rule.
    pub ignored_lines: u64,
    /// Agents forgotten to make room for new ones in a full table.
    pub agents_evicted: u64,
    /// The stream port's bounds (input bytes queued, hellos waiting).
    pub gate: GateStatus,
}

struct Route {
    conn: u64,
    incarnation: u64,
    tx: Outbound,
}

/// The core task's state.
pub struct Driver {
    core: Allocator,
    clock: ShellClock,
    config_version: String,
    admin_max_keys: usize,
    routes: HashMap<Arc<str>, Route>,
    /// Agent of each live stream.
    conns: HashMap<u64, (String, u64)>,
    counters: ShellCounters,
    last_error: Option<String>,
    /// Grants being routed, by the core's agent index (see `GrantRef::agent_index`).
    batch: HashMap<u32, (Arc<str>, Vec<pb::Grant>)>,
    reload: ReloadStatus,
    gate: Arc<Gate>,
}

/// Inputs handled before grants are routed, at most.
const INPUT_BATCH_MAX: usize = 256;

impl Driver {
    /// A driver for `core`, whose rules came from `rules_path` (`None`: embedded).
    pub fn new(
        core: Allocator,
        clock: ShellClock,
        config_version: String,
        admin_max_keys: usize,
        rules_path: Option<String>,
        gate: Arc<Gate>,
    ) -> Driver {
        Driver {
            core,
            clock,
            config_version,
            admin_max_keys,
            routes: HashMap::new(),
            conns: HashMap::new(),
            counters: ShellCounters::default(),
            last_error: None,
            batch: HashMap::new(),
            reload: ReloadStatus {
                path: rules_path,
                ..ReloadStatus::default()
            },
            gate,
        }
    }

    /// Runs until `shutdown` turns true or every input sender is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Input>, mut shutdown: watch::Receiver<bool>) {
        loop {
            let deadline = self.clock.instant_of(self.core.poll_timeout());
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|s| *s) => break,
                input = rx.recv() => {
                    let Some(input) = input else { break };
                    self.handle(input);
                    for _ in 1..INPUT_BATCH_MAX {
                        match rx.try_recv() {
                            Ok(i) => self.handle(i),
                            Err(_) => break,
                        }
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {}
            }
            let now = self.clock.now_ns();
            if self.core.poll_timeout() <= now {
                self.core.handle_timeout(now);
            }
            debug_assert!(self.core.check_invariants().is_ok());
            self.route();
        }
    }

    fn note(&mut self, what: &str, agent: &str, e: &AllocError) {
        self.counters.refused += 1;
        if !matches!(
            e,
            AllocError::StaleReport { .. } | AllocError::StaleTerm { .. }
        ) {
            let msg = bounded_note(&format!("{what} from {agent:?}: {e}"));
            eprintln!("bursar-allocator: {msg}");
            self.last_error = Some(msg);
        }
    }

    fn handle(&mut self, input: Input) {
        let now = self.clock.now_ns();
        match input {
            Input::Hello {
                conn,
                hello,
                tx,
                reply,
                ..
            } => match self.core.handle_hello(now, &hello) {
                Ok(()) => {
                    self.counters.hellos += 1;
                    let cfg = self.core.config();
                    let welcome = pb::AllocatorMessage {
                        msg: Some(pb::allocator_message::Msg::Welcome(pb::Welcome {
                            protocol_version: pb::PROTOCOL_VERSION,
                            term: self.core.term(),
                            config_version: self.config_version.clone(),
                            max_keys_per_message: cfg.max_keys_per_message.min(u32::MAX as usize)
                                as u32,
                            max_message_bytes: pb::MAX_MESSAGE_BYTES as u32,
                            lease_ms: cfg.lease_ms,
                        })),
                    };
                    // A fresh channel: the welcome always fits.
                    let _ = tx.try_send(Ok(welcome));
                    let agent: Arc<str> = hello.agent.as_str().into();
                    self.conns
                        .insert(conn, (hello.agent.clone(), hello.incarnation));
                    // A newer stream replaces the old route (the old stream ends when its
                    // last sender is dropped).
                    self.routes.insert(
                        agent,
                        Route {
                            conn,
                            incarnation: hello.incarnation,
                            tx,
                        },
                    );
                    let _ = reply.send(Ok(()));
                }
                Err(e) => {
                    self.counters.hellos_refused += 1;
                    self.note("hello", &hello.agent, &e);
                    let _ = reply.send(Err(e));
                }
            },
            Input::Report { conn, report, .. } => {
                if !self.conns.contains_key(&conn) {
                    return;
                }
                match self.core.handle_report(now, &report) {
                    Ok(()) => self.counters.reports += 1,
                    Err(e) => self.note("report", &report.agent, &e),
                }
            }
            Input::Ack { conn, ack, .. } => {
                if !self.conns.contains_key(&conn) {
                    return;
                }
                match self.core.handle_ack(now, &ack) {
                    Ok(()) => self.counters.acks += 1,
                    Err(e) => self.note("ack", &ack.agent, &e),
                }
            }
            Input::Disconnect { conn, agent } => {
                self.conns.remove(&conn);
                if self
                    .routes
                    .get(agent.as_str())
                    .is_some_and(|r| r.conn == conn)
                {
                    self.routes.remove(agent.as_str());
                    let _ = self.core.handle_disconnect(now, &agent);
                }
            }
            Input::Snapshot { reply } => {
                let _ = reply.send(self.snapshot());
            }
            Input::Reload { rules, reply } => {
                let _ = reply.send(self.reload(now, rules));
            }
        }
    }

    /// Applies new rules, or records why not (the rules in force stay unchanged).
    fn reload(
        &mut self,
        now: u64,
        rules: Result<bursar_agent::Config, String>,
    ) -> Result<Reloaded, String> {
        let rules = match rules {
            Ok(r) => r,
            Err(e) => {
                let msg = format!(
                    "{e}; the rules in force (version {}) are unchanged",
                    self.config_version
                );
                eprintln!("bursar-allocator: reload refused: {msg}");
                self.reload.failed += 1;
                self.reload.last_error = Some(msg.clone());
                return Err(msg);
            }
        };
        let summary = self.core.reload(now, &rules);
        let version = super::config_version(&rules);
        let previous_version = std::mem::replace(&mut self.config_version, version.clone());
        self.reload.applied += 1;
        self.reload.last_error = None;
        self.reload.last_applied = Some(summary.to_string());
        eprintln!(
            "bursar-allocator: rules reloaded (version {previous_version} -> {version}): {summary}"
        );
        if version != previous_version {
            // Agents log a mismatch with their own rules (they reload on their own).
            let msg = pb::AllocatorMessage {
                msg: Some(pb::allocator_message::Msg::ConfigVersion(
                    pb::ConfigVersion {
                        version: version.clone(),
                    },
                )),
            };
            for r in self.routes.values() {
                if r.tx.try_send(Ok(msg.clone())).is_ok() {
                    self.reload.versions_sent += 1;
                }
            }
        }
        Ok(Reloaded {
            version,
            previous_version,
            summary,
        })
    }

    fn snapshot(&self) -> Snapshot {
        // The first `admin_max_keys` keys the core lists (not all of them: the core
        // task must not stall on a million keys), sorted by name.
        let mut names: Vec<_> = self
            .core
            .key_names()
            .take(self.admin_max_keys)
            .cloned()
            .collect();
        names.sort();
        let truncated = self.core.key_count() > names.len();
        Snapshot {
            term: self.core.term(),
            learning: self.core.is_learning(),
            agents: self.core.agent_count(),
            connected: self.routes.len(),
            key_count: self.core.key_count(),
            keys: names
                .iter()
                .filter_map(|k| self.core.key_status(k))
                .collect(),
            truncated,
            counters: ShellCounters {
                // Also those the core could not queue (its queue was full).
                measures_dropped: self.counters.measures_dropped + self.core.measures_dropped(),
                unknown_handles_dropped: self.counters.unknown_handles_dropped
                    + self.core.unknown_handles_dropped(),
                revocations_dropped: self.counters.revocations_dropped
                    + self.core.revocations_dropped(),
                ..self.counters
            },
            last_error: self.last_error.clone(),
            config_version: self.config_version.clone(),
            rules: self.core.rules().collect(),
            reload: self.reload.clone(),
            ignored_lines: self.core.ignored_lines(),
            agents_evicted: self.core.agents_evicted(),
            gate: self.gate.status(),
        }
    }

    /// Sends drained grants, batched per agent, on the right incarnation's stream, then
    /// the revocations (after any grant they revoke), the lease extensions (after the
    /// grants they may cover; either order is safe), then the measure requests and
    /// unknown-handle notices (as the simulator, which replays this order).
    fn route(&mut self) {
        self.route_grants();
        if self.core.pending_revocations() > 0 {
            for r in self.core.drain_revocations() {
                let keys: Vec<pb::Key> = r
                    .keys
                    .iter()
                    .map(|k| pb::Key {
                        rule: k.rule.clone(),
                        values: k.values.clone(),
                    })
                    .collect();
                for chunk in message_chunks(&keys, keys.len(), GRANTS_BYTES_MAX) {
                    let n = chunk.len() as u64;
                    let msg = pb::allocator_message::Msg::Revoke(pb::Revoke {
                        epoch: r.epoch,
                        through_seq: r.through_seq,
                        keys: chunk.to_vec(),
                    });
                    if self.send_on_stream(&r.agent, r.incarnation, msg) {
                        self.counters.revocations_sent += n;
                    } else {
                        self.counters.revocations_dropped += n;
                        // Told again when the agent next names those keys with a grant.
                        self.core.revocations_undelivered(&r.agent);
                    }
                }
            }
        }
        if self.core.pending_extensions() > 0 {
            for x in self.core.drain_extensions() {
                let msg = pb::allocator_message::Msg::LeaseExtension(pb::LeaseExtension {
                    epoch: x.epoch,
                    through_seq: x.through_seq,
                    lease_expires_at_ns: x.lease_expires_at_ns,
                });
                if self.send_on_stream(&x.agent, x.incarnation, msg) {
                    self.counters.extensions_sent += 1;
                } else {
                    self.counters.extensions_dropped += 1;
                }
            }
        }
        if self.core.pending_measure_requests() > 0 {
            for m in self.core.drain_measure_requests() {
                let n = m.key_handles.len() as u64;
                let msg = pb::allocator_message::Msg::MeasureRequest(pb::MeasureRequest {
                    key_handles: m.key_handles,
                    window_ms: m.window_ms,
                });
                if self.send_on_stream(&m.agent, m.incarnation, msg) {
                    self.counters.measures_sent += n;
                } else {
                    self.counters.measures_dropped += n;
                }
            }
        }
        if self.core.pending_unknown_handles() > 0 {
            for u in self.core.drain_unknown_handles() {
                let n = u.key_handles.len() as u64;
                let msg = pb::allocator_message::Msg::UnknownKeys(pb::UnknownKeys {
                    key_handles: u.key_handles,
                });
                if self.send_on_stream(&u.agent, u.incarnation, msg) {
                    self.counters.unknown_handles_sent += n;
                } else {
                    self.counters.unknown_handles_dropped += n;
                }
            }
        }
    }

    /// Queues one message on the stream of `agent`'s incarnation `incarnation`: false
    /// if that incarnation has no stream or its queue is full.
    fn send_on_stream(
        &self,
        agent: &str,
        incarnation: u64,
        msg: pb::allocator_message::Msg,
    ) -> bool {
        match self.routes.get(agent) {
            Some(r) if r.incarnation == incarnation => {
                r.tx.try_send(Ok(pb::AllocatorMessage { msg: Some(msg) }))
                    .is_ok()
            }
            _ => false,
        }
    }

    fn route_grants(&mut self) {
        if self.core.pending_grants() == 0 {
            return;
        }
        let (routes, batch, counters) = (&self.routes, &mut self.batch, &mut self.counters);
        self.core.for_each_grant(|g| match routes.get(&**g.agent) {
            Some(r) if r.incarnation == g.incarnation => {
                batch
                    .entry(g.agent_index)
                    .or_insert_with(|| (Arc::clone(g.agent), Vec::new()))
                    .1
                    .push(grant_to_pb(&g));
            }
            _ => counters.grants_dropped += 1,
        });
        let max = self.core.config().max_keys_per_message.max(1);
        for (_, (agent, grants)) in self.batch.drain() {
            let Some(r) = self.routes.get(&agent) else {
                continue;
            };
            let (mut closed, mut dropped) = (false, false);
            for chunk in message_chunks(&grants, max, GRANTS_BYTES_MAX) {
                let n = chunk.len() as u64;
                let msg = pb::AllocatorMessage {
                    msg: Some(pb::allocator_message::Msg::Grants(pb::Grants {
                        grants: chunk.to_vec(),
                    })),
                };
                match r.tx.try_send(Ok(msg)) {
                    Ok(()) => self.counters.grants_sent += n,
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        self.counters.grants_dropped += n;
                        dropped = true;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        self.counters.grants_dropped += n;
                        closed = true;
                    }
                }
            }
            if closed {
                // The stream is gone: the core hears of it here too (the reader's
                // `Disconnect` finds no route after this, and a hello whose handler was
                // cancelled started no reader at all), or it would count the agent
                // connected, and grow its grants, for up to a lease.
                // Its reports still queued are read no further either: one handled
                // after this marked the agent connected again, and its `Disconnect`
                // then found no route, so the core never heard it go (the id never
                // evicted, a restart refused as a duplicate, grants sent nowhere).
                if let Some(r) = self.routes.remove(&agent) {
                    self.conns.remove(&r.conn);
                }
                let now = self.clock.now_ns();
                let _ = self.core.handle_disconnect(now, &agent);
            } else if dropped {
                // The stream lives on, but the names those grants carried did not
                // reach it.
                self.core.grants_undelivered(&agent);
            }
        }
    }
}

/// Most encoded bytes of grants in one `Grants` message: the protocol's bound less
/// room for the message's own framing.
const GRANTS_BYTES_MAX: usize = pb::MAX_MESSAGE_BYTES - 64 * 1024;

/// `grants` in runs of at most `max` grants and `max_bytes` encoded bytes each (one
/// grant per run at least). A key count alone is not a bound: a grant naming a key of
/// 16 `*` values of 256 bytes is ~4 KiB, and 10,000 of them would be ten times what
/// the agent's end accepts.
fn message_chunks<T: bursar_proto::prost::Message>(
    items: &[T],
    max: usize,
    max_bytes: usize,
) -> impl Iterator<Item = &[T]> {
    let mut rest = items;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let (mut n, mut bytes) = (0, 0);
        while n < rest.len() && n < max.max(1) {
            // The field's tag and length prefix: at most 1 + 3 bytes here.
            let b = bursar_proto::prost::Message::encoded_len(&rest[n]) + 4;
            if n > 0 && bytes + b > max_bytes {
                break;
            }
            bytes += b;
            n += 1;
        }
        let (run, tail) = rest.split_at(n);
        rest = tail;
        Some(run)
    })
}

/// A core grant as a wire grant.
pub fn grant_to_pb(g: &GrantRef<'_>) -> pb::Grant {
    pb::Grant {
        // By handle alone once the stream has had the name (`GrantRef::named`): no
        // strings to copy.
        key: g.named.then(|| pb::Key {
            rule: g.key.rule.clone(),
            values: g.key.values.clone(),
        }),
        rate: g.rate,
        burst: g.burst,
        epoch: g.epoch,
        seq: g.seq,
        lease_expires_at_ns: g.lease_expires_at_ns,
        fleet_size: g.fleet_size,
        transfer_tokens: g.transfer_tokens,
        key_handle: g.key_handle,
    }
}

/// Longest refusal note logged and kept as `last_error`, in bytes.
const NOTE_MAX: usize = 1024;

/// `msg` cut to [`NOTE_MAX`] bytes (at a character boundary) with the length it had:
/// a refusal names what the agent sent (its id, key names), up to 4 MiB, and
/// in its debug form up to five times that, written to stderr from the core task for
/// every such message.
fn bounded_note(msg: &str) -> String {
    if msg.len() <= NOTE_MAX {
        return msg.to_string();
    }
    let mut end = NOTE_MAX;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &msg[..end], msg.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grant that found its agent's stream closed removed the route but left the
    /// stream readable: a report of it handled after that marked the agent connected
    /// again, and its Disconnect then found no route, so the core never heard it go (a
    /// restart was refused as a duplicate for `agent_silence_ms`). The stream is read
    /// no further now.
    #[test]
    fn a_stream_found_closed_by_a_grant_is_read_no_further() {
        use crate::testing::{hello, key, line, report, warm_allocator};
        let clock = crate::shell::ShellClock {
            start: std::time::Instant::now() - std::time::Duration::from_secs(100),
        };
        let now = clock.now_ns();
        let gate = Arc::new(Gate::new(1 << 20, 4, 4, std::time::Duration::from_secs(10)));
        let mut d = Driver::new(warm_allocator(1, now), clock, "v".into(), 100, None, gate);
        let (tx, rx) = mpsc::channel(64);
        let (reply, _answer) = oneshot::channel();
        d.handle(Input::Hello {
            conn: 1,
            hello: hello("a", 1, now),
            tx,
            reply,
            charge: Charge::NONE,
        });
        assert_eq!(d.counters.hellos, 1);
        drop(rx);
        let rep = |t: u64, n: u64| Input::Report {
            conn: 1,
            report: report("a", 1, t, vec![line(key("rps", "x"), 0, n, None)]),
            charge: Charge::NONE,
        };
        d.handle(rep(now + 1, 5));
        let t0 = std::time::Instant::now();
        while d.core.pending_grants() == 0 {
            assert!(t0.elapsed().as_secs() < 5, "no grant");
            std::thread::sleep(std::time::Duration::from_millis(10));
            d.core.handle_timeout(d.clock.now_ns());
        }
        d.route();
        assert!(
            d.counters.grants_dropped > 0,
            "the grant found the stream closed"
        );
        // A report of that stream still queued, then its Disconnect.
        d.handle(rep(now + 2, 9));
        d.handle(Input::Disconnect {
            conn: 1,
            agent: "a".into(),
        });
        // The agent is gone to the core: its restart (a new incarnation) is welcomed.
        let (tx2, _rx2) = mpsc::channel(64);
        let (reply2, answer2) = oneshot::channel();
        d.handle(Input::Hello {
            conn: 2,
            hello: hello("a", 2, d.clock.now_ns()),
            tx: tx2,
            reply: reply2,
            charge: Charge::NONE,
        });
        let r = answer2.blocking_recv().unwrap();
        assert!(r.is_ok(), "{r:?}");
    }

    /// A refusal's note named the agent's id in debug form: a 4 MiB id of control
    /// bytes wrote ~20 MiB to stderr from the core task per hello, and kept it as
    /// `last_error`. Notes are cut to 1 KiB, at a character boundary.
    #[test]
    fn a_refusal_note_is_cut_to_a_kib() {
        let id = "\u{1}é".repeat(2 << 20);
        let note = bounded_note(&format!("hello from {id:?}: invalid agent id"));
        assert!(note.len() <= NOTE_MAX + 40, "{}", note.len());
        assert!(
            note.ends_with("bytes in all)"),
            "{}",
            &note[note.len() - 40..]
        );
        assert_eq!(bounded_note("short"), "short");
    }

    fn named(values: usize) -> pb::Grant {
        pb::Grant {
            key: Some(pb::Key {
                rule: "r".repeat(200),
                values: (0..values).map(|_| "v".repeat(256)).collect(),
            }),
            rate: u64::MAX,
            burst: u64::MAX,
            ..Default::default()
        }
    }

    /// Review (twenty-fifth session's open item): grants were split by count alone, so
    /// 10,000 first grants naming long keys made one message of ~40 MiB, which the
    /// agent's end refuses, breaking its stream at every reconnect.
    #[test]
    fn grants_of_long_names_are_split_under_the_byte_bound() {
        let grants: Vec<pb::Grant> = (0..10_000).map(|_| named(16)).collect();
        let runs: Vec<&[pb::Grant]> = message_chunks(&grants, 10_000, GRANTS_BYTES_MAX).collect();
        assert!(runs.len() > 9, "{} messages", runs.len());
        assert_eq!(runs.iter().map(|r| r.len()).sum::<usize>(), 10_000);
        for run in &runs {
            let m = pb::AllocatorMessage {
                msg: Some(pb::allocator_message::Msg::Grants(pb::Grants {
                    grants: run.to_vec(),
                })),
            };
            let len = bursar_proto::prost::Message::encoded_len(&m);
            assert!(
                len <= pb::MAX_MESSAGE_BYTES,
                "{} grants: {len} bytes",
                run.len()
            );
        }
        // Small grants still go by the count; one over the byte bound still goes alone.
        let small: Vec<pb::Grant> = (0..25).map(|_| pb::Grant::default()).collect();
        let sizes: Vec<usize> = message_chunks(&small, 10, GRANTS_BYTES_MAX)
            .map(<[pb::Grant]>::len)
            .collect();
        assert_eq!(sizes, vec![10, 10, 5]);
        let huge = [named(16), named(16)];
        assert_eq!(message_chunks(&huge, 10, 100).count(), 2);
        assert_eq!(message_chunks::<pb::Grant>(&[], 10, 100).count(), 0);
    }
}
