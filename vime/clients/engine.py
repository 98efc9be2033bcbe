"""Typed async client for an inference engine's HTTP API (real vLLM 0.26 / 0.33, or the CPU reference engine).

The rollout manager and the trainer reach engines only through these calls (seed steps 5–7,
11–13, 20–24, 35–36, 46–52). Response-shape differences between engine versions are absorbed
here: ``/sleep`` and ``/wake_up`` answer an empty body in 0.26 and JSON in 0.33 (both return
None), generate responses carry ``weight_versions`` spans only in 0.33 and the reference engine
(`GenerateResult.weight_version` is None otherwise), and ``/weight_info`` exists only from 0.33
(`weight_version` returns None on 0.26). Errors raise `ServiceCallError` with the engine's
message, whichever of vLLM's error shapes it used.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, Unpack

from vime.clients.base import ServiceCallError, ServiceClient
from vime.wire.engine import EngineVersion, PauseMode, logprobs_mode_in
from vime.wire.engine_metrics import FINISHED, metric_sum
from vime.wire.vllm import (
    COMPACT_GENERATE_PATH,
    GENERATE_PATH,
    GenerateResult,
    build_sampling_params,
    parse_generate_response,
)

log = logging.getLogger("vime.engine")

DEFAULT_GENERATE_TIMEOUT_S = 1800.0
"""Long enough for a 1024-token generation queued behind hundreds of others."""


class GenerateOptions(TypedDict, total=False):
    """What `EngineClient.generate` and `EngineClient.generate_choices` take besides prompt and sampling."""

    model: str | None
    """The served model name (vLLM checks it when given)."""
    request_id: str | None
    """The engine's id of the request, for `abort_requests`."""
    timeout: float | object | None
    """As `ServiceClient.request`'s."""


class EngineClient(ServiceClient):
    """One engine's routes. vLLM's control routes are unauthenticated: the engines the rollout
    manager starts are behind a gate that wants ``token`` for them (`vime_rollout.engines.gate`)."""

    def __init__(
        self, base_url: str, *, timeout: float | None = DEFAULT_GENERATE_TIMEOUT_S, **kwargs: Any
    ) -> None:
        super().__init__(base_url, timeout=timeout, **kwargs)

    # ----- generation ---------------------------------------------------------------------------

    async def generate_raw(
        self, body: Mapping[str, Any], *, timeout: float | object | None = ...
    ) -> dict[str, Any]:
        """POST the body to ``/inference/v1/generate`` and return the JSON response."""
        out = await self.request("POST", GENERATE_PATH, json=dict(body), timeout=timeout)
        if not isinstance(out, dict):
            raise ServiceCallError("POST", self.base_url + GENERATE_PATH, 200, f"not a JSON object: {out!r}")
        return out

    async def generate_choices(
        self, token_ids: Sequence[int], sampling_params: Mapping[str, Any], **options: Unpack[GenerateOptions]
    ) -> list[GenerateResult]:
        """Generate and parse every choice (``sampling_params.n`` of them)."""
        body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": dict(sampling_params)}
        if (model := options.get("model")) is not None:
            body["model"] = model
        if (request_id := options.get("request_id")) is not None:
            body["request_id"] = request_id
        output = await self.generate_raw(body, timeout=options.get("timeout", ...))
        return [parse_generate_response(output, i) for i in range(len(output.get("choices") or [None]))]

    async def generate(
        self, token_ids: Sequence[int], sampling_params: Mapping[str, Any], **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """Generate one choice (seed steps 20–25): token ids, log-probs, finish reason, usage, version."""
        return (await self.generate_choices(token_ids, sampling_params, **options))[0]

    async def abort_requests(self, request_ids: Sequence[str] | None = None) -> int | None:
        """Abort requests by engine id (`vime.wire.engine.engine_request_id`); none given aborts all."""
        body = {"request_ids": list(request_ids or [])}
        out = await self.request("POST", "/abort_requests", json=body, idempotent=True)
        return int(out["aborted"]) if isinstance(out, dict) and "aborted" in out else None

    # ----- identity and health ------------------------------------------------------------------

    async def health(self) -> bool:
        """True when ``/health`` answers 200 (vLLM answers 503 once its engine died)."""
        response = await self.send("GET", "/health", retries=0)
        return response.status_code == 200

    async def version(self) -> EngineVersion:
        """``GET /version``: the vLLM version, and whether this is the reference engine."""
        return EngineVersion.from_body(await self.request("GET", "/version", idempotent=True))

    async def models(self) -> list[dict[str, Any]]:
        """The model cards of ``GET /v1/models``."""
        out = await self.request("GET", "/v1/models", idempotent=True)
        return list(out.get("data") or []) if isinstance(out, dict) else []

    async def get_world_size(self, include_dp: bool = True) -> int:
        out = await self.request(
            "GET", "/get_world_size", params={"include_dp": str(include_dp).lower()}, idempotent=True
        )
        return int(out["world_size"])

    # ----- sleep / wake (seed steps 5–7, 11–13, 35–36) --------------------------------------------

    async def sleep(
        self, level: int = 1, mode: PauseMode = "abort", *, timeout: float | object | None = ...
    ) -> None:
        """``POST /sleep?level=&mode=``; returns once the engine is asleep (0.26 answers an empty body)."""
        await self.request("POST", "/sleep", params={"level": level, "mode": mode}, timeout=timeout)

    async def wake_up(
        self, tags: Sequence[str] | None = None, *, timeout: float | object | None = ...
    ) -> None:
        """``POST /wake_up?tags=..&tags=..``; no tags wakes everything (and resumes scheduling)."""
        params = [("tags", t) for t in tags] if tags else None
        await self.request("POST", "/wake_up", params=params, timeout=timeout)

    async def is_sleeping(self) -> bool:
        """True while any memory is asleep — and, in vLLM, also while merely paused."""
        out = await self.request("GET", "/is_sleeping", idempotent=True)
        return bool(out["is_sleeping"])

    # ----- pause / resume (seed steps 46, 52) ---------------------------------------------------

    async def pause(
        self,
        mode: PauseMode = "abort",
        *,
        clear_cache: bool | None = None,
        timeout: float | object | None = ...,
    ) -> None:
        """``POST /pause?mode=``; ``wait`` returns once the running requests have finished."""
        params: dict[str, Any] = {"mode": mode}
        if clear_cache is not None:
            params["clear_cache"] = str(clear_cache).lower()
        await self.request("POST", "/pause", params=params, timeout=timeout)

    async def resume(self) -> None:
        await self.request("POST", "/resume")

    async def is_paused(self) -> bool:
        out = await self.request("GET", "/is_paused", idempotent=True)
        return bool(out["is_paused"])

    async def reset_prefix_cache(
        self, *, reset_running_requests: bool = False, reset_external: bool = False
    ) -> bool:
        """Flush the prefix cache; False means blocks were still held (vLLM: retry)."""
        params = {
            "reset_running_requests": str(reset_running_requests).lower(),
            "reset_external": str(reset_external).lower(),
        }
        out = await self.request("POST", "/reset_prefix_cache", params=params)
        return bool(out.get("success", True)) if isinstance(out, dict) else True

    # ----- weight updates (seed steps 47–51) ----------------------------------------------------

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any] | None = None) -> None:
        await self.request("POST", "/init_weight_transfer_engine", json={"init_info": dict(init_info or {})})

    async def start_weight_update(self) -> None:
        await self.request("POST", "/start_weight_update")

    async def update_weights(
        self,
        update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        timeout: float | object | None = ...,
    ) -> None:
        """Send one bucket; returns once the engine has loaded it."""
        info: Any = dict(update_info) if isinstance(update_info, Mapping) else [dict(u) for u in update_info]
        await self.request("POST", "/update_weights", json={"update_info": info}, timeout=timeout)

    async def finish_weight_update(self, weight_version: str | int | None = None) -> None:
        """End the update; the version label is kept by 0.33 and the reference engine, ignored by 0.26."""
        body = None if weight_version is None else {"weight_version": str(weight_version)}
        await self.request("POST", "/finish_weight_update", json=body)

    async def finished_requests(self) -> float | None:
        """Requests the engine has finished since it started (``vllm:request_success_total`` in
        ``GET /metrics``); None where it does not say."""
        response = await self.send("GET", "/metrics", idempotent=True)
        return metric_sum(response.content, FINISHED) if response.status_code == 200 else None

    async def serves_compact_generate(self) -> bool:
        """Whether the engine answers vime's compact generate route (`COMPACT_GENERATE_PATH`: the
        engines vime starts do, a plain ``vllm serve`` answers 404): one token asked for there, with
        its log-prob, must come back in the compact form."""
        probe = build_sampling_params(
            max_new_tokens=1, temperature=1.0, top_p=1.0, logprobs=0, detokenize=False
        )
        response = await self.send(
            "POST", COMPACT_GENERATE_PATH, json={"token_ids": [0], "sampling_params": probe}, idempotent=True
        )
        if response.status_code == 404:
            return False
        try:
            reply = response.json()
            choice = reply["choices"][0]
            result = parse_generate_response(reply)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning(
                "%s: its compact generate route answered %s, %s", self.base_url, response.status_code, exc
            )
            return False
        return (
            isinstance(choice.get("logprobs"), list)
            and result.log_probs is not None
            and len(result.token_ids) == 1
        )

    async def logprobs_mode(self) -> str | None:
        """The engine's ``--logprobs-mode`` from vLLM's dev-mode ``GET /server_info`` (None: not said)."""
        response = await self.send("GET", "/server_info", params={"config_format": "json"}, idempotent=True)
        if response.status_code != 200:
            return None
        try:
            return logprobs_mode_in(response.json())
        except ValueError:  # not JSON
            return None

    async def weight_version(self) -> str | None:
        """The engine's own weight-version label (``GET /weight_info``), or None where it has none (0.26)."""
        response = await self.send("GET", "/weight_info", idempotent=True)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise ServiceCallError(
                "GET", self.base_url + "/weight_info", response.status_code, response.text[:200]
            )
        version = response.json().get("weight_version")
        return None if version is None else str(version)
