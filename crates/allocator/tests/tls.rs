//! TLS on the agents' stream, with the real `bursar-allocator` process: with
//! `--tls-client-ca` an agent must present a certificate from that CA; one from
//! another CA, none, or plain HTTP/2 is refused at the handshake. A real
//! `bursar-agent` process connects with `--allocator-ca` and its certificate.
#![cfg(feature = "shell")]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bursar_proto::allocator as pb;
use pb::allocator_client::AllocatorClient;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const RULES: &str = r#"
[[rule]]
name = "org-rps"
match = { org = "*" }
dimension = "requests"
rate = 100
per = "second"
burst = 20
"#;

const NAME: &str = "allocator.bursar.test";

/// A CA; writes `<name>-ca.pem` and returns its issuer.
fn ca(dir: &Path, name: &str) -> Issuer<'static, KeyPair> {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = p.self_signed(&key).unwrap();
    std::fs::write(dir.join(format!("{name}-ca.pem")), cert.pem()).unwrap();
    Issuer::new(p, key)
}

/// A leaf signed by `issuer`; writes `<name>.pem` and `<name>.key`.
fn leaf(dir: &Path, issuer: &Issuer<'static, KeyPair>, name: &str, san: &str) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec![san.to_string()]).unwrap();
    p.distinguished_name.push(DnType::CommonName, name);
    let cert = p.signed_by(&key, issuer).unwrap();
    std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_allocator(dir: &Path) -> (Proc, SocketAddr, SocketAddr) {
    let rules = dir.join("rules.toml");
    std::fs::write(&rules, RULES).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_bursar-allocator"))
        .arg("--config")
        .arg(&rules)
        .args([
            "--grpc",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--term",
            "3",
        ])
        .args(["--lease-ms", "1000", "--reclaim-margin-ms", "200"])
        .arg("--tls-cert")
        .arg(dir.join("allocator.pem"))
        .arg("--tls-key")
        .arg(dir.join("allocator.key"))
        .arg("--tls-client-ca")
        .arg(dir.join("fleet-ca.pem"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let field = |name: &str| -> SocketAddr {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
    };
    (Proc(child), field("grpc="), field("admin="))
}

fn status(admin: SocketAddr) -> serde_json::Value {
    let mut s = TcpStream::connect(admin).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /v1/status HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let (_, body) = raw.split_once("\r\n\r\n").unwrap();
    serde_json::from_str(body).unwrap()
}

fn hello(agent: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        msg: Some(pb::agent_message::Msg::Hello(pb::Hello {
            protocol_version: pb::PROTOCOL_VERSION,
            agent: agent.into(),
            incarnation: 1,
            weight: 1,
            agent_time_ns: 1_000,
            held: vec![],
            config_version: String::new(),
        })),
    }
}

/// Connects with `tls` and sends a hello; Ok(first message) or the error, as text.
async fn try_agent(
    grpc: SocketAddr,
    scheme: &str,
    tls: Option<ClientTlsConfig>,
) -> Result<pb::AllocatorMessage, String> {
    let mut ep = Endpoint::from_shared(format!("{scheme}://{grpc}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5));
    if let Some(t) = tls {
        ep = ep.tls_config(t).map_err(|e| e.to_string())?;
    }
    let channel: Channel = ep.connect().await.map_err(|e| format!("connect: {e:?}"))?;
    let mut client = AllocatorClient::new(channel);
    let (tx, rx) = mpsc::channel(4);
    tx.send(hello("tls-agent")).await.unwrap();
    let mut inbound =
        tokio::time::timeout(Duration::from_secs(5), client.sync(ReceiverStream::new(rx)))
            .await
            .map_err(|_| "sync timed out".to_string())?
            .map_err(|e| format!("sync: {e}"))?
            .into_inner();
    let m = tokio::time::timeout(Duration::from_secs(5), inbound.message())
        .await
        .map_err(|_| "no message".to_string())?
        .map_err(|e| format!("message: {e}"))?
        .ok_or("stream ended")?;
    drop(tx);
    Ok(m)
}

fn client_tls(dir: &Path, ca: &str, who: Option<&str>) -> ClientTlsConfig {
    let mut t = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(dir.join(ca)).unwrap()))
        .domain_name(NAME);
    if let Some(w) = who {
        t = t.identity(Identity::from_pem(
            std::fs::read(dir.join(format!("{w}.pem"))).unwrap(),
            std::fs::read(dir.join(format!("{w}.key"))).unwrap(),
        ));
    }
    t
}

fn certs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let server_ca = ca(dir.path(), "server");
    let fleet = ca(dir.path(), "fleet");
    let foreign = ca(dir.path(), "foreign");
    leaf(dir.path(), &server_ca, "allocator", NAME);
    leaf(dir.path(), &fleet, "agent", "agent-1");
    leaf(dir.path(), &foreign, "stranger", "agent-x");
    dir
}

#[tokio::test]
async fn only_agents_with_a_certificate_from_the_fleet_ca_get_in() {
    let dir = certs();
    let (_a, grpc, admin) = start_allocator(dir.path());
    // The fleet's certificate: welcomed.
    let m = try_agent(
        grpc,
        "https",
        Some(client_tls(dir.path(), "server-ca.pem", Some("agent"))),
    )
    .await
    .expect("an agent with a fleet certificate is welcomed");
    assert!(
        matches!(m.msg, Some(pb::allocator_message::Msg::Welcome(ref w)) if w.term == 3),
        "{m:?}"
    );
    // No client certificate, another CA's, plain HTTP/2: refused.
    for (what, scheme, tls) in [
        (
            "no certificate",
            "https",
            Some(client_tls(dir.path(), "server-ca.pem", None)),
        ),
        (
            "another CA",
            "https",
            Some(client_tls(dir.path(), "server-ca.pem", Some("stranger"))),
        ),
        ("plain HTTP/2", "http", None),
    ] {
        let r = try_agent(grpc, scheme, tls).await;
        assert!(r.is_err(), "{what} must be refused, got {r:?}");
    }
    // An agent that does not trust the allocator's CA refuses it too.
    let r = try_agent(
        grpc,
        "https",
        Some(client_tls(dir.path(), "foreign-ca.pem", Some("agent"))),
    )
    .await;
    assert!(
        r.is_err(),
        "an allocator from an unknown CA must be refused: {r:?}"
    );
    // Only the fleet agent's hello reached the allocator.
    let s = tokio::task::spawn_blocking(move || status(admin))
        .await
        .unwrap();
    assert_eq!(s["counters"]["hellos"], 1, "{s}");
}

fn agent_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_bursar-allocator")).with_file_name("bursar-agent");
    assert!(
        p.exists(),
        "{} is missing: `cargo test --workspace` (or `cargo build`) builds it",
        p.display()
    );
    p
}

#[test]
fn a_real_agent_connects_over_mutual_tls() {
    let dir = certs();
    let (_a, grpc, admin) = start_allocator(dir.path());
    let rules = dir.path().join("rules.toml");
    let _agent = Proc(
        Command::new(agent_bin())
            .arg("--config")
            .arg(&rules)
            .args(["--http", "127.0.0.1:0", "--agent-id", "tls-agent-1"])
            .args([
                "--allocator",
                &grpc.to_string(),
                "--allocator-tls-name",
                NAME,
            ])
            .arg("--allocator-ca")
            .arg(dir.path().join("server-ca.pem"))
            .arg("--allocator-cert")
            .arg(dir.path().join("agent.pem"))
            .arg("--allocator-key")
            .arg(dir.path().join("agent.key"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let t0 = Instant::now();
    loop {
        let s = status(admin);
        if s["connected"] == 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the agent did not connect over TLS: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
