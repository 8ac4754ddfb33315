"""Issue 45 point 3: every path a spec names resolves under a root ($CONVEYOR_HOME, and the
directories of $CONVEYOR_FILE_ROOTS), never under the secrets directory nor in Conveyor's own
files, symlinks resolved, checked when the spec is validated and again when the file is opened;
a connector's dead letters never go into another's place; no error quotes a file's content.

The review's findings, each a spec the code before this change accepted: an Iceberg table
``../../../../escaped`` (data and metadata outside the home), ``catalog.uri:
sqlite:////anywhere.db``, a LocalFile path and a dead-letter path anywhere (or in another
connector's dead letters), ``schema_file: secrets/sa.json`` whose parse error quoted the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from conveyor.config.specs import dedupe, from_mapping, parse_spec
from conveyor.core.errors import ConfigError, PermanentSinkError
from conveyor.core.trust import paths
from conveyor.sinks import build_sink
from conveyor.sinks.localfile import LocalFileSink
from conveyor.spark.deadletters import dead_letter_location

PRIVATE_KEY = "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0BAQEFAAS-canary-5e1f\\n-----END"
CANARY = "canary-5e1f"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$CONVEYOR_HOME in tmp_path/home with its secrets directory; the default roots (no
    CONVEYOR_FILE_ROOTS, the default secrets directory); tmp_path/outside beside it."""
    for var in (paths.ROOTS_ENV, "CONVEYOR_SECRET_FILES", "CONVEYOR_META_URL", *paths.OWN_ENV):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "secrets" / "sa.json").write_text(
        json.dumps({"type": "service_account", "private_key": PRIVATE_KEY})
    )
    (tmp_path / "outside").mkdir()
    monkeypatch.setenv("CONVEYOR_HOME", str(home))
    return home


def spec(sink: dict[str, Any], name: str = "orders", **over: Any) -> dict[str, Any]:
    return {"name": name, "source": {"topics": ["o"]}, "sink": sink, **over}


def localfile(path: str = "out/orders") -> dict[str, Any]:
    return {"type": "localfile", "path": path}


def iceberg(**over: Any) -> dict[str, Any]:
    return {"type": "iceberg", "namespace": "lake", "table": "orders", **over}


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_spec(data)
    return str(e.value)


def assert_names_roots(message: str, home: Path) -> None:
    assert f"$CONVEYOR_HOME ({home})" in message and "CONVEYOR_FILE_ROOTS" in message, message


# -- the review's specs, refused at validation ------------------------------------------------


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"table": "../../../../escaped"}, "sink.table"),
        ({"table": "a/b"}, "sink.table"),
        ({"table": ".."}, "sink.table"),
        ({"namespace": "lake/../../.."}, "sink.namespace"),
        ({"namespace": "lake...x"}, "sink.namespace"),  # an empty part
        ({"namespace": "a\\b"}, "sink.namespace"),
    ],
)
def test_iceberg_names_that_would_climb_out_of_the_warehouse_are_refused(
    home: Path, over: dict[str, str], field: str
) -> None:
    message = refused(spec(iceberg(**over)))
    assert f"{field}:" in message
    assert list((home.parent / "outside").iterdir()) == []


def test_a_sqlite_catalog_outside_the_roots_is_refused_and_one_inside_resolved_under_home(
    home: Path,
) -> None:
    from conveyor.sinks.iceberg import catalog_properties

    anywhere = home.parent / "outside" / "anywhere.db"
    message = refused(spec(iceberg(catalog={"uri": f"sqlite:///{anywhere}"})))
    assert "sink.catalog.uri:" in message and "outside the roots" in message
    assert_names_roots(message, home)
    for uri in ("sqlite:///meta.db", "sqlite:///secrets/c.db", "sqlite:///file:c.db?uri=true"):
        assert "sink.catalog.uri:" in refused(spec(iceberg(catalog={"uri": uri})))
    _, config = parse_spec(spec(iceberg(catalog={"uri": "sqlite:///catalogs/lake.db"})))
    props = catalog_properties(config)  # type: ignore[arg-type]
    assert props["uri"] == f"sqlite:///{home / 'catalogs' / 'lake.db'}"  # not the cwd's
    assert props["warehouse"] == f"file://{home / 'iceberg' / 'warehouse'}"
    pg = "postgresql+psycopg2://app:${env:CONVEYOR_PG_PW}@db/lake"
    parse_spec(spec(iceberg(catalog={"uri": pg})))  # another database: no file
    assert not anywhere.exists()


def test_a_localfile_directory_lies_under_a_root_and_a_relative_one_under_home(
    home: Path,
) -> None:
    outside = home.parent / "outside" / "out"
    message = refused(spec(localfile(str(outside))))
    assert "sink.path:" in message
    assert_names_roots(message, home)
    assert "sink.path:" in refused(spec(localfile("secrets/out")))
    assert "sink.path:" in refused(spec(localfile("connectors")))  # Conveyor's own
    assert "sink.path:" in refused(spec(localfile("dead_letters/other")))
    assert "sink.path:" in refused(spec(localfile(".")))  # the root itself
    _, config = parse_spec(spec(localfile("out/orders")))
    assert config.directory() == home / "out" / "orders"  # type: ignore[attr-defined]


def test_dead_letters_go_to_the_connectors_own_place_or_a_root(home: Path) -> None:
    def dead_letters(path: str, name: str = "orders") -> dict[str, Any]:
        return spec(
            localfile(), name, failure={"policy": "dead_letter", "dead_letter": {"path": path}}
        )

    outside = home.parent / "outside" / "dl"
    for path in (str(outside), f"file://{outside}", "dead_letters/payments", "dead_letters"):
        message = refused(dead_letters(path))
        assert "failure.dead_letter.path:" in message, message
    assert "payments" in refused(dead_letters("dead_letters/payments"))
    assert "dead_letters/orders" in refused(dead_letters("dead_letters"))
    for path, place in (
        ("dead_letters/orders", home / "dead_letters" / "orders"),
        ("dl/orders", home / "dl" / "orders"),
    ):
        connector, _ = parse_spec(dead_letters(path))
        assert dead_letter_location(connector) == place.as_uri()
    connector, _ = parse_spec(dead_letters("s3a://lake/dl/"))
    assert dead_letter_location(connector) == "s3a://lake/dl"  # another scheme: as written
    default, _ = parse_spec(spec(localfile()))
    assert dead_letter_location(default) == (home / "dead_letters" / "orders").as_uri()
    assert not outside.exists()


def test_a_schema_file_in_the_secrets_directory_is_refused(home: Path) -> None:
    def avro(path: str) -> dict[str, Any]:
        return spec(localfile(), transform={"decode": "avro", "schema_file": path})

    message = refused(avro("secrets/sa.json"))
    assert "transform.schema_file:" in message and "secrets directory" in message
    (home / "schemas").mkdir()
    (home / "schemas" / "sa.avsc").symlink_to(home / "secrets" / "sa.json")
    assert "secrets directory" in refused(avro("schemas/sa.avsc"))  # through a link
    assert "transform.schema_file:" in refused(avro("/etc/hostname"))
    assert "transform.schema_file:" in refused(avro("../sa.json"))
    assert CANARY not in refused(avro("secrets/sa.json"))


def test_certificates_and_keys_lie_under_a_root_outside_the_secrets(home: Path) -> None:
    tls = {"security_protocol": "SSL"}
    message = refused(
        {"name": "orders", "source": {"topics": ["o"], **tls, "ssl_cafile": "/etc/ssl/ca.pem"},
         "sink": localfile()}
    )  # fmt: skip
    assert "source.ssl_cafile" in message
    assert_names_roots(message, home)
    key = {"ssl_certfile": "tls/c.pem", "ssl_keyfile": "secrets/k.pem"}
    assert "source.ssl_keyfile" in refused(
        {"name": "orders", "source": {"topics": ["o"], **tls, **key}, "sink": localfile()}
    )
    registry = {"url": "https://reg:8081", "ssl_cafile": "/etc/ssl/ca.pem"}
    assert "transform.schema_registry.ssl_cafile" in refused(
        spec(localfile(), transform={"decode": "avro", "schema_registry": registry})
    )
    es = {"type": "elasticsearch", "hosts": ["https://es:9200"], "index": "o"}
    assert "sink.ca_certs" in refused(spec({**es, "ca_certs": "/etc/ssl/ca.pem"}))
    redis = {"type": "redis", "commands": ["SET k:${key} ${payload}"], "tls": True}
    redis["tls_cert_file"] = "tls/c.pem"
    assert "sink.tls_key_file" in refused(spec({**redis, "tls_key_file": "secrets/k.pem"}))
    parse_spec(spec({**es, "ca_certs": "tls/es-ca.pem"}))  # under the home: fine


def test_a_symlink_inside_the_home_that_points_out_is_refused(home: Path) -> None:
    (home / "link").symlink_to(home.parent / "outside")
    message = refused(spec(localfile("link/out")))
    assert "sink.path:" in message and "through a symbolic link" in message


def test_file_roots_add_directories_and_must_be_absolute(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = home.parent / "outside"
    monkeypatch.setenv(paths.ROOTS_ENV, f"{outside}, /srv/conveyor")
    _, config = parse_spec(spec(localfile(str(outside / "out"))))
    assert config.directory() == outside / "out"  # type: ignore[attr-defined]
    assert "sink.path:" in refused(spec(localfile(str(outside))))  # a root itself
    monkeypatch.setenv(paths.ROOTS_ENV, "relative/dir")
    with pytest.raises(ConfigError, match="CONVEYOR_FILE_ROOTS: 'relative/dir' is not an absolute"):
        paths.resolve("out", field="sink.path")


def test_object_storage_urls_pass_as_written(home: Path) -> None:
    assert paths.location_problem("s3://bucket/lake") is None
    assert paths.resolve_location("gs://b/t", field="sink.path") == "gs://b/t"
    assert "on this host" in str(paths.location_problem("file://otherhost/lake"))


# -- again when the file is opened -------------------------------------------------------------


def test_a_localfile_directory_swapped_for_a_link_after_validation_is_refused_at_open(
    home: Path,
) -> None:
    sink = build_sink(localfile("out/orders"))
    assert isinstance(sink, LocalFileSink)
    (home / "out").symlink_to(home.parent / "outside")  # after the spec was accepted
    with pytest.raises(ConfigError, match="sink.path: .*through a symbolic link"):
        sink.init_sink()
    assert list((home.parent / "outside").iterdir()) == []


def test_dead_letters_are_resolved_again_at_each_use(home: Path) -> None:
    connector, _ = parse_spec(spec(localfile()))
    (home / "dead_letters").symlink_to(home.parent / "outside")
    with pytest.raises(ConfigError, match="failure.dead_letter.path: .*symbolic link"):
        dead_letter_location(connector)


def test_a_localfile_sink_never_follows_a_link_in_its_directory(home: Path) -> None:
    target = home.parent / "outside" / "victim"
    target.write_text("")
    out = home / "out"
    out.mkdir()
    (out / "data.jsonl").symlink_to(target)
    sink = build_sink({**localfile("out"), "prefix": "data", "rotation": "none"})
    with pytest.raises(PermanentSinkError, match="Too many levels of symbolic links"):
        sink.init_sink()  # it would cut the newest file's partial line: not through a link
    (out / "data.jsonl").unlink()
    sink.init_sink()
    (out / "data.jsonl").symlink_to(target)  # after the start: the append refuses it too
    batch = pa.table({"__topic": ["o"], "__partition": pa.array([0], pa.int32()),
                      "__offset": pa.array([0], pa.int64()), "id": [1]})  # fmt: skip
    with pytest.raises(PermanentSinkError, match="Too many levels of symbolic links"):
        sink.send_batch(batch)
    assert target.read_text() == ""


# -- no error quotes a file -------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        json.dumps({"type": "service_account", "private_key": PRIVATE_KEY}),
        json.dumps({"type": "record", "name": "X", "fields": [{"name": "a", "type": CANARY}]}),
        json.dumps(CANARY),
        f"api_key={CANARY}\n",
        f'{{"type": "record", "name": "{CANARY}"',
    ],
)
def test_a_schema_file_that_is_not_a_schema_is_never_quoted(home: Path, content: str) -> None:
    from conveyor.formats import payload_decoder

    (home / "schemas").mkdir()
    (home / "schemas" / "bad.avsc").write_text(content)
    with pytest.raises(ConfigError) as e:
        payload_decoder("avro", None, None, None, "schemas/bad.avsc")
    message = str(e.value)
    assert message.startswith("transform.schema_file: 'schemas/bad.avsc' is ")
    assert CANARY not in message and "PRIVATE KEY" not in message
    assert e.value.__cause__ is None and e.value.__context__ is None  # nothing holds the file


def test_a_schema_file_in_the_secrets_directory_is_refused_when_opened(home: Path) -> None:
    from conveyor.formats.avro import load_schema_file

    with pytest.raises(ConfigError) as e:
        load_schema_file("secrets/sa.json", field="transform.schema_file")
    assert "secrets directory" in str(e.value) and CANARY not in str(e.value)


# -- each connector's dead letters in a place of its own --------------------------------------


def _loaded(name: str, path: str | None) -> Any:
    failure = {"dead_letter": {"path": path}} if path else {}
    return from_mapping(
        spec(localfile(), name, failure=failure), source=f"{name}.yaml", fallback_name=name
    )


def test_two_connectors_sharing_a_dead_letter_place_the_later_is_refused(home: Path) -> None:
    a, b, c = _loaded("a", "dl/shared"), _loaded("b", "dl/shared"), _loaded("c", "dl/shared/in")
    out = {s.name: s for s in dedupe([a, b, c])}
    assert out["a"].ok
    assert out["b"].error is not None and "overlaps connector 'a'" in out["b"].error
    assert out["c"].error is not None and "overlaps connector 'a'" in out["c"].error
    assert "failure.dead_letter.path" in out["b"].error
    # The one created first keeps it, whatever the order of the files.
    out = {s.name: s for s in dedupe([a, b], created={"a": 2.0, "b": 1.0})}
    assert out["b"].ok and out["a"].error is not None


def test_a_place_that_holds_another_connectors_default_place_loses_to_it(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner = home / "inner"  # $CONVEYOR_HOME, inside a root that holds more
    monkeypatch.setenv("CONVEYOR_HOME", str(inner))
    monkeypatch.setenv(paths.ROOTS_ENV, str(home.parent))
    wide = _loaded("wide", str(home))  # holds the home, every default place in it
    assert wide.ok, wide.error
    out = {s.name: s for s in dedupe([wide, _loaded("orders", None)])}
    assert out["orders"].ok
    assert out["wide"].error is not None and "overlaps connector 'orders'" in out["wide"].error
    assert all(s.ok for s in dedupe([_loaded("a", None), _loaded("b", None)]))


def test_the_rule_reads_no_file(home: Path) -> None:
    """Checking a path never opens it: validation of a FIFO, which would block a reader, returns."""
    os.mkfifo(home / "pipe")
    assert paths.problem("pipe") is None
