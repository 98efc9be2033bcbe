"""Nothing is open by default (issue 17): each service, started as its real process with no API
token, exits at once with one line saying what to set, before it binds a port or starts a child;
``--insecure`` (or ``services.insecure``) is the explicit way to serve open."""

from __future__ import annotations

import os
import subprocess

import pytest

from vime import procs

SERVICES = ("reward", "router", "rollout", "trainer")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "VIME_API_TOKEN"}


@pytest.mark.parametrize("name", SERVICES)
def test_a_service_with_no_token_refuses_to_start(name: str) -> None:
    port = procs.free_port()
    argv = procs.python_module(f"vime_{name}", "--set", f"services.{name}_port={port}")
    if name == "router":
        argv += ["--set", f"services.router_control_port={port}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"vime {name}: no API token: set VIME_API_TOKEN (or services.api_token), "
        "or pass --insecure to serve with every route open"
    )
    assert not procs.port_open("127.0.0.1", port)


def test_insecure_is_explicit_and_serves_open() -> None:
    port = procs.free_port()
    argv = procs.python_module("vime_reward", "--port", str(port), "--set", "reward.num_workers=1")
    for how in (["--insecure"], ["--set", "services.insecure=true"]):
        child = procs.start("reward", [*argv, *how], env={"VIME_API_TOKEN": ""})
        try:
            procs.wait_healthy(f"http://127.0.0.1:{port}", child, timeout_s=60)
        finally:
            child.stop()
