"""A ``SchemaRegistrySpec`` as confluent-kafka's ``SchemaRegistryClient``, and what its failures mean.

``Registry`` wraps the client (which caches schemas by id, ``cache_capacity``) and classifies
every failure once:

- connection refused or reset, a timeout, HTTP 5xx or 429: ``TransientSinkError``, an outage
  (the loop retries the batch with backoff and shows the connector Degraded);
- HTTP 401 / 403: ``ConfigError`` naming ``<prefix>.basic_auth_user`` or
  ``<prefix>.bearer_token`` (no retry fixes refused credentials);
- an unknown schema id (HTTP 404, error 40403): ``UnknownSchema``, which a decoder turns into
  a failed row (the record's fault, for the failure policy);
- a missing subject or version (40401 / 40402): ``ConfigError`` naming the subject.

Secrets are resolved through ``conveyor.core.trust.secrets.resolve`` when the client is built (the
password) or at each request (the bearer token, so a rotated token file works); no error text
carries them (the server's message is scrubbed, ``conveyor.core.trust.scrubbing``).
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from confluent_kafka.schema_registry import RegisteredSchema, Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from conveyor.core.connection import check_readable
from conveyor.core.errors import ConfigError, TransientSinkError
from conveyor.core.schema_registry import SR_SSL_FIELDS, SchemaRegistrySpec
from conveyor.core.trust import scrubbing
from conveyor.core.trust.secrets import resolve
from conveyor.formats.caches import LruCache, UnknownIds
from conveyor.formats.limits import SchemaName

SCHEMA_NOT_FOUND = 40403
SUBJECT_NOT_FOUND = 40401
VERSION_NOT_FOUND = 40402
# The client's own retries stay short: a longer outage is the loop's to retry (with backoff,
# Degraded shown), not a request hanging inside one batch.
CLIENT_RETRIES = {"max.retries": 1, "retries.wait.ms": 200, "retries.max.wait.ms": 1000}


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The network errors of the HTTP client confluent-kafka uses: httpx2 where installed
    (its preference), else httpx; both when both are."""
    found: list[type[BaseException]] = [OSError, TimeoutError]
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except ImportError:
            continue
    return tuple(found)


TRANSPORT_ERRORS = _transport_errors()


class UnknownSchema(LookupError):
    """The registry has no schema with this id: the record's fault (a failed row)."""


def check_files(spec: SchemaRegistrySpec, *, prefix: str) -> dict[str, str]:
    """The real path of every certificate / key file of the section, resolved under a root
    now and readable (ConfigError naming the field): the client is given these paths."""
    return check_readable(spec, SR_SSL_FIELDS, prefix=prefix)


def client_config(spec: SchemaRegistrySpec, *, prefix: str) -> dict[str, Any]:
    """confluent-kafka's registry client configuration (secrets resolved: never log it)."""
    files = check_files(spec, prefix=prefix)
    conf: dict[str, Any] = {
        "url": spec.url,
        "timeout": spec.timeout_s,
        "cache.capacity": spec.cache_capacity,
        **CLIENT_RETRIES,
    }
    if "ssl_cafile" in files:
        conf["ssl.ca.location"] = files["ssl_cafile"]
    if "ssl_certfile" in files:
        conf["ssl.certificate.location"] = files["ssl_certfile"]
        conf["ssl.key.location"] = files["ssl_keyfile"]
    if spec.basic_auth_user is not None and spec.basic_auth_password is not None:
        password = resolve(spec.basic_auth_password, field=f"{prefix}.basic_auth_password")
        conf["basic.auth.user.info"] = f"{spec.basic_auth_user}:{password}"
    if spec.bearer_token is not None:
        ref, field = spec.bearer_token, f"{prefix}.bearer_token"
        resolve(ref, field=field)  # fail now, not at the first request

        def bearer(_config: dict[str, Any]) -> dict[str, str]:
            # confluent-kafka sends 'target-sr-cluster' with the token; only Confluent Cloud
            # reads it, so it stays empty.
            token: str = resolve(ref, field=field)
            return {"bearer.auth.token": token, "bearer.auth.logical.cluster": ""}

        conf["bearer.auth.credentials.source"] = "CUSTOM"
        conf["bearer.auth.custom.provider.function"] = bearer
        conf["bearer.auth.custom.provider.config"] = {}
    return conf


def registry_error(
    error: Exception, spec: SchemaRegistrySpec, *, prefix: str, what: str
) -> Exception:
    """What a failure of the registry client means (see the module); ``what`` names the
    request (``schema id 42``)."""
    where = f"schema registry {spec.url}"
    if isinstance(error, SchemaRegistryError):
        status, code = error.http_status_code, error.error_code
        text = scrubbing.scrub(str(error.error_message))
        if status in (401, 403):
            field = (
                f"{prefix}.bearer_token"
                if spec.bearer_token is not None
                else f"{prefix}.basic_auth_user"
            )
            return ConfigError(
                f"the {where} refused the credentials (HTTP {status}) for {what}", field=field
            )
        if status == 429 or status >= 500 or status < 0:
            return TransientSinkError(f"{where} unavailable (HTTP {status}) for {what}: {text}")
        if code == SCHEMA_NOT_FOUND or (status == 404 and what.startswith("schema id")):
            return UnknownSchema(f"unknown schema id: {what} is not in the {where}")
        if code in (SUBJECT_NOT_FOUND, VERSION_NOT_FOUND):
            return ConfigError(f"{what}: not in the {where} ({text})", field=f"{prefix}.url")
        return ConfigError(
            f"the {where} refused {what} (HTTP {status}): {text}", field=f"{prefix}.url"
        )
    if isinstance(error, TRANSPORT_ERRORS):
        kind = type(error).__name__
        return TransientSinkError(
            f"{where} unreachable for {what}: {kind}: {scrubbing.scrub(str(error))}"
        )
    return error


class Registry:
    """A registry client for one section; every call's failure classified (see the module).

    Lookups are cached here, bounded (``conveyor.formats.caches``): schemas by id and subject
    versions in LRU caches of ``cache_capacity`` entries, and ids the registry does not know
    for ``unknown_id_ttl_s`` seconds, so a topic of random ids costs one request per id and
    period, not one per record. The client's own cache, which nothing bounds, is emptied
    whenever these drop an entry: it never holds more than what was fetched since."""

    def __init__(self, spec: SchemaRegistrySpec, *, prefix: str = "schema_registry"):
        self.spec, self.prefix = spec, prefix
        self.client = SchemaRegistryClient(client_config(spec, prefix=prefix))
        self._latest_lock = threading.Lock()
        self._schemas: LruCache[tuple[int, str | None], Schema] = LruCache(spec.cache_capacity)
        self._versions: LruCache[tuple[str, int, str | None], RegisteredSchema] = LruCache(
            spec.cache_capacity
        )
        self._unknown: UnknownIds[tuple[int, str | None]] = UnknownIds(
            spec.cache_capacity, spec.unknown_id_ttl_s
        )
        self.requests = 0  # lookups sent to the registry (by id and by subject version)

    def _fail(self, error: Exception, what: str) -> Exception:
        return registry_error(error, self.spec, prefix=self.prefix, what=what)

    def schema(self, schema_id: int, fmt: str | None = None) -> Schema:
        """The schema with this id (cached); UnknownSchema when there is none (remembered for
        ``unknown_id_ttl_s``)."""
        key = (schema_id, fmt)
        found = self._schemas.get(key)
        if found is not None:
            return found
        what = f"schema id {schema_id}"
        if self._unknown.known_unknown(key):
            raise UnknownSchema(
                f"unknown schema id: {what} is not in the schema registry {self.spec.url}"
            )
        self.requests += 1
        try:
            found = self.client.get_schema(schema_id, fmt=fmt)
        except Exception as e:
            error = self._fail(e, what)
            if isinstance(error, UnknownSchema):
                self._unknown.add(key)
            raise error from None
        self._kept(self._schemas, key, found)
        return found

    def version(self, subject: str, version: int, fmt: str | None = None) -> RegisteredSchema:
        """A subject's version (a schema's reference; cached)."""
        key = (subject, int(version), fmt)
        found = self._versions.get(key)
        if found is not None:
            return found
        self.requests += 1
        try:
            found = self.client.get_version(subject, version, True, fmt)
        except Exception as e:
            raise self._fail(e, f"subject {subject!r} version {version}") from None
        self._kept(self._versions, key, found)
        return found

    def _kept(self, cache: LruCache[Any, Any], key: Any, value: Any) -> None:
        evicted = cache.evictions
        cache.put(key, value)
        if cache.evictions != evicted:
            self.client.clear_caches()  # the client's cache is not bounded: keep it small

    def metrics(self) -> dict[str, int]:
        """What the lookups cost (counters) and what the caches hold (gauges)."""
        return {
            "lookups_cached": self._schemas.hits + self._versions.hits,
            "lookups_unknown_cached": self._unknown.hits,
            "requests": self.requests,
            "evictions": self._schemas.evictions + self._versions.evictions,
            "unknown_evictions": self._unknown.evictions,
            "schemas_cached": len(self._schemas) + len(self._versions),
            "unknown_cached": len(self._unknown),
        }

    def schema_name(self, schema_id: int) -> SchemaName:
        """How errors name a writer schema: its id and the subject versions it is (asked of
        the registry, ``GET /schemas/ids/{id}/versions``; the id alone if it cannot say)."""
        try:
            found = self.client.get_schema_versions(schema_id)
        except Exception:  # noqa: BLE001 - a name for an error message, best effort
            return SchemaName(schema_id)
        pairs = tuple((str(v.subject), int(v.version)) for v in found if v.subject and v.version)
        return SchemaName(schema_id, pairs)

    def latest(self, subject: str, fmt: str | None = None) -> RegisteredSchema:
        """The subject's newest version, asked of the registry again (not the client's cache)."""
        with self._latest_lock:
            try:
                self.client.clear_latest_caches()
                found: RegisteredSchema = self.client.get_latest_version(subject, fmt)
            except Exception as e:
                raise self._fail(e, f"the latest version of subject {subject!r}") from None
        return found
