"""Conveyor as Dagster components, for projects managed with ``dg``.

Two component types:

- ``conveyor.dagster.components.ConnectorComponent``: one connector, declared in a
  ``defs.yaml``; its ``attributes`` are a connector spec (docs/CONFIG.md)::

      type: conveyor.dagster.components.ConnectorComponent
      attributes:
        name: orders_to_pg
        source: {topics: [orders]}
        sink: {type: postgres, url: "${env:ORDERS_PG_URL}", table: orders}

  ``dg scaffold defs conveyor.dagster.components.ConnectorComponent orders_to_pg`` writes one;
  ``dg check defs`` validates it with Conveyor's own rules (a bad field is an error
  naming the file and the field). Secrets stay ``${env:...}`` / ``${file:...}``
  references, resolved inside the run; Dagster's ``{{ env.X }}`` templating would
  resolve them while the code location loads, so it is for non-secret values.

- ``conveyor.dagster.components.ConveyorComponent``: Conveyor itself, once per project: the
  connector jobs, lineage assets, sensors (the scheduler among them), the lag checks
  and the ``conveyor`` resource, for every ``ConnectorComponent`` of the project's
  defs folder plus, optionally, a directory of plain spec files
  (``connectors_dir``). ``dg scaffold defs conveyor.dagster.components.ConveyorComponent conveyor``.

The connectors are built once, by ``ConveyorComponent``, so that connectors sharing a
topic share its asset; a ``ConnectorComponent`` only validates its spec. The scheduler
sensor rescans the defs folder and reloads the location when a connector file is
added, changed or removed (see conveyor/config/reload.py).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import dagster as dg
from dagster.components import Scaffolder, ScaffoldRequest, scaffold_with

from conveyor.config.specs import COMPONENT_TYPES, from_mapping

PLATFORM_TYPES = ("conveyor.dagster.components.ConveyorComponent", "conveyor.ConveyorComponent")


class ConnectorScaffolder(Scaffolder):
    """A ``defs.yaml`` with a minimal spec named after the folder."""

    def scaffold(self, request: ScaffoldRequest) -> None:
        target = Path(request.target_path)
        target.mkdir(parents=True, exist_ok=True)
        name = target.name.replace("-", "_").lower()
        (target / "defs.yaml").write_text(
            textwrap.dedent(
                f"""\
                type: {request.type_name}
                attributes:
                  name: {name}
                  source:
                    topics: [{name}]
                  sink:
                    type: localfile
                    path: out/{name}  # under $CONVEYOR_HOME
                  # secrets: write references, resolved only inside the run, e.g.
                  # sink: {{type: postgres, url: "${{env:PG_URL}}", table: {name}}}
                """
            )
        )


@scaffold_with(ConnectorScaffolder)
class ConnectorComponent(dg.Component, dg.Resolvable, dg.Model):
    """One Conveyor connector; the attributes are its spec (see Conveyor's docs/CONFIG.md)."""

    name: str
    source: dict[str, Any]
    sink: dict[str, Any] | None = None  # a sink connector's
    kind: str | None = None  # 'source' for a source connector
    kafka: dict[str, Any] | None = None  # a source connector's destination cluster
    routing: dict[str, Any] | None = None  # a source connector's routing
    commit_failure_threshold: int | None = None
    description: str | None = None
    batch: dict[str, Any] | str | None = None
    transform: dict[str, Any] | None = None
    retry: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None
    desired: str | None = None
    heartbeat_timeout_s: float | None = None
    max_restarts: int | None = None
    expected_latency_s: float | None = None
    owners: list[str] | None = None

    def spec_mapping(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        loaded = from_mapping(
            self.spec_mapping(), source=str(context.path), fallback_name=self.name
        )
        if not loaded.ok:
            raise dg.DagsterInvalidDefinitionError(f"Conveyor connector: {loaded.error}")
        if not _has_conveyor_component(context.defs_module_path):
            raise dg.DagsterInvalidDefinitionError(
                f"connector {self.name!r} ({context.path}): this project has no "
                "conveyor.dagster.components.ConveyorComponent to run it; add one with "
                "`dg scaffold defs conveyor.dagster.components.ConveyorComponent conveyor`"
            )
        return dg.Definitions()  # built by the project's ConveyorComponent


class ConveyorComponent(dg.Component, dg.Resolvable, dg.Model):
    """Conveyor's jobs, assets, sensors and resource for the connectors of this project."""

    connectors_dir: str | None = None
    """A directory of plain spec files to load as well (relative to the project root)."""

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        from conveyor.dagster.definitions import conveyor_defs
        from conveyor.dagster.sensors.scheduler import SpecSources

        directory = None
        if self.connectors_dir:
            directory = Path(self.connectors_dir)
            if not directory.is_absolute():
                directory = (Path(context.project_root) / directory).resolve()
        sources = SpecSources(directory, (Path(context.defs_module_path),))
        return conveyor_defs(sources.scan(), sources)


def _has_conveyor_component(defs_root: Path) -> bool:
    for p in Path(defs_root).rglob("defs.y*ml"):
        try:
            text = p.read_text()
        except OSError:
            continue
        if any(t in text for t in PLATFORM_TYPES):
            return True
    return False


__all__ = ["COMPONENT_TYPES", "ConnectorComponent", "ConveyorComponent"]
