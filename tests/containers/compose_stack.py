"""The compose stack (profile `cpu`) as its user drives it: `docker compose` commands, HTTP to the
two published ports, and `docker compose exec` for what is not published (the rollout manager, the
reward service, Redis), where a user would reach them the same way.

The stack is whatever deploy/compose.yaml makes of the environment (COMPOSE_PROJECT_NAME,
VIME_BIND, VIME_TOKEN_FILE, VIME_REDIS_IMAGE, ...: scripts/containers.sh sets them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"
CPU_CONFIG = ROOT / "deploy" / "config" / "cpu.yaml"
SERVICES = frozenset({"redis", "router", "reward", "rollout-cpu", "trainer-cpu"})
ROUTER_PORT, TRAINER_PORT = 18080, 18084
UP_TIMEOUT_S = 600
"""`up --wait`: the pair's start on two busy cores takes minutes (start_period is 300 s)."""

# Runs inside a container: one HTTP call with the container's own copy of the token (the compose
# secret), printed as `status json` (urllib: the slim image has no curl).
_CALL = """
import json, sys, urllib.error, urllib.request
method, url, body, auth = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
headers = {"Content-Type": "application/json"}
if auth:
    headers["Authorization"] = "Bearer " + open("/run/secrets/vime_api_token").read().strip()
req = urllib.request.Request(url, data=body.encode() if body else None, method=method, headers=headers)
try:
    with urllib.request.urlopen(req, timeout=float(sys.argv[5])) as resp:
        status, text = resp.status, resp.read().decode()
except urllib.error.HTTPError as exc:
    status, text = exc.code, exc.read().decode()
print(status, text)
"""


def compose_binary() -> str | None:
    """docker-compose from the running venv (scripts/setup_deploy_tools.sh puts it there), else PATH."""
    return shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which(
        "docker-compose"
    )


@dataclass
class Stack:
    compose_bin: str
    bind: str
    token: str

    # --- docker compose -----------------------------------------------------------------------
    def compose(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        env = os.environ | {"COMPOSE_PROFILES": "cpu"}
        argv = [self.compose_bin, "-f", str(COMPOSE_FILE), *args]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
        if check and proc.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def up(self) -> None:
        """Every service running and healthy (what is up already is left alone)."""
        self.compose(
            "up",
            "-d",
            "--no-build",
            "--pull",
            "never",
            "--wait",
            "--wait-timeout",
            str(UP_TIMEOUT_S),
            timeout=UP_TIMEOUT_S + 60,
        )

    def containers(self) -> dict[str, dict[str, Any]]:
        """Service name -> its container as `docker compose ps -a` reports it (state, health, ports)."""
        out = self.compose("ps", "-a", "--format", "json").stdout.strip()
        rows = json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines()]
        return {row["Service"]: row for row in rows}

    def logs(self, service: str, tail: int = 60) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    # --- HTTP ------------------------------------------------------------------------------------
    def url(self, port: int, path: str) -> str:
        return f"http://{self.bind}:{port}{path}"

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def trainer(self, method: str, path: str, *, auth: bool = False, **kw: Any) -> httpx.Response:
        """A call to the trainer's published API."""
        headers = self.auth() if auth else {}
        return httpx.request(method, self.url(TRAINER_PORT, path), headers=headers, timeout=60, **kw)

    def call(
        self,
        service_url: str,
        method: str = "GET",
        body: Any = None,
        *,
        auth: bool = True,
        timeout: float = 300,
        via: str = "router",
    ) -> tuple[int, Any]:
        """(status, JSON body) of a call to a private service (``http://rollout:18083/...``), made
        from inside the ``via`` container with the token of its compose secret."""
        payload = "" if body is None else json.dumps(body)
        proc = self.compose(
            "exec",
            "-T",
            via,
            "python",
            "-c",
            _CALL,
            method,
            service_url,
            payload,
            "1" if auth else "0",
            str(timeout),
            timeout=timeout + 60,
        )
        status, _, text = proc.stdout.strip().partition(" ")
        return int(status), json.loads(text) if text else None

    def redis(self, *args: str) -> str:
        """redis-cli in the Redis container, raw output."""
        return self.compose("exec", "-T", "redis", "redis-cli", "--raw", *args).stdout.strip()

    # --- runs ------------------------------------------------------------------------------------
    def start_run(self, run_id: str, config: dict[str, Any]) -> dict[str, Any]:
        resp = self.trainer("POST", "/v1/runs", auth=True, json={"run_id": run_id, "config": config})
        assert resp.status_code == 201, resp.text
        return dict(resp.json())

    def wait_run(
        self, run_id: str, until: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        """Poll ``GET /v1/runs/{run_id}`` until ``until(status)``; fail with the last status after
        ``timeout`` seconds, or at once when the run ended without reaching it."""
        deadline, status = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            resp = self.trainer("GET", f"/v1/runs/{run_id}")
            assert resp.status_code == 200, resp.text
            status = resp.json()
            if until(status):
                return dict(status)
            if status["state"] not in ("running", "stopping"):
                break
            time.sleep(2)
        raise AssertionError(
            f"run {run_id}: not {what} (state {status.get('state')}, error {status.get('error')}, "
            f"steps {status.get('steps_done')})\n{self.logs('trainer-cpu')}"
        )

    def checkpoints(self, run_id: str) -> list[int]:
        """Rollout ids of the complete checkpoints of a run on the trainer's checkpoint volume."""
        script = (
            "import os, re, sys; d = '/checkpoints/' + sys.argv[1]; "
            "print(' '.join(m.group(1) for n in (os.listdir(d) if os.path.isdir(d) else []) "
            "for m in [re.fullmatch(r'rollout_(\\d+)', n)] "
            "if m and os.path.isfile(os.path.join(d, n, 'vime_state.json'))))"
        )
        out = self.compose("exec", "-T", "trainer-cpu", "python", "-c", script, run_id).stdout
        return sorted(int(x) for x in out.split())
