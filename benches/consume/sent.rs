//! Stage L's PostgreSQL-alone runs with each batch sent by the client, as the consumer sends it
//! once its messages are parsed: the keys, routes, sources, types, hashes and offsets of 500
//! events and their payloads as JSON text, made before the clock starts.
//!
//! - **LA** the claim with its columns as arrays, one statement (what the consumer does,
//!   [`replayproof::claims::claim`]);
//! - **LC** the columns copied into a temporary table first (`COPY … FROM STDIN`, the table
//!   emptied at each commit), then the same claim reading the table: two statements and the
//!   copy's own round trip.
//!
//! The ledger insert that follows is the consumer's, arrays in both. Each run has two clients,
//! one connection each, and keys that arrive in no order, as stage L's do.

use crate::limit::{claim_over, Cost, Meter};
use crate::{pool, Database, BATCH};
use sqlx::Connection as _;
use std::fmt::Write as _;

/// How the claim's columns travel.
#[derive(Clone, Copy, PartialEq)]
pub enum Form {
    Arrays,
    Copy,
}

const UNNEST: &str = "unnest($3::text[], $4::text[], $5::text[], $6::bytea[], \
    $7::timestamptz[], $8::int8[], $9::text[], $10::text[], $11::text[]) \
    AS u(k, s, t, h, r, o, q, tp, rk)";

const TEMP_TABLE: &str = "CREATE TEMP TABLE IF NOT EXISTS claim_in (k text, s text, t text, \
    h bytea, r timestamptz, o int8, q text, tp text, rk text) ON COMMIT DELETE ROWS";

const LEDGER: &str = "INSERT INTO ledger (event_key, source, event_type, payload, route_key)
     SELECT k, s, t, p::jsonb, rk
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) AS u(k, s, t, p, rk)";

/// One batch's columns, as the consumer has them after parsing.
struct Batch {
    keys: Vec<String>,
    sources: Vec<String>,
    types: Vec<Option<String>>,
    hashes: Vec<Vec<u8>>,
    offsets: Vec<i64>,
    payloads: Vec<String>,
}

impl Batch {
    /// Events `lo..hi` of a backlog of `events`: the keys stage L's [`crate::backlog::KEY`]
    /// makes, in the same order, 100 B payloads.
    fn new(lo: usize, hi: usize, events: usize) -> Self {
        let numbers = lo as u64..hi as u64;
        let keys: Vec<String> = numbers
            .clone()
            .map(|g| format!("lim-100-{:08}", g * 2654435761 % events as u64))
            .collect();
        Self {
            sources: vec!["bench".to_owned(); keys.len()],
            types: vec![Some("bench.event".to_owned()); keys.len()],
            hashes: keys.iter().map(|k| sha(k)).collect(),
            offsets: numbers.clone().map(|g| g as i64).collect(),
            payloads: numbers
                .map(|g| {
                    format!(
                        r#"{{"id":"evt_{g}","amount":{},"pad":"Zq3xT9bLk2VwP8nRc4YhJ6mFd1GsA7eUo5KtQ0iXyWzB"}}"#,
                        g % 10000
                    )
                })
                .collect(),
            keys,
        }
    }

    /// The claim's columns as `COPY` text: tab-separated, `\N` for null, bytea as `\\x…`.
    fn copy_text(&self) -> String {
        let mut out = String::with_capacity(self.keys.len() * 160);
        for i in 0..self.keys.len() {
            let t = self.types[i].as_deref().unwrap_or("\\N");
            let (k, s, o) = (&self.keys[i], &self.sources[i], self.offsets[i]);
            let _ = write!(out, "{k}\t{s}\t{t}\t\\\\x");
            for b in &self.hashes[i] {
                let _ = write!(out, "{b:02x}");
            }
            let _ = writeln!(out, "\t\\N\t{o}\t\\N\t\\N\t{k}");
        }
        out
    }
}

/// A 32-byte hash standing in for the payload's.
fn sha(key: &str) -> Vec<u8> {
    use sha2::Digest as _;
    sha2::Sha256::digest(key.as_bytes()).to_vec()
}

/// One transaction: the claim (as `form` says), the ledger insert, the commit.
async fn apply(conn: &mut sqlx::PgConnection, form: Form, b: &Batch, partition: i32) {
    type Row = (String, Option<String>, Option<Vec<u8>>);
    let mut tx = conn.begin().await.unwrap();
    let claimed: Vec<Row> = match form {
        Form::Arrays => {
            let none: Vec<Option<String>> = vec![None; b.keys.len()];
            let times: Vec<Option<chrono::DateTime<chrono::Utc>>> = vec![None; b.keys.len()];
            sqlx::query_as(&claim_over(UNNEST))
                .bind("bench")
                .bind(partition)
                .bind(&b.keys)
                .bind(&b.sources)
                .bind(&b.types)
                .bind(&b.hashes)
                .bind(times)
                .bind(&b.offsets)
                .bind(&none)
                .bind(&none)
                .bind(&b.keys)
                .fetch_all(&mut *tx)
                .await
        }
        Form::Copy => {
            let mut copy = tx
                .copy_in_raw("COPY claim_in (k, s, t, h, r, o, q, tp, rk) FROM STDIN")
                .await
                .unwrap();
            copy.send(b.copy_text().into_bytes()).await.unwrap();
            copy.finish().await.unwrap();
            sqlx::query_as(&claim_over("claim_in AS u"))
                .bind("bench")
                .bind(partition)
                .fetch_all(&mut *tx)
                .await
        }
    }
    .unwrap();
    assert_eq!(claimed.len(), b.keys.len());
    sqlx::query(LEDGER)
        .bind(&b.keys)
        .bind(&b.sources)
        .bind(&b.types)
        .bind(&b.payloads)
        .bind(&b.keys)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// LA or LC: two clients, each applying its half of `events` in batches of 500.
pub async fn stage(db: &Database, url: &str, events: usize, form: Form) -> Cost {
    const CLIENTS: usize = 2;
    let pool = pool(url, CLIENTS as u32).await;
    let per_client = events / CLIENTS;
    let mut work = Vec::new();
    for c in 0..CLIENTS {
        let mut conn = pool.pool().acquire().await.unwrap();
        sqlx::query(TEMP_TABLE).execute(&mut *conn).await.unwrap();
        let first = c * per_client;
        let batches: Vec<Batch> = (first..first + per_client)
            .step_by(BATCH)
            .map(|lo| Batch::new(lo, (lo + BATCH).min(first + per_client), events))
            .collect();
        work.push((conn, batches));
    }
    let meter = Meter::start(db, url).await;
    let tasks: Vec<_> = work
        .into_iter()
        .enumerate()
        .map(|(c, (mut conn, batches))| {
            tokio::spawn(async move {
                for b in &batches {
                    apply(&mut conn, form, b, c as i32).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let cost = meter.cost(db, url, per_client * CLIENTS).await;
    pool.close().await;
    cost
}
