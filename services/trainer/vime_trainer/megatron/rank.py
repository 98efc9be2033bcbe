"""One training rank: everything a Ray actor of the trainer does, as a plain class.

`ActorGroup` runs one of these per rank inside a Ray actor; nothing here knows about Ray. The
rank builds its model shard from an HF checkpoint (or resumes from a distributed checkpoint),
reads its share of a batch from Redis and trains on it, sleeps and wakes, saves, and takes part
in the collective weight export. Every method that involves collectives must be called on all
ranks at once. Only the driver loop sleeps and wakes a rank (`Controller.run`): a method that
needs the model's memory refuses to run while the rank is asleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from vime.batch import RankBatch
from vime.config import RunConfig
from vime_trainer.batches import BatchRef, ShareReader, ShareSummary, TrainResult
from vime_trainer.weights.architecture import Architecture
from vime_trainer.weights.bucket_files import write_bucket

if TYPE_CHECKING:
    from vime_trainer.megatron.checkpoint import PendingCheckpoint

T = TypeVar("T")


class RankAsleepError(RuntimeError):
    """A method that needs the model's memory was called while the rank sleeps."""


class TrainRank:
    """The state and operations of one Megatron training rank."""

    def __init__(self, rank: int, world_size: int, config: RunConfig, hf_checkpoint: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.hf_checkpoint = hf_checkpoint
        self.arch = Architecture.from_checkpoint(hf_checkpoint)
        self._ready = False
        self._reader: ShareReader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._retries_at_wake = 0
        self._pending: PendingCheckpoint | None = None

    # --- start-up (seed step 3) -------------------------------------------------------------
    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group, build the model shard, load HF weights, build the optimizer."""
        from vime_trainer.megatron import model as model_lib
        from vime_trainer.megatron.memory import Offloader, WeightBackup
        from vime_trainer.megatron.optimizer import build_optimizer, wrap_ddp
        from vime_trainer.megatron.passes import Passes
        from vime_trainer.megatron.runtime import init_rank
        from vime_trainer.megatron.train_step import TrainStep

        c = self.config
        self.info = init_rank(
            self.rank,
            self.world_size,
            master_addr,
            master_port,
            c.tensor_model_parallel_size,
            c.pipeline_model_parallel_size,
            c.trainer.seed,
            cpu_threads=1,  # CPU ranks are for tests and demos on small shared machines
        )
        if c.trainer.gpu_memory_utilization is not None and self.info.device.startswith("cuda"):
            torch.cuda.set_per_process_memory_fraction(c.trainer.gpu_memory_utilization, self.info.device)
        model = model_lib.build_model(self.arch, c.trainer, self.info)
        model_lib.load_hf_weights(model, self.arch, self.hf_checkpoint, self.info)
        self.dtype = model_lib.params_dtype(c.trainer, self.info.device.startswith("cuda"))
        self.ddp = wrap_ddp(model, c.trainer.grad_reduce_in_fp32)
        self.optimizer = build_optimizer(self.ddp, c.trainer, self.dtype)
        self.layer_offset = model_lib.layer_offset(self.arch, self.info)
        self.backup = WeightBackup(self.ddp)
        self.backup.backup("actor")
        if c.kl_coef > 0:
            self.backup.backup("ref")
        self.offloader = Offloader(self.ddp, self.optimizer, self.info.device)
        self.passes = Passes(
            self.ddp,
            self.optimizer,
            use_local_attention=not c.trainer.use_sdpa,
            state_ready=self.offloader.state_ready,
        )
        self.steps = TrainStep(self.passes, c, self.backup, self.info.device, self.info.dp_size)
        self._ready = True
        return asdict(self.info)

    # --- training (seed steps 37-41) --------------------------------------------------------
    def read_and_train(self, ref: BatchRef, sft: bool = False) -> TrainResult:
        """Seed steps 37–40 on this rank: read its share of ``ref`` from Redis, train on it
        (`train`, or `train_sft` for a warm-up batch), ack it after the optimizer step."""
        self._require_awake()
        reader = self._share_reader(ref.redis_url)
        t0 = time.perf_counter()
        share = self._await(reader.read(ref))
        read_s = time.perf_counter() - t0
        if (share.rollout_id, share.dp_size) != (ref.rollout_id, self.info.dp_size):
            raise ValueError(
                f"batch {share.batch_id} holds rollout {share.rollout_id} split for DP size {share.dp_size}; "
                f"asked for rollout {ref.rollout_id} at DP size {self.info.dp_size}"
            )
        steps = (self.train_sft if sft else self.train)(share)
        if steps:
            steps[0]["t_read_s"] = read_s
        self._await(reader.ack(share.batch_id))
        if not reader.consumes:
            return TrainResult(steps if self.info.reports_metrics else [])
        return TrainResult(
            steps if self.info.reports_metrics else [], [ShareSummary.of(share)], reader.skipped
        )

    def train(self, batch: RankBatch) -> list[dict[str, float]]:
        """Train on this rank's share (steps 38–40); backs the new weights up (step 41)."""
        self._require_awake()
        return self.steps.train(batch)

    def train_sft(self, batch: RankBatch) -> list[dict[str, float]]:
        """Supervised warm-up steps on this rank's share of (prompt, label) samples."""
        self._require_awake()
        return self.steps.train_sft(batch)

    def log_probs(self, batch: RankBatch) -> list[np.ndarray]:
        """Response-token log-probs per micro-batch with the current weights (last stage only)."""
        self._require_awake()
        return [lp.float().cpu().numpy() for lp in self.steps.log_probs(self.steps.micro_batches(batch))]

    def _share_reader(self, redis_url: str) -> ShareReader:
        """This rank's reader: the DP rank's consumer on TP rank 0 of PP stage 0, a blob reader on
        its peers (`vime_trainer.batches`)."""
        if self._reader is not None and self._reader.redis_url != redis_url:
            self._await(self._reader.aclose())
            self._reader = None
        if self._reader is None:
            first = self.info.tp_rank == 0 and self.info.pp_rank == 0
            self._reader = ShareReader(redis_url, self.info.dp_rank, consumes=first)
        return self._reader

    def _await(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a Redis call on this rank's own event loop (a Ray actor's methods run in one thread)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def logits(self, tokens: np.ndarray) -> np.ndarray | None:
        """Full-vocabulary logits ``[b, s, V]`` of a token batch (returned by the reporting rank only)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        from vime_trainer.megatron.micro_batch import MicroBatch

        self._require_awake()
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.info.device)
        b, s = ids.shape
        empty = torch.zeros(0, dtype=torch.long, device=ids.device)
        mb = MicroBatch(
            ids,
            torch.arange(s, device=ids.device).expand(b, s),
            empty,
            empty,
            empty.float(),
            empty.float(),
            empty.float(),
            empty.bool(),
            [],
        )
        out: list[np.ndarray] = []

        def loss_fn(k: int, _: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logits = gather_from_tensor_model_parallel_region(self.passes.model.output_logits(hidden))
            out.append(logits.transpose(0, 1).float().cpu().numpy())
            return hidden.new_zeros(()), {}

        self.passes.forward_only([mb], loss_fn)
        return out[0] if out and self.info.reports_metrics else None

    # --- memory (seed steps 37, 41) ---------------------------------------------------------
    def sleep(self, offload: bool = True, keep_weights: bool = False) -> dict[str, float]:
        """Free accelerator memory (parameters, grads, optimizer state). ``offload=False`` keeps the
        optimizer's state on the GPU (`Offloader.sleep`) and refuses to when it would not leave the
        engines their ``engine.gpu_memory_utilization``. ``keep_weights``: the parameters stay
        until `drop_weights`, so the weight push reads them on the device instead of copying the
        CPU backup up. Returns GiB: freed, and on the GPU the peak allocated and reserved since
        the wake-up, what stays reserved while asleep, and how often the allocator, out of room,
        freed its cache and tried again (``alloc_retries``: each one a device-wide wait)."""
        gib = float(1 << 30)
        cuda = self.info.device.startswith("cuda")
        if cuda:
            awake = {
                "peak_gib": torch.cuda.max_memory_allocated() / gib,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib,
                "alloc_retries": float(_alloc_retries() - self._retries_at_wake),
            }
        freed = {"freed_gib": self.offloader.sleep(offload, keep_weights) / gib}
        if not cuda:
            return freed
        if not offload:
            from vime_trainer.megatron.memory import check_room_for_engines

            check_room_for_engines(self.info.device, self.config.engine.gpu_memory_utilization)
        return freed | awake | {"asleep_reserved_gib": torch.cuda.memory_reserved() / gib}

    def drop_weights(self) -> dict[str, float]:
        """Free the parameters a ``keep_weights`` sleep kept (after the push read them). GiB freed
        and, on the GPU, what stays reserved while asleep."""
        gib = float(1 << 30)
        out = {"freed_gib": self.offloader.drop_weights() / gib}
        if self.info.device.startswith("cuda"):
            out["asleep_reserved_gib"] = torch.cuda.memory_reserved() / gib
        return out

    def wake_up(self) -> None:
        self.offloader.wake_up()
        if self.info.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()  # the next sleep reports this step's peak
            self._retries_at_wake = _alloc_retries()

    @property
    def asleep(self) -> bool:
        return self.offloader.asleep

    def _require_awake(self) -> None:
        if self.asleep:
            raise RankAsleepError("the rank is asleep: wake it up first (the driver loop does, seed step 37)")

    def memory_stats(self) -> dict[str, float]:
        """GiB in use on this rank's device (GPU: allocated/reserved/peak; CPU: process RSS)."""
        gib = float(1 << 30)
        if self.info.device.startswith("cuda"):
            return {
                "allocated_gib": torch.cuda.memory_allocated() / gib,
                "reserved_gib": torch.cuda.memory_reserved() / gib,
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib,
            }
        import psutil

        return {"rss_gib": psutil.Process().memory_info().rss / gib}

    # --- checkpoints -----------------------------------------------------------------------
    def save(self, rollout_id: int, run_state: dict[str, Any], wait: bool = True) -> str:
        """Distributed checkpoint of model + optimizer, and the controller's run state (collective).
        ``wait=False`` returns once the state is copied off the model: the files are written in
        the background and `saved` completes the checkpoint. A save still being written is
        completed first."""
        from vime_trainer.megatron.checkpoint import start_checkpoint

        self._require_awake()
        self.saved()
        self.offloader.state_ready()
        meta = {
            "layout": {"tp": self.info.tp_size, "pp": self.info.pp_size, "dp": self.info.dp_size},
            "architecture": self.arch.to_dict(),
            "hf_checkpoint": self.hf_checkpoint,
            "params_dtype": str(self.dtype).removeprefix("torch."),
        }
        self._pending = start_checkpoint(
            self.config.trainer.checkpoint_dir,
            rollout_id,
            self.passes.model,
            self.optimizer,
            run_state,
            meta,
            self.info.device,
            background=not wait,
        )
        path = str(self._pending.path)
        if wait:
            self.saved()
        return path

    def saved(self) -> str | None:
        """Complete the checkpoint being written once every rank has written its files; its
        directory, or None when none was being written (collective; also while asleep)."""
        pending, self._pending = self._pending, None  # a failed one stays incomplete: resumes skip it
        if pending is None:
            return None
        pending.finish()
        return str(pending.path)

    def load(self, path: str | None = None) -> dict[str, Any] | None:
        """Load ``path`` (default: the newest complete checkpoint); None when there is none."""
        from vime_trainer.megatron.checkpoint import latest_checkpoint, load_checkpoint

        self._require_awake()
        self.saved()
        self.offloader.state_ready()  # a late copy of the old state must not land on the loaded one
        if path is None:
            found = latest_checkpoint(self.config.trainer.checkpoint_dir)
            if found is None:
                return None
            path = str(found[0])
        state = load_checkpoint(path, self.passes.model, self.optimizer)
        self.backup.backup("actor")
        return state

    # --- weight export (seed steps 48-50) ---------------------------------------------------
    def _export_source(self) -> dict[str, torch.Tensor]:
        """The parameters where they are on the device, else (asleep) their CPU backup."""
        if not self.offloader.weights_resident:
            return self.backup.get("actor")
        inner = self.passes.model
        return {n: p.detach() for n, p in inner.named_parameters()}

    def hf_buckets(self) -> Iterator[Any]:
        """Buckets of full HF tensors (collective; every rank receives every bucket)."""
        from vime_trainer.megatron.gather import iter_hf_buckets

        return iter_hf_buckets(
            self.arch,
            self._export_source(),
            self.info,
            self.layer_offset,
            self.config.trainer.packed_buffer_size_bytes,
        )

    def hf_state_dict(self) -> dict[str, np.ndarray] | None:
        """The whole model in HF names as numpy arrays (global rank 0; others None). For small models."""
        out = {}
        for bucket in self.hf_buckets():
            out.update(
                {
                    n: t.float().cpu().numpy() if t.dtype == torch.bfloat16 else t.cpu().numpy()
                    for n, t in bucket.state_dict().items()
                }
            )
        return out if self.rank == 0 else None

    def write_weight_buckets(self, directory: str | None = None) -> Iterator[dict[str, Any]]:
        """Write each bucket as a safetensors file (global rank 0) and yield its description."""
        for bucket in self.hf_buckets():
            if self.rank == 0:
                path = write_bucket(bucket, directory)
                yield {
                    "path": str(path),
                    "index": bucket.index,
                    "names": list(bucket.names),
                    "nbytes": bucket.nbytes,
                }

    def shutdown(self) -> None:
        from vime_trainer.megatron.runtime import shutdown_rank

        if self._reader is not None:
            self._await(self._reader.aclose())
            self._reader = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self._ready:
            shutdown_rank()
            self._ready = False


def _alloc_retries() -> int:
    """The caching allocator's count of allocations that found no room, freed its cache and retried."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
