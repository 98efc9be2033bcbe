"""The router service end to end: real vllm-router, the route filter, the control plane, and four
fake engines, all separate processes on loopback (seed steps 20–21: 256 requests over 4 engines).
The router judges no engine's health (the rollout manager does, `tests/integration/
test_rollout_service.py`): here the test takes engines out itself, as the manager would.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.fake_engine import CONTROL_ROUTES
from tests.support.router_harness import (
    FakeEngineProcess,
    RouterProcess,
    start_fake_engine,
    start_fake_engines,
    start_router,
    stop_all,
)
from vime import procs
from vime.clients.base import ServiceCallError
from vime.clients.router import RouterClient, RouterDataClient
from vime.retry import poll_until, poll_until_blocking
from vime.wire.router import DataPlaneStatus
from vime.wire.vllm import GENERATE_PATH, parse_generate_response

TOKEN = "router-test-token"
SEED_SAMPLING = {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "logprobs": 1, "top_k": -1}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


@pytest.fixture(scope="module")
def engines(logs: Path) -> Iterator[list[FakeEngineProcess]]:
    started = start_fake_engines(4, logs)
    yield started
    stop_all(e.child for e in started)


@pytest.fixture(scope="module")
def router(logs: Path, engines: list[FakeEngineProcess]) -> Iterator[RouterProcess]:
    overrides = ["router.policy=round_robin", "router.max_body_bytes=1048576"]
    r = start_router(logs, token=TOKEN, overrides=overrides)
    for e in engines:
        assert r.register(e)["routable"]
    yield r
    stop_all([r.child])


def generate_body(seed: int = 1) -> dict[str, object]:
    return {"model": "fake", "token_ids": [151644, 872, 198, seed], "sampling_params": SEED_SAMPLING}


async def send_many(router: RouterProcess, n: int, *, retry_window_s: float = 0) -> list[str]:
    """``n`` concurrent generates through the data plane; the engine id of each answer."""
    async with RouterDataClient(router.data_url, retry_window_s=retry_window_s) as client:
        outs = await asyncio.gather(
            *(client.generate([1, 2, i], SEED_SAMPLING, session_id=f"s{i}") for i in range(n))
        )
    return [str(o["engine_id"]) for o in outs]


async def test_seed_256_requests_spread_64_per_engine_round_robin(
    router: RouterProcess, engines: list[FakeEngineProcess]
) -> None:
    before = {e.engine_id: e.stats()["generate_total"] for e in engines}
    answered = Counter(await send_many(router, 256))
    assert answered == {e.engine_id: 64 for e in engines}
    after = {e.engine_id: e.stats()["generate_total"] for e in engines}
    assert {k: after[k] - before[k] for k in after} == {e.engine_id: 64 for e in engines}


async def test_generate_reply_is_vllms_shape_through_the_router(router: RouterProcess) -> None:
    async with RouterDataClient(router.data_url) as client:
        out = await client.post(GENERATE_PATH, generate_body())
    parsed = parse_generate_response(out)
    assert len(parsed.token_ids) == 8 and parsed.log_probs == [-0.5] * 8
    assert parsed.finish_reason == "length" and parsed.prompt_tokens == 4


async def test_openai_routes_are_forwarded(router: RouterProcess) -> None:
    async with RouterDataClient(router.data_url) as client:
        comp = await client.post("/v1/completions", {"model": "fake", "prompt": [1, 2], "max_tokens": 2})
        chat = await client.post(
            "/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        )
    assert comp["object"] == "text_completion" and chat["object"] == "chat.completion"


def test_control_routes_are_unreachable_through_the_router(
    router: RouterProcess, engines: list[FakeEngineProcess]
) -> None:
    tricks = ["/sl%65ep", "//sleep", "/inference/v1/generate/../../sleep", "/fake/stats", "/fake/config"]
    with httpx.Client(base_url=router.data_url, timeout=10) as http:
        for path in [*CONTROL_ROUTES, *tricks]:
            r = http.post(path, json={"level": 2, "update_info": {"names": []}})
            assert r.status_code == 404, (path, r.status_code, r.text)
            assert "not served by the router" in r.json()["error"]["message"]
        assert http.get("/metrics").status_code == 404
        assert http.get("/health").status_code == 200
    assert sum(sum(e.stats()["control_calls"].values()) for e in engines) == 0
    assert all(e.stats()["healthy"] for e in engines)  # /fake/config never arrived either


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b"{not json", {"content-type": "application/json"}, 400),
        (b'{"sampling_params": {}}', {"content-type": "application/json"}, 422),
        (b'{"token_ids": "abc", "sampling_params": {}}', {"content-type": "application/json"}, 422),
        (b'{"token_ids": [], "sampling_params": {}}', {"content-type": "application/json"}, 400),
        (
            b'{"token_ids": [1], "sampling_params": {"max_tokens": 0}}',
            {"content-type": "application/json"},
            400,
        ),
        (b'{"token_ids": [1], "sampling_params": {}}', {"content-type": "text/plain"}, 415),
        (b'{"token_ids": [' + b"1," * 600_000 + b"1]}", {"content-type": "application/json"}, 413),
    ],
)
def test_bad_generate_bodies_get_4xx(
    router: RouterProcess, content: bytes, headers: dict[str, str], status: int
) -> None:
    r = httpx.post(router.data_url + GENERATE_PATH, content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text[:300]


def test_wrong_method_is_405(router: RouterProcess) -> None:
    r = httpx.get(router.data_url + GENERATE_PATH, timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_state_changing_routes_need_the_token(router: RouterProcess, logs: Path) -> None:
    body = {"url": "http://127.0.0.1:1", "id": "nope"}
    assert httpx.post(f"{router.control_url}/v1/engines", json=body).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(f"{router.control_url}/v1/engines/e0/drain", headers=wrong).status_code == 401
    assert httpx.delete(f"{router.control_url}/v1/engines/e0").status_code == 401
    # The data plane's status names vllm-router's private port (issue 17): behind the token, in the
    # listing of engines too, and left out of /health.
    assert httpx.get(f"{router.control_url}/v1/engines").status_code == 401
    assert httpx.get(f"{router.control_url}/v1/engines", headers=router.headers()).status_code == 200
    assert "router_url" not in httpx.get(f"{router.control_url}/health").json()["data_plane"]
    assert httpx.get(f"{router.control_url}/v1/data-plane").status_code == 401
    assert httpx.get(f"{router.control_url}/v1/data-plane", headers=router.headers()).status_code == 200
    assert (
        httpx.post(
            f"{router.control_url}/v1/engines", json={"url": "ftp://x"}, headers=router.headers()
        ).status_code
        == 422
    )
    assert router.post("/v1/engines/ghost/drain").status_code == 404


async def test_drained_engine_gets_nothing_new_while_its_requests_finish(
    router: RouterProcess, engines: list[FakeEngineProcess]
) -> None:
    e0 = engines[0]
    e0.configure(delay_s=2.0)
    control = RouterClient(router.control_url, token=TOKEN)
    try:
        first = asyncio.create_task(send_many(router, 8))  # 2 land on e0 and take 2 s there
        await asyncio.to_thread(
            poll_until_blocking,
            lambda: e0.stats()["in_flight"] == 2,
            timeout_s=10,
            interval_s=0.05,
            what="two requests in flight on e0",
        )
        drained = await control.drain("e0")
        assert drained.draining and not drained.routable
        received_at_drain = e0.stats()["generate_total"]
        later = Counter(await send_many(router, 30))
        assert "e0" not in later and sum(later.values()) == 30
        assert e0.stats()["generate_total"] == received_at_drain
        assert not first.done()  # e0's two are still running ...
        status = await control.wait_drained("e0", timeout_s=15, poll_s=0.1)
        assert status.in_flight == 0
        assert Counter(await first)["e0"] == 2  # ... and they completed, answered by e0
        undrained = await control.undrain("e0")
        assert undrained.routable
        e0.configure(delay_s=0.0)
        assert "e0" in Counter(await send_many(router, 8))
    finally:
        e0.configure(delay_s=0.0)
        await control.undrain("e0")
        await control.aclose()


async def test_an_engine_killed_mid_traffic_loses_nothing_once_taken_out(
    router: RouterProcess, logs: Path
) -> None:
    """Requests in flight on an engine that dies are sent again (the data client's retry window)
    and answered by the others once its registrant takes it out; nothing reaches it afterwards."""
    victim = start_fake_engine("victim", logs)
    procs.wait_healthy(victim.url, victim.child)
    control = RouterClient(router.control_url, token=TOKEN)
    try:
        assert (await control.register(victim.url, engine_id="victim", gpu_ids=[6, 7])).routable
        assert "victim" in Counter(await send_many(router, 10))
        during = asyncio.create_task(send_many(router, 40, retry_window_s=30))  # in flight while it dies
        victim.child.kill()
        await asyncio.sleep(0.3)  # the manager's next health check
        assert await control.deregister("victim")
        assert victim.url not in (await control.data_plane()).workers
        assert len(await during) == 40
        after = Counter(await send_many(router, 64))  # no retries: nothing goes to the dead engine
        assert sum(after.values()) == 64 and set(after) == {"e0", "e1", "e2", "e3"}
    finally:
        victim.child.kill()
        await control.deregister("victim")
        await control.aclose()


async def test_deregistered_engine_gets_no_traffic(router: RouterProcess, logs: Path) -> None:
    extra = start_fake_engine("extra", logs)
    procs.wait_healthy(extra.url, extra.child)
    control = RouterClient(router.control_url, token=TOKEN)
    try:
        created = await control.register(extra.url)  # id defaults to host:port
        assert created.id == f"127.0.0.1:{extra.port}"
        again = await control.register(extra.url)
        assert again.id == created.id and again.registered_at == created.registered_at
        with pytest.raises(ServiceCallError) as conflict:
            await control.register(extra.url, engine_id="other-name")
        assert conflict.value.status_code == 409
        assert await control.deregister(extra.url) is True
        assert await control.deregister(extra.url) is False
        before = extra.stats()["generate_total"]
        await send_many(router, 20)
        assert extra.stats()["generate_total"] == before
    finally:
        stop_all([extra.child])
        await control.aclose()


def test_metrics_and_health_report_engines(router: RouterProcess) -> None:
    text = httpx.get(f"{router.control_url}/metrics").text
    assert 'vime_router_engine_routable{engine="e0"} 1.0' in text
    assert "vime_router_refused_requests_total" in text
    health = httpx.get(f"{router.control_url}/health").json()
    assert health["data_plane"]["ready"] and health["routable_engines"] == 4


async def test_data_plane_processes_are_restarted_and_resynced(router: RouterProcess) -> None:
    control = RouterClient(router.control_url, token=TOKEN)
    try:
        dp = await control.data_plane()
        assert dp.router_pid and dp.filter_pid
        os.kill(dp.router_pid, signal.SIGKILL)
        os.kill(dp.filter_pid, signal.SIGKILL)

        async def back() -> bool:
            now = await control.data_plane()
            return now.ready and now.router_pid not in (None, dp.router_pid) and len(now.workers) == 4

        await poll_until(back, timeout_s=30, interval_s=0.1, what="the data plane back")
        assert (await control.data_plane()).restarts >= dp.restarts + 2
        assert Counter(await send_many(router, 8)) == {"e0": 2, "e1": 2, "e2": 2, "e3": 2}
    finally:
        await control.aclose()


async def test_hung_vllm_router_is_replaced(router: RouterProcess) -> None:
    control = RouterClient(router.control_url, token=TOKEN)
    try:
        before = await control.data_plane()
        assert before.router_pid
        os.kill(before.router_pid, signal.SIGSTOP)  # alive, but answers nothing

        async def replaced() -> DataPlaneStatus | None:
            now = await control.data_plane()
            return now if now.ready and now.router_pid not in (None, before.router_pid) else None

        now = await poll_until(replaced, timeout_s=40, interval_s=0.2, what="the hung vllm-router replaced")
        assert _gone(before.router_pid)
        assert len(now.workers) == 4
        assert len(await send_many(router, 8, retry_window_s=10)) == 8
    finally:
        await control.aclose()


async def test_a_worker_added_behind_the_services_back_is_removed_with_a_warning(
    router: RouterProcess, engines: list[FakeEngineProcess], logs: Path
) -> None:
    """vllm-router's private port is on loopback, open to any process on the host: a worker added
    there directly (generate traffic to a server nobody checked) is taken out by the next sync,
    and the router's log says so; the engines the service placed are not named."""
    rogue = start_fake_engine("rogue", logs)
    procs.wait_healthy(rogue.url, rogue.child)
    control = RouterClient(router.control_url, token=TOKEN)
    try:
        private = (await control.data_plane()).router_url
        async with httpx.AsyncClient(base_url=private, timeout=15) as vllm_router:
            added = await vllm_router.post("/workers", json={"url": rogue.url})
            assert added.status_code in (200, 201, 202), added.text

            async def removed() -> bool:
                urls = [w["url"].rstrip("/") for w in (await vllm_router.get("/workers")).json()["workers"]]
                return rogue.url not in urls

            await poll_until(removed, timeout_s=10, interval_s=0.2, what="the rogue worker removed")
        warnings = [
            line for line in (logs / "router.log").read_text().splitlines() if "no registration" in line
        ]
        assert len(warnings) == 1 and rogue.url in warnings[0], warnings
        assert not any(e.url in warnings[0] for e in engines)
    finally:
        stop_all([rogue.child])
        await control.aclose()


def _gone(pid: int) -> bool:
    """Exited (a zombie nobody has reaped yet counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_data_plane_dies_with_a_killed_service(tmp_path: Path) -> None:
    r = start_router(tmp_path)
    dp = httpx.get(f"{r.control_url}/v1/data-plane").json()
    pids = [dp["router_pid"], dp["filter_pid"]]
    assert not any(_gone(p) for p in pids)
    os.kill(r.child.pid, signal.SIGKILL)  # no chance to stop its children itself
    poll_until_blocking(
        lambda: all(_gone(p) for p in pids), timeout_s=10, interval_s=0.05, what="the data plane exiting"
    )
    with pytest.raises(httpx.ConnectError):
        httpx.post(r.data_url + GENERATE_PATH, json={}, timeout=2)
    r.child.stop()


def test_an_engine_that_does_not_answer_is_refused_naming_the_url(router: RouterProcess) -> None:
    ghost = procs.free_port()
    body = {"url": f"http://127.0.0.1:{ghost}", "id": "ghost"}
    r = httpx.post(f"{router.control_url}/v1/engines", json=body, headers=router.headers(), timeout=30)
    assert r.status_code == 422 and "url: http://127.0.0.1" in r.json()["error"]["message"]
    assert "ghost" not in router.engines()
    assert (
        f"http://127.0.0.1:{ghost}"
        not in httpx.get(f"{router.control_url}/v1/data-plane", headers=router.headers()).json()["workers"]
    )


def test_a_service_that_is_not_an_engine_is_refused(router: RouterProcess) -> None:
    """Any vime service answers /health (this router's control plane does): registering one would
    route generate traffic to it. An engine must also answer /version or /server_info as vLLM does."""
    body = {"url": router.control_url, "id": "not-an-engine"}
    r = httpx.post(f"{router.control_url}/v1/engines", json=body, headers=router.headers(), timeout=30)
    assert r.status_code == 422, r.text
    assert "is not an inference engine" in r.json()["error"]["message"] and "/version" in r.text
    assert "not-an-engine" not in router.engines()
