//! Sources as an operator pauses them: `sources pause NAME` holds a source's events in the
//! consumers (claimed and deferred, their effect not run) until `sources resume NAME`, while
//! ingest keeps accepting its deliveries. All SQL for `source_pauses` is in [`pauses`]; the
//! consumer asks [`Paused`] which sources it holds.

pub mod pauses;

pub use pauses::{Paused, SourcePause, HELD_REASON};
