//! The login limiter as a client meets it: behind the trusted proxy each client has its own
//! allowance, a name that failed is slowed down and never locked out, and a name of any size
//! costs the limiter nothing.

use crate::harness::console::{settings, TestConsole};
use crate::harness::TestDb;
use std::time::Instant;

/// `POST /login` as `name` with `password`, through the proxy for `client`: the status.
async fn login(console: &TestConsole, client: &str, name: &str, password: &str) -> u16 {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("{}/login", console.base))
        .header("x-forwarded-for", client)
        .form(&[("username", name), ("password", password)])
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_the_proxy_each_client_has_its_own_allowance_and_a_failing_name_is_only_slowed() {
    let db = TestDb::new().await;
    let mut s = settings();
    s.trusted_proxies = vec!["127.0.0.1".parse().unwrap()];
    let console = TestConsole::start(&db, s).await;
    // One client spends its ten attempts a minute; the next client is not refused for it.
    for _ in 0..10 {
        assert_eq!(login(&console, "203.0.113.1", "nobody", "x").await, 401);
    }
    assert_eq!(login(&console, "203.0.113.1", "nobody", "x").await, 429);
    assert_eq!(login(&console, "203.0.113.2", "ann", "ann-pass").await, 303);
    // Eleven wrong passwords for ann from eleven places: each answered, none refused, and
    // ann still logs in, the later attempts only slower.
    for i in 0..11 {
        let client = format!("198.51.100.{i}");
        assert_eq!(login(&console, &client, "ann", "wrong").await, 401);
    }
    let started = Instant::now();
    assert_eq!(login(&console, "192.0.2.50", "ann", "ann-pass").await, 303);
    assert!(started.elapsed().as_millis() >= 1000, "slowed down");
    // A name of 1 MiB is no user's: refused as a wrong login, at no cost.
    let huge = "n".repeat(1 << 20);
    assert_eq!(login(&console, "192.0.2.60", &huge, "x").await, 401);
}
