"""Bad requests get a 4xx in vLLM's error shape, never a 500 — and never an answer that ignores the problem."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from contract_support import EngineUnderTest

from vime.clients.engine import EngineClient

PROMPT = [5, 17, 42, 8]
SP = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


async def _post(eut: EngineUnderTest, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=eut.url, timeout=60) as c:
        return await c.post(path, **kwargs)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert "type" in err and "param" in err
    return dict(err)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"token_ids": [], "sampling_params": SP}, "token_ids"),
        ({"token_ids": [5, -1], "sampling_params": SP}, "token_ids"),
        ({"token_ids": "5 6", "sampling_params": SP}, "token_ids"),
        ({"token_ids": PROMPT}, "sampling_params"),
        ({"token_ids": PROMPT, "sampling_params": {"max_tokens": -3}}, "max_tokens"),
        ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 0}}, "max_tokens"),
        ({"token_ids": PROMPT, "sampling_params": {"temperature": 3.0}}, "temperature"),
        ({"token_ids": PROMPT, "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"token_ids": PROMPT, "sampling_params": {"top_k": -5}}, "top_k"),
        ({"token_ids": PROMPT, "sampling_params": {"logprobs": 21}}, "logprobs"),
        ({"token_ids": PROMPT, "sampling_params": {"n": 0}}, "n"),
        ({"token_ids": PROMPT, "sampling_params": {"n": 2, "temperature": 0.0}}, "n"),
        ({"token_ids": PROMPT, "sampling_params": {"min_tokens": 9, "max_tokens": 4}}, "min_tokens"),
        ({"token_ids": PROMPT, "sampling_params": {"n": 100_000, "temperature": 1.0}}, "n"),
    ],
)
async def test_invalid_generate_bodies_are_400(
    eut: EngineUnderTest, body: dict[str, Any], field: str
) -> None:
    err = _error(await _post(eut, "/inference/v1/generate", json=body), 400)
    assert field in err["message"] or field in str(err["param"])


async def test_malformed_json_is_400(eut: EngineUnderTest) -> None:
    r = await _post(
        eut,
        "/inference/v1/generate",
        content=b'{"token_ids": [1,',
        headers={"content-type": "application/json"},
    )
    _error(r, 400)


async def test_unknown_model_is_404(eut: EngineUnderTest) -> None:
    r = await _post(
        eut,
        "/inference/v1/generate",
        json={"model": "no-such-model", "token_ids": PROMPT, "sampling_params": SP},
    )
    err = _error(r, 404)
    assert "no-such-model" in err["message"]


async def test_prompt_limits_are_400(eut: EngineUnderTest, engine: EngineClient) -> None:
    max_len = (await engine.models())[0]["max_model_len"]
    _error(
        await _post(eut, "/inference/v1/generate", json={"token_ids": [5] * max_len, "sampling_params": SP}),
        400,
    )
    huge_id = 10_000_000
    err = _error(
        await _post(eut, "/inference/v1/generate", json={"token_ids": [5, huge_id], "sampling_params": SP}),
        400,
    )
    assert str(huge_id) in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"token_ids": PROMPT, "sampling_params": SP, "tokens_ids": [1]},
        {"token_ids": PROMPT, "sampling_params": {**SP, "max_new_tokens": 2}},
    ],
)
async def test_unknown_fields(eut: EngineUnderTest, body: dict[str, Any]) -> None:
    """Reference engine: 400 naming the field. vLLM 0.26 drops unknown fields silently (documented)."""
    r = await _post(eut, "/inference/v1/generate", json=body)
    if eut.profile.rejects_unknown_fields:
        err = _error(r, 400)
        assert "tokens_ids" in err["message"] or "max_new_tokens" in err["message"]
    else:
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == SP["max_tokens"]  # the unknown key had no effect


async def test_bad_control_parameters_are_400(eut: EngineUnderTest, engine: EngineClient) -> None:
    _error(await _post(eut, "/pause", params={"mode": "sideways"}), 400)
    _error(await _post(eut, "/sleep", params={"level": "deep"}), 400)
    assert not await engine.is_sleeping()  # a refused sleep left the engine awake
    if eut.profile.reference:  # vLLM 0.26 passes any integer through to its allocator: not tested there
        _error(await _post(eut, "/sleep", params={"level": "7"}), 400)
    assert (await _post(eut, "/init_weight_transfer_engine", json={})).status_code == 400
    assert (await _post(eut, "/update_weights", json={"no": "update_info"})).status_code == 400
    assert (await _post(eut, "/abort_requests", content=b"not json")).status_code == 400


async def test_streaming(eut: EngineUnderTest) -> None:
    """vLLM streams SSE chunks; the reference engine does not stream and says so with a 400 (documented)."""
    body = {"token_ids": PROMPT, "sampling_params": SP, "stream": True}
    r = await _post(eut, "/inference/v1/generate", json=body)
    if eut.profile.reference:
        err = _error(r, 400)
        assert "stream" in err["message"]
        return
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c["token_ids"]]
    assert len(tokens) == SP["max_tokens"]
