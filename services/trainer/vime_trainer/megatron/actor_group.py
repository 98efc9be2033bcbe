"""The training ranks as Ray actors behind a small interface the run controller uses (seed step 3).

`TrainerBackend` is all the controller sees: start, train on per-DP-rank batches, export weight
buckets, sleep/wake, save/load, shutdown. `ActorGroup` implements it with one Ray actor per rank,
placed by a placement group (one GPU per rank on GPU hosts; an equal share of the CPUs
otherwise), so TP=2 × DP=4 is 8 actors. Every call fans out to all ranks at once, because the
ranks' collectives need all of them; TP/PP peers of a DP rank receive the same `RankBatch`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.batch import RankBatch
from vime.config import RunConfig
from vime_trainer.megatron.rank import TrainRank

StepMetrics = dict[str, float]


class TrainerError(RuntimeError):
    """A training rank failed or the group is not in a state to do what was asked."""


class TrainerBackend(Protocol):
    """What the run controller needs from a training backend."""

    def start(self) -> None: ...
    def train(self, rollout_id: int, rank_batches: Sequence[RankBatch]) -> list[StepMetrics]: ...
    def train_sft(self, rank_batches: Sequence[RankBatch]) -> list[StepMetrics]: ...
    def export_weight_buckets(self, directory: str | None = None) -> Iterator[dict[str, Any]]: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
    def save(self, rollout_id: int, run_state: dict[str, Any]) -> str: ...
    def load(self, path: str | None = None) -> dict[str, Any] | None: ...
    def shutdown(self) -> None: ...


class RankActor(TrainRank):
    """`TrainRank` plus what the group needs to wire ranks together."""

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port for the process-group rendezvous (asked of rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port


class ActorGroup:
    """``train_world_size`` Megatron ranks as Ray actors."""

    def __init__(
        self,
        config: RunConfig,
        hf_checkpoint: str,
        *,
        timeout_s: float | None = None,
        placement_timeout_s: float = 120.0,
    ) -> None:
        self.config = config
        self.hf_checkpoint = hf_checkpoint
        self.timeout_s = timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.world_size = config.train_world_size
        self.on_gpu = config.actor_num_gpus_per_node > 0
        self.actors: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self._pg: Any = None

    def _get(self, refs: Any) -> Any:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TrainerError(f"training ranks did not answer within {self.timeout_s} s") from exc
        except ray.exceptions.RayError as exc:
            raise TrainerError(f"a training rank failed: {exc}") from exc

    def _bundle(self) -> dict[str, float]:
        """One GPU per rank; on CPU an equal share of the CPUs still free (at most one each)."""
        if self.on_gpu:
            return {"GPU": 1.0, "CPU": 1.0}
        free = float(ray.available_resources().get("CPU", 0.0))
        return {"CPU": max(0.01, min(1.0, free / self.world_size))}

    def _place(self, bundle: dict[str, float]) -> None:
        self._pg = placement_group([bundle] * self.world_size, strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            remove_placement_group(self._pg)
            self._pg = None
            raise TrainerError(
                f"could not place {self.world_size} training ranks of {bundle} within "
                f"{self.placement_timeout_s:.0f} s; the Ray cluster has {ray.available_resources()} free"
            )

    def start(self) -> None:
        """Place and start the ranks, join them into one process group, load the HF weights."""
        if self.actors:
            raise TrainerError("the actor group is already started")
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        bundle = self._bundle()
        self._place(bundle)
        remote = ray.remote(RankActor)
        for i in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=i
            )
            self.actors.append(
                remote.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy
                ).remote(i, self.world_size, self.config, self.hf_checkpoint)
            )
        addr, port = self._get(self.actors[0].address.remote())
        self.infos = self._get([a.setup.remote(addr, port) for a in self.actors])

    @property
    def dp_size(self) -> int:
        return int(self.infos[0]["dp_size"]) if self.infos else self.config.dp_size

    def _reporter(self) -> int:
        for i, info in enumerate(self.infos):
            if info["pp_rank"] == info["pp_size"] - 1 and info["tp_rank"] == 0 and info["dp_rank"] == 0:
                return i
        raise TrainerError("no rank reports metrics")

    def _require_started(self) -> None:
        if not self.actors:
            raise TrainerError("the actor group is not started")

    def _fan_out(self, method: str, rank_batches: Sequence[RankBatch]) -> list[StepMetrics]:
        self._require_started()
        if len(rank_batches) != self.dp_size:
            raise TrainerError(f"got {len(rank_batches)} rank batches for dp_size={self.dp_size}")
        for d, rb in enumerate(rank_batches):
            if rb.dp_rank != d:
                raise TrainerError(f"rank batch {d} is for dp_rank {rb.dp_rank}: pass them in DP-rank order")
        refs = [ray.put(rb) for rb in rank_batches]
        calls = [
            getattr(a, method).remote(refs[info["dp_rank"]])
            for a, info in zip(self.actors, self.infos, strict=True)
        ]
        results = self._get(calls)
        return list(results[self._reporter()])

    def train(self, rollout_id: int, rank_batches: Sequence[RankBatch]) -> list[StepMetrics]:
        """Train on one rollout (seed steps 37-41); one metrics dict per optimizer step."""
        for rb in rank_batches:
            if rb.rollout_id != rollout_id:
                raise TrainerError(
                    f"rank batch of rollout {rb.rollout_id} passed to train rollout {rollout_id}"
                )
        return self._fan_out("train", rank_batches)

    def train_sft(self, rank_batches: Sequence[RankBatch]) -> list[StepMetrics]:
        """Supervised warm-up steps on (prompt, label) batches."""
        return self._fan_out("train_sft", rank_batches)

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run a rank method on every rank (collective) and return each rank's result."""
        self._require_started()
        return list(self._get([getattr(a, method).remote(*args) for a in self.actors]))

    def export_weight_buckets(self, directory: str | None = None) -> Iterator[dict[str, Any]]:
        """Write the HF weights bucket by bucket (safetensors files) and yield each file's description.

        Rank 0 writes at most two buckets ahead of the consumer; the consumer deletes a file once the
        engines have loaded it. Abandoning the iterator drains (and deletes) the rest.
        """
        self._require_started()
        gens = [
            a.write_weight_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=2 if i == 0 else -1
            ).remote(directory)
            for i, a in enumerate(self.actors)
        ]
        done = False
        try:
            for ref in gens[0]:
                yield self._get(ref)
            done = True
        finally:
            if not done:
                for ref in gens[0]:
                    _unlink(self._get(ref)["path"])
            for gen in gens[1:]:
                for ref in gen:
                    self._get(ref)

    def sleep(self) -> None:
        self.call("sleep")

    def wake_up(self) -> None:
        self.call("wake_up")

    def save(self, rollout_id: int, run_state: dict[str, Any]) -> str:
        """Checkpoint every rank; returns the checkpoint directory."""
        return str(self.call("save", rollout_id, run_state)[0])

    def load(self, path: str | None = None) -> dict[str, Any] | None:
        """Load a checkpoint (default: the newest complete one); returns its saved state or None."""
        states = self.call("load", path)
        return states[0]

    def shutdown(self) -> None:
        """Stop the ranks and free the placement group (safe to call twice)."""
        if self.actors:
            with contextlib.suppress(TrainerError):
                self._get([a.shutdown.remote() for a in self.actors])
            for a in self.actors:
                ray.kill(a)
        self.actors, self.infos = [], []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
