//! The login limiter. A request's user name is capped before anything else is done with it;
//! the client's address is checked first (a refused address costs the limiter nothing more);
//! names are remembered only by their hash, and only once a login under them failed; a name's
//! failures slow its next attempts down (a growing delay), never lock it out, so nobody can
//! keep a user from logging in by failing under their name. Behind the trusted proxies the
//! client is the address `X-Forwarded-For` names, so one proxy's address is not everyone's.

use governor::{DefaultKeyedRateLimiter, Quota};
use http::HeaderMap;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The longest user name looked at; a longer one is no user's.
pub const MAX_NAME_BYTES: usize = 256;
/// How much of a name a log line shows.
const LOGGED_NAME_CHARS: usize = 64;
/// Failed logins under one name before its attempts are slowed down.
const FREE_FAILURES: u32 = 5;
/// How much each further failure adds to the name's delay, and the most it grows to.
const DELAY_STEP: Duration = Duration::from_millis(250);
const MAX_DELAY: Duration = Duration::from_secs(5);
/// A name's failures are forgotten this long after its last one.
const FORGET_FAILURES_AFTER: Duration = Duration::from_secs(15 * 60);
/// How many addresses or names the limiter holds before it forgets the idle ones.
const FORGET_AFTER_KEYS: usize = 10_000;

/// A user name as the limiter and the logs see it.
pub(crate) struct Name<'a> {
    /// The name, when it is short enough to be anyone's.
    pub text: Option<&'a str>,
    digest: [u8; 32],
}

impl<'a> Name<'a> {
    pub fn new(given: &'a str) -> Self {
        let capped = &given.as_bytes()[..given.len().min(MAX_NAME_BYTES)];
        Self {
            text: (given.len() <= MAX_NAME_BYTES).then_some(given),
            digest: Sha256::digest(capped).into(),
        }
    }

    /// The name for a log line: its start, escaped.
    pub fn logged(given: &str) -> String {
        let start: String = given.chars().take(LOGGED_NAME_CHARS).collect();
        match start.len() < given.len() {
            true => format!("{start:?}…"),
            false => format!("{start:?}"),
        }
    }
}

/// The limits of logins.
pub(crate) struct Logins {
    by_address: DefaultKeyedRateLimiter<IpAddr>,
    /// Failed logins by the name's hash: how many, and when the last was.
    failures: Mutex<HashMap<[u8; 32], (u32, Instant)>>,
}

impl Logins {
    pub fn new(per_minute: u32) -> Self {
        let per_minute = NonZeroU32::new(per_minute.max(1)).expect("at least one");
        Self {
            by_address: DefaultKeyedRateLimiter::keyed(Quota::per_minute(per_minute)),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `client` may try now (false: too many attempts from it this minute); when it
    /// may, how long the attempt under `name` waits first.
    pub fn admit(&self, client: IpAddr, name: &Name<'_>) -> Option<Duration> {
        if self.by_address.len() > FORGET_AFTER_KEYS {
            self.by_address.retain_recent();
        }
        self.by_address.check_key(&client).ok()?;
        let failures = self.failures.lock().expect("failures lock");
        let failed = failures.get(&name.digest).map_or(0, |(n, _)| *n);
        Some(delay_after(failed))
    }

    /// A login under `name` failed.
    pub fn failed(&self, name: &Name<'_>) {
        let mut failures = self.failures.lock().expect("failures lock");
        if failures.len() > FORGET_AFTER_KEYS {
            failures.retain(|_, (_, at)| at.elapsed() < FORGET_FAILURES_AFTER);
            forget_oldest(&mut failures);
        }
        let entry = failures.entry(name.digest).or_insert((0, Instant::now()));
        if entry.1.elapsed() >= FORGET_FAILURES_AFTER {
            entry.0 = 0;
        }
        *entry = (entry.0.saturating_add(1), Instant::now());
    }

    /// A login under `name` succeeded: its delay is gone.
    pub fn succeeded(&self, name: &Name<'_>) {
        self.failures
            .lock()
            .expect("failures lock")
            .remove(&name.digest);
    }

    /// How many names the limiter remembers.
    #[cfg(test)]
    fn names(&self) -> usize {
        self.failures.lock().expect("failures lock").len()
    }
}

/// Forgets the names whose last failure is oldest until half the room is free: a flood of
/// made-up names pushes out the oldest, not a victim's recent failures all at once.
fn forget_oldest(failures: &mut HashMap<[u8; 32], (u32, Instant)>) {
    if failures.len() <= FORGET_AFTER_KEYS {
        return;
    }
    let mut times: Vec<Instant> = failures.values().map(|(_, at)| *at).collect();
    times.sort_unstable();
    let cut = times[failures.len() - FORGET_AFTER_KEYS / 2];
    failures.retain(|_, (_, at)| *at >= cut);
}

/// The wait before an attempt under a name that failed `failed` times.
fn delay_after(failed: u32) -> Duration {
    let over = failed.saturating_sub(FREE_FAILURES);
    (DELAY_STEP * over).min(MAX_DELAY)
}

/// The client a request comes from: its peer, or, when the peer is a trusted proxy, the last
/// address of `X-Forwarded-For` that is not one of the trusted proxies.
pub(crate) fn client(peer: IpAddr, headers: &HeaderMap, trusted: &[IpAddr]) -> IpAddr {
    if !trusted.contains(&peer) {
        return peer;
    }
    let forwarded = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|a| a.trim().parse::<IpAddr>().ok())
        .collect::<Vec<_>>();
    forwarded
        .into_iter()
        .rev()
        .find(|a| !trusted.contains(a))
        .unwrap_or(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_refused_address_costs_nothing_and_names_are_kept_by_hash_only_once_failed() {
        let logins = Logins::new(2);
        let huge = "x".repeat(2 << 20);
        let name = Name::new(&huge);
        assert_eq!(name.text, None, "too long to be anyone's");
        for _ in 0..2 {
            assert!(logins.admit(ip("10.0.0.1"), &name).is_some());
        }
        for i in 0..100 {
            let other = format!("made-up-{i}");
            assert!(logins.admit(ip("10.0.0.1"), &Name::new(&other)).is_none());
        }
        assert_eq!(logins.names(), 0, "asking remembers no name");
        logins.failed(&name);
        assert_eq!(logins.names(), 1);
        assert!(Name::logged(&huge).len() < 80);
    }

    #[test]
    fn failures_slow_a_name_down_and_never_lock_it_out() {
        let logins = Logins::new(1000);
        let ann = Name::new("ann");
        for _ in 0..FREE_FAILURES {
            assert_eq!(logins.admit(ip("10.0.0.1"), &ann), Some(Duration::ZERO));
            logins.failed(&ann);
        }
        let mut last = Duration::ZERO;
        for _ in 0..100 {
            let wait = logins
                .admit(ip("10.0.0.2"), &ann)
                .expect("never locked out");
            assert!(wait >= last && wait <= MAX_DELAY, "{wait:?}");
            last = wait;
            logins.failed(&ann);
        }
        assert_eq!(last, MAX_DELAY);
        logins.succeeded(&ann);
        assert_eq!(logins.admit(ip("10.0.0.3"), &ann), Some(Duration::ZERO));
    }

    #[test]
    fn behind_a_trusted_proxy_the_client_is_the_forwarded_address() {
        let proxy = [ip("127.0.0.1")];
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-forwarded-for",
            "203.0.113.9, 198.51.100.7".parse().unwrap(),
        );
        assert_eq!(
            client(ip("127.0.0.1"), &headers, &proxy),
            ip("198.51.100.7")
        );
        // From anyone else the header is the client's own word: ignored.
        assert_eq!(client(ip("192.0.2.1"), &headers, &proxy), ip("192.0.2.1"));
        let none = HeaderMap::new();
        assert_eq!(client(ip("127.0.0.1"), &none, &proxy), ip("127.0.0.1"));
        // A chain of trusted proxies: the last address that is none of them.
        let chain = [ip("127.0.0.1"), ip("10.0.0.5")];
        headers.insert("x-forwarded-for", "203.0.113.9, 10.0.0.5".parse().unwrap());
        assert_eq!(client(ip("127.0.0.1"), &headers, &chain), ip("203.0.113.9"));
    }
}
