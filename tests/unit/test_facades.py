"""The facades over the narrow classes (issue 46): ``MetaStore``, ``TaskStore``, ``Operations``
keep every method their callers know, each one the method of the part that owns it."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.control.operations import Operations
from conveyor.store.facade import Delegate
from conveyor.store.meta import MetaStore
from conveyor.store.tasks import TaskStore

# The public methods of each class before it was split: callers may use every one.
KEPT = {
    MetaStore: """apply assign backfill backfills claim close commit committed_offsets delete
        ensure_current ensure_schema fence_writers get get_broker gone_brokers heartbeat
        history list list_brokers mark_gone positions_adopted record record_positions release
        request_abandon request_backfill reset_offsets reset_source_state save_source_state
        schema_version set_desired set_draining source_state source_state_info stop
        stored_positions sync_spec update_backfill upsert_broker""",
    TaskStore: """apply commit connectors drop ensure_current epoch force_handovers grant
        heartbeat load_group partitions release set_partitions tasks""",
    Operations: """abandon_batch alter_offsets apply_file config dead_letter_store dead_letters
        delete destination destinations history info names offsets pause put_config
        reset_offsets reset_offsets_to reset_source_state restart resume row rows start
        status stop summary tasks validate""",
}


@pytest.fixture
def facades(tmp_path: Path) -> Iterator[dict[type, object]]:
    store = MetaStore(f"sqlite:///{tmp_path / 'meta.db'}")
    try:
        yield {
            MetaStore: store,
            TaskStore: TaskStore(store),
            Operations: Operations(store, directory=tmp_path, actor="the test"),
        }
    finally:
        store.close()


@pytest.mark.parametrize("facade", list(KEPT), ids=lambda c: c.__name__)
def test_every_method_callers_know_is_kept(facade: type, facades: dict[type, object]) -> None:
    obj = facades[facade]
    missing = [n for n in KEPT[facade].split() if not callable(getattr(obj, n, None))]
    assert not missing, f"{facade.__name__} lost {missing}"


@pytest.mark.parametrize("facade", list(KEPT), ids=lambda c: c.__name__)
def test_each_delegate_is_its_parts_method(facade: type, facades: dict[type, object]) -> None:
    """Bound to the part it names, with the part method's signature and docstring."""
    obj = facades[facade]
    delegates = {n: d for n, d in vars(facade).items() if isinstance(d, Delegate)}
    assert delegates
    for name, d in delegates.items():
        bound = getattr(obj, name)
        assert bound.__self__ is getattr(obj, d.part), name
        assert bound.__func__ is d.method, name
        assert bound.__doc__ == d.method.__doc__, name
        assert inspect.signature(getattr(facade, name)) == inspect.signature(d.method), name


def test_a_clock_set_on_the_store_is_every_repositorys(facades: dict[type, object]) -> None:
    """Tests set ``store.clock`` after opening the store: each write stamps with it."""
    store = facades[MetaStore]
    assert isinstance(store, MetaStore)
    store.clock = lambda: 1234.5
    store.sync_spec("c1", spec_json="{}", spec_hash="h", source="cli", error=None)
    assert store.get("c1").created_at == 1234.5
    assert store.history("c1")[0].at == 1234.5
    tasks = facades[TaskStore]
    assert isinstance(tasks, TaskStore) and tasks.tables.db.clock() == 1234.5


def test_an_actor_set_after_making_the_operations_is_every_parts(
    facades: dict[type, object],
) -> None:
    """The CLI's ``serve`` sets ``actor`` and ``specs_changed`` on operations it made."""
    ops = facades[Operations]
    assert isinstance(ops, Operations)
    ops.store.sync_spec("c1", spec_json="{}", spec_hash="h", source="cli", error=None)
    ops.actor = "the REST API"
    ops.stop("c1")
    assert ops.history("c1")[0]["reason"].startswith("stopped from the REST API")
