"""The one small interface every weight transport implements (seed steps 48–50).

A transport turns the trainer's current weights into a stream of buckets. Each bucket knows the
``update_info`` body of vLLM's ``POST /update_weights`` for a given engine (CUDA IPC handles of
the GPUs that engine runs on, or the path of a safetensors file) and stays valid until the next
bucket is asked for or the stream is closed: the protocol only moves on once every engine has
loaded it, so a transport may free a bucket's memory (or delete its file) at that point.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from vime.wire.rollout import EngineInfo


class OutgoingBucket(Protocol):
    """One bucket of HF-named tensors on its way to the engines."""

    @property
    def index(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def num_tensors(self) -> int: ...

    def update_info(self, engine: EngineInfo) -> dict[str, Any]:
        """The ``update_info`` body for ``engine`` (``POST /update_weights {"update_info": ...}``)."""
        ...


class WeightTransport(Protocol):
    """How weights travel from the trainer ranks to the engines."""

    name: str
    init_info: dict[str, Any] | None
    """``/init_weight_transfer_engine`` body sent before each update session (None: not sent)."""

    def buckets(self, engines: Sequence[EngineInfo]) -> Iterator[OutgoingBucket]:
        """The model's buckets in order; blocking (the protocol runs it in a worker thread)."""
        ...
