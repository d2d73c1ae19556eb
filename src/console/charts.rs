//! The overview's pictures of the last hour, drawn on the server as inline SVG (no script, no
//! style attribute: the console's CSP stays `default-src 'none'`): events applied, duplicates
//! suppressed and dead letters per minute as bars, and each partition's lag as a line. Each
//! bar and point carries a `<title>`, the number a browser shows on hover.

use crate::activity::Minute;
use chrono::{DateTime, Duration, DurationRound, Utc};
use maud::{html, Markup};
use std::collections::BTreeMap;

/// Minutes drawn: the last hour.
pub(crate) const MINUTES: i64 = 60;
const WIDTH: i64 = 600;
const HEIGHT: i64 = 90;
/// Colours, one per series, and per partition in turn.
const PALETTE: [&str; 6] = [
    "#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b7791f", "#c53030",
];

/// The first minute drawn, for a picture at `now`.
pub(crate) fn start(now: DateTime<Utc>) -> DateTime<Utc> {
    let minute = now.duration_trunc(Duration::minutes(1)).unwrap_or(now);
    minute - Duration::minutes(MINUTES - 1)
}

/// The four charts of `minutes` (oldest first), the hour ending at `now`.
pub(crate) fn last_hour(minutes: &[Minute], now: DateTime<Utc>) -> Markup {
    let first = start(now);
    let slot = |m: &Minute| (m.minute - first).num_minutes();
    let minutes: Vec<&Minute> = minutes
        .iter()
        .filter(|m| (0..MINUTES).contains(&slot(m)))
        .collect();
    let series = |pick: fn(&Minute) -> i64| -> Vec<(i64, i64)> {
        minutes.iter().map(|m| (slot(m), pick(m))).collect()
    };
    html! {
        section id="activity" {
            h2 { "The last hour" }
            div class="grid" {
                (bars("applied", "Events applied per minute", &series(|m| m.total.applied), PALETTE[0]))
                (bars("suppressed", "Duplicates suppressed per minute", &series(|m| m.total.suppressed), PALETTE[1]))
                (bars("dead-letters", "Dead letters per minute", &series(|m| m.total.dead_letters), PALETTE[5]))
                (lag(&lag_by_partition(&minutes, slot)))
            }
        }
    }
}

/// Each partition's lag readings, by slot.
fn lag_by_partition(
    minutes: &[&Minute],
    slot: impl Fn(&Minute) -> i64,
) -> BTreeMap<i32, Vec<(i64, i64)>> {
    let mut lines: BTreeMap<i32, Vec<(i64, i64)>> = BTreeMap::new();
    for m in minutes {
        for (partition, lag) in &m.lag {
            lines.entry(*partition).or_default().push((slot(m), *lag));
        }
    }
    lines
}

/// A bar per minute of `values` ((slot, value), slots 0 to 59).
fn bars(id: &str, title: &str, values: &[(i64, i64)], colour: &str) -> Markup {
    let top = values.iter().map(|(_, v)| *v).max().unwrap_or(0).max(1);
    let total: i64 = values.iter().map(|(_, v)| *v).sum();
    let width = WIDTH / MINUTES;
    html! {
        figure class="chart" id=(id) {
            figcaption { (title) ": " (total) " in the hour, at most " (top) " a minute" }
            svg xmlns="http://www.w3.org/2000/svg" viewBox=(format!("0 0 {WIDTH} {HEIGHT}")) role="img" aria-label=(title) {
                line x1="0" y1=(HEIGHT) x2=(WIDTH) y2=(HEIGHT) stroke="#999" {}
                @for (slot, value) in values.iter().filter(|(_, v)| *v > 0) {
                    @let h = (value * (HEIGHT - 2) / top).max(1);
                    rect x=(slot * width) y=(HEIGHT - h) width=(width - 1) height=(h) fill=(colour) {
                        title { (minutes_ago(*slot)) ": " (value) }
                    }
                }
            }
        }
    }
}

/// A line per partition of its lag readings.
fn lag(lines: &BTreeMap<i32, Vec<(i64, i64)>>) -> Markup {
    let top = lines
        .values()
        .flatten()
        .map(|(_, v)| *v)
        .max()
        .unwrap_or(0)
        .max(1);
    let x = |slot: i64| slot * WIDTH / (MINUTES - 1);
    let y = |v: i64| HEIGHT - v * (HEIGHT - 2) / top;
    html! {
        figure class="chart" id="lag" {
            figcaption { "Lag per partition, at most " (top) }
            svg xmlns="http://www.w3.org/2000/svg" viewBox=(format!("0 0 {WIDTH} {HEIGHT}")) role="img" aria-label="Lag per partition" {
                line x1="0" y1=(HEIGHT) x2=(WIDTH) y2=(HEIGHT) stroke="#999" {}
                @for (i, (partition, points)) in lines.iter().enumerate() {
                    @let colour = PALETTE[i % PALETTE.len()];
                    polyline fill="none" stroke=(colour) points=(points.iter().map(|(s, v)| format!("{},{}", x(*s), y(*v))).collect::<Vec<_>>().join(" ")) {
                        title { "partition " (partition) }
                    }
                    @for (s, v) in points {
                        circle cx=(x(*s)) cy=(y(*v)) r="2" fill=(colour) { title { "partition " (partition) ", " (minutes_ago(*s)) ": " (v) } }
                    }
                }
            }
            @if lines.is_empty() { p { "No lag reported by a consumer in the hour." } }
            @else { p class="legend" { @for (i, p) in lines.keys().enumerate() { (swatch(PALETTE[i % PALETTE.len()])) " partition " (p) " " } } }
        }
    }
}

/// A square of `colour`, for a legend.
fn swatch(colour: &str) -> Markup {
    html! { svg xmlns="http://www.w3.org/2000/svg" width="10" height="10" viewBox="0 0 10 10" { rect width="10" height="10" fill=(colour) {} } }
}

fn minutes_ago(slot: i64) -> String {
    match MINUTES - 1 - slot {
        0 => "this minute".into(),
        1 => "a minute ago".into(),
        n => format!("{n} minutes ago"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::Counts;

    fn minute(at: DateTime<Utc>, applied: i64, lag: &[(i32, i64)]) -> Minute {
        Minute {
            minute: at,
            total: Counts {
                applied,
                suppressed: 1,
                dead_letters: 0,
                lag: None,
            },
            lag: lag.iter().copied().collect(),
        }
    }

    #[test]
    fn a_bar_per_minute_with_its_number_and_a_line_per_partition() {
        let now = "2026-12-03T10:30:20Z".parse().unwrap();
        let first = start(now);
        let minutes = [
            minute(first - Duration::minutes(1), 4321, &[]),
            minute(first, 10, &[(0, 5), (1, 50)]),
            minute(first + Duration::minutes(59), 40, &[(0, 0)]),
        ];
        let svg = last_hour(&minutes, now).into_string();
        assert!(
            svg.contains("Events applied per minute: 50 in the hour"),
            "{svg}"
        );
        assert!(svg.contains("<title>59 minutes ago: 10</title>"), "{svg}");
        assert!(svg.contains("<title>this minute: 40</title>"), "{svg}");
        assert!(
            !svg.contains("4321"),
            "a minute before the hour is not drawn"
        );
        assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");
        assert!(!svg.contains("style="), "no style attribute under the CSP");
        assert!(!svg.contains("<script"));
    }
}
