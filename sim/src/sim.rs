//! The discrete-event core: simulated links, agents that are real
//! [`bursar_agent::Engine`]s driven the way the agent's sync client drives them, the
//! real [`bursar_allocator::Allocator`], and the checker. Event queues ordered by
//! `(time, seq)`: the workload's, the allocator's side's (`side.rs`) and one per shard
//! of the gateways (`shard.rs`), run in rounds no longer than the shortest link's
//! latency, on one thread or two.
//!
//! Nothing here reads a clock or an unseeded source of randomness: a scenario and a
//! seed give the same [`Report`] bit for bit, on one thread or two.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt::Write as _;
use std::sync::Arc;

use bursar_agent::engine::KeyDemand;
use bursar_agent::sync_core::{Ack as SyncAck, Held, Line};
use bursar_agent::sync_session::{MeasureMark, Outgoing, SessionConfig, SyncSession};
use bursar_agent::{
    AdmitRequest, CompletionStatus, Config, Cost, Decision, DiscardSink, Engine, SliceExtension,
    Usage,
};
use bursar_allocator::{
    Ack, AllocError, Allocator, AllocatorConfig, Grant, HeldGrant, HeldSlice, Hello, KeyName,
    KeyReport, LeaseExtension, Measure, MeasureRequest, Report as AllocReport, SliceAck,
    UnknownHandles,
};
use serde::Serialize;

use crate::policy::{POLICIES, Policy, Proportional};
use crate::rng::Rng;
use crate::scenario::{FaultKind, NetworkSpec, Overrides, Scenario, WorkloadKind};
use crate::wire;

mod shard;
mod side;
mod workload;
use shard::{KeyInfo, Offer, SHARDS, Shard, Shared};
use side::{AllocSide, Net};
use workload::Workload;
pub(crate) use workload::mean_cost;

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;
/// The rule every key is limited by.
const RULE: &str = "tenant";
/// Each engine's `max_leases`: reservations in flight at once on one gateway (an LLM-like
/// request holds one until it completes). The agent's default (65,536) reserves memory
/// up front for each of possibly thousands of engines; a run that needs more fails with
/// `admit refused ... LeaseTableFull` as a violation, never silently.
const LEASES_MAX: usize = 16_384;
/// Each engine's `max_tombstones`: finished request ids remembered to recognise a
/// duplicate completion. The simulator never repeats a request id, so this bounds
/// memory only (the default, 262,144, made `Engine::new` a fifth of a 1,000-gateway
/// run's time and most of its 1.2 GB).
const TOMBSTONES_MAX: usize = 4_096;
/// How often the checker samples the allocator's bound and checks invariants.
const SAMPLE_NS: u64 = 50 * MS;
/// Allocator entries checked per sample, on average (see `Sim::sample`).
const CHECK_ENTRIES_PER_SAMPLE: usize = 50_000;
/// How often each agent runs `Engine::maintain` (the agent shell's period).
const MAINTAIN_NS: u64 = 100 * MS;
/// Window over which the fleet's admitted rate is compared with the ideal bucket's
/// after a shift (realloc time).
const REALLOC_WINDOW_NS: u64 = 250 * MS;
/// Resolution of the per-key admitted histories (shift workloads only).
const BIN_NS: u64 = 50 * MS;
/// How long an agent waits for the welcome after its hello before it gives the
/// stream up and backs off (the sync client's default `connect_timeout`).
const CONNECT_TIMEOUT_NS: u64 = 2 * SEC;
/// The HTTP/2 keep-alive of both ends of a stream (the sync client's and the
/// allocator's shell's settings): a ping every 2 s, the stream given up when one goes
/// unanswered for 5 s.
const KEEPALIVE_INTERVAL_NS: u64 = 2 * SEC;
const KEEPALIVE_TIMEOUT_NS: u64 = 5 * SEC;
/// Most violation messages kept in a report (the count is exact).
const VIOLATIONS_KEPT_MAX: usize = 20;
/// Most keys listed individually in a report (the worst by overshoot).
const KEYS_LISTED_MAX: usize = 10;

/// The simulator could not start (operator error; nothing ran).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The rules built from the scenario were refused by the agent's config parser.
    #[error("rules refused: {0}")]
    Rules(String),
    /// The allocator refused its settings.
    #[error("allocator settings refused: {0}")]
    Allocator(String),
    /// The policy is not built.
    #[error("policy `{0}` is not built (built: {list})", list = POLICIES.iter().map(|p| p.0).collect::<Vec<_>>().join(", "))]
    Policy(String),
}

/// The result of one run. Deterministic: no wall-clock figures in it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Seed.
    pub seed: u64,
    /// Allocation policy (`bursar`: the real allocator; see [`crate::policy`]).
    pub policy: String,
    /// Gateways simulated.
    pub gateways: usize,
    /// Keys simulated.
    pub keys: usize,
    /// Virtual seconds of traffic.
    pub duration_s: f64,
    /// The figures.
    pub summary: Summary,
    /// The keys with the largest measured overshoot (at most 10).
    pub worst_keys: Vec<KeyOutcome>,
    /// Counters.
    pub counters: Counters,
    /// The first violations, in order (the count is `summary.violations`).
    pub violation_messages: Vec<String>,
}

/// The headline figures.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    /// Largest verifier deficit over all keys, as a fraction of `B`.
    pub overshoot_max_fraction_of_burst: f64,
    /// Largest bound over all keys, as a fraction of `B` (the allocator's stated
    /// bound, integrated over the run; see docs/simulation.md).
    pub bound_fraction_of_burst: f64,
    /// Fleet admitted over what one ideal zero-latency global bucket admitted.
    pub utilization_vs_ideal: f64,
    /// The same over the second half of the run only (requests offered from its
    /// middle on): the steady state, without the start, where the ideal bucket starts
    /// full and every agent starts empty (invariant 2), so the fleet gives up `B`.
    pub utilization_second_half: f64,
    /// 95th percentile of the time, after a demand shift, until the fleet admits 95 %
    /// of what the ideal bucket admits over a 250 ms window (shift workloads only).
    pub realloc_p95_ms: Option<f64>,
    /// Jain's index over keys of admitted / ideal admitted (`None` with one key).
    pub jain_fairness: Option<f64>,
    /// 95th percentile of the time from a key's first request to its first admission
    /// (a key never admitted counts the time to the run's end: a lower bound).
    pub cold_first_admit_p95_ms: Option<f64>,
    /// Messages (both ways, and peer to peer) per agent per virtual second of
    /// traffic (sent from the start of traffic on, over its duration: the warm-up
    /// before it is left out, as its length follows the lease).
    pub control_messages_per_agent_per_s: f64,
    /// Their encoded size ([`crate::wire`]: protobuf plus gRPC's prefix, no HTTP/2,
    /// TLS or TCP overhead), bytes per agent per virtual second of traffic.
    pub control_bytes_per_agent_per_s: f64,
    /// Keys whose overshoot exceeded their bound, plus failed invariant checks.
    pub violations: u64,
}

/// One key's outcome.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KeyOutcome {
    /// The key.
    pub key: String,
    /// Largest verifier deficit, tokens.
    pub overshoot_tokens: f64,
    /// The stated bound, tokens.
    pub bound_tokens: f64,
    /// Tokens offered.
    pub offered: u64,
    /// Tokens the fleet admitted.
    pub admitted: u64,
    /// Tokens the ideal bucket admitted.
    pub ideal_admitted: u64,
}

/// What happened, counted.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Counters {
    /// Events processed.
    pub events: u64,
    /// Requests offered.
    pub requests: u64,
    /// Messages agents sent (hello, report, ack).
    pub to_allocator: u64,
    /// Messages the allocator sent (each a batch of grants for one agent stream).
    pub to_agents: u64,
    /// Grants in those messages.
    pub grants: u64,
    /// Lease extensions the allocator sent (one message each, in `to_agents` too).
    pub extensions: u64,
    /// Measure requests the allocator sent (one message each, in `to_agents` too).
    pub measure_requests: u64,
    /// Hit batches agents sent each other (the Gubernator-like policy).
    pub peer: u64,
    /// Encoded bytes of `to_allocator` messages ([`crate::wire`]).
    pub to_allocator_bytes: u64,
    /// Encoded bytes of `to_agents` messages.
    pub to_agents_bytes: u64,
    /// Encoded bytes of `peer` messages.
    pub peer_bytes: u64,
    /// Messages lost (loss, partition, a dead peer).
    pub lost: u64,
    /// Grants the engines refused (stale, lease already ended).
    pub grants_refused: u64,
    /// Completions the engines refused (the reservation had expired).
    pub completions_refused: u64,
    /// Allocator refusals by error (unknown agent after a restart, stale reports...).
    pub allocator_refusals: BTreeMap<String, u64>,
    /// Streams agents opened (hellos sent).
    pub streams_opened: u64,
    /// Streams agents gave up or lost: refused (the allocator down, or its answer an
    /// error), no welcome within the connect timeout, or broken by an allocator crash.
    /// Each is followed by the client's backoff and another hello.
    pub streams_lost: u64,
    /// Running agents whose stream to the allocator is up when the run ends (under a
    /// policy with an allocator: every running agent, once faults have healed).
    pub streams_up_at_end: u64,
}

impl Counters {
    /// Adds `other`'s counts to these.
    fn absorb(&mut self, other: Counters) {
        let Counters {
            events,
            requests,
            to_allocator,
            to_agents,
            grants,
            extensions,
            measure_requests,
            peer,
            to_allocator_bytes,
            to_agents_bytes,
            peer_bytes,
            lost,
            grants_refused,
            completions_refused,
            allocator_refusals,
            streams_opened,
            streams_lost,
            streams_up_at_end,
        } = other;
        self.events += events;
        self.requests += requests;
        self.to_allocator += to_allocator;
        self.to_agents += to_agents;
        self.grants += grants;
        self.extensions += extensions;
        self.measure_requests += measure_requests;
        self.peer += peer;
        self.to_allocator_bytes += to_allocator_bytes;
        self.to_agents_bytes += to_agents_bytes;
        self.peer_bytes += peer_bytes;
        self.lost += lost;
        self.grants_refused += grants_refused;
        self.completions_refused += completions_refused;
        self.streams_opened += streams_opened;
        self.streams_lost += streams_lost;
        self.streams_up_at_end += streams_up_at_end;
        for (k, n) in allocator_refusals {
            *self.allocator_refusals.entry(k).or_default() += n;
        }
    }
}

/// Resolution of the admitted-rate series ([`Series`]).
pub const SERIES_BIN_NS: u64 = 100 * MS;
/// Keys whose overshoot, bound and slices [`Series`] records (the first ones).
pub const SERIES_KEYS_MAX: usize = 8;
/// Agents whose slices [`Series`] records (the first ones).
pub const SERIES_AGENTS_MAX: usize = 32;

/// Time series of one run, for charts (`--plot`). Recorded only when asked for; times
/// are seconds since traffic started.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    /// One key's `R`, tokens per second.
    pub rate_per_s: f64,
    /// The sum of every key's `R`, tokens per second.
    pub limit_rate_per_s: f64,
    /// Width of the admitted bins, s.
    pub bin_s: f64,
    /// Tokens offered per bin, all keys.
    pub offered: Vec<u64>,
    /// Tokens the fleet admitted per bin, all keys.
    pub admitted: Vec<u64>,
    /// Tokens the ideal bucket admitted per bin, all keys.
    pub ideal: Vec<u64>,
    /// Sample times (every 50 ms), s.
    pub sample_s: Vec<f64>,
    /// The first [`SERIES_KEYS_MAX`] keys.
    pub keys: Vec<KeySeries>,
    /// Agents whose slices are recorded (the first [`SERIES_AGENTS_MAX`]).
    pub agents: Vec<String>,
}

/// One key's series, one value per sample.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeySeries {
    /// The key.
    pub name: String,
    /// `B`, tokens.
    pub burst: u64,
    /// The verifier's deficit now, tokens (0 when not in deficit).
    pub deficit: Vec<f64>,
    /// The deepest deficit so far (the measured overshoot), tokens.
    pub overshoot: Vec<f64>,
    /// The bound stated over the verifier's current window (since it was last full),
    /// tokens.
    pub bound: Vec<f64>,
    /// Per recorded agent, the slice rate its engine holds for the key (tokens/s; 0
    /// when it holds none or is down).
    pub slices: Vec<Vec<u64>>,
}

/// An exact token bucket in token-nanoseconds (no rounding).
#[derive(Clone, Debug)]
struct Exact {
    level: i128,
    cap: i128,
    rate: i128,
    at: u64,
    min_level: i128,
}

impl Exact {
    fn full(rate_per_s: u64, burst: u64, at: u64) -> Exact {
        let cap = burst as i128 * SEC as i128;
        Exact {
            level: cap,
            cap,
            rate: rate_per_s as i128,
            at,
            min_level: cap,
        }
    }

    fn refill(&mut self, now: u64) {
        let dt = now.saturating_sub(self.at) as i128;
        self.level = (self.level + self.rate * dt).min(self.cap);
        self.at = self.at.max(now);
    }

    /// The verifier: debits whatever was admitted, past zero if need be.
    fn debit(&mut self, now: u64, cost: u64) {
        self.refill(now);
        self.level -= cost as i128 * SEC as i128;
        self.min_level = self.min_level.min(self.level);
    }

    /// Whether the bucket is at capacity at `now` (before any debit then): a
    /// deficit after this point is measured over a window starting here.
    fn is_full(&mut self, now: u64) -> bool {
        self.refill(now);
        self.level >= self.cap
    }

    /// The deficit now, tokens (0 when not in deficit), without refilling.
    fn deficit_level(&self) -> f64 {
        (-self.level).max(0) as f64 / SEC as f64
    }

    /// The ideal limiter: admits if the cost fits.
    fn try_take(&mut self, now: u64, cost: u64) -> bool {
        self.refill(now);
        let c = cost as i128 * SEC as i128;
        if self.level >= c {
            self.level -= c;
            true
        } else {
            false
        }
    }

    fn deficit_tokens(&self) -> f64 {
        (-self.min_level).max(0) as f64 / SEC as f64
    }

    fn deficit_now_tokens(&mut self, now: u64) -> f64 {
        self.refill(now);
        (-self.level).max(0) as f64 / SEC as f64
    }
}

impl KeyState {
    /// Debits an admission from the verifier, noting the window its deficit (if any)
    /// is measured over.
    fn verify(&mut self, now: u64, cost: u64) {
        let allowance = self.allowance_at(now);
        if self.verifier.is_full(now) {
            self.base = allowance - self.bound_burst as f64;
            self.tight = self.base;
        } else {
            // A window may start here as well, at the level the verifier holds now: the
            // excess over `[now, t]` is `level(now) - level(t) - B`, allowed
            // `allowance(t) - allowance(now) + burst(now)`, so a deficit at `t` is held
            // to `allowance(t) - (allowance(now) - burst(now) + level(now) - B)`. The
            // largest such start term since the verifier was last full is the tightest
            // window (windows from before it are never tighter).
            let level = (self.verifier.level - self.verifier.cap) as f64 / SEC as f64;
            let h = allowance - self.bound_burst as f64 + level;
            if h > self.tight {
                self.tight = h;
            }
        }
        self.verifier.debit(now, cost);
        let d = self.verifier.deficit_level();
        if d > 0.0 {
            self.window_worst = self.window_worst.max(d + self.tight);
            // Checked against `allowance` at the next sample: the accrual up to now,
            // at the last sample's rate, comes off here.
            let accrued = allowance - self.allowance;
            self.window_worst_here = self.window_worst_here.max(d + self.tight - accrued);
        }
    }

    /// The allowance at `now`, between samples: the last sample's, plus its rate since.
    fn allowance_at(&self, now: u64) -> f64 {
        let since = now.saturating_sub(self.sampled_at) as f64;
        self.allowance + self.bound_rate as f64 * since / SEC as f64
    }
}

struct KeyState {
    name: KeyName,
    value: String,
    verifier: Exact,
    ideal: Exact,
    offered: u64,
    admitted: u64,
    ideal_admitted: u64,
    /// Admitted by the fleet and by the ideal bucket from the middle of the run on.
    late_admitted: u64,
    late_ideal_admitted: u64,
    first_offer: Option<u64>,
    first_admit: Option<u64>,
    /// The stated bound accumulated so far, tokens: the excess rate's integral plus
    /// every rise of the stated burst.
    allowance: f64,
    /// `allowance` (as of that instant, see `allowance_at`) less the burst then in
    /// force, when the verifier was last full (seen at the first debit after): a
    /// deficit is allowed `allowance - base`, what the bound states over its window
    /// (since the bucket was last full: the excess rate's integral, the burst in
    /// force then and every rise since).
    base: f64,
    /// The tightest window's start term since the verifier was last full (`base` at
    /// that instant, then the largest `allowance - burst + level - B` at a debit since):
    /// what a deficit is checked against. (Until the thirtieth session only `base`: a
    /// verifier that stayed in deficit under load never was full again, and an
    /// allowance stated long before, unused, covered a later breach.)
    tight: f64,
    /// Since the last sample, the largest `deficit + tight` at a debit (`-inf`: none):
    /// checked against the allowance as the sample ends, when that sample raised the
    /// stated rate or burst (the rise is credited to the whole interval).
    window_worst: f64,
    /// The same less the allowance accrued at the last sample's rate between it and
    /// each debit: checked against the last sample's allowance when the next sample
    /// states no rise, so a window is allowed its own accrual, not the interval's.
    window_worst_here: f64,
    /// When the last sample was taken (virtual ns): `allowance` and `bound_rate` are
    /// as of then.
    sampled_at: u64,
    /// The largest `allowance - base` at any sample: the bound stated over a window.
    window_bound_max: f64,
    /// The most a window's deepest deficit exceeded the allowance as of the sample
    /// ending the window (tokens; > 0 is a violation). A deficit is held to the bound
    /// accumulated by its time, not by the end of the run: comparing the run's deepest
    /// deficit with the run's whole allowance let a bound stated later (a partition
    /// after the deficit, an overdraft accruing) cover an earlier breach.
    worst_excess: f64,
    bound_rate: u64,
    bound_burst: u64,
    /// Admitted per `BIN_NS` bin since traffic started: fleet, ideal (shift only).
    bins: Option<(Vec<u64>, Vec<u64>)>,
}

struct Agent {
    name: String,
    incarnation: u64,
    engine: Option<Engine>,
    /// Agent clock = offset + virtual time * (1 + drift_ppm / 1e6).
    offset: u64,
    /// This agent's clock-rate error, parts per million.
    drift_ppm: f64,
    /// The sync client's session and per-key bookkeeping: the code the agent's client
    /// runs (`bursar_agent::sync_session`), keys named by number. The simulator owns
    /// only the timers and the links.
    sync: SyncSession<u32>,
    /// A new-key poll is queued: the simulator queues one, at the agent's next tick of
    /// `new_key_poll_ms`, only when the session has something for it to do
    /// (`SyncSession::wants_poll`), where the client ticks every time.
    poll_pending: bool,
    next_request: u64,
    /// Phase within the interval of the timers that run whatever the stream (hit
    /// syncs, maintenance).
    phase: u64,
    /// Virtual time of the current stream's welcome: the client's report, new-key
    /// poll and keep-alive timers run from it.
    welcomed_at: u64,
    /// Earliest delivery time of the next message up its link (FIFO links; the
    /// allocator's side keeps the other direction's).
    up_free_at: u64,
    rng: Rng,
    id_buf: String,
    /// Cost admitted per key since the last hit sync (the Gubernator-like policy).
    hits: BTreeMap<u32, u64>,
}

impl Agent {
    /// The agent's clock at virtual time `t` (what its engine and reports run on).
    fn clock(&self, t: u64) -> u64 {
        let drift = (t as f64 * self.drift_ppm / 1e6) as i64;
        self.offset + t.saturating_add_signed(drift)
    }
}

enum ToAlloc {
    /// A hello, and which of the agent's streams it opens (the answer goes to that
    /// stream only).
    Hello(Hello, u64),
    Report(AllocReport),
    Ack(Ack),
    /// The agent's stream `stream` closed: the connection's close crossing the link
    /// (an agent that crashed or gave a stream up), or, `local`, the allocator's own
    /// HTTP/2 keep-alive giving up on a cut-off agent (no link to cross). As the
    /// allocator's shell, only the close of the stream that holds the agent's route
    /// (its last welcomed one) reaches `Allocator::handle_disconnect`.
    Disconnect {
        agent: String,
        stream: u64,
        local: bool,
    },
}

enum Ev {
    /// The workload's next request on key `.0` is due.
    Arrival(u32),
    /// The workload's rate on key `.0` may change.
    Rearm(u32),
    /// A request reaches gateway `.0`: key, input, reserved output, actual output.
    Request(u32, u32, u64, u64, u64),
    /// A message on the stream to the allocator of the given term.
    ToAlloc(u32, u64, Box<ToAlloc>),
    /// One grants message (one agent stream's batch).
    ToAgent(u32, Vec<Grant>),
    /// One lease extension (boxed: rare, and it would be the largest variant).
    ToAgentExt(u32, Box<LeaseExtension>),
    /// One measure request (boxed: rare).
    ToAgentMeasure(u32, Box<MeasureRequest>),
    ToAgentUnknown(u32, Box<UnknownHandles>),
    /// The allocator welcomes agent `.0`'s incarnation `.1` on its stream `.2`.
    ToAgentWelcome(u32, u64, u64),
    /// The allocator refused (or, down, could not take) agent `.0`'s incarnation `.1`'s
    /// stream `.2`.
    ToAgentRefused(u32, u64, u64),
    /// Agent `.0`'s incarnation `.1` gives its stream `.2` up if no welcome came.
    WelcomeTimeout(u32, u64, u64),
    /// Agent `.0`'s incarnation `.1` sends its stream `.2` an HTTP/2 keep-alive ping.
    KeepAlive(u32, u64, u64),
    /// No answer to that ping in time: the stream is gone.
    KeepAliveLost(u32, u64, u64),
    /// Agent `.0` (incarnation `.1`) ends its open measurement, if it is still due now.
    MeasureEnd(u32, u64),
    /// Agent `.0`'s incarnation `.1`'s report tick on its stream `.2` (the client's
    /// ticker runs from each welcome).
    Report(u32, u64, u64),
    NewKeyPoll(u32, u64),
    Maintain(u32, u64),
    Hello(u32, u64),
    AllocWake(u64),
    Sample,
    AllocCrash,
    AllocRestart,
    AgentCrash(u32),
    AgentRestart(u32),
    /// The Doorman-like policy's periodic recomputation.
    NaiveTick,
    /// The static policy's fixed slices for one agent incarnation.
    StaticSlices(u32, u64),
    /// An LLM-like request ends: agent, incarnation, key, request number, input,
    /// output.
    Complete(u32, u64, u32, u64, u64, u64),
    /// The Gubernator-like policy: agent `.0` (incarnation `.1`) sends its hits.
    HitSync(u32, u64),
    /// The Gubernator-like policy: agent `.1`'s hits (key, cost) reach agent `.0`.
    Hits(u32, u32, Arc<[(u32, u64)]>),
}

/// The gateway an event happens at, or is sent to (sent by, for messages to the
/// allocator); `None` for the workload's, the allocator's and global events.
fn agent_of(ev: &Ev) -> Option<u32> {
    match ev {
        Ev::Request(i, ..)
        | Ev::ToAlloc(i, ..)
        | Ev::ToAgent(i, _)
        | Ev::ToAgentExt(i, _)
        | Ev::ToAgentMeasure(i, _)
        | Ev::ToAgentUnknown(i, _)
        | Ev::ToAgentWelcome(i, ..)
        | Ev::ToAgentRefused(i, ..)
        | Ev::WelcomeTimeout(i, ..)
        | Ev::KeepAlive(i, ..)
        | Ev::KeepAliveLost(i, ..)
        | Ev::MeasureEnd(i, _)
        | Ev::Report(i, ..)
        | Ev::NewKeyPoll(i, _)
        | Ev::Maintain(i, _)
        | Ev::Hello(i, _)
        | Ev::AgentCrash(i)
        | Ev::AgentRestart(i)
        | Ev::StaticSlices(i, _)
        | Ev::Complete(i, ..)
        | Ev::HitSync(i, _)
        | Ev::Hits(i, _, _) => Some(*i),
        Ev::Arrival(_)
        | Ev::Rearm(_)
        | Ev::AllocWake(_)
        | Ev::Sample
        | Ev::AllocCrash
        | Ev::AllocRestart
        | Ev::NaiveTick => None,
    }
}

/// The event queue: a binary heap of 16-byte keys `(time, seq << 24 | slot)` over a
/// slab of events. Heap moves and comparisons touch only the keys (a heap of whole
/// events, 64 bytes each, spent 6.5 % of a fleet-scale run in `pop`, most of it moving
/// them); the order is `(time, seq)` exactly as before, `seq` being unique.
#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64)>>,
    events: Vec<Option<Ev>>,
    free: Vec<u32>,
    seq: u64,
}

/// Low bits of a queue key that name the event's slab slot.
const QUEUE_SLOT_BITS: u32 = 24;

impl Queue {
    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        let slot = match self.free.pop() {
            Some(i) => {
                self.events[i as usize] = Some(ev);
                i
            }
            None => {
                self.events.push(Some(ev));
                (self.events.len() - 1) as u32
            }
        };
        assert!(
            slot < 1 << QUEUE_SLOT_BITS && self.seq < 1 << (64 - QUEUE_SLOT_BITS),
            "more than 2^24 events pending or 2^40 scheduled"
        );
        self.heap
            .push(Reverse((at, self.seq << QUEUE_SLOT_BITS | slot as u64)));
    }

    /// The earliest event's time.
    fn peek_time(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// The earliest event and its time, if it is due before `limit` (a round's end).
    fn pop_before(&mut self, limit: u64) -> Option<(u64, Ev)> {
        if self.peek_time()? < limit {
            self.pop()
        } else {
            None
        }
    }

    /// The earliest event and its time.
    fn pop(&mut self) -> Option<(u64, Ev)> {
        let Reverse((at, key)) = self.heap.pop()?;
        let slot = (key & ((1 << QUEUE_SLOT_BITS) - 1)) as u32;
        let ev = self.events[slot as usize]
            .take()
            .expect("a queued slot holds its event");
        self.free.push(slot);
        Some((at, ev))
    }
}

/// One message's one-way delay on a link, ms: its base latency plus an exponential
/// jitter (drawn only when there is some, so that jitter-free links draw nothing).
fn delay_ms(n: &NetworkSpec, rng: &mut Rng) -> f64 {
    n.latency_ms
        + if n.jitter_ms > 0.0 {
            rng.exp(n.jitter_ms)
        } else {
            0.0
        }
}

/// One round's work for one thread: the allocator's side or a shard.
enum Task {
    Side(Box<AllocSide>),
    Shard(Box<Shard>),
    /// Draws the next round's requests (up to its `horizon`).
    Workload(Box<Workload>),
}

impl Task {
    fn run(&mut self, shared: &Shared, limit: u64) {
        match self {
            Task::Side(s) => s.run_until(limit),
            Task::Shard(s) => s.run_until(shared, limit),
            Task::Workload(w) => {
                let horizon = w.horizon;
                w.draw_until(shared, horizon);
            }
        }
    }
}

/// A round's tasks, shared out between two threads. Each task has a home thread
/// (the calling thread: the allocator's side, the workload and the first
/// [`HOME_SHARDS`] shards; the other thread: the other shards), so that what a task
/// allocates is mostly freed by the thread that allocated it (glibc's malloc locks the
/// arena of a chunk freed from another thread's) and stays in that core's caches; a
/// thread with nothing left at home takes the other's last task. Which thread runs
/// which changes nothing in the run.
#[derive(Default)]
struct Pool {
    todo: [std::sync::Mutex<Vec<Task>>; 2],
    done: std::sync::Mutex<Vec<Task>>,
}

/// Shards whose home is the calling thread (with the allocator's side and the
/// workload: together about half a round's work at fleet scale).
const HOME_SHARDS: usize = 2;

impl Pool {
    /// This round's tasks, to their home threads.
    fn set(&self, tasks: Vec<Task>) {
        let (mut home, mut away) = (Vec::new(), Vec::new());
        for t in tasks {
            match &t {
                Task::Shard(s) if s.index >= HOME_SHARDS => away.push(t),
                _ => home.push(t),
            }
        }
        // Taken from the end: each thread's first task first.
        home.reverse();
        away.reverse();
        *self.todo[0].lock().expect("no task panicked") = home;
        *self.todo[1].lock().expect("no task panicked") = away;
    }

    /// Runs thread `me`'s tasks, then the other's, until none is left.
    fn work(&self, me: usize, shared: &Shared, limit: u64) {
        loop {
            let next = self.todo[me].lock().expect("no task panicked").pop();
            let next = next.or_else(|| {
                let mut other = self.todo[1 - me].lock().expect("no task panicked");
                // The other thread's last task: it takes its own from the end.
                (!other.is_empty()).then(|| other.remove(0))
            });
            let Some(mut t) = next else {
                return;
            };
            t.run(shared, limit);
            self.done.lock().expect("no task panicked").push(t);
        }
    }

    fn take(&self) -> Vec<Task> {
        std::mem::take(&mut *self.done.lock().expect("no task panicked"))
    }
}

/// [`Sim::on_progress`]'s callback.
type ProgressFn = Box<dyn FnMut(Progress)>;

/// How far a run has got ([`Sim::on_progress`]).
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// Virtual seconds of traffic simulated (from the start of traffic).
    pub virtual_s: f64,
    /// The run's virtual duration of traffic, seconds.
    pub duration_s: f64,
    /// Events handled so far.
    pub events: u64,
}

/// Gateway-key pairs from which a run uses two threads by default ([`Sim::set_threads`]):
/// below it a run is over in seconds, and its rounds' hand-offs cost more than the
/// second thread saves.
const TWO_THREADS_MIN_PAIRS: usize = 100_000;

/// Threads a run of `sc` uses unless told ([`Sim::set_threads`]).
/// Per gateway, when the fault schedule has it down (`[from, to)` in engine time from
/// `t0`): crashed until it restarts, or not yet joined.
fn down_times(sc: &Scenario, t0: u64) -> Vec<Vec<(u64, u64)>> {
    let s_ns = |s: f64| t0 + (s * SEC as f64) as u64;
    let mut down = vec![Vec::new(); sc.gateways];
    for f in &sc.faults {
        let span = match f.kind {
            FaultKind::AgentCrash => (s_ns(f.at_s), s_ns(f.at_s + f.for_s)),
            FaultKind::AgentJoin => (0, s_ns(f.at_s)),
            _ => continue,
        };
        for &i in &f.agents {
            if let Some(d) = down.get_mut(i) {
                d.push(span);
            }
        }
    }
    down
}

/// Seconds that gateways were up within `[from, to)`, summed over gateways, given
/// each one's down spans ([`down_times`]; spans may overlap).
fn live_agent_seconds(down: &[Vec<(u64, u64)>], from: u64, to: u64) -> f64 {
    let mut total = 0u64;
    for spans in down {
        let mut cut: Vec<(u64, u64)> = spans
            .iter()
            .map(|&(a, b)| (a.max(from), b.min(to)))
            .filter(|(a, b)| a < b)
            .collect();
        cut.sort_unstable();
        let (mut down_ns, mut reach) = (0u64, from);
        for (a, b) in cut {
            let a = a.max(reach);
            if b > a {
                down_ns += b - a;
                reach = b;
            }
        }
        total += to.saturating_sub(from) - down_ns;
    }
    total as f64 / SEC as f64
}

fn default_threads(sc: &Scenario) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores >= 2 && sc.gateways.saturating_mul(sc.keys) >= TWO_THREADS_MIN_PAIRS {
        2
    } else {
        1
    }
}

/// One simulation: build it with [`Sim::new`], run it with [`Sim::run`].
pub struct Sim {
    seed: u64,
    /// The allocator's side (`side.rs`): here between rounds, on a thread during one.
    side: Option<Box<AllocSide>>,
    /// The agents' side in `SHARDS` shards (`shard.rs`): here between rounds. Boxed:
    /// each moves to a task and back every round, a pointer's copy.
    #[allow(clippy::vec_box)]
    shards: Vec<Box<Shard>>,
    /// The scenario, the rules, the network: what every part of the run reads.
    shared: Arc<Shared>,
    /// The workload (`workload.rs`): here between rounds, a task during one.
    workload: Option<Box<Workload>>,
    /// Events that read or change both sides (samples, allocator crashes and restarts):
    /// each runs between rounds.
    globals: Queue,
    /// Threads a run uses ([`Sim::set_threads`]).
    threads: usize,
    keys: Vec<KeyState>,
    now: u64,
    /// Traffic starts here (after the first term's learning lease).
    t0: u64,
    /// Sample number of the next check of the engines' invariants.
    next_engine_check: u64,
    end: u64,
    overdraft_rate: u64,
    counters: Counters,
    /// Control messages and bytes sent before traffic started (not in the rates).
    control_at_t0: (u64, u64),
    violations: u64,
    violation_messages: Vec<String>,
    demand_buf: Vec<KeyDemand>,
    /// Time series for `--plot`, when asked for ([`Sim::record_series`]).
    series: Option<Series>,
    /// [`Sim::on_progress`]'s callback and its interval of events.
    progress: Option<(u64, ProgressFn)>,
    samples: u64,
}

/// An agent's sync session from `now`, with the scenario's full-report cadence and
/// the client's default backoff (the report and poll timers are the simulator's).
fn session(now: u64, sc: &Scenario) -> SyncSession<u32> {
    SyncSession::new(
        now,
        SessionConfig {
            full_report_every: sc.allocator.full_report_every,
            ..SessionConfig::default()
        },
    )
}

impl Sim {
    /// Builds the fleet for a scenario and seed under a policy ([`POLICIES`]).
    pub fn new(sc: &Scenario, seed: u64, policy: &str) -> Result<Sim, SimError> {
        let policy = Policy::parse(policy).ok_or_else(|| SimError::Policy(policy.to_string()))?;
        let rules = format!(
            "[engine]\nslice_source = \"allocated\"\nmax_leases = {LEASES_MAX}\n\
             max_tombstones = {TOMBSTONES_MAX}\n\n[[rule]]\nname = \"{RULE}\"\n\
             match = {{ org = \"*\" }}\ndimension = \"{}\"\nrate = {}\n\
             per = \"second\"\nburst = {}\nposture = \"{}\"\ntypical_cost = {}\n",
            if sc.workload.llm {
                "total_tokens"
            } else {
                "input_tokens"
            },
            sc.limit.rate_per_s,
            sc.limit.burst,
            sc.limit.posture,
            sc.limit.typical_cost
        );
        let config = Config::from_toml(&rules).map_err(|e| SimError::Rules(e.to_string()))?;
        let mut acfg = sc.allocator.config(sc.gateways);
        // The allocator is told how far the scenario's clocks drift (it grants rates
        // that keep fast clocks within the limit).
        acfg.clock_drift_ppm = sc.clock_drift_ppm.ceil() as u32;
        let alloc = Allocator::new(&config, acfg.clone(), 1, 0)
            .map_err(|e| SimError::Allocator(e.to_string()))?;
        let rng = Rng::new(seed);
        let t0 = (sc.allocator.lease_ms + sc.allocator.reclaim_margin_ms + 200) * MS;
        let end = t0 + (sc.duration_s * SEC as f64) as u64;
        let report_ns = sc.allocator.report_interval_ms * MS;
        let agents: Vec<Agent> = (0..sc.gateways)
            .map(|i| {
                let mut r = rng.fork(1_000 + i as u64);
                Agent {
                    name: format!("gw-{i}"),
                    incarnation: 1,
                    engine: Some(Engine::new(config.clone(), Arc::new(DiscardSink))),
                    offset: 1_000 * SEC + r.below(3_600 * SEC),
                    // Drawn only when asked for, so that other scenarios' streams do not move.
                    drift_ppm: if sc.clock_drift_ppm > 0.0 {
                        sc.clock_drift_ppm * (2.0 * r.unit() - 1.0)
                    } else {
                        0.0
                    },
                    sync: session(0, sc),
                    poll_pending: false,
                    next_request: 0,
                    phase: r.below(report_ns),
                    welcomed_at: 0,
                    up_free_at: 0,
                    rng: r,
                    id_buf: String::new(),
                    hits: BTreeMap::new(),
                }
            })
            .collect();
        let bins_len = if sc.workload.kind == WorkloadKind::Shift {
            (end - t0).div_ceil(BIN_NS) as usize
        } else {
            0
        };
        let keys: Vec<KeyState> = (0..sc.keys)
            .map(|k| {
                let value = format!("t{k}");
                KeyState {
                    name: KeyName::new(RULE, &[&value]),
                    value,
                    verifier: Exact::full(sc.limit.rate_per_s, sc.limit.burst, t0),
                    ideal: Exact::full(sc.limit.rate_per_s, sc.limit.burst, t0),
                    offered: 0,
                    admitted: 0,
                    ideal_admitted: 0,
                    late_admitted: 0,
                    late_ideal_admitted: 0,
                    first_offer: None,
                    first_admit: None,
                    allowance: 0.0,
                    base: 0.0,
                    tight: 0.0,
                    window_worst: f64::NEG_INFINITY,
                    window_worst_here: f64::NEG_INFINITY,
                    sampled_at: 0,
                    window_bound_max: 0.0,
                    worst_excess: 0.0,
                    bound_rate: 0,
                    bound_burst: 0,
                    bins: (bins_len > 0).then(|| (vec![0; bins_len], vec![0; bins_len])),
                }
            })
            .collect();
        let mut zipf_cdf = Vec::new();
        if sc.workload.kind == WorkloadKind::Zipf {
            let mut acc = 0.0;
            for r in 1..=sc.gateways {
                acc += 1.0 / (r as f64).powf(sc.workload.zipf_s);
                zipf_cdf.push(acc);
            }
            for c in zipf_cdf.iter_mut() {
                *c /= acc;
            }
        }
        let s_ns = |s: f64| t0 + (s * SEC as f64) as u64;
        let partitions = sc
            .faults
            .iter()
            .filter(|f| f.kind == FaultKind::Partition)
            .map(|f| (s_ns(f.at_s), s_ns(f.at_s + f.for_s), f.agents.clone()))
            .collect();
        let allocator_cut = sc
            .faults
            .iter()
            .filter(|f| f.kind == FaultKind::AllocatorPartition)
            .map(|f| (s_ns(f.at_s), s_ns(f.at_s + f.for_s)))
            .collect();
        let naive = (policy == Policy::Doorman).then(|| {
            Proportional::new(
                sc.limit.rate_per_s,
                sc.limit.burst,
                (acfg.lease_ms - acfg.drift_margin_ms) * MS,
                1,
            )
        });
        let agent_names: Vec<Arc<str>> = (0..sc.gateways)
            .map(|i| Arc::from(format!("gw-{i}")))
            .collect();
        let key_names: Vec<Arc<KeyName>> = keys.iter().map(|k| Arc::new(k.name.clone())).collect();
        let net = Arc::new(Net {
            links: sc.link_specs(),
            partitions,
            allocator_cut,
        });
        let side = AllocSide::new(
            (policy == Policy::Bursar).then_some(alloc),
            naive,
            rng.fork(4),
            Arc::clone(&net),
            policy,
            &acfg,
            report_ns,
            end,
            agent_names.clone(),
            key_names.clone(),
        );
        let mut shards: Vec<Box<Shard>> = (0..SHARDS)
            .map(|s| Box::new(Shard::new(s, rng.fork(2 + (s as u64) * (1 << 40)))))
            .collect();
        for (i, a) in agents.into_iter().enumerate() {
            shards[i % SHARDS].agents.push(a);
        }
        let shared = Arc::new(Shared {
            sc: sc.clone(),
            acfg,
            config,
            policy,
            keys: keys
                .iter()
                .map(|k| KeyInfo {
                    name: k.name.clone(),
                    value: k.value.clone(),
                })
                .collect(),
            agent_names,
            key_names,
            net,
        });
        let mut sim = Sim {
            overdraft_rate: sc.limit.rate_per_s * sc.allocator.overdraft_permille as u64 / 1000,
            seed,
            side: Some(Box::new(side)),
            shards,
            shared,
            workload: Some(Box::new(Workload::new(
                rng.fork(3),
                zipf_cdf,
                t0,
                end,
                down_times(sc, t0),
                workload::mean_cost(&sc.workload),
            ))),
            globals: Queue::default(),
            threads: default_threads(sc),
            keys,
            now: 0,
            t0,
            next_engine_check: 20,
            end,
            counters: Counters::default(),
            control_at_t0: (0, 0),
            violations: 0,
            violation_messages: Vec::new(),
            demand_buf: Vec::new(),
            series: None,
            progress: None,
            samples: 0,
        };
        sim.side_mut().schedule_wake();
        if policy == Policy::Doorman {
            // One interval before traffic, or with an interval longer than the warm-up
            // the first tick of the same grid that is not before 0 (`t0` itself at
            // most): `t0 - report_ns` wrapped around and the tick never came.
            let first = t0.checked_sub(report_ns).unwrap_or(t0 % report_ns);
            sim.push(first, Ev::NaiveTick);
        }
        for i in 0..sc.gateways {
            let a = sim.agent_mut(i);
            // Agents started at their own times: their first hellos, and so their
            // report tickers, spread over one report interval (a fleet whose reports
            // all land together is not one that started gateway by gateway).
            let phase = a.phase;
            let hello_at = phase;
            if policy.fixed_slices() {
                sim.push(t0 - MS, Ev::StaticSlices(i as u32, 1));
                if policy == Policy::Gubernator {
                    sim.push(t0 + phase, Ev::HitSync(i as u32, 1));
                }
            } else {
                sim.push(hello_at, Ev::Hello(i as u32, 1));
            }
            sim.push(phase % MAINTAIN_NS, Ev::Maintain(i as u32, 1));
        }
        for k in 0..sim.keys.len() {
            sim.push(t0, Ev::Rearm(k as u32));
        }
        sim.push(t0, Ev::Sample);
        for f in sc.faults.clone() {
            let (a, b) = (s_ns(f.at_s), s_ns(f.at_s + f.for_s));
            match f.kind {
                FaultKind::Partition | FaultKind::AllocatorPartition => {}
                FaultKind::AllocatorCrash => {
                    sim.push(a, Ev::AllocCrash);
                    sim.push(b, Ev::AllocRestart);
                }
                FaultKind::AgentCrash => {
                    for &i in &f.agents {
                        sim.push(a, Ev::AgentCrash(i as u32));
                        sim.push(b, Ev::AgentRestart(i as u32));
                    }
                }
                FaultKind::AgentJoin => {
                    for &i in &f.agents {
                        // Not started yet: its first-incarnation events find no engine.
                        sim.agent_mut(i).engine = None;
                        sim.push(a, Ev::AgentRestart(i as u32));
                    }
                }
            }
        }
        Ok(sim)
    }

    /// Queues an event where it runs: the agents' side, the allocator's (a message to
    /// it crosses over at the end of the round), or between rounds.
    fn push(&mut self, at: u64, ev: Ev) {
        match ev {
            Ev::ToAlloc(..) | Ev::AllocWake(_) | Ev::NaiveTick => {
                self.side_mut().queue.push(at, ev)
            }
            Ev::Sample | Ev::AllocCrash | Ev::AllocRestart => self.globals.push(at, ev),
            Ev::Arrival(_) | Ev::Rearm(_) => self.workload_mut().queue.push(at, ev),
            ev => {
                let i = agent_of(&ev).expect("an agent's event") as usize;
                self.shards[i % SHARDS].queue.push(at, ev)
            }
        }
    }

    /// The workload, between rounds.
    fn workload_mut(&mut self) -> &mut Workload {
        self.workload
            .as_mut()
            .expect("the workload is here between rounds")
    }

    /// Gateway `i`, between rounds.
    fn agent(&self, i: usize) -> &Agent {
        &self.shards[i % SHARDS].agents[i / SHARDS]
    }

    fn agent_mut(&mut self, i: usize) -> &mut Agent {
        &mut self.shards[i % SHARDS].agents[i / SHARDS]
    }

    /// The allocator's side, between rounds.
    fn side_mut(&mut self) -> &mut AllocSide {
        self.side
            .as_mut()
            .expect("the allocator's side is here between rounds")
    }

    fn side(&self) -> &AllocSide {
        self.side
            .as_ref()
            .expect("the allocator's side is here between rounds")
    }

    /// Shares each round's work (the allocator's side, the gateways' shards) out
    /// between two threads (`2`), or runs it all on the calling thread (`1`). The
    /// report is the same either way; two threads finish a large fleet sooner
    /// (docs/simulation.md, "Speed"). The default: two for fleets of at least 100,000
    /// gateway-key pairs on a machine with two cores or more.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.clamp(1, 2);
    }

    fn violation(&mut self, msg: String) {
        self.violations += 1;
        if self.violation_messages.len() < VIOLATIONS_KEPT_MAX {
            self.violation_messages.push(msg);
        }
    }

    /// Calls `f` every `every` events with how far the run has got (the CLI prints it
    /// on a terminal: the fleet-scale minute runs for minutes). Reads no clock and
    /// changes nothing in the run.
    pub fn on_progress(&mut self, every: u64, f: impl FnMut(Progress) + 'static) {
        self.progress = Some((every.max(1), Box::new(f)));
    }

    /// Records the time series charts are drawn from ([`Sim::run_with_series`]).
    /// Costs a walk of the first [`SERIES_AGENTS_MAX`] engines' keys every 50 ms.
    pub fn record_series(&mut self) {
        let bins = (self.end - self.t0).div_ceil(SERIES_BIN_NS) as usize;
        let agents = self.shared.sc.gateways.min(SERIES_AGENTS_MAX);
        self.series = Some(Series {
            rate_per_s: self.shared.sc.limit.rate_per_s as f64,
            limit_rate_per_s: (self.shared.sc.limit.rate_per_s * self.keys.len() as u64) as f64,
            bin_s: SERIES_BIN_NS as f64 / SEC as f64,
            offered: vec![0; bins],
            admitted: vec![0; bins],
            ideal: vec![0; bins],
            sample_s: Vec::new(),
            keys: self
                .keys
                .iter()
                .take(SERIES_KEYS_MAX)
                .map(|k| KeySeries {
                    name: k.name.to_string(),
                    burst: self.shared.sc.limit.burst,
                    slices: vec![Vec::new(); agents],
                    ..KeySeries::default()
                })
                .collect(),
            agents: (0..agents).map(|i| self.agent(i).name.clone()).collect(),
        });
    }

    /// Runs to the end and reports, with the series [`Sim::record_series`] asked for
    /// (empty if it was not called).
    pub fn run_with_series(self) -> (Report, Series) {
        let (report, series, _spent) = self.run_to_end();
        (report, series)
    }

    /// [`Sim::run_with_series`], handing back the spent simulation too: a caller that
    /// exits next may leak it (`std::mem::forget`) rather than free a fleet's engines
    /// one by one (seconds at 1,000 gateways, counted in its wall time otherwise).
    pub fn run_to_end(mut self) -> (Report, Series, Sim) {
        self.run_loop();
        let series = self.series.take().unwrap_or_default();
        let report = self.report();
        (report, series, self)
    }

    /// Runs to the end and reports.
    pub fn run(mut self) -> Report {
        self.run_loop();
        self.report()
    }

    /// Runs the rounds: global events at their time; then the workload's requests
    /// up to the round's limit, drawn and sent to their gateways' shards; then the
    /// shards and the allocator's side, each up to the limit (on one thread, or shared
    /// out between two); then what the round sent crosses over and the checker takes
    /// the round's requests in time order.
    fn run_loop(&mut self) {
        let lookahead = self.shared.net.lookahead_ns().max(1);
        if self.threads < 2 {
            self.rounds(lookahead, None);
            return;
        }
        let pool = Pool::default();
        let (start, started) = std::sync::mpsc::channel::<u64>();
        let (finished, finish) = std::sync::mpsc::channel::<()>();
        let shared = Arc::clone(&self.shared);
        std::thread::scope(|s| {
            let pool = &pool;
            s.spawn(move || {
                for limit in started {
                    pool.work(1, &shared, limit);
                    if finished.send(()).is_err() {
                        break;
                    }
                }
            });
            self.rounds(lookahead, Some((pool, &start, &finish)));
            drop(start);
        });
    }

    #[allow(clippy::type_complexity)]
    fn rounds(
        &mut self,
        lookahead: u64,
        worker: Option<(
            &Pool,
            &std::sync::mpsc::Sender<u64>,
            &std::sync::mpsc::Receiver<()>,
        )>,
    ) {
        let mut next_progress = self.progress.as_ref().map_or(u64::MAX, |(every, _)| *every);
        let mut offers: Vec<Offer> = Vec::new();
        loop {
            self.cross_over(&mut offers);
            let global = self.globals.peek_time().unwrap_or(u64::MAX);
            let t = self
                .shards
                .iter()
                .filter_map(|s| s.queue.peek_time())
                .chain(self.side().queue.peek_time())
                .chain(self.workload.as_ref().and_then(|w| w.queue.peek_time()))
                .min()
                .unwrap_or(u64::MAX)
                .min(global);
            if t > self.end {
                break;
            }
            if global == t {
                // Every side is here: a global event sees (and may change) them all.
                let (_, ev) = self.globals.pop().expect("peeked");
                self.now = t;
                let side = self.side_mut();
                side.now = side.now.max(t);
                self.counters.events += 1;
                self.step_global(ev);
                continue;
            }
            // Nothing either side does before `t + lookahead` reaches the other before
            // then: all run up to there (and to the next global event) at once.
            let limit = t
                .saturating_add(lookahead)
                .min(global)
                .min(self.end.saturating_add(1));
            // Requests due in this round that were not drawn ahead (the first round,
            // after a gap) are drawn now; the next round's are drawn during this one.
            let mut wl = self.workload.take().expect("here between rounds");
            wl.draw_until(&self.shared, limit);
            self.requests_to_shards(&mut wl);
            wl.horizon = limit.saturating_add(lookahead);
            let mut tasks: Vec<Task> = Vec::with_capacity(SHARDS + 2);
            tasks.push(Task::Side(self.side.take().expect("here between rounds")));
            tasks.extend(self.shards.drain(..).map(Task::Shard));
            tasks.push(Task::Workload(wl));
            let tasks = match worker {
                Some((pool, start, finish)) => {
                    pool.set(tasks);
                    start.send(limit).expect("the worker thread is running");
                    pool.work(0, &self.shared, limit);
                    finish.recv().expect("the worker thread finished its part");
                    pool.take()
                }
                None => {
                    for t in tasks.iter_mut() {
                        t.run(&self.shared, limit);
                    }
                    tasks
                }
            };
            self.put_back(tasks);
            let events = self.counters.events
                + self.workload.as_ref().map_or(0, |w| w.events)
                + self.side().counters.events
                + self.shards.iter().map(|s| s.counters.events).sum::<u64>();
            while events >= next_progress {
                if let Some((every, f)) = &mut self.progress {
                    f(Progress {
                        virtual_s: limit.min(self.end).saturating_sub(self.t0) as f64 / SEC as f64,
                        duration_s: (self.end - self.t0) as f64 / SEC as f64,
                        events: next_progress,
                    });
                    next_progress += *every;
                }
            }
        }
        self.now = self.end;
        self.side_mut().now = self.end;
        self.sample();
        self.finish_checks();
    }

    /// Sends the requests the workload drew to their gateways' shards, in order.
    fn requests_to_shards(&mut self, wl: &mut Workload) {
        for (at, ev) in wl.out.drain(..) {
            let i = agent_of(&ev).expect("a request names its gateway") as usize;
            self.shards[i % SHARDS].queue.push(at, ev);
        }
    }

    /// The side and the shards come back from a round, in their places.
    fn put_back(&mut self, tasks: Vec<Task>) {
        let mut shards: Vec<Box<Shard>> = Vec::with_capacity(SHARDS);
        for t in tasks {
            match t {
                Task::Side(s) => self.side = Some(s),
                Task::Shard(s) => shards.push(s),
                Task::Workload(w) => self.workload = Some(w),
            }
        }
        shards.sort_by_key(|s| s.index);
        self.shards = shards;
    }

    /// What the last round sent crosses over, in a fixed order (shard by shard, each
    /// in the order sent); the checker takes the round's requests in time order.
    fn cross_over(&mut self, offers: &mut Vec<Offer>) {
        let mut side = self.side.take().expect("here between rounds");
        let mut violations = std::mem::take(&mut side.violations);
        for (at, ev) in side.out.drain(..) {
            let i = agent_of(&ev).expect("sent to an agent") as usize;
            self.shards[i % SHARDS].queue.push(at, ev);
        }
        let mut wl = self.workload.take().expect("here between rounds");
        self.requests_to_shards(&mut wl);
        self.workload = Some(wl);
        let mut peers = Vec::new();
        for shard in self.shards.iter_mut() {
            for (at, ev) in shard.to_alloc.drain(..) {
                side.queue.push(at, ev);
            }
            peers.append(&mut shard.to_peers);
            offers.append(&mut shard.offers);
            violations.append(&mut shard.violations);
        }
        self.side = Some(side);
        for (at, ev) in peers {
            let i = agent_of(&ev).expect("sent to an agent") as usize;
            self.shards[i % SHARDS].queue.push(at, ev);
        }
        // Stable: one gateway's requests at one instant keep their order.
        offers.sort_by_key(|o| (o.at, o.agent));
        for o in offers.drain(..) {
            self.offer(&o);
        }
        for msg in violations {
            self.violation(msg);
        }
    }

    /// An event that reads or changes both sides, between rounds.
    fn step_global(&mut self, ev: Ev) {
        match ev {
            Ev::Sample => {
                self.sample();
                self.push(self.now + SAMPLE_NS, Ev::Sample);
            }
            Ev::AllocCrash | Ev::AllocRestart if self.shared.policy.fixed_slices() => {}
            Ev::AllocCrash => {
                self.side_mut().crash();
                // Every agent's stream broke: each reconnects after the client's backoff
                // (and keeps trying, refused, until the allocator is back).
                for i in 0..self.shared.sc.gateways {
                    let now = self.now;
                    let a = self.agent_mut(i);
                    if a.engine.is_some() && (a.sync.is_up() || a.sync.is_opening()) {
                        let at = a.clock(now);
                        let wait = a.sync.lost(at, a.rng.next_u64());
                        let inc = a.incarnation;
                        self.counters.streams_lost += 1;
                        self.push(now + wait, Ev::Hello(i as u32, inc));
                    }
                }
            }
            Ev::AllocRestart => {
                let now = self.now;
                let side = self.side.as_mut().expect("between rounds");
                side.term += 1;
                let term = side.term;
                if self.shared.policy == Policy::Doorman {
                    side.naive = Some(Proportional::new(
                        self.shared.sc.limit.rate_per_s,
                        self.shared.sc.limit.burst,
                        (self.shared.acfg.lease_ms - self.shared.acfg.drift_margin_ms) * MS,
                        term,
                    ));
                } else {
                    match Allocator::new(&self.shared.config, self.shared.acfg.clone(), term, now) {
                        Ok(a) => side.alloc = Some(a),
                        Err(e) => self.violation(format!("allocator restart refused: {e}")),
                    }
                }
                self.side_mut().schedule_wake();
                for shard in self.shards.iter_mut() {
                    shard.term = term;
                }
            }
            _ => unreachable!("an event of one side between rounds"),
        }
    }

    /// The checker's account of one request, in time order over every shard: what was
    /// offered, what one ideal bucket would have admitted, what the fleet admitted.
    fn offer(&mut self, o: &Offer) {
        let (now, cost) = (o.at, o.cost);
        let key = &mut self.keys[o.key as usize];
        key.offered += cost;
        key.first_offer.get_or_insert(now);
        let bin = ((now - self.t0) / BIN_NS) as usize;
        let sbin = ((now - self.t0) / SERIES_BIN_NS) as usize;
        if let Some(s) = self.series.as_mut()
            && let Some(b) = s.offered.get_mut(sbin)
        {
            *b += cost;
        }
        let late = now >= self.t0 + (self.end - self.t0) / 2;
        if key.ideal.try_take(now, cost) {
            key.ideal_admitted += cost;
            if late {
                key.late_ideal_admitted += cost;
            }
            if let Some(s) = self.series.as_mut()
                && let Some(b) = s.ideal.get_mut(sbin)
            {
                *b += cost;
            }
            if let Some((_, ideal)) = key.bins.as_mut()
                && let Some(b) = ideal.get_mut(bin)
            {
                *b += cost;
            }
        }
        if !o.admitted {
            return;
        }
        key.admitted += cost;
        if late {
            key.late_admitted += cost;
        }
        if let Some(s) = self.series.as_mut()
            && let Some(b) = s.admitted.get_mut(sbin)
        {
            *b += cost;
        }
        key.first_admit.get_or_insert(now);
        key.verify(now, cost);
        if let Some((fleet, _)) = key.bins.as_mut()
            && let Some(b) = fleet.get_mut(bin)
        {
            *b += cost;
        }
    }

    // ---- checker ----

    /// Control messages and their bytes sent so far, every side and shard.
    fn control_totals(&self) -> (u64, u64) {
        let mut n = (0, 0);
        for c in std::iter::once(&self.counters)
            .chain(std::iter::once(&self.side().counters))
            .chain(self.shards.iter().map(|s| &s.counters))
        {
            n.0 += c.to_allocator + c.to_agents + c.peer;
            n.1 += c.to_allocator_bytes + c.to_agents_bytes + c.peer_bytes;
        }
        n
    }

    fn sample(&mut self) {
        if self.samples == 0 {
            // Traffic starts: control traffic is counted from here, over the traffic's
            // duration (the warm-up before it grows with the lease and has no load).
            self.control_at_t0 = self.control_totals();
        }
        let from = self.last_sample_at();
        let span = self.now.saturating_sub(from) as f64;
        self.samples += 1;
        let period = SEC as f64;
        let alloc = self.side.as_ref().and_then(|s| s.alloc.as_ref());
        for key in self.keys.iter_mut() {
            let (rate, burst) = match alloc.and_then(|a| a.overshoot_bound(&key.name)) {
                Some(b) => (b.rate + b.overdraft_rate.max(self.overdraft_rate), b.burst),
                // The allocator is down (its last bound stands) or has not met the key.
                // Baselines state no bound beyond the contract's `(R, B)`.
                None if self.shared.policy != Policy::Bursar => (self.overdraft_rate, 0),
                None if alloc.is_none() => (key.bound_rate, key.bound_burst),
                None => (self.overdraft_rate, 0),
            };
            // Conservative between samples: the larger rate over the whole span, and
            // every rise of the summed fallback bursts counts again.
            let rose = rate > key.bound_rate || burst > key.bound_burst;
            let before = key.allowance;
            key.allowance += rate.max(key.bound_rate) as f64 * span / period;
            key.allowance += burst.saturating_sub(key.bound_burst) as f64;
            key.bound_rate = rate;
            key.bound_burst = burst;
            key.sampled_at = self.now;
            // Each deficit since the last sample against the bound over its own
            // window (since the verifier was last full). Where this sample states a
            // rise, the rise may have begun anywhere in the interval: the deficit is
            // held to the allowance as this sample ends. Otherwise the rate held
            // throughout, and a window is allowed what accrued up to its own end.
            let excess = if rose {
                key.window_worst - key.allowance
            } else {
                key.window_worst_here - before
            };
            key.worst_excess = key.worst_excess.max(excess);
            key.window_worst = f64::NEG_INFINITY;
            key.window_worst_here = f64::NEG_INFINITY;
            key.window_bound_max = key.window_bound_max.max(key.allowance - key.base);
        }
        if self.series.is_some() {
            self.sample_series();
        }
        // The allocator's invariants every sample while it holds up to
        // CHECK_ENTRIES_PER_SAMPLE key-agent entries (every built-in scenario), and every
        // `entries / CHECK_ENTRIES_PER_SAMPLE` samples beyond: a check walks every entry,
        // and at fleet scale (millions of entries) checking every 50 ms cost more than
        // the allocation it checks. Checked by the allocator's side before anything else
        // in its next round (as it is now: nothing runs in between), beside the shards.
        let (now, samples) = (self.now, self.samples);
        let side = self.side_mut();
        if let Some(a) = side.alloc.as_ref()
            && samples.is_multiple_of((a.entry_count() / CHECK_ENTRIES_PER_SAMPLE).max(1) as u64)
        {
            side.check_at = Some(now);
        }
        // The engines' invariants every 20 samples (a second) while the fleet's engines
        // hold up to CHECK_ENTRIES_PER_SAMPLE keys, and proportionally less often
        // beyond: a check walks (and maps) every key of every engine, 7 % of a
        // fleet-scale run at 4,000 keys per engine.
        if self.samples >= self.next_engine_check {
            let keys: usize = (0..self.shared.sc.gateways)
                .filter_map(|i| self.agent(i).engine.as_ref())
                .map(|e| e.key_count())
                .sum();
            self.next_engine_check =
                self.samples + 20 * (keys / CHECK_ENTRIES_PER_SAMPLE).max(1) as u64;
            // Each shard checks its engines first in its next round, likewise.
            for shard in self.shards.iter_mut() {
                shard.check_at = Some(now);
            }
        }
    }

    /// Runs the checks the last sample left to the next round (the run has ended).
    fn finish_checks(&mut self) {
        let mut side = self.side.take().expect("here between rounds");
        side.run_until(0);
        self.side = Some(side);
        for shard in self.shards.iter_mut() {
            shard.run_until(&self.shared, 0);
        }
        let mut offers = Vec::new();
        self.cross_over(&mut offers);
    }

    fn sample_series(&mut self) {
        let Some(s) = self.series.as_mut() else {
            return;
        };
        s.sample_s
            .push(self.now.saturating_sub(self.t0) as f64 / SEC as f64);
        for (ks, key) in s.keys.iter_mut().zip(self.keys.iter_mut()) {
            ks.deficit.push(key.verifier.deficit_now_tokens(self.now));
            ks.overshoot.push(key.verifier.deficit_tokens());
            ks.bound.push(key.allowance - key.base);
        }
        for i in 0..s.agents.len() {
            let a = &self.shards[i % SHARDS].agents[i / SHARDS];
            self.demand_buf.clear();
            if let Some(e) = &a.engine {
                e.key_demand(&mut self.demand_buf);
            }
            for ks in s.keys.iter_mut() {
                ks.slices[i].push(0);
            }
            for d in self.demand_buf.drain(..) {
                let Some(k) = d.values().first().and_then(|v| key_of(v, self.keys.len())) else {
                    continue;
                };
                if let (Some(ks), Some(sl)) = (s.keys.get_mut(k as usize), d.slice)
                    && let Some(last) = ks.slices[i].last_mut()
                {
                    *last = sl.rate;
                }
            }
        }
    }

    fn last_sample_at(&self) -> u64 {
        if self.samples == 0 {
            self.t0
        } else {
            (self.t0 + (self.samples - 1) * SAMPLE_NS).min(self.now)
        }
    }

    fn report(&mut self) -> Report {
        // The allocator's side and the shards counted their own events and messages.
        if let Some(side) = self.side.as_mut() {
            self.counters.absorb(std::mem::take(&mut side.counters));
        }
        for shard in self.shards.iter_mut() {
            self.counters.absorb(std::mem::take(&mut shard.counters));
        }
        if let Some(w) = self.workload.as_mut() {
            self.counters.events += std::mem::take(&mut w.events);
        }
        self.counters.streams_up_at_end = (0..self.shared.sc.gateways)
            .filter(|&i| {
                let a = self.agent(i);
                a.engine.is_some() && a.sync.is_up()
            })
            .count() as u64;
        let b = self.shared.sc.limit.burst as f64;
        let mut outcomes: Vec<KeyOutcome> = Vec::new();
        let mut over_max: f64 = 0.0;
        let mut bound_max: f64 = 0.0;
        for k in &self.keys {
            let measured = k.verifier.deficit_tokens();
            over_max = over_max.max(measured / b);
            let window_bound = k.window_bound_max.max(k.allowance - k.base);
            bound_max = bound_max.max(window_bound / b);
            // The tail since the last sample, against what accrued up to each deficit.
            let excess = k.worst_excess.max(k.window_worst_here - k.allowance);
            if excess > 1e-6 {
                let msg = format!(
                    "key {}: overshoot {excess:.1} tokens above the bound stated over its window \
                     (deepest deficit {measured:.1}, largest bound over a window {window_bound:.1}, B = {b})",
                    k.name
                );
                self.violations += 1;
                if self.violation_messages.len() < VIOLATIONS_KEPT_MAX {
                    self.violation_messages.push(msg);
                }
            }
            outcomes.push(KeyOutcome {
                key: k.name.to_string(),
                overshoot_tokens: measured,
                bound_tokens: window_bound,
                offered: k.offered,
                admitted: k.admitted,
                ideal_admitted: k.ideal_admitted,
            });
        }
        outcomes.sort_by(|x, y| {
            y.overshoot_tokens
                .total_cmp(&x.overshoot_tokens)
                .then(x.key.cmp(&y.key))
        });
        outcomes.truncate(KEYS_LISTED_MAX);
        let admitted: u64 = self.keys.iter().map(|k| k.admitted).sum();
        let ideal: u64 = self.keys.iter().map(|k| k.ideal_admitted).sum();
        let late: u64 = self.keys.iter().map(|k| k.late_admitted).sum();
        let late_ideal: u64 = self.keys.iter().map(|k| k.late_ideal_admitted).sum();
        let ratios: Vec<f64> = self
            .keys
            .iter()
            .filter(|k| k.ideal_admitted > 0)
            .map(|k| k.admitted as f64 / k.ideal_admitted as f64)
            .collect();
        let jain = (ratios.len() > 1).then(|| {
            let s: f64 = ratios.iter().sum();
            let s2: f64 = ratios.iter().map(|x| x * x).sum();
            if s2 > 0.0 {
                s * s / (ratios.len() as f64 * s2)
            } else {
                1.0
            }
        });
        let mut first: Vec<f64> = self
            .keys
            .iter()
            // A key offered but never admitted counts as waiting until the run's end
            // (censored): leaving it out understated the p95 exactly when cold keys
            // starve.
            .filter_map(|k| {
                let offered = k.first_offer?;
                Some((k.first_admit.unwrap_or(self.end) - offered) as f64 / MS as f64)
            })
            .collect();
        let duration_s = (self.end - self.t0) as f64 / SEC as f64;
        let (msgs, bytes) = self.control_totals();
        let msgs = msgs.saturating_sub(self.control_at_t0.0) as f64;
        let bytes = bytes.saturating_sub(self.control_at_t0.1) as f64;
        // Per agent-second a gateway ran: not yet joined or crashed, it sends nothing
        // (every configured gateway over the whole run read `churn` 25 % low).
        let per_agent_s =
            live_agent_seconds(&down_times(&self.shared.sc, self.t0), self.t0, self.end).max(1e-9);
        Report {
            scenario: self.shared.sc.name.clone(),
            seed: self.seed,
            policy: self.shared.policy.name().into(),
            gateways: self.shared.sc.gateways,
            keys: self.shared.sc.keys,
            duration_s,
            summary: Summary {
                overshoot_max_fraction_of_burst: over_max,
                bound_fraction_of_burst: bound_max,
                utilization_vs_ideal: if ideal > 0 {
                    admitted as f64 / ideal as f64
                } else {
                    1.0
                },
                utilization_second_half: if late_ideal > 0 {
                    late as f64 / late_ideal as f64
                } else {
                    1.0
                },
                realloc_p95_ms: self.realloc_p95_ms(),
                jain_fairness: jain,
                cold_first_admit_p95_ms: p95(&mut first),
                control_messages_per_agent_per_s: msgs / per_agent_s,
                control_bytes_per_agent_per_s: bytes / per_agent_s,
                violations: self.violations,
            },
            worst_keys: outcomes,
            counters: self.counters.clone(),
            violation_messages: std::mem::take(&mut self.violation_messages),
        }
    }

    /// Per key and shift: the end of the first 250 ms window (sliding by 50 ms) after
    /// the shift in which the fleet admitted at least 95 % of what the ideal global
    /// bucket admitted over the same window, as the issue defines it; a phase that
    /// never gets there counts whole (censored). The p95 is over every key and shift.
    fn realloc_p95_ms(&self) -> Option<f64> {
        if self.shared.sc.workload.kind != WorkloadKind::Shift {
            return None;
        }
        let every = (self.shared.sc.workload.shift_every_s * SEC as f64) as u64;
        let per_window = (REALLOC_WINDOW_NS / BIN_NS) as usize;
        let mut samples = Vec::new();
        for k in &self.keys {
            let Some((fleet, ideal)) = &k.bins else {
                continue;
            };
            let mut ts = every;
            while ts + every <= self.end - self.t0 {
                let b0 = (ts / BIN_NS) as usize;
                let b1 = (((ts + every) / BIN_NS) as usize).min(fleet.len());
                if b1 < b0 + per_window {
                    break;
                }
                // 95 % of the ideal bucket over the same window, as the issue defines it.
                // (Until the twenty-eighth session: of the lower of the ideal and what
                // the fleet settled at over the phase's last second, so a policy that
                // settled low, or never moved, passed in the first window: `static`
                // read 250 ms, the best of all.)
                let mut found = None;
                for e in (b0 + per_window)..=b1 {
                    let f: u64 = fleet[e - per_window..e].iter().sum();
                    let i: u64 = ideal[e - per_window..e].iter().sum();
                    if f * 100 >= i * 95 {
                        found = Some(e);
                        break;
                    }
                }
                // Never reached within the phase: count the whole phase (censored).
                let e = found.unwrap_or(b1);
                samples.push(((e - b0) as u64 * BIN_NS) as f64 / MS as f64);
                ts += every;
            }
        }
        p95(&mut samples)
    }
}

/// The index of the key whose tenant value is `v` (`t<index>`, as built in
/// [`Sim::new`]), if it is one of the `n` keys.
fn key_of(v: &str, n: usize) -> Option<u32> {
    let digits = v.strip_prefix('t')?;
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    let k: u32 = digits.parse().ok().filter(|_| canonical)?;
    ((k as usize) < n).then_some(k)
}

/// The key number of an engine key (its first `*` value), for the sync bookkeeping.
fn engine_key(d: &KeyDemand, n: usize) -> Option<u32> {
    d.values().first().and_then(|v| key_of(v, n))
}

/// A report line as the sync client sends it: by the handle a grant carried, else by
/// name.
fn key_report(l: Line<'_, u32>, names: &[KeyInfo]) -> KeyReport {
    KeyReport {
        key: if l.key_handle != 0 {
            KeyName::default()
        } else {
            names[*l.key as usize].name.clone()
        },
        admitted: l.admitted,
        rejected: l.rejected,
        counting_since_ns: l.counting_since_ns,
        in_flight: l.in_flight,
        held: l.held.map(held_grant),
        key_handle: l.key_handle,
    }
}

fn held_grant(h: Held) -> HeldGrant {
    HeldGrant {
        epoch: h.epoch,
        seq: h.seq,
        rate: h.rate,
        burst: h.burst,
    }
}

/// An ack the sync bookkeeping owes, as the allocator reads it: by the handle the grant
/// carried (as the sync client), else by the key's name (`name`).
fn slice_ack(x: SyncAck<u32>, name: impl FnOnce() -> KeyName) -> SliceAck {
    SliceAck {
        key: if x.key_handle != 0 {
            KeyName::default()
        } else {
            name()
        },
        key_handle: x.key_handle,
        epoch: x.epoch,
        seq: x.seq,
        released_tokens: x.released_tokens,
        in_flight: x.in_flight,
    }
}

fn p95(xs: &mut [f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let i = ((xs.len() as f64 * 0.95).ceil() as usize).clamp(1, xs.len()) - 1;
    Some(xs[i])
}

/// The one command that replays a run: scenario, seed, every override given, policy.
pub fn replay_command(scenario: &str, seed: u64, overrides: &Overrides, policy: &str) -> String {
    let mut c = format!(
        "bursar-sim run {scenario} --seed {seed}{}",
        overrides.flags()
    );
    if policy != "bursar" {
        c += &format!(" --policy {policy}");
    }
    c
}

/// Runs one scenario with one seed under the real allocator.
pub fn run(sc: &Scenario, seed: u64) -> Result<Report, SimError> {
    Ok(Sim::new(sc, seed, "bursar")?.run())
}

/// One run of [`run_jobs`]: a scenario, a seed and a policy.
pub type Job<'a> = (&'a Scenario, u64, &'a str);

/// Runs independent `jobs` side by side, one per core (each run on one thread), and
/// hands `done` each job's index and report in job order, as soon as it and every
/// earlier one have finished. The reports are the runs' own: which thread ran which
/// changes nothing. Stops at the first job that cannot start (in job order) and
/// returns its error.
pub fn run_jobs(jobs: &[Job<'_>], mut done: impl FnMut(usize, Report)) -> Result<(), SimError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len());
    let run_one = |(sc, seed, policy): Job<'_>, threads: usize| {
        Sim::new(sc, seed, policy).map(|mut sim| {
            if threads > 1 {
                sim.set_threads(1);
            }
            sim.run()
        })
    };
    if threads <= 1 {
        for (i, job) in jobs.iter().enumerate() {
            done(i, run_one(*job, 1)?);
        }
        return Ok(());
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<Report, SimError>)>();
    std::thread::scope(|s| {
        for _ in 0..threads {
            let (tx, next, failed) = (tx.clone(), &next, &failed);
            s.spawn(move || {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= jobs.len() || failed.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    let r = run_one(jobs[i], threads);
                    failed.fetch_or(r.is_err(), std::sync::atomic::Ordering::Relaxed);
                    if tx.send((i, r)).is_err() {
                        return;
                    }
                }
            });
        }
        drop(tx);
        // Reports in job order: each waits here until those before it are out.
        let mut waiting = BTreeMap::new();
        let mut want = 0;
        for (i, r) in rx {
            waiting.insert(i, r);
            while let Some(r) = waiting.remove(&want) {
                done(want, r?);
                want += 1;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(name: &str) -> Scenario {
        let mut sc = Scenario::load(name).unwrap();
        sc.duration_s = 3.0;
        sc
    }

    /// Review, twenty-eighth session: a request the workload sent to a gateway that was
    /// down (crashed, or not yet joined) vanished, so `churn`, stated as 1.2 R, offered
    /// 0.6 R until its late gateways joined. A load balancer sends it to one that is up.
    #[test]
    fn a_down_gateway_s_requests_go_to_one_that_is_up() {
        let sc = small("churn"); // 3 s, gateways 4-7 join at 3 s: half are down
        let r = run(&sc, 1).unwrap();
        let stated = sc.workload.load * sc.limit.rate_per_s as f64 * sc.duration_s;
        for k in &r.worst_keys {
            let ratio = k.offered as f64 / stated;
            assert!(
                (0.9..1.1).contains(&ratio),
                "{}: offered {ratio:.2} of the stated load",
                k.key
            );
        }
        // Nothing redirected while every gateway is up: `steady` draws as before.
        // Live agent-seconds: overlapping spans count once, spans outside the run not.
        let spans = vec![
            vec![(0, 2 * SEC), (SEC, 3 * SEC), (9 * SEC, 20 * SEC)],
            vec![],
        ];
        assert_eq!(live_agent_seconds(&spans, 0, 10 * SEC), 6.0 + 10.0);
        let down = down_times(&Scenario::load("steady").unwrap(), 0);
        assert!(down.iter().all(Vec::is_empty));
    }

    /// Review, twenty-fifth session: the run's deepest deficit was compared with the
    /// whole run's allowance, so a bound stated after a breach (a later partition, an
    /// overdraft accruing) hid it. A deficit is held to the bound accumulated by the
    /// sample that ends its window.
    #[test]
    fn a_deficit_is_held_to_the_bound_stated_by_its_time_not_by_the_end_of_the_run() {
        let mut sc = small("steady");
        sc.keys = 1;
        // The stated bound grows by R each second (static split: the overdraft only).
        sc.allocator.overdraft_permille = 1000;
        let mut sim = Sim::new(&sc, 1, "static").unwrap();
        let (t0, r, b) = (sim.t0, sc.limit.rate_per_s, sc.limit.burst);
        sim.now = t0;
        sim.sample();
        // A deficit of R tokens 10 ms in: far above the 0.05 R stated by 50 ms, below
        // the 3 R stated by the end.
        sim.keys[0].verify(t0 + 10 * MS, b + r);
        for i in 1..=60 {
            sim.now = t0 + i * SAMPLE_NS;
            sim.sample();
        }
        let report = sim.report();
        assert!(report.summary.violations > 0, "{:?}", report.summary);
    }

    /// Review, twenty-eighth session: the allowance accumulated over the whole run, so
    /// a bound stated earlier (an overdraft accruing, a partition's fallback bursts)
    /// covered a breach long after the verifier was full again. A deficit is held to
    /// the bound over its own window, since the verifier was last full.
    #[test]
    fn a_bound_stated_before_the_verifier_was_full_again_does_not_cover_a_later_deficit() {
        let mut sc = small("steady");
        sc.keys = 1;
        // The stated bound grows by R/10 each second (static split: the overdraft).
        sc.allocator.overdraft_permille = 100;
        let mut sim = Sim::new(&sc, 1, "static").unwrap();
        let (t0, r, b) = (sim.t0, sc.limit.rate_per_s, sc.limit.burst);
        for i in 0..=200 {
            sim.now = t0 + i * SAMPLE_NS;
            sim.sample();
        }
        // 10 s in, R accrued; the verifier is full. R/2 over it now is far above what
        // the bound states over a window that starts now.
        sim.keys[0].verify(sim.now + MS, b + r / 2);
        sim.now += SAMPLE_NS;
        sim.sample();
        let report = sim.report();
        assert!(report.summary.violations > 0, "{:?}", report.summary);
    }

    /// Review, thirtieth session: a window started only where the verifier was full,
    /// and under load a verifier in deficit is never full again, so the allowance
    /// accrued since its last full instant, unused, covered a later breach. One token
    /// short of full, then exactly R for 10 s (the level stays at -1): B + R/2 in one
    /// millisecond is far above what the bound states over a window starting then.
    #[test]
    fn a_window_starts_anywhere_not_only_where_the_verifier_was_full() {
        let mut sc = small("steady");
        sc.keys = 1;
        sc.allocator.overdraft_permille = 100;
        let mut sim = Sim::new(&sc, 1, "static").unwrap();
        let (t0, r, b) = (sim.t0, sc.limit.rate_per_s, sc.limit.burst);
        sim.now = t0;
        sim.sample();
        sim.keys[0].verify(t0, b + 1);
        for i in 1..=1_000u64 {
            let at = t0 + i * 10 * MS;
            while sim.now + SAMPLE_NS <= at {
                sim.now += SAMPLE_NS;
                sim.sample();
            }
            sim.keys[0].verify(at, r / 100);
        }
        sim.keys[0].verify(sim.now + MS, b + r / 2);
        sim.now += SAMPLE_NS;
        sim.sample();
        let report = sim.report();
        assert!(report.summary.violations > 0, "{:?}", report.summary);
    }

    /// Review, thirty-first session: a window's start took the allowance of the sample
    /// before it and its end the allowance of the sample after it, so a window inside
    /// one sample interval was allowed up to two intervals' accrual (100 ms of the
    /// bound's rate; `partition-set`'s fallback rate of about R/2 made that 0.25 B). The
    /// bound rate R here (the overdraft): from full at 49 ms, 0.05 R at 51 ms is 0.048 R
    /// past the verifier, against 0.002 R stated over those 2 ms.
    #[test]
    fn a_window_between_two_samples_is_allowed_its_own_accrual_only() {
        let mut sc = small("steady");
        sc.keys = 1;
        sc.allocator.overdraft_permille = 1000;
        let mut sim = Sim::new(&sc, 1, "static").unwrap();
        let (t0, r, b) = (sim.t0, sc.limit.rate_per_s, sc.limit.burst);
        sim.now = t0;
        sim.sample();
        sim.keys[0].verify(t0 + 49 * MS, b);
        sim.now = t0 + SAMPLE_NS;
        sim.sample();
        sim.keys[0].verify(t0 + 51 * MS, r / 20);
        sim.now = t0 + 2 * SAMPLE_NS;
        sim.sample();
        let report = sim.report();
        assert!(report.summary.violations > 0, "{:?}", report.summary);
        // The same excess spread at the bound's own rate is none: 0.05 R over the
        // 50 ms after full, R/1000 every millisecond.
        let mut sim = Sim::new(&sc, 1, "static").unwrap();
        sim.now = t0;
        sim.sample();
        sim.keys[0].verify(t0 + 49 * MS, b);
        for i in 50..=100u64 {
            let at = t0 + i * MS;
            while sim.now + SAMPLE_NS <= at {
                sim.now += SAMPLE_NS;
                sim.sample();
            }
            sim.keys[0].verify(at, 2 * r / 1000 - 1);
        }
        sim.now += SAMPLE_NS;
        sim.sample();
        let report = sim.report();
        assert_eq!(report.summary.violations, 0, "{:?}", report.summary);
        assert!(report.summary.overshoot_max_fraction_of_burst > 0.0);
    }

    #[test]
    fn an_excess_within_the_overdraft_over_its_window_is_no_violation() {
        let mut sc = small("steady");
        sc.keys = 1;
        sc.allocator.overdraft_permille = 100;
        let mut sim = Sim::new(&sc, 1, "static").unwrap();
        let (t0, r, b) = (sim.t0, sc.limit.rate_per_s, sc.limit.burst);
        sim.now = t0;
        sim.sample();
        // From a full verifier: B at once, then 1.05 R for 10 s (every 10 ms): a
        // deficit growing to R/2 against the R/10 per second the overdraft states.
        sim.keys[0].verify(t0, b);
        let step = 10 * MS;
        for i in 1..=1_000u64 {
            let at = t0 + i * step;
            while sim.now + SAMPLE_NS <= at {
                sim.now += SAMPLE_NS;
                sim.sample();
            }
            sim.keys[0].verify(at, r * 105 / 100 / 100);
        }
        sim.now += SAMPLE_NS;
        sim.sample();
        let report = sim.report();
        assert_eq!(report.summary.violations, 0, "{:?}", report.summary);
        assert!(
            report.summary.overshoot_max_fraction_of_burst > 0.0,
            "{:?}",
            report.summary
        );
    }

    /// Review, twenty-eighth session: control traffic was divided by the run's whole
    /// time, warm-up included, whose length follows the lease: longer leases looked
    /// cheaper for that alone. It is counted from the start of traffic, over it.
    #[test]
    fn control_traffic_per_agent_is_counted_over_the_traffic_whatever_the_lease() {
        let rate = |lease_ms: u64| {
            let mut sc = small("steady");
            sc.allocator.lease_ms = lease_ms;
            run(&sc, 1)
                .unwrap()
                .summary
                .control_messages_per_agent_per_s
        };
        let (short, long) = (rate(1_000), rate(10_000));
        assert!(
            (short / long - 1.0).abs() < 0.15,
            "{short:.1} against {long:.1} messages per agent per second"
        );
    }

    /// Review, twenty-eighth session: a key offered but never admitted was left out of
    /// the cold first-admit p95, which so read best when cold keys starved.
    #[test]
    fn a_key_never_admitted_counts_as_waiting_until_the_end() {
        let mut sc = small("steady");
        sc.keys = 1;
        let mut sim = Sim::new(&sc, 1, "bursar").unwrap();
        let t0 = sim.t0;
        sim.keys[0].first_offer = Some(t0);
        sim.now = sim.end;
        let report = sim.report();
        let waited = report
            .summary
            .cold_first_admit_p95_ms
            .expect("censored, not absent");
        assert!(
            waited >= (sim.end - t0) as f64 / MS as f64 - 1.0,
            "{waited}"
        );
    }

    /// Review, twenty-eighth session: reallocation was measured to 95 % of the lower of
    /// the ideal and what the fleet settled at, so `static`, which never moves budget,
    /// read the best figure. It is measured to 95 % of the ideal bucket; a phase that
    /// never gets there counts whole.
    #[test]
    fn a_policy_that_never_moves_budget_is_censored_at_the_phase_and_short_phases_count() {
        let mut sc = Scenario::load("shift").unwrap();
        sc.duration_s = 7.0;
        let every_ms = sc.workload.shift_every_s * 1_000.0;
        let fixed = Sim::new(&sc, 1, "static").unwrap().run();
        assert_eq!(
            fixed.summary.realloc_p95_ms,
            Some(every_ms),
            "never reached"
        );
        let ours = run(&sc, 1).unwrap();
        let t = ours.summary.realloc_p95_ms.expect("measured");
        assert!(t < every_ms, "{t} ms");
        sc.workload.shift_every_s = 0.8;
        sc.duration_s = 4.0;
        assert!(run(&sc, 1).unwrap().summary.realloc_p95_ms.is_some());
    }

    #[test]
    fn the_same_seed_and_scenario_replay_bit_for_bit() {
        // Loss, jitter and a partition: every random choice is exercised.
        let sc = small("partition-set");
        let a = run(&sc, 11).unwrap();
        let b = run(&sc, 11).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
        let c = run(&sc, 12).unwrap();
        assert_ne!(a.counters, c.counters, "another seed, another run");
    }

    #[test]
    fn one_thread_or_two_the_report_is_the_same() {
        // Faults on both sides (an allocator crash and restart, partitions, loss,
        // jitter), every policy, and a zero-latency link (rounds of one instant).
        let mut zero = small("steady");
        zero.network.latency_ms = 0.0;
        zero.network.jitter_ms = 0.5;
        let cases = [
            (small("allocator-crash"), "bursar"),
            (small("partition-set"), "bursar"),
            (small("lossy"), "bursar"),
            (small("agent-crash"), "bursar"),
            (small("churn"), "bursar"),
            (small("cold-keys"), "bursar"),
            (small("partition-drift"), "bursar"),
            (small("llm-zipf"), "bursar"),
            (small("llm-zipf"), "gubernator"),
            (small("shift"), "doorman"),
            (small("partition-set"), "gubernator"),
            (small("shift"), "static"),
            (zero, "bursar"),
        ];
        for (sc, policy) in cases {
            let reports: Vec<Report> = [1, 2]
                .into_iter()
                .map(|threads| {
                    let mut sim = Sim::new(&sc, 3, policy).unwrap();
                    sim.set_threads(threads);
                    sim.run()
                })
                .collect();
            assert!(
                reports[0].counters.to_agents > 0 || policy != "bursar",
                "{}: the allocator sent nothing",
                sc.name
            );
            assert_eq!(reports[0], reports[1], "{} under {policy}", sc.name);
        }
    }

    #[test]
    fn jobs_run_side_by_side_come_back_in_order_as_run_alone() {
        let (a, b) = (small("steady"), small("shift"));
        let jobs: Vec<Job<'_>> = vec![(&a, 1, "bursar"), (&b, 2, "doorman"), (&a, 3, "bursar")];
        let mut got = Vec::new();
        run_jobs(&jobs, |i, r| got.push((i, r))).unwrap();
        let alone: Vec<(usize, Report)> = jobs
            .iter()
            .enumerate()
            .map(|(i, &(sc, seed, policy))| (i, Sim::new(sc, seed, policy).unwrap().run()))
            .collect();
        assert_eq!(got, alone);
        // A job that cannot start is an error, and nothing after it is handed back.
        let bad: Vec<Job<'_>> = vec![
            (&a, 1, "bursar"),
            (&a, 2, "no-such-policy"),
            (&b, 3, "bursar"),
        ];
        let mut seen = Vec::new();
        let err = run_jobs(&bad, |i, _| seen.push(i)).unwrap_err();
        assert!(matches!(err, SimError::Policy(_)), "{err:?}");
        assert_eq!(seen, vec![0]);
    }

    #[test]
    fn progress_reports_move_forward_and_change_nothing_in_the_run() {
        let sc = small("shift");
        let quiet = run(&sc, 5).unwrap();
        let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let mut sim = Sim::new(&sc, 5, "bursar").unwrap();
        let log = std::rc::Rc::clone(&seen);
        sim.on_progress(1_000, move |p| log.borrow_mut().push(p));
        let watched = sim.run();
        assert_eq!(quiet, watched, "watching a run must not change it");
        let seen = seen.borrow();
        assert_eq!(seen.len() as u64, watched.counters.events / 1_000);
        assert!(
            seen.windows(2)
                .all(|w| w[0].virtual_s <= w[1].virtual_s && w[0].events + 1_000 == w[1].events)
        );
        assert_eq!(seen[0].events, 1_000);
        let last = seen.last().unwrap();
        assert!(last.virtual_s > 1.0 && last.virtual_s <= 3.0, "{last:?}");
        assert_eq!(last.duration_s, 3.0);
    }

    #[test]
    fn a_link_entry_is_the_network_for_the_gateways_it_names() {
        use crate::scenario::LinkSpec;
        let mut near = small("shift");
        near.network.latency_ms = 2.0;
        let mut far = near.clone();
        far.network.latency_ms = 60.0;
        // Every gateway named by a link of 60 ms: the same run as a 60 ms network.
        let mut linked = near.clone();
        linked.links.push(LinkSpec {
            agents: (0..near.gateways).collect(),
            latency_ms: Some(60.0),
            jitter_ms: None,
            loss: None,
            reorder: None,
        });
        let (near_r, far_r) = (run(&near, 5).unwrap(), run(&far, 5).unwrap());
        let linked_r = run(&linked, 5).unwrap();
        assert_eq!(linked_r.summary, far_r.summary);
        assert_eq!(linked_r.counters, far_r.counters);
        assert_ne!(near_r.counters, far_r.counters);
        // Half of them far: neither run.
        let mut half = near.clone();
        half.links.push(LinkSpec {
            agents: (near.gateways / 2..near.gateways).collect(),
            ..linked.links[0].clone()
        });
        let half_r = run(&half, 5).unwrap();
        assert_eq!(half_r.summary.violations, 0);
        assert_ne!(half_r.counters, near_r.counters);
        assert_ne!(half_r.counters, far_r.counters);
    }

    #[test]
    fn the_allocator_sees_the_demand_the_gateways_are_offered() {
        // Every key is offered 1.2 R. Grants replace a key's slot (and its counters)
        // several times per report interval at first; a replaced slot's counts used to
        // be lost, and the allocator saw about a fifth of the demand.
        let sc = small("steady");
        let mut sim = Sim::new(&sc, 1, "bursar").unwrap();
        sim.run_loop();
        let offered = sc.workload.load * sc.limit.rate_per_s as f64;
        let alloc = sim.side().alloc.as_ref().unwrap();
        for k in &sim.keys {
            let st = alloc.key_status(&k.name).unwrap();
            assert!(
                (st.demand - offered).abs() < 0.3 * offered,
                "{}: demand {:.0} against {offered:.0} offered",
                k.name,
                st.demand
            );
        }
    }

    #[test]
    fn zipf_skew_keeps_most_of_what_one_ideal_bucket_admits() {
        // The built-in: B is 0.2 s of R, so B/N is 1.25-2.3 requests per gateway;
        // split buckets that small waste refill whenever they sit full (a static split
        // in proportion to demand reaches about 0.8 in a model of this load).
        let sc = Scenario::load("zipf").unwrap();
        let r = run(&sc, 1).unwrap();
        assert_eq!(r.summary.violations, 0);
        assert_eq!(r.summary.overshoot_max_fraction_of_burst, 0.0);
        assert!(r.summary.utilization_vs_ideal > 0.75, "{:?}", r.summary);
        assert!(r.summary.utilization_second_half > 0.78, "{:?}", r.summary);
        // With the rule's default burst (one period of R), the steady state is within
        // a few percent of the ideal bucket.
        let mut big = sc.clone();
        big.limit.burst = sc.limit.rate_per_s;
        let r = run(&big, 1).unwrap();
        assert_eq!(r.summary.overshoot_max_fraction_of_burst, 0.0);
        assert!(r.summary.utilization_second_half > 0.96, "{:?}", r.summary);
    }

    #[test]
    fn growth_before_shrinks_land_overshoots_and_revoke_before_grant_does_not() {
        // Every gateway over its share while the shares move, half of them 150 ms
        // away: a Doorman-like allocator grows the near half before the far half's
        // shrinks arrive, and the fleet admits more than one bucket would.
        let sc = Scenario::load("shift-overload").unwrap();
        assert!(sc.workload.shift_share < 1.0);
        let ours = run(&sc, 1).unwrap();
        assert_eq!(ours.summary.violations, 0);
        assert_eq!(ours.summary.overshoot_max_fraction_of_burst, 0.0);
        assert!(
            ours.summary.utilization_vs_ideal > 0.9,
            "{:?}",
            ours.summary
        );
        let doorman = Sim::new(&sc, 1, "doorman").unwrap().run();
        assert!(
            doorman.summary.overshoot_max_fraction_of_burst > 0.1,
            "{:?}",
            doorman.summary
        );
    }

    #[test]
    fn a_shift_share_below_one_keeps_demand_on_the_quiet_half() {
        let mut sc = Scenario::load("shift").unwrap();
        sc.duration_s = 2.0;
        let all = Sim::new(&sc, 1, "static").unwrap().run();
        sc.workload.shift_share = 0.75;
        let most = Sim::new(&sc, 1, "static").unwrap().run();
        // Static slices of R/N: with every request on one half, half of the fleet's
        // slices sit idle; with a quarter on the other, they admit too.
        assert!(
            most.summary.utilization_vs_ideal > all.summary.utilization_vs_ideal + 0.1,
            "{} vs {}",
            most.summary.utilization_vs_ideal,
            all.summary.utilization_vs_ideal
        );
    }

    #[test]
    fn zipf_at_the_default_burst_reaches_the_utilization_goal_in_steady_state() {
        // The issue's goal (>= 0.98 of one ideal bucket under steady Zipf skew), over
        // the second half of a 20 s run: the fleet's slices start empty while the ideal
        // bucket starts with B, so the whole run stays ~5 % behind.
        let sc = Scenario::load("zipf-default-burst").unwrap();
        assert_eq!(sc.limit.burst, sc.limit.rate_per_s);
        let r = run(&sc, 1).unwrap();
        assert_eq!(r.summary.violations, 0);
        assert_eq!(r.summary.overshoot_max_fraction_of_burst, 0.0);
        assert!(r.summary.utilization_second_half >= 0.98, "{:?}", r.summary);
        assert!(r.summary.utilization_vs_ideal > 0.9, "{:?}", r.summary);
    }

    #[test]
    fn a_sparse_key_concentrated_on_its_busiest_gateways_admits_more_with_fewer_grants() {
        // Under one request per key per report on almost every gateway: every even
        // split gives slices too small for a request. With the rule's typical cost the
        // allocator concentrates each key on the busiest gateways (tuning.md, "Sparse
        // keys"); without it, it chases single requests with grants.
        let sc = Scenario::load("sparse").unwrap();
        assert!(sc.limit.typical_cost > 0);
        let with = run(&sc, 1).unwrap();
        let mut unknown = sc.clone();
        unknown.limit.typical_cost = 0;
        let without = run(&unknown, 1).unwrap();
        for r in [&with, &without] {
            assert_eq!(r.summary.violations, 0);
            assert_eq!(r.summary.overshoot_max_fraction_of_burst, 0.0);
        }
        let (u, u0) = (
            with.summary.utilization_second_half,
            without.summary.utilization_second_half,
        );
        assert!(u > 2.0 * u0 && u > 0.2, "with {u}, without {u0}");
        assert!(
            with.counters.grants * 3 < without.counters.grants,
            "grants with {}, without {}",
            with.counters.grants,
            without.counters.grants
        );
    }

    #[test]
    fn the_verifier_records_its_deepest_deficit_and_the_ideal_bucket_refuses_past_zero() {
        let mut v = Exact::full(100, 50, 0);
        v.debit(0, 80);
        assert_eq!(v.deficit_tokens(), 30.0);
        v.debit(SEC, 10); // refilled by 100, capped at 50, minus 10
        assert_eq!(v.level, 40 * SEC as i128);
        assert_eq!(v.deficit_tokens(), 30.0);
        let mut ideal = Exact::full(100, 50, 0);
        assert!(ideal.try_take(0, 50));
        assert!(!ideal.try_take(0, 1));
        assert!(ideal.try_take(SEC / 100, 1));
    }

    #[test]
    fn an_unknown_policy_is_refused() {
        let sc = small("steady");
        assert!(matches!(
            Sim::new(&sc, 1, "envoy"),
            Err(SimError::Policy(_))
        ));
    }

    #[test]
    fn after_an_allocator_crash_every_agent_backs_off_and_reconnects_to_the_new_term() {
        // 8 gateways; the allocator is down from 2 s to 5 s of a 12 s run.
        let sc = Scenario::load("allocator-crash").unwrap();
        let g = sc.gateways as u64;
        for seed in [1, 2] {
            let r = run(&sc, seed).unwrap();
            assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
            assert_eq!(r.summary.overshoot_max_fraction_of_burst, 0.0);
            let c = &r.counters;
            // Every stream broke at the crash, and the client's backoff (waits of
            // 50-100 ms doubling) meets the dead allocator 4-5 times in 3 s, each a
            // refusal; a hello in flight across the restart is answered by no one
            // and given up after 2 s.
            assert!(
                (5 * g..=8 * g).contains(&c.streams_lost),
                "streams lost: {}",
                c.streams_lost
            );
            // Each loss is followed by a hello, the last of each agent's welcomed: no
            // agent is left without a stream.
            assert_eq!(c.streams_opened, g + c.streams_lost);
            assert_eq!(c.streams_up_at_end, g);
            // And the new term grants again: the second half admits.
            assert!(r.summary.utilization_second_half > 0.5, "{:?}", r.summary);
        }
    }

    /// Review, thirty-first session: LLM arrivals were spaced by the lognormal's mean
    /// without the clamp to `[cost_min, cost_max]`, so at `input_sigma` 3 the offered
    /// load was about 6 % of the stated one, and past sigma ~38 the mean was infinite
    /// and nothing arrived at all. They are spaced by the clamped distribution's mean.
    #[test]
    fn llm_costs_offer_the_stated_load_whatever_the_input_sigma() {
        for sigma in [3.0, 1.0, 50.0] {
            let mut sc = Scenario::load("llm-zipf").unwrap();
            sc.duration_s = 20.0;
            sc.workload.input_sigma = sigma;
            sc.validate().unwrap();
            let r = run(&sc, 1).unwrap();
            assert_eq!(r.worst_keys.len(), sc.keys);
            let offered: u64 = r.worst_keys.iter().map(|k| k.offered).sum();
            let stated =
                sc.workload.load * sc.limit.rate_per_s as f64 * sc.duration_s * sc.keys as f64;
            let ratio = offered as f64 / stated;
            assert!(
                (0.9..1.1).contains(&ratio),
                "input_sigma {sigma}: offered {ratio:.3} of the stated load"
            );
        }
    }

    /// Review, thirty-first session: the LLM input's median was
    /// `sqrt((cost_min * cost_max) as f64)` with the product in u64, which wraps for
    /// costs past 2^32 each (a panic in debug; in release a median of ~0, so every
    /// input was clamped up to `cost_min`). The product is taken in f64.
    #[test]
    fn llm_inputs_center_on_their_median_with_costs_past_two_to_the_32() {
        let mut sc = Scenario::load("llm-zipf").unwrap();
        let big = 1u64 << 36;
        sc.workload.cost_min = 1 << 32;
        sc.workload.cost_max = big;
        sc.workload.output_max_tokens = big;
        sc.workload.ms_per_output_token = 0.0; // an hour's generation at most
        sc.limit.burst = 2 * big;
        sc.limit.rate_per_s = 4 * big;
        sc.validate().unwrap();
        let mut sim = Sim::new(&sc, 1, "bursar").unwrap();
        let shared = Arc::clone(&sim.shared);
        let until = sim.t0 + 20 * SEC;
        let wl = sim.workload_mut();
        wl.draw_until(&shared, until);
        let mut inputs: Vec<u64> = wl
            .out
            .iter()
            .filter_map(|(_, ev)| match ev {
                Ev::Request(_, _, input, _, _) => Some(*input),
                _ => None,
            })
            .collect();
        assert!(inputs.len() > 100, "{} requests", inputs.len());
        inputs.sort_unstable();
        let median = inputs[inputs.len() / 2];
        // sqrt(2^32 * 2^36) = 2^34.
        assert!(
            (1 << 33..1 << 35).contains(&median),
            "median input {median} against 2^34 = {}",
            1u64 << 34
        );
    }

    /// Review, thirty-first session: a restarted Doorman-like allocator stamped its
    /// grants epoch 1 again with its seq from 0, so the agents, still holding the old
    /// term's (1, N), refused them as stale until the new count passed the old one
    /// (about a fifth of the grants in `allocator-crash`). The term is the epoch.
    #[test]
    fn a_restarted_doorman_like_allocator_s_grants_are_not_refused_as_stale() {
        let sc = Scenario::load("allocator-crash").unwrap();
        for seed in [1, 2] {
            let r = Sim::new(&sc, seed, "doorman").unwrap().run();
            assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
            let c = &r.counters;
            assert!(c.grants > 0);
            assert!(
                c.grants_refused * 50 < c.grants,
                "seed {seed}: {} grants refused of {} messages",
                c.grants_refused,
                c.grants
            );
        }
    }

    /// Review, thirty-first session: the Doorman-like allocator's first tick was
    /// pushed at `t0 - report_interval`, which wrapped around with an interval longer
    /// than the warm-up (a panic in debug; in release the tick never came and nothing
    /// was granted).
    #[test]
    fn a_doorman_like_report_interval_longer_than_the_warm_up_still_grants() {
        let mut sc = small("steady");
        sc.duration_s = 10.0;
        sc.allocator.report_interval_ms = 3_000;
        sc.validate().unwrap();
        let sim = Sim::new(&sc, 1, "doorman").unwrap();
        assert!(
            sim.t0 < 3_000 * MS,
            "the warm-up is shorter than the interval"
        );
        let r = sim.run();
        assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
        assert!(r.counters.grants > 0, "{:?}", r.counters);
        assert!(r.summary.utilization_vs_ideal > 0.0, "{:?}", r.summary);
    }

    #[test]
    fn a_partition_longer_than_the_keep_alive_breaks_the_streams_and_they_come_back() {
        // Gateways 0-3 lose the allocator from 2 s to 17 s of 24 s.
        let sc = Scenario::load("partition-long").unwrap();
        let r = run(&sc, 1).unwrap();
        assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
        assert!(r.summary.overshoot_max_fraction_of_burst <= r.summary.bound_fraction_of_burst);
        let c = &r.counters;
        // Each cut-off agent's keep-alive gives its stream up within 7 s, then each
        // hello goes unanswered for 2 s and the backoff grows (0.1 s doubling): 3 to 5
        // more tries in the 8-10 s left of the partition.
        assert!(
            (4 * 4..=4 * 7).contains(&c.streams_lost),
            "{}",
            c.streams_lost
        );
        // Every loss is followed by a hello; the four come back after the heal (the
        // second half admits nearly what one ideal bucket would).
        assert_eq!(c.streams_opened, sc.gateways as u64 + c.streams_lost);
        assert_eq!(c.streams_up_at_end, sc.gateways as u64);
        assert!(r.summary.utilization_second_half > 0.9, "{:?}", r.summary);
    }

    #[test]
    fn a_hello_or_welcome_lost_on_a_lossy_link_is_retried_until_the_stream_is_up() {
        // A quarter of every message lost: many hellos or welcomes never arrive, and
        // each such stream is given up after 2 s and tried again after the backoff.
        let mut sc = small("steady");
        sc.gateways = 8;
        sc.duration_s = 8.0;
        sc.network.loss = 0.25;
        let r = run(&sc, 4).unwrap();
        assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
        let c = &r.counters;
        assert!(c.streams_lost > 0, "no stream was given up at 30 % loss");
        assert_eq!(c.streams_opened, sc.gateways as u64 + c.streams_lost);
        assert_eq!(c.streams_up_at_end, sc.gateways as u64);
    }

    #[test]
    fn a_crashed_agent_comes_back_as_a_new_incarnation_and_gets_budget_again() {
        let sc = small("agent-crash");
        let r = run(&sc, 5).unwrap();
        assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
        assert_eq!(r.summary.overshoot_max_fraction_of_burst, 0.0);
        assert!(r.summary.utilization_vs_ideal > 0.3);
    }

    #[test]
    fn gubernator_like_peers_debit_each_others_buckets_and_overshoot_by_the_sync_lag() {
        // 4 gateways, 1 key, 2 R offered: each gateway alone sees 0.5 R, under the full
        // (R, B) it holds, so only the peers' hits can hold the fleet near R.
        let mut sc = small("steady");
        sc.gateways = 4;
        sc.keys = 1;
        sc.workload.load = 2.0;
        let run_with = |interval_ms: u64| {
            let mut sc = sc.clone();
            sc.allocator.report_interval_ms = interval_ms;
            Sim::new(&sc, 21, "gubernator").unwrap().run()
        };
        let synced = run_with(50);
        let never = run_with(1_000_000); // first sync after the run ends
        assert_eq!(synced.policy, "gubernator");
        assert_eq!(synced.counters.to_allocator + synced.counters.to_agents, 0);
        assert!(synced.counters.peer > 0 && synced.counters.peer_bytes > 0);
        assert_eq!(never.counters.peer, 0);
        let (u_synced, u_never) = (
            synced.summary.utilization_vs_ideal,
            never.summary.utilization_vs_ideal,
        );
        assert!(
            u_never > 1.8,
            "unsynced, 4 full buckets admit ~2 R: {u_never}"
        );
        assert!(
            u_synced < 1.15,
            "synced hits hold the fleet near R: {u_synced}"
        );
        // The lag between a hit and its debit elsewhere still lets the fleet past
        // (R, B); the policy states no bound, so that is a violation.
        let over = synced.summary.overshoot_max_fraction_of_burst;
        assert!(over > 0.0, "{over}");
        assert!(over < never.summary.overshoot_max_fraction_of_burst / 4.0);
        assert!(synced.summary.violations > 0);
    }

    #[test]
    fn an_allocator_partition_cuts_every_agent_off_the_allocator_but_not_each_other() {
        let mut sc = Scenario::load("allocator-partition").unwrap();
        sc.duration_s = 7.0;
        sc.gateways = 4;
        let r = run(&sc, 3).unwrap();
        assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
        assert!(
            r.counters.lost > 0,
            "messages to and from the allocator are lost"
        );
        // The 4 s cut outlasts the 2 s leases: every agent falls back, and the bound
        // counts it.
        assert!(r.summary.bound_fraction_of_burst > 0.0);
        let g = Sim::new(&sc, 3, "gubernator").unwrap().run();
        assert!(g.counters.peer > 0);
        assert_eq!(g.counters.lost, 0, "peers still reach each other");
    }

    #[test]
    fn control_bytes_are_counted_for_every_message() {
        let mut sc = small("steady");
        sc.gateways = 3;
        let r = run(&sc, 8).unwrap();
        let c = &r.counters;
        assert!(c.to_allocator > 0 && c.to_agents > 0);
        // Every message carries at least the gRPC prefix and a few fields.
        assert!(c.to_allocator_bytes >= 10 * c.to_allocator);
        assert!(c.to_agents_bytes >= 20 * c.to_agents);
        let s = &r.summary;
        assert!(s.control_bytes_per_agent_per_s > 10.0 * s.control_messages_per_agent_per_s);
    }

    #[test]
    fn the_baseline_policies_drive_the_same_engines_and_report_under_their_name() {
        let mut sc = small("zipf");
        sc.gateways = 4;
        let st = Sim::new(&sc, 9, "static").unwrap().run();
        assert_eq!(st.policy, "static");
        assert_eq!(st.counters.to_allocator, 0, "a static split sends nothing");
        assert_eq!(st.summary.overshoot_max_fraction_of_burst, 0.0);
        assert!(st.summary.utilization_vs_ideal > 0.2);
        let d1 = Sim::new(&sc, 9, "doorman").unwrap().run();
        let d2 = Sim::new(&sc, 9, "doorman").unwrap().run();
        assert_eq!(d1, d2);
        assert_eq!(d1.policy, "doorman");
        assert!(d1.counters.to_agents > 0 && d1.counters.to_allocator > 0);
        assert!(d1.summary.utilization_vs_ideal > 0.2);
    }

    #[test]
    fn llm_like_requests_reserve_output_and_complete_later_without_overshoot() {
        let sc = small("llm-zipf");
        assert!(sc.workload.llm);
        let r = run(&sc, 4).unwrap();
        assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
        assert_eq!(r.summary.overshoot_max_fraction_of_burst, 0.0);
        assert_eq!(r.counters.completions_refused, 0);
        let admitted: u64 = r.worst_keys.iter().map(|k| k.admitted).sum();
        assert!(admitted > 0, "some LLM-like requests were admitted");
    }

    #[test]
    fn drifting_agent_clocks_run_at_their_own_rate_and_stay_monotonic() {
        let mut sc = small("partition-drift");
        sc.gateways = 3;
        let sim = Sim::new(&sc, 2, "bursar").unwrap();
        let agents: Vec<&Agent> = (0..sc.gateways).map(|i| sim.agent(i)).collect();
        let rates: Vec<f64> = agents.iter().map(|a| a.drift_ppm).collect();
        assert!(rates.iter().all(|d| d.abs() <= 50_000.0));
        assert!(rates.iter().any(|d| *d != 0.0));
        for a in agents {
            let (t1, t2) = (10 * SEC, 20 * SEC);
            let dt = (a.clock(t2) - a.clock(t1)) as f64;
            assert!((dt / (10 * SEC) as f64 - (1.0 + a.drift_ppm / 1e6)).abs() < 1e-6);
        }
        let r = sim.run();
        assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
    }

    #[test]
    fn the_replay_command_names_the_seed_and_every_override() {
        assert_eq!(
            replay_command("steady", 7, &Overrides::default(), "bursar"),
            "bursar-sim run steady --seed 7"
        );
        let o = Overrides {
            gateways: Some(3),
            keys: Some(2),
            duration_s: Some(1.5),
            latency_ms: Some(40.0),
            jitter_ms: Some(8.5),
            report_interval_ms: Some(100),
            lease_ms: Some(5_000),
            burst: Some(800),
            overdraft_permille: Some(50),
            hysteresis_permille: Some(150),
            measure_window_ms: Some(60),
        };
        assert_eq!(
            replay_command("x.toml", 1, &o, "static"),
            "bursar-sim run x.toml --seed 1 --gateways 3 --keys 2 --duration-s 1.5 \
             --latency-ms 40 --jitter-ms 8.5 --report-interval-ms 100 --lease-ms 5000 --burst 800 --overdraft-permille 50 \
             --hysteresis-permille 150 --measure-window-ms 60 --policy static"
        );
        // The overrides it names are the ones applied.
        let mut sc = Scenario::load("steady").unwrap();
        o.apply(&mut sc).unwrap();
        assert_eq!(
            (sc.gateways, sc.allocator.lease_ms, sc.limit.burst),
            (3, 5_000, 800)
        );
        assert_eq!(sc.allocator.overdraft_permille, 50);
        assert_eq!(sc.allocator.hysteresis_permille, 150);
        assert_eq!(sc.allocator.measure_window_ms, 60);
        assert_eq!((sc.network.latency_ms, sc.network.jitter_ms), (40.0, 8.5));
    }

    #[test]
    fn a_wider_hysteresis_band_sends_fewer_grants_and_never_overshoots() {
        // The trade docs/tuning.md measures: the band reaches the real allocator.
        let run = |h: u32| {
            let mut sc = small("zipf");
            sc.duration_s = 4.0;
            sc.allocator.hysteresis_permille = h;
            Sim::new(&sc, 1, "bursar").unwrap().run()
        };
        let (narrow, wide) = (run(50), run(250));
        for r in [&narrow, &wide] {
            assert_eq!(r.summary.violations, 0, "{:?}", r.violation_messages);
            assert_eq!(r.summary.overshoot_max_fraction_of_burst, 0.0);
        }
        assert!(
            wide.counters.grants * 3 < narrow.counters.grants * 2,
            "grants: band 250 {} against band 50 {}",
            wide.counters.grants,
            narrow.counters.grants
        );
    }

    #[test]
    fn key_values_map_back_to_their_index_and_nothing_else_does() {
        assert_eq!(key_of("t0", 3), Some(0));
        assert_eq!(key_of("t2", 3), Some(2));
        for bad in ["t3", "t", "t01", "t+1", "x1", "1", "t-1"] {
            assert_eq!(key_of(bad, 3), None, "{bad}");
        }
    }

    #[test]
    fn p95_picks_the_nearest_rank() {
        let mut xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(p95(&mut xs), Some(95.0));
        assert_eq!(p95(&mut []), None);
    }
}
