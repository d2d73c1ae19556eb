//! The operator commands' I/O: run an `ops` query or change, print a table or JSON.

use crate::cli::{DeadLettersCommand, EventsCommand, OperatorArgs};
use crate::ops::{self, Changes, Table};
use anyhow::Context as _;
use std::time::Duration;

fn pool(op: &OperatorArgs) -> anyhow::Result<sqlx::PgPool> {
    op.database.pool(2)
}

fn print_table(op: &OperatorArgs, table: &Table) {
    if op.json {
        println!("{}", table.to_json());
    } else {
        print!("{}", table.render());
    }
}

fn print_changes(op: &OperatorArgs, changes: &Changes) {
    if op.json {
        let rows: Vec<_> = changes
            .iter()
            .map(|(t, b, a)| serde_json::json!({"target": t, "before": b, "after": a}))
            .collect();
        println!("{}", serde_json::Value::Array(rows));
    } else {
        for (target, before, after) in changes {
            println!("{target}: {before} -> {after}");
        }
    }
}

pub async fn events(command: EventsCommand) -> anyhow::Result<()> {
    match command {
        EventsCommand::List {
            op,
            state,
            source,
            older_than_secs,
            limit,
        } => {
            let filter = ops::EventFilter {
                state,
                source,
                older_than: older_than_secs.map(Duration::from_secs),
                limit,
            };
            print_table(&op, &ops::list_events(&pool(&op)?, &filter).await?);
        }
        EventsCommand::Show { op, key } => {
            let sections = ops::show_event(&pool(&op)?, &key).await?;
            if op.json {
                let object: serde_json::Map<_, _> = sections
                    .iter()
                    .map(|(name, t)| (name.to_string(), t.to_json()))
                    .collect();
                println!("{}", serde_json::Value::Object(object));
            } else {
                for (name, table) in sections {
                    println!("== {name}");
                    print!("{}", table.render());
                }
            }
        }
        EventsCommand::Retry {
            op,
            key,
            operation,
            effect,
            state,
            source,
            since,
            limit,
            dry_run,
            reason,
        } => {
            let effect = effect.map(|e| e.build(None)).transpose()?;
            let pool = pool(&op)?;
            let Some(state) = state else {
                let key = key.context("an event key, or --state for a bulk retry")?;
                let changes = ops::retry(
                    &pool,
                    effect.as_deref(),
                    &key,
                    operation.as_deref(),
                    &op.actor(),
                    &reason,
                )
                .await?;
                print_changes(&op, &changes);
                return Ok(());
            };
            let filter = ops::RetryFilter {
                state,
                source,
                since,
                limit,
            };
            let keys = ops::events_to_retry(&pool, &filter).await?;
            if dry_run {
                for key in &keys {
                    println!("{key}: would be retried");
                }
                println!(
                    "{} events would be retried (dry run: nothing changed)",
                    keys.len()
                );
                return Ok(());
            }
            let mut failures = 0;
            for key in &keys {
                let retried = ops::retry(
                    &pool,
                    effect.as_deref(),
                    key,
                    operation.as_deref(),
                    &op.actor(),
                    &reason,
                )
                .await;
                match retried {
                    Ok(changes) => print_changes(&op, &changes),
                    Err(e) => {
                        failures += 1;
                        eprintln!("{key}: not retried: {e:#}");
                    }
                }
            }
            anyhow::ensure!(
                failures == 0,
                "{failures} of {} events were not retried",
                keys.len()
            );
        }
        EventsCommand::Resolve {
            op,
            key,
            to,
            operation,
            reason,
        } => {
            let changes = ops::resolve(
                &pool(&op)?,
                &key,
                operation.as_deref(),
                &to,
                &op.actor(),
                &reason,
            )
            .await?;
            print_changes(&op, &changes);
        }
    }
    Ok(())
}

pub async fn dead_letters(command: DeadLettersCommand) -> anyhow::Result<()> {
    match command {
        DeadLettersCommand::List { op, limit } => {
            print_table(&op, &ops::list_dead_letters(&pool(&op)?, limit).await?)
        }
        DeadLettersCommand::Show { op, id } => {
            print_table(&op, &ops::show_dead_letter(&pool(&op)?, id).await?)
        }
        DeadLettersCommand::Replay {
            op,
            id,
            brokers,
            topic,
            kafka_options,
            reason,
        } => {
            let produce = |letter: ops::DeadLetter| async move {
                let topic = topic.unwrap_or(letter.topic);
                produce_raw(&brokers, &kafka_options, &topic, letter.key, letter.value).await?;
                Ok(topic)
            };
            let changes =
                ops::replay_dead_letter(&pool(&op)?, id, &op.actor(), &reason, produce).await?;
            print_changes(&op, &changes);
        }
    }
    Ok(())
}

async fn produce_raw(
    brokers: &str,
    options: &[(String, String)],
    topic: &str,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
) -> anyhow::Result<()> {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let mut config = rdkafka::ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("acks", "all")
        .set("enable.idempotence", "true");
    for (k, v) in options {
        config.set(k, v);
    }
    let producer: FutureProducer = config.create().context("creating the Kafka producer")?;
    let mut record = FutureRecord::<[u8], [u8]>::to(topic);
    if let Some(k) = &key {
        record = record.key(k);
    }
    if let Some(v) = &value {
        record = record.payload(v);
    }
    producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .context("producing the dead letter")?;
    Ok(())
}
