"""The router's engine registry, wire shapes and data-plane command line (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from vime_router.data_plane import DataPlaneSpec, filter_argv, vllm_router_argv
from vime_router.registry import Registry

from vime.config import EngineConfig, RouterConfig, load_config
from vime.service import ServiceError
from vime.wire.engine_metrics import IN_FLIGHT, metric_sum
from vime.wire.router import EngineRegistration, default_engine_id, normalize_engine_url


def reg(url: str = "http://127.0.0.1:18100", engine_id: str | None = "e0") -> EngineRegistration:
    return EngineRegistration(url=url, id=engine_id)


def test_a_registered_engine_serves_until_drained_or_removed() -> None:
    r = Registry()
    e, created = r.register(reg())
    assert created and r.routable_urls() == {"http://127.0.0.1:18100"}
    e.draining = True
    assert r.routable_urls() == set()
    assert not e.status(in_data_plane=True).routable and e.status(in_data_plane=True).draining
    e.draining = False
    assert e.status(in_data_plane=True).routable and not e.status(in_data_plane=False).routable
    r.remove("e0")
    assert r.routable_urls() == set() and r.engines == {}


def test_registration_conflicts_and_unknown_ids() -> None:
    r = Registry()
    r.register(reg("http://h:1", "a"))
    _, created = r.register(reg("http://h:1/", "a"))
    assert not created
    with pytest.raises(ServiceError) as same_id:
        r.register(reg("http://h:2", "a"))
    assert same_id.value.status_code == 409
    with pytest.raises(ServiceError) as same_url:
        r.register(reg("http://h:1", "b"))
    assert same_url.value.status_code == 409
    with pytest.raises(ServiceError) as missing:
        r.remove("nope")
    assert missing.value.status_code == 404


@pytest.mark.parametrize(
    ("url", "normal"),
    [
        ("http://127.0.0.1:18100/", "http://127.0.0.1:18100"),
        ("  http://Engine-0:8000 ", "http://engine-0:8000"),
        ("https://[::1]:9000", "https://[::1]:9000"),
    ],
)
def test_engine_urls_are_normalized(url: str, normal: str) -> None:
    assert normalize_engine_url(url) == normal


@pytest.mark.parametrize(
    "url",
    [
        "ftp://h:1",
        "http://h:1/v1",
        "http://h:1?x=1",
        "http://user@h:1",
        "http://:80",
        "h:1",
        "http://h:99999",
    ],
)
def test_bad_engine_urls_are_refused(url: str) -> None:
    with pytest.raises(ValidationError):
        EngineRegistration(url=url)


def test_registration_defaults_and_field_checks() -> None:
    assert EngineRegistration(url="http://10.0.0.5:18101").engine_id() == "10.0.0.5:18101"
    assert default_engine_id("http://10.0.0.5:18101/") == "10.0.0.5:18101"
    with pytest.raises(ValidationError):
        EngineRegistration(url="http://h:1", id="has/slash")
    with pytest.raises(ValidationError):
        EngineRegistration(url="http://h:1", gpu_ids=[0, 0])
    with pytest.raises(ValidationError):
        EngineRegistration(url="http://h:1", unknown=1)  # type: ignore[call-arg]


def test_in_flight_is_running_plus_waiting_over_all_label_sets() -> None:
    text = (
        b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        b'vllm:num_requests_waiting_by_reason{reason="x"} 100.0\n'
        b"vllm:num_preemptions_total 7.0\n"
    )
    # the _by_reason family shares the prefix; it must not be counted
    assert metric_sum(text, IN_FLIGHT) == 9
    assert metric_sum(b"vllm:num_requests_running 0.0\n", IN_FLIGHT) == 0
    assert metric_sum(b"other_metric 1\n", IN_FLIGHT) is None


def test_vllm_router_command_line_follows_the_config(tmp_path: Path) -> None:
    cfg = load_config(overrides=["router.policy=consistent_hash", "router.request_timeout_s=3600"]).router
    spec = DataPlaneSpec(host="0.0.0.0", port=18080, config=cfg, log_dir=tmp_path)
    argv = vllm_router_argv(spec)
    flag = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flag["--policy"] == "consistent_hash"
    assert flag["--host"] == "127.0.0.1"  # vllm-router itself is never public
    assert flag["--port"] == str(spec.router_port) != "18080"
    assert flag["--request-timeout-secs"] == "3600"
    assert flag["--log-level"] == "warning"
    assert "--disable-circuit-breaker" in argv
    assert int(flag["--health-check-interval-secs"]) >= 3600
    caddy = filter_argv(spec)
    assert caddy[1:3] == ["run", "--config"]
    public = json.loads(Path(caddy[3]).read_text())["apps"]["http"]["servers"]["public"]
    assert public["listen"] == ["0.0.0.0:18080"]
    proxies = [h for r in public["routes"] for h in r["handle"] if h["handler"] == "reverse_proxy"]
    assert {p["upstreams"][0]["dial"] for p in proxies} == {f"127.0.0.1:{spec.router_port}"}
    assert spec.public_url == "http://127.0.0.1:18080"


def test_router_config_refuses_impossible_values() -> None:
    with pytest.raises(ValidationError):
        RouterConfig(policy="cache_aware")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        RouterConfig(retry_window_s=-1)
    with pytest.raises(ValidationError):
        EngineConfig(health_failure_threshold=0)
    with pytest.raises(ValidationError):
        EngineConfig(health_check_interval_s=0)
