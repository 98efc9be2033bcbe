"""Each service answering its own API in the containers: a rollout preview (`publish: false`) from
the rollout manager, a generate through the router's published port, a reward call."""

from __future__ import annotations

import httpx
from compose_stack import ROUTER_PORT, Stack

from vime.queue import stream_key
from vime.wire.vllm import GENERATE_PATH

ROLLOUT = "http://rollout:18083"


def test_a_rollout_preview_returns_samples_and_publishes_nothing(stack: Stack, cpu_config: dict) -> None:
    stream = stream_key("default")  # the rollout manager's run id: compose sets none
    before = stack.redis("XLEN", stream)
    status, body = stack.call(f"{ROLLOUT}/v1/engines/offload", "POST", {})
    assert status == 200, body
    status, body = stack.call(f"{ROLLOUT}/v1/rollouts", "POST", {"rollout_id": 0, "publish": False})
    assert status == 409 and "/v1/engines/onload" in body["error"]["message"], body
    status, body = stack.call(f"{ROLLOUT}/v1/engines/onload", "POST", {})
    assert status == 200, body
    status, job = stack.call(f"{ROLLOUT}/v1/rollouts", "POST", {"rollout_id": 0, "publish": False})
    assert status == 200, job
    n = cpu_config["rollout_batch_size"] * cpu_config["n_samples_per_prompt"]
    assert (job["state"], job["preview"], job["batch_id"], job["num_samples"]) == ("done", True, None, n)
    samples = job["samples"]
    assert len(samples) == n
    assert all(s["response_ids"] and s["reward"] is not None for s in samples)
    assert len({s["group_index"] for s in samples}) == cpu_config["rollout_batch_size"]
    assert stack.redis("XLEN", stream) == before


def test_generate_through_the_router(stack: Stack, awake: None) -> None:
    url = stack.url(ROUTER_PORT, GENERATE_PATH)
    body = {"token_ids": [20, 21, 14, 22], "sampling_params": {"max_tokens": 8, "temperature": 0}}
    resp = httpx.post(url, json=body, headers={"X-Session-ID": "ci"}, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    choice = out["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 8
    assert out["usage"]["prompt_tokens"] == 4
    again = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    assert again["token_ids"] == choice["token_ids"]  # temperature 0: the same answer
    bad = httpx.post(url, json={"token_ids": [], "sampling_params": {}}, timeout=120)
    assert 400 <= bad.status_code < 500, bad.text


def test_a_reward_call(stack: Stack) -> None:
    reward = "http://reward:18082/v1/reward"
    right = {"response": "so the answer is \\boxed{42}", "label": "42", "fn": "math"}
    status, body = stack.call(reward, "POST", right)
    assert status == 200, body
    assert (body["reward"], body["status"], body["pred"]) == (1.0, "ok", "42")
    status, body = stack.call(reward, "POST", right | {"label": "41"})
    assert (status, body["reward"]) == (200, 0.0), body
    status, body = stack.call(reward, "POST", {"response": "42", "fn": "math"})
    assert status == 422 and "label" in str(body), body
