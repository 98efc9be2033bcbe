"""The largest integers the services' APIs take, so an out-of-range number is a 422 naming its
field when it arrives, not an OverflowError in a later rollout (sample indices are int64 and
token ids and weight versions int32 in a batch; ids end up in Redis keys and JSON readers).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

MAX_ID = 2**53 - 1
"""Rollout ids, steps, sample and group indices, event sequence numbers: exact in every JSON reader."""
MAX_VERSION = 2**31 - 1
"""Weight versions (int32 in a batch)."""
MAX_TOKEN_ID = 2**31 - 1
"""Token ids (int32 in a batch)."""
MAX_COUNT = 2**16
"""Sizes and device numbers: DP sizes, GPU ids."""

Id = Annotated[int, Field(ge=0, le=MAX_ID)]
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
