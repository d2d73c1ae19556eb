//! Throwaway services for running with nothing installed: a PostgreSQL cluster from the local
//! PostgreSQL binaries, and librdkafka's in-process mock Kafka cluster.
//!
//! Both are for development, demos and tests. They are used only when asked for, and their
//! data is gone when they are dropped.

use anyhow::{bail, Context as _};
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::ClientConfig;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A PostgreSQL cluster in a temporary directory on a free port, stopped and removed on drop.
///
/// PostgreSQL refuses to run as root, so when this process is root the cluster runs as the
/// `postgres` user.
pub struct EmbeddedPostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    run_as: Option<String>,
    /// Server settings (`name=value`) applied after the defaults.
    settings: Vec<String>,
}

impl EmbeddedPostgres {
    /// Creates and starts a cluster. Blocking: call it from `spawn_blocking` in async code.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(&[])
    }

    /// Like [`EmbeddedPostgres::start`], with server settings (`name=value`) that override the
    /// defaults, such as `fsync=on` for a durable cluster.
    pub fn start_with(settings: &[&str]) -> anyhow::Result<Self> {
        let pg = Self::create(settings)?;
        pg.resume()?;
        tracing::info!(port = pg.port, dir = %pg.dir.path().display(), "Started a throwaway PostgreSQL cluster.");
        Ok(pg)
    }

    /// A cluster that accepts TCP connections only over TLS, with the PEM certificate chain
    /// and private key given: `ssl=on`, and `pg_hba.conf` refusing any connection without
    /// encryption. Blocking, as [`EmbeddedPostgres::start`].
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> anyhow::Result<Self> {
        let pg = Self::create(&[
            "ssl=on",
            "ssl_cert_file=server.crt",
            "ssl_key_file=server.key",
        ])?;
        let data = PathBuf::from(pg.data_dir());
        std::fs::write(data.join("server.crt"), cert_pem)?;
        std::fs::write(data.join("server.key"), key_pem)?;
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 0.0.0.0/0 reject\n",
        )?;
        for file in ["server.crt", "server.key", "pg_hba.conf"] {
            let path = data.join(file);
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
            if let Some(user) = &pg.run_as {
                let user = nix::unistd::User::from_name(user)?.context("the postgres user")?;
                nix::unistd::chown(&path, Some(user.uid), Some(user.gid))?;
            }
        }
        pg.resume()?;
        Ok(pg)
    }

    /// Creates the cluster's files, without starting it.
    fn create(settings: &[&str]) -> anyhow::Result<Self> {
        let bin = postgres_bindir()?;
        let run_as = nix::unistd::geteuid()
            .is_root()
            .then(|| "postgres".to_owned());
        let dir = tempfile::Builder::new()
            .prefix("replayproof-pg-")
            .tempdir()
            .context("creating a directory for PostgreSQL")?;
        if let Some(user) = &run_as {
            let user = nix::unistd::User::from_name(user)?.context(
                "running as root needs a `postgres` user: install Debian's `postgresql` package",
            )?;
            nix::unistd::chown(dir.path(), Some(user.uid), Some(user.gid))?;
        }
        let pg = Self {
            port: free_port()?,
            dir,
            bin,
            run_as,
            settings: settings.iter().map(|s| s.to_string()).collect(),
        };
        pg.run(
            "initdb",
            &[
                "-D",
                &pg.data_dir(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        Ok(pg)
    }

    /// The URL of the cluster's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the server the way a crash or `kill -9` would (`pg_ctl -m immediate`).
    pub fn stop(&self) -> anyhow::Result<()> {
        self.run(
            "pg_ctl",
            &["-D", &self.data_dir(), "-m", "immediate", "-w", "stop"],
        )
    }

    /// Starts the server again, on the same port with the same data.
    pub fn resume(&self) -> anyhow::Result<()> {
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        for setting in &self.settings {
            options += &format!(" -c {setting}");
        }
        let log = self.dir.path().join("postgres.log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data_dir(),
                "-l",
                &log.to_string_lossy(),
                "-o",
                &options,
                "-w",
                "start",
            ],
        )
    }

    fn data_dir(&self) -> String {
        self.dir.path().join("data").to_string_lossy().into_owned()
    }

    fn run(&self, tool: &str, args: &[&str]) -> anyhow::Result<()> {
        let program = self.bin.join(tool);
        let mut command = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        let output = command
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .with_context(|| format!("running {}", program.display()))?;
        if !output.status.success() {
            bail!(
                "{tool} failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Where the PostgreSQL server binaries are: `REPLAYPROOF_PG_BINDIR`, then `pg_config
/// --bindir`, then the newest `/usr/lib/postgresql/*/bin`.
pub fn postgres_bindir() -> anyhow::Result<PathBuf> {
    let has_initdb = |dir: &Path| dir.join("initdb").is_file();
    if let Ok(dir) = std::env::var("REPLAYPROOF_PG_BINDIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has_initdb(&dir) {
            return Ok(dir);
        }
    }
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|d| has_initdb(d))
        .collect();
    candidates.sort_by_key(|d| {
        let version = d
            .parent()
            .and_then(|v| v.file_name())
            .map(|v| v.to_string_lossy().into_owned());
        version.and_then(|v| v.parse::<u32>().ok()).unwrap_or(0)
    });
    candidates.pop().context(
        "no PostgreSQL server binaries found (initdb, pg_ctl): install Debian's `postgresql` \
         package, set REPLAYPROOF_PG_BINDIR, or set DATABASE_URL to a running server",
    )
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// librdkafka's mock Kafka cluster, in this process, listening on localhost so that other
/// processes can use it too. It lives as long as this value and is not `Send`: keep it in the
/// task that created it.
pub struct EmbeddedKafka {
    /// The client that owns the mock cluster.
    owner: BaseProducer,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl EmbeddedKafka {
    /// Starts a one-broker cluster whose consumer groups rebalance without the initial delay.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with_brokers(1)
    }

    /// Like [`EmbeddedKafka::start`], with `brokers` brokers (ids 1 to `brokers`), so that
    /// partitions can be led by different brokers and one of them can fail alone.
    pub fn start_with_brokers(brokers: u32) -> anyhow::Result<Self> {
        let owner: BaseProducer = ClientConfig::new()
            .set("test.mock.num.brokers", brokers.max(1).to_string())
            .set("log_level", "3")
            .create()
            .context("starting the mock Kafka cluster")?;
        let kafka = Self {
            owner,
            _not_send: std::marker::PhantomData,
        };
        // SAFETY: the handle's mock cluster lives as long as `owner`, which `kafka` holds.
        unsafe {
            let cluster =
                rdkafka::bindings::rd_kafka_handle_mock_cluster(kafka.owner.client().native_ptr());
            anyhow::ensure!(!cluster.is_null(), "the mock Kafka cluster did not start");
            rdkafka::bindings::rd_kafka_mock_group_initial_rebalance_delay_ms(cluster, 0);
        }
        tracing::info!(brokers = %kafka.bootstrap_servers(), "Started an in-process mock Kafka cluster.");
        Ok(kafka)
    }

    pub fn bootstrap_servers(&self) -> String {
        self.cluster().bootstrap_servers()
    }

    /// Creates a topic (the mock cluster does not serve the CreateTopics admin request).
    pub fn create_topic(&self, topic: &str, partitions: i32) -> anyhow::Result<()> {
        self.cluster()
            .create_topic(topic, partitions, 1)
            .with_context(|| format!("creating topic {topic}"))
    }

    /// Takes the broker down (its listener refuses connections) or brings it back, for fault
    /// injection.
    pub fn set_broker_up(&self, up: bool) -> anyhow::Result<()> {
        let cluster = self.cluster();
        let result = if up {
            cluster.broker_up(1)
        } else {
            cluster.broker_down(1)
        };
        result.context("changing the mock broker's state")
    }

    /// Makes the next requests of one kind fail with the given errors, one error each, for
    /// fault injection (for example an offset commit the broker refuses).
    pub fn fail_requests(
        &self,
        api_key: rdkafka::types::RDKafkaApiKey,
        errors: &[rdkafka::types::RDKafkaRespErr],
    ) {
        self.cluster().request_errors(api_key, errors);
    }

    /// Makes `partition` of `topic` led by broker `broker`.
    pub fn set_partition_leader(
        &self,
        topic: &str,
        partition: i32,
        broker: i32,
    ) -> anyhow::Result<()> {
        self.cluster()
            .partition_leader(topic, partition, Some(broker))
            .with_context(|| format!("moving {topic} [{partition}] to broker {broker}"))
    }

    /// Makes the next `count` Fetch requests to broker `broker` fail with `error` for every
    /// partition they ask for: one broker's partitions fail while the others' go on.
    pub fn fail_fetches_from(
        &self,
        broker: i32,
        count: usize,
        error: rdkafka::types::RDKafkaRespErr,
    ) {
        let fetch = rdkafka::types::RDKafkaApiKey::Fetch as i16;
        // SAFETY: the handle's mock cluster lives as long as `owner`; each call pushes one
        // (error, round-trip time) pair, passed as C ints as the variadic function reads them.
        unsafe {
            let cluster =
                rdkafka::bindings::rd_kafka_handle_mock_cluster(self.owner.client().native_ptr());
            for _ in 0..count {
                rdkafka::bindings::rd_kafka_mock_broker_push_request_error_rtts(
                    cluster,
                    broker,
                    fetch,
                    1,
                    error as std::ffi::c_int,
                    0 as std::ffi::c_int,
                );
            }
        }
    }

    /// Lets requests of this kind through again.
    pub fn clear_request_errors(&self, api_key: rdkafka::types::RDKafkaApiKey) {
        self.cluster().clear_request_errors(api_key);
    }

    fn cluster(
        &self,
    ) -> rdkafka::mocking::MockCluster<'_, rdkafka::producer::DefaultProducerContext> {
        self.owner
            .client()
            .mock_cluster()
            .expect("the owner client was created with a mock cluster")
    }
}
