//! Keeping secrets out of everything replayproof prints or stores: errors, logs, `config
//! check`, and the outbox's recorded errors.
//!
//! Two layers. Where a value is known to carry a secret (a database URL, a header, a signing
//! key, a librdkafka password, a target URL whose path or query is its credential, as Slack's
//! and Teams' incoming webhooks are), it is redacted where it is shown. And every secret the
//! process was given is registered at start ([`register`]); the log writer and the error
//! printers pass their text through [`scrub`], so a secret that reaches a message some other
//! way (a library's error, a parser echoing its input) is replaced before it is written.

use std::borrow::Cow;
use std::sync::RwLock;

/// What replaces a secret.
pub const REDACTED: &str = "<redacted>";

/// Secrets shorter than this are not scrubbed from text: replacing every occurrence of a
/// three-letter word would garble logs, and so short a secret protects nothing anyway.
pub const MIN_SCRUBBED_LEN: usize = 6;

static KNOWN: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// Remembers `secret` so that [`scrub`] replaces it wherever it appears.
pub fn register(secret: &str) {
    let secret = secret.trim();
    if secret.chars().count() < MIN_SCRUBBED_LEN {
        return;
    }
    let mut known = KNOWN.write().unwrap_or_else(|e| e.into_inner());
    if !known.iter().any(|k| k == secret) {
        known.push(secret.to_owned());
        // Longest first, so a secret that contains another is replaced whole.
        known.sort_by_key(|k| std::cmp::Reverse(k.len()));
    }
}

/// Registers the secret parts of a URL: its password, the values of its credential-like query
/// parameters, and its token-like path segments.
pub fn register_url(url: &str) {
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return;
    };
    if let Some(password) = parsed.password() {
        register(password);
        if let Ok(decoded) = percent_encoding::percent_decode_str(password).decode_utf8() {
            register(&decoded);
        }
    }
    for (k, v) in parsed.query_pairs() {
        if is_secret_query_key(&k) {
            register(&v);
        }
    }
    for segment in parsed.path_segments().into_iter().flatten() {
        if is_token_like(segment) {
            register(segment);
        }
    }
}

/// `text` with every registered secret replaced by [`REDACTED`].
pub fn scrub(text: &str) -> Cow<'_, str> {
    let known = KNOWN.read().unwrap_or_else(|e| e.into_inner());
    if !known.iter().any(|s| text.contains(s.as_str())) {
        return Cow::Borrowed(text);
    }
    let mut out = text.to_owned();
    for secret in known.iter() {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), REDACTED);
        }
    }
    Cow::Owned(out)
}

/// Whether a librdkafka property (or a similar key) holds a secret: passwords, secrets, private
/// keys, JAAS-like configs, tokens.
pub fn is_secret_property(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "key.pem",
        "oauthbearer.config",
        "token",
        "credential",
    ]
    .iter()
    .any(|s| key.contains(s))
}

/// `value` when `key` names no secret, otherwise [`REDACTED`].
pub fn redacted(key: &str, value: &str) -> String {
    if is_secret_property(key) {
        REDACTED.into()
    } else {
        value.into()
    }
}

/// Whether a URL's query parameter carries a credential: `token`, `key`, `sig`, `secret`,
/// `password`, `auth`, `code` and the like (Google Chat's `key` and `token`, Azure's `sig`).
fn is_secret_query_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    is_secret_property(&key)
        || ["key", "sig", "auth", "code", "access", "session", "pass"]
            .iter()
            .any(|s| key.contains(s))
}

/// Whether a path segment looks like a credential rather than a name: 32 characters or more,
/// or 16 or more with a digit in them (Slack's, Discord's and Teams' webhook tokens, GUIDs).
fn is_token_like(segment: &str) -> bool {
    let n = segment.chars().count();
    n >= 32 || (n >= 16 && segment.chars().any(|c| c.is_ascii_digit()))
}

/// A URL as it may be shown: the password, credential-like query values and token-like path
/// segments replaced. Text that is not a URL is replaced whole.
pub fn redact_url(url: &str) -> String {
    let Ok(mut parsed) = reqwest::Url::parse(url) else {
        return format!("{REDACTED}: not a URL");
    };
    // `user:password@host` without `//` parses with `user` as its scheme and the rest as an
    // opaque path: whatever comes before an `@` there may be a credential.
    if parsed.cannot_be_a_base() && url.contains('@') {
        return format!("{REDACTED}: not a URL");
    }
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some("redacted"));
    }
    let pairs: Vec<(String, String)> = parsed
        .query_pairs()
        .map(|(k, v)| {
            let v = match is_secret_query_key(&k) {
                true => "redacted".to_owned(),
                false => v.into_owned(),
            };
            (k.into_owned(), v)
        })
        .collect();
    if !pairs.is_empty() {
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    let segments: Option<Vec<String>> = parsed.path_segments().map(|s| {
        s.map(|seg| match is_token_like(seg) {
            true => "redacted".to_owned(),
            false => seg.to_owned(),
        })
        .collect()
    });
    if let Some(segments) = segments {
        if let Ok(mut path) = parsed.path_segments_mut() {
            path.clear().extend(segments);
        }
    }
    scrub(parsed.as_str()).into_owned()
}

/// A log writer that scrubs every registered secret from each line before it reaches
/// `inner`. The formatter writes a whole line at a time, so a secret is never split.
pub struct Scrubbing<W>(pub W);

impl<W: std::io::Write> std::io::Write for Scrubbing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        match scrub(&text) {
            Cow::Borrowed(_) => self.0.write_all(buf)?,
            Cow::Owned(clean) => self.0.write_all(clean.as_bytes())?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Makes a [`Scrubbing`] writer on stderr for every log line.
pub fn scrubbing_stderr() -> Scrubbing<std::io::Stderr> {
    Scrubbing(std::io::stderr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_written_without_a_scheme_is_not_shown() {
        for given in ["u:pw@host", "user:s3cret@api.example.com/path"] {
            let shown = redact_url(given);
            assert!(
                !shown.contains("pw") && !shown.contains("s3cret"),
                "{shown}"
            );
        }
        assert_eq!(redact_url("mailto:ops"), "mailto:ops");
    }

    #[test]
    fn urls_lose_their_passwords_tokens_and_credential_queries() {
        let shown =
            redact_url("postgres://app:pa55word@db:5432/rp?sslmode=verify-full&password=x1");
        assert!(
            !shown.contains("pa55word") && !shown.contains("x1"),
            "{shown}"
        );
        assert!(
            shown.contains("sslmode=verify-full") && shown.contains("db:5432"),
            "{shown}"
        );
        let slack = "https://hooks.slack.com/services/T0001/B0001/XyZ123abcDEF456ghiJKL789";
        let shown = redact_url(slack);
        assert!(!shown.contains("XyZ123abcDEF456ghiJKL789"), "{shown}");
        assert!(
            shown.starts_with("https://hooks.slack.com/services/T0001/B0001/"),
            "{shown}"
        );
        let shown = redact_url("https://api.example.com/hooks/orders?token=tkn-987654321&v=2");
        assert!(!shown.contains("tkn-987654321"), "{shown}");
        assert!(
            shown.contains("/hooks/orders") && shown.contains("v=2"),
            "{shown}"
        );
        assert_eq!(redact_url("not a url s3cret"), "<redacted>: not a URL");
    }

    #[test]
    fn registered_secrets_are_scrubbed_from_any_text() {
        register("correct-horse-battery");
        register("abc");
        let line = "connecting as correct-horse-battery failed; abc stays";
        assert_eq!(scrub(line), "connecting as <redacted> failed; abc stays");
        let mut out = Vec::new();
        std::io::Write::write_all(&mut Scrubbing(&mut out), line.as_bytes()).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "connecting as <redacted> failed; abc stays"
        );
        register_url(
            "https://chat.example.com/v1/spaces/AAA?key=kkkk-1111-2222&token=tttt-3333-4444",
        );
        assert_eq!(
            scrub("k=kkkk-1111-2222 t=tttt-3333-4444"),
            "k=<redacted> t=<redacted>"
        );
    }
}
