//! Envelopes as the ingress writes them.

use replayproof::envelope::Envelope;

/// An envelope value for `key`.
pub fn envelope(key: &str, payload: serde_json::Value) -> Vec<u8> {
    Envelope {
        key: key.into(),
        source: "test".into(),
        event_type: Some("test.event".into()),
        received_at: None,
        payload,
        unhashed: Vec::new(),
        replay_window_secs: None,
    }
    .to_bytes()
}
