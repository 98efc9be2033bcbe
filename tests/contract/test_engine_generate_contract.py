"""Generate route contract: response shape, log-prob semantics, sampling controls, many requests at once."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import torch
from contract_support import EngineUnderTest, HFReference, debug_state, greedy

from vime.clients.engine import EngineClient
from vime.wire.engine import EngineVersion
from vime.wire.vllm import (
    COMPACT_GENERATE_PATH,
    OUTPUT_KIND_FINAL_ONLY,
    build_sampling_params,
    parse_generate_response,
)

PROMPT = [5, 17, 42, 8, 23, 11, 60, 3]


async def test_identity_routes(engine: EngineClient, eut: EngineUnderTest) -> None:
    assert await engine.health()
    info = await engine.version()
    assert isinstance(info, EngineVersion) and info.version
    cards = await engine.models()
    assert cards[0]["id"] == eut.served_name and cards[0]["object"] == "model"
    assert isinstance(cards[0]["max_model_len"], int) and cards[0]["max_model_len"] > len(PROMPT)
    assert await engine.get_world_size() >= 1


async def test_generate_shape(engine: EngineClient, eut: EngineUnderTest) -> None:
    body = {
        "model": eut.served_name,
        "request_id": "shape-1",
        "token_ids": PROMPT,
        "sampling_params": {
            "max_tokens": 6,
            "temperature": 1.0,
            "seed": 3,
            "logprobs": 2,
            "ignore_eos": True,
        },
    }
    out = await engine.generate_raw(body)
    assert out["request_id"] == "generate-tokens-shape-1"
    assert out["model"] == eut.served_name and isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    tokens = choice["token_ids"]
    assert len(tokens) == 6
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in tokens]
    for c, t in zip(content, tokens, strict=True):
        assert c["logprob"] <= 0.0
        assert len(c["top_logprobs"]) == 2  # logprobs=k gives k entries, the sampled token first
        assert c["top_logprobs"][0] == {"token": f"token_id:{t}", "logprob": c["logprob"], "bytes": None}
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (8, 6, 14)
    result = parse_generate_response(out)
    assert result.token_ids == tokens and result.log_probs == [c["logprob"] for c in content]

    bare = await engine.generate_raw({"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
    assert bare["choices"][0]["logprobs"] is None  # no logprobs asked, none sent


async def test_the_compact_route_reads_as_vllms_own(engine: EngineClient, eut: EngineUnderTest) -> None:
    """vime's ``/vime/v1/generate`` (what the rollout manager posts to on the engines it starts):
    the same request as ``/inference/v1/generate``, the same tokens, log-probs, finish reason and
    usage; the log-probs one float per token, none when none were asked for; a bad body refused
    (which is how the manager tells the route is there)."""
    assert await engine.serves_compact_generate()
    sp = build_sampling_params(max_new_tokens=24, temperature=1.0, top_p=1.0, logprobs=0, seed=7)
    body = {"model": eut.served_name, "token_ids": PROMPT, "sampling_params": sp | {"ignore_eos": True}}
    own = await engine.generate_raw(body)
    compact = await engine.request("POST", COMPACT_GENERATE_PATH, json=body)
    (choice,) = compact["choices"]
    assert isinstance(choice["logprobs"], list) and len(choice["logprobs"]) == len(choice["token_ids"]) == 24
    a, b = parse_generate_response(own), parse_generate_response(compact)
    assert b.token_ids == a.token_ids and (b.finish_reason, a.finish_reason) == ("length", "length")
    assert a.log_probs is not None and b.log_probs is not None
    assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= 1e-6
    assert (b.prompt_tokens, b.completion_tokens) == (a.prompt_tokens, a.completion_tokens) == (8, 24)
    assert compact["request_id"].startswith("generate-tokens-") and compact["model"] == eut.served_name

    bare = {k: v for k, v in sp.items() if k not in ("logprobs", "flat_logprobs")}
    out = await engine.request(
        "POST", COMPACT_GENERATE_PATH, json={"token_ids": PROMPT, "sampling_params": bare}
    )
    assert out["choices"][0]["logprobs"] is None
    refused = await engine.send("POST", COMPACT_GENERATE_PATH, json={})
    assert 400 <= refused.status_code < 500 and refused.status_code != 404


async def test_logprobs_are_the_sampled_tokens_under_the_model(
    engine: EngineClient, eut: EngineUnderTest, hf: HFReference
) -> None:
    sp = {"max_tokens": 24, "temperature": 1.0, "seed": 11, "logprobs": 1, "ignore_eos": True}
    result = await engine.generate(PROMPT, sp)
    expected = hf.token_logprobs(PROMPT, result.token_ids)
    assert result.log_probs is not None
    diff = max(abs(a - b) for a, b in zip(result.log_probs, expected, strict=True))
    assert diff <= eut.profile.logprob_atol, f"max |engine - HF| log-prob = {diff}"


async def test_greedy_is_deterministic_and_takes_the_argmax(
    engine: EngineClient, eut: EngineUnderTest, hf: HFReference
) -> None:
    first = await greedy(engine, PROMPT, 16)
    assert await greedy(engine, PROMPT, 16) == first
    lp = hf.logprobs(PROMPT, first)
    best = lp.max(dim=-1).values
    chosen = lp[torch.arange(len(first)), torch.tensor(first)]
    assert torch.all(chosen >= best - eut.profile.logprob_atol), "a greedy token was not the model's argmax"
    if eut.profile.exact_numerics:
        assert first == hf.greedy(PROMPT, 16)


async def test_max_tokens_and_stop_token_ids(engine: EngineClient) -> None:
    for n in (1, 7):
        result = await engine.generate(PROMPT, {"max_tokens": n, "temperature": 0.0, "ignore_eos": True})
        assert len(result.token_ids) == n and result.finish_reason == "length"
    run = await greedy(engine, PROMPT, 12)
    k = next(i for i in range(2, len(run)) if run[i] not in run[:i])  # a token first seen at i >= 2
    stopped = await engine.generate(
        PROMPT, {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop_token_ids": [run[k]]}
    )
    assert stopped.token_ids == run[: k + 1]  # the stop token is kept, as vLLM does
    assert stopped.finish_reason == "stop"
    assert stopped.completion_tokens == k + 1


async def test_seeds_and_n_choices(engine: EngineClient, hf: HFReference, eut: EngineUnderTest) -> None:
    sp = {"max_tokens": 10, "temperature": 1.0, "seed": 1234, "ignore_eos": True, "logprobs": 0}
    a = await engine.generate(PROMPT, sp)
    assert (await engine.generate(PROMPT, sp)).token_ids == a.token_ids
    assert (await engine.generate(PROMPT, {**sp, "seed": 99})).token_ids != a.token_ids

    # As vime sends it (`build_sampling_params`): FINAL_ONLY. Left at vLLM 0.26's default
    # (CUMULATIVE), a non-streaming n > 1 request answers only the choices that finished in the
    # last step (`ParentRequest.get_outputs` aggregates the n outputs for FINAL_ONLY alone): on an
    # H100 on 12-07 choices 1 and 2 came back without 0, which had finished one step earlier.
    final_only = {"output_kind": OUTPUT_KIND_FINAL_ONLY}
    out = await engine.generate_raw({"token_ids": PROMPT, "sampling_params": {**sp, "n": 3, **final_only}})
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices) == 30
    assert len({tuple(c["token_ids"]) for c in choices}) == 3
    for c in choices:
        got = [e["logprob"] for e in c["logprobs"]["content"]]
        want = hf.token_logprobs(PROMPT, c["token_ids"])
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= eut.profile.logprob_atol


async def test_256_concurrent_requests(engine: EngineClient, eut: EngineUnderTest) -> None:
    prompts = [[5 + i % 50, 7 + i % 13, 9, 11 + i % 7] for i in range(256)]
    sp = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    before = await debug_state(eut.url) if eut.profile.reference else None
    results = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
    assert all(len(r.token_ids) == 12 and r.finish_reason == "length" for r in results)
    if before is not None:  # the reference engine says how many passes it took: far fewer than tokens
        after = await debug_state(eut.url)
        steps = after["steps"] - before["steps"]
        tokens = after["generated_tokens"] - before["generated_tokens"]
        assert tokens / steps >= 8, f"{tokens} tokens in {steps} steps: requests were not batched"
    if eut.profile.exact_numerics:  # a request's tokens do not depend on what it was batched with
        for i in (0, 77, 255):
            assert await greedy(engine, prompts[i], 12) == results[i].token_ids


async def test_top_k_top_p_and_min_tokens(engine: EngineClient) -> None:
    run = await greedy(engine, PROMPT, 8)
    base = {"max_tokens": 8, "temperature": 1.0, "seed": 21, "ignore_eos": True}
    assert (await engine.generate(PROMPT, {**base, "top_k": 1})).token_ids == run
    assert (await engine.generate(PROMPT, {**base, "top_p": 1e-9})).token_ids == run
    # min_tokens: the stop token cannot be sampled before min_tokens tokens exist.
    sp = {
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "stop_token_ids": [run[0]],
        "min_tokens": 3,
    }
    held_off = await engine.generate(PROMPT, sp)
    assert held_off.token_ids[0] != run[0] and len(held_off.token_ids) >= 3
    assert run[0] not in held_off.token_ids[:3]


async def test_stop_strings(engine: EngineClient, eut: EngineUnderTest) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(eut.model_dir))
    run = await greedy(engine, PROMPT, 12)
    stop = next(s for t in run[2:] if (s := tok.decode([t], skip_special_tokens=True).strip()))
    cut = next(j for j in range(1, 13) if stop in tok.decode(run[:j], skip_special_tokens=True))
    sp = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}
    result = await engine.generate(PROMPT, sp)
    assert result.finish_reason == "stop"
    assert result.token_ids == run[:cut]  # token ids are not cut, only the text would be


def _eos_ids(model_dir: object) -> set[int]:
    """EOS ids as vLLM reads them: the tokenizer's, the config's, and generation_config.json's if any."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    sources: list[object] = [
        AutoConfig.from_pretrained(str(model_dir)),
        AutoTokenizer.from_pretrained(str(model_dir)),
    ]
    with contextlib.suppress(OSError):
        sources.append(GenerationConfig.from_pretrained(str(model_dir)))
    ids: set[int] = set()
    for src in sources:
        eos = getattr(src, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return ids


async def test_eos_stops_unless_ignored(engine: EngineClient, eut: EngineUnderTest) -> None:
    eos = _eos_ids(eut.model_dir)
    assert eos, "the model declares no EOS token"
    max_len = (await engine.models())[0]["max_model_len"]
    sp = {"max_tokens": min(2000, max_len - len(PROMPT)), "temperature": 1.0, "seed": 77}
    natural = await engine.generate(PROMPT, sp)
    if natural.finish_reason == "stop":  # sampled EOS: it ends the output and is kept in it
        assert natural.token_ids[-1] in eos and not eos & set(natural.token_ids[:-1])
        ignored = await engine.generate(PROMPT, {**sp, "ignore_eos": True})
        assert ignored.finish_reason == "length" and len(ignored.token_ids) == sp["max_tokens"]
        assert ignored.token_ids[: len(natural.token_ids)] == natural.token_ids  # same seed, same draws
    else:  # never sampled EOS in max_tokens draws: then it must not appear at all
        assert natural.finish_reason == "length" and not eos & set(natural.token_ids)


async def test_top_k_and_top_p_restrict_what_is_sampled(
    engine: EngineClient, eut: EngineUnderTest, hf: HFReference
) -> None:
    """First tokens drawn under top-k / top-p lie in the set the HF model's distribution allows."""
    lp = hf.logprobs(PROMPT, [0])[0]  # log-probs of the first generated position
    ranked = lp.sort(descending=True).values
    nucleus_end = int((ranked.exp().cumsum(0) < 0.1).sum()) + 1  # smallest prefix holding >= 10%
    tol = eut.profile.logprob_atol
    for extra, allowed in (({"top_k": 3}, 3), ({"top_p": 0.1}, nucleus_end)):
        sp = {"max_tokens": 1, "temperature": 1.0, **extra}
        firsts = await asyncio.gather(*(engine.generate(PROMPT, {**sp, "seed": s}) for s in range(48)))
        tokens = [r.token_ids[0] for r in firsts]
        assert all(lp[t] >= ranked[allowed - 1] - tol for t in tokens), (extra, tokens)
        # Diversity is only owed where the restricted distribution has it: with a peaked model the
        # nucleus can be one token, or the top token can hold nearly all of the allowed mass.
        kept = ranked[:allowed].exp()
        if float((kept[0] / kept.sum()) ** 48) < 1e-6:
            assert len(set(tokens)) >= 2, f"{extra}: 48 seeds all drew {tokens[0]}"


def _gauges(text: str) -> dict[str, float]:
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def test_metrics_report_requests_in_flight(engine: EngineClient, eut: EngineUnderTest) -> None:
    """The router drains an engine by reading these two vLLM gauges from /metrics."""
    async with httpx.AsyncClient(base_url=eut.url, timeout=30) as c:
        text = (await c.get("/metrics")).text
        assert "vllm:num_requests_running" in text and "vllm:num_requests_waiting" in text
        if not eut.profile.reference:  # vLLM refreshes them per engine step: only their presence is checked
            return
        await engine.pause("keep")
        held = [asyncio.create_task(engine.generate(PROMPT, {"max_tokens": 2})) for _ in range(3)]
        await asyncio.sleep(0.3)
        assert _gauges((await c.get("/metrics")).text)["vllm:num_requests_waiting"] == 3
        await engine.resume()
        await asyncio.gather(*held)
        assert _gauges((await c.get("/metrics")).text) == {
            "vllm:num_requests_running": 0.0,
            "vllm:num_requests_waiting": 0.0,
        }
