//! `[dispatch.credentials]`: the named credentials an operation may ask for, each bound to the
//! origins it may be sent to.
//!
//! ```toml
//! [dispatch.credentials.stripe_live]
//! headers = { Authorization = "Bearer ${STRIPE_LIVE_KEY}" }
//! origins = ["https://api.stripe.com"]   # the only origins it is ever sent to
//! ```

use super::outbound::Header;
use crate::outbox;
use anyhow::Context as _;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The named credentials: headers added to the requests of the operations that name them,
/// each only to the origins it is bound to.
#[derive(Debug, Clone, Default)]
pub struct Credentials(pub BTreeMap<String, Credential>);

/// One named credential: its headers and the origins they may be sent to.
#[derive(Debug, Clone)]
pub struct Credential {
    pub headers: Vec<Header>,
    /// Origins (`https://api.stripe.com`), as [`outbox::origin`] writes them.
    pub origins: Vec<String>,
}

/// One credential as the file writes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialFile {
    headers: BTreeMap<String, String>,
    origins: Vec<String>,
}

impl Credentials {
    /// Reads `[dispatch.credentials]`: `NAME = { headers = { Header = "value" } }`, the values
    /// already read from the environment (`${VAR}`) and kept secret.
    pub fn from_table(table: Option<&toml::Value>) -> anyhow::Result<Self> {
        let Some(table) = table else {
            return Ok(Self::default());
        };
        let entries: BTreeMap<String, toml::Value> = table
            .clone()
            .try_into()
            .context("[dispatch.credentials] holds one table per credential")?;
        let mut credentials = BTreeMap::new();
        for (name, value) in entries {
            let file: CredentialFile = value
                .try_into()
                .with_context(|| format!("[dispatch.credentials.{name}]"))?;
            let headers = file
                .headers
                .iter()
                .map(|(header, value)| Header::secret(header, value))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("[dispatch.credentials.{name}]: {e}"))?;
            anyhow::ensure!(
                !headers.is_empty(),
                "[dispatch.credentials.{name}] has no headers"
            );
            let origins = bound_origins(&name, &file.origins)?;
            credentials.insert(name, Credential { headers, origins });
        }
        Ok(Self(credentials))
    }

    /// The headers of the credential `name` for a request to `url`; refused, saying why, when
    /// the configuration has no such credential or binds it to other origins. No name, none.
    pub fn headers_for(&self, name: Option<&str>, url: &str) -> Result<&[Header], String> {
        let Some(name) = name else { return Ok(&[]) };
        let credential = self
            .0
            .get(name)
            .ok_or_else(|| format!("the credential {name:?} is not in [dispatch.credentials]"))?;
        let origin = outbox::origin(url);
        if !credential.origins.contains(&origin) {
            return Err(format!(
                "the credential {name:?} is sent only to {}, never to {origin}",
                credential.origins.join(", ")
            ));
        }
        Ok(&credential.headers)
    }
}

/// A credential's `origins`: at least one, each a bare origin (scheme, host, port).
fn bound_origins(name: &str, given: &[String]) -> anyhow::Result<Vec<String>> {
    anyhow::ensure!(
        !given.is_empty(),
        "[dispatch.credentials.{name}] names no origins: say where it may be sent \
         (origins = [\"https://api.example.com\"])"
    );
    given
        .iter()
        .map(|o| {
            let origin = outbox::origin(o);
            anyhow::ensure!(
                origin == o.trim_end_matches('/') && origin.contains("://"),
                "[dispatch.credentials.{name}] origins: {o:?} is not an origin \
                 (scheme://host[:port], no path)"
            );
            Ok(origin)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_secret_headers() {
        let table: toml::Table = toml::from_str(
            "[credentials.stripe_live]\nheaders = { Authorization = \"Bearer sk_live_abcdef123456\" }\norigins = [\"https://api.stripe.com\"]\n",
        )
        .unwrap();
        let c = Credentials::from_table(table.get("credentials")).unwrap();
        let h = &c.0["stripe_live"].headers[0];
        assert_eq!(h.name.as_str(), "authorization");
        assert!(h.value.is_sensitive());
        assert!(!format!("{c:?}").contains("sk_live"));
        let bad: toml::Table = toml::from_str(
            "[credentials.x]\nheaders = { Content-Type = \"a\" }\norigins = [\"https://a.b\"]\n",
        )
        .unwrap();
        assert!(Credentials::from_table(bad.get("credentials")).is_err());
    }

    #[test]
    fn a_credential_goes_only_to_the_origins_it_is_bound_to() {
        let read = |origins: &str| {
            let text = format!(
                "[credentials.live]\nheaders = {{ Authorization = \"Bearer sk_live_abcdef\" }}\n{origins}"
            );
            let table: toml::Table = toml::from_str(&text).unwrap();
            Credentials::from_table(table.get("credentials"))
        };
        let unbound = format!("{:#}", read("").unwrap_err());
        assert!(unbound.contains("origins"), "{unbound}");
        let refused = read("origins = []\n").unwrap_err();
        assert!(format!("{refused:#}").contains("names no origins"));
        let path = read("origins = [\"https://api.stripe.com/v1\"]\n").unwrap_err();
        assert!(format!("{path:#}").contains("is not an origin"), "{path:#}");
        let c =
            read("origins = [\"https://api.stripe.com\", \"https://files.stripe.com:8443/\"]\n")
                .unwrap();
        let to = |url: &str| c.headers_for(Some("live"), url).map(|h| h.len());
        assert_eq!(to("https://api.stripe.com/v1/refunds"), Ok(1));
        assert_eq!(to("https://files.stripe.com:8443/x"), Ok(1));
        for elsewhere in [
            "https://evil.example/v1",
            "http://api.stripe.com/v1",
            "https://api.stripe.com.evil.example/",
            "https://api.stripe.com:444/",
        ] {
            let said = to(elsewhere).unwrap_err();
            assert!(
                said.contains("sent only to https://api.stripe.com"),
                "{said}"
            );
        }
        assert_eq!(
            c.headers_for(None, "https://evil.example").map(|h| h.len()),
            Ok(0)
        );
        assert!(c
            .headers_for(Some("other"), "https://api.stripe.com")
            .is_err());
    }
}
