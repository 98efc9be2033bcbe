"""Weight-update contract (seed steps 45–52): new weights change outputs, the version label, the protocol."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch
from contract_pushers import ShmPusher, WeightPusher
from contract_support import EngineUnderTest, HFReference, greedy, until_running

from vime.clients.base import ServiceCallError
from vime.clients.engine import EngineClient
from vime.wire.engine import shm_update_info

PROMPT = [21, 3, 58, 14, 6, 33, 9]


@pytest.fixture
def restore_weights(hf: HFReference) -> Iterator[None]:
    """The HF copy gets the original weights back whatever a test loaded (the engine's: `_push_back`)."""
    yield
    hf.restore()


async def _push_back(pusher: WeightPusher, engine: EngineClient, hf: HFReference) -> None:
    await pusher.push(engine, {"lm_head.weight": hf.original["lm_head.weight"]}, version="contract-original")
    hf.restore()


async def test_update_changes_outputs_like_hf_and_labels_the_version(
    engine: EngineClient,
    eut: EngineUnderTest,
    hf: HFReference,
    need_pusher: WeightPusher,
    restore_weights: None,
) -> None:
    before = await greedy(engine, PROMPT, 12)
    negated = {"lm_head.weight": -hf.original["lm_head.weight"]}
    await engine.pause("abort")  # seed step 46
    try:
        await need_pusher.push(engine, negated, version="contract-negated")  # seed steps 47–51
    finally:
        await engine.resume()  # seed step 52
    hf.load(negated)
    sp = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    try:
        after = await engine.generate(PROMPT, sp)
        assert after.token_ids != before
        lp = hf.logprobs(PROMPT, after.token_ids)
        chosen = lp[torch.arange(12), torch.tensor(after.token_ids)]
        assert torch.all(chosen >= lp.max(-1).values - eut.profile.logprob_atol)  # argmax of the NEW model
        assert after.log_probs is not None
        assert (
            max(abs(a - float(b)) for a, b in zip(after.log_probs, chosen, strict=True))
            <= eut.profile.logprob_atol
        )
        if eut.profile.reports_weight_version:
            assert after.weight_version == "contract-negated"
            assert after.weight_versions == [{"version": "contract-negated", "start": 0, "end": 12}]
            assert await engine.weight_version() == "contract-negated"
        else:  # vLLM 0.26: no version anywhere; the rollout manager records it itself
            assert after.weight_version is None and after.weight_versions is None
            assert await engine.weight_version() is None
    finally:
        await _push_back(need_pusher, engine, hf)
    assert await greedy(engine, PROMPT, 12) == before


async def test_request_kept_across_an_update_is_recomputed_with_new_weights(
    engine: EngineClient,
    eut: EngineUnderTest,
    hf: HFReference,
    need_pusher: WeightPusher,
    restore_weights: None,
) -> None:
    """pause(keep) → push → resume: the request finishes; where versions are reported it has two spans."""
    await need_pusher.push(engine, {"lm_head.weight": hf.original["lm_head.weight"]}, version="contract-a")
    sp = {"max_tokens": 500, "temperature": 1.0, "seed": 4, "ignore_eos": True, "logprobs": 0}
    task = asyncio.create_task(engine.generate(PROMPT, sp))
    await until_running(eut, 1, min_tokens=5, tasks=[task])
    await engine.pause("keep")
    try:
        await need_pusher.push(
            engine, {"lm_head.weight": -hf.original["lm_head.weight"]}, version="contract-b"
        )
    finally:
        await engine.resume()
    try:
        result = await asyncio.wait_for(task, 120)
        assert result.finish_reason == "length" and len(result.token_ids) == 500
        if eut.profile.reports_weight_version:
            spans = result.weight_versions or []
            assert [s["version"] for s in spans] == ["contract-a", "contract-b"]
            assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 500
            # Tokens after the update are the new model's: their log-probs match HF with the new weights.
            hf.load({"lm_head.weight": -hf.original["lm_head.weight"]})
            cut = spans[1]["start"]
            want = hf.token_logprobs(PROMPT, result.token_ids)[cut:]
            got = (result.log_probs or [])[cut:]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= eut.profile.logprob_atol
        else:
            assert result.weight_versions is None
    finally:
        await _push_back(need_pusher, engine, hf)


async def _status(call: object) -> int:
    try:
        await call  # type: ignore[misc]
    except ServiceCallError as exc:
        return exc.status_code
    return 200


async def test_update_protocol_misuse_is_refused(engine: EngineClient, eut: EngineUnderTest) -> None:
    """vLLM 0.26 answers these with 500 (a RuntimeError in its worker); the reference engine with 400."""
    want = eut.profile.protocol_error_status
    assert await _status(engine.update_weights({"backend": "shm", "path": "x"})) == want
    assert await _status(engine.finish_weight_update()) == want
    await engine.init_weight_transfer_engine({})
    await engine.start_weight_update()
    try:
        assert await _status(engine.start_weight_update()) == want
    finally:
        await engine.finish_weight_update()
    assert await _status(engine.finish_weight_update()) == want


@pytest.fixture
def shm_only(eut: EngineUnderTest, pusher: WeightPusher | None) -> ShmPusher:
    if not eut.profile.reference or not isinstance(pusher, ShmPusher):
        pytest.skip("safetensors-bucket checks are specific to the reference engine's shm transport")
    return pusher


async def test_bad_buckets_are_400_and_leave_weights_untouched(
    engine: EngineClient, hf: HFReference, shm_only: ShmPusher
) -> None:
    from safetensors.torch import save_file

    before = await greedy(engine, PROMPT, 8)
    lm_head = hf.original["lm_head.weight"]
    cases = {
        "unknown": ({"lm_head.weight": -lm_head, "model.layers.0.mlp.no_such.weight": lm_head}, "no_such"),
        "shape": ({"lm_head.weight": -lm_head[:, :3].contiguous()}, "lm_head.weight"),
    }
    for name, (tensors, named) in cases.items():
        path = shm_only.directory / f"bad-{name}.safetensors"
        save_file(tensors, str(path))
        await engine.start_weight_update()
        with pytest.raises(ServiceCallError) as err:
            await engine.update_weights(shm_update_info(path))
        assert err.value.status_code == 400 and named in err.value.message
        # As in vLLM 0.26, a failed update ends the session.
        assert await _status(engine.finish_weight_update()) == 400
    unusable = {
        "does not exist": {"backend": "shm", "path": str(shm_only.directory / "missing.safetensors")},
        "CUDA IPC": {"names": ["lm_head.weight"], "ipc_handles_pickled": "AAAA"},
    }
    for message, info in unusable.items():
        await engine.start_weight_update()
        with pytest.raises(ServiceCallError) as err:
            await engine.update_weights(info)
        assert err.value.status_code == 400 and message in err.value.message
    assert await greedy(engine, PROMPT, 8) == before


async def test_update_while_weights_asleep_is_refused(
    engine: EngineClient, eut: EngineUnderTest, hf: HFReference, shm_only: ShmPusher
) -> None:
    """vLLM has no guard (the write would hit unmapped memory); the reference engine refuses."""
    await engine.sleep(2)
    with pytest.raises(ServiceCallError) as err:
        await shm_only.push(engine, {"lm_head.weight": hf.original["lm_head.weight"]})
    assert err.value.status_code == 400 and "asleep" in err.value.message
    await engine.wake_up(["weights"])
    await shm_only.push(engine, dict(hf.original))  # every parameter: level 2 dropped them all
    await engine.wake_up(["kv_cache"])
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(eut.url + "/debug/memory")).json()["weights_bytes"] > 0
    assert await greedy(engine, PROMPT, 8) == hf.greedy(PROMPT, 8)
