"""What a reported log-prob is, per ``--logprobs-mode`` (vLLM 0.26's ``Sampler``), against HF logits.

``raw_logprobs`` (vLLM's default): log-softmax of the logits, whatever the temperature or top-k.
``processed_logprobs`` (what the rollout manager starts engines with): log-softmax of what is
sampled from — logits / T, then top-k/top-p (entries cut off are -inf, sent as -9999) — the
distribution the trainer's log-probs (logits / T) are compared with. Greedy requests (T = 0)
report T = 1 log-probs in both modes: nothing is divided by zero.

Every test runs against the engine under test in its own mode; against the reference engine a
second one is started without the flag, so both modes are checked on every CI run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from contract_support import EngineUnderTest, HFReference, logprobs_mode_of

from vime import procs
from vime.clients.engine import EngineClient
from vime.wire.vllm import build_sampling_params, logprobs_to_request, parse_generate_response

PROMPT = [5, 17, 42, 8, 23, 11, 60, 3]
TEMPERATURE = 0.7
FLOOR = -9999.0


@pytest.fixture(scope="module")
def raw_reference(eut: EngineUnderTest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    """A reference engine started without ``--logprobs-mode`` (vLLM's default), beside the suite's."""
    if not eut.profile.reference:
        yield None
        return
    port = procs.free_port()
    argv = procs.python_module(
        "vime_rollout.reference_engine", "--model", str(eut.model_dir), "--port", str(port), "--seed", "0"
    )
    child = procs.start("reference-engine-raw", argv, log_path=tmp_path_factory.mktemp("raw") / "engine.log")
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(url, child, timeout_s=180)
        yield url
    finally:
        child.stop()


@pytest.fixture(scope="module")
def engines(eut: EngineUnderTest, raw_reference: str | None) -> list[tuple[str, str]]:
    """(mode, url) of every engine checked here: the engine under test, and the raw reference one."""
    urls = [eut.url] + ([raw_reference] if raw_reference else [])
    return [(logprobs_mode_of(u), u) for u in urls]


def test_the_modes_are_vllms(eut: EngineUnderTest, raw_reference: str | None) -> None:
    assert eut.logprobs_mode in ("raw_logprobs", "processed_logprobs")
    if raw_reference is not None:  # the suite's reference engine runs the rollout manager's mode
        assert (eut.logprobs_mode, logprobs_mode_of(raw_reference)) == ("processed_logprobs", "raw_logprobs")


async def test_log_probs_at_a_temperature_follow_the_mode(
    engines: list[tuple[str, str]], eut: EngineUnderTest, hf: HFReference
) -> None:
    sp = {"max_tokens": 24, "temperature": TEMPERATURE, "seed": 5, "logprobs": 1, "ignore_eos": True}
    for mode, url in engines:
        async with EngineClient(url, timeout=300) as engine:
            result = await engine.generate(PROMPT, sp)
        assert result.log_probs is not None
        tempered = hf.token_logprobs(PROMPT, result.token_ids, TEMPERATURE)
        plain = hf.token_logprobs(PROMPT, result.token_ids)
        want, other = (tempered, plain) if mode == "processed_logprobs" else (plain, tempered)
        diff = max(abs(a - b) for a, b in zip(result.log_probs, want, strict=True))
        assert diff <= eut.profile.logprob_atol, f"{mode}: max |engine - HF| log-prob = {diff}"
        apart = max(abs(a - b) for a, b in zip(want, other, strict=True))
        assert apart > 2 * eut.profile.logprob_atol, "the two modes must be told apart by this prompt"


async def test_processed_log_probs_are_of_the_top_k_distribution(
    engines: list[tuple[str, str]], eut: EngineUnderTest, hf: HFReference
) -> None:
    """top_k=4: processed log-probs renormalise over the 4 best tokens of logits / T; raw ignore it."""
    sp = {
        "max_tokens": 12,
        "temperature": TEMPERATURE,
        "top_k": 4,
        "seed": 9,
        "logprobs": 6,
        "ignore_eos": True,
    }
    for mode, url in engines:
        async with EngineClient(url, timeout=300) as engine:
            out = await engine.generate_raw({"token_ids": PROMPT, "sampling_params": sp})
        choice = out["choices"][0]
        tokens, content = choice["token_ids"], choice["logprobs"]["content"]
        lp_t = hf.logprobs(PROMPT, tokens, TEMPERATURE)
        top4 = lp_t.topk(4, dim=-1)
        renormalised = lp_t - torch.logsumexp(top4.values, dim=-1, keepdim=True)
        plain = hf.logprobs(PROMPT, tokens)
        for i, (t, c) in enumerate(zip(tokens, content, strict=True)):
            entries = [e["logprob"] for e in c["top_logprobs"]]
            if mode == "processed_logprobs":
                assert abs(c["logprob"] - float(renormalised[i, t])) <= eut.profile.logprob_atol, (i, mode)
                assert min(entries) == FLOOR  # 6 entries asked, 4 tokens allowed: the rest are cut off
            else:
                assert abs(c["logprob"] - float(plain[i, t])) <= eut.profile.logprob_atol, (i, mode)
                assert min(entries) > FLOOR


async def test_greedy_reports_temperature_one_log_probs_in_both_modes(
    engines: list[tuple[str, str]], eut: EngineUnderTest, hf: HFReference
) -> None:
    sp = {"max_tokens": 12, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}
    for mode, url in engines:
        async with EngineClient(url, timeout=300) as engine:
            result = await engine.generate(PROMPT, sp)
        assert result.log_probs is not None and all(FLOOR < x <= 0.0 for x in result.log_probs), mode
        want = hf.token_logprobs(PROMPT, result.token_ids)
        diff = max(abs(a - b) for a, b in zip(result.log_probs, want, strict=True))
        assert diff <= eut.profile.logprob_atol, f"{mode}: max |engine - HF| greedy log-prob = {diff}"


async def test_the_rollout_managers_cheap_form_reads_as_the_seeds_logprobs_1(
    engine: EngineClient, eut: EngineUnderTest, hf: HFReference
) -> None:
    """The rollout manager asks for ``logprobs: 0`` (the sampled token only) with ``flat_logprobs``;
    the seed asks for ``logprobs: 1``. Same request otherwise: the same tokens, the same log-prob of
    each sampled token, and the same response shape (one ``top_logprobs`` entry, the sampled token)."""
    cheap = build_sampling_params(
        max_new_tokens=40, temperature=TEMPERATURE, top_p=1.0, logprobs=logprobs_to_request(None), seed=11
    )
    assert (cheap["logprobs"], cheap["flat_logprobs"]) == (0, True)
    seeds = {k: v for k, v in cheap.items() if k != "flat_logprobs"} | {"logprobs": 1}
    outs = [await engine.generate_raw({"token_ids": PROMPT, "sampling_params": sp}) for sp in (seeds, cheap)]
    (current, current_c), (new, new_c) = [
        (parse_generate_response(o), o["choices"][0]["logprobs"]["content"]) for o in outs
    ]
    assert new.token_ids == current.token_ids and len(new.token_ids) == 40
    assert new.log_probs is not None and current.log_probs is not None
    assert max(abs(a - b) for a, b in zip(new.log_probs, current.log_probs, strict=True)) <= 1e-6
    for t, a, b in zip(new.token_ids, current_c, new_c, strict=True):
        assert (
            [e["token"] for e in a["top_logprobs"]]
            == [e["token"] for e in b["top_logprobs"]]
            == [f"token_id:{t}"]
        )
    want = hf.token_logprobs(
        PROMPT, new.token_ids, TEMPERATURE if eut.logprobs_mode == "processed_logprobs" else 1.0
    )
    assert max(abs(a - b) for a, b in zip(new.log_probs, want, strict=True)) <= eut.profile.logprob_atol
