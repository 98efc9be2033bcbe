"""The rollout manager as a process with everything real around it: Redis, the router service
(vllm-router behind it), the reward service, and two CPU reference engines it starts itself.

The seed's rollout scaled down: 4 prompts × 8 samples, a dynamic filter that drops the groups
whose rewards are all equal (re-sampling until the batch is full), GRPO-normalised rewards, loss
masks and a DP schedule read back from Redis as the trainer's ranks read them; every engine killed
mid-rollout (the rollout waits for the restarted engines and completes with all its groups); an
engine killed mid-rollout once weights were pushed (taken out of the router, the rollout completes
on the other; the engine is restarted and waits for weights);
offload/onload reaching every engine; bad input answered 4xx; a preview (``publish: false``)
leaving the stream and the data source untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import yaml
from vime_rollout.rollout.state import logprobs_wanted

from tests.support.rollout_stack import start_rollout_services
from vime import procs
from vime.algorithms import normalize_group_rewards
from vime.clients.base import ServiceCallError
from vime.clients.rollout import RolloutClient
from vime.config import load_config
from vime.models.tiny import build_tokenizer
from vime.queue import BatchConsumer, stream_key
from vime.retry import poll_until
from vime.wire.rollout import EngineInfo

pytestmark = pytest.mark.slow

TOKEN = "it-rollout-token"
N = 8
# Rewards by label: "const" prompts score 1 for every sample (zero std: the filter drops the group),
# "vary" prompts score by a hash of the response (their groups almost surely differ).
REWARD_MODULE = """
import zlib


def reward(req):
    if req.label == "const":
        return 1.0
    return float(zlib.crc32((req.response or "").encode()) % 2)
"""


@dataclass
class Stack:
    url: str
    cfg_path: Path
    cfg: dict[str, Any]
    redis_url: str
    manager: procs.Child
    logs: Path

    def client(self) -> RolloutClient:
        return RolloutClient(self.url, token=TOKEN)

    def router_urls(self) -> set[str]:
        """The engine URLs the router holds now."""
        port = self.cfg["services"]["router_control_port"]
        listing = httpx.get(
            f"http://127.0.0.1:{port}/v1/engines", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        return {e["url"] for e in listing.json()["engines"]}

    def config(self) -> Any:
        return load_config(self.cfg_path)


def _write_inputs(work: Path) -> tuple[Path, Path]:
    prompts = work / "prompts.jsonl"
    # Alternating labels, not shuffled: the first 4 drawn hold 2 groups the filter drops.
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"{i}+{i}=", "label": "const" if i % 2 == 0 else "vary"}) + "\n"
            for i in range(12)
        )
    )
    evals = work / "eval.jsonl"
    evals.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": "vary"}) + "\n" for i in range(3)))
    (work / "rollout_it_rewards.py").write_text(REWARD_MODULE)
    return prompts, evals


def _config(work: Path, redis_url: str) -> dict[str, Any]:
    prompts, evals = _write_inputs(work)
    ports = {name: procs.free_port() for name in ("router", "router_control", "reward", "rollout")}
    return {
        "run_id": f"it-{uuid.uuid4().hex[:8]}",
        "output_dir": str(work / "runs"),
        "rollout_batch_size": 4,
        "n_samples_per_prompt": N,
        "over_sampling_batch_size": 4,
        "rollout_max_prompt_len": 16,
        "rollout_max_response_len": 48,
        "rollout_max_context_len": 64,
        "rollout_num_gpus": 0,
        "rollout_num_engines_cpu": 2,
        "vllm_server_concurrency": 16,
        "actor_num_gpus_per_node": 0,
        "actor_num_cpu_ranks": 2,
        "tensor_model_parallel_size": 1,
        "micro_batch_size": 4,
        "dynamic_sampling_filter_path": "vime_rollout.filters:check_reward_nonzero_std",
        "partial_rollout": True,
        "rollout_logprobs_fraction": 0.5,
        "model": {"tiny_model_size": "micro"},
        "data": {
            "prompt_data": str(prompts),
            "rollout_shuffle": False,
            "eval_prompt_data": {"held": str(evals)},
            "n_samples_per_eval_prompt": 4,
        },
        "reward": {"custom_rm_path": "rollout_it_rewards:reward", "num_workers": 1},
        "engine": {
            "backend": "reference",
            "base_port": procs.free_port_run(2),
            "startup_timeout_s": 300,
            "health_check_interval_s": 0.5,
            "health_failure_threshold": 2,
        },
        "router": {"policy": "round_robin", "retry_window_s": 240},
        "services": {
            "host": "127.0.0.1",
            **{f"{k}_port": v for k, v in ports.items()},
            "redis_url": redis_url,
            "api_token": TOKEN,
        },
    }


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("rollout-it")
    cfg = _config(work, redis_url)
    cfg_path = work / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    logs = work / "logs"
    children: list[procs.Child] = []
    engine_pids: list[int] = []
    try:
        url = start_rollout_services(
            cfg_path,
            cfg["services"],
            logs,
            children,
            reward_env={"PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])},
            manager_env={"VIME_MODEL_CACHE": str(tmp_path_factory.getbasetemp() / "models")},
        )
        manager = children[-1]  # started last
        engine_pids = [e["pid"] for e in httpx.get(url + "/v1/engines").json()["engines"]]
        yield Stack(url, cfg_path, cfg, redis_url, manager, logs)
    finally:
        for child in reversed(children):
            child.stop()
        for pid in engine_pids:  # in case the manager could not stop them itself
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _read_shares(stack: Stack, batch_id: str, dp_size: int, run_id: str | None = None) -> list[Any]:
    async def read() -> list[Any]:
        shares = []
        stream = run_id or stack.cfg["run_id"]
        for rank in range(dp_size):
            async with BatchConsumer(stack.redis_url, stream, rank, f"it-{rank}") as consumer:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    rb = await consumer.next(block_ms=1000)
                    if rb is not None and rb.batch_id == batch_id:
                        shares.append(rb)
                        break
                    if rb is not None:
                        await consumer.ack(rb.batch_id)
        return shares

    return asyncio.run(read())


def _engine_sleeping(url: str) -> bool:
    return bool(httpx.get(url + "/is_sleeping", timeout=10).json()["is_sleeping"])


def test_0_every_engine_killed_mid_rollout_the_rollout_waits_for_them(stack: Stack) -> None:
    """No engine left (issue 17): the generates wait (``router.retry_window_s``) while the manager
    restarts the engines (no weights pushed yet: they serve at once) and the rollout completes
    with all its groups. A preview, so the later tests see the stream and data source untouched."""

    async def main() -> None:
        async with stack.client() as c:
            await c.onload(None)  # the engines started asleep (colocated)
            before = (await c.engines()).engines
            job = await c.rollout(50, wait=False, publish=False)
            await asyncio.sleep(0.3)
            assert (await c.job(job.job_id)).state == "running"
            for e in before:
                os.kill(e.pid or 0, signal.SIGKILL)
            done = await c.wait_job(job.job_id, 0.2, timeout_s=300)
            assert done.state == "done", done.error
            assert done.num_samples == 32 and done.metrics["rollout/num_groups"] == 4
            after = (await c.engines()).engines
            assert [e.restarts for e in after] == [e.restarts + 1 for e in before]
            assert all(
                e.status == "ready" and e.registered and e.pid not in {b.pid for b in before} for e in after
            )
            assert stack.router_urls() == {e.url for e in after}
            await c.offload()  # as the engines were when the stack came up

    asyncio.run(main())


def test_1_engines_start_asleep_and_onload_reaches_every_engine(stack: Stack) -> None:
    """colocate → engines sleep after start (the trainer initialises); onload wakes each one."""

    async def main() -> None:
        async with stack.client() as c:
            engines = (await c.engines()).engines
            assert len(engines) == 2 and all(e.status == "ready" and e.registered for e in engines)
            assert all(set(e.asleep) == {"weights", "kv_cache"} for e in engines)
            assert all(_engine_sleeping(e.url) for e in engines)
            r = await c.onload(["weights"])  # seed steps 4–7
            assert r.tags_sent == ["weights"] and set(r.results.values()) == {"ok"}
            assert all(_engine_sleeping(e.url) for e in engines)  # kv_cache still asleep
            await c.weights_loaded(1)  # seed step 8: the trainer pushed v1
            r = await c.onload(["kv_cache", "cuda_graph"])  # seed steps 10–13
            assert r.tags_sent == ["kv_cache"] and len(r.results) == 2
            assert not any(_engine_sleeping(e.url) for e in engines)
            status = await c.engines()
            assert status.weight_version == 1 and all(e.weight_version == 1 for e in status.engines)

    asyncio.run(main())


def test_2_seed_rollout_scaled_down(stack: Stack) -> None:
    """4 prompts × 8 samples, filter re-sampling, normalised rewards, loss masks, DP schedule."""

    async def main() -> Any:
        async with stack.client() as c:
            return await c.rollout(0)

    job = asyncio.run(main())
    assert job.state == "done" and job.num_samples == 32 and job.dp_size == 2 and job.weight_version == 1
    assert job.run_id == stack.cfg["run_id"]  # the stream the trainer reads the batch from
    m = job.metrics
    assert m["rollout/num_groups"] == 4 and m["rollout/num_samples"] == 32
    assert m["rollout/groups_submitted"] >= 8 and m["rollout/groups_dropped"] >= 2  # "const" groups
    assert m["rollout/dropped/zero_std_1"] >= 2
    shares = _read_shares(stack, job.batch_id or "", 2)
    assert [s.dp_rank for s in shares] == [0, 1]
    cfg = stack.config()
    rows = sorted((sh.sample(i) for sh in shares for i in range(sh.num_samples)), key=lambda r: r.index)
    assert len(rows) == 32
    groups: dict[int, list[Any]] = {}
    for r in rows:
        groups.setdefault(r.group_index, []).append(r)
    assert len(groups) == 4 and all(len(g) == N for g in groups.values())
    for gi, g in groups.items():
        assert [r.index for r in g] == list(range(g[0].index, g[0].index + N))  # deep copies, consecutive
        rewards = [r.reward for r in g]
        assert len(set(rewards)) > 1  # the filter kept only groups with non-zero std
        expected = normalize_group_rewards(rewards, N)
        np.testing.assert_allclose([r.advantage for r in g], expected, atol=1e-5)
        assert abs(sum(r.advantage for r in g)) < 1e-4
        wanted = logprobs_wanted(cfg, gi) is not None
        for r in g:
            assert r.response_length > 0 and r.prompt_length > 0
            assert len(r.loss_mask) == r.response_length and r.loss_mask.all()
            assert (r.rollout_log_probs is not None) == wanted
            assert r.weight_version == 1
    for sh in shares:
        assert sh.num_samples == 16 and sh.num_microbatches == [4] and sh.global_batch_size == 32
        assert sh.micro_batches == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_3_engine_killed_mid_rollout(stack: Stack) -> None:
    """The rollout completes through the other engine; the dead one is restarted and needs weights."""

    async def main() -> None:
        async with stack.client() as c:
            victim = (await c.engines()).engines[1]
            job = await c.rollout(1, wait=False)
            await asyncio.sleep(0.3)
            assert (await c.job(job.job_id)).state == "running"
            os.kill(victim.pid or 0, signal.SIGKILL)
            # The manager takes it out of the router at its next check (0.5 s here).
            await poll_until(
                lambda: asyncio.to_thread(lambda: victim.url not in stack.router_urls()),
                timeout_s=10,
                interval_s=0.1,
                what="the killed engine out of the router",
            )
            done = await c.wait_job(job.job_id, 0.2, timeout_s=180)
            assert done.state == "done", done.error
            assert done.num_samples == 32

            async def waiting() -> EngineInfo | None:
                status = (await c.engines()).engines[1]
                return status if status.status == "needs_weights" else None

            status = await poll_until(waiting, timeout_s=240, interval_s=0.5, what="engine 1 restarted")
            assert (
                status.restarts == victim.restarts + 1 and not status.registered and status.pid != victim.pid
            )
            assert victim.url not in stack.router_urls()
            lock = await c.update_lock()
            assert lock.num_new_engines == 1 and len(lock.engines) == 2
            await c.weights_loaded(1, lease_id=lock.lease_id)
            back = (await c.engines()).engines[1]
            assert back.status == "ready" and back.registered and back.weight_version == 1
            again = await c.rollout(2)
            assert again.state == "done" and again.num_samples == 32

    asyncio.run(main())


def test_4_offload_reaches_every_engine(stack: Stack) -> None:
    async def main() -> None:
        async with stack.client() as c:
            engines = (await c.engines()).engines
            r = await c.offload()
            assert (
                r.level == 2
                and set(r.results) == {e.url for e in engines}
                and set(r.results.values()) == {"ok"}
            )
            assert all(_engine_sleeping(e.url) for e in engines)
            status = await c.engines()
            assert status.health_monitor_paused and all(
                set(e.asleep) == {"weights", "kv_cache"} for e in status.engines
            )
            # A rollout now would hang in the engines' queues: refused with what to do.
            r2 = httpx.post(
                stack.url + "/v1/rollouts",
                json={"rollout_id": 3},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert r2.status_code == 409 and "onload" in r2.json()["error"]["message"]
            await c.onload(None)
            assert not any(_engine_sleeping(e.url) for e in engines)
            assert not (await c.engines()).health_monitor_paused

    asyncio.run(main())


def test_5_bad_input_is_4xx(stack: Stack) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    post = httpx.post
    assert post(stack.url + "/v1/rollouts", json={"rollout_id": 0}).status_code == 401
    assert post(stack.url + "/v1/rollouts", json={"rollout_id": "x"}, headers=auth).status_code == 422
    assert post(stack.url + "/v1/engines/onload", json={"tags": ["vram"]}, headers=auth).status_code == 422
    assert httpx.get(stack.url + "/v1/rollouts/nope").status_code == 404
    r = httpx.put(stack.url + "/v1/data-source/state", json={"state": {"version": 1}}, headers=auth)
    assert r.status_code == 422 and "malformed" in r.json()["error"]["message"]
    # Issue 17: numbers out of range are refused naming the field, and nothing is changed by them.
    state = httpx.get(stack.url + "/v1/data-source/state").json()["state"]
    r = httpx.put(
        stack.url + "/v1/data-source/state", json={"state": {**state, "sample_index": 2**70}}, headers=auth
    )
    assert r.status_code == 422 and "state.sample_index" in r.json()["error"]["message"]
    assert httpx.get(stack.url + "/v1/data-source/state").json()["state"] == state
    for path, body, field in [
        ("/v1/sft-batches", {"step": 2**70}, "step"),
        ("/v1/engines/weights-loaded", {"version": 9 * 10**29}, "version"),
        ("/v1/rollouts", {"rollout_id": 2**64}, "rollout_id"),
    ]:
        r = post(stack.url + path, json=body, headers=auth)
        assert r.status_code == 422 and r.json()["error"]["message"].startswith(f"invalid request: {field}: ")
    big = b'{"rollout_id": 0, "x": "' + b"x" * (50 * 1024 * 1024) + b'"}'
    r = post(stack.url + "/v1/rollouts", content=big, headers={**auth, "content-type": "application/json"})
    assert r.status_code == 413


def test_6_eval_and_data_state(stack: Stack) -> None:
    async def main() -> None:
        async with stack.client() as c:
            paused = await c.pause_admission()  # as after the last step (seed step 53 skipped)
            job = await c.rollout(4, evaluation=True)  # admission gates training rollouts only
            assert job.batch_id is None and job.metrics["eval/held/num_samples"] == 12.0
            assert 0.0 <= job.metrics["eval/held/pass@4"] <= 1.0
            with pytest.raises(ServiceCallError) as refused:
                await c.rollout(5)
            assert refused.value.status_code == 409 and "admission is paused" in refused.value.message
            await c.resume_admission(paused.was_paused)
            state = await c.data_state()
            assert state["sample_group_index"] >= 8 and state["dataset_size"] == 12
            await c.set_data_state(state)
            assert await c.data_state() == state

    asyncio.run(main())


def test_7_sft_warm_up_batches(stack: Stack, tmp_path: Path) -> None:
    """Prompts with their labels (+ EOS) as responses on the run's own ``:sft`` stream; engines asleep."""

    async def main() -> list[Any]:
        async with stack.client() as c:
            await c.offload()  # the warm-up runs while the engines sleep (the colocated start-up)
            out = [await c.sft_batch(0), await c.sft_batch(0), await c.sft_batch(1)]
            await c.onload(None)
            return out

    a, again, b = asyncio.run(main())
    run = stack.cfg["run_id"]
    assert (a.run_id, a.batch_id, again.batch_id) == (f"{run}:sft", f"{run}:sft:0:0", f"{run}:sft:0:1")
    assert a.num_samples == 32 and a.dp_size == 2 and a.entry_id and a.metrics["sft/label_len_mean"] > 1
    tok = build_tokenizer(tmp_path / "tok")
    rows = {}
    for reply in (a, again, b):
        shares = _read_shares(stack, reply.batch_id, 2, run_id=reply.run_id)
        assert [sh.dp_rank for sh in shares] == [0, 1] and all(sh.num_microbatches == [4] for sh in shares)
        rows[reply.batch_id] = sorted(
            (sh.sample(i) for sh in shares for i in range(16)), key=lambda r: r.index
        )
    assert [r.index for r in rows[a.batch_id]] == list(range(32))
    assert [r.index for r in rows[b.batch_id]] == list(range(32, 64))  # step 1: the next 32 positions
    for x, y in zip(rows[a.batch_id], rows[again.batch_id], strict=True):  # a step asked again: the same
        assert np.array_equal(x.tokens, y.tokens)
    for r in rows[a.batch_id] + rows[b.batch_id]:
        i = r.index % 12  # not shuffled: position p is prompt p mod 12
        assert tok.decode(r.tokens[: r.prompt_length].tolist()) == f"{i}+{i}="
        label = "const" if i % 2 == 0 else "vary"
        assert tok.decode(r.tokens[r.prompt_length :].tolist()) == label + "<|endoftext|>"
        assert r.loss_mask.all() and r.advantage == 1.0 and r.reward == 1.0


def test_8_a_preview_publishes_nothing(stack: Stack) -> None:
    """``publish: false`` (what `vime rollout` sends): the samples come back in the reply, the run's
    stream is untouched and the data source is where it was; the training rollout of the same id is
    a separate job that does publish."""
    stream = stream_key(stack.cfg["run_id"])

    async def main() -> None:
        r = aioredis.Redis.from_url(stack.redis_url)
        try:
            async with stack.client() as c:
                state, length = await c.data_state(), await r.xlen(stream)
                job = await c.rollout(9, publish=False)
                assert job.preview and job.state == "done" and job.batch_id is None and job.samples
                assert await r.xlen(stream) == length and await c.data_state() == state
                assert job.num_samples == len(job.samples) == 32 and job.metrics["rollout/num_groups"] == 4
                by_group: dict[int, list[Any]] = {}
                for s in job.samples:
                    by_group.setdefault(s.group_index or 0, []).append(s)
                for g in by_group.values():
                    rewards = [s.reward or 0.0 for s in g]
                    assert len(g) == N and len(set(rewards)) > 1  # the filter ran as for training
                    np.testing.assert_allclose(
                        [s.advantage for s in g], normalize_group_rewards(rewards, N), atol=1e-5
                    )
                    assert len({s.prompt for s in g}) == 1 and all(s.response_ids for s in g)
                train = await c.rollout(9)
                assert train.job_id != job.job_id and not train.preview and train.batch_id
                assert await r.xlen(stream) == length + 1
        finally:
            await r.aclose()

    asyncio.run(main())


def test_9_a_rollout_made_before_a_run_is_not_the_runs(stack: Stack) -> None:
    """Issue 17: a rollout published out of band, before a run, was handed to the run as its own.
    After ``POST /v1/training-ready`` the run's request for that id generates it anew."""

    async def main() -> None:
        async with stack.client() as c:
            early = await c.rollout(20)
            assert (await c.rollout(20)).job_id == early.job_id  # a retry still gets its job
            await c.training_ready()
            own = await c.rollout(20)
            assert own.job_id != early.job_id and own.batch_id != early.batch_id
            assert own.batch_id and own.batch_id.endswith(":20:1")

    asyncio.run(main())
