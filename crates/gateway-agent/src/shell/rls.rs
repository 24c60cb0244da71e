//! Envoy's rate limit service v3 (`ShouldRateLimit`) on the agent's gRPC port.
//!
//! Each descriptor is decided on its own against the rules of the request's domain
//! (plus domainless rules), as Envoy's ratelimit service does; the overall code is
//! `OVER_LIMIT` if any descriptor is. The cost is the descriptor's `hits_addend` when
//! set, else the request's (0 means 1). See [`crate::Engine::decide_hits`] for what a
//! cost means per dimension (requests are admitted, tokens are checked at 0 and charged
//! past zero otherwise). Limits in the request (`RateLimitOverride`) are ignored: limits
//! come from the rules file. A descriptor no rule matches is `OK` with no limit, as in
//! Envoy's service, whatever `[engine] unmatched` says.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bursar_proto::envoy::config::core::v3::HeaderValue;
use bursar_proto::rls::rate_limit_response::{Code, DescriptorStatus, RateLimit, rate_limit};
use bursar_proto::rls::rate_limit_service_server::RateLimitService;
use bursar_proto::rls::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

use super::AgentState;
use super::headers;
use crate::AdmitError;
use crate::clock::Clock;
use crate::config::MAX_DESCRIPTORS;
use crate::engine::Decision;

/// Most descriptors one RLS request may carry.
pub const MAX_RLS_DESCRIPTORS: usize = 64;

/// Which responses carry `response_headers_to_add` (the rate-limit headers Envoy passes
/// on to the client). Envoy's own service sends them only when enabled; they are ~500
/// bytes per response that both ends must encode (docs/BENCHMARKS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RlsHeaders {
    /// Every response.
    Always,
    /// Only `OVER_LIMIT` responses (the client needs `Retry-After`). The default.
    #[default]
    OverLimit,
    /// None.
    Never,
}

/// The service.
#[derive(Clone)]
pub struct Rls {
    state: Arc<AgentState>,
    headers: RlsHeaders,
}

impl Rls {
    /// A service over the agent's state.
    pub fn new(state: Arc<AgentState>, headers: RlsHeaders) -> Rls {
        Rls { state, headers }
    }
}

fn unit(period_ns: u64) -> i32 {
    match period_ns {
        1_000_000_000 => rate_limit::Unit::Second as i32,
        60_000_000_000 => rate_limit::Unit::Minute as i32,
        3_600_000_000_000 => rate_limit::Unit::Hour as i32,
        86_400_000_000_000 => rate_limit::Unit::Day as i32,
        _ => rate_limit::Unit::Unknown as i32,
    }
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument("no descriptors"));
        }
        if req.descriptors.len() > MAX_RLS_DESCRIPTORS {
            return Err(Status::invalid_argument(format!(
                "{} descriptors, at most {MAX_RLS_DESCRIPTORS}",
                req.descriptors.len()
            )));
        }
        let engine = &self.state.engine;
        let now = self.state.clock.now_ns();
        let domain = (!req.domain.is_empty()).then_some(req.domain.as_str());
        let request_hits = if req.hits_addend == 0 {
            1
        } else {
            u64::from(req.hits_addend)
        };
        let mut overall = Code::Ok;
        // True until the first OVER_LIMIT descriptor (whose headers are sent).
        let mut overall_was_ok = true;
        let mut statuses = Vec::with_capacity(req.descriptors.len());
        let mut response_headers = Vec::new();
        // Every descriptor is checked before any is charged: a bad one after good ones
        // refused the call with their budget spent, and Envoy, failing open by
        // default, then let the request through.
        for (i, desc) in req.descriptors.iter().enumerate() {
            if desc.entries.len() > MAX_DESCRIPTORS {
                return Err(Status::invalid_argument(format!(
                    "descriptor {i}: {} entries, at most {MAX_DESCRIPTORS}",
                    desc.entries.len()
                )));
            }
            let entries: Vec<(&str, &str)> = desc
                .entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect();
            if let Err(e) = engine.validate_descriptors(domain, &entries) {
                self.state.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Err(Status::invalid_argument(format!(
                    "descriptor {i}: {e} (nothing was charged)"
                )));
            }
        }
        for desc in req.descriptors.iter() {
            let entries: Vec<(&str, &str)> = desc
                .entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect();
            // An absurd `hits_addend` (Envoy may take it from the request) is the most
            // any limit can hold, which no rule's burst fits: OVER_LIMIT where a rule
            // matches, as Envoy's own service answers, not an error Envoy fails open on.
            let hits = desc
                .hits_addend
                .unwrap_or(request_hits)
                .min(crate::MAX_COST);
            let decision = match engine.decide_hits(now, domain, &entries, hits) {
                Ok(d) => d,
                Err(AdmitError::NoMatchingRule) => {
                    statuses.push(DescriptorStatus {
                        code: Code::Ok as i32,
                        ..Default::default()
                    });
                    continue;
                }
                Err(
                    e @ (AdmitError::Invalid(_)
                    | AdmitError::CostTooLarge { .. }
                    | AdmitError::InvalidTtl { .. }),
                ) => {
                    // Checked above; kept for a check the engine may add.
                    self.state.counters.errors.fetch_add(1, Ordering::Relaxed);
                    return Err(Status::invalid_argument(e.to_string()));
                }
                Err(e) => {
                    self.state.counters.errors.fetch_add(1, Ordering::Relaxed);
                    return Err(Status::unavailable(e.to_string()));
                }
            };
            let code = if decision.is_admitted() {
                self.state.counters.admitted.fetch_add(1, Ordering::Relaxed);
                Code::Ok
            } else {
                self.state.counters.rejected.fetch_add(1, Ordering::Relaxed);
                overall = Code::OverLimit;
                Code::OverLimit
            };
            // Report the limit that tripped, else the most constraining enforce one.
            let shown = headers::tripped(&decision).copied().or_else(|| {
                decision
                    .limits()
                    .iter()
                    .filter(|l| l.mode == crate::Mode::Enforce)
                    .min_by_key(|l| l.remaining())
                    .copied()
            });
            let status = match shown {
                Some(l) => {
                    let rules = engine.rules();
                    let rule = &rules.rules()[l.rule_index()];
                    let (rate, period) = l.rate().unwrap_or((l.limit(), 1_000_000_000));
                    let reset = match &decision {
                        Decision::Rejected(r) => match r.reason {
                            crate::RejectReason::RetryLater {
                                retry_after_ns: Some(ns),
                            } => ns,
                            _ => l.reset_after_ns(),
                        },
                        Decision::Admitted(_) => l.reset_after_ns(),
                    };
                    DescriptorStatus {
                        code: code as i32,
                        current_limit: Some(RateLimit {
                            name: rule.name.clone(),
                            requests_per_unit: u32::try_from(rate).unwrap_or(u32::MAX),
                            unit: unit(period),
                        }),
                        limit_remaining: u32::try_from(l.remaining()).unwrap_or(u32::MAX),
                        duration_until_reset: Some(prost_types::Duration {
                            seconds: (reset / 1_000_000_000) as i64,
                            nanos: (reset % 1_000_000_000) as i32,
                        }),
                    }
                }
                None => DescriptorStatus {
                    code: code as i32,
                    ..Default::default()
                },
            };
            statuses.push(status);
            let wanted = match self.headers {
                // The first OVER_LIMIT descriptor's, as `OverLimit` sends (later ones
                // overwrote them), else the first descriptor's.
                RlsHeaders::Always => {
                    (code == Code::OverLimit && overall_was_ok) || response_headers.is_empty()
                }
                RlsHeaders::OverLimit => code == Code::OverLimit && overall_was_ok,
                RlsHeaders::Never => false,
            };
            overall_was_ok &= code != Code::OverLimit;
            if wanted {
                response_headers = headers::for_decision(engine, &decision);
                if let Decision::Rejected(r) = &decision
                    && let crate::RejectReason::RetryLater { retry_after_ns } = r.reason
                {
                    response_headers.push((
                        "retry-after",
                        headers::retry_after_secs(retry_after_ns).to_string(),
                    ));
                }
            }
        }
        Ok(Response::new(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add: response_headers
                .into_iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    value: v,
                    raw_value: Vec::new(),
                })
                .collect(),
            ..Default::default()
        }))
    }
}
