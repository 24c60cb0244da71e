//! The ledger cluster (feature `cluster`): every node holds every event; nodes converge
//! by push and by digest-driven pull.
//!
//! - **Transport**: QUIC ([quinn]) on the `--gossip` address, TLS 1.3 with mutual
//!   authentication: a peer must present a certificate from the cluster CA
//!   ([`tls`]). One connection per peer; each exchange is one bidirectional stream;
//!   SWIM packets ride on QUIC datagrams.
//! - **Membership** ([`membership`]): foca (SWIM) for membership and failure detection
//!   only; no data rides on it. Seeds (`--peer`) are announced to at start and again
//!   while they are not members, so a healed partition rejoins quickly.
//! - **Push** ([`exchange`]): events newly committed from this node's HTTP ingest go to
//!   `push_fanout` random live peers, which apply them durably before they answer.
//!   A push that fails or is dropped (queue full) is repaired by pull.
//! - **Pull**: every `sync_interval` a node runs one anti-entropy round with a random
//!   live peer: roots first (a ~100-byte exchange when in sync); when they differ, the
//!   reconciliation of [`crate::reconcile`] over the stream: bucket digests, only the
//!   differing buckets' events (split into sub-buckets when large), conflict winners
//!   returned. Rounds repeat at once while they move data.
//!
//! Every message is an rkyv archive in a checked envelope ([`frame`]); every size is
//! bounded; a malformed frame ends its exchange and changes nothing.
//!
//! Version vectors (per-origin sequence ranges) are **not** used: the digests find
//! every difference whatever the sequence numbers say, and an in-sync round already
//! costs one root comparison. See docs/ledger.md, "Cluster".

pub mod exchange;
pub mod frame;
pub mod membership;
pub mod tls;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::{RngExt as _, SeedableRng as _};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::event::{Event, Limits};
use crate::reconcile::ReconcileLimits;
use crate::redb_store::RedbStore;
use crate::server::Writer;

pub use tls::TlsFiles;

/// Cluster configuration. Plain data; [`ClusterConfig::validate`] at start-up.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// This node's id.
    pub node_id: String,
    /// UDP address for QUIC (`--gossip`).
    pub listen: SocketAddr,
    /// The address peers reach this node at (`--gossip-advertise`): its identity in
    /// membership. `None`: `listen`, which must then name one interface (a node bound
    /// to `0.0.0.0` would call itself `0.0.0.0`, as every such node would, and foca
    /// drops packets from its own address: no member would ever be seen).
    pub advertise: Option<SocketAddr>,
    /// This run's membership generation (a restarted node must win the address
    /// conflict against its previous identity, which peers keep as down): the binary
    /// keeps it in the data directory ([`crate::counter`]). `None`: the wall clock in
    /// ms, which a clock stepped back between runs would lower.
    pub generation: Option<u64>,
    /// Seed peers' gossip addresses (`--peer`), `HOST:PORT` or `IP:PORT`; resolved at
    /// start and every 2 s.
    pub seeds: Vec<String>,
    /// CA, certificate and key.
    pub tls: TlsFiles,
    /// Peers each new local batch is pushed to. Default 2.
    pub push_fanout: usize,
    /// Time between anti-entropy rounds. Default 1 s.
    pub sync_interval: Duration,
    /// Bounds of one reconciliation round.
    pub reconcile: ReconcileLimits,
    /// Bounds on each event received from a peer (time window excepted).
    pub limits: Limits,
    /// Largest frame payload accepted. Default 32 MiB.
    pub frame_max: usize,
    /// Deadline of one exchange (push or sync round). Default 60 s.
    pub exchange_timeout: Duration,
    /// Most pushed batches waiting to be sent. Default 256; beyond, batches are
    /// dropped from push (pull repairs them) and counted.
    pub push_queue_max: usize,
    /// Accept `POST /v1/cluster/isolate` (fault injection for tests). Default off.
    pub fault_injection: bool,
    /// Seed of this node's RNG (foca and peer choice). Default: a hash of the node id,
    /// so that nodes differ (it was 0 for every node a library caller did not set it
    /// for: the same foca probes and peer choices on every node).
    pub rng_seed: u64,
}

/// A node's default RNG seed: FNV-1a of its id (deterministic, distinct per node).
pub fn node_seed(node_id: &str) -> u64 {
    node_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

impl ClusterConfig {
    /// A configuration with the defaults.
    pub fn new(node_id: &str, listen: SocketAddr, tls: TlsFiles) -> ClusterConfig {
        ClusterConfig {
            node_id: node_id.to_string(),
            listen,
            advertise: None,
            generation: None,
            seeds: Vec::new(),
            tls,
            push_fanout: 2,
            sync_interval: Duration::from_secs(1),
            reconcile: ReconcileLimits::default(),
            limits: Limits::default(),
            frame_max: frame::FRAME_MAX_DEFAULT,
            exchange_timeout: Duration::from_secs(60),
            push_queue_max: 256,
            fault_injection: false,
            rng_seed: node_seed(node_id),
        }
    }

    /// The address this node is known by in membership: `advertise`, else `listen`.
    pub fn identity_addr(&self) -> SocketAddr {
        self.advertise.unwrap_or(self.listen)
    }

    /// Checks the values are usable.
    pub fn validate(&self) -> Result<(), String> {
        if self.sync_interval.is_zero() {
            return Err("sync interval must be > 0".into());
        }
        if self.reconcile.events_max == 0 || self.reconcile.buckets_max == 0 {
            return Err("reconcile bounds must be > 0".into());
        }
        if self.reconcile.bytes_max == 0 {
            return Err("reconcile bytes_max must be > 0".into());
        }
        // A message's events, its returned winners and the answer's lists of buckets
        // must fit a frame, with room for the envelope and the rest of the message.
        let need = exchange::message_bytes_max(&self.reconcile)
            + crate::reconcile::ANSWER_LISTS_BYTES_MAX
            + (1 << 20);
        if self.frame_max < need {
            return Err(format!(
                "frame_max ({} bytes) must be at least {need}: reconcile bytes_max ({}) plus a third, the answer's bucket lists and 1 MiB",
                self.frame_max, self.reconcile.bytes_max
            ));
        }
        if self.push_queue_max == 0 {
            return Err("push_queue_max must be > 0".into());
        }
        match self.advertise {
            None if self.listen.ip().is_unspecified() => {
                return Err(format!(
                    "--gossip {} listens on every interface: give --gossip-advertise IP:PORT, \
                     the address peers reach this node at (in Kubernetes, the pod IP)",
                    self.listen
                ));
            }
            Some(a) if a.ip().is_unspecified() || a.port() == 0 => {
                return Err(format!(
                    "--gossip-advertise {a}: must name one address and a port peers can reach"
                ));
            }
            _ => {}
        }
        if let Some(own) = self.seeds.iter().find(|s| {
            let a = s.parse::<SocketAddr>().ok();
            a == Some(self.listen) || (a.is_some() && a == self.advertise)
        }) {
            return Err(format!("--peer {own} is this node's own --gossip address"));
        }
        if let Some(bad) = self.seeds.iter().find(|s| {
            s.rsplit_once(':')
                .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        }) {
            return Err(format!("--peer {bad}: expected HOST:PORT or IP:PORT"));
        }
        Ok(())
    }
}

/// Cluster counters (exported by `/metrics` and `/v1/cluster`).
#[derive(Debug, Default)]
pub struct ClusterStats {
    /// Push exchanges that completed.
    pub push_ok: AtomicU64,
    /// Push exchanges that failed (pull repairs them).
    pub push_failed: AtomicU64,
    /// Events pushed (counted once per peer).
    pub push_events: AtomicU64,
    /// Bytes of push frames sent (envelope included).
    pub push_bytes: AtomicU64,
    /// Sync rounds that found the roots equal.
    pub sync_in_sync: AtomicU64,
    /// Sync rounds that reconciled something.
    pub sync_reconciled: AtomicU64,
    /// Sync rounds that failed.
    pub sync_failed: AtomicU64,
    /// Sync rounds not run because one side was in another round.
    pub sync_busy: AtomicU64,
    /// Events sent by sync rounds (both roles).
    pub sync_events_sent: AtomicU64,
    /// Events received by sync rounds (both roles).
    pub sync_events_received: AtomicU64,
    /// Frame bytes sent in all exchanges.
    pub bytes_sent: AtomicU64,
    /// Frame bytes received in all exchanges.
    pub bytes_received: AtomicU64,
    /// Frames refused as malformed (bad envelope, archive or events).
    pub frames_rejected: AtomicU64,
    /// Incoming connections whose handshake failed (e.g. a certificate from another CA).
    pub handshakes_failed: AtomicU64,
    /// Exchanges served for peers.
    pub exchanges_served: AtomicU64,
}

/// A running cluster node.
pub struct Cluster {
    pub(crate) inner: Arc<Inner>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

pub(crate) struct Inner {
    pub(crate) cfg: ClusterConfig,
    pub(crate) endpoint: quinn::Endpoint,
    pub(crate) client: quinn::ClientConfig,
    pub(crate) conns: Mutex<HashMap<SocketAddr, quinn::Connection>>,
    pub(crate) dialing: Mutex<HashSet<SocketAddr>>,
    pub(crate) members: Mutex<HashMap<SocketAddr, membership::Ident>>,
    pub(crate) isolated: AtomicBool,
    pub(crate) stats: ClusterStats,
    pub(crate) store: RedbStore,
    pub(crate) writer: Mutex<Option<Writer>>,
    pub(crate) rng: Mutex<rand::rngs::SmallRng>,
    pub(crate) foca_tx: mpsc::Sender<membership::Input>,
    /// Where the next offer's range ends (hours, exclusive): newest first, then older
    /// ranges when the newest agree (see `reconcile::reconcile_in_memory`).
    pub(crate) sync_to: Mutex<crate::digest::Bucket>,
    /// The seeds' current addresses (see `membership::resolve_seeds`).
    pub(crate) seed_addrs: Mutex<Vec<SocketAddr>>,
    /// Held during an anti-entropy round, as initiator or responder.
    pub(crate) in_round: AtomicBool,
}

/// A start-up failure of the cluster shell.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Bad configuration.
    #[error("cluster configuration: {0}")]
    Config(String),
    /// TLS material.
    #[error("cluster TLS: {0}")]
    Tls(#[from] tls::TlsError),
    /// The gossip socket.
    #[error("binding --gossip {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(64u32.into());
    t.max_concurrent_uni_streams(0u32.into());
    t.keep_alive_interval(Some(Duration::from_millis(500)));
    t.max_idle_timeout(Some(
        Duration::from_secs(3)
            .try_into()
            .expect("3 s is a valid idle timeout"),
    ));
    t.datagram_receive_buffer_size(Some(256 * 1024));
    Arc::new(t)
}

impl Cluster {
    /// Binds the gossip socket, and starts membership, push and pull. `push_rx` carries
    /// the events the writer newly committed from local ingest.
    pub fn start(
        cfg: ClusterConfig,
        store: RedbStore,
        writer: Writer,
        push_rx: mpsc::Receiver<Vec<Event>>,
    ) -> Result<Cluster, ClusterError> {
        cfg.validate().map_err(ClusterError::Config)?;
        let node_tls = tls::load(&cfg.tls)?;
        let mut server = node_tls.server;
        server.transport_config(transport());
        let mut client = node_tls.client;
        client.transport_config(transport());
        let endpoint =
            quinn::Endpoint::server(server, cfg.listen).map_err(|source| ClusterError::Bind {
                addr: cfg.listen,
                source,
            })?;
        let listen = endpoint.local_addr().map_err(|source| ClusterError::Bind {
            addr: cfg.listen,
            source,
        })?;
        let mut cfg = cfg;
        cfg.listen = listen;
        debug_assert!(cfg.advertise.is_some() || !listen.ip().is_unspecified());
        let (foca_tx, foca_rx) = mpsc::channel(4096);
        let rng = rand::rngs::SmallRng::seed_from_u64(cfg.rng_seed ^ 0x5eed_1ed9);
        let inner = Arc::new(Inner {
            cfg,
            endpoint,
            client,
            conns: Mutex::new(HashMap::new()),
            dialing: Mutex::new(HashSet::new()),
            members: Mutex::new(HashMap::new()),
            isolated: AtomicBool::new(false),
            stats: ClusterStats::default(),
            store,
            writer: Mutex::new(Some(writer)),
            rng: Mutex::new(rng),
            foca_tx,
            sync_to: Mutex::new(crate::reconcile::newest_end()),
            in_round: AtomicBool::new(false),
            seed_addrs: Mutex::new(Vec::new()),
        });
        // Seeds given as IP:PORT are usable before the first resolution.
        *inner.seed_addrs.lock().expect("seeds") = inner
            .cfg
            .seeds
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        let tasks = vec![
            tokio::spawn(membership::resolve_seeds(inner.clone())),
            tokio::spawn(accept_loop(inner.clone())),
            tokio::spawn(membership::run(inner.clone(), foca_rx)),
            tokio::spawn(exchange::push_loop(inner.clone(), push_rx)),
            tokio::spawn(exchange::sync_loop(inner.clone())),
        ];
        Ok(Cluster {
            inner,
            tasks: Mutex::new(tasks),
        })
    }

    /// The bound gossip address (the chosen port when `--gossip` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.cfg.listen
    }

    /// Whether fault injection is enabled.
    pub fn fault_injection(&self) -> bool {
        self.inner.cfg.fault_injection
    }

    /// Fault injection: cut this node off from every peer (`true`) or heal (`false`).
    /// While isolated the node refuses connections, drops datagrams, sends nothing and
    /// keeps serving its HTTP API (writes included).
    pub fn set_isolated(&self, on: bool) {
        self.inner.isolated.store(on, Ordering::SeqCst);
        if on {
            let conns: Vec<_> = self.inner.conns.lock().expect("conns").drain().collect();
            for (_, c) in conns {
                c.close(1u32.into(), b"isolated");
            }
        }
    }

    /// Counters.
    pub fn stats(&self) -> &ClusterStats {
        &self.inner.stats
    }

    /// Live members other than this node: (node id, gossip address).
    pub fn members(&self) -> Vec<(String, SocketAddr)> {
        let mut v: Vec<_> = self
            .inner
            .members
            .lock()
            .expect("members")
            .values()
            .map(|i| (i.id.clone(), i.addr))
            .collect();
        v.sort();
        v
    }

    /// The status as JSON (`GET /v1/cluster`).
    pub fn status_json(&self) -> Value {
        let s = &self.inner.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "node_id": self.inner.cfg.node_id,
            "gossip": self.local_addr().to_string(),
            "advertise": self.inner.cfg.identity_addr().to_string(),
            "generation": self.inner.cfg.generation,
            "isolated": self.inner.isolated.load(Ordering::Relaxed),
            "members": self.members().iter().map(|(id, a)| json!({"node_id": id, "gossip": a.to_string()})).collect::<Vec<_>>(),
            "push": {"ok": l(&s.push_ok), "failed": l(&s.push_failed), "events": l(&s.push_events), "bytes": l(&s.push_bytes)},
            "sync": {"in_sync": l(&s.sync_in_sync), "reconciled": l(&s.sync_reconciled), "failed": l(&s.sync_failed), "busy": l(&s.sync_busy), "events_sent": l(&s.sync_events_sent), "events_received": l(&s.sync_events_received)},
            "bytes_sent": l(&s.bytes_sent),
            "bytes_received": l(&s.bytes_received),
            "frames_rejected": l(&s.frames_rejected),
            "handshakes_failed": l(&s.handshakes_failed),
            "exchanges_served": l(&s.exchanges_served),
        })
    }

    /// Stops every task, leaves the cluster, closes the endpoint and releases the
    /// writer (so it can drain and stop).
    pub async fn shutdown(&self) {
        let _ = self.inner.foca_tx.try_send(membership::Input::Leave);
        tokio::time::sleep(Duration::from_millis(50)).await;
        for t in self.tasks.lock().expect("tasks").drain(..) {
            t.abort();
        }
        self.inner.writer.lock().expect("writer").take();
        self.inner.endpoint.close(0u32.into(), b"shutdown");
        let conns: Vec<_> = self.inner.conns.lock().expect("conns").drain().collect();
        drop(conns);
    }
}

/// Holds a node's round slot until dropped.
pub(crate) struct RoundSlot<'a>(&'a AtomicBool);

impl Drop for RoundSlot<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Inner {
    /// Takes the node's anti-entropy round slot, if free.
    pub(crate) fn try_round(&self) -> Option<RoundSlot<'_>> {
        self.in_round
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| RoundSlot(&self.in_round))
    }

    pub(crate) fn isolated(&self) -> bool {
        self.isolated.load(Ordering::Relaxed)
    }

    pub(crate) fn writer(&self) -> Option<Writer> {
        self.writer.lock().expect("writer").clone()
    }

    /// Up to `n` distinct live members, chosen at random; the seeds when no member is
    /// known yet.
    pub(crate) fn pick_peers(&self, n: usize) -> Vec<SocketAddr> {
        let mut all: Vec<SocketAddr> = self
            .members
            .lock()
            .expect("members")
            .keys()
            .copied()
            .collect();
        if all.is_empty() {
            all = self.seed_addrs.lock().expect("seeds").clone();
        }
        all.sort();
        let mut rng = self.rng.lock().expect("rng");
        let mut out = Vec::with_capacity(n.min(all.len()));
        while out.len() < n && !all.is_empty() {
            let i = rng.random_range(0..all.len());
            out.push(all.swap_remove(i));
        }
        out
    }

    /// The live cached connection to `addr`, if any.
    pub(crate) fn cached(&self, addr: SocketAddr) -> Option<quinn::Connection> {
        self.conns
            .lock()
            .expect("conns")
            .get(&addr)
            .filter(|c| c.close_reason().is_none())
            .cloned()
    }

    /// Dials `addr` (a new connection; callers check the cache first).
    async fn dial(&self, addr: SocketAddr) -> Result<quinn::Connection, String> {
        if self.isolated() {
            return Err("isolated".into());
        }
        let connecting = self
            .endpoint
            .connect_with(self.client.clone(), addr, tls::CLUSTER_SERVER_NAME)
            .map_err(|e| format!("connect {addr}: {e}"))?;
        tokio::time::timeout(Duration::from_secs(5), connecting)
            .await
            .map_err(|_| format!("connect {addr}: timed out"))?
            .map_err(|e| format!("connect {addr}: {e}"))
    }

    /// Registers a connection and starts serving its datagrams and streams.
    pub(crate) fn adopt(self: &Arc<Self>, conn: quinn::Connection) {
        self.conns
            .lock()
            .expect("conns")
            .insert(conn.remote_address(), conn.clone());
        tokio::spawn(membership::datagram_loop(self.clone(), conn.clone()));
        tokio::spawn(exchange::serve_streams(self.clone(), conn));
    }

    /// Dials `addr` in the background (once at a time) and adopts the connection.
    pub(crate) fn dial_in_background(
        self: &Arc<Self>,
        addr: SocketAddr,
        then: Option<bytes::Bytes>,
    ) {
        if !self.dialing.lock().expect("dialing").insert(addr) {
            return;
        }
        let inner = self.clone();
        tokio::spawn(async move {
            let r = inner.dial(addr).await;
            inner.dialing.lock().expect("dialing").remove(&addr);
            if let Ok(conn) = r {
                inner.adopt(conn.clone());
                if let Some(b) = then {
                    let _ = conn.send_datagram(b);
                }
            }
        });
    }

    /// A connection for an exchange: cached, or dialed and adopted now.
    pub(crate) async fn exchange_connection(
        self: &Arc<Self>,
        addr: SocketAddr,
    ) -> Result<quinn::Connection, String> {
        if self.isolated() {
            return Err("isolated".into());
        }
        if let Some(c) = self.cached(addr) {
            return Ok(c);
        }
        let c = self.dial(addr).await?;
        self.adopt(c.clone());
        Ok(c)
    }
}

async fn accept_loop(inner: Arc<Inner>) {
    while let Some(incoming) = inner.endpoint.accept().await {
        if inner.isolated() {
            incoming.refuse();
            continue;
        }
        let inner = inner.clone();
        tokio::spawn(async move {
            match incoming.await {
                Ok(conn) => inner.adopt(conn),
                Err(e) => {
                    inner
                        .stats
                        .handshakes_failed
                        .fetch_add(1, Ordering::Relaxed);
                    eprintln!("bursar-ledger: refused a peer connection: {e}");
                }
            }
        });
    }
}

#[cfg(test)]
mod seed_tests {
    /// Nodes' default seeds differ, and stay the same across restarts (FNV-1a).
    #[test]
    fn default_seeds_are_distinct_per_node_and_stable() {
        assert_ne!(super::node_seed("ledger-1"), super::node_seed("ledger-2"));
        assert_eq!(super::node_seed("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
