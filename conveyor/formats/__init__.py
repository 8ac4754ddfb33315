"""Payloads with a schema: Avro, Protobuf and JSON Schema in Confluent's wire format, to and from Arrow.

``payload_decoder`` builds the decoder of one topic's payloads (``decoded.PayloadDecoder``:
one Arrow row per record, failed records all null and named with a reason);
``conveyor.formats.encoding.payload_encoder`` the encoder of a table's rows for the Kafka
sink. The writer schemas come from a schema registry (``registry``); decoding and encoding
are the maintained libraries' (fastavro, protobuf, jsonschema, confluent-kafka's
serializers); only the 5-byte frame is read here (``frame``). The format modules import
their libraries when a decoder is built, never when this package is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from conveyor.core.errors import ConfigError
from conveyor.core.schema_registry import SchemaRegistrySpec
from conveyor.formats.decoded import PayloadDecoder

Format = Literal["avro", "protobuf", "json_schema"]


def payload_decoder(
    fmt: Format,
    registry: SchemaRegistrySpec | None,
    reader_schema: str | Literal["latest"] | None,
    subject: str | None,
    schema_file: str | None,
    *,
    prefix: str = "transform",
) -> PayloadDecoder:
    """The decoder of one topic's payloads in ``fmt``. ``prefix`` is the config section the
    settings come from (errors name ``<prefix>.schema_registry.basic_auth_user``...).

    Raises ConfigError for settings that cannot work (a reader schema that is not Avro, a
    schema file outside ``$CONVEYOR_HOME``, a format without a registry).
    """
    from conveyor.formats.registry import Registry

    client = None
    if registry is not None:
        client = Registry(registry, prefix=f"{prefix}.schema_registry")
    if fmt == "avro":
        from conveyor.formats.avro import AvroDecoder

        return AvroDecoder(client, reader_schema, subject, schema_file, prefix=prefix)
    if client is None:
        raise ConfigError(f"decode {fmt} needs schema_registry", field=f"{prefix}.schema_registry")
    if reader_schema is not None or schema_file is not None:
        raise ConfigError(
            f"reader_schema and schema_file are for avro, not {fmt}", field=f"{prefix}.decode"
        )
    if fmt == "protobuf":
        from conveyor.formats.protobuf import ProtobufDecoder

        return ProtobufDecoder(client)
    if fmt == "json_schema":
        from conveyor.formats.json_schema import JsonSchemaDecoder

        return JsonSchemaDecoder(client)
    raise ConfigError(
        f"unknown format {fmt!r}: avro, protobuf or json_schema", field=f"{prefix}.decode"
    )


def registry_metrics(decoders: Iterable[PayloadDecoder]) -> dict[str, int] | None:
    """The schema registry lookups of these decoders, summed (``Registry.metrics``); None
    when none of them reads a registry."""
    total: dict[str, int] | None = None
    for d in decoders:
        registry = getattr(d, "registry", None)
        if registry is None:
            continue
        total = total or {}
        for k, v in registry.metrics().items():
            total[k] = total.get(k, 0) + v
    return total
