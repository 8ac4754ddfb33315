"""Issue 34's secrets findings, on pure code: resolved values scrubbed from any text, log
record and exception chain (H1); literal credentials found as the clients parse them (M1); a
mask kept only for an unchanged destination (M2); a secret field shown only when it is one
reference (L1); Conveyor's own settings never readable by a reference (L4)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from urllib.parse import quote

import psycopg2
import psycopg2.extensions
import pytest
from dagster import Failure, RetryRequested

from conveyor.control.configdoc import environment_names
from conveyor.core.errors import ConfigError, PermanentSinkError
from conveyor.core.trust import scrubbing
from conveyor.core.trust.secrets import (
    MASK,
    SecretPolicy,
    check_placement,
    is_destination_field,
    keep_stored_secrets,
    libpq_credential_problem,
    mask_literal,
    resolve,
)
from conveyor.dagster.jobs.runs import scrubbed_errors
from conveyor.sinks import REGISTRY as SINKS
from conveyor.sources import REGISTRY as SOURCES

CANARY = "s3cr3t-Canary/42 x"


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    scrubbing.forget_all()
    yield
    scrubbing.forget_all()


def resolved_canary(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CONVEYOR_CANARY_PW", CANARY)
    monkeypatch.delenv("CONVEYOR_SECRET_ENV", raising=False)
    return resolve("${env:CONVEYOR_CANARY_PW}", field="sink.password")


# -- H1: one registry, one scrub ---------------------------------------------------------


def test_every_resolved_value_and_its_encoded_forms_are_scrubbed(monkeypatch) -> None:
    assert resolved_canary(monkeypatch) == CANARY
    text = (
        f"auth failed for {CANARY}; url postgresql://u:{quote(CANARY, safe='')}@h/db; "
        f"form {quote(CANARY)} plus {CANARY.replace(' ', '+')}; json {CANARY!r}"
    )
    out = scrubbing.scrub(text)
    assert "Canary" not in out
    assert out.startswith("auth failed for ${env:CONVEYOR_CANARY_PW};")


def test_a_resolved_connection_string_has_its_passwords_scrubbed_on_their_own() -> None:
    scrubbing.remember("postgresql://app:pw-9a8b@db/app?sslpassword=ssl-5555", "${env:PG_URL}")
    scrubbing.remember("host=db password='kv pass 77' dbname=x", "${env:KV}")
    out = scrubbing.scrub("app: pw-9a8b, ssl-5555, kv pass 77 (kv%20pass%2077)")
    assert out == "app: ***, ***, *** (***)"
    assert scrubbing.scrub("postgresql://app:pw-9a8b@db/app?sslpassword=ssl-5555") == (
        "${env:PG_URL}"
    )


def test_short_values_are_not_remembered(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_SHORT", "abc")
    resolve("${env:CONVEYOR_SHORT}")
    assert scrubbing.scrub("abc abcdef") == "abc abcdef"


def test_a_value_inside_its_own_reference_is_shown_as_stars() -> None:
    scrubbing.remember("CONVEYOR_X", "${env:CONVEYOR_X}")
    assert scrubbing.scrub("saw CONVEYOR_X") == "saw ***"


def test_log_records_are_scrubbed_whoever_logs_them(monkeypatch) -> None:
    resolved_canary(monkeypatch)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("some.library.issue34")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        logger.warning("connect as %s failed", CANARY)
        try:
            raise psycopg2.OperationalError(f'FATAL: role "{CANARY}" does not exist')
        except psycopg2.OperationalError:
            logger.exception("giving up")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "Canary" not in out
    assert "connect as ${env:CONVEYOR_CANARY_PW} failed" in out
    assert 'role "${env:CONVEYOR_CANARY_PW}" does not exist' in out


def _chain(error: BaseException) -> str:
    parts, e = [], error
    while e is not None:
        parts.append(f"{type(e).__name__}: {e} {e.args!r}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def test_an_op_raises_the_same_kind_of_error_scrubbed_with_no_original_in_its_chain(
    monkeypatch,
) -> None:
    resolved_canary(monkeypatch)

    @scrubbed_errors
    def op_body(kind: str) -> None:
        try:
            raise psycopg2.OperationalError(f'role "{CANARY}" does not exist')
        except psycopg2.OperationalError as e:
            if kind == "sink":
                raise PermanentSinkError(f"refused: {e}") from e
            if kind == "failure":
                raise Failure(description=f"stopped: {e}") from None
            raise RetryRequested(max_retries=2, seconds_to_wait=1.5) from e

    for kind, expected in (
        ("sink", PermanentSinkError),
        ("failure", Failure),
        ("retry", RetryRequested),
    ):
        with pytest.raises(expected) as info:
            op_body(kind)
        chain = _chain(info.value)
        assert "Canary" not in chain, chain
        if kind != "retry":
            assert 'role "${env:CONVEYOR_CANARY_PW}" does not exist' in chain
    retry = info.value
    assert isinstance(retry, RetryRequested)
    assert (retry.max_retries, retry.seconds_to_wait) == (2, 1.5)
    assert 'role "${env:CONVEYOR_CANARY_PW}"' in str(retry.__cause__)


def test_an_error_without_a_secret_is_raised_as_it_is(monkeypatch) -> None:
    resolved_canary(monkeypatch)
    original = ValueError("nothing secret here")

    @scrubbed_errors
    def op_body() -> None:
        raise original

    with pytest.raises(ValueError) as info:
        op_body()
    assert info.value is original


# -- M1: literal credentials, as the clients parse them ----------------------------------

LITERAL = [
    "postgresql://app:hunt?er2@h/db",
    "postgresql://app?:hunter2@h/db",
    "postgresql://app@h/db?%70assword=x",
    "host='127.0.0.1'password=hunter2 dbname=test",
    "mysql://root:pa ss@h/db",
    "postgresql://u:pa#ss@h/db",
    "postgresql://u:pa ss@h/db",
    "host=h\tpassword=secret",
    "host=h password = secret",
    "host=h\npassword=x",
    "host=h password='se cret'",
    "mysql+pymysql://u:pa/ss@h/db",
    "redis://:p@h",
    "rediss://:pass@h",
    "amqps://u:p@h",
    "mongodb+srv://u:p@h",
    "postgres://u:p@h",
    "POSTGRESQL://u:p@h",
    "postgresql://h/db?sslpassword=x",
    "host=h sslpassword=x",
    "postgresql://h/db?password=x",
    "postgresql://h/db?user=u&password=x",
    "postgresql://[::1]/db?password=x",
    "postgresql:///db?host=h&password=x",
    "postgresql://u:%70@h",
    "postgresql://u:p%40x@h/db",
    "postgresql://u:p@h,h2/db",
    "dbname=x password=${env:CONVEYOR_X}x",
    "postgresql://u:${env:CONVEYOR_X}x@h/db",
    "postgresql://u:%24%7Benv:CONVEYOR_X%7D@h/db",
    "postgresql://h/db?%50ASSWORD=x",
    "http://u:p@h",
]

REFERENCES = [
    "${env:CONVEYOR_PG_URL}",
    "postgresql://app:${env:CONVEYOR_PG_PW}@db:5432/app",
    "postgresql://${env:CONVEYOR_U}:${file:/run/secrets/pg}@db/app",
    "postgresql://app@db/app?password=${env:CONVEYOR_PG_PW}",
    "host=db password=${file:/run/secrets/pg} dbname=app",
    "host='db'password='${env:CONVEYOR_PG_PW}' dbname=app",
    "mysql://root:${env:CONVEYOR_MY_PW}@h/db",
    "redis://:${env:CONVEYOR_REDIS_PW}@h:6379/0",
    "amqp://u:${file:/run/secrets/mq}@h/vhost",
    "postgresql://app@db/app",
]


@pytest.mark.parametrize("value", LITERAL)
def test_a_literal_credential_is_refused_however_it_is_written(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^sink\.url: holds .* written literally"):
        check_placement({"sink": {"url": value}}, {"sink.url"})


@pytest.mark.parametrize("value", REFERENCES)
def test_credentials_given_as_references_pass(value: str) -> None:
    check_placement({"sink": {"url": value}}, {"sink.url"})


def test_urls_in_prose_of_other_fields_are_not_read_as_credentials() -> None:
    prose = "docs at http://wiki:8080/page@anchor; mail http://lists.example ops@example.com"
    check_placement({"description": prose, "sink": {"url": REFERENCES[0]}}, {"sink.url"})
    with pytest.raises(ConfigError, match=r"^description: holds a URL's password"):
        check_placement({"description": "http://u:hunter2@h"}, {"sink.url"})


def test_libpq_reads_every_postgresql_string_the_way_the_client_will() -> None:
    """The PostgreSQL rule is libpq's own parser: on its own it refuses each PostgreSQL
    string of the corpus (``POSTGRESQL://`` is no URI to libpq) and passes each reference."""
    for value in LITERAL:
        if value.startswith(("postgres", "host=", "dbname=")) and _libpq_takes(value):
            assert libpq_credential_problem(value), value
    for value in REFERENCES:
        if value.startswith(("postgres", "host=")):
            assert libpq_credential_problem(value) is None, value


def _libpq_takes(value: str) -> bool:
    try:
        psycopg2.extensions.parse_dsn(value.replace("${env:CONVEYOR_X}", "ref"))
    except psycopg2.ProgrammingError:  # libpq would not connect with it at all
        return False
    return True


# -- M2: the mask keeps a secret only for the same destination ---------------------------


def test_a_mask_sent_back_with_a_changed_destination_is_refused() -> None:
    stored = {
        "sink": {"type": "elasticsearch", "hosts": ["http://127.0.0.1:9200"], "password": "pw1"}
    }
    same = {"sink": {**stored["sink"], "password": MASK, "index": "other"}}
    kept = keep_stored_secrets(same, stored, {"sink.password"})
    assert kept["sink"]["password"] == "pw1"
    moved = {"sink": {**same["sink"], "hosts": ["http://attacker.example:9200"]}}
    with pytest.raises(ConfigError) as e:
        keep_stored_secrets(moved, stored, {"sink.password"})
    assert str(e.value).startswith("sink.password: re-enter sink.password: the destination")
    assert "(hosts)" in str(e.value)
    added = {"sink": {**same["sink"], "port": 9300}}
    with pytest.raises(ConfigError, match=r"destination changed \(port\)"):
        keep_stored_secrets(added, stored, {"sink.password"})


def test_a_masked_secret_that_is_also_the_destination_round_trips() -> None:
    """Issue 45: a connection URL is a secret field and a destination; its mask sent back
    unchanged is the stored URL (it was refused as 'destination changed (url)')."""
    stored = {
        "sink": {"type": "mongodb", "url": "mongodb://app@db:27017", "database": "shop"},
        "catalog": {"uri": "sqlite:///c.db", "token": "t0k"},
    }
    paths = {"sink.url", "catalog.uri", "catalog.token"}
    sent = {"sink": {**stored["sink"], "url": MASK}, "catalog": {"uri": MASK, "token": MASK}}
    kept = keep_stored_secrets(sent, stored, paths)
    assert kept == stored
    moved = {**sent, "sink": {**sent["sink"], "database": "other"}}
    with pytest.raises(
        ConfigError, match=r"re-enter sink.url: the destination changed \(database\)"
    ):
        keep_stored_secrets(moved, stored, paths)
    pointed = {**sent, "catalog": {"uri": "sqlite:///elsewhere.db", "token": MASK}}
    with pytest.raises(ConfigError, match=r"re-enter catalog.token: .*changed \(uri\)"):
        keep_stored_secrets(pointed, stored, paths)


def test_every_config_field_naming_a_place_is_a_destination() -> None:
    """The one list (``secrets.DESTINATION_FIELDS`` and its name rule) covers the models."""
    import re

    place = re.compile(r"url|uri|host|servers?$|endpoint|port$|nodes|vhost|bootstrap")
    fields = set()
    for registry in (SINKS, SOURCES):
        for name in registry.types():
            fields |= set(registry.load(name).config_class.model_fields)
    named_like_a_place = {f for f in fields if place.search(f)}
    missing = {f for f in named_like_a_place if not is_destination_field(f)}
    assert not missing, missing
    for f in ("table", "index", "topic", "password", "batch_size", "max_body_bytes"):
        assert not is_destination_field(f)


# -- L1: shown only when it is one reference ---------------------------------------------


def test_a_secret_field_is_shown_only_as_references() -> None:
    for shown in REFERENCES[:4] + ["redis://:${env:CONVEYOR_REDIS_PW}@h:6379/0"]:
        assert mask_literal(shown) == shown
    for hidden in (
        "${env:CONVEYOR_X}LITERAL_SUFFIX_9911",
        "LITERAL${env:CONVEYOR_X}",
        "${env:CONVEYOR_A}${env:CONVEYOR_B}",
        "plain-token",
        "host=db password=${file:/run/secrets/pg}",
        "postgresql://u:${env:CONVEYOR_X}x@h/db",
    ):
        assert mask_literal(hidden) == MASK, hidden


# -- L4: Conveyor's own settings -----------------------------------------------------------


def test_no_documented_setting_is_readable_by_a_reference_whatever_the_patterns(
    monkeypatch,
) -> None:
    policy = SecretPolicy(file_prefixes=("/nonexistent",), env_patterns=("*",))
    names = environment_names()  # the documented table: each row must be denied
    assert {"CONVEYOR_DEMO_PG_URL", "CONVEYOR_SPARK_REMOTE", "CONVEYOR_META_URL"} <= names
    assert not [n for n in names if policy.env_allowed(n)]
    assert policy.env_allowed("CONVEYOR_ORDERS_PG_URL")
    monkeypatch.setenv("CONVEYOR_SPARK_REMOTE", "sc://h:15002/;token=t0ken-9f")
    with pytest.raises(ConfigError, match="may not be referenced") as e:
        resolve("${env:CONVEYOR_SPARK_REMOTE}", field="sink.url", policy=policy)
    assert "t0ken" not in str(e.value)


def test_a_dead_letter_never_keeps_a_resolved_value(monkeypatch) -> None:
    from conveyor.core.engine.failure import FailedMessage

    resolved_canary(monkeypatch)
    failed = FailedMessage("t", 0, 7, f"value rejected for user {CANARY}", "data")
    assert failed.error == "value rejected for user ${env:CONVEYOR_CANARY_PW}"
