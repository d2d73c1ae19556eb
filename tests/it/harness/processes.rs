//! Consumers in this process and as `replayproof consume` processes, and commands run to
//! completion.

use super::*;
use replayproof::consume::{self, BatchProcessor, ConsumeMetrics, ConsumerSettings, EffectRetry};
use replayproof::db::Db;
use replayproof::effect::{Effect, Ledger};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A consumer running in this process, stopped like a SIGTERM would stop it.
pub struct InProcessConsumer {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    pub registry: prometheus::Registry,
}

impl InProcessConsumer {
    pub fn start(settings: ConsumerSettings, pool: Db) -> Self {
        Self::with_effect(settings, pool, Arc::new(Ledger))
    }

    pub fn with_effect(settings: ConsumerSettings, pool: Db, effect: Arc<dyn Effect>) -> Self {
        let processor = BatchProcessor::new(pool, effect).with_retry(EffectRetry {
            attempts: 3,
            backoff: Duration::from_millis(10),
        });
        Self::with_processor(settings, processor)
    }

    pub fn with_processor(settings: ConsumerSettings, processor: BatchProcessor) -> Self {
        let registry = prometheus::Registry::new();
        let metrics = ConsumeMetrics::new(&registry).unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(consume::run(settings, processor, metrics, shutdown.clone()));
        Self {
            shutdown,
            task,
            registry,
        }
    }

    pub fn metric(&self, name: &str) -> f64 {
        metric_value(&self.registry, name)
    }

    /// Waits for the consumer to stop by itself, and returns how it ended.
    pub async fn ended(self, timeout: Duration) -> anyhow::Result<()> {
        tokio::time::timeout(timeout, self.task)
            .await
            .expect("the consumer stops by itself")
            .expect("consumer task")
    }

    /// Stops it like a SIGTERM would, and returns how it ended.
    pub async fn stop_result(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.task.await.expect("consumer task")
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task
            .await
            .expect("consumer task")
            .expect("consumer result");
    }
}

/// A `replayproof consume` process.
pub struct ConsumerProcess {
    pub child: tokio::process::Child,
}

impl ConsumerProcess {
    pub fn spawn(
        brokers: &str,
        topic: &str,
        group: &str,
        database_url: &str,
        failpoints: Option<&str>,
    ) -> Self {
        Self::spawn_with(brokers, topic, group, database_url, failpoints, &[])
    }

    /// Like [`ConsumerProcess::spawn`], with more arguments for `consume`.
    pub fn spawn_with(
        brokers: &str,
        topic: &str,
        group: &str,
        database_url: &str,
        failpoints: Option<&str>,
        extra: &[&str],
    ) -> Self {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
        cmd.arg("consume")
            .args(["--brokers", brokers, "--topic", topic, "--group", group])
            .args(["--database-url", database_url])
            .args(["--batch-size", "200"])
            .args([
                "--commit-interval-ms",
                "50",
                "--max-retry-backoff-ms",
                "500",
            ])
            .args(extra)
            .env("RUST_LOG", "warn,replayproof=info")
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        for (k, v) in test_kafka_options() {
            cmd.arg("--kafka-option").arg(format!("{k}={v}"));
        }
        if !extra.contains(&"--metrics-addr") {
            cmd.args(["--metrics-addr", "127.0.0.1:0"]);
        }
        if let Some(f) = failpoints {
            cmd.env("FAILPOINTS", f);
        }
        Self {
            child: cmd.spawn().expect("spawn replayproof consume"),
        }
    }

    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id().expect("running") as i32)
    }

    /// kill -9, then reap it.
    pub async fn kill9(mut self) {
        nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGKILL).expect("kill -9");
        self.child.wait().await.expect("reap");
    }

    #[cfg(feature = "failpoints")]
    /// Waits for the process to exit by itself.
    pub async fn exited(mut self, timeout: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .expect("exits by itself in time")
            .expect("exit status")
    }

    /// Whether it is still running (it has not exited by itself).
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("the child's status").is_none()
    }

    #[cfg(feature = "failpoints")]
    /// Sends a signal, such as SIGSTOP or SIGCONT.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(self.pid(), signal).expect("signal");
    }

    /// SIGTERM, then wait for the exit status.
    pub async fn terminate(mut self, timeout: Duration) -> std::process::ExitStatus {
        nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .expect("exits within the grace period")
            .expect("exit status")
    }
}

#[cfg(feature = "failpoints")]
/// Waits for `consumer` to stop at a failpoint with its transaction open, kills it with
/// SIGKILL, and waits until PostgreSQL has ended (rolled back) that transaction.
pub async fn kill_inside_transaction(consumer: ConsumerProcess, db: &TestDb) {
    wait_for_open_transaction(db).await;
    consumer.kill9().await;
    wait_for(
        "the killed consumer's transaction to end",
        Duration::from_secs(60),
        || async { idle_in_transaction(db).await == 0 },
    )
    .await;
}

/// Runs `command` to its end and returns its standard output; fails the test with the standard
/// error unless it succeeded.
pub fn stdout_of(command: &mut std::process::Command) -> Vec<u8> {
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}
