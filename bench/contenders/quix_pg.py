"""quixstreams' ``Application`` with its ``PostgreSQLSink``, default settings.

It runs until stopped: the benchmark sends SIGTERM (a graceful stop) once every row is in.
"""

from __future__ import annotations

import argparse

from quixstreams import Application
from quixstreams.sinks.community.postgresql import PostgreSQLSink


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--bootstrap", required=True)
    a.add_argument("--topic", required=True)
    a.add_argument("--group", required=True)
    a.add_argument("--pg-host", default="127.0.0.1")
    a.add_argument("--pg-port", type=int, default=5432)
    a.add_argument("--pg-db", default="test")
    a.add_argument("--pg-user", default="postgres")
    a.add_argument("--schema", required=True)
    a.add_argument("--table", required=True)
    args = a.parse_args()
    app = Application(
        broker_address=args.bootstrap,
        consumer_group=args.group,
        auto_offset_reset="earliest",
        state_dir=f"/tmp/quix-state-{args.group}",
    )
    sink = PostgreSQLSink(
        host=args.pg_host,
        port=args.pg_port,
        dbname=args.pg_db,
        user=args.pg_user,
        password="",
        table_name=args.table,
        schema_name=args.schema,
    )
    sdf = app.dataframe(app.topic(args.topic, value_deserializer="json"))
    sdf.sink(sink)

    app.run()


if __name__ == "__main__":
    main()
