//! The agents' streams: `bursar.allocator.v1.Allocator/Sync` over tonic.
//!
//! A stream starts with a hello (protocol version checked here, then the core
//! decides); its reader task converts each report and ack into the core's types and
//! queues it for the core task, waiting when the queue is full (back-pressure on the
//! agent). Malformed messages end the stream with `INVALID_ARGUMENT`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bursar_proto::allocator as pb;
use pb::agent_message::Msg;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::driver::Input;
use crate::{
    Ack, AllocError, HeldGrant, HeldSlice, Hello, KeyName, KeyReport, Measure, Report, SliceAck,
};

/// The tonic service.
#[derive(Clone)]
pub struct Service {
    inputs: mpsc::Sender<Input>,
    hello_timeout: Duration,
    agent_queue_max: usize,
    next_conn: Arc<AtomicU64>,
}

impl Service {
    /// A service queueing inputs on `inputs`.
    pub fn new(
        inputs: mpsc::Sender<Input>,
        hello_timeout: Duration,
        agent_queue_max: usize,
    ) -> Service {
        Service {
            inputs,
            hello_timeout,
            agent_queue_max: agent_queue_max.max(1),
            next_conn: Arc::new(AtomicU64::new(1)),
        }
    }

    /// The tonic server, with the protocol's message size bound both ways.
    pub fn into_server(self) -> pb::allocator_server::AllocatorServer<Service> {
        pb::allocator_server::AllocatorServer::new(self)
            .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(pb::MAX_MESSAGE_BYTES)
    }
}

/// The gRPC status for a refused hello.
pub fn status_of(e: &AllocError) -> Status {
    let msg = e.to_string();
    match e {
        AllocError::DuplicateAgent { .. } => Status::already_exists(msg),
        AllocError::AgentTableFull { .. }
        | AllocError::KeyTableFull { .. }
        | AllocError::EntryTableFull { .. } => Status::resource_exhausted(msg),
        AllocError::StaleIncarnation { .. }
        | AllocError::StaleReport { .. }
        | AllocError::NewerTerm { .. }
        | AllocError::UnknownRule(_) => Status::failed_precondition(msg),
        _ => Status::invalid_argument(msg),
    }
}

fn key(k: Option<pb::Key>) -> Result<KeyName, Status> {
    let k = k.ok_or_else(|| Status::invalid_argument("a key is missing"))?;
    Ok(KeyName {
        rule: k.rule,
        values: k.values,
    })
}

/// A line's key: required unless a handle names it (then it may be absent).
fn key_or_handle(k: Option<pb::Key>, handle: u64) -> Result<KeyName, Status> {
    if handle == 0 {
        return key(k);
    }
    Ok(k.map(|k| KeyName {
        rule: k.rule,
        values: k.values,
    })
    .unwrap_or_default())
}

fn held(h: pb::HeldGrant) -> HeldGrant {
    HeldGrant {
        epoch: h.epoch,
        seq: h.seq,
        rate: h.rate,
        burst: h.burst,
    }
}

fn too_many(n: usize) -> Result<(), Status> {
    if n > pb::MAX_KEYS_PER_MESSAGE {
        return Err(Status::invalid_argument(format!(
            "message names {n} keys, more than {}",
            pb::MAX_KEYS_PER_MESSAGE
        )));
    }
    Ok(())
}

/// A wire hello as the core's (version already checked).
pub fn hello_from_pb(h: pb::Hello) -> Result<Hello, Status> {
    too_many(h.held.len())?;
    let held = h
        .held
        .into_iter()
        .map(|s| {
            Ok(HeldSlice {
                key: key(s.key)?,
                grant: held(
                    s.grant
                        .ok_or_else(|| Status::invalid_argument("a held grant is missing"))?,
                ),
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    Ok(Hello {
        agent: h.agent,
        incarnation: h.incarnation,
        agent_time_ns: h.agent_time_ns,
        weight: h.weight,
        report_interval_ms: h.report_interval_ms,
        held,
        grants_by_handle: h.grants_by_handle,
        rule_shapes: h
            .rule_shapes
            .into_iter()
            .map(|r| (r.rule, r.shape))
            .collect(),
    })
}

/// A wire report as the core's, for the stream's agent.
pub fn report_from_pb(agent: &str, incarnation: u64, r: pb::Report) -> Result<Report, Status> {
    too_many(r.keys.len())?;
    // A value this build does not know is read as a regular report (only slower).
    let measure = match r.measure() {
        pb::Measure::None => Measure::None,
        pb::Measure::Start => Measure::Start,
        pb::Measure::End => Measure::End,
    };
    let keys = r
        .keys
        .into_iter()
        .map(|k| {
            Ok(KeyReport {
                key: key_or_handle(k.key, k.key_handle)?,
                key_handle: k.key_handle,
                admitted: k.admitted,
                rejected: k.rejected,
                counting_since_ns: k.counting_since_ns,
                in_flight: k.in_flight,
                held: k.held.map(held),
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    Ok(Report {
        agent: agent.to_string(),
        incarnation,
        agent_time_ns: r.agent_time_ns,
        keys,
        measure,
    })
}

/// A wire ack as the core's, for the stream's agent.
pub fn ack_from_pb(agent: &str, incarnation: u64, a: pb::Ack) -> Result<Ack, Status> {
    too_many(a.slices.len())?;
    let slices = a
        .slices
        .into_iter()
        .map(|s| {
            Ok(SliceAck {
                key: key_or_handle(s.key, s.key_handle)?,
                key_handle: s.key_handle,
                epoch: s.epoch,
                seq: s.seq,
                released_tokens: s.released_tokens,
                in_flight: s.in_flight,
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    Ok(Ack {
        agent: agent.to_string(),
        incarnation,
        slices,
    })
}

#[tonic::async_trait]
impl pb::allocator_server::Allocator for Service {
    type SyncStream = ReceiverStream<Result<pb::AllocatorMessage, Status>>;

    async fn sync(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(self.hello_timeout, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no hello within the hello timeout"))??;
        let Some(pb::AgentMessage {
            msg: Some(Msg::Hello(h)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "the first message on a stream must be a hello",
            ));
        };
        if h.protocol_version != pb::PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "protocol version {} is not supported (this allocator speaks {})",
                h.protocol_version,
                pb::PROTOCOL_VERSION
            )));
        }
        let hello = hello_from_pb(h)?;
        let (agent, incarnation) = (hello.agent.clone(), hello.incarnation);
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(self.agent_queue_max);
        let weak = tx.downgrade();
        let (reply, answer) = oneshot::channel();
        // Until the reader below runs (it says `Disconnect` when the stream ends), the
        // guard says it if this handler is dropped: a client that resets the stream
        // while its hello waits for the core left the core counting it connected, and
        // the shell holding its connection entry, for good.
        let mut guard = HelloGuard {
            inputs: self.inputs.clone(),
            conn,
            agent: Some(agent.clone()),
        };
        self.inputs
            .send(Input::Hello {
                conn,
                hello,
                tx,
                reply,
            })
            .await
            .map_err(|_| Status::unavailable("the allocator is shutting down"))?;
        answer
            .await
            .map_err(|_| Status::unavailable("the allocator is shutting down"))?
            .map_err(|e| status_of(&e))?;
        let inputs = self.inputs.clone();
        guard.agent = None;
        tokio::spawn(async move {
            loop {
                let m = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(status) => {
                        // E.g. a message over MAX_MESSAGE_BYTES: say why, then end.
                        if let Some(tx) = weak.upgrade() {
                            let _ = tx.try_send(Err(status));
                        }
                        break;
                    }
                };
                let input = match m.msg {
                    Some(Msg::Report(r)) => report_from_pb(&agent, incarnation, r)
                        .map(|report| Input::Report { conn, report }),
                    Some(Msg::Ack(a)) => {
                        ack_from_pb(&agent, incarnation, a).map(|ack| Input::Ack { conn, ack })
                    }
                    Some(Msg::Hello(_)) => Err(Status::invalid_argument(
                        "a stream carries one hello, first",
                    )),
                    None => Err(Status::invalid_argument("an empty message")),
                };
                match input {
                    Ok(i) => {
                        if inputs.send(i).await.is_err() {
                            break;
                        }
                    }
                    Err(status) => {
                        if let Some(tx) = weak.upgrade() {
                            let _ = tx.send(Err(status)).await;
                        }
                        break;
                    }
                }
            }
            let _ = inputs.send(Input::Disconnect { conn, agent }).await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Says `Disconnect` for a stream whose hello handler ends before its reader starts
/// (see `sync`), unless disarmed (`agent` taken).
struct HelloGuard {
    inputs: mpsc::Sender<Input>,
    conn: u64,
    agent: Option<String>,
}

impl Drop for HelloGuard {
    fn drop(&mut self) {
        if let Some(agent) = self.agent.take() {
            let (inputs, conn) = (self.inputs.clone(), self.conn);
            tokio::spawn(async move {
                let _ = inputs.send(Input::Disconnect { conn, agent }).await;
            });
        }
    }
}
