"""Cross-field rules live in the config models: an error names its field (``sink.<field>``), a
content rule waits for a reference to be resolved, and the run validates the model again."""

from __future__ import annotations

import threading
import time

import pytest

from conveyor.core.engine.stopping import sleep_unless_stopped
from conveyor.core.errors import ConfigError
from conveyor.core.trust.references import known_now
from conveyor.sinks import parse_sink_config
from conveyor.sources import canonical_type as source_type


def test_a_cross_field_rule_names_its_field_when_the_model_is_validated() -> None:
    with pytest.raises(ConfigError) as err:
        parse_sink_config(
            {"type": "postgres", "url": "postgresql://h/db", "table": "t", "delete_enabled": True}
        )
    assert str(err.value) == "sink.delete_enabled: a delete needs the key columns: set upsert_keys"


def test_a_content_rule_skips_a_reference_and_checks_the_resolved_value() -> None:
    base = {"type": "mongodb", "database": "db", "collection": "c"}
    parse_sink_config({**base, "url": "${env:MONGO_URL}"})  # known only inside the run
    with pytest.raises(ConfigError, match=r"^sink\.url: must start with mongodb://"):
        parse_sink_config({**base, "url": "http://127.0.0.1:27017"})
    # a rule between fields still applies while a value is a reference
    with pytest.raises(ConfigError, match=r"^sink\.delete_enabled: deletes need write_mode"):
        parse_sink_config({**base, "url": "${env:MONGO_URL}", "delete_enabled": True})


def test_field_errors_come_before_the_cross_field_rules() -> None:
    # a field-level error (pydantic's) stops before the cross-field rules run
    with pytest.raises(ConfigError) as err:
        parse_sink_config({"type": "redis", "commands": [], "mode": "cluster", "db": 1})
    assert str(err.value).startswith("sink.commands: ")


def test_a_redis_template_that_does_not_parse_names_its_index() -> None:
    with pytest.raises(ConfigError, match=r"^sink\.commands\[1\]: "):
        parse_sink_config({"type": "redis", "commands": ["SET ${key} ${payload}", "SET ${"]})


def test_known_now() -> None:
    assert known_now(None) and known_now("orders") and known_now("$${env:NOT_A_REFERENCE}")
    assert not known_now("${env:URL}") and not known_now("pre-${file:/run/secret}")


def test_one_registry_lookup_for_sources_too() -> None:
    with pytest.raises(ConfigError, match="did you mean 'webhook'"):
        source_type("webhok")


def test_a_stop_cuts_the_sleep_short() -> None:
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    sleep_unless_stopped(30, stop, stop.is_set)
    assert time.monotonic() - started < 5


def test_a_source_client_without_its_primitives_cannot_be_built() -> None:
    from conveyor.brokers.kafka import KafkaPythonSource, KafkaSource
    from conveyor.core.model import SourceSpec

    assert "_poll" in KafkaSource.__abstractmethods__ and not KafkaPythonSource.__abstractmethods__

    class Partial(KafkaPythonSource):
        pass

    no_primitives = type("NoPrimitives", (KafkaSource,), {"client": "none"})
    with pytest.raises(TypeError, match="abstract"):
        no_primitives(SourceSpec(topics=["t"]), "g")
    assert isinstance(Partial(SourceSpec(topics=["t"]), "g"), KafkaSource)
