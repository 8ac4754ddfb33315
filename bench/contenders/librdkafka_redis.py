"""The 30-line loop for Redis: confluent-kafka ``consume(10000)``, ``json.loads``, redis-py
``HSET <prefix>:<id> name .. amount .. ts ..`` per row in non-transactional pipelines of
1,000 rows (the Redis sink's default ``pipeline_size``), every reply checked, commit per
batch, one thread (issue 18's baseline for the Redis sink, as a user would write it)."""

from __future__ import annotations

import argparse
import json

import redis
from confluent_kafka import Consumer


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--bootstrap", required=True)
    a.add_argument("--topic", required=True)
    a.add_argument("--group", required=True)
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=6379)
    a.add_argument("--db", type=int, default=0)
    a.add_argument("--prefix", required=True)
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
    r = redis.Redis(host=args.host, port=args.port, db=args.db)
    done = 0
    while done < args.n:
        msgs = consumer.consume(10_000, timeout=0.5)
        if not msgs:
            continue
        for i in range(0, len(msgs), 1000):
            pipe = r.pipeline(transaction=False)
            for m in msgs[i : i + 1000]:
                if m.error():
                    raise SystemExit(str(m.error()))
                o = json.loads(m.value())
                pipe.hset(
                    f"{args.prefix}:{o['id']}",
                    mapping={"name": o["name"], "amount": o["amount"], "ts": o.get("ts", 0)},
                )
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, Exception):
                    raise SystemExit(str(reply))
        consumer.commit(asynchronous=False)
        done += len(msgs)
    consumer.close()
    r.close()


if __name__ == "__main__":
    main()
