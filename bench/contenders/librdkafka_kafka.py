"""The 30-line loop for Kafka: confluent-kafka ``consume(10000)``, ``json.loads``, each row
re-encoded as JSON and produced to another topic with the source key, headers and
timestamp by a confluent-kafka ``Producer`` with the Kafka sink's defaults (idempotent,
``acks=all``, linger 5 ms, 256 KiB batches), ``flush()`` per batch and every delivery
checked, commit per batch, one thread (issue 18's baseline for the Kafka sink)."""

from __future__ import annotations

import argparse
import json

from confluent_kafka import Consumer, Producer


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--bootstrap", required=True)
    a.add_argument("--topic", required=True)
    a.add_argument("--group", required=True)
    a.add_argument("--target", required=True)
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
    producer = Producer(
        {
            "bootstrap.servers": args.bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "batch.size": 256 * 1024,
        }
    )
    errors: list[str] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    done = 0
    while done < args.n:
        msgs = consumer.consume(10_000, timeout=0.5)
        if not msgs:
            continue
        for m in msgs:
            if m.error():
                raise SystemExit(str(m.error()))
            o = json.loads(m.value())
            value = json.dumps(o, separators=(",", ":"))
            while True:
                try:
                    producer.produce(
                        args.target,
                        value=value,
                        key=m.key(),
                        headers=m.headers(),
                        timestamp=m.timestamp()[1],
                        on_delivery=delivered,
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
        if producer.flush(60) or errors:
            raise SystemExit(f"undelivered: {errors[:3]}")
        consumer.commit(asynchronous=False)
        done += len(msgs)
    consumer.close()


if __name__ == "__main__":
    main()
