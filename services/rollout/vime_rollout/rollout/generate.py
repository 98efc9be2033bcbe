"""One sample, and one group, from request to reward (seed steps 17–19, 25–26).

`generate` builds the request (step 19: ``max_new_tokens -= response_length``, truncated at 0,
vLLM's parameter names), sends it through the router, and appends the parsed response
(step 25). `generate_and_rm` adds the semaphore and the per-sample reward; `generate_and_rm_group`
runs a group's samples together and, with ``group_rm``, scores the group in one call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from vime.types import Sample, SampleStatus
from vime.wire.vllm import GenerateResult, build_sampling_params, parse_generate_response
from vime_rollout.rollout.state import GenerateState

log = logging.getLogger("vime.rollout.generate")

MAX_ENGINE_ABORT_RETRIES = 5
"""Times a sample aborted by an engine (not by us) is sent again before the rollout gives up."""

FINISHED = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


def request_payload(
    state: GenerateState, sample: Sample, max_new_tokens: int, logprobs: int | None
) -> dict[str, Any]:
    """The generate request body for a sample (seed step 20)."""
    s = state.sampling
    sp = build_sampling_params(
        max_new_tokens=max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        logprobs=logprobs,
        skip_special_tokens=s.skip_special_tokens,
        detokenize=False,
    )
    return {"model": state.model_name, "token_ids": list(sample.tokens), "sampling_params": sp}


def _version_of(reported: Any, known: int) -> str:
    """The engine's own version report when it is a number, else the version we know it holds."""
    if reported is not None:
        try:
            return str(int(reported))
        except ValueError:
            pass
    return str(known)


def _versions(result: GenerateResult, sent_at: int, replied_at: int) -> tuple[str, str]:
    """(first, last) weight versions of a reply's tokens: the engine's spans where it reports them
    (0.33, the reference engine), else what the engines held when the request was sent and when
    its reply came (vLLM 0.26 reports none; a push in between updated it in flight)."""
    spans = result.weight_versions or []
    first = _version_of(spans[0].get("version") if spans else None, sent_at)
    return first, _version_of(result.weight_version, replied_at)


async def generate(state: GenerateState, sample: Sample, logprobs: int | None) -> Sample:
    """Generate (the rest of) a sample's response under the semaphore; the sample is changed only by
    a usable reply (an aborted rollout turns a waiting sample into an aborted one, step 28).

    A request the engine aborted (paused with ``abort`` for a weight update, drained) is sent
    again: from scratch, its partial output dropped; or, with ``state.continue_aborted`` (the async
    mode's ``inflight_update: abort``), from where it stopped, its partial output kept.
    """
    if sample.response_length:
        # A continued partial sample keeps asking for what it already carries (step 25 keeps them in step).
        logprobs = logprobs if sample.rollout_log_probs is not None else None
    session = sample.session_id if state.send_session_header else None
    for _ in range(MAX_ENGINE_ABORT_RETRIES + 1):
        max_new = sample.remaining_new_tokens(state.sampling.max_new_tokens)
        if max_new <= 0:
            sample.status = SampleStatus.TRUNCATED
            return sample
        payload = request_payload(state, sample, max_new, logprobs)
        async with state.semaphore:  # seed step 18: bounds the requests in flight, nothing else
            if state.aborted:
                sample.status = SampleStatus.ABORTED
                return sample
            known_version = state.weight_version()
            state.counters.clock.request()
            output = await state.generator.generate(payload, session_id=session)
            state.counters.clock.response()
        # Let the request that takes the freed slot go out before this reply is parsed: when many
        # replies land at once, the engines are refilled first and the parsing waits.
        await asyncio.sleep(0)
        state.counters.requests += 1
        result = parse_generate_response(output)
        state.counters.generated_tokens += len(result.token_ids)
        status = SampleStatus.from_finish_reason(result.finish_reason)
        if status is SampleStatus.ABORTED and not state.aborted:
            state.counters.engine_aborts_retried += 1
            if state.continue_aborted and result.token_ids:
                _append(state, sample, result, logprobs, known_version)
            await asyncio.sleep(0.1)
            continue
        break
    else:
        raise RuntimeError(
            f"sample {sample.index} was aborted by the engines {MAX_ENGINE_ABORT_RETRIES + 1} times"
        )
    if status is SampleStatus.FAILED:
        raise RuntimeError(f"sample {sample.index}: engine finished with {result.finish_reason!r}")
    _append(state, sample, result, logprobs, known_version)
    sample.status = status
    return sample


def _append(
    state: GenerateState, sample: Sample, result: GenerateResult, logprobs: int | None, sent_at: int
) -> None:
    """A reply's tokens (and log-probs, text, versions) onto the sample (seed step 25)."""
    text = state.tokenizer.decode(result.token_ids, skip_special_tokens=state.sampling.skip_special_tokens)
    meta = result.meta_info()
    meta["engine_weight_version"] = meta.pop("weight_version")
    sample.append_response_tokens(
        result.token_ids,
        result.log_probs if logprobs is not None else None,
        text=text,
        meta_info=meta,
    )
    first, last = _versions(result, sent_at, state.weight_version())
    sample.weight_version = last
    if sample.first_weight_version is None:  # a continued sample keeps its first chunk's
        sample.first_weight_version = first


async def generate_and_rm(state: GenerateState, sample: Sample, logprobs: int | None) -> Sample:
    """Generate, then the reward unless the group is scored as a whole (steps 18, 26)."""
    if sample.status in FINISHED and sample.reward is not None:
        return sample  # finished in an earlier (aborted) rollout: nothing to redo
    if sample.status not in FINISHED:
        sample = await generate(state, sample, logprobs)
    if sample.status is SampleStatus.ABORTED or state.cfg.reward.group_rm:
        return sample
    if sample.reward is None:
        ((sample.reward, sample.reward_details),) = await _score(state, [sample])
    return sample


async def _score(state: GenerateState, samples: list[Sample]) -> list[tuple[float, dict[str, Any] | None]]:
    t0 = time.perf_counter()
    try:
        return await state.scorer.score(samples)
    finally:
        state.counters.clock.reward_s += time.perf_counter() - t0


async def generate_and_rm_group(
    state: GenerateState, group: list[Sample], logprobs: int | None
) -> list[Sample]:
    """All samples of a group concurrently; a group finishes with its slowest sample (step 17)."""
    tasks = [asyncio.create_task(generate_and_rm(state, s, logprobs)) for s in group]
    try:
        done = list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    if state.cfg.reward.group_rm and not any(s.status is SampleStatus.ABORTED for s in done):
        # One batched call for the whole group: group-level verifiers see every member.
        for s, (reward, details) in zip(done, await _score(state, done), strict=True):
            s.reward, s.reward_details = reward, details
    return done
