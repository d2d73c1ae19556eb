//! What stage L's runs claim and start from: the backlog's keys as PostgreSQL alone makes them
//! in the server (the very keys the consumers claim), the ledger insert over them, and the
//! database every run copies, empty or with weeks of claims already in it.

use crate::common::env_or;
use crate::limit::settle;
use crate::{pool, Database};

/// The key of event number `n` of stage L's backlog: the key `Workload::new("lim", events, 0,
/// 100, …)` gives it (`lim-100-` and the number, zero-padded to 8 digits), so PostgreSQL alone
/// claims the very keys the consumers claim.
pub const KEY: &str = "'lim-100-' || repeat('0', greatest(0, 8 - length(n::text))) || n";

/// The batch of the numbers `$3..=$4` of a backlog of `$5` events made in the server, as
/// [`crate::limit::claim_over`] takes it, with one payload hash for all (the hash is only
/// stored). Each number `g` is event `g × 2654435761 mod $5` (a prime multiplier: a bijection of
/// the backlog), so the keys arrive in no order, as event ids do: keys in order would let every
/// index insert land on the same rightmost page.
pub fn generated() -> String {
    format!(
        "(SELECT {KEY} AS k, 'bench' AS s, 'bench.event' AS t, \
         decode(repeat('ab', 32), 'hex') AS h, NULL::timestamptz AS r, g AS o, NULL::text AS q, \
         NULL::text AS tp, {KEY} AS rk \
         FROM generate_series($3::int8, $4::int8) AS g, \
         LATERAL (SELECT (g * 2654435761) % $5::int8) AS x(n)) AS u"
    )
}

/// The ledger effect's statement ([`replayproof::effect::Ledger`]) over the same keys (`$1..=$2`
/// of `$3`), each payload about 100 B of JSON text made in the server and parsed as `jsonb`.
pub fn ledger() -> String {
    format!(
        r#"INSERT INTO ledger (event_key, source, event_type, payload, route_key)
           SELECT {KEY}, 'bench', 'bench.event',
                  ('{{"id":"evt_' || g || '","amount":' || g % 10000
                   || ',"pad":"Zq3xT9bLk2VwP8nRc4YhJ6mFd1GsA7eUo5KtQ0iXyWzB"}}')::jsonb, {KEY}
           FROM generate_series($1::int8, $2::int8) AS g,
                LATERAL (SELECT (g * 2654435761) % $3::int8) AS x(n)"#
    )
}

/// The database stage L's runs are copies of, when not the empty migrated template: with
/// `BENCH_LIMIT_PREFILL` claims settled a day ago and their ledger rows already in it, vacuumed
/// and analysed, as a backlog finds a claims table that holds weeks of keys. Their keys fall
/// among the runs' own keys in the indexes, as event ids from one sender do: the key of each
/// event of the backlog ([`KEY`]) followed by `.1`, `.2`, … (a backlog of `events`).
pub async fn prefilled(db: &Database, events: usize) -> Option<String> {
    let keys = env_or("BENCH_LIMIT_PREFILL", 0);
    if keys == 0 {
        return None;
    }
    let url = db.fresh("bench_template").await;
    let p = pool(&url, 1).await;
    let old = format!("{KEY} || '.' || (g / $2::int8 + 1)");
    let from = "FROM generate_series(0, $1::int8 - 1) AS g, LATERAL (SELECT g % $2::int8) AS x(n)";
    for sql in [
        format!(
            "INSERT INTO processed_events (event_key, route_key, source, event_type, status,
                 payload_sha256, kafka_topic, kafka_partition, kafka_offset, attempts,
                 claimed_at, completed_at)
             SELECT {old}, {old}, 'bench', 'bench.event', 'done', sha256(g::text::bytea),
                    'bench', 0, g, 1, now() - interval '1 day', now() - interval '1 day'
             {from}"
        ),
        format!(
            "INSERT INTO ledger (event_key, source, event_type, payload, route_key, applied_at)
             SELECT {old}, 'bench', 'bench.event',
                    jsonb_build_object('id', 'evt_' || g, 'amount', g % 10000, 'pad', md5(g::text)),
                    {old}, now() - interval '1 day'
             {from}"
        ),
    ] {
        let mut conn = p.pool().acquire().await.unwrap();
        sqlx::query("SET statement_timeout = 0")
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::query(&sql)
            .bind(keys as i64)
            .bind(events as i64)
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    p.close().await;
    settle(&url).await;
    println!("  prefilled: {keys} claims and ledger rows a day old");
    Some(url)
}
