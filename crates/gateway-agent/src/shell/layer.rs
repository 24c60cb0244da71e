//! A `tower::Layer` that runs the engine in-process in front of any `tower::Service`
//! over HTTP (axum, tonic, hyper): admit before the inner service, complete when its
//! response is ready.
//!
//! The caller supplies a classifier that turns a request's head into an
//! [`Admission`] (descriptors and cost), or `None` to let it pass unlimited. A
//! rejected request gets 429 (or 400 when it can never fit, 503 on overload) with the
//! rate-limit headers and an empty body, and never reaches the inner service. Usage at
//! completion is what the inner service reports in a [`UsageReport`] response extension;
//! without one, the request is settled as having used its input and no output.
//!
//! With [`AdmissionLayer::with_outbox`] (the engine's sink being that durable outbox),
//! a full outbox answers 503 before the inner service runs, and a response is returned
//! only after its usage record is committed (past the outbox's durable timeout it is
//! returned anyway: the work is done and the record stays queued). Give the layer the
//! clock whose origin the outbox was started with ([`AdmissionLayer::with_clock`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use http::{HeaderName, HeaderValue, Request, Response, StatusCode};

use super::headers;
use crate::clock::{Clock, MonotonicClock};
use crate::engine::{AdmitRequest, Cost, Decision, RejectReason};
use crate::{CompletionStatus, Engine, Usage};

/// What to admit for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Descriptor entries (key, value).
    pub descriptors: Vec<(String, String)>,
    /// The cost.
    pub cost: Cost,
}

/// Usage the inner service reports, as a response extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsageReport(pub Usage);

type Classifier = dyn Fn(&http::request::Parts) -> Option<Admission> + Send + Sync;

/// The layer.
#[derive(Clone)]
pub struct AdmissionLayer {
    engine: Arc<Engine>,
    classify: Arc<Classifier>,
    clock: MonotonicClock,
    ids: Arc<AtomicU64>,
    /// Request ids become ledger event keys with an outbox: a random per-layer prefix
    /// keeps them unique across processes and restarts.
    id_prefix: Arc<str>,
    outbox: Option<Arc<super::outbox::Outbox>>,
}

impl AdmissionLayer {
    /// A layer over `engine` using `classify` to decide what each request costs.
    pub fn new(
        engine: Arc<Engine>,
        classify: impl Fn(&http::request::Parts) -> Option<Admission> + Send + Sync + 'static,
    ) -> AdmissionLayer {
        use std::hash::BuildHasher;
        let nonce = std::collections::hash_map::RandomState::new()
            .hash_one((std::process::id(), std::time::SystemTime::now()));
        AdmissionLayer {
            engine,
            classify: Arc::new(classify),
            clock: MonotonicClock::new(),
            ids: Arc::new(AtomicU64::new(0)),
            id_prefix: format!("layer-{nonce:016x}").into(),
            outbox: None,
        }
    }

    /// Uses `clock` for engine time (the one every other caller of the engine uses,
    /// and whose origin the outbox maps to wall time).
    pub fn with_clock(mut self, clock: MonotonicClock) -> AdmissionLayer {
        self.clock = clock;
        self
    }

    /// Waits for each completion's usage record to be durable in `outbox` (the
    /// engine's sink) before returning the response; refuses with 503 when it is full.
    pub fn with_outbox(mut self, outbox: Arc<super::outbox::Outbox>) -> AdmissionLayer {
        self.outbox = Some(outbox);
        self
    }
}

impl AdmissionLayer {
    /// The layer's clock (engine time of its decisions), e.g. to read levels.
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }
}

impl<S> tower::Layer<S> for AdmissionLayer {
    type Service = Admit<S>;
    fn layer(&self, inner: S) -> Admit<S> {
        Admit {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service the layer wraps around `S`.
#[derive(Clone)]
pub struct Admit<S> {
    inner: S,
    layer: AdmissionLayer,
}

impl<S, B, R> tower::Service<Request<B>> for Admit<S>
where
    S: tower::Service<Request<B>, Response = Response<R>> + Send,
    S::Future: Send + 'static,
    // Held across the wait for the usage record's commit (with an outbox).
    S::Error: Send,
    R: Default + Send + 'static,
{
    type Response = Response<R>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<R>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let Some(adm) = (self.layer.classify)(&parts) else {
            return Box::pin(self.inner.call(Request::from_parts(parts, body)));
        };
        let engine = Arc::clone(&self.layer.engine);
        let clock = self.layer.clock;
        let outbox = self.layer.outbox.clone();
        if let Some(ob) = &outbox
            && ob.check_room().is_err()
        {
            let mut r = Response::new(R::default());
            *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            r.headers_mut()
                .insert("retry-after", HeaderValue::from_static("1"));
            return Box::pin(async move { Ok(r) });
        }
        let id = format!(
            "{}-{}",
            self.layer.id_prefix,
            self.layer.ids.fetch_add(1, Ordering::Relaxed)
        );
        let desc: Vec<(&str, &str)> = adm
            .descriptors
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let decision = engine.admit(
            clock.now_ns(),
            &AdmitRequest {
                request_id: &id,
                domain: None,
                descriptors: &desc,
                cost: adm.cost,
                ttl_ms: None,
            },
        );
        let reject = |status: StatusCode, hs: Vec<(&'static str, String)>| {
            let mut r = Response::new(R::default());
            *r.status_mut() = status;
            for (k, v) in hs {
                if let Ok(v) = HeaderValue::from_str(&v) {
                    r.headers_mut().insert(HeaderName::from_static(k), v);
                }
            }
            r
        };
        match decision {
            Ok(d @ Decision::Admitted(_)) => {
                let hs = headers::for_decision(&engine, &d);
                let fut = self.inner.call(Request::from_parts(parts, body));
                let input = adm.cost.input_tokens;
                Box::pin(async move {
                    let res = fut.await;
                    let (usage, status) = match &res {
                        Ok(r) => (
                            r.extensions().get::<UsageReport>().map_or(
                                Usage {
                                    input_tokens: input,
                                    ..Usage::default()
                                },
                                |u| u.0,
                            ),
                            if r.status().is_server_error() {
                                CompletionStatus::UpstreamError
                            } else {
                                CompletionStatus::Ok
                            },
                        ),
                        Err(_) => (Usage::default(), CompletionStatus::UpstreamError),
                    };
                    let _ = engine.complete(clock.now_ns(), &id, usage, status);
                    if let Some(ob) = &outbox {
                        let _ = ob.durable(ob.ticket()).await;
                    }
                    res.map(|mut r| {
                        for (k, v) in hs {
                            if let Ok(v) = HeaderValue::from_str(&v) {
                                r.headers_mut().insert(HeaderName::from_static(k), v);
                            }
                        }
                        r
                    })
                })
            }
            Ok(d @ Decision::Rejected(_)) => {
                let mut hs = headers::for_decision(&engine, &d);
                let Decision::Rejected(r) = &d else {
                    unreachable!()
                };
                let status = match r.reason {
                    RejectReason::NeverFits { .. } => StatusCode::BAD_REQUEST,
                    RejectReason::RetryLater { retry_after_ns } => {
                        hs.push((
                            "retry-after",
                            headers::retry_after_secs(retry_after_ns).to_string(),
                        ));
                        if headers::no_budget(&d) {
                            StatusCode::SERVICE_UNAVAILABLE
                        } else {
                            StatusCode::TOO_MANY_REQUESTS
                        }
                    }
                };
                let r = reject(status, hs);
                Box::pin(async move { Ok(r) })
            }
            Err(e) => {
                let status = match e {
                    crate::AdmitError::KeyTableFull { .. }
                    | crate::AdmitError::LeaseTableFull { .. } => StatusCode::SERVICE_UNAVAILABLE,
                    crate::AdmitError::NoMatchingRule => StatusCode::FORBIDDEN,
                    _ => StatusCode::BAD_REQUEST,
                };
                let r = reject(status, Vec::new());
                Box::pin(async move { Ok(r) })
            }
        }
    }
}
