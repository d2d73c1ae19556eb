//! What every request the dispatcher sends carries besides the payload: configured headers
//! (such as `Authorization`), and an optional Standard Webhooks signature, so a downstream can
//! authenticate deliveries with the official verifier libraries.

use crate::outbox::RESERVED_HEADERS;
use anyhow::Context as _;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;
use std::fmt;
use std::path::Path;
use std::time::Duration;

/// The signing key of outbound deliveries: `whsec_` and base64, as Standard Webhooks issues it.
#[derive(Clone)]
pub struct SigningSecret(Vec<u8>);

impl SigningSecret {
    /// The shortest key accepted, in bytes, as for incoming sources.
    pub const MIN_BYTES: usize = 16;

    /// Reads `whsec_<base64>` (or the base64 alone). The text is registered as a secret
    /// first, so that nothing prints it, even when it is refused.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        crate::secrets::register(text);
        let encoded = text.trim().strip_prefix("whsec_").unwrap_or(text.trim());
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|_| anyhow::anyhow!("a signing secret is base64 after whsec_"))?;
        anyhow::ensure!(
            bytes.len() >= Self::MIN_BYTES,
            "the signing secret is {} bytes; at least {} are required",
            bytes.len(),
            Self::MIN_BYTES
        );
        Ok(Self(bytes))
    }

    /// The `webhook-signature` value for `body` sent as message `id` at `timestamp` (Unix
    /// seconds): `v1,` and the base64 HMAC-SHA256 of `id.timestamp.body`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        let signature = mac.finalize().into_bytes();
        format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(signature)
        )
    }
}

impl fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningSecret(<redacted>)")
    }
}

impl std::str::FromStr for SigningSecret {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        Self::parse(s)
    }
}

/// One `NAME=VALUE` header for every outbound request. The value is sensitive: it never prints.
#[derive(Clone)]
pub struct Header {
    pub name: HeaderName,
    pub value: HeaderValue,
}

impl Header {
    /// A header whose value may be secret: it is registered as one ([`crate::secrets`]) before
    /// anything is checked, so that no error, log or `config check` line prints it; errors
    /// never repeat the value.
    pub fn secret(name: &str, value: &str) -> Result<Self, String> {
        crate::secrets::register(value);
        let name = HeaderName::try_from(name.trim())
            .map_err(|_| format!("{:?} is not a header name", name.trim()))?;
        if RESERVED_HEADERS.contains(&name.as_str()) {
            return Err(format!(
                "the {name} header is set by replayproof on every request"
            ));
        }
        let mut value = HeaderValue::try_from(value).map_err(|_| {
            format!(
                "the value of {name} is not a header value (a control character such as a \
                 line break, perhaps at its end?)"
            )
        })?;
        value.set_sensitive(true);
        Ok(Self { name, value })
    }
}

impl std::str::FromStr for Header {
    type Err = String;

    /// `NAME=VALUE`, where `${VAR}` in the value is read from the environment, so a token need
    /// not be written on the command line: `--header 'Authorization=Bearer ${DOWNSTREAM_TOKEN}'`.
    /// The value is registered as a secret ([`crate::secrets`]) before anything is checked, so
    /// that no error, log or `config check` line prints it; errors never repeat the input.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, value) = s
            .split_once('=')
            .ok_or_else(|| "expected NAME=VALUE".to_owned())?;
        crate::secrets::register(value);
        if HeaderName::try_from(name.trim()).is_err() {
            return Err(
                "the text before `=` is not a header name (expected NAME=VALUE)".to_owned(),
            );
        }
        let value = expand_env(value).map_err(|e| format!("header {}: {e:#}", name.trim()))?;
        Self::secret(name, &value)
    }
}

#[cfg(feature = "cli")]
fn expand_env(value: &str) -> anyhow::Result<String> {
    crate::config::expand_str(value, &crate::config::ProcessEnv)
}

#[cfg(not(feature = "cli"))]
fn expand_env(value: &str) -> anyhow::Result<String> {
    Ok(value.to_owned())
}

impl fmt::Debug for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: <redacted>", self.name)
    }
}

/// How the dispatcher's requests leave: trusted roots, headers and signing.
#[derive(Debug, Clone, Default)]
pub struct Outbound {
    /// Headers sent with every delivery and reconcile.
    pub headers: Vec<Header>,
    /// Named credentials, whose headers go with the operations that name them.
    pub credentials: super::Credentials,
    /// Signs each delivery with the Standard Webhooks scheme when set.
    pub signing: Option<SigningSecret>,
    /// PEM certificates trusted besides the system's roots (a private CA).
    pub ca_certificates: Vec<reqwest::Certificate>,
}

impl Outbound {
    /// Reads the PEM bundle at `path` (one or more certificates) as extra trusted roots.
    pub fn trust_pem_file(&mut self, path: &Path) -> anyhow::Result<()> {
        let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("{} is not a PEM certificate bundle", path.display()))?;
        anyhow::ensure!(!certs.is_empty(), "{} holds no certificate", path.display());
        self.ca_certificates.extend(certs);
        Ok(())
    }

    /// The HTTP client: the system's roots and the extra ones, no redirects, the timeouts.
    pub fn client(&self, request_timeout: Duration) -> anyhow::Result<reqwest::Client> {
        let mut headers = HeaderMap::new();
        for h in &self.headers {
            headers.append(h.name.clone(), h.value.clone());
        }
        // A redirect would turn a POST into a body-less GET and carry the Idempotency-Key to
        // another host: a 3xx is an answer to record, never to follow.
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .https_only(false)
            .redirect(reqwest::redirect::Policy::none())
            .default_headers(headers)
            .timeout(request_timeout)
            .connect_timeout(request_timeout.min(Duration::from_secs(5)));
        for cert in &self.ca_certificates {
            builder = builder.add_root_certificate(cert.clone());
        }
        builder.build().context("building the HTTP client")
    }

    /// The signature headers of one delivery, when signing is on.
    pub fn signature_headers(&self, id: &str, body: &[u8]) -> Vec<(&'static str, String)> {
        let Some(secret) = &self.signing else {
            return Vec::new();
        };
        let timestamp = chrono::Utc::now().timestamp();
        vec![
            ("webhook-id", id.to_owned()),
            ("webhook-timestamp", timestamp.to_string()),
            ("webhook-signature", secret.sign(id, timestamp, body)),
        ]
    }
}

/// Checks a target or reconcile URL at start-up: http or https, with a host, so a typo fails at
/// once instead of after every attempt. `{key}` (a reconcile template's placeholder) is allowed.
/// The URL's credentials (a password, a token in its path or query, as incoming webhooks of
/// Slack or Teams carry) are registered as secrets, and errors show it redacted.
pub fn check_url(url: &str) -> Result<String, String> {
    crate::secrets::register_url(&url.replace("{key}", "key"));
    let parsed =
        reqwest::Url::parse(&url.replace("{key}", "key")).map_err(|e| format!("not a URL: {e}"))?;
    let shown = crate::secrets::redact_url(url);
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "{shown}: the scheme must be http or https, not {}",
            parsed.scheme()
        ));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(format!("{shown} names no host"));
    }
    Ok(url.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_at_start() {
        assert!(check_url("https://api.example.com/hooks").is_ok());
        assert!(check_url("http://127.0.0.1:8080/ops/{key}").is_ok());
        for bad in [
            "htps://x/y",
            "ftp://x/y",
            "localhost:8080/x",
            "http://:80/x",
            "x",
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn headers_read_the_environment_and_never_print() {
        std::env::set_var("REPLAYPROOF_TEST_HEADER_TOKEN", "t0ken-value");
        let h: Header = "Authorization=Bearer ${REPLAYPROOF_TEST_HEADER_TOKEN}"
            .parse()
            .unwrap();
        assert_eq!(h.value.to_str().unwrap(), "Bearer t0ken-value");
        assert!(h.value.is_sensitive());
        assert!(!format!("{h:?}").contains("t0ken"));
        assert!("Idempotency-Key=x".parse::<Header>().is_err());
        assert!("X-Missing=${REPLAYPROOF_TEST_UNSET_VARIABLE}"
            .parse::<Header>()
            .is_err());
    }

    #[test]
    fn short_signing_secrets_are_refused() {
        assert!(SigningSecret::parse("whsec_c2hvcnQ=").is_err());
        let s = SigningSecret::parse("whsec_MDEyMzQ1Njc4OWFiY2RlZg==").unwrap();
        assert!(s.sign("id", 1, b"{}").starts_with("v1,"));
        assert!(!format!("{s:?}").contains("MDEy"));
    }
}
