"""Bounded memory for what the decoders look up: least recently used schemas, and schema ids
the registry does not know, remembered for a while.

A topic is input: its records may name any schema id. Unbounded maps of schemas by id grow
with every id a producer (or an attacker) writes, and an id the registry does not know was
asked again for every record that names it. ``LruCache`` keeps the ``capacity`` most recently
used entries; ``UnknownIds`` remembers an unknown id for ``ttl_s`` seconds (a schema
registered later is found once that has passed), at most ``capacity`` of them. Both count
what they do, for the connector's metrics (``conveyor.formats.registry.Registry.metrics``).
Thread-safe: a connector's batches ahead may be decoded on several threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """At most ``capacity`` entries; the least recently used one goes first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("an LRU cache holds at least one entry")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            if key not in self._entries:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key]

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.evictions += 1

    def discard(self, key: K) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._entries)


class UnknownIds(Generic[K]):
    """Keys found unknown, each remembered ``ttl_s`` seconds (0: never), at most ``capacity``
    (the oldest forgotten first)."""

    def __init__(self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._until: LruCache[K, float] = LruCache(capacity)
        self.hits = 0

    def add(self, key: K) -> None:
        if self.ttl_s > 0:
            self._until.put(key, self.clock() + self.ttl_s)

    def known_unknown(self, key: K) -> bool:
        """Whether ``key`` was found unknown less than ``ttl_s`` ago."""
        until = self._until.get(key)
        if until is None:
            return False
        if until <= self.clock():
            self._until.discard(key)  # expired: the registry is asked again
            return False
        self.hits += 1
        return True

    @property
    def evictions(self) -> int:
        return self._until.evictions

    def __len__(self) -> int:
        return len(self._until)
