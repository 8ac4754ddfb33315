"""Exactly once from Kafka to Kafka (``delivery: exactly_once``): each batch's records and the
source offsets they end at in one Kafka transaction, as Kafka Streams does it.

The run's producer has the transactional id ``conveyor-<writer id>`` (``<writer>@<incarnation>``:
the connector, or a partition task's ``<connector>.task<N>``, of this incarnation;
``core/positions.py``): initialising it fences every older producer of that id, so a zombie run
cannot commit after the new run has started. The offsets go to the consumer group
``conveyor-<writer id>`` of the target cluster with ``send_offsets_to_transaction``, each carrying
``<generation>|<log id>|<destination>`` as its metadata (the release before issue 44 wrote the
generation alone); the run reads them on start (``target_offsets``) and they win over the meta
store's where they are positions of the logs it reads and its destination. Rows those offsets already cover are never written again: a zombie that
reconnects (and so fences the new run's producer) and commits makes the new run, once it has
reconnected in turn, skip what the zombie wrote. A producer that initialises and finds a greater
generation recorded is the zombie and stops (``FencedError``; a broker that keeps no offset
metadata, as tansu, leaves that to the meta store's fencing). The source and target topics must be on one cluster (the offsets of
the source's partitions are committed in the target's group coordinator), as in Kafka Streams.
Consumers of the target see each record once with ``isolation.level=read_committed``.

An operator's offsets change (``move_offsets``) goes through each writer's transactional id in
turn: ``init_transactions`` fences that id's older producers (a zombie's open transaction is
aborted and its commit refused), then one transaction sends the new offsets with the new
generation (backwards too: a group's offsets are overwritten). To forget a partition the
writer's group is deleted and the offsets it keeps are committed again (OffsetDelete is not in
every broker); a crash between the two leaves the group without them, and the meta store's
values apply.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from conveyor.core.errors import BatchRejected, FencedError, TransientSinkError
from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.positions import StoredPosition, StoredPositions, TargetBinding
from conveyor.core.sink import is_writer_of

log = logging.getLogger("conveyor.sinks.kafka")


# librdkafka's default transaction timeout; raised to the record timeout when that is longer.
TRANSACTION_TIMEOUT_MS = 60_000


def transactional_id(writer: str) -> str:
    return f"conveyor-{writer}"


def parse_metadata(metadata: str | None) -> tuple[int, str | None, str | None]:
    """(generation, log id, destination) of a committed offset's metadata (-1: none)."""
    gen, _, rest = (metadata or "").partition("|")
    log_id, _, destination = rest.partition("|")
    try:
        generation = int(gen)
    except ValueError:
        generation = -1
    return generation, log_id or None, destination or None


def retire(conf: dict[str, Any], connector: str, timeout_s: float = 30.0) -> None:
    """Delete the group of every writer of ``connector`` (a writer id) on the target cluster
    (transactional ids cannot be deleted: they expire on the broker)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({k: v for k, v in conf.items() if k in _ADMIN_KEYS})
    listed = admin.list_consumer_groups(request_timeout=timeout_s).result(timeout_s)
    head = transactional_id("")
    groups = [
        g.group_id
        for g in listed.valid
        if g.group_id.startswith(head) and is_writer_of(connector, g.group_id[len(head) :])
    ]
    if groups:
        for f in admin.delete_consumer_groups(groups, request_timeout=timeout_s).values():
            f.result(timeout_s)


def move_offsets(
    conf: dict[str, Any],
    generations: Mapping[str, int],
    connector: str,
    offsets: Offsets,
    *,
    forget: Collection[TopicPartition] = (),
    replace: bool = False,
    timeout_s: float = 30.0,
) -> None:
    """``OffsetsInTarget.move_target_offsets`` on the writers' groups (the writers named in
    ``generations``): every writer's older producers fenced first, then one transaction per
    writer (a transactional id is one writer's). A partition to forget: the group is deleted
    (Kafka's OffsetDelete is not in every broker, tansu's included) and what it keeps is
    committed again, through a producer initialised anew."""
    fenced: dict[str, tuple[Transactions, Any, Offsets]] = {}
    try:
        for writer, generation in sorted(generations.items()):
            txn = Transactions(conf, TargetBinding(writer, generation), timeout_s)
            fenced[writer] = (txn, txn.fence(), {})
            positions, newest = txn.read_offsets()
            held = {tp: p.offset for tp, p in positions.items()}
            if newest > generation:
                raise FencedError(
                    f"{txn.group}: generation {newest} has committed, newer than {generation}: "
                    "a run started meanwhile; nothing moved"
                )
            fenced[writer] = (txn, fenced[writer][1], held)
        anyone = {tp for _, _, held in fenced.values() for tp in held}
        for writer, (txn, producer, held) in fenced.items():
            mine = {
                tp: off
                for tp, off in offsets.items()
                if tp in held or (writer == connector and tp not in anyone)
            }
            gone = set(held) if replace else {tp for tp in forget if tp in held}
            if gone:
                txn.delete_group()
                mine = {**{tp: o for tp, o in held.items() if tp not in gone}, **mine}
                producer.flush(0)
                producer = txn.fence()
                fenced[writer] = (txn, producer, held)
            if mine:
                txn.begin(producer)
                txn.commit(producer, mine)
    finally:
        for txn, producer, _ in fenced.values():
            txn.close()
            producer.flush(0)


class Transactions:
    """One writer's transactions on a librdkafka producer (``ConfluentProducer.client``)."""

    def __init__(self, conf: dict[str, Any], binding: TargetBinding, timeout_s: float):
        self.conf, self.binding, self.timeout_s = conf, binding, timeout_s
        self.writer, self.generation = binding.writer, binding.generation
        self.group = transactional_id(binding.writer)
        self._consumer: Any = None

    def producer_conf(self) -> dict[str, Any]:
        """The transactional settings: this writer's id, and a transaction timeout no shorter
        than the records' (librdkafka refuses ``message.timeout.ms`` above
        ``transaction.timeout.ms``, whose own default, 60 s, is below ``delivery_timeout_ms``'s)."""
        record_timeout = int(self.conf.get("message.timeout.ms", 0))
        return {
            "transactional.id": transactional_id(self.writer),
            "enable.idempotence": True,
            "transaction.timeout.ms": max(TRANSACTION_TIMEOUT_MS, record_timeout),
        }

    def start(self, client: Any) -> StoredPositions:
        """Initialise the producer (fencing older ones of the id), check no newer generation
        committed, and return the positions the group holds (the target's; a migrated
        connector's in the group of its bare writer name while its own holds none, committed
        into its own at once)."""
        try:
            client.init_transactions(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - mapped
            raise self.error(e, "initialising the transactional producer") from None
        positions, newest = self.read_offsets()
        legacy = self.binding.legacy_writer
        if not positions and legacy:
            positions, _ = self.read_offsets(transactional_id(legacy))
            positions = {tp: StoredPosition(p.offset) for tp, p in positions.items()}
        held = {tp: p.offset for tp, p in positions.items()}
        if newest > self.generation:
            raise FencedError(
                f"{self.writer}: generation {newest} has committed to the target; this run is "
                f"generation {self.generation} and stops without writing"
            )
        if held and newest < self.generation:
            # Record this generation at once: an older run that reconnects (and so fences this
            # producer) finds it and stops, instead of taking the id back and forth. Each
            # position keeps what it names (a stale one is judged on start, replaced later).
            self.begin(client)
            self._commit_positions(client, positions)
        return positions

    def read_offsets(self, group: str | None = None) -> tuple[StoredPositions, int]:
        """The group's committed positions and the greatest generation recorded with them."""
        from confluent_kafka import ConsumerGroupTopicPartitions
        from confluent_kafka.admin import AdminClient

        group = group or self.group
        admin = AdminClient({k: v for k, v in self.conf.items() if k in _ADMIN_KEYS})
        try:
            futures = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])
            found = futures[group].result(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - mapped
            raise self.error(e, f"reading the offsets of group {group!r}") from None
        held: StoredPositions = {}
        newest = -1
        for tp in found.topic_partitions or []:
            if tp.offset is not None and tp.offset >= 0:
                generation, log_id, destination = parse_metadata(tp.metadata)
                held[TopicPartition(tp.topic, tp.partition)] = StoredPosition(
                    tp.offset, log_id, destination
                )
                newest = max(newest, generation)
        return held, newest

    def fence(self) -> Any:
        """A producer of this writer's transactional id, initialised: every older producer of
        the id is fenced (its open transaction aborted, its next commit refused)."""
        from confluent_kafka import Producer

        producer = Producer({**self.conf, **self.producer_conf()})
        try:
            producer.init_transactions(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - mapped
            producer.flush(0)
            raise self.error(e, "initialising the transactional producer") from None
        return producer

    def delete_group(self) -> None:
        """Delete the writer's group, its offsets with it (an operator's forget)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({k: v for k, v in self.conf.items() if k in _ADMIN_KEYS})
        try:
            admin.delete_consumer_groups([self.group])[self.group].result(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - mapped
            raise self.error(e, f"deleting group {self.group!r}") from None

    def begin(self, client: Any) -> None:
        try:
            client.begin_transaction()
        except Exception as e:  # noqa: BLE001 - mapped
            raise self.error(e, "beginning a transaction") from None

    def commit(self, client: Any, offsets: Offsets) -> None:
        """Send the offsets to the transaction and commit it (records and offsets, or neither),
        each naming the binding's log and destination."""
        scope = self.binding.scope
        self._commit_positions(client, {tp: scope.position(tp, o) for tp, o in offsets.items()})

    def _commit_positions(self, client: Any, positions: StoredPositions) -> None:
        from confluent_kafka import TopicPartition as RdTopicPartition

        try:
            if positions:
                tps = [
                    RdTopicPartition(
                        tp.topic,
                        tp.partition,
                        p.offset,
                        metadata=f"{self.generation}|{p.log_id or ''}|{p.destination or ''}",
                    )
                    for tp, p in sorted(positions.items())
                ]
                client.send_offsets_to_transaction(tps, self._group_metadata(), self.timeout_s)
            client.commit_transaction(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - mapped
            self.abort(client)
            raise self.error(e, "committing the transaction") from None

    def abort(self, client: Any) -> Exception | None:
        """Abort the open transaction (a fenced or fatal producer cannot): what the abort
        revealed when the producer was fenced (the error to raise instead), else None."""
        try:
            client.abort_transaction(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the producer is dropped by the caller
            log.debug("%s: abort_transaction: %s", self.writer, e)
            mapped = self.error(e, "the transaction")
            return mapped if "fenced" in str(mapped) else None
        return None

    def _group_metadata(self) -> Any:
        if self._consumer is None:
            from confluent_kafka import Consumer

            conf = {k: v for k, v in self.conf.items() if k in _ADMIN_KEYS}
            self._consumer = Consumer({**conf, "group.id": self.group, "enable.auto.commit": False})
        return self._consumer.consumer_group_metadata()

    def close(self) -> None:
        c, self._consumer = self._consumer, None
        if c is not None:
            c.close()

    def error(self, e: BaseException, what: str) -> Exception:
        """A transaction failure as the loop takes it: fenced (another producer of the id
        started: a newer run), an aborted batch (a record refused: bisected), or an outage."""
        err = e.args[0] if e.args else None
        code = getattr(err, "code", lambda: None)()
        name = getattr(err, "name", lambda: "")() or ""
        if "FENCED" in name or "INVALID_PRODUCER_EPOCH" in name:
            return TransientSinkError(
                f"{self.writer}: {what}: fenced by another producer of the same transactional "
                f"id ({name}); reconnecting checks which generation runs"
            )
        if getattr(err, "txn_requires_abort", lambda: False)() and code is not None:
            return BatchRejected(f"{self.writer}: {what}: the transaction was aborted: {err}")
        return TransientSinkError(f"{self.writer}: {what}: {e}")


# The connection settings an admin client and the group's consumer take from the producer's.
_ADMIN_KEYS = frozenset(
    [
        "bootstrap.servers",
        "client.id",
        "security.protocol",
        "sasl.mechanism",
        "sasl.username",
        "sasl.password",
        "oauth_cb",
        "sasl.kerberos.service.name",
        "ssl.ca.location",
        "ssl.certificate.location",
        "ssl.key.location",
        "ssl.key.password",
        "ssl.endpoint.identification.algorithm",
        "socket.connection.setup.timeout.ms",
        "logger",
    ]
)
