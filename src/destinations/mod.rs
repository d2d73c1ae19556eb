//! Destinations: where outbox operations are sent, each keyed by its origin. Their settings
//! (`[dispatch.destinations]`: limits, idempotency header and window, in [`settings`]), the
//! two rules every dispatcher follows for one ([`admit`] and the breaker's [`transition`]),
//! and their shared state in PostgreSQL (`outbox_destinations`, all its SQL in `shared`, an
//! operator's pause of one in [`pauses`]).
//!
//! The dispatcher asks here what it may lease and tells here what each answer said; the
//! operations themselves are the outbox's ([`crate::outbox`]).

mod admission;
pub mod pauses;
pub mod settings;
mod shared;

pub use admission::{
    admit, transition, Admission, Breaker, BreakerChange, DestinationState, Health, Limits, Pause,
    Verdict, DEFAULT_BREAKER_OPEN, RATE_HORIZON,
};
pub use pauses::DestinationRow;
pub use settings::{Destination, Destinations, DEFAULT_IDEMPOTENCY_HEADER, KNOWN_WINDOWS};
pub use shared::{
    destination_gauges, lease_within_limits, record_health, Admitted, DestinationGauge, LimitsHome,
};
