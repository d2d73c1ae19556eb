//! Signs webhook requests the way each provider does: for the demo's storm, the tests and the
//! benchmarks.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// HMAC-SHA256 of the concatenated `parts`.
pub fn hmac(secret: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("any key length");
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().to_vec()
}

/// Stripe's `Stripe-Signature` header for `body` sent at `now` (Unix seconds).
pub fn stripe(secret: &str, now: &str, body: &str) -> String {
    let sig = hex::encode(hmac(
        secret.as_bytes(),
        &[now.as_bytes(), b".", body.as_bytes()],
    ));
    format!("t={now},v1={sig}")
}

/// GitHub's `X-Hub-Signature-256` header for `body`.
pub fn github(secret: &str, body: &str) -> String {
    format!(
        "sha256={}",
        hex::encode(hmac(secret.as_bytes(), &[body.as_bytes()]))
    )
}

/// Standard Webhooks' `webhook-signature` header; `secret` is `whsec_` and base64. With
/// `tamper`, the key is changed so the signature is wrong.
pub fn standard_webhooks(secret: &str, id: &str, now: &str, body: &str, tamper: bool) -> String {
    let engine = base64::engine::general_purpose::STANDARD;
    let mut key = engine
        .decode(secret.trim_start_matches("whsec_"))
        .expect("a whsec_ secret is base64");
    if tamper {
        key[0] ^= 1;
    }
    let signed = [id.as_bytes(), b".", now.as_bytes(), b".", body.as_bytes()];
    format!("v1,{}", engine.encode(hmac(&key, &signed)))
}
