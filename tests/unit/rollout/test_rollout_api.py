"""The REST API in-process (stub engines, in-process router/reward stand-ins): bad input and wrong
states are 4xx answers naming the problem; the happy paths of the integration tests are not
repeated here."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from rollout_fakes import FakeGenerator, StubWorld, manager_starter, small_config
from vime_rollout.app import build_app
from vime_rollout.batch_builder import BatchSink
from vime_rollout.data import DataSource, build_dataset
from vime_rollout.data.synthetic import arithmetic_records
from vime_rollout.sft import SftExamples

from vime.algorithms import normalize_group_rewards
from vime.clients.base import ServiceCallError, ServiceUnreachable
from vime.clients.rollout import RolloutClient
from vime.procs import free_port
from vime.retry import poll_until_blocking

TOKEN = "t0ken"
COMMON: dict[str, Any] = {
    "input_key": "prompt",
    "label_key": "label",
    "metadata_key": "metadata",
    "apply_chat_template": False,
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(tokenizer: Any) -> Iterator[tuple[TestClient, StubWorld, FakeGenerator]]:
    cfg = small_config()
    world = StubWorld()
    gen = FakeGenerator()
    train = build_dataset("a", arithmetic_records(20, 1), tokenizer, max_prompt_len=64, **COMMON)
    evals = {"held": build_dataset("held", arithmetic_records(3, 2), tokenizer, max_prompt_len=64, **COMMON)}

    start = manager_starter(
        cfg,
        tokenizer,
        world,
        engines=2,
        run_id="unit",
        generator=gen,
        train_data=DataSource(train, cfg.n_samples_per_prompt, seed=1),
        eval_data=evals,
        sink=None,
    )
    with TestClient(build_app(start, token=TOKEN, default_dp_size=cfg.dp_size)) as c:
        yield c, world, gen


def _error(r: Any, status: int) -> str:
    assert r.status_code == status, r.text
    return str(r.json()["error"]["message"])


def test_state_changes_need_the_token(client: Any) -> None:
    c, _, _ = client
    assert c.post("/v1/rollouts", json={"rollout_id": 0}).status_code == 401
    assert c.post("/v1/engines/offload").status_code == 401
    assert c.put("/v1/data-source/state", json={"state": {}}).status_code == 401
    assert c.get("/v1/engines").status_code == 200  # reads are open


def test_bad_bodies_are_422_naming_the_field(client: Any) -> None:
    c, _, _ = client
    assert "rollout_id" in _error(c.post("/v1/rollouts", json={"rollout_id": -1}, headers=AUTH), 422)
    assert "rollout_id" in _error(c.post("/v1/rollouts", json={}, headers=AUTH), 422)
    assert "evalution" in _error(
        c.post("/v1/rollouts", json={"rollout_id": 0, "evalution": True}, headers=AUTH), 422
    )
    assert "dp_size=3" in _error(
        c.post("/v1/rollouts", json={"rollout_id": 0, "dp_size": 3}, headers=AUTH), 422
    )
    assert "tags" in _error(c.post("/v1/engines/onload", json={"tags": ["gpu"]}, headers=AUTH), 422)
    assert "level" in _error(c.post("/v1/engines/offload", json={"level": 3}, headers=AUTH), 422)
    assert "version" in _error(c.post("/v1/engines/weights-loaded", json={"version": -2}, headers=AUTH), 422)
    bad_json = c.post("/v1/rollouts", content=b"{nope", headers={**AUTH, "content-type": "application/json"})
    assert bad_json.status_code == 422


def test_every_integer_is_bounded_naming_the_field(client: Any) -> None:
    """Issue 17: ``{"step": 2**70}`` was a plain-text 500 and a weight version of 9 × 10^29 was
    taken; every number now has a range and a number outside it is a 422 naming its field."""
    c, _, _ = client
    cases = [
        ("/v1/rollouts", {"rollout_id": 2**53}, "rollout_id"),
        ("/v1/rollouts", {"rollout_id": 0, "dp_size": 2**70}, "dp_size"),
        ("/v1/sft-batches", {"step": 2**70}, "step"),
        ("/v1/sft-batches", {"step": 0, "dp_size": 2**40}, "dp_size"),
        ("/v1/engines/weights-loaded", {"version": 9 * 10**29}, "version"),
        ("/v1/engines/weights-loaded", {"version": 2**31}, "version"),
    ]
    for path, body, field in cases:
        r = c.post(path, json=body, headers=AUTH)
        assert r.status_code == 422 and r.json()["error"]["message"].startswith(
            f"invalid request: {field}:"
        ), (
            path,
            r.text,
        )
    assert "rollout_id" in _error(c.post(f"/v1/training-completed/{2**70}", headers=AUTH), 422)
    assert "rollout_id" in _error(c.post("/v1/training-completed/-1", headers=AUTH), 422)
    assert c.get("/v1/engines").json()["weight_version"] == 0  # nothing was taken


def test_bodies_are_limited_like_every_service(client: Any) -> None:
    """Issue 17: a 50 MB body was read and parsed; now 413 above 1 MiB (64 MiB for a data-source
    state, which carries handed-back samples)."""
    c, _, _ = client
    big = b'{"rollout_id": 0, "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    r = c.post("/v1/rollouts", content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["error"]["message"]
    state = {"state": {**c.get("/v1/data-source/state").json()["state"], "pad": "x" * (2 * 1024 * 1024)}}
    r = c.put("/v1/data-source/state", json=state, headers=AUTH)
    assert r.status_code == 200, r.text[:200]


def test_unknown_job_is_404(client: Any) -> None:
    c, _, _ = client
    assert "no rollout job" in _error(c.get("/v1/rollouts/abc"), 404)


def test_rollout_refused_while_offloaded_or_paused(client: Any) -> None:
    c, _, _ = client
    r = c.post("/v1/engines/offload", headers=AUTH)
    assert r.status_code == 200 and r.json()["level"] == 2 and set(r.json()["results"].values()) == {"ok"}
    assert "offloaded" in _error(c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH), 409)
    r = c.post("/v1/engines/onload", json={"tags": ["weights"]}, headers=AUTH)
    assert r.json()["tags_sent"] == ["weights"]
    assert "kv_cache asleep" in _error(c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH), 409)
    r = c.post("/v1/engines/onload", json={"tags": ["kv_cache", "cuda_graph"]}, headers=AUTH)
    assert r.json()["tags_sent"] == ["kv_cache"]
    # Seed steps 44 and 53: pause says whether admission was paused already; resume undoes only a
    # pause that found it open, so a second pause's resume leaves the first one in force.
    assert c.post("/v1/admission/pause", headers=AUTH).json() == {"was_paused": False, "paused": True}
    assert "admission is paused" in _error(c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH), 409)
    assert c.post("/v1/admission/pause", headers=AUTH).json() == {"was_paused": True, "paused": True}
    assert c.post("/v1/admission/resume", json={"was_paused": True}, headers=AUTH).json()["paused"] is True
    assert "was_paused" in _error(c.post("/v1/admission/resume", json={}, headers=AUTH), 422)
    # Admission gates training rollouts only: an eval (nothing published) runs while it is paused.
    ev = c.post("/v1/rollouts", json={"rollout_id": 0, "evaluation": True}, headers=AUTH)
    assert ev.status_code == 200 and ev.json()["state"] == "done", ev.text
    assert c.post("/v1/admission/resume", json={"was_paused": False}, headers=AUTH).json()["paused"] is False
    # Step 9 opens admission a previous run's last step left paused (it skips step 53).
    c.post("/v1/admission/pause", headers=AUTH)
    assert c.post("/v1/training-ready", headers=AUTH).json()["admission_paused"] is False
    # Without Redis the batch cannot be published: a 502 naming why, and the prompts are not lost.
    before = c.get("/v1/data-source/state").json()["state"]
    assert "no Redis" in _error(c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH), 502)
    assert c.get("/v1/data-source/state").json()["state"] == before


def test_eval_rollout_and_concurrency_conflict(client: Any) -> None:
    c, _, gen = client
    gen.hold_after = 0  # every request hangs until aborted
    r = c.post("/v1/rollouts", json={"rollout_id": 5, "evaluation": True, "wait": False}, headers=AUTH)
    assert r.status_code == 202 and r.json()["state"] == "running"
    job_id = r.json()["job_id"]
    # The same rollout again: the same job (a retried request does not start a second one).
    again = c.post("/v1/rollouts", json={"rollout_id": 5, "evaluation": True, "wait": False}, headers=AUTH)
    assert again.json()["job_id"] == job_id
    assert "still running" in _error(c.post("/v1/rollouts", json={"rollout_id": 6}, headers=AUTH), 409)
    assert "rollout is running" in _error(
        c.put("/v1/data-source/state", json={"state": {}}, headers=AUTH), 409
    )
    assert "offload after it finishes" in _error(c.post("/v1/engines/offload", headers=AUTH), 409)
    gen.hold_after = None
    gen.abort_event.set()  # every request now comes back aborted, as from an engine paused for good
    job: dict[str, Any] = poll_until_blocking(
        lambda: (j := c.get(f"/v1/rollouts/{job_id}").json())["state"] != "running" and j,
        timeout_s=20,
        interval_s=0.05,
        what="the rollout job ended",
    )
    # Aborted by the engines, not by a full batch: retried a bounded number of times, then failed.
    assert job["state"] == "failed" and "aborted by the engines 6 times" in job["error"]
    assert c.post("/v1/rollouts", json={"rollout_id": 6}, headers=AUTH).status_code != 409  # slot free again


def test_eval_metrics(client: Any) -> None:
    c, _, _ = client
    r = c.post("/v1/rollouts", json={"rollout_id": 1, "evaluation": True}, headers=AUTH)
    assert r.status_code == 200, r.text
    m = r.json()["metrics"]
    assert m["eval/held/num_prompts"] == 3.0 and m["eval/held/num_samples"] == 3.0
    assert "eval/held/pass@1" in m and r.json()["batch_id"] is None
    assert r.json()["run_id"] == "unit"  # every job names the manager's run (its Redis stream)
    prom = c.get("/metrics").text
    assert 'vime_rollouts_total{kind="eval",state="ok"} 1.0' in prom
    assert 'vime_rollout_engines{status="ready"} 2.0' in prom and "vime_rollout_weight_version 0.0" in prom


def test_weight_bookkeeping_routes(client: Any) -> None:
    c, _, _ = client
    lock = c.post("/v1/engines/update-lock", json={"ttl_s": 30}, headers=AUTH).json()
    assert lock["num_new_engines"] == 0 and len(lock["engines"]) == 2 and lock["weight_version"] == 0
    assert "held by lease" in _error(c.post("/v1/engines/update-lock", json={}, headers=AUTH), 409)
    body = {"version": 1, "lease_id": "not-mine"}
    assert "does not hold" in _error(c.post("/v1/engines/weights-loaded", json=body, headers=AUTH), 409)
    body = {"version": 1, "lease_id": lock["lease_id"], "engine_urls": ["http://nowhere:1"]}
    assert "unknown engine" in _error(c.post("/v1/engines/weights-loaded", json=body, headers=AUTH), 404)
    r = c.post("/v1/engines/weights-loaded", json={"version": 1, "lease_id": lock["lease_id"]}, headers=AUTH)
    assert r.status_code == 200 and r.json()["weight_version"] == 1 and not r.json()["update_lock_held"]
    assert {e["weight_version"] for e in r.json()["engines"]} == {1}
    # Versions only go up: one lower than the engines hold is refused and changes nothing.
    c.post("/v1/engines/weights-loaded", json={"version": 3}, headers=AUTH)
    msg = _error(c.post("/v1/engines/weights-loaded", json={"version": 2}, headers=AUTH), 409)
    assert msg == "version 2 is older than the engines' 3"
    assert c.get("/v1/engines").json()["weight_version"] == 3


def test_data_state_round_trip_and_mismatch(client: Any) -> None:
    c, _, _ = client
    state = c.get("/v1/data-source/state").json()["state"]
    assert state["dataset_size"] == 20 and state["offset"] == 0
    state["offset"] = 7
    r = c.put("/v1/data-source/state", json={"state": state}, headers=AUTH)
    assert r.status_code == 200 and r.json()["state"]["offset"] == 7
    state["dataset_size"] = 99
    assert "saved for 99 prompts" in _error(
        c.put("/v1/data-source/state", json={"state": state}, headers=AUTH), 409
    )
    assert "malformed" in _error(
        c.put("/v1/data-source/state", json={"state": {"version": 1}}, headers=AUTH), 422
    )
    # Issue 17: a huge sample_index used to be taken, and every later rollout then 502'd.
    state["dataset_size"] = 20
    msg = _error(
        c.put("/v1/data-source/state", json={"state": {**state, "sample_index": 2**70}}, headers=AUTH), 422
    )
    assert "state.sample_index" in msg
    assert c.get("/v1/data-source/state").json()["state"]["offset"] == 7  # unchanged


def test_the_data_state_leaves_out_the_rollout_under_way(client: Any) -> None:
    """A checkpoint saved during a rollout (the trainer's save after a fault) resumes with that
    rollout's prompts: the state it reads is the one from before the rollout drew them."""
    c, _, gen = client
    before = c.get("/v1/data-source/state").json()["state"]
    gen.hold_after = 0  # every request hangs until aborted
    r = c.post("/v1/rollouts", json={"rollout_id": 0, "wait": False}, headers=AUTH)
    assert r.status_code == 202 and r.json()["state"] == "running"
    poll_until_blocking(
        lambda: gen.in_flight > 0, timeout_s=10, interval_s=0.02, what="the rollout's generates"
    )
    assert c.get("/v1/data-source/state").json()["state"] == before
    gen.hold_after = None
    gen.abort_event.set()
    poll_until_blocking(
        lambda: c.get(f"/v1/rollouts/{r.json()['job_id']}").json()["state"] != "running",
        timeout_s=20,
        interval_s=0.05,
        what="the rollout job ended",
    )
    assert c.get("/v1/data-source/state").json()["state"] == before


def test_sft_batches_need_the_token_labels_that_are_text_and_redis(client: Any, tokenizer: Any) -> None:
    c, _, _ = client
    assert c.post("/v1/sft-batches", json={"step": 0}).status_code == 401
    assert "step" in _error(c.post("/v1/sft-batches", json={"step": -1}, headers=AUTH), 422)
    assert "stp" in _error(c.post("/v1/sft-batches", json={"stp": 0}, headers=AUTH), 422)
    assert c.post("/v1/engines/offload", headers=AUTH).status_code == 200  # the warm-up needs no engine
    assert "no Redis" in _error(c.post("/v1/sft-batches", json={"step": 0}, headers=AUTH), 503)
    assert "dp_size=3" in _error(c.post("/v1/sft-batches", json={"step": 0, "dp_size": 3}, headers=AUTH), 422)
    records = [{"prompt": f"{i}=", "label": {"tests": [i]}} for i in range(8)]
    dataset = build_dataset("code", records, tokenizer, max_prompt_len=64, **COMMON)
    c.app.state.manager.sft = SftExamples(  # type: ignore[attr-defined]
        dataset, tokenizer, label_key="label", max_response_len=8, shuffle=False, seed=0
    )
    assert "not text the model should emit" in _error(
        c.post("/v1/sft-batches", json={"step": 0}, headers=AUTH), 422
    )


def test_a_preview_returns_its_samples_and_leaves_no_trace(client: Any, tokenizer: Any) -> None:
    """``publish: false`` (`vime rollout`): samples in the reply, nothing published (no Redis needed
    here), the prompts given back, and no job shared with the training rollout of the same id."""
    c, _, _ = client
    before = c.get("/v1/data-source/state").json()["state"]
    assert c.post("/v1/admission/pause", headers=AUTH).status_code == 200  # a preview publishes nothing
    r = c.post("/v1/rollouts", json={"rollout_id": 0, "publish": False}, headers=AUTH)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["preview"] and job["state"] == "done" and job["batch_id"] is None and job["entry_id"] is None
    samples = job["samples"]
    assert job["num_samples"] == len(samples) == 8 and job["metrics"]["rollout/num_samples"] == 8.0
    assert [(s["group_index"], s["index"]) for s in samples] == sorted(
        (s["group_index"], s["index"]) for s in samples
    )
    for g in range(2):
        group = [s for s in samples if s["group_index"] == g]
        assert len(group) == 4 and len({s["prompt"] for s in group}) == 1
        rewards = [s["reward"] for s in group]
        assert rewards == [float(s["index"] % 2) for s in group]  # the stub scorer's rewards
        assert [s["advantage"] for s in group] == pytest.approx(normalize_group_rewards(rewards, 4))
    for s in samples:
        assert tokenizer.decode(s["prompt_ids"]) == s["prompt"] and s["response_ids"]
        assert tokenizer.decode(s["response_ids"]) == s["response"]
    assert c.get("/v1/data-source/state").json()["state"] == before  # the next rollout gets the same prompts
    assert c.get(f"/v1/rollouts/{job['job_id']}").json()["samples"] == samples
    again = c.post("/v1/rollouts", json={"rollout_id": 0, "publish": False, "wait": False}, headers=AUTH)
    assert again.status_code == 202 and again.json()["job_id"] != job["job_id"]  # a new look, not the old one
    _wait_done(c, again.json()["job_id"])
    assert c.post("/v1/admission/resume", json={"was_paused": False}, headers=AUTH).status_code == 200
    # The training rollout of the same id is its own job: here it fails to publish (no Redis).
    assert "no Redis" in _error(c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH), 502)


def test_a_rollout_made_before_a_run_is_never_that_runs_rollout(client: Any, redis_url: str) -> None:
    """Issue 17: ``POST /v1/rollouts {rollout_id: 0}`` before a run was handed to the run as its
    rollout 0 (samples of the weights before its first push). A run begins with
    ``POST /v1/training-ready``; from then on only jobs made since answer for a rollout id, so the
    run generates rollout 0 itself. A retry within the run still gets its job back."""
    c, _, gen = client
    m = c.app.state.manager
    m.run_id = f"unit-oob-{uuid.uuid4().hex[:8]}"
    m.sink = BatchSink(redis_url, m.run_id)
    early = c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH).json()
    assert early["state"] == "done" and early["batch_id"].endswith(":0:0")
    assert c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH).json()["job_id"] == early["job_id"]
    calls = len(gen.requests)
    assert c.post("/v1/training-ready", headers=AUTH).status_code == 200
    own = c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH).json()
    assert own["job_id"] != early["job_id"] and own["batch_id"].endswith(":0:1") and len(gen.requests) > calls
    retry = c.post("/v1/rollouts", json={"rollout_id": 0}, headers=AUTH).json()
    assert retry["job_id"] == own["job_id"]  # a retry within the run is still answered, not regenerated
    assert c.get(f"/v1/rollouts/{early['job_id']}").status_code == 404  # the out-of-band job is gone


def _wait_done(c: Any, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = poll_until_blocking(
        lambda: (j := c.get(f"/v1/rollouts/{job_id}").json())["state"] != "running" and j,
        timeout_s=20,
        interval_s=0.05,
        what="the rollout job ended",
    )
    assert job["state"] == "done", job
    return job
    raise AssertionError(f"job {job_id} still running")


class LoseFirstReply(httpx.AsyncBaseTransport):
    """Hands each request to the app; the first reply is lost after the app processed it."""

    def __init__(self, app: TestClient) -> None:
        self.app = app
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        body = await request.aread()
        r = await asyncio.to_thread(
            self.app.request, request.method, request.url.path, content=body, headers=dict(request.headers)
        )
        if self.calls == 1:
            raise httpx.ReadError("connection reset after the request was processed")
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)


def test_update_lock_sent_again_after_a_lost_reply_gets_its_own_lease(client: Any) -> None:
    c, _, _ = client

    async def main() -> None:
        lossy = LoseFirstReply(c)
        async with RolloutClient("http://testserver", token=TOKEN, transport=lossy, backoff_s=0.01) as rc:
            lock = await rc.update_lock(30)  # processed, reply lost, sent again: not its own 409
            assert lossy.calls == 2 and lock.lease_id and len(lock.engines) == 2
            assert (await rc.engines()).update_lock_held
            other = LoseFirstReply(c)
            other.calls = 1  # nothing lost: another caller is refused while the lease is held
            async with RolloutClient("http://testserver", token=TOKEN, transport=other) as rc2:
                with pytest.raises(ServiceCallError) as held:
                    await rc2.update_lock(30)
            assert held.value.status_code == 409
            await rc.release_update_lock(lock.lease_id)
            lossy.calls = 0  # a call that is not idempotent is not sent again after a lost reply
            with pytest.raises(ServiceUnreachable):
                await rc.training_completed(0)
            assert lossy.calls == 1

    asyncio.run(main())


def test_a_refused_connection_is_retried_for_every_call() -> None:
    async def main() -> None:
        async with RolloutClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01) as rc:
            with pytest.raises(ServiceUnreachable, match="after 3 attempt"):
                await rc.training_completed(0)  # not idempotent, but it never reached the service

    asyncio.run(main())
