"""The rounds of bench/weight_sync.py: what runs inside the trainer's ranks (the weight flip, the
D2D baseline), the greedy checks against the engines, and one colocated push as ``vime train``
makes it, each round checked and timed; a failed round is recorded, never raised."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import httpx
from gpu_common import console, sync_round
from ray import cloudpickle

from vime.config import RunConfig
from vime.wire.rollout import EngineInfo

# The ranks are Ray actors: ship this module's functions by value, as they are when they live in
# the script itself (a rank's interpreter need not find bench/ on its path).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

KINDS = ("vllm", "direct")
PROMPTS = [[(7 * i + 13 * j) % 90 + 3 for j in range(8)] for i in range(8)]


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``KIND`` or ``KIND@MB``: the ``engine.weight_load`` value and the bucket size in MiB (None:
    the config's)."""
    kind, _, mb = spec.partition("@")
    if kind not in KINDS or (mb and not mb.isdigit()):
        raise ValueError(f"KIND or KIND@MB with KIND one of {', '.join(KINDS)}")
    return kind, int(mb) if mb else None


def with_weight_load(cfg: RunConfig, spec: str) -> RunConfig:
    """``cfg`` with the spec's ``engine.weight_load`` (and bucket size, for ``KIND@MB``)."""
    kind, mb = parse_spec(spec)
    trainer = (
        cfg.trainer if mb is None else cfg.trainer.model_copy(update={"packed_buffer_size_bytes": mb << 20})
    )
    return cfg.model_copy(
        update={"engine": cfg.engine.model_copy(update={"weight_load": kind}), "trainer": trainer}
    )


# --- what runs inside the trainer's rank ----------------------------------------------------------


def flip_final_norm(rank: Any) -> None:
    """Negate the final norm — live, in its fp32 master and in the CPU backup — so every greedy token
    changes. The master matters: a mixed-precision optimizer's wake-up rebuilds the bf16 weights from
    the masters, so a flip of the live weights alone is undone by the next round's wake-up (on the
    H100 on 12-08 every round after the first found the engine already agreeing)."""
    import torch
    from vime_trainer.megatron.memory import masters_of

    rank.wake_up()
    masters = masters_of(rank.optimizer)
    with torch.no_grad():
        for name, p in rank.passes.model.named_parameters():
            if name.endswith("final_layernorm.weight"):
                p.neg_()
                if id(p) in masters:
                    masters[id(p)].neg_()
        if rank.backup.has("actor"):
            for name, t in rank.backup.get("actor").items():
                if name.endswith("final_layernorm.weight"):
                    t.neg_()


def device_copy_seconds(rank: Any) -> dict[str, float]:
    """The same bytes copied on the GPU (one flat copy; one clone per parameter)."""
    import torch

    params = [p.detach() for p in rank.passes.model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    out: dict[str, float] = {}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(2):  # the second is the figure
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        out["flat"] = time.perf_counter() - t0
    del src, dst  # at most 2× the weights extra at any time
    for _ in range(2):  # the second is the figure (the first pays for allocation)
        t0 = time.perf_counter()
        clones = [p.clone() for p in params]
        torch.cuda.synchronize()
        out["clones"] = time.perf_counter() - t0
        del clones
    torch.cuda.empty_cache()
    return {**out, "bytes": float(nbytes)}


def empty_cache(rank: Any) -> None:
    import torch

    torch.cuda.empty_cache()


# --- rounds ------------------------------------------------------------------------------------


def trainer_logits(group: Any) -> Any:
    """The trainer's logits at the last position of every probe prompt (``[prompts, vocab]``)."""
    import numpy as np

    return next(x for x in group.call("logits", np.array(PROMPTS)) if x is not None)[:, -1, :]


def greedy_agrees(logits: Any, url: str) -> bool:
    """The engine's greedy next token is the trainer's argmax, or within bf16 noise of it, for every prompt.

    bf16 noise scales with the logits: two bf16 implementations of a 4B model differ by ~1% of the
    largest logit (a fixed 0.05 flagged every correct push of the 4B shape on the H200), while
    stale or garbled weights pick tokens far below the trainer's maximum.
    """
    import numpy as np

    for prompt, row in zip(PROMPTS, logits, strict=True):
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        out = httpx.post(url + "/inference/v1/generate", json=body, timeout=60).json()
        noise = 0.05 + 0.02 * float(np.abs(row).max())
        if row[out["choices"][0]["token_ids"][0]] < row.max() - noise:
            return False
    return True


def on_engines(engines: list[EngineInfo], path: str, **params: Any) -> None:
    """``POST path`` on every engine (a sleep or wake-up outside the timed push)."""
    for e in engines:
        httpx.post(e.url + path, params=params, timeout=300).raise_for_status()


async def colocated_push(
    sync: Any, group: Any, engines: list[EngineInfo], version: int, trainer: str
) -> tuple[Any, dict[str, float]]:
    """Seed 33–36, (41), 43, 45–52, 54: engines sleep, (trainer sleeps,) weights wake, push, (the
    trainer's weights go,) KV wakes. ``trainer``: ``awake`` (it stays so), ``sleeps`` (it sleeps
    keeping its weights after the engines do) or ``asleep`` (it already sleeps so)."""
    clients = [httpx.AsyncClient(base_url=e.url, timeout=300) for e in engines]

    async def each(path: str, **params: Any) -> float:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(c.post(path, params=params) for c in clients))
        for a in answers:
            a.raise_for_status()
        return time.perf_counter() - t0

    try:
        await each("/sleep", level=2, mode="keep")
        if trainer == "sleeps":  # as `vime train`: its weights stay on the GPU for the push
            await asyncio.to_thread(group.sleep, True, True)
        wake_weights = await each("/wake_up", tags="weights")
        rep = await sync.push(engines, version, flush=True)
        if trainer != "awake":
            await asyncio.to_thread(group.drop_weights)
        wake_kv = await each("/wake_up", tags="kv_cache")
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return rep, {"wake_weights_s": round(wake_weights, 4), "wake_kv_s": round(wake_kv, 4)}


class Rounds:
    """Pushes through `make_weight_sync`, each checked (stale before, greedy agreement after) and
    timed against its baseline; a failed round is recorded, never raised. A ``direct`` push opens
    its staging buffers before the pause and closes them after the resume (phases ``open`` and
    ``close``, outside pause → resume), so the specs can alternate freely."""

    def __init__(
        self,
        cfg: RunConfig,
        group: Any,
        engines: list[EngineInfo],
        gpu: bool,
        specs: list[str],
        lean: bool = False,
    ) -> None:
        from vime_trainer.weight_sync import make_weight_sync

        self.group, self.engines, self.gpu, self.lean = group, engines, gpu, lean
        self.version = 0
        self.problems: list[str] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.syncs = {
            spec: make_weight_sync(with_weight_load(cfg, spec), group, on_event=self._event) for spec in specs
        }
        self.d2d: dict[str, float] | None = None
        self.tmpfs_s: float | None = None

    def _event(self, action: str, **detail: Any) -> None:
        self.events.append((action, detail))

    def agree(self, logits: Any = None) -> bool:
        """Every engine agrees with ``logits`` (default: the trainer's now)."""
        logits = trainer_logits(self.group) if logits is None else logits
        return all(greedy_agrees(logits, e.url) for e in self.engines)

    def run(self, kind: str, trainer_sleeps: bool, label: str) -> dict[str, Any]:
        try:
            return self._one(kind, trainer_sleeps)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.problems.append(f"{label} {kind} push {self.version}: {error}")
            console.print(f"[red]✗ {label} {kind} push {self.version} failed: {error}[/]")
            return {"kind": kind, "version": self.version, "error": error}

    def _one(self, spec: str, trainer_sleeps: bool) -> dict[str, Any]:
        from vime_trainer.weight_sync.ipc import call_on_ranks

        kind, _ = parse_spec(spec)
        self.version += 1
        call_on_ranks(self.group, flip_final_norm)
        if self.lean:  # the trainer's state and the engines never awake together
            expected = trainer_logits(self.group)
            self.group.sleep(True, True)
            self._baseline()
            on_engines(self.engines, "/wake_up")
        else:
            expected = None
        stale = not self.agree(expected)
        if not stale:
            self.problems.append(f"{spec} push {self.version}: the engines agreed before the push")
        trainer = "asleep" if self.lean else "sleeps" if trainer_sleeps else "awake"
        rep, wakes = asyncio.run(
            colocated_push(self.syncs[spec], self.group, self.engines, self.version, trainer)
        )
        if trainer == "sleeps":  # seed step 37: the comparison and the next round run its forward
            self.group.wake_up()
        agrees = self.agree(expected)
        if self.lean:
            on_engines(self.engines, "/sleep", level=1)  # the next round wakes the trainer
        if not agrees:
            self.problems.append(
                f"{spec} push {self.version}: after the push an engine disagrees with the trainer"
            )
        if rep.weight_load != kind:
            self.problems.append(f"{spec} push {self.version}: loaded by {rep.weight_load} (refused?)")
        extra = {
            "kind": spec,
            "weight_load": rep.weight_load,
            "engine_was_stale": stale,
            "greedy_agrees": agrees,
        }
        if not self.gpu:
            base = self.tmpfs_s = self.tmpfs_s or tmpfs_round_trip(self.group)
            return sync_round(rep, "tmpfs write+read", base, **extra, **wakes)
        d2d = self._baseline()
        return sync_round(
            rep, "D2D flat copy", d2d["flat"], d2d_clones_s=round(d2d["clones"], 5), **extra, **wakes
        )

    def _baseline(self) -> dict[str, float]:
        """The D2D copy of the weights' bytes on the GPU, measured once."""
        from vime_trainer.weight_sync.ipc import call_on_ranks

        if self.gpu and self.d2d is None:
            self.d2d = call_on_ranks(self.group, device_copy_seconds)[0]
        return self.d2d or {}

    def close(self) -> None:
        for sync in self.syncs.values():
            asyncio.run(sync.aclose())


def tmpfs_round_trip(group: Any) -> float:
    """Write + read the same buckets in this process: the tmpfs floor."""
    import torch
    from vime_trainer.weights.bucket_files import read_bucket, write_bucket
    from vime_trainer.weights.buckets import pack_buckets

    tensors = [(n, torch.tensor(a)) for n, a in group.call("hf_state_dict")[0].items()]
    t0 = time.perf_counter()
    for bucket in pack_buckets(tensors, group.config.trainer.packed_buffer_size_bytes):
        path = write_bucket(bucket, group.config.trainer.weight_dir, prefix="bench-baseline")
        read_bucket(path)
        path.unlink()
    return time.perf_counter() - t0
