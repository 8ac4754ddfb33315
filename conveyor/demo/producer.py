"""Demo producer: JSON orders into a topic at a steady rate (``python -m conveyor.demo.producer``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import time
from datetime import datetime, timezone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", default="orders")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--rate", type=float, default=50.0, help="messages per second")
    ap.add_argument("--count", type=int, default=0, help="stop after this many (0 = forever)")
    args = ap.parse_args()

    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=args.bootstrap)
    with contextlib.suppress(TopicAlreadyExistsError):
        admin.create_topics([NewTopic(args.topic, args.partitions, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=args.bootstrap, linger_ms=20)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    rng = random.Random(7)
    i = 0
    interval = 1.0 / args.rate if args.rate > 0 else 0
    next_at = time.monotonic()
    while not stop and (args.count == 0 or i < args.count):
        order = {
            "id": i,
            "customer": rng.choice(["ada", "grace", "linus", "margaret", "barbara"]),
            "amount": round(rng.uniform(-5, 200), 2),
            "status": rng.choice(["new", "paid", "shipped"]),
        }
        # The record timestamp is the order's created_at (milliseconds, the same minute):
        # the demo connector's watermark reads it.
        now_ms = int(time.time() * 1000)
        order["created_at"] = datetime.fromtimestamp(now_ms / 1000, timezone.utc).isoformat()
        producer.send(
            args.topic,
            key=str(i).encode(),
            value=json.dumps(order).encode(),
            headers=[("source", b"demo")],
            timestamp_ms=now_ms,
        )
        i += 1
        if interval:
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    producer.flush()
    producer.close()


if __name__ == "__main__":
    main()
