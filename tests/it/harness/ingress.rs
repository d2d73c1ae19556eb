//! Envelopes as the ingress writes them, and signatures as senders make them.

use replayproof::envelope::Envelope;

/// An envelope value for `key`.
pub fn envelope(key: &str, payload: serde_json::Value) -> Vec<u8> {
    routed_envelope(key, None, payload)
}

/// [`envelope`], routed by `route` (a tenant's route key) when given.
pub fn routed_envelope(key: &str, route: Option<&str>, payload: serde_json::Value) -> Vec<u8> {
    Envelope {
        route: route.map(|r| r.try_into().expect("a valid route key")),
        key: key.try_into().expect("a valid event key"),
        source: "test".into(),
        event_type: Some("test.event".into()),
        received_at: None,
        occurred_at: None,
        payload: serde_json::value::to_raw_value(&payload).unwrap(),
        unhashed: Vec::new(),
        replay_window_secs: None,
        request_id: None,
    }
    .to_bytes()
}

/// Hex HMAC-SHA256 of `parts` under `secret`, as most providers sign.
pub fn hmac_hex(secret: &str, parts: &[&[u8]]) -> String {
    hex::encode(replayproof::devkit::sign::hmac(secret.as_bytes(), parts))
}
