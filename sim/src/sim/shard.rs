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
    /// gateway's engine, and offered to the checker. The workload sends nothing to a
    /// gateway the fault schedule has down (its requests go to one that is up); one
    /// found down all the same (every gateway down at once) drops the request.
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
        // A key new to the engine: the client's next new-key poll reports it.
        let poll = !sh.policy.fixed_slices() && !a.poll_pending && a.sync.wants_poll(engine);
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
                    if poll {
                        self.schedule_poll(sh, i);
                    }
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
            Ok(Decision::Rejected(_)) => {}
            Err(e) => {
                let msg = format!("admit refused on {}: {e}", a.name);
                self.violation(msg);
            }
        }
        if poll {
            self.schedule_poll(sh, i);
        }
    }

    /// Queues agent `i`'s new-key poll at its next tick of `new_key_poll_ms` (the
    /// client's ticker, phased per agent), unless one is queued.
    fn schedule_poll(&mut self, sh: &Shared, i: u32) {
        let now = self.now;
        let a = &mut self.agents[i as usize / SHARDS];
        if a.poll_pending {
            return;
        }
        a.poll_pending = true;
        let poll = sh.sc.allocator.new_key_poll_ms * MS;
        let at = now + poll - (now - a.welcomed_at) % poll;
        let inc = a.incarnation;
        self.push(at, Ev::NewKeyPoll(i, inc));
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
            Ev::ToAgentWelcome(i, inc, stream) => {
                if self.reaches(sh, i as usize, inc) && self.opening(i, stream) {
                    let names = &sh.keys;
                    let nkeys = names.len();
                    let a = &mut self.agents[i as usize / SHARDS];
                    let Some(engine) = &a.engine else {
                        return;
                    };
                    let now = a.clock(self.now);
                    let out = a.sync.welcome(
                        engine,
                        now,
                        sh.acfg.lease_ms,
                        sh.acfg.max_keys_per_message,
                        &mut self.demand_buf,
                        |d| engine_key(d, nkeys),
                        |l| key_report(l, names),
                    );
                    self.agents[i as usize / SHARDS].welcomed_at = self.now;
                    self.send_out(sh, i, out);
                    // The stream's timers start: the report ticker (its first tick one
                    // interval on) and the keep-alive pings.
                    let every = sh.sc.allocator.report_interval_ms * MS;
                    self.push(self.now + every, Ev::Report(i, inc, stream));
                    self.push(
                        self.now + KEEPALIVE_INTERVAL_NS,
                        Ev::KeepAlive(i, inc, stream),
                    );
                }
            }
            Ev::ToAgentRefused(i, inc, stream) => {
                if self.reaches(sh, i as usize, inc) && self.opening(i, stream) {
                    self.reconnect(sh, i);
                }
            }
            Ev::WelcomeTimeout(i, inc, stream) => {
                if self.live(i, inc) && self.opening(i, stream) {
                    self.reconnect(sh, i);
                }
            }
            Ev::KeepAlive(i, inc, stream) => {
                if self.live(i, inc) && self.up(i, stream) {
                    // A ping no answer reaches before the timeout: the link is cut from
                    // now until then (a partition healing sooner lets TCP deliver it).
                    let (now, timeout) = (self.now, self.now + KEEPALIVE_TIMEOUT_NS);
                    if sh.net.cut_through(i as usize, now, timeout) {
                        self.push(timeout, Ev::KeepAliveLost(i, inc, stream));
                    } else {
                        self.push(now + KEEPALIVE_INTERVAL_NS, Ev::KeepAlive(i, inc, stream));
                    }
                }
            }
            Ev::KeepAliveLost(i, inc, stream) => {
                if self.live(i, inc) && self.up(i, stream) {
                    // Both ends give the stream up: the allocator's own keep-alive
                    // (the same settings) tells its core, with no link to cross; it
                    // is heard there no sooner than the run's rounds allow (the
                    // shortest link's latency later: the two timers are not in step
                    // anyway).
                    let agent = self.agents[i as usize / SHARDS].name.clone();
                    let term = self.term;
                    let at = self.now + sh.net.lookahead_ns().max(1);
                    let close = ToAlloc::Disconnect {
                        agent,
                        stream,
                        local: true,
                    };
                    self.push(at, Ev::ToAlloc(i, term, Box::new(close)));
                    self.reconnect(sh, i);
                }
            }
            Ev::MeasureEnd(i, inc) => {
                if self.live(i, inc) {
                    // An earlier end that a later request moved finds nothing ended.
                    let names = &sh.keys;
                    let a = &mut self.agents[(i as usize) / SHARDS];
                    let now = a.clock(self.now);
                    let out = a.sync.measure_end(now, self.now, |l| key_report(l, names));
                    self.send_out(sh, i, out);
                }
            }
            Ev::Report(i, inc, stream) => {
                if self.live(i, inc) && self.up(i, stream) {
                    self.tick(sh, i, false);
                    let every = sh.sc.allocator.report_interval_ms * MS;
                    self.push(self.now + every, Ev::Report(i, inc, stream));
                }
            }
            Ev::NewKeyPoll(i, inc) => {
                if self.live(i, inc) {
                    self.agents[(i as usize) / SHARDS].poll_pending = false;
                    // The client polls every tick while a shrink drains.
                    if self.tick(sh, i, true) {
                        self.schedule_poll(sh, i);
                    }
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
            Ev::Hits(i, from, hits) => self.deliver_hits(sh, i, from, &hits),
            Ev::AgentCrash(i) => {
                let a = &mut self.agents[(i as usize) / SHARDS];
                // The process's sockets close with it.
                if a.engine.is_some() && (a.sync.is_up() || a.sync.is_opening()) {
                    let close = ToAlloc::Disconnect {
                        agent: a.name.clone(),
                        stream: a.sync.streams_opened(),
                        local: false,
                    };
                    self.send_to_alloc(sh, i, close);
                }
                let a = &mut self.agents[(i as usize) / SHARDS];
                a.engine = None;
                a.sync = session(0, &sh.sc);
                a.hits.clear();
                a.poll_pending = false;
            }
            Ev::AgentRestart(i) => {
                let a = &mut self.agents[(i as usize) / SHARDS];
                a.incarnation += 1;
                a.engine = Some(Engine::new(sh.config.clone(), Arc::new(DiscardSink)));
                a.sync = session(a.clock(self.now), &sh.sc);
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

    /// Agent `i`'s report tick, or (`poll`) its new-key poll, run by its session and
    /// sent; true if a concurrency shrink still drains.
    fn tick(&mut self, sh: &Shared, i: u32, poll: bool) -> bool {
        let names = &sh.keys;
        let nkeys = names.len();
        let a = &mut self.agents[(i as usize) / SHARDS];
        let Some(engine) = &a.engine else {
            return false;
        };
        let (now, buf) = (a.clock(self.now), &mut self.demand_buf);
        let key_of = |d: &KeyDemand| engine_key(d, nkeys);
        let line = |l: Line<'_, u32>| key_report(l, names);
        let out = if poll {
            a.sync.poll_tick(engine, now, buf, key_of, line)
        } else {
            a.sync.report_tick(engine, now, buf, key_of, line)
        };
        let draining = a.sync.draining() > 0;
        self.send_out(sh, i, out);
        draining
    }

    /// Agent `i`'s stream `stream` is up (not given up since).
    fn up(&self, i: u32, stream: u64) -> bool {
        let s = &self.agents[(i as usize) / SHARDS].sync;
        s.is_up() && s.streams_opened() == stream
    }

    /// Agent `i` waits for the welcome to its stream `stream` (and not to an older one
    /// it gave up).
    fn opening(&self, i: u32, stream: u64) -> bool {
        let s = &self.agents[(i as usize) / SHARDS].sync;
        s.is_opening() && s.streams_opened() == stream
    }

    /// Agent `i`'s stream failed (refused, no welcome in time, or its keep-alive
    /// went unanswered): it closes the connection and opens another after the client's
    /// backoff.
    fn reconnect(&mut self, sh: &Shared, i: u32) {
        let a = &mut self.agents[(i as usize) / SHARDS];
        let stream = a.sync.streams_opened();
        let wait = a.sync.lost(a.clock(self.now), a.rng.next_u64());
        let (inc, agent) = (a.incarnation, a.name.clone());
        self.counters.streams_lost += 1;
        self.push(self.now + wait, Ev::Hello(i, inc));
        let close = ToAlloc::Disconnect {
            agent,
            stream,
            local: false,
        };
        self.send_to_alloc(sh, i, close);
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
        // A connection's close is no message (a TCP FIN), but it crosses the link.
        let bytes = match &m {
            ToAlloc::Hello(h, _) => Some(wire::hello_bytes(h)),
            ToAlloc::Report(r) => Some(wire::report_bytes(r)),
            ToAlloc::Ack(a) => Some(wire::ack_bytes(a)),
            ToAlloc::Disconnect { .. } => None,
        };
        if let Some(b) = bytes {
            self.counters.to_allocator += 1;
            self.counters.to_allocator_bytes += b;
        }
        if let Some(at) = self.link_delay(sh, i as usize) {
            let term = self.term;
            self.push(at, Ev::ToAlloc(i, term, Box::new(m)));
        }
    }

    /// An unknown-handle notice reaches agent `i` (as `sync.rs`): those keys are named
    /// by name again, counting from when they were last named.
    fn deliver_unknown(&mut self, sh: &Shared, i: u32, u: &UnknownHandles) {
        if self.reaches_stream(sh, i as usize, u.incarnation) {
            self.agents[(i as usize) / SHARDS]
                .sync
                .unknown_handles(&u.key_handles);
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

    /// [`Shard::reaches`], and the agent's stream is up: what the allocator sends on a
    /// stream reaches the client only on that stream (one it gave up, or one not yet
    /// welcomed, hears nothing; counted as lost).
    fn reaches_stream(&mut self, sh: &Shared, iu: usize, incarnation: u64) -> bool {
        if !self.reaches(sh, iu, incarnation) {
            return false;
        }
        let up = self.agents[iu / SHARDS].sync.is_up();
        if !up {
            self.counters.lost += 1;
        }
        up
    }

    /// A measure request reaches agent `i` (as `sync.rs`): the keys' start report at
    /// once, their end when the window closes.
    fn deliver_measure(&mut self, sh: &Shared, i: u32, m: MeasureRequest) {
        let iu = i as usize;
        if !self.reaches_stream(sh, iu, m.incarnation) {
            return;
        }
        let names = &sh.keys;
        let a = &mut self.agents[iu / SHARDS];
        let now = a.clock(self.now);
        let (out, end) = a
            .sync
            .measure_request(now, self.now, &m.key_handles, m.window_ms, |l| {
                key_report(l, names)
            });
        let inc = a.incarnation;
        self.send_out(sh, i, out);
        if let Some(at) = end {
            self.push(at, Ev::MeasureEnd(i, inc));
        }
    }

    /// Sends what agent `i`'s session asks for, in order, as the allocator's messages.
    fn send_out(&mut self, sh: &Shared, i: u32, out: Vec<Outgoing<KeyReport, u32>>) {
        for o in out {
            let a = &self.agents[i as usize / SHARDS];
            let m = match o {
                Outgoing::Report {
                    agent_time_ns,
                    lines,
                    measure,
                } => ToAlloc::Report(AllocReport {
                    agent: a.name.clone(),
                    incarnation: a.incarnation,
                    agent_time_ns,
                    keys: lines,
                    measure: match measure {
                        MeasureMark::None => Measure::None,
                        MeasureMark::Start => Measure::Start,
                        MeasureMark::End => Measure::End,
                    },
                }),
                Outgoing::Acks(acks) => ToAlloc::Ack(Ack {
                    agent: a.name.clone(),
                    incarnation: a.incarnation,
                    slices: acks
                        .into_iter()
                        .map(|x| {
                            let k = x.key as usize;
                            slice_ack(x, || sh.keys[k].name.clone())
                        })
                        .collect(),
                }),
            };
            self.send_to_alloc(sh, i, m);
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
                    named: true,
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
            self.push(at, Ev::Hits(j as u32, i, hits.clone()));
        }
    }

    /// Peer `from`'s hits reach agent `i`: its own bucket for each key is debited by
    /// them with `Engine::charge` (past zero if need be: the debt is kept, later
    /// requests wait). Lost if either end is cut off now, as on the allocator's links
    /// (a batch in flight when its sender's partition starts does not arrive).
    fn deliver_hits(&mut self, sh: &Shared, i: u32, from: u32, hits: &[(u32, u64)]) {
        let iu = i as usize;
        let cut = sh.net.peer_cut(iu, self.now) || sh.net.peer_cut(from as usize, self.now);
        if cut || self.agents[iu / SHARDS].engine.is_none() {
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

    /// Agent `i` opens a stream: its hello (with the grants it holds), and the timer
    /// that gives the stream up if no welcome comes.
    fn send_hello(&mut self, sh: &Shared, i: u32) {
        let iu = i as usize;
        let nkeys = sh.keys.len();
        let a = &mut self.agents[iu / SHARDS];
        let Some(engine) = &a.engine else {
            return;
        };
        let now = a.clock(self.now);
        let ts = a
            .sync
            .open(engine, now, &mut self.demand_buf, |d| engine_key(d, nkeys));
        let held = a
            .sync
            .hello_held()
            .map(|(&k, g)| HeldSlice {
                key: sh.keys[k as usize].name.clone(),
                grant: held_grant(g),
            })
            .collect();
        let hello = Hello {
            agent: a.name.clone(),
            incarnation: a.incarnation,
            agent_time_ns: ts,
            weight: 1,
            report_interval_ms: sh.sc.allocator.report_interval_ms,
            held,
            grants_by_handle: true,
            rule_shapes: Vec::new(),
        };
        let (inc, stream) = (a.incarnation, a.sync.streams_opened());
        self.counters.streams_opened += 1;
        self.send_to_alloc(sh, i, ToAlloc::Hello(hello, stream));
        self.push(
            self.now + CONNECT_TIMEOUT_NS,
            Ev::WelcomeTimeout(i, inc, stream),
        );
    }

    /// One grants message reaches agent `i`: applied with one `apply_slices` call and
    /// acknowledged in one ack, as the agent's sync client does (`apply`).
    fn deliver_to_agent(&mut self, sh: &Shared, i: u32, grants: Vec<Grant>) {
        let iu = i as usize;
        // A batch is one stream's: its first grant names the incarnation.
        let incarnation = grants
            .first()
            .map_or(self.agents[iu / SHARDS].incarnation, |g| g.incarnation);
        if !self.reaches_stream(sh, iu, incarnation) {
            return;
        }
        let nkeys = sh.keys.len();
        let a = &mut self.agents[iu / SHARDS];
        let Some(engine) = &a.engine else {
            return;
        };
        let at = a.clock(self.now);
        let (mut updates, mut keys, mut handles) = (Vec::new(), Vec::new(), Vec::new());
        let mut unknown = 0;
        for g in &grants {
            let k = if g.named {
                g.key
                    .values
                    .first()
                    .and_then(|v| key_of(v, nkeys))
                    .unwrap_or(u32::MAX)
            } else {
                // By handle alone, as the client resolves it: the key the handle was
                // given to on this stream (the grant's own name is not on the wire).
                match a.sync.key_of_handle(g.key_handle) {
                    Some(&k) => k,
                    None => {
                        unknown += 1;
                        continue;
                    }
                }
            };
            updates.push(if g.named {
                g.to_slice_update()
            } else {
                g.update_for(&sh.key_names[k as usize])
            });
            keys.push(k);
            handles.push(g.key_handle);
        }
        // The sync client's own handling (folding replaced slots into the tracks,
        // holding back a concurrency shrink's ack until its work drains).
        let granted = a.sync.grants(engine, at, updates, keys, &handles);
        self.counters.grants_refused += unknown + granted.refused.len() as u64;
        let draining = a.sync.draining() > 0;
        self.send_out(sh, i, granted.out);
        // The client's poll reads a draining shrink's in-flight count every tick.
        if draining {
            self.schedule_poll(sh, i);
        }
    }

    /// A lease extension reaches agent `i` (as `sync.rs`: `Engine::extend_slices`; no
    /// answer).
    fn deliver_extension(&mut self, sh: &Shared, i: u32, x: &LeaseExtension) {
        let iu = i as usize;
        if !self.reaches_stream(sh, iu, x.incarnation) {
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
        if a.sync.extension(engine, a.clock(self.now), ext).is_err() {
            self.counters.grants_refused += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review, thirty-first session: a peer's hits were dropped at delivery only if
    /// the receiver was cut off, so a batch in flight when its sender's partition
    /// started still arrived (the allocator's links lose what is in flight when
    /// either end is cut, and the docs promised the same of peer links).
    #[test]
    fn peer_hits_in_flight_are_lost_when_either_end_is_cut_off() {
        // Gateway 0 is cut off from 2 s to 7 s after traffic starts.
        let sc = Scenario::load("partition-one").unwrap();
        assert_eq!(sc.faults[0].agents, vec![0]);
        let mut sim = Sim::new(&sc, 1, "gubernator").unwrap();
        let sh = Arc::clone(&sim.shared);
        let during = sim.t0 + 3 * SEC;
        let shard = &mut sim.shards[1 % SHARDS];
        shard.now = sim.t0;
        shard.static_slices(&sh, 1);
        shard.now = during;
        let hits: Arc<[(u32, u64)]> = vec![(0, 100)].into();
        // From gateway 2, which is not cut off: delivered.
        let lost = shard.counters.lost;
        shard.step(&sh, Ev::Hits(1, 2, Arc::clone(&hits)));
        assert_eq!(shard.counters.lost, lost);
        // From gateway 0, cut off since it was sent: lost.
        shard.step(&sh, Ev::Hits(1, 0, hits));
        assert_eq!(shard.counters.lost, lost + 1);
        assert!(shard.violations.is_empty(), "{:?}", shard.violations);
    }
}
