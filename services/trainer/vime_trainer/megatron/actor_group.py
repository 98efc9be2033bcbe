"""The training ranks as Ray actors (seed step 3): start, train, export weight buckets,
sleep/wake, save/load, shutdown.

`ActorGroup` runs one Ray actor per rank, placed by a placement group (one GPU per rank on GPU
hosts; an equal share of the CPUs otherwise), so TP=2 × DP=4 is 8 actors. Every call fans out to
all ranks at once, because the ranks' collectives need all of them. A training call carries only
where the batch is (`BatchRef`): each rank reads its own share from Redis (`vime_trainer.batches`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime import procs
from vime.config import RunConfig
from vime_trainer.batches import BatchRef, TrainResult
from vime_trainer.megatron.rank import TrainRank

SHUTDOWN_GRACE_S = 10.0


class TrainerError(RuntimeError):
    """A training rank failed or the group is not in a state to do what was asked."""


def rank_failure(exc: BaseException, cfg: RunConfig) -> TrainerError:
    """The error a rank's failure ends the run with; running out of GPU memory says what to change
    first (the rest of Ray's message, the rank's traceback, follows)."""
    cause = getattr(exc, "cause", None) or exc
    if not isinstance(cause, torch.OutOfMemoryError):
        return TrainerError(f"a training rank failed: {exc}")
    split = (
        f"max_tokens_per_gpu={cfg.max_tokens_per_gpu}"
        if cfg.max_tokens_per_gpu
        else f"micro_batch_size={cfg.micro_batch_size}"
    )
    share = cfg.trainer.gpu_memory_utilization
    more = f", or a larger trainer.gpu_memory_utilization (now {share})" if share is not None else ""
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else "out of memory"
    return TrainerError(
        f"a training rank ran out of GPU memory: lower {split}, set trainer.recompute_activations=true"
        f"{more}. {first}"
    )


class RankActor(TrainRank):
    """`TrainRank` plus what the group needs to wire ranks together."""

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port for the process-group rendezvous (asked of rank 0)."""
        return ray.util.get_node_ip_address(), procs.free_port("")


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
            raise rank_failure(exc, self.config) from exc

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

    def train(self, ref: BatchRef) -> TrainResult:
        """Seed steps 37–40: every rank reads its share of ``ref`` from Redis, trains, acks it."""
        return self._read_and_train(ref, sft=False)

    def train_sft(self, ref: BatchRef) -> TrainResult:
        """Supervised warm-up steps on a published batch of (prompt, label) samples."""
        return self._read_and_train(ref, sft=True)

    def _read_and_train(self, ref: BatchRef, sft: bool) -> TrainResult:
        self._require_started()
        results: list[TrainResult] = self._get([a.read_and_train.remote(ref, sft) for a in self.actors])
        shares = sorted((s for r in results for s in r.shares), key=lambda s: s.dp_rank)
        skipped = sorted({s for r in results for s in r.skipped})  # every DP rank skips the same
        return TrainResult(results[self._reporter()].steps, shares, skipped)

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

    def sleep(self, offload: bool = True, keep_weights: bool = False) -> dict[str, float]:
        """Every rank sleeps; the most any rank reports of each memory figure (`TrainRank.sleep`)."""
        return _most(self.call("sleep", offload, keep_weights))

    def drop_weights(self) -> dict[str, float]:
        """Every rank frees the weights its sleep kept for the push (`TrainRank.drop_weights`)."""
        return _most(self.call("drop_weights"))

    def wake_up(self) -> None:
        self.call("wake_up")

    def save(self, rollout_id: int, run_state: dict[str, Any], wait: bool = True) -> str:
        """Checkpoint every rank; returns the checkpoint directory (``wait=False``: its files are
        written in the background and `saved` completes it)."""
        return str(self.call("save", rollout_id, run_state, wait)[0])

    def saved(self) -> str | None:
        """The checkpoint being written, completed: its directory, or None (`TrainRank.saved`)."""
        out: str | None = self.call("saved")[0]
        return out

    def load(self, path: str | None = None) -> dict[str, Any] | None:
        """Load a checkpoint (default: the newest complete one); returns its saved state or None."""
        states = self.call("load", path)
        return states[0]

    def shutdown(self) -> None:
        """Stop the ranks and free the placement group (safe to call twice). A rank still busy
        (a step the run was cancelled in) gets `SHUTDOWN_GRACE_S` to finish before it is killed,
        so a trainer told to stop stops within seconds."""
        if self.actors:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get([a.shutdown.remote() for a in self.actors], timeout=SHUTDOWN_GRACE_S)
            for a in self.actors:
                ray.kill(a)
        self.actors, self.infos = [], []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def _most(reports: list[dict[str, float]]) -> dict[str, float]:
    """The most any rank reports of each figure."""
    out: dict[str, float] = {}
    for stats in reports:
        for k, v in stats.items():
            out[k] = max(v, out.get(k, v))
    return out


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
