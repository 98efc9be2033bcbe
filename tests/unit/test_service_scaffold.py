"""The shared service conventions: auth, error shapes, body limit, health, metrics, client retries."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi import Depends
from pydantic import BaseModel

from vime.clients.base import ServiceCallError, ServiceClient, ServiceUnreachable, ssl_context
from vime.config import ServicesConfig
from vime.procs import free_port
from vime.service import ServiceError, create_app, make_token_checker, start_token


class Body(BaseModel):
    count: int
    name: str


def _app() -> object:
    app = create_app("demo", max_body_bytes=1024)
    guard = make_token_checker("secret")

    @app.post("/v1/things", dependencies=[Depends(guard)])
    async def things(body: Body) -> dict[str, int]:
        if body.count < 0:
            raise ServiceError(409, "count must not be negative", field="count")
        return {"count": body.count}

    return app


@pytest.fixture
async def client() -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=_app())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
        yield c  # type: ignore[misc]


AUTH = {"Authorization": "Bearer secret"}


async def test_health_and_metrics(client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert r.status_code == 200 and r.json()["service"] == "demo"
    await client.post("/v1/things", json={"count": 1, "name": "a"}, headers=AUTH)
    m = await client.get("/metrics")
    assert 'vime_http_requests_total{route="/v1/things",service="demo",status="200"} 1.0' in m.text


async def test_token_required(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/things", json={"count": 1, "name": "a"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "missing or wrong bearer token"
    r = await client.post(
        "/v1/things", json={"count": 1, "name": "a"}, headers={"Authorization": "Bearer nope"}
    )
    assert r.status_code == 401


async def test_validation_error_names_the_field(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/things", json={"count": "many"}, headers=AUTH)
    assert r.status_code == 422
    msg = r.json()["error"]["message"]
    assert "count" in msg and "name" in msg


async def test_malformed_json_is_4xx(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/things", content=b"{not json", headers={**AUTH, "content-type": "application/json"}
    )
    assert r.status_code == 422


async def test_service_error_and_body_limit(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/things", json={"count": -1, "name": "a"}, headers=AUTH)
    assert r.status_code == 409 and r.json()["error"] == {
        "message": "count must not be negative",
        "field": "count",
    }
    r = await client.post("/v1/things", json={"count": 1, "name": "x" * 5000}, headers=AUTH)
    assert r.status_code == 413


async def test_client_raises_call_error_with_message() -> None:
    transport = httpx.ASGITransport(app=_app())  # type: ignore[arg-type]
    c = ServiceClient("http://demo", token="secret", transport=transport)
    assert await c.request("POST", "/v1/things", json={"count": 2, "name": "b"}) == {"count": 2}
    with pytest.raises(ServiceCallError) as info:
        await c.request("POST", "/v1/things", json={"count": -1, "name": "b"})
    assert info.value.status_code == 409 and "negative" in info.value.message
    await c.aclose()


async def test_clients_share_one_certificate_context() -> None:
    """A client made per call (a push's, per engine) does not load the CA bundle again."""
    a, b = ServiceClient("https://one.example"), ServiceClient("http://two.example")
    try:
        contexts = {id(c._client._transport._pool._ssl_context) for c in (a, b)}  # type: ignore[attr-defined]
        assert contexts == {id(ssl_context())}
    finally:
        await a.aclose()
        await b.aclose()


async def test_client_retries_then_fails_clearly() -> None:
    port = free_port()
    c = ServiceClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
    with pytest.raises(ServiceUnreachable, match="failed after 3 attempt"):
        await c.request("GET", "/health")
    await c.aclose()


async def test_client_retry_reaches_a_late_server() -> None:
    """A server that comes up during the client's backoff is reached (connection errors are retried)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="error"))  # type: ignore[arg-type]

    async def late_start() -> None:
        await asyncio.sleep(0.3)
        await server.serve()

    task = asyncio.create_task(late_start())
    c = ServiceClient(f"http://127.0.0.1:{port}", retries=8, backoff_s=0.1)
    try:
        body = await c.request("GET", "/health")
        assert body["status"] == "ok"
    finally:
        await c.aclose()
        server.should_exit = True
        await task


def test_a_service_without_a_token_refuses_to_start_unless_insecure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VIME_API_TOKEN", raising=False)
    with pytest.raises(SystemExit) as stop:
        start_token(ServicesConfig(), "reward")
    line = str(stop.value.code)
    assert "\n" not in line and line.startswith("vime reward: no API token")
    assert "VIME_API_TOKEN" in line and "--insecure" in line
    assert start_token(ServicesConfig(), "reward", insecure=True) is None
    assert start_token(ServicesConfig(insecure=True), "reward") is None
    assert start_token(ServicesConfig(api_token="from-config"), "reward") == "from-config"
    monkeypatch.setenv("VIME_API_TOKEN", "from-env")
    assert start_token(ServicesConfig(), "reward") == "from-env"


async def test_unparseable_body_keeps_the_error_shape(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/things", content=b"\xff\xfe", headers={**AUTH, "content-type": "application/json"}
    )
    assert 400 <= r.status_code < 500
    assert "message" in r.json()["error"]
    r = await client.get("/no/such/route")
    assert r.status_code == 404 and "message" in r.json()["error"]


_FAILING_APP = """
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

app = FastAPI()


@app.exception_handler(Exception)
async def answer_500(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc)}}, status_code=500)


@app.post("/fail")
async def fail() -> None:
    raise RuntimeError("start_weight_update must be called before update_weights.")


@app.post("/ok")
async def ok() -> dict:
    return {"ok": True}
"""


async def test_a_call_after_a_server_error_gets_its_own_connection(tmp_path: Path) -> None:
    """vLLM's pattern: a 500 from an exception handler, after which uvicorn closes the connection
    (Starlette re-raises; the traceback is logged first). The next call must not be sent on it."""
    (tmp_path / "failing_app.py").write_text(_FAILING_APP)
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "failing_app:app", "--port", str(port), "--log-level", "error"]
    server = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = ServiceClient(f"http://127.0.0.1:{port}", retries=20, backoff_s=0.1)
    try:
        await c.request("POST", "/ok")  # up (connection errors are retried)
        for _ in range(30):
            with pytest.raises(ServiceCallError) as err:
                await c.request("POST", "/fail")
            assert err.value.status_code == 500
            assert await c.request("POST", "/ok", retries=0) == {"ok": True}
    finally:
        await c.aclose()
        server.terminate()
        server.wait(10)


def test_what_a_service_builds_at_start_is_frozen_out_of_the_collectors_scans() -> None:
    """Built in the lifespan: frozen once start-up is done; made while serving: scanned as usual."""
    import gc
    from contextlib import asynccontextmanager

    from fastapi.testclient import TestClient

    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: tracked by the collector

    def scanned(obj: object) -> bool:
        return any(o is obj for o in gc.get_objects())

    @asynccontextmanager
    async def lifespan(app):  # type: ignore[no-untyped-def]
        app.state.kept = Node()
        assert scanned(app.state.kept)
        yield

    app = create_app("demo", lifespan=lifespan)
    try:
        with TestClient(app):
            assert not scanned(app.state.kept)
            later = Node()
            assert scanned(later)
    finally:
        gc.unfreeze()
