//! What PostgreSQL would refuse in an event, found before the batch's transaction meets it:
//! nesting too deep to read back, a NUL character, a number past `numeric`, a date before
//! 4713 BC.

use super::canonical::write_canonical_text;
use super::Malformed;
use chrono::{DateTime, Datelike as _, Utc};
use serde_json::value::RawValue;

/// The deepest nesting of arrays and objects a payload may have: the most serde_json reads back
/// (its recursion limit of 128 counts the level it refuses). Checked without recursion before
/// anything else walks the payload, so a payload nested 200,000 levels deep is a dead letter,
/// not a stack overflow.
pub const MAX_NESTING: usize = 127;

/// Whether JSON `text` nests arrays and objects more than `limit` deep, found in one pass
/// without recursion (brackets inside strings do not count). A string's contents are skipped
/// to its next quote or backslash at once, so most of a body is passed over without looking at
/// each byte.
pub(crate) fn nests_deeper_than(text: &str, limit: usize) -> bool {
    let bytes = text.as_bytes();
    let (mut depth, mut i) = (0usize, 0usize);
    while let Some(&b) = bytes.get(i) {
        i += 1;
        match b {
            b'"' => loop {
                // Inside a string: jump to its next quote or backslash.
                match memchr::memchr2(b'"', b'\\', &bytes[i.min(bytes.len())..]) {
                    None => return false,
                    Some(at) if bytes[i + at] == b'"' => {
                        i += at + 1;
                        break;
                    }
                    // A backslash escapes the byte after it.
                    Some(at) => i += at + 2,
                }
            },
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// The earliest instant PostgreSQL's `timestamptz` holds: 4713 BC, which is year -4712.
pub(super) const EARLIEST_STORABLE_YEAR: i32 = -4712;

/// Refuses what PostgreSQL would refuse inside the batch transaction: a NUL character in any
/// text (PostgreSQL's `text` and `jsonb` cannot hold one, though JSON may carry it as `\u0000`),
/// a number beyond `numeric`'s range, and a `received_at` before 4713 BC. Checked by the
/// ingress before producing and by the consumer when parsing (the same walk over the payload's
/// text), so such an event is refused or dead-lettered, never retried forever.
pub fn check_storable(
    key: &str,
    source: &str,
    event_type: Option<&str>,
    received_at: Option<DateTime<Utc>>,
    payload: &RawValue,
) -> Result<(), Malformed> {
    check_fields(key, source, event_type, received_at)?;
    if nests_deeper_than(payload.get(), MAX_NESTING) {
        return Err(Malformed::TooDeep);
    }
    write_canonical_text(payload.get(), &[], &mut std::io::sink())
}

/// [`check_storable`] for everything but the payload.
pub(super) fn check_fields(
    key: &str,
    source: &str,
    event_type: Option<&str>,
    received_at: Option<DateTime<Utc>>,
) -> Result<(), Malformed> {
    if [Some(key), Some(source), event_type]
        .into_iter()
        .flatten()
        .any(|s| s.contains('\0'))
    {
        return Err(Malformed::Unstorable(
            "the key, source or type holds a NUL character",
        ));
    }
    if received_at.is_some_and(|t| t.year() < EARLIEST_STORABLE_YEAR) {
        return Err(Malformed::Unstorable(
            "received_at is before 4713 BC, outside PostgreSQL's timestamps",
        ));
    }
    Ok(())
}

/// The largest power of ten PostgreSQL's `numeric` (and so `jsonb`) holds is about 10^131071,
/// the smallest about 10^-16383; these bounds leave room for the digits themselves.
pub(super) const NUMBER_EXPONENT_RANGE: std::ops::RangeInclusive<i64> = -16_000..=130_000;

pub(super) const NUL_IN_PAYLOAD: &str = "the payload holds a NUL character (\\u0000)";

/// The power of ten of a JSON number's leading digit, from its text: 1234.5 is 3, 0.01 is -2,
/// 5e7 is 7, read from the text as it arrived.
pub(super) fn decimal_exponent(text: &str) -> i64 {
    let text = text.trim_start_matches('-');
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(i) => (&text[..i], text[i + 1..].parse::<i64>().unwrap_or(i64::MAX)),
        None => (text, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let int = int.trim_start_matches('0');
    let lead = if !int.is_empty() {
        int.len() as i64 - 1
    } else {
        match frac.find(|c: char| c != '0') {
            Some(zeros) => -(zeros as i64) - 1,
            None => 0,
        }
    };
    exponent.saturating_add(lead)
}
