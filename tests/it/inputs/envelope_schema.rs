//! The envelope's JSON Schema (docs/schemas/envelope.schema.json) held to the consumer's own
//! parser over the corpus in tests/fixtures/envelopes/: every case is judged by the schema
//! (Python's jsonschema, draft 2020-12, `format` asserted) and by `Event::parse`, and the two
//! agree everywhere but in the gaps the schema documents.
//!
//! The groups: `accepted.json` (both take it), `refused.json` (both refuse it; with the
//! consumer's reason), `beyond-schema.json` (the schema takes it, the consumer dead-letters it:
//! each names one of [`GAPS`]) and `lenient.json` (the schema refuses it, the consumer takes it:
//! chrono's relaxed timestamps).

use replayproof::envelope::Event;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::process::{Command, Stdio};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const SCHEMA: &str = "docs/schemas/envelope.schema.json";
const CORPUS: &str = "tests/fixtures/envelopes";

/// What JSON Schema cannot say that the consumer refuses, as the schema's description lists
/// them, in its order.
const GAPS: [&str; 6] = [
    "key-bytes",
    "nesting",
    "numeric-range",
    "duplicate-member",
    "lone-surrogate",
    "integer-spelling",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Group {
    Accepted,
    Refused,
    BeyondSchema,
    Lenient,
}

impl Group {
    const ALL: [Self; 4] = [
        Self::Accepted,
        Self::Refused,
        Self::BeyondSchema,
        Self::Lenient,
    ];

    fn file(self) -> &'static str {
        match self {
            Self::Accepted => "accepted.json",
            Self::Refused => "refused.json",
            Self::BeyondSchema => "beyond-schema.json",
            Self::Lenient => "lenient.json",
        }
    }

    /// The verdicts a case of the group must get: (schema-valid, consumer-accepts).
    fn expected(self) -> (bool, bool) {
        match self {
            Self::Accepted => (true, true),
            Self::Refused => (false, false),
            Self::BeyondSchema => (true, false),
            Self::Lenient => (false, true),
        }
    }

    /// The fewest cases a group may hold, so that no test passes over an emptied corpus.
    fn at_least(self) -> usize {
        match self {
            Self::Accepted => 35,
            Self::Refused => 60,
            Self::BeyondSchema => 15,
            Self::Lenient => 8,
        }
    }
}

/// One corpus case: the exact bytes of a Kafka message value.
#[derive(Debug)]
struct Case {
    group: Group,
    name: String,
    why: String,
    /// The consumer's reason to refuse it: a `Malformed` variant's name.
    malformed: Option<String>,
    gap: Option<String>,
    bytes: Vec<u8>,
}

#[derive(serde::Deserialize)]
struct File {
    description: String,
    cases: Vec<Entry>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    why: String,
    #[serde(default)]
    malformed: Option<String>,
    #[serde(default)]
    gap: Option<String>,
    /// The value as text (UTF-8), or as `hex` when it is not UTF-8.
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    hex: Option<String>,
}

fn corpus() -> Vec<Case> {
    let mut cases = Vec::new();
    for group in Group::ALL {
        let path = format!("{ROOT}/{CORPUS}/{}", group.file());
        let file: File = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!file.description.is_empty(), "{path} says what it holds");
        for entry in file.cases {
            let bytes = match (entry.text, entry.hex) {
                (Some(text), None) => text.into_bytes(),
                (None, Some(hex)) => hex::decode(hex).unwrap(),
                _ => panic!("{path}: {} has one of text and hex", entry.name),
            };
            cases.push(Case {
                group,
                name: entry.name,
                why: entry.why,
                malformed: entry.malformed,
                gap: entry.gap,
                bytes,
            });
        }
    }
    cases
}

/// The consumer's verdict: `Ok` when it takes the value, else the `Malformed` variant's name
/// (the reason of the dead letter).
fn consumer_verdict(bytes: &[u8]) -> Result<(), String> {
    Event::parse(None, Some(bytes)).map(drop).map_err(|e| {
        let debug = format!("{e:?}");
        debug.split('(').next().unwrap_or_default().to_owned()
    })
}

/// Judges every case in one Python process: the schema checked against the draft 2020-12
/// meta-schema, then each value parsed as strict JSON (UTF-8, no NaN) and validated with
/// `format` asserted. A value that is not JSON is invalid. Also reports whether `date-time` is
/// really checked: jsonschema skips it silently without the rfc3339-validator package.
const VERDICTS: &str = r#"
import json, sys
from jsonschema import Draft202012Validator, validators

sys.setrecursionlimit(20000)
request = json.load(sys.stdin)
with open(request["schema"], encoding="utf-8") as f:
    schema = json.load(f)
Draft202012Validator.check_schema(schema)
validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)

def not_json(name):
    raise ValueError(f"{name} is not JSON")

def verdict(data):
    try:
        instance = json.loads(data.decode("utf-8"), parse_constant=not_json)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return {"valid": False, "errors": [f"not JSON: {e}"]}
    errors = validator.iter_errors(instance)
    errors = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in errors]
    return {"valid": not errors, "errors": errors}

probe = {"key": "k", "source": "s", "payload": 1, "received_at": "2026-02-30T10:00:00Z"}
json.dump({
    "dialect": validators.validator_for(schema).__name__,
    "date_time_checked": not validator.is_valid(probe),
    "verdicts": [verdict(bytes.fromhex(h)) for h in request["cases"]],
}, sys.stdout)
"#;

#[derive(serde::Deserialize)]
struct Judged {
    dialect: String,
    date_time_checked: bool,
    verdicts: Vec<Verdict>,
}

#[derive(serde::Deserialize)]
struct Verdict {
    valid: bool,
    errors: Vec<String>,
}

fn schema_verdicts(cases: &[Case]) -> Judged {
    let request = serde_json::json!({
        "schema": SCHEMA,
        "cases": cases.iter().map(|c| hex::encode(&c.bytes)).collect::<Vec<_>>(),
    });
    let mut child = Command::new("python3")
        .args(["-c", VERDICTS])
        .current_dir(ROOT)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(request.to_string().as_bytes()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the schema's validator did not run (pip install jsonschema rfc3339-validator): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What is wrong with one case's verdicts, if anything.
fn disagreement(case: &Case, schema: &Verdict) -> Option<String> {
    let consumer = consumer_verdict(&case.bytes);
    let (schema_valid, consumer_accepts) = case.group.expected();
    let text = String::from_utf8_lossy(&case.bytes);
    let shown: String = text.chars().take(160).collect();
    let label = format!("{:?} {} ({}): {shown:?}", case.group, case.name, case.why);
    if schema.valid != schema_valid {
        return Some(format!(
            "{label}\n    the schema says {}, not {}: {:?}",
            verdict_word(schema.valid),
            verdict_word(schema_valid),
            schema.errors
        ));
    }
    match (&consumer, consumer_accepts, &case.malformed) {
        (Ok(()), true, None) => None,
        (Err(reason), false, Some(expected)) if reason == expected => None,
        (Err(reason), false, Some(expected)) => Some(format!(
            "{label}\n    the consumer dead-letters it as {reason}, not {expected}"
        )),
        (_, _, malformed) => Some(format!(
            "{label}\n    the consumer's verdict is {consumer:?}; the case expects {} \
             (malformed: {malformed:?})",
            if consumer_accepts {
                "Ok"
            } else {
                "a dead letter"
            }
        )),
    }
}

fn verdict_word(valid: bool) -> &'static str {
    if valid {
        "valid"
    } else {
        "invalid"
    }
}

#[test]
fn schema_and_consumer_agree_on_every_envelope_but_the_documented_gaps() {
    let cases = corpus();
    let judged = schema_verdicts(&cases);
    assert_eq!(judged.dialect, "Draft202012Validator", "{SCHEMA}'s $schema");
    assert!(
        judged.date_time_checked,
        "the schema's validator does not check `format: date-time` (it accepted 30 February): \
         jsonschema skips the format without the rfc3339-validator package \
         (pip install rfc3339-validator)"
    );
    assert_eq!(judged.verdicts.len(), cases.len());
    let wrong: Vec<String> = cases
        .iter()
        .zip(&judged.verdicts)
        .filter_map(|(case, verdict)| disagreement(case, verdict))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} cases disagree with their group:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}

/// A case says why it is in its group; a refused one names the consumer's reason, and a
/// beyond-schema one the gap it shows.
fn check_labels(case: &Case) {
    assert!(!case.why.is_empty(), "{} says why", case.name);
    let consumer_refuses = !case.group.expected().1;
    assert_eq!(
        case.malformed.is_some(),
        consumer_refuses,
        "{}: a refused case names the consumer's reason, an accepted one none",
        case.name
    );
    assert_eq!(
        case.gap.is_some(),
        case.group == Group::BeyondSchema,
        "{}: only a beyond-schema case names a gap",
        case.name
    );
    if let Some(gap) = &case.gap {
        assert!(
            GAPS.contains(&gap.as_str()),
            "{}: unknown gap {gap}",
            case.name
        );
    }
}

#[test]
fn the_schema_is_draft_2020_12_and_the_corpus_covers_every_group_and_every_gap() {
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{ROOT}/{SCHEMA}")).unwrap())
            .unwrap();
    assert_eq!(
        schema["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    assert!(schema["$id"].as_str().is_some_and(|id| !id.is_empty()));
    let required: BTreeSet<&str> = schema["required"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(required, BTreeSet::from(["key", "source", "payload"]));
    // Unknown members are ignored by the consumer, so the schema must not refuse them.
    assert_eq!(schema["additionalProperties"], true);
    // The description numbers its gaps: as many as the corpus exercises.
    let description = schema["description"].as_str().unwrap();
    assert!(description.contains(&format!("({})", GAPS.len())));
    assert!(!description.contains(&format!("({})", GAPS.len() + 1)));

    let cases = corpus();
    let mut per_group: BTreeMap<Group, usize> = BTreeMap::new();
    let mut names = BTreeSet::new();
    for case in &cases {
        *per_group.entry(case.group).or_default() += 1;
        assert!(names.insert(&case.name), "{} is named twice", case.name);
        check_labels(case);
    }
    for group in Group::ALL {
        let count = per_group.get(&group).copied().unwrap_or(0);
        assert!(
            count >= group.at_least(),
            "{:?} holds {count} cases, fewer than {}",
            group,
            group.at_least()
        );
    }
    for gap in GAPS {
        assert!(
            cases.iter().any(|c| c.gap.as_deref() == Some(gap)),
            "no case shows the gap {gap}"
        );
    }
}

/// docs/asyncapi.yaml describes the same input: the default topic, this schema as the
/// envelope's payload, and an example envelope the consumer takes (its Kafka key the envelope's).
#[test]
fn the_asyncapi_document_names_the_default_topic_this_schema_and_an_example_the_consumer_takes() {
    let path = format!("{ROOT}/docs/asyncapi.yaml");
    let script = r#"
import json, sys, yaml
doc = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))
envelope = doc["components"]["messages"]["envelope"]
json.dump({
    "addresses": [c["address"] for c in doc["channels"].values()],
    "payload": envelope["payload"],
    "examples": [e["payload"] for e in envelope["examples"]],
}, sys.stdout)
"#;
    let out = crate::harness::stdout_of(Command::new("python3").args(["-c", script, &path]));
    let doc: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        doc["addresses"],
        serde_json::json!([replayproof::kafka::DEFAULT_TOPIC])
    );
    assert_eq!(
        doc["payload"],
        serde_json::json!({"$ref": "./schemas/envelope.schema.json"})
    );
    let examples = doc["examples"].as_array().unwrap();
    assert!(!examples.is_empty());
    for example in examples {
        let value = serde_json::to_vec(example).unwrap();
        let key = example["key"].as_str().unwrap().as_bytes();
        let event = Event::parse(Some(key), Some(&value));
        assert!(event.is_ok(), "{example}: {event:?}");
    }
}
