"""The control routes of vLLM 0.26 (dev mode): sleep/wake, pause/resume, abort, weight updates.

Bodies and status codes are 0.26's: ``/sleep`` and ``/wake_up`` answer 200 with an empty body,
``/pause`` ``{"status": "paused"}``, the weight routes ``{"message": ...}``. Differences, all
tested in ``tests/contract``: misuse of the weight-update protocol is 400 here (0.26: 500 from the
worker's RuntimeError), a sleep level outside 0..2 is 400, ``/finish_weight_update`` accepts 0.33's
optional ``{"weight_version": ...}``, ``/weight_info`` and ``/update_weight_version`` are 0.33's,
and ``/debug/state`` and ``/debug/memory`` are ours (the reference engine's nvidia-smi).
``/collective_rpc`` runs a method of the engine's worker (`worker`), with vLLM's body and answer:
a worker exception is a 500, as in vLLM.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response

from .engine_core import EngineCore
from .errors import EngineError
from .memory import memory_report
from .responses import DEFAULT_VERSION


def core_of(request: Request) -> EngineCore:
    """The engine core of the app serving ``request``."""
    core: EngineCore = request.app.state.core
    return core


async def json_body(request: Request) -> Any:
    """The request's JSON body; a 400 in vLLM's words when it is not JSON."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError("Invalid JSON format", err_type="Bad Request") from exc


def add_control_routes(app: FastAPI) -> None:
    """Every route but generate and the identity routes."""
    _add_sleep_routes(app)
    _add_pause_routes(app)
    _add_weight_routes(app)
    _add_rpc_route(app)
    _add_debug_routes(app)


def _add_sleep_routes(app: FastAPI) -> None:
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


def _add_pause_routes(app: FastAPI) -> None:
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
        body = await json_body(raw)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise EngineError("request_ids must be a list of strings", param="request_ids")
        return {"status": "aborted", "aborted": await core_of(raw).abort(ids)}


def _embedded(body: Any, key: str, required: bool) -> Any:
    if not isinstance(body, dict) or (required and body.get(key) is None):
        raise EngineError(f"Missing '{key}' in request body", err_type="Bad Request", param=key)
    return body.get(key)


def _add_weight_routes(app: FastAPI) -> None:
    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(raw: Request) -> dict[str, str]:
        _embedded(await json_body(raw), "init_info", required=True)
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weight_update(raw: Request) -> dict[str, str]:
        await core_of(raw).start_weight_update()
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(raw: Request) -> dict[str, str]:
        info = _embedded(await json_body(raw), "update_info", required=True)
        await core_of(raw).update_weights(info)
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weight_update(raw: Request) -> dict[str, str]:
        body = await raw.body()
        version = None
        if body.strip():
            version = _embedded(await json_body(raw), "weight_version", required=False)
            if version is not None and not isinstance(version, str | int):
                raise EngineError("weight_version must be a string", param="weight_version")
        await core_of(raw).finish_weight_update(None if version is None else str(version))
        return {"message": "Weight update finished"}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)) -> dict[str, int]:
        return {"world_size": 1}

    @app.post("/update_weight_version")
    async def update_weight_version(raw: Request) -> dict[str, Any]:
        version = _embedded(await json_body(raw), "new_version", required=True)
        if not isinstance(version, str | int):
            raise EngineError("new_version must be a string", param="new_version")
        await core_of(raw).set_weight_version(str(version))
        return {"success": True, "new_version": str(version)}

    @app.get("/weight_info")
    async def weight_info(raw: Request) -> dict[str, str]:
        return {"weight_version": core_of(raw).weight_version or DEFAULT_VERSION}


def _add_rpc_route(app: FastAPI) -> None:
    @app.post("/collective_rpc")
    async def collective_rpc(raw: Request) -> Any:
        body = await json_body(raw)
        method = _embedded(body, "method", required=True)
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if not isinstance(method, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
            raise EngineError("method must be a string, args a list and kwargs an object", param="method")
        results = await core_of(raw).collective_rpc(method, args, kwargs)
        return {"results": [r if r is None or isinstance(r, dict | list) else str(r) for r in results]}


def _add_debug_routes(app: FastAPI) -> None:
    @app.get("/debug/state")
    async def debug_state(raw: Request) -> dict[str, Any]:
        return core_of(raw).state()

    @app.get("/debug/memory")
    async def debug_memory(raw: Request) -> dict[str, Any]:
        core = core_of(raw)
        return memory_report(core.runner, core.sleeping_tags)
