"""``engine.weight_load`` on CPU: the direct load into reference engines (the same worker extension
vLLM runs, over shared-memory staging buffers), its refusal and the fallback to vLLM's loader.

Real processes: reference engines started with and without ``--worker-extension-cls``, Megatron
CPU ranks as Ray actors. Checked: after a direct push the engine's log-probs are the trainer's
(and were not before: training moved the weights), also from the sleeping trainer's CPU backup
and, from a sleep that kept them, from the parameters themselves;
the engines' checksums agree with the trainer's on every bucket, and a byte that changed after
the trainer checksummed it fails the push with the engines left paused; the staging buffers live
for one push (allocated and opened before the pause, closed and freed after the resume, also
when the push fails) while an engine's layout is read once per engine start (the order of one
push's calls: `test_direct_push_order`); engines that cannot be loaded directly (weights
in another dtype, no extension) are refused before anything is paused, and the push goes through
vLLM's loader instead with a ``weights.direct_refused`` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from vime_trainer.megatron.actor_group import ActorGroup
from vime_trainer.weight_sync import WeightSyncError, make_weight_sync
from vime_trainer.weight_sync.direct_sync import DirectSync
from vime_trainer.weight_sync.ipc import call_on_ranks

from tests.support.direct_engines import Unused, info, pushed_weights, start_engine
from tests.support.direct_ranks import LocalRanks
from tests.support.megatron import Publisher, one, rollout_batch, run_config, split
from vime import procs
from vime.wire.direct_load import EXTENSION

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 8, 23, 11, 60, 3]
STEPS = 6


@pytest.fixture(scope="module")
def engines(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Reference engines serving the checkpoint: ``direct`` (the extension), ``bf16`` (the extension,
    weights in bfloat16), ``plain`` (no extension)."""
    logs = tmp_path_factory.mktemp("engines")
    flavours = {
        "direct": ("--worker-extension-cls", EXTENSION),
        "bf16": ("--worker-extension-cls", EXTENSION, "--dtype", "bfloat16"),
        "plain": (),
    }
    children: list[procs.Child] = []
    urls: dict[str, str] = {}
    try:
        for name, extra in flavours.items():
            child, urls[name] = start_engine(qwen3, logs, name, *extra)
            children.append(child)
        yield urls
    finally:
        for child in children:
            child.stop()


def engine_logprobs(url: str) -> tuple[list[int], list[float]]:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": STEPS, "temperature": 0.0, "logprobs": 0}}
    choice = httpx.post(url + "/inference/v1/generate", json=body, timeout=60).json()["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


def trainer_logprobs(group: ActorGroup, tokens: list[int]) -> list[float]:
    logits = torch.tensor(one(group.call("logits", np.array([PROMPT + tokens]))))[0]
    lp = logits.log_softmax(-1)
    return [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]


def gap(url: str, group: ActorGroup) -> float:
    """Largest |engine − trainer| log-prob over the engine's greedy continuation of PROMPT."""
    tokens, got = engine_logprobs(url)
    want = trainer_logprobs(group, tokens)
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


def recorder() -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    events: list[tuple[str, dict[str, Any]]] = []
    return events, lambda action, **detail: events.append((action, detail))


@pytest.fixture(scope="module")
def group(ray_cluster: None, qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ActorGroup]:
    """TP=2 CPU ranks (the gather is collective; only global rank 0 shares a buffer)."""
    tmp = tmp_path_factory.mktemp("trainer")
    cfg = run_config(tmp, tp=2, ranks=2, engine={"weight_load": "direct"}, trainer={"lr": 1e-2})
    g = ActorGroup(cfg, str(qwen3))
    g.start()
    try:
        yield g
    finally:
        g.shutdown()


def test_direct_pushes_give_the_engine_the_trainers_weights(
    group: ActorGroup, engines: dict[str, str], publish: Publisher
) -> None:
    events, on_event = recorder()
    sync = make_weight_sync(group.config, group, on_event=on_event)
    assert isinstance(sync, DirectSync)
    url = engines["direct"]
    try:
        group.train(publish(split(group.config, rollout_batch(group.config, 0, seed=7))))
        assert gap(url, group) > 1e-3  # training moved the trainer away from the engine's checkpoint
        report = asyncio.run(sync.push([info(url)], 2, flush=True))
        assert report.weight_load == "direct" and report.buckets >= 1
        assert gap(url, group) < 1e-4
        assert httpx.get(url + "/weight_info").json() == {"weight_version": "2"}

        group.train(publish(split(group.config, rollout_batch(group.config, 1, seed=8))))
        group.sleep()  # asleep, weights and all: the push reads the CPU backup
        asyncio.run(sync.push([info(url)], 3, flush=False))
        group.wake_up()  # the comparison runs the trainer's forward
        assert gap(url, group) < 1e-4

        def shift_backup(rank: Any, by: float) -> None:
            for t in rank.backup.get("actor").values():
                t.add_(by)

        group.train(publish(split(group.config, rollout_batch(group.config, 2, seed=9))))
        group.sleep(keep_weights=True)  # seed step 41 as the loop runs it: the weights stay for the push
        call_on_ranks(group, shift_backup, 1.0)  # a push that read the backup would load this
        try:
            asyncio.run(sync.push([info(url)], 4, flush=False))
        finally:
            call_on_ranks(group, shift_backup, -1.0)
        group.drop_weights()
        group.wake_up()
        assert gap(url, group) < 1e-4
    finally:
        asyncio.run(sync.aclose())
    actions = [a for a, _ in events]
    assert "weights.direct_refused" not in actions
    opened, closed = "weights.direct_open", "weights.direct_close"
    assert [a for a in actions if a != "weights.update"] == [
        *(opened, "weights.pause", "weights.flush", "weights.label", "weights.resume", closed),
        *(opened, "weights.pause", "weights.label", "weights.resume", closed),
        *(opened, "weights.pause", "weights.label", "weights.resume", closed),
    ]
    assert call_on_ranks(group, lambda rank: getattr(rank, "_vime_direct_exporter", None)) == [None, None]


@pytest.mark.parametrize(
    ("flavour", "reason"),
    [("bf16", "bfloat16"), ("plain", "--worker-extension-cls")],
    ids=["other-dtype", "no-extension"],
)
def test_refused_engines_get_vllms_loader_instead(
    group: ActorGroup, engines: dict[str, str], flavour: str, reason: str, publish: Publisher
) -> None:
    events, on_event = recorder()
    sync = make_weight_sync(group.config, group, on_event=on_event)
    url = engines[flavour]
    before = engine_logprobs(url)
    group.wake_up()  # an earlier test may have left the ranks asleep
    group.train(publish(split(group.config, rollout_batch(group.config, 5, seed=11))))
    try:
        report = asyncio.run(sync.push([info(url)], 7, flush=True))
        report_2 = asyncio.run(sync.push([info(url)], 8, flush=True))
    finally:
        asyncio.run(sync.aclose())
    assert (report.weight_load, report_2.weight_load) == ("vllm", "vllm")
    refused = [d for a, d in events if a == "weights.direct_refused"]
    assert len(refused) == 1 and reason in refused[0]["reason"]
    assert [a for a, _ in events].index("weights.direct_refused") < [a for a, _ in events].index(
        "weights.pause"
    )
    assert "weights.start" in [a for a, _ in events]  # vLLM's protocol carried the weights
    assert engine_logprobs(url) != before
    assert gap(url, group) < (0.05 if flavour == "bf16" else 1e-4)


# --- the driver alone (no Megatron): checksums, restarts ---------------------------------------------


@pytest.fixture
def hf_weights(qwen3: Path) -> dict[str, torch.Tensor]:
    return pushed_weights(qwen3)


class CorruptingRanks(LocalRanks):
    """Flips one byte of bucket ``bad`` in the staging buffer after the trainer checksummed it."""

    bad = 1

    def next(self, slot: int) -> list[dict[str, Any] | None]:
        out = super().next(slot)
        if out[0] is not None and out[0]["index"] == self.bad:
            _, offset, _ = out[0]["params"][0]
            buffer = self._open().buffers[slot]
            buffer[offset] ^= 0xFF
        return out


def test_a_byte_the_engine_did_not_get_as_packed_fails_the_push_and_keeps_it_paused(
    engines: dict[str, str], hf_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    url = engines["direct"]
    ranks = CorruptingRanks(hf_weights, tmp_path)
    sync = DirectSync(ranks, Unused(), bucket_bytes=32 << 10)
    try:
        with pytest.raises(WeightSyncError, match=r"bucket 1: .* checksum .* the engines stay paused"):
            asyncio.run(sync.push([info(url)], 4, flush=True))
        assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
        assert sync.opened == [] and ranks.exporter is None and not list(tmp_path.iterdir())
    finally:
        httpx.post(url + "/resume")
        asyncio.run(sync.aclose())


def rpc_log(calls: list[str]) -> Any:
    """An engine client factory recording the worker methods it calls through ``/collective_rpc``."""
    from vime.clients.engine import EngineClient

    class Recording(EngineClient):
        async def request(self, method: str, path: str, **options: Any) -> Any:
            if path == "/collective_rpc":
                calls.append(options["json"]["method"])
            return await super().request(method, path, **options)

    return lambda url: Recording(url)


def test_staging_buffers_live_for_one_push_and_a_restarted_engine_is_checked_again(
    engines: dict[str, str], hf_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    url = engines["direct"]
    events, on_event = recorder()
    fallback = Unused()
    fallback.on_event = on_event
    ranks = LocalRanks(hf_weights, tmp_path)
    calls: list[str] = []
    sync = DirectSync(ranks, fallback, bucket_bytes=32 << 10, client_factory=rpc_log(calls))
    left: list[list[Path]] = []
    try:
        nothing = asyncio.run(sync.push([], 4, flush=True))  # no engine: no staging, no call
        assert (nothing.buckets, ranks.opened, calls) == (0, 0, [])
        for version, restarts in ((5, 0), (6, 0), (7, 1)):
            asyncio.run(sync.push([info(url, restarts=restarts)], version, flush=version != 6))
            left.append(list(tmp_path.iterdir()))
            assert ranks.exporter is None and not sync.staged and sync.opened == []
        tokens, _ = engine_logprobs(url)
    finally:
        asyncio.run(sync.aclose())
    assert left == [[], [], []]  # the staging files are gone after every push
    assert ranks.opened == 3
    layout, opened, load, closed = (
        "vime_direct_layout",
        "vime_direct_open",
        "vime_direct_load",
        "vime_direct_close",
    )
    assert [c for c in calls if c != load] == [
        *(layout, opened, closed),
        *(opened, closed),
        *(layout, opened, closed),  # the restarted engine's layout is read again
    ]
    actions = [a for a, _ in events]
    for _ in range(3):
        a, b = actions.index("weights.direct_open"), actions.index("weights.direct_close")
        assert a < actions.index("weights.pause") < actions.index("weights.resume") < b
        actions = actions[b + 1 :]
    updates = [a for a, _ in events].count("weights.update")
    assert updates % 3 == 0 and updates // 3 > 2  # several buckets a push: both staging buffers in turn
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "7"}
    assert tokens  # still generating after three direct pushes
