"""Every service's OpenAPI, fuzzed with schemathesis: no request, valid or not, gets a 5xx.

Short and seeded (hypothesis derandomized, a few examples per operation) with the bearer token,
so the state-changing routes are exercised, not only refused. Against what:

- reward, router, rollout manager: the real processes (`start_rollout_services`), with the real
  Redis, vllm-router and one CPU reference engine with the nano model behind them;
- trainer: its real app served over HTTP from this process (uvicorn in a thread) with a stand-in
  for the Megatron ranks, since starting Ray and Megatron for each generated ``POST /v1/runs``
  does not fit a one-minute test; its rollout manager is unreachable, so a run it starts stays in
  start-up (the state its push/checkpoint/stop routes must answer in).

A 5xx fails the test with the request that caused it (schemathesis prints a curl line).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import uvicorn
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from test_cli_support import TOKEN, stack_config
from vime_trainer.app import build_app
from vime_trainer.runs import RunRegistry

from tests.support.rollout_stack import start_rollout_services
from vime import procs
from vime.config import load_config

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
FUZZ = settings(
    max_examples=10,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def services(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Reward, router and rollout manager as real processes; their base URLs by name."""
    work = tmp_path_factory.mktemp("fuzz")
    cfg = stack_config(work, rollout_max_response_len=4)
    cfg["services"]["redis_url"] = redis_url
    cfg_path = work / "fuzz.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    children: list[procs.Child] = []
    try:
        rollout = start_rollout_services(
            cfg_path,
            cfg["services"],
            work / "logs",
            children,
            manager_env={"VIME_MODEL_CACHE": str(tmp_path_factory.getbasetemp() / "models")},
        )
        ports = cfg["services"]
        yield {
            "reward": f"http://127.0.0.1:{ports['reward_port']}",
            "router": f"http://127.0.0.1:{ports['router_control_port']}",
            "rollout": rollout,
        }
    finally:
        for child in reversed(children):
            child.stop()


class _Ranks:
    """Stands in for the Megatron ranks: a run here never gets past waiting for its rollout manager."""

    dp_size = 1

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    """The trainer's app over real HTTP on a free port, served from a thread of this process."""
    work = tmp_path_factory.mktemp("fuzz-trainer")
    base = [
        "rollout_num_gpus=0",
        "actor_num_gpus_per_node=0",
        "tensor_model_parallel_size=1",
        "rollout_batch_size=2",
        "n_samples_per_prompt=4",
        "micro_batch_size=4",
        f"output_dir={work / 'runs'}",
        f"trainer.checkpoint_dir={work / 'ckpt'}",
        f"services.rollout_url=http://127.0.0.1:{procs.free_port()}",
        f"services.redis_url={redis_url}",
    ]
    registry = RunRegistry(lambda extra: load_config(None, [*base, *extra], environ={}), lambda cfg: _Ranks())  # type: ignore[arg-type,return-value]
    port = procs.free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(registry, token=TOKEN), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(url, timeout_s=30)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def fuzz(url: str) -> list[str]:
    """Every operation of the service at ``url``: valid and invalid cases (schemathesis' positive
    and negative generation), each sent with the token; the operations that answered a 5xx."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failed: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in MODES))

        @FUZZ
        @given(case=cases)
        def call(case: Any) -> None:
            response = case.call(headers=AUTH, timeout=120)
            assert response.status_code < 500, (
                f"{response.status_code}: {response.text[:300]}\n{case.as_curl_command(headers=AUTH)}"
            )

        try:
            call()
        except AssertionError as exc:
            failed.append(f"{operation.label}: {exc}")
    return failed


@pytest.mark.parametrize("name", ["reward", "router", "rollout"])
def test_a_service_answers_no_request_with_a_5xx(services: dict[str, str], name: str) -> None:
    assert fuzz(services[name]) == []


def test_the_trainer_answers_no_request_with_a_5xx(trainer: str) -> None:
    assert fuzz(trainer) == []


def test_the_fuzzed_services_are_still_healthy(services: dict[str, str]) -> None:
    """Nothing a fuzzed request did took a service down."""
    for url in services.values():
        procs.wait_healthy(url, timeout_s=30)
