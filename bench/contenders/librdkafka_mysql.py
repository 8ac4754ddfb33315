"""The 30-line loop for MySQL: confluent-kafka ``consume(10000)``, ``json.loads``, pymysql
``executemany`` of the INSERT 1,000 rows at a time (the MySQL sink's default
``rows_per_statement``; pymysql makes each a multi-row INSERT), commit per batch, one
thread (issue 18's baseline for the MySQL sink, as a user would write it)."""

from __future__ import annotations

import argparse
import json

import pymysql
from confluent_kafka import Consumer


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--bootstrap", required=True)
    a.add_argument("--topic", required=True)
    a.add_argument("--group", required=True)
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=3306)
    a.add_argument("--user", default="root")
    a.add_argument("--database", default="test")
    a.add_argument("--table", required=True)
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
    conn = pymysql.connect(
        host=args.host, port=args.port, user=args.user, database=args.database, charset="utf8mb4"
    )
    stmt = f"INSERT INTO `{args.table}` (id, name, amount, ts) VALUES (%s, %s, %s, %s)"
    done = 0
    while done < args.n:
        msgs = consumer.consume(10_000, timeout=0.5)
        if not msgs:
            continue
        rows = []
        for m in msgs:
            if m.error():
                raise SystemExit(str(m.error()))
            o = json.loads(m.value())
            rows.append((o["id"], o["name"], o["amount"], o.get("ts", 0)))
        with conn.cursor() as cur:
            for i in range(0, len(rows), 1000):
                cur.executemany(stmt, rows[i : i + 1000])
        conn.commit()
        consumer.commit(asynchronous=False)
        done += len(msgs)
    consumer.close()
    conn.close()


if __name__ == "__main__":
    main()
