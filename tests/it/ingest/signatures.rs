//! Each scheme against signatures computed here from the providers' published definitions.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use http::{HeaderMap, HeaderName, HeaderValue};
use replayproof::devkit::sign::hmac;
use replayproof::ingest::signature::{
    Encoding, KeyFrom, Rejection, Request, Scheme, Secret, Verified,
};

const NOW: i64 = 1_764_400_000;

fn headers(pairs: &[(&str, String)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn verify(
    scheme: &Scheme,
    secrets: &[&[u8]],
    h: &HeaderMap,
    body: &[u8],
) -> Result<Verified, Rejection> {
    let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::new(*s)).collect();
    scheme.verify(
        &secrets,
        300,
        &Request {
            headers: h,
            body,
            now: NOW,
        },
    )
}

fn id(v: Result<Verified, Rejection>) -> String {
    match v {
        Ok(Verified::Event(identity)) => identity.id,
        other => panic!("expected an event, got {other:?}"),
    }
}

fn unauthorized(v: Result<Verified, Rejection>) {
    assert!(
        matches!(v, Err(Rejection::Unauthorized(_))),
        "expected 401, got {v:?}"
    );
}

#[test]
fn github_documented_test_vector_passes() {
    let h = headers(&[
        (
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17".into(),
        ),
        (
            "x-github-delivery",
            "72d3162e-cc78-11e3-81ab-4c9367dc0958".into(),
        ),
        ("x-github-event", "push".into()),
    ]);
    let v = verify(
        &Scheme::Github,
        &[b"It's a Secret to Everybody"],
        &h,
        b"Hello, World!",
    );
    assert_eq!(id(v), "72d3162e-cc78-11e3-81ab-4c9367dc0958");
    unauthorized(verify(
        &Scheme::Github,
        &[b"another secret"],
        &h,
        b"Hello, World!",
    ));
    unauthorized(verify(
        &Scheme::Github,
        &[b"It's a Secret to Everybody"],
        &h,
        b"Hello, World?",
    ));
}

#[test]
fn github_truncated_empty_and_unprefixed_signatures_fail() {
    let secret = b"It's a Secret to Everybody";
    let full = "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    for sig in [
        "sha256=",
        &format!("sha256={}", &full[..32]),
        full,
        "sha1=757107ea",
    ] {
        let h = headers(&[
            ("x-hub-signature-256", sig.to_string()),
            ("x-github-delivery", "d".into()),
        ]);
        unauthorized(verify(&Scheme::Github, &[secret], &h, b"Hello, World!"));
    }
    let missing_delivery = headers(&[("x-hub-signature-256", format!("sha256={full}"))]);
    assert!(matches!(
        verify(
            &Scheme::Github,
            &[secret],
            &missing_delivery,
            b"Hello, World!"
        ),
        Err(Rejection::BadRequest(_))
    ));
}

fn stripe_header(secret: &[u8], t: i64, body: &[u8]) -> String {
    format!(
        "t={t},v1={}",
        hex::encode(hmac(secret, &[t.to_string().as_bytes(), b".", body]))
    )
}

#[test]
fn stripe_signatures_with_rotation_v0_and_tolerance() {
    let body = br#"{"id":"evt_1","type":"charge.succeeded","object":"event"}"#;
    let (old, new) = (b"whsec_old".as_slice(), b"whsec_new".as_slice());
    let h = |v: String| headers(&[("stripe-signature", v)]);
    assert_eq!(
        id(verify(
            &Scheme::Stripe,
            &[old, new],
            &h(stripe_header(new, NOW, body)),
            body
        )),
        "evt_1"
    );
    assert_eq!(
        id(verify(
            &Scheme::Stripe,
            &[old, new],
            &h(stripe_header(old, NOW, body)),
            body
        )),
        "evt_1"
    );
    // Several v1 values, one valid (Stripe signs with each active secret).
    let two = format!(
        "{},v1={}",
        stripe_header(new, NOW, body),
        hex::encode([0u8; 32])
    );
    assert_eq!(id(verify(&Scheme::Stripe, &[new], &h(two), body)), "evt_1");
    // v0 only, or the valid MAC under v0: refused.
    let mac = hex::encode(hmac(new, &[NOW.to_string().as_bytes(), b".", body]));
    unauthorized(verify(
        &Scheme::Stripe,
        &[new],
        &h(format!("t={NOW},v0={mac}")),
        body,
    ));
    unauthorized(verify(
        &Scheme::Stripe,
        &[new],
        &h(format!("t={NOW},v1=")),
        body,
    ));
    unauthorized(verify(
        &Scheme::Stripe,
        &[new],
        &h(format!("t={NOW},v1={}", &mac[..62])),
        body,
    ));
    unauthorized(verify(
        &Scheme::Stripe,
        &[new],
        &h(format!("v1={mac}")),
        body,
    ));
    // Tolerance: 300 s either way passes, 301 s fails, in the past and the future.
    for (skew, ok) in [
        (-300, true),
        (300, true),
        (-301, false),
        (301, false),
        (-299, true),
        (299, true),
    ] {
        let t = NOW + skew;
        let v = verify(
            &Scheme::Stripe,
            &[new],
            &h(stripe_header(new, t, body)),
            body,
        );
        assert_eq!(v.is_ok(), ok, "skew {skew}: {v:?}");
    }
}

#[test]
fn stripe_tampered_and_reserialised_bodies_fail() {
    let body = br#"{"id":"evt_1","amount":100}"#;
    let secret = b"whsec_x".as_slice();
    let h = headers(&[("stripe-signature", stripe_header(secret, NOW, body))]);
    unauthorized(verify(
        &Scheme::Stripe,
        &[secret],
        &h,
        br#"{"id":"evt_1","amount":999}"#,
    ));
    unauthorized(verify(
        &Scheme::Stripe,
        &[secret],
        &h,
        br#"{"id": "evt_1", "amount": 100}"#,
    ));
}

#[test]
fn stripe_connect_events_are_qualified_by_account() {
    let body = br#"{"id":"evt_1","account":"acct_9","type":"payout.paid"}"#;
    let h = headers(&[("stripe-signature", stripe_header(b"s", NOW, body))]);
    assert_eq!(
        id(verify(&Scheme::Stripe, &[b"s"], &h, body)),
        "acct_9:evt_1"
    );
}

#[test]
fn stripe_body_without_id_or_not_json_is_a_bad_request() {
    for body in [br#"{"type":"x"}"#.as_slice(), b"not json"] {
        let h = headers(&[("stripe-signature", stripe_header(b"s", NOW, body))]);
        assert!(matches!(
            verify(&Scheme::Stripe, &[b"s"], &h, body),
            Err(Rejection::BadRequest(_))
        ));
    }
}

fn standard_headers(prefix: &str, key: &[u8], msg_id: &str, t: i64, body: &[u8]) -> HeaderMap {
    let sig = BASE64.encode(hmac(
        key,
        &[
            msg_id.as_bytes(),
            b".",
            t.to_string().as_bytes(),
            b".",
            body,
        ],
    ));
    headers(&[
        (&format!("{prefix}-id"), msg_id.into()),
        (&format!("{prefix}-timestamp"), t.to_string()),
        (&format!("{prefix}-signature"), format!("v1,{sig}")),
    ])
}

#[test]
fn standard_webhooks_and_svix_headers_verify() {
    // The spec's secrets are base64 after `whsec_`; the key is the decoded bytes.
    let key = b"MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let body = br#"{"type":"invoice.paid","data":{}}"#;
    for prefix in ["webhook", "svix"] {
        let h = standard_headers(prefix, key, "msg_2Lh", NOW, body);
        assert_eq!(
            id(verify(&Scheme::StandardWebhooks, &[key], &h, body)),
            "msg_2Lh"
        );
    }
    // Several signatures, space-separated, one valid; rotation across secrets.
    let good = standard_headers("webhook", key, "msg_1", NOW, body);
    let mut h = good.clone();
    let valid = good["webhook-signature"].to_str().unwrap().to_owned();
    h.insert(
        "webhook-signature",
        HeaderValue::from_str(&format!("v1,AAAA {valid} v2,xyz")).unwrap(),
    );
    assert_eq!(
        id(verify(
            &Scheme::StandardWebhooks,
            &[b"other", key],
            &h,
            body
        )),
        "msg_1"
    );
    h.insert("webhook-signature", HeaderValue::from_static("v1,"));
    unauthorized(verify(&Scheme::StandardWebhooks, &[key], &h, body));
    unauthorized(verify(&Scheme::StandardWebhooks, &[key], &good, b"{}"));
    for (skew, ok) in [(300, true), (-300, true), (301, false), (-301, false)] {
        let h = standard_headers("webhook", key, "msg_1", NOW + skew, body);
        assert_eq!(
            verify(&Scheme::StandardWebhooks, &[key], &h, body).is_ok(),
            ok,
            "skew {skew}"
        );
    }
}

#[test]
fn shopify_keys_by_shop_and_event_id() {
    let body = br#"{"id":820982911946154508}"#;
    let sig = BASE64.encode(hmac(b"shpss", &[body]));
    let mut h = headers(&[
        ("x-shopify-hmac-sha256", sig.clone()),
        ("x-shopify-shop-domain", "shop.myshopify.com".into()),
        ("x-shopify-webhook-id", "b54557e4".into()),
        ("x-shopify-event-id", "98880550-7158".into()),
    ]);
    assert_eq!(
        id(verify(&Scheme::Shopify, &[b"old", b"shpss"], &h, body)),
        "shop.myshopify.com:98880550-7158"
    );
    h.remove("x-shopify-event-id");
    assert_eq!(
        id(verify(&Scheme::Shopify, &[b"shpss"], &h, body)),
        "shop.myshopify.com:webhook:b54557e4"
    );
    h.insert(
        "x-shopify-hmac-sha256",
        HeaderValue::from_str(&sig[..20]).unwrap(),
    );
    unauthorized(verify(&Scheme::Shopify, &[b"shpss"], &h, body));
}

#[test]
fn slack_signatures_challenge_and_keys() {
    let secret = b"8f742231b10e8888abcd99yyyzzz85a5";
    let sign = |t: i64, body: &[u8]| {
        headers(&[
            ("x-slack-request-timestamp", t.to_string()),
            (
                "x-slack-signature",
                format!(
                    "v0={}",
                    hex::encode(hmac(
                        secret,
                        &[b"v0:", t.to_string().as_bytes(), b":", body]
                    ))
                ),
            ),
        ])
    };
    let body =
        br#"{"type":"event_callback","team_id":"T1","event_id":"Ev9","event":{"type":"message"}}"#;
    assert_eq!(
        id(verify(&Scheme::Slack, &[secret], &sign(NOW, body), body)),
        "T1:Ev9"
    );
    let challenge = br#"{"type":"url_verification","challenge":"3eZbrw1aBm"}"#;
    assert!(matches!(
        verify(&Scheme::Slack, &[secret], &sign(NOW, challenge), challenge),
        Ok(Verified::Challenge(c)) if c == "3eZbrw1aBm"
    ));
    unauthorized(verify(
        &Scheme::Slack,
        &[secret],
        &sign(NOW - 301, body),
        body,
    ));
    assert!(verify(&Scheme::Slack, &[secret], &sign(NOW + 300, body), body).is_ok());
    let no_event_id = br#"{"type":"event_callback","team_id":"T1"}"#;
    assert!(matches!(
        verify(
            &Scheme::Slack,
            &[secret],
            &sign(NOW, no_event_id),
            no_event_id
        ),
        Err(Rejection::BadRequest(_))
    ));
}

#[test]
fn generic_hmac_reads_its_header_prefix_encoding_and_key() {
    let body = br#"{"id":"ord_1","n":2}"#;
    let scheme = Scheme::Hmac {
        header: "x-acme-signature".into(),
        prefix: "sha256=".into(),
        encoding: Encoding::Base64,
        key_from: KeyFrom::JsonPointer("/id".into()),
    };
    let h = headers(&[(
        "x-acme-signature",
        format!("sha256={}", BASE64.encode(hmac(b"k", &[body]))),
    )]);
    assert_eq!(id(verify(&scheme, &[b"k"], &h, body)), "ord_1");
    let hex_h = headers(&[(
        "x-acme-signature",
        format!("sha256={}", hex::encode(hmac(b"k", &[body]))),
    )]);
    unauthorized(verify(&scheme, &[b"k"], &hex_h, body));
    let by_header = Scheme::Hmac {
        header: "x-acme-signature".into(),
        prefix: String::new(),
        encoding: Encoding::Hex,
        key_from: KeyFrom::Header("x-acme-event".into()),
    };
    let h = headers(&[
        ("x-acme-signature", hex::encode(hmac(b"k", &[b"plain"]))),
        ("x-acme-event", "e-7".into()),
    ]);
    assert_eq!(id(verify(&by_header, &[b"k"], &h, b"plain")), "e-7");
}

#[test]
fn an_id_at_a_json_pointer_is_read_as_written_and_the_payload_is_the_body_as_sent() {
    let scheme = |pointer: &str| Scheme::Hmac {
        header: "x-sig".into(),
        prefix: String::new(),
        encoding: Encoding::Hex,
        key_from: KeyFrom::JsonPointer(pointer.into()),
    };
    let sign = |body: &[u8]| headers(&[("x-sig", hex::encode(hmac(b"k", &[body])))]);
    let body = br#"{ "order": {"id": 123456789012345678901234567890, "ref": "a/b"},
        "items": [{"sku": 1.50}], "a/b": {"~x": "tilde"}, "dup": "first", "dup": "last" }"#;
    let cases = [
        ("/order/id", "123456789012345678901234567890"),
        ("/items/0/sku", "1.50"),
        ("/a~1b/~0x", "tilde"),
        ("/dup", "last"),
    ];
    for (pointer, expected) in cases {
        assert_eq!(
            id(verify(&scheme(pointer), &[b"k"], &sign(body), body)),
            expected,
            "{pointer}"
        );
    }
    for missing in [
        "/order/none",
        "/items/1/sku",
        "/items/x",
        "/order",
        "no-slash",
    ] {
        assert!(
            matches!(
                verify(&scheme(missing), &[b"k"], &sign(body), body),
                Err(Rejection::BadRequest(_))
            ),
            "{missing}"
        );
    }
    // The payload is the body's own text, white space and all: nothing is read and rewritten.
    match verify(&scheme("/order/id"), &[b"k"], &sign(body), body) {
        Ok(Verified::Event(identity)) => {
            assert_eq!(identity.payload.get().as_bytes(), body.as_slice())
        }
        other => panic!("expected an event, got {other:?}"),
    }
}

#[test]
fn extreme_timestamps_are_refused_not_an_overflow() {
    let secret = b"whsec_a-long-enough-secret".as_slice();
    let body = br#"{"id":"evt_1"}"#;
    for t in [i64::MIN, i64::MIN + 1, i64::MAX, -1, 0] {
        let h = headers(&[("stripe-signature", stripe_header(secret, t, body))]);
        unauthorized(verify(&Scheme::Stripe, &[secret], &h, body));
        let h = standard_headers("webhook", secret, "msg_1", t, body);
        unauthorized(verify(&Scheme::StandardWebhooks, &[secret], &h, body));
    }
}

fn occurred_at(v: Result<Verified, Rejection>) -> Option<i64> {
    match v {
        Ok(Verified::Event(identity)) => identity.occurred_at.map(|t| t.timestamp()),
        other => panic!("expected an event, got {other:?}"),
    }
}

#[test]
fn the_event_time_is_read_where_the_provider_puts_it_and_only_there() {
    let stripe = br#"{"id":"evt_1","created":1700000000}"#;
    let h = headers(&[("stripe-signature", stripe_header(b"s", NOW, stripe))]);
    assert_eq!(
        occurred_at(verify(&Scheme::Stripe, &[b"s"], &h, stripe)),
        Some(1_700_000_000)
    );
    // Stripe's v2 events write `created` as RFC 3339 text.
    let v2 = br#"{"id":"evt_2","created":"2023-11-14T22:13:20.000Z"}"#;
    let h = headers(&[("stripe-signature", stripe_header(b"s", NOW, v2))]);
    assert_eq!(
        occurred_at(verify(&Scheme::Stripe, &[b"s"], &h, v2)),
        Some(1_700_000_000)
    );
    // A created time no sender could mean is left out, not stored.
    let absurd = br#"{"id":"evt_1","created":-99999999999999}"#;
    let h = headers(&[("stripe-signature", stripe_header(b"s", NOW, absurd))]);
    assert_eq!(
        occurred_at(verify(&Scheme::Stripe, &[b"s"], &h, absurd)),
        None
    );

    let body = br#"{"id":1}"#;
    let h = headers(&[
        (
            "x-shopify-hmac-sha256",
            BASE64.encode(hmac(b"shpss", &[body])),
        ),
        ("x-shopify-shop-domain", "shop.myshopify.com".into()),
        ("x-shopify-event-id", "e1".into()),
        (
            "x-shopify-triggered-at",
            "2023-11-14T22:13:20.000000Z".into(),
        ),
    ]);
    assert_eq!(
        occurred_at(verify(&Scheme::Shopify, &[b"shpss"], &h, body)),
        Some(1_700_000_000)
    );

    let secret = b"8f742231b10e8888abcd99yyyzzz85a5";
    let slack =
        br#"{"type":"event_callback","team_id":"T1","event_id":"Ev9","event_time":1700000000}"#;
    let t = NOW.to_string();
    let h = headers(&[
        ("x-slack-request-timestamp", t.clone()),
        (
            "x-slack-signature",
            format!(
                "v0={}",
                hex::encode(hmac(secret, &[b"v0:", t.as_bytes(), b":", slack]))
            ),
        ),
    ]);
    assert_eq!(
        occurred_at(verify(&Scheme::Slack, &[secret], &h, slack)),
        Some(1_700_000_000)
    );

    // GitHub's deliveries carry no time of the event itself.
    let github = br#"{"created_at":"2023-11-14T22:13:20Z"}"#;
    let h = headers(&[
        (
            "x-hub-signature-256",
            format!("sha256={}", hex::encode(hmac(b"g", &[github]))),
        ),
        ("x-github-delivery", "d1".into()),
    ]);
    assert_eq!(
        occurred_at(verify(&Scheme::Github, &[b"g"], &h, github)),
        None
    );
}
