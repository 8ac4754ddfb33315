"""The loop a user writes for an Avro topic: confluent-kafka ``consume(10000)``, its
``AvroDeserializer`` per message (the writer schema from the registry, cached), psycopg2
``COPY`` (amount as the Decimal's text, address as JSON), commit per batch, one thread
(librdkafka_pg.py's shape; the baseline of bench/test_bench_avro.py)."""

from __future__ import annotations

import argparse
import io
import json

import psycopg2
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--bootstrap", required=True)
    a.add_argument("--topic", required=True)
    a.add_argument("--group", required=True)
    a.add_argument("--registry", required=True)
    a.add_argument("--pg", required=True)
    a.add_argument("--table", required=True)  # "schema"."table"
    a.add_argument("--n", type=int, required=True)
    args = a.parse_args()
    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([args.topic])
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": args.registry}))
    ctx = SerializationContext(args.topic, MessageField.VALUE)
    conn = psycopg2.connect(args.pg)
    done = 0
    while done < args.n:
        msgs = consumer.consume(10_000, timeout=0.5)
        if not msgs:
            continue
        buf = io.StringIO()
        for m in msgs:
            if m.error():
                raise SystemExit(str(m.error()))
            o = deserialize(m.value(), ctx)
            buf.write(
                f"{o['id']}\t{o['name']}\t{o['amount']}\t{o['ts'].isoformat()}"
                f"\t{json.dumps(o['address'])}\n"
            )
        buf.seek(0)
        with conn.cursor() as cur:
            cur.copy_expert(f"COPY {args.table} (id, name, amount, ts, address) FROM STDIN", buf)
        conn.commit()
        consumer.commit(asynchronous=False)
        done += len(msgs)
    consumer.close()
    conn.close()


if __name__ == "__main__":
    main()
