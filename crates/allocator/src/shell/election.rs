//! Leader election through etcd's v3 election API (invariant 4, HA).
//!
//! Each allocator replica grants a lease with a TTL, keeps it alive every TTL/3, and
//! campaigns under one election name with its advertised gRPC address as the value.
//! The winner's **term** is the revision of its leader key: etcd revisions only grow,
//! so every new leader's term is higher than any before it, and agents ignore grants of
//! lower terms (fencing). A replica that cannot renew its lease for a whole TTL has
//! lost leadership (another replica may be elected once the lease ends): it steps
//! down at once. While not leader, a replica answers every agent stream with a
//! `Redirect` naming the current leader.
//!
//! Talks to etcd with Bursar's own wire-compatible definitions in `crates/proto`
//! (`etcdserverpb`, `v3electionpb`): the `etcd-client` crate's build needs a system
//! `protoc`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bursar_proto::allocator as pb;
use bursar_proto::etcd::etcdserverpb::{
    LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest, lease_client::LeaseClient,
};
use bursar_proto::etcd::v3electionpb::{
    CampaignRequest, LeaderRequest, election_client::ElectionClient,
};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// An election error (operator: etcd unreachable or refusing).
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    /// The endpoint is not a valid URI or cannot be reached.
    #[error("etcd at {endpoint}: {reason}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// An etcd call failed.
    #[error("etcd {call}: {status}")]
    Call {
        /// Which call.
        call: &'static str,
        /// The gRPC status.
        status: Status,
    },
}

/// A connection to etcd for one election name.
#[derive(Clone)]
pub struct Election {
    channel: Channel,
    name: Vec<u8>,
    ttl_s: i64,
}

/// This replica's leadership: its term, and a signal that turns true if it is lost.
pub struct Leadership {
    /// The term: the leader key's revision.
    pub term: u64,
    /// Turns true when the lease could not be renewed for two thirds of a TTL, or
    /// etcd names another leader (the leader key was deleted or resigned while the
    /// lease lived, and another replica won).
    pub lost: watch::Receiver<bool>,
    /// The etcd lease the leader key lives on ([`Election::resign`]).
    pub lease: i64,
}

impl Election {
    /// Connects to `endpoint` (e.g. `http://127.0.0.1:2379`).
    pub async fn connect(
        endpoint: &str,
        name: &str,
        ttl_s: i64,
    ) -> Result<Election, ElectionError> {
        let err = |reason: String| ElectionError::Connect {
            endpoint: endpoint.to_string(),
            reason,
        };
        let channel = Channel::from_shared(endpoint.to_string())
            .map_err(|e| err(e.to_string()))?
            .connect_timeout(Duration::from_secs(3))
            .connect()
            .await
            .map_err(|e| err(e.to_string()))?;
        Ok(Election {
            channel,
            name: name.as_bytes().to_vec(),
            ttl_s: ttl_s.max(1),
        })
    }

    /// The current leader's advertised address, if there is a leader.
    pub async fn leader(&self) -> Result<Option<String>, ElectionError> {
        let mut c = ElectionClient::new(self.channel.clone());
        match c
            .leader(LeaderRequest {
                name: self.name.clone(),
            })
            .await
        {
            Ok(r) => Ok(r
                .into_inner()
                .kv
                .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())),
            // etcd answers "election: no leader" as an error.
            Err(s) if s.message().contains("no leader") => Ok(None),
            Err(status) => Err(ElectionError::Call {
                call: "Leader",
                status,
            }),
        }
    }

    /// Grants a lease, keeps it alive, and campaigns with `advertise` as the value;
    /// returns once elected.
    pub async fn win(&self, advertise: &str) -> Result<Leadership, ElectionError> {
        let mut leases = LeaseClient::new(self.channel.clone());
        let granted = Instant::now();
        let lease = leases
            .lease_grant(LeaseGrantRequest {
                ttl: self.ttl_s,
                id: 0,
            })
            .await
            .map_err(|status| ElectionError::Call {
                call: "LeaseGrant",
                status,
            })?
            .into_inner()
            .id;
        let (lost_tx, lost) = watch::channel(false);
        let lost_tx = Arc::new(lost_tx);
        tokio::spawn(keep_alive(
            leases,
            lease,
            Duration::from_secs(self.ttl_s as u64),
            granted,
            Arc::clone(&lost_tx),
        ));
        let mut c = ElectionClient::new(self.channel.clone());
        let won = c
            .campaign(CampaignRequest {
                name: self.name.clone(),
                lease,
                value: advertise.as_bytes().to_vec(),
            })
            .await
            .map_err(|status| ElectionError::Call {
                call: "Campaign",
                status,
            })?
            .into_inner();
        let rev = won.leader.as_ref().map_or(0, |l| l.rev);
        if let Some(key) = won.leader.map(|l| l.key) {
            tokio::spawn(watch_leader(
                ElectionClient::new(self.channel.clone()),
                self.name.clone(),
                key,
                Duration::from_secs(self.ttl_s as u64) / 3,
                lost_tx,
            ));
        }
        Ok(Leadership {
            term: u64::try_from(rev).unwrap_or(0).max(1),
            lost,
            lease,
        })
    }

    /// Revokes `lease` (a leader's, after it stopped serving on a graceful shutdown):
    /// its leader key goes at once and a standby is elected without waiting a TTL.
    /// Best effort, within 2 s; a failure leaves the lease to lapse as before.
    pub async fn resign(&self, lease: i64) -> Result<(), ElectionError> {
        let mut leases = LeaseClient::new(self.channel.clone());
        match tokio::time::timeout(
            Duration::from_secs(2),
            leases.lease_revoke(LeaseRevokeRequest { id: lease }),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(status)) => Err(ElectionError::Call {
                call: "LeaseRevoke",
                status,
            }),
            Err(_) => Err(ElectionError::Call {
                call: "LeaseRevoke",
                status: Status::deadline_exceeded("no answer within 2 s"),
            }),
        }
    }
}

/// Renews `lease` every TTL/3; signals `lost` (the leader steps down) once no renewal
/// has succeeded for two thirds of a TTL, or etcd says the lease is gone. `granted`:
/// when the lease grant was requested.
///
/// etcd counts a renewed lease's TTL from when it processed the renewal, which is no
/// earlier than when the request was sent: a renewal's success is dated by its send
/// time, so the lease cannot end before `last_ok + ttl`. Stepping down at `last_ok +
/// 2/3 ttl`, with every wait cut at that deadline, leaves a third of a TTL before
/// another replica can be elected (dating renewals by their replies, and checking only
/// after a wait of up to TTL/3, let a leader serve past its lease's end).
async fn keep_alive(
    mut leases: LeaseClient<Channel>,
    lease: i64,
    ttl: Duration,
    granted: Instant,
    lost: Arc<watch::Sender<bool>>,
) {
    let every = ttl / 3;
    let safe = ttl - ttl / 3;
    let mut last_ok = granted;
    let left = |last_ok: Instant| safe.saturating_sub(last_ok.elapsed());
    'outer: loop {
        if left(last_ok).is_zero() {
            break;
        }
        let (tx, rx) = mpsc::channel(4);
        // The first request goes in before the call: etcd answers the stream's headers
        // only once it has a message, and the call waits for the headers.
        let mut sent = Instant::now();
        let _ = tx.try_send(LeaseKeepAliveRequest { id: lease });
        let call = leases.lease_keep_alive(ReceiverStream::new(rx));
        let mut stream = match tokio::time::timeout(every.min(left(last_ok)), call).await {
            Ok(Ok(s)) => s.into_inner(),
            _ => {
                tokio::time::sleep((every / 2).min(left(last_ok))).await;
                continue;
            }
        };
        let mut first = true;
        loop {
            if !first {
                sent = Instant::now();
                if tx.send(LeaseKeepAliveRequest { id: lease }).await.is_err() {
                    break;
                }
            }
            first = false;
            match tokio::time::timeout(every.min(left(last_ok)), stream.message()).await {
                Ok(Ok(Some(r))) if r.ttl > 0 => last_ok = last_ok.max(sent),
                Ok(Ok(Some(_))) => break 'outer, // TTL 0: the lease is gone
                _ => break,                      // reopen the stream (or give up above)
            }
            if left(last_ok).is_zero() {
                break 'outer;
            }
            tokio::time::sleep(every.min(left(last_ok))).await;
        }
    }
    let _ = lost.send(true);
}

/// Asks etcd who leads every `every` (a third of the TTL); signals `lost` once it names
/// a leader key other than `ours`, or none. The lease alone kept a leader whose key
/// was deleted or resigned (an operator's `etcdctl del`) serving while another replica
/// won with a higher term: two leaders granting the whole limit to different agents.
/// A failed call signals nothing: an unreachable etcd is the lease keeper's to judge.
async fn watch_leader(
    mut c: ElectionClient<Channel>,
    name: Vec<u8>,
    ours: Vec<u8>,
    every: Duration,
    lost: Arc<watch::Sender<bool>>,
) {
    loop {
        tokio::time::sleep(every).await;
        if *lost.borrow() {
            return;
        }
        let call = c.leader(LeaderRequest { name: name.clone() });
        let leader = match tokio::time::timeout(every, call).await {
            Ok(Ok(r)) => r.into_inner().kv.map(|kv| kv.key),
            Ok(Err(s)) if s.message().contains("no leader") => None,
            _ => continue,
        };
        if leader.as_deref() != Some(ours.as_slice()) {
            let _ = lost.send(true);
            return;
        }
    }
}

/// What a replica that is not the leader serves on the agents' port: every stream is
/// answered with a `Redirect` to the current leader (or UNAVAILABLE if there is none
/// yet; agents retry with backoff).
#[derive(Clone)]
pub struct Standby {
    election: Arc<Election>,
}

#[tonic::async_trait]
impl pb::allocator_server::Allocator for Standby {
    type SyncStream = ReceiverStream<Result<pb::AllocatorMessage, Status>>;

    async fn sync(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        super::conns::mark_stream_opened(&request);
        // Within a deadline: an etcd that does not answer held every agent's stream.
        let leader = tokio::time::timeout(Duration::from_secs(2), self.election.leader())
            .await
            .map_err(|_| Status::unavailable("standby: etcd did not answer within 2 s"))?
            .map_err(|e| Status::unavailable(e.to_string()))?
            .ok_or_else(|| Status::unavailable("standby: no allocator is leader yet"))?;
        let (tx, rx) = mpsc::channel(1);
        let _ = tx
            .send(Ok(pb::AllocatorMessage {
                msg: Some(pb::allocator_message::Msg::Redirect(pb::Redirect {
                    leader,
                })),
            }))
            .await;
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Serves the standby redirect on `listener` until `shutdown` turns true (then the port
/// is free for the leader's shell).
pub async fn serve_standby(
    listener: TcpListener,
    election: Arc<Election>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    connections_max: usize,
    first_stream_timeout: std::time::Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let incoming = Arc::new(super::conns::ConnectionCap::new(
        connections_max,
        first_stream_timeout,
    ))
    .incoming(listener);
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        match server.tls_config(tls) {
            Ok(s) => server = s,
            Err(e) => {
                eprintln!("bursar-allocator: standby TLS refused: {e}");
                return;
            }
        }
    }
    let _ = server
        // As the leader's port: an agent opens one stream, and a redirect is short.
        .max_concurrent_streams(Some(16))
        .add_service(pb::allocator_server::AllocatorServer::new(Standby {
            election,
        }))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = shutdown.wait_for(|s| *s).await;
        })
        .await;
}
