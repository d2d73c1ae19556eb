//! How the operator commands print: tables for people (through `comfy-table`), JSON for
//! machines. Every table is drawn here.

use super::counts::Count;
use super::events::EventDetail;
use super::status::Status;
use super::Change;
use crate::envelope::{Members, Text};
use comfy_table::{presets, CellAlignment, Table};
use serde::Serialize;

/// The longest cell shown in a table; longer ones are cut, whole values are in `--json`.
const MAX_CELL_CHARS: usize = 60;

/// Prints `value` as JSON, or as text drawn by `text`.
pub fn print<T: Serialize>(json: bool, value: &T, text: impl FnOnce(&T) -> String) {
    if json {
        let json = serde_json::to_string_pretty(value).expect("operator views serialise");
        println!("{json}");
    } else {
        print!("{}", text(value));
    }
}

/// Rows of a view as a table, one column per field in the field's order.
pub fn rows<T: Serialize>(rows: &[T]) -> String {
    // Serialised as text, whose members come in the fields' order, and read back as members.
    let texts: Vec<String> = rows
        .iter()
        .map(|r| serde_json::to_string(r).expect("operator views serialise"))
        .collect();
    let views: Vec<Members> = texts
        .iter()
        .map(|t| serde_json::from_str(t).expect("an operator view is an object"))
        .collect();
    let Some(Members(first)) = views.first() else {
        return "(none)\n".into();
    };
    let columns: Vec<&str> = first.iter().map(|(name, _)| name.as_ref()).collect();
    let mut table = plain_table(columns.iter().copied());
    for Members(members) in &views {
        table.add_row(columns.iter().map(|c| {
            let value = members.iter().find(|(name, _)| name == c);
            cell(value.map(|(_, v)| v.get()).unwrap_or("null"))
        }));
    }
    format!("{table}\n")
}

/// One row of a view as a table.
pub fn row<T: Serialize>(row: &T) -> String {
    rows(std::slice::from_ref(row))
}

fn plain_table<'a>(header: impl IntoIterator<Item = &'a str>) -> Table {
    let mut table = Table::new();
    table.load_preset(presets::NOTHING).set_header(header);
    table
}

/// A value's JSON text as one line of at most [`MAX_CELL_CHARS`] characters: a string without
/// its quotes, null as `-`.
fn cell(json: &str) -> String {
    let text = match json {
        "null" => "-".to_owned(),
        _ if json.starts_with('"') => match serde_json::from_str::<Text>(json) {
            Ok(Text(s)) => s.into_owned(),
            Err(_) => json.to_owned(),
        },
        other => other.to_owned(),
    };
    let text = text.replace('\n', " ");
    if text.chars().count() > MAX_CELL_CHARS {
        let cut: String = text.chars().take(MAX_CELL_CHARS - 1).collect();
        format!("{cut}…")
    } else {
        text
    }
}

/// Everything about one event, section by section.
pub fn event_detail(detail: &EventDetail) -> String {
    let mut claim = row(&detail.claim);
    let c = &detail.claim;
    claim += &format!(
        "delivered {} time(s), {} suppressed as duplicates; last seen {}\n",
        c.deliveries,
        c.suppressed(),
        c.last_seen_at.to_rfc3339()
    );
    if detail.claim.payload.is_none() {
        claim += "payload not kept: a settled claim keeps only payload_sha256; the effect rows \
                  and outbox operations hold what was applied\n";
    }
    [
        ("claim", claim),
        ("effect rows (ledger)", rows(&detail.ledger)),
        ("outbox operations", rows(&detail.operations)),
        ("fulfilled by", fulfilled(detail)),
        ("attempts", rows(&detail.attempts)),
        ("output records", rows(&detail.output_records)),
        ("dead letters", rows(&detail.dead_letters)),
        ("key conflicts", rows(&detail.key_conflicts)),
    ]
    .into_iter()
    .map(|(name, table)| format!("== {name}\n{table}"))
    .collect()
}

/// The operations another event fulfils, one line each: nothing was sent for them.
fn fulfilled(detail: &EventDetail) -> String {
    if detail.fulfilled_by.is_empty() {
        return rows(&detail.fulfilled_by);
    }
    detail
        .fulfilled_by
        .iter()
        .map(|f| {
            format!(
                "{}: fulfilled by {} ({}); nothing was enqueued for this event\n",
                f.operation, f.fulfilled_by, f.operation_key
            )
        })
        .collect()
}

/// What a change moved, one line per row.
pub fn changes(changes: &[Change]) -> String {
    changes
        .iter()
        .map(|c| format!("{}: {} -> {}\n", c.target, c.before, c.after))
        .collect()
}

/// The `status` screen.
pub fn status(s: &Status) -> String {
    let mut out = String::new();
    if let (Some(topic), Some(group)) = (&s.topic, &s.group) {
        let total: i64 = s.lag.iter().map(|l| l.lag).sum();
        out += &format!("Kafka: topic {topic}, group {group}, total lag {total}\n");
        out += &lag_table(s);
    }
    out += &format!("Claims: {}\n", by_state(&s.claims));
    if let Some(next) = s.next_deferred_due_seconds {
        out += &format!(
            "Deferred: {}; oldest {:.0} s; next due {}\n",
            s.deferred,
            s.oldest_deferred_seconds,
            match next > 0.0 {
                true => format!("in {next:.0} s"),
                false => format!("now (overdue {:.0} s)", -next),
            }
        );
    }
    out += &format!("Outbox: {}\n", by_state(&s.outbox));
    out += &format!(
        "Oldest due operation: {:.0} s; expired leases: {}\n",
        s.oldest_due_seconds, s.expired_leases
    );
    out += &format!(
        "Dead letters: {} ({} not replayed); key conflicts: {}\n",
        s.dead_letters, s.dead_letters_not_replayed, s.key_conflicts
    );
    out += &format!(
        "Expired replays: {} waiting for an operator; oldest {:.0} s\n",
        s.expired_replays, s.oldest_expired_replay_seconds
    );
    out += &breakers(s);
    out += &output_backlog(s);
    out
}

/// The Kafka output's backlog per output partition, and each stop with its reason.
fn output_backlog(s: &Status) -> String {
    if s.output.is_empty() {
        return "Kafka output: nothing waiting\n".into();
    }
    let now = chrono::Utc::now();
    let mut table = plain_table([
        "output topic",
        "partition",
        "waiting",
        "oldest",
        "relay",
        "state",
    ]);
    for b in &s.output {
        let oldest = b.oldest.map_or("-".into(), |t| {
            format!("{} s", (now - t).num_seconds().max(0))
        });
        let state = match (&b.stopped, b.in_doubt) {
            (Some(why), _) => format!("stopped: {why}"),
            (None, true) => "in doubt: read back first".into(),
            (None, false) => "ok".into(),
        };
        table.add_row([
            b.topic.clone(),
            b.partition.map_or("unassigned".into(), |p| p.to_string()),
            b.pending.to_string(),
            oldest,
            b.owner.clone().unwrap_or_else(|| "-".into()),
            state,
        ]);
    }
    format!("Kafka output:\n{table}\n")
}

/// The destinations whose breaker is not closed, one line each.
fn breakers(s: &Status) -> String {
    if s.open_breakers.is_empty() {
        return "Destinations: every circuit breaker is closed\n".into();
    }
    s.open_breakers
        .iter()
        .map(|b| {
            format!(
                "Destination {}: breaker {}, {} in flight\n",
                b.origin, b.breaker, b.in_flight
            )
        })
        .collect()
}

/// The lag per partition, numbers right-aligned whatever their width.
fn lag_table(s: &Status) -> String {
    let mut table = plain_table(["partition", "committed", "end", "lag"]);
    for l in &s.lag {
        let committed = l.committed.map_or("-".into(), |c| c.to_string());
        table.add_row([
            l.partition.to_string(),
            committed,
            l.high_watermark.to_string(),
            l.lag.to_string(),
        ]);
    }
    for column in table.column_iter_mut() {
        column.set_cell_alignment(CellAlignment::Right);
    }
    format!("{table}\n")
}

/// Counts by state, an estimate marked `~`.
fn by_state(rows: &[(String, Count)]) -> String {
    if rows.is_empty() {
        return "none".into();
    }
    let parts: Vec<String> = rows.iter().map(|(k, n)| format!("{k} {n}")).collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::status::PartitionLag;

    #[test]
    fn a_table_has_one_column_per_field_in_the_fields_order_with_exact_values() {
        #[derive(Serialize)]
        struct View {
            zeta: &'static str,
            alpha: Option<i64>,
            payload: Box<serde_json::value::RawValue>,
        }
        let payload = |text: &str| serde_json::value::RawValue::from_string(text.into()).unwrap();
        let text = rows(&[
            View {
                zeta: "a \"quoted\"\nline",
                alpha: None,
                payload: payload(r#"{"amount":123456789012345678901234567890}"#),
            },
            View {
                zeta: "z",
                alpha: Some(2),
                payload: payload("0.1000000000000000055511151231257827"),
            },
        ]);
        let lines: Vec<&str> = text.lines().collect();
        let header: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(header, ["zeta", "alpha", "payload"], "{text}");
        assert!(lines[1].contains(r#"a "quoted" line"#), "{text}");
        assert!(lines[1].contains(" - "), "null is shown as -: {text}");
        assert!(
            lines[1].contains("123456789012345678901234567890"),
            "{text}"
        );
        assert!(
            lines[2].contains("0.1000000000000000055511151231257827"),
            "{text}"
        );
        assert_eq!(rows::<View>(&[]), "(none)\n");
    }

    #[test]
    fn lag_columns_line_up_past_offset_999() {
        let lag = |partition, committed, high_watermark| PartitionLag {
            partition,
            committed,
            high_watermark,
            lag: high_watermark - committed.unwrap_or(0),
        };
        let status = Status {
            topic: Some("t".into()),
            group: Some("g".into()),
            lag: vec![
                lag(0, Some(7), 12),
                lag(1, Some(123_456), 1_234_567),
                lag(2, None, 5),
            ],
            ..Status::default()
        };
        let text = status_lines(&status);
        let ends: Vec<usize> = text.iter().map(|l| l.trim_end().len()).collect();
        assert!(ends.windows(2).all(|w| w[0] == w[1]), "{text:#?}");
    }

    /// The lag table's lines: header and one per partition.
    fn status_lines(status: &Status) -> Vec<String> {
        lag_table(status).lines().map(str::to_owned).collect()
    }
}
