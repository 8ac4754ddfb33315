"""The 30-line loop: confluent-kafka ``consume(10000)``, ``json.loads``, psycopg2 ``COPY``,
commit per batch, one thread (issue 18's baseline, as a user would write it)."""

from __future__ import annotations

import argparse
import io
import json

import psycopg2
from confluent_kafka import Consumer


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--bootstrap", required=True)
    a.add_argument("--topic", required=True)
    a.add_argument("--group", required=True)
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
            o = json.loads(m.value())
            buf.write(f"{o['id']}\t{o['name']}\t{o['amount']}\t{o.get('ts', 0)}\n")
        buf.seek(0)
        with conn.cursor() as cur:
            cur.copy_expert(f"COPY {args.table} (id, name, amount, ts) FROM STDIN", buf)
        conn.commit()
        consumer.commit(asynchronous=False)
        done += len(msgs)
    consumer.close()
    conn.close()


if __name__ == "__main__":
    main()
