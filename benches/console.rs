//! What the console's pages cost over a large table, side by side in one run against one
//! PostgreSQL: `BENCH_CLAIMS` (1,000,000) claims, one in a thousand failed with an operation
//! failed too, claimed a second apart; then each page asked `BENCH_REQUESTS` (50) times by a
//! logged-in client:
//!
//! - the **overview**, the **first page** of events, a **deep page** (the page after the
//!   event 90% of the way down, by its cursor), a **state search** (failed events), **key
//!   prefix** searches matching 1,000 and 10,000 old events, and one event's **story**;
//! - beside them, the baselines: a **bare endpoint** of the same server (the stylesheet: no
//!   database), **PostgreSQL alone** running the first page's keyset query, and a **naive
//!   peer**: the deep page as `OFFSET` would fetch it, which is what keyset paging avoids.
//!
//! Printed: p50 and p99 of each, and each page's p50 as a ratio to the bare endpoint's and
//! (the first and deep page) to PostgreSQL alone. Without `DATABASE_URL` a throwaway
//! PostgreSQL is started.
//!
//! `cargo bench --bench console`

// A benchmark's run reads as one script, start to finish: long ones are allowed here.
#![allow(clippy::too_many_lines)]

use replayproof::console::{self, ConsoleFile, ConsoleSettings, HashParams, Role, UserConfig};
use replayproof::db::Db;
use replayproof::devkit::embedded::EmbeddedPostgres;
use replayproof::effect::Registry;
use std::time::{Duration, Instant};

#[allow(dead_code)]
mod common;
use common::env_or;

async fn fill(pool: &Db, claims: i64) {
    sqlx::query(
        "INSERT INTO processed_events (event_key, route_key, source, event_type, status, \
         payload_sha256, payload, kafka_topic, kafka_partition, kafka_offset, attempts, \
         last_error, claimed_at, completed_at) \
         SELECT 'stripe:evt_' || lpad(i::text, 8, '0'), 'stripe:evt_' || lpad(i::text, 8, '0'), \
                'stripe', 'charge.succeeded', \
                CASE WHEN i % 1000 = 0 THEN 'failed' ELSE 'done' END, \
                sha256(i::text::bytea), \
                CASE WHEN i % 1000 = 0 THEN jsonb_build_object('amount', i) END, \
                'webhooks', i % 8, i / 8, CASE WHEN i % 1000 = 0 THEN 3 ELSE 1 END, \
                CASE WHEN i % 1000 = 0 THEN 'card declined' END, \
                now() - make_interval(secs => $1 - i), now() - make_interval(secs => $1 - i) \
         FROM generate_series(1, $1::int8) AS i",
    )
    .bind(claims)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox (operation_key, event_key, route_key, operation, destination, payload, \
         state, attempts, origin) \
         SELECT event_key || '#deliver', event_key, route_key, 'deliver', 'https://api.example.com/x', \
                '\\x7b7d', 'failed', 3, 'https://api.example.com' \
         FROM processed_events WHERE status = 'failed'",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("VACUUM ANALYZE processed_events")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("VACUUM ANALYZE outbox")
        .execute(pool)
        .await
        .unwrap();
}

/// p50 and p99 of `n` runs of `f`, in milliseconds.
async fn measure<F, Fut>(n: usize, mut f: F) -> (f64, f64)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    f().await; // warm
    let mut times: Vec<Duration> = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        f().await;
        times.push(start.elapsed());
    }
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    (ms(times[n / 2]), ms(times[(n * 99 / 100).min(n - 1)]))
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let claims = env_or("BENCH_CLAIMS", 1_000_000) as i64;
    let requests = env_or("BENCH_REQUESTS", 50);
    let embedded = match std::env::var("DATABASE_URL") {
        Ok(u) if !u.is_empty() => None,
        _ => Some(EmbeddedPostgres::start_with(&["shared_buffers=512MB"]).unwrap()),
    };
    let url = embedded
        .as_ref()
        .map(EmbeddedPostgres::url)
        .unwrap_or_else(|| std::env::var("DATABASE_URL").unwrap());
    runtime.block_on(async {
        let admin = Db::from(sqlx::PgPool::connect(&url).await.unwrap());
        let base = url.rsplit_once('/').unwrap().0.to_owned();
        let name = "bench_console";
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&admin)
            .await
            .unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .unwrap();
        let pool = replayproof::db::pool(&format!("{base}/{name}").parse().unwrap(), 8).unwrap();
        replayproof::db::migrate(&pool).await.unwrap();
        let started = Instant::now();
        fill(&pool, claims).await;
        println!(
            "{claims} claims ({} failed, each with a failed operation) written and analysed in {:.1} s; {} requests per page",
            claims / 1000,
            started.elapsed().as_secs_f64(),
            requests
        );

        let hash = console::hash_password_with("pw", HashParams::new(1024, 1, 1, None).unwrap())
            .unwrap();
        let file = ConsoleFile {
            session_key: Some("a benchmark session key of thirty-two bytes or more".into()),
            users: vec![UserConfig {
                name: "bench".into(),
                role: Role::Viewer,
                password_hash: Some(hash),
            }],
            ..ConsoleFile::default()
        };
        let settings = ConsoleSettings::new("127.0.0.1:0".parse().unwrap(), file).unwrap();
        let served = console::Console::bind(settings, pool.clone(), Registry::default())
            .await
            .unwrap();
        let at = format!("http://{}", served.addr());
        let _running = served.run_until_stopped(tokio_util::sync::CancellationToken::new());
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let login = http
            .post(format!("{at}/login"))
            .form(&[("username", "bench"), ("password", "pw")])
            .send()
            .await
            .unwrap();
        let cookie = login.headers()["set-cookie"].to_str().unwrap();
        let cookie = cookie.split(';').next().unwrap().to_owned();

        // The cursor of the event 90% of the way down, newest first.
        let depth = claims * 9 / 10;
        let (at_time, at_key): (chrono::DateTime<chrono::Utc>, String) = sqlx::query_as(
            "SELECT claimed_at, event_key FROM processed_events \
             ORDER BY claimed_at DESC, event_key DESC OFFSET $1 LIMIT 1",
        )
        .bind(depth)
        .fetch_one(&pool)
        .await
        .unwrap();
        let cursor = replayproof::operator::search::Cursor {
            claimed_at: at_time,
            key: at_key,
        };
        let failed_key = format!("stripe:evt_{:08}", (claims / 2000) * 1000);

        let page = |path: String| {
            let (http, cookie, at) = (http.clone(), cookie.clone(), at.clone());
            move || {
                let (http, cookie, url) = (http.clone(), cookie.clone(), format!("{at}{path}"));
                async move {
                    let r = http.get(url).header("cookie", cookie).send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().await.unwrap();
                }
            }
        };
        let mut rows: Vec<(&str, (f64, f64))> = Vec::new();
        rows.push(("bare endpoint (stylesheet)", measure(requests, page("/static/console.css".into())).await));
        rows.push(("overview", measure(requests, page("/".into())).await));
        rows.push(("events, first page", measure(requests, page("/events".into())).await));
        rows.push((
            "events, deep page (90%)",
            measure(requests, page(format!("/events?after={cursor}"))).await,
        ));
        rows.push(("events, state=failed", measure(requests, page("/events?state=failed".into())).await));
        rows.push((
            "events, key prefix (1,000 keys)",
            measure(requests, page("/events?q=stripe:evt_00999*".into())).await,
        ));
        rows.push((
            "events, key prefix (10,000 keys)",
            measure(requests, page("/events?q=stripe:evt_0012*".into())).await,
        ));
        rows.push((
            "one event's story",
            measure(requests, page(format!("/events/{failed_key}"))).await,
        ));
        let keyset = "SELECT event_key FROM processed_events ORDER BY claimed_at DESC, event_key DESC LIMIT 51";
        rows.push((
            "PostgreSQL alone: first page",
            measure(requests, || async {
                sqlx::query(keyset).fetch_all(&pool).await.unwrap();
            })
            .await,
        ));
        rows.push((
            "PostgreSQL alone: deep page by keyset",
            measure(requests, || async {
                sqlx::query(
                    "SELECT event_key FROM processed_events WHERE (claimed_at, event_key) < ($1, $2) \
                     ORDER BY claimed_at DESC, event_key DESC LIMIT 51",
                )
                .bind(cursor.claimed_at)
                .bind(&cursor.key)
                .fetch_all(&pool)
                .await
                .unwrap();
            })
            .await,
        ));
        rows.push((
            "naive peer: deep page by OFFSET",
            measure(requests.min(10), || async {
                sqlx::query(
                    "SELECT event_key FROM processed_events \
                     ORDER BY claimed_at DESC, event_key DESC OFFSET $1 LIMIT 50",
                )
                .bind(depth)
                .fetch_all(&pool)
                .await
                .unwrap();
            })
            .await,
        ));
        let bare = rows[0].1 .0;
        let pg_first = rows[8].1 .0;
        let pg_deep = rows[9].1 .0;
        println!("{:<40} {:>9} {:>9} {:>12} {:>12}", "", "p50 ms", "p99 ms", "/ bare", "/ pg alone");
        for (i, (name, (p50, p99))) in rows.iter().enumerate() {
            let vs_pg = match i {
                2 => format!("{:.1}x", p50 / pg_first),
                3 => format!("{:.1}x", p50 / pg_deep),
                10 => format!("{:.1}x", p50 / pg_deep),
                _ => String::new(),
            };
            println!("{name:<40} {p50:>9.2} {p99:>9.2} {:>11.1}x {vs_pg:>12}", p50 / bare);
        }
        pool.close().await;
        sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
            .execute(&admin)
            .await
            .unwrap();
    });
}
