//! What the tests of connections over TLS share: a test PKI, a nisshi broker that requires TLS
//! and SASL/SCRAM, and the replayproof binary with a clean environment.

use super::free_port;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A test CA, a certificate it signed for localhost and 127.0.0.1, and a second CA that signed
/// nothing here.
pub struct Pki {
    pub dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub wrong_ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub cert_pem: String,
    pub key_pem: String,
    /// A certificate and key from the same CA for another host only.
    pub other_cert_pem: String,
    pub other_key_pem: String,
}

impl Pki {
    pub fn new(names: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name);
            let cert = params.self_signed(&key).unwrap();
            (cert, key)
        };
        let (ca_cert, ca_key) = ca("replayproof test CA");
        let (wrong_cert, _) = ca("another CA");
        let key = rcgen::KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "localhost");
        let cert = params.signed_by(&key, &ca_cert, &ca_key).unwrap();
        let other_key = rcgen::KeyPair::generate().unwrap();
        let other = rcgen::CertificateParams::new(vec!["downstream.example.internal".to_owned()])
            .unwrap()
            .signed_by(&other_key, &ca_cert, &ca_key)
            .unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
        Self {
            ca: write("ca.pem", &ca_cert.pem()),
            wrong_ca: write("wrong-ca.pem", &wrong_cert.pem()),
            cert: write("server.pem", &cert_pem),
            key: write("server.key", &key_pem),
            cert_pem,
            key_pem,
            other_cert_pem: other.pem(),
            other_key_pem: other_key.serialize_pem(),
            dir,
        }
    }

    /// For localhost and 127.0.0.1.
    pub fn local() -> Self {
        Self::new(&["localhost", "127.0.0.1"])
    }
}

/// What a finished command printed: its standard output, then its standard error.
pub fn printed(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn replayproof() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.env_remove("DATABASE_URL")
        .env_remove("REPLAYPROOF_CONFIG")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    cmd
}

pub fn tls_url(port: u16, mode: &str, ca: &Path) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{port}/postgres?sslmode={mode}&sslrootcert={}",
        ca.display()
    )
}

/// Runs `migrate` against `url`, checks that it fails, and returns its standard error.
pub fn migrate_refused(url: &str) -> String {
    let out = replayproof()
        .args(["migrate", "--database-url", url])
        .output()
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A nisshi broker serving only TLS and requiring SASL/SCRAM, with one user and one topic.
pub struct SecuredBroker {
    child: std::process::Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for SecuredBroker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The nisshi binary the test script installed, if any.
pub fn nisshi() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("REPLAYPROOF_NISSHI").map(PathBuf::from),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin/nisshi")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file())
}

pub fn wait_port(port: u16) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "port {port} never opened"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl SecuredBroker {
    /// Creates the user and topics on a plaintext broker over the same storage (nisshi's tools
    /// speak plaintext only), then serves that storage over TLS with authentication required.
    pub fn start(bin: &Path, pki: &Pki, user: &str, password: &str, topics: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        // nisshi reads a sqlite path relative to its working directory.
        let storage = "sqlite://nisshi.db";
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let broker = |secured: bool| {
            let mut cmd = Command::new(bin);
            cmd.args(["broker", "--listener-url", &url])
                .args(["--advertised-listener-url", &url])
                .args(["--storage-engine", storage])
                .current_dir(dir.path())
                .args(["--group-initial-rebalance-delay", "0s", "--silent"])
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            if secured {
                cmd.arg("--cert").arg(&pki.cert).arg("--key").arg(&pki.key);
                cmd.arg("--authentication");
            }
            cmd.spawn().unwrap()
        };
        let mut plain = broker(false);
        wait_port(port);
        let tool = |args: &[&str]| {
            let status = Command::new(bin)
                .args(args)
                .args(["--broker", &url])
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(status.success(), "nisshi {args:?}");
        };
        tool(&["user", "create", "--mechanism", "scram512", user, password]);
        for topic in topics {
            tool(&["topic", "create", "--partitions", "2", "--silent", topic]);
        }
        plain.kill().unwrap();
        plain.wait().unwrap();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            std::thread::sleep(Duration::from_millis(50));
        }
        let child = broker(true);
        wait_port(port);
        Self {
            child,
            port,
            _dir: dir,
        }
    }
}

pub fn read_cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}
