"""Reward wire schemas and the typed client's request building and failure behaviour."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vime.clients.base import ServiceUnreachable
from vime.clients.reward import RewardClient, to_request
from vime.procs import free_port
from vime.types import Sample
from vime.wire.reward import RewardBatchRequest, RewardRequest, request_from_sample


def test_request_needs_a_label_and_a_response() -> None:
    with pytest.raises(ValidationError, match="label"):
        RewardRequest.model_validate({"response": "x"})
    with pytest.raises(ValidationError, match="response"):
        RewardRequest.model_validate({"label": "1"})
    with pytest.raises(ValidationError, match="lable"):
        RewardRequest.model_validate({"response": "x", "label": 1, "lable": 1})
    assert RewardRequest.model_validate({"response_token_ids": [1], "label": None}).label is None
    with pytest.raises(ValidationError):
        RewardBatchRequest(items=[])


def test_request_from_sample() -> None:
    sample = Sample(prompt="12+34=", label=46, tokens=[1, 2, 3, 4], response_length=2, response="46")
    sample.metadata["rm_type"] = "arithmetic"
    req = request_from_sample(sample, sample_id="g0-s1")
    assert (req.response, req.response_token_ids, req.label) == ("46", None, 46)
    assert req.metadata == {"rm_type": "arithmetic"} and req.sample_id == "g0-s1" and req.fn is None
    undecoded = Sample(prompt="p", label=1, tokens=[1, 2, 3, 4], response_length=2)
    assert request_from_sample(undecoded).response_token_ids == [3, 4]


def test_to_request_fills_defaults_and_an_idempotency_key() -> None:
    sample = Sample(prompt="p", label="1", response="\\boxed{1}")
    a, b = to_request(sample, fn="math"), to_request(sample, fn="math")
    assert a.fn == "math" and a.sample_id and a.sample_id != b.sample_id
    explicit = to_request(
        {"response": "x", "label": 1, "fn": "f1", "sample_id": "k"}, fn="math", options={"x": 1}
    )
    assert (explicit.fn, explicit.sample_id, explicit.options) == ("f1", "k", {"x": 1})
    kept = RewardRequest(response="x", label=1, options={"y": 2}, sample_id="k2")
    assert to_request(kept, options={"x": 1}).options == {"y": 2}


async def test_client_gives_a_clear_error_after_the_last_retry() -> None:
    port = free_port()
    async with RewardClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01) as client:
        with pytest.raises(ServiceUnreachable, match=r"POST .*/v1/reward failed after 3 attempt"):
            await client.score({"response": "x", "label": 1})
        with pytest.raises(ServiceUnreachable, match="/v1/rewards"):
            await client.score_batch([{"response": "x", "label": 1}])
