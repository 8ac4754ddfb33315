"""The one ``${...}`` template syntax (conveyor.sinks.templates) and the old ``{...}`` form."""

from __future__ import annotations

import datetime as dt

import pytest

from conveyor.sinks import templates
from conveyor.sinks.base import Record
from conveyor.sinks.elasticsearch import ElasticsearchSinkConfig, template_problems
from conveyor.sinks.greptimedb import GreptimeDBSinkConfig
from conveyor.sinks.pulsar import PulsarSinkConfig


def record(**kw: object) -> Record:
    base: dict[str, object] = dict(
        index=0,
        topic="orders",
        partition=1,
        offset=7,
        timestamp=dt.datetime(2026, 11, 23, 21, 5, tzinfo=dt.timezone.utc),
        key=b"k1",
        headers=[("trace.id", b"t-1"), ("h", b"a"), ("h", b"b")],
        destination="eu",
        payload=b'{"id": 3, "c": {"r": "x"}, "f": true, "n": null}',
    )
    base.update(kw)
    return Record(**base)  # type: ignore[arg-type]


def test_every_field_renders() -> None:
    r = record()
    assert (
        templates.render("${topic}/${partition}/${offset}/${key}/${destination}", r)
        == "orders/1/7/k1/eu"
    )
    assert templates.render("${timestamp}", r) == str(int(r.timestamp.timestamp() * 1000))  # type: ignore[union-attr]
    assert templates.render("logs-${timestamp:%Y.%m.%d}", r) == "logs-2026.11.23"
    assert templates.render("${payload.id}-${payload.c.r}-${payload.f}", r) == "3-x-true"
    assert templates.render("${payload.c}", r) == '{"r":"x"}'
    assert templates.render("${headers.trace.id} ${headers.h}", r) == "t-1 b"


@pytest.mark.parametrize(
    ("template", "kw", "match"),
    [
        ("${key}", {"key": None}, "no key"),
        ("${destination}", {"destination": None}, "no destination"),
        ("${timestamp:%Y}", {"timestamp": None}, "no timestamp"),
        ("${payload.nope}", {}, "has no field 'nope'"),
        ("${payload.n}", {}, "'n' is null"),
        ("${headers.x}", {}, "no header 'x'"),
    ],
)
def test_a_row_that_cannot_fill_a_template_is_a_row_error(
    template: str, kw: dict[str, object], match: str
) -> None:
    with pytest.raises(templates.TemplateError, match=match):
        templates.render(template, record(**kw))


@pytest.mark.parametrize(
    ("template", "allowed", "formats", "match"),
    [
        ("${nope}", templates.FIELDS, (), "unknown placeholder"),
        ("${payload.}", templates.FIELDS, (), "empty field name"),
        ("${key.x}", templates.FIELDS, (), "only payload and headers have fields"),
        ("${topic:%Y}", templates.FIELDS, ("timestamp",), "take a format"),
        ("${timestamp:}", templates.FIELDS, ("timestamp",), "empty format"),
        ("a${b", templates.FIELDS, (), "unclosed"),
        ("${payload.id}", ("topic", "destination"), (), "unknown placeholder"),
        ("  ", templates.FIELDS, (), "must not be empty"),
    ],
)
def test_config_problems(
    template: str, allowed: tuple[str, ...], formats: tuple[str, ...], match: str
) -> None:
    assert any(match in p for p in templates.problems(template, allowed, formats))
    if template.strip():
        with pytest.raises(templates.TemplateSyntaxError, match=match):
            templates.parse(template, allowed, formats)


def test_legacy_single_brace_form_is_upgraded_with_a_warning() -> None:
    with pytest.warns(
        FutureWarning, match=r"sink.index.*logs-\$\{topic\}-\$\{timestamp:%Y.%m.%d\}"
    ):
        es = ElasticsearchSinkConfig(
            hosts=["http://127.0.0.1:9200"], index="logs-{topic}-{%Y.%m.%d}"
        )
    assert es.index == "logs-${topic}-${timestamp:%Y.%m.%d}"
    assert template_problems(es.index) == []
    with pytest.warns(FutureWarning, match="sink.topic"):
        pulsar = PulsarSinkConfig(
            service_url="pulsar://127.0.0.1:6650", topic="persistent://p/d/{destination}"
        )
    assert pulsar.topic == "persistent://p/d/${destination}"
    with pytest.warns(FutureWarning, match="sink.measurement"):
        greptime = GreptimeDBSinkConfig(url="http://127.0.0.1:4000", measurement="{topic}_m")
    assert greptime.measurement == "${topic}_m"


def test_the_current_form_is_left_alone(recwarn: pytest.WarningsRecorder) -> None:
    es = ElasticsearchSinkConfig(hosts=["http://127.0.0.1:9200"], index="logs-${topic}")
    assert es.index == "logs-${topic}" and not [w for w in recwarn if w.category is FutureWarning]
