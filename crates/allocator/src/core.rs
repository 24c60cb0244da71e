//! The allocation core: a sans-IO state machine.
//!
//! Inputs are [`Allocator::handle_hello`], [`Allocator::handle_report`],
//! [`Allocator::handle_ack`], [`Allocator::handle_disconnect`] and
//! [`Allocator::handle_timeout`], each with the allocator's `now` (nanoseconds of a
//! monotonic clock the shell owns). Outputs are [`Grant`]s in an outbox the shell drains
//! ([`Allocator::drain_grants`]) after each call, and the next deadline
//! ([`Allocator::poll_timeout`]).
//!
//! # Accounting (invariant 1, revoke before grant)
//!
//! Per key and agent the core keeps the grants it has **sent** that the agent might
//! still be using: every grant from the last one the agent is known to have applied (by
//! an ack, or the held grant in a report or hello) onwards, until its lease has ended by
//! the allocator's clock plus `reclaim_margin_ms`. The agent's **commitment** is the
//! componentwise maximum of those grants; the sum of commitments per key never exceeds
//! `(R + O, B)`. A shrink is sent at once but frees nothing until applied; growth is
//! sent only out of what is free. A grant's allocator-side expiry is computed from the
//! allocator's receive time of the report whose agent timestamp the grant echoes, which
//! is later than the agent's own timestamp: the agent's lease always ends first
//! (invariant 3).
//!
//! # Partitions
//!
//! When a grant the agent might be using expires, the core stops counting it and
//! remembers the rule's posture **fallback** (`strict`: nothing; `conservative`:
//! `min(grant, R/N)`; `open`: the grant) until the agent applies a newer grant. The
//! sum of fallbacks is the key's overshoot bound ([`Allocator::overshoot_bound`]).
//!
//! # Recomputation
//!
//! A report marks the keys whose demand moved (beyond `demand_change_permille`); marked
//! keys sit in a heap by due time and are recomputed whole in
//! [`Allocator::handle_timeout`] `recompute_delay_ms` later, so reports that arrive
//! together are allocated together. Due times fall on a tick of a quarter of the delay
//! (an acknowledged shrink makes its key due at the next tick), so the allocator wakes
//! at most four times per delay and an agent's grants from one pass leave together. A key held by more than `large_key_entries` agents
//! is recomputed whole at most every `large_key_recompute_ms * ceil(sqrt(n / large))`;
//! in between, a report re-targets only the reporting agent's entry against the key's
//! last water level ([`crate::waterfill::Fill`]). Both paths grant through one function
//! (`grant_towards`) that enforces revoke-before-grant, so the schedule affects how fast
//! budget moves, never whether the sum stays within the limit.
//!
//! # Time and tables
//!
//! An agent's leases are renewed when it reports and its earliest grant has less than
//! half of its hold (`lease_ms + reclaim_margin_ms`) left: one lease extension for all
//! of them ([`Allocator::drain_extensions`]); a report that shows a grant lost or
//! lapsed gets it sent again. Expired grants are swept every `lease_ms / 8`. Every
//! table has a bound in [`AllocatorConfig`]; at a bound the message is refused whole
//! with an [`AllocError`], and a full outbox defers recomputation until drained.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use bursar_agent::config::Pattern;
use bursar_agent::{Config, Dimension, MAX_COST, Posture, RuleLimit};
use foldhash::fast::FixedState;

use crate::config::{AllocatorConfig, MAX_AGENT_ID_BYTES};
use crate::error::AllocError;
use crate::msg::{
    Ack, Grant, GrantRef, HeldGrant, Hello, KeyName, KeyReport, LeaseExtension, Measure,
    MeasureRequest, Report, Revocation, UnknownHandles,
};
use crate::waterfill::{Claim, Fill, to_units, water_fill};
use smallvec::SmallVec;

mod pass;
mod reload;
pub use reload::{ReloadSummary, RuleStatus};

/// Grants remembered per key and agent before the oldest two are merged (into one
/// record as large as both, so that accounting stays conservative).
const MAX_SENT: usize = 6;
// `Entry::push_sent` merges the oldest two inside the boxed older grants.
const _: () = assert!(MAX_SENT >= 2);

/// Recompute ticks per `recompute_delay_ms` ([`Allocator::recompute_due`]).
const RECOMPUTE_TICKS_PER_DELAY: u64 = 4;

/// [`Entry::term_seq`] when the latest grant is not of this allocator's term (or none
/// was sent): no seq of a term reaches it.
const NOT_TERM: u64 = u64::MAX;
/// Most holders of one key asked to measure at a time (the largest grants).
const MEASURE_MAX_HOLDERS: usize = 64;
/// Most measure requests (agent, key) queued before the shell drains them.
const MAX_MEASURES_QUEUED: usize = 65_536;

/// Most unknown key handles queued for agents between two drains.
const MAX_UNKNOWN_QUEUED: usize = 65_536;
/// Most revoked (agent, key) pairs queued between two drains: a reload that releases
/// more queues the rest when their agents next name the keys ([`Revocation`]).
const MAX_REVOCATIONS_QUEUED: usize = 1 << 20;
/// Most keys an agent's stream remembers having revoked (each revoked once per
/// stream: the agent's lines keep naming a revoked key, with the posture's slice as
/// held). Past it, a key's every line with a held grant revokes it again.
const MAX_REVOKED_PER_STREAM: usize = 65_536;
/// Typical requests a holder should expect in a measurement window: an empty window
/// then happens by chance about once in 150 (Poisson).
const MEASURE_MIN_REQUESTS: f64 = 5.0;

/// Typical requests an empty measurement window must have been expected to hold, by
/// the estimate when it ends, for the emptiness to drop the estimate. Below
/// [`MEASURE_MIN_REQUESTS`]: a window sized for exactly five at the request is judged
/// at its end, when the estimate has moved a little, and at five a holder whose demand
/// had left was kept whenever its estimate had slipped a fraction of a percent (the
/// `shift` scenario's one-second reallocations). An empty window expected to hold four
/// is chance once in 55 (`e^-4`).
const MEASURE_ENOUGH_REQUESTS: f64 = 4.0;

/// Probes for a key id whose name hash collides.
const MAX_PROBE: u64 = 4;

/// Longest descriptor value in a key name (as the agent's config bounds it).
const MAX_VALUE_BYTES: usize = 256;
/// Most rule shapes one hello may carry.
const MAX_RULE_SHAPES: usize = 10_000;

/// A (rate, burst) pair: rate in units per the rule's period (0 for concurrency), burst
/// in units (slots for concurrency).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slice {
    /// Rate per period.
    pub rate: u64,
    /// Burst (slots).
    pub burst: u64,
}

impl Slice {
    const ZERO: Slice = Slice { rate: 0, burst: 0 };

    fn max(self, o: Slice) -> Slice {
        Slice {
            rate: self.rate.max(o.rate),
            burst: self.burst.max(o.burst),
        }
    }

    fn min(self, o: Slice) -> Slice {
        Slice {
            rate: self.rate.min(o.rate),
            burst: self.burst.min(o.burst),
        }
    }

    fn le(self, o: Slice) -> bool {
        self.rate <= o.rate && self.burst <= o.burst
    }

    fn is_zero(self) -> bool {
        self.rate == 0 && self.burst == 0
    }
}

/// The worst-case overshoot a key can suffer now (DESIGN.md, "Leases and
/// partitions"): in any window of length `T`, fleet-wide admissions stay within
/// `B + R*T` plus `burst + (rate + overdraft_rate) * T / period`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OvershootBound {
    /// Sum over partitioned agents of their posture fallback rates (`conservative`:
    /// `min(grant, R/N)`; `open`: the grant; `strict`: 0), per the rule's period.
    pub rate: u64,
    /// The same sum over bursts (slots for concurrency rules).
    pub burst: u64,
    /// The overdraft `O` (rate per period): granted on purpose, never on burst.
    pub overdraft_rate: u64,
    /// Agents whose fallback counts.
    pub partitioned_agents: u32,
    /// The rule's period in ns (0 for concurrency).
    pub period_ns: u64,
}

impl OvershootBound {
    /// Most units admitted beyond one global bucket `(R, B)` in a window of `window_ns`.
    pub fn excess_over(&self, window_ns: u64) -> u128 {
        let per = self.period_ns.max(1) as u128;
        let rate = (self.rate + self.overdraft_rate) as u128;
        self.burst as u128 + rate * window_ns as u128 / per
    }
}

/// A key's allocation state, for the admin endpoint, summaries and tests.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyStatus {
    /// The key.
    pub key: KeyName,
    /// The whole limit: `(R, B)` (concurrency: `(0, slots)`).
    pub limit: Slice,
    /// The rate capacity granted at most: `R + O` (concurrency: 0).
    pub rate_capacity: u64,
    /// Sum of commitments.
    pub committed: Slice,
    /// Sum of smoothed demand, per period.
    pub demand: f64,
    /// Per agent: id, smoothed demand, latest grant sent, commitment.
    pub agents: Vec<AgentSlice>,
    /// Tokens waiting to be handed to a growing agent.
    pub transfer_pool: u64,
    /// The key is concentrated on its busiest agents (its split would leave slices too
    /// small for the rule's typical cost; docs/tuning.md, "Sparse keys").
    pub concentrated: bool,
    /// The overshoot bound.
    pub bound: OvershootBound,
}

/// One agent's share of a key.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentSlice {
    /// The agent.
    pub agent: Arc<str>,
    /// Smoothed demand, per period.
    pub demand: f64,
    /// Demand averaged over `sparse_half_life_ms` (what ranks the agents of a
    /// concentrated key).
    pub slow_demand: f64,
    /// The latest grant sent.
    pub granted: Slice,
    /// The largest grant it might be using.
    pub committed: Slice,
    /// Its posture fallback if it is partitioned.
    pub fallback: Option<Slice>,
}

#[derive(Clone, Copy, Debug)]
struct RuleInfo {
    wildcards: usize,
    /// `R` (0 for concurrency).
    rate: u64,
    /// `R + O` (0 for concurrency).
    rate_cap: u64,
    /// The overdraft `O` per period (what the bound states beside `R`).
    overdraft: u64,
    /// `B`, or slots.
    burst: u64,
    period_ns: u64,
    concurrency: bool,
    posture: Posture,
    /// The largest limit this rule has had in this process: a held grant above it is
    /// absurd (one below it may have been issued before a reload shrank the limit).
    held_cap: Slice,
    /// What an agent still on an older rules file may fall back to once its lease ends:
    /// the most permissive posture and the largest `(R, B)` this rule has had in this
    /// process (agents apply the posture of the file they run; the bound must not
    /// understate it after a reload).
    fallback_posture: Posture,
    fallback_limit: Slice,
    /// The cost of a typical request (the rule's `typical_cost`; 0: unknown). A slice
    /// whose burst is below it cannot admit such a request: see `concentrate`.
    typical: u64,
    /// New keys of this rule start with no transfer pool before this (allocator time):
    /// grants of its keys were released before their leases ended (an agent
    /// restarted), so a key forgotten and made again may not have been quiet for the
    /// margin [`Allocator::new_key_pool`] assumes.
    pool_quiet_until_ns: u64,
}

/// What gives a rule's keys their meaning; a reload that changes any of it replaces
/// the rule (its keys are released and start afresh).
#[derive(Clone, Debug, PartialEq)]
struct RuleMeta {
    name: String,
    dimension: Dimension,
    matches: Vec<(String, Pattern)>,
    period_ns: u64,
    concurrency: bool,
    /// `bursar_agent::Rule::shape` (a function of the fields above).
    shape: u64,
}

/// The rate the allocator grants out of: `cap / (1 + ppm / 10^6)`, rounded down, so
/// that agents whose clocks run fast by up to `ppm` refill within `cap` in real time.
fn drift_cap(cap: u64, ppm: u32) -> u64 {
    (cap as u128 * 1_000_000 / (1_000_000 + ppm as u128)) as u64
}

/// Builds the core's view of `rules`: per rule its numbers and meaning, and the index
/// by name.
fn build_rules(
    rules: &Config,
    overdraft_permille: u32,
    clock_drift_ppm: u32,
) -> (
    Vec<RuleInfo>,
    Vec<RuleMeta>,
    HashMap<String, u32, FixedState>,
) {
    let mut infos = Vec::new();
    let mut meta = Vec::new();
    let mut rule_index = HashMap::with_hasher(FixedState::with_seed(0));
    for (i, r) in rules.rules.rules().iter().enumerate() {
        let wildcards = r.wildcards();
        let mut info = match r.limit {
            RuleLimit::Rate { rate, per, burst } => RuleInfo {
                wildcards,
                rate,
                rate_cap: drift_cap(
                    rate + rate * overdraft_permille as u64 / 1000,
                    clock_drift_ppm,
                ),
                overdraft: rate * overdraft_permille as u64 / 1000,
                burst,
                period_ns: per.as_ns(),
                concurrency: false,
                posture: r.posture,
                held_cap: Slice::ZERO,
                fallback_posture: r.posture,
                fallback_limit: Slice::ZERO,
                typical: r.typical_cost,
                pool_quiet_until_ns: 0,
            },
            RuleLimit::Concurrency { max_in_flight } => RuleInfo {
                wildcards,
                rate: 0,
                rate_cap: 0,
                overdraft: 0,
                burst: max_in_flight,
                period_ns: 0,
                concurrency: true,
                posture: r.posture,
                held_cap: Slice::ZERO,
                fallback_posture: r.posture,
                fallback_limit: Slice::ZERO,
                typical: 0,
                pool_quiet_until_ns: 0,
            },
        };
        info.held_cap = info.limit();
        info.fallback_limit = Slice {
            rate: info.rate,
            burst: info.burst,
        };
        meta.push(RuleMeta {
            name: r.name.clone(),
            dimension: r.dimension,
            matches: r.matches.clone(),
            period_ns: info.period_ns,
            concurrency: info.concurrency,
            shape: r.shape(),
        });
        infos.push(info);
        rule_index.insert(r.name.clone(), i as u32);
    }
    (infos, meta, rule_index)
}

impl RuleInfo {
    /// Capacity water-filling divides: the rate (with overdraft), or slots.
    fn capacity(&self) -> u64 {
        if self.concurrency {
            self.burst
        } else {
            self.rate_cap
        }
    }

    fn limit(&self) -> Slice {
        Slice {
            rate: self.rate_cap,
            burst: self.burst,
        }
    }

    /// The slice for `units` of the split dimension. The burst goes by the square root
    /// of the rate: `B * sqrt(units) / norm`, where `norm` is the key's sum of
    /// `sqrt(units)` over its entries plus `sqrt` of the rate left unassigned (which
    /// keeps its share of the burst free for newcomers), so the bursts sum to at most
    /// `B`. A concentrated (sparse) key first gives every slice `typical_cost` and splits
    /// what is left that way (`BurstSplit`). A bucket's refill noise grows with the
    /// square root of its rate, not with the rate: split in proportion, small slices got
    /// bursts below one request's cost (never admitting it, however much rate they held)
    /// and sat full, wasting refill, while large ones held more burst than they use.
    /// `split.norm <= 0` (before the key's first full recomputation): in proportion.
    fn target(&self, units: u64, learning: bool, e: &Entry, split: BurstSplit) -> Slice {
        let t = if self.concurrency {
            Slice {
                rate: 0,
                burst: units,
            }
        } else if split.norm > 0.0 {
            let b = split.spread as f64 * (units as f64).sqrt() / split.norm;
            let burst = if units > 0 && b.is_finite() && b >= 0.0 {
                (split.floor + b as u64).min(self.burst)
            } else {
                0
            };
            Slice { rate: units, burst }
        } else {
            // No division when burst and capacity are equal (burst defaults to the rate
            // per period); u64 when the product fits (a u128 division is a library call).
            let cap = self.rate_cap.max(1);
            let burst = if self.burst == cap {
                units
            } else {
                match self.burst.checked_mul(units) {
                    Some(p) => p / cap,
                    None => (self.burst as u128 * units as u128 / cap as u128) as u64,
                }
            };
            Slice { rate: units, burst }
        };
        if learning {
            // `black_box`: otherwise the load of `rare` is hoisted above the branch.
            t.min(learned_cap(std::hint::black_box(e)))
        } else {
            t
        }
    }

    /// The fallback of a grant from term `epoch`. A grant from an earlier term may
    /// have been issued under rules this process never ran (the allocator restarted on
    /// a changed file, and the agent still runs its old one, posture and limit): it
    /// counts whole, which never understates the bound.
    fn fallback_of(&self, epoch: u64, term: u64, g: Slice, fleet: u32) -> Slice {
        if epoch < term {
            g
        } else {
            self.fallback(g, fleet)
        }
    }

    fn fallback(&self, g: Slice, fleet: u32) -> Slice {
        let n = fleet.max(1) as u64;
        match self.fallback_posture {
            Posture::Strict => Slice::ZERO,
            Posture::Open => g,
            Posture::Conservative => Slice {
                rate: g.rate.min(self.fallback_limit.rate / n),
                burst: g.burst.min(self.fallback_limit.burst / n),
            },
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Sent {
    epoch: u64,
    seq: u64,
    slice: Slice,
    fleet: u32,
    /// Allocator clock: when this grant stops counting.
    expires_ns: u64,
}

impl Sent {
    fn id(&self) -> (u64, u64) {
        (self.epoch, self.seq)
    }
}

/// An agent's lease extension as the allocator counts it (see [`Allocator::renew`]):
/// every grant of term `term` with a seq up to `through` stops counting no earlier
/// than `expires_ns` (allocator clock), whatever its own expiry says. The agent extends
/// the same grants (`Engine::extend_slices`), so the two sides agree on what is in force.
#[derive(Clone, Copy, Debug, Default)]
struct Ext {
    term: u64,
    through: u64,
    expires_ns: u64,
}

impl Ext {
    /// When `s` stops counting, extension included.
    fn expiry(&self, s: &Sent) -> u64 {
        if s.epoch == self.term && s.seq <= self.through {
            s.expires_ns.max(self.expires_ns)
        } else {
            s.expires_ns
        }
    }
}

/// One key-agent pair. A million of them at the design's scale, so the layout matters:
/// what every recomputation reads (agent, flags, demand, the current grant's slice,
/// its seq when it is of this term, the last sample's time, in-flight: 64 bytes) comes
/// first (`repr(C)`); what every report line reads besides (the counters' bases, the
/// grant known applied) follows, so that a report line touches the first two lines
/// only; the rest of the latest grant, the count of grants remembered and the
/// commitment (read when a grant changes) make the third, so that a cold pass touches
/// the first and the third; older
/// grants still counted and what is rare (a grant learned from an earlier term, a
/// partition fallback) are boxed. 192 bytes, aligned to a cache line, so that each
/// group is one line (tested): at 264 bytes unaligned (`smallvec` without its `union`
/// layout), seven entries in eight straddled two lines there; at 256 (the grants as an
/// inline list of two, until the eighteenth session) a first grant touched all four.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
struct Entry {
    agent: u32,
    has_demand: bool,
    rejecting: bool,
    rejecting_used: bool,
    sampled: Sampled,
    demand: f64,
    /// The latest grant sent (with `cur_epoch`, `cur_seq`, `cur_expires_ns` and
    /// `cur_fleet`; zero when none is): read on every recomputation.
    cur: Slice,
    /// The latest grant's seq if it is of this allocator's term, else [`NOT_TERM`]
    /// (none sent, or one learned from an earlier term): a report line compares the
    /// grant it holds with the latest on the first line (a quarter of `handle_report`
    /// when it read the list of grants), and the term's grants need no epoch there.
    term_seq: u64,
    /// The agent's report time of the last sample: on the first line because an entry
    /// without a grant is tested for idleness by it (every entry of a cold pass).
    base_ts: u64,
    in_flight: u64,
    /// Demand when the key was last allocated (for change detection).
    demand_used: f64,
    /// Smoothed rejected cost per period.
    rejected_rate: f64,
    /// Demand averaged over `sparse_half_life_ms`, from 0 (no jumps): what ranks and
    /// splits a sparse key's entries.
    demand_slow: f64,
    base_admitted: u64,
    base_rejected: u64,
    since: u64,
    /// Latest grant known applied.
    applied: (u64, u64),
    /// Unused: the second line's last word, so that the third starts with the latest
    /// grant's id (a grant sent writes the first line and the third only).
    _spare: u64,
    /// The rest of the latest grant sent (`cur` holds its slice on the first line):
    /// its id, expiry and fleet size.
    cur_epoch: u64,
    cur_seq: u64,
    cur_expires_ns: u64,
    cur_fleet: u32,
    /// How many grants are remembered (0 to [`MAX_SENT`]): the latest, inline, and
    /// `older`.
    nsent: u8,
    /// The agent's stream ([`Agent::stream`]) that a grant of this entry named its key
    /// on (0: none yet): later grants on that stream go by handle alone
    /// ([`Hello::grants_by_handle`]). Beside the grant a recomputation writes, in the
    /// third line's padding: deciding costs no lookup.
    told: u16,
    /// The other grants that may be in use, oldest first, while there are any (most
    /// entries remember one grant: the box keeps the entry at three lines where an
    /// inline list of two took 104 of its 256 bytes).
    older: Option<Box<OlderSent>>,
    /// A learned grant or a partition fallback (rare: `None` otherwise).
    rare: Option<Box<Rare>>,
    /// Componentwise maximum of the grants remembered (kept in step by [`Key::edit`]).
    commit: Slice,
}

/// Whether an entry's counters have a base, and what set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Sampled {
    /// No report yet.
    No,
    /// A regular report.
    Yes,
    /// A requested measurement ([`Measure`]) started or ended: a regular report soon
    /// after is short, and is read as the frequent reporters' short samples are (the
    /// base stays, only a jump up counts), not diluted over `min_sample_ms`.
    Measured,
}

/// The rare parts of an [`Entry`].
#[derive(Clone, Debug, Default)]
struct Rare {
    /// What the agent held from an earlier term (the cap while learning).
    learned: Option<Slice>,
    /// Posture fallback of an expired grant, and the id it came from.
    fallback: Option<(Slice, (u64, u64))>,
}

impl Entry {
    /// A word from the first and third of the entry's lines, the ones a recomputation
    /// reads (for loops that only bring entries into cache).
    #[inline]
    fn warm_lines(&self) -> u64 {
        self.agent as u64 ^ self.cur_seq
    }

    fn new(agent: u32) -> Entry {
        Entry {
            agent,
            told: 0,
            has_demand: false,
            rejecting: false,
            rejecting_used: false,
            sampled: Sampled::No,
            demand: 0.0,
            cur: Slice::ZERO,
            commit: Slice::ZERO,
            in_flight: 0,
            demand_used: 0.0,
            rejected_rate: 0.0,
            demand_slow: 0.0,
            base_admitted: 0,
            base_rejected: 0,
            base_ts: 0,
            since: 0,
            applied: (0, 0),
            cur_expires_ns: 0,
            cur_fleet: 0,
            nsent: 0,
            older: None,
            rare: None,
            cur_epoch: 0,
            cur_seq: 0,
            term_seq: NOT_TERM,
            _spare: 0,
        }
    }

    /// The latest grant sent, if any.
    fn last_sent(&self) -> Option<Sent> {
        (self.nsent > 0).then_some(Sent {
            epoch: self.cur_epoch,
            seq: self.cur_seq,
            slice: self.cur,
            fleet: self.cur_fleet,
            expires_ns: self.cur_expires_ns,
        })
    }

    /// The grants remembered (that may be in use), oldest first.
    fn sent(&self) -> impl Iterator<Item = Sent> + '_ {
        self.older
            .iter()
            .flat_map(|o| o.iter().copied())
            .chain(self.last_sent())
    }

    /// Makes `s` the latest grant sent (the older ones unchanged); `term`: this
    /// allocator's.
    fn set_last(&mut self, s: Option<Sent>, term: u64) {
        self.term_seq = match s {
            Some(s) if s.epoch == term => s.seq,
            _ => NOT_TERM,
        };
        let s = s.unwrap_or(Sent {
            epoch: 0,
            seq: 0,
            slice: Slice::ZERO,
            fleet: 0,
            expires_ns: 0,
        });
        self.cur = s.slice;
        self.cur_epoch = s.epoch;
        self.cur_seq = s.seq;
        self.cur_fleet = s.fleet;
        self.cur_expires_ns = s.expires_ns;
    }

    /// Edits the grants remembered as a list, oldest first (the rarer edits: a
    /// learned grant, expiries, an acknowledgement).
    fn edit_sent<R>(
        &mut self,
        term: u64,
        f: impl FnOnce(&mut SmallVec<[Sent; MAX_SENT + 1]>) -> R,
    ) -> R {
        let mut v: SmallVec<[Sent; MAX_SENT + 1]> = self.sent().collect();
        let r = f(&mut v);
        self.nsent = v.len() as u8;
        let last = v.pop();
        self.set_last(last, term);
        if v.is_empty() {
            self.older = None;
        } else {
            let o = self.older.get_or_insert_with(Box::default);
            o.clear();
            o.extend_from_slice(&v);
        }
        r
    }

    fn learned(&self) -> Option<Slice> {
        self.rare.as_ref().and_then(|r| r.learned)
    }

    fn fallback(&self) -> Option<(Slice, (u64, u64))> {
        self.rare.as_ref().and_then(|r| r.fallback)
    }

    fn set_learned(&mut self, v: Option<Slice>) {
        self.edit_rare(|r| r.learned = v, v.is_none());
    }

    fn set_fallback(&mut self, v: Option<(Slice, (u64, u64))>) {
        self.edit_rare(|r| r.fallback = v, v.is_none());
    }

    /// Edits the rare parts; the box exists only while one of them is set.
    fn edit_rare(&mut self, f: impl FnOnce(&mut Rare), clearing: bool) {
        if clearing && self.rare.is_none() {
            return;
        }
        let r = self.rare.get_or_insert_with(Box::default);
        f(r);
        if r.learned.is_none() && r.fallback.is_none() {
            self.rare = None;
        }
    }

    fn commitment(&self) -> Slice {
        self.commit
    }

    fn recount(&self) -> Slice {
        self.sent().fold(Slice::ZERO, |acc, s| acc.max(s.slice))
    }

    /// The earliest allocator-side expiry of the grants remembered (`u64::MAX`: none).
    fn earliest_expiry(&self) -> u64 {
        self.sent().map(|s| s.expires_ns).min().unwrap_or(u64::MAX)
    }

    /// The latest grant sent (what the agent should end up holding).
    fn current(&self) -> Slice {
        self.cur
    }

    /// The agent applied `id`: older grants can no longer be in use. An id past the
    /// latest grant sent here names no grant of this entry (seqs are one counter for
    /// every entry: a confused agent naming another's), and would release this one's
    /// whole commitment while the agent still uses it: ignored.
    fn mark_applied(&mut self, id: (u64, u64), term: u64) -> bool {
        if id <= self.applied || self.last_sent().is_none_or(|s| id > s.id()) {
            return false;
        }
        self.applied = id;
        if self.older.is_some() || self.last_sent().is_some_and(|s| s.id() < id) {
            self.edit_sent(term, |v| v.retain(|s| s.id() >= id));
        }
        if self.fallback().is_some_and(|(_, f)| id > f) {
            self.set_fallback(None);
        }
        true
    }

    /// Remembers a grant sent; past `MAX_SENT`, the oldest two merge into the newer's
    /// id with the larger slice and the later expiry, the older's extension included
    /// (the newer's id may be past the extension).
    fn push_sent(&mut self, s: Sent, ext: Ext, term: u64) {
        if let Some(prev) = self.last_sent() {
            let o = self.older.get_or_insert_with(Box::default);
            o.push(prev);
            if o.len() + 1 > MAX_SENT {
                // MAX_SENT >= 2: the newer of the two is still in `older`.
                let a = o.remove(0);
                let b = &mut o[0];
                b.slice = b.slice.max(a.slice);
                b.expires_ns = ext.expiry(b).max(ext.expiry(&a));
                b.fleet = b.fleet.min(a.fleet);
            }
            self.nsent = o.len() as u8 + 1;
        } else {
            self.nsent = 1;
        }
        self.set_last(Some(s), term);
    }
}

/// An entry's grants older than the latest, oldest first: every one `MAX_SENT` allows
/// in the box itself. With room for two, a third spilled into a second allocation
/// (`SmallVec`'s growth was 2.6 % of a report's instructions in callgrind, and the
/// allocations ~4 %).
type OlderSent = SmallVec<[Sent; MAX_SENT - 1]>;

#[derive(Clone, Debug)]
struct Key {
    name: Arc<KeyName>,
    fp: Fp,
    rule: u32,
    entries: Vec<Entry>,
    /// Released tokens waiting for a grower (never above the free burst).
    pool: u64,
    dirty: bool,
    /// When a marked key is due for recomputation.
    due_ns: u64,
    /// Sum of entries' commitments.
    committed: Slice,
    /// `(R + O, B)`.
    limit: Slice,
    /// How far grants learned from an earlier term exceed the limit: agents that were
    /// partitioned under that term may hold lapsed grants it had already reclaimed.
    /// Nothing is granted while it is non-zero; it shrinks as learned grants are
    /// superseded or expire, and counts in the bound meanwhile.
    inherited: Slice,
    /// The water level found by the last full recomputation (for one-entry updates).
    fill: Fill,
    /// The burst split of the last full recomputation (see `RuleInfo::target`; norm 0
    /// before the first).
    split: BurstSplit,
    /// A sparse key (see `concentrate`) as of its last full recomputation: its entries
    /// claim their slow demand, and only those whose priority reached `keep_floor` hold
    /// a share.
    sparse: bool,
    keep_floor: f64,
    /// No remembered grant of this key expires before this (a lower bound, kept by
    /// [`Key::edit`] and made exact by the sweep): the sweep skips the key until then.
    sweep_after_ns: u64,
    /// When a report line last named the key (allocator time): a key named by no
    /// line for a lease is recomputed by the sweep, which forgets its quiet entries
    /// (agents name only keys that change, and holders: see `idle_entry`).
    named_ns: u64,
    last_full_ns: u64,
    /// When the key's holders were last asked to measure (0: never).
    measured_at_ns: u64,
    /// Whether the entry whose surge started that round held a grant.
    measured_for_holder: bool,
    /// Entries with a learned grant or a partition fallback (`Entry::rare`): the bound
    /// ([`Allocator::overshoot_bound`]) walks the entries only when some have one. Kept
    /// by [`Key::edit`] (every change of `rare` goes through it, or recounts).
    rare_entries: u32,
}

impl Key {
    /// Runs `f` on one entry and keeps its cached commitment and the key's sum in step.
    fn edit<R>(&mut self, pos: usize, f: impl FnOnce(&mut Entry) -> R) -> R {
        let e = &mut self.entries[pos];
        let before = e.commit;
        let had_rare = e.rare.is_some();
        let r = f(e);
        if had_rare != e.rare.is_some() {
            if had_rare {
                self.rare_entries -= 1;
            } else {
                self.rare_entries += 1;
            }
        }
        let e = &mut self.entries[pos];
        // One pass over the remembered grants: commitment and earliest expiry.
        let (mut commit, mut earliest) = (Slice::ZERO, u64::MAX);
        for s in e.sent() {
            commit = commit.max(s.slice);
            earliest = earliest.min(s.expires_ns);
        }
        e.commit = commit;
        self.sweep_after_ns = self.sweep_after_ns.min(earliest);
        self.recommitted(before, commit);
        r
    }

    /// [`Key::edit`] for the commonest edit, a grant sent: the caches follow from the
    /// new grant alone, without a pass over the remembered ones. The commitment is the
    /// old one or the new slice, whichever is larger per component (merging the oldest
    /// two grants when there are too many keeps their maximum, so it does not change
    /// the commitment), and the key's sweep bound only needs lowering to the new
    /// grant's expiry (a merge only makes expiries later).
    fn push_grant(&mut self, pos: usize, s: Sent, ext: Ext, term: u64) {
        let e = &mut self.entries[pos];
        let before = e.commit;
        e.push_sent(s, ext, term);
        let commit = before.max(s.slice);
        e.commit = commit;
        self.sweep_after_ns = self.sweep_after_ns.min(s.expires_ns);
        self.recommitted(before, commit);
    }

    /// One entry's commitment went from `before` to `after`: the key's sums and what
    /// depends on them.
    fn recommitted(&mut self, before: Slice, after: Slice) {
        self.committed.rate = self.committed.rate - before.rate + after.rate;
        self.committed.burst = self.committed.burst - before.burst + after.burst;
        self.inherited = self.inherited.min(self.excess());
        // Transferable tokens may only vanish.
        self.clamp_pool();
    }

    /// What is free of the limit.
    fn free(&self) -> Slice {
        Slice {
            rate: self.limit.rate.saturating_sub(self.committed.rate),
            burst: self.limit.burst.saturating_sub(self.committed.burst),
        }
    }

    /// Transferable tokens never exceed the free burst.
    fn clamp_pool(&mut self) {
        self.pool = self.pool.min(self.free().burst);
    }

    /// How far the commitments exceed the limit (zero unless learned grants do).
    fn excess(&self) -> Slice {
        Slice {
            rate: self.committed.rate.saturating_sub(self.limit.rate),
            burst: self.committed.burst.saturating_sub(self.limit.burst),
        }
    }
}

#[derive(Clone, Debug)]
struct Agent {
    id: Arc<str>,
    incarnation: u64,
    /// The rule shapes of the agent's file (its hello's), and the indices of the
    /// rules in force whose shape differs: their lines are ignored.
    shapes: Arc<[(String, u64)]>,
    stale_rules: Vec<u32>,
    weight: f64,
    /// The report interval the agent declared in its hello, ns (0: not declared): a
    /// demand sample is read over at least this or `min_sample_ms`, the shorter.
    report_interval_ns: u64,
    connected: bool,
    last_heard_ns: u64,
    /// Agent clock of the last accepted hello or report.
    report_ts: u64,
    /// Allocator clock when it arrived.
    report_recv_ns: u64,
    /// Key id -> position in the key's entries.
    entries: HashMap<u32, u32, FixedState>,
    /// The next lease extension is due (allocator clock; see [`Allocator::renew`]).
    renew_due_ns: u64,
    /// Latest seq issued to this agent in this term (0: none yet).
    last_seq: u64,
    /// The extension in force for this agent's grants (the latest one queued).
    ext: Ext,
    /// Agent clock: the lease end the latest extension carries.
    ext_lease_at_ns: u64,
    /// Earliest allocator-side expiry of the grants issued since that extension
    /// (`u64::MAX`: none).
    unext_min_expiry: u64,
    /// An extension waits in [`Allocator::extensions`].
    ext_queued: bool,
    /// Some entry may hold a grant of an earlier term, which no extension covers:
    /// renewals re-issue it in this term (a walk of the agent's entries).
    stale_epochs: bool,
    /// The agent's hello asked for grants that name a key by handle alone once its
    /// stream has had the key's name ([`Hello::grants_by_handle`]).
    by_handle: bool,
    /// Name hashes of keys revoked on this stream (at most `MAX_REVOKED_PER_STREAM`;
    /// cleared at each hello).
    revoked: HashSet<u64, FixedState>,
    /// This agent's stream, as far as key names go: a new one (1 and up, wrapping
    /// back to 1 after [`u16::MAX`] with every entry's stamp cleared) at each hello
    /// and each time grants went undelivered. An entry whose [`Entry::told`] is this
    /// has had its key's name on it.
    stream: u16,
}

/// The allocation core. See the module docs.
#[derive(Clone, Debug)]
pub struct Allocator {
    cfg: AllocatorConfig,
    rules: Vec<RuleInfo>,
    /// Per rule (same index): its name and what gives its keys their meaning.
    rule_meta: Vec<RuleMeta>,
    rule_index: HashMap<String, u32, FixedState>,
    /// Names of rules a reload removed or replaced (at most `MAX_RELOADED_RULES`, the
    /// latest): report and ack lines naming them in their old form are ignored, not
    /// refused, so that agents still on the old rules keep their other keys.
    reloaded_rules: Vec<String>,
    /// Lines ignored for naming a rule a reload removed or replaced.
    ignored_lines: u64,
    term: u64,
    learn_until_ns: u64,
    learning: bool,
    next_seq: u64,
    agents: Vec<Option<Agent>>,
    agent_index: HashMap<Arc<str>, u32, FixedState>,
    free_agents: Vec<u32>,
    live_agents: usize,
    keys: Vec<Option<Key>>,
    /// Per key index: bumped each time the index is freed, so that a key handle
    /// ([`Grant::key_handle`]) of a forgotten key never names its successor.
    key_gens: Vec<u32>,
    key_index: HashMap<u64, u32, FixedState>,
    free_keys: Vec<u32>,
    live_keys: usize,
    entry_count: usize,
    /// Marked keys by due time (stale entries are skipped: a key's own `due_ns` and
    /// `dirty` say whether an entry is current).
    dirty: BinaryHeap<Reverse<(u64, u32)>>,
    recompute_at_ns: Option<u64>,
    next_sweep_ns: u64,
    /// Grants issued and not yet drained, by table index ([`Pending`]).
    outbox: Vec<Pending>,
    /// Grants issued after `outbox`'s, when a batch ran on two threads: the second
    /// thread's (it fills its own vector, so that neither copies the other's), and any
    /// issued after them until the drain. Drained after `outbox`.
    outbox_tail: Vec<Pending>,
    /// Agents with a lease extension to send (each at most once: `Agent::ext_queued`).
    extensions: Vec<u32>,
    /// Measure requests queued, at most `MAX_MEASURES_QUEUED`.
    measures: Vec<Measuring>,
    /// Measure requests not queued because the queue was full.
    measures_dropped: u64,
    /// Handles of accepted reports' lines this allocator did not know, per report (at
    /// most `MAX_UNKNOWN_QUEUED` handles; see [`UnknownHandles`]).
    unknown: Vec<UnknownHandles>,
    unknown_queued: usize,
    /// Unknown handles not queued because the queue was full.
    unknown_dropped: u64,
    /// Grants to revoke (agent, incarnation, key), at most `MAX_REVOCATIONS_QUEUED`.
    revocations: Vec<(Arc<str>, u64, Arc<KeyName>)>,
    /// Revocations not queued because the queue was full.
    revocations_dropped: u64,
    /// Agents forgotten to make room in a full table.
    agents_evicted: u64,
    /// Names of agents and keys removed while the outbox held grants for them (a
    /// pending grant still names them), and their indices, which are not reused until
    /// the outbox is drained.
    graves: Graves,
    /// The demand smoothing factor of the last sample interval seen: `(interval, alpha)`.
    alpha_memo: (u64, f64, f64),
    hasher: FixedState,
    check_hasher: FixedState,
    scratch: Scratch,
    report_scratch: ReportScratch,
    /// Keys of the batch `recompute_dirty` is recomputing (kept between calls).
    batch: Vec<u32>,
    /// Batches of fewer entries run on the calling thread
    /// (`pass::PARALLEL_MIN_ENTRIES`; tests lower it).
    parallel_min_entries: usize,
}

/// One key of a queued measure request (batched per agent stream and window when
/// drained). Ordered by those, so that a sort groups them.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Measuring {
    agent: Arc<str>,
    incarnation: u64,
    window_ms: u32,
    key_handle: u64,
}

/// A grant in the outbox: agent and key by index, named only when drained
/// ([`Allocator::for_each_grant`]). Building a million grants in a full pass then takes
/// no reference count and writes 40 bytes each (it was 88 bytes with names, then 64);
/// the pass's page faults on a fresh outbox scale with it. What every grant has in
/// common or can be told apart by is not stored:
/// - the term: an allocator's term never changes (a new term is a new `Allocator`);
/// - the seq: [`Allocator::issue`] is the only place that takes one, and it pushes one
///   record for each, so the `i`-th record's seq is the outbox's first seq plus `i`;
/// - the incarnation: the agent's, unless it changed or the agent was forgotten before
///   the drain ([`Graves`] keeps the old one);
/// - transfer tokens: almost always zero, so the few non-zero ones sit beside the
///   outbox, by record index.
#[derive(Clone, Copy, Debug)]
struct Pending {
    agent: u32,
    key: u32,
    fleet_size: u32,
    /// The agent's stream when its entry had already been told the key's name, so
    /// the grant may go by handle if that stream is still the one (0: name it).
    told: u16,
    rate: u64,
    burst: u64,
    lease_expires_at_ns: u64,
}

/// What pending grants need of agents and keys that changed or went away before the
/// outbox was drained.
#[derive(Clone, Debug, Default)]
struct Graves {
    /// Forgotten agents: index, then name and incarnation.
    agents: Vec<(u32, (Arc<str>, u64))>,
    keys: Vec<(u32, Arc<KeyName>)>,
    /// Agents that restarted: index, the outbox length when they did, and the
    /// incarnation of the grants queued before that.
    reincarnated: Vec<(u32, usize, u64)>,
    /// Transfer tokens of the records that carry any: record index, tokens.
    transfers: Vec<(u32, u64)>,
    /// Records whose seq is not the one before plus one (a batch recomputed on two
    /// threads: the second half's seqs start past the first half's entries): record
    /// index, its seq. In order.
    seq_jumps: Vec<(u32, u64)>,
    /// The seqs those jumps skipped, in all.
    seq_gap: u64,
}

impl Graves {
    /// The name of removed index `i` (a pending grant names only removed indices that
    /// are in its grave, since they are not reused before the drain).
    fn find<T>(graves: &[(u32, T)], i: u32) -> &T {
        &graves
            .iter()
            .rev()
            .find(|(j, _)| *j == i)
            .expect("a pending grant names a live or buried index")
            .1
    }

    /// The seq of each pending grant in turn, the first being `first`.
    fn seqs(&self, first: u64) -> impl FnMut(usize) -> u64 + '_ {
        let mut next = first;
        let mut jumps = self.seq_jumps.iter().peekable();
        move |i| {
            if let Some(&&(j, seq)) = jumps.peek()
                && j as usize == i
            {
                jumps.next();
                next = seq;
            }
            next += 1;
            next - 1
        }
    }

    /// The incarnation of the `i`-th pending grant, for agent `agent`, if the agent
    /// restarted after it was queued.
    fn incarnation_before(&self, agent: u32, i: usize) -> Option<u64> {
        self.reincarnated
            .iter()
            .find(|&&(a, at, _)| a == agent && at > i)
            .map(|&(_, _, inc)| inc)
    }
}

#[derive(Clone, Debug, Default)]
struct Scratch {
    claims: Vec<Claim>,
    reachable: Vec<bool>,
    growers: Vec<(bool, u32)>,
    shares: Vec<f64>,
    units: Vec<u64>,
    desired: Vec<Slice>,
    /// Per entry: how far its desired rate may move to absorb the band's residue.
    room: Vec<u64>,
    /// Claims on slow demand (sparse keys).
    slow: Vec<Claim>,
    /// Entries with a claim, by priority (sparse keys).
    order: Vec<(f64, u32)>,
    /// Holders of a key to ask for a measurement: (rate held, agent, demand).
    measure: Vec<(u64, u32, f64)>,
}

/// The handle of key index `k` in generation `generation` ([`Grant::key_handle`]):
/// never 0, and small (a key's first generation is 0: the handle is its index plus
/// one, a varint of 1 to 3 bytes at up to 2 million keys).
fn key_handle(generation: u32, k: u32) -> u64 {
    ((u64::from(generation) << 32) | u64::from(k)) + 1
}

/// A key's 128-bit identity (see `Allocator::hash_name`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Fp {
    hash: u64,
    check: u64,
}

/// How a report entry resolved in validation.
#[derive(Clone, Copy, Debug)]
struct Resolved {
    key: Option<u32>,
    rule: u32,
    hash: Fp,
    entry: Option<u32>,
}

/// [`Allocator::handle_report`]'s per-line buffers, kept between reports.
#[derive(Clone, Debug, Default)]
struct ReportScratch {
    resolved: Vec<Option<Resolved>>,
    fps: Vec<Fp>,
    found: Vec<Option<u32>>,
    positions: Vec<Option<u32>>,
    /// Key ids seen in this report (duplicates are refused).
    ids: HashSet<(u64, u64), FixedState>,
    /// Lines whose demand jumped up: (key, entry).
    surged: Vec<(u32, u32)>,
    /// Handles of lines naming a key this allocator does not know.
    unknown: Vec<u64>,
}

impl Allocator {
    /// An allocator for `rules` (the agents' TOML file), in `term`, starting at `now`.
    ///
    /// A new term learns for one lease (`lease_ms + reclaim_margin_ms`) before it grants
    /// anything beyond what agents report holding (invariant 4).
    pub fn new(
        rules: &Config,
        cfg: AllocatorConfig,
        term: u64,
        now: u64,
    ) -> Result<Allocator, crate::config::ConfigError> {
        cfg.validate()?;
        let (infos, meta, rule_index) =
            build_rules(rules, cfg.overdraft_permille, cfg.clock_drift_ppm);
        let learn = AllocatorConfig::ns(cfg.lease_ms + cfg.reclaim_margin_ms);
        Ok(Allocator {
            next_sweep_ns: now,
            rules: infos,
            rule_meta: meta,
            rule_index,
            reloaded_rules: Vec::new(),
            ignored_lines: 0,
            term,
            learn_until_ns: now.saturating_add(learn),
            learning: true,
            next_seq: 1,
            agents: Vec::new(),
            agent_index: HashMap::with_hasher(FixedState::with_seed(1)),
            free_agents: Vec::new(),
            live_agents: 0,
            keys: Vec::new(),
            key_gens: Vec::new(),
            key_index: HashMap::with_hasher(FixedState::with_seed(2)),
            free_keys: Vec::new(),
            live_keys: 0,
            entry_count: 0,
            dirty: BinaryHeap::new(),
            recompute_at_ns: None,
            outbox: Vec::new(),
            outbox_tail: Vec::new(),
            extensions: Vec::new(),
            measures: Vec::new(),
            measures_dropped: 0,
            unknown: Vec::new(),
            unknown_queued: 0,
            unknown_dropped: 0,
            revocations: Vec::new(),
            revocations_dropped: 0,
            agents_evicted: 0,
            graves: Graves::default(),
            alpha_memo: (0, 0.0, 0.0),
            hasher: FixedState::with_seed(cfg.hash_seed),
            check_hasher: FixedState::with_seed(cfg.hash_seed ^ 0x9E37_79B9_7F4A_7C15),
            scratch: Scratch::default(),
            report_scratch: ReportScratch::default(),
            batch: Vec::new(),
            parallel_min_entries: pass::PARALLEL_MIN_ENTRIES,
            cfg,
        })
    }

    /// This allocator's term.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// True while the new term is still learning what agents hold (it grants nothing
    /// beyond that).
    pub fn is_learning(&self) -> bool {
        self.learning
    }

    /// The settings.
    pub fn config(&self) -> &AllocatorConfig {
        &self.cfg
    }

    /// Registered agents.
    pub fn agent_count(&self) -> usize {
        self.live_agents
    }

    /// Tracked keys.
    pub fn key_count(&self) -> usize {
        self.live_keys
    }

    /// Tracked key-agent entries.
    pub fn entry_count(&self) -> usize {
        self.entry_count
    }

    /// Grants waiting in the outbox.
    pub fn pending_grants(&self) -> usize {
        self.pending_len()
    }

    /// The seq of the first grant in the outbox (or of the next one, if it is empty).
    fn first_pending_seq(&self) -> u64 {
        self.next_seq - self.pending_len() as u64 - self.graves.seq_gap
    }

    /// Grants in the outbox, both parts.
    fn pending_len(&self) -> usize {
        self.outbox.len() + self.outbox_tail.len()
    }

    /// Takes every grant issued so far, oldest first, as owned [`Grant`]s. The shell
    /// sends each on its agent's stream (a grant for a disconnected agent may be
    /// dropped: it stays counted until its lease ends, which is safe).
    /// [`Allocator::for_each_grant`] does the same without taking reference counts.
    pub fn drain_grants(&mut self) -> std::vec::IntoIter<Grant> {
        let mut out = Vec::with_capacity(self.pending_len());
        self.for_each_grant(|g| out.push(g.to_grant()));
        out.into_iter()
    }

    /// Takes every grant issued so far, oldest first, and hands each to `f` with the
    /// agent and key names borrowed (see [`GrantRef`]). Afterwards the outbox is empty
    /// and the indices of agents and keys removed meanwhile become reusable.
    pub fn for_each_grant(&mut self, mut f: impl FnMut(GrantRef<'_>)) {
        let mut seqs = self.graves.seqs(self.first_pending_seq());
        let mut transfers = self.graves.transfers.iter().peekable();
        let drained = self.outbox.drain(..).chain(self.outbox_tail.drain(..));
        for (i, p) in drained.enumerate() {
            let seq = seqs(i);
            let (key, key_handle) = match &self.keys[p.key as usize] {
                Some(k) => (&k.name, key_handle(self.key_gens[p.key as usize], p.key)),
                None => (Graves::find(&self.graves.keys, p.key), 0),
            };
            let before = self.graves.incarnation_before(p.agent, i);
            // The key's name goes with the grant unless the agent's current stream
            // asked for grants by handle and has had this key's name already.
            let named = match self.agents[p.agent as usize].as_ref() {
                Some(ag) if ag.by_handle && key_handle != 0 && before.is_none() => {
                    p.told == 0 || p.told != ag.stream
                }
                _ => true,
            };
            let (agent, latest) = match &self.agents[p.agent as usize] {
                Some(ag) => (&ag.id, ag.incarnation),
                None => {
                    let (id, inc) = Graves::find(&self.graves.agents, p.agent);
                    (id, *inc)
                }
            };
            let incarnation = before.unwrap_or(latest);
            let transfer_tokens = match transfers.peek() {
                Some(&&(j, t)) if j as usize == i => {
                    transfers.next();
                    t
                }
                _ => 0,
            };
            f(GrantRef {
                agent,
                agent_index: p.agent,
                incarnation,
                key,
                rate: p.rate,
                burst: p.burst,
                epoch: self.term,
                seq,
                lease_expires_at_ns: p.lease_expires_at_ns,
                fleet_size: p.fleet_size,
                transfer_tokens,
                key_handle,
                named,
            });
        }
        drop(seqs);
        self.graves.transfers.clear();
        self.graves.reincarnated.clear();
        self.graves.seq_jumps.clear();
        self.graves.seq_gap = 0;
        self.free_agents
            .extend(self.graves.agents.drain(..).map(|(a, _)| a));
        self.free_keys
            .extend(self.graves.keys.drain(..).map(|(k, _)| k));
    }

    /// Takes the lease extensions queued so far, one per agent at most (see
    /// [`LeaseExtension`]). The shell sends each on its agent's stream, like grants,
    /// only to the incarnation it names; one lost is safe (the allocator counts the
    /// grants as extended either way: the agent may hold them no longer than that).
    pub fn drain_extensions(&mut self) -> Vec<LeaseExtension> {
        let mut out = Vec::with_capacity(self.extensions.len());
        for a in self.extensions.drain(..) {
            let Some(ag) = self.agents[a as usize].as_mut() else {
                continue;
            };
            if !ag.ext_queued {
                continue;
            }
            ag.ext_queued = false;
            out.push(LeaseExtension {
                agent: Arc::clone(&ag.id),
                incarnation: ag.incarnation,
                epoch: ag.ext.term,
                through_seq: ag.ext.through,
                lease_expires_at_ns: ag.ext_lease_at_ns,
            });
        }
        out
    }

    /// Lease extensions waiting to be drained (at most one per agent).
    pub fn pending_extensions(&self) -> usize {
        self.extensions.len()
    }

    /// Takes the measure requests queued so far, one message per agent stream (at most
    /// `max_keys_per_message` keys each; see [`MeasureRequest`]). The shell sends each
    /// on its agent's stream, only to the incarnation it names; one lost only leaves
    /// that holder to its regular reports.
    pub fn drain_measure_requests(&mut self) -> Vec<MeasureRequest> {
        let max = self.cfg.max_keys_per_message.max(1);
        let mut q = std::mem::take(&mut self.measures);
        q.sort_unstable();
        q.dedup();
        let mut out: Vec<MeasureRequest> = Vec::new();
        for m in q {
            match out.last_mut() {
                Some(o)
                    if o.agent == m.agent
                        && o.incarnation == m.incarnation
                        && o.window_ms == m.window_ms
                        && o.key_handles.len() < max =>
                {
                    o.key_handles.push(m.key_handle)
                }
                _ => out.push(MeasureRequest {
                    agent: m.agent,
                    incarnation: m.incarnation,
                    key_handles: vec![m.key_handle],
                    window_ms: m.window_ms,
                }),
            }
        }
        out
    }

    /// Takes the unknown-handle notices queued so far, one per report that named keys
    /// by handles this allocator does not know (see [`UnknownHandles`]). The shell sends
    /// each on its agent's stream, only to the incarnation it names; one lost only
    /// leaves those lines ignored until the agent's next full report names the keys.
    pub fn drain_unknown_handles(&mut self) -> Vec<UnknownHandles> {
        self.unknown_queued = 0;
        std::mem::take(&mut self.unknown)
    }

    /// Unknown-handle notices waiting to be drained.
    pub fn pending_unknown_handles(&self) -> usize {
        self.unknown.len()
    }

    /// Takes the revocations queued so far, per agent incarnation in messages of at
    /// most `max_keys_per_message` keys (see [`Revocation`]). The shell sends each on
    /// its agent's stream, only to the incarnation it names, after the grants; one lost
    /// is queued again when the agent next names a revoked key with a grant.
    pub fn drain_revocations(&mut self) -> Vec<Revocation> {
        let max = self.cfg.max_keys_per_message.max(1);
        let mut q = std::mem::take(&mut self.revocations);
        q.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        let through_seq = self.next_seq - 1;
        let mut out: Vec<Revocation> = Vec::new();
        for (agent, incarnation, key) in q {
            match out.last_mut() {
                Some(o)
                    if o.agent == agent && o.incarnation == incarnation && o.keys.len() < max =>
                {
                    o.keys.push(key)
                }
                _ => out.push(Revocation {
                    agent,
                    incarnation,
                    epoch: self.term,
                    through_seq,
                    keys: vec![key],
                }),
            }
        }
        out
    }

    /// Revoked (agent, key) pairs waiting to be drained.
    pub fn pending_revocations(&self) -> usize {
        self.revocations.len()
    }

    /// Revocations not queued because `MAX_REVOCATIONS_QUEUED` were waiting (made good
    /// when the agents next name those keys).
    pub fn revocations_dropped(&self) -> u64 {
        self.revocations_dropped
    }

    /// The shell could not send `agent` a revocation: the next line of that agent
    /// naming a revoked key with a grant queues it again.
    pub fn revocations_undelivered(&mut self, agent: &str) {
        if let Some(&a) = self.agent_index.get(agent)
            && let Some(ag) = self.agents[a as usize].as_mut()
        {
            ag.revoked.clear();
        }
    }

    /// Queues the revocation of agent `a`'s grant on `key` (hash `fp`), once per stream.
    fn revoke(&mut self, a: u32, key: Arc<KeyName>, fp: u64) {
        let ag = self.agents[a as usize]
            .as_mut()
            .expect("a live agent's index");
        if ag.revoked.contains(&fp) {
            return;
        }
        if self.revocations.len() >= MAX_REVOCATIONS_QUEUED {
            self.revocations_dropped += 1;
            return;
        }
        if ag.revoked.len() < MAX_REVOKED_PER_STREAM {
            ag.revoked.insert(fp);
        }
        self.revocations
            .push((Arc::clone(&ag.id), ag.incarnation, key));
    }

    /// Unknown handles not queued because `MAX_UNKNOWN_QUEUED` were waiting.
    pub fn unknown_handles_dropped(&self) -> u64 {
        self.unknown_dropped
    }

    /// Measure requests (agent, key) waiting to be drained.
    pub fn pending_measure_requests(&self) -> usize {
        self.measures.len()
    }

    /// Measure requests not queued because `MAX_MEASURES_QUEUED` were waiting (the
    /// shell drains after every input, so this stays 0 unless it stalls).
    pub fn measures_dropped(&self) -> u64 {
        self.measures_dropped
    }

    /// Entry `pos` of key `k` (a rate rule) surged: if the key has nothing free for it,
    /// asks the key's largest other holders (at most `MEASURE_MAX_HOLDERS`) to measure
    /// afresh, at most once per `min_sample_ms` per key (see [`MeasureRequest`]). Each
    /// holder's window is long enough to expect `MEASURE_MIN_REQUESTS` of its typical
    /// requests (at least `measure_window_ms`): an empty window then says its demand
    /// moved away, not that it had a quiet spell. A holder that would need more than
    /// two `min_sample_ms` is left to its regular reports, and so is every holder of a
    /// rule whose typical request is unknown (`typical_cost` 0, the default for
    /// `input_tokens`): a short window proves nothing without a request size.
    fn request_measures(&mut self, now: u64, k: u32, pos: u32) {
        if self.cfg.measure_window_ms == 0 || self.learning {
            return;
        }
        let min_sample = AllocatorConfig::ns(self.cfg.min_sample_ms);
        let floor = AllocatorConfig::ns(self.cfg.measure_window_ms);
        let key = self.keys[k as usize].as_ref().expect("live key");
        let rule = &self.rules[key.rule as usize];
        if rule.typical == 0 || rule.concurrency {
            return;
        }
        let e = &key.entries[pos as usize];
        // One round per `min_sample_ms` per key, except that demand arriving where
        // there is no grant (a shift's new gateways) may start one after a round a
        // holder's surge started: under overload holders' estimates jump by noise, and
        // such a round just before a shift held off the one the shift needed for a
        // whole `min_sample_ms`.
        let holder = e.cur.rate > 0;
        if key.measured_at_ns != 0
            && now < key.measured_at_ns.saturating_add(min_sample)
            && (holder || !key.measured_for_holder)
        {
            return;
        }
        let unmet = e.demand - e.cur.rate as f64;
        let free = key.free().rate as f64;
        if unmet <= free {
            return;
        }
        let mut holders = std::mem::take(&mut self.scratch.measure);
        holders.clear();
        holders.extend(
            key.entries
                .iter()
                .enumerate()
                .filter(|&(i, o)| i != pos as usize && o.cur.rate > 0)
                .map(|(_, o)| (o.cur.rate, o.agent, o.demand)),
        );
        if holders.len() > MEASURE_MAX_HOLDERS {
            holders.select_nth_unstable_by(MEASURE_MAX_HOLDERS, |a, b| b.0.cmp(&a.0));
            holders.truncate(MEASURE_MAX_HOLDERS);
        }
        let handle = key_handle(self.key_gens[k as usize], k);
        let (typical, period) = (rule.typical as f64, rule.period_ns as f64);
        let mut asked = false;
        for &(_, a, demand) in &holders {
            // Time to expect the requests: demand is in units per period.
            let need = MEASURE_MIN_REQUESTS * typical * period / demand.max(f64::MIN_POSITIVE);
            // Also skips a holder with no demand (an infinite or NaN wait).
            if need.is_nan() || need > 2.0 * min_sample as f64 {
                continue;
            }
            let window_ms = (need as u64).max(floor).div_ceil(1_000_000);
            let Some(ag) = self.agents[a as usize].as_ref() else {
                continue;
            };
            if !ag.connected {
                continue;
            }
            if self.measures.len() >= MAX_MEASURES_QUEUED {
                self.measures_dropped += 1;
                continue;
            }
            self.measures.push(Measuring {
                agent: Arc::clone(&ag.id),
                incarnation: ag.incarnation,
                window_ms: u32::try_from(window_ms).unwrap_or(u32::MAX),
                key_handle: handle,
            });
            asked = true;
        }
        self.scratch.measure = holders;
        if asked && let Some(key) = self.keys[k as usize].as_mut() {
            key.measured_at_ns = now.max(1);
            key.measured_for_holder = holder;
        }
    }

    /// When [`Allocator::handle_timeout`] next has work: a recomputation, the expiry
    /// sweep, or the end of the learning period.
    pub fn poll_timeout(&self) -> u64 {
        let mut t = self.next_sweep_ns;
        if self.learning {
            t = t.min(self.learn_until_ns);
        }
        if let Some(r) = self.recompute_at_ns {
            t = t.min(r);
        }
        t
    }

    fn lease_ns(&self) -> u64 {
        AllocatorConfig::ns(self.cfg.lease_ms)
    }

    /// Allocator-side lifetime of a grant: lease plus reclaim margin.
    fn hold_ns(&self) -> u64 {
        AllocatorConfig::ns(self.cfg.lease_ms + self.cfg.reclaim_margin_ms)
    }

    /// A key's identity: two independently seeded 64-bit hashes of (rule, values). The
    /// first indexes the table, both are compared: a lookup touches no strings.
    fn hash_name(&self, rule: &str, values: &[String]) -> Fp {
        let mut h = self.hasher.build_hasher();
        rule.hash(&mut h);
        values.hash(&mut h);
        let mut c = self.check_hasher.build_hasher();
        rule.hash(&mut c);
        values.hash(&mut c);
        Fp {
            hash: h.finish(),
            check: c.finish(),
        }
    }

    /// The live key a handle names, if it still does.
    fn handle_key(&self, handle: u64) -> Option<u32> {
        let h = handle.checked_sub(1)?;
        let (k, generation) = (h as u32, (h >> 32) as u32);
        (self.key_gens.get(k as usize) == Some(&generation) && self.keys[k as usize].is_some())
            .then_some(k)
    }

    /// How a report line names its key: by handle (the table's name), else its own.
    fn line_name<'a>(&'a self, kr: &'a KeyReport) -> &'a KeyName {
        match self.handle_key(kr.key_handle) {
            Some(k) if kr.key_handle != 0 => &self.key(k).name,
            _ => &kr.key,
        }
    }

    fn find_key(&self, fp: Fp) -> Option<u32> {
        for p in 0..MAX_PROBE {
            if let Some(&id) = self.key_index.get(&fp.hash.wrapping_add(p))
                && let Some(k) = &self.keys[id as usize]
                && k.fp == fp
            {
                return Some(id);
            }
        }
        None
    }

    /// Resolves a key name: an existing key, or the rule a new one would have.
    fn resolve(&self, name: &KeyName) -> Result<(Option<u32>, u32, Fp), AllocError> {
        let hash = self.hash_name(&name.rule, &name.values);
        self.resolve_found(name, hash, self.find_key(hash))
    }

    /// [`Allocator::resolve`] once the lookup is done.
    fn resolve_found(
        &self,
        name: &KeyName,
        hash: Fp,
        found: Option<u32>,
    ) -> Result<(Option<u32>, u32, Fp), AllocError> {
        if let Some(id) = found {
            return Ok((Some(id), self.key(id).rule, hash));
        }
        let &rule = self
            .rule_index
            .get(&name.rule)
            .ok_or_else(|| AllocError::UnknownRule(name.rule.clone()))?;
        let info = &self.rules[rule as usize];
        if name.values.len() != info.wildcards
            || name
                .values
                .iter()
                .any(|v| v.is_empty() || v.len() > MAX_VALUE_BYTES)
        {
            return Err(AllocError::InvalidKey {
                key: name.clone(),
                expected: info.wildcards,
            });
        }
        Ok((None, rule, hash))
    }

    /// The transfer pool a key starts with: tokens its first grants carry, so that a
    /// new tenant's first requests are admitted at once instead of waiting for an empty
    /// slice to fill (the `cold-keys` scenario's first admissions waited ~400 ms at the
    /// median, 0.8-0.9 s at p95), and the fleet starts with the `B` one global bucket
    /// would. Safe because no grant of the key has been in force anywhere for at least
    /// `reclaim_margin_ms` when the allocator creates it: past the learning period no
    /// earlier term's grant is alive, and a key is forgotten only once every entry is
    /// idle (its agent gone, whose grants lapsed a margin before, or not reporting the
    /// key for a lease, so its engine dropped it). The global bucket has refilled
    /// `R x reclaim_margin_ms` in that time, up to `B`. Nothing while learning
    /// (holdings are not all known yet), nothing for concurrency rules, and nothing
    /// for a margin after an agent's restart released grants of the rule before their
    /// leases ended (the key may be forgotten and made again at once: a restarted
    /// agent's fresh key with a full pool was a second burst).
    fn new_key_pool(&self, now: u64, rule: u32) -> u64 {
        let info = &self.rules[rule as usize];
        if self.learning || info.concurrency || now < info.pool_quiet_until_ns {
            return 0;
        }
        let quiet = AllocatorConfig::ns(self.cfg.reclaim_margin_ms) as u128;
        let refill = info.rate as u128 * quiet / info.period_ns as u128;
        refill.min(info.burst as u128) as u64
    }

    fn create_key(&mut self, now: u64, name: &KeyName, rule: u32, hash: Fp) -> u32 {
        let pool = self.new_key_pool(now, rule);
        let key = Key {
            name: Arc::new(name.clone()),
            fp: hash,
            rule,
            entries: Vec::new(),
            pool,
            dirty: false,
            due_ns: 0,
            committed: Slice::ZERO,
            limit: self.rules[rule as usize].limit(),
            inherited: Slice::ZERO,
            fill: Fill::default(),
            split: BurstSplit::default(),
            sparse: false,
            keep_floor: 0.0,
            last_full_ns: 0,
            sweep_after_ns: u64::MAX,
            named_ns: 0,
            measured_at_ns: 0,
            measured_for_holder: false,
            rare_entries: 0,
        };
        let id = match self.free_keys.pop() {
            Some(id) => {
                self.keys[id as usize] = Some(key);
                id
            }
            None => {
                self.keys.push(Some(key));
                self.key_gens.push(0);
                (self.keys.len() - 1) as u32
            }
        };
        let slot = (0..MAX_PROBE)
            .map(|p| hash.hash.wrapping_add(p))
            .find(|h| !self.key_index.contains_key(h))
            .expect("validation checked a probe slot is free");
        self.key_index.insert(slot, id);
        self.live_keys += 1;
        id
    }

    /// The rules in force whose shape differs from the one an agent's file gives the
    /// same name (rules the agent lacks or the allocator lacks are not listed: lines
    /// naming those resolve or fail as before).
    fn stale_rules_of(&self, shapes: &[(String, u64)]) -> Vec<u32> {
        shapes
            .iter()
            .filter_map(|(name, shape)| {
                let &i = self.rule_index.get(name)?;
                (self.rule_meta[i as usize].shape != *shape).then_some(i)
            })
            .collect()
    }

    /// A line naming a rule that a reload removed, or naming a replaced rule in its old
    /// form, comes from an agent still on the old rules: it is ignored rather than
    /// refusing the whole message (its other keys still count).
    fn ignorable(&self, name: &KeyName, e: &AllocError) -> bool {
        matches!(
            e,
            AllocError::UnknownRule(_) | AllocError::InvalidKey { .. }
        ) && self.reloaded_rules.contains(&name.rule)
    }

    fn key_has_free_probe(&self, hash: Fp) -> bool {
        (0..MAX_PROBE).any(|p| !self.key_index.contains_key(&hash.hash.wrapping_add(p)))
    }

    fn remove_key(&mut self, id: u32) {
        let Some(key) = self.keys[id as usize].take() else {
            return;
        };
        let g = &mut self.key_gens[id as usize];
        *g = g.wrapping_add(1);
        for p in 0..MAX_PROBE {
            let h = key.fp.hash.wrapping_add(p);
            if self.key_index.get(&h) == Some(&id) {
                self.key_index.remove(&h);
                break;
            }
        }
        if self.pending_len() == 0 {
            self.free_keys.push(id);
        } else {
            // A pending grant still names it: freed when the outbox is drained.
            self.graves.keys.push((id, key.name));
        }
        self.live_keys -= 1;
    }

    fn agent_id(&self, id: &str) -> Result<u32, AllocError> {
        self.agent_index
            .get(id)
            .copied()
            .ok_or_else(|| AllocError::UnknownAgent(id.to_string()))
    }

    fn agent(&self, a: u32) -> &Agent {
        self.agents[a as usize].as_ref().expect("live agent index")
    }

    fn agent_mut(&mut self, a: u32) -> &mut Agent {
        self.agents[a as usize].as_mut().expect("live agent index")
    }

    fn key_mut(&mut self, k: u32) -> &mut Key {
        self.keys[k as usize].as_mut().expect("live key index")
    }

    fn key(&self, k: u32) -> &Key {
        self.keys[k as usize].as_ref().expect("live key index")
    }

    fn entry_pos(&self, a: u32, k: u32) -> Option<u32> {
        self.agent(a).entries.get(&k).copied()
    }

    fn create_entry(&mut self, a: u32, k: u32) -> u32 {
        let key = self.key_mut(k);
        key.entries.push(Entry::new(a));
        let pos = (key.entries.len() - 1) as u32;
        self.agent_mut(a).entries.insert(k, pos);
        self.entry_count += 1;
        pos
    }

    fn remove_entry(&mut self, k: u32, pos: u32) {
        let term = self.term;
        let key = self.key_mut(k);
        key.edit(pos as usize, |e| e.edit_sent(term, |v| v.clear()));
        let e = key.entries.swap_remove(pos as usize);
        if e.rare.is_some() {
            key.rare_entries -= 1;
        }
        let moved = key.entries.get(pos as usize).map(|m| m.agent);
        let ag = self.agent_mut(e.agent);
        ag.entries.remove(&k);
        if let Some(m) = moved {
            self.agent_mut(m).entries.insert(k, pos);
        }
        self.entry_count -= 1;
    }

    /// When a key whose demand changed at `now` is due: `recompute_delay_ms` later,
    /// rounded down to the recompute tick (a quarter of the delay). Keys marked within
    /// one tick of each other are then recomputed in one pass, and the grants they owe
    /// one agent leave in one message: without the tick every report had its own due
    /// time, so a fleet reporting continuously woke the allocator once per report and
    /// each agent took its grants piecemeal. A key is still recomputed at most the delay
    /// after it changed, and at least three quarters of it.
    fn recompute_due(&self, now: u64) -> u64 {
        let at = now.saturating_add(AllocatorConfig::ns(self.cfg.recompute_delay_ms));
        match self.recompute_tick_ns() {
            0 => at,
            tick => (at - at % tick).max(now),
        }
    }

    /// The recompute tick ([`Allocator::recompute_due`]); 0 for none.
    fn recompute_tick_ns(&self) -> u64 {
        AllocatorConfig::ns(self.cfg.recompute_delay_ms) / RECOMPUTE_TICKS_PER_DELAY
    }

    fn mark_dirty(&mut self, k: u32, at: u64) {
        let large = self.cfg.large_key_entries;
        let every = AllocatorConfig::ns(self.cfg.large_key_recompute_ms);
        let tick = self.recompute_tick_ns();
        let key = self.keys[k as usize].as_mut().expect("live key");
        // A large key is recomputed whole at most every `large_key_recompute_ms` times
        // the square root of how many times larger than `large_key_entries` it is; in
        // between, reports re-target single entries.
        let n = key.entries.len();
        let at = if n > large {
            let scale = ((n as f64 / large.max(1) as f64).sqrt().ceil() as u64).max(1);
            at.max(key.last_full_ns.saturating_add(every.saturating_mul(scale)))
        } else {
            at
        };
        // Up to the tick, with the other keys due then.
        let at = match tick {
            0 => at,
            _ => at.div_ceil(tick).saturating_mul(tick),
        };
        if !key.dirty || at < key.due_ns {
            key.dirty = true;
            key.due_ns = at;
            self.dirty.push(Reverse((at, k)));
        }
        let at = key.due_ns;
        self.recompute_at_ns = Some(self.recompute_at_ns.map_or(at, |r| r.min(at)));
    }

    fn validate_held(&self, name: &KeyName, rule: u32, h: &HeldGrant) -> Result<(), AllocError> {
        if h.epoch > self.term {
            return Err(AllocError::NewerTerm {
                ours: self.term,
                theirs: h.epoch,
            });
        }
        if h.epoch == self.term && h.seq >= self.next_seq {
            return Err(AllocError::UnknownSeq {
                key: name.clone(),
                seq: h.seq,
            });
        }
        // This term's grants were all issued here: none exceeds the largest limit the
        // rule has had. An earlier term may have run larger limits (rules reloaded, or
        // the allocator restarted on a new file): its grants are learned, and what they
        // exceed the limit by is inherited excess, in the bound; only a grant beyond any
        // rule's reach is absurd.
        let cap = if h.epoch == self.term {
            self.rules[rule as usize].held_cap
        } else {
            Slice {
                rate: MAX_COST,
                burst: MAX_COST,
            }
        };
        if h.rate > cap.rate || h.burst > cap.burst {
            return Err(AllocError::AbsurdGrant(name.clone()));
        }
        Ok(())
    }

    /// Records a held grant: from this term it acknowledges; from an earlier term it is
    /// learned (while learning) or, past learning, its lease has ended and its posture
    /// fallback counts in the bound until a newer grant is applied.
    ///
    /// A held grant does not say the fleet size it carried, and the agent's
    /// `conservative` fallback divides by that: the core assumes 1 (the fallback is then
    /// the whole grant, as for `open`), which never understates the bound.
    fn apply_held(&mut self, k: u32, pos: u32, h: &HeldGrant, in_flight: u64) {
        let fleet = 1;
        let term = self.term;
        let learning = self.learning;
        let learn_until = self.learn_until_ns;
        let rule = self.rules[self.key(k).rule as usize];
        let key = self.key(k);
        if h.epoch == term && (h.epoch, h.seq) <= key.entries[pos as usize].applied {
            // Already known applied (every report repeats the held grant): nothing
            // changes, and `sent` (maybe on the heap) need not be read.
            return;
        }
        let agent = key.entries[pos as usize].agent;
        let ag = self.agent_mut(agent);
        if h.epoch != term {
            // Re-issued in this term by the next renewal (not covered by extensions).
            ag.stale_epochs = true;
            ag.renew_due_ns = 0;
        }
        let ext = ag.ext;
        let key = self.key_mut(k);
        key.edit(pos as usize, |e| {
            held_into(
                e,
                &rule,
                h,
                in_flight,
                fleet,
                term,
                learning,
                learn_until,
                ext,
            )
        });
        if learning {
            key.inherited = key.inherited.max(key.excess());
        }
    }
}

/// See [`Allocator::apply_held`].
#[allow(clippy::too_many_arguments)]
fn held_into(
    e: &mut Entry,
    rule: &RuleInfo,
    h: &HeldGrant,
    in_flight: u64,
    fleet: u32,
    term: u64,
    learning: bool,
    learn_until: u64,
    ext: Ext,
) {
    {
        let held = Slice {
            rate: h.rate,
            burst: h.burst,
        };
        if h.epoch == term {
            // A concurrency shrink counts as applied only once in-flight work fits.
            if !(rule.concurrency && in_flight > h.burst) {
                e.mark_applied((h.epoch, h.seq), term);
            }
            return;
        }
        let id = (h.epoch, h.seq);
        if id < e.applied || e.sent().any(|s| s.id() == id) {
            return;
        }
        if learning {
            e.set_learned(Some(e.learned().unwrap_or(Slice::ZERO).max(held)));
            e.edit_sent(term, |v| {
                v.insert(
                    0,
                    Sent {
                        epoch: h.epoch,
                        seq: h.seq,
                        slice: held,
                        fleet,
                        expires_ns: learn_until,
                    },
                );
                v.sort_unstable_by_key(|s| s.id());
                while v.len() > MAX_SENT {
                    let a = v.remove(0);
                    v[0].slice = v[0].slice.max(a.slice);
                    v[0].expires_ns = ext.expiry(&v[0]).max(ext.expiry(&a));
                }
            });
            e.applied = e.applied.max(id);
        } else {
            let fb = rule.fallback_of(h.epoch, term, held, fleet);
            if !fb.is_zero() {
                let prev = e.fallback().map(|(s, _)| s).unwrap_or(Slice::ZERO);
                let at = e.fallback().map(|(_, f)| f).unwrap_or((0, 0)).max(id);
                e.set_fallback(Some((prev.max(fb), at)));
            }
        }
    }
}

impl Allocator {
    /// A hello: registers an agent, reconnects it, or replaces a restarted one.
    ///
    /// A higher incarnation releases every grant of the previous one at once (a
    /// restarted agent starts empty), unless the previous one is still live (connected
    /// and heard from within `agent_silence_ms`): then two agents claim one id and the
    /// hello is refused.
    pub fn handle_hello(&mut self, now: u64, hello: &Hello) -> Result<(), AllocError> {
        if hello.agent.is_empty() || hello.agent.len() > MAX_AGENT_ID_BYTES {
            return Err(AllocError::InvalidAgentId {
                max: MAX_AGENT_ID_BYTES,
            });
        }
        if hello.held.len() > self.cfg.max_keys_per_message {
            return Err(AllocError::MessageTooLarge {
                got: hello.held.len(),
                max: self.cfg.max_keys_per_message,
            });
        }
        let existing = self.agent_index.get(hello.agent.as_str()).copied();
        let mut replace = false;
        if let Some(a) = existing {
            let ag = self.agent(a);
            if hello.incarnation < ag.incarnation {
                return Err(AllocError::StaleIncarnation {
                    agent: hello.agent.clone(),
                    registered: ag.incarnation,
                    got: hello.incarnation,
                });
            }
            if hello.incarnation > ag.incarnation {
                let silence = AllocatorConfig::ns(self.cfg.agent_silence_ms);
                if ag.connected && now.saturating_sub(ag.last_heard_ns) < silence {
                    return Err(AllocError::DuplicateAgent {
                        agent: hello.agent.clone(),
                        registered: ag.incarnation,
                        got: hello.incarnation,
                    });
                }
                replace = true;
            } else if hello.agent_time_ns < ag.report_ts {
                return Err(AllocError::StaleReport {
                    last: ag.report_ts,
                    got: hello.agent_time_ns,
                });
            }
        }
        // A full table makes room by forgetting the agent disconnected longest, once
        // its grants have lapsed (a lease and the margin): agent ids change with every
        // rollout (pod names), and the table used to fill for good, refusing every new
        // agent until a restart. What such an agent's posture may still admit, if it
        // runs on cut off, no longer counts in the bound: only under this pressure.
        let evict = if existing.is_none() && self.live_agents >= self.cfg.max_agents {
            Some(self.longest_gone(now).ok_or(AllocError::AgentTableFull {
                max: self.cfg.max_agents,
            })?)
        } else {
            None
        };
        if hello.rule_shapes.len() > MAX_RULE_SHAPES {
            return Err(AllocError::MessageTooLarge {
                got: hello.rule_shapes.len(),
                max: MAX_RULE_SHAPES,
            });
        }
        let stale = self.stale_rules_of(&hello.rule_shapes);
        // Validate held grants before changing anything.
        let mut resolved = Vec::with_capacity(hello.held.len());
        let mut new_keys = 0;
        for h in hello.held.iter() {
            let (key, rule, hash) = match self.resolve(&h.key) {
                Ok(r) => r,
                Err(e) if self.ignorable(&h.key, &e) => {
                    resolved.push(None);
                    continue;
                }
                Err(e) => return Err(e),
            };
            if stale.contains(&rule) {
                // The agent's rule of this name means something else: its grant is
                // not one of ours.
                resolved.push(None);
                continue;
            }
            self.validate_held(&h.key, rule, &h.grant)?;
            if key.is_none() {
                if !self.key_has_free_probe(hash) {
                    return Err(AllocError::KeyTableFull {
                        max: self.cfg.max_keys,
                    });
                }
                new_keys += 1;
            }
            resolved.push(Some((key, rule, hash)));
        }
        let mut ids: Vec<(u64, u64, usize)> = resolved
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.map(|r| (r.2.hash, r.2.check, i)))
            .collect();
        ids.sort_unstable();
        if let Some(w) = ids
            .windows(2)
            .find(|w| (w[0].0, w[0].1) == (w[1].0, w[1].1))
        {
            return Err(AllocError::DuplicateKey(hello.held[w[1].2].key.clone()));
        }
        if self.live_keys + new_keys > self.cfg.max_keys {
            return Err(AllocError::KeyTableFull {
                max: self.cfg.max_keys,
            });
        }
        if self.entry_count + hello.held.len() > self.cfg.max_entries {
            return Err(AllocError::EntryTableFull {
                max: self.cfg.max_entries,
            });
        }
        // Apply.
        if let Some(v) = evict {
            let id = Arc::clone(&self.agent(v).id);
            self.forget_agent(now, &id)
                .expect("a live agent's id names it");
            self.agents_evicted += 1;
        }
        let a = match existing {
            Some(a) if replace => {
                self.release_agent(now, a);
                if self.pending_len() != 0 {
                    // Grants queued for the old incarnation keep it.
                    let old = self.agent(a).incarnation;
                    self.graves.reincarnated.push((a, self.pending_len(), old));
                }
                let ag = self.agent_mut(a);
                ag.incarnation = hello.incarnation;
                ag.report_ts = 0;
                // The new process holds nothing: nothing of the old one's to extend.
                ag.last_seq = 0;
                ag.ext = Ext::default();
                ag.unext_min_expiry = u64::MAX;
                ag.ext_queued = false;
                a
            }
            Some(a) => a,
            None => self.register(hello),
        };
        let ag = self.agent_mut(a);
        ag.shapes = Arc::from(hello.rule_shapes.as_slice());
        ag.stale_rules = stale;
        ag.weight = hello.weight.max(1) as f64;
        ag.report_interval_ns = AllocatorConfig::ns(hello.report_interval_ms.min(3_600_000));
        ag.by_handle = hello.grants_by_handle;
        ag.connected = true;
        ag.last_heard_ns = now;
        ag.report_ts = hello.agent_time_ns;
        ag.report_recv_ns = now;
        ag.renew_due_ns = now;
        // A new stream: it has been told no key's name, and no revocation.
        self.new_stream(a);
        self.agent_mut(a).revoked.clear();
        for (h, r) in hello.held.iter().zip(resolved) {
            let Some((key, rule, hash)) = r else {
                // A grant this allocator does not count (its rule was removed, or means
                // something else in the agent's file): it must not stay in force.
                self.ignored_lines += 1;
                let fp = self.hash_name(&h.key.rule, &h.key.values).hash;
                self.revoke(a, Arc::new(h.key.clone()), fp);
                continue;
            };
            let k = match key.or_else(|| self.find_key(hash)) {
                Some(k) => k,
                None => self.create_key(now, &h.key, rule, hash),
            };
            let pos = match self.entry_pos(a, k) {
                Some(p) => p,
                None => self.create_entry(a, k),
            };
            // A hello says nothing of work in flight: the entry's last report does (a
            // concurrency shrink still draining must not count as applied on a
            // reconnect).
            let in_flight = self.key(k).entries[pos as usize].in_flight;
            self.apply_held(k, pos, &h.grant, in_flight);
            self.mark_dirty(k, self.recompute_due(now));
        }
        Ok(())
    }

    fn register(&mut self, hello: &Hello) -> u32 {
        let id: Arc<str> = hello.agent.as_str().into();
        let agent = Agent {
            id: Arc::clone(&id),
            incarnation: hello.incarnation,
            shapes: Arc::from(Vec::new()),
            stale_rules: Vec::new(),
            weight: 1.0,
            report_interval_ns: 0,
            connected: true,
            last_heard_ns: 0,
            report_ts: 0,
            report_recv_ns: 0,
            entries: HashMap::with_hasher(FixedState::with_seed(3)),
            renew_due_ns: 0,
            last_seq: 0,
            ext: Ext::default(),
            ext_lease_at_ns: 0,
            unext_min_expiry: u64::MAX,
            ext_queued: false,
            stale_epochs: false,
            by_handle: false,
            stream: 1,
            revoked: HashSet::default(),
        };
        let a = match self.free_agents.pop() {
            Some(a) => {
                self.agents[a as usize] = Some(agent);
                a
            }
            None => {
                self.agents.push(Some(agent));
                (self.agents.len() - 1) as u32
            }
        };
        self.agent_index.insert(id, a);
        self.live_agents += 1;
        a
    }

    /// Drops every entry of agent `a` (its grants are released: the process is gone).
    fn release_agent(&mut self, now: u64, a: u32) {
        let keys: Vec<u32> = self.agent(a).entries.keys().copied().collect();
        let quiet = now.saturating_add(AllocatorConfig::ns(self.cfg.reclaim_margin_ms));
        for k in keys {
            if let Some(pos) = self.entry_pos(a, k) {
                // Released before its lease ended: the key's rule gives new keys no
                // pool for a margin (see `new_key_pool`).
                if !self.key(k).entries[pos as usize].commitment().is_zero() {
                    let rule = self.key(k).rule as usize;
                    let r = &mut self.rules[rule];
                    r.pool_quiet_until_ns = r.pool_quiet_until_ns.max(quiet);
                }
                self.remove_entry(k, pos);
                self.mark_dirty(k, now);
            }
        }
    }

    /// The shell could not send some of `agent`'s grants (its stream's queue was full):
    /// the names they carried may never have reached it, so the next grant for each of
    /// its keys names the key again ([`Hello::grants_by_handle`]). An unknown agent is
    /// ignored.
    pub fn grants_undelivered(&mut self, agent: &str) {
        if let Ok(a) = self.agent_id(agent) {
            self.new_stream(a);
        }
    }

    /// Agent `a`'s stream has been told no key's name (a hello, grants undelivered):
    /// a new stream number, which no entry's stamp holds.
    fn new_stream(&mut self, a: u32) {
        let ag = self.agent_mut(a);
        if ag.stream < u16::MAX {
            ag.stream += 1;
            return;
        }
        // Wrapped (after 65,535 streams): clear the stamps, which could match again.
        ag.stream = 1;
        let held: Vec<(u32, u32)> = ag.entries.iter().map(|(&k, &p)| (k, p)).collect();
        for (k, pos) in held {
            self.key_mut(k).entries[pos as usize].told = 0;
        }
    }

    /// The agent's stream closed. Its grants stay counted until their leases end (it may
    /// still be admitting); it gets no growth while disconnected.
    pub fn handle_disconnect(&mut self, _now: u64, agent: &str) -> Result<(), AllocError> {
        let a = self.agent_id(agent)?;
        self.agent_mut(a).connected = false;
        Ok(())
    }

    /// The agent disconnected longest, if it has been gone a lease and the margin
    /// (every grant it held has lapsed), for [`Allocator::handle_hello`] to forget when
    /// the table is full.
    fn longest_gone(&self, now: u64) -> Option<u32> {
        let hold = self.hold_ns();
        self.agents
            .iter()
            .enumerate()
            .filter_map(|(i, ag)| ag.as_ref().map(|ag| (i as u32, ag)))
            .filter(|(_, ag)| !ag.connected && now.saturating_sub(ag.last_heard_ns) >= hold)
            .min_by_key(|(_, ag)| ag.last_heard_ns)
            .map(|(i, _)| i)
    }

    /// Agents forgotten to make room for new ones in a full table.
    pub fn agents_evicted(&self) -> u64 {
        self.agents_evicted
    }

    /// Forgets an agent (operator action, or the shell's clean-up of an agent gone for
    /// good): its grants and any partition fallback stop counting. Only safe once the
    /// agent is known to be stopped.
    pub fn forget_agent(&mut self, now: u64, agent: &str) -> Result<(), AllocError> {
        let a = self.agent_id(agent)?;
        self.release_agent(now, a);
        let ag = self.agents[a as usize].take().expect("live agent");
        self.agent_index.remove(&ag.id);
        if self.pending_len() == 0 {
            self.free_agents.push(a);
        } else {
            self.graves.agents.push((a, (ag.id, ag.incarnation)));
        }
        self.live_agents -= 1;
        Ok(())
    }

    /// A report: updates demand for each key named, records held grants, renews leases
    /// that are due, and marks keys whose demand changed for recomputation (done in
    /// [`Allocator::handle_timeout`] after `recompute_delay_ms`, so that reports
    /// arriving together are allocated together).
    ///
    /// The report is validated whole first; an error means nothing changed.
    pub fn handle_report(&mut self, now: u64, report: &Report) -> Result<(), AllocError> {
        // The per-line buffers are kept between reports (four allocations a report, at
        // thousands of reports a second, otherwise).
        let mut rs = std::mem::take(&mut self.report_scratch);
        let r = self.handle_report_in(now, report, &mut rs);
        self.report_scratch = rs;
        r
    }

    fn handle_report_in(
        &mut self,
        now: u64,
        report: &Report,
        rs: &mut ReportScratch,
    ) -> Result<(), AllocError> {
        let a = self.agent_id(&report.agent)?;
        let ag = self.agent(a);
        if ag.incarnation != report.incarnation {
            return Err(AllocError::StaleIncarnation {
                agent: report.agent.clone(),
                registered: ag.incarnation,
                got: report.incarnation,
            });
        }
        if report.agent_time_ns <= ag.report_ts {
            return Err(AllocError::StaleReport {
                last: ag.report_ts,
                got: report.agent_time_ns,
            });
        }
        if report.keys.len() > self.cfg.max_keys_per_message {
            return Err(AllocError::MessageTooLarge {
                got: report.keys.len(),
                max: self.cfg.max_keys_per_message,
            });
        }
        let ReportScratch {
            resolved,
            fps,
            found,
            positions,
            ids,
            surged,
            unknown,
        } = rs;
        resolved.clear();
        unknown.clear();
        let mut new_keys = 0usize;
        let mut new_entries = 0usize;
        // Lookups in phases, each a tight loop over the report, so that the cache misses
        // of different keys overlap instead of queueing one behind another.
        // A line naming its key by handle needs no hashing and no table probe.
        fps.clear();
        fps.extend(report.keys.iter().map(|kr| {
            if kr.key_handle != 0 {
                self.handle_key(kr.key_handle)
                    .map_or(Fp::default(), |k| self.key(k).fp)
            } else {
                self.hash_name(&kr.key.rule, &kr.key.values)
            }
        }));
        found.clear();
        found.extend(report.keys.iter().zip(fps.iter()).map(|(kr, &fp)| {
            if kr.key_handle != 0 {
                self.handle_key(kr.key_handle)
            } else {
                self.find_key(fp)
            }
        }));
        positions.clear();
        positions.extend(found.iter().map(|k| k.and_then(|k| self.entry_pos(a, k))));
        // The entries' three cache lines (flags, counters' bases, the commitment), loaded
        // in a tight loop too: validation, sampling and a large key's re-targeting
        // (`adjust_entry` compares the target with the commitment) then find them in
        // cache. Without the third line, that comparison took the miss: 9 % of a report
        // in `report/100_keys_default_recompute_delay`.
        let warm = found
            .iter()
            .zip(positions.iter())
            .filter_map(|(k, p)| Some(&self.key((*k)?).entries[(*p)? as usize]))
            .fold(0u64, |acc, e| {
                acc ^ e.since ^ e.sampled as u64 ^ e.commitment().rate
            });
        std::hint::black_box(warm);
        for (i, kr) in report.keys.iter().enumerate() {
            if kr.key_handle != 0 && found[i].is_none() {
                // A handle this allocator no longer knows: nothing to count it against.
                // The agent is told, and names the key by name from then on.
                resolved.push(None);
                unknown.push(kr.key_handle);
                continue;
            }
            let name = self.line_name(kr);
            let (key, rule, hash) = match self.resolve_found(name, fps[i], found[i]) {
                Ok(r) => r,
                Err(e) if self.ignorable(name, &e) => {
                    resolved.push(None);
                    continue;
                }
                Err(e) => return Err(e),
            };
            if self.agent(a).stale_rules.contains(&rule) {
                // The agent runs a file where this rule means something else.
                resolved.push(None);
                continue;
            }
            if let Some(h) = &kr.held {
                self.validate_held(name, rule, h)?;
            }
            let entry = positions[i];
            self.validate_counters(kr, name, report.agent_time_ns, key, entry)?;
            match key {
                None => {
                    if !self.key_has_free_probe(hash) {
                        return Err(AllocError::KeyTableFull {
                            max: self.cfg.max_keys,
                        });
                    }
                    new_keys += 1;
                    new_entries += 1;
                }
                Some(_) if entry.is_none() => new_entries += 1,
                Some(_) => {}
            }
            resolved.push(Some(Resolved {
                key,
                rule,
                hash,
                entry,
            }));
        }
        // A key named twice is refused (the later line is named). A set reused from
        // report to report: sorting the ids for the same check was a tenth of the
        // instructions of `handle_report` (bench/allocator_instructions.sh).
        ids.clear();
        for (i, r) in resolved.iter().enumerate() {
            if let Some(r) = r
                && !ids.insert((r.hash.hash, r.hash.check))
            {
                return Err(AllocError::DuplicateKey(
                    self.line_name(&report.keys[i]).clone(),
                ));
            }
        }
        if self.live_keys + new_keys > self.cfg.max_keys {
            return Err(AllocError::KeyTableFull {
                max: self.cfg.max_keys,
            });
        }
        if self.entry_count + new_entries > self.cfg.max_entries {
            return Err(AllocError::EntryTableFull {
                max: self.cfg.max_entries,
            });
        }
        // Apply.
        let ag = self.agent_mut(a);
        ag.report_ts = report.agent_time_ns;
        ag.report_recv_ns = now;
        ag.last_heard_ns = now;
        ag.connected = true;
        let (stream, last_seq) = (ag.stream, ag.last_seq);
        if ag.by_handle {
            // A line by name for a key its stream was told says the agent has no
            // handle for it any more (evicted, rebased, a grant lost): the key's next
            // grant names it. One already queued carries the stream it was issued on,
            // so if the agent has any grant queued, the stream starts afresh (every
            // key's next grant named: rare, as the shell drains after each batch).
            let mut forgot = false;
            for (kr, r) in report.keys.iter().zip(resolved.iter()) {
                if kr.key_handle == 0
                    && let Some(Resolved {
                        key: Some(k),
                        entry: Some(pos),
                        ..
                    }) = r
                {
                    let e = &mut self.key_mut(*k).entries[*pos as usize];
                    if e.told == stream {
                        e.told = 0;
                        forgot = true;
                    }
                }
            }
            if forgot && self.pending_len() > 0 && last_seq >= self.first_pending_seq() {
                self.new_stream(a);
            }
        }
        let soon = self.recompute_due(now);
        let frequent = self.reports_frequently(a);
        surged.clear();
        for (kr, r) in report.keys.iter().zip(resolved.drain(..)) {
            let Some(r) = r else {
                self.ignored_lines += 1;
                if kr.held.is_some()
                    && (kr.key_handle == 0 || self.handle_key(kr.key_handle).is_some())
                {
                    // A grant this allocator does not count (a reload removed its rule,
                    // or the agent's file gives it another meaning): revoked. (A line
                    // by an unknown handle names no key: the agent is told, and its
                    // next line names it.)
                    let name = self.line_name(kr).clone();
                    let fp = self.hash_name(&name.rule, &name.values).hash;
                    self.revoke(a, Arc::new(name), fp);
                }
                continue;
            };
            let k = match r.key.or_else(|| self.find_key(r.hash)) {
                Some(k) => k,
                None => self.create_key(now, &kr.key, r.rule, r.hash),
            };
            let pos = match r.entry.or_else(|| self.entry_pos(a, k)) {
                Some(p) => p,
                None => self.create_entry(a, k),
            };
            self.key_mut(k).named_ns = now;
            let (changed, jumped_up) =
                self.sample(k, pos, kr, report.agent_time_ns, frequent, report.measure);
            if jumped_up {
                surged.push((k, pos));
            }
            if let Some(h) = &kr.held {
                self.apply_held(k, pos, h, kr.in_flight);
            }
            self.resend_if_lost(now, k, pos, kr.held.as_ref());
            if changed {
                // Large keys: re-target this entry now against the last water level
                // (a new entry waits for the whole pass, which knows its peers).
                let key = self.key(k);
                if key.entries.len() > self.cfg.large_key_entries
                    && key.last_full_ns != 0
                    && r.entry.is_some()
                    && !self.learning
                {
                    self.adjust_entry(now, k, pos);
                }
                self.mark_dirty(k, soon);
            }
        }
        // After the held grants of this report are applied (a holder's commitment is
        // then current): keys where this agent now wants more than is free.
        for &(k, pos) in surged.iter() {
            self.request_measures(now, k, pos);
        }
        if !unknown.is_empty() {
            if self.unknown_queued + unknown.len() > MAX_UNKNOWN_QUEUED {
                self.unknown_dropped += unknown.len() as u64;
            } else {
                self.unknown_queued += unknown.len();
                self.unknown.push(UnknownHandles {
                    agent: Arc::clone(&self.agent(a).id),
                    incarnation: report.incarnation,
                    key_handles: unknown.clone(),
                });
            }
        }
        self.renew(now, a);
        Ok(())
    }

    fn validate_counters(
        &self,
        kr: &KeyReport,
        name: &KeyName,
        agent_time: u64,
        key: Option<u32>,
        entry: Option<u32>,
    ) -> Result<(), AllocError> {
        let absurd = |reason| AllocError::AbsurdDemand {
            key: name.clone(),
            reason,
        };
        if kr.counting_since_ns > agent_time {
            return Err(absurd("counters start after the report's time"));
        }
        if kr.in_flight > MAX_COST {
            return Err(absurd("in-flight count above MAX_COST"));
        }
        let (mut base_a, mut base_r) = (0, 0);
        if let (Some(k), Some(p)) = (key, entry) {
            let e = &self.key(k).entries[p as usize];
            if e.sampled != Sampled::No && e.since == kr.counting_since_ns {
                base_a = e.base_admitted;
                base_r = e.base_rejected;
            }
        }
        if kr.admitted < base_a {
            return Err(AllocError::NegativeDemand {
                key: name.clone(),
                counter: "admitted",
                was: base_a,
                now: kr.admitted,
            });
        }
        if kr.rejected < base_r {
            return Err(AllocError::NegativeDemand {
                key: name.clone(),
                counter: "rejected",
                was: base_r,
                now: kr.rejected,
            });
        }
        // A line's counts since its base are not bounded here: a rule with a large
        // limit passes `MAX_COST` units within a report legitimately (or the
        // counters of a key busy for days, first named to a new leader), and refusing
        // the line refused the whole report, so none of the agent's leases were
        // renewed and every key it held fell to its posture. [`Allocator::sample`]
        // reads at most `MAX_COST` units of each counter from one line instead.
        Ok(())
    }

    /// Whether agent `a` said in its hello that it reports more often than
    /// `min_sample_ms` (see [`Allocator::sample`]).
    fn reports_frequently(&self, a: u32) -> bool {
        let interval = self.agent(a).report_interval_ns;
        interval > 0 && interval < AllocatorConfig::ns(self.cfg.min_sample_ms)
    }

    /// Folds one report's counters into the smoothed demand; `frequent`: the agent
    /// reports more often than `min_sample_ms`; `measure`: what the report is to the
    /// estimate ([`Measure`]). Returns whether the key should be recomputed, and
    /// whether the entry's demand jumped up (a surge that may need other holders
    /// measured, [`Allocator::request_measures`]).
    fn sample(
        &mut self,
        k: u32,
        pos: u32,
        kr: &KeyReport,
        agent_time: u64,
        frequent: bool,
        measure: Measure,
    ) -> (bool, bool) {
        let half_life = AllocatorConfig::ns(self.cfg.demand_half_life_ms) as f64;
        let slow_half_life = AllocatorConfig::ns(self.cfg.sparse_half_life_ms) as f64;
        let min_sample = AllocatorConfig::ns(self.cfg.min_sample_ms);
        let change = self.cfg.demand_change_permille as f64 / 1000.0;
        let jump_rel = self.cfg.demand_jump_permille as f64 / 1000.0;
        let memo = &mut self.alpha_memo;
        let key = self.keys[k as usize].as_mut().expect("live key");
        let rule = &self.rules[key.rule as usize];
        let jump_floor =
            rule.capacity() as f64 * self.cfg.demand_jump_floor_permille as f64 / 1000.0;
        let window = AllocatorConfig::ns(self.cfg.measure_window_ms).max(1);
        let e = &mut key.entries[pos as usize];
        if measure == Measure::Start && !rule.concurrency {
            // The start of a measurement: a base, not a sample (what came before it
            // may be mostly history; that is why it was asked for).
            e.base_admitted = kr.admitted;
            e.base_rejected = kr.rejected;
            e.base_ts = agent_time;
            e.since = kr.counting_since_ns;
            // A regular report before the end is short: it keeps this base.
            e.sampled = Sampled::Measured;
            e.in_flight = kr.in_flight;
            return (false, false);
        }
        let (before, was_rejecting) = (e.demand, e.rejecting);
        let (ba, br, bt) = if e.sampled != Sampled::No && e.since == kr.counting_since_ns {
            (e.base_admitted, e.base_rejected, e.base_ts)
        } else {
            (0, 0, kr.counting_since_ns)
        };
        // At most `MAX_COST` units a counter from one line (see `validate_counters`):
        // beyond that the estimate is past any limit a rule can hold already.
        let da = (kr.admitted - ba).min(MAX_COST);
        let dr = (kr.rejected - br).min(MAX_COST);
        let elapsed = agent_time.saturating_sub(bt);
        // A sample shorter than `min_sample_ms` is measured over `min_sample_ms`: a
        // new key's first report covers one request, and read over its own few
        // milliseconds it would be a surge. For an agent that reports more often than
        // that (its hello says so) the dilution was a bias: with reports every 125 ms
        // every sample read half the demand, and the `shift` scenario's utilization fell
        // from 0.87-0.89 to 0.76-0.77. So such an agent's entry that already has an
        // estimate keeps its base instead (the next report measures from it, over at
        // least `min_sample_ms`), and a short sample can only raise the estimate, by a
        // jump: the diluted rate is a lower bound on the real one. Reading short samples
        // over their own length instead was noisier than the bias (`zipf` at 50 ms
        // reports: 0.71 of the ideal bucket and 308 messages per agent per second,
        // against 0.78 and 81 this way). Agents that report at `min_sample_ms` or less
        // often (the default), or do not say, are read as before: an out-of-band report
        // followed soon by a regular one is folded as it always was.
        //
        // The end of a requested measurement is read over its own window (at least the
        // configured one): it was asked for because the estimate may be stale. A
        // regular report soon after one is short, and is read as a frequent agent's.
        let measured = measure == Measure::End && !rule.concurrency;
        let short = !measured
            && (frequent || e.sampled == Sampled::Measured)
            && elapsed < min_sample
            && e.has_demand
            && !rule.concurrency;
        let interval = if measured {
            elapsed.max(window)
        } else {
            elapsed.max(min_sample)
        };
        let sample = if rule.concurrency {
            kr.in_flight as f64 + dr as f64
        } else {
            (da + dr) as f64 * rule.period_ns as f64 / interval as f64
        };
        let rejected_sample = if rule.concurrency {
            dr as f64
        } else {
            dr as f64 * rule.period_ns as f64 / interval as f64
        };
        // A measurement's window held enough typical requests for an empty one to mean
        // something (see `request_measures`).
        let enough = rule.typical > 0
            && before * elapsed as f64
                >= MEASURE_ENOUGH_REQUESTS * rule.typical as f64 * rule.period_ns as f64;
        let jump = |d: f64| {
            // A change too large to be noise: demand moved (a shift, a surge, a gateway
            // drained). Follow it at once instead of over several half-lives. A
            // measurement's window is short: it jumps down only when nothing at all
            // came in it (a holder whose demand moved away), not on a quiet spell of a
            // few requests; and then whatever the estimate's size, since the floor is
            // there for noise and a window that should have held `enough` requests is
            // not noise (with the floor, a small holder whose demand had left kept its
            // grant, and grew on what the others freed, for a half-life).
            if measured && sample < d {
                return da + dr == 0 && enough;
            }
            let diff = (sample - d).abs();
            diff > jump_rel * sample.max(d) && diff > jump_floor
        };
        if short {
            // The base stays; only a jump up is taken from the diluted rate.
            if sample > e.demand && jump(e.demand) {
                e.demand = sample;
                e.rejected_rate = e.rejected_rate.max(rejected_sample);
            }
            e.rejecting |= dr > 0;
        } else {
            // Reports come at one interval: the smoothing factors are computed once per
            // interval seen, not once per key (`exp2` is a libm call).
            if memo.0 != interval {
                let f = |hl: f64| 1.0 - (-(interval as f64) / hl).exp2();
                *memo = (interval, f(half_life), f(slow_half_life));
            }
            let (alpha, alpha_slow) = (memo.1, memo.2);
            if e.has_demand && !jump(e.demand) {
                e.demand += alpha * (sample - e.demand);
                e.rejected_rate += alpha * (rejected_sample - e.rejected_rate);
            } else {
                e.demand = sample;
                e.rejected_rate = rejected_sample;
                e.has_demand = true;
            }
            e.demand_slow += alpha_slow * (sample - e.demand_slow);
            // Rejecting until the smoothed rejections fade below 2 % of demand: an agent
            // that got spare capacity keeps it for a few reports after it stops
            // rejecting, instead of losing it at once and rejecting again (flapping).
            e.rejecting = dr > 0 || e.rejected_rate > 0.02 * e.demand;
            e.base_admitted = kr.admitted;
            e.base_rejected = kr.rejected;
            e.base_ts = agent_time;
            e.since = kr.counting_since_ns;
            e.sampled = if measured {
                Sampled::Measured
            } else {
                Sampled::Yes
            };
        }
        e.in_flight = kr.in_flight;
        let floor = rule.capacity() as f64 / 1000.0;
        // A surge: demand jumped up, or the entry started rejecting (a first report
        // covers a few milliseconds, too few to jump, but its rejections say the agent
        // is short now).
        let rise = e.demand - before;
        let jumped_up = !rule.concurrency
            && ((rise > jump_floor && rise > jump_rel * e.demand)
                || (!was_rejecting && e.rejecting && dr > 0 && e.cur.rate == 0));
        let changed = e.rejecting != e.rejecting_used
            || (e.demand - e.demand_used).abs() > change * e.demand_used.max(floor)
            || (e.demand_used == 0.0) != (e.demand == 0.0);
        (changed, jumped_up)
    }

    /// Keeps agent `a`'s grants in force while it reports: once the earliest of them
    /// has less than half a hold (`lease_ms + reclaim_margin_ms`) left, one lease
    /// extension for all of them (through the latest seq issued to it, lease from its
    /// latest report), instead of re-sending each grant as it comes due. At the
    /// design's scale (1,000 agents holding 1,000 keys each) per-grant renewal was
    /// ~360,000 grants a second, each issued, named, sent, applied and acknowledged; an
    /// extension is one small message per agent every half hold. Grants of an earlier
    /// term are not covered (the agent holds them under that term's lease): they are
    /// re-issued in this term, as before.
    fn renew(&mut self, now: u64, a: u32) {
        if now < self.agent(a).renew_due_ns {
            return;
        }
        let hold = self.hold_ns();
        let lease = self.lease_ns();
        let drift = AllocatorConfig::ns(self.cfg.drift_margin_ms);
        let term = self.term;
        let ag = self.agent_mut(a);
        let extended = if ag.ext.through > 0 {
            ag.ext.expires_ns
        } else {
            u64::MAX
        };
        let earliest = extended.min(ag.unext_min_expiry);
        if earliest != u64::MAX && earliest.saturating_sub(hold / 2) <= now {
            ag.ext = Ext {
                term,
                through: ag.last_seq,
                expires_ns: ag.report_recv_ns.saturating_add(hold),
            };
            ag.ext_lease_at_ns = ag.report_ts.saturating_add(lease).saturating_sub(drift);
            ag.unext_min_expiry = u64::MAX;
            ag.renew_due_ns = ag.ext.expires_ns.saturating_sub(hold / 2);
            if !ag.ext_queued {
                ag.ext_queued = true;
                self.extensions.push(a);
            }
        } else {
            ag.renew_due_ns = earliest.saturating_sub(hold / 2);
        }
        if self.agent(a).stale_epochs {
            self.renew_earlier_terms(now, a);
        }
    }

    /// Re-issues in this term the grants agent `a` holds from an earlier one (unless
    /// the key inherited excess: renewing what was learned would put a lapsed grant
    /// back in force). A walk of the agent's entries, only while some may be left.
    fn renew_earlier_terms(&mut self, now: u64, a: u32) {
        let list: Vec<(u32, u32)> = self
            .agent(a)
            .entries
            .iter()
            .map(|(&k, &p)| (k, p))
            .collect();
        let mut left = false;
        for (k, pos) in list {
            let key = self.key(k);
            let e = &key.entries[pos as usize];
            if e.term_seq != NOT_TERM || e.nsent == 0 {
                continue; // nothing sent, or covered by the extension
            }
            if !key.inherited.is_zero() {
                left = true;
                continue;
            }
            let slice = e.cur;
            if slice.is_zero() {
                continue;
            }
            if self.pending_len() >= self.cfg.max_outbox {
                left = true;
                break;
            }
            self.issue(k, pos, slice, 0);
        }
        let ag = self.agent_mut(a);
        ag.stale_epochs = left;
        if left {
            // Looked at again on the next report.
            ag.renew_due_ns = now;
        }
    }

    /// A report line says agent `a` holds `held` for entry `pos` of key `k`: if that is
    /// not the latest grant sent, and the latest went out long enough ago to have been
    /// applied and reported (`lease / 4`; the lower bound of its issue time is the
    /// report time it carried), it was lost (a full queue, a reconnect): re-send it.
    /// Likewise if the agent holds the latest grant but on its posture's slice (its
    /// lease ended there while this side still counts it: an extension lost, or a
    /// partition shorter than the allocator's margin); an extension never puts a lapsed
    /// grant back, since it cannot tell which ones this side has reclaimed. Per-grant
    /// renewals used to repair both as a side effect.
    fn resend_if_lost(&mut self, now: u64, k: u32, pos: u32, held: Option<&HeldGrant>) {
        let key = self.key(k);
        let e = &key.entries[pos as usize];
        if e.term_seq == NOT_TERM || e.cur.is_zero() {
            return;
        }
        // The latest grant's id (of this term) and slice are on the entry's first line.
        let latest = (self.term, e.term_seq);
        let on_posture = |h: &HeldGrant| h.rate != e.cur.rate || h.burst != e.cur.burst;
        if held.is_some_and(|h| {
            (h.epoch, h.seq) > latest || ((h.epoch, h.seq) == latest && !on_posture(h))
        }) {
            return;
        }
        let Some(expires_ns) = e.last_sent().map(|s| s.expires_ns) else {
            return;
        };
        let issued_after = expires_ns.saturating_sub(self.hold_ns());
        if issued_after.saturating_add(self.lease_ns() / 4) > now
            || self.pending_len() >= self.cfg.max_outbox
        {
            return;
        }
        let slice = e.cur;
        self.issue(k, pos, slice, 0);
    }

    /// Sends `slice` to the entry's agent: new seq, lease from its latest report.
    fn issue(&mut self, k: u32, pos: u32, slice: Slice, transfer: u64) {
        let (mut pass, keys, _) = self.serial_pass();
        let key = keys[k as usize].as_mut().expect("live key");
        pass.issue(k, key, pos, slice, transfer);
    }

    /// Acknowledgements: the agent applied these grants. Older grants stop counting,
    /// released tokens join the key's transfer pool, and the key is recomputed at once
    /// (its freed budget can go to agents waiting to grow).
    pub fn handle_ack(&mut self, now: u64, ack: &Ack) -> Result<(), AllocError> {
        let a = self.agent_id(&ack.agent)?;
        let ag = self.agent(a);
        if ag.incarnation != ack.incarnation {
            return Err(AllocError::StaleIncarnation {
                agent: ack.agent.clone(),
                registered: ag.incarnation,
                got: ack.incarnation,
            });
        }
        if ack.slices.len() > self.cfg.max_keys_per_message {
            return Err(AllocError::MessageTooLarge {
                got: ack.slices.len(),
                max: self.cfg.max_keys_per_message,
            });
        }
        let mut found = Vec::with_capacity(ack.slices.len());
        for s in &ack.slices {
            if s.epoch > self.term {
                return Err(AllocError::NewerTerm {
                    ours: self.term,
                    theirs: s.epoch,
                });
            }
            if s.epoch < self.term {
                return Err(AllocError::StaleTerm {
                    ours: self.term,
                    theirs: s.epoch,
                });
            }
            if s.seq >= self.next_seq || s.released_tokens > MAX_COST || s.in_flight > MAX_COST {
                let key = match self.handle_key(s.key_handle) {
                    Some(k) if s.key_handle != 0 => (*self.key(k).name).clone(),
                    _ => s.key.clone(),
                };
                return Err(AllocError::UnknownSeq { key, seq: s.seq });
            }
            // By handle (no hashing, no probe; one no longer known names nothing), else
            // by name.
            let key = if s.key_handle != 0 {
                self.handle_key(s.key_handle)
            } else {
                match self.resolve(&s.key) {
                    Ok((key, _, _)) => key,
                    Err(e) if self.ignorable(&s.key, &e) => None,
                    Err(e) => return Err(e),
                }
            };
            // An ack for a key or entry no longer tracked (forgotten, released) is
            // harmless: nothing to update.
            found.push(key.and_then(|k| self.entry_pos(a, k).map(|p| (k, p))));
        }
        self.agent_mut(a).last_heard_ns = now;
        let term = self.term;
        for (s, f) in ack.slices.iter().zip(found) {
            let Some((k, pos)) = f else { continue };
            let concurrency = self.rules[self.key(k).rule as usize].concurrency;
            let key = self.key_mut(k);
            let e = &mut key.entries[pos as usize];
            e.in_flight = s.in_flight;
            let slots = e.sent().find(|g| g.seq == s.seq).map(|g| g.slice.burst);
            if concurrency && slots.is_some_and(|n| s.in_flight > n) {
                // Not drained yet: the old, larger grant still counts.
                continue;
            }
            let grew_pool =
                key.edit(pos as usize, |e| e.mark_applied((s.epoch, s.seq), term)) && !concurrency;
            if grew_pool {
                key.pool = key.pool.saturating_add(s.released_tokens);
            }
            self.key_mut(k).clamp_pool();
            self.mark_dirty(k, now);
        }
        Ok(())
    }

    /// Timers: ends the learning period, sweeps expired grants (reclaiming an
    /// unreachable agent's slice once its lease has ended by this clock plus
    /// `reclaim_margin_ms`), and recomputes keys marked since the last call.
    pub fn handle_timeout(&mut self, now: u64) {
        if self.learning && now >= self.learn_until_ns {
            self.learning = false;
            for k in 0..self.keys.len() as u32 {
                if let Some(key) = &mut self.keys[k as usize] {
                    for e in &mut key.entries {
                        e.set_learned(None);
                    }
                    key.rare_entries =
                        key.entries.iter().filter(|e| e.rare.is_some()).count() as u32;
                    self.mark_dirty(k, now);
                }
            }
        }
        if now >= self.next_sweep_ns {
            self.sweep(now);
            self.next_sweep_ns = now + (self.lease_ns() / 8).max(1);
        }
        if self.recompute_at_ns.is_some_and(|t| t <= now) {
            self.recompute_dirty(now);
        }
    }

    /// Recomputes every key now, whatever its demand did (after a config change, and the
    /// full-pass benchmark).
    pub fn reallocate_all(&mut self, now: u64) {
        if self.entry_count < self.parallel_min_entries {
            self.outbox
                .reserve(self.entry_count.min(self.cfg.max_outbox));
        }
        let live: Vec<u32> = (0..self.keys.len() as u32)
            .filter(|&k| self.keys[k as usize].is_some())
            .collect();
        self.recompute_now_all(now, &live);
    }

    /// Whether a key of `entries` entries may be recomputed before the shell drains: its
    /// grants fit under `max_outbox`, or the outbox is empty (a key with more agents
    /// than `max_outbox` would otherwise never be recomputed; the outbox then holds one
    /// key's grants past the bound).
    fn outbox_has_room(&self, entries: usize) -> bool {
        self.outbox_fits(self.pending_len(), entries)
    }

    /// Whether a key of `entries` entries fits after `pending` grants (see
    /// [`Allocator::outbox_has_room`]).
    fn outbox_fits(&self, pending: usize, entries: usize) -> bool {
        pending == 0 || pending + entries <= self.cfg.max_outbox
    }

    /// Leaves key `k` marked, due now: its grants wait for the shell to drain.
    fn defer(&mut self, now: u64, k: u32) {
        let key = self.key_mut(k);
        key.dirty = true;
        key.due_ns = now;
        self.dirty.push(Reverse((now, k)));
        self.recompute_at_ns = Some(now);
    }

    /// Recomputes key `k` now, or, if the outbox has no room for its grants, leaves it
    /// marked, due now (the shell must drain first). True if it was recomputed.
    fn recompute_now(&mut self, now: u64, k: u32) -> bool {
        if !self.outbox_has_room(self.key(k).entries.len()) {
            self.defer(now, k);
            return false;
        }
        // Any heap entry for it goes stale (its `dirty` is cleared).
        self.key_mut(k).dirty = false;
        self.recompute(now, k);
        true
    }

    fn sweep(&mut self, now: u64) {
        let term = self.term;
        let quiet = self.lease_ns() + self.lease_ns() / 8;
        for k in 0..self.keys.len() as u32 {
            let Some(key) = self.keys[k as usize].as_mut() else {
                continue;
            };
            if now.saturating_sub(key.named_ns) >= quiet {
                // Named by nobody for a lease: a recomputation forgets the entries
                // gone quiet (and the key, if that is all of them). Again after
                // another lease if some stay (held grants, an agent cut off).
                key.named_ns = now;
                self.mark_dirty(k, now);
            }
            let key = self.keys[k as usize].as_mut().expect("live key");
            if key.sweep_after_ns > now {
                continue;
            }
            let rule = self.rules[key.rule as usize];
            let mut changed = false;
            for pos in 0..key.entries.len() {
                if key.entries[pos].sent().all(|s| s.expires_ns > now) {
                    continue;
                }
                let ext = self.agents[key.entries[pos].agent as usize]
                    .as_ref()
                    .map_or(Ext::default(), |ag| ag.ext);
                changed |= key.edit(pos, |e| {
                    let applied = e.applied;
                    let in_flight = e.in_flight;
                    let mut fb = e.fallback();
                    let before = e.nsent;
                    e.edit_sent(term, |v| {
                        v.retain(|s| {
                            // An extended grant's own expiry catches up with its
                            // extension: the key is visited again only when that ends.
                            s.expires_ns = ext.expiry(s);
                            if s.expires_ns > now {
                                return true;
                            }
                            // It may be the grant in force: the agent now follows its
                            // posture.
                            if s.id() >= applied {
                                let mut f = rule.fallback_of(s.epoch, term, s.slice, s.fleet);
                                if rule.concurrency {
                                    // Work in flight is never revoked: it drains on its
                                    // own, and until the agent says it has, the slots it
                                    // last reported busy (within the grant) count in
                                    // the bound beside the posture's.
                                    f.burst = f.burst.max(in_flight.min(s.slice.burst));
                                }
                                if !f.is_zero() {
                                    let (prev, at) = fb.unwrap_or((Slice::ZERO, (0, 0)));
                                    fb = Some((prev.max(f), at.max(s.id())));
                                }
                            }
                            false
                        })
                    });
                    e.set_fallback(fb);
                    e.nsent != before
                });
            }
            key.sweep_after_ns = key
                .entries
                .iter()
                .map(Entry::earliest_expiry)
                .min()
                .unwrap_or(u64::MAX);
            if changed {
                self.mark_dirty(k, now);
            }
        }
    }

    /// Recomputes the keys due by `now`, in batches: those whose grants fit in the
    /// outbox counting one per entry (a batch of many entries runs on two threads:
    /// `recompute_batch`), again until none is due or the first due does not fit.
    fn recompute_dirty(&mut self, now: u64) {
        let mut batch = std::mem::take(&mut self.batch);
        loop {
            batch.clear();
            let (mut projected, mut entries) = (self.pending_len(), 0usize);
            while let Some(&Reverse((due, k))) = self.dirty.peek() {
                if due > now {
                    break;
                }
                let current = self.keys[k as usize]
                    .as_ref()
                    .is_some_and(|key| key.dirty && key.due_ns == due);
                if !current {
                    self.dirty.pop();
                    continue;
                }
                let n = self.key(k).entries.len();
                if !self.outbox_fits(projected, n) {
                    break; // the shell must drain first; stays due
                }
                self.dirty.pop();
                self.key_mut(k).dirty = false;
                projected += n;
                entries += n;
                batch.push(k);
            }
            if batch.is_empty() {
                break;
            }
            self.recompute_batch(now, &mut batch, entries);
        }
        self.batch = batch;
        self.recompute_at_ns = self.dirty.peek().map(|Reverse((due, _))| (*due).max(now));
    }

    /// The whole-key target for `units` of the split dimension for entry `e`, capped
    /// for learning and unreachable agents.
    fn target_of(
        &self,
        rule: &RuleInfo,
        units: u64,
        e: &Entry,
        reachable: bool,
        split: BurstSplit,
    ) -> Slice {
        target_of(rule, self.learning, units, e, reachable, split)
    }

    fn reachable(&self, a: u32, now: u64) -> bool {
        self.agents[a as usize].as_ref().is_some_and(|ag| {
            ag.connected && ag.report_recv_ns.saturating_add(self.lease_ns()) > now
        })
    }

    /// Sends `desired` to entry `pos` as far as revoke-before-grant allows: a shrink (or
    /// anything within its commitment) at once, growth only out of what is free, with
    /// transfer tokens from the pool. Returns true if a grant was issued.
    fn grant_towards(&mut self, k: u32, pos: u32, desired: Slice) -> bool {
        let (mut pass, keys, _) = self.serial_pass();
        let key = keys[k as usize].as_mut().expect("live key");
        pass.grant_towards(k, key, pos, desired)
    }

    /// One entry's demand changed on a large key: re-target just that entry with the
    /// key's last water level (the whole key is recomputed on its own schedule).
    fn adjust_entry(&mut self, now: u64, k: u32, pos: u32) {
        let key = self.key(k);
        let rule = self.rules[key.rule as usize];
        let e = &key.entries[pos as usize];
        let weight = self.agent(e.agent).weight;
        let reachable = self.reachable(e.agent, now);
        let demand = if key.sparse { e.demand_slow } else { e.demand };
        let claim = Claim {
            demand: if reachable && demand.is_finite() {
                demand.max(0.0)
            } else {
                0.0
            },
            weight,
            rejecting: e.rejecting && !key.sparse,
        };
        let share = if key.sparse && priority(e) < key.keep_floor {
            0.0
        } else {
            key.fill.share(&claim)
        };
        let units = if share.is_finite() && share > 0.0 {
            (share as u64).min(rule.capacity())
        } else {
            0
        };
        let target = self.target_of(&rule, units, e, reachable, key.split);
        let h = band(self.cfg.hysteresis_permille as u64, key.sparse);
        let desired = with_hysteresis(&rule, h, target, e);
        self.grant_towards(k, pos, desired);
        let e = &mut self.key_mut(k).entries[pos as usize];
        e.demand_used = e.demand;
        e.rejecting_used = e.rejecting;
    }

    /// An entry that can be forgotten: nothing granted or remembered, and the agent
    /// has had no sample of the key for a lease, or is gone. An agent names a key
    /// whenever its counts change, and in full reports while it holds a grant and
    /// once after it changed, so a lease without a sample means the key went quiet
    /// there (an estimate left from its last sample is stale). The agent rebases a
    /// line after half a lease unnamed (`SyncTracks::set_rebase_after`): an entry
    /// revived then reads counts since the agent last named the key, not the
    /// cumulative counters of everything since it first did (seconds of past demand
    /// as if current, found by the simulator's `shift`). Entries were kept until their
    /// demand decayed to nothing, named every 2 s by full reports that named every key
    /// an agent held: at fleet scale an entry per key and gateway, for as long as the
    /// gateway kept the key.
    ///
    /// Tested in the order of the entry's cache lines (`recompute` calls this for every
    /// entry): the current grant and in-flight count on the first, the sample's time on
    /// the second, the commitment and rare parts on the fourth (tested first, the
    /// commitment's load was a fifth of `recompute`'s time at fleet scale).
    fn idle_entry(&self, e: &Entry, lease: u64) -> bool {
        pass::idle_entry(&self.agents[..], e, lease)
    }

    /// Allocates one key (`pass::recompute`), forgetting its idle entries first (and
    /// the key, if that is all of them).
    fn recompute(&mut self, now: u64, k: u32) {
        loop {
            let (mut pass, keys, sc) = self.serial_pass();
            let key = keys[k as usize].as_mut().expect("live key");
            if pass.recompute(now, k, key, sc) {
                return;
            }
            let lease = self.lease_ns();
            for pos in (0..self.key(k).entries.len()).rev() {
                if self.idle_entry(&self.key(k).entries[pos], lease) {
                    self.remove_entry(k, pos as u32);
                }
            }
            if self.key(k).entries.is_empty() {
                self.remove_key(k);
                return;
            }
        }
    }

    /// The worst-case overshoot of one key now (DESIGN.md's posture table): 0 with no
    /// partition (plus the overdraft), else the sum of partitioned agents' fallbacks.
    pub fn overshoot_bound(&self, key: &KeyName) -> Option<OvershootBound> {
        let hash = self.hash_name(&key.rule, &key.values);
        let k = self.find_key(hash)?;
        Some(self.bound_of(k))
    }

    fn bound_of(&self, k: u32) -> OvershootBound {
        let key = self.key(k);
        let rule = &self.rules[key.rule as usize];
        let mut b = OvershootBound {
            overdraft_rate: rule.overdraft,
            period_ns: rule.period_ns,
            ..OvershootBound::default()
        };
        // No entry has a fallback (no partition): nothing to walk. The simulator asks
        // for every key's bound every 50 ms; walking a fleet's million entries for it
        // was 9 % of a long fleet-scale run.
        let entries = if key.rare_entries == 0 {
            &[][..]
        } else {
            &key.entries[..]
        };
        for e in entries {
            if let Some((f, _)) = e.fallback() {
                b.rate += f.rate;
                b.burst += f.burst;
                b.partitioned_agents += 1;
            }
        }
        b.rate += key.inherited.rate;
        b.burst += key.inherited.burst;
        b
    }

    /// A key's allocation state (the admin endpoint's per-key view).
    pub fn key_status(&self, key: &KeyName) -> Option<KeyStatus> {
        let hash = self.hash_name(&key.rule, &key.values);
        let k = self.find_key(hash)?;
        let kk = self.key(k);
        let rule = &self.rules[kk.rule as usize];
        let mut committed = Slice::ZERO;
        let mut demand = 0.0;
        let agents = kk
            .entries
            .iter()
            .map(|e| {
                let c = e.commitment();
                committed.rate += c.rate;
                committed.burst += c.burst;
                demand += e.demand;
                AgentSlice {
                    agent: Arc::clone(&self.agent(e.agent).id),
                    demand: e.demand,
                    slow_demand: e.demand_slow,
                    granted: e.current(),
                    committed: c,
                    fallback: e.fallback().map(|(s, _)| s),
                }
            })
            .collect();
        Some(KeyStatus {
            key: key.clone(),
            limit: Slice {
                rate: rule.rate,
                burst: rule.burst,
            },
            rate_capacity: rule.rate_cap,
            committed,
            demand,
            agents,
            transfer_pool: kk.pool,
            concentrated: kk.sparse,
            bound: self.bound_of(k),
        })
    }

    /// Names of every tracked key.
    pub fn key_names(&self) -> impl Iterator<Item = &KeyName> {
        self.keys.iter().flatten().map(|k| &*k.name)
    }

    /// Checks the core's invariants; tests call it after every step. Returns the first
    /// violation. Checked: budget conservation for every key (sum of commitments at
    /// most `(R + O, B)`: invariant 1), the transfer pool within the free burst,
    /// grants ordered and bounded, index consistency, and table bounds.
    pub fn check_invariants(&self) -> Result<(), String> {
        for ag in self.agents.iter().flatten() {
            // An extension covers only grants issued (and to this agent).
            if ag.last_seq >= self.next_seq || ag.ext.through > ag.last_seq {
                return Err(format!(
                    "agent {}: extension through {} past its latest grant {}",
                    ag.id, ag.ext.through, ag.last_seq
                ));
            }
            if ag.ext.through > 0 && ag.ext.term != self.term {
                return Err(format!("agent {}: extension of another term", ag.id));
            }
            if ag.stream == 0 {
                return Err(format!("agent {}: stream 0", ag.id));
            }
        }
        let mut entries = 0;
        let mut live_keys = 0;
        for (k, key) in self.keys.iter().enumerate() {
            let Some(key) = key else { continue };
            live_keys += 1;
            let rule = &self.rules[key.rule as usize];
            let limit = rule.limit();
            if key.limit != limit {
                return Err(format!("{}: limit out of step with its rule", key.name));
            }
            let (mut r, mut b) = (0u128, 0u128);
            for (pos, e) in key.entries.iter().enumerate() {
                let Some(ag) = self.agents.get(e.agent as usize).and_then(|a| a.as_ref()) else {
                    return Err(format!("{}: entry of a dead agent", key.name));
                };
                if ag.entries.get(&(k as u32)) != Some(&(pos as u32)) {
                    return Err(format!("{}: agent index out of step", key.name));
                }
                if e.told > ag.stream {
                    return Err(format!(
                        "{}: told on stream {} of {}, which is at {}",
                        key.name, e.told, ag.id, ag.stream
                    ));
                }
                // Counted and compared in one pass, without collecting them: the
                // simulator runs this over millions of entries.
                let (mut n_sent, mut ordered, mut prev) = (0usize, true, None);
                for s in e.sent() {
                    let id = s.id();
                    ordered &= prev.is_none_or(|p| p < id);
                    prev = Some(id);
                    n_sent += 1;
                }
                if n_sent > MAX_SENT || n_sent != e.nsent as usize {
                    return Err(format!(
                        "{}: {} grants remembered, {} counted",
                        key.name, n_sent, e.nsent
                    ));
                }
                if e.older.as_ref().is_some_and(|o| o.is_empty()) {
                    return Err(format!("{}: an empty box of older grants", key.name));
                }
                if !ordered {
                    return Err(format!("{}: grants out of order", key.name));
                }
                let c = e.commitment();
                if c != e.recount() {
                    return Err(format!("{}: cached commitment out of step", key.name));
                }
                if e.nsent == 0
                    && (e.cur, e.cur_epoch, e.cur_seq, e.cur_fleet, e.cur_expires_ns)
                        != (Slice::ZERO, 0, 0, 0, 0)
                {
                    return Err(format!("{}: a current grant without one sent", key.name));
                }
                let term_seq = match e.last_sent() {
                    Some(l) if l.epoch == self.term => l.seq,
                    _ => NOT_TERM,
                };
                if e.term_seq != term_seq {
                    return Err(format!("{}: the term's seq out of step", key.name));
                }
                if e.earliest_expiry() < key.sweep_after_ns {
                    return Err(format!(
                        "{}: a grant expires before the sweep looks",
                        key.name
                    ));
                }
                if rule.concurrency && c.rate != 0 {
                    return Err(format!("{}: a concurrency grant with a rate", key.name));
                }
                r += c.rate as u128;
                b += c.burst as u128;
            }
            entries += key.entries.len();
            let rare = key.entries.iter().filter(|e| e.rare.is_some()).count();
            if rare != key.rare_entries as usize {
                return Err(format!(
                    "{}: {} entries with a learned grant or fallback, {} counted",
                    key.name, rare, key.rare_entries
                ));
            }
            if (key.committed.rate as u128, key.committed.burst as u128) != (r, b) {
                return Err(format!("{}: cached committed sum out of step", key.name));
            }
            if r > (limit.rate + key.inherited.rate) as u128
                || b > (limit.burst + key.inherited.burst) as u128
            {
                return Err(format!(
                    "{}: committed ({r}, {b}) exceeds (R + O, B) = ({}, {})",
                    key.name, limit.rate, limit.burst
                ));
            }
            if key.pool as u128 > (limit.burst as u128).saturating_sub(b) {
                return Err(format!(
                    "{}: transfer pool {} above the free burst",
                    key.name, key.pool
                ));
            }
            if key.inherited != key.inherited.min(key.excess()) {
                return Err(format!("{}: inherited excess out of step", key.name));
            }
        }
        if entries != self.entry_count || live_keys != self.live_keys {
            return Err("entry or key count out of step".into());
        }
        // Every pending grant names a live index or a buried one, and a buried index
        // is neither live nor free (it is reused only after the drain).
        let buried_agent = |i: u32| self.graves.agents.iter().any(|(j, _)| *j == i);
        let buried_key = |i: u32| self.graves.keys.iter().any(|(j, _)| *j == i);
        let mut seqs = self.graves.seqs(self.first_pending_seq());
        for (i, p) in self.outbox.iter().chain(&self.outbox_tail).enumerate() {
            let seq = seqs(i);
            let agent_ok = self
                .agents
                .get(p.agent as usize)
                .is_some_and(|a| a.is_some())
                || buried_agent(p.agent);
            let key_ok =
                self.keys.get(p.key as usize).is_some_and(|k| k.is_some()) || buried_key(p.key);
            if !agent_ok || !key_ok {
                return Err(format!("pending grant seq {seq} names a freed index"));
            }
        }
        for &(i, _) in &self.graves.agents {
            if self.agents[i as usize].is_some() || self.free_agents.contains(&i) {
                return Err(format!("buried agent index {i} live or free"));
            }
        }
        for &(i, _) in &self.graves.keys {
            if self.keys[i as usize].is_some() || self.free_keys.contains(&i) {
                return Err(format!("buried key index {i} live or free"));
            }
        }
        // What sits beside the outbox points into it: transfer tokens by record index,
        // in order; restarts at a length the outbox has reached.
        let n = self.pending_len();
        if self.graves.transfers.windows(2).any(|w| w[0].0 >= w[1].0)
            || self.graves.seq_jumps.windows(2).any(|w| w[0].0 >= w[1].0)
            || self.graves.seq_jumps.iter().any(|&(j, _)| j as usize >= n)
            || self
                .graves
                .transfers
                .iter()
                .any(|&(j, t)| j as usize >= n || t == 0)
            || self
                .graves
                .reincarnated
                .iter()
                .any(|&(_, at, _)| at > n || at == 0)
        {
            return Err("transfers or restarts beside the outbox out of step".into());
        }
        if self.live_keys > self.cfg.max_keys
            || self.entry_count > self.cfg.max_entries
            || self.live_agents > self.cfg.max_agents
        {
            return Err("a table is above its bound".into());
        }
        Ok(())
    }
}

/// What an entry may hold while the allocator learns an earlier term's grants. Out of
/// line and behind `black_box` in its caller: otherwise the compiler loads `rare` (the
/// entry's fourth cache line) on every recomputation, learning or not (`perf annotate`:
/// a fifth of `recompute`'s samples stalled on it).
#[cold]
#[inline(never)]
fn learned_cap(e: &Entry) -> Slice {
    e.learned().unwrap_or(Slice::ZERO)
}

/// The whole-key target for `units` of the split dimension for entry `e`, capped for
/// learning and unreachable agents.
fn target_of(
    rule: &RuleInfo,
    learning: bool,
    units: u64,
    e: &Entry,
    reachable: bool,
    split: BurstSplit,
) -> Slice {
    let t = rule.target(units, learning, e, split);
    if reachable { t } else { t.min(e.current()) }
}

/// How a key's burst `B` is split (see `RuleInfo::target`): each slice with rate gets
/// `floor + spread * sqrt(units) / norm`.
#[derive(Clone, Copy, Debug, Default)]
struct BurstSplit {
    norm: f64,
    floor: u64,
    spread: u64,
}

/// The burst split for these units: by the square root of the rate; a concentrated key
/// first gives every slice with rate its typical cost.
fn burst_split(rule: &RuleInfo, units: &[u64], sparse: bool) -> BurstSplit {
    let cap = rule.capacity();
    let assigned: u64 = units.iter().sum();
    let norm = units.iter().map(|&u| (u as f64).sqrt()).sum::<f64>()
        + (cap.saturating_sub(assigned) as f64).sqrt();
    let floor = if sparse { rule.typical } else { 0 };
    let held = units.iter().filter(|&&u| u > 0).count() as u64;
    BurstSplit {
        norm,
        floor,
        spread: rule.burst.saturating_sub(floor.saturating_mul(held)),
    }
}

/// True when no plain split among `n` entries can give a slice with rate a burst below
/// `m`: each such slice has at least one unit, and the split's norm is at most
/// `sqrt((n + 1) * capacity)`, so every burst is at least `B / sqrt((n + 1) * cap)`.
/// Most keys pass, and skip the water-filling on slow demand that would tell.
fn any_split_fits(rule: &RuleInfo, n: usize, m: u64) -> bool {
    let bound = ((n as f64 + 1.0) * rule.capacity() as f64).sqrt();
    rule.burst as f64 >= m as f64 * bound
}

/// True when every entry's burst under the plain split would reach `m`.
fn bursts_fit(rule: &RuleInfo, units: &[u64], m: u64) -> bool {
    let split = burst_split(rule, units, false);
    let (b, m) = (rule.burst as f64, m as f64);
    split.norm <= 0.0
        || units
            .iter()
            .all(|&u| u == 0 || b * (u as f64).sqrt() / split.norm >= m)
}

/// The hysteresis band of a key: three times wider on a concentrated key, where one
/// request moves a kept gateway's slow average by a few percent, close to the plain
/// band (`sparse`: 22 % fewer grants at the same utilization; 4x: 28 % fewer, 0.005
/// less utilization).
fn band(h: u64, sparse: bool) -> u64 {
    if sparse { (h * 3).min(1000) } else { h }
}

/// A sparse key's claim of one entry: its slow demand, doubled while it holds a slice
/// (so that who holds one does not change on noise).
fn priority(e: &Entry) -> f64 {
    let d = if e.demand_slow.is_finite() {
        e.demand_slow.max(0.0)
    } else {
        0.0
    };
    if e.current().rate > 0 { 2.0 * d } else { d }
}

/// Sparse keys. A slice whose burst is below one typical request admits no such
/// request, however much rate it holds: its refill is wasted while other gateways
/// reject. When a key's plain split (on slow demand, `sc.claims`) would make such a
/// slice, only the entries with the highest priority keep a claim, at most
/// `B / (2 typical)` of them (each then gets `typical` of burst first: `burst_split`); the
/// others' claims are zeroed and the water-filling runs again over the kept ones.
/// Writes the units into `sc.units`; returns the fill and the smallest kept priority.
fn concentrate(rule: &RuleInfo, entries: &[Entry], sc: &mut Scratch, reserve: f64) -> (Fill, f64) {
    sc.order.clear();
    for (i, e) in entries.iter().enumerate() {
        if sc.claims[i].demand > 0.0 {
            sc.order.push((priority(e), i as u32));
        }
    }
    sc.order.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
    // At most B / (2 typical): every kept slice gets `typical` first and at least half
    // of B is spread by the square root of the rate, so the busiest gateways hold a few
    // requests' worth. (At B / typical, every slice held exactly one typical request and
    // waited a whole refill after it: `sparse` admitted 0.12-0.13 of the ideal bucket,
    // against 0.29-0.31 at this bound and 0.28-0.30 at B / (3 typical).)
    let most = (rule.burst / rule.typical.max(1).saturating_mul(2)).max(1) as usize;
    let keep = sc.order.len().min(most);
    // The kept entries share the whole capacity in proportion to their slow demand
    // (no spare to "rejecting" ones: on a sparse key that flag flips with every
    // request, and so would the grants).
    for (j, &(_, i)) in sc.order.iter().enumerate() {
        let c = &mut sc.claims[i as usize];
        c.rejecting = false;
        if j >= keep {
            c.demand = 0.0;
        }
    }
    let fill = water_fill(rule.capacity() as f64, &sc.claims, reserve, &mut sc.shares);
    to_units(rule.capacity(), &sc.shares, &mut sc.units);
    let floor = match keep.checked_sub(1) {
        Some(last) if keep < sc.order.len() => sc.order[last].0,
        _ => 0.0,
    };
    (fill, floor)
}

/// The hysteresis band leaves a residue: grants held within the band of their targets
/// sum to more or less than the targets do (which, under overload, sum to the limit).
/// The entries that get a grant this round anyway (out of band, reachable) absorb it,
/// each within the band of its own target: growth only for rejecting entries and never
/// past their demand, so that under overload the grants keep summing to the limit
/// without a message to anyone else. (Left alone, the residue was ~0.5-1 % of the
/// limit unassigned under steady overload in the simulator's `zipf`, and when it was
/// positive every held entry above its target was shrunk exactly: a grant each.)
/// Returns the new sum of desired rates.
fn absorb_band_residue(
    entries: &[Entry],
    reachable: &[bool],
    h: u64,
    limit: u64,
    sum: u128,
    desired: &mut [Slice],
    room: &mut Vec<u64>,
) -> u128 {
    let limit = limit as u128;
    if sum == limit || h == 0 {
        return sum;
    }
    let grow = sum < limit;
    let residue = limit.abs_diff(sum);
    room.clear();
    let mut total = 0u128;
    for (i, e) in entries.iter().enumerate() {
        let d = desired[i];
        let moves = reachable[i] && d != e.current();
        let r = if !moves || d.rate == 0 {
            0
        } else if grow {
            if e.rejecting && e.demand.is_finite() {
                let to_demand = (e.demand as u64).saturating_sub(d.rate);
                (d.rate * h / 1000).min(to_demand)
            } else {
                0
            }
        } else {
            d.rate * h / 1000
        };
        total += r as u128;
        room.push(r);
    }
    if total == 0 {
        return sum;
    }
    let take = residue.min(total);
    let mut moved = 0u128;
    for (i, &r) in room.iter().enumerate() {
        if r == 0 {
            continue;
        }
        // Floor of the proportional part: the sum moved never exceeds `take`.
        let part = (r as u128 * take / total) as u64;
        let d = &mut desired[i];
        if grow {
            d.rate += part;
        } else {
            d.rate -= part;
        }
        moved += part as u128;
    }
    if grow { sum + moved } else { sum - moved }
}

/// Hysteresis (`h` permille) on the dimension being split, both ways: a grant within
/// the band of its target stays. (It used to let a rejecting agent's growth through
/// whatever its size; under overload every agent rejects, so every recomputation moved
/// every grant by a percent or two and shrank the others exactly to make room: ~50
/// grants per agent and key per second in the simulator's `steady`.)
fn with_hysteresis(rule: &RuleInfo, h: u64, target: Slice, e: &Entry) -> Slice {
    let cur = e.current();
    let (t, c) = if rule.concurrency {
        (target.burst, cur.burst)
    } else {
        (target.rate, cur.rate)
    };
    let in_band = t != 0 && c != 0 && t.abs_diff(c) * 1000 <= h * t.max(c);
    if in_band { cur } else { target }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    /// Runs due timers at `now`, checks invariants, returns the grants issued.
    fn settle(a: &mut Allocator, now: u64) -> Vec<Grant> {
        a.handle_timeout(now);
        a.check_invariants().unwrap();
        a.drain_grants().collect()
    }

    fn last_for(gs: &[Grant], agent: &str) -> Grant {
        for_agent(gs, agent)
            .last()
            .map(|g| (*g).clone())
            .expect("a grant for the agent")
    }

    fn for_agent<'a>(gs: &'a [Grant], agent: &str) -> Vec<&'a Grant> {
        gs.iter().filter(|g| &*g.agent == agent).collect()
    }

    /// Agent `agent` says hello and reports one key it rejects on (a cold key).
    fn join(a: &mut Allocator, at: u64, agent: &str, org: &str) {
        a.handle_hello(at, &hello(agent, 1, 10)).unwrap();
        a.handle_report(
            at,
            &report(agent, 1, 20, vec![line(key("rps", org), 0, 1, None)]),
        )
        .unwrap();
    }

    /// Agent `agent`'s hello asking for grants by handle.
    fn hello_by_handle(agent: &str, ts: u64) -> Hello {
        Hello {
            grants_by_handle: true,
            ..hello(agent, 1, ts)
        }
    }

    #[test]
    fn grants_name_a_key_once_per_stream_for_agents_that_find_keys_by_handle() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        let x = key("rps", "x");
        a.handle_hello(now, &hello_by_handle("h", 1)).unwrap();
        a.handle_hello(now, &hello("n", 1, 1)).unwrap();
        // Both report demand that moves every time, so each report brings a grant.
        let names = |a: &mut Allocator, t: u64, ts: u64, by_handle: u64| {
            let mut out = Vec::new();
            for (agent, demand) in [("h", 40 + ts), ("n", 60 + 2 * ts)] {
                let mut l = line(x.clone(), demand, 400, None);
                if agent == "h" {
                    l.key_handle = by_handle;
                }
                a.handle_report(t, &report(agent, 1, ts, vec![l])).unwrap();
            }
            for g in settle(a, t + 20 * MS) {
                out.push((g.agent.to_string(), g.named, g.key_handle));
            }
            out
        };
        let first = names(&mut a, now, 10, 0);
        let h = first.iter().find(|g| g.0 == "h").expect("h granted").2;
        assert!(
            first.iter().all(|g| g.1),
            "first grants are named: {first:?}"
        );
        // Later grants: by handle for `h`, always named for `n` (its hello did not ask).
        let mut later = Vec::new();
        for i in 1..4u64 {
            later.extend(names(&mut a, now + i * SEC, 10 + i, h));
        }
        assert!(later.iter().any(|g| g.0 == "h"), "{later:?}");
        assert!(later.iter().all(|g| g.1 == (g.0 == "n")), "{later:?}");
        // A report naming the key by name: `h` has no handle for it; named again.
        let again = names(&mut a, now + 5 * SEC, 20, 0);
        assert!(
            again.iter().filter(|g| g.0 == "h").all(|g| g.1),
            "{again:?}"
        );
        assert!(again.iter().any(|g| g.0 == "h"), "{again:?}");
        // Named once more after a hello (a new stream), and after grants went undelivered.
        a.handle_hello(now + 6 * SEC, &hello_by_handle("h", 30))
            .unwrap();
        let fresh = names(&mut a, now + 6 * SEC, 40, h);
        assert!(fresh.iter().any(|g| g.0 == "h"), "{fresh:?}");
        assert!(
            fresh.iter().filter(|g| g.0 == "h").all(|g| g.1),
            "{fresh:?}"
        );
        let told = names(&mut a, now + 7 * SEC, 41, h);
        assert!(told.iter().any(|g| g.0 == "h"), "{told:?}");
        assert!(told.iter().filter(|g| g.0 == "h").all(|g| !g.1), "{told:?}");
        a.grants_undelivered("h");
        let lost = names(&mut a, now + 8 * SEC, 42, h);
        assert!(lost.iter().any(|g| g.0 == "h"), "{lost:?}");
        assert!(lost.iter().filter(|g| g.0 == "h").all(|g| g.1), "{lost:?}");
    }

    #[test]
    fn an_entry_without_a_sample_for_a_lease_is_forgotten_whatever_its_estimate() {
        // Agents name a key only when it changes (and in full reports while they hold
        // a grant, or once after a change): a lease without a sample means the key went
        // quiet there. `a` takes the whole limit and does not acknowledge the shrink
        // that `b`'s demand asks for, so `b` has an estimate and no grant.
        let x = key("rps", "x");
        let (mut a, mut t, g) = granted_to_a(&rules(), quick_config(), &x, 900);
        let mut ts = 10 * MS;
        a.handle_report(t, &report("b", 1, ts, vec![line(x.clone(), 0, 3, None)]))
            .unwrap();
        settle(&mut a, t + 10 * MS);
        let b_of = |a: &Allocator| {
            a.key_status(&x)
                .unwrap()
                .agents
                .into_iter()
                .find(|s| &*s.agent == "b")
        };
        let b = b_of(&a).expect("b has an entry");
        assert!(b.demand > 0.0 && b.granted.is_zero(), "{b:?}");
        // `a` keeps naming the key (busy, holding, its demand moving, so the key is
        // recomputed: that is when entries are forgotten); `b` reports, naming nothing.
        let mut admitted = 0;
        for i in 0..6 {
            t += 250 * MS;
            ts += 250 * MS;
            admitted += if i % 2 == 0 { 100 } else { 300 };
            a.handle_report(
                t,
                &report(
                    "a",
                    1,
                    ts,
                    vec![line(x.clone(), admitted, 900, Some(g.held()))],
                ),
            )
            .unwrap();
            a.handle_report(t, &report("b", 1, ts + 1, vec![])).unwrap();
            settle(&mut a, t + 10 * MS);
        }
        assert!(
            b_of(&a).is_none(),
            "forgotten after a lease unnamed: {:?}",
            b_of(&a)
        );
        assert!(a.key_status(&x).is_some(), "a's entry stays");
    }

    #[test]
    fn a_key_no_agent_names_for_a_lease_is_forgotten_by_the_sweep() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        let y = key("rps", "y");
        a.handle_report(now, &report("a", 1, 10, vec![line(y.clone(), 0, 0, None)]))
            .unwrap();
        settle(&mut a, now + 10 * MS);
        assert!(a.key_status(&y).is_some());
        // Reports that name nothing: no line marks the key for recomputation.
        let mut t = now;
        for i in 1..=3 {
            t += 400 * MS;
            a.handle_report(t, &report("a", 1, 10 + i * 400 * MS, vec![]))
                .unwrap();
            settle(&mut a, t);
        }
        assert!(a.key_status(&y).is_none(), "gone {} ms on", (t - now) / MS);
    }

    #[test]
    fn the_invariant_check_catches_a_miscounted_or_misordered_grant_list() {
        let now = 10_000 * MS;
        let mut a = warm_allocator(1, now);
        join(&mut a, now, "a", "y");
        settle(&mut a, now + 10 * MS);
        let k = a.keys.iter().position(|k| k.is_some()).unwrap();
        let latest = {
            let e = &a.keys[k].as_ref().unwrap().entries[0];
            assert_eq!(e.nsent, 1, "one grant sent");
            e.last_sent().unwrap()
        };
        // One more counted than remembered.
        a.keys[k].as_mut().unwrap().entries[0].nsent += 1;
        let err = a.check_invariants().unwrap_err();
        assert!(err.contains("2 counted"), "{err}");
        // A remembered older grant newer than the latest: counted, but out of order.
        let e = &mut a.keys[k].as_mut().unwrap().entries[0];
        let newer = Sent {
            seq: latest.seq + 5,
            ..latest
        };
        e.older = Some(Box::new(smallvec::smallvec![newer]));
        let err = a.check_invariants().unwrap_err();
        assert!(err.contains("out of order"), "{err}");
    }

    #[test]
    fn a_grant_queued_by_handle_goes_named_once_the_agent_names_its_key_by_name() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello_by_handle("h", 1)).unwrap();
        let x = key("rps", "x");
        a.handle_report(now, &report("h", 1, 10, vec![line(x.clone(), 0, 5, None)]))
            .unwrap();
        a.handle_timeout(now + 10 * MS);
        let first: Vec<Grant> = a.drain_grants().collect();
        assert!(
            !first.is_empty() && first.iter().all(|g| g.named),
            "{first:?}"
        );
        let h = a.agent_id("h").unwrap();
        let k = *a.agent(h).entries.keys().next().unwrap();
        let pos = a.agent(h).entries[&k];
        let by_handle = |admitted: u64| {
            let mut l = line(x.clone(), admitted, 5, None);
            l.key_handle = first[0].key_handle;
            l
        };
        // A grant queued, the agent still naming the key by handle: it goes by handle.
        let half = |a: &Allocator| {
            let cur = a.key(k).entries[pos as usize].cur;
            Slice {
                rate: cur.rate / 2,
                burst: cur.burst / 2,
            }
        };
        let s = half(&a);
        a.issue(k, pos, s, 0);
        a.handle_report(now + SEC, &report("h", 1, 20 * MS, vec![by_handle(10)]))
            .unwrap();
        let kept: Vec<Grant> = a.drain_grants().collect();
        assert!(
            !kept.is_empty() && kept.iter().all(|g| !g.named),
            "{kept:?}"
        );
        // Queued again, then a line by name (the agent lost its handle) before the
        // outbox drains: the queued grant goes named, as does the next.
        let s = half(&a);
        a.issue(k, pos, s, 0);
        a.handle_report(
            now + 2 * SEC,
            &report("h", 1, 30 * MS, vec![line(x.clone(), 20, 5, None)]),
        )
        .unwrap();
        let queued: Vec<Grant> = a.drain_grants().collect();
        assert!(
            !queued.is_empty() && queued.iter().all(|g| g.named),
            "{queued:?}"
        );
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_key_name_is_told_once_per_stream_and_entry_even_when_stream_numbers_wrap() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello_by_handle("h", 1)).unwrap();
        let x = key("rps", "x");
        let mut ts = 10;
        let mut t = now;
        // Lines by the handle the first grant gave (a line by name says the agent has
        // none, and its next grant names the key again).
        let mut handle = 0;
        let mut grant = |a: &mut Allocator, admitted: u64| {
            ts += 250 * MS;
            t += SEC;
            let mut l = line(x.clone(), admitted, 5, None);
            l.key_handle = handle;
            a.handle_report(t, &report("h", 1, ts, vec![l])).unwrap();
            a.handle_timeout(t + 10 * MS);
            let g: Vec<Grant> = a.drain_grants().collect();
            a.check_invariants().unwrap();
            if let Some(first) = g.first() {
                handle = first.key_handle;
            }
            g
        };
        let first = grant(&mut a, 0);
        assert!(
            !first.is_empty() && first.iter().all(|g| g.named),
            "{first:?}"
        );
        let later = grant(&mut a, 900);
        assert!(
            !later.is_empty() && later.iter().all(|g| !g.named),
            "{later:?}"
        );
        // The stream numbers run out: every stamp is cleared, none can match again.
        let h = a.agent_id("h").unwrap();
        a.agent_mut(h).stream = u16::MAX;
        let k = *a.agent(h).entries.keys().next().unwrap();
        let pos = a.agent(h).entries[&k] as usize;
        a.key_mut(k).entries[pos].told = u16::MAX;
        a.check_invariants().unwrap();
        a.grants_undelivered("h");
        assert_eq!(a.agent(h).stream, 1);
        assert_eq!(a.key(k).entries[pos].told, 0);
        let wrapped = grant(&mut a, 2_000);
        assert!(
            !wrapped.is_empty() && wrapped.iter().all(|g| g.named),
            "{wrapped:?}"
        );
        // A stamp ahead of its agent's stream is caught.
        a.key_mut(k).entries[pos].told = 7;
        let err = a.check_invariants().unwrap_err();
        assert!(err.contains("told on stream 7"), "{err}");
        a.key_mut(k).entries[pos].told = 1;
        // An entry that goes takes its stamp; the key's next entry names it again.
        a.remove_entry(k, pos as u32);
        a.check_invariants().unwrap();
        let back = grant(&mut a, 3_000);
        assert!(!back.is_empty() && back.iter().all(|g| g.named), "{back:?}");
    }

    #[test]
    fn keys_changed_within_one_tick_are_recomputed_in_one_pass_within_the_delay() {
        let delay = quick_config().recompute_delay_ms * MS;
        let tick = delay / RECOMPUTE_TICKS_PER_DELAY;
        // Half a millisecond past a tick, so that the second change, a millisecond
        // later, falls in the same tick.
        let now = 5 * SEC + MS / 2;
        let mut a = warm_allocator(1, now);
        join(&mut a, now, "a", "x");
        let due = a.poll_timeout();
        join(&mut a, now + MS, "b", "y");
        assert_eq!(a.poll_timeout(), due, "one wake for both keys");
        assert_eq!(due % tick, 0, "on a tick");
        assert!(
            due >= now + MS + delay * 3 / 4 && due <= now + delay,
            "within 3/4 to 1 delay of both changes: due {} ns after the first",
            due - now
        );
        assert!(
            settle(&mut a, due - 1).is_empty(),
            "nothing before the tick"
        );
        let gs = settle(&mut a, due);
        assert_eq!(gs.len(), 2, "both keys in one pass: {gs:?}");
        // An acknowledged grant frees nothing here, but marks its key: due at the next
        // tick, not at once.
        let ga = last_for(&gs, "a");
        a.handle_ack(due + MS / 4, &ack(&ga, 1, 0)).unwrap();
        assert_eq!(a.poll_timeout(), due + tick, "at the next tick");
        assert!(settle(&mut a, due + MS / 4).is_empty());
    }

    #[test]
    fn a_pending_grant_is_forty_bytes() {
        assert_eq!(std::mem::size_of::<Pending>(), 40);
    }

    #[test]
    fn an_entrys_grants_keep_order_count_and_latest_through_merges_trims_and_terms() {
        let term = 7;
        let ext = Ext::default();
        let g = |epoch: u64, seq: u64, rate: u64| Sent {
            epoch,
            seq,
            slice: Slice { rate, burst: rate },
            fleet: seq as u32,
            expires_ns: 1_000 + seq,
        };
        let mut e = Entry::new(0);
        assert_eq!(e.sent().count(), 0);
        assert_eq!((e.nsent, e.term_seq), (0, NOT_TERM));
        // One grant: the latest, inline; no box.
        e.push_sent(g(term, 1, 100), ext, term);
        assert!(e.older.is_none());
        assert_eq!((e.nsent, e.term_seq, e.cur.rate), (1, 1, 100));
        // Shrinking grants past MAX_SENT: the oldest two merge into the newer's id with
        // the larger slice, the later expiry and the smaller fleet.
        let last = MAX_SENT as u64 + 2;
        for seq in 2..=last {
            e.push_sent(g(term, seq, 100 - seq), ext, term);
        }
        let v: Vec<Sent> = e.sent().collect();
        assert_eq!(v.len(), MAX_SENT);
        assert_eq!(e.nsent as usize, MAX_SENT);
        assert!(v.windows(2).all(|w| w[0].id() < w[1].id()));
        assert_eq!(v[0].seq, 3, "1 and 2 merged into 2, then 2 into 3");
        assert_eq!(v[0].slice.rate, 100, "the merged grants' largest slice");
        assert_eq!(v[0].expires_ns, 1_003);
        assert_eq!(v[0].fleet, 1);
        let l = e.last_sent().expect("a latest grant");
        assert_eq!((l.seq, e.term_seq, e.cur.rate), (last, last, 100 - last));
        // The latest applied: the older ones can no longer be in use, and the box goes.
        assert!(e.mark_applied((term, last), term));
        assert!(e.older.is_none());
        assert_eq!(e.sent().map(|s| s.seq).collect::<Vec<_>>(), vec![last]);
        // A grant learned from an earlier term as the latest: no seq of this term.
        e.edit_sent(term, |v| {
            v.clear();
            v.push(g(term - 1, 50, 5));
        });
        assert_eq!(e.term_seq, NOT_TERM);
        assert_eq!((e.cur_epoch, e.cur_seq, e.cur.rate), (term - 1, 50, 5));
        // Then one of this term on top of it: both kept, the newer is the latest.
        e.push_sent(g(term, 60, 6), ext, term);
        assert_eq!((e.nsent, e.term_seq), (2, 60));
        assert_eq!(e.older.as_ref().map(|o| o.len()), Some(1));
        // Cleared: everything about the latest grant back to zero.
        e.edit_sent(term, |v| v.clear());
        assert!(e.older.is_none());
        assert_eq!(
            (
                e.cur,
                e.cur_epoch,
                e.cur_seq,
                e.cur_fleet,
                e.cur_expires_ns,
                e.nsent
            ),
            (Slice::ZERO, 0, 0, 0, 0, 0)
        );
        assert_eq!(e.term_seq, NOT_TERM);
    }

    #[test]
    fn an_entry_is_three_lines_recomputation_reads_the_first_and_a_report_line_two() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<Entry>(), 192);
        assert_eq!(align_of::<Entry>(), 64);
        // Each field as (name, offset, size), on the line (0, 1 or 2) that holds it whole.
        macro_rules! field {
            ($f:ident, $t:ty) => {
                (stringify!($f), offset_of!(Entry, $f), size_of::<$t>())
            };
        }
        let on_line = |line: usize, fields: &[(&str, usize, usize)]| {
            for &(name, at, size) in fields {
                assert!(
                    at >= 64 * line && at + size <= 64 * (line + 1),
                    "{name} at bytes {at}..{} is not on line {line}",
                    at + size
                );
            }
        };
        // What every recomputation reads: the first line.
        on_line(
            0,
            &[
                field!(agent, u32),
                field!(sampled, Sampled),
                field!(demand, f64),
                field!(cur, Slice),
                field!(term_seq, u64),
                field!(base_ts, u64),
                field!(in_flight, u64),
                field!(demand_used, f64),
            ],
        );
        // What a report line reads besides: the second.
        on_line(
            1,
            &[
                field!(rejected_rate, f64),
                field!(demand_slow, f64),
                field!(base_admitted, u64),
                field!(base_rejected, u64),
                field!(since, u64),
                field!(applied, (u64, u64)),
            ],
        );
        // What a grant sent writes besides the first line: the third (with what an
        // entry's idleness reads there, `rare` and `commit`: a cold pass touches two).
        on_line(
            2,
            &[
                field!(cur_epoch, u64),
                field!(cur_seq, u64),
                field!(cur_expires_ns, u64),
                field!(cur_fleet, u32),
                field!(nsent, u8),
                field!(older, Option<Box<OlderSent>>),
                field!(rare, Option<Box<Rare>>),
                field!(commit, Slice),
            ],
        );
    }

    #[test]
    fn grants_queued_before_an_agent_restarts_keep_their_incarnation_and_seqs_run_on() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        join(&mut a, now, "a", "x");
        a.handle_timeout(now + 10 * MS);
        assert_eq!(a.pending_grants(), 1, "a's grant for x waits in the outbox");
        // a restarts before the shell drains: silent, then hello as incarnation 2,
        // and its new incarnation rejects on y.
        let t = now + 2 * SEC;
        a.handle_disconnect(t, "a").unwrap();
        a.handle_hello(t + 10 * MS, &hello("a", 2, 5 * SEC))
            .unwrap();
        a.handle_report(
            t + 10 * MS,
            &report("a", 2, 5 * SEC + 1, vec![line(key("rps", "y"), 0, 1, None)]),
        )
        .unwrap();
        a.handle_timeout(t + 20 * MS);
        a.check_invariants().unwrap();
        let gs: Vec<Grant> = a.drain_grants().collect();
        let seen: Vec<(u64, String, u64)> = gs
            .iter()
            .map(|g| (g.incarnation, g.key.to_string(), g.seq))
            .collect();
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert_eq!(
            (seen[0].0, seen[0].1.as_str()),
            (1, key("rps", "x").to_string().as_str()),
            "queued for the old incarnation: {seen:?}"
        );
        assert_eq!(
            (seen[1].0, seen[1].1.as_str()),
            (2, key("rps", "y").to_string().as_str()),
            "{seen:?}"
        );
        assert_eq!(seen[1].2, seen[0].2 + 1, "seqs are consecutive: {seen:?}");
        // The next drain starts where this one ended, with the new incarnation only.
        a.handle_report(
            t + 300 * MS,
            &report("a", 2, 5 * SEC + 2, vec![line(key("rps", "z"), 0, 1, None)]),
        )
        .unwrap();
        let more = settle(&mut a, t + 310 * MS);
        assert!(!more.is_empty());
        assert!(more.iter().all(|g| g.incarnation == 2 && g.seq > seen[1].2));
    }

    #[test]
    fn a_pending_grant_keeps_its_names_when_its_agent_and_key_go_before_the_drain() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        join(&mut a, now, "a", "x");
        settle(&mut a, now + 10 * MS);
        // b's grant for y waits in the outbox while b is forgotten and, a lease and
        // more later, the sweep removes y (no entry left).
        join(&mut a, now, "b", "y");
        a.handle_timeout(now + 10 * MS);
        assert_eq!(a.pending_grants(), 1);
        a.forget_agent(now + 20 * MS, "b").unwrap();
        a.check_invariants().unwrap();
        let later = now + 10 * SEC;
        a.handle_report(later, &report("a", 1, 10 * SEC, vec![]))
            .unwrap();
        a.handle_timeout(later);
        assert!(a.key_status(&key("rps", "y")).is_none(), "y was swept");
        a.check_invariants().unwrap();
        // New arrivals get fresh indices: the buried ones are not reused yet.
        join(&mut a, later, "c", "z");
        a.handle_timeout(later + 10 * MS);
        a.check_invariants().unwrap();
        assert_eq!(a.agents.len(), 3, "a, b (buried), c");
        let gs: Vec<Grant> = a.drain_grants().collect();
        let named: Vec<(&str, String)> =
            gs.iter().map(|g| (&*g.agent, g.key.to_string())).collect();
        assert_eq!(named[0], ("b", key("rps", "y").to_string()), "{named:?}");
        assert!(
            named.contains(&("c", key("rps", "z").to_string())),
            "{named:?}"
        );
        // After the drain the indices are free again, and reused.
        a.check_invariants().unwrap();
        join(&mut a, later, "d", "w");
        a.handle_timeout(later + 20 * MS);
        a.check_invariants().unwrap();
        let gs = settle(&mut a, later + 30 * MS);
        assert!(gs.iter().all(|g| &*g.agent != "b"));
        assert_eq!(a.agents.iter().flatten().count(), 3, "a, c, d");
        assert_eq!(a.agents.len(), 3, "d took b's index");
    }

    #[test]
    fn a_small_outbox_allocates_in_rounds_and_never_starves_a_key_wider_than_it() {
        // max_outbox 2, a key on three agents (wider than the outbox) and two keys on
        // one agent each: every key is allocated, a round at a time, the outbox holding
        // one key's grants past its bound at most.
        let now = 5 * SEC;
        let cfg = AllocatorConfig {
            max_outbox: 2,
            ..quick_config()
        };
        let mut a = warm_allocator_with(&rules(), cfg, 1, now);
        for (agent, orgs) in [
            ("a", &["wide", "p"][..]),
            ("b", &["wide", "q"]),
            ("c", &["wide"]),
        ] {
            a.handle_hello(now, &hello(agent, 1, 10)).unwrap();
            let lines = orgs
                .iter()
                .map(|o| line(key("rps", o), 0, 5, None))
                .collect();
            a.handle_report(now, &report(agent, 1, 20, lines)).unwrap();
        }
        let mut granted: Vec<(String, String)> = Vec::new();
        let mut rounds = 0;
        let mut t = now;
        a.reallocate_all(t);
        loop {
            assert!(a.pending_grants() <= 3, "{} queued", a.pending_grants());
            let gs: Vec<Grant> = a.drain_grants().collect();
            a.check_invariants().unwrap();
            granted.extend(gs.iter().map(|g| (g.agent.to_string(), g.key.to_string())));
            if a.poll_timeout() > t {
                break;
            }
            rounds += 1;
            assert!(rounds < 20, "the rounds must end");
            t += MS;
            a.handle_timeout(t);
        }
        assert!(
            rounds >= 1,
            "two slots of outbox take more than one round: {rounds}"
        );
        for (agent, org) in [
            ("a", "wide"),
            ("b", "wide"),
            ("c", "wide"),
            ("a", "p"),
            ("b", "q"),
        ] {
            assert!(
                granted.contains(&(agent.to_string(), key("rps", org).to_string())),
                "{agent} got nothing for {org}: {granted:?}"
            );
        }
    }

    #[test]
    fn a_cold_key_gets_a_first_grant_from_one_out_of_band_report() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        join(&mut a, now, "a", "x");
        assert!(a.poll_timeout() <= now + 10 * MS);
        let gs = settle(&mut a, now + 10 * MS);
        assert_eq!(gs.len(), 1);
        let g = &gs[0];
        assert_eq!((g.epoch, &*g.agent), (1, "a"));
        // Spare goes to the rejecting agent (no reserve kept free by default).
        assert!(g.rate >= 990 && g.rate <= 1000, "{g:?}");
        assert!(g.burst >= 990 && g.burst <= 1000, "{g:?}");

        // With a reserve, part of the rate stays free, and the burst goes by the
        // square root of the rate, the unassigned rate keeping its share free:
        // B * sqrt(r) / (sqrt(r) + sqrt(R - r)).
        let cfg = AllocatorConfig {
            spare_reserve_permille: 250,
            ..quick_config()
        };
        let mut a = warm_allocator_with(&rules(), cfg, 1, now);
        join(&mut a, now, "a", "x");
        let gs = settle(&mut a, now + 10 * MS);
        let g = &gs[0];
        assert!(g.rate >= 700 && g.rate <= 800, "{g:?}");
        let r = g.rate as f64;
        let expect = 1000.0 * r.sqrt() / (r.sqrt() + (1000.0 - r).sqrt());
        assert_eq!(g.burst, expect as u64, "{g:?}");
        assert!(g.burst < 1000, "part of the burst stays free for newcomers");
        assert_eq!(g.fleet_size, 1);
        assert_eq!(
            g.transfer_tokens, 100,
            "a new key's first grant carries R x reclaim_margin_ms (100 ms of 1,000 a second)"
        );
    }

    #[test]
    fn a_new_key_starts_with_what_the_bucket_refilled_in_a_margin_but_not_while_learning() {
        let now = 5 * SEC;
        // Past learning: R x reclaim_margin_ms, at most B.
        let mut a = warm_allocator(1, now);
        join(&mut a, now, "a", "x");
        assert_eq!(a.key_status(&key("rps", "x")).unwrap().transfer_pool, 100);
        a.check_invariants().unwrap();
        let cfg = AllocatorConfig {
            reclaim_margin_ms: 3_000,
            ..quick_config()
        };
        let mut a = warm_allocator_with(&rules(), cfg, 1, now);
        join(&mut a, now, "a", "y");
        let st = a.key_status(&key("rps", "y")).unwrap();
        assert_eq!(st.transfer_pool, 1_000, "capped at B");
        // Concurrency rules hold slots, not tokens.
        join(&mut a, now, "b", "z");
        a.handle_report(
            now + MS,
            &report("b", 1, 30, vec![line(key("conc", "z"), 0, 1, None)]),
        )
        .unwrap();
        assert_eq!(a.key_status(&key("conc", "z")).unwrap().transfer_pool, 0);
        // While learning, holdings are not all known: nothing.
        let mut a = Allocator::new(&rules(), quick_config(), 2, now).unwrap();
        a.handle_timeout(now);
        join(&mut a, now, "a", "x");
        assert_eq!(a.key_status(&key("rps", "x")).unwrap().transfer_pool, 0);
    }

    #[test]
    fn rates_are_granted_out_of_the_limit_less_the_clock_drift_allowance() {
        let now = 5 * SEC;
        let cfg = AllocatorConfig {
            clock_drift_ppm: 50_000,
            ..quick_config()
        };
        let mut a = warm_allocator_with(&rules(), cfg, 1, now);
        join(&mut a, now, "a", "x");
        let st = a.key_status(&key("rps", "x")).unwrap();
        // 1,000 / 1.05, rounded down: a clock 5 % fast refills at most 1,000 a second.
        assert_eq!(st.rate_capacity, 952);
        let gs = settle(&mut a, now + 10 * MS);
        assert!(gs.iter().all(|g| g.rate <= 952), "{gs:?}");
        assert_eq!(
            st.bound.overdraft_rate, 0,
            "the allowance is not an overdraft"
        );
        let bad = AllocatorConfig {
            clock_drift_ppm: 100_001,
            ..quick_config()
        };
        assert_eq!(bad.validate().unwrap_err().field, "clock_drift_ppm");
    }

    #[test]
    fn grants_echo_the_agents_report_time_plus_lease_minus_drift() {
        let now = 5 * SEC;
        let mut a = warm_allocator(7, now);
        a.handle_hello(now, &hello("a", 1, 123)).unwrap();
        let agent_time = 987_654_321;
        a.handle_report(
            now + 3 * MS,
            &report("a", 1, agent_time, vec![line(key("rps", "x"), 0, 5, None)]),
        )
        .unwrap();
        let gs = settle(&mut a, now + 20 * MS);
        let cfg = quick_config();
        assert_eq!(
            gs[0].lease_expires_at_ns,
            agent_time + cfg.lease_ms * MS - cfg.drift_margin_ms * MS
        );
        assert_eq!(gs[0].epoch, 7);
        let update = gs[0].to_slice_update();
        assert_eq!(update.rule, "rps");
        assert_eq!(update.values, vec!["x".to_string()]);
        assert_eq!(
            (
                update.rate,
                update.burst,
                update.seq,
                update.lease_expires_at_ns
            ),
            (
                gs[0].rate,
                gs[0].burst,
                gs[0].seq,
                gs[0].lease_expires_at_ns
            )
        );
    }

    #[test]
    fn many_agents_reporting_a_new_key_at_once_split_the_free_budget() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            a.handle_hello(now, &hello(id, 1, 1)).unwrap();
            a.handle_report(
                now + i as u64 * MS,
                &report(id, 1, 2, vec![line(key("rps", "fan"), 0, 1, None)]),
            )
            .unwrap();
        }
        let gs = settle(&mut a, now + 20 * MS);
        assert_eq!(gs.len(), 4);
        let rates: Vec<u64> = gs.iter().map(|g| g.rate).collect();
        assert!(
            rates.iter().all(|&r| r == rates[0]),
            "equal split: {rates:?}"
        );
        assert!(rates.iter().sum::<u64>() <= 1000);
        assert!(rates[0] >= 180, "{rates:?}");
    }

    /// One agent, `a`, reporting demand on `rps{x}` at 5 s, and the one grant that
    /// answers it (issued, drained, not yet delivered).
    fn first_grant() -> (Allocator, u64, KeyName, Grant) {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        let k = key("rps", "x");
        a.handle_report(
            now,
            &report("a", 1, now, vec![line(k.clone(), 100, 0, None)]),
        )
        .unwrap();
        let mut gs = settle(&mut a, now + 10 * MS);
        assert_eq!(gs.len(), 1);
        (a, now, k, gs.pop().unwrap())
    }

    /// Agent `a` holds most of the key; demand moves to `b`.
    fn shifted() -> (Allocator, u64, Grant) {
        let mut now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        a.handle_hello(now, &hello("b", 1, 1)).unwrap();
        a.handle_report(
            now,
            &report("a", 1, 2, vec![line(key("rps", "x"), 0, 900, None)]),
        )
        .unwrap();
        let gs = settle(&mut a, now + 20 * MS);
        let ga = gs[0].clone();
        a.handle_ack(now + 21 * MS, &ack(&ga, 1, 0)).unwrap();
        assert!(settle(&mut a, now + 21 * MS).is_empty());
        // Demand moves: a is idle, b rejects heavily.
        now += SEC;
        a.handle_report(
            now,
            &report(
                "a",
                1,
                SEC,
                vec![line(key("rps", "x"), 0, 900, Some(ga.held()))],
            ),
        )
        .unwrap();
        a.handle_report(
            now,
            &report("b", 1, SEC, vec![line(key("rps", "x"), 0, 2000, None)]),
        )
        .unwrap();
        (a, now, ga)
    }

    /// Agent `a` holds all of key `rps/x` (demand ~3,600 a second), acknowledged; `b`
    /// and `c` are registered. Returns the allocator, the time, and a's grant.
    fn held_by_a() -> (Allocator, u64, Grant) {
        held_by_a_with(&rules(), quick_config(), key("rps", "x"))
    }

    /// [`held_by_a`] under other rules and settings, for key `k`.
    fn held_by_a_with(rules: &Config, cfg: AllocatorConfig, k: KeyName) -> (Allocator, u64, Grant) {
        let (a, now, ga) = granted_to_a(rules, cfg, &k, 900);
        let status = a.key_status(&k).unwrap();
        assert_eq!(
            status.committed.rate, status.rate_capacity,
            "a holds the whole key"
        );
        (a, now, ga)
    }

    /// Agents `a`, `b` and `c` registered; `a` reported `rejected` units over its first
    /// sample (read over 250 ms) of key `k` and acknowledged the grant it got. Returns
    /// the allocator, a time just after, and a's grant.
    fn granted_to_a(
        rules: &Config,
        cfg: AllocatorConfig,
        k: &KeyName,
        rejected: u64,
    ) -> (Allocator, u64, Grant) {
        let now = 5 * SEC;
        let mut a = warm_allocator_with(rules, cfg, 1, now);
        for agent in ["a", "b", "c"] {
            a.handle_hello(now, &hello(agent, 1, 1)).unwrap();
        }
        a.handle_report(
            now,
            &report("a", 1, 2, vec![line(k.clone(), 0, rejected, None)]),
        )
        .unwrap();
        let ga = last_for(&settle(&mut a, now + 20 * MS), "a");
        a.handle_ack(now + 21 * MS, &ack(&ga, 1, 0)).unwrap();
        settle(&mut a, now + 21 * MS);
        (a, now + 30 * MS, ga)
    }

    fn demand_of(a: &Allocator, agent: &str) -> f64 {
        let k = a.key_status(&key("rps", "x")).unwrap();
        k.agents.iter().find(|s| &*s.agent == agent).unwrap().demand
    }

    fn measured(agent: &str, t: u64, admitted: u64, measure: Measure, ga: &Grant) -> Report {
        measured_with(agent, t, admitted, 900, measure, ga)
    }

    /// A report of key `rps/x` by `agent` at `t`, holding `ga`, marked `measure`.
    fn measured_with(
        agent: &str,
        t: u64,
        admitted: u64,
        rejected: u64,
        measure: Measure,
        ga: &Grant,
    ) -> Report {
        Report {
            measure,
            ..report(
                agent,
                1,
                t,
                vec![line(key("rps", "x"), admitted, rejected, Some(ga.held()))],
            )
        }
    }

    /// Review, thirty-first session: seqs are one counter for every entry, and an ack
    /// (or a report's held grant) was refused only past the counter, so an agent that
    /// named another entry's newer seq on this key released this key's whole
    /// commitment while it kept using its grant: the budget went to others twice
    /// over. An id past the latest grant sent to the entry is now ignored.
    #[test]
    fn an_ack_naming_another_entrys_seq_releases_nothing() {
        let (mut a, now, ga) = held_by_a();
        a.handle_report(
            now,
            &report("c", 1, 3, vec![line(key("rps", "y"), 0, 500, None)]),
        )
        .unwrap();
        let gc = last_for(&settle(&mut a, now + 20 * MS), "c");
        assert!(gc.seq > ga.seq);
        let committed = |a: &Allocator| {
            let st = a.key_status(&key("rps", "x")).unwrap();
            st.agents
                .iter()
                .find(|s| &*s.agent == "a")
                .unwrap()
                .committed
        };
        let held = committed(&a);
        assert!(held.rate > 0);
        // By ack, then by a report line claiming to hold that seq on x.
        let mut bogus = ack(&ga, 1, 0);
        bogus.slices[0].seq = gc.seq;
        let _ = a.handle_ack(now + 25 * MS, &bogus);
        assert_eq!(committed(&a), held, "an ack of another entry's seq");
        let mut h = ga.held();
        h.seq = gc.seq;
        let _ = a.handle_report(
            now + 30 * MS,
            &report("a", 1, 4, vec![line(key("rps", "x"), 100, 0, Some(h))]),
        );
        assert_eq!(
            committed(&a),
            held,
            "a held line naming another entry's seq"
        );
        // b's surge cannot take what a still holds.
        a.handle_report(
            now + 40 * MS,
            &report("b", 1, 2, vec![line(key("rps", "x"), 0, 2_000, None)]),
        )
        .unwrap();
        settle(&mut a, now + 60 * MS);
        let st = a.key_status(&key("rps", "x")).unwrap();
        assert!(
            st.committed.rate <= st.rate_capacity,
            "{:?} over {}",
            st.committed,
            st.rate_capacity
        );
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_surge_on_a_full_key_asks_its_holders_to_measure_and_an_empty_window_frees_theirs() {
        let (mut a, now, ga) = held_by_a();
        // b starts rejecting: nothing is free, so a (the holder) is asked to measure,
        // over the configured floor (a's ~3,600 requests a second need far less).
        a.handle_report(
            now,
            &report("b", 1, 2, vec![line(key("rps", "x"), 0, 50, None)]),
        )
        .unwrap();
        let asked = a.drain_measure_requests();
        assert_eq!(asked.len(), 1);
        assert_eq!(&*asked[0].agent, "a");
        assert_eq!(asked[0].incarnation, 1);
        assert_eq!(asked[0].key_handles, vec![ga.key_handle]);
        assert_eq!(asked[0].window_ms, 100);
        // At most once per `min_sample_ms` per key: c's surge 100 ms later asks nothing.
        a.handle_report(
            now + 100 * MS,
            &report("c", 1, 2, vec![line(key("rps", "x"), 0, 50, None)]),
        )
        .unwrap();
        assert_eq!(a.pending_measure_requests(), 0);

        // a answers: the start is a base, not a sample; a regular report 30 ms later is
        // short and keeps it (read over 250 ms, its empty 30 ms would look like a drop).
        let before = demand_of(&a, "a");
        let t = 300 * MS;
        a.handle_report(now + 5 * MS, &measured("a", t, 0, Measure::Start, &ga))
            .unwrap();
        assert_eq!(demand_of(&a, "a"), before);
        a.handle_report(
            now + 35 * MS,
            &measured("a", t + 30 * MS, 0, Measure::None, &ga),
        )
        .unwrap();
        assert_eq!(
            demand_of(&a, "a"),
            before,
            "a short report after a start is kept"
        );
        // The end: nothing came in 100 ms where ~360 requests were expected.
        a.handle_report(
            now + 105 * MS,
            &measured("a", t + 100 * MS, 0, Measure::End, &ga),
        )
        .unwrap();
        assert_eq!(
            demand_of(&a, "a"),
            0.0,
            "an empty window drops the estimate"
        );
        // a's grant shrinks at the next recomputation.
        let gs = settle(&mut a, now + 120 * MS);
        assert!(last_for(&gs, "a").rate < ga.rate);
    }

    /// Agent `a` holds key `rps/x` asking `rejected` requests over its first sample
    /// (read over 250 ms), then `b` surges and `a` is asked to measure; returns the
    /// allocator, the time, `a`'s grant and the window it was asked for.
    fn measuring_a(cfg: AllocatorConfig, rejected: u64) -> (Allocator, u64, Grant, u32) {
        let k = key("rps", "x");
        let (mut a, now, ga) = granted_to_a(&rules(), cfg, &k, rejected);
        a.handle_report(now, &report("b", 1, 2, vec![line(k, 0, 900, None)]))
            .unwrap();
        let asked = a.drain_measure_requests();
        assert_eq!(asked.len(), 1, "a is asked to measure");
        (a, now, ga, asked[0].window_ms)
    }

    /// `a` measures over `window_ms` and nothing comes (its counters stay where they
    /// were: 0 admitted, `rejected` rejected).
    fn a_measures(a: &mut Allocator, now: u64, ga: &Grant, rejected: u64, window_ms: u64) {
        let t = 300 * MS;
        let start = measured_with("a", t, 0, rejected, Measure::Start, ga);
        a.handle_report(now + 5 * MS, &start).unwrap();
        let end = measured_with("a", t + window_ms * MS, 0, rejected, Measure::End, ga);
        a.handle_report(now + 5 * MS + window_ms * MS, &end)
            .unwrap();
    }

    #[test]
    fn an_empty_window_drops_a_small_holder_and_one_judged_a_little_short() {
        // a asks ~150 requests a second, under the jump floor (20 % of the limit of
        // 1,000): a 100 ms window that should have held 15 and held none still means its
        // demand left (with the floor, it was kept for a half-life).
        let (mut a, now, ga, window) = measuring_a(quick_config(), 37);
        let before = demand_of(&a, "a");
        assert!(before > 100.0 && before < 200.0, "{before}");
        assert_eq!(window, 100);
        a_measures(&mut a, now, &ga, 37, 100);
        assert_eq!(
            demand_of(&a, "a"),
            0.0,
            "an empty window drops a small holder"
        );

        // A window sized for five requests at the request, judged at its end over a
        // little less (4.5 expected): empty, it drops the estimate too (at five it was
        // kept whenever the estimate had slipped a fraction of a percent).
        let short = AllocatorConfig {
            measure_window_ms: 10,
            ..quick_config()
        };
        let (mut a, now, ga, window) = measuring_a(short, 63);
        let before = demand_of(&a, "a");
        assert!(before > 200.0, "{before}");
        assert!(
            (window as f64 - 5_000.0 / before).abs() < 1.0,
            "{window} ms for five"
        );
        let judged = (window as f64 * 0.9).floor() as u64;
        assert!(
            before * judged as f64 / 1_000.0 >= 4.0,
            "{before} over {judged} ms"
        );
        a_measures(&mut a, now, &ga, 63, judged);
        assert_eq!(demand_of(&a, "a"), 0.0, "{before} over {judged} ms");
    }

    #[test]
    fn demand_arriving_without_a_grant_may_start_a_round_after_a_holders_surge() {
        let now = 5 * SEC;
        let mut a = warm_allocator_with(&rules(), quick_config(), 1, now);
        let k = key("rps", "x");
        for agent in ["a", "b", "c", "d"] {
            a.handle_hello(now, &hello(agent, 1, 1)).unwrap();
        }
        // a and b both want far more than the limit: each holds half.
        for agent in ["a", "b"] {
            a.handle_report(
                now,
                &report(agent, 1, 2, vec![line(k.clone(), 0, 900, None)]),
            )
            .unwrap();
        }
        let gs = settle(&mut a, now + 20 * MS);
        let (ga, gb) = (last_for(&gs, "a"), last_for(&gs, "b"));
        a.handle_ack(now + 21 * MS, &ack(&ga, 1, 0)).unwrap();
        a.handle_ack(now + 21 * MS, &ack(&gb, 1, 0)).unwrap();
        settle(&mut a, now + 21 * MS);
        a.drain_measure_requests();
        // A holder's surge (a's demand jumps tenfold) asks the other holder.
        a.handle_report(
            now + 300 * MS,
            &report(
                "a",
                1,
                300 * MS,
                vec![line(k.clone(), 0, 10_900, Some(ga.held()))],
            ),
        )
        .unwrap();
        let asked: Vec<_> = a.drain_measure_requests();
        assert_eq!(asked.len(), 1);
        assert_eq!(&*asked[0].agent, "b");
        // 50 ms later demand arrives at c, which holds nothing: a round of its own,
        // asking both holders (with the old rule, nothing until `min_sample_ms`).
        a.handle_report(
            now + 350 * MS,
            &report("c", 1, 2, vec![line(k.clone(), 0, 50, None)]),
        )
        .unwrap();
        let mut asked: Vec<_> = a
            .drain_measure_requests()
            .into_iter()
            .map(|m| m.agent.to_string())
            .collect();
        asked.sort();
        assert_eq!(asked, ["a", "b"]);
        // That round stands for `min_sample_ms`, for everyone: d asks nothing.
        a.handle_report(
            now + 400 * MS,
            &report("d", 1, 2, vec![line(k, 0, 50, None)]),
        )
        .unwrap();
        assert_eq!(a.pending_measure_requests(), 0);
    }

    #[test]
    fn a_window_with_requests_in_it_only_nudges_the_estimate() {
        let (mut a, now, ga) = held_by_a();
        let before = demand_of(&a, "a");
        let t = 300 * MS;
        a.handle_report(now + 5 * MS, &measured("a", t, 0, Measure::Start, &ga))
            .unwrap();
        // One request in the window: far below the estimate, but not nothing. A quiet
        // spell is not a move; it is folded in as a sample of its own length.
        a.handle_report(
            now + 105 * MS,
            &measured("a", t + 100 * MS, 1, Measure::End, &ga),
        )
        .unwrap();
        let after = demand_of(&a, "a");
        assert!(
            after < before && after > before / 2.0,
            "{before} -> {after}"
        );
    }

    #[test]
    fn holders_of_a_rule_with_no_typical_request_size_are_never_asked_to_measure() {
        // `input_tokens` without `typical_cost`: an empty 100 ms window could be one
        // large request's gap, so it proves nothing and nobody is asked.
        let tpm = Config::from_toml(
            r#"
            [engine]
            slice_source = "allocated"
            [[rule]]
            name = "tpm"
            match = { org = "*" }
            dimension = "input_tokens"
            rate = 1000
            per = "second"
            burst = 1000
            "#,
        )
        .unwrap();
        let surge = |rule: &str| report("b", 1, 2, vec![line(key(rule, "x"), 0, 900, None)]);
        let (mut a, now, _) = held_by_a_with(&tpm, quick_config(), key("tpm", "x"));
        a.handle_report(now, &surge("tpm")).unwrap();
        assert_eq!(a.pending_measure_requests(), 0);
        // Nor when measuring is off.
        let off = AllocatorConfig {
            measure_window_ms: 0,
            ..quick_config()
        };
        let (mut a, now, _) = held_by_a_with(&rules(), off, key("rps", "x"));
        a.handle_report(now, &surge("rps")).unwrap();
        assert_eq!(a.pending_measure_requests(), 0);
        // On, the same surge asks: the two above are not vacuous.
        let (mut a, now, _) = held_by_a();
        a.handle_report(now, &surge("rps")).unwrap();
        assert_eq!(a.pending_measure_requests(), 1);
    }

    #[test]
    fn an_agent_reporting_more_often_than_the_minimum_sample_is_read_at_its_rate() {
        // Agents admitting 400 units a second each, reporting every 125 ms (half of
        // `min_sample_ms`): one says so in its hello, one does not. Samples are read over
        // at least the minimum sample or the declared interval, the shorter: the silent
        // one's 125 ms samples are read over 250 ms, i.e. as 200 a second.
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        let declared = Hello {
            report_interval_ms: 125,
            ..hello("a", 1, 0)
        };
        a.handle_hello(now, &declared).unwrap();
        a.handle_hello(now, &hello("b", 1, 0)).unwrap();
        let step = 125 * MS;
        let mut admitted = 0;
        for i in 1..=40u64 {
            admitted += 50;
            let t = i * step;
            for (agent, org) in [("a", "x"), ("b", "y")] {
                a.handle_report(
                    now + t,
                    &report(agent, 1, t, vec![line(key("rps", org), admitted, 0, None)]),
                )
                .unwrap();
            }
            settle(&mut a, now + t);
        }
        let demand = |org: &str| a.key_status(&key("rps", org)).unwrap().demand;
        assert!(
            (380.0..=420.0).contains(&demand("x")),
            "estimate {}, offered 400 a second",
            demand("x")
        );
        assert!(
            (190.0..=210.0).contains(&demand("y")),
            "estimate {} without a declared interval",
            demand("y")
        );
    }

    #[test]
    fn a_shrink_is_applied_before_growth_is_granted() {
        let (mut a, now, ga) = shifted();
        let gs = settle(&mut a, now + 20 * MS);
        let to_a = last_for(&gs, "a");
        let to_b = for_agent(&gs, "b");
        assert!(to_a.rate < ga.rate, "a is shrunk");
        let st = a.key_status(&key("rps", "x")).unwrap();
        // Until a acknowledges, b gets only what a's old grant leaves free.
        let b_rate: u64 = to_b.iter().map(|g| g.rate).sum();
        assert!(
            b_rate <= 1000 - ga.rate,
            "b {b_rate} vs a's old {}",
            ga.rate
        );
        assert_eq!(st.committed.rate, ga.rate + b_rate);
        // The ack frees a's old grant at once; b grows.
        a.handle_ack(now + 30 * MS, &ack(&to_a, 1, 0)).unwrap();
        let gs = settle(&mut a, now + 30 * MS);
        let grown = for_agent(&gs, "b");
        assert_eq!(grown.len(), 1);
        assert!(grown[0].rate > b_rate);
        assert!(grown[0].rate + to_a.rate <= 1000);
    }

    #[test]
    fn an_ack_may_name_its_key_by_the_handle_its_grant_carried() {
        let (mut a, now, ga) = shifted();
        let gs = settle(&mut a, now + 20 * MS);
        let to_a = last_for(&gs, "a");
        assert!(to_a.rate < ga.rate, "a is shrunk");
        let committed = |a: &Allocator| a.key_status(&key("rps", "x")).unwrap().committed.rate;
        let before = committed(&a);
        // A stale handle (another generation of the index) acknowledges nothing.
        let mut stale = ack(&to_a, 1, 0);
        stale.slices[0].key = KeyName::default();
        stale.slices[0].key_handle = to_a.key_handle + (1 << 32);
        a.handle_ack(now + 25 * MS, &stale).unwrap();
        assert_eq!(committed(&a), before);
        // By the grant's handle alone: the shrink counts as applied, a's old grant stops
        // counting.
        let mut by_handle = ack(&to_a, 1, 0);
        by_handle.slices[0].key = KeyName::default();
        by_handle.slices[0].key_handle = to_a.key_handle;
        a.handle_ack(now + 30 * MS, &by_handle).unwrap();
        a.check_invariants().unwrap();
        assert_eq!(committed(&a), before - (ga.rate - to_a.rate));
    }

    #[test]
    fn an_unacknowledged_shrink_frees_nothing_until_its_lease_ends_plus_the_margin() {
        let (mut a, now, ga) = shifted();
        let gs = settle(&mut a, now + 20 * MS);
        let shrink = last_for(&gs, "a");
        // The ack is lost and a goes silent; b keeps reporting.
        let cfg = quick_config();
        let hold = (cfg.lease_ms + cfg.reclaim_margin_ms) * MS;
        let mut t = now + 20 * MS;
        let mut b_time = SEC;
        while t < now + hold - 50 * MS {
            t += 250 * MS;
            b_time += 250 * MS;
            a.handle_report(
                t,
                &report("b", 1, b_time, vec![line(key("rps", "x"), 0, 2000, None)]),
            )
            .unwrap();
            settle(&mut a, t + 10 * MS);
            let st = a.key_status(&key("rps", "x")).unwrap();
            let a_commit = st
                .agents
                .iter()
                .find(|s| &*s.agent == "a")
                .unwrap()
                .committed;
            if t + 10 * MS < now + hold {
                assert_eq!(a_commit.rate, ga.rate, "old grant counts until it expires");
            }
        }
        // Past a's lease (by the allocator's clock) plus the margin, it is reclaimed.
        let late = now + hold + SEC;
        a.handle_report(
            late,
            &report(
                "b",
                1,
                b_time + SEC,
                vec![line(key("rps", "x"), 0, 2000, None)],
            ),
        )
        .unwrap();
        settle(&mut a, late);
        settle(&mut a, late + 20 * MS);
        let st = a.key_status(&key("rps", "x")).unwrap();
        let sa = st.agents.iter().find(|s| &*s.agent == "a").unwrap();
        assert_eq!(sa.committed, Slice::ZERO);
        // Conservative posture: a may keep min(last grant, R/N) (N = 2 here).
        let fb = sa.fallback.unwrap();
        // N is the fleet size in the grant the agent may hold (ga was issued when a was
        // alone on the key).
        assert_eq!(shrink.fleet_size, 2);
        assert_eq!(
            fb.rate,
            ga.rate
                .min(1000 / ga.fleet_size as u64)
                .max(shrink.rate.min(500))
        );
        assert_eq!(st.bound.rate, fb.rate);
        assert_eq!(st.bound.partitioned_agents, 1);
    }

    #[test]
    fn the_bound_follows_each_posture() {
        for (rule, expect) in [("strict-rps", 0u64), ("open-rps", 1), ("rps", 2)] {
            let now = 5 * SEC;
            let mut a = warm_allocator(1, now);
            for id in ["a", "b"] {
                a.handle_hello(now, &hello(id, 1, 1)).unwrap();
                a.handle_report(
                    now,
                    &report(id, 1, 2, vec![line(key(rule, "x"), 0, 900, None)]),
                )
                .unwrap();
            }
            let gs = settle(&mut a, now + 20 * MS);
            let ga = last_for(&gs, "a");
            assert_eq!(
                a.overshoot_bound(&key(rule, "x")).unwrap().rate,
                0,
                "no partition"
            );
            // a is partitioned; b keeps reporting.
            let mut t = now;
            let mut bt = 2;
            let mut rejected = 900;
            let mut held = Some(last_for(&gs, "b").held());
            while t < now + 3 * SEC {
                t += 250 * MS;
                bt += 250 * MS;
                rejected += 900; // b's demand stays as high as a's was
                let l = line(key(rule, "x"), 0, rejected, held);
                a.handle_report(t, &report("b", 1, bt, vec![l])).unwrap();
                if let Some(g) = for_agent(&settle(&mut a, t + 10 * MS), "b").last() {
                    held = Some(g.held());
                }
            }
            let b = a.overshoot_bound(&key(rule, "x")).unwrap();
            match expect {
                0 => assert_eq!(b.rate + b.burst, 0, "strict: {b:?}"),
                1 => assert_eq!((b.rate, b.burst), (ga.rate, ga.burst), "open"),
                _ => assert_eq!(
                    (b.rate, b.burst),
                    (ga.rate.min(1000 / 2), ga.burst.min(1000 / 2)),
                    "conservative"
                ),
            }
            assert_eq!(b.excess_over(SEC), (b.burst + b.rate) as u128);
        }
    }

    #[test]
    fn released_tokens_are_handed_to_the_agent_that_grows() {
        let (mut a, now, _) = shifted();
        let gs = settle(&mut a, now + 20 * MS);
        let shrink = last_for(&gs, "a");
        a.handle_ack(now + 30 * MS, &ack(&shrink, 1, 400)).unwrap();
        let gs = settle(&mut a, now + 30 * MS);
        let grow = for_agent(&gs, "b")[0];
        assert!(
            grow.transfer_tokens > 0 && grow.transfer_tokens <= 400,
            "{grow:?}"
        );
        let st = a.key_status(&key("rps", "x")).unwrap();
        assert!(st.transfer_pool + grow.transfer_tokens <= 400);
        // A duplicate ack adds nothing.
        a.handle_ack(now + 31 * MS, &ack(&shrink, 1, 400)).unwrap();
        assert_eq!(
            a.key_status(&key("rps", "x")).unwrap().transfer_pool,
            st.transfer_pool
        );
    }

    #[test]
    fn small_demand_changes_do_not_move_grants() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        a.handle_hello(now, &hello("b", 1, 1)).unwrap();
        let k = key("rps", "x");
        // Both want more than half: about 500 each.
        let mut adm = [0u64, 0];
        let mut t = now;
        let mut issued = 0;
        let mut settled = 0;
        for i in 0..40u64 {
            t += 250 * MS;
            for (j, id) in ["a", "b"].iter().enumerate() {
                adm[j] += 200 + (i % 3) * 5; // ~800/s each, jittering by ~2 %
                a.handle_report(t, &report(id, 1, t, vec![line(k.clone(), adm[j], 0, None)]))
                    .unwrap();
            }
            let gs = settle(&mut a, t + 10 * MS);
            if i == 20 {
                settled = a.key_status(&k).unwrap().agents[0].granted.rate;
            }
            if i >= 20 {
                issued += gs.iter().filter(|g| g.rate != settled).count();
            }
        }
        assert_eq!(issued, 0, "no flapping once settled");
    }

    #[test]
    fn rejecting_agents_under_overload_keep_their_grants_while_demand_only_jitters() {
        // Eight agents all offered more than their share: every one rejects. A demand
        // that jitters within the hysteresis band must not move grants (it used to let
        // each rejecting agent's growth through, and then shrink the others exactly to
        // make room: a grant per agent on nearly every recomputation).
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        let ids = ["a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7"];
        for id in ids {
            a.handle_hello(now, &hello(id, 1, 1)).unwrap();
        }
        let k = key("rps", "x");
        let mut rej = [0u64; 8];
        let mut held: [Option<HeldGrant>; 8] = [None; 8];
        let mut t = now;
        let mut moved = 0;
        for i in 0..40u64 {
            t += 250 * MS;
            for (j, id) in ids.iter().enumerate() {
                // ~200 per second each against a limit of 1,000, jittering by up to 4 %
                // (enough to recompute the key, not enough to leave the band).
                rej[j] += 48 + (3 * i + j as u64) % 5;
                a.handle_report(
                    t,
                    &report(id, 1, t, vec![line(k.clone(), 0, rej[j], held[j])]),
                )
                .unwrap();
            }
            let gs = settle(&mut a, t + 10 * MS);
            for g in &gs {
                let j = ids.iter().position(|id| *id == &*g.agent).unwrap();
                if i >= 12 && held[j].is_some_and(|h| (h.rate, h.burst) != (g.rate, g.burst)) {
                    moved += 1;
                }
                held[j] = Some(g.held());
                a.handle_ack(t + 12 * MS, &ack(g, 1, 0)).unwrap();
            }
            settle(&mut a, t + 12 * MS);
        }
        let st = a.key_status(&k).unwrap();
        assert!(st.committed.rate >= 950, "the limit is handed out: {st:?}");
        assert_eq!(moved, 0, "no grant moved once settled");
    }

    #[test]
    fn under_overload_the_grants_keep_summing_to_the_limit_through_the_hysteresis_band() {
        // Eight agents offered ~1.6x the limit between them, each jittering by up to
        // 40 %: every recomputation moves some grants and holds others within the band.
        // What the held ones leave over (or take beyond their targets) is absorbed by the
        // ones that move, so the limit stays handed out; it used to be left unassigned
        // (up to the band, 5 % here) until the next move.
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        let ids = ["a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7"];
        for id in ids {
            a.handle_hello(now, &hello(id, 1, 1)).unwrap();
        }
        let k = key("rps", "x");
        let mut rej = [0u64; 8];
        let mut held: [Option<HeldGrant>; 8] = [None; 8];
        let mut t = now;
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let (mut lowest, mut grants) = (u64::MAX, 0);
        for i in 0..60u64 {
            t += 250 * MS;
            for r in &mut rej {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                *r += 40 + rng % 21;
            }
            let n = report_round(&mut a, t, &ids, &k, &rej, &mut held);
            if i >= 12 {
                lowest = lowest.min(a.key_status(&k).unwrap().committed.rate);
                grants += n;
            }
        }
        assert!(
            lowest >= 990,
            "the limit (1,000) stays handed out: lowest {lowest}"
        );
        assert!(grants > 0, "the jitter leaves the band sometimes");
    }

    /// Twenty agents offered Zipf demand (2,000/(i+1) per second each, ~7,200 in
    /// all) on one key of (1,000/s, 1,000) for 10 s; the key's grants at the end.
    fn sparse_run(typical: Option<u64>) -> KeyStatus {
        let rules = format!(
            "[engine]\nslice_source = \"allocated\"\n[[rule]]\nname = \"tps\"\n\
             match = {{ org = \"*\" }}\ndimension = \"input_tokens\"\nrate = 1000\n\
             per = \"second\"\nburst = 1000\n{}",
            typical.map_or(String::new(), |t| format!("typical_cost = {t}\n"))
        );
        let cfg = AllocatorConfig {
            sparse_half_life_ms: 1_000,
            ..quick_config()
        };
        let now = 5 * SEC;
        let mut a = warm_allocator_with(&Config::from_toml(&rules).unwrap(), cfg, 1, now);
        let ids: Vec<String> = (0..20).map(|i| format!("a{i:02}")).collect();
        for id in &ids {
            a.handle_hello(now, &hello(id, 1, 1)).unwrap();
        }
        let k = key("tps", "x");
        let mut rej = [0u64; 20];
        let mut held: [Option<HeldGrant>; 20] = [None; 20];
        let mut t = now;
        for _ in 0..40 {
            t += 250 * MS;
            for (j, r) in rej.iter_mut().enumerate() {
                *r += 500 / (j as u64 + 1);
            }
            report_round(&mut a, t, &ids, &k, &rej, &mut held);
        }
        a.key_status(&k).unwrap()
    }

    /// Every agent in `ids` reports key `k` at `t` with its cumulative rejections
    /// `rej[j]` and the grant it holds; then grants are settled and acknowledged three
    /// times over 15 ms (shrinks acknowledged free growth). Returns the grants issued.
    fn report_round<S: AsRef<str>>(
        a: &mut Allocator,
        t: u64,
        ids: &[S],
        k: &KeyName,
        rej: &[u64],
        held: &mut [Option<HeldGrant>],
    ) -> usize {
        for (j, id) in ids.iter().enumerate() {
            let l = line(k.clone(), 0, rej[j], held[j]);
            a.handle_report(t, &report(id.as_ref(), 1, t, vec![l]))
                .unwrap();
        }
        let mut n = 0;
        for step in [10, 12, 14] {
            for g in settle(a, t + step * MS) {
                let j = ids.iter().position(|id| id.as_ref() == &*g.agent).unwrap();
                held[j] = Some(g.held());
                a.handle_ack(t + step * MS + MS, &ack(&g, 1, 0)).unwrap();
                n += 1;
            }
        }
        n
    }

    #[test]
    fn a_sparse_key_is_concentrated_on_the_agents_with_the_most_demand() {
        // typical_cost 200 on a burst of 1,000: an even split over 20 agents gives most
        // slices a burst too small for a typical request, so only the busiest agents hold
        // one (at most B / (2 typical) = 2), each with a burst of 200 or more, and they
        // hold the whole rate between them.
        let st = sparse_run(Some(200));
        assert!(st.concentrated, "{st:?}");
        let holders: Vec<&AgentSlice> = st.agents.iter().filter(|s| s.granted.rate > 0).collect();
        assert!(!holders.is_empty() && holders.len() <= 2, "{st:?}");
        for h in &holders {
            assert!(h.granted.burst >= 200, "{h:?}");
            let rank: usize = h.agent[1..].parse().unwrap();
            assert!(
                rank < 2,
                "{} holds a slice over busier agents: {st:?}",
                h.agent
            );
        }
        assert!(st.committed.rate >= 950, "the rate is handed out: {st:?}");
        assert!(st.committed.rate <= 1000 && st.committed.burst <= 1000);
        // Without it (token rules default to unknown), every agent gets a slice, most of
        // them too small to admit a typical request.
        let st = sparse_run(None);
        assert!(!st.concentrated);
        let holders = st.agents.iter().filter(|s| s.granted.rate > 0).count();
        let small = st.agents.iter().filter(|s| s.granted.burst < 200).count();
        assert_eq!(holders, 20, "{st:?}");
        assert!(small >= 10, "{st:?}");
    }

    #[test]
    fn a_drained_agent_releases_at_once_and_is_not_read_as_new_demand_later() {
        let (mut a, mut now, ga) = shifted();
        // a's report showed nothing since the last: its demand drops at once (not over
        // several half-lives), so its slice is released in one pass.
        let gs = settle(&mut a, now + 20 * MS);
        let to_a = last_for(&gs, "a");
        assert!(ga.rate > 0);
        assert_eq!((to_a.rate, to_a.burst), (0, 0), "{to_a:?}");
        a.handle_ack(now + 25 * MS, &ack(&to_a, 1, 0)).unwrap();
        settle(&mut a, now + 25 * MS);
        // a keeps reporting the key (its engine still holds it) with the same
        // cumulative counters. Its entry, idle now, must not be forgotten and made
        // again from such a report: the counters would read as 900 units of new demand.
        for i in 1..=6u64 {
            now += 250 * MS;
            let line_a = line(key("rps", "x"), 0, 900, Some(to_a.held()));
            a.handle_report(now, &report("a", 1, SEC + i * 250 * MS, vec![line_a]))
                .unwrap();
            let gs = settle(&mut a, now + 20 * MS);
            assert!(
                for_agent(&gs, "a").iter().all(|g| g.rate == 0),
                "report {i}: {gs:?}"
            );
        }
    }

    #[test]
    fn while_learning_no_agent_is_granted_more_than_it_held_in_the_earlier_term() {
        // Review, twenty-fifth session: the band's residue was added to rejecting
        // entries while learning, lifting a grant past what the agent held.
        let cfg = quick_config();
        let start = 100 * SEC;
        let mut a = Allocator::new(&rules(), cfg.clone(), 2, start).unwrap();
        let held = |seq| HeldGrant {
            epoch: 1,
            seq,
            rate: 300,
            burst: 300,
        };
        for (agent, seq) in [("a", 40), ("b", 41)] {
            let mut h = hello(agent, 1, 10);
            h.held.push(crate::msg::HeldSlice {
                key: key("rps", "x"),
                grant: held(seq),
            });
            a.handle_hello(start, &h).unwrap();
        }
        let mut a_held = Some(held(40));
        let mut granted_a = Vec::new();
        let mut t = start;
        // Cumulative counters, as agents report them.
        let (mut adm, mut rej, mut b_adm, mut b_rej) = (0, 0, 0, 0);
        for round in 0..12u64 {
            t += 60 * MS;
            // a: quiet for a while, then rejecting far above what it held; b: busy.
            if round < 4 {
                adm += 1;
            } else {
                adm += 20;
                rej += 300;
            }
            b_adm += 20;
            b_rej += 300;
            a.handle_report(
                t,
                &report(
                    "a",
                    1,
                    20 + t - start,
                    vec![line(key("rps", "x"), adm, rej, a_held)],
                ),
            )
            .unwrap();
            a.handle_report(
                t,
                &report(
                    "b",
                    1,
                    20 + t - start,
                    vec![line(key("rps", "x"), b_adm, b_rej, Some(held(41)))],
                ),
            )
            .unwrap();
            let gs = settle(&mut a, t + 20 * MS);
            for g in for_agent(&gs, "a") {
                granted_a.push(g.rate);
                a.handle_ack(t + 21 * MS, &ack(g, 1, 0)).unwrap();
                a_held = Some(g.held());
            }
            assert!(a.is_learning());
        }
        assert!(!granted_a.is_empty());
        assert!(granted_a.iter().all(|&r| r <= 300), "{granted_a:?}");
    }

    #[test]
    fn a_new_term_grants_nothing_beyond_what_agents_hold_until_a_lease_has_passed() {
        let cfg = quick_config();
        let start = 100 * SEC;
        let mut a = Allocator::new(&rules(), cfg.clone(), 2, start).unwrap();
        assert!(a.is_learning());
        let held = HeldGrant {
            epoch: 1,
            seq: 40,
            rate: 300,
            burst: 300,
        };
        let mut h = hello("a", 1, 10);
        h.held.push(crate::msg::HeldSlice {
            key: key("rps", "x"),
            grant: held,
        });
        a.handle_hello(start, &h).unwrap();
        a.handle_hello(start, &hello("b", 1, 10)).unwrap();
        a.handle_report(
            start + MS,
            &report("a", 1, 20, vec![line(key("rps", "x"), 0, 5000, Some(held))]),
        )
        .unwrap();
        a.handle_report(
            start + MS,
            &report("b", 1, 20, vec![line(key("rps", "x"), 0, 5000, None)]),
        )
        .unwrap();
        let gs = settle(&mut a, start + 20 * MS);
        // a's lease is renewed in the new term at what it holds; b (cold) gets nothing.
        assert!(gs.iter().all(|g| g.epoch == 2));
        assert_eq!(for_agent(&gs, "a").iter().map(|g| g.rate).max(), Some(300));
        assert!(for_agent(&gs, "b").iter().all(|g| g.rate == 0));
        // After one lease plus margin, growth resumes.
        let end = start + (cfg.lease_ms + cfg.reclaim_margin_ms) * MS;
        a.handle_report(
            end - 100 * MS,
            &report("b", 1, SEC, vec![line(key("rps", "x"), 0, 9000, None)]),
        )
        .unwrap();
        let gs = settle(&mut a, end);
        assert!(!a.is_learning());
        assert!(for_agent(&gs, "b").iter().any(|g| g.rate > 0), "{gs:?}");
    }

    #[test]
    fn a_restarted_agent_releases_its_old_grants_at_once() {
        let (mut a, now, ga) = shifted();
        settle(&mut a, now + 20 * MS);
        let before = a.key_status(&key("rps", "x")).unwrap();
        assert!(before.committed.rate >= ga.rate);
        // a restarts: it is silent for agent_silence_ms, then says hello as incarnation 2.
        a.handle_disconnect(now + 30 * MS, "a").unwrap();
        a.handle_hello(now + 40 * MS, &hello("a", 2, 5)).unwrap();
        let after = a.key_status(&key("rps", "x")).unwrap();
        assert!(
            after.agents.iter().all(|s| &*s.agent != "a"),
            "old grants dropped"
        );
        assert_eq!(
            after.bound.partitioned_agents, 0,
            "a restarted agent starts empty"
        );
        // Reports from the old incarnation are refused.
        let err = a
            .handle_report(now + 50 * MS, &report("a", 1, SEC * 9, vec![]))
            .unwrap_err();
        assert!(matches!(
            err,
            AllocError::StaleIncarnation {
                registered: 2,
                got: 1,
                ..
            }
        ));
        a.check_invariants().unwrap();
    }

    /// Review, twenty-fifth session: a restart released the old incarnation's grant
    /// at once, the emptied key was forgotten, and the new process's first request
    /// made it again with a full transfer pool: a second burst on top of whatever the
    /// old process had spent.
    #[test]
    fn a_restarted_agents_key_made_again_gets_no_second_burst() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        join(&mut a, now, "a", "x");
        let g1 = last_for(&settle(&mut a, now + 10 * MS), "a");
        assert!(
            g1.transfer_tokens > 0,
            "a new key's first grant carries its pool"
        );
        a.handle_disconnect(now + 20 * MS, "a").unwrap();
        a.handle_hello(now + 20 * MS, &hello("a", 2, 1)).unwrap();
        settle(&mut a, now + 30 * MS);
        assert!(
            a.key_status(&key("rps", "x")).is_none(),
            "the emptied key was forgotten"
        );
        a.handle_report(
            now + 30 * MS,
            &report("a", 2, 2, vec![line(key("rps", "x"), 0, 1, None)]),
        )
        .unwrap();
        let g2 = last_for(&settle(&mut a, now + 40 * MS), "a");
        assert_eq!(g2.transfer_tokens, 0, "a second burst: {g2:?}");
        // Past the margin, a key made again starts with its pool as before.
        let later = now + 40 * MS + AllocatorConfig::ns(a.cfg.reclaim_margin_ms);
        a.handle_report(
            later,
            &report("a", 2, 3, vec![line(key("rps", "y"), 0, 1, None)]),
        )
        .unwrap();
        let g3 = last_for(&settle(&mut a, later + 10 * MS), "a");
        assert!(g3.transfer_tokens > 0, "{g3:?}");
    }

    #[test]
    fn two_live_agents_claiming_one_id_are_refused() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        a.handle_report(
            now,
            &report("a", 1, 2, vec![line(key("rps", "x"), 0, 10, None)]),
        )
        .unwrap();
        let err = a.handle_hello(now + MS, &hello("a", 2, 1)).unwrap_err();
        assert!(matches!(
            err,
            AllocError::DuplicateAgent {
                registered: 1,
                got: 2,
                ..
            }
        ));
        assert_eq!(a.agent_count(), 1);
        // Once the first has been silent for agent_silence_ms, the claim is a restart.
        let later = now + (quick_config().agent_silence_ms + 1) * MS;
        a.handle_hello(later, &hello("a", 2, 1)).unwrap();
        a.check_invariants().unwrap();
    }

    /// A line whose counts grew by more than `MAX_COST` since its base (a rule with a
    /// huge limit, or a key busy for days first named to a new leader) made the whole
    /// report an error: no line was read and none of the agent's leases renewed. It is
    /// read as `MAX_COST` units now, and the report's other lines count.
    #[test]
    fn a_line_past_max_cost_is_read_as_max_cost_and_the_rest_of_its_report_counts() {
        let now = 5 * SEC;
        let mut a = warm_allocator(2, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        let (big, small) = (key("rps", "big"), key("rps", "small"));
        a.handle_report(
            now,
            &report(
                "a",
                1,
                10,
                vec![
                    line(big.clone(), 0, 0, None),
                    line(small.clone(), 0, 0, None),
                ],
            ),
        )
        .unwrap();
        let t = 10 + SEC;
        a.handle_report(
            now + SEC,
            &report(
                "a",
                1,
                t,
                vec![
                    line(big.clone(), 1 << 45, 0, None),
                    line(small.clone(), 50, 0, None),
                ],
            ),
        )
        .expect("the report is read");
        let big_demand = a.key_status(&big).unwrap().agents[0].demand;
        assert!(
            big_demand > 0.0 && big_demand <= (MAX_COST as f64) * 2.0,
            "{big_demand}"
        );
        let small_demand = a.key_status(&small).unwrap().agents[0].demand;
        assert!(small_demand > 0.0, "the other line counts: {small_demand}");
        a.check_invariants().unwrap();
    }

    #[test]
    fn bad_input_is_refused_with_a_clear_error_and_changes_nothing() {
        let now = 5 * SEC;
        let mut a = warm_allocator(3, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        let k = key("rps", "x");
        a.handle_report(
            now,
            &report("a", 1, 10, vec![line(k.clone(), 100, 0, None)]),
        )
        .unwrap();
        let before = a.key_status(&k).unwrap();
        let mut t = 10;
        let mut bad = |a: &mut Allocator, keys: Vec<KeyReport>| {
            t += 1;
            a.handle_report(now, &report("a", 1, t, keys)).unwrap_err()
        };
        let e = bad(&mut a, vec![line(key("nope", "x"), 0, 0, None)]);
        assert_eq!(
            e.to_string(),
            "unknown rule \"nope\" (not in the allocator's rules)"
        );
        let e = bad(&mut a, vec![line(KeyName::new("rps", &[]), 0, 0, None)]);
        assert!(matches!(e, AllocError::InvalidKey { expected: 1, .. }));
        let e = bad(&mut a, vec![line(k.clone(), 50, 0, None)]);
        assert!(matches!(
            e,
            AllocError::NegativeDemand {
                counter: "admitted",
                was: 100,
                now: 50,
                ..
            }
        ));
        let e = bad(
            &mut a,
            vec![line(k.clone(), 100, 0, None), line(k.clone(), 100, 0, None)],
        );
        assert!(matches!(e, AllocError::DuplicateKey(_)));
        let newer = HeldGrant {
            epoch: 4,
            seq: 1,
            rate: 1,
            burst: 1,
        };
        let e = bad(&mut a, vec![line(k.clone(), 100, 0, Some(newer))]);
        assert!(matches!(e, AllocError::NewerTerm { ours: 3, theirs: 4 }));
        // Beyond any rule's reach (from an earlier term, one above this limit may come
        // from an allocator that ran larger rules: it is learned).
        let huge = HeldGrant {
            epoch: 2,
            seq: 1,
            rate: MAX_COST + 1,
            burst: 1,
        };
        let e = bad(&mut a, vec![line(k.clone(), 100, 0, Some(huge))]);
        assert!(matches!(e, AllocError::AbsurdGrant(_)));
        let never = HeldGrant {
            epoch: 3,
            seq: 999,
            rate: 1,
            burst: 1,
        };
        let e = bad(&mut a, vec![line(k.clone(), 100, 0, Some(never))]);
        assert!(matches!(e, AllocError::UnknownSeq { seq: 999, .. }));
        let many: Vec<KeyReport> = (0..a.config().max_keys_per_message + 1)
            .map(|i| line(key("rps", &format!("k{i}")), 0, 1, None))
            .collect();
        let e = bad(&mut a, many);
        assert!(matches!(e, AllocError::MessageTooLarge { .. }));
        // Stale report (not newer by the agent's clock), unknown agent, stale term acks.
        let e = a
            .handle_report(now, &report("a", 1, 5, vec![]))
            .unwrap_err();
        assert!(matches!(e, AllocError::StaleReport { last: 10, got: 5 }));
        let e = a
            .handle_report(now, &report("zed", 1, 50, vec![]))
            .unwrap_err();
        assert!(matches!(e, AllocError::UnknownAgent(_)));
        let stale_ack = Ack {
            agent: "a".into(),
            incarnation: 1,
            slices: vec![crate::msg::SliceAck {
                key: k.clone(),
                epoch: 2,
                seq: 1,
                released_tokens: 0,
                in_flight: 0,
                key_handle: 0,
            }],
        };
        let e = a.handle_ack(now, &stale_ack).unwrap_err();
        assert!(matches!(e, AllocError::StaleTerm { ours: 3, theirs: 2 }));
        let e = a.handle_hello(now, &hello("", 1, 1)).unwrap_err();
        assert!(matches!(e, AllocError::InvalidAgentId { .. }));
        // Nothing changed.
        assert_eq!(a.key_status(&k).unwrap(), before);
        assert_eq!(a.key_count(), 1);
        a.check_invariants().unwrap();
    }

    #[test]
    fn tables_refuse_entries_beyond_their_bounds() {
        let now = 5 * SEC;
        let cfg = AllocatorConfig {
            max_agents: 1,
            max_keys: 2,
            ..quick_config()
        };
        let mut a = Allocator::new(&rules(), cfg, 1, now).unwrap();
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        let e = a.handle_hello(now, &hello("b", 1, 1)).unwrap_err();
        assert!(matches!(e, AllocError::AgentTableFull { max: 1 }));
        let three = (0..3)
            .map(|i| line(key("rps", &format!("k{i}")), 0, 1, None))
            .collect();
        let e = a.handle_report(now, &report("a", 1, 2, three)).unwrap_err();
        assert!(matches!(e, AllocError::KeyTableFull { max: 2 }));
        assert_eq!(a.key_count(), 0);

        // Review (twenty-seventh session): agents were never forgotten, so ids that
        // change with every rollout filled the table for good. A full table now
        // forgets the agent disconnected longest once its grants have lapsed: not a
        // connected one, nor one gone for less than a lease and the margin.
        // (Review, thirty-first session: the bound was a lease alone, so an agent's
        // grants were freed up to the margin before they lapse by the allocator's
        // books.)
        a.handle_disconnect(now, "a").unwrap();
        let soon = now + a.hold_ns() - 1;
        let e = a.handle_hello(soon, &hello("b", 1, 1)).unwrap_err();
        assert!(matches!(e, AllocError::AgentTableFull { max: 1 }));
        let later = now + a.hold_ns();
        a.handle_hello(later, &hello("b", 1, 1)).unwrap();
        assert_eq!((a.agent_count(), a.agents_evicted()), (1, 1));
        let e = a
            .handle_report(later, &report("a", 1, 3, vec![]))
            .unwrap_err();
        assert!(matches!(e, AllocError::UnknownAgent(_)), "{e}");
        let e = a.handle_hello(later, &hello("c", 1, 1)).unwrap_err();
        assert!(
            matches!(e, AllocError::AgentTableFull { max: 1 }),
            "b is connected: {e}"
        );
        a.check_invariants().unwrap();
    }

    /// Agent a holds a `conc` grant (`ga`) and, with `busy` of its slots still in
    /// flight, is shrunk (`shrink`) because b wants slots; `t` is the shrinking round.
    fn concurrency_shrink_while_busy(
        busy: impl Fn(&Grant) -> u64,
    ) -> (Allocator, KeyName, Grant, Grant, u64) {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        let k = key("conc", "x");
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        a.handle_hello(now, &hello("b", 1, 1)).unwrap();
        let mut l = line(k.clone(), 0, 0, None);
        l.in_flight = 0;
        l.rejected = 20;
        a.handle_report(now, &report("a", 1, 2, vec![l])).unwrap();
        let gs = settle(&mut a, now + 20 * MS);
        let ga = gs[0].clone();
        a.handle_ack(now + 21 * MS, &ack(&ga, 1, 0)).unwrap();
        settle(&mut a, now + 21 * MS);
        // b wants slots; a is idle but still has work in flight.
        let t = now + SEC;
        let mut la = line(k.clone(), 0, 20, Some(ga.held()));
        la.in_flight = busy(&ga);
        a.handle_report(t, &report("a", 1, SEC, vec![la])).unwrap();
        let mut lb = line(k.clone(), 0, 50, None);
        lb.in_flight = 0;
        a.handle_report(t, &report("b", 1, SEC, vec![lb])).unwrap();
        let gs = settle(&mut a, t + 20 * MS);
        let shrink = last_for(&gs, "a");
        (a, k, ga, shrink, t)
    }

    #[test]
    fn a_concurrency_shrink_counts_until_in_flight_work_drains() {
        let (mut a, k, ga, shrink, t) = concurrency_shrink_while_busy(|_| 1);
        assert!(ga.burst >= 7 && ga.rate == 0, "{ga:?}");
        assert!(shrink.burst < ga.burst);
        // Acked while still over the new slot count: the old grant keeps counting.
        let mut drained = ack(&shrink, 1, 0);
        drained.slices[0].in_flight = shrink.burst + 1;
        a.handle_ack(t + 30 * MS, &drained).unwrap();
        settle(&mut a, t + 30 * MS);
        let st = a.key_status(&k).unwrap();
        let sa = st.agents.iter().find(|s| &*s.agent == "a").unwrap();
        assert_eq!(sa.committed.burst, ga.burst);
        assert!(st.committed.burst <= 10);
        // Drained: now it counts as applied, and b can grow.
        drained.slices[0].in_flight = 0;
        a.handle_ack(t + 40 * MS, &drained).unwrap();
        let gs = settle(&mut a, t + 40 * MS);
        assert!(for_agent(&gs, "b").iter().any(|g| g.burst > 10 - ga.burst));
    }

    /// Review, twenty-fifth session: an agent cut off with its concurrency slots busy
    /// keeps that work running past its lease (in-flight work is never revoked), but
    /// the bound counted only its posture's fallback (none under `strict`).
    #[test]
    fn in_flight_work_of_an_agent_cut_off_counts_in_the_bound() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        let k = key("conc", "x");
        // Two holders, so the conservative posture falls back to 10 / 2 slots.
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        a.handle_hello(now, &hello("b", 1, 1)).unwrap();
        let mut l = line(k.clone(), 0, 0, None);
        l.rejected = 80;
        a.handle_report(now, &report("a", 1, 2, vec![l])).unwrap();
        let mut l = line(k.clone(), 0, 0, None);
        l.rejected = 5;
        a.handle_report(now, &report("b", 1, 2, vec![l])).unwrap();
        let gs = settle(&mut a, now + 20 * MS);
        let (ga, gb) = (last_for(&gs, "a"), last_for(&gs, "b"));
        assert!(ga.burst > 5, "{ga:?}");
        a.handle_ack(now + 21 * MS, &ack(&ga, 1, 0)).unwrap();
        a.handle_ack(now + 21 * MS, &ack(&gb, 1, 0)).unwrap();
        // a: every slot of its grant busy, then not a word; b keeps reporting.
        let t = now + 100 * MS;
        let mut la = line(k.clone(), 0, 80, Some(ga.held()));
        la.in_flight = ga.burst;
        a.handle_report(t, &report("a", 1, 100 * MS, vec![la]))
            .unwrap();
        settle(&mut a, t + 10 * MS);
        let (mut at, mut ts) = (t, 100 * MS);
        while at < t + 5 * SEC {
            at += 250 * MS;
            ts += 250 * MS;
            let lb = line(k.clone(), 0, 5, Some(gb.held()));
            a.handle_report(at, &report("b", 1, ts, vec![lb])).unwrap();
            settle(&mut a, at + 10 * MS);
        }
        let st = a.key_status(&k).unwrap();
        assert_eq!(st.bound.partitioned_agents, 1, "{st:?}");
        assert!(
            st.bound.burst >= ga.burst,
            "{} slots still busy, a bound of {}",
            ga.burst,
            st.bound.burst
        );
    }

    /// Review, twenty-fifth session: a reconnect's hello (which says nothing of work in
    /// flight) marked a concurrency shrink still draining as applied, so the slots still
    /// busy were granted to another agent.
    #[test]
    fn a_reconnect_does_not_end_a_concurrency_shrink_that_is_still_draining() {
        // Every slot of a's grant still busy.
        let (mut a, k, ga, shrink, t) = concurrency_shrink_while_busy(|ga| ga.burst);
        assert!(shrink.burst < ga.burst);
        // a applies the shrink but its work has not drained; then its stream breaks and
        // it says hello again holding the shrink.
        a.handle_disconnect(t + 30 * MS, "a").unwrap();
        let mut h = hello("a", 1, SEC + 30 * MS);
        h.held.push(crate::msg::HeldSlice {
            key: k.clone(),
            grant: shrink.held(),
        });
        a.handle_hello(t + 31 * MS, &h).unwrap();
        settle(&mut a, t + 40 * MS);
        let st = a.key_status(&k).unwrap();
        let sa = st.agents.iter().find(|s| &*s.agent == "a").unwrap();
        assert_eq!(
            sa.committed.burst, ga.burst,
            "the old grant counts until the work drains"
        );
        assert!(st.committed.burst <= 10, "{st:?}");
    }

    #[test]
    fn only_keys_whose_demand_changed_are_recomputed() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        let keys = |n: u64, held: &HashMap<String, HeldGrant>| -> Vec<KeyReport> {
            (0..50)
                .map(|i| {
                    let k = format!("k{i}");
                    line(key("rps", &k), 0, 100 * n, held.get(&k).copied())
                })
                .collect()
        };
        a.handle_report(now, &report("a", 1, 250 * MS, keys(1, &HashMap::new())))
            .unwrap();
        let gs = settle(&mut a, now + 20 * MS);
        assert_eq!(gs.len(), 50);
        // The agent applied them (its next report says so).
        let held: HashMap<String, HeldGrant> = gs
            .iter()
            .map(|g| (g.key.values[0].clone(), g.held()))
            .collect();
        // One key's demand changes; the other 49 are steady (and not due for renewal).
        let t = now + 250 * MS;
        let mut steady = keys(2, &held);
        steady[7].rejected = 5000;
        a.handle_report(t, &report("a", 1, 500 * MS, steady))
            .unwrap();
        assert_eq!(a.dirty.iter().filter(|d| a.key((d.0).1).dirty).count(), 1);
        let gs = settle(&mut a, t + 20 * MS);
        assert!(gs.iter().all(|g| g.key.values[0] == "k7"), "{gs:?}");
    }

    #[test]
    fn leases_are_renewed_while_the_agent_reports() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        let k = key("rps", "x");
        let mut held = None;
        let mut t = now;
        let mut last_lease = 0;
        let (mut grants, mut extensions) = (0, 0);
        for _ in 0..40 {
            t += 250 * MS;
            // Steady demand: after the first grant nothing needs re-granting.
            a.handle_report(t, &report("a", 1, t, vec![line(k.clone(), 100, 0, held)]))
                .unwrap();
            a.handle_timeout(t + 10 * MS);
            a.check_invariants().unwrap();
            for g in a.drain_grants() {
                grants += 1;
                held = Some(g.held());
                last_lease = last_lease.max(g.lease_expires_at_ns);
            }
            for x in a.drain_extensions() {
                extensions += 1;
                assert_eq!((x.agent.as_ref(), x.incarnation, x.epoch), ("a", 1, 1));
                // Every grant sent so far is covered.
                assert!(x.through_seq >= held.map_or(0, |h| h.seq), "{x:?}");
                // Invariant 3: the lease echoes the report it answers (agent time t),
                // plus the lease, minus the drift margin.
                let cfg = a.config();
                assert_eq!(
                    x.lease_expires_at_ns,
                    t + MS * (cfg.lease_ms - cfg.drift_margin_ms)
                );
                last_lease = last_lease.max(x.lease_expires_at_ns);
            }
        }
        // 10 s of reports with a 1 s lease: the lease is always in the future, and the
        // allocator never let the grant lapse (no partition fallback in the bound).
        assert!(last_lease > t - SEC, "lease {last_lease} at {t}");
        assert_eq!(a.overshoot_bound(&k).unwrap().partitioned_agents, 0);
        let granted = a.key_status(&k).unwrap().agents[0].granted;
        assert!(!granted.is_zero());
        assert_eq!(a.key_status(&k).unwrap().agents[0].committed, granted);
        // Renewed by extensions (one each time the grant is down to half its hold of
        // 1.1 s: every 0.55-0.75 s at a report every 0.25 s), not by re-sending it.
        assert_eq!(grants, 1, "the grant was re-sent");
        assert!((12..=19).contains(&extensions), "{extensions} extensions");
    }

    #[test]
    fn an_agent_that_stops_reporting_loses_its_extended_grants_one_hold_after_its_last_report() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        let k = key("rps", "x");
        let mut held = None;
        let mut t = now;
        for _ in 0..12 {
            t += 250 * MS;
            a.handle_report(t, &report("a", 1, t, vec![line(k.clone(), 100, 0, held)]))
                .unwrap();
            a.handle_timeout(t + 10 * MS);
            for g in a.drain_grants() {
                held = Some(g.held());
            }
            a.drain_extensions();
        }
        let last = t;
        let granted = a.key_status(&k).unwrap().agents[0].granted;
        assert!(!granted.is_zero());
        let hold = MS * (a.config().lease_ms + a.config().reclaim_margin_ms);
        // Silent from here: the grant counts until one hold after the last extension
        // (sent less than half a hold before the last report), then its posture
        // fallback does.
        a.handle_timeout(last + hold / 2 - MS);
        a.check_invariants().unwrap();
        assert_eq!(a.key_status(&k).unwrap().agents[0].committed, granted);
        a.handle_timeout(last + hold + MS);
        a.check_invariants().unwrap();
        assert!(a.key_status(&k).unwrap().agents[0].committed.is_zero());
        assert_eq!(a.overshoot_bound(&k).unwrap().partitioned_agents, 1);
    }

    #[test]
    fn a_grant_the_agent_holds_on_its_posture_is_sent_again_while_it_still_counts() {
        // The agent's lease ended before this side's (an extension lost on the way):
        // it reports the grant's id with its posture's slice. An extension never puts a
        // lapsed grant back, so the grant is sent again.
        let (mut a, now, k, g) = first_grant();
        let mut posture = g.held();
        posture.rate /= 4;
        posture.burst /= 4;
        // Not while it may be the agent's fresh state...
        let t = now + 100 * MS;
        a.handle_report(
            t,
            &report("a", 1, t, vec![line(k.clone(), 100, 0, Some(posture))]),
        )
        .unwrap();
        assert!(settle(&mut a, t + 10 * MS).is_empty());
        // ...but once a quarter lease has passed.
        let t = now + MS * a.config().lease_ms / 4 + 100 * MS;
        a.handle_report(
            t,
            &report("a", 1, t, vec![line(k.clone(), 100, 0, Some(posture))]),
        )
        .unwrap();
        let again = settle(&mut a, t + 10 * MS);
        assert_eq!(again.len(), 1);
        assert_eq!((again[0].rate, again[0].burst), (g.rate, g.burst));
        assert!(again[0].seq > g.seq);
    }

    #[test]
    fn report_lines_may_name_their_key_by_the_handle_a_grant_carried() {
        let (mut a, now, k, g) = first_grant();
        assert_ne!(g.key_handle, 0);
        // By handle alone (no name): counted against the key.
        let t = now + 250 * MS;
        let mut by_handle = line(KeyName::default(), 100, 400, Some(g.held()));
        by_handle.key_handle = g.key_handle;
        a.handle_report(t, &report("a", 1, t, vec![by_handle.clone()]))
            .unwrap();
        a.check_invariants().unwrap();
        assert!(a.key_status(&k).unwrap().agents[0].demand > 0.0);
        assert_eq!(a.ignored_lines(), 0);
        // A handle of another generation of that index (a forgotten key's, or
        // another term's) is ignored: never counted against whatever key has it now.
        let before = a.key_status(&k).unwrap().agents[0].demand;
        let t = t + 250 * MS;
        let mut stale = by_handle.clone();
        stale.key_handle = g.key_handle + (1 << 32);
        stale.rejected = 100_000;
        assert_eq!(a.pending_unknown_handles(), 0);
        a.handle_report(t, &report("a", 1, t, vec![stale.clone()]))
            .unwrap();
        assert_eq!(a.ignored_lines(), 1);
        assert_eq!(a.key_status(&k).unwrap().agents[0].demand, before);
        // The agent is told which handles it used that this allocator does not know,
        // on its own incarnation's stream.
        let told = a.drain_unknown_handles();
        assert_eq!(told.len(), 1);
        assert_eq!((&*told[0].agent, told[0].incarnation), ("a", 1));
        assert_eq!(told[0].key_handles, vec![stale.key_handle]);
        assert_eq!(a.pending_unknown_handles(), 0);
        // Bad input by handle gets the key's name in its error.
        let t = t + 250 * MS;
        let mut bad = by_handle;
        bad.admitted = 1;
        let e = a
            .handle_report(t, &report("a", 1, t, vec![bad]))
            .unwrap_err();
        assert!(
            matches!(&e, AllocError::NegativeDemand { key, .. } if *key == k),
            "{e:?}"
        );
    }

    #[test]
    fn a_grant_the_agent_never_received_is_sent_again() {
        let (mut a, now, k, lost) = first_grant();
        let lost = [lost];
        // The grant is lost on the way; the agent keeps reporting that it holds nothing.
        // Not at once (it may be in flight), but once a quarter lease has passed.
        let lease = MS * a.config().lease_ms;
        let mut t = now;
        let mut again = Vec::new();
        while again.is_empty() {
            t += 250 * MS;
            assert!(t < now + lease, "never sent again");
            a.handle_report(t, &report("a", 1, t, vec![line(k.clone(), 100, 0, None)]))
                .unwrap();
            again = settle(&mut a, t + 10 * MS);
        }
        assert!(
            t >= now + lease / 4,
            "sent again after {} ms",
            (t - now) / MS
        );
        assert_eq!(
            (again[0].rate, again[0].burst),
            (lost[0].rate, lost[0].burst)
        );
        assert!(again[0].seq > lost[0].seq);
        // Once the agent reports holding it, nothing more is sent.
        let held = Some(again[0].held());
        for _ in 0..8 {
            t += 250 * MS;
            a.handle_report(t, &report("a", 1, t, vec![line(k.clone(), 100, 0, held)]))
                .unwrap();
            assert!(settle(&mut a, t + 10 * MS).is_empty());
        }
    }

    #[test]
    fn a_large_key_retargets_the_reporting_agent_at_once_and_recomputes_on_schedule() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        let k = key("rps", "hot");
        let n = 40u64; // above large_key_entries (32)
        for i in 0..n {
            let id = format!("a{i}");
            a.handle_hello(now, &hello(&id, 1, 1)).unwrap();
            a.handle_report(
                now,
                &report(&id, 1, 250 * MS, vec![line(k.clone(), 10, 0, None)]),
            )
            .unwrap();
        }
        let gs = settle(&mut a, now + 20 * MS);
        // Demand is 40/s each, 1,600/s in all: overloaded, 25/s each.
        assert_eq!(gs.len(), n as usize, "the first pass grants everyone");
        assert!(gs.iter().all(|g| g.rate == 25), "{:?}", gs[0]);
        // One agent's demand drops: its entry is re-targeted inside handle_report.
        let t = now + 100 * MS;
        a.handle_report(
            t,
            &report("a0", 1, 500 * MS, vec![line(k.clone(), 11, 0, None)]),
        )
        .unwrap();
        let at_once: Vec<Grant> = a.drain_grants().collect();
        assert_eq!(at_once.len(), 1);
        assert!(at_once[0].rate < 25, "{:?}", at_once[0]);
        a.check_invariants().unwrap();
        // The whole key waits for its schedule (last full pass + 250 ms).
        assert!(a.recompute_at_ns.unwrap() >= now + 20 * MS + 250 * MS);
    }

    #[test]
    fn a_new_term_that_learns_more_than_the_limit_grants_nothing_and_bounds_the_excess() {
        // Under the old term, a was partitioned and its lapsed grant reclaimed for b:
        // both still say they hold 700 of 1,000.
        let cfg = quick_config();
        let start = 100 * SEC;
        let mut a = Allocator::new(&rules(), cfg.clone(), 2, start).unwrap();
        let k = key("rps", "x");
        for (id, seq) in [("a", 5), ("b", 9)] {
            let mut h = hello(id, 1, 10);
            h.held.push(crate::msg::HeldSlice {
                key: k.clone(),
                grant: HeldGrant {
                    epoch: 1,
                    seq,
                    rate: 700,
                    burst: 700,
                },
            });
            a.handle_hello(start, &h).unwrap();
        }
        a.check_invariants().unwrap();
        let st = a.key_status(&k).unwrap();
        assert_eq!(st.committed.rate, 1400);
        assert_eq!(
            (st.bound.rate, st.bound.burst),
            (400, 400),
            "the excess is stated"
        );
        // Reports renew nothing learned while over the limit, and nothing grows.
        for id in ["a", "b"] {
            a.handle_report(
                start + MS,
                &report(id, 1, 20, vec![line(k.clone(), 0, 500, None)]),
            )
            .unwrap();
        }
        let gs = settle(&mut a, start + 20 * MS);
        assert!(gs.iter().map(|g| g.rate).sum::<u64>() <= 1000, "{gs:?}");
        // Once the learned grants lapse, the excess moves into the partition bound.
        let end = start + (cfg.lease_ms + cfg.reclaim_margin_ms) * MS;
        settle(&mut a, end);
        let st = a.key_status(&k).unwrap();
        assert!(st.committed.rate <= 1000);
    }

    #[test]
    fn spare_capacity_stays_with_an_agent_for_a_few_reports_after_it_stops_rejecting() {
        let now = 5 * SEC;
        let mut a = warm_allocator(1, now);
        let k = key("rps", "under");
        a.handle_hello(now, &hello("a", 1, 1)).unwrap();
        a.handle_hello(now, &hello("b", 1, 1)).unwrap();
        // Under the limit: a 300/s, b 200/s; b rejected some in its last report.
        let (mut adm_a, mut adm_b, mut rej_b) = (0u64, 0u64, 0u64);
        let mut t = now;
        let mut granted_b = Vec::new();
        for i in 0..8u64 {
            t += 250 * MS;
            adm_a += 75;
            adm_b += 50;
            if i == 3 {
                rej_b += 20;
            }
            a.handle_report(t, &report("a", 1, t, vec![line(k.clone(), adm_a, 0, None)]))
                .unwrap();
            a.handle_report(
                t,
                &report("b", 1, t, vec![line(k.clone(), adm_b, rej_b, None)]),
            )
            .unwrap();
            settle(&mut a, t + 10 * MS);
            let st = a.key_status(&k).unwrap();
            granted_b.push(
                st.agents
                    .iter()
                    .find(|s| &*s.agent == "b")
                    .unwrap()
                    .granted
                    .rate,
            );
        }
        // Every agent keeps headroom above its demand, and b's extra share does not
        // vanish on the first report without rejections.
        assert!(granted_b[2] > 200, "{granted_b:?}");
        assert!(
            granted_b[3] > granted_b[2],
            "b grows when it rejects: {granted_b:?}"
        );
        assert!(granted_b[4] >= granted_b[3] * 95 / 100, "{granted_b:?}");
        assert!(a.key_status(&k).unwrap().committed.rate <= 1000);
    }
}
