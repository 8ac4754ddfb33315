"""Redis sink (redis-py): command templates filled per row, pipelined per chunk of rows.

Each row of a batch runs every command template, e.g. ``HSET orders:${payload.id}
status ${payload.status}``; the templates are parsed and filled by
``conveyor.sinks.redis_templates``. Values are sent as bytes.

A chunk of ``pipeline_size`` rows is one round trip (per node in cluster mode), in
a MULTI/EXEC transaction with ``transaction: true``. ``send_batch`` returns after
Redis answered every command of the batch. A command Redis rejects (WRONGTYPE, not
a number...) or a row that cannot fill a template is a data error for that row;
the other rows are written. Under ``fail_fast`` a standalone server runs each chunk
in one Lua script that stops at the first refused command. The client never
retries by itself: an outage raises
``TransientSinkError`` and the runtime retries the batch, so non-idempotent
commands (XADD with ``*``, LPUSH, INCR...) may run twice for rows of a replayed
batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, SecretStr, model_validator

from conveyor.core.asset_keys import key_part
from conveyor.core.errors import FieldRuleError, TransientSinkError, rule
from conveyor.core.model import Offsets, TopicPartition
from conveyor.core.positions import StoredPositions, TargetBinding
from conveyor.core.sink import ErrorKind, isolate_rows, sink_error
from conveyor.core.trust import paths
from conveyor.core.trust.references import known_now
from conveyor.sinks.base import (
    RowFailure,
    SendResult,
    Sink,
    SinkConfig,
    batch_offsets,
    secret,
    unseen_mask,
)

# The template engine; its public names stay importable from here.
from conveyor.sinks.redis_templates import (  # noqa: F401 - re-exported
    FORBIDDEN_COMMANDS,
    NOT_IDEMPOTENT,
    RESERVED,
    BatchValues,
    CommandTemplate,
    EncodedBatch,
    Placeholder,
    TemplateError,
    TemplateSyntaxError,
    arrow_value_array,
    check_arity,
    checked_commands,
    command_flags,
    default_delete_commands,
    encode_commands,
    parse_argument,
    parse_command,
    render_batch,
    tombstone_rows,
    value_bytes,
    with_keys,
)
from conveyor.sinks.tombstones import has_tombstones

log = logging.getLogger("conveyor.sinks.redis")


class RedisSinkConfig(SinkConfig):
    """Rows as Redis commands from templates."""

    type: Literal["redis"] = "redis"
    commands: list[str | list[str]] = Field(
        min_length=1,
        description="Command templates run for every row, in order: a list of arguments, or a string split like a shell "
        "command (once, before substitution). Placeholders inside arguments: ${key}, ${topic}, ${partition}, ${offset}, "
        "${timestamp} (epoch ms), ${destination}, ${headers} (JSON), ${headers.<name>}, ${payload} (bytes as is, columns "
        "as JSON), ${payload.<field>[.<field>...]}.",
    )
    delete_enabled: bool = Field(
        default=False,
        description="A tombstone (transform.null_values: pass) runs delete_commands instead of commands "
        "(Kafka Connect's delete.enabled).",
    )
    delete_commands: list[str | list[str]] | None = Field(
        default=None,
        description="Command templates run for a tombstone with delete_enabled (same placeholders; a tombstone's "
        "payload is null, so keys come from ${key}, ${headers.<name>}...). Default: DEL of the first argument "
        "(the key) of each command template.",
    )
    mode: Literal["standalone", "cluster"] = Field(
        default="standalone", description="A single Redis server or a Redis Cluster."
    )
    host: str = Field(
        default="127.0.0.1", description="Server host (in cluster mode: a startup node)."
    )
    port: int = Field(
        default=6379,
        ge=1,
        le=65535,
        description="Server port (in cluster mode: of the startup node).",
    )
    startup_nodes: list[str] = Field(
        default_factory=list, description="Cluster mode: more startup nodes as host:port."
    )
    db: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Database number (standalone only; a cluster has only db 0).",
    )
    username: str | None = Field(
        default=None, description="ACL user name (Redis 6+); default: the default user."
    )
    password: SecretStr | None = Field(default=None, description="Password (secret).")
    tls: bool = Field(default=False, description="Connect with TLS.")
    tls_ca_file: str | None = Field(
        default=None,
        description="CA bundle (PEM) to verify the server (with tls); default: the system CAs.",
    )
    tls_cert_file: str | None = Field(
        default=None, description="Client certificate (PEM) for mutual TLS (with tls_key_file)."
    )
    tls_key_file: str | None = Field(
        default=None, description="Private key (PEM) of the client certificate."
    )
    tls_check_hostname: bool = Field(
        default=True, description="Check that the server certificate names the host."
    )
    socket_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Socket read/write timeout: how long a round trip may take.",
    )
    socket_connect_timeout_s: float = Field(
        default=5.0, gt=0, le=300, description="Socket connect timeout."
    )
    pipeline_size: int = Field(
        default=1000, ge=1, le=1_000_000, description="Rows per pipeline (one round trip)."
    )
    transaction: bool = Field(
        default=False, description="Wrap each pipeline in MULTI/EXEC (standalone only)."
    )
    delivery: Literal["at_least_once", "exactly_once"] = Field(
        default="at_least_once",
        description="exactly_once (standalone): each batch's commands and the source offsets they "
        "end at in one MULTI/EXEC fenced by WATCH (the hash conveyor:offsets:<connector>, which wins "
        "over the meta store's offsets on start), so XADD, LPUSH and INCR templates apply once per "
        "message (docs/sinks/redis.md).",
    )
    client_name: str = Field(
        default="conveyor", description="CLIENT SETNAME of the sink's connections."
    )

    def asset_key_path(self) -> list[str]:
        prefix = ""
        with contextlib.suppress(TemplateSyntaxError):
            t = parse_command(self.commands[0])
            if len(t.args) > 1:
                first = t.args[1]
                lead = first[0] if first and isinstance(first[0], bytes) else b""
                prefix = lead.decode(errors="replace").strip(":._- ")
        return ["redis", key_part(prefix) or f"db{self.db}"]

    def kind(self) -> str:
        return "redis"

    @model_validator(mode="after")
    def _rules(self) -> RedisSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        commands = checked_commands(self.commands, "commands")
        if self.delete_commands is not None:
            rule(self.delete_enabled, "only with delete_enabled: true", field="delete_commands")
            rule(bool(self.delete_commands), "must not be empty", field="delete_commands")
            checked_commands(self.delete_commands, "delete_commands")
        elif self.delete_enabled and commands is not None:
            rule(
                bool(default_delete_commands(commands)),
                "no command template has a key argument to DEL; give delete_commands",
                field="delete_enabled",
            )
        rule(bool(self.host.strip()), "must not be empty", field="host")
        if self.mode == "cluster":
            rule(self.db == 0, "a Redis Cluster has only database 0", field="db")
            rule(
                not self.transaction,
                "MULTI/EXEC across a chunk of rows would span hash slots; not supported in cluster mode",
                field="transaction",
            )
            for node in filter(known_now, self.startup_nodes):
                try:
                    _node(node)
                except ValueError as e:
                    raise FieldRuleError(str(e), field="startup_nodes") from None
            rule(
                self.delivery == "at_least_once",
                "exactly_once runs each batch in one MULTI/EXEC: standalone only",
                field="delivery",
            )
        else:
            rule(not self.startup_nodes, "only in cluster mode", field="startup_nodes")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            rule(getattr(self, name) is None or self.tls, "needs tls: true", field=name)
        rule(
            (self.tls_cert_file is None) == (self.tls_key_file is None),
            "give tls_cert_file and tls_key_file together",
            field="tls_cert_file",
        )
        rule(
            self.password is None or bool(secret(self.password)),
            "must not be empty (leave it out for no password)",
            field="password",
        )
        return self


# -- errors -------------------------------------------------------------------------------------

#: Error codes (the reply's first word) of outages: loading, busy script, failover, OOM, cluster moves.
TRANSIENT_CODES = frozenset(
    {"LOADING", "BUSY", "MISCONF", "OOM", "READONLY", "MASTERDOWN", "NOREPLICAS", "TRYAGAIN", "CLUSTERDOWN", "MOVED", "ASK", "UNBLOCKED", "EXECABORT"}
)  # fmt: skip
#: Error codes no retry fixes: permissions, authentication, a missing script.
PERMANENT_CODES = frozenset({"NOPERM", "NOAUTH", "WRONGPASS", "NOSCRIPT"})
#: ``ERR`` replies that mean the template itself is wrong (the same for every row).
PERMANENT_ERR = ("unknown command", "wrong number of arguments", "unknown subcommand")
_CERT_ERRORS = (
    "CERTIFICATE_VERIFY_FAILED",
    "certificate verify failed",
    "hostname mismatch",
    "doesn't match",
)


_ANNOTATION = re.compile(r"^Command # \d+ \(.*\) of pipeline caused error: ", re.DOTALL)


def redis_error_code(exc: BaseException) -> str | None:
    """The reply's error code (ERR, WRONGTYPE, NOPERM...): redis-py strips it into status_code."""
    code = getattr(exc, "status_code", None)
    if code:
        return str(code)
    text = str(exc)
    first = text.split(" ", 1)[0]
    return first if first.isupper() and first.isalpha() and len(first) > 1 else None


def redis_error_text(exc: BaseException) -> str:
    """One line: the error code and message as Redis sent them, or the exception's class and text."""
    # redis-py prefixes errors of a MULTI/EXEC with the whole command, row values included.
    text = _ANNOTATION.sub("", str(exc).strip()) or type(exc).__name__
    text = text.splitlines()[0]
    code = getattr(exc, "status_code", None)
    if code and not text.startswith(str(code)):
        return f"{code} {text}"
    from redis import exceptions as rx

    if not isinstance(exc, rx.ResponseError) and type(exc).__name__ not in text:
        return f"{type(exc).__name__}: {text}"
    return text


def classify_redis_error(exc: BaseException) -> ErrorKind:
    """What an exception from redis-py (raised, or a pipeline's per-command ResponseError) means."""
    from redis import exceptions as rx

    if isinstance(
        exc,
        (
            rx.AuthenticationError,
            rx.AuthorizationError,
            rx.AuthenticationWrongNumberOfArgsError,
            rx.NoPermissionError,
        ),
    ):
        return ErrorKind.PERMANENT
    if isinstance(exc, rx.CrossSlotTransactionError):
        return ErrorKind.PERMANENT
    if isinstance(
        exc,
        (
            rx.BusyLoadingError,
            rx.OutOfMemoryError,
            rx.ReadOnlyError,
            rx.ClusterDownError,
            rx.TryAgainError,
            rx.AskError,
        ),
    ):
        return ErrorKind.TRANSIENT
    if isinstance(exc, rx.ConnectionError):
        if any(m in str(exc) for m in _CERT_ERRORS):
            return ErrorKind.PERMANENT  # a wrong CA or host name does not fix itself
        return ErrorKind.TRANSIENT
    if isinstance(exc, (rx.TimeoutError, rx.ClusterError, rx.RedisClusterException, OSError)):
        return ErrorKind.TRANSIENT
    if isinstance(exc, rx.ResponseError):
        code = redis_error_code(exc)
        if code in TRANSIENT_CODES or isinstance(exc, rx.ExecAbortError):
            return ErrorKind.TRANSIENT
        if code in PERMANENT_CODES or isinstance(exc, rx.NoScriptError):
            return ErrorKind.PERMANENT
        text = str(exc).removeprefix("ERR ")
        if text.startswith(PERMANENT_ERR):
            return ErrorKind.PERMANENT
        return (
            ErrorKind.DATA
        )  # WRONGTYPE, not an integer / float, XADD id too small, a syntax error in an argument...
    if isinstance(exc, rx.DataError):
        return ErrorKind.DATA  # redis-py refused an argument client-side
    return ErrorKind.TRANSIENT


# -- client -------------------------------------------------------------------------------------


def _node(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{spec!r} is not host:port")
    return host.strip("[]"), int(port)


def client_kwargs(c: RedisSinkConfig) -> dict[str, Any]:
    """Keyword arguments of redis.Redis / redis.cluster.RedisCluster (includes the password: never log it).
    TLS files are the real paths under a root (``core.trust.paths.resolve``; ConfigError naming the field).

    ``retry`` is left out here; the client is built with zero retries (the runtime retries batches).
    """
    kw: dict[str, Any] = {
        "host": c.host,
        "port": c.port,
        "username": c.username,
        "password": secret(c.password),
        "socket_timeout": c.socket_timeout_s,
        "socket_connect_timeout": c.socket_connect_timeout_s,
        "socket_keepalive": True,
        "client_name": c.client_name,
    }
    if c.mode == "standalone":
        kw["db"] = c.db
        kw["health_check_interval"] = 30  # PING a connection idle for 30 s before using it
    else:
        kw["startup_nodes_spec"] = [(c.host, c.port), *(_node(s) for s in c.startup_nodes)]
        kw["require_full_coverage"] = True
    if c.tls:
        kw.update(ssl=True, ssl_cert_reqs="required", ssl_check_hostname=c.tls_check_hostname)
        # The files the client opens, resolved again now (``core.trust.paths``: the check at the
        # time of use); a refused one is a ConfigError naming its field.
        if c.tls_ca_file:
            kw["ssl_ca_certs"] = paths.resolve(c.tls_ca_file, field="sink.tls_ca_file")
        if c.tls_cert_file:
            kw["ssl_certfile"] = paths.resolve(c.tls_cert_file, field="sink.tls_cert_file")
            kw["ssl_keyfile"] = paths.resolve_file(c.tls_key_file, field="sink.tls_key_file")
    return kw


def make_client(c: RedisSinkConfig) -> Any:
    """A redis.Redis or RedisCluster for the config, without retries. Cluster mode connects at once."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = client_kwargs(c)
    no_retry = Retry(NoBackoff(), 0)
    if c.mode == "standalone":
        return redis.Redis(retry=no_retry, **kw)
    from redis.cluster import ClusterNode, RedisCluster

    nodes = [ClusterNode(h, p) for h, p in kw.pop("startup_nodes_spec")]
    kw.pop("host")
    kw.pop("port")
    return RedisCluster(startup_nodes=nodes, retry=no_retry, **kw)


# -- the sink -----------------------------------------------------------------------------------


class RedisSink(Sink):
    """Pipelines every row's commands; per-command errors are mapped back to their rows."""

    config_class = RedisSinkConfig
    config: RedisSinkConfig

    def __init__(self, config: RedisSinkConfig):
        super().__init__(config)
        self._client: Any = None
        self._templates: list[CommandTemplate] | None = None
        self._delete_templates: list[CommandTemplate] | None = None
        self._noscript = False  # a template command Redis does not allow in scripts
        self._binding: TargetBinding | None = None  # delivery exactly_once, bound to a run

    def validate(self) -> None:
        """Parse the command templates once (the config model checked them)."""
        c = self.config
        self._templates = [parse_command(spec) for spec in c.commands]
        self._delete_templates = None
        if c.delete_commands is not None:
            self._delete_templates = [parse_command(spec) for spec in c.delete_commands]
        elif c.delete_enabled:
            self._delete_templates = default_delete_commands(self._templates)

    def templates(self) -> list[CommandTemplate]:
        if self._templates is None:
            self.validate()
        assert self._templates is not None
        return self._templates

    def delete_templates(self) -> list[CommandTemplate] | None:
        """The templates a tombstone runs (None without delete_enabled)."""
        self.templates()
        return self._delete_templates

    def describe(self) -> str:
        return f"redis {self.config.mode} {self.config.host}:{self.config.port}/{self.config.db}: {'; '.join(t.name for t in self.templates())}"

    def _error(self, exc: BaseException, context: str) -> Exception:
        # A data error outside a row's reply (a protocol-level refusal) is retried like an outage.
        where = f"{self.config.host}:{self.config.port}"
        return sink_error(
            classify_redis_error(exc),
            f"Redis {where} {context}: {redis_error_text(exc)}",
            data=ErrorKind.TRANSIENT,
        )

    def _connect(self) -> Any:
        from redis import exceptions as rx

        try:
            client = make_client(self.config)
            client.ping()
            return client
        except (rx.RedisError, rx.RedisClusterException, OSError) as e:
            raise self._error(e, "connect failed") from None

    def init_sink(self) -> None:
        self.templates()
        self._client = self._connect()
        try:
            self._check_commands()
        except Exception:
            self.cleanup_sink()
            raise
        risky = sorted({t.name for t in self.templates() if t.name in NOT_IDEMPOTENT})
        if risky:
            log.info(
                "Redis templates use %s: a replayed batch runs them again (not idempotent)",
                ", ".join(risky),
            )

    def _check_commands(self) -> None:
        """Every template's command exists and takes its number of arguments (COMMAND INFO);
        the templates learn which of their arguments are keys (``redis_keys.key_positions``)."""
        from redis import exceptions as rx

        # One node answers for the cluster; a bytes command name skips redis-py's reply
        # parser, which fails on the nil entry of an unknown command.
        node = (
            self._client.get_default_node().redis_connection
            if self.config.mode == "cluster"
            else self._client
        )
        checked = [(f"commands[{i}]", t) for i, t in enumerate(self.templates())]
        checked += [
            (f"delete_commands[{i}]", t) for i, t in enumerate(self.delete_templates() or [])
        ]
        infos: dict[str, Any] = {}
        for where, t in checked:
            try:
                infos[t.name] = node.execute_command(b"COMMAND", b"INFO", t.name)
            except rx.ResponseError as e:
                if _cannot_check(e):
                    log.info(
                        "cannot check the templates' commands (COMMAND INFO: %s)",
                        redis_error_text(e),
                    )
                    return
                raise self._error(e, f"checking command {t.name}") from None
            except (rx.RedisError, rx.RedisClusterException, OSError) as e:
                raise self._error(e, f"checking command {t.name}") from None
            if command_flags(infos[t.name]) & {"noscript", "no_script"}:
                self._noscript = True  # fail_fast then pipelines (not exact; DESIGN says so)
            check_arity(t, infos[t.name], f"sink.{where}")
        self._templates = [with_keys(t, infos) for t in self.templates()]
        if self._delete_templates is not None:
            self._delete_templates = [with_keys(t, infos) for t in self._delete_templates]

    def cleanup_sink(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                self._client.close()
            self._client = None

    # -- writing ----------------------------------------------------------------------------

    # -- exactly once (``conveyor.sinks.redis_transactions``) -------------------------------

    def bind(self, binding: TargetBinding) -> None:
        if self.config.delivery == "exactly_once":
            self._binding = binding

    @property
    def _writer(self) -> str | None:
        return self._binding.writer if self._binding is not None else None

    @property
    def _generation(self) -> int:
        return self._binding.generation if self._binding is not None else 0

    def target_offsets(self) -> StoredPositions | None:
        """The positions the hash holds (a greater generation recorded: FencedError); a
        migrated connector's under its bare name taken over first."""
        from redis import exceptions as rx

        from conveyor.sinks import redis_transactions as rt

        if self._binding is None:
            return None
        if self._client is None:
            self._client = self._connect()
        writer = self._binding.writer
        try:
            if self._binding.legacy_writer:
                rt.adopt_legacy(self._client, self._binding.legacy_writer, writer, self._generation)
            held, recorded = rt.parse_positions(self._client.hgetall(rt.offsets_key(writer)))
        except (rx.RedisError, OSError) as e:
            raise self._error(e, "reading the offsets failed") from None
        rt.check_generation(writer, recorded, self._generation)
        return held

    def retire_target_offsets(self, connector: str) -> str | None:
        """Delete the hashes of a deleted connector's writers; what failed, or None."""
        from conveyor.sinks import redis_transactions as rt

        if self.config.delivery != "exactly_once":
            return None
        try:
            client = self._connect()
        except Exception as e:  # noqa: BLE001 - reported to the operator
            return str(e)
        try:
            rt.retire(client, connector)
            return None
        except Exception as e:  # noqa: BLE001 - reported to the operator
            return str(self._error(e, "deleting the offsets failed"))
        finally:
            client.close()

    def move_target_offsets(
        self,
        connector: str,
        generations: Mapping[str, int],
        offsets: Offsets,
        *,
        forget: Collection[TopicPartition] = (),
        replace: bool = False,
    ) -> None:
        """An operator's offsets change in the writers' hashes (``redis_transactions.move_offsets``)."""
        from redis import exceptions as rx

        from conveyor.sinks import redis_transactions as rt

        client = self._connect()
        try:
            rt.move_offsets(client, connector, generations, offsets, forget=forget, replace=replace)
        except (rx.RedisError, OSError) as e:
            raise self._error(e, "moving the offsets failed") from None
        finally:
            client.close()

    def _send_exactly_once(self, batch: pa.Table) -> dict[int, RowFailure]:
        """The rows the hash's offsets do not cover, their commands and the offsets they end
        at in one MULTI/EXEC, watching the hash."""
        from conveyor.sinks import redis_transactions as rt

        assert self._binding is not None
        key = rt.offsets_key(self._binding.writer)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(key)
            held, recorded = rt.parse_positions(pipe.hgetall(key))
            rt.check_generation(self._binding.writer, recorded, self._generation)
            mask = unseen_mask(batch, self._binding.usable(held))
            todo = range(batch.num_rows) if mask is None else pc.indices_nonzero(mask).to_pylist()
            rows, bad = self._render(batch)
            failures = {i: RowFailure(i, msg) for i, msg in bad.items() if i in set(todo)}
            good = [i for i in todo if i not in bad]
            if self.fail_fast and failures:
                first = min(failures)
                failures = {first: failures[first]}
                good = [i for i in good if i < first]
            if not good:
                return failures
            queued = [cmd for i in good for cmd in rows[i] or []]
            offsets = batch_offsets(batch.take(pa.array(good, pa.int64())))
            replies = rt.run_transaction(
                pipe, queued, key, rt.offsets_fields(offsets, self._generation, self._binding.scope)
            )
        pos = 0
        for i in good:
            row = rows[i] or []
            for k, cmd in enumerate(row):
                r = replies[pos + k]
                if isinstance(r, Exception) and i not in failures:
                    failures[i] = RowFailure(i, f"{str(cmd[0]).upper()}: {redis_error_text(r)}")
            pos += len(row)
        return failures

    def send_batch(self, batch: pa.Table) -> SendResult:
        from redis import exceptions as rx

        if batch.num_rows == 0:
            return SendResult(rows=0)
        if self._client is None:
            self._client = self._connect()
        try:
            if self._writer is not None:
                failures = self._send_exactly_once(batch)
            elif self._use_script():
                failures = self._send_scripted(batch)
            else:
                failures = self._send_pipelined(batch)
        except (rx.RedisError, rx.RedisClusterException, OSError) as e:
            err = self._error(e, "write failed")
            self.cleanup_sink()  # a fresh connection for the retry
            raise err from None
        except TransientSinkError:
            self.cleanup_sink()
            raise
        return SendResult(rows=batch.num_rows, failed=tuple(failures[i] for i in sorted(failures)))

    def _render(
        self, batch: pa.Table
    ) -> tuple[list[list[list[bytes | str]] | None], dict[int, str]]:
        """Every row's commands, and the rows that cannot fill them (a tombstone runs the
        delete templates; each row keeps its own errors only)."""
        rows, bad = render_batch(self.templates(), batch)
        deletes = self.delete_templates()
        if deletes is not None and has_tombstones(batch):
            drows, dbad = render_batch(deletes, batch)
            for i in tombstone_rows(batch, bad, dbad):
                rows[i] = drows[i]
        return rows, bad

    def _send_pipelined(self, batch: pa.Table) -> dict[int, RowFailure]:
        """The batch in pipelines of ``pipeline_size`` rows (or ``MULTI``/``EXEC``, or a
        cluster's pipelines). Under fail_fast nothing after a row whose command cannot be
        built is sent, and no pipeline after one with a refused command (in cluster mode a
        refusal is known only once its pipeline ran: the rows after it in that pipeline are
        written). A standalone pipeline's commands are encoded by Arrow (``EncodedBatch``)."""
        if self.config.mode == "standalone" and not self.config.transaction:
            enc = EncodedBatch(batch, self.templates(), self.delete_templates(), argv=False)
            bad = enc.bad
            names = enc.names

            def execute(sub: Sequence[int]) -> list[Any]:
                return pipeline_packed(
                    self._client, lambda _conn: [enc.body(sub)], sum(len(names[i]) for i in sub)
                )

        else:
            rows, bad = self._render(batch)
            names = [[] if r is None else [str(c[0]) for c in r] for r in rows]

            def execute(sub: Sequence[int]) -> list[Any]:
                pipe = self._client.pipeline(transaction=self.config.transaction)
                for i in sub:
                    for cmd in rows[i]:  # type: ignore[union-attr]
                        pipe.execute_command(*cmd)
                return list(pipe.execute(raise_on_error=False))

        failures = {i: RowFailure(i, msg) for i, msg in bad.items()}
        good = [i for i in range(batch.num_rows) if i not in bad]
        if self.fail_fast and failures:
            first = min(failures)
            failures = {first: failures[first]}
            good = [i for i in good if i < first]
        size = self.config.pipeline_size
        for start in range(0, len(good), size):
            refused = self._run_chunk(good[start : start + size], names, execute)
            failures.update((f.index, f) for f in refused)
            if refused and self.fail_fast:
                break
        return failures

    def _use_script(self) -> bool:
        """fail_fast on a standalone server whose template commands may run in a script."""
        return self.fail_fast and self.config.mode == "standalone" and not self._noscript

    def _send_scripted(self, batch: pa.Table) -> dict[int, RowFailure]:
        """Under fail_fast on a standalone server: each chunk of ``pipeline_size`` rows in
        one EVALSHA of STOP_AT_FIRST_ERROR (``run_script``). Nothing after a refused command
        runs and nothing after a row whose command cannot be built is sent. A data error
        becomes that row's RowFailure (the rows before it are written); any other error
        raises. A user the ACL denies scripts pipelines from the denied chunk on."""
        n = batch.num_rows
        enc = EncodedBatch(batch, self.templates(), self.delete_templates(), argv=True)
        end = min(enc.bad) if enc.bad else n  # every row before the first failure is sent
        try:
            refused = run_script(self._client, enc, end, self.config.pipeline_size)
        except ScriptsDenied as e:
            # Pipelines from this chunk on (not exact: the rows after a refused command in
            # its pipeline are written).
            log.warning(
                "Redis user may not run scripts (%s): fail_fast pipelines instead, "
                "so the rows after a refused command in its pipeline are written",
                e.reason,
            )
            self._noscript = True
            return {
                i + e.start: dataclasses.replace(f, index=f.index + e.start)
                for i, f in self._send_pipelined(batch.slice(e.start)).items()
            }
        if refused is not None:
            return {refused.index: refused}
        if end < n:
            return {end: RowFailure(end, enc.bad[end])}
        return {}

    def _run_chunk(
        self,
        idx: list[int],
        names: list[list[str]],
        execute: Callable[[Sequence[int]], list[Any]],
    ) -> list[RowFailure]:
        """One round trip for the rows ``idx`` (``execute`` sends their commands and returns
        a reply per command; ``names`` are each row's command names); data errors become
        RowFailures, others raise."""
        from redis import exceptions as rx

        def attempt(sub: Sequence[int]) -> list[RowFailure]:
            results = execute(sub)
            counts = [len(names[i]) for i in sub]
            if len(results) != sum(counts):
                raise TransientSinkError(
                    f"Redis answered {len(results)} replies for {sum(counts)} commands"
                )
            out = []
            pos = 0
            for i, count in zip(sub, counts, strict=True):
                for k in range(count):
                    r = results[pos + k]
                    if isinstance(r, Exception):
                        if classify_redis_error(r) is not ErrorKind.DATA:
                            raise r
                        out.append(RowFailure(i, f"{names[i][k].upper()}: {redis_error_text(r)}"))
                        break
                pos += count
            return out

        def rejection(e: Exception) -> str | None:
            # A command refused while queueing aborts the whole MULTI/EXEC: nothing ran.
            if (
                self.config.transaction
                and isinstance(e, rx.ResponseError)
                and classify_redis_error(e) is ErrorKind.DATA
            ):
                return redis_error_text(e)
            return None

        return isolate_rows(idx, attempt, rejection)


#: Runs the commands packed in ARGV (each: its word count, then its words) in order with
#: redis.pcall and stops at the first error reply: returns the number of commands run, or
#: {the 1-based position of the refused command, its error}. Used under fail_fast.
STOP_AT_FIRST_ERROR = """
local i, n, c = 1, #ARGV, 0
while i <= n do
  local argc = tonumber(ARGV[i])
  local r = redis.pcall(unpack(ARGV, i + 1, i + argc))
  c = c + 1
  if type(r) == 'table' and r.err then
    return {c, r.err}
  end
  i = i + argc + 1
end
return c
"""
STOP_AT_FIRST_ERROR_SHA = hashlib.sha1(STOP_AT_FIRST_ERROR.encode()).hexdigest()


def pipeline_packed(client: Any, pack: Callable[[Any], list[bytes]], count: int) -> list[Any]:
    """``count`` commands on ``client``'s pool (``pack(connection)`` gives their bytes) in one write on one
    standalone connection, then every reply: an error reply in its command's place, as
    ``pipeline(transaction=False).execute(raise_on_error=False)`` returns them, without
    the pipeline's per-command bookkeeping. A connection that fails is closed."""
    from redis import exceptions as rx

    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(pack(conn))
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(conn.read_response(disable_decoding=True))
            except rx.ResponseError as e:  # this command's error reply; the rest follow
                replies.append(e)
        return replies
    except BaseException:
        conn.disconnect()  # replies may be left unread: the connection is not reused
        raise
    finally:
        pool.release(conn)


class ScriptsDenied(Exception):
    """The ACL user may not run scripts: refused before the chunk at row ``start`` ran."""

    def __init__(self, start: int, reason: str):
        super().__init__(reason)
        self.start = start
        self.reason = reason


def run_script(client: Any, enc: EncodedBatch, end: int, size: int) -> RowFailure | None:
    """Rows ``0..end`` of ``enc`` in chunks of ``size`` rows, each one EVALSHA of
    STOP_AT_FIRST_ERROR on one connection of ``client``'s pool: the refused row (no chunk
    after it is sent), or None when every command ran. A data error becomes the RowFailure;
    any other error raises (ScriptsDenied: the user may not run scripts).

    The commands are encoded by Arrow, column by column (``encode_commands``): no Python
    work per row. While the server runs one chunk's script the next chunk's call is cut
    (a script costs the server about three times a pipeline's commands); it is sent
    only once the reply said the chunk ran whole."""
    from redis import exceptions as rx

    def call(start: int) -> tuple[list[bytes], int]:
        stop = min(start + size, end)
        words = sum(enc.words[start:stop])
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n0\r\n" % (
            3 + words,
            STOP_AT_FIRST_ERROR_SHA.encode(),
        )
        return [head, enc.body(range(start, stop))], stop

    starts = range(0, end, size)
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        nxt = call(0) if end else None
        for k, start in enumerate(starts):
            assert nxt is not None
            packed, stop = nxt
            conn.send_packed_command(packed)
            if k + 1 < len(starts):
                nxt = call(starts[k + 1])
            try:
                try:
                    reply = conn.read_response(disable_decoding=True)
                except rx.NoScriptError:  # a new server, or SCRIPT FLUSH: load it
                    conn.send_command("SCRIPT", "LOAD", STOP_AT_FIRST_ERROR)
                    conn.read_response()
                    conn.send_packed_command(packed)
                    reply = conn.read_response(disable_decoding=True)
            except rx.NoPermissionError as e:
                if not any(w in str(e).lower() for w in ("evalsha", "'eval'", "script")):
                    raise
                raise ScriptsDenied(start, redis_error_text(e)) from None
            refused = _script_refusal(reply, enc.names, start, stop)
            if refused is not None:
                return refused
        return None
    except ScriptsDenied:
        raise  # its refusal was read: the connection is reused
    except BaseException:
        conn.disconnect()  # a reply may be left unread: the connection is not reused
        raise
    finally:
        pool.release(conn)


def _script_refusal(reply: Any, names: list[list[str]], start: int, stop: int) -> RowFailure | None:
    """The refused row from STOP_AT_FIRST_ERROR's reply over the commands of rows
    ``start``..``stop`` (``names``: each row's command names); None if every command ran."""
    from redis import exceptions as rx

    if isinstance(reply, int):
        count = sum(map(len, names[start:stop]))
        if reply != count:
            raise TransientSinkError(f"Redis ran {reply} commands of {count}")
        return None
    pos, text = int(reply[0]), reply[1]
    text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    err = rx.ResponseError(text)
    if classify_redis_error(err) is not ErrorKind.DATA:
        raise err
    i, name = [(i, name) for i in range(start, stop) for name in names[i]][pos - 1]
    return RowFailure(i, f"{name.upper()}: {redis_error_text(err)}")


def _cannot_check(e: Exception) -> bool:
    """Whether COMMAND INFO's refusal means it cannot be asked (a proxy or managed service
    without COMMAND, an ACL user without it): the check is skipped (a wrong template then
    fails on the first batch instead)."""
    from redis import exceptions as rx

    return (
        isinstance(e, rx.NoPermissionError)
        or classify_redis_error(e) is ErrorKind.DATA
        or "unknown command" in str(e)
    )
