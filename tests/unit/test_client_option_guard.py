"""client_options that reach the run's host are refused (issue 34, H2): options that load
code (plugin.library.paths, OpenSSL engines and providers), run a command (kinit), read a
file (every *.location, keytab, kafka-python's *file) or carry key material (*.pem), and
OAUTHBEARER set up outside the connection. One rule (``core.connection``), for the
source and the Kafka sink, under both clients' names; ordinary tuning stays accepted."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.config.specs import parse_spec
from conveyor.core.connection import option_host_problem
from conveyor.core.errors import ConfigError
from conveyor.sinks import parse_sink_config

# librdkafka (source.client: confluent, the Kafka sink's client: confluent).
LIBRDKAFKA_REFUSED = [
    ("plugin.library.paths", "/tmp/evil.so", "loads native code"),
    ("ssl.engine.location", "/tmp/engine.so", "loads native code"),
    ("ssl.engine.id", "dynamic", "OpenSSL engine"),
    ("ssl.providers", "legacy,evil", "OpenSSL providers"),
    ("sasl.kerberos.kinit.cmd", "touch /tmp/pwned", "shell command"),
    ("sasl.kerberos.principal", "x; touch /tmp/pwned", "kinit shell command"),
    ("sasl.kerberos.keytab", "/etc/krb5.keytab", "keytab"),
    ("ssl.ca.location", "/etc/passwd", "names a file"),
    ("ssl.crl.location", "/etc/passwd", "names a file"),
    ("ssl.keystore.location", "/etc/passwd", "names a file"),
    ("https.ca.location", "/etc/passwd", "names a file"),
    ("ssl.ca.pem", "-----BEGIN CERTIFICATE-----", "key material"),
    ("https.ca.pem", "-----BEGIN CERTIFICATE-----", "key material"),
    ("sasl.oauthbearer.method", "oidc", "OAUTHBEARER"),
    ("sasl.oauthbearer.token.endpoint.url", "http://169.254.169.254/", "OAUTHBEARER"),
    ("sasl.oauthbearer.client.id", "x", "OAUTHBEARER"),
    ("sasl.oauthbearer.assertion.private.key.file", "/etc/passwd", "OAUTHBEARER"),
    ("sasl.oauthbearer.metadata.authentication.type", "azure_imds", "OAUTHBEARER"),
    ("enable.sasl.oauthbearer.unsecure.jwt", True, "OAUTHBEARER"),
    ("Plugin.Library.Paths", "/tmp/evil.so", "loads native code"),
    (" plugin.library.paths", "/tmp/evil.so", "loads native code"),
]
# kafka-python (client: kafka-python): the same reach under its names.
KAFKA_PYTHON_REFUSED = [
    ("ssl_crlfile", "/etc/passwd", "names a file"),
    ("ssl_cafile", "/etc/passwd", "names a file"),
    ("sasl_kerberos_keytab", "/etc/krb5.keytab", "keytab"),
    ("plugin_library_paths", "/tmp/evil.so", "loads native code"),
]
# Tuning the repository's tests, benchmarks and docs use, and common others.
LIBRDKAFKA_ACCEPTED = {
    "socket.keepalive.enable": True,
    "queue.buffering.max.messages": 7,
    "fetch.min.bytes": 1,
    "queued.max.messages.kbytes": 65536,
    "linger.ms": 5,
    "compression.type": "lz4",
    "debug": "broker,protocol",
    "ssl.cipher.suites": "ECDHE-RSA-AES256-GCM-SHA384",
    "sasl.kerberos.min.time.before.relogin": 60000,
}
KAFKA_PYTHON_ACCEPTED = {
    "fetch_min_bytes": 1024,
    "metadata_max_age_ms": 60_000,
    "max_partition_fetch_bytes": 1 << 20,
    "request_timeout_ms": 30_000,
}


@pytest.fixture(autouse=True)
def _secrets_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    """About client options, not the secrets policy: references may read any variable."""
    monkeypatch.setenv("CONVEYOR_SECRET_ENV", "*")


def source_spec(client: str, options: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "guarded",
        "source": {"topics": ["t"], "client": client, "client_options": options},
        "sink": {"type": "localfile", "path": "never-written"},
    }


def kafka_sink(client: str, options: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "kafka",
        "bootstrap_servers": "127.0.0.1:9092",
        "topic": "out",
        "client": client,
        "client_options": options,
    }


@pytest.mark.parametrize(("name", "value", "why"), LIBRDKAFKA_REFUSED + KAFKA_PYTHON_REFUSED)
def test_the_rule_names_the_option_and_says_why(name: str, value: Any, why: str) -> None:
    problem = option_host_problem(name)
    assert problem is not None and repr(name) in problem and why in problem


@pytest.mark.parametrize(("name", "value", "why"), LIBRDKAFKA_REFUSED)
def test_source_and_sink_refuse_librdkafka_host_options(name: str, value: Any, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_spec(source_spec("confluent", {name: value}))
    assert "source.client_options" in str(e.value) and why in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_sink_config(kafka_sink("confluent", {name: value}))
    assert "sink.client_options" in str(e.value) and why in str(e.value)


@pytest.mark.parametrize(("name", "value", "why"), KAFKA_PYTHON_REFUSED)
def test_source_and_sink_refuse_kafka_python_host_options(name: str, value: Any, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_spec(source_spec("kafka-python", {name: value}))
    assert "source.client_options" in str(e.value) and why in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_sink_config(kafka_sink("kafka-python", {name: value}))
    assert "sink.client_options" in str(e.value) and why in str(e.value)


def test_ordinary_tuning_is_still_accepted_on_both_sides_and_clients() -> None:
    spec, _ = parse_spec(source_spec("confluent", LIBRDKAFKA_ACCEPTED))
    assert dict(spec.source.client_options) == LIBRDKAFKA_ACCEPTED
    spec, _ = parse_spec(source_spec("kafka-python", KAFKA_PYTHON_ACCEPTED))
    assert dict(spec.source.client_options) == KAFKA_PYTHON_ACCEPTED
    sink = parse_sink_config(kafka_sink("confluent", LIBRDKAFKA_ACCEPTED))
    assert dict(sink.client_options) == LIBRDKAFKA_ACCEPTED  # type: ignore[attr-defined]
    sink = parse_sink_config(kafka_sink("kafka-python", {"linger_ms": 5}))
    assert dict(sink.client_options) == {"linger_ms": 5}  # type: ignore[attr-defined]
    for name in [*LIBRDKAFKA_ACCEPTED, *KAFKA_PYTHON_ACCEPTED]:
        assert option_host_problem(name) is None, name
