"""vLLM's error shape and the exception handlers that produce it.

vLLM 0.26 answers every error as ``{"error": {"message", "type", "param", "code"}}``: validation
problems are 400 ``"Bad Request"`` naming the first bad field in ``param`` (``body.token_ids``),
an unknown model is 404 ``NotFoundError``. Clients parse one shape whichever engine answered.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class EngineError(Exception):
    """An error the engine answers with a status, a vLLM error type and optionally a parameter."""

    def __init__(
        self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


def error_json(message: str, status: int, err_type: str, param: str | None = None) -> JSONResponse:
    """A JSONResponse in vLLM's error shape."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _param(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-"))


def _validation_message(errors: list[dict[str, Any]]) -> str:
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    for err in errors:
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        lines.append(f"  {_param(tuple(err.get('loc', ())))}: {msg}")
    return "\n".join(lines)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error of ``app`` answer in vLLM's shape (validation errors are 400, as in vLLM)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        param = _param(tuple(errors[0].get("loc", ()))) if errors else None
        return error_json(_validation_message(errors), 400, HTTPStatus.BAD_REQUEST.phrase, param)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        return error_json(exc.message, exc.status, exc.err_type, exc.param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_json(str(exc.detail), exc.status_code, HTTPStatus(exc.status_code).phrase)
