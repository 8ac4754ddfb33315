"""The source contract for the kafka-python client (the default), against tansu."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.brokers.kafka import KafkaSource
from conveyor.core.model import SourceSpec
from tests.sources.contract import SourceContract

pytestmark = pytest.mark.integration


class TestKafkaPythonSource(SourceContract):
    client = "kafka-python"

    def make_source(self, spec: SourceSpec, group_id: str) -> Any:
        return KafkaSource(spec, group_id=group_id)
