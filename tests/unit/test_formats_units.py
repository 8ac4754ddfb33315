"""conveyor.formats without a registry: the config model, the frame, the Avro <-> Arrow mapping,
plain Avro with a schema file, and the settings the factories refuse.

Plain Avro payloads are written by fastavro (the library the decoder reads with); framed ones
in tests/integration/test_formats_registry.py by confluent-kafka's serializers.
"""

from __future__ import annotations

import io
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa
import pytest
from pydantic import ValidationError

from conveyor.core.errors import ConfigError
from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.formats import payload_decoder
from conveyor.formats.avro_arrow import AvroTypeError, avro_schema_of, avro_shape
from conveyor.formats.encoding import payload_encoder
from conveyor.formats.frame import FrameError, read_frame

URL = "http://127.0.0.1:1"


# -- SchemaRegistrySpec ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "field", "words"),
    [
        ({"url": "http://svc:pw@reg:8081"}, "url", "credentials may not be written in the URL"),
        ({"url": "ftp://reg"}, "url", "http or https"),
        ({"url": "http://:8081"}, "url", "no host"),
        (
            {"url": URL, "basic_auth_user": "u", "basic_auth_password": "pw"},
            "basic_auth_password",
            "reference",
        ),
        ({"url": URL, "bearer_token": "tok"}, "bearer_token", "reference"),
        (
            {"url": URL, "basic_auth_user": "u"},
            None,
            "give both basic_auth_user and basic_auth_password",
        ),
        ({"url": URL, "ssl_cafile": "tls/ca.pem"}, None, "only with an https:// url"),
        (
            {"url": "https://reg", "ssl_certfile": "tls/c.pem"},
            None,
            "give both ssl_certfile and ssl_keyfile",
        ),
        (
            {
                "url": URL,
                "basic_auth_user": "u",
                "basic_auth_password": "${env:CONVEYOR_X}",
                "bearer_token": "${env:CONVEYOR_Y}",
            },
            None,
            "either bearer_token or basic auth",
        ),
        ({"url": URL, "timeout_s": 0}, "timeout_s", "greater than 0"),
        ({"url": URL, "proxy": "http://p"}, "proxy", "Extra inputs"),
    ],
)
def test_registry_spec_refuses(kw: dict[str, Any], field: str | None, words: str) -> None:
    with pytest.raises(ValidationError) as e:
        SchemaRegistrySpec(**kw)
    assert words in str(e.value)
    if field:
        assert e.value.errors()[0]["loc"] == (field,)
    assert "pw@" not in str(e.value).replace("'http://svc:pw@reg:8081'", "")


def test_registry_spec_accepts_references_and_tls() -> None:
    spec = SchemaRegistrySpec(
        url="https://reg.example:8081/",
        basic_auth_user="svc",
        basic_auth_password="${file:/run/secrets/sr}",
        ssl_cafile="tls/ca.pem",  # under $CONVEYOR_HOME
        ssl_certfile="tls/c.pem",
        ssl_keyfile="tls/k.pem",
    )
    assert spec.url == "https://reg.example:8081"
    assert SchemaRegistrySpec.model_json_schema()["properties"]["basic_auth_password"]["secret"]
    assert SchemaRegistrySpec.model_json_schema()["properties"]["bearer_token"]["secret"]
    with pytest.raises(ValidationError):
        spec.url = "http://other"  # type: ignore[misc]  # frozen


# -- the frame ------------------------------------------------------------------------------------


def test_frame_reads_id_and_message_indexes() -> None:
    f = read_frame(b"\x00\x00\x01\x00\x02payload")
    assert (f.schema_id, f.message_indexes, f.payload) == (65538, None, b"payload")
    assert read_frame(b"\x00\x00\x00\x00\x07\x00x", protobuf=True).message_indexes == (0,)
    # [1, 0]: length 2, then 1 and 0, zigzag varints (2 -> 4, 1 -> 2, 0 -> 0)
    assert read_frame(b"\x00\x00\x00\x00\x07\x04\x02\x00x", protobuf=True).message_indexes == (1, 0)


@pytest.mark.parametrize(
    ("value", "protobuf", "words"),
    [
        (b"", False, "shorter than the 5-byte header"),
        (b"\x00\x00\x00", False, "shorter than the 5-byte header"),
        (b"\x01\x00\x00\x00\x07x", False, "magic byte 1"),
        (b'{"a": 1}', False, "magic byte 123"),
        (b"\x00\x00\x00\x00\x07", True, "Unexpected EOF"),
        (b"\x00\x00\x00\x00\x07\x04\x02", True, "Unexpected EOF"),
    ],
)
def test_corrupt_frames(value: bytes, protobuf: bool, words: str) -> None:
    with pytest.raises(FrameError, match="corrupt frame") as e:
        read_frame(value, protobuf=protobuf)
    assert words in str(e.value)


# -- Avro <-> Arrow -------------------------------------------------------------------------------


def shape_of(schema: Any) -> pa.DataType:
    named: dict[str, Any] = {}
    return avro_shape(fastavro.parse_schema(schema, named_schemas=named), named).type


def test_wide_decimals_are_decimal256_and_too_wide_ones_refused() -> None:
    dec = {"type": "bytes", "logicalType": "decimal"}
    assert shape_of({**dec, "precision": 38, "scale": 2}) == pa.decimal128(38, 2)
    assert shape_of({**dec, "precision": 40, "scale": 3}) == pa.decimal256(40, 3)
    with pytest.raises(AvroTypeError, match=r"decimal\(80, 0\) is wider than Arrow's 76"):
        shape_of({**dec, "precision": 80, "scale": 0})


def test_recursive_records_have_no_arrow_type() -> None:
    node = {
        "type": "record",
        "name": "Node",
        "fields": [{"name": "next", "type": ["null", "Node"]}],
    }
    with pytest.raises(AvroTypeError, match="contains itself"):
        shape_of(node)


def test_arrow_to_avro_and_back_keeps_the_types() -> None:
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            ("amount", pa.decimal128(20, 4)),
            ("wide", pa.decimal256(50, 10)),
            ("day", pa.date32()),
            ("at", pa.timestamp("us", tz="UTC")),
            ("at_ms", pa.timestamp("ms", tz="UTC")),
            ("local", pa.timestamp("us")),
            ("blob", pa.binary()),
            ("digest", pa.binary(16)),
            ("tags", pa.list_(pa.string())),
            ("attrs", pa.map_(pa.string(), pa.float64())),
            ("who", pa.struct([("name", pa.string()), ("age", pa.int32())])),
        ]
    )
    avro = avro_schema_of(schema, "my-topic.v1")
    assert avro["name"] == "my_topic_v1"
    back = shape_of(avro)
    assert isinstance(back, pa.StructType)
    for f in schema:
        assert back.field(f.name).type.equals(f.type, check_metadata=False) or (
            pa.types.is_list(f.type) or pa.types.is_map(f.type)
        ), f.name
    assert back.field("tags").type.value_type == pa.string()
    assert back.field("attrs").type.item_type == pa.float64()
    with pytest.raises(AvroTypeError, match="string keys"):
        avro_schema_of(pa.schema([("m", pa.map_(pa.int32(), pa.int32()))]), "t")


# -- plain Avro with a schema file ----------------------------------------------------------------

WIDE = {
    "type": "record",
    "name": "Wide",
    "fields": [
        {"name": "id", "type": "long"},
        {
            "name": "big",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 40, "scale": 5},
        },
    ],
}


def plain(schema: Any, rows: list[dict[str, Any]]) -> pa.Array:
    parsed = fastavro.parse_schema(schema)
    out = []
    for r in rows:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, r)
        out.append(buf.getvalue())
    return pa.array(out, pa.binary())


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "schemas").mkdir(parents=True)
    return tmp_path / "home"


def test_schema_file_plain_avro_with_a_wide_decimal(home: Path) -> None:
    (home / "schemas" / "wide.avsc").write_text(json.dumps(WIDE))
    big = Decimal("12345678901234567890123456789012345.67891")
    values = plain(WIDE, [{"id": 1, "big": big}, {"id": 2, "big": Decimal("-0.00001")}])
    values = pa.concat_arrays([values, pa.array([b"\x02"], pa.binary())])  # cut short
    for path in ("schemas/wide.avsc", str(home / "schemas" / "wide.avsc")):
        got = payload_decoder("avro", None, None, None, path).decode(values)
        assert got.table.schema.field("big").type == pa.decimal256(40, 5)
        assert got.table.column("big").to_pylist() == [big, Decimal("-0.00001"), None]
        assert list(got.failed) == [2] and "not Avro of its writer schema" in got.failed[2]


def test_schema_file_with_a_reader_schema(home: Path) -> None:
    v1 = {"type": "record", "name": "U", "fields": [{"name": "id", "type": "long"}]}
    v2 = {**v1, "fields": [*v1["fields"], {"name": "tier", "type": "string", "default": "free"}]}
    (home / "schemas" / "u.avsc").write_text(json.dumps(v1))
    got = payload_decoder("avro", None, json.dumps(v2), None, "schemas/u.avsc").decode(
        plain(v1, [{"id": 4}])
    )
    assert got.table.to_pylist() == [{"id": 4, "tier": "free"}]


def test_schema_file_must_be_under_conveyor_home(home: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.avsc"
    outside.write_text(json.dumps(WIDE))
    with pytest.raises(ConfigError, match=r"transform\.schema_file: .*outside the roots"):
        payload_decoder("avro", None, None, None, str(outside))
    with pytest.raises(ConfigError, match="'..' is not allowed"):
        payload_decoder("avro", None, None, None, "schemas/../../elsewhere.avsc")
    (home / "link.avsc").symlink_to(outside)
    with pytest.raises(ConfigError, match="outside"):
        payload_decoder("avro", None, None, None, "link.avsc")
    with pytest.raises(ConfigError, match="cannot be read"):
        payload_decoder("avro", None, None, None, "schemas/missing.avsc")


# -- what the factories refuse --------------------------------------------------------------------


def test_decoder_settings_that_cannot_work(home: Path) -> None:
    spec = SchemaRegistrySpec(url=URL)
    with pytest.raises(ConfigError, match="transform.schema_registry: decode protobuf needs"):
        payload_decoder("protobuf", None, None, None, None)
    with pytest.raises(ConfigError, match="transform.subject: reader_schema latest needs"):
        payload_decoder("avro", spec, "latest", None, None)
    with pytest.raises(ConfigError, match="transform.reader_schema: the schema is not an Avro"):
        payload_decoder("avro", spec, "{not json", None, None)
    with pytest.raises(ConfigError, match="reader_schema and schema_file are for avro"):
        payload_decoder("json_schema", spec, json.dumps(WIDE), None, None)


def test_encoder_settings_that_cannot_work() -> None:
    spec = SchemaRegistrySpec(url=URL)
    with pytest.raises(
        ConfigError, match="sink.use_latest_version: protobuf writes with the subject.s latest"
    ):
        payload_encoder("protobuf", spec, "topic", True, False, None)
    with pytest.raises(ConfigError, match="exclude each other"):
        payload_encoder("avro", spec, "topic", True, True, None)
    with pytest.raises(ConfigError, match="sink.schema: not JSON"):
        payload_encoder("avro", spec, "topic", True, False, "{")
    with pytest.raises(ConfigError, match="subject_strategy"):
        payload_encoder("avro", spec, "bogus", True, False, None)  # type: ignore[arg-type]
