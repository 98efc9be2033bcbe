"""The built-in synthetic task: two-number additions ("12+34=" → 46), used when no data file is set.

Generated locally and deterministically from a seed, so a run needs no dataset download, and
scored by the reward service's ``arithmetic`` verifier (each record carries ``rm_type`` in its
metadata). A character-level tiny model can learn it on a CPU, which is what the demo shows.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

RM_TYPE = "arithmetic"
MAX_OPERAND = 99


def arithmetic_records(num_prompts: int, seed: int) -> Iterator[dict[str, Any]]:
    """``num_prompts`` records ``{"prompt": "a+b=", "label": a+b, "metadata": {"rm_type": ...}}``."""
    rng = random.Random(f"vime-arithmetic:{seed}")
    for _ in range(num_prompts):
        a = rng.randint(0, MAX_OPERAND)
        b = rng.randint(0, MAX_OPERAND)
        yield {"prompt": f"{a}+{b}=", "label": a + b, "metadata": {"rm_type": RM_TYPE}}
