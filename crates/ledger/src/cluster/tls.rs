//! Mutual TLS between ledger nodes: a cluster CA signs every node's certificate; a node
//! accepts a connection only from a peer whose certificate chains to that CA, and
//! connects only to peers that present one. `bursar-ledger certs` makes a development
//! CA and node certificates ([`make_certs`]).
//!
//! Every node certificate carries the DNS name [`CLUSTER_SERVER_NAME`] (so a node can
//! dial a peer by address and still verify it) and the node's own id.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The DNS name every node certificate carries and every node verifies when it dials.
pub const CLUSTER_SERVER_NAME: &str = "bursar-ledger.cluster";

/// ALPN protocol id of the ledger's cluster protocol (version 1).
pub const ALPN: &[u8] = b"bursar-ledger/1";

/// A TLS set-up problem. Each names the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the configuration (a key that does not match its certificate, a
    /// CA certificate that cannot be a trust anchor, ...).
    #[error("TLS configuration: {0}")]
    Config(String),
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Generate(String),
}

/// Where a node's TLS material lives: the cluster CA certificate, and the node's own
/// certificate chain and private key, all PEM.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The cluster CA certificate (trust anchor for peers).
    pub ca: PathBuf,
    /// This node's certificate (chain), signed by the CA.
    pub cert: PathBuf,
    /// This node's private key.
    pub key: PathBuf,
}

impl TlsFiles {
    /// The layout `bursar-ledger certs --out DIR` writes: `DIR/ca.pem`,
    /// `DIR/<node>.pem`, `DIR/<node>.key`.
    pub fn in_dir(dir: &Path, node: &str) -> TlsFiles {
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{node}.pem")),
            key: dir.join(format!("{node}.key")),
        }
    }
}

fn file_err(path: &Path, reason: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let all: Result<Vec<_>, _> = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(path, e))?
        .collect();
    let all = all.map_err(|e| file_err(path, e))?;
    if all.is_empty() {
        return Err(file_err(
            path,
            "no certificate (PEM \"CERTIFICATE\") in the file",
        ));
    }
    Ok(all)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(path: &Path) -> Result<Arc<rustls::RootCertStore>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(path)? {
        roots
            .add(c)
            .map_err(|e| file_err(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
}

/// The server and client TLS configurations of one node, for quinn.
pub struct NodeTls {
    /// Accepts peers (client certificate required, chained to the cluster CA).
    pub server: quinn::ServerConfig,
    /// Dials peers (presents this node's certificate, verifies theirs).
    pub client: quinn::ClientConfig,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeTls { .. }")
    }
}

/// Loads the PEM files and builds both configurations.
pub fn load(files: &TlsFiles) -> Result<NodeTls, TlsError> {
    let roots = roots(&files.ca)?;
    let chain = certs(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| file_err(&files.key, e))?;
    let provider = provider();
    let cfg_err = |e: rustls::Error| TlsError::Config(e.to_string());

    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| TlsError::Config(format!("client verifier: {e}")))?;
    let verifier = Arc::new(ClusterPeerVerifier { inner: verifier });
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cfg_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| {
            TlsError::Config(format!(
                "{} / {}: {e}",
                files.cert.display(),
                files.key.display()
            ))
        })?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cfg_err)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| {
            TlsError::Config(format!(
                "{} / {}: {e}",
                files.cert.display(),
                files.key.display()
            ))
        })?;
    client.alpn_protocols = vec![ALPN.to_vec()];

    let server = quinn::crypto::rustls::QuicServerConfig::try_from(server)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let client = quinn::crypto::rustls::QuicClientConfig::try_from(client)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    Ok(NodeTls {
        server: quinn::ServerConfig::with_crypto(Arc::new(server)),
        client: quinn::ClientConfig::new(Arc::new(client)),
    })
}

/// Accepts a peer's certificate only if it chains to the cluster CA **and** names
/// [`CLUSTER_SERVER_NAME`], as a dialing node requires of the node it dials. (Until
/// the thirty-first session an accepting node checked the chain only: any client
/// certificate of a CA that also signs other services' certificates, or of any root
/// in a `ca.pem` bundle, made a full peer that could push billing events.)
#[derive(Debug)]
struct ClusterPeerVerifier {
    inner: Arc<dyn rustls::server::danger::ClientCertVerifier>,
}

impl rustls::server::danger::ClientCertVerifier for ClusterPeerVerifier {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let not_a_peer =
            || rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName);
        let cert = webpki::EndEntityCert::try_from(end_entity).map_err(|_| not_a_peer())?;
        let name = rustls::pki_types::ServerName::try_from(CLUSTER_SERVER_NAME)
            .map_err(|_| not_a_peer())?;
        cert.verify_is_valid_for_subject_name(&name)
            .map_err(|_| not_a_peer())?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// What [`make_certs`] wrote.
#[derive(Debug)]
pub struct MadeCerts {
    /// Whether the CA was created now (false: an existing `ca.pem`/`ca.key` was used).
    pub ca_created: bool,
    /// Files written, in order.
    pub written: Vec<PathBuf>,
}

/// Writes a development cluster CA (`ca.pem`, `ca.key`; reused if both exist) and a
/// certificate and key for each node (`<node>.pem`, `<node>.key`) into `dir`. Keys are
/// written with mode 0600 on Unix. For production, issue node certificates from your
/// own CA with the DNS name [`CLUSTER_SERVER_NAME`].
pub fn make_certs(dir: &Path, nodes: &[String]) -> Result<MadeCerts, TlsError> {
    use rcgen::{Issuer, KeyPair};
    for n in nodes {
        if n.is_empty()
            || !n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        {
            return Err(TlsError::Generate(format!(
                "node id {n:?}: use letters, digits, '-' and '.' only (it becomes a DNS name \
                 and a file name)"
            )));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e))?;
    let (ca_pem, ca_key_pem) = (dir.join("ca.pem"), dir.join("ca.key"));
    let mut written = Vec::new();
    let ca_created = match (ca_pem.exists(), ca_key_pem.exists()) {
        (true, true) => false,
        (false, false) => true,
        // Half a CA: making a new one would replace the half that is there (nodes
        // restarted with a new `ca.pem` refuse every certificate of the old CA).
        (pem, _) => {
            let (there, missing) = if pem {
                (&ca_pem, &ca_key_pem)
            } else {
                (&ca_key_pem, &ca_pem)
            };
            return Err(TlsError::Generate(format!(
                "{} exists but {} does not: refusing to make a new CA over it (put the \
                 CA's other file beside it to sign with it, or use another --out directory \
                 for a new CA); nothing was written",
                there.display(),
                missing.display()
            )));
        }
    };
    let ca_key = if ca_created {
        let key = KeyPair::generate().map_err(generr)?;
        let cert = ca_params()?.self_signed(&key).map_err(generr)?;
        write_file(&ca_pem, cert.pem().as_bytes(), false)?;
        write_file(&ca_key_pem, key.serialize_pem().as_bytes(), true)?;
        written.push(ca_pem.clone());
        written.push(ca_key_pem.clone());
        key
    } else {
        ca_key(&ca_key_pem)?
    };
    let issuer = Issuer::new(ca_params()?, ca_key);
    for n in nodes {
        let names = [CLUSTER_SERVER_NAME.to_string(), n.clone()];
        written.extend(sign(dir, &issuer, n, &names)?);
    }
    Ok(MadeCerts {
        ca_created,
        written,
    })
}

/// Writes `<stem>.pem` and `<stem>.key` into `dir`: a certificate for `names` (its DNS
/// names; the first is its common name) signed by the CA in `dir` (which must exist,
/// both files), for server and client use. [`make_certs`] makes node certificates
/// with it; a certificate without [`CLUSTER_SERVER_NAME`] (a client of another
/// service signed by the same CA) is one a node refuses as a peer.
pub fn make_cert_for_names(dir: &Path, stem: &str, names: &[String]) -> Result<(), TlsError> {
    let (ca_pem, ca_key_pem) = (dir.join("ca.pem"), dir.join("ca.key"));
    if !(ca_pem.exists() && ca_key_pem.exists()) {
        return Err(TlsError::Generate(format!(
            "no CA in {} (ca.pem and ca.key)",
            dir.display()
        )));
    }
    let issuer = rcgen::Issuer::new(ca_params()?, ca_key(&ca_key_pem)?);
    sign(dir, &issuer, stem, names).map(|_| ())
}

/// An existing CA's key (the issuer is rebuilt from it and [`ca_params`]).
fn ca_key(path: &Path) -> Result<rcgen::KeyPair, TlsError> {
    let text = std::fs::read_to_string(path).map_err(|e| file_err(path, e))?;
    rcgen::KeyPair::from_pem(&text).map_err(|e| file_err(path, e))
}

/// The development CA's parameters: fixed, so an existing CA is rebuilt as an issuer
/// from its key alone (same subject, same key: what it signs chains to `ca.pem`).
fn ca_params() -> Result<rcgen::CertificateParams, TlsError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyUsagePurpose};
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(generr)?;
    params
        .distinguished_name
        .push(DnType::CommonName, "Bursar ledger development CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(params)
}

fn generr(e: rcgen::Error) -> TlsError {
    TlsError::Generate(e.to_string())
}

/// Signs a certificate for `names` with `issuer`; writes `<stem>.pem` and `<stem>.key`.
fn sign(
    dir: &Path,
    issuer: &rcgen::Issuer<'_, rcgen::KeyPair>,
    stem: &str,
    names: &[String],
) -> Result<[PathBuf; 2], TlsError> {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose};
    let key = KeyPair::generate().map_err(generr)?;
    let mut params = CertificateParams::new(names.to_vec()).map_err(generr)?;
    let cn = names.last().map_or(stem, String::as_str);
    params.distinguished_name.push(DnType::CommonName, cn);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = params.signed_by(&key, issuer).map_err(generr)?;
    let files = TlsFiles::in_dir(dir, stem);
    write_file(&files.cert, cert.pem().as_bytes(), false)?;
    write_file(&files.key, key.serialize_pem().as_bytes(), true)?;
    Ok([files.cert, files.key])
}

fn write_file(path: &Path, bytes: &[u8], secret: bool) -> Result<(), TlsError> {
    use std::io::Write as _;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut f = opts.open(path).map_err(|e| file_err(path, e))?;
    f.write_all(bytes).map_err(|e| file_err(path, e))?;
    f.sync_all().map_err(|e| file_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certs_are_made_reused_and_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let made = make_certs(dir.path(), &["a".into(), "b".into()]).unwrap();
        assert!(made.ca_created);
        assert_eq!(made.written.len(), 6);
        let ca_before = std::fs::read(dir.path().join("ca.pem")).unwrap();
        let again = make_certs(dir.path(), &["c".into()]).unwrap();
        assert!(!again.ca_created, "an existing CA must be reused");
        assert_eq!(std::fs::read(dir.path().join("ca.pem")).unwrap(), ca_before);
        for n in ["a", "b", "c"] {
            load(&TlsFiles::in_dir(dir.path(), n)).unwrap();
        }
    }

    #[test]
    fn bad_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        make_certs(dir.path(), &["a".into()]).unwrap();
        let mut files = TlsFiles::in_dir(dir.path(), "a");
        std::fs::write(dir.path().join("junk.pem"), "not a pem file\n").unwrap();
        files.ca = dir.path().join("junk.pem");
        let e = load(&files).unwrap_err().to_string();
        assert!(e.contains("junk.pem"), "{e}");
        let files = TlsFiles::in_dir(dir.path(), "missing");
        let e = load(&files).unwrap_err().to_string();
        assert!(e.contains("missing.pem"), "{e}");
        let e = make_certs(dir.path(), &["../evil".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("letters, digits"), "{e}");
    }

    /// Review, thirty-first session: with `ca.pem` but not `ca.key` (the key kept off
    /// the machine, as the docs advise) a new CA replaced `ca.pem`, splitting the
    /// cluster at the next restarts; with `ca.key` alone, the CA's key was overwritten.
    #[test]
    fn half_a_ca_is_refused_and_left_as_it_was() {
        for keep in ["ca.pem", "ca.key"] {
            let dir = tempfile::tempdir().unwrap();
            make_certs(dir.path(), &["a".into()]).unwrap();
            let gone = if keep == "ca.pem" { "ca.key" } else { "ca.pem" };
            std::fs::remove_file(dir.path().join(gone)).unwrap();
            let before = std::fs::read(dir.path().join(keep)).unwrap();
            let e = make_certs(dir.path(), &["d".into()])
                .unwrap_err()
                .to_string();
            assert!(e.contains(gone) && e.contains(keep), "{e}");
            assert_eq!(std::fs::read(dir.path().join(keep)).unwrap(), before);
            assert!(!dir.path().join(gone).exists());
            assert!(!dir.path().join("d.pem").exists());
        }
    }
}
