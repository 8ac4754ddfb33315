"""How Conveyor reaches a Kafka(-protocol) cluster: one model for every client it opens.

The connector's source, the consumer-group offsets mirror, the Kafka dead-letter
writer, ``conveyor offsets reset`` and the Kafka sink all connect with a
``KafkaConnection``: bootstrap servers, transport security (TLS), SASL, client id
and a pass-through for other client settings. The model is pure (validation only);
``conveyor.brokers.connection`` maps it onto a client's configuration names
(kafka-python's ``snake_case`` keywords or librdkafka's dotted properties, see
``OPTION_NAMES``) and resolves its secrets inside the run.

Secrets are references, never values: ``${env:NAME}`` (an environment variable of
the run's process) or ``${file:/path}`` (a file's contents, trailing newline
stripped, read again at each connection: rotated files work). A spec is stored in
the meta store and shown by the CLI, so a literal password is refused. The run keeps
these fields as references (``specs.resolved``) and the client resolves them, through
``conveyor.core.trust.secrets.resolve``, each time it connects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import JsonDict

from conveyor.core.errors import ConfigError
from conveyor.core.trust import paths
from conveyor.core.trust.references import whole_reference_problem

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"]

# Field -> (kafka-python keyword, librdkafka property). The one mapping of the model
# onto the two clients' names; client_options use the client's own names directly.
OPTION_NAMES: dict[str, tuple[str, str]] = {
    "bootstrap_servers": ("bootstrap_servers", "bootstrap.servers"),
    "client_id": ("client_id", "client.id"),
    "security_protocol": ("security_protocol", "security.protocol"),
    "sasl_mechanism": ("sasl_mechanism", "sasl.mechanism"),
    "sasl_username": ("sasl_plain_username", "sasl.username"),
    "sasl_password": ("sasl_plain_password", "sasl.password"),
    "sasl_oauthbearer_token": ("sasl_oauth_token_provider", "oauth_cb"),
    "sasl_kerberos_service_name": ("sasl_kerberos_service_name", "sasl.kerberos.service.name"),
    "ssl_cafile": ("ssl_cafile", "ssl.ca.location"),
    "ssl_certfile": ("ssl_certfile", "ssl.certificate.location"),
    "ssl_keyfile": ("ssl_keyfile", "ssl.key.location"),
    "ssl_key_password": ("ssl_password", "ssl.key.password"),
    "ssl_check_hostname": ("ssl_check_hostname", "ssl.endpoint.identification.algorithm"),
}

SECRET_FIELDS = ("sasl_password", "sasl_oauthbearer_token", "ssl_key_password")
# Marks a text field as secret (``conveyor.config.specs.secret_fields``), as ``SecretStr`` does: only
# such fields may hold references, and they are masked when shown.
SECRET_FIELD: JsonDict = {"secret": True}
SSL_FIELDS = ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_key_password")
SASL_FIELDS = (
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "sasl_oauthbearer_token",
)

# Words that mark a client option as a secret: such options must be model fields
# (references), never pass-through values stored in the spec.
_SECRET_WORDS = ("password", "secret", "token", "jaas", "credential", "private_key", "key_pem")


def check_readable(model: BaseModel, names: Iterable[str], *, prefix: str) -> dict[str, str]:
    """The real path of each certificate / key file named by ``model``'s fields ``names``,
    resolved under a root (``core.trust.paths``) and readable here when a client is built (a
    ConfigError naming ``<prefix>.<field>`` otherwise): the client opens these paths."""
    out: dict[str, str] = {}
    for name in names:
        path = getattr(model, name)
        if path:
            real = paths.resolve(path, field=f"{prefix}.{name}")
            try:
                open(real, "rb").close()  # noqa: SIM115 - only checks it is readable
            except OSError as e:
                raise ConfigError(
                    f"{path!r} cannot be read: {e.strerror}", field=f"{prefix}.{name}"
                ) from None
            out[name] = real
    return out


def host_file_problem(value: str | None) -> str | None:
    """Why a certificate or key file a model names is refused (``core.trust.paths``), or None."""
    return None if value is None else paths.problem(value)


def secret_ref_problem(value: str) -> str | None:
    """Why ``value`` is not a secret reference, or None (``core.trust.references``' rule)."""
    return whole_reference_problem(value)


def option_secret_problem(name: str) -> str | None:
    """Why the client option ``name`` may not be passed through (it looks like a secret)."""
    low = name.lower().replace(".", "_")
    if any(w in low for w in _SECRET_WORDS):
        return (
            f"{name!r} looks like a secret: client_options are stored in the meta store as written; "
            "use the connection's secret fields (references) instead"
        )
    return None


# Client options that would load code, run a command or read a file on the run's host
# (librdkafka's and kafka-python's names, compared lower-cased with '.' and '-' as '_').
_LOADS_CODE = "loads native code into the run's process"
_HOST_OPTIONS: dict[str, str] = {
    "plugin_library_paths": _LOADS_CODE,
    "ssl_engine_location": _LOADS_CODE,
    "ssl_engine_id": _LOADS_CODE + " (an OpenSSL engine)",
    "ssl_providers": _LOADS_CODE + " (OpenSSL providers)",
    "sasl_kerberos_kinit_cmd": "is a shell command the client runs",
    "sasl_kerberos_principal": "is put into the kinit shell command the client runs",
    "sasl_kerberos_keytab": "reads a keytab file on the run's host",
}
_FILE_SUFFIXES = ("_location", "file", "_keytab", "_path", "_paths", "_cmd")
_OAUTH_PREFIXES = ("sasl_oauthbearer_", "enable_sasl_oauthbearer_")


def option_host_problem(name: str) -> str | None:
    """Why the client option ``name`` may not be passed through because it reaches the
    run's host (loads code, runs a command, reads a file), or None."""
    low = name.strip().lower().replace(".", "_").replace("-", "_")
    why = _HOST_OPTIONS.get(low)
    if why is None and low.startswith(_OAUTH_PREFIXES):
        why = (
            "configures OAUTHBEARER outside the connection (token requests to any URL, key "
            "files); use sasl_mechanism OAUTHBEARER with sasl_oauthbearer_token"
        )
    if why is None and low.endswith("_pem"):
        why = (
            "holds certificate or key material outside the connection; use the connection's "
            "ssl_cafile, ssl_certfile and ssl_keyfile"
        )
    if why is None and (low.startswith("plugin_") or low.endswith(_FILE_SUFFIXES)):
        why = (
            "names a file or program on the run's host; certificates and keys are the "
            "connection's ssl_cafile, ssl_certfile and ssl_keyfile"
        )
    if why is None:
        return None
    return f"{name!r} {why}: client_options may not load code, run commands or read host files"


class KafkaConnection(BaseModel):
    """Connection settings shared by every Kafka client Conveyor opens."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    bootstrap_servers: str | None = Field(
        default=None,
        description="Kafka bootstrap servers 'host:port[,host:port]'. Default: $CONVEYOR_KAFKA_BOOTSTRAP, "
        "else the embedded broker started by `conveyor dev`.",
    )
    client_id: str | None = Field(
        default=None,
        description="Client id shown in broker logs, metrics and quotas. Default: conveyor-<connector> "
        "(conveyor-sink for the Kafka sink).",
    )
    security_protocol: SecurityProtocol = Field(
        default="PLAINTEXT",
        description="PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL (SASL over TLS).",
    )
    sasl_mechanism: SaslMechanism | None = Field(
        default=None,
        description="SASL mechanism (with SASL_PLAINTEXT / SASL_SSL): PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, "
        "OAUTHBEARER (a token from sasl_oauthbearer_token) or GSSAPI (Kerberos; needs the `gssapi` package "
        "and a ticket or keytab in the run's environment).",
    )
    sasl_username: str | None = Field(default=None, description="SASL user name (PLAIN and SCRAM).")
    sasl_password: str | None = Field(
        default=None,
        json_schema_extra=SECRET_FIELD,
        description="SASL password (PLAIN and SCRAM): a reference, ${env:NAME} or ${file:/path}; never the "
        "password itself.",
    )
    sasl_oauthbearer_token: str | None = Field(
        default=None,
        json_schema_extra=SECRET_FIELD,
        description="OAUTHBEARER: the bearer token, a reference (${file:/path} is read again at every "
        "(re)connection, so a token file refreshed by a sidecar works).",
    )
    sasl_kerberos_service_name: str = Field(
        default="kafka", description="GSSAPI: the brokers' Kerberos service name."
    )
    ssl_cafile: str | None = Field(
        default=None,
        description="CA bundle (PEM) the brokers' certificates are verified against (with SSL / SASL_SSL). "
        "Default: the system's CAs. Like every file below, under a root ($CONVEYOR_HOME, relative: from "
        "there; section Files a spec names).",
    )
    ssl_certfile: str | None = Field(
        default=None,
        description="Client certificate (PEM) for mutual TLS (with ssl_keyfile), under a root.",
    )
    ssl_keyfile: str | None = Field(
        default=None, description="Client private key (PEM) for mutual TLS, under a root."
    )
    ssl_key_password: str | None = Field(
        default=None,
        json_schema_extra=SECRET_FIELD,
        description="Password of an encrypted ssl_keyfile: a reference, ${env:NAME} or ${file:/path}.",
    )
    ssl_check_hostname: bool = Field(
        default=True,
        description="Check that the broker's certificate names the host connected to.",
    )
    client_options: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Other settings passed to the Kafka client as they are, under the client's own names "
        "(kafka-python: `fetch_min_bytes`, `metadata_max_age_ms`...). Settings Conveyor owns (group, "
        "offsets, security), anything that looks like a secret and anything that loads code, runs a command "
        "or reads a file on the run's host (plugin.library.paths, sasl.kerberos.kinit.cmd, *.location, "
        "sasl.oauthbearer.*...) are refused.",
    )

    @field_validator("sasl_password", "sasl_oauthbearer_token", "ssl_key_password")
    @classmethod
    def _is_reference(cls, v: str | None) -> str | None:
        if v is not None:
            problem = secret_ref_problem(v)
            if problem:
                raise ValueError(problem)
        return v

    @field_validator("ssl_cafile", "ssl_certfile", "ssl_keyfile")
    @classmethod
    def _host_file(cls, v: str | None) -> str | None:
        problem = host_file_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("bootstrap_servers")
    @classmethod
    def _bootstrap(cls, v: str | None) -> str | None:
        if v is None:
            return v
        for hp in v.split(","):
            host, _, port = hp.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{hp.strip()!r} is not host:port")
        return v

    @field_validator("client_options")
    @classmethod
    def _options(
        cls, v: dict[str, str | int | float | bool]
    ) -> dict[str, str | int | float | bool]:
        for name in v:
            problem = option_host_problem(name) or option_secret_problem(name)
            if problem:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _security(self) -> KafkaConnection:
        for problem in connection_problems(self):
            raise ValueError(problem)
        return self

    def with_default_bootstrap(self, default: str | None) -> Self:
        """This connection, with ``default`` (the deployment's bootstrap servers: the
        resource's ``kafka_bootstrap`` or $CONVEYOR_KAFKA_BOOTSTRAP) where it names none."""
        if self.bootstrap_servers is None and default:
            return self.model_copy(update={"bootstrap_servers": default})
        return self


def connection_problems(c: KafkaConnection) -> list[str]:
    """Cross-field problems of a connection, each naming its field (empty when usable)."""
    out: list[str] = []
    sasl = c.security_protocol.startswith("SASL")
    tls = c.security_protocol.endswith("SSL")
    if sasl:
        if c.sasl_mechanism is None:
            out.append(f"sasl_mechanism: required with security_protocol {c.security_protocol}")
        elif c.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            if not c.sasl_username:
                out.append(f"sasl_username: required with sasl_mechanism {c.sasl_mechanism}")
            if c.sasl_password is None:
                out.append(f"sasl_password: required with sasl_mechanism {c.sasl_mechanism}")
            if c.sasl_oauthbearer_token is not None:
                out.append("sasl_oauthbearer_token: only with sasl_mechanism OAUTHBEARER")
        elif c.sasl_mechanism == "OAUTHBEARER":
            if c.sasl_oauthbearer_token is None:
                out.append("sasl_oauthbearer_token: required with sasl_mechanism OAUTHBEARER")
            for name in ("sasl_username", "sasl_password"):
                if getattr(c, name) is not None:
                    out.append(f"{name}: not used with sasl_mechanism OAUTHBEARER")
        elif c.sasl_mechanism == "GSSAPI":
            for name in ("sasl_password", "sasl_oauthbearer_token"):
                if getattr(c, name) is not None:
                    out.append(f"{name}: not used with sasl_mechanism GSSAPI (Kerberos)")
    else:
        for name in SASL_FIELDS:
            if getattr(c, name) is not None:
                out.append(f"{name}: only with security_protocol SASL_PLAINTEXT or SASL_SSL")
    if not tls:
        for name in SSL_FIELDS:
            if getattr(c, name) is not None:
                out.append(f"{name}: only with security_protocol SSL or SASL_SSL")
    if bool(c.ssl_certfile) != bool(c.ssl_keyfile):
        out.append("ssl_keyfile: give both ssl_certfile and ssl_keyfile, or neither")
    if c.ssl_key_password is not None and not c.ssl_keyfile:
        out.append("ssl_key_password: only with ssl_keyfile")
    return out
