//! The demo's consumer processes: started from typed [`ConsumeArgs`], killed and restarted.

use crate::args::ToArgs;
use crate::consume::args::ConsumeArgs;
use anyhow::Context as _;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::time::Duration;
use tokio::process::{Child, Command};

pub struct Consumers {
    exe: std::path::PathBuf,
    args: ConsumeArgs,
    children: Vec<Child>,
}

impl Consumers {
    /// Starts `n` consumer processes of this binary with `args`.
    pub fn start(args: ConsumeArgs, n: usize) -> anyhow::Result<Self> {
        let mut consumers = Self {
            exe: std::env::current_exe()?,
            args,
            children: Vec::new(),
        };
        for _ in 0..n.max(1) {
            let child = consumers.spawn_one()?;
            consumers.children.push(child);
        }
        Ok(consumers)
    }

    fn spawn_one(&self) -> anyhow::Result<Child> {
        Command::new(&self.exe)
            .arg("consume")
            .args(self.args.to_args())
            .env("RUST_LOG", "error")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting a consumer process")
    }

    /// Kills consumer `i` with SIGKILL and starts it again.
    pub async fn kill_and_restart(&mut self, i: usize) -> anyhow::Result<()> {
        let pid = self.children[i]
            .id()
            .context("the consumer already exited")?;
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL)?;
        self.children[i].wait().await?;
        self.children[i] = self.spawn_one()?;
        Ok(())
    }

    /// Stops every consumer with SIGTERM and waits for it.
    pub async fn stop(mut self) {
        for child in &mut self.children {
            if let Some(pid) = child.id() {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            }
        }
        for child in &mut self.children {
            let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
        }
    }
}
