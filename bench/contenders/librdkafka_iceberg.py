"""The loop a user writes for Iceberg: confluent-kafka ``consume(--batch)``, ``json.loads``,
``pyarrow.Table.from_pylist``, pyiceberg ``table.append`` (one snapshot per batch), commit
per batch, one thread. The table is created on start (SQL catalog, local warehouse)."""

from __future__ import annotations

import argparse
import json

import pyarrow as pa
from confluent_kafka import Consumer
from pyiceberg.catalog import load_catalog

SCHEMA = pa.schema(
    [("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64()), ("ts", pa.int64())]
)


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--bootstrap", required=True)
    a.add_argument("--topic", required=True)
    a.add_argument("--group", required=True)
    a.add_argument("--catalog", required=True)  # a SQLAlchemy URL
    a.add_argument("--warehouse", required=True)  # file:// URL
    a.add_argument("--table", required=True)  # namespace.table
    a.add_argument("--n", type=int, required=True)
    a.add_argument("--batch", type=int, default=40_000)
    args = a.parse_args()
    catalog = load_catalog("bench", type="sql", uri=args.catalog, warehouse=args.warehouse)
    namespace, _, name = args.table.rpartition(".")
    catalog.create_namespace_if_not_exists(namespace)
    table = catalog.create_table_if_not_exists((namespace, name), schema=SCHEMA)
    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([args.topic])
    done = 0
    while done < args.n:
        msgs = consumer.consume(args.batch, timeout=0.5)
        if not msgs:
            continue
        rows = []
        for m in msgs:
            if m.error():
                raise SystemExit(str(m.error()))
            rows.append(json.loads(m.value()))
        table.append(pa.Table.from_pylist(rows, schema=SCHEMA))
        consumer.commit(asynchronous=False)
        done += len(msgs)
    consumer.close()


if __name__ == "__main__":
    main()
