"""The MySQL / MariaDB sink's config model (``MySQLSinkConfig``): a URL or host fields, the
table, the session's timeouts and TLS; and what pymysql is given (``connect_kwargs``), the
TLS files resolved through the one path rule (``core.trust.paths``) right before connecting.
"""

from __future__ import annotations

import urllib.parse
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from conveyor.core.errors import ConfigError, rule
from conveyor.core.trust import paths
from conveyor.core.trust.references import known_now
from conveyor.sinks.base import require, secret
from conveyor.sinks.mysql_sql import SQL_MODE, identifier_problem
from conveyor.sinks.sql import (
    AutoEvolve,
    ConnectTimeoutS,
    DeleteEnabled,
    Delivery,
    OffsetsTableName,
    SqlColumns,
    SqlSinkConfig,
)


class MySQLSinkConfig(SqlSinkConfig):
    """Rows into a MySQL or MariaDB table."""

    type: Literal["mysql"] = "mysql"
    url: SecretStr | None = Field(
        default=None,
        description="mysql://user:${file:/run/secrets/mysql}@host:3306/db (secret; a password in it must be a reference; the user percent-encoded). One of url, url_env or host.",
    )
    host: str | None = Field(
        default=None,
        description="Server host, with port/user/password/database (instead of a URL).",
    )
    port: int = Field(default=3306, ge=1, le=65535, description="Server port (with host).")
    user: str | None = Field(default=None, description="User name (with host); default root.")
    password: SecretStr | None = Field(default=None, description="Password (with host; secret).")
    database: str | None = Field(
        default=None, description="Database (with host; with a URL the database is the URL's path)."
    )
    table: str = Field(
        description="Target table (one identifier; quoted, so any character but NUL is allowed)."
    )
    columns: SqlColumns = None
    upsert_keys: list[str] = Field(
        default_factory=list,
        description="Columns of the table's PRIMARY KEY or a UNIQUE index: INSERT ... ON DUPLICATE KEY UPDATE the other columns "
        "(idempotent replays). Empty: plain INSERT.",
    )
    create_table: bool = Field(
        default=False,
        description="Create the table (InnoDB, upsert_keys as PRIMARY KEY) from the first batch's schema when it does not exist.",
    )
    auto_evolve: AutoEvolve = False
    delete_enabled: DeleteEnabled = False
    rows_per_statement: int = Field(
        default=1000, ge=1, le=100_000, description="Rows per multi-row INSERT statement."
    )
    max_statement_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        le=1 << 30,
        description="pymysql splits a statement longer than this; keep it under the server's max_allowed_packet.",
    )
    connect_timeout_s: ConnectTimeoutS = 10
    read_timeout_s: int = Field(
        default=60,
        ge=1,
        le=86_400,
        description="Socket read timeout: how long one statement may take.",
    )
    write_timeout_s: int = Field(default=60, ge=1, le=86_400, description="Socket write timeout.")
    lock_wait_timeout_s: int | None = Field(
        default=None,
        ge=1,
        le=86_400,
        description="Session innodb_lock_wait_timeout (default: the server's, usually 50 s).",
    )
    tls_ca_file: str | None = Field(
        default=None,
        description="CA bundle (PEM): connect with TLS and verify the server against it.",
    )
    tls_cert_file: str | None = Field(
        default=None,
        description="Client certificate (PEM) for mutual TLS: connect with TLS and present it "
        "(its key in it, or in tls_key_file).",
    )
    tls_key_file: str | None = Field(
        default=None, description="The client certificate's private key (PEM; with tls_cert_file)."
    )
    charset: str = Field(default="utf8mb4", description="Connection character set.")
    delivery: Delivery
    offsets_table: OffsetsTableName = "conveyor_offsets"

    def database_name(self) -> str | None:
        """The database, from `database` or the URL's path when the URL writes it out.

        A URL given by reference (``${env:MYSQL_URL}``) is not read here: outside the run
        its database is unknown (the asset key says ``default``).
        """
        if self.database:
            return self.database
        url = secret(self.url)
        if not url or url.startswith("${"):
            return None
        path = urllib.parse.urlsplit(url).path.lstrip("/")
        if "${" in path:
            return None
        return urllib.parse.unquote(path) or None

    def key_namespace(self) -> str:
        return self.database_name() or "default"

    def kind(self) -> str:
        return "mysql"

    @model_validator(mode="after")
    def _rules(self) -> MySQLSinkConfig:
        """Cross-field rules (no I/O): each error names its field."""
        schemes = [n for n, v in (("url", self.url), ("host", self.host)) if v]
        rule(
            len(schemes) == 1,
            f"give exactly one of url (or url_env) and host (got {', '.join(schemes) or 'none'})",
            field="url",
        )
        if self.host is not None:
            rule(bool(self.host.strip()), "must not be empty", field="host")
            rule(
                bool(self.database and self.database.strip()),
                "a database is required with host",
                field="database",
            )
        else:
            for name in ("user", "password", "database"):
                rule(
                    getattr(self, name) is None,
                    f"{name} goes into the URL when url (or url_env) is used",
                    field=name,
                )
            rule(
                "port" not in self.model_fields_set,
                "port goes into the URL when url (or url_env) is used",
                field="port",
            )
        rule(
            self.tls_key_file is None or self.tls_cert_file is not None,
            "a key needs its certificate: set tls_cert_file",
            field="tls_key_file",
        )
        problem = identifier_problem(self.table) if known_now(self.table) else None
        rule(problem is None, f"{self.table!r}: {problem}", field="table")
        problem = identifier_problem(self.offsets_table)
        rule(problem is None, f"{self.offsets_table!r}: {problem}", field="offsets_table")
        self.check_mapping(column_problem=identifier_problem)
        rule(
            len(set(self.upsert_keys)) == len(self.upsert_keys),
            "duplicate column",
            field="upsert_keys",
        )
        rule(
            not known_now(self.charset)
            or (bool(self.charset.strip()) and self.charset.replace("_", "").isalnum()),
            f"{self.charset!r} is not a character set name",
            field="charset",
        )
        return self


def check_url(url: str) -> None:
    """ConfigError naming ``sink.url`` when the (resolved) URL lacks a part pymysql needs."""
    field = "sink.url"
    u = urllib.parse.urlsplit(url)
    require(
        u.scheme in ("mysql", "mariadb"),
        "must start with mysql:// (or mariadb://)",
        field=field,
    )
    require(bool(u.hostname), "has no host", field=field)
    try:
        u.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError("has a bad port", field=field) from None
    require(
        bool(u.path.lstrip("/")),
        "has no database (mysql://user:pw@host:3306/<database>)",
        field=field,
    )


def address(c: MySQLSinkConfig) -> dict[str, Any]:
    """Host, port, user, password and database, from the host fields or the URL."""
    if c.host is not None:
        return {
            "host": c.host,
            "port": c.port,
            "user": c.user or "root",
            "password": secret(c.password) or "",
            "database": c.database,
        }
    u = urllib.parse.urlsplit(secret(c.url) or "")
    return {
        "host": u.hostname,
        "port": u.port or 3306,
        "user": urllib.parse.unquote(u.username or "root"),
        "password": urllib.parse.unquote(u.password or ""),
        "database": urllib.parse.unquote(u.path.lstrip("/")),
    }


def tls_options(c: MySQLSinkConfig) -> dict[str, Any]:
    """pymysql's ``ssl`` options, each file the real path ``core.trust.paths`` resolves it to now
    (ConfigError naming the field when it is refused); empty without TLS."""
    ssl = {
        option: paths.resolve(value, field=f"sink.{name}")
        for option, name, value in (
            ("ca", "tls_ca_file", c.tls_ca_file),
            ("cert", "tls_cert_file", c.tls_cert_file),
            ("key", "tls_key_file", c.tls_key_file),
        )
        if value
    }
    if not ssl:
        return {}
    return {"ssl": ssl, "ssl_verify_cert": True} if "ca" in ssl else {"ssl": ssl}


def connect_kwargs(c: MySQLSinkConfig) -> dict[str, Any]:
    """pymysql.connect keyword arguments (includes the password: never log it)."""
    init = [f"sql_mode = '{SQL_MODE}'", "time_zone = '+00:00'"]
    if c.lock_wait_timeout_s is not None:
        init.append(f"innodb_lock_wait_timeout = {int(c.lock_wait_timeout_s)}")
    return {
        **address(c),
        "charset": c.charset,
        "connect_timeout": c.connect_timeout_s,
        "read_timeout": c.read_timeout_s,
        "write_timeout": c.write_timeout_s,
        "autocommit": False,
        "init_command": "SET SESSION " + ", ".join(init),
        "program_name": "conveyor",
        **tls_options(c),
    }
