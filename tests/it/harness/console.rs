//! A console over a test database, in this process or as a `replayproof console` process, and
//! a browser-less client that logs in, keeps its cookie and reads the CSRF token from the
//! pages, as a browser would.

use super::TestDb;
use replayproof::console::{self, ConsoleSettings, HashParams, Role, UserConfig};
use replayproof::effect::Registry;
use tokio_util::sync::CancellationToken;

/// The users every test console has: `ann`, an operator, and `vic`, a viewer; each's password
/// is their name followed by `-pass`.
pub fn users() -> Vec<UserConfig> {
    // Cheap hashes: the parameters travel in the PHC string, so verifying them is cheap too.
    let cheap = || HashParams::new(1024, 1, 1, None).unwrap();
    [("ann", Role::Operator), ("vic", Role::Viewer)]
        .into_iter()
        .map(|(name, role)| UserConfig {
            name: name.into(),
            role,
            password_hash: Some(
                console::hash_password_with(&format!("{name}-pass"), cheap()).unwrap(),
            ),
        })
        .collect()
}

/// Settings for a test console on a free port of this machine.
pub fn settings() -> ConsoleSettings {
    let file = console::ConsoleFile {
        session_key: Some("a test session key of at least thirty-two bytes".into()),
        users: users(),
        ..Default::default()
    };
    ConsoleSettings::new("127.0.0.1:0".parse().unwrap(), file).unwrap()
}

pub struct TestConsole {
    pub base: String,
    stop: CancellationToken,
}

impl TestConsole {
    pub async fn start(db: &TestDb, settings: ConsoleSettings) -> Self {
        Self::over(db.pool.clone(), settings).await
    }

    /// A console over `shards` (a pool for one database).
    pub async fn over(
        shards: impl Into<replayproof::shard::Shards>,
        settings: ConsoleSettings,
    ) -> Self {
        let console = console::Console::bind(settings, shards, Registry::default())
            .await
            .unwrap();
        let base = format!("http://{}", console.addr());
        let stop = CancellationToken::new();
        // Serves until the test ends; the runtime's end stops it.
        drop(console.run_until_stopped(stop.clone()));
        Self { base, stop }
    }

    /// A client with no session.
    pub fn anonymous(&self) -> Client {
        Client::at(&self.base)
    }

    /// A client logged in as `name` with the right password.
    pub async fn login(&self, name: &str) -> Client {
        self.anonymous()
            .logged_in(name, &format!("{name}-pass"))
            .await
    }
}

impl Drop for TestConsole {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: String,
    pub location: Option<String>,
    pub set_cookie: Option<String>,
}

pub struct Client {
    http: reqwest::Client,
    base: String,
    pub cookie: Option<String>,
}

impl Client {
    /// A client of the console at `base` with no session.
    pub fn at(base: &str) -> Self {
        Self {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            base: base.to_owned(),
            cookie: None,
        }
    }

    /// This client once logged in through the form as `name` with `password`.
    pub async fn logged_in(mut self, name: &str, password: &str) -> Self {
        let form = [("username", name), ("password", password)];
        let answer = self.post("/login", &form).await;
        assert_eq!(answer.status, 303, "logging in as {name}: {}", answer.body);
        assert_eq!(answer.location.as_deref(), Some("/"));
        let set = answer.set_cookie.expect("a session cookie");
        assert!(set.contains("HttpOnly"), "{set}");
        assert!(set.contains("SameSite=Strict"), "{set}");
        self.cookie = Some(set.split(';').next().unwrap().to_owned());
        self
    }

    async fn answer(&self, request: reqwest::RequestBuilder) -> Answer {
        let request = match &self.cookie {
            Some(c) => request.header("cookie", c),
            None => request,
        };
        let response = request.send().await.unwrap();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        let (location, set_cookie) = (header("location"), header("set-cookie"));
        Answer {
            status: response.status().as_u16(),
            location,
            set_cookie,
            body: response.text().await.unwrap(),
        }
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.answer(self.http.get(format!("{}{path}", self.base)))
            .await
    }

    pub async fn post(&self, path: &str, form: &[(&str, &str)]) -> Answer {
        self.answer(self.http.post(format!("{}{path}", self.base)).form(form))
            .await
    }

    /// The CSRF token of this session, as the page at `path` carries it.
    pub async fn csrf(&self, path: &str) -> String {
        let page = self.get(path).await;
        let at = page
            .body
            .find("name=\"csrf_token\" value=\"")
            .unwrap_or_else(|| panic!("no CSRF token on {path}: {}", page.body));
        let rest = &page.body[at + "name=\"csrf_token\" value=\"".len()..];
        rest[..rest.find('"').unwrap()].to_owned()
    }
}

/// A `replayproof console` process, stopped by its pid when dropped.
pub struct ConsoleProcess {
    child: std::process::Child,
    pub base: String,
}

/// Runs the binary with `args` and `env` (and no other `DATABASE_URL`), its output captured.
pub fn console_command(args: &[&str], env: &[(&str, &str)]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null());
    cmd
}

impl ConsoleProcess {
    /// Starts `replayproof` with `args` and `env`, and waits until it answers at `listen`;
    /// fails the test with what it printed if it exits first.
    pub async fn listening(args: &[&str], env: &[(&str, &str)], listen: &str) -> Self {
        let mut child = console_command(args, env)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn replayproof console");
        let base = format!("http://{listen}");
        let http = reqwest::Client::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let mut said = String::new();
                std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut said)
                    .unwrap();
                panic!("the console exited with {status} before listening: {said}");
            }
            let login = http.get(format!("{base}/login")).send().await;
            if login.is_ok_and(|r| r.status() == 200) {
                return Self { child, base };
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the console never listened"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    pub fn client(&self) -> Client {
        Client::at(&self.base)
    }
}

impl Drop for ConsoleProcess {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}
