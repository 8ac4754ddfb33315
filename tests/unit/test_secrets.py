"""Secrets by reference: resolution, syntax errors, redaction (conveyor/secrets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.core.errors import ConfigError
from conveyor.secrets import MASK, check_syntax, mask_literal, redact, references, resolve


def test_env_and_file_references_resolve_whole_and_inside_text(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cr:et@/\n")  # a mounted secret with a trailing newline
    spec = {
        "sink": {
            "url": "postgresql://app:${file:" + str(pw) + "}@db:5432/app",
            "token": "${env:TOKEN}",
            "port": 5432,
            "hosts": ["${env:HOST}", "b"],
        }
    }
    out = resolve(spec, environ={"TOKEN": "t0k", "HOST": "a"})
    assert out == {
        "sink": {
            "url": "postgresql://app:s3cr:et@/@db:5432/app",
            "token": "t0k",
            "port": 5432,
            "hosts": ["a", "b"],
        }
    }
    assert references(spec) == ["${file:" + str(pw) + "}", "${env:TOKEN}", "${env:HOST}"]


def test_escaped_reference_is_literal() -> None:
    assert resolve("cost: $${env:X}", environ={}) == "cost: ${env:X}"
    assert references("$${env:X}") == []


def test_an_empty_variable_is_set() -> None:
    assert resolve("${env:EMPTY}", environ={"EMPTY": ""}) == ""


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("${env:MISSING}", "sink.url: ${env:MISSING}: environment variable MISSING is not set"),
        ("${file:/nonexistent/x}", "sink.url: ${file:/nonexistent/x}: cannot read: No such file"),
        ("${file:relative/x}", "sink.url: ${file:relative/x}: the path must be absolute"),
        ("${env:1BAD}", "sink.url: ${env:1BAD}: '1BAD' is not an environment variable name"),
    ],
)
def test_resolution_errors_name_the_field_and_the_reference(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve({"sink": {"url": value}}, environ={})
    assert str(e.value).startswith(message)


def test_syntax_is_checked_without_reading_anything() -> None:
    check_syntax({"sink": {"url": "${env:PG_URL}", "x": "$${literal"}})  # no error, nothing read
    with pytest.raises(ConfigError, match=r"sink\.url: \$\{file:x\}: the path must be absolute"):
        check_syntax({"sink": {"url": "${file:x}"}})
    with pytest.raises(ConfigError, match=r"sink\.url: has an unterminated reference"):
        check_syntax({"sink": {"url": "postgresql://a:${env:PW@db/x"}})


def test_sink_templates_and_unknown_providers_are_left_as_written() -> None:
    # Redis, RabbitMQ and Kafka templates use the same brackets: they are not references.
    spec = {"sink": {"commands": ["HSET o:${payload.id} s ${payload.status}"], "k": "${topic}"}}
    check_syntax(spec)
    assert references(spec) == []
    assert resolve(spec, environ={}) == spec
    assert resolve("${vault:secret/x}", environ={}) == "${vault:secret/x}"  # as Kafka Connect


def test_a_secret_field_shows_its_references_and_masks_literals() -> None:
    assert mask_literal("${env:PG_URL}") == "${env:PG_URL}"
    assert mask_literal("postgresql://app:${env:PW}@db/app") == "postgresql://app:${env:PW}@db/app"
    assert mask_literal("postgresql://app:${file:/run/s/pw}@db/x") == (
        "postgresql://app:${file:/run/s/pw}@db/x"
    )
    assert mask_literal("hunter2") == MASK
    # A reference elsewhere does not unmask a literal password.
    assert mask_literal("postgresql://app:hunter2@${env:HOST}/app") == MASK


def test_redact_masks_secret_fields_and_literal_url_passwords_anywhere() -> None:
    spec = {
        "name": "c",
        "sink": {"type": "redis", "password": "hunter2", "url": "redis://u:pw1@h:6379/0"},
        "source": {"bootstrap_servers": "k:9092", "note": "see http://x:pw2@y/z"},
        "description": "${env:DESC}",
    }
    out = redact(spec, lambda f: f == "sink.password")
    assert out["sink"]["password"] == MASK
    assert out["sink"]["url"] == f"redis://u:{MASK}@h:6379/0"
    assert out["source"]["note"] == f"see http://x:{MASK}@y/z"
    assert out["description"] == "${env:DESC}"
    assert "hunter2" not in repr(out) and "pw1" not in repr(out) and "pw2" not in repr(out)


def test_a_run_keeps_kafka_secrets_as_references_for_the_client_and_resolves_the_rest(
    tmp_path: Path, monkeypatch
) -> None:
    """One resolver, two moments: a Kafka connection's secrets stay references in the run's
    spec (the client resolves them at each connection, so a rotated file is read again);
    every other reference is resolved when the run starts."""
    from conveyor.brokers.connection import kafka_python_options
    from conveyor.sinks.base import secret
    from conveyor.specs import from_mapping, resolved

    pw = tmp_path / "kafka-pw"
    pw.write_text("first\n")
    monkeypatch.setenv("ORDERS_PG_URL", "postgresql://app@db/app")
    ls = from_mapping(
        {
            "name": "orders",
            "source": {
                "topics": ["orders"],
                "bootstrap_servers": "kafka:9093",
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_username": "conveyor",
                "sasl_password": f"${{file:{pw}}}",
            },
            "sink": {"type": "postgres", "url": "${env:ORDERS_PG_URL}", "table": "orders"},
        },
        source="test",
        fallback_name="orders",
    )
    assert ls.ok, ls.error
    live = resolved(ls)
    assert live.spec is not None and live.sink is not None
    assert live.spec.source.sasl_password == f"${{file:{pw}}}"
    assert secret(live.sink.url) == "postgresql://app@db/app"  # type: ignore[attr-defined]
    options = kafka_python_options(live.spec.source, "consumer", prefix="source")
    assert options["sasl_plain_password"] == "first"
    pw.write_text("rotated\n")
    options = kafka_python_options(live.spec.source, "consumer", prefix="source")
    assert options["sasl_plain_password"] == "rotated"
