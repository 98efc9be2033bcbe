"""docker/entrypoint.sh and docker/healthcheck.py, run as real processes (as the images run them).

The entry point turns a token file (compose secret) into VIME_API_TOKEN and refuses to start when
a named token file is unusable; the health check exits 0 only on a 200 from /health.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_support import ROOT

from vime import procs

ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
PRINT_TOKEN = ["sh", "-c", 'printf "%s" "${VIME_API_TOKEN:-<unset>}"']


def _entry(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin"}
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *PRINT_TOKEN], env=base | env, capture_output=True, text=True
    )


def test_token_file_becomes_the_env_token(tmp_path: Path) -> None:
    token = tmp_path / "api_token"
    token.write_text("s3cret-token\n")
    proc = _entry({"VIME_API_TOKEN_FILE": str(token)})
    assert (proc.returncode, proc.stdout) == (0, "s3cret-token")


def test_explicit_env_token_wins_over_the_file(tmp_path: Path) -> None:
    token = tmp_path / "api_token"
    token.write_text("from-file")
    proc = _entry({"VIME_API_TOKEN_FILE": str(token), "VIME_API_TOKEN": "from-env"})
    assert (proc.returncode, proc.stdout) == (0, "from-env")


def test_named_but_missing_token_file_refuses_to_start(tmp_path: Path) -> None:
    proc = _entry({"VIME_API_TOKEN_FILE": str(tmp_path / "absent")})
    assert proc.returncode == 64
    assert "not readable" in proc.stderr and proc.stdout == ""


def test_empty_token_file_refuses_to_start(tmp_path: Path) -> None:
    token = tmp_path / "api_token"
    token.write_text("\n")
    proc = _entry({"VIME_API_TOKEN_FILE": str(token)})
    assert proc.returncode == 64 and "is empty" in proc.stderr


def test_no_token_configured_passes_through() -> None:
    """Kubernetes injects VIME_API_TOKEN from the Secret itself; no file is named there."""
    proc = _entry({})
    assert (proc.returncode, proc.stdout) == (0, "<unset>")


def test_command_exit_status_is_kept() -> None:
    proc = subprocess.run(["sh", str(ENTRYPOINT), "sh", "-c", "exit 7"], env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 7


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response({"/health": 200, "/sick": 503}.get(self.path, 404))
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=30
    )


def test_healthcheck_passes_on_200(health_port: int) -> None:
    assert _check(str(health_port)).returncode == 0


def test_healthcheck_fails_on_error_status(health_port: int) -> None:
    proc = _check(str(health_port), "/sick")
    assert proc.returncode == 1 and "503" in proc.stderr


def test_healthcheck_fails_when_nothing_listens() -> None:
    port = procs.free_port()
    proc = _check(str(port))
    assert proc.returncode == 1 and f"127.0.0.1:{port}" in proc.stderr


def test_healthcheck_rejects_bad_usage() -> None:
    assert _check("not-a-port").returncode == 2
    assert _check().returncode == 2
