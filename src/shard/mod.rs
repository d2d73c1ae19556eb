//! Where a claim lives when the claims outgrow one PostgreSQL primary: every claim carries a
//! route key (the event key unless its source routes by a tenant field), the route key maps to
//! one of a fixed number of buckets with the hash Citus uses for `text` distribution columns
//! (PostgreSQL's `hashtext`, split into equal `int32` ranges), and the buckets map to shards:
//! databases, or Citus shards behind one coordinator.
//!
//! The shard is a function of the route key alone, never of the Kafka partition: adding
//! partitions moves keys between partitions, never between databases, so a late duplicate
//! always finds its key's claim.

#[cfg(feature = "cli")]
pub mod args;
pub mod citus;
pub mod holdings;
pub mod lint;
#[cfg(feature = "cli")]
mod open;
pub mod reshard;

use crate::db::Db;
use std::ops::Range;
use std::sync::Arc;

pub use crate::db::DEFAULT_BUCKETS;

/// PostgreSQL's `hashtext` of a `text` value in a deterministic collation (such as `"C"`): Bob
/// Jenkins' lookup3 hash as PostgreSQL's `hash_bytes` computes it (`src/common/hashfn.c`), read
/// as a signed 32-bit value. Citus hashes `text` distribution columns with it.
pub fn hashtext(bytes: &[u8]) -> i32 {
    let (mut a, mut b, mut c) = {
        let init = 0x9e37_79b9_u32
            .wrapping_add(bytes.len() as u32)
            .wrapping_add(3_923_095);
        (init, init, init)
    };
    let word = |w: &[u8]| u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
    let mut rest = bytes;
    while rest.len() >= 12 {
        a = a.wrapping_add(word(&rest[0..4]));
        b = b.wrapping_add(word(&rest[4..8]));
        c = c.wrapping_add(word(&rest[8..12]));
        mix(&mut a, &mut b, &mut c);
        rest = &rest[12..];
    }
    // The last 11 bytes at most, little-endian; the lowest byte of `c` is left to the length.
    for (i, &byte) in rest.iter().enumerate() {
        let byte = byte as u32;
        match i {
            0..=3 => a = a.wrapping_add(byte << (8 * i)),
            4..=7 => b = b.wrapping_add(byte << (8 * (i - 4))),
            _ => c = c.wrapping_add(byte << (8 * (i - 7))),
        }
    }
    finish(&mut a, &mut b, &mut c);
    c as i32
}

fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *a = a.wrapping_sub(*c) ^ c.rotate_left(4);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a) ^ a.rotate_left(6);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b) ^ b.rotate_left(8);
    *b = b.wrapping_add(*a);
    *a = a.wrapping_sub(*c) ^ c.rotate_left(16);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a) ^ a.rotate_left(19);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b) ^ b.rotate_left(4);
    *b = b.wrapping_add(*a);
}

fn finish(a: &mut u32, b: &mut u32, c: &mut u32) {
    *c = (*c ^ *b).wrapping_sub(b.rotate_left(14));
    *a = (*a ^ *c).wrapping_sub(c.rotate_left(11));
    *b = (*b ^ *a).wrapping_sub(a.rotate_left(25));
    *c = (*c ^ *b).wrapping_sub(b.rotate_left(16));
    *a = (*a ^ *c).wrapping_sub(c.rotate_left(4));
    *b = (*b ^ *a).wrapping_sub(a.rotate_left(14));
    *c = (*c ^ *b).wrapping_sub(b.rotate_left(24));
}

/// Which of `n` equal ranges of the `int32` hash space `hash` falls in, counted from
/// `i32::MIN`: the shard Citus picks for a hash-distributed table with `n` shards
/// (`shard_count`), each covering `2^32 / n` hash values. For a power of two `n` this is
/// `((hash + 2^31) * n) >> 32`.
pub fn range_index(hash: i32, n: u32) -> u32 {
    let from_min = (hash as i64 - i32::MIN as i64) as u64;
    let width = (1u64 << 32) / n as u64;
    (from_min / width).min(n as u64 - 1) as u32
}

/// Why a shard layout is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("buckets must be a power of two between 1 and 65536, not {0}")]
    Buckets(u32),
    #[error(
        "{shards} shards do not split {buckets} buckets evenly: use a power of two up to {buckets}"
    )]
    Uneven { shards: usize, buckets: u32 },
    #[error("at least one shard is needed")]
    NoShard,
}

/// How route keys map to buckets and buckets to shards: `B` buckets (fixed forever) split into
/// equal contiguous ranges, one per shard in the order the shards are listed, so a key lives on
/// shard `((hashtext(route_key) + 2^31) * N) >> 32`, exactly the shard Citus would pick with
/// `N` shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    buckets: u32,
    shards: u32,
}

impl Default for Layout {
    /// One shard holding every bucket: a single database.
    fn default() -> Self {
        Self {
            buckets: DEFAULT_BUCKETS,
            shards: 1,
        }
    }
}

impl Layout {
    /// `shards` shards over `buckets` buckets; both powers of two, `shards` at most `buckets`.
    pub fn new(buckets: u32, shards: usize) -> Result<Self, LayoutError> {
        if !buckets.is_power_of_two() || buckets > 1 << 16 {
            return Err(LayoutError::Buckets(buckets));
        }
        if shards == 0 {
            return Err(LayoutError::NoShard);
        }
        if shards > buckets as usize || !buckets.is_multiple_of(shards as u32) {
            return Err(LayoutError::Uneven { shards, buckets });
        }
        Ok(Self {
            buckets,
            shards: shards as u32,
        })
    }

    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    pub fn shards(&self) -> usize {
        self.shards as usize
    }

    /// The bucket of a route key.
    pub fn bucket(&self, route_key: &str) -> u32 {
        range_index(hashtext(route_key.as_bytes()), self.buckets)
    }

    /// The shard holding a bucket.
    pub fn shard_of_bucket(&self, bucket: u32) -> usize {
        (bucket / (self.buckets / self.shards)) as usize
    }

    /// The shard of a route key.
    pub fn shard(&self, route_key: &str) -> usize {
        self.shard_of_bucket(self.bucket(route_key))
    }

    /// The buckets a shard holds.
    pub fn buckets_of(&self, shard: usize) -> Range<u32> {
        let per = self.buckets / self.shards;
        shard as u32 * per..(shard as u32 + 1) * per
    }
}

/// The databases claims are spread over, with the layout that says which holds a key. One
/// entry for a single database; with Citus, every entry is the coordinator and the layout
/// mirrors the distributed tables' shard count, so that each transaction stays on one shard.
#[derive(Clone)]
pub struct Shards {
    layout: Layout,
    pools: Arc<[Db]>,
    /// The shards whose pool is a distinct database (all of them, or only the first with
    /// Citus).
    distinct: Arc<[usize]>,
}

impl std::fmt::Debug for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shards")
            .field("layout", &self.layout)
            .field("pools", &self.pools.len())
            .finish()
    }
}

impl From<Db> for Shards {
    /// A single database.
    fn from(pool: Db) -> Self {
        Self {
            layout: Layout::default(),
            pools: Arc::from(vec![pool]),
            distinct: Arc::from(vec![0]),
        }
    }
}

impl Shards {
    /// One pool per shard, in the layout's order.
    pub fn new(layout: Layout, pools: Vec<Db>) -> Result<Self, LayoutError> {
        if pools.len() != layout.shards() {
            return Err(LayoutError::Uneven {
                shards: pools.len(),
                buckets: layout.buckets(),
            });
        }
        Ok(Self {
            layout,
            distinct: (0..pools.len()).collect(),
            pools: Arc::from(pools),
        })
    }

    /// Citus: `shard_count` shards of the distributed tables, all reached through the
    /// coordinator's pool. Each part of a batch is then one shard's transaction, which Citus
    /// routes to one worker without two-phase commit.
    pub fn citus(coordinator: Db, buckets: u32, shard_count: usize) -> Result<Self, LayoutError> {
        let layout = Layout::new(buckets, shard_count)?;
        Ok(Self {
            layout,
            pools: Arc::from(vec![coordinator; shard_count]),
            distinct: Arc::from(vec![0]),
        })
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// How many shards (transaction groups) there are.
    pub fn len(&self) -> usize {
        self.pools.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }

    /// The pool of shard `i`.
    pub fn pool(&self, i: usize) -> &Db {
        &self.pools[i]
    }

    /// The first shard's pool: it also holds every dead letter.
    pub fn first(&self) -> &Db {
        &self.pools[0]
    }

    /// The shard of a route key.
    pub fn shard(&self, route_key: &str) -> usize {
        self.layout.shard(route_key)
    }

    /// Each distinct database once, with the first shard it serves (with Citus, only the
    /// coordinator): what a fan-out reads or a migration runs on.
    pub fn databases(&self) -> impl Iterator<Item = (usize, &Db)> + '_ {
        self.distinct.iter().map(|&i| (i, &self.pools[i]))
    }

    /// Whether each shard is its own database (not shards of one Citus coordinator).
    pub fn is_multi_primary(&self) -> bool {
        self.distinct.len() > 1
    }

    /// The database holding `key`'s claim (or its expired replay), asking each: a key routed by
    /// a tenant field lives on its tenant's shard. With one database, that one. Refused when more
    /// than one holds it (its source's route was changed); None when none does.
    pub async fn holding(&self, key: &str) -> anyhow::Result<Option<Db>> {
        if !self.is_multi_primary() {
            return Ok(Some(self.first().clone()));
        }
        let mut holders = Vec::new();
        for (shard, pool) in self.databases() {
            if crate::claims::holds(pool, key).await? {
                holders.push((shard, pool.clone()));
            }
        }
        match holders.len() {
            0 | 1 => Ok(holders.pop().map(|(_, pool)| pool)),
            _ => anyhow::bail!(
                "the event {key} is claimed on shards {:?}: its source's route changed; add --shard N",
                holders.iter().map(|(s, _)| *s).collect::<Vec<_>>()
            ),
        }
    }

    /// Every distinct database's pool, in order.
    pub fn pools(&self) -> Vec<Db> {
        self.databases().map(|(_, pool)| pool.clone()).collect()
    }

    /// Closes every pool.
    pub async fn close(&self) {
        for (_, pool) in self.databases() {
            pool.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashtext_matches_postgresql_on_known_values() {
        // `SELECT hashtext(x)` on PostgreSQL 15: every tail length and one full block.
        for (text, expected) in [
            ("", -1_477_818_771),
            ("a", 1_075_015_857),
            ("evt_1", -135_355_631),
            ("abcdefghijkl", -1_586_087_212),
            ("abcdefghijklm", 405_849_808),
            ("ünïcødé", -1_156_658_761),
            ("evt_1NqXyZ2eZvKYlo2C0123456789", -1_785_278_283),
        ] {
            assert_eq!(hashtext(text.as_bytes()), expected, "{text:?}");
        }
    }

    #[test]
    fn range_index_agrees_with_the_multiply_and_shift_form_for_powers_of_two() {
        for n in [1u32, 2, 4, 32, 1024] {
            for hash in [i32::MIN, -1, 0, 1, i32::MAX, 123_456_789, -987_654_321] {
                let shifted = (((hash as i64 + (1 << 31)) * n as i64) >> 32) as u32;
                assert_eq!(range_index(hash, n), shifted, "hash {hash}, n {n}");
            }
        }
    }

    #[test]
    fn equal_contiguous_ranges_in_the_order_listed() {
        let layout = Layout::new(1024, 4).unwrap();
        assert_eq!(layout.buckets_of(0), 0..256);
        assert_eq!(layout.buckets_of(3), 768..1024);
        for key in ["evt_1", "evt_2", "ünïcødé", "a".repeat(300).as_str()] {
            let bucket = layout.bucket(key);
            let shard = layout.shard(key);
            assert!(layout.buckets_of(shard).contains(&bucket));
            // The shard Citus would pick with 4 shards.
            assert_eq!(shard as u32, range_index(hashtext(key.as_bytes()), 4));
        }
    }

    #[test]
    fn uneven_and_odd_layouts_are_refused() {
        assert_eq!(Layout::new(1000, 2), Err(LayoutError::Buckets(1000)));
        assert_eq!(
            Layout::new(1024, 3),
            Err(LayoutError::Uneven {
                shards: 3,
                buckets: 1024
            })
        );
        assert_eq!(Layout::new(1024, 0), Err(LayoutError::NoShard));
        assert!(Layout::new(1, 1).is_ok());
    }
}
