"""`vime.service.serve`'s ``on_signal`` runs as soon as SIGTERM arrives, while a request is still
open (uvicorn's graceful shutdown then waits up to ``GRACEFUL_SHUTDOWN_S`` for it): the trainer
stops its run there, before it could go on from a rollout into the training after it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx

from vime import procs
from vime.retry import poll_until_blocking

APP = textwrap.dedent(
    """
    import asyncio, sys
    from contextlib import asynccontextmanager
    from fastapi import FastAPI
    from vime.service import serve

    released = asyncio.Event()

    @asynccontextmanager
    async def lifespan(app):
        yield
        print("lifespan end, released:", released.is_set(), flush=True)

    app = FastAPI(lifespan=lifespan)

    @app.get("/hold")
    async def hold():
        await released.wait()
        return {"released": "by the signal"}

    def on_signal():
        print("on_signal", flush=True)
        released.set()

    serve(app, "127.0.0.1", int(sys.argv[1]), on_signal=on_signal)
    """
)


def test_on_signal_runs_while_a_request_is_still_open(tmp_path: Path) -> None:
    port = procs.free_port()
    script = tmp_path / "app.py"
    script.write_text(APP)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        poll_until_blocking(
            lambda: procs.port_open("127.0.0.1", port), timeout_s=30, interval_s=0.05, what="the app"
        )
        answer: list[httpx.Response | Exception] = []

        def get() -> None:
            try:
                answer.append(httpx.get(f"http://127.0.0.1:{port}/hold", timeout=30))
            except httpx.HTTPError as exc:
                answer.append(exc)

        thread = threading.Thread(target=get)
        thread.start()
        time.sleep(0.5)  # the request is held
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        thread.join(30)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert isinstance(answer[0], httpx.Response) and answer[0].json() == {"released": "by the signal"}, (
        answer,
        out,
    )
    assert time.monotonic() - t0 < 3  # not the graceful shutdown's 5 s cut
    assert out.index("on_signal") < out.index("lifespan end, released: True"), out
    assert proc.returncode == -signal.SIGTERM, out  # uvicorn re-raises the signal once it is down
