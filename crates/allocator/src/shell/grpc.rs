//! The agents' streams: `bursar.allocator.v1.Allocator/Sync` over tonic.
//!
//! A stream starts with a hello (protocol version checked here, then the core
//! decides); its reader task converts each report and ack into the core's types and
//! queues it for the core task, waiting when the queue is full (back-pressure on the
//! agent). Malformed messages end the stream with `INVALID_ARGUMENT`.
//!
//! Two bounds hold across every stream ([`Gate`]): the bytes of converted input
//! waiting for the core (each queued hello, report and ack holds its share of the
//! budget until the core has handled it, so a reader waits, and TCP pushes back on its
//! agent, once the budget is spent), and the streams still waiting for their hello's
//! answer (one more is refused at once with `RESOURCE_EXHAUSTED`).

use std::mem::size_of;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bursar_proto::allocator as pb;
use pb::agent_message::Msg;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::driver::Input;
use crate::{
    Ack, AllocError, HeldGrant, HeldSlice, Hello, KeyName, KeyReport, Measure, Report, SliceAck,
};

/// The bounds every stream shares: bytes of input queued for the core, and streams
/// waiting for their hello's answer.
#[derive(Debug)]
pub struct Gate {
    bytes: Arc<Semaphore>,
    bytes_max: u32,
    pending: Arc<Semaphore>,
    pending_max: usize,
    streams_refused: AtomicU64,
    bytes_waits: AtomicU64,
    connections: Arc<super::conns::ConnectionCap>,
}

/// What [`Gate`] shows the admin endpoint.
#[derive(Clone, Copy, Debug, Default)]
pub struct GateStatus {
    /// The byte budget of queued input.
    pub input_bytes_max: u64,
    /// Bytes of it held by inputs the core has not handled yet (and set aside for a
    /// reader waiting for the rest of its share).
    pub input_bytes_queued: u64,
    /// Times a stream's reader waited for the budget (its agent was held back).
    pub input_bytes_waits: u64,
    /// Streams allowed to wait for their hello's answer at once.
    pub pending_hellos_max: u64,
    /// Streams waiting for their hello's answer now.
    pub pending_hellos: u64,
    /// Streams refused because that many were waiting already.
    pub streams_refused: u64,
    /// Open TCP connections to the stream port allowed at once.
    pub connections_max: u64,
    /// Open now.
    pub connections_open: u64,
    /// Connections closed at accept because that many were open.
    pub connections_refused: u64,
    /// Connections closed because they opened no stream within the first-stream
    /// timeout.
    pub connections_silent: u64,
}

impl Gate {
    /// A gate with a budget of `bytes_max` bytes (at most `u32::MAX`), at most
    /// `pending_max` streams waiting for their hello's answer and `connections_max`
    /// connections open (each at least 1), each closed unless it opens a stream within
    /// `first_stream_timeout`.
    pub fn new(
        bytes_max: usize,
        pending_max: usize,
        connections_max: usize,
        first_stream_timeout: Duration,
    ) -> Gate {
        let bytes_max = bytes_max.clamp(1, u32::MAX as usize) as u32;
        let pending_max = pending_max.clamp(1, Semaphore::MAX_PERMITS);
        Gate {
            bytes: Arc::new(Semaphore::new(bytes_max as usize)),
            bytes_max,
            pending: Arc::new(Semaphore::new(pending_max)),
            pending_max,
            streams_refused: AtomicU64::new(0),
            bytes_waits: AtomicU64::new(0),
            connections: Arc::new(super::conns::ConnectionCap::new(
                connections_max,
                first_stream_timeout,
            )),
        }
    }

    /// The cap on the stream port's connections.
    pub fn connections(&self) -> &Arc<super::conns::ConnectionCap> {
        &self.connections
    }

    /// Its counters now.
    pub fn status(&self) -> GateStatus {
        GateStatus {
            input_bytes_max: self.bytes_max as u64,
            input_bytes_queued: (self.bytes_max as usize)
                .saturating_sub(self.bytes.available_permits())
                as u64,
            input_bytes_waits: self.bytes_waits.load(Ordering::Relaxed),
            pending_hellos_max: self.pending_max as u64,
            pending_hellos: self
                .pending_max
                .saturating_sub(self.pending.available_permits())
                as u64,
            streams_refused: self.streams_refused.load(Ordering::Relaxed),
            connections_max: self.connections.max(),
            connections_open: self.connections.open(),
            connections_refused: self.connections.refused(),
            connections_silent: self.connections.silent(),
        }
    }

    /// Takes `bytes` of the budget (all of it for an input larger than the whole
    /// budget: such an input waits until nothing else is queued), waiting while it is
    /// spent.
    pub async fn charge(&self, bytes: usize) -> Charge {
        let n = bytes.clamp(1, self.bytes_max as usize) as u32;
        let permit = match Arc::clone(&self.bytes).try_acquire_many_owned(n) {
            Ok(p) => p,
            Err(_) => {
                self.bytes_waits.fetch_add(1, Ordering::Relaxed);
                Arc::clone(&self.bytes)
                    .acquire_many_owned(n)
                    .await
                    .expect("the gate's semaphore is never closed")
            }
        };
        Charge(Some(permit))
    }
}

/// An input's share of the byte budget, given back when the input is dropped (after
/// the core has handled it).
#[derive(Debug, Default)]
pub struct Charge(#[allow(dead_code)] Option<OwnedSemaphorePermit>); // held for its drop

impl Charge {
    /// No share (inputs that do not come from a stream).
    pub const NONE: Charge = Charge(None);
}

/// Heap and inline bytes a converted key holds, about.
fn key_bytes(k: &KeyName) -> usize {
    k.rule.len()
        + k.values
            .iter()
            .map(|v| v.len() + size_of::<String>())
            .sum::<usize>()
}

/// Bytes a converted hello holds, about (what it is charged).
pub fn hello_bytes(h: &Hello) -> usize {
    size_of::<Hello>()
        + h.agent.len()
        + h.held.len() * size_of::<HeldSlice>()
        + h.held.iter().map(|s| key_bytes(&s.key)).sum::<usize>()
        + h.rule_shapes
            .iter()
            .map(|(r, _)| r.len() + size_of::<(String, u64)>())
            .sum::<usize>()
}

/// Bytes a converted report holds, about (what it is charged).
pub fn report_bytes(r: &Report) -> usize {
    size_of::<Report>()
        + r.agent.len()
        + r.keys.len() * size_of::<KeyReport>()
        + r.keys.iter().map(|k| key_bytes(&k.key)).sum::<usize>()
}

/// Bytes a converted ack holds, about (what it is charged).
pub fn ack_bytes(a: &Ack) -> usize {
    size_of::<Ack>()
        + a.agent.len()
        + a.slices.len() * size_of::<SliceAck>()
        + a.slices.iter().map(|s| key_bytes(&s.key)).sum::<usize>()
}

/// The tonic service.
#[derive(Clone)]
pub struct Service {
    inputs: mpsc::Sender<Input>,
    hello_timeout: Duration,
    agent_queue_max: usize,
    next_conn: Arc<AtomicU64>,
    gate: Arc<Gate>,
}

impl Service {
    /// A service queueing inputs on `inputs`, within `gate`'s bounds.
    pub fn new(
        inputs: mpsc::Sender<Input>,
        hello_timeout: Duration,
        agent_queue_max: usize,
        gate: Arc<Gate>,
    ) -> Service {
        Service {
            inputs,
            hello_timeout,
            agent_queue_max: agent_queue_max.max(1),
            next_conn: Arc::new(AtomicU64::new(1)),
            gate,
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
        super::conns::mark_stream_opened(&request);
        // Held until the hello is answered (or the stream ends before).
        let Ok(_pending) = Arc::clone(&self.gate.pending).try_acquire_owned() else {
            self.gate.streams_refused.fetch_add(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted(format!(
                "{} streams are waiting for their hello's answer already \
                 (--pending-hellos-max); retry later",
                self.gate.pending_max
            )));
        };
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
        let charge = self.gate.charge(hello_bytes(&hello)).await;
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
                charge,
            })
            .await
            .map_err(|_| Status::unavailable("the allocator is shutting down"))?;
        answer
            .await
            .map_err(|_| Status::unavailable("the allocator is shutting down"))?
            .map_err(|e| status_of(&e))?;
        let inputs = self.inputs.clone();
        let gate = Arc::clone(&self.gate);
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
                // A newer stream of this agent took the route (the core task held the
                // only sender): this one is read no further.
                if weak.strong_count() == 0 {
                    break;
                }
                let input = match m.msg {
                    Some(Msg::Report(r)) => report_from_pb(&agent, incarnation, r).map(|report| {
                        (
                            report_bytes(&report),
                            Input::Report {
                                conn,
                                report,
                                charge: Charge::NONE,
                            },
                        )
                    }),
                    Some(Msg::Ack(a)) => ack_from_pb(&agent, incarnation, a).map(|ack| {
                        (
                            ack_bytes(&ack),
                            Input::Ack {
                                conn,
                                ack,
                                charge: Charge::NONE,
                            },
                        )
                    }),
                    Some(Msg::Hello(_)) => Err(Status::invalid_argument(
                        "a stream carries one hello, first",
                    )),
                    None => Err(Status::invalid_argument("an empty message")),
                };
                match input {
                    Ok((bytes, mut i)) => {
                        // The budget first: while it is spent, this stream is not read
                        // and TCP holds its agent back.
                        let charged = tokio::select! {
                            c = gate.charge(bytes) => c,
                            _ = inputs.closed() => break,
                        };
                        i.set_charge(charged);
                        if inputs.send(i).await.is_err() {
                            break;
                        }
                    }
                    Err(status) => {
                        // Without waiting: a peer that does not read would hold this
                        // reader, its stream and its Disconnect for ever.
                        if let Some(tx) = weak.upgrade() {
                            let _ = tx.try_send(Err(status));
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

#[cfg(test)]
mod tests {
    use super::*;
    use pb::allocator_client::AllocatorClient;

    fn line(i: usize) -> pb::KeyReport {
        pb::KeyReport {
            key: Some(pb::Key {
                rule: "org-rps".into(),
                values: vec![format!("tenant-{i:0>24}")],
            }),
            admitted: 1,
            rejected: 0,
            counting_since_ns: 1,
            in_flight: 0,
            held: None,
            key_handle: 0,
        }
    }

    fn report(time: u64, keys: usize) -> pb::AgentMessage {
        pb::AgentMessage {
            msg: Some(Msg::Report(pb::Report {
                agent_time_ns: time,
                keys: (0..keys).map(line).collect(),
                measure: 0,
            })),
        }
    }

    /// A real server and client over loopback; the test stands in for the core task,
    /// so it decides when queued inputs are handled (dropped).
    #[tokio::test]
    async fn queued_input_stays_within_the_byte_budget_and_every_report_arrives_in_order() {
        const BUDGET: usize = 8 * 1024;
        const REPORTS: u64 = 200;
        let gate = Arc::new(Gate::new(BUDGET, 4, 64, Duration::from_secs(10)));
        let (tx, mut rx) = mpsc::channel(10_000);
        let svc = Service::new(tx, Duration::from_secs(5), 16, Arc::clone(&gate)).into_server();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
        );
        let mut client = AllocatorClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let (out, out_rx) = mpsc::channel(1_000);
        out.send(pb::AgentMessage {
            msg: Some(Msg::Hello(pb::Hello {
                protocol_version: pb::PROTOCOL_VERSION,
                agent: "node-a".into(),
                incarnation: 1,
                weight: 1,
                agent_time_ns: 1,
                held: vec![],
                config_version: String::new(),
                report_interval_ms: 250,
                grants_by_handle: false,
                rule_shapes: vec![],
            })),
        })
        .await
        .unwrap();
        let call = tokio::spawn(async move { client.sync(ReceiverStream::new(out_rx)).await });
        let Some(Input::Hello {
            reply, tx: route, ..
        }) = rx.recv().await
        else {
            panic!("the hello comes first");
        };
        reply.send(Ok(())).unwrap();
        let _inbound = call.await.unwrap().expect("accepted");
        // Many small reports, then one larger than the whole budget.
        for t in 2..REPORTS + 1 {
            out.send(report(t, 5)).await.unwrap();
        }
        out.send(report(REPORTS + 1, 100)).await.unwrap();

        // Nothing handled yet: the reader fills the budget, then waits.
        let t0 = std::time::Instant::now();
        while gate.status().input_bytes_waits == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the reader never waited"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut held = Vec::new();
        while let Ok(i) = rx.try_recv() {
            held.push(i);
        }
        let bytes: usize = held
            .iter()
            .map(|i| match i {
                Input::Report { report, .. } => report_bytes(report),
                other => panic!("only reports: {other:?}"),
            })
            .sum();
        let status = gate.status();
        assert!(
            !held.is_empty() && held.len() < REPORTS as usize,
            "{}",
            held.len()
        );
        assert!(bytes <= BUDGET, "{bytes} bytes queued, budget {BUDGET}");
        // Every queued byte is charged (a waiting reader may hold part of the rest).
        assert!(
            (bytes as u64..=BUDGET as u64).contains(&status.input_bytes_queued),
            "{} charged, {bytes} queued",
            status.input_bytes_queued
        );
        assert_eq!(status.input_bytes_max, BUDGET as u64);

        // Handling (dropping) inputs gives the budget back: every report arrives, in
        // order, the oversized one too.
        let mut next = 2;
        for i in held.drain(..) {
            let Input::Report { report, .. } = i else {
                unreachable!()
            };
            assert_eq!(report.agent_time_ns, next);
            next += 1;
        }
        while next <= REPORTS + 1 {
            let i = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("the reader resumes")
                .expect("open");
            let Input::Report { report, .. } = i else {
                panic!("only reports")
            };
            assert_eq!(report.agent_time_ns, next);
            if next == REPORTS + 1 {
                assert!(report_bytes(&report) > BUDGET, "the last one is oversized");
                assert_eq!(gate.status().input_bytes_queued, BUDGET as u64);
            }
            next += 1;
        }
        assert_eq!(gate.status().input_bytes_queued, 0, "all given back");
        drop(route);
    }

    #[test]
    fn charges_count_what_a_line_holds_and_grow_with_its_names() {
        let short = report_from_pb(
            "a",
            1,
            pb::Report {
                agent_time_ns: 1,
                keys: vec![line(1)],
                measure: 0,
            },
        )
        .unwrap();
        let mut long_line = line(1);
        long_line.key.as_mut().unwrap().values[0] = "x".repeat(10_000);
        let long = report_from_pb(
            "a",
            1,
            pb::Report {
                agent_time_ns: 1,
                keys: vec![long_line],
                measure: 0,
            },
        )
        .unwrap();
        assert!(report_bytes(&short) >= size_of::<Report>() + size_of::<KeyReport>());
        assert!(report_bytes(&long) >= report_bytes(&short) + 10_000 - 40);
    }
}
