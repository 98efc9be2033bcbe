"""When a weight push must also abort in-flight requests and flush the prefix cache (seed steps 8, 45)."""

from __future__ import annotations


def should_flush_cache(flush_cache_interval: int, weight_version: int, last_flushed_version: int) -> bool:
    """True when the push that produces ``weight_version`` must flush the engines' caches.

    ``last_flushed_version`` is the version the engines held when this run (re)started: the
    first push after it always flushes (``weight_version == last_flushed_version + 1``; seed step
    8: ``should_flush_cache(1, 1, 0)``), later pushes flush every ``flush_cache_interval``
    versions counted from version 1 (seed step 45: ``(2 - 1) % 1 == 0``).
    """
    if flush_cache_interval < 1:
        raise ValueError(f"flush_cache_interval must be >= 1, got {flush_cache_interval}")
    if weight_version == last_flushed_version + 1:
        return True
    return (weight_version - 1) % flush_cache_interval == 0
