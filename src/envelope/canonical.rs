//! The payload's canonical form (RFC 8785), written straight from the payload's text without
//! building a value; its SHA-256 is the payload hash.

use super::storable::{decimal_exponent, NUL_IN_PAYLOAD, NUMBER_EXPONENT_RANGE};
use super::Malformed;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::fmt;

/// Writes a payload's canonical form, whose SHA-256 is the payload hash, after RFC 8785 (JSON
/// Canonicalization Scheme): object keys sorted by their UTF-16 code units at every depth, no
/// whitespace, serde_json's minimal escapes, the top-level fields in `skip` left out. A
/// re-serialised copy of the same payload hashes the same whatever its key order. Numbers keep
/// the exact text they arrived with, so two payloads differing in a digit past f64's precision
/// never hash the same.
///
/// It reads the payload's JSON text and builds no `serde_json::Value`. Containers are read one
/// level at a time (members and items kept as borrowed text), strings are borrowed unless they
/// hold escapes, and numbers are copied as the text they arrived as, the exponent written `e`
/// and signed. On the way it refuses what PostgreSQL would refuse, including inside the fields
/// left out of the hash: [`super::check_storable`] is this walk writing nowhere.
pub(super) fn write_canonical_text(
    text: &str,
    skip: &[String],
    out: &mut impl std::io::Write,
) -> Result<(), Malformed> {
    let text = text.trim();
    match text.as_bytes().first() {
        Some(b'{') => write_canonical_object(text, skip, out),
        Some(b'[') => write_canonical_array(text, out),
        // Without escapes the text is already what serde_json writes (a NUL can only arrive
        // escaped: raw control characters are not JSON).
        Some(b'"') if !text.contains('\\') => out.write_all(text.as_bytes()).map_err(written),
        Some(b'"') => {
            let Text(s) = serde_json::from_str(text).map_err(not_json)?;
            if s.contains('\0') {
                return Err(Malformed::Unstorable(NUL_IN_PAYLOAD));
            }
            serde_json::to_writer(out, s.as_ref()).map_err(not_json)
        }
        Some(b'-' | b'0'..=b'9') => write_canonical_number(text, out),
        // `true`, `false` and `null`, checked as JSON when the envelope was read.
        _ => out.write_all(text.as_bytes()).map_err(written),
    }
}

fn not_json(e: serde_json::Error) -> Malformed {
    Malformed::NotJson(e.to_string())
}

fn written(e: std::io::Error) -> Malformed {
    Malformed::NotJson(e.to_string())
}

/// An object's members in UTF-16 key order, without the `skip`ped ones.
fn write_canonical_object(
    text: &str,
    skip: &[String],
    out: &mut impl std::io::Write,
) -> Result<(), Malformed> {
    let Members(mut members) = serde_json::from_str(text).map_err(not_json)?;
    if members.iter().any(|(k, _)| k.contains('\0')) {
        return Err(Malformed::Unstorable(NUL_IN_PAYLOAD));
    }
    // A key given twice keeps its last value, as a parsed `Value` does: after a stable sort the
    // last of each run of equal keys is the one kept.
    members.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
    out.write_all(b"{").map_err(written)?;
    let mut first = true;
    for (i, (k, v)) in members.iter().enumerate() {
        let replaced = members.get(i + 1).is_some_and(|(next, _)| next == k);
        if replaced || skip.iter().any(|s| s == k.as_ref()) {
            // Not hashed, but stored with the payload's text all the same.
            write_canonical_text(v.get(), &[], &mut std::io::sink())?;
            continue;
        }
        if !first {
            out.write_all(b",").map_err(written)?;
        }
        first = false;
        serde_json::to_writer(&mut *out, k.as_ref()).map_err(not_json)?;
        out.write_all(b":").map_err(written)?;
        write_canonical_text(v.get(), &[], out)?;
    }
    out.write_all(b"}").map_err(written)
}

fn write_canonical_array(text: &str, out: &mut impl std::io::Write) -> Result<(), Malformed> {
    let items: Vec<&RawValue> = serde_json::from_str(text).map_err(not_json)?;
    out.write_all(b"[").map_err(written)?;
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.write_all(b",").map_err(written)?;
        }
        write_canonical_text(item.get(), &[], out)?;
    }
    out.write_all(b"]").map_err(written)
}

/// A number as it arrived: its text, with the exponent written `e` and signed; refused beyond
/// PostgreSQL's `numeric` range.
fn write_canonical_number(text: &str, out: &mut impl std::io::Write) -> Result<(), Malformed> {
    if !NUMBER_EXPONENT_RANGE.contains(&decimal_exponent(text)) {
        return Err(Malformed::Unstorable(
            "the payload holds a number beyond PostgreSQL's numeric range",
        ));
    }
    match text.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => {
            let sign = match exponent.as_bytes().first() {
                Some(b'+' | b'-') => "",
                _ => "+",
            };
            write!(out, "{mantissa}e{sign}{exponent}").map_err(written)
        }
        None => out.write_all(text.as_bytes()).map_err(written),
    }
}

/// A JSON string, borrowed from the text unless it holds escapes.
#[derive(Deserialize)]
#[serde(transparent)]
pub(crate) struct Text<'a>(#[serde(borrow)] pub(crate) std::borrow::Cow<'a, str>);

/// A JSON object's members in the order written, duplicates included, values as text.
pub(crate) struct Members<'a>(pub(crate) Vec<(std::borrow::Cow<'a, str>, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(Text(k)) = map.next_key()? {
                    members.push((k, map.next_value()?));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(Visitor)
    }
}
