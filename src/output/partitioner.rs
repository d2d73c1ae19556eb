//! The output partition of a record, fixed before its first send: the Java client's default
//! partitioner (murmur2 of the key, its sign bit cleared, modulo the partition count), so an
//! output topic is key-partitioned the way Kafka users expect, whichever client wrote it.

/// The seed of Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`).
const KAFKA_SEED: u32 = 0x9747_b28c;

/// Kafka's murmur2 hash of `bytes`, as the Java client computes it.
pub fn murmur2(bytes: &[u8]) -> i32 {
    murmur2::murmur2(bytes, KAFKA_SEED) as i32
}

/// The partition of `key` among `partitions`: `toPositive(murmur2(key)) % partitions`.
pub fn partition_of(key: &[u8], partitions: i32) -> i32 {
    assert!(partitions > 0, "a topic has at least one partition");
    (murmur2(key) & 0x7fff_ffff) % partitions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_the_java_clients() {
        // The cases of Kafka's own UtilsTest.testMurmur2.
        for (bytes, hash) in [
            (&b"21"[..], -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ] {
            assert_eq!(murmur2(bytes), hash, "{}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn a_partition_is_within_the_count_and_stable() {
        for n in 1..50 {
            let p = partition_of(b"evt-1", n);
            assert!((0..n).contains(&p));
            assert_eq!(p, partition_of(b"evt-1", n));
        }
    }
}
