"""What the engine holds in memory, for ``GET /debug/memory`` (the CPU stand-in's nvidia-smi).

Reports the process's resident set size (from /proc) next to the bytes the engine itself
accounts for (resident weights, the level-1 backup, the KV cache), so a test can check that a
sleep really gives memory back to the operating system and not only to an allocator.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .model_runner import ModelRunner


def rss_bytes() -> int:
    """Resident set size of this process, or 0 where /proc is not available."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def memory_report(runner: ModelRunner, sleeping_tags: Iterable[str]) -> dict[str, Any]:
    return {
        "rss_bytes": rss_bytes(),
        "weights_bytes": runner.weights_nbytes(),
        "weights_backup_bytes": runner.backup_nbytes(),
        "weights_total_bytes": runner.total_weight_nbytes(),
        "kv_cache_bytes": runner.kv.nbytes,
        "kv_cache_shape": {"slots": runner.kv.slots, "positions": runner.kv.capacity},
        "sleeping_tags": sorted(sleeping_tags),
    }
