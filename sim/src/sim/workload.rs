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
    /// The mean cost of one request ([`mean_cost`]), which spaces the arrivals.
    mean_cost: f64,
}

/// The mean cost of one request: with `llm`, the mean of the input as drawn
/// (lognormal, clamped to `[cost_min, cost_max]`) plus the mean actual output (55 %
/// of the reservation); else the middle of `[cost_min, cost_max]`. The arrivals are
/// spaced by it, so that the offered tokens per second are the stated `load * R`.
/// (The input's truncation to whole tokens, under one token, is left out.)
pub(crate) fn mean_cost(w: &crate::scenario::WorkloadSpec) -> f64 {
    if w.llm {
        let (lo, hi) = (w.cost_min as f64, w.cost_max as f64);
        clamped_lognormal_mean((lo * hi).sqrt(), w.input_sigma, lo, hi)
            + 0.55 * w.output_max_tokens as f64
    } else {
        (w.cost_min as f64 + w.cost_max as f64) / 2.0
    }
}

/// The mean of `clamp(median * exp(sigma * Z), lo, hi)`, `Z` standard normal and
/// `lo <= median <= hi`: `lo` times the mass below it, `hi` times the mass above it,
/// and in between `median * exp(sigma z)` integrated against the normal density over
/// `z` (Simpson's rule: the closed form's `exp(sigma^2 / 2)` overflows at large
/// sigma, while the integrand here never exceeds `hi` times the density). Finite for
/// every finite `sigma >= 0`.
pub(crate) fn clamped_lognormal_mean(median: f64, sigma: f64, lo: f64, hi: f64) -> f64 {
    if lo >= hi {
        return lo;
    }
    if sigma <= 0.0 {
        return median.clamp(lo, hi);
    }
    let mu = median.ln();
    let (alpha, beta) = ((lo.ln() - mu) / sigma, (hi.ln() - mu) / sigma);
    let tails = lo * normal_cdf(alpha) + hi * normal_cdf(-beta);
    // Past 40 standard deviations the density is below 1e-300.
    let (z0, z1) = (alpha.max(-40.0), beta.min(40.0));
    if z0 >= z1 {
        return tails;
    }
    const STEPS: usize = 4_096; // even
    let h = (z1 - z0) / STEPS as f64;
    let f = |z: f64| (mu + sigma * z - z * z / 2.0).exp() / (std::f64::consts::TAU).sqrt();
    let mut sum = f(z0) + f(z1);
    for i in 1..STEPS {
        sum += f(z0 + i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
    }
    tails + sum * h / 3.0
}

/// The standard normal CDF, from the complementary error function of Abramowitz and
/// Stegun 7.1.26 (absolute error below 1.5e-7, and it keeps its relative accuracy in
/// the far tail: no `1 - x` cancellation for `z < 0`).
pub(crate) fn normal_cdf(z: f64) -> f64 {
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let upper = 0.5 * poly * (-x * x).exp(); // P(Z > |z|)
    if z < 0.0 { upper } else { 1.0 - upper }
}

impl Workload {
    pub(super) fn new(
        rng: Rng,
        zipf_cdf: Vec<f64>,
        t0: u64,
        end: u64,
        down: Vec<Vec<(u64, u64)>>,
        mean_cost: f64,
    ) -> Workload {
        Workload {
            down,
            mean_cost,
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
        let per_s = rate / self.mean_cost;
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
            // In f64: the product of two large costs overflows a u64.
            let median = (w.cost_min as f64 * w.cost_max as f64).sqrt();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clamped_lognormal_mean_matches_its_closed_form_and_its_limits() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.96) - 0.975).abs() < 1e-4);
        assert!((normal_cdf(-1.96) - 0.025).abs() < 1e-4);
        let (lo, hi) = (10.0_f64, 2_000.0_f64);
        let median = (lo * hi).sqrt();
        for sigma in [0.5, 1.0, 3.0] {
            // The closed form, fine at these sigmas.
            let mu = median.ln();
            let (a, b) = ((lo.ln() - mu) / sigma, (hi.ln() - mu) / sigma);
            let closed = lo * normal_cdf(a)
                + hi * (1.0 - normal_cdf(b))
                + (mu + sigma * sigma / 2.0).exp()
                    * (normal_cdf(b - sigma) - normal_cdf(a - sigma));
            let m = clamped_lognormal_mean(median, sigma, lo, hi);
            assert!(
                (m - closed).abs() < 1e-3 * closed,
                "sigma {sigma}: {m} vs {closed}"
            );
        }
        // Unclamped in effect: the lognormal's own mean.
        let m = clamped_lognormal_mean(100.0, 0.1, 1.0, 1e9);
        assert!((m - 100.0 * 0.005_f64.exp()).abs() < 1e-6 * m, "{m}");
        // No spread; and so much that every draw is at one end or the other.
        assert_eq!(clamped_lognormal_mean(median, 0.0, lo, hi), median);
        let m = clamped_lognormal_mean(median, 1e6, lo, hi);
        assert!((m - (lo + hi) / 2.0).abs() < 1.0, "{m}");
        assert_eq!(clamped_lognormal_mean(5.0, 2.0, 5.0, 5.0), 5.0);
    }
}
