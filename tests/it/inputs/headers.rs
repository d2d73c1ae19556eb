//! Headers as the protocol carries them: any bytes. A header name that is not UTF-8 (which no
//! Java or Rust client writes, but librdkafka's C API and the protocol allow) is read lossily,
//! never a crash: consume and replay read past it.

use crate::harness::*;
use std::collections::HashSet;
use std::ffi::CString;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

/// Produces an envelope of `key` whose one header is named by bytes that are not UTF-8,
/// through librdkafka's C API (`rd_kafka_produceva`).
fn produce_with_a_binary_header_name(brokers: &str, topic: &str, key: &str) {
    use rdkafka::bindings as rd;
    use rdkafka::producer::Producer as _;
    let producer: rdkafka::producer::BaseProducer = client_config(brokers).create().unwrap();
    let topic = CString::new(topic).unwrap();
    let value = envelope(key, serde_json::json!({"n": 1}));
    let name = c"\xff\xfe-trace";
    let vu = |vtype, u| rd::rd_kafka_vu_t { vtype, u };
    let vus = [
        vu(
            rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_TOPIC,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                cstr: topic.as_ptr(),
            },
        ),
        vu(
            rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_PARTITION,
            rd::rd_kafka_vu_s__bindgen_ty_1 { i32_: 0 },
        ),
        vu(
            rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_KEY,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                    ptr: key.as_ptr() as *mut _,
                    size: key.len(),
                },
            },
        ),
        vu(
            rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_VALUE,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                    ptr: value.as_ptr() as *mut _,
                    size: value.len(),
                },
            },
        ),
        vu(
            rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_HEADER,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                header: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
                    name: name.as_ptr(),
                    val: b"x".as_ptr() as *const _,
                    size: 1,
                },
            },
        ),
    ];
    // SAFETY: every pointer lives until the flush below has delivered the message.
    let error =
        unsafe { rd::rd_kafka_produceva(producer.client().native_ptr(), vus.as_ptr(), vus.len()) };
    assert!(error.is_null(), "produceva refused the message");
    producer.flush(Duration::from_secs(10)).expect("delivered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_name_that_is_not_utf8_is_read_past_by_consume_and_replay() {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group, brokers) = (kafka.topic(1).await, unique("group"), kafka.brokers());
    let since = (chrono::Utc::now() - chrono::Duration::seconds(5)).to_rfc3339();
    produce_with_a_binary_header_name(&brokers, &topic, "evt-odd-header");
    produce(
        &producer(&brokers),
        &topic,
        &[Record::event("evt-after", serde_json::json!({"n": 2}))],
    )
    .await;
    let consumer = ConsumerProcess::spawn(&brokers, &topic, &group, &db.url, None);
    let expected: HashSet<String> = ["evt-odd-header", "evt-after"].map(String::from).into();
    assert_exactly_once(&db, &expected, WAIT).await;
    assert!(consumer.terminate(WAIT).await.success());
    if !matches!(kafka, TestKafka::External(_)) {
        return eprintln!("NOT RUN: the replay half needs a broker that looks offsets up by time");
    }
    sqlx::query("DELETE FROM ledger")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM processed_events")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args(["replay", "--since", &since, "--json", "--actor", "ann"])
        .args([
            "--brokers",
            &brokers,
            "--topic",
            &topic,
            "--database-url",
            &db.url,
        ]);
    for (k, v) in test_kafka_options() {
        cmd.arg("--kafka-option").arg(format!("{k}={v}"));
    }
    let report: serde_json::Value = serde_json::from_slice(&stdout_of(&mut cmd)).unwrap();
    assert_eq!(report["newly_applied"], 2, "{report}");
    assert_exactly_once(&db, &expected, WAIT).await;
}
