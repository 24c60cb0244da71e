//! A shard of the agents' side of a run: a fixed share of the gateways (gateway `i`
//! is in shard `i % SHARDS`), with their events, their links up to the allocator and
//! to their peers, and what they counted. Shards touch nothing of each other's within
//! a round: what one sends another (a peer's hits) crosses over at the round's end, as
//! what they send the allocator does, so the shards and the allocator's side of one
//! round may run on any threads in any order and the run is the same
//! (`Sim::run_loop`).

use super::*;

/// Shards of the agents' side. Fixed whatever the threads, so that a run is the same on
/// one thread or two; more shards than threads let two threads share a round's work
/// evenly whatever the allocator's side takes.
pub(super) const SHARDS: usize = 8;

/// A key's names, read by every shard.
pub(super) struct KeyInfo {
    pub(super) name: KeyName,
    /// The key's `org` descriptor value.
    pub(super) value: String,
}

/// What every shard reads and none changes during a run.
pub(super) struct Shared {
    pub(super) sc: Scenario,
    pub(super) acfg: AllocatorConfig,
    pub(super) config: Config,
    pub(super) policy: Policy,
    pub(super) keys: Vec<KeyInfo>,
    pub(super) agent_names: Vec<Arc<str>>,
    pub(super) key_names: Vec<Arc<KeyName>>,
    pub(super) net: Arc<Net>,
}

/// One request's outcome, for the checker (which sees every shard's in time order at
/// the end of the round).
pub(super) struct Offer {
    pub(super) at: u64,
    pub(super) agent: u32,
    pub(super) key: u32,
    pub(super) cost: u64,
    pub(super) admitted: bool,
}

/// A shard of the agents' side (see the module's docs).
pub(super) struct Shard {
    pub(super) index: usize,
    /// Gateway `i` of this shard at `i / SHARDS`.
    pub(super) agents: Vec<Agent>,
    pub(super) queue: Queue,
    pub(super) now: u64,
    /// The allocator's term, as the agents' streams know it.
    pub(super) term: u64,
    /// Draws of this shard's links up to the allocator and to peers.
    net_rng: Rng,
    pub(super) counters: Counters,
    /// Sent this round, in order: to the allocator, to other shards' gateways.
    pub(super) to_alloc: Vec<(u64, Ev)>,
    pub(super) to_peers: Vec<(u64, Ev)>,
    /// Requests this round, in order.
    pub(super) offers: Vec<Offer>,
    /// Violations this round, in order.
    pub(super) violations: Vec<String>,
    /// A sample at this time asked for the engines' invariants to be checked: done
    /// first in the next round, on the state the sample saw.
    pub(super) check_at: Option<u64>,
    demand_buf: Vec<KeyDemand>,
}

impl Shard {
    pub(super) fn new(index: usize, net_rng: Rng) -> Shard {
        Shard {
            index,
            agents: Vec::new(),
            queue: Queue::default(),
            now: 0,
            term: 1,
            net_rng,
            counters: Counters::default(),
            to_alloc: Vec::new(),
            to_peers: Vec::new(),
            offers: Vec::new(),
            violations: Vec::new(),
            check_at: None,
            demand_buf: Vec::new(),
        }
    }

    /// Queues an event: this shard's own, or one to send at the end of the round.
    pub(super) fn push(&mut self, at: u64, ev: Ev) {
        match ev {
            Ev::ToAlloc(..) => self.to_alloc.push((at, ev)),
            ev if agent_of(&ev).is_some_and(|j| j as usize % SHARDS != self.index) => {
                self.to_peers.push((at, ev))
            }
            ev => self.queue.push(at, ev),
        }
    }

    fn violation(&mut self, msg: String) {
        self.violations.push(msg);
    }

    /// Handles this shard's events before `limit`, in order.
    pub(super) fn run_until(&mut self, sh: &Shared, limit: u64) {
        if let Some(at) = self.check_at.take() {
            for a in &self.agents {
                if let Some(e) = &a.engine
                    && let Err(err) = e.check_invariants(a.clock(at))
                {
                    let msg = format!("{} invariant at {} ms: {err}", a.name, at / MS);
                    self.violations.push(msg);
                }
            }
        }
        while let Some((at, ev)) = self.queue.pop_before(limit) {
            debug_assert!(at >= self.now, "time went backwards");
            self.now = at;
            self.counters.events += 1;
            self.step(sh, ev);
        }
    }

    /// A request the workload sent to gateway `i` for key `k` (input, reserved output,
    /// actual output; its cost is input plus actual output): admitted or not by the
    /// gateway's engine, and offered to the checker. A dead gateway gets no traffic
    /// (its clients went elsewhere).
    fn request(&mut self, sh: &Shared, i: u32, k: u32, (input, reserved, output): (u64, u64, u64)) {
        let w = &sh.sc.workload;
        let cost = input + output;
        let llm = w.llm;
        let complete_after = (output as f64 * w.ms_per_output_token * MS as f64) as u64;
        let now = self.now;
        let a = &mut self.agents[i as usize / SHARDS];
        let Some(engine) = &a.engine else {
            return;
        };
        self.counters.requests += 1;
        let key = &sh.keys[k as usize];
        a.next_request += 1;
        a.id_buf.clear();
        let _ = write!(a.id_buf, "r{}", a.next_request);
        let at = a.clock(now);
        let req = AdmitRequest {
            request_id: &a.id_buf,
            domain: None,
            descriptors: &[("org", &key.value)],
            cost: Cost {
                requests: 1,
                input_tokens: input,
                max_output_tokens: Some(reserved),
            },
            ttl_ms: None,
        };
        let decision = engine.admit(at, &req);
        self.offers.push(Offer {
            at: now,
            agent: i,
            key: k,
            cost,
            admitted: matches!(decision, Ok(Decision::Admitted(_))),
        });
        match decision {
            Ok(Decision::Admitted(_)) => {
                if llm {
                    let (inc, n) = (a.incarnation, a.next_request);
                    self.push(
                        now + complete_after,
                        Ev::Complete(i, inc, k, n, input, output),
                    );
                    return;
                }
                if sh.policy == Policy::Gubernator {
                    *a.hits.entry(k).or_default() += cost;
                }
                let usage = Usage {
                    input_tokens: cost,
                    ..Usage::default()
                };
                if let Err(e) = engine.complete(at, &a.id_buf, usage, CompletionStatus::Ok) {
                    let msg = format!("complete refused on {}: {e}", a.name);
                    self.violation(msg);
                }
            }
            Ok(Decision::Rejected(_)) => {
                // A key the agent has not reported yet is reported at its next poll.
                if !sh.policy.fixed_slices() && !a.sync.contains(&k) && !a.poll_pending {
                    a.poll_pending = true;
                    let poll = sh.sc.allocator.new_key_poll_ms * MS;
                    let at = now + poll - (now + a.phase) % poll;
                    let inc = a.incarnation;
                    self.push(at, Ev::NewKeyPoll(i, inc));
                }
            }
            Err(e) => {
                let msg = format!("admit refused on {}: {e}", a.name);
                self.violation(msg);
            }
        }
    }

    fn step(&mut self, sh: &Shared, ev: Ev) {
        match ev {
            Ev::Request(i, k, input, reserved, output) => {
                self.request(sh, i, k, (input, reserved, output));
            }
            Ev::ToAgent(i, g) => self.deliver_to_agent(sh, i, g),
            Ev::ToAgentExt(i, x) => self.deliver_extension(sh, i, &x),
            Ev::ToAgentMeasure(i, m) => self.deliver_measure(sh, i, *m),
            Ev::ToAgentUnknown(i, u) => self.deliver_unknown(sh, i, &u),
            Ev::MeasureEnd(i, inc) => {
                if self.live(i, inc) {
                    // An earlier end that a later request moved finds nothing ended.
                    let now = self.now;
                    let sync = &mut self.agents[(i as usize) / SHARDS].sync;
                    if let Some(handles) = sync.take_ended_measurement(now) {
                        self.send_measure_reports(sh, i, &handles, Measure::End);
                    }
                }
            }
            Ev::Report(i, inc) => {
                if self.live(i, inc) {
                    self.send_reports(sh, i, false);
                    let every = sh.sc.allocator.report_interval_ms * MS;
                    self.push(self.now + every, Ev::Report(i, inc));
                }
            }
            Ev::NewKeyPoll(i, inc) => {
                if self.live(i, inc) {
                    self.agents[(i as usize) / SHARDS].poll_pending = false;
                    self.send_reports(sh, i, true);
                }
            }
            Ev::Maintain(i, inc) => {
                if self.live(i, inc) {
                    let a = &self.agents[(i as usize) / SHARDS];
                    if let Some(e) = &a.engine {
                        e.maintain(a.clock(self.now));
                    }
                    self.push(self.now + MAINTAIN_NS, Ev::Maintain(i, inc));
                }
            }
            Ev::Hello(i, inc) => {
                if self.live(i, inc) {
                    self.send_hello(sh, i);
                }
            }
            Ev::Complete(i, inc, k, n, input, output) => {
                if self.live(i, inc) {
                    let a = &mut self.agents[(i as usize) / SHARDS];
                    if sh.policy == Policy::Gubernator {
                        *a.hits.entry(k).or_default() += input + output;
                    }
                    a.id_buf.clear();
                    let _ = write!(a.id_buf, "r{n}");
                    let usage = Usage {
                        input_tokens: input,
                        output_tokens: output,
                        ..Usage::default()
                    };
                    let at = a.clock(self.now);
                    if let Some(e) = &a.engine
                        && e.complete(at, &a.id_buf, usage, CompletionStatus::Ok)
                            .is_err()
                    {
                        self.counters.completions_refused += 1;
                    }
                }
            }
            Ev::StaticSlices(i, inc) => {
                if self.live(i, inc) {
                    self.static_slices(sh, i);
                }
            }
            Ev::HitSync(i, inc) => {
                if self.live(i, inc) {
                    self.sync_hits(sh, i);
                    let every = sh.sc.allocator.report_interval_ms * MS;
                    self.push(self.now + every, Ev::HitSync(i, inc));
                }
            }
            Ev::Hits(i, hits) => self.deliver_hits(sh, i, &hits),
            Ev::AgentCrash(i) => {
                let a = &mut self.agents[(i as usize) / SHARDS];
                a.engine = None;
                a.sync = tracks(0, &sh.acfg);
                a.hits.clear();
                a.poll_pending = false;
            }
            Ev::AgentRestart(i) => {
                let a = &mut self.agents[(i as usize) / SHARDS];
                a.incarnation += 1;
                a.engine = Some(Engine::new(sh.config.clone(), Arc::new(DiscardSink)));
                a.sync = tracks(a.clock(self.now), &sh.acfg);
                let inc = a.incarnation;
                let phase = a.phase;
                let report_ns = sh.sc.allocator.report_interval_ms * MS;
                if sh.policy.fixed_slices() {
                    self.push(self.now, Ev::StaticSlices(i, inc));
                    if sh.policy == Policy::Gubernator {
                        self.push(self.now + phase % report_ns + 1, Ev::HitSync(i, inc));
                    }
                } else {
                    self.push(self.now, Ev::Hello(i, inc));
                    self.push(self.now + phase % report_ns + 1, Ev::Report(i, inc));
                }
                self.push(self.now + phase % MAINTAIN_NS, Ev::Maintain(i, inc));
            }
            _ => unreachable!("an allocator's, a workload's or a global event in a shard"),
        }
    }

    fn live(&self, i: u32, inc: u64) -> bool {
        let a = &self.agents[(i as usize) / SHARDS];
        a.incarnation == inc && a.engine.is_some()
    }

    /// Delivery time on agent `agent`'s link up to the allocator, or `None` if the
    /// message is lost (the allocator's side draws the links down).
    fn link_delay(&mut self, sh: &Shared, agent: usize) -> Option<u64> {
        let n = &sh.net.links[agent];
        if sh.net.cut(agent, self.now) || self.net_rng.chance(n.loss) {
            self.counters.lost += 1;
            return None;
        }
        let mut at = self.now + (delay_ms(n, &mut self.net_rng) * MS as f64) as u64;
        if !n.reorder {
            let free = &mut self.agents[agent / SHARDS].up_free_at;
            at = at.max(*free);
            *free = at;
        }
        Some(at)
    }

    fn send_to_alloc(&mut self, sh: &Shared, i: u32, m: ToAlloc) {
        self.counters.to_allocator += 1;
        self.counters.to_allocator_bytes += match &m {
            ToAlloc::Hello(h) => wire::hello_bytes(h),
            ToAlloc::Report(r) => wire::report_bytes(r),
            ToAlloc::Ack(a) => wire::ack_bytes(a),
        };
        if let Some(at) = self.link_delay(sh, i as usize) {
            let term = self.term;
            self.push(at, Ev::ToAlloc(i, term, Box::new(m)));
        }
    }

    /// An unknown-handle notice reaches agent `i` (as `sync.rs`): those keys are named
    /// by name again, counting from when they were last named.
    fn deliver_unknown(&mut self, sh: &Shared, i: u32, u: &UnknownHandles) {
        if self.reaches(sh, i as usize, u.incarnation) {
            self.agents[(i as usize) / SHARDS]
                .sync
                .forget_handles(&u.key_handles);
        }
    }

    /// Whether a message to agent `iu`'s incarnation `incarnation` arrives now: its
    /// link is not cut, it is running, and it is that incarnation (the shells send only
    /// on the stream of the incarnation a message names). Counted as lost if not.
    fn reaches(&mut self, sh: &Shared, iu: usize, incarnation: u64) -> bool {
        let a = &self.agents[iu / SHARDS];
        let ok = !sh.net.cut(iu, self.now) && a.engine.is_some() && a.incarnation == incarnation;
        if !ok {
            self.counters.lost += 1;
        }
        ok
    }

    /// A measure request reaches agent `i` (as `sync.rs`): the keys' start report at
    /// once, their end when the window closes.
    fn deliver_measure(&mut self, sh: &Shared, i: u32, m: MeasureRequest) {
        let iu = i as usize;
        if !self.reaches(sh, iu, m.incarnation) {
            return;
        }
        let max = sh.acfg.max_keys_per_message.max(1);
        let mut handles = m.key_handles;
        handles.truncate(max);
        self.send_measure_reports(sh, i, &handles, Measure::Start);
        let a = &mut self.agents[iu / SHARDS];
        if let Some(at) = a
            .sync
            .open_measurement(&handles, self.now, m.window_ms, max)
        {
            let inc = a.incarnation;
            self.push(at, Ev::MeasureEnd(i, inc));
        }
    }

    /// The reports of a requested measurement for `handles`' keys (those the agent's
    /// stream knows), marked `measure`.
    fn send_measure_reports(&mut self, sh: &Shared, i: u32, handles: &[u64], measure: Measure) {
        let mut keys = Vec::new();
        let names = &sh.keys;
        self.agents[(i as usize) / SHARDS]
            .sync
            .measure_report(handles, |l| keys.push(key_report(l, names)));
        if !keys.is_empty() {
            self.send_report_lines(sh, i, keys, measure);
        }
    }

    /// Report lines in messages of at most `max_keys_per_message` lines (one, empty,
    /// for none), as the sync client sends them.
    fn send_report_lines(&mut self, sh: &Shared, i: u32, keys: Vec<KeyReport>, measure: Measure) {
        let iu = i as usize;
        let max = sh.acfg.max_keys_per_message.max(1);
        let (name, incarnation) = (
            self.agents[iu / SHARDS].name.clone(),
            self.agents[iu / SHARDS].incarnation,
        );
        let mut rest = keys;
        loop {
            let tail = rest.split_off(rest.len().min(max));
            let ts = self.stamp(iu);
            let r = AllocReport {
                agent: name.clone(),
                incarnation,
                agent_time_ns: ts,
                keys: rest,
                measure,
            };
            self.send_to_alloc(sh, i, ToAlloc::Report(r));
            if tail.is_empty() {
                break;
            }
            rest = tail;
        }
    }

    /// The static policy: `(R/N, B/N)` per key, starting full, leased for ever. The
    /// Gubernator-like policy: the whole `(R, B)` per key, likewise.
    fn static_slices(&mut self, sh: &Shared, i: u32) {
        let n = sh.sc.gateways as u64;
        let a = &self.agents[(i as usize) / SHARDS];
        let Some(engine) = &a.engine else {
            return;
        };
        let at = a.clock(self.now);
        let (rate, burst) = if sh.policy == Policy::Gubernator {
            (sh.sc.limit.rate_per_s, sh.sc.limit.burst)
        } else {
            (sh.sc.limit.rate_per_s / n, (sh.sc.limit.burst / n).max(1))
        };
        let updates: Vec<_> = sh
            .key_names
            .iter()
            .map(|k| {
                Grant {
                    agent: sh.agent_names[i as usize].clone(),
                    incarnation: a.incarnation,
                    key: k.clone(),
                    rate,
                    burst,
                    epoch: 1,
                    seq: 1,
                    lease_expires_at_ns: at + 1_000_000 * SEC,
                    fleet_size: n as u32,
                    transfer_tokens: burst,
                    key_handle: 0,
                }
                .to_slice_update()
            })
            .collect();
        let refused = engine
            .apply_slices(at, &updates)
            .iter()
            .filter(|r| r.is_err())
            .count();
        self.counters.grants_refused += refused as u64;
    }

    /// The Gubernator-like policy: agent `i` sends the hits it admitted since its last
    /// sync, one batch to every other agent. A partition cuts the named agents off
    /// from every peer (there is no allocator to lose); loss and latency are drawn per
    /// message as on the allocator links. Hits commute, so links need not be FIFO.
    fn sync_hits(&mut self, sh: &Shared, i: u32) {
        let a = &mut self.agents[(i as usize) / SHARDS];
        if a.hits.is_empty() {
            return;
        }
        let hits: Arc<[(u32, u64)]> = std::mem::take(&mut a.hits).into_iter().collect();
        let bytes = wire::hits_bytes(hits.iter().map(|&(k, h)| (&sh.keys[k as usize].name, h)));
        // To every other gateway: whether a peer is up is not this shard's to know
        // (one that is down loses the message).
        for j in 0..sh.agent_names.len() {
            if j == i as usize {
                continue;
            }
            self.counters.peer += 1;
            self.counters.peer_bytes += bytes;
            // A peer link is as slow and as lossy as the worse of its two ends.
            let (a, b) = (&sh.net.links[i as usize], &sh.net.links[j]);
            let n = NetworkSpec {
                latency_ms: a.latency_ms.max(b.latency_ms),
                jitter_ms: a.jitter_ms.max(b.jitter_ms),
                loss: a.loss.max(b.loss),
                // Peer batches are not held in order (each is its own message).
                reorder: true,
            };
            if sh.net.peer_cut(i as usize, self.now)
                || sh.net.peer_cut(j, self.now)
                || self.net_rng.chance(n.loss)
            {
                self.counters.lost += 1;
                continue;
            }
            let at = self.now + (delay_ms(&n, &mut self.net_rng) * MS as f64) as u64;
            self.push(at, Ev::Hits(j as u32, hits.clone()));
        }
    }

    /// A peer's hits reach agent `i`: its own bucket for each key is debited by them
    /// with `Engine::charge` (past zero if need be: the debt is kept, later requests
    /// wait).
    fn deliver_hits(&mut self, sh: &Shared, i: u32, hits: &[(u32, u64)]) {
        let iu = i as usize;
        if sh.net.peer_cut(iu, self.now) || self.agents[iu / SHARDS].engine.is_none() {
            self.counters.lost += 1;
            return;
        }
        let a = &self.agents[iu / SHARDS];
        let at = a.clock(self.now);
        let Some(engine) = &a.engine else {
            return;
        };
        let mut refused = Vec::new();
        for &(k, h) in hits {
            let req = AdmitRequest {
                request_id: "peer-hits",
                domain: None,
                descriptors: &[("org", &sh.keys[k as usize].value)],
                cost: Cost {
                    requests: 0,
                    input_tokens: h,
                    max_output_tokens: Some(0),
                },
                ttl_ms: None,
            };
            match engine.charge(at, &req) {
                Ok(1) => {}
                Ok(n) => refused.push(format!("{} charged {n} buckets for {h} hits", a.name)),
                Err(e) => refused.push(format!("{} refused {h} peer hits: {e}", a.name)),
            }
        }
        for msg in refused {
            self.violation(msg);
        }
    }

    /// Reads agent `i`'s engine into its sync tracks, as the sync client does: every
    /// key (`refresh`, at a hello), the keys changed since the last walk
    /// (`refresh_changed`, the report tick), or the keys created since the last read
    /// (`refresh_new`, the new-key poll); the last two read everything when the engine
    /// cannot say.
    fn read_keys(&mut self, sh: &Shared, i: usize, read: Read) {
        let nkeys = sh.keys.len();
        let a = &mut self.agents[i / SHARDS];
        let Some(engine) = &a.engine else {
            return;
        };
        let now = a.clock(self.now);
        let (buf, key_of) = (&mut self.demand_buf, |d: &KeyDemand| engine_key(d, nkeys));
        match read {
            Read::All => a.sync.refresh(engine, now, buf, key_of),
            Read::Changed => a.sync.refresh_changed(engine, now, buf, key_of),
            Read::New => a.sync.refresh_new(engine, now, buf, key_of),
        }
    }

    fn stamp(&mut self, i: usize) -> u64 {
        let a = &mut self.agents[i / SHARDS];
        let t = (a.clock(self.now)).max(a.last_ts + 1);
        a.last_ts = t;
        t
    }

    fn send_hello(&mut self, sh: &Shared, i: u32) {
        let iu = i as usize;
        self.read_keys(sh, iu, Read::All);
        let a = &mut self.agents[iu / SHARDS];
        // A new stream starts with a full report and knows no handle of the last one.
        a.sync.new_stream();
        let held = a
            .sync
            .held()
            .map(|(&k, g)| HeldSlice {
                key: sh.keys[k as usize].name.clone(),
                grant: held_grant(g),
            })
            .collect();
        let hello = Hello {
            agent: a.name.clone(),
            incarnation: a.incarnation,
            agent_time_ns: 0,
            weight: 1,
            report_interval_ms: sh.sc.allocator.report_interval_ms,
            held,
        };
        let ts = self.stamp(iu);
        self.send_to_alloc(
            sh,
            i,
            ToAlloc::Hello(Hello {
                agent_time_ns: ts,
                ..hello
            }),
        );
    }

    fn send_reports(&mut self, sh: &Shared, i: u32, only_new: bool) {
        let iu = i as usize;
        if only_new {
            self.read_keys(sh, iu, Read::New);
        } else {
            self.read_keys(sh, iu, Read::Changed);
        }
        let a = &mut self.agents[iu / SHARDS];
        let full = !only_new
            && a.sync
                .next_report_is_full(sh.sc.allocator.full_report_every as u64);
        let mut keys = Vec::new();
        let names = &sh.keys;
        a.sync
            .report(full, only_new, |l| keys.push(key_report(l, names)));
        // Concurrency shrinks whose in-flight work drained, acknowledged with the
        // report (as the client's report tick).
        let drained = a.sync.drained_acks();
        if !drained.is_empty() {
            let ack = Ack {
                agent: a.name.clone(),
                incarnation: a.incarnation,
                slices: drained
                    .into_iter()
                    .map(|x| {
                        let k = x.key as usize;
                        slice_ack(x, || sh.keys[k].name.clone())
                    })
                    .collect(),
            };
            self.send_to_alloc(sh, i, ToAlloc::Ack(ack));
        }
        if keys.is_empty() && only_new {
            return;
        }
        self.send_report_lines(sh, i, keys, Measure::None);
    }

    /// One grants message reaches agent `i`: applied with one `apply_slices` call and
    /// acknowledged in one ack, as the agent's sync client does (`apply`).
    fn deliver_to_agent(&mut self, sh: &Shared, i: u32, grants: Vec<Grant>) {
        let iu = i as usize;
        // A batch is one stream's: its first grant names the incarnation.
        let incarnation = grants
            .first()
            .map_or(self.agents[iu / SHARDS].incarnation, |g| g.incarnation);
        if !self.reaches(sh, iu, incarnation) {
            return;
        }
        let nkeys = sh.keys.len();
        let a = &mut self.agents[iu / SHARDS];
        let Some(engine) = &a.engine else {
            return;
        };
        let at = a.clock(self.now);
        let updates: Vec<_> = grants.iter().map(Grant::to_slice_update).collect();
        let keys: Vec<u32> = grants
            .iter()
            .map(|g| {
                g.key
                    .values
                    .first()
                    .and_then(|v| key_of(v, nkeys))
                    .unwrap_or(u32::MAX)
            })
            .collect();
        let handles: Vec<u64> = grants.iter().map(|g| g.key_handle).collect();
        // The sync client's own `apply` (folding replaced slots into the tracks,
        // holding back a concurrency shrink's ack until its work drains).
        let outcomes = a.sync.apply(engine, at, updates, keys, &handles);
        let mut slices = Vec::with_capacity(grants.len());
        for (g, outcome) in grants.iter().zip(outcomes) {
            match outcome {
                Applied::Ack(x) => slices.push(slice_ack(x, || (*g.key).clone())),
                Applied::Draining | Applied::Held => {}
                Applied::Refused(_) => self.counters.grants_refused += 1,
            }
        }
        if slices.is_empty() {
            return;
        }
        let ack = Ack {
            agent: a.name.clone(),
            incarnation: a.incarnation,
            slices,
        };
        self.send_to_alloc(sh, i, ToAlloc::Ack(ack));
    }

    /// A lease extension reaches agent `i` (as `sync.rs`: `Engine::extend_slices`; no
    /// answer).
    fn deliver_extension(&mut self, sh: &Shared, i: u32, x: &LeaseExtension) {
        let iu = i as usize;
        if !self.reaches(sh, iu, x.incarnation) {
            return;
        }
        let a = &self.agents[iu / SHARDS];
        let Some(engine) = &a.engine else {
            return;
        };
        let ext = SliceExtension {
            epoch: x.epoch,
            through_seq: x.through_seq,
            lease_expires_at_ns: x.lease_expires_at_ns,
        };
        if engine.extend_slices(a.clock(self.now), ext).is_err() {
            self.counters.grants_refused += 1;
        }
    }
}
