"""vime's compact generate route inside a vLLM 0.26 API server (`vime.wire.vllm.COMPACT_GENERATE_PATH`).

vLLM's ``/inference/v1/generate`` builds its reply on the API server's one event loop: for every
token a dict and a ``Logprob`` (re-made from the flat log-prob lists), two pydantic models (the
token's entry and a ``top_logprobs`` entry repeating it), then ``model_dump`` and ``json.dumps`` of
~160 bytes per token. At 256 requests of 1,024 tokens that is seconds of one core at the end of a
rollout, while replies wait. This route takes the same request and hands it to the same
``ServingTokens.serve_tokens`` (model check, request id, prompt rendering, ``max_tokens`` default,
pause and abort, the engine call), so only the reply differs: `compact_choice`, each choice's
sampled-token log-probs read straight from vLLM's flat lists as one list of floats
(`compact_reply`). The request's ``output_kind`` is set to ``FINAL_ONLY`` (one output per request,
when it ends).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from vllm.entrypoints.openai.engine.protocol import ErrorResponse
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
from vllm.entrypoints.serve.utils.api_utils import load_aware_call, validate_json_request, with_cancellation
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from vime.wire.vllm import COMPACT_GENERATE_PATH
from vime_rollout.vllm_ext.compact_reply import compact_reply


class CompactServingTokens(ServingTokens):
    """vLLM's ``ServingTokens`` with the reply of `COMPACT_GENERATE_PATH`."""

    async def serve_tokens_full_generator(
        self,
        request: GenerateRequest,
        result_generator: AsyncGenerator[RequestOutput, None],
        request_id: str,
        model_name: str,
        request_metadata: Any,
    ) -> ErrorResponse | dict[str, Any]:
        final: RequestOutput | None = None
        try:
            async for out in result_generator:
                final = out
        except asyncio.CancelledError:
            return self.create_error_response("Client disconnected")
        assert final is not None and final.prompt_token_ids is not None
        return compact_reply(final, request_id, model_name, request.sampling_params.logprobs is not None)


def _serving(app_state: Any) -> CompactServingTokens:
    """The app's ``ServingTokens``, configured as vLLM configured it, with this module's reply."""
    serving: CompactServingTokens | None = getattr(app_state, "vime_serving_tokens", None)
    if serving is None:
        serving = copy.copy(app_state.serving_tokens)
        serving.__class__ = CompactServingTokens
        app_state.vime_serving_tokens = serving
    return serving


router = APIRouter()


@router.post(COMPACT_GENERATE_PATH, dependencies=[Depends(validate_json_request)])
@with_cancellation
@load_aware_call
async def generate(request: GenerateRequest, raw_request: Request) -> Response:
    if request.stream:
        return JSONResponse({"error": {"message": "stream is not served here", "code": 400}}, status_code=400)
    request.sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
    out = await _serving(raw_request.app.state).serve_tokens(request, raw_request)
    if isinstance(out, ErrorResponse):
        return JSONResponse(content=out.model_dump(), status_code=out.error.code)
    return Response(json.dumps(out, separators=(",", ":"), allow_nan=False), media_type="application/json")


def attach(app: FastAPI) -> FastAPI:
    """The route added to vLLM's app."""
    app.include_router(router)
    return app
