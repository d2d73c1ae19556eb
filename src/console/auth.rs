//! Users, logins and sessions: argon2id hashes, signed session cookies, CSRF tokens bound to a
//! session, login attempts limited per address and slowed per name (`limiter`), and a trusted
//! proxy's header.

use super::layout::document;
use super::problem::PageError;
use super::{ConsoleSettings, State, SESSION_LIFETIME};
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum_extra::extract::cookie::{Cookie, Key, SameSite, SignedCookieJar};
use hmac::{Hmac, Mac};
use maud::html;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use std::net::{IpAddr, SocketAddr};

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "replayproof_session";

/// What a user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads every page; sees payloads only when `show_payloads_to_viewers` allows it.
    Viewer,
    /// Reads, and acts: retry, resolve, replay.
    Operator,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Operator => "operator",
        }
    }
}

/// One `[[console.users]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    pub name: String,
    pub role: Role,
    /// An argon2id PHC string (`replayproof console hash-password`). Without one the user logs
    /// in only through the trusted proxy's header.
    #[serde(default)]
    pub password_hash: Option<String>,
}

impl UserConfig {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.name.is_empty() && !self.name.chars().any(char::is_control),
            "[[console.users]]: a name must be non-empty printable text"
        );
        if let Some(hash) = &self.password_hash {
            let parsed = PasswordHash::new(hash).map_err(|e| {
                anyhow::anyhow!(
                    "[[console.users]] {}: password_hash is no PHC string: {e}",
                    self.name
                )
            })?;
            anyhow::ensure!(
                parsed.algorithm.as_str() == "argon2id",
                "[[console.users]] {}: password_hash is {}, not argon2id",
                self.name,
                parsed.algorithm
            );
        }
        Ok(())
    }
}

/// An argon2id PHC string of `password`, with argon2's default (OWASP) parameters.
pub fn hash_password(password: &str) -> anyhow::Result<String> {
    hash_password_with(password, argon2::Params::default())
}

/// [`hash_password`] with chosen parameters (tests use cheap ones).
pub fn hash_password_with(password: &str, params: argon2::Params) -> anyhow::Result<String> {
    let salt = SaltString::encode_b64(&random_bytes::<16>())
        .map_err(|e| anyhow::anyhow!("making a salt: {e}"))?;
    let argon = Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    Ok(argon
        .hash_password(password.as_bytes(), &salt)
        .map_err(|e| anyhow::anyhow!("hashing: {e}"))?
        .to_string())
}

/// `N` random bytes from the operating system, as hex.
pub fn random_hex<const N: usize>() -> String {
    hex::encode(random_bytes::<N>())
}

/// Random bytes from the operating system.
fn random_bytes<const N: usize>() -> [u8; N] {
    use argon2::password_hash::rand_core::{OsRng, RngCore};
    let mut bytes = [0u8; N];
    OsRng.fill_bytes(&mut bytes);
    bytes
}

/// The keys and limits of logins.
pub(crate) struct Auth {
    pub(crate) cookie_key: Key,
    csrf_key: Vec<u8>,
    logins: super::limiter::Logins,
    /// Verified when the name is unknown, so an unknown name costs what a wrong password does.
    dummy_hash: String,
}

impl Auth {
    pub(super) fn new(settings: &ConsoleSettings) -> anyhow::Result<Self> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&settings.session_key)
            .expect("HMAC takes any key length");
        mac.update(b"replayproof console csrf");
        let csrf_key = mac.finalize().into_bytes().to_vec();
        // The same cost as a real user's hash.
        let params = settings
            .users
            .iter()
            .find_map(|u| u.password_hash.as_deref())
            .and_then(|h| PasswordHash::new(h).ok())
            .and_then(|h| argon2::Params::try_from(&h).ok())
            .unwrap_or_default();
        let dummy = hex::encode(random_bytes::<16>());
        Ok(Self {
            cookie_key: Key::derive_from(&settings.session_key),
            csrf_key,
            logins: super::limiter::Logins::new(settings.logins_per_minute),
            dummy_hash: hash_password_with(&dummy, params)?,
        })
    }

    /// The CSRF token of a session: an HMAC of its id, so it needs no storage.
    fn csrf(&self, session: &str) -> String {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.csrf_key).expect("HMAC takes any key length");
        mac.update(session.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    /// The CSRF token of a user the trusted proxy names: bound to the user and to the hour,
    /// so it changes every hour (the last hour's is still taken, for a form opened just before).
    fn proxy_csrf(&self, session: &str, hour: i64) -> String {
        self.csrf(&format!("{session}\0{hour}"))
    }

    /// Whether `token` is the CSRF token of `session`, compared in constant time.
    fn csrf_matches(&self, session: &str, token: &str) -> bool {
        let Ok(token) = hex::decode(token) else {
            return false;
        };
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.csrf_key).expect("HMAC takes any key length");
        mac.update(session.as_bytes());
        mac.verify_slice(&token).is_ok()
    }
}

/// What the signed session cookie holds.
#[derive(Serialize, Deserialize)]
struct Session {
    /// The user's name; the role is read from the configuration at each request.
    u: String,
    /// A random id, which the CSRF token is bound to.
    s: String,
    /// When it ends, in Unix seconds.
    e: i64,
}

/// The logged-in user of a request.
#[derive(Debug, Clone)]
pub(crate) struct User {
    pub(crate) name: String,
    pub(crate) role: Role,
    /// The session's id: what the CSRF token is bound to.
    session: String,
    /// Named by the trusted proxy's header: its CSRF token turns with the hour.
    proxied: bool,
    /// The CSRF token every action form of this session carries.
    pub(crate) csrf: String,
}

impl User {
    /// Whether `token` is this session's CSRF token.
    pub(crate) fn csrf_ok(&self, state: &State, token: Option<&str>) -> bool {
        let Some(token) = token else { return false };
        if !self.proxied {
            return state.auth.csrf_matches(&self.session, token);
        }
        let hour = this_hour();
        [hour, hour - 1].iter().any(|h| {
            state
                .auth
                .csrf_matches(&format!("{}\0{h}", self.session), token)
        })
    }

    /// Whether this user sees payloads and raw bytes.
    pub(crate) fn sees_payloads(&self, state: &State) -> bool {
        self.role == Role::Operator || state.settings.show_payloads_to_viewers
    }
}

/// The peer's address, when the connection gave one.
fn peer(parts: &Parts) -> Option<IpAddr> {
    parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| addr.ip())
}

impl FromRequestParts<State> for User {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &State) -> Result<Self, Response> {
        let to_login = || Redirect::to("/login").into_response();
        let settings = &state.settings;
        // A trusted proxy's header names the user; from anyone else it is ignored.
        if let Some(header) = &settings.auth_header {
            let trusted = peer(parts).is_some_and(|ip| settings.trusted_proxies.contains(&ip));
            if let (true, Some(name)) = (trusted, parts.headers.get(header.as_str())) {
                let name = name.to_str().map_err(|_| to_login())?;
                let user = settings.users.iter().find(|u| u.name == name);
                let user = user.ok_or_else(|| {
                    PageError::new(
                        StatusCode::FORBIDDEN,
                        "Not a console user",
                        format!("The proxy names {name:?}, who is not among [[console.users]]."),
                    )
                    .into_response()
                })?;
                let session = format!("proxy\0{}", user.name);
                return Ok(Self {
                    name: user.name.clone(),
                    role: user.role,
                    csrf: state.auth.proxy_csrf(&session, this_hour()),
                    session,
                    proxied: true,
                });
            }
        }
        let jar =
            SignedCookieJar::<Key>::from_headers(&parts.headers, state.auth.cookie_key.clone());
        let cookie = jar.get(SESSION_COOKIE).ok_or_else(to_login)?;
        let session: Session = serde_json::from_str(cookie.value()).map_err(|_| to_login())?;
        if session.e <= chrono::Utc::now().timestamp() {
            return Err(to_login());
        }
        // A user removed from the configuration is logged out at once.
        let user = settings
            .users
            .iter()
            .find(|u| u.name == session.u)
            .ok_or_else(to_login)?;
        // Logged out, or opened with another password_hash: over.
        let live = super::sessions::live(state.desk.first(), user, &session.s).await;
        match live {
            Ok(true) => {}
            Ok(false) => return Err(to_login()),
            Err(e) => return Err(unavailable(&e)),
        }
        Ok(Self {
            name: user.name.clone(),
            role: user.role,
            csrf: state.auth.csrf(&session.s),
            session: session.s,
            proxied: false,
        })
    }
}

/// Whether the request reached us over TLS: through a trusted proxy that says so.
fn over_tls(state: &State, parts_headers: &HeaderMap, peer: Option<IpAddr>) -> bool {
    let trusted = peer.is_some_and(|ip| state.settings.trusted_proxies.contains(&ip));
    trusted
        && parts_headers
            .get("x-forwarded-proto")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

/// `GET /login`.
pub(crate) async fn login_page() -> Response {
    login_form(StatusCode::OK, None)
}

fn login_form(status: StatusCode, problem: Option<&str>) -> Response {
    let body = html! {
        main class="login" {
            h1 { "replayproof" }
            @if let Some(problem) = problem { p class="problem" role="alert" { (problem) } }
            form method="post" action="/login" {
                label { "User" input name="username" id="username" autocomplete="username" required autofocus; }
                label { "Password" input name="password" id="password" type="password" autocomplete="current-password" required; }
                button type="submit" id="login" { "Log in" }
            }
        }
    };
    (status, document("Log in", None, body)).into_response()
}

/// 429 with `Retry-After`: too many attempts from one address this minute.
fn too_many() -> Response {
    let mut response = login_form(
        StatusCode::TOO_MANY_REQUESTS,
        Some("Too many attempts: wait a minute and try again."),
    );
    response.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("60"),
    );
    response
}

/// `POST /login`: a session cookie for a right name and password, within the attempts allowed.
pub(crate) async fn login(
    axum::extract::State(state): axum::extract::State<State>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    fields: super::form::Fields,
) -> Response {
    let given = fields.get("username").unwrap_or_default();
    // Capped before anything else; the address is checked before the name is looked at.
    let name = super::limiter::Name::new(given);
    let client = super::limiter::client(peer.ip(), &headers, &state.settings.trusted_proxies);
    let Some(wait) = state.auth.logins.admit(client, &name) else {
        tracing::warn!(address = %client, "Too many login attempts from one address.");
        return too_many();
    };
    // A name that failed often waits longer each time; it is never locked out.
    tokio::time::sleep(wait).await;
    let username = name.text.unwrap_or_default().to_owned();
    let password = fields
        .all("password")
        .first()
        .map(|p| p.to_string())
        .unwrap_or_default();
    let user = state
        .settings
        .users
        .iter()
        .find(|u| name.text.is_some() && u.name == username)
        .cloned();
    let verified = verify(&state, user.as_ref(), password).await;
    let Some(user) = user.filter(|u| verified && u.password_hash.is_some()) else {
        state.auth.logins.failed(&name);
        let logged = super::limiter::Name::logged(given);
        tracing::info!(address = %client, user = %logged, "A login failed.");
        return login_form(StatusCode::UNAUTHORIZED, Some("Wrong user or password."));
    };
    state.auth.logins.succeeded(&name);
    let tls = over_tls(&state, &headers, Some(peer.ip()));
    start_session(&state, &user, tls, jar).await
}

/// Whether `password` is `user`'s; an unknown user costs what a wrong password does.
async fn verify(state: &State, user: Option<&UserConfig>, password: String) -> bool {
    let hash = user
        .and_then(|u| u.password_hash.clone())
        .unwrap_or_else(|| state.auth.dummy_hash.clone());
    tokio::task::spawn_blocking(move || {
        PasswordHash::new(&hash)
            .map(|h| {
                Argon2::default()
                    .verify_password(password.as_bytes(), &h)
                    .is_ok()
            })
            .unwrap_or(false)
    })
    .await
    .unwrap_or(false)
}

/// Opens a session for `user` and answers with its cookie, `Secure` over `tls`.
async fn start_session(
    state: &State,
    user: &UserConfig,
    tls: bool,
    jar: SignedCookieJar,
) -> Response {
    let session = Session {
        u: user.name.clone(),
        s: hex::encode(random_bytes::<16>()),
        e: chrono::Utc::now().timestamp() + SESSION_LIFETIME.as_secs() as i64,
    };
    if let Err(e) = super::sessions::open(state.desk.first(), user, &session.s, session.e).await {
        return unavailable(&e);
    }
    let cookie = Cookie::build((
        SESSION_COOKIE,
        serde_json::to_string(&session).expect("serialises"),
    ))
    .path("/")
    .http_only(true)
    .same_site(SameSite::Strict)
    .secure(tls);
    tracing::info!(user = %user.name, role = user.role.as_str(), "Logged in to the console.");
    (jar.add(cookie), Redirect::to("/")).into_response()
}

/// `POST /logout`: the session is revoked, so a copy of its cookie opens nothing, and the
/// cookie is removed.
pub(crate) async fn logout(
    axum::extract::State(state): axum::extract::State<State>,
    jar: SignedCookieJar,
) -> Response {
    let session = jar
        .get(SESSION_COOKIE)
        .and_then(|c| serde_json::from_str::<Session>(c.value()).ok());
    if let Some(session) = session {
        if let Err(e) = super::sessions::revoke(state.desk.first(), &session.s).await {
            return unavailable(&e);
        }
    }
    let gone = Cookie::build((SESSION_COOKIE, "")).path("/");
    (jar.remove(gone), Redirect::to("/login")).into_response()
}

/// The hour of now, in hours since the Unix epoch.
fn this_hour() -> i64 {
    chrono::Utc::now().timestamp().div_euclid(3600)
}

/// 503: the sessions' database does not answer.
fn unavailable(e: &sqlx::Error) -> Response {
    tracing::warn!(error = %e, "The console's sessions could not be read.");
    PageError::unavailable(
        "Unavailable",
        "The database does not answer; try again shortly.",
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proxied_user_s_csrf_token_turns_with_the_hour() {
        let file = crate::console::ConsoleFile {
            session_key: Some("a unit test session key of thirty-two bytes".into()),
            users: vec![UserConfig {
                name: "sso".into(),
                role: Role::Operator,
                password_hash: None,
            }],
            ..Default::default()
        };
        let settings = ConsoleSettings::new("127.0.0.1:0".parse().unwrap(), file).unwrap();
        let auth = Auth::new(&settings).unwrap();
        let session = "proxy\0sso";
        let now = auth.proxy_csrf(session, 500_000);
        assert_ne!(now, auth.proxy_csrf(session, 500_001));
        assert_ne!(now, auth.csrf(session), "never the constant of old");
        assert!(auth.csrf_matches(&format!("{session}\0500000"), &now));
        assert!(!auth.csrf_matches(&format!("{session}\0500002"), &now));
    }

    #[test]
    fn a_hash_is_argon2id_and_verifies_only_its_password() {
        let params = argon2::Params::new(1024, 1, 1, None).unwrap();
        let hash = hash_password_with("correct horse", params).unwrap();
        assert!(hash.starts_with("$argon2id$"), "{hash}");
        let parsed = PasswordHash::new(&hash).unwrap();
        assert!(Argon2::default()
            .verify_password(b"correct horse", &parsed)
            .is_ok());
        assert!(Argon2::default()
            .verify_password(b"correct horsf", &parsed)
            .is_err());
        let user = UserConfig {
            name: "ann".into(),
            role: Role::Operator,
            password_hash: Some(hash),
        };
        user.check().unwrap();
        let argon2i = Argon2::new(
            argon2::Algorithm::Argon2i,
            argon2::Version::V0x13,
            argon2::Params::new(1024, 1, 1, None).unwrap(),
        )
        .hash_password(b"x", &SaltString::encode_b64(&[7; 16]).unwrap())
        .unwrap()
        .to_string();
        let weak = UserConfig {
            password_hash: Some(argon2i),
            ..user
        };
        assert!(weak
            .check()
            .unwrap_err()
            .to_string()
            .contains("not argon2id"));
    }
}
