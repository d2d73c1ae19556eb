//! The nothing-installed world: an embedded PostgreSQL and mock Kafka cluster, the stack that
//! picks real or embedded ones, PgBouncer in front of a database (for the pooler's tests),
//! development sources with known secrets, a request signer, a fake downstream, and the `dev`
//! and `demo` commands built from them.

pub mod demo;
pub mod dev;
pub mod downstream;
pub mod embedded;
pub mod pgbouncer;
pub mod sign;
pub mod sources;
pub mod stack;
