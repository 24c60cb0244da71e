//! The workload: when each key's next request is due, which gateway it goes to and
//! what it costs. It depends on nothing the fleet does, so it is drawn ahead: the
//! requests of the next round are drawn during this one, as one more task
//! (`Sim::run_loop`), and reach their gateways' shards when the round ends.

use super::*;

/// The workload's state (see the module's docs).
pub(super) struct Workload {
    /// When each key's next request (or rate change) is due.
    pub(super) queue: Queue,
    now: u64,
    rng: Rng,
    zipf_cdf: Vec<f64>,
    t0: u64,
    end: u64,
    /// Draw up to here (exclusive) in the next run.
    pub(super) horizon: u64,
    /// Requests drawn, in order, for the shards: (time, event).
    pub(super) out: Vec<(u64, Ev)>,
    pub(super) events: u64,
    /// Per gateway, the times it is down by the fault schedule (`[from, to)`: crashed,
    /// or not yet joined): its requests go to a gateway that is up, as a load balancer
    /// sends them.
    down: Vec<Vec<(u64, u64)>>,
}

impl Workload {
    pub(super) fn new(
        rng: Rng,
        zipf_cdf: Vec<f64>,
        t0: u64,
        end: u64,
        down: Vec<Vec<(u64, u64)>>,
    ) -> Workload {
        Workload {
            down,
            queue: Queue::default(),
            now: 0,
            rng,
            zipf_cdf,
            t0,
            end,
            horizon: 0,
            out: Vec::new(),
            events: 0,
        }
    }

    /// Draws every request due before `limit`.
    pub(super) fn draw_until(&mut self, sh: &Shared, limit: u64) {
        while let Some((at, ev)) = self.queue.pop_before(limit) {
            self.now = at;
            self.events += 1;
            match ev {
                Ev::Rearm(k) => self.schedule_arrival(sh, k),
                Ev::Arrival(k) => {
                    self.arrival(sh, k);
                    self.schedule_arrival(sh, k);
                }
                _ => unreachable!("only the workload's events are in its queue"),
            }
        }
    }

    /// Offered tokens per second on key `k` at `t`, and the next time that may change.
    fn offered_rate(&self, sh: &Shared, k: u32, t: u64) -> (f64, u64) {
        let w = &sh.sc.workload;
        let r = sh.sc.limit.rate_per_s as f64;
        let rel = t.saturating_sub(self.t0);
        match w.kind {
            WorkloadKind::Uniform | WorkloadKind::Zipf | WorkloadKind::Shift => {
                (w.load * r, u64::MAX)
            }
            WorkloadKind::Whale => {
                let at = (w.whale_at_s * SEC as f64) as u64;
                if k != 0 {
                    (w.load * r, u64::MAX)
                } else if rel < at {
                    (w.load * r, self.t0 + at)
                } else {
                    (w.whale_load * r, u64::MAX)
                }
            }
            WorkloadKind::Diurnal => {
                // Piecewise constant in 50 ms steps (Poisson within each step).
                let step = 50 * MS;
                let start = t - t % step;
                let x = start.saturating_sub(self.t0) as f64 / SEC as f64;
                let phase = std::f64::consts::TAU * x / w.diurnal_period_s;
                let f = 1.0 + w.diurnal_amplitude * phase.sin();
                (w.load * r * f, start + step)
            }
            WorkloadKind::Cold => {
                let at = (k as f64 * w.cold_stagger_ms * MS as f64) as u64;
                if rel < at {
                    (0.0, self.t0 + at)
                } else {
                    (w.load * r, u64::MAX)
                }
            }
        }
    }

    fn schedule_arrival(&mut self, sh: &Shared, k: u32) {
        let (rate, change) = self.offered_rate(sh, k, self.now);
        let w = &sh.sc.workload;
        let mean_cost = if w.llm {
            // Lognormal mean (ignoring the clamp) plus the mean actual output.
            let median = ((w.cost_min * w.cost_max) as f64).sqrt();
            median * (w.input_sigma * w.input_sigma / 2.0).exp() + 0.55 * w.output_max_tokens as f64
        } else {
            (w.cost_min + w.cost_max) as f64 / 2.0
        };
        let per_s = rate / mean_cost;
        let next = if per_s > 0.0 {
            let dt = self.rng.exp(SEC as f64 / per_s);
            self.now + (dt as u64).max(1)
        } else {
            u64::MAX
        };
        if next >= change {
            if change <= self.end {
                self.queue.push(change, Ev::Rearm(k));
            }
        } else if next <= self.end {
            self.queue.push(next, Ev::Arrival(k));
        }
    }

    fn pick_agent(&mut self, sh: &Shared, k: u32) -> usize {
        let g = sh.sc.gateways;
        match sh.sc.workload.kind {
            WorkloadKind::Uniform
            | WorkloadKind::Whale
            | WorkloadKind::Cold
            | WorkloadKind::Diurnal => self.rng.below(g as u64) as usize,
            WorkloadKind::Zipf => {
                let u = self.rng.unit();
                let rank = self.zipf_cdf.partition_point(|&c| c <= u).min(g - 1);
                (rank + k as usize * 7) % g
            }
            WorkloadKind::Shift => {
                let every = (sh.sc.workload.shift_every_s * SEC as f64) as u64;
                let phase = (self.now - self.t0) / every.max(1);
                let half = g / 2;
                // Below 1, a request goes to the quiet half with the rest of the share
                // (no draw at 1: the default replays as it did).
                let share = sh.sc.workload.shift_share;
                let busy = share >= 1.0 || self.rng.unit() < share;
                if phase.is_multiple_of(2) == busy {
                    self.rng.below(half as u64) as usize
                } else {
                    half + self.rng.below((g - half) as u64) as usize
                }
            }
        }
    }

    /// Whether gateway `i` is down at `t` by the fault schedule.
    fn is_down(&self, i: usize, t: u64) -> bool {
        self.down
            .get(i)
            .is_some_and(|d| d.iter().any(|&(from, to)| (from..to).contains(&t)))
    }

    /// `i`, or if it is down now, a gateway that is up, drawn uniformly (a load
    /// balancer's choice); `i` itself if every one is down. Draws nothing while `i` is
    /// up, so a run without crashes or joins replays as it always did.
    fn route(&mut self, i: usize) -> usize {
        if !self.is_down(i, self.now) {
            return i;
        }
        let up = (0..self.down.len())
            .filter(|&j| !self.is_down(j, self.now))
            .count();
        if up == 0 {
            return i;
        }
        let nth = self.rng.below(up as u64) as usize;
        (0..self.down.len())
            .filter(|&j| !self.is_down(j, self.now))
            .nth(nth)
            .unwrap_or(i)
    }

    /// A request arrives on key `k`: picks its gateway and draws its costs, for the
    /// gateway's shard.
    fn arrival(&mut self, sh: &Shared, k: u32) {
        let i = self.pick_agent(sh, k);
        let i = self.route(i);
        let w = &sh.sc.workload;
        // (input, reserved output, actual output); the cost is input + actual output.
        let costs = if w.llm {
            let median = ((w.cost_min * w.cost_max) as f64).sqrt();
            let x = median * (w.input_sigma * self.rng.normal()).exp();
            let input = (x as u64).clamp(w.cost_min, w.cost_max);
            let reserved = w.output_max_tokens;
            let output = reserved * (10 + self.rng.below(91)) / 100;
            (input, reserved, output)
        } else {
            (
                w.cost_min + self.rng.below(w.cost_max - w.cost_min + 1),
                0,
                0,
            )
        };
        let (input, reserved, output) = costs;
        self.out
            .push((self.now, Ev::Request(i as u32, k, input, reserved, output)));
    }
}
