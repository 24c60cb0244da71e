//! Leader election through a real etcd (Debian's `etcd-server`; `.ci/run` installs it):
//! two real `bursar-allocator` replicas. The standby redirects agents to the leader;
//! when the leader dies the standby is elected with a higher term; when etcd goes
//! away the leader steps down.
#![cfg(feature = "shell")]

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use bursar_proto::allocator as pb;
use common::{Proc, field, hello, open};
use pb::allocator_message::Msg as Out;

/// A replica: its process (killed on drop) and its stdout, line by line.
struct Replica {
    child: Proc,
    lines: std_mpsc::Receiver<String>,
}

impl Replica {
    fn spawn(cmd: &mut Command) -> Replica {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = std_mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Replica {
            child: Proc(child),
            lines,
        }
    }

    /// The next stdout line starting with `prefix`, within `timeout`.
    fn line(&self, prefix: &str, timeout: Duration) -> String {
        let end = Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => continue,
                Err(_) => panic!("no line starting with {prefix:?} within {timeout:?}"),
            }
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Etcd {
    // Declared before `_dir`: etcd is gone before its data directory is removed.
    _child: Proc,
    url: String,
    _dir: tempfile::TempDir,
}

impl Etcd {
    fn start() -> Etcd {
        let (client, peer) = (free_port(), free_port());
        let dir = tempfile::Builder::new()
            .prefix("bursar-etcd-")
            .tempdir()
            .expect("temp dir");
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(dir.path())
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the etcd binary (Debian package etcd-server; scripts/test installs it)");
        let end = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
            assert!(Instant::now() < end, "etcd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Etcd {
            _child: Proc(child),
            url,
            _dir: dir,
        }
    }
}

fn replica(etcd: &str) -> Replica {
    replica_ttl(etcd, "2")
}

fn replica_ttl(etcd: &str, ttl_s: &str) -> Replica {
    Replica::spawn(Command::new(env!("CARGO_BIN_EXE_bursar-allocator")).args([
        "--etcd",
        etcd,
        "--election-ttl-s",
        ttl_s,
        "--grpc",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--lease-ms",
        "1000",
        "--reclaim-margin-ms",
        "200",
    ]))
}

/// Opens a stream to `addr` with a hello; returns the allocator's first message.
async fn first_message(addr: SocketAddr) -> Result<Out, tonic::Status> {
    let (_tx, r) = open(addr, hello("probe", pb::PROTOCOL_VERSION, 1)).await;
    let m = r?
        .message()
        .await?
        .ok_or_else(|| tonic::Status::aborted("closed"))?;
    m.msg
        .ok_or_else(|| tonic::Status::internal("empty message"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_redirects_takes_over_with_a_higher_term_and_a_cut_off_leader_steps_down() {
    let etcd = Etcd::start();
    let mut a = replica(&etcd.url);
    let a_lead = a.line("bursar-allocator listening:", Duration::from_secs(20));
    let a_grpc: SocketAddr = field(&a_lead, "grpc=").parse().unwrap();
    let a_term: u64 = field(&a_lead, "term=").parse().unwrap();
    let mut b = replica(&etcd.url);
    let b_standby = b.line("bursar-allocator standby:", Duration::from_secs(20));
    let b_grpc: SocketAddr = field(&b_standby, "grpc=").parse().unwrap();

    // The standby answers an agent with a redirect to the leader, and stays standby.
    match first_message(b_grpc).await.unwrap() {
        Out::Redirect(r) => assert_eq!(r.leader, a_grpc.to_string()),
        other => panic!("expected a redirect, got {other:?}"),
    }
    assert!(
        b.lines.recv_timeout(Duration::from_secs(3)).is_err(),
        "B must not be elected while A's lease is alive"
    );
    match first_message(a_grpc).await.unwrap() {
        Out::Welcome(w) => assert_eq!(w.term, a_term),
        other => panic!("expected a welcome, got {other:?}"),
    }

    // The leader dies: after its lease (2 s) the standby is elected, with a higher term.
    let killed = Instant::now();
    let _ = a.child.kill();
    let _ = a.child.wait();
    let b_lead = b.line("bursar-allocator listening:", Duration::from_secs(15));
    let took = killed.elapsed();
    let b_term: u64 = field(&b_lead, "term=").parse().unwrap();
    assert!(b_term > a_term, "term must grow: {a_term} then {b_term}");
    assert_eq!(
        field(&b_lead, "grpc=").parse::<SocketAddr>().unwrap(),
        b_grpc
    );
    eprintln!(
        "failover: standby elected {took:?} after the leader was killed (etcd lease TTL 2 s); terms {a_term} -> {b_term}"
    );
    match first_message(b_grpc).await.unwrap() {
        Out::Welcome(w) => assert_eq!(w.term, b_term),
        other => panic!("expected a welcome, got {other:?}"),
    }

    // etcd goes away: the leader cannot renew its lease and steps down (exit 1).
    drop(etcd);
    let end = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = b.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < end,
            "the leader must step down without etcd"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(1), "stepping down exits 1");
}

/// The leader trusted only its lease: with its leader key resigned (or deleted by an
/// operator) while the lease lived, the standby won with a higher term and both
/// granted. The leader now asks etcd who leads every third of a TTL and steps down
/// (exit 1) once it is not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_key_is_gone_steps_down_while_its_lease_lives() {
    use bursar_proto::etcd::v3electionpb::{
        LeaderKey, LeaderRequest, ResignRequest, election_client::ElectionClient,
    };
    let etcd = Etcd::start();
    let mut a = replica(&etcd.url);
    let a_lead = a.line("bursar-allocator listening:", Duration::from_secs(20));
    let a_term: u64 = field(&a_lead, "term=").parse().unwrap();
    let b = replica(&etcd.url);
    b.line("bursar-allocator standby:", Duration::from_secs(20));
    let mut c = ElectionClient::connect(etcd.url.clone()).await.unwrap();
    let name = b"bursar/allocator".to_vec();
    let kv = c
        .leader(LeaderRequest { name: name.clone() })
        .await
        .expect("a leader")
        .into_inner()
        .kv
        .expect("its key");
    c.resign(ResignRequest {
        leader: Some(LeaderKey {
            name,
            key: kv.key,
            rev: kv.create_revision,
            lease: kv.lease,
        }),
    })
    .await
    .expect("resigned");
    let resigned = Instant::now();
    // B wins at once (A's lease still lives); A must step down within a TTL.
    let b_lead = b.line("bursar-allocator listening:", Duration::from_secs(15));
    let b_term: u64 = field(&b_lead, "term=").parse().unwrap();
    assert!(b_term > a_term, "{a_term} then {b_term}");
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = a.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < end,
            "the old leader must step down once etcd names another"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(1));
    eprintln!(
        "the old leader stepped down {:?} after its key was resigned (TTL 2 s)",
        resigned.elapsed()
    );
}

/// A leader stopped gracefully (SIGTERM) left its etcd lease to lapse, so the standby
/// waited a whole TTL to be elected. It resigns now: with a 30 s TTL the standby is
/// elected within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_gracefully_hands_over_without_waiting_for_its_lease() {
    let etcd = Etcd::start();
    let mut a = replica_ttl(&etcd.url, "30");
    let a_lead = a.line("bursar-allocator listening:", Duration::from_secs(20));
    let a_term: u64 = field(&a_lead, "term=").parse().unwrap();
    let b = replica_ttl(&etcd.url, "30");
    b.line("bursar-allocator standby:", Duration::from_secs(20));
    let stopped = Instant::now();
    let term = Command::new("kill")
        .args(["-TERM", &a.child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let b_lead = b.line("bursar-allocator listening:", Duration::from_secs(15));
    let took = stopped.elapsed();
    let b_term: u64 = field(&b_lead, "term=").parse().unwrap();
    assert!(b_term > a_term, "{a_term} then {b_term}");
    assert!(
        took < Duration::from_secs(15),
        "elected {took:?} after the leader stopped: it waited for the 30 s lease"
    );
    eprintln!("graceful handover: standby elected {took:?} after SIGTERM (TTL 30 s)");
    assert_eq!(a.child.wait().unwrap().code(), Some(0));
}
