"""Secrets by reference: resolution, syntax errors, redaction (conveyor/core/trust/secrets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.core.errors import ConfigError
from conveyor.core.trust.secrets import (
    MASK,
    SecretPolicy,
    check_placement,
    check_syntax,
    keep_stored_secrets,
    mask_literal,
    redact,
    references,
    resolve,
)

ANY = SecretPolicy(file_prefixes=("/",), env_patterns=("*",))  # the resolver alone


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
    out = resolve(spec, environ={"TOKEN": "t0k", "HOST": "a"}, policy=ANY)
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
    assert resolve("cost: $${env:X}", environ={}, policy=ANY) == "cost: ${env:X}"
    assert references("$${env:X}") == []


def test_an_empty_variable_is_set() -> None:
    assert resolve("${env:EMPTY}", environ={"EMPTY": ""}, policy=ANY) == ""


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
        resolve({"sink": {"url": value}}, environ={}, policy=ANY)
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
    from conveyor.config.specs import from_mapping, resolved
    from conveyor.sinks.base import secret

    pw = tmp_path / "kafka-pw"
    pw.write_text("first\n")
    monkeypatch.setenv("CONVEYOR_SECRET_FILES", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_ORDERS_PG_URL", "postgresql://app@db/app")
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
            "sink": {"type": "postgres", "url": "${env:CONVEYOR_ORDERS_PG_URL}", "table": "orders"},
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


# -- bounded: the operator's policy --------------------------------------------------------


def _err(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    return str(e.value)


def test_files_are_read_only_under_the_allowed_directories_symlinks_resolved(
    tmp_path: Path,
) -> None:
    secrets, outside = tmp_path / "secrets", tmp_path / "outside"
    secrets.mkdir()
    outside.mkdir()
    canary = "canary-7f3a9c"
    (secrets / "pg").write_text("pw\n")
    (outside / "host-file").write_text(canary)
    (secrets / "link").symlink_to(outside / "host-file")
    (secrets / "dirlink").symlink_to(outside)
    env = {"CONVEYOR_SECRET_FILES": str(secrets)}
    pol = SecretPolicy.from_environ(env)
    assert resolve("${file:" + str(secrets / "pg") + "}", environ=env) == "pw"
    refused = [
        str(outside / "host-file"),
        str(secrets / "link"),  # a symlink out of the directory
        str(secrets / "dirlink" / "host-file"),
        str(secrets) + "/../outside/host-file",  # `..`
        str(secrets),  # the directory itself
        "/etc/passwd",
    ]
    for path in refused:
        msg = _err(lambda p=path: resolve({"sink": {"url": "${file:" + p + "}"}}, policy=pol))
        assert msg.startswith(f"sink.url: ${{file:{path}}}: the file is outside the directories")
        assert canary not in msg


def test_default_file_directory_is_conveyor_home_secrets(tmp_path: Path) -> None:
    pol = SecretPolicy.from_environ({"CONVEYOR_HOME": str(tmp_path)})
    assert pol.file_prefixes == (str((tmp_path / "secrets").resolve()),)
    assert "not an absolute directory" in _err(
        lambda: SecretPolicy.from_environ({"CONVEYOR_SECRET_FILES": "rel/dir"})
    )


def test_variables_are_read_only_when_allowed_never_conveyors_own() -> None:
    env = {
        "CONVEYOR_PG_PW": "ok",
        "HOME_SECRET": "canary-1",
        "CONVEYOR_META_URL": "postgresql://m:canary-2@db/meta",
        "CONVEYOR_API_TOKEN": "canary-3",
    }
    assert resolve("${env:CONVEYOR_PG_PW}", environ=env) == "ok"  # default CONVEYOR_*
    for name in ("HOME_SECRET", "CONVEYOR_META_URL", "CONVEYOR_API_TOKEN"):
        msg = _err(lambda n=name: resolve({"sink": {"password": "${env:" + n + "}"}}, environ=env))
        assert msg.startswith(f"sink.password: ${{env:{name}}}: variable {name} may not be")
        assert "canary" not in msg
    wide = {**env, "CONVEYOR_SECRET_ENV": "HOME_*,*"}
    assert resolve("${env:HOME_SECRET}", environ=wide) == "canary-1"
    assert "may not be referenced" in _err(
        lambda: resolve("${env:CONVEYOR_API_TOKEN}", environ=wide)  # never, whatever the patterns
    )


def test_references_stand_only_in_secret_fields() -> None:
    secret = {"sink.url", "sink.password"}
    check_placement({"sink": {"url": "${env:CONVEYOR_X}", "table": "orders"}}, secret)
    for field, value in [
        ("sink.table", "${file:/etc/passwd}"),
        ("name", "${env:CONVEYOR_X}"),
        ("sink.hosts[1]", "pre-${env:CONVEYOR_X}"),
    ]:
        *parents, leaf = field.replace("[1]", "").split(".")
        data: dict = {}
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = ["a", value] if field.endswith("[1]") else value
        msg = _err(lambda d=data: check_placement(d, secret))
        assert msg.startswith(f"{field}: holds a ${{env:...}} / ${{file:...}} reference")
        assert "sink.password, sink.url" in msg


@pytest.mark.parametrize(
    "value",
    [
        "postgresql://u:hunter2@h/db",
        "postgresql://h/db?sslmode=require&password=hunter2",
        "host=h password=hunter2 dbname=x",
        "host=h password='hunter 2'",
        "mysql://root:hunter2@h:3306/db",
        "redis://:hunter2@h:6379/0",
        "amqp://u:hunter2@h/%2F",
        "mongodb://u:hunter2@h1,h2/?replicaSet=rs",
    ],
)
def test_literal_credentials_in_connection_strings_are_refused(value: str) -> None:
    msg = _err(lambda: check_placement({"sink": {"url": value}}, {"sink.url"}))
    assert msg.startswith("sink.url: holds ") and "written literally" in msg
    assert "hunter" not in msg
    # The same credential as a reference passes.
    ok = value.replace("'hunter 2'", "hunter2").replace("hunter2", "${env:CONVEYOR_PG_PW}")
    check_placement({"sink": {"url": ok}}, {"sink.url"})


def test_connection_strings_without_credentials_pass() -> None:
    for value in ["postgresql://u@h/db", "http://[::1]:4000", "redis://h:6379/0", "orders"]:
        check_placement({"sink": {"url": value, "x": value}}, {"sink.url"})


def test_a_mask_sent_back_keeps_the_stored_secret_or_is_refused() -> None:
    stored = {"name": "c", "source": {"type": "webhook", "token": "t0k-stored"}}
    sent = {"name": "c", "source": {"type": "webhook", "token": MASK, "max_body_bytes": 9000}}
    out = keep_stored_secrets(sent, stored, {"source.token"})
    assert out == {
        "name": "c",
        "source": {"type": "webhook", "token": "t0k-stored", "max_body_bytes": 9000},
    }
    assert sent["source"]["token"] == MASK  # the request is not changed in place
    msg = _err(lambda: keep_stored_secrets(sent, {"source": {}}, {"source.token"}))
    assert msg.startswith("source.token: is the mask") and "no stored secret" in msg
    # Never stored: a mask that reaches validation is refused too.
    assert "holds the mask" in _err(lambda: check_placement(sent, {"source.token"}))


def test_errors_of_resolved_values_never_quote_them(tmp_path: Path, monkeypatch) -> None:
    """Whatever a validator writes about a resolved value, the run's error masks it."""
    from conveyor.config.specs import from_mapping, resolved

    (tmp_path / "url").write_text("http://canary-6be1/x\n")
    monkeypatch.setenv("CONVEYOR_SECRET_FILES", str(tmp_path))
    ls = from_mapping(
        {
            "name": "c",
            "source": {"topics": ["o"]},
            "sink": {"type": "rabbitmq", "url": "${file:" + str(tmp_path / "url") + "}"},
        },
        source="test",
        fallback_name="c",
    )
    assert ls.ok, ls.error
    with pytest.raises(ConfigError, match=r"sink\.url: must be amqp://") as e:
        resolved(ls)
    assert "canary" not in str(e.value)
