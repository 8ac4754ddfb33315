"""docs/CONFIG.md is the generator's output, and the generator covers every setting."""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field, SecretStr

from conveyor import sinks
from conveyor.control import configdoc
from conveyor.core.model import Broker, BrokerSpec

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MD = ROOT / "docs" / "CONFIG.md"


def test_config_md_is_in_sync_with_the_code():
    expected = configdoc.render()
    actual = CONFIG_MD.read_text() if CONFIG_MD.exists() else ""
    if actual != expected:
        diff = "".join(
            list(
                difflib.unified_diff(
                    actual.splitlines(True),
                    expected.splitlines(True),
                    "docs/CONFIG.md",
                    "generated",
                )
            )[:60]
        )
        pytest.fail(
            f"docs/CONFIG.md is out of date; regenerate with: {configdoc.REGENERATE}\n{diff}",
            pytrace=False,
        )


def test_every_spec_section_field_is_documented():
    doc = configdoc.render()
    for title, model in configdoc.SECTIONS:
        assert f"## `{title}`" in doc
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in doc, f"{title}.{name}"


def test_every_registered_sink_has_a_section():
    doc = configdoc.render()
    for name in sinks.sink_types():
        assert f"### sink `{name}`" in doc


def test_a_sink_that_cannot_be_imported_gets_a_note(monkeypatch: pytest.MonkeyPatch):
    real = sinks.sink_class

    def broken(name: str):
        if name == "localfile":
            raise SyntaxError("invalid syntax (localfile.py, line 3)")
        return real(name)

    monkeypatch.setattr(sinks, "sink_class", broken)
    doc = configdoc.render()
    section = doc.split("### sink `localfile`", 1)[1].split("### sink", 1)[0]
    assert (
        "> Not documented: this sink could not be imported (invalid syntax (localfile.py, line 3))."
        in section
    )
    assert "| `path` |" not in section
    assert "### sink `postgres`" in doc and "| `table` |" in doc.split("### sink `postgres`", 1)[1]


def test_broker_fields_match_the_broker_model():
    # The brokers file's model and the runtime Broker carry the same fields.
    assert list(BrokerSpec.model_fields) == [f.name for f in dataclasses.fields(Broker)]
    doc = configdoc.render()
    assert "## Brokers file" in doc
    assert "| `capacity` | integer (≥ 1, ≤ 10000) | `8` |" in doc
    assert "| `run_tags` | mapping of string to string | `{}` |" in doc


def test_every_environment_variable_the_code_reads_is_documented():
    doc = configdoc.render()
    env_section = doc.split("## Environment", 1)[1].split("\n## ", 1)[0]
    used = set()
    for path in (ROOT / "conveyor").rglob("*.py"):
        used |= set(re.findall(r"CONVEYOR_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    used.discard("CONVEYOR_SCHEDULER")  # the prefix of CONVEYOR_SCHEDULER_<FIELD>
    missing = sorted(v for v in used if f"`{v}`" not in env_section)
    assert not missing, (
        f"undocumented environment variables: {missing}; add them to conveyor/control/configdoc.py"
    )
    from conveyor.core.planning.scheduler import SchedulerConfig

    for f in dataclasses.fields(SchedulerConfig):
        assert f"`CONVEYOR_SCHEDULER_{f.name.upper()}`" in env_section


class _Example(BaseModel):
    """An example."""

    name: str = Field(description="A | B <name>, `<kept>`")
    mode: Literal["a", "b"] = "a"
    tags: dict[str, str] = Field(default_factory=dict)
    items: list[str | list[str]] = Field(min_length=1)
    count: int = Field(default=3, ge=1, le=10)
    secret: SecretStr | None = None


def test_model_table_renders_types_bounds_defaults_and_escapes():
    table = configdoc.model_table(_Example).splitlines()
    assert table[2] == "| `name` | string | required | A \\| B &lt;name>, `<kept>` |"
    assert table[3] == "| `mode` | `'a'` or `'b'` | `'a'` |  |"
    assert table[4] == "| `tags` | mapping of string to string | `{}` |  |"
    assert (
        table[5]
        == "| `items` | list of (string or list of string) (at least 1 item) | required |  |"
    )
    assert table[6] == "| `count` | integer (≥ 1, ≤ 10) | `3` |  |"
    assert table[7] == "| `secret` | secret string or null | `None` |  |"


def test_attribute_docs_reads_attribute_docstrings():
    @dataclasses.dataclass
    class Settings:
        a: float = 1.0
        """First
        setting."""
        b: int = 2

    assert configdoc.attribute_docs(Settings) == {"a": "First setting."}


def test_a_second_render_in_one_process_is_the_same_text():
    """Sub-sections (sink.iceberg.catalog, ...) are titled during a render; a render after
    another (another test of the same worker) once left them out."""
    import importlib

    fresh = importlib.reload(configdoc)  # a worker's first render, whatever ran before
    first = fresh.render()
    assert fresh.render() == first
    fresh = importlib.reload(configdoc)
    fresh._section_title(fresh.SinkConfig)  # the source sections learnt outside a render
    assert fresh.render() == first == CONFIG_MD.read_text()
