"""Generates docs/CONFIG.md: every connector spec field, the brokers file, the environment
and every sink's fields, with type, constraints, default and description.

``python -m conveyor.control.configdoc > docs/CONFIG.md``; tests/unit/test_configdoc.py keeps
the file in sync. Sinks are found through the registry (``conveyor.sinks``); one that
cannot be imported gets a note instead of its table, so the reference always renders.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from conveyor.core.engine.routing import DestinationRulesSpec
from conveyor.core.model import (
    BATCH_PRESETS,
    BatchPolicy,
    BrokerSpec,
    ConnectorSpec,
    DeadLetterSpec,
    FailureSpec,
    LivenessSpec,
    RetrySpec,
    SourceSpec,
    TasksSpec,
    TransformSpec,
    WatermarkSpec,
)
from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.sinks.base import SinkConfig

REGENERATE = "python -m conveyor.control.configdoc > docs/CONFIG.md"

SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("connector", ConnectorSpec),
    ("source", SourceSpec),
    ("batch", BatchPolicy),
    ("transform", TransformSpec),
    ("transform.schema_registry", SchemaRegistrySpec),
    ("retry", RetrySpec),
    ("failure", FailureSpec),
    ("failure.dead_letter", DeadLetterSpec),
    ("liveness", LivenessSpec),
    ("tasks", TasksSpec),
    ("watermark", WatermarkSpec),
    ("destinations", DestinationRulesSpec),
]
_SECTION_OF = {model: title for title, model in SECTIONS}


def _section_title(model: type[BaseModel]) -> str | None:
    """The section a model is documented in: the same answer whatever was rendered before."""
    if not _SOURCE_SECTIONS_KNOWN:
        for title, section in _source_sections():
            _SECTION_OF.setdefault(section, title)
        _SOURCE_SECTIONS_KNOWN.append(True)
    return _SECTION_OF.get(model)


_SOURCE_SECTIONS_KNOWN: list[bool] = []


def _run_environment() -> list[tuple[str, str, str]]:
    """A connector run process's allocator (conveyor/dagster/jobs/allocators.py) and the run
    server it is forked from (conveyor/dagster/runserver.py)."""
    from conveyor.dagster.jobs import allocators as a

    return [
        (
            a.ARROW_POOL_ENV,
            "Arrow's memory pool in a connector's run process: `system` (malloc) or `arrow` (Arrow's "
            "own default, mimalloc in the wheels, or `ARROW_DEFAULT_MEMORY_POOL`)",
            f"`{a.DEFAULT_ARROW_POOL}`",
        ),
        (
            a.MMAP_THRESHOLD_ENV,
            "glibc's mmap threshold in a connector's run process, KiB: blocks this large are mapped "
            "on their own and returned to the system when freed; `0` keeps glibc's own rule",
            f"`{a.DEFAULT_MMAP_THRESHOLD_KIB}`",
        ),
        (
            "CONVEYOR_RUN_LAUNCHER",
            "how `conveyor dev` launches runs: `forkserver` (forked from a warm run server, "
            "`conveyor/dagster/runserver.py`: shared imports, a run starts in milliseconds; "
            "BENCHMARKS section 11) or `default` (Dagster's DefaultRunLauncher, an interpreter "
            "spawned per run)",
            "`forkserver`",
        ),
        (
            "CONVEYOR_RUNSERVER_PRELOAD",
            "modules the run server imports before forking runs, comma-separated",
            "Dagster's run worker, Conveyor's jobs, pyspark's Connect client, confluent-kafka, "
            "the PostgreSQL sink",
        ),
        (
            "CONVEYOR_RUNSERVER_CODE_LOCATION",
            "the code location the run server builds for its runs (empty: none)",
            "`conveyor.dagster.definitions`",
        ),
    ]


@functools.cache
def environment_names() -> frozenset[str]:
    """Every environment variable Conveyor reads as a setting (the Environment table): the one
    list a secret reference may never read (``secrets.SecretPolicy``)."""
    return frozenset(var for var, _meaning, _default in _environment())


def _environment() -> list[tuple[str, str, str]]:
    """Every row of the Environment table, in the order CONFIG.md shows them."""
    return [
        *_home_environment(),
        *_scheduler_environment(),
        *_run_environment(),
        *_reload_environment(),
        *_api_environment(),
        *_secret_environment(),
        *_cli_environment(),
    ]


def _home_environment() -> list[tuple[str, str, str]]:
    """Where the state lives and what a connector reaches by default: home, meta store,
    spec directory, brokers, Kafka, Spark, the lag check."""
    from conveyor.brokers.kafka import DEFAULT_BOOTSTRAP
    from conveyor.core.host.home import DEFAULT_HOME
    from conveyor.dagster.assets.checks import DEFAULT_LAG_CHECK_MINUTES
    from conveyor.dagster.resources.conveyor import DEFAULT_SPARK_REMOTE

    return [
        (
            "CONVEYOR_HOME",
            "state directory (meta store, dead letters, connectors)",
            f"`{DEFAULT_HOME}`",
        ),
        (
            "CONVEYOR_META_URL",
            "meta store URL (`postgresql://...` in production)",
            "SQLite `$CONVEYOR_HOME/meta.db`",
        ),
        ("CONVEYOR_CONNECTORS_DIR", "connector spec directory", "`$CONVEYOR_HOME/connectors`"),
        (
            "CONVEYOR_BROKERS_FILE",
            "broker executors YAML (section Brokers file)",
            "`$CONVEYOR_HOME/brokers.yaml` (else one broker `local`)",
        ),
        (
            "CONVEYOR_BROKER_CAPACITY",
            "capacity of the default broker `local` when there is no brokers file",
            "`8`",
        ),
        (
            "CONVEYOR_KAFKA_BOOTSTRAP",
            "bootstrap servers of connectors that set no `source.bootstrap_servers`",
            f"`{DEFAULT_BOOTSTRAP}`",
        ),
        (
            "CONVEYOR_SPARK_REMOTE",
            "Spark Connect endpoint of the default broker",
            f"`{DEFAULT_SPARK_REMOTE}`",
        ),
        (
            "CONVEYOR_LAG_CHECK_MINUTES",
            "window of the sink assets' `lag_not_growing` check: it fails when lag grew over this many minutes",
            f"`{DEFAULT_LAG_CHECK_MINUTES:g}`",
        ),
    ]


def _reload_environment() -> list[tuple[str, str, str]]:
    """How a changed spec file reaches the code location (the Dagster webserver to ask)."""
    return [
        (
            "CONVEYOR_DAGSTER_URL",
            "Dagster webserver (e.g. `http://127.0.0.1:3000`) that the scheduler sensor and the REST API "
            "ask to reload the code location when a spec file is added, changed or removed; unset: "
            "reload by hand (`conveyor dev` sets it)",
            "unset",
        ),
        (
            "CONVEYOR_RELOAD_GRACE_S",
            "seconds a changed spec file waits before the scheduler sensor reloads the code location "
            "(the REST API reloads at once)",
            "`10`",
        ),
    ]


def _api_environment() -> list[tuple[str, str, str]]:
    """The REST API's tokens, allowed hosts and origins, and body limit (`conveyor serve`)."""
    return [
        (
            "CONVEYOR_API_TOKEN",
            "the REST API's bearer token (`conveyor serve`)",
            "unset",
        ),
        (
            "CONVEYOR_API_TOKEN_FILE",
            "a file holding the REST API's bearer token (wins over `CONVEYOR_API_TOKEN`)",
            "unset (`conveyor dev`: `$CONVEYOR_HOME/api-token`)",
        ),
        (
            "CONVEYOR_API_READONLY_TOKEN",
            "the REST API's read-only token: GET only, for monitoring",
            "unset",
        ),
        (
            "CONVEYOR_API_READONLY_TOKEN_FILE",
            "a file holding the read-only token (wins over `CONVEYOR_API_READONLY_TOKEN`)",
            "unset, else `$CONVEYOR_HOME/api-token-readonly` if it exists",
        ),
        (
            "CONVEYOR_API_ALLOWED_HOSTS",
            "comma-separated host names the REST API answers to (the `Host` header; `*` any); "
            "set it to the names clients use when serving on 0.0.0.0",
            "`localhost`, `127.0.0.1`, `::1` and the `--host` address",
        ),
        (
            "CONVEYOR_API_ALLOWED_ORIGINS",
            "comma-separated browser origins (`https://ui.example`) allowed to call the REST API "
            "besides its own",
            "none",
        ),
        (
            "CONVEYOR_API_MAX_BODY_BYTES",
            "largest request body the REST API reads (413 above)",
            "`1048576`",
        ),
    ]


def _secret_environment() -> list[tuple[str, str, str]]:
    """What `${file:...}` and `${env:...}` secret references may read."""
    return [
        (
            "CONVEYOR_SECRET_FILES",
            "comma-separated absolute directories that `${file:...}` references may read "
            "(see 'Secrets by reference')",
            "`$CONVEYOR_HOME/secrets`",
        ),
        (
            "CONVEYOR_FILE_ROOTS",
            "comma-separated absolute directories that the paths a spec names (schema and TLS files, "
            "LocalFile directories, lakehouse warehouses and tables, the Iceberg SQLite catalog, dead "
            "letters) may lie under, besides `$CONVEYOR_HOME` (see 'Files a spec names')",
            "none: `$CONVEYOR_HOME` only",
        ),
        (
            "CONVEYOR_SECRET_ENV",
            "comma-separated name patterns (`*`, `?`) of the variables `${env:...}` references may "
            "read; never `CONVEYOR_META_URL`, `CONVEYOR_API`* or the two secret settings",
            "`CONVEYOR_*`",
        ),
    ]


def _cli_environment() -> list[tuple[str, str, str]]:
    """The CLI's own switches: tracebacks, the `conveyor dev` PostgreSQL demo."""
    return [
        (
            "CONVEYOR_DEBUG",
            "any value: the CLI shows tracebacks instead of one-line errors",
            "unset",
        ),
        (
            "CONVEYOR_DEMO_PG_URL",
            "`conveyor dev` also installs the PostgreSQL demo connector, writing there (the URL "
            "goes to `$CONVEYOR_HOME/secrets/demo-pg-url`, which the demo's spec refers to: no "
            "spec may read this variable)",
            "unset",
        ),
        (
            "CONVEYOR_DEMO_LAKE",
            "`1`: `conveyor dev` also installs the Delta Lake demo connector (`demo_orders_lake`, "
            "the table `$CONVEYOR_HOME/lake/demo_orders`; needs the `lakehouse` extra) and its "
            "downstream asset `orders_per_minute_lake`",
            "unset",
        ),
        (
            "CONVEYOR_DEMO_START",
            "the first minute (Unix seconds) of the demo's downstream asset `orders_per_minute` "
            "(`conveyor/demo/downstream.py`); `conveyor dev` sets it to the minute it started in",
            "the minute the demo's code location was loaded in",
        ),
    ]


# Scheduler settings without an attribute docstring in core.planning.scheduler.SchedulerConfig.
SCHEDULER_FIELDS: dict[str, str] = {
    "restart_backoff_s": "first wait before an Error connector is restarted; doubles with each restart",
    "restart_backoff_max_s": "upper bound of that wait",
    "rebalance_threshold": "load gap (in connector weights) between the most and the least loaded broker above which one connector moves",
    "rebalance_cooldown_s": "seconds after a move before the next rebalance",
}


def _scheduler_environment() -> list[tuple[str, str, str]]:
    """``CONVEYOR_SCHEDULER_<FIELD>``: one row per field of the scheduler's config."""
    from conveyor.core.planning.scheduler import SchedulerConfig

    docs = {**SCHEDULER_FIELDS, **attribute_docs(SchedulerConfig)}
    return [
        (
            f"CONVEYOR_SCHEDULER_{f.name.upper()}",
            "scheduler: " + docs.get(f.name, f.name.replace("_", " ")),
            f"`{f.default!r}`",
        )
        for f in dataclasses.fields(SchedulerConfig)
    ]


def attribute_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after ``name: type = value``) of a class."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[stmt.target.id] = " ".join(nxt.value.value.split())
    return out


# -- types, constraints, defaults --------------------------------------------------------------

_SIMPLE = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    bytes: "bytes",
    Any: "any",
}


def type_name(annotation: Any) -> str:
    """A reader's name for a field type: ``string or null``, ``list of string``, ``'a' or 'b'``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " or ".join(f"`{v!r}`" for v in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin in (list, tuple, set, frozenset, Sequence):
        return f"list of {_inner(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_inner(args[0])} to {_inner(args[1])}" if args else "mapping"
    if annotation in _SIMPLE:
        return _SIMPLE[annotation]
    if annotation is SecretStr:
        return "secret string"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " or ".join(f"`{m.value!r}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        title = _section_title(annotation)
        return f"section `{title}`" if title else "mapping"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _inner(annotation: Any) -> str:
    text = type_name(annotation)
    return f"({text})" if " or " in text else text


_BOUNDS = {
    "gt": ">",
    "ge": "≥",
    "lt": "<",
    "le": "≤",
    "min_length": "at least",
    "max_length": "at most",
}


def constraints(field: FieldInfo) -> str:
    """Bounds from the field's metadata, e.g. ``≥ 1, ≤ 1000`` or ``at least 1 item(s)``."""
    out = []
    for m in field.metadata:
        for attr, word in _BOUNDS.items():
            v = getattr(m, attr, None)
            if v is not None:
                out.append(
                    f"{word} {v} item{'' if v == 1 else 's'}"
                    if attr.endswith("length")
                    else f"{word} {v}"
                )
    return ", ".join(out)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(section defaults)"
        return f"`{value!r}`"
    d = field.default
    if isinstance(d, enum.Enum):
        d = d.value
    if isinstance(d, SecretStr):
        return "(secret)"
    return f"`{d!r}`"


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, ``<`` outside code spans escaped (``<name>`` is no HTML tag)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def model_table(model: type[BaseModel]) -> str:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = field.alias or name
        typ = type_name(field.annotation)
        bounds = constraints(field)
        if bounds:
            typ += f" ({bounds})"
        desc = field.description or (
            "Selects this sink." if name == "type" and issubclass(model, SinkConfig) else ""
        )
        lines.append(f"| `{key}` | {_cell(typ)} | {_cell(default_text(field))} | {_cell(desc)} |")
    return "\n".join(lines)


# -- sections ------------------------------------------------------------------------------


def brokers_section() -> list[str]:
    return [
        "## Brokers file",
        "",
        "`$CONVEYOR_BROKERS_FILE` (default `$CONVEYOR_HOME/brokers.yaml`) lists the broker executors under",
        "`brokers:`. Without the file there is one broker, `local`, with capacity `$CONVEYOR_BROKER_CAPACITY`",
        "and the Spark Connect endpoint `$CONVEYOR_SPARK_REMOTE`. Unknown fields are rejected, ids are",
        "unique, and an error names the file and the field (`brokers.0.capacity: ...`); the scheduler then",
        "keeps the brokers it knew.",
        "",
        "```yaml",
        "brokers:",
        "  - id: spark-a",
        "    capacity: 8",
        "    spark_remote: sc://spark-a.internal:15002",
        "    run_tags: {dagster-celery/queue: spark-a}",
        "```",
        "",
        model_table(BrokerSpec),
        "",
    ]


def sink_sections() -> list[str]:
    """One section per registered sink type, or a note line for one that cannot be imported."""
    from conveyor import sinks

    out = []
    for name in sinks.sink_types():
        try:
            cls = sinks.sink_class(name).config_class
        except Exception as e:  # noqa: BLE001 - a sink being written must not break the reference
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            out.append(
                f"### sink `{name}`\n\n> Not documented: this sink could not be imported ({_cell(reason)}).\n"
            )
            continue
        nested = nested_models(cls, f"sink.{name}")
        out.append(f"### sink `{name}`\n\n{_cell(cls.__doc__ or '')}\n\n{model_table(cls)}\n")
        for title, model in nested:
            out.append(f"#### `{title}`\n\n{_cell(model.__doc__ or '')}\n\n{model_table(model)}\n")
    return out


def nested_models(model: type[BaseModel], prefix: str) -> list[tuple[str, type[BaseModel]]]:
    """The sub-models of ``model``'s fields (a mapping, or a list of them) that no section
    documents yet, titled ``<prefix>.<field>`` (and registered so, for their type names)."""
    out = []
    for name, field in model.model_fields.items():
        for inner in _models_in(field.annotation):
            if _section_title(inner) is None:
                title = f"{prefix}.{field.alias or name}"
                _SECTION_OF[inner] = title
                out.append((title, inner))
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, list, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def _source_sections() -> list[tuple[str, type[BaseModel]]]:
    from conveyor.core.engine.routing import AdmissionSpec, RouteSpec, RoutingSpec
    from conveyor.core.source_connector import ProducerSpec, SourceConnectorSpec

    return [
        ("source connector", SourceConnectorSpec),
        ("kafka", ProducerSpec),
        ("routing", RoutingSpec),
        ("routing.route", RouteSpec),
        ("routing.admission", AdmissionSpec),
    ]


def source_connector_sections() -> list[str]:
    """The source connector spec, its `kafka` and `routing` sections, and one per source type."""
    from conveyor import sources

    sections = _source_sections()
    for title, model in sections:
        _SECTION_OF.setdefault(model, title)
    out = [
        "## Source connectors",
        "",
        "A spec with `kind: source` (or whose `source.type` is not Kafka) is a source connector: it",
        "reads `source` (one of the types below) and produces every message into the topic its",
        "routing chooses, on the cluster of `kafka`. `batch`, `transform` (a `select` may set",
        "`__destination`), `retry`, `desired` and the run settings read as for sink connectors.",
        "Destinations come from the data (a source's destination column or per-table destinations, or",
        "a `select` setting `__destination`) or from `routing.route`, never both (refused at start).",
        "",
        "```yaml",
        "name: orders_in",
        "kind: source",
        "source: {type: postgres_polling, url: postgresql://app@db/shop, table: public.orders,",
        "         incrementing_column: id, destination_column: region}",
        "kafka: {partitions: 3}",
        "routing:",
        "  admission: {mode: allowlist, patterns: ['orders.*']}",
        "  max_destinations: 10",
        "```",
        "",
    ]
    for title, model in sections:
        out += [f"### `{title}`", "", _cell(model.__doc__ or ""), "", model_table(model), ""]
    for name in sources.source_types():
        try:
            cls = sources.source_class(name).config_class
        except Exception as e:  # noqa: BLE001 - a source being written must not break the reference
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            out.append(
                f"### source `{name}`\n\n> Not documented: this source could not be imported ({_cell(reason)}).\n"
            )
            continue
        notes = str(getattr(cls, "doc_notes", "")).strip()  # markdown after the fields
        out.append(
            f"### source `{name}`\n\n{_cell(cls.__doc__ or '')}\n\n{model_table(cls)}\n"
            + (f"\n{notes}\n" if notes else "")
        )
    return out


def render() -> str:
    """The whole of docs/CONFIG.md: intro, secrets, live changes, environment, spec sections,
    brokers file, sinks, source connectors. The same text at every call: the sub-sections a
    render titles (``nested_models``) are forgotten after it, so a second render in one process
    documents them again."""
    known, sources_known = dict(_SECTION_OF), list(_SOURCE_SECTIONS_KNOWN)
    try:
        return _render()
    finally:
        _SECTION_OF.clear()
        _SECTION_OF.update(known)
        _SOURCE_SECTIONS_KNOWN[:] = sources_known


def _render() -> str:
    parts = _intro_section()
    parts += _secrets_section()
    parts += _paths_section()
    parts += _live_changes_section()
    parts += _environment_section()
    parts += _spec_sections()
    parts += brokers_section()
    parts += _sinks_heading()
    parts += sink_sections()
    parts += source_connector_sections()
    return "\n".join(parts).rstrip() + "\n"


def _intro_section() -> list[str]:
    """The title, how the file is generated, and where a connector spec lives."""
    return [
        "# Configuration reference",
        "",
        f"Generated from the code by `{REGENERATE}`; do not edit by hand.",
        "",
        "A connector is one YAML file in `$CONVEYOR_CONNECTORS_DIR` (default `$CONVEYOR_HOME/connectors`),",
        "or a `conveyor.dagster.components.ConnectorComponent` in a `dg` project's `defs.yaml` (the spec under",
        "`attributes`). Unknown fields are rejected, and every error names the file and the field.",
        "",
    ]


def _secrets_section() -> list[str]:
    """Secrets by reference: where `${env:...}` and `${file:...}` may appear and what they may read."""
    return [
        "## Secrets by reference",
        "",
        "A secret field (a `secret string` field below, and a Kafka connection's `sasl_password`,",
        "`sasl_oauthbearer_token`, `ssl_key_password`) may hold `${env:NAME}` (an environment variable)",
        "or `${file:/abs/path}` (a file's content without its trailing newline), whole or inside the",
        "text, as Kafka Connect's config providers (KIP-297):",
        "`url: postgresql://app:${file:/run/secrets/pg}@db:5432/app`. `$${` writes a literal `${`.",
        "",
        "References are bounded (as Kafka Connect's KIP-993 `allowed.paths`), so that whoever may",
        "write a spec cannot read the run host's files or environment:",
        "",
        "- **Only in secret fields.** A reference in any other field (a name, table, topic, template,",
        "  path: values that end up in data, errors and status) is refused, naming the field.",
        "- **Only allowed files.** `${file:...}` reads files under `$CONVEYOR_SECRET_FILES`",
        "  (comma-separated absolute directories; default `$CONVEYOR_HOME/secrets`). The path must be",
        "  absolute, without `..`; it is resolved (symlinks followed) before the check, so a link",
        "  cannot point outside.",
        "- **Only allowed variables.** `${env:...}` reads variables whose names match",
        "  `$CONVEYOR_SECRET_ENV` (comma-separated shell patterns; default `CONVEYOR_*`), never",
        "  Conveyor's own credentials and policy (`CONVEYOR_META_URL`, `CONVEYOR_API_*`,",
        "  `CONVEYOR_SECRET_FILES`, `CONVEYOR_SECRET_ENV`) nor any other variable of the",
        "  Environment table below (Conveyor's settings: `CONVEYOR_SPARK_REMOTE`,",
        "  `CONVEYOR_DEMO_PG_URL`...), whatever the patterns say.",
        "- **No literal credentials in connection strings.** A password in a URL",
        "  (`postgresql://u:p@h`, `mysql://`, `redis://:p@h`, `amqp://u:p@h`), a `?password=`",
        "  parameter or a libpq `password=` setting must be a whole reference",
        "  (`postgresql://app:${file:/run/secrets/pg}@db/app`), as a Kafka connection's secrets must.",
        "  The string is read as the clients read it: PostgreSQL's by libpq's own parser",
        "  (percent-decoded keys, `password=` right after a quote), other URLs' user info up to",
        "  the last `@`, any character included.",
        "",
        "References are resolved only inside the connector's run (and a dead-letter replay or an",
        "offsets reset that must reach Kafka); the meta store, the Dagster UI and asset metadata, the",
        "CLI, the REST API and the logs show the reference, and errors name the field and the",
        "reference, never the value: every value resolved in a run is replaced by its reference in",
        "the errors, history and logs the run writes and in the exception it raises to Dagster.",
        "A secret field is shown as written only when it is one reference, or a URL whose",
        "credentials are references; anything else (`token: abc`, `${env:X}suffix`) is shown as",
        "`**********`. A config sent back with that mask (`GET` then `PUT .../config`) keeps the",
        "stored secret while the section's destination (`url`, `hosts`, `port`,",
        "`bootstrap_servers`...) is unchanged; else it is refused (`re-enter <field>: the",
        "destination changed`), as is a mask where nothing is stored. A secret that is itself the",
        "destination (a connection `url`) sent back as the mask is the stored one. `url_env: NAME` (PostgreSQL,",
        "MySQL, MongoDB) is an alias of `url: ${env:NAME}`. A changed secret behind a reference is",
        "picked up when the connector restarts (`conveyor connector restart`,",
        "`POST /connectors/<name>/restart`).",
        "",
    ]


def _paths_section() -> list[str]:
    """Files a spec names: the one rule of ``conveyor/core/trust/paths.py``."""
    return [
        "## Files a spec names",
        "",
        "Every path a spec names (`transform.schema_file`; TLS certificates and keys: a Kafka",
        "connection's and a schema registry's `ssl_cafile`/`ssl_certfile`/`ssl_keyfile`, the sinks'",
        "`ca_certs`, `tls_ca_file`, `ssl_cafile`, `tls_trust_certs_file_path`, MQTT's `tls_*_file`;",
        "LocalFile's `path`; Delta's `path`; Iceberg's `warehouse`, `namespace` and `table` and a",
        "SQLite `catalog.uri`; `failure.dead_letter.path`) lies under a root: `$CONVEYOR_HOME`, or a",
        "directory of `$CONVEYOR_FILE_ROOTS` (comma-separated absolute directories). A relative path is",
        "taken from `$CONVEYOR_HOME`; `..` is refused; symlinks are resolved first, so a link that",
        "points out of a root is refused; a root itself is refused. Never the secrets directories",
        "(`$CONVEYOR_SECRET_FILES`) nor Conveyor's own files (the meta store, the API tokens, the",
        "connectors directory, the brokers file, `dagster/`, `logs/`, `spark/`, `active-topics/` of",
        "the home). `$CONVEYOR_HOME/dead_letters/<name>` is connector `<name>`'s dead-letter place:",
        "only its own `failure.dead_letter.path` may name it, and two connectors' dead-letter places",
        "may not be the same or one inside the other. Iceberg names become directory names: no `/`,",
        "`\\`, `.` or `..`. A URL of another scheme (`s3://`, `gs://`, `hdfs://`) is passed as",
        "written. The rule is checked when a spec is loaded (an error naming the field and the roots)",
        "and again when the run opens the file; an error never quotes a file's content.",
        "",
    ]


def _live_changes_section() -> list[str]:
    """How a new, changed or removed spec file reaches the running connectors."""
    return [
        "## Live changes",
        "",
        "A new spec file is loaded into the code location by the scheduler sensor (with",
        "`$CONVEYOR_DAGSTER_URL` set) and launched; a changed spec reaches the running connector at its",
        "next batch boundary, in the same run (offsets and counters go on); a removed file stops the",
        "connector and keeps its offsets (delete it to forget them). `desired` applies when a connector",
        "is created.",
        "",
    ]


def _environment_section() -> list[str]:
    """The Environment table: one row per variable of ``_environment``."""
    return [
        "## Environment",
        "",
        "| variable | meaning | default |",
        "|---|---|---|",
        *(
            f"| `{var}` | {_cell(meaning)} | {default} |"
            for var, meaning, default in _environment()
        ),
        "",
    ]


def _spec_sections() -> list[str]:
    """One section per connector spec model (SECTIONS), the batch presets after `batch`."""
    parts: list[str] = []
    for title, model in SECTIONS:
        parts += [f"## `{title}`", "", _cell(model.__doc__ or ""), "", model_table(model), ""]
        if model is BatchPolicy:
            parts += _batch_presets()
    return parts


def _batch_presets() -> list[str]:
    """The named batch presets, one bullet each with its fields."""
    parts = ["Batch presets (`batch: {preset: NAME}` or `batch: NAME`):", ""]
    parts += [
        f"- `{k}`: {', '.join(f'`{f}: {v}`' for f, v in fields.items())}"
        for k, fields in BATCH_PRESETS.items()
    ]
    parts.append("")
    return parts


def _sinks_heading() -> list[str]:
    """The Sinks heading, before one section per sink type."""
    return [
        "## Sinks",
        "",
        "`sink.type` selects one of these; the other `sink` fields are that sink's.",
        "",
    ]


if __name__ == "__main__":
    sys.stdout.write(render())
