"""Unit tests: the byte-bounded LRU cache."""

from prism.cache import ByteLru


def test_evicts_least_recently_used_by_bytes():
    cache = ByteLru(10, size=len)
    cache.put("a", b"1234")
    cache.put("b", b"1234")
    assert cache.get("a") == b"1234"  # a is now the most recent
    cache.put("c", b"1234")  # 12 bytes > 10: b goes
    assert cache.get("b") is None
    assert cache.get("a") and cache.get("c")
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (3, 1, 1)
    assert cache.stats.bytes == 8 and cache.stats.entries == 2


def test_oversized_values_and_zero_bound_are_not_kept():
    cache = ByteLru(3, size=len)
    cache.put("big", b"1234")
    assert cache.get("big") is None and cache.stats.bytes == 0
    off = ByteLru(0, size=len)
    off.put("x", b"1")
    assert off.get("x") is None


def test_replacing_a_key_keeps_the_byte_count():
    cache = ByteLru(100, size=len)
    cache.put("a", b"12")
    cache.put("a", b"12345")
    assert cache.stats.bytes == 5 and cache.stats.entries == 1
