//! The allocator's side of a run: the events that reach the allocator (messages from
//! agents, its timer, the Doorman-like baseline's tick), the allocator or baseline
//! itself, and the links down to the agents.
//!
//! Neither side can affect the other sooner than the shortest link's latency (every
//! message between them crosses a link), so the run proceeds in rounds of that length
//! (`Sim::run_loop`): the allocator's side and each shard of the agents' side
//! (`shard.rs`) handle their own events of the round, shared out between two threads
//! when the run asks for them, and the messages a round produced cross over at its end.
//! The rounds, and what crosses when, depend on the scenario and seed only: a run
//! replays bit for bit on one thread or two.

use super::*;

/// What both sides read of the network: each gateway's link to the allocator and the
/// partitions in force over time.
pub(super) struct Net {
    pub(super) links: Vec<NetworkSpec>,
    /// Partitions: (start, end, agents).
    pub(super) partitions: Vec<(u64, u64, Vec<usize>)>,
    /// Allocator partitions (every agent loses it; the allocator keeps running).
    pub(super) allocator_cut: Vec<(u64, u64)>,
}

impl Net {
    /// Is `agent` cut off from the allocator at `t`?
    pub(super) fn cut(&self, agent: usize, t: u64) -> bool {
        self.peer_cut(agent, t) || self.allocator_cut.iter().any(|(a, b)| *a <= t && t < *b)
    }

    /// Is `agent` cut off from the allocator from `from` until `to`, throughout (by one
    /// fault, or by several that overlap or meet end to end)? What an unanswered
    /// keep-alive ping sent at `from` needs to go unanswered until `to`.
    pub(super) fn cut_through(&self, agent: usize, from: u64, to: u64) -> bool {
        let spans = || {
            self.partitions
                .iter()
                .filter(|(_, _, set)| set.contains(&agent))
                .map(|(a, b, _)| (*a, *b))
                .chain(self.allocator_cut.iter().copied())
        };
        // Walk forward through the faults in force: each step reaches the furthest
        // end of those covering `t`, until past `to` or a gap.
        let mut t = from;
        loop {
            match spans()
                .filter(|(a, b)| *a <= t && t < *b)
                .map(|(_, b)| b)
                .max()
            {
                Some(b) if b > to => return true,
                Some(b) => t = b,
                None => return false,
            }
        }
    }

    /// Is `agent` cut off by a `partition` fault at `t` (from the allocator, and from
    /// its peers under the Gubernator-like policy)? An allocator partition leaves
    /// peer links alone.
    pub(super) fn peer_cut(&self, agent: usize, t: u64) -> bool {
        self.partitions
            .iter()
            .any(|(a, b, set)| *a <= t && t < *b && set.contains(&agent))
    }

    /// The shortest time a message takes on any agent-allocator link, ns: how far one
    /// side may run ahead of what it has heard from the other.
    pub(super) fn lookahead_ns(&self) -> u64 {
        self.links
            .iter()
            .map(|n| (n.latency_ms * MS as f64) as u64)
            .min()
            .unwrap_or(0)
    }
}

/// The allocator's side of a run (see the module's docs).
pub(super) struct AllocSide {
    pub(super) queue: Queue,
    pub(super) now: u64,
    pub(super) alloc: Option<Allocator>,
    pub(super) naive: Option<Proportional>,
    /// The allocator's term (the agents' side keeps the same number, to stamp its
    /// messages with).
    pub(super) term: u64,
    pub(super) alloc_wake: u64,
    /// Draws of the links down to the agents (the agents' side draws its own).
    rng: Rng,
    /// Earliest delivery time of the next message down each agent's link (FIFO links).
    down_free_at: Vec<u64>,
    /// Each agent's route: the stream whose hello this allocator welcomed last (0:
    /// none), as the shell routes an agent's grants to one connection.
    routes: Vec<u64>,
    /// What this side counted: messages and bytes down, losses, allocator refusals,
    /// events. Added to the agents' side's counters for the report.
    pub(super) counters: Counters,
    /// Messages to agents sent this round, in the order sent: (delivery time, event).
    pub(super) out: Vec<(u64, Ev)>,
    /// A sample at this time asked for the allocator's invariants to be checked: done
    /// first in the next round, on the state the sample saw.
    pub(super) check_at: Option<u64>,
    /// What those checks found.
    pub(super) violations: Vec<String>,
    net: Arc<Net>,
    policy: Policy,
    max_keys_per_message: usize,
    /// The allocator's lease, as its welcome says.
    lease_ms: u64,
    report_ns: u64,
    /// The run's end: no timer is queued past it.
    end: u64,
    agent_names: Vec<Arc<str>>,
    key_names: Vec<Arc<KeyName>>,
}

impl AllocSide {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        alloc: Option<Allocator>,
        naive: Option<Proportional>,
        rng: Rng,
        net: Arc<Net>,
        policy: Policy,
        acfg: &AllocatorConfig,
        report_ns: u64,
        end: u64,
        agent_names: Vec<Arc<str>>,
        key_names: Vec<Arc<KeyName>>,
    ) -> AllocSide {
        AllocSide {
            queue: Queue::default(),
            now: 0,
            alloc,
            naive,
            term: 1,
            alloc_wake: u64::MAX,
            rng,
            down_free_at: vec![0; agent_names.len()],
            routes: vec![0; agent_names.len()],
            counters: Counters::default(),
            out: Vec::new(),
            check_at: None,
            violations: Vec::new(),
            net,
            policy,
            max_keys_per_message: acfg.max_keys_per_message.max(1),
            lease_ms: acfg.lease_ms,
            report_ns,
            end,
            agent_names,
            key_names,
        }
    }

    /// Queues an event of this side, or sends one to the agents' side (at the end of
    /// the round).
    pub(super) fn push(&mut self, at: u64, ev: Ev) {
        match ev {
            Ev::ToAlloc(..) | Ev::AllocWake(_) | Ev::NaiveTick => self.queue.push(at, ev),
            ev => self.out.push((at, ev)),
        }
    }

    /// Handles this side's events before `limit`, in order.
    pub(super) fn run_until(&mut self, limit: u64) {
        if let Some(at) = self.check_at.take()
            && let Some(a) = &self.alloc
            && let Err(e) = a.check_invariants()
        {
            let msg = format!("allocator invariant at {} ms: {e}", at / MS);
            self.violations.push(msg);
        }
        while let Some((at, ev)) = self.queue.pop_before(limit) {
            debug_assert!(at >= self.now, "time went backwards");
            self.now = at;
            self.counters.events += 1;
            self.step(ev);
        }
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            // A stream dies with its allocator: nothing sent to a crashed one reaches the
            // next term.
            Ev::ToAlloc(_, term, _) if term != self.term => self.counters.lost += 1,
            Ev::ToAlloc(i, _, m) => self.deliver(i, *m),
            Ev::AllocWake(term) => {
                if term != self.term || self.now != self.alloc_wake {
                    return;
                }
                self.alloc_wake = u64::MAX;
                if let Some(a) = self.alloc.as_mut() {
                    if a.poll_timeout() <= self.now {
                        a.handle_timeout(self.now);
                    }
                    self.after_input();
                }
            }
            Ev::NaiveTick => {
                let mut grants = Vec::new();
                if let Some(n) = self.naive.as_mut() {
                    n.tick(&self.agent_names, &self.key_names, &mut grants);
                }
                self.send_grants(grants);
                self.push(self.now + self.report_ns, Ev::NaiveTick);
            }
            _ => unreachable!("an agent's event on the allocator's side"),
        }
    }

    /// The allocator crashed: everything it held is gone.
    pub(super) fn crash(&mut self) {
        self.routes.fill(0);
        self.alloc = None;
        self.naive = None;
        self.alloc_wake = u64::MAX;
    }

    /// Delivery time on agent `agent`'s link down, or `None` if the message is lost.
    fn link_delay(&mut self, agent: usize) -> Option<u64> {
        let n = &self.net.links[agent];
        if self.net.cut(agent, self.now) || self.rng.chance(n.loss) {
            self.counters.lost += 1;
            return None;
        }
        let mut at = self.now + (delay_ms(n, &mut self.rng) * MS as f64) as u64;
        if !n.reorder {
            let free = &mut self.down_free_at[agent];
            at = at.max(*free);
            *free = at;
        }
        Some(at)
    }

    fn deliver(&mut self, i: u32, m: ToAlloc) {
        let now = self.now;
        if let ToAlloc::Disconnect {
            agent,
            stream,
            local,
        } = &m
        {
            if !local && self.net.cut(i as usize, now) {
                self.counters.lost += 1;
            } else if let Some(a) = self.alloc.as_mut()
                && self.routes[i as usize] == *stream
            {
                self.routes[i as usize] = 0;
                // An agent this allocator never heard of (a term started since) is not
                // an error worth counting.
                let _ = a.handle_disconnect(now, agent);
            }
            return;
        }
        if self.net.cut(i as usize, self.now) {
            self.counters.lost += 1;
            return;
        }
        if let ToAlloc::Hello(h, stream) = &m {
            // A stream opens: welcomed, or refused (as the allocator's shell answers a
            // hello with a welcome or an error status; a crashed one refuses the
            // connection).
            let (inc, stream) = (h.incarnation, *stream);
            let accepted = match (self.policy, self.naive.as_mut(), self.alloc.as_mut()) {
                (Policy::Doorman, Some(n), _) => {
                    n.hello(i, inc);
                    Ok(())
                }
                (Policy::Doorman, None, _) | (_, _, None) => Err(None),
                (_, _, Some(alloc)) => alloc.handle_hello(now, h).map_err(Some),
            };
            match accepted {
                Ok(()) => {
                    self.routes[i as usize] = stream;
                    self.counters.to_agents += 1;
                    self.counters.to_agents_bytes +=
                        wire::welcome_bytes(self.term, self.max_keys_per_message, self.lease_ms);
                    if let Some(at) = self.link_delay(i as usize) {
                        self.push(at, Ev::ToAgentWelcome(i, inc, stream));
                    }
                }
                Err(e) => {
                    if let Some(e) = e {
                        self.refused(&e);
                    }
                    if let Some(at) = self.link_delay(i as usize) {
                        self.push(at, Ev::ToAgentRefused(i, inc, stream));
                    }
                }
            }
            self.after_input();
            return;
        }
        if self.policy == Policy::Doorman {
            let Some(n) = self.naive.as_mut() else {
                self.counters.lost += 1;
                return;
            };
            match &m {
                ToAlloc::Hello(..) | ToAlloc::Disconnect { .. } => {}
                ToAlloc::Report(r) => {
                    for k in &r.keys {
                        if let Some(key) = k
                            .key
                            .values
                            .first()
                            .and_then(|v| key_of(v, self.key_names.len()))
                        {
                            n.report(
                                i,
                                key,
                                r.incarnation,
                                r.agent_time_ns,
                                k.counting_since_ns,
                                k.admitted + k.rejected,
                            );
                        }
                    }
                }
                ToAlloc::Ack(_) => {}
            }
            return;
        }
        let Some(alloc) = self.alloc.as_mut() else {
            self.counters.lost += 1;
            return;
        };
        let r = match &m {
            ToAlloc::Hello(..) | ToAlloc::Disconnect { .. } => Ok(()),
            ToAlloc::Report(r) => alloc.handle_report(now, r),
            ToAlloc::Ack(a) => alloc.handle_ack(now, a),
        };
        if let Err(e) = r {
            self.refused(&e);
        }
        self.after_input();
    }

    /// Counts an input the allocator refused, by its error's kind.
    fn refused(&mut self, e: &AllocError) {
        let dbg = format!("{e:?}");
        let name: String = dbg.chars().take_while(|c| c.is_alphanumeric()).collect();
        *self.counters.allocator_refusals.entry(name).or_default() += 1;
    }

    fn after_input(&mut self) {
        let Some(alloc) = self.alloc.as_mut() else {
            return;
        };
        let grants: Vec<Grant> = alloc.drain_grants().collect();
        // Revocations follow a reload that removes or replaces rules, or an agent's
        // line of a rule its file gives another meaning: neither happens here (no
        // reloads, and the simulated agents send no rule shapes).
        debug_assert_eq!(alloc.pending_revocations(), 0);
        let extensions = alloc.drain_extensions();
        let measures = alloc.drain_measure_requests();
        let unknown = alloc.drain_unknown_handles();
        self.send_grants(grants);
        self.send_extensions(extensions);
        self.send_measures(measures);
        for u in unknown {
            let (agent, bytes) = (Arc::clone(&u.agent), wire::unknown_keys_bytes(&u));
            self.send_one(&agent, bytes, |i| Ev::ToAgentUnknown(i, Box::new(u)));
        }
        self.schedule_wake();
    }

    /// Sends drained grants as the allocator's shell does (`shell/driver.rs`,
    /// `route`): batched per agent stream (agent and incarnation), at most
    /// `max_keys_per_message` grants per message.
    fn send_grants(&mut self, grants: Vec<Grant>) {
        let mut batches: BTreeMap<(usize, u64), Vec<Grant>> = BTreeMap::new();
        for g in grants {
            let Some(i) = self.agent_index(&g.agent) else {
                continue;
            };
            batches.entry((i, g.incarnation)).or_default().push(g);
        }
        let max = self.max_keys_per_message;
        for ((i, _), mut rest) in batches {
            loop {
                let tail = rest.split_off(rest.len().min(max));
                self.counters.to_agents += 1;
                self.counters.grants += rest.len() as u64;
                self.counters.to_agents_bytes += wire::grants_bytes(&rest);
                if let Some(at) = self.link_delay(i) {
                    self.push(at, Ev::ToAgent(i as u32, rest));
                }
                if tail.is_empty() {
                    break;
                }
                rest = tail;
            }
        }
    }

    /// Sends drained measure requests, one message each, after the grants and
    /// extensions (as the shell's `route`).
    fn send_measures(&mut self, measures: Vec<MeasureRequest>) {
        for m in measures {
            let (agent, bytes) = (Arc::clone(&m.agent), wire::measure_request_bytes(&m));
            if self.send_one(&agent, bytes, |i| Ev::ToAgentMeasure(i, Box::new(m))) {
                self.counters.measure_requests += 1;
            }
        }
    }

    /// Sends drained lease extensions, one message each, after the grants (as the
    /// shell's `route`).
    fn send_extensions(&mut self, extensions: Vec<LeaseExtension>) {
        for x in extensions {
            let (agent, bytes) = (Arc::clone(&x.agent), wire::extension_bytes(&x));
            if self.send_one(&agent, bytes, |i| Ev::ToAgentExt(i, Box::new(x))) {
                self.counters.extensions += 1;
            }
        }
    }

    /// One message to agent `agent` (`bytes` encoded), counted, on its link: false if
    /// no such agent.
    fn send_one(&mut self, agent: &str, bytes: u64, ev: impl FnOnce(u32) -> Ev) -> bool {
        let Some(i) = self.agent_index(agent) else {
            return false;
        };
        self.counters.to_agents += 1;
        self.counters.to_agents_bytes += bytes;
        if let Some(at) = self.link_delay(i) {
            self.push(at, ev(i as u32));
        }
        true
    }

    fn agent_index(&self, name: &str) -> Option<usize> {
        // Agent names are `gw-<index>`.
        let i: usize = name.strip_prefix("gw-")?.parse().ok()?;
        (i < self.agent_names.len()).then_some(i)
    }

    /// Queues the allocator's next timer (if earlier than the one queued).
    pub(super) fn schedule_wake(&mut self) {
        let Some(alloc) = self.alloc.as_ref() else {
            return;
        };
        let t = alloc.poll_timeout().max(self.now);
        if t < self.alloc_wake && t <= self.end {
            self.alloc_wake = t;
            let term = self.term;
            self.push(t, Ev::AllocWake(term));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review, twenty-fifth session: two back-to-back partitions cut an agent off for
    /// their whole span, but neither alone covered a keep-alive window, so the stream
    /// never broke as it does under one fault of the same span.
    #[test]
    fn faults_that_meet_end_to_end_cut_through_as_one() {
        let net = Net {
            links: Vec::new(),
            partitions: vec![(2 * SEC, 5 * SEC, vec![0]), (5 * SEC, 9 * SEC, vec![0, 1])],
            allocator_cut: vec![(9 * SEC, 10 * SEC)],
        };
        assert!(net.cut_through(0, 3 * SEC, 8 * SEC));
        assert!(
            net.cut_through(0, 2 * SEC, 9 * SEC + 500 * MS),
            "with the allocator cut"
        );
        assert!(
            !net.cut_through(1, 3 * SEC, 8 * SEC),
            "agent 1 is cut from 5 s only"
        );
        assert!(net.cut_through(1, 5 * SEC, 8 * SEC));
        assert!(
            !net.cut_through(0, 3 * SEC, 10 * SEC),
            "up to 10 s, not through it"
        );
        assert!(!net.cut_through(0, SEC, 3 * SEC), "not before 2 s");
    }
}
