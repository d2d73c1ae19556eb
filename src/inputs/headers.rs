//! A Kafka message's headers as they arrived: in order, repeats kept, values as bytes.

/// A message's headers, in the order the producer wrote them. Kafka allows a name twice; the
/// readers here take the last, as librdkafka's `header_get_last` does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, Option<Vec<u8>>)>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a header after the others.
    pub fn push(&mut self, name: impl Into<String>, value: Option<Vec<u8>>) {
        self.0.push((name.into(), value));
    }

    /// The value of the last header named `name` exactly; None when there is none or its
    /// value is null.
    pub fn last(&self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// [`Headers::last`], the name compared without regard to ASCII case (`Content-Type`).
    pub fn last_ignoring_case(&self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .rev()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| v.as_deref())
    }

    /// Each header, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Option<&[u8]>)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_deref()))
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes the headers' names and values take.
    pub fn byte_len(&self) -> usize {
        self.0
            .iter()
            .map(|(n, v)| n.len() + v.as_ref().map_or(0, Vec::len))
            .sum()
    }

    /// The headers as stored with a dead letter: name and value in turn (a null value as
    /// NULL), names as their bytes.
    pub fn to_stored(&self) -> Vec<Option<Vec<u8>>> {
        self.0
            .iter()
            .flat_map(|(n, v)| [Some(n.as_bytes().to_vec()), v.clone()])
            .collect()
    }

    /// The headers [`Headers::to_stored`] wrote; a name that is not UTF-8 is read lossily.
    pub fn from_stored(stored: &[Option<Vec<u8>>]) -> Self {
        let pairs = stored.chunks(2).map(|pair| {
            let name = pair[0].as_deref().unwrap_or_default();
            let value = pair.get(1).cloned().flatten();
            (String::from_utf8_lossy(name).into_owned(), value)
        });
        Self(pairs.collect())
    }
}

impl<N: Into<String>, V: Into<Vec<u8>>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        Self(
            iter.into_iter()
                .map(|(n, v)| (n.into(), Some(v.into())))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_of_repeated_headers_is_read_and_storing_keeps_order_and_nulls() {
        let mut headers: Headers = [("id", "1"), ("ce_type", "a"), ("id", "2")]
            .into_iter()
            .collect();
        headers.push("empty", None);
        assert_eq!(headers.last("id"), Some(&b"2"[..]));
        assert_eq!(headers.last("ID"), None);
        assert_eq!(headers.last_ignoring_case("ID"), Some(&b"2"[..]));
        assert_eq!(headers.last("empty"), None);
        assert_eq!(Headers::from_stored(&headers.to_stored()), headers);
    }
}
