"""The PostgreSQL sink's config model (``PostgresSinkConfig``), and the one path rule applied
to the files its connection string names (libpq's ``sslrootcert``, ``sslcert``, ``sslkey``,
``sslcrl``, ``passfile``, ``servicefile``...: ``libpq_files``, issue 45).
"""

from __future__ import annotations

import configparser
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from conveyor.core.errors import ConfigError, rule
from conveyor.core.trust import paths
from conveyor.core.trust.references import known_now
from conveyor.sinks.base import secret
from conveyor.sinks.sql import (
    AutoEvolve,
    ConnectTimeoutS,
    DeleteEnabled,
    Delivery,
    OffsetsTableName,
    SqlColumns,
    SqlSinkConfig,
)


class PostgresSinkConfig(SqlSinkConfig):
    """Rows into a PostgreSQL table."""

    type: Literal["postgres"] = "postgres"
    url: SecretStr | None = Field(
        default=None,
        description="libpq URL, e.g. postgresql://user:${file:/run/secrets/pg}@127.0.0.1:5432/db (secret; a password in it must be a reference).",
    )
    schema_: str = Field(default="public", alias="schema", description="Target schema.")
    table: str = Field(description="Target table.")
    columns: SqlColumns = None
    upsert_keys: list[str] = Field(
        default_factory=list,
        description="Key columns: INSERT ... ON CONFLICT (keys) DO UPDATE (idempotent replays).",
    )
    create_table: bool = Field(
        default=False,
        description="Create the table from the first batch's schema when it does not exist.",
    )
    auto_evolve: AutoEvolve = False
    delete_enabled: DeleteEnabled = False
    truncate_enabled: bool = Field(
        default=False,
        description="A row whose __truncate column (a boolean the transform's select sets, e.g. "
        "op = 't' AS __truncate for Debezium changes) is true truncates the table at its place in the "
        "batch, in the batch's transaction (Debezium JDBC sink's truncate.enabled); its other columns "
        "are ignored. Off: such a row is a failed row (failure.policy), never written.",
    )
    write_method: Literal["copy", "values"] = Field(
        default="copy",
        description="COPY (fast) or multi-row INSERT; upserts always go through a COPY into a temporary table.",
    )
    connect_timeout_s: ConnectTimeoutS = 10
    statement_timeout_ms: int = Field(
        default=60_000, ge=0, description="Statement timeout (0 = none)."
    )
    delivery: Delivery
    offsets_table: OffsetsTableName = "conveyor_offsets"

    def key_namespace(self) -> str:
        return self.schema_

    def kind(self) -> str:
        return "postgres"

    @model_validator(mode="after")
    def _rules(self) -> PostgresSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        rule(bool(self.url), "is required (a libpq URL, or ${env:NAME})", field="url")
        rule(bool(self.table.strip()), "must not be empty", field="table")
        url = secret(self.url)
        why = file_params_problem(url) if url and known_now(url) else None
        rule(why is None, why or "", field="url")
        self.check_mapping()
        return self


#: libpq's parameters naming a file or directory it opens (or writes: sslkeylogfile).
LIBPQ_FILE_PARAMS = (
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslcrl",
    "sslcrldir",
    "sslkeylogfile",
    "passfile",
    "servicefile",
)


def file_params(dsn: str) -> dict[str, str]:
    """The file parameters of a libpq URL or DSN as written (parsed by the libpq that connects);
    none when it does not parse: that libpq refuses it on connect too (a parameter newer than
    it, such as ``servicefile`` or ``sslkeylogfile`` before PostgreSQL 18, included).
    ``sslrootcert=system`` (libpq's own CA store) is not a path."""
    from psycopg2.extensions import parse_dsn

    try:
        params = parse_dsn(dsn)
    except Exception:  # noqa: BLE001 - refused on connect
        return {}
    return {
        name: params[name]
        for name in (*LIBPQ_FILE_PARAMS, "service")
        if params.get(name) is not None and not (name == "sslrootcert" and params[name] == "system")
    }


def file_params_problem(dsn: str) -> str | None:
    """Why a file parameter of the connection string is refused (``core.trust.paths``), or None."""
    for name, value in file_params(dsn).items():
        why = paths.problem(value) if name != "service" else None
        if why is not None:
            return f"{name}: {why}"
    return None


def libpq_files(dsn: str, *, read_service: bool = True) -> dict[str, str]:
    """The real path of each file parameter of the connection string, as ``core.trust.paths``
    resolves it now (to hand to ``psycopg2.connect``, which lets them override the DSN's);
    ConfigError naming ``sink.url`` and the parameter when one is refused. With
    ``read_service``, the file parameters of a ``service`` in a ``servicefile`` too."""
    why = file_params_problem(dsn)
    if why is not None:
        raise ConfigError(why, field="sink.url")
    params = file_params(dsn)
    service = params.pop("service", None)
    out = {name: paths.resolve(value, field="sink.url") for name, value in params.items()}
    if read_service and service and "servicefile" in out:
        check_service(out["servicefile"], service)
    return out


def check_service(servicefile: str, service: str) -> None:
    """ConfigError when the service's section of ``servicefile`` names a file parameter
    outside the roots (the error never quotes the file)."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read(servicefile, encoding="utf-8")
    except (configparser.Error, UnicodeError, OSError):
        raise ConfigError(
            "servicefile: cannot be read as a libpq service file", field="sink.url"
        ) from None
    for name in LIBPQ_FILE_PARAMS:
        value = parser.get(service, name, fallback=None) if parser.has_section(service) else None
        if value is None or (name == "sslrootcert" and value == "system"):
            continue
        if paths.problem(value) is not None:
            raise ConfigError(
                f"service {service!r} of the servicefile names a {name} outside the roots a "
                f"spec's paths may name ({paths.roots().describe()})",
                field="sink.url",
            )
