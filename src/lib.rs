//! replayproof makes webhook redeliveries harmless.
//!
//! Events arrive on a Kafka topic as [`envelope::Envelope`]s keyed by a dedupe key. The
//! consumer ([`consume`]) claims each key in PostgreSQL inside the same transaction as the
//! event's [`effect::Effect`], and commits the Kafka offset only after that transaction
//! committed, so every redelivery is a harmless replay with one visible effect per event.
//!
//! With the `cli` feature (on by default), [`Cli`] runs the whole command line with an
//! application's own effects registered by name.

pub mod activity;
#[cfg(feature = "cli")]
pub mod args;
pub mod audit;
pub mod claims;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "cli")]
pub mod config;
#[cfg(feature = "cli")]
pub mod console;
pub mod consume;
pub mod db;
pub mod destinations;
#[cfg(feature = "devkit")]
pub mod devkit;
pub mod dispatch;
pub mod effect;
pub mod envelope;
pub mod ingest;
pub mod inputs;
pub mod kafka;
pub mod operator;
pub mod outbox;
pub mod output;
pub mod retention;
pub mod secrets;
pub mod shard;
pub mod shutdown;
pub mod sources;
pub mod telemetry;
#[cfg(feature = "devkit")]
pub mod testing;
pub mod trace;

#[cfg(feature = "cli")]
pub use cli::Cli;

/// The attribute an [`effect::Effect`] implementation carries (`#[replayproof::async_trait]`),
/// re-exported so that an application needs no dependency of its own on `async-trait`.
pub use async_trait::async_trait;

/// A `fail` failpoint, compiled in only with the `failpoints` feature. Tests use them to stop a
/// real process at a chosen step (for example between the claim and COMMIT) and kill it there.
#[macro_export]
macro_rules! failpoint {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        fail::fail_point!($name);
    };
}

/// A `fail` failpoint that, configured as `return`, ends the process at once with SIGABRT, as a
/// `kill -9` there would: no destructor runs, nothing is flushed or recorded. Compiled in only
/// with the `failpoints` feature.
#[macro_export]
macro_rules! crashpoint {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        (|| {
            fail::fail_point!($name, |_| std::process::abort());
        })();
    };
}

/// An asynchronous stall at a `fail` failpoint: configured as `NAME=return(MS)`, the task sleeps
/// MS milliseconds without blocking a runtime thread, as a slow batch or a hung connection would.
/// Compiled in only with the `failpoints` feature.
#[macro_export]
macro_rules! stallpoint {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        {
            let stall = (|| {
                fail::fail_point!($name, |ms: Option<String>| ms
                    .and_then(|ms| ms.parse::<u64>().ok()));
                None
            })();
            if let Some(ms) = stall {
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
        }
    };
}
