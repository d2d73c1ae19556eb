#!/usr/bin/env python3
"""Writes CloudEvents to a Kafka topic with the CloudEvents SDK's own Kafka binding.

Each line of standard input is one event as JSON:
    {"source": "/shop/orders", "id": "A-1", "type": "order.created",
     "data": {"total": 10}, "extensions": {"partitionkey": "tenant-7"}}
(`time`, `subject` and `datacontenttype` are optional too.)

    python3 cloudevents_producer.py --brokers localhost:9092 --topic orders \
        --mode binary < events.jsonl

`--mode binary` puts the attributes in ce_* headers and the data in the value;
`--mode structured` writes the whole event as application/cloudevents+json.
replayproof reads both (`replayproof consume --input cloudevents`): the identity is the
event's (source, id), so a redelivery in the other mode or on another partition is a replay.
Needs `pip install cloudevents==2.2.0 confluent-kafka`.
"""
import argparse
import json
import sys

from cloudevents.core.bindings.kafka import to_binary, to_structured
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from confluent_kafka import Producer
from dateutil.parser import isoparse


def cloudevent(line: dict) -> CloudEvent:
    attributes = {k: line[k] for k in ("source", "id", "type", "subject", "datacontenttype") if k in line}
    if "time" in line:
        attributes["time"] = isoparse(line["time"])
    attributes.update(line.get("extensions", {}))
    return CloudEvent(attributes=attributes, data=line.get("data"))


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--brokers", required=True)
    args.add_argument("--topic", required=True)
    args.add_argument("--mode", choices=["binary", "structured"], default="binary")
    args.add_argument("--partition", type=int, help="write every event to this partition")
    args.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                      help="a librdkafka property, such as broker.address.family=v4")
    opts = args.parse_args()
    config = {"bootstrap.servers": opts.brokers, "acks": "all", "enable.idempotence": True}
    config.update(kv.split("=", 1) for kv in opts.config)
    producer = Producer(config)
    convert = to_binary if opts.mode == "binary" else to_structured
    failures = []

    def delivered(err, _msg):
        if err is not None:
            failures.append(err)

    for raw in sys.stdin:
        if not raw.strip():
            continue
        message = convert(cloudevent(json.loads(raw)), JSONFormat())
        extra = {} if opts.partition is None else {"partition": opts.partition}
        producer.produce(opts.topic, key=message.key, value=message.value,
                         headers=list(message.headers.items()), on_delivery=delivered, **extra)
    producer.flush(30)
    if failures or len(producer):
        print(f"not delivered: {failures or len(producer)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
