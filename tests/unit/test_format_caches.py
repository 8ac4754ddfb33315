"""The bounded caches of the decoders' schema lookups (conveyor.formats.caches), on a fake
clock: least recently used first out, unknown ids forgotten after their TTL."""

from __future__ import annotations

from conveyor.formats.caches import LruCache, UnknownIds


def test_the_least_recently_used_entry_goes_first_and_the_cache_never_grows_past_capacity() -> None:
    cache: LruCache[int, str] = LruCache(3)
    for i in range(3):
        cache.put(i, f"s{i}")
    assert cache.get(0) == "s0"  # 0 is now the most recently used
    cache.put(3, "s3")
    assert cache.keys() == [2, 0, 3] and 1 not in cache
    for i in range(100):
        cache.put(100 + i, "x")
    assert len(cache) == 3 and cache.evictions == 101
    assert (cache.hits, cache.misses) == (1, 0)
    assert cache.get(1) is None and cache.misses == 1


def test_an_unknown_id_is_remembered_for_its_ttl_and_at_most_capacity_of_them() -> None:
    now = [1000.0]
    unknown: UnknownIds[int] = UnknownIds(capacity=2, ttl_s=60, clock=lambda: now[0])
    unknown.add(7)
    assert unknown.known_unknown(7) and not unknown.known_unknown(8)
    now[0] += 59.9
    assert unknown.known_unknown(7)
    now[0] += 0.2
    assert not unknown.known_unknown(7)  # expired: the registry is asked again
    for i in (1, 2, 3):
        unknown.add(i)
    assert len(unknown) == 2 and unknown.evictions == 1 and not unknown.known_unknown(1)
    assert unknown.hits == 2


def test_a_ttl_of_zero_remembers_nothing() -> None:
    unknown: UnknownIds[int] = UnknownIds(capacity=10, ttl_s=0)
    unknown.add(1)
    assert not unknown.known_unknown(1) and len(unknown) == 0
