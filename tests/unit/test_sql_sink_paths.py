"""Issue 45 (the SQL sinks' leftover): the files a SQL sink's connection opens follow the one path
rule (``core/trust/paths.py``): MySQL's TLS files (``tls_ca_file``, ``tls_cert_file``,
``tls_key_file``) and the file parameters of a PostgreSQL connection string (libpq's
``sslrootcert``, ``sslcert``, ``sslkey``, ``sslcrl``, ``passfile``, ``servicefile`` and the
file parameters of the service it names), in a URL's query or a key=value DSN. Refused with a
ConfigError naming the field when the spec is validated, and again right before connecting
(a symlink swapped in between), without opening anything; no server is needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conveyor.config.specs import parse_spec
from conveyor.core.errors import ConfigError
from conveyor.core.trust import paths
from conveyor.sinks import build_sink
from conveyor.sinks.postgres_config import check_service, libpq_files

PG = "postgresql://conveyor@127.0.0.1:5432/test"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$CONVEYOR_HOME in tmp_path/home with a tls/ directory and the secrets directory; the
    default roots; tmp_path/outside beside it."""
    for var in (paths.ROOTS_ENV, "CONVEYOR_SECRET_FILES", "CONVEYOR_META_URL", *paths.OWN_ENV):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "tls").mkdir()
    for name in ("ca.pem", "client.pem", "client.key"):
        (home / "tls" / name).write_text("not read by these tests")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "key.pem").write_text("-----BEGIN PRIVATE KEY----- canary-77")
    monkeypatch.setenv("CONVEYOR_HOME", str(home))
    return home


def libpq_knows(url: str) -> bool:
    """Whether the libpq psycopg2 connects with parses ``url`` (its parameters are its own)."""
    from psycopg2.extensions import parse_dsn

    try:
        parse_dsn(url)
    except Exception:  # noqa: BLE001
        return False
    return True


def spec(sink: dict[str, Any]) -> dict[str, Any]:
    return {"name": "orders", "source": {"topics": ["o"]}, "sink": sink}


def refused(sink: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_spec(spec(sink))
    return str(e.value)


def postgres(url: str) -> dict[str, Any]:
    return {"type": "postgres", "url": url, "table": "orders"}


def mysql(**over: Any) -> dict[str, Any]:
    return {"type": "mysql", "url": "mysql://root@127.0.0.1:3306/test", "table": "orders", **over}


# -- PostgreSQL: the connection string's file parameters ------------------------------------


@pytest.mark.parametrize(
    "param", ["sslrootcert", "sslcert", "sslkey", "sslcrl", "sslcrldir", "passfile", "servicefile"]
)
def test_a_file_parameter_of_the_url_outside_the_roots_is_refused(home: Path, param: str) -> None:
    url = f"{PG}?sslmode=verify-full&{param}=/etc/passwd"
    if not libpq_knows(url):
        pytest.skip(f"this libpq has no {param} (it refuses the URL on connect)")
    message = refused(postgres(url))
    assert "sink.url" in message and f"{param}:" in message and "outside the roots" in message


def test_the_key_value_dsn_form_and_the_secrets_directory_are_refused(home: Path) -> None:
    dsn = f"host=127.0.0.1 dbname=test sslkey={home / 'secrets' / 'k.pem'}"
    message = refused(postgres(dsn))
    assert "sink.url" in message and "sslkey:" in message and "secrets directory" in message
    assert "sink.url" in refused(postgres(f"{PG}?sslcrl=../crl.pem"))


def test_file_parameters_under_a_root_resolve_to_their_real_path(home: Path) -> None:
    url = f"{PG}?sslmode=verify-ca&sslrootcert=tls/ca.pem&sslcert=tls/client.pem&sslkey=tls/client.key"
    parse_spec(spec(postgres(url)))  # under the home: fine
    assert libpq_files(url) == {
        "sslrootcert": str(home / "tls" / "ca.pem"),
        "sslcert": str(home / "tls" / "client.pem"),
        "sslkey": str(home / "tls" / "client.key"),
    }
    assert libpq_files(f"{PG}?sslrootcert=system&sslmode=verify-full") == {}  # libpq's own CAs
    assert libpq_files(PG) == {}


def test_a_file_swapped_for_a_link_out_is_refused_before_connecting(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg2

    sink = build_sink(postgres(f"{PG}?sslmode=verify-ca&sslrootcert=tls/ca.pem"))
    (home / "tls" / "ca.pem").unlink()
    (home / "tls" / "ca.pem").symlink_to(home.parent / "outside" / "key.pem")
    monkeypatch.setattr(psycopg2, "connect", lambda *a, **k: pytest.fail("connected"))
    with pytest.raises(ConfigError, match=r"sink.url: sslrootcert: .*through a symbolic link"):
        sink.init_sink()


def test_a_service_file_naming_a_file_outside_the_roots_is_refused_unquoted(home: Path) -> None:
    outside = home.parent / "outside" / "key.pem"
    service_file = home / "tls" / "pg_service.conf"
    service_file.write_text(
        f"[lake]\nhost=127.0.0.1\ndbname=test\nsslkey={outside}\n\n[ok]\nsslrootcert=tls/ca.pem\n"
    )
    with pytest.raises(ConfigError) as e:
        check_service(str(service_file), "lake")
    message = str(e.value)
    assert "sink.url" in message and "service 'lake'" in message and "sslkey" in message
    assert str(outside) not in message and "canary" not in message
    check_service(str(service_file), "ok")
    check_service(str(service_file), "missing")  # libpq's error, on connect


def test_a_servicefile_parameter_is_held_to_the_rule_before_connecting(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg2

    (home / "tls" / "pg_service.conf").write_text(
        f"[lake]\nsslkey={home.parent / 'outside' / 'key.pem'}\n"
    )
    url = "postgresql:///?service=lake&servicefile=tls/pg_service.conf"
    if not libpq_knows(url):
        pytest.skip("this libpq has no servicefile parameter (it refuses the URL on connect)")
    sink = build_sink(postgres(url))  # the service file is read only right before connecting
    monkeypatch.setattr(psycopg2, "connect", lambda *a, **k: pytest.fail("connected"))
    with pytest.raises(ConfigError, match="service 'lake' of the servicefile names a sslkey"):
        sink.init_sink()


# -- MySQL: the TLS files ---------------------------------------------------------------------


@pytest.mark.parametrize("field", ["tls_ca_file", "tls_cert_file"])
def test_a_mysql_tls_file_outside_the_roots_is_refused(home: Path, field: str) -> None:
    message = refused(mysql(**{field: "/etc/ssl/certs/ca-certificates.crt"}))
    assert f"sink.{field}" in message and "outside the roots" in message


def test_a_mysql_tls_key_in_the_secrets_directory_or_without_its_certificate_is_refused(
    home: Path,
) -> None:
    message = refused(mysql(tls_cert_file="tls/client.pem", tls_key_file="secrets/k.pem"))
    assert "sink.tls_key_file" in message and "secrets directory" in message
    assert "sink.tls_key_file" in refused(mysql(tls_key_file="tls/client.key"))


def test_mysql_tls_files_reach_pymysql_as_real_paths(home: Path) -> None:
    sink = build_sink(
        mysql(
            tls_ca_file="tls/ca.pem", tls_cert_file="tls/client.pem", tls_key_file="tls/client.key"
        )
    )
    kw = sink.connect_kwargs()  # type: ignore[attr-defined]
    assert kw["ssl"] == {
        "ca": str(home / "tls" / "ca.pem"),
        "cert": str(home / "tls" / "client.pem"),
        "key": str(home / "tls" / "client.key"),
    }
    assert kw["ssl_verify_cert"] is True
    client_only = build_sink(mysql(tls_cert_file="tls/client.pem")).connect_kwargs()  # type: ignore[attr-defined]
    assert client_only["ssl"] == {"cert": str(home / "tls" / "client.pem")}
    assert "ssl" not in build_sink(mysql()).connect_kwargs()  # type: ignore[attr-defined]


def test_a_mysql_tls_file_swapped_for_a_link_out_is_refused_before_connecting(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pymysql

    sink = build_sink(mysql(tls_ca_file="tls/ca.pem"))
    (home / "tls" / "ca.pem").unlink()
    (home / "tls" / "ca.pem").symlink_to(home.parent / "outside" / "key.pem")
    monkeypatch.setattr(pymysql, "connect", lambda *a, **k: pytest.fail("connected"))
    with pytest.raises(ConfigError, match=r"sink.tls_ca_file: .*through a symbolic link"):
        sink.init_sink()
