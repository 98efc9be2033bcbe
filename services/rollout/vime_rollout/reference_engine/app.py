"""vLLM 0.26's HTTP API, served by the reference engine: the app, generate and the identity routes.

Same paths, query parameters and bodies as ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``: the
token-in/token-out generate route (and vime's compact form of it, which the vLLM engines vime
starts serve too: `vime.wire.vllm.COMPACT_GENERATE_PATH`), ``/health`` (200, empty), ``/v1/models``, ``/metrics`` (the vLLM
gauges the router reads), ``/server_info`` (the model settings, ``logprobs_mode`` among them), and
(in `control_routes`) sleep/wake, pause/resume and weight updates. ``GET /version`` reports the
vLLM API version emulated plus ``"engine": "vime-reference"``, so that a client can tell the
stand-in from the real thing. Errors use vLLM's shape (`errors`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response

from vime.wire.vllm import COMPACT_GENERATE_PATH, GENERATE_PATH

from .control_routes import add_control_routes, core_of
from .engine_core import EngineCore
from .errors import EngineError, install_error_handlers
from .metrics import add_metrics_route
from .protocol import GenerateRequest
from .responses import generate_response, models_response
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
            return generate_response(req, served.name, compact=raw.url.path == COMPACT_GENERATE_PATH)

        return await _cancel_on_disconnect(raw, finished(), lambda: core.abort([req.request_id]))

    app.post(GENERATE_PATH)(generate)
    app.post(COMPACT_GENERATE_PATH)(generate)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": EMULATED_VLLM_VERSION, "engine": ENGINE_NAME}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_response(served.name, served.root, served.max_model_len, served.created)

    @app.get("/server_info")
    async def server_info(raw: Request, config_format: Literal["text", "json"] = "text") -> dict[str, Any]:
        """vLLM's dev-mode ``/server_info``, reduced to the model settings this engine has."""
        model = {
            "model": served.root,
            "served_model_name": served.name,
            "max_model_len": served.max_model_len,
            "logprobs_mode": core_of(raw).logprobs_mode,
        }
        text = ", ".join(f"{k}={v}" for k, v in model.items())
        config = {"model_config": model} if config_format == "json" else text
        return {"vllm_config": config, "vllm_env": {}, "system_env": {"engine": ENGINE_NAME}}

    add_control_routes(app)
    add_metrics_route(app, served.name)
    return app


def served_model(model_dir: Path, name: str | None, max_model_len: int, vocab_size: int) -> ServedModel:
    return ServedModel(name or str(model_dir), str(model_dir), max_model_len, vocab_size, int(time.time()))
