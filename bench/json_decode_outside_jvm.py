"""What decoding the benchmark's JSON costs outside the JVM: Arrow's C++ JSON reader.

A reference figure for the design choice of decoding every batch in Spark (issue 47: the
Spark JVM's CPU per row is what keeps a connector above 2x the bare loop's CPU). Decodes
400,000 of the peer benchmark's orders in batches of 40,000 (the default batch) with
``pyarrow.json.read_json`` and the benchmark's schema, one thread, five rounds, and prints
the process CPU seconds per 100,000 rows::

    .venv/bin/python -m bench.json_decode_outside_jvm

Not the connector's semantics (a document spanning lines, a failed document's reason); a
floor to set against the JVM's 0.47-0.52 s per 100K (docs/BENCHMARKS.md section 11,
run H). Not a test.
"""

from __future__ import annotations

import io
import json
import time

import pyarrow as pa
import pyarrow.json as pj

N = 400_000
BATCH = 40_000
SCHEMA = pa.schema(
    [("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64()), ("ts", pa.int64())]
)


def main() -> None:
    docs = [
        json.dumps({"id": i, "name": f"name {i}", "amount": i * 0.5, "ts": 1_700_000_000_000})
        for i in range(N)
    ]
    batches = ["\n".join(docs[k : k + BATCH]).encode() for k in range(0, N, BATCH)]
    parse = pj.ParseOptions(explicit_schema=SCHEMA, unexpected_field_behavior="ignore")
    read = pj.ReadOptions(use_threads=False)
    rounds = []
    for _ in range(5):
        start = time.process_time()
        rows = sum(
            pj.read_json(io.BytesIO(b), parse_options=parse, read_options=read).num_rows
            for b in batches
        )
        assert rows == N
        rounds.append((time.process_time() - start) * 100_000 / N)
    print("Arrow JSON reader, CPU s per 100K rows:", ", ".join(f"{r:.3f}" for r in rounds))


if __name__ == "__main__":
    main()
