//! PgBouncer in transaction mode in front of a PostgreSQL server, as a managed platform puts a
//! pooler in front of its database: for the tests and benchmarks of `[database] pooler`.
//! Debian's `pgbouncer` (`REPLAYPROOF_PGBOUNCER` names another binary), stopped by its own pid
//! when dropped.

use anyhow::Context as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A PgBouncer process of its own, in transaction mode.
pub struct EmbeddedPgBouncer {
    child: Option<Child>,
    port: u16,
    server_connections: u32,
    dir: tempfile::TempDir,
}

impl EmbeddedPgBouncer {
    /// PgBouncer passing every database name through to `server` (a PostgreSQL URL), with
    /// `server_connections` server connections per database and user.
    pub fn in_front_of(server: &str, server_connections: u32) -> anyhow::Result<Self> {
        let server = url::Url::parse(server).context("the server's URL")?;
        let databases = format!(
            "* = host={} port={}",
            server.host_str().unwrap_or("127.0.0.1"),
            server.port().unwrap_or(5432)
        );
        Self::start(&databases, server_connections)
    }

    /// PgBouncer with `databases` as its `[databases]` section (trusting the `postgres` user).
    pub fn start(databases: &str, server_connections: u32) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("replayproof-pgbouncer-")
            .tempdir()?;
        std::fs::write(dir.path().join("users.txt"), "\"postgres\" \"\"\n")?;
        let mut bouncer = Self {
            child: None,
            port: super::embedded::free_port()?,
            server_connections,
            dir,
        };
        bouncer.write_config(databases)?;
        let mut command = Command::new(binary()?);
        command
            .arg(bouncer.dir.path().join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        run_as_postgres_when_root(&mut command, bouncer.dir.path())?;
        bouncer.child = Some(command.spawn().context("starting pgbouncer")?);
        bouncer.wait_listening()?;
        Ok(bouncer)
    }

    /// The port it listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `database` through the pooler, as the `postgres` user and nothing else.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Points the pooler's databases elsewhere while its clients stay connected, as an
    /// operator's edit and reload (or a platform's failover) does: `databases` replaces the
    /// `[databases]` section and the process is sent SIGHUP.
    pub fn repoint(&self, databases: &str) -> anyhow::Result<()> {
        self.write_config(databases)?;
        let pid = self.child.as_ref().context("pgbouncer is running")?.id();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGHUP,
        )?;
        Ok(())
    }

    fn write_config(&self, databases: &str) -> anyhow::Result<()> {
        let dir = self.dir.path();
        let config = format!(
            "[databases]\n{databases}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\n\
             listen_port = {port}\nunix_socket_dir =\nauth_type = trust\n\
             auth_file = {dir}/users.txt\npool_mode = transaction\n\
             default_pool_size = {connections}\nmax_client_conn = 500\n\
             logfile = {dir}/pgbouncer.log\n",
            port = self.port,
            connections = self.server_connections,
            dir = dir.display(),
        );
        Ok(std::fs::write(dir.join("pgbouncer.ini"), config)?)
    }

    fn wait_listening(&self) -> anyhow::Result<()> {
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if started.elapsed() > Duration::from_secs(20) {
                let log = std::fs::read_to_string(self.dir.path().join("pgbouncer.log"));
                anyhow::bail!("pgbouncer did not listen: {}", log.unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Drop for EmbeddedPgBouncer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `REPLAYPROOF_PGBOUNCER`, else Debian's binary.
fn binary() -> anyhow::Result<PathBuf> {
    let named = std::env::var_os("REPLAYPROOF_PGBOUNCER").map(PathBuf::from);
    named
        .or_else(|| {
            ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
                .into_iter()
                .map(PathBuf::from)
                .find(|p| p.exists())
        })
        .context("no pgbouncer: install Debian's pgbouncer (scripts/test.sh does) or set REPLAYPROOF_PGBOUNCER")
}

/// PgBouncer refuses to run as root: as root, it runs as the `postgres` user, which then owns
/// its directory.
fn run_as_postgres_when_root(command: &mut Command, dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt as _;
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    let user = nix::unistd::User::from_name("postgres")?.context(
        "running as root needs a `postgres` user: install Debian's `postgresql` package",
    )?;
    nix::unistd::chown(dir, Some(user.uid), Some(user.gid))?;
    command.uid(user.uid.as_raw()).gid(user.gid.as_raw());
    Ok(())
}
