"""The one small interface every weight transport implements (seed steps 48–50).

A transport turns the trainer's current weights into a stream of buckets. Each bucket knows the
``update_info`` body of vLLM's ``POST /update_weights`` for a given engine (CUDA IPC handles of
the GPUs that engine runs on, or the path of a safetensors file) and stays valid until the bucket
after the next is asked for, or the stream is closed: the protocol asks for the next bucket while
the engines load the current one, and for the one after only once every engine has loaded it, so a
transport may free a bucket's memory (or delete its file) at that point. Running out frees
nothing (the engines may still be loading the last bucket): the protocol always closes the stream
once every engine has loaded it, or when the push is abandoned.
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

    def buckets(self, engines: Sequence[EngineInfo]) -> BucketStream:
        """The model's buckets in order; blocking (the protocol runs it in a worker thread)."""
        ...


class BucketStream(Protocol):
    """An iterator of buckets whose ``close`` releases what the transport still holds."""

    def __iter__(self) -> Iterator[OutgoingBucket]: ...
    def __next__(self) -> OutgoingBucket: ...
    def close(self) -> None: ...
