//! The demo's storm: every event delivered, a share of them again, a few badly signed or not
//! JSON, shuffled, and sent by concurrent senders that retry like real ones.

use super::DemoOptions;
use crate::devkit::sign;
use indicatif::ProgressBar;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const GITHUB_SECRET: &str = "demo-github-secret";
pub const STRIPE_SECRET: &str = "whsec_demo-secret-for-replayproof";
/// base64 of "demo-standard-webhooks-secret".
pub const SVIX_SECRET: &str = "whsec_ZGVtby1zdGFuZGFyZC13ZWJob29rcy1zZWNyZXQ=";

/// One delivery of the storm.
#[derive(Debug, Clone, Copy)]
pub enum Delivery {
    Event(usize),
    BadSignature(usize),
    NotJson(usize),
}

/// The key the ingress derives for the storm's event `n`.
pub fn event_key(n: usize) -> String {
    match n % 3 {
        0 => format!("github:delivery-{n}"),
        1 => format!("stripe:evt_{n}"),
        _ => format!("svix:msg_{n}"),
    }
}

fn request(http: &reqwest::Client, base: &str, delivery: Delivery) -> reqwest::RequestBuilder {
    let now = chrono::Utc::now().timestamp().to_string();
    let (n, tamper) = match delivery {
        Delivery::Event(n) => (n, false),
        Delivery::BadSignature(n) => (n, true),
        Delivery::NotJson(n) => {
            let body = format!("{{not json {n}");
            return http
                .post(format!("{base}/webhooks/stripe"))
                .header("stripe-signature", sign::stripe(STRIPE_SECRET, &now, &body))
                .body(body);
        }
    };
    let secret = |s: &str| {
        if tamper {
            format!("{s}-wrong")
        } else {
            s.to_owned()
        }
    };
    match n % 3 {
        0 => {
            let body = format!(r#"{{"action":"opened","number":{n}}}"#);
            http.post(format!("{base}/webhooks/github"))
                .header(
                    "x-hub-signature-256",
                    sign::github(&secret(GITHUB_SECRET), &body),
                )
                .header("x-github-delivery", format!("delivery-{n}"))
                .header("x-github-event", "pull_request")
                .body(body)
        }
        1 => {
            let body =
                format!(r#"{{"id":"evt_{n}","type":"charge.succeeded","data":{{"amount":{n}}}}}"#);
            let signature = sign::stripe(&secret(STRIPE_SECRET), &now, &body);
            http.post(format!("{base}/webhooks/stripe"))
                .header("stripe-signature", signature)
                .body(body)
        }
        _ => {
            let body = format!(r#"{{"type":"invoice.paid","data":{{"n":{n}}}}}"#);
            let id = format!("msg_{n}");
            let signature = sign::standard_webhooks(SVIX_SECRET, &id, &now, &body, tamper);
            http.post(format!("{base}/webhooks/svix"))
                .header("webhook-id", id)
                .header("webhook-timestamp", now)
                .header("webhook-signature", signature)
                .body(body)
        }
    }
}

/// The storm: every event once, a share again, a few bad ones, shuffled.
pub fn plan(o: &DemoOptions) -> Vec<Delivery> {
    let mut rng = fastrand::Rng::with_seed(o.seed);
    let mut plan: Vec<Delivery> = (0..o.events).map(Delivery::Event).collect();
    let redeliveries = (o.events as f64 * o.redeliver).round() as usize;
    plan.extend((0..redeliveries).map(|_| Delivery::Event(rng.usize(..o.events))));
    let bad = (o.events / 50).max(2);
    plan.extend((0..bad).map(|i| {
        if i % 2 == 0 {
            Delivery::BadSignature(i)
        } else {
            Delivery::NotJson(i)
        }
    }));
    rng.shuffle(&mut plan);
    plan
}

/// Answers by status, and retries after 503 or a failed connection.
#[derive(Default)]
pub struct Answers {
    pub by_status: Mutex<BTreeMap<u16, u64>>,
    pub retries: AtomicU64,
}

/// Sends the plan with `senders` concurrent senders, each retrying until a final answer.
pub async fn send(
    base: String,
    plan: Vec<Delivery>,
    senders: usize,
    answers: Arc<Answers>,
    bar: ProgressBar,
) {
    let http = reqwest::Client::new();
    let plan = Arc::new(plan);
    let tasks: Vec<_> = (0..senders)
        .map(|s| {
            let (plan, http, base) = (plan.clone(), http.clone(), base.clone());
            let (answers, bar) = (answers.clone(), bar.clone());
            tokio::spawn(async move {
                for delivery in plan.iter().skip(s).step_by(senders) {
                    deliver(&http, &base, *delivery, &answers).await;
                    bar.inc(1);
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

/// Like a sender: retry until a final answer.
async fn deliver(http: &reqwest::Client, base: &str, delivery: Delivery, answers: &Answers) {
    for attempt in 0..20 {
        let status = request(http, base, delivery)
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0);
        if status != 503 && status != 0 {
            let mut by_status = answers.by_status.lock().expect("answers lock");
            *by_status.entry(status).or_default() += 1;
            return;
        }
        answers.retries.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(100 * (attempt + 1))).await;
    }
}
