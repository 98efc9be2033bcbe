"""What a user of `docker compose --profile cpu up` finds: five healthy containers, two published
ports, and the bearer token required on every call that changes state."""

from __future__ import annotations

import socket

import httpx
from compose_stack import ROUTER_PORT, SERVICES, TRAINER_PORT, Stack

from vime.config import EngineConfig

# Ports the services listen on inside the compose network, which must not be reachable on the
# published address: the router's control plane, reward, rollout manager, two engines, Redis.
PRIVATE_PORTS = (18081, 18082, 18083, EngineConfig().base_port, EngineConfig().base_port + 1, 6379)


def test_every_service_is_running_and_healthy(stack: Stack) -> None:
    containers = stack.containers()
    assert set(containers) == SERVICES
    for name, c in containers.items():
        assert (c["State"], c["Health"]) == ("running", "healthy"), f"{name}: {c['Status']}"
    for port in (ROUTER_PORT, TRAINER_PORT):
        resp = httpx.get(stack.url(port, "/health"), timeout=30)
        assert resp.status_code == 200, resp.text


def test_only_the_router_generate_port_and_the_trainer_api_are_published(stack: Stack) -> None:
    published = {
        (name, p["TargetPort"], p["URL"], p["PublishedPort"])
        for name, c in stack.containers().items()
        for p in c.get("Publishers") or []
        if p.get("PublishedPort")
    }
    assert published == {
        ("router", ROUTER_PORT, stack.bind, ROUTER_PORT),
        ("trainer-cpu", TRAINER_PORT, stack.bind, TRAINER_PORT),
    }
    for port in PRIVATE_PORTS:
        with socket.socket() as s:
            s.settimeout(5)
            assert s.connect_ex((stack.bind, port)) != 0, f"{stack.bind}:{port} accepts connections"


def test_the_router_port_serves_only_generate_routes(stack: Stack) -> None:
    """An engine's control routes (sleep, weight updates) are refused at the router's port."""
    for path in ("/sleep", "/update_weights_from_ipc", "/v1/engines"):
        resp = httpx.post(stack.url(ROUTER_PORT, path), json={}, timeout=30)
        assert resp.status_code == 404, f"{path}: {resp.status_code} {resp.text}"
        assert "not served by the router" in resp.json()["error"]["message"]


def test_state_changing_calls_need_the_secret_files_token(stack: Stack) -> None:
    # The trainer, on its published port: no token or a wrong one is 401, and no run is created.
    for headers in ({}, stack.auth("not-the-token")):
        resp = httpx.post(
            stack.url(TRAINER_PORT, "/v1/runs"), json={"run_id": "no-token"}, headers=headers, timeout=30
        )
        assert resp.status_code == 401, resp.text
    runs = stack.trainer("GET", "/v1/runs").json()["runs"]
    assert "no-token" not in {r["run_id"] for r in runs}
    # With the token from the file the compose secret is made of, the call gets past the check
    # and is answered on its merits (no run is active to push weights from).
    resp = stack.trainer("POST", "/v1/weights/push", auth=True)
    assert resp.status_code == 409 and "no active run" in resp.text, resp.text
    # The rollout manager (private), from inside the compose network: 401 without a token, and
    # accepted with the token of the container's own secret.
    status, body = stack.call("http://rollout:18083/v1/engines/offload", "POST", {}, auth=False)
    assert status == 401, body
    status, body = stack.call("http://rollout:18083/v1/engines/offload", "POST", {})
    assert status == 200, body
