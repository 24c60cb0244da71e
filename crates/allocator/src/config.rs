//! Allocator settings: plain data with units in the names, a bound on every table, and
//! [`AllocatorConfig::validate`] at start-up.

/// Longest agent id, in bytes.
pub const MAX_AGENT_ID_BYTES: usize = 128;

/// Settings of the allocation core. The rules come from the agent's TOML file
/// (`bursar_agent::Config`); these are the allocator's own knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// Lease of every grant. Default 10,000 ms. An agent that loses the allocator keeps
    /// its grant this long, then follows the rule's posture; the allocator reclaims the
    /// grant `lease_ms + reclaim_margin_ms` after the report it answered. Longer leases
    /// ride out longer allocator outages but delay reclaiming a dead agent's slice and a
    /// new term's first growth (it learns for one lease).
    pub lease_ms: u64,
    /// Subtracted from the agent's lease end (agent clock) so that clock-rate drift
    /// cannot make the agent's lease outlive the allocator's view. Default 200 ms
    /// (2 % of the default lease: far above real oscillator drift).
    pub drift_margin_ms: u64,
    /// Added to the lease end (allocator clock) before a grant is reclaimed. Covers the
    /// agent's maintenance period (it applies its posture on its next `maintain`,
    /// ~100 ms) and scheduling delays. Default 1,000 ms.
    pub reclaim_margin_ms: u64,
    /// Half-life of the demand average. Default 1,000 ms (four report intervals): a
    /// gateway sees a few requests per key per interval, so one report's sample is
    /// Poisson noise of +-50 % and more; with a 250 ms half-life that noise moved rate
    /// between agents that were all offered the same load. A real shift or surge does
    /// not wait for the average: see `demand_jump_permille`.
    pub demand_half_life_ms: u64,
    /// Half-life of the slow demand average that ranks and splits sparse keys (see
    /// `RuleInfo`'s typical cost and docs/tuning.md, "Sparse keys"): a gateway that sees
    /// under one request per key per report reads as 0 or as a surge report by report;
    /// only a long average tells the busiest gateways from the rest. Default 10,000 ms.
    pub sparse_half_life_ms: u64,
    /// A demand sample that differs from the smoothed demand by more than this share
    /// (permille) of the larger of the two (750: the sample is below a quarter of the
    /// average or above four times it), and by more than `demand_jump_floor_permille`
    /// of the key's capacity, replaces the smoothed demand at once: a shift, a surge or
    /// a drained gateway moves the slice in one report instead of several half-lives,
    /// while Poisson noise (rarely beyond both bounds) is smoothed. Default 750 (1,000
    /// never jumps).
    pub demand_jump_permille: u32,
    /// See `demand_jump_permille`: the smallest change, in permille of the key's
    /// capacity (`R + O`, or slots), that may jump. Default 200 (at 100, one gateway of
    /// 16 offered 7.5 % of the limit jumped on noise about once a second).
    pub demand_jump_floor_permille: u32,
    /// Shortest interval a demand sample is measured over (a new key's first report
    /// covers one request). Default 250 ms (one report interval).
    pub min_sample_ms: u64,
    /// When an agent's demand for a key jumps and the key has nothing free for it, the
    /// key's other holders are asked to measure their demand afresh over this window
    /// ([`crate::MeasureRequest`]), at most once per `min_sample_ms` per key: a holder
    /// whose demand moved away is seen within the window instead of up to two report
    /// intervals (its regular reports still cover time before the move). 0 turns it
    /// off. Default 100 ms: at ~5 requests a window a holder still busy reads below a
    /// quarter of its demand (a jump down) about once in 25 requests, and its next
    /// regular report restores it.
    pub measure_window_ms: u64,
    /// A key is recomputed at most this long after its demand changed: reports arriving
    /// together are allocated together (and many agents reporting a new key at once
    /// split it). Recomputations run on a tick of a quarter of it, so a changed key is
    /// recomputed 3/4 to 1 delay after its change. Default 10 ms.
    pub recompute_delay_ms: u64,
    /// Keys with more agents than this are recomputed whole at most every
    /// `large_key_recompute_ms`; in between, a report re-targets only the reporting
    /// agent's entry against the key's last water level (growth still only from what is
    /// free). Default 32.
    pub large_key_entries: usize,
    /// See `large_key_entries`. Default 250 ms (one report interval).
    pub large_key_recompute_ms: u64,
    /// Grants are changed only when the new target differs from the current one by more
    /// than this, in permille of the larger. Shrinks ignore it when another agent's
    /// growth is blocked. Default 50 (5 %).
    pub hysteresis_permille: u32,
    /// A demand change smaller than this (permille) does not mark the key for
    /// recomputation. Default 20.
    pub demand_change_permille: u32,
    /// When demand is below the limit, this share (permille) of the spare capacity stays
    /// free, so a newcomer's first grant needs no revocation round trip. Of the rest,
    /// half is headroom for every agent in proportion to its demand and half goes to
    /// agents that are rejecting (all of it as headroom when none is). An agent counts as
    /// rejecting until its smoothed rejections fall below 2 % of its demand, so spare
    /// capacity does not flap between agents report by report. Default 0: spare capacity
    /// kept free is capacity every rejecting agent goes without, and a newcomer's first
    /// grant waits only one round trip for the shrinks that make room (in the simulator,
    /// 250 cost 0.005-0.03 of utilization on every built-in and made cold keys' first
    /// admission no faster).
    pub spare_reserve_permille: u32,
    /// Overdraft `O` in permille of each rule's rate: the only excess the allocator
    /// ever grants (rate only, never burst). Default 0.
    pub overdraft_permille: u32,
    /// How fast, at most, an agent's clock may run against real time, in parts per
    /// million. Buckets refill by their agent's clock: one running fast by `d` admits
    /// `d` times its rate beyond it. Rates are granted out of `(R + O) / (1 + d)`, so
    /// that the fleet's refill in real time stays within `R + O`. Default 0 (clocks
    /// trusted: NTP-disciplined clocks drift by tens of ppm, an excess of `ppm x R x T`
    /// over a long saturated window); at most 100,000.
    pub clock_drift_ppm: u32,
    /// An agent silent this long (no report, no ack) counts as gone for the purpose of a
    /// hello claiming its id with a new incarnation. Until then such a hello is refused
    /// as a duplicate. Default 1,000 ms.
    pub agent_silence_ms: u64,
    /// Seed of the hashes that identify limit keys (two independent 64-bit hashes of
    /// rule and values). The shell should pass a random one per process, so that
    /// descriptor values chosen by clients cannot be crafted to collide.
    pub hash_seed: u64,
    /// Most agents registered. At the bound, a new agent's hello is refused
    /// (`AgentTableFull`). Default 4,096.
    pub max_agents: usize,
    /// Most limit keys tracked. At the bound, a report naming a new key is refused
    /// (`KeyTableFull`). Default 1,000,000.
    pub max_keys: usize,
    /// Most key-agent entries (demand, grants). At the bound, a report naming a new
    /// pair is refused (`EntryTableFull`). Default 4,000,000 (~200 bytes each).
    pub max_entries: usize,
    /// Most keys in one report, hello or ack. Larger ones are refused whole
    /// (`MessageTooLarge`). Default 10,000.
    pub max_keys_per_message: usize,
    /// Most grants waiting in the outbox. At the bound, no new grant is issued (keys
    /// stay marked and renewals stay due) until the shell drains it. Default 4,000,000.
    pub max_outbox: usize,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            lease_ms: 10_000,
            drift_margin_ms: 200,
            reclaim_margin_ms: 1_000,
            demand_half_life_ms: 1_000,
            sparse_half_life_ms: 10_000,
            demand_jump_permille: 750,
            demand_jump_floor_permille: 200,
            min_sample_ms: 250,
            measure_window_ms: 100,
            recompute_delay_ms: 10,
            large_key_entries: 32,
            large_key_recompute_ms: 250,
            hysteresis_permille: 50,
            demand_change_permille: 20,
            spare_reserve_permille: 0,
            overdraft_permille: 0,
            clock_drift_ppm: 0,
            agent_silence_ms: 1_000,
            hash_seed: 0x6275_7273_6172,
            max_agents: 4_096,
            max_keys: 1_000_000,
            max_entries: 4_000_000,
            max_keys_per_message: 10_000,
            max_outbox: 4_000_000,
        }
    }
}

/// A setting is out of range (operator). Nothing was started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allocator setting `{field}`: {reason}")]
pub struct ConfigError {
    /// The field.
    pub field: &'static str,
    /// What is wrong.
    pub reason: String,
}

impl AllocatorConfig {
    /// Checks every documented constraint.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, reason: String| Err(ConfigError { field, reason });
        if self.lease_ms == 0 || self.lease_ms > 3_600_000 {
            return err("lease_ms", "must be 1 to 3,600,000".into());
        }
        if self.drift_margin_ms >= self.lease_ms {
            return err("drift_margin_ms", "must be below lease_ms".into());
        }
        if self.reclaim_margin_ms > 3_600_000 {
            return err("reclaim_margin_ms", "must be at most 3,600,000".into());
        }
        if self.demand_half_life_ms == 0 {
            return err("demand_half_life_ms", "must be at least 1".into());
        }
        if self.sparse_half_life_ms == 0 {
            return err("sparse_half_life_ms", "must be at least 1".into());
        }
        if self.min_sample_ms == 0 {
            return err("min_sample_ms", "must be at least 1".into());
        }
        let max_window = bursar_agent::sync_core::MAX_MEASURE_WINDOW_MS;
        if self.measure_window_ms > u64::from(max_window) {
            return err(
                "measure_window_ms",
                format!(
                    "must be at most {max_window} (what agents honour), got {}",
                    self.measure_window_ms
                ),
            );
        }
        for (field, v) in [
            ("hysteresis_permille", self.hysteresis_permille),
            ("demand_change_permille", self.demand_change_permille),
            ("demand_jump_permille", self.demand_jump_permille),
            (
                "demand_jump_floor_permille",
                self.demand_jump_floor_permille,
            ),
            ("spare_reserve_permille", self.spare_reserve_permille),
            ("overdraft_permille", self.overdraft_permille),
        ] {
            if v > 1000 {
                return err(field, format!("must be at most 1000, got {v}"));
            }
        }
        if self.clock_drift_ppm > 100_000 {
            return err(
                "clock_drift_ppm",
                format!("must be at most 100,000, got {}", self.clock_drift_ppm),
            );
        }
        for (field, v) in [
            ("max_agents", self.max_agents),
            ("max_keys", self.max_keys),
            ("max_entries", self.max_entries),
            ("max_keys_per_message", self.max_keys_per_message),
            ("max_outbox", self.max_outbox),
        ] {
            if v == 0 {
                return err(field, "must be at least 1".into());
            }
        }
        // Agents, keys and queued grants are indexed by u32.
        for (field, v) in [
            ("max_agents", self.max_agents),
            ("max_keys", self.max_keys),
            ("max_outbox", self.max_outbox),
        ] {
            if v > u32::MAX as usize {
                return err(field, format!("must be at most {}, got {v}", u32::MAX));
            }
        }
        Ok(())
    }

    pub(crate) fn ns(ms: u64) -> u64 {
        ms.saturating_mul(1_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid_and_bad_values_name_their_field() {
        AllocatorConfig::default().validate().unwrap();
        let bad = AllocatorConfig {
            drift_margin_ms: 20_000,
            ..AllocatorConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "drift_margin_ms");
        let bad = AllocatorConfig {
            overdraft_permille: 1001,
            ..AllocatorConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "overdraft_permille");
        let bad = AllocatorConfig {
            measure_window_ms: 10_001,
            ..AllocatorConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "measure_window_ms");
        let bad = AllocatorConfig {
            max_keys: 0,
            ..AllocatorConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "max_keys");
        for (field, bad) in [
            (
                "demand_half_life_ms",
                AllocatorConfig {
                    demand_half_life_ms: 0,
                    ..AllocatorConfig::default()
                },
            ),
            (
                "sparse_half_life_ms",
                AllocatorConfig {
                    sparse_half_life_ms: 0,
                    ..AllocatorConfig::default()
                },
            ),
        ] {
            let e = bad.validate().unwrap_err();
            assert_eq!((e.field, e.reason.as_str()), (field, "must be at least 1"));
        }
    }

    #[test]
    fn tables_indexed_by_u32_refuse_a_bound_above_it_and_name_the_field() {
        let too_many = u32::MAX as usize + 1;
        for (field, bad) in [
            (
                "max_keys",
                AllocatorConfig {
                    max_keys: too_many,
                    ..AllocatorConfig::default()
                },
            ),
            (
                "max_outbox",
                AllocatorConfig {
                    max_outbox: too_many,
                    ..AllocatorConfig::default()
                },
            ),
        ] {
            let e = bad.validate().unwrap_err();
            assert_eq!(e.field, field);
            assert!(e.reason.contains("at most 4294967295"), "{}", e.reason);
        }
    }
}
