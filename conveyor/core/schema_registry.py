"""How Conveyor reaches a Confluent-compatible schema registry: the ``schema_registry`` section.

A record in Confluent's wire format carries only its writer schema's id; the schema is read
from the registry (``conveyor.formats.registry`` builds the client). The model is pure
(validation only) and follows ``conveyor.core.connection.KafkaConnection``: secrets are
references (``${env:NAME}`` / ``${file:/path}``), resolved by the client inside the run,
never values; certificate and key files are paths, checked readable when the client is
built, and only with TLS (an ``https://`` URL).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conveyor.core.connection import SECRET_FIELD, host_file_problem, secret_ref_problem
from conveyor.core.errors import FieldRuleError

SR_SECRET_FIELDS = ("basic_auth_password", "bearer_token")
SR_SSL_FIELDS = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")


class SchemaRegistrySpec(BaseModel):
    """A schema registry speaking Confluent's REST API (Confluent, Apicurio's and Karapace's
    compatible endpoints, Redpanda)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        description="Base URL of the registry, http:// or https://, e.g. http://127.0.0.1:8081. "
        "No credentials in it: use basic_auth_user / basic_auth_password or bearer_token.",
    )
    basic_auth_user: str | None = Field(
        default=None, description="HTTP Basic user name (with basic_auth_password)."
    )
    basic_auth_password: str | None = Field(
        default=None,
        json_schema_extra=SECRET_FIELD,
        description="HTTP Basic password: a reference, ${env:NAME} or ${file:/path}; never the "
        "password itself.",
    )
    bearer_token: str | None = Field(
        default=None,
        json_schema_extra=SECRET_FIELD,
        description="Bearer token sent as 'Authorization: Bearer <token>': a reference "
        "(${file:/path} is read again for every request, so a token file a sidecar refreshes "
        "works). Instead of basic auth.",
    )
    ssl_cafile: str | None = Field(
        default=None,
        description="CA bundle (PEM) the registry's certificate is verified against (https:// "
        "URLs). Default: the system's CAs. Like the two below, under a root ($CONVEYOR_HOME, "
        "relative: from there; section Files a spec names).",
    )
    ssl_certfile: str | None = Field(
        default=None, description="Client certificate (PEM) for mutual TLS (with ssl_keyfile)."
    )
    ssl_keyfile: str | None = Field(
        default=None, description="Client private key (PEM) for mutual TLS (unencrypted)."
    )
    timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="Timeout of one request to the registry, seconds."
    )
    cache_capacity: int = Field(
        default=1000,
        ge=1,
        description="How many schemas (by id, and subject versions) and how many unknown ids "
        "are kept in memory, the least recently used dropped first; also how many parsed "
        "writer schemas each topic's decoder keeps.",
    )
    unknown_id_ttl_s: float = Field(
        default=60.0,
        ge=0,
        le=86_400,
        description="How long a schema id the registry answered 'not found' is remembered: "
        "records naming it fail without a request until then (a topic of random ids costs "
        "one request per id per period, not one per record). 0: ask every time.",
    )

    @field_validator("basic_auth_password", "bearer_token")
    @classmethod
    def _is_reference(cls, v: str | None) -> str | None:
        if v is not None:
            problem = secret_ref_problem(v)
            if problem:
                raise ValueError(problem)
        return v

    @field_validator(*SR_SSL_FIELDS)
    @classmethod
    def _host_file(cls, v: str | None) -> str | None:
        problem = host_file_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        problem = registry_url_problem(v)
        if problem:
            raise ValueError(problem)
        return v.rstrip("/")

    @model_validator(mode="after")
    def _fields_fit(self) -> SchemaRegistrySpec:
        for field, problem in registry_problems(self):
            raise FieldRuleError(problem, field=field)
        return self


def registry_url_problem(url: str) -> str | None:
    """Why ``url`` is not a usable registry base URL, or None."""
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:
        return f"{url!r} is not a URL: {e}"
    if parts.scheme not in ("http", "https"):
        return f"{url!r}: the scheme must be http or https"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return (
            "credentials may not be written in the URL (user:pass@host): use basic_auth_user "
            "and basic_auth_password (a reference) or bearer_token"
        )
    if not parts.hostname:
        return f"{url!r} has no host"
    if parts.query or parts.fragment:
        return f"{url!r}: a base URL takes no query or fragment"
    return None


def registry_problems(s: SchemaRegistrySpec) -> list[tuple[str, str]]:
    """Cross-field problems of a registry section as (field, problem) (empty when usable)."""
    out: list[tuple[str, str]] = []
    if (s.basic_auth_user is None) != (s.basic_auth_password is None):
        missing = "basic_auth_password" if s.basic_auth_password is None else "basic_auth_user"
        out.append((missing, "give both basic_auth_user and basic_auth_password, or neither"))
    if s.bearer_token is not None and s.basic_auth_user is not None:
        out.append(("bearer_token", "use either bearer_token or basic auth, not both"))
    if not s.url.startswith("https://"):
        for name in SR_SSL_FIELDS:
            if getattr(s, name) is not None:
                out.append((name, "only with an https:// url"))
    if bool(s.ssl_certfile) != bool(s.ssl_keyfile):
        out.append(("ssl_keyfile", "give both ssl_certfile and ssl_keyfile, or neither"))
    return out
