"""vLLM 0.26's HTTP routes, served by the reference engine.

Same paths, query parameters and bodies as ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``: the
token-in/token-out generate route, the dev sleep routes (``/sleep`` and ``/wake_up`` answer 200
with an empty body, as 0.26 does), the RL routes (pause/resume, weight updates), ``/health`` (200,
empty) and ``/v1/models``. Where this engine answers differently from 0.26 it says so here and
``tests/contract`` tests it: protocol misuse of the weight-update routes is 400 (0.26: 500 from
the worker's RuntimeError), a sleep level outside 0..2 is 400, ``/finish_weight_update`` accepts
0.33's optional ``{"weight_version": ...}``, and two routes are ours: ``/debug/state`` and
``/debug/memory``. ``GET /version`` reports the vLLM API version emulated plus
``"engine": "vime-reference"`` so that a client can tell the stand-in from the real thing.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response

from .engine_core import EngineCore
from .errors import EngineError, install_error_handlers
from .memory import memory_report
from .protocol import GenerateRequest
from .responses import DEFAULT_VERSION, generate_response, models_response
from .sequence import Request as EngineRequest

EMULATED_VLLM_VERSION = "0.26.0"
ENGINE_NAME = "vime-reference"


@dataclass
class ServedModel:
    name: str
    root: str
    max_model_len: int
    vocab_size: int
    created: int


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError("Invalid JSON format", err_type="Bad Request") from exc


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any], on_cancel: Any) -> Any:
    """Await ``work`` unless the client goes away first (then ``on_cancel()`` aborts the request)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_until_disconnect(request))
    done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if work_task in done:
        watch.cancel()
        return work_task.result()
    work_task.cancel()
    await on_cancel()
    return Response(status_code=499)


def _check_prompt(body: GenerateRequest, served: ServedModel) -> int:
    """Validate the prompt against the model; return the effective max_tokens."""
    if body.model and body.model != served.name:
        raise EngineError(f"The model `{body.model}` does not exist.", 404, "NotFoundError", "model")
    top = max(body.token_ids)
    if top >= served.vocab_size:
        raise EngineError(f"Token id {top} is out of vocabulary")
    n_prompt = len(body.token_ids)
    if n_prompt >= served.max_model_len:
        raise EngineError(
            f"The decoder prompt (length {n_prompt}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {served.max_model_len}."
        )
    room = served.max_model_len - n_prompt
    sp = body.sampling_params
    return room if sp.max_tokens is None else sp.max_tokens


def build_app(core_factory: Any, served: ServedModel) -> FastAPI:
    """The FastAPI app; ``core_factory()`` builds the `EngineCore` inside the server's event loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        core: EngineCore = core_factory()
        app.state.core = core
        core.start()
        try:
            yield
        finally:
            await core.stop()

    app = FastAPI(title="vime reference engine (CPU stand-in for vLLM)", lifespan=lifespan)
    install_error_handlers(app)

    def core_of(request: Request) -> EngineCore:
        core: EngineCore = request.app.state.core
        return core

    @app.post("/inference/v1/generate")
    async def generate(body: GenerateRequest, raw: Request) -> Any:
        core = core_of(raw)
        max_tokens = _check_prompt(body, served)
        if body.sampling_params.n > core.max_batch:
            raise EngineError(
                f"sampling_params.n must be at most the server's max_num_seqs ({core.max_batch}), "
                f"got {body.sampling_params.n}."
            )
        if body.sampling_params.stop and core.decode_text is None:
            raise EngineError("stop strings need a tokenizer and this model has none; use stop_token_ids")
        base = raw.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex
        req = EngineRequest.create(
            f"generate-tokens-{base}", body.token_ids, body.sampling_params, max_tokens
        )
        core.add(req)

        async def finished() -> dict[str, Any]:
            await asyncio.shield(req.future)
            return generate_response(req, served.name)

        return await _cancel_on_disconnect(raw, finished(), lambda: core.abort([req.request_id]))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": EMULATED_VLLM_VERSION, "engine": ENGINE_NAME}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_response(served.name, served.root, served.max_model_len, served.created)

    @app.post("/sleep")
    async def sleep(raw: Request) -> Response:
        level_text = raw.query_params.get("level", "1")
        try:
            level = int(level_text)
        except ValueError as exc:
            raise EngineError(f"invalid sleep level {level_text!r}", param="level") from exc
        await core_of(raw).sleep(level, raw.query_params.get("mode", "abort"))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(raw: Request) -> Response:
        tags = raw.query_params.getlist("tags") or None
        await core_of(raw).wake_up(tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(raw: Request) -> dict[str, bool]:
        return {"is_sleeping": core_of(raw).is_sleeping()}

    @app.post("/pause")
    async def pause(
        raw: Request,
        mode: Literal["abort", "wait", "keep"] = Query("abort"),
        wait_for_inflight_requests: bool = Query(False),
        clear_cache: bool = Query(True),
    ) -> dict[str, str]:
        await core_of(raw).pause("wait" if wait_for_inflight_requests else mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume(raw: Request) -> dict[str, str]:
        await core_of(raw).resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused(raw: Request) -> dict[str, bool]:
        return {"is_paused": core_of(raw).paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        raw: Request, reset_running_requests: bool = Query(False), reset_external: bool = Query(False)
    ) -> dict[str, bool]:
        return {"success": await core_of(raw).reset_prefix_cache(reset_running_requests)}

    @app.post("/abort_requests")
    async def abort_requests(raw: Request) -> dict[str, Any]:
        body = await _json_body(raw)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise EngineError("request_ids must be a list of strings", param="request_ids")
        return {"status": "aborted", "aborted": await core_of(raw).abort(ids)}

    _add_weight_routes(app, core_of)
    _add_debug_routes(app, core_of)
    return app


def _embedded(body: Any, key: str, required: bool) -> Any:
    if not isinstance(body, dict) or (required and body.get(key) is None):
        raise EngineError(f"Missing '{key}' in request body", err_type="Bad Request", param=key)
    return body.get(key)


def _add_weight_routes(app: FastAPI, core_of: Any) -> None:
    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(raw: Request) -> dict[str, str]:
        _embedded(await _json_body(raw), "init_info", required=True)
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weight_update(raw: Request) -> dict[str, str]:
        await core_of(raw).start_weight_update()
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(raw: Request) -> dict[str, str]:
        info = _embedded(await _json_body(raw), "update_info", required=True)
        await core_of(raw).update_weights(info)
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weight_update(raw: Request) -> dict[str, str]:
        body = await raw.body()
        version = None
        if body.strip():
            version = _embedded(await _json_body(raw), "weight_version", required=False)
            if version is not None and not isinstance(version, str | int):
                raise EngineError("weight_version must be a string", param="weight_version")
        await core_of(raw).finish_weight_update(None if version is None else str(version))
        return {"message": "Weight update finished"}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)) -> dict[str, int]:
        return {"world_size": 1}

    @app.get("/weight_info")
    async def weight_info(raw: Request) -> dict[str, str]:
        return {"weight_version": core_of(raw).weight_version or DEFAULT_VERSION}


def _add_debug_routes(app: FastAPI, core_of: Any) -> None:
    @app.get("/debug/state")
    async def debug_state(raw: Request) -> dict[str, Any]:
        return core_of(raw).state()

    @app.get("/debug/memory")
    async def debug_memory(raw: Request) -> dict[str, Any]:
        core = core_of(raw)
        return memory_report(core.runner, core.sleeping_tags)


def served_model(model_dir: Path, name: str | None, max_model_len: int, vocab_size: int) -> ServedModel:
    return ServedModel(name or str(model_dir), str(model_dir), max_model_len, vocab_size, int(time.time()))
