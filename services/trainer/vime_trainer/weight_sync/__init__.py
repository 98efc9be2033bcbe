"""Weight sync: vLLM's update protocol (`protocol`) over a transport (`shm_transport`, `ipc`).

`make_transport` picks one: ``ipc`` when the trainer ranks share GPUs with the engines
(colocated, on GPUs), ``shm`` otherwise (CPU hosts, or engines on other GPUs/hosts that share a
filesystem). ``trainer.weight_transport`` forces either. `make_weight_sync` builds the run's push:
vLLM's loader (`WeightSync`) or, with ``engine.weight_load: direct``, the direct load
(`direct_sync.DirectSync`, staging buffers of the same kind as the transport) falling back to it.
"""

from __future__ import annotations

from typing import Any

from vime.config import RunConfig
from vime_trainer.weight_sync.protocol import EventFn, PushReport, WeightSync, WeightSyncError, no_event
from vime_trainer.weight_sync.transport import OutgoingBucket, WeightTransport

__all__ = [
    "OutgoingBucket",
    "PushReport",
    "WeightSync",
    "WeightSyncError",
    "WeightTransport",
    "make_transport",
    "make_weight_sync",
]


def make_transport(cfg: RunConfig, backend: Any) -> WeightTransport:
    """The transport for this run, over the started trainer backend (an `ActorGroup`)."""
    if cfg.weight_transport == "ipc":
        from vime_trainer.weight_sync.ipc import IpcTransport

        return IpcTransport(backend, packed=cfg.trainer.ipc_packed)
    from vime_trainer.weight_sync.shm_transport import ShmTransport

    return ShmTransport(backend, cfg.trainer.weight_dir)


def make_weight_sync(cfg: RunConfig, backend: Any, on_event: EventFn = no_event) -> WeightSync:
    """The run's weight push over the started trainer backend, as ``engine.weight_load`` asks."""
    stock = WeightSync(make_transport(cfg, backend), on_event=on_event, token=cfg.services.token())
    if cfg.engine.weight_load != "direct":
        return stock
    from vime_trainer.weight_sync.direct_ranks import RayRanks
    from vime_trainer.weight_sync.direct_sync import DirectSync

    ranks = RayRanks(backend, cfg.weight_transport, cfg.trainer.weight_dir)
    return DirectSync(ranks, stock, bucket_bytes=cfg.trainer.packed_buffer_size_bytes)
