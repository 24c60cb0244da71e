//! TLS on the agents' stream, with the real `bursar-allocator` process: with
//! `--tls-client-ca` an agent must present a certificate from that CA; one from
//! another CA, none, or plain HTTP/2 is refused at the handshake. A real
//! `bursar-agent` process connects with `--allocator-ca` and its certificate.
#![cfg(feature = "shell")]

mod common;

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bursar_proto::allocator as pb;
use common::{Allocator, Proc, hello, sibling_bin};
use pb::allocator_client::AllocatorClient;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

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

/// The allocator with its certificate from `dir`, requiring agents' certificates
/// from the fleet CA, and `extra` flags.
fn start_allocator(dir: &Path, extra: &[&str]) -> Allocator {
    let mut args: Vec<OsString> = [
        "--term",
        "3",
        "--lease-ms",
        "1000",
        "--reclaim-margin-ms",
        "200",
    ]
    .map(OsString::from)
    .into();
    args.extend(extra.iter().map(OsString::from));
    for (flag, file) in [
        ("--tls-cert", "allocator.pem"),
        ("--tls-key", "allocator.key"),
        ("--tls-client-ca", "fleet-ca.pem"),
    ] {
        args.push(flag.into());
        args.push(dir.join(file).into());
    }
    Allocator::start(&args)
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
    tx.send(hello("tls-agent", pb::PROTOCOL_VERSION, 1_000))
        .await
        .unwrap();
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
    let a = start_allocator(dir.path(), &[]);
    let grpc = a.grpc;
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
    let s = tokio::task::spawn_blocking(move || a.get_json("/v1/status"))
        .await
        .unwrap();
    assert_eq!(s["counters"]["hellos"], 1, "{s}");
}

/// Also: under TLS the agent's stream marks its connection (tonic wraps the connection
/// info), so a first-stream timeout shorter than the test keeps the agent connected on
/// its first stream, while a connection that never speaks is closed and counted.
#[test]
fn a_real_agent_connects_over_mutual_tls() {
    let dir = certs();
    let a = start_allocator(dir.path(), &["--first-stream-timeout-ms", "300"]);
    let _agent = Proc(
        Command::new(sibling_bin("bursar-agent"))
            .arg("--config")
            .arg(&a.config)
            .args(["--http", "127.0.0.1:0", "--agent-id", "tls-agent-1"])
            .args([
                "--allocator",
                &a.grpc.to_string(),
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
        let s = a.get_json("/v1/status");
        if s["connected"] == 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the agent did not connect over TLS: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut silent = std::net::TcpStream::connect(a.grpc).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let t1 = Instant::now();
    let mut byte = [0u8; 1];
    let n = std::io::Read::read(&mut silent, &mut byte);
    assert!(
        matches!(n, Ok(0))
            || n.as_ref()
                .is_err_and(|e| e.kind() != std::io::ErrorKind::WouldBlock),
        "{n:?}"
    );
    assert!(
        t1.elapsed() < Duration::from_secs(5),
        "closed at its deadline"
    );
    let s = a.get_json("/v1/status");
    assert_eq!(s["counters"]["connections_silent"], 1, "{s}");
    assert_eq!(
        s["counters"]["hellos"], 1,
        "the agent kept its first stream: {s}"
    );
    assert_eq!(s["connected"], 1, "{s}");
}
