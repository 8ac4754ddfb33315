"""The Kafka connection model and its mapping onto kafka-python and librdkafka.

SASL cannot be tested against a server here (README, "Kafka connections"): these are the
request-building tests. The librdkafka mapping is checked by librdkafka itself: a
confluent-kafka client refuses unknown or inconsistent properties when it is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.brokers.connection import (
    check_client_options,
    classify_kafka_error,
    kafka_python_options,
    librdkafka_config,
    resolve_secret,
)
from conveyor.core.connection import OPTION_NAMES, KafkaConnection
from conveyor.core.errors import ConfigError
from conveyor.core.model import ConnectorSpec, SourceSpec


@pytest.fixture(autouse=True)
def _secrets_readable(file_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the clients' options, not the secrets policy (tests/unit/
    test_secrets.py): the operator lets references read any variable and the files of
    ``tmp_path/secrets``; certificates are files of ``tmp_path``, a root of spec paths."""
    monkeypatch.setenv("CONVEYOR_SECRET_ENV", "*")
    monkeypatch.setenv("CONVEYOR_SECRET_FILES", str(file_root / "secrets"))
    (file_root / "secrets").mkdir()


def conn(**kw: Any) -> KafkaConnection:
    return KafkaConnection(bootstrap_servers="b1:9092,b2:9093", **kw)


def scram(**kw: Any) -> KafkaConnection:
    return conn(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password="${env:KAFKA_PW}",
        **kw,
    )


# -- the model -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"security_protocol": "SASL_SSL"}, "sasl_mechanism: required"),
        (
            {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"},
            "sasl_username: required",
        ),
        (
            {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "u",
                "sasl_password": "hunter2",
            },
            "must be a reference",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
            "sasl_oauthbearer_token: required",
        ),
        ({"sasl_mechanism": "PLAIN"}, "only with security_protocol SASL"),
        ({"ssl_cafile": "ca.pem"}, "ssl_cafile: only with security_protocol SSL"),
        ({"security_protocol": "SSL", "ssl_certfile": "c.pem"}, "ssl_keyfile: give both"),
        ({"security_protocol": "SSL", "ssl_key_password": "${env:X}"}, "only with ssl_keyfile"),
        ({"sasl_password": "${env:not a name}"}, "not an environment variable name"),
        ({"client_options": {"sasl_plain_password": "x"}}, "looks like a secret"),
        ({"client_options": {"ssl.key.password": "x"}}, "looks like a secret"),
        ({"bootstrap_servers": "nohost"}, "is not host:port"),
    ],
)
def test_bad_connections_are_refused_naming_the_field(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KafkaConnection(**{"bootstrap_servers": "b:1", **kw})


def test_the_spec_stores_references_never_passwords() -> None:
    spec = ConnectorSpec.model_validate(
        {
            "name": "c",
            "source": {
                "topics": ["t"],
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-256",
                "sasl_username": "svc",
                "sasl_password": "${file:/run/secrets/kafka}",
            },
            "sink": {"type": "localfile", "path": "x"},
        }
    )
    assert '"sasl_password":"${file:/run/secrets/kafka}"' in spec.model_dump_json()


def test_every_field_has_a_name_in_both_clients() -> None:
    fields = set(KafkaConnection.model_fields) - {"client_options"}
    assert fields == set(OPTION_NAMES), "a connection field without a client mapping"


# -- secrets -----------------------------------------------------------------------------


def test_secrets_come_from_the_environment_or_a_file_read_at_each_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAFKA_PW", "from-env")
    assert resolve_secret("${env:KAFKA_PW}", field="f") == "from-env"
    f = tmp_path / "secrets" / "pw"
    f.write_text("v1\n")
    assert resolve_secret(f"${{file:{f}}}", field="f") == "v1"  # the trailing newline goes
    f.write_text("v2")
    assert resolve_secret(f"${{file:{f}}}", field="f") == "v2"  # a rotated file is read again
    monkeypatch.delenv("KAFKA_PW")
    with pytest.raises(
        ConfigError,
        match=r"source.sasl_password: \$\{env:KAFKA_PW\}: environment variable KAFKA_PW is not set",
    ):
        resolve_secret("${env:KAFKA_PW}", field="source.sasl_password")
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_secret(f"${{file:{tmp_path / 'secrets' / 'missing'}}}", field="f")


# -- kafka-python ------------------------------------------------------------------------


def _files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        p = tmp_path / f"{name}.pem"
        p.write_text("PEM")
        out[name] = str(p)
    return out


def test_kafka_python_options_for_scram_over_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    monkeypatch.setenv("KAFKA_PW", "s3cret")
    monkeypatch.setenv("KEY_PW", "k3y")
    c = scram(**_files(tmp_path), ssl_key_password="${env:KEY_PW}", client_id="me")
    for role, cls in (("consumer", KafkaConsumer), ("producer", KafkaProducer)):
        kw = kafka_python_options(c, role, prefix="source")  # type: ignore[arg-type]
        assert set(kw) <= set(cls.DEFAULT_CONFIG)
        assert kw["bootstrap_servers"] == ["b1:9092", "b2:9093"]
        assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
        assert kw["sasl_plain_username"] == "svc" and kw["sasl_plain_password"] == "s3cret"
        assert kw["ssl_cafile"].endswith("ssl_cafile.pem") and kw["ssl_password"] == "k3y"
        assert kw["ssl_check_hostname"] is True and kw["client_id"] == "me"


def test_kafka_python_oauthbearer_token_is_read_at_each_connection(tmp_path: Path) -> None:
    from kafka.net.sasl.oauth import AbstractTokenProvider

    token = tmp_path / "secrets" / "token"
    token.write_text("t1\n")
    c = conn(
        security_protocol="SASL_SSL",
        sasl_mechanism="OAUTHBEARER",
        sasl_oauthbearer_token=f"${{file:{token}}}",
    )
    kw = kafka_python_options(c, "consumer", prefix="source")
    provider = kw["sasl_oauth_token_provider"]
    assert isinstance(provider, AbstractTokenProvider)
    assert provider.token() == "t1"
    token.write_text("t2")
    assert provider.token() == "t2"


def test_gssapi_without_its_package_is_a_config_error() -> None:
    pytest.importorskip("kafka")
    try:
        import gssapi  # noqa: F401

        pytest.skip("gssapi is installed here")
    except ImportError:
        pass
    c = conn(security_protocol="SASL_PLAINTEXT", sasl_mechanism="GSSAPI")
    with pytest.raises(ConfigError, match="source.sasl_mechanism: GSSAPI needs the Python package"):
        kafka_python_options(c, "consumer", prefix="source")


def test_files_must_be_readable(tmp_path: Path) -> None:
    c = conn(security_protocol="SSL", ssl_cafile=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match="sink.ssl_cafile: .* cannot be read"):
        kafka_python_options(c, "producer", prefix="sink")


def test_client_options_pass_through_checked_against_the_client() -> None:
    c = conn(client_options={"fetch_min_bytes": 1024, "metadata_max_age_ms": 60_000})
    kw = kafka_python_options(c, "consumer", prefix="source")
    assert kw["fetch_min_bytes"] == 1024 and kw["metadata_max_age_ms"] == 60_000
    with pytest.raises(
        ConfigError,
        match="'fetch_min_byte' is not a kafka-python consumer setting; did you mean 'fetch_min_bytes'",
    ):
        check_client_options(
            conn(client_options={"fetch_min_byte": 1}), "consumer", prefix="source"
        )
    with pytest.raises(ConfigError, match="'group_id' is set by Conveyor"):
        check_client_options(conn(client_options={"group_id": "x"}), "consumer", prefix="source")
    with pytest.raises(ConfigError, match="is not a kafka-python producer setting"):
        check_client_options(conn(client_options={"fetch_min_bytes": 1}), "producer", prefix="sink")


# -- librdkafka ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"security_protocol": "SSL", "ssl_check_hostname": False},
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-256",
            "sasl_username": "svc",
            "sasl_password": "${env:KAFKA_PW}",
        },
        {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "PLAIN",
            "sasl_username": "svc",
            "sasl_password": "${env:KAFKA_PW}",
        },
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "OAUTHBEARER",
            "sasl_oauthbearer_token": "${env:KAFKA_PW}",
        },
    ],
)
def test_librdkafka_config_is_accepted_by_librdkafka(
    kw: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from confluent_kafka import Consumer, Producer

    monkeypatch.setenv("KAFKA_PW", "s3cret")
    files = {}
    if kw.get("security_protocol", "").endswith("SSL"):
        from tests.sources.tls import make_certificates

        certs = make_certificates(tmp_path)
        files = {"ssl_cafile": str(certs.ca)}
    c = conn(client_id="me", **kw, **files)
    conf = librdkafka_config(c, prefix="source")
    assert conf["bootstrap.servers"] == "b1:9092,b2:9093" and conf["client.id"] == "me"
    if "sasl_password" in kw:
        assert conf["sasl.password"] == "s3cret" and conf["sasl.username"] == "svc"
    if kw.get("sasl_mechanism") == "OAUTHBEARER":
        token, expiry = conf["oauth_cb"](None)
        assert token == "s3cret" and expiry > 0
    if kw.get("ssl_check_hostname") is False:
        assert conf["ssl.endpoint.identification.algorithm"] == "none"
    # librdkafka validates every property when the client is built (no connection yet).
    Producer(conf).flush(0)
    Consumer({**conf, "group.id": "g"}).close()


# -- error classes -------------------------------------------------------------------------


def test_non_retriable_kafka_errors_are_permanent_outages_transient() -> None:
    import ssl

    from kafka import errors as E

    assert (
        classify_kafka_error(
            E.UnsupportedCodecError("Libraries for snappy compression codec not found")
        )
        == "permanent"
    )
    assert classify_kafka_error(E.TopicAuthorizationFailedError()) == "permanent"
    assert classify_kafka_error(E.SaslAuthenticationFailedError()) == "permanent"
    assert classify_kafka_error(E.InvalidReplicationFactorError()) == "permanent"  # non-retriable
    assert classify_kafka_error(E.CorruptRecordError()) == "data"
    assert classify_kafka_error(E.KafkaConnectionError()) == "transient"
    assert classify_kafka_error(E.KafkaTimeoutError()) == "transient"
    assert classify_kafka_error(E.NotLeaderForPartitionError()) == "transient"
    assert classify_kafka_error(E.UnknownError()) == "transient"
    assert (
        classify_kafka_error(ssl.SSLCertVerificationError("certificate verify failed"))
        == "permanent"
    )
    assert classify_kafka_error(OSError("connection reset")) == "transient"


def test_librdkafka_errors_get_the_same_classes() -> None:
    """confluent-kafka's errors go through the one classifier: the same meaning, the same class."""
    from confluent_kafka import KafkaError, KafkaException

    def rd(code: int, text: str = "", *, fatal: bool = False) -> KafkaException:
        return KafkaException(KafkaError(code, text, fatal=fatal))

    assert classify_kafka_error(rd(KafkaError.TOPIC_AUTHORIZATION_FAILED)) == "permanent"
    assert classify_kafka_error(rd(KafkaError.SASL_AUTHENTICATION_FAILED)) == "permanent"
    assert classify_kafka_error(rd(KafkaError._AUTHENTICATION)) == "permanent"
    assert classify_kafka_error(rd(KafkaError._INVALID_ARG, "No such property")) == "permanent"
    assert classify_kafka_error(rd(KafkaError.UNSUPPORTED_COMPRESSION_TYPE)) == "permanent"
    assert classify_kafka_error(rd(KafkaError.INVALID_MSG)) == "data"
    assert classify_kafka_error(rd(KafkaError.MSG_SIZE_TOO_LARGE)) == "data"
    # what librdkafka marks fatal is permanent, whatever its code
    assert classify_kafka_error(rd(KafkaError._FENCED, fatal=True)) == "permanent"
    assert (
        classify_kafka_error(
            rd(KafkaError._SSL, "SSL handshake failed: certificate verify failed: broker cert")
        )
        == "permanent"
    )
    assert classify_kafka_error(rd(KafkaError._TRANSPORT, "Connection refused")) == "transient"
    assert classify_kafka_error(rd(KafkaError._ALL_BROKERS_DOWN)) == "transient"
    assert classify_kafka_error(rd(KafkaError._TIMED_OUT)) == "transient"
    assert classify_kafka_error(rd(KafkaError.NOT_LEADER_FOR_PARTITION)) == "transient"
    assert classify_kafka_error(KafkaError(KafkaError._TRANSPORT)) == "transient"


def test_source_spec_topics_regex_and_start_from() -> None:
    s = SourceSpec(topics_regex=r"orders\..*")
    assert (
        s.matches("orders.eu") and not s.matches("orders") and not s.matches("__consumer_offsets")
    )
    with pytest.raises(ValidationError, match="give topics, topics_regex, or both"):
        SourceSpec()
    with pytest.raises(ValidationError, match="not a regular expression"):
        SourceSpec(topics_regex="(")
    with pytest.raises(ValidationError, match="is not earliest, latest or an ISO 8601 time"):
        SourceSpec(topics=["t"], start_from="yesterday")
    assert (
        SourceSpec(topics=["t"], start_from="2026-11-01T00:00:00Z").isolation_level
        == "read_committed"
    )
