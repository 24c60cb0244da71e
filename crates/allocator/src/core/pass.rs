//! One key's recomputation apart from the rest of the allocator: everything it reads
//! besides the key ([`Ctx`], the agents), and everything it writes besides the key
//! (grants: [`Out`], and what the agents remember of them: [`Agents::issued`]). The
//! allocator's own calls ([`Allocator::recompute`], `grant_towards`, `issue`) go through
//! these functions with the allocator's tables; a large batch of keys
//! ([`Allocator::recompute_batch`]: a full pass, the end of a term's learning, a rules
//! reload) runs them on two threads, each over its own half of the key table, with
//! its own outbox and a record of what it issued to each agent, merged afterwards.
//!
//! The split is by key index at half the work (entries, plus [`KEY_COST`] a key) and
//! the same on any machine (it does not depend on how many cores there are, nor on
//! timing), so a run replays bit for bit: the second
//! half's grants take their seqs from `first + entries of the first half` (each entry
//! takes at most one grant per recomputation), and the gap that leaves in the outbox's
//! seqs is recorded beside it (`Graves::seq_jumps`).

use super::*;

/// Batches with fewer entries than this run on the calling thread: below it, starting
/// a thread costs more than half the batch.
pub(super) const PARALLEL_MIN_ENTRIES: usize = 1 << 16;

/// Keys whose entries a batch below [`PARALLEL_MIN_ENTRIES`] loads ahead of
/// recomputing them (`recompute_batch`).
const WARM_KEYS: usize = 32;

/// What a key costs besides its entries, in entries: each half of the benchmark's
/// fleet (1,000 agents, 100,000 keys, Zipf-spread), timed alone, split by entries only
/// and by entries plus 4 a key, put the balance between the two.
const KEY_COST: usize = 2;

/// What a key's recomputation reads of the allocator (besides the agents).
#[derive(Clone, Copy)]
pub(super) struct Ctx<'a> {
    pub rules: &'a [RuleInfo],
    pub hysteresis_permille: u64,
    pub reserve: f64,
    pub learning: bool,
    pub term: u64,
    pub lease_ns: u64,
    pub hold_ns: u64,
    pub drift_ns: u64,
}

/// The agents, as a recomputation sees them: read, and told of each grant issued.
pub(super) trait Agents {
    fn agent(&self, a: u32) -> Option<&Agent>;
    /// A grant with `seq` went to agent `a`, held (allocator side) until `expires_ns`.
    fn issued(&mut self, a: u32, seq: u64, expires_ns: u64, hold_ns: u64);
}

impl Agents for [Option<Agent>] {
    fn agent(&self, a: u32) -> Option<&Agent> {
        self[a as usize].as_ref()
    }

    fn issued(&mut self, a: u32, seq: u64, expires_ns: u64, hold_ns: u64) {
        let ag = self[a as usize].as_mut().expect("live agent");
        ag.last_seq = seq;
        ag.unext_min_expiry = ag.unext_min_expiry.min(expires_ns);
        ag.renew_due_ns = ag.renew_due_ns.min(expires_ns.saturating_sub(hold_ns / 2));
    }
}

/// The agents shared by the two threads of a batch: read-only, and what each thread
/// issued to each agent kept apart (latest seq, earliest expiry), applied after the
/// join ([`Issued::apply`]): the same as [`Agents::issued`] in seq order, since seqs
/// only grow and the other two are minima.
pub(super) struct Shared<'a> {
    agents: &'a [Option<Agent>],
    issued: Issued,
}

#[derive(Default)]
pub(super) struct Issued {
    /// Per agent index: (latest seq, earliest expiry); seq 0 for none.
    by_agent: Vec<(u64, u64)>,
}

impl Issued {
    fn new(agents: usize) -> Issued {
        Issued {
            by_agent: vec![(0, u64::MAX); agents],
        }
    }

    fn apply(&self, agents: &mut [Option<Agent>], hold_ns: u64) {
        for (a, &(seq, expires_ns)) in self.by_agent.iter().enumerate() {
            if seq > 0 {
                agents.issued(a as u32, seq, expires_ns, hold_ns);
            }
        }
    }
}

impl Agents for Shared<'_> {
    fn agent(&self, a: u32) -> Option<&Agent> {
        self.agents[a as usize].as_ref()
    }

    fn issued(&mut self, a: u32, seq: u64, expires_ns: u64, _hold_ns: u64) {
        let m = &mut self.issued.by_agent[a as usize];
        m.0 = m.0.max(seq);
        m.1 = m.1.min(expires_ns);
    }
}

/// Where a recomputation's grants go: `outbox`, after `before` records in other
/// vectors (transfer tokens are kept by record index over all of them).
pub(super) struct Out<'a> {
    pub next_seq: &'a mut u64,
    pub outbox: &'a mut Vec<Pending>,
    pub before: usize,
    pub transfers: &'a mut Vec<(u32, u64)>,
}

/// Whether `e` can be forgotten: no grant, nothing in flight, nothing remembered, and
/// its agent gone or silent about it for a lease.
pub(super) fn idle_entry<A: Agents + ?Sized>(agents: &A, e: &Entry, lease: u64) -> bool {
    e.current().is_zero()
        && e.in_flight == 0
        && agents
            .agent(e.agent)
            .is_none_or(|ag| ag.report_ts.saturating_sub(e.base_ts) >= lease)
        && e.rare.is_none()
        && e.commitment().is_zero()
}

/// One recomputation's surroundings: what it reads ([`Ctx`], the agents) and where its
/// grants go ([`Out`]); one per thread in a batch.
pub(super) struct Pass<'a, A: Agents + ?Sized> {
    pub ctx: Ctx<'a>,
    pub agents: &'a mut A,
    pub out: Out<'a>,
}

impl<A: Agents + ?Sized> Pass<'_, A> {
    /// Sends `slice` to entry `pos` of key `k`: new seq, lease from its agent's latest
    /// report.
    pub(super) fn issue(&mut self, k: u32, key: &mut Key, pos: u32, slice: Slice, transfer: u64) {
        let seq = *self.out.next_seq;
        *self.out.next_seq += 1;
        let fleet = key.entries.len().max(1) as u32;
        let agent = key.entries[pos as usize].agent;
        let ag = self.agents.agent(agent).expect("live agent");
        let expires_ns = ag.report_recv_ns.saturating_add(self.ctx.hold_ns);
        let lease_expires_at_ns = ag
            .report_ts
            .saturating_add(self.ctx.lease_ns)
            .saturating_sub(self.ctx.drift_ns);
        let ext = ag.ext;
        // The key's name goes with the first grant on each stream of an agent that
        // asked for grants by handle; later ones carry the stream they may skip it on.
        let told = if ag.by_handle {
            let e = &mut key.entries[pos as usize];
            if e.told == ag.stream {
                ag.stream
            } else {
                e.told = ag.stream;
                0
            }
        } else {
            0
        };
        self.agents.issued(agent, seq, expires_ns, self.ctx.hold_ns);
        key.push_grant(
            pos as usize,
            Sent {
                epoch: self.ctx.term,
                seq,
                slice,
                fleet,
                expires_ns,
            },
            ext,
            self.ctx.term,
        );
        if transfer > 0 {
            self.out
                .transfers
                .push(((self.out.before + self.out.outbox.len()) as u32, transfer));
        }
        self.out.outbox.push(Pending {
            agent,
            told,
            key: k,
            rate: slice.rate,
            burst: slice.burst,
            lease_expires_at_ns,
            fleet_size: fleet,
        });
    }

    /// Sends `desired` to entry `pos` as far as revoke-before-grant allows: a shrink (or
    /// anything within its commitment) at once, growth only out of what is free, with
    /// transfer tokens from the pool. Returns true if a grant was issued.
    pub(super) fn grant_towards(
        &mut self,
        k: u32,
        key: &mut Key,
        pos: u32,
        desired: Slice,
    ) -> bool {
        let rule = self.ctx.rules[key.rule as usize];
        let free = key.free();
        let e = &key.entries[pos as usize];
        let commit = e.commitment();
        let cur = e.current();
        let new = if desired.le(commit) {
            desired
        } else {
            Slice {
                rate: desired.rate.min(commit.rate + free.rate),
                burst: desired.burst.min(commit.burst + free.burst),
            }
        };
        if new == cur {
            return false;
        }
        if new != desired && cur.le(new) && !cur.is_zero() {
            // Partial growth (the rest waits for shrinks to be applied): not worth a
            // grant until it is more than the hysteresis band, or complete. Otherwise
            // every acknowledgement of a shrink would send the grower another sliver.
            let h = self.ctx.hysteresis_permille;
            let small = |n: u64, c: u64, d: u64| (n - c) * 1000 <= h * d;
            if small(new.rate, cur.rate, desired.rate) && small(new.burst, cur.burst, desired.burst)
            {
                return false;
            }
        }
        let grow_burst = new.burst.saturating_sub(commit.burst);
        let transfer = if rule.concurrency {
            0
        } else {
            key.pool.min(grow_burst)
        };
        key.pool -= transfer;
        // The grant's commitment clamps the pool to what is left free (`Key::recommitted`).
        self.issue(k, key, pos, new, transfer);
        true
    }

    /// Allocates key `k`: targets by water-filling, hysteresis, then shrinks at once and
    /// growth only out of what is free (revoke before grant), with transfer tokens. False,
    /// having changed nothing, if some entry is idle: the caller forgets the idle entries
    /// (which the key table alone cannot do) and calls again.
    pub(super) fn recompute(&mut self, now: u64, k: u32, key: &mut Key, sc: &mut Scratch) -> bool {
        let rule = self.ctx.rules[key.rule as usize];
        let cap = rule.capacity();
        let limit = rule.limit();
        let lease = self.ctx.lease_ns;
        let reserve = self.ctx.reserve;

        // One pass over the entries: claims, and whether any entry is idle.
        sc.claims.clear();
        sc.reachable.clear();
        let mut idle = false;
        for e in &key.entries {
            idle |= idle_entry(&*self.agents, e, lease);
            let (reachable, weight) = match self.agents.agent(e.agent) {
                Some(ag) => (
                    ag.connected && ag.report_recv_ns.saturating_add(lease) > now,
                    ag.weight,
                ),
                None => (false, 1.0),
            };
            sc.reachable.push(reachable);
            sc.claims.push(Claim {
                // An agent not heard from for a lease gets no share: its grants would
                // carry leases already over, and its share would sit unused.
                demand: if e.demand.is_finite() && reachable {
                    e.demand.max(0.0)
                } else {
                    0.0
                },
                weight,
                rejecting: e.rejecting,
            });
        }
        // A key left with no entry (its agents forgotten or restarted) goes too.
        if idle || key.entries.is_empty() {
            return false;
        }
        // A sparse key (see `concentrate`) is split on slow demand among the entries with
        // the most of it; any other on the demand as smoothed.
        let mut sparse = None;
        // Sticky: a concentrated key goes back to the plain split only once every slice
        // would hold two typical requests (no flapping at the edge).
        let need = if key.sparse {
            rule.typical.saturating_mul(2)
        } else {
            rule.typical
        };
        if rule.typical > 0 && !rule.concurrency && !any_split_fits(&rule, key.entries.len(), need)
        {
            sc.slow.clear();
            for (i, e) in key.entries.iter().enumerate() {
                let mut c = sc.claims[i];
                c.demand = if sc.reachable[i] && e.demand_slow.is_finite() {
                    e.demand_slow.max(0.0)
                } else {
                    0.0
                };
                sc.slow.push(c);
            }
            water_fill(cap as f64, &sc.slow, reserve, &mut sc.shares);
            to_units(cap, &sc.shares, &mut sc.units);
            if !bursts_fit(&rule, &sc.units, need) {
                std::mem::swap(&mut sc.claims, &mut sc.slow);
                sparse = Some(concentrate(&rule, &key.entries, sc, reserve));
            }
        }
        let fill = match sparse {
            Some((fill, _)) => fill,
            None => {
                let fill = water_fill(cap as f64, &sc.claims, reserve, &mut sc.shares);
                to_units(cap, &sc.shares, &mut sc.units);
                fill
            }
        };
        let split = burst_split(&rule, &sc.units, sparse.is_some());
        let h = band(self.ctx.hysteresis_permille, sparse.is_some());

        // Targets with hysteresis; the demand they answer is now the demand used.
        let learning = self.ctx.learning;
        let target = |i: usize, e: &Entry| {
            target_of(&rule, learning, sc.units[i], e, sc.reachable[i], split)
        };
        sc.desired.clear();
        let (mut sum_r, mut sum_b) = (0u128, 0u128);
        for (i, e) in key.entries.iter_mut().enumerate() {
            let target = target(i, e);
            let desired = with_hysteresis(&rule, h, target, e);
            sum_r += desired.rate as u128;
            sum_b += desired.burst as u128;
            sc.desired.push(desired);
            e.demand_used = e.demand;
            e.rejecting_used = e.rejecting;
        }
        // Not while learning: targets are capped at what each agent held in the earlier
        // term, and growth past that (the band's residue) could hand out budget that
        // agents not heard from yet still hold (invariant 4).
        if !rule.concurrency && !learning {
            sum_r = absorb_band_residue(
                &key.entries,
                &sc.reachable,
                h,
                limit.rate,
                sum_r,
                &mut sc.desired,
                &mut sc.room,
            );
        }
        if sum_r > limit.rate as u128 || sum_b > limit.burst as u128 {
            // Shrinks held back by hysteresis would block growth: shrink exactly.
            for (i, e) in key.entries.iter().enumerate() {
                let target = target(i, e);
                let d = &mut sc.desired[i];
                if target.le(*d) {
                    *d = target;
                }
            }
        }
        key.fill = fill;
        key.split = split;
        key.sparse = sparse.is_some();
        key.keep_floor = sparse.map_or(0.0, |(_, floor)| floor);
        key.last_full_ns = now;
        // Shrinks (and anything within a commitment) first, then rejecting growers, then
        // the others.
        sc.growers.clear();
        for i in 0..sc.desired.len() {
            let e = &key.entries[i];
            if sc.desired[i] == e.current() {
                continue;
            }
            if sc.desired[i].le(e.commitment()) {
                self.grant_towards(k, key, i as u32, sc.desired[i]);
            } else {
                sc.growers.push((!e.rejecting, i as u32));
            }
        }
        sc.growers.sort_unstable();
        for &(_, i) in &sc.growers {
            self.grant_towards(k, key, i, sc.desired[i as usize]);
        }
        true
    }
}

/// One thread's share of a batch: keys `ks` (ascending, each `>= base`) of the key
/// table's part `keys` (index `base` onwards).
pub(super) struct Half<'a> {
    pub keys: &'a mut [Option<Key>],
    pub base: u32,
    pub ks: &'a [u32],
}

/// What a thread did with its half: its grants went to its outbox; keys with idle
/// entries were left for the caller.
pub(super) struct HalfDone {
    pub idle: Vec<u32>,
}

/// Recomputes a half of a batch, the agents shared read-only.
fn run_half(
    pass: &mut Pass<'_, Shared<'_>>,
    now: u64,
    half: Half<'_>,
    sc: &mut Scratch,
) -> HalfDone {
    let mut idle = Vec::new();
    for &k in half.ks {
        let Some(key) = half.keys[(k - half.base) as usize].as_mut() else {
            continue;
        };
        key.dirty = false;
        if !pass.recompute(now, k, key, sc) {
            idle.push(k);
        }
    }
    HalfDone { idle }
}

/// [`Allocator::serial_pass`]: a pass over the allocator's agents and outbox, the key
/// table and the scratch buffers.
pub(super) type SerialPass<'a> = (
    Pass<'a, [Option<Agent>]>,
    &'a mut Vec<Option<Key>>,
    &'a mut Scratch,
);

/// [`Allocator::pass_parts`]: the context, the key table, the agents, where grants go
/// and the scratch buffers, borrowed apart.
pub(super) type PassParts<'a> = (
    Ctx<'a>,
    &'a mut Vec<Option<Key>>,
    &'a mut Vec<Option<Agent>>,
    Out<'a>,
    &'a mut Scratch,
);

impl Allocator {
    /// A [`Pass`] over the allocator's own agents and outbox, the key table and the
    /// scratch buffers beside it: what a recomputation on this thread needs.
    pub(super) fn serial_pass(&mut self) -> SerialPass<'_> {
        let (ctx, keys, agents, out, sc) = self.pass_parts();
        let pass = Pass {
            ctx,
            agents: &mut agents[..],
            out,
        };
        (pass, keys, sc)
    }

    /// The read-only context and the split borrows a recomputation needs.
    pub(super) fn pass_parts(&mut self) -> PassParts<'_> {
        let ctx = Ctx {
            rules: &self.rules,
            hysteresis_permille: self.cfg.hysteresis_permille as u64,
            reserve: self.cfg.spare_reserve_permille as f64 / 1000.0,
            learning: self.learning,
            term: self.term,
            lease_ns: AllocatorConfig::ns(self.cfg.lease_ms),
            hold_ns: AllocatorConfig::ns(self.cfg.lease_ms + self.cfg.reclaim_margin_ms),
            drift_ns: AllocatorConfig::ns(self.cfg.drift_margin_ms),
        };
        // Grants go after the tail's once it has any.
        let (outbox, before) = if self.outbox_tail.is_empty() {
            (&mut self.outbox, 0)
        } else {
            (&mut self.outbox_tail, self.outbox.len())
        };
        (
            ctx,
            &mut self.keys,
            &mut self.agents,
            Out {
                next_seq: &mut self.next_seq,
                outbox,
                before,
                transfers: &mut self.graves.transfers,
            },
            &mut self.scratch,
        )
    }

    /// Recomputes live keys `ks` (ascending) now, as `recompute_now` does one by one:
    /// those whose grants fit in the outbox (counting one per entry, when they run on
    /// two threads), the rest left marked, due now. Returns how many were recomputed.
    pub(super) fn recompute_now_all(&mut self, now: u64, ks: &[u32]) -> usize {
        let entries: usize = ks.iter().map(|&k| self.key(k).entries.len()).sum();
        if entries < self.parallel_min_entries {
            return ks.iter().filter(|&&k| self.recompute_now(now, k)).count();
        }
        let mut batch = Vec::with_capacity(ks.len());
        let (mut projected, mut entries) = (self.pending_len(), 0);
        for &k in ks {
            let n = self.key(k).entries.len();
            if self.outbox_fits(projected, n) {
                projected += n;
                entries += n;
                batch.push(k);
            } else {
                self.defer(now, k);
            }
        }
        self.recompute_batch(now, &mut batch, entries);
        batch.len()
    }

    /// Recomputes live keys `ks`, whose grants fit in the outbox and which hold
    /// `entries` entries, now: in their order on this thread below
    /// [`PARALLEL_MIN_ENTRIES`] entries, else sorted by index and split over two
    /// threads. Keys with idle entries are recomputed last, on this thread, once those
    /// are forgotten.
    pub(super) fn recompute_batch(&mut self, now: u64, ks: &mut [u32], entries: usize) {
        if entries < self.parallel_min_entries {
            // The lines a recomputation reads of every entry of `WARM_KEYS` keys,
            // loaded in one tight loop before those keys are recomputed: the entries
            // were last read a report interval ago (cold), and loads with nothing
            // between them overlap their misses, where the recomputation would take
            // them one key at a time. A few keys at a time, so that what is loaded is
            // still in cache when its key's turn comes in a batch of thousands (the
            // default `recompute_delay_ms` gathers ~40 reports' keys).
            for chunk in ks.chunks(WARM_KEYS) {
                let warm = chunk
                    .iter()
                    .filter_map(|&k| self.keys[k as usize].as_ref())
                    .flat_map(|key| key.entries.iter())
                    .fold(0u64, |acc, e| acc ^ e.warm_lines());
                std::hint::black_box(warm);
                for &k in chunk {
                    self.key_mut(k).dirty = false;
                    self.recompute(now, k);
                }
            }
            return;
        }
        ks.sort_unstable();
        let ks = &*ks;
        // Split at half the work: keys below `mid` (by index) on this thread. A key
        // costs about as much as `KEY_COST` entries besides its entries (its own lines
        // and the water-filling's set-up): split by entries alone, the half with the
        // long tail of one-agent keys finished last.
        let work = entries + ks.len() * KEY_COST;
        let (mut cut, mut first_entries) = (ks.len(), 0);
        for (i, &k) in ks.iter().enumerate() {
            first_entries += self.key(k).entries.len();
            if (first_entries + (i + 1) * KEY_COST) * 2 >= work {
                cut = i + 1;
                break;
            }
        }
        let (ks0, ks1) = ks.split_at(cut);
        let mid = ks1.first().map_or(self.keys.len() as u32, |&k| k);
        let n_agents = self.agents.len();
        let first_seq = self.next_seq;
        let second_seq = first_seq + first_entries as u64;
        let mut seq1 = second_seq;
        // This thread fills `outbox`, the other the tail (so neither copies the
        // other's records, and each takes its own page faults): a tail left from an
        // earlier batch joins `outbox` first.
        let mut tail = std::mem::take(&mut self.outbox_tail);
        self.outbox.append(&mut tail);
        self.outbox.reserve(first_entries);
        tail.reserve(entries - first_entries);
        let mut transfers1 = Vec::new();
        let mut sc1 = Scratch::default();
        let (ctx, keys, agents, out0, sc0) = self.pass_parts();
        let hold_ns = ctx.hold_ns;
        let (keys0, keys1) = keys.split_at_mut(mid as usize);
        let agents_ro: &[Option<Agent>] = agents;
        let mut shared0 = Shared {
            agents: agents_ro,
            issued: Issued::new(n_agents),
        };
        let mut shared1 = Shared {
            agents: agents_ro,
            issued: Issued::new(n_agents),
        };
        let mut pass0 = Pass {
            ctx,
            agents: &mut shared0,
            out: out0,
        };
        let (done0, done1) = std::thread::scope(|s| {
            let worker = s.spawn(|| {
                let mut pass1 = Pass {
                    ctx,
                    agents: &mut shared1,
                    out: Out {
                        next_seq: &mut seq1,
                        outbox: &mut tail,
                        before: 0,
                        transfers: &mut transfers1,
                    },
                };
                let half = Half {
                    keys: keys1,
                    base: mid,
                    ks: ks1,
                };
                run_half(&mut pass1, now, half, &mut sc1)
            });
            let half = Half {
                keys: keys0,
                base: 0,
                ks: ks0,
            };
            let done0 = run_half(&mut pass0, now, half, sc0);
            (done0, worker.join().expect("allocation thread panicked"))
        });
        let end0 = *pass0.out.next_seq;
        let (issued0, issued1) = (shared0.issued, shared1.issued);
        issued0.apply(&mut self.agents, hold_ns);
        issued1.apply(&mut self.agents, hold_ns);
        // The second half's records follow the first's, their seqs from `second_seq`.
        let at = self.outbox.len() as u32;
        self.graves
            .transfers
            .extend(transfers1.into_iter().map(|(i, t)| (i + at, t)));
        if !tail.is_empty() {
            if second_seq != end0 {
                self.graves.seq_jumps.push((at, second_seq));
                self.graves.seq_gap += second_seq - end0;
            }
            self.next_seq = seq1;
        }
        self.outbox_tail = tail;
        for k in done0.idle.into_iter().chain(done1.idle) {
            self.recompute(now, k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;
    use bursar_agent::Config;

    const AGENTS: usize = 30;
    const KEYS: usize = 240;
    const RULE_NAMES: [&str; 4] = ["rps", "strict-rps", "open-rps", "conc"];

    fn held(seed: u64, agent: usize, k: usize) -> bool {
        // Every agent on the first few keys, then thinner and thinner.
        k < 4 || (agent as u64 * 7 + k as u64 * 13 + seed).is_multiple_of(k as u64 % 9 + 1)
    }

    fn name_of(k: usize) -> KeyName {
        key(RULE_NAMES[k % 4], &format!("org-{k}"))
    }

    fn lines(seed: u64, agent: usize, round: u64) -> Vec<KeyReport> {
        (0..KEYS)
            .filter(|&k| held(seed, agent, k))
            .map(|k| {
                let x = (agent as u64 * 31 + k as u64 * 17 + seed * 5) % 40;
                line(name_of(k), (round + 1) * (x + 1), round * (x % 3), None)
            })
            .collect()
    }

    /// The same fleet in two allocators, one whose batches all run on two threads
    /// (batches of at least 50 entries) and one on a single thread; `learning`: the
    /// reports arrive while the term is learning, and the whole fleet is recomputed
    /// when it ends (`recompute_dirty`); otherwise after it (then `reallocate_all`).
    /// Then a second round of reports from a few agents is handled before the drain
    /// (small batches: grants after the two threads' tail). Returns the grants of
    /// each, drained, and the allocators.
    fn both(seed: u64, learning: bool) -> [(Vec<Grant>, Allocator); 2] {
        [50, usize::MAX].map(|threshold| {
            let now = 5 * SEC;
            let mut a = if learning {
                // Learning ends at `now + 50 ms` (a lease and margin of 1.1 s).
                Allocator::new(&rules(), quick_config(), 1, now - 1_050 * MS).unwrap()
            } else {
                warm_allocator(1, now)
            };
            a.parallel_min_entries = threshold;
            for i in 0..AGENTS {
                let id = format!("agent-{i}");
                a.handle_hello(now, &hello(&id, 1, 1)).unwrap();
                a.handle_report(now, &report(&id, 1, 2, lines(seed, i, 0)))
                    .unwrap();
            }
            let t = if learning {
                a.handle_timeout(now + 60 * MS);
                now + 60 * MS
            } else {
                a.reallocate_all(now + 20 * MS);
                now + 20 * MS
            };
            a.check_invariants().unwrap();
            if threshold == 50 {
                assert!(
                    !a.outbox_tail.is_empty(),
                    "the batch ran on two threads (learning: {learning})"
                );
            }
            for i in 0..AGENTS / 3 {
                let id = format!("agent-{i}");
                a.handle_report(t, &report(&id, 1, 2 + 250 * MS, lines(seed, i, 1)))
                    .unwrap();
            }
            a.handle_timeout(t + 20 * MS);
            a.check_invariants().unwrap();
            let mut gs: Vec<Grant> = a.drain_grants().collect();
            a.check_invariants().unwrap();
            // A rules reload that changes `rps` and `conc`: their keys are recomputed
            // at once (`recompute_now_all`).
            let changed = RULES
                .replace("burst = 1000\nposture", "burst = 1500\nposture")
                .replace("max_in_flight = 10", "max_in_flight = 7");
            let summary = a.reload(t + 40 * MS, &Config::from_toml(&changed).unwrap());
            assert_eq!(summary.changed.len(), 2, "{summary:?}");
            assert!(summary.keys_recomputed >= KEYS / 3, "{summary:?}");
            assert_eq!(threshold == 50, !a.outbox_tail.is_empty(), "reload batch");
            a.check_invariants().unwrap();
            gs.extend(a.drain_grants());
            a.check_invariants().unwrap();
            (gs, a)
        })
    }

    #[test]
    fn a_batch_on_two_threads_grants_what_one_thread_does_with_seqs_that_still_grow() {
        for learning in [false, true] {
            for seed in 0..3 {
                let [(par, pa), (ser, sa)] = both(seed, learning);
                assert!(pa.entry_count() >= 500, "{} entries", pa.entry_count());
                assert!(par.len() >= pa.entry_count() / 2, "{} grants", par.len());
                assert_eq!(par.len(), ser.len(), "seed {seed}, learning {learning}");
                for gs in [&par, &ser] {
                    assert!(gs.windows(2).all(|w| w[0].seq < w[1].seq), "seqs grow");
                }
                // The same grants in the same order (keys by index either way), only
                // the seqs of the second thread's half differ.
                let gap = par.iter().zip(&ser).filter(|(p, s)| p.seq != s.seq).count();
                assert!(
                    gap > 0,
                    "the second half's seqs start past the first half's"
                );
                for (p, s) in par.iter().zip(&ser) {
                    let p = Grant {
                        seq: 0,
                        ..p.clone()
                    };
                    let s = Grant {
                        seq: 0,
                        ..s.clone()
                    };
                    assert_eq!(p, s, "seed {seed}, learning {learning}");
                }
                for k in 0..KEYS {
                    assert_eq!(pa.key_status(&name_of(k)), sa.key_status(&name_of(k)));
                }
                // What the agents remember of the grants: the same latest seq as the
                // grants say, and the same lease bookkeeping.
                for (x, y) in pa.agents.iter().zip(&sa.agents) {
                    let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
                    let last = par.iter().filter(|g| g.agent == x.id).map(|g| g.seq).max();
                    assert_eq!(last.unwrap_or(0).max(x.last_seq), x.last_seq);
                    assert_eq!(x.unext_min_expiry, y.unext_min_expiry);
                    assert_eq!(x.renew_due_ns, y.renew_due_ns);
                }
            }
        }
    }
}
