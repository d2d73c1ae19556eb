//! replayproof's integration tests, in one binary. Scenarios are grouped by the capability
//! they prove; the helpers they share are in `harness`.

mod harness;

mod batch;
mod compose;
mod consume;
mod dev_and_demo;
mod dispatch;
mod effects;
mod end_to_end;
mod example_orders;
#[cfg(feature = "failpoints")]
mod failpoints;
mod ingest;
mod operator;
mod processes;
mod production;
mod schema;
mod secrets;
mod signatures;
mod status;
mod telemetry;
