//! replayproof's integration tests, in one binary, grouped by the capability they prove; the
//! helpers they share are in `harness`.

// A test reads as its whole story, set-up and assertions together: long ones are allowed here.
#![allow(clippy::too_many_lines)]

mod harness;

/// Applying events once: batches, the consumer group, effects and deferral, real processes
/// killed and restarted, and the example binary.
mod consume {
    mod batch;
    mod effects;
    mod example_orders;
    mod group;
    mod processes;
}
/// Operations as the requests real APIs take, and each destination's limits.
mod destinations;
/// The outbox's delivery under leases, with idempotency keys, against a fake downstream.
mod dispatch;
/// The business boundary: operations keyed by their obligation, and the downstream's
/// idempotency window, through the binaries.
mod obligations;
/// The consumer's inputs: replayproof's envelope and its schema, CloudEvents and Debezium's
/// outbox messages, each read through the binary.
mod inputs {
    mod cloudevents;
    mod debezium;
    mod envelope_schema;
    mod headers;
}
/// The HTTP ingress: requests, their answers and what reaches the topic; each signature scheme.
mod ingest {
    mod overload;
    mod requests;
    mod signatures;
}
/// The Kafka output: each claimed event's record once in the output topic, through kills,
/// races and a broker's restart (`--features failpoints`).
#[cfg(feature = "failpoints")]
mod output;
/// An operator's pauses of destinations and sources, through the binaries and the console.
mod pauses;
/// The database reached through a transaction-mode pooler (PgBouncer): every guarantee holds.
mod pooler;
/// Which buckets each database holds: lists that disagree are refused, moves cut off finish.
mod shard_layout;
/// Claims and effects spread over several databases by route key, as Citus would shard them.
mod shards;
/// Every connection over TLS: PostgreSQL, Kafka with SASL/SCRAM, dispatch over HTTPS.
mod tls;
/// The operator's console: its pages and actions over HTTP, and in a real browser.
mod console {
    mod browser;
    mod errors;
    mod logins;
    mod pages;
    mod process;
    mod sessions;
}
/// The operator's commands, `status`, and retention: prune, expired replays, erasure.
mod operator {
    mod commands;
    mod erasure;
    mod replay;
    mod retention;
    mod status;
}
/// What a deployment reads: the compose file, the schema, the secrets, the metrics and alerts,
/// `dev` and `demo`; the command line's completion, manual pages and errors.
mod deploy {
    mod cli;
    mod compose;
    mod config_check;
    mod dev_and_demo;
    mod kubernetes;
    mod kustomize;
    mod schema;
    mod secrets;
    mod telemetry;
}
/// The whole pipeline as processes: ingest, the broker, consume.
mod end_to_end;
/// This process's own code stopped at a chosen step (`--features failpoints`).
#[cfg(feature = "failpoints")]
mod failpoints;
