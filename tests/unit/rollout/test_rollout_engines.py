"""Engines: the seed step 2 command lines, GPU placement, the container spec, the memory fan-out with
tag normalisation (steps 5–13, 34–35), and the health monitor's restart → needs-weights cycle."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from rollout_fakes import StubWorld, stub_group
from vime_rollout.engines.commands import reference_command, vllm_command
from vime_rollout.engines.gate import CONTAINER_DIR, behind_gates
from vime_rollout.engines.gated import TOKEN_ENV
from vime_rollout.engines.group import EngineGroup, EngineStartError
from vime_rollout.engines.health import HealthMonitor
from vime_rollout.engines.launchers import DockerLauncher, container_spec
from vime_rollout.engines.records import LockHeld, UpdateLock
from vime_rollout.engines.spec import EnginePlanError, plan_engines
from vime_rollout.factory import make_launcher
from vime_rollout.rollout.metrics import engine_request_metrics

from vime.config import RunConfig, load_config
from vime.retry import poll_until
from vime.wire.engine import normalize_wake_tags
from vime.wire.rollout import EngineState
from vime.wire.vllm import COMPACT_GENERATE_PATH, GENERATE_PATH


def _cfg(**over: Any) -> RunConfig:
    return load_config(
        overrides=[f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in over.items()]
    )


def test_seed_step_2_vllm_command() -> None:
    cfg = _cfg(**{"engine.backend": "vllm"})  # seed: colocate, offload_rollout, 8 GPUs, 2 per engine
    specs = plan_engines(cfg, gpus=list(range(8)))
    assert [s.gpu_ids for s in specs] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.port for s in specs] == [18100, 18101, 18102, 18103]
    cmd = vllm_command(cfg, specs[2], "/m/qwen", "qwen")
    argv = cmd.argv
    assert argv[1:5] == ["-m", "vime_rollout.vllm_ext.serve", "serve", "/m/qwen"]

    def opt(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert opt("--max-model-len") == "4096"
    assert opt("--tensor-parallel-size") == "2"
    assert opt("--port") == "18102"
    assert opt("--served-model-name") == "qwen"
    assert opt("--seed") == "42"
    assert json.loads(opt("--weight-transfer-config")) == {"backend": "ipc"}
    assert "--enable-sleep-mode" in argv and "--enforce-eager" not in argv
    assert opt("--logprobs-mode") == "processed_logprobs"  # log-probs after temperature, as the trainer's
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert cmd.env["VLLM_SERVER_DEV_MODE"] == "1" and cmd.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert cmd.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_the_direct_weight_load_starts_every_engine_with_its_worker_extension() -> None:
    from vime.wire.direct_load import EXTENSION

    gpu = _cfg(**{"engine.backend": "vllm", "engine.weight_load": "direct"})
    cpu = _cfg(
        rollout_num_gpus=0, rollout_num_engines_cpu=1, actor_num_gpus_per_node=0, tensor_model_parallel_size=1
    )
    cpu_direct = cpu.model_copy(update={"engine": cpu.engine.model_copy(update={"weight_load": "direct"})})
    vllm_argv = vllm_command(gpu, plan_engines(gpu, gpus=list(range(8)))[0], "/m", "m").argv
    ref_spec = plan_engines(cpu, gpus=[])[0]
    for argv in (vllm_argv, reference_command(cpu_direct, ref_spec, "/m", "m").argv):
        assert argv[argv.index("--worker-extension-cls") + 1] == EXTENSION
    assert "--weight-transfer-config" in vllm_argv  # vLLM's own loader stays available as the fallback
    assert "--worker-extension-cls" not in reference_command(cpu, ref_spec, "/m", "m").argv  # default: vllm
    assert cpu.engine.weight_load == "vllm"
    with pytest.raises(ValueError, match="weight_load"):
        _cfg(**{"engine.weight_load": "fast"})


def test_no_sleep_mode_or_ipc_without_colocation() -> None:
    cfg = _cfg(
        colocate=False,
        offload_rollout=False,
        rollout_num_gpus=2,
        rollout_num_gpus_per_engine=1,
        actor_num_gpus_per_node=2,
        **{"engine.backend": "vllm", "engine.extra_args": ["--max-num-seqs", "64"]},
    )
    spec = plan_engines(cfg, gpus=[3, 5])[1]
    argv = vllm_command(cfg, spec, "/m", "m").argv
    assert "--enable-sleep-mode" not in argv and "--weight-transfer-config" not in argv
    assert argv[-2:] == ["--max-num-seqs", "64"] and spec.gpu_ids == (5,)


def test_planning_refuses_too_few_gpus_and_needs_urls_for_external() -> None:
    with pytest.raises(EnginePlanError, match="only 4 GPU"):
        plan_engines(_cfg(**{"engine.backend": "vllm"}), gpus=[0, 1, 2, 3])
    with pytest.raises(EnginePlanError, match=r"engine\.urls"):
        plan_engines(_cfg(**{"engine.launcher": "external"}), gpus=[])
    ext = plan_engines(_cfg(**{"engine.launcher": "external", "engine.urls": ["http://a:1/", "http://b:2"]}))
    assert [s.url for s in ext] == ["http://a:1", "http://b:2"]


def test_auto_backend_on_a_cpu_host_is_the_reference_engine() -> None:
    cfg = _cfg(
        rollout_num_gpus=0, rollout_num_engines_cpu=2, actor_num_gpus_per_node=0, tensor_model_parallel_size=1
    )
    specs = plan_engines(cfg, gpus=[])
    assert [(s.backend, s.port) for s in specs] == [("reference", 18100), ("reference", 18101)]
    argv = reference_command(cfg, specs[1], "/m", "tiny").argv
    assert argv[1:3] == ["-m", "vime_rollout.reference_engine"]
    assert argv[argv.index("--port") + 1] == "18101" and argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(4 << 30)  # the engine's own default
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"  # the same flag as vLLM
    small = cfg.model_copy(
        update={"engine": cfg.engine.model_copy(update={"reference_kv_cache_bytes": 1 << 28})}
    )
    argv = reference_command(small, specs[0], "/m", "tiny").argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "268435456"
    with pytest.raises(ValueError, match="reference_kv_cache_bytes"):
        _cfg(**{"engine.reference_kv_cache_bytes": 10})


def test_the_docker_launcher_takes_its_image_from_the_config(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    docker = pytest.importorskip("docker")
    monkeypatch.setattr(docker, "from_env", lambda: None)  # no Docker engine on this host
    cfg = _cfg(**{"engine.launcher": "docker", "engine.image": "registry.local/vime-gpu:dev"})
    launcher = make_launcher(cfg, "r1", tmp_path / "model", tmp_path / "logs")
    assert isinstance(launcher, DockerLauncher) and launcher.image == "registry.local/vime-gpu:dev"
    assert _cfg().engine.image == "vime-gpu:0.1.0"


def test_container_spec_shares_ipc_and_gets_its_gpus() -> None:
    cfg = _cfg(**{"engine.backend": "vllm"})
    spec = plan_engines(cfg, gpus=list(range(8)))[1]
    kw = container_spec(
        spec, vllm_command(cfg, spec, "/models/q", "q"), image="img", run_id="r1", mounts=["/models/q"]
    )
    assert kw["ipc_mode"] == "host" and kw["pid_mode"] == "host" and kw["network_mode"] == "host"
    assert kw["device_requests"][0]["DeviceIDs"] == ["2", "3"]
    assert kw["ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}]
    assert (
        "CUDA_VISIBLE_DEVICES" not in kw["environment"] and kw["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    )
    assert kw["command"][:3] == ["python3", "-m", "vime_rollout.vllm_ext.serve"]
    assert kw["volumes"] == {"/models/q": {"bind": "/models/q", "mode": "ro"}}
    assert kw["name"] == "vime-r1-engine1"


def test_a_cpu_engine_container_asks_for_no_gpu() -> None:
    cfg = _cfg(**{"engine.backend": "reference"})
    spec = plan_engines(cfg, gpus=[])[0]
    kw = container_spec(
        spec, reference_command(cfg, spec, "/m", "m"), image="img", run_id="r1", mounts=["/m"]
    )
    assert kw["device_requests"] == []  # a request would need NVIDIA's runtime on the host
    assert kw["ulimits"] == []  # nothing pinned: no memlock a host may refuse to raise
    assert kw["environment"]["CUDA_VISIBLE_DEVICES"] == ""  # and nothing inside sees one
    assert kw["command"][:3] == ["python3", "-m", "vime_rollout.reference_engine"]


def test_an_engine_container_runs_behind_its_gate_with_the_token() -> None:
    cfg = _cfg(**{"engine.backend": "vllm"})
    [spec] = behind_gates(plan_engines(cfg, gpus=list(range(8)))[:1], CONTAINER_DIR)
    command = vllm_command(cfg, spec, "/models/q", "q")
    kw = container_spec(spec, command, image="img", run_id="r1", mounts=["/models/q"], token="s3cret")
    gated, engine = kw["command"][: kw["command"].index("--")], kw["command"][kw["command"].index("--") + 1 :]
    assert gated[:3] == ["python3", "-m", "vime_rollout.engines.gated"]
    assert gated[3:] == [
        "--name",
        "engine0",
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--socket",
        spec.socket,
    ]
    assert spec.socket == f"{CONTAINER_DIR}/engine0.sock"
    assert engine == ["python3", *command.argv[1:]] and engine[engine.index("--uds") + 1] == spec.socket
    assert "--port" not in engine  # only the gate has the port
    assert kw["environment"][TOKEN_ENV] == "s3cret"
    open_kw = container_spec(spec, command, image="img", run_id="r1", mounts=["/models/q"])
    assert TOKEN_ENV not in open_kw["environment"]  # no token: the gate passes everything, as locally


def test_wake_tags_are_normalised_as_in_the_seed() -> None:
    assert normalize_wake_tags(["kv_cache", "cuda_graph"]) == ["kv_cache"]
    assert normalize_wake_tags(["weights"]) == ["weights"]
    assert normalize_wake_tags(["cuda_graph"]) == []
    assert normalize_wake_tags(None) is None


def test_update_lock_lease() -> None:
    lock = UpdateLock()
    lease = lock.acquire(60)
    with pytest.raises(LockHeld):
        lock.acquire(60)
    with pytest.raises(LockHeld):
        lock.release("someone-else")
    assert lock.release(lease) and not lock.held()
    lock.acquire(0.001)
    time.sleep(0.01)  # expired: anyone may take it (a trainer that died while pushing)
    assert lock.acquire(60)


# --- the group and the monitor against stub engines ------------------------------------------------


def _group(world: StubWorld, n: int = 3) -> EngineGroup:
    group: EngineGroup = stub_group(world, n)
    return group


def test_group_starts_registers_and_fans_memory_calls_out() -> None:
    async def main() -> None:
        world = StubWorld()
        group = _group(world)
        await group.start()
        urls = [r.url for r in group.records]
        assert world.registered == urls and all(r.status is EngineState.READY for r in group.records)
        res = await group.offload(2)
        assert res == dict.fromkeys(urls, "ok")
        assert sorted(c for c in world.calls if c[1] == "sleep") == sorted(
            (u, "sleep", (2, "keep")) for u in urls
        )
        assert group.asleep
        world.calls.clear()
        sent, _ = await group.onload(["weights"])
        assert sent == ["weights"] and group.asleep
        sent, _ = await group.onload(["kv_cache", "cuda_graph"])
        assert sent == ["kv_cache"] and not group.asleep
        assert [c[2] for c in world.calls] == [("weights",)] * 3 + [("kv_cache",)] * 3
        sent, res = await group.onload(["cuda_graph"])
        assert sent == [] and all(v.startswith("skipped") for v in res.values())
        await group.abort_all()
        assert sum(c[1] == "abort" for c in world.calls) == 3

    asyncio.run(main())


def test_an_engine_with_raw_logprobs_is_refused_and_one_that_does_not_say_is_admitted() -> None:
    async def main() -> None:
        world = StubWorld()
        group = _group(world, n=2)
        world.logprobs_mode[group.records[1].url] = "raw_logprobs"  # attached, started without the flag
        with pytest.raises(
            EngineStartError, match=r"engine.*raw_logprobs.*--logprobs-mode processed_logprobs"
        ):
            await group.start()
        world.logprobs_mode[group.records[1].url] = None  # no dev-mode /server_info: a warning only
        await _group(world, n=2).start()

    asyncio.run(main())


def test_generate_requests_take_the_compact_route_only_when_every_engine_serves_it() -> None:
    async def main() -> None:
        world = StubWorld()
        group = _group(world, n=2)
        assert group.generate_path == GENERATE_PATH  # nothing known before the engines start
        await group.start()
        assert group.generate_path == COMPACT_GENERATE_PATH
        world.plain_vllm.add(group.records[1].url)  # an attached `vllm serve`
        mixed = _group(world, n=2)
        await mixed.start()
        assert mixed.generate_path == GENERATE_PATH

    asyncio.run(main())


def test_requests_per_engine_come_from_each_engines_counter() -> None:
    async def main() -> None:
        world = StubWorld()
        group = _group(world, n=4)
        await group.start()
        urls = [r.url for r in group.records]
        world.finished.update({u: 10.0 * k for k, u in enumerate(urls[:3])})  # engine 3 does not say
        before = await group.finished_requests()
        assert set(before) == set(urls[:3])
        world.finished.update({urls[0]: 64.0, urls[1]: 10.0 + 60, urls[2]: 3.0})  # engine 2 restarted
        m = engine_request_metrics(before, await group.finished_requests())
        assert m == {
            "rollout/engines_reporting": 2.0,
            "rollout/engine_requests_min": 60.0,
            "rollout/engine_requests_max": 64.0,
        }
        assert engine_request_metrics({}, {urls[0]: 5.0}) == {}

    asyncio.run(main())


def test_dead_engine_is_restarted_and_waits_for_weights() -> None:
    async def main() -> None:
        world = StubWorld()
        group = _group(world)
        await group.start()
        await group.weights_loaded(1, None)  # the trainer's first push (seed step 8)
        monitor = HealthMonitor(group, interval_s=0.01, failure_threshold=2)
        victim = group.records[1]
        world.processes[victim.url].running = False  # the process died
        world.up[victim.url] = False
        await monitor.check_once()
        assert victim.url in world.deregistered and not victim.registered

        async def waiting() -> bool:
            return victim.status is EngineState.NEEDS_WEIGHTS

        await poll_until(waiting, timeout_s=5, interval_s=0.01, what="restarted, waiting for weights")
        assert victim.status is EngineState.NEEDS_WEIGHTS and victim.restarts == 1
        assert world.starts.count(victim.url) == 2 and not victim.registered
        assert [r.url for r in group.serving()] == [group.records[0].url, group.records[2].url]
        assert group.updatable() == group.records  # the push must reach it too
        await group.weights_loaded(2, [r.url for r in group.records])
        assert victim.status is EngineState.READY and victim.registered and victim.weight_version == 2
        await monitor.stop()

    asyncio.run(main())


def test_an_engine_a_push_left_out_leaves_the_router_until_it_holds_the_version() -> None:
    """The trainer leaves out of a push an engine that was gone when it paused it; if the monitor
    has not seen that yet, the engine still counts as serving, with the older weights."""

    async def main() -> None:
        world = StubWorld()
        group = _group(world, n=3)
        await group.start()
        await group.weights_loaded(1, None)
        left_out = group.records[1]
        await group.weights_loaded(2, [group.records[0].url, group.records[2].url])
        assert left_out.status is EngineState.NEEDS_WEIGHTS and not left_out.registered
        assert left_out.url in world.deregistered and left_out.weight_version == 1
        assert [r.weight_version for r in group.serving()] == [2, 2]
        await group.weights_loaded(2, [left_out.url])  # the catch-up push of the same version
        assert left_out.status is EngineState.READY and left_out.registered
        assert [r.status for r in group.records] == [EngineState.READY] * 3

    asyncio.run(main())


def test_a_paused_monitor_marks_an_exited_engine_dead_and_restarts_it_once_resumed() -> None:
    """While the engines sleep (the trainer may be using their GPU memory) an engine whose process
    exited is dead at once — out of the router, the memory calls and the pushes — and restarted
    only when the monitor resumes."""

    async def main() -> None:
        world = StubWorld()
        group = _group(world, n=2)
        await group.start()
        await group.weights_loaded(1, None)
        monitor = HealthMonitor(group, interval_s=0.01, failure_threshold=2)
        monitor.pause("offload")
        for rec in group.records:
            rec.asleep = {"weights", "kv_cache"}
        victim = group.records[0]
        world.processes[victim.url].running = False
        monitor.start()

        async def dead() -> bool:
            return victim.status is EngineState.DEAD

        await poll_until(dead, timeout_s=5, interval_s=0.01, what="the exited engine marked dead")
        assert victim.url in world.deregistered and group.live() == [group.records[1]]
        await asyncio.sleep(0.05)
        assert world.starts.count(victim.url) == 1 and victim.status is EngineState.DEAD  # no restart yet
        monitor.resume("offload")

        async def waiting() -> bool:
            return victim.status is EngineState.NEEDS_WEIGHTS

        await poll_until(waiting, timeout_s=5, interval_s=0.01, what="restarted after the resume")
        assert world.starts.count(victim.url) == 2
        await monitor.stop()

    asyncio.run(main())


def test_monitor_waits_while_paused_and_before_the_first_push_re_registers_at_once() -> None:
    async def main() -> None:
        world = StubWorld()
        group = _group(world, n=2)
        await group.start()
        monitor = HealthMonitor(group, interval_s=0.01, failure_threshold=1)
        monitor.pause("offload")
        victim = group.records[0]
        world.up[victim.url] = False
        monitor.start()
        await asyncio.sleep(0.05)
        assert victim.status is EngineState.READY  # a sleeping engine is not a dead one
        monitor.resume("offload")

        async def serving() -> bool:
            return victim.restarts > 0 and victim.status is EngineState.READY

        await poll_until(serving, timeout_s=5, interval_s=0.01, what="restarted and serving")
        # Version 0 (no push yet): the restarted engine holds the checkpoint's weights and serves.
        assert (
            victim.status is EngineState.READY
            and victim.registered
            and world.registered.count(victim.url) == 2
        )
        await monitor.stop()

    asyncio.run(main())


def test_the_router_is_kept_holding_exactly_the_serving_engines() -> None:
    """The monitor is the one judge: a router that lost its registry (restarted) gets the serving
    engines back, and an engine that does not serve is taken out, at the next check."""

    async def main() -> None:
        world = StubWorld()
        group = _group(world, n=3)
        await group.start()
        await group.weights_loaded(1, None)
        monitor = HealthMonitor(group, interval_s=0.01, failure_threshold=2)
        world.held.clear()  # the router restarted and holds nothing
        group.records[2].status = EngineState.NEEDS_WEIGHTS  # restarted, waiting for a push
        world.held.add(group.records[2].url)  # ... but somebody registered it
        world.held.add("http://someone-elses:1")  # registered by a user: not ours to judge
        await monitor.check_once()
        assert world.held == {group.records[0].url, group.records[1].url, "http://someone-elses:1"}
        assert [r.registered for r in group.records] == [True, True, False]
        await monitor.stop()

    asyncio.run(main())


def test_an_external_engine_is_taken_out_while_it_fails_and_put_back_when_it_answers() -> None:
    async def main() -> None:
        world = StubWorld()
        world.can_restart = False  # engines attached by URL: the manager cannot restart them
        group = _group(world, n=2)
        await group.start()
        monitor = HealthMonitor(group, interval_s=0.01, failure_threshold=2)
        ext = group.records[1]
        world.up[ext.url] = False
        await monitor.check_once()
        assert ext.status is EngineState.READY and ext.registered  # one failed probe is not enough
        await monitor.check_once()
        assert (
            ext.status is EngineState.DEAD and ext.url not in world.held and world.starts.count(ext.url) == 1
        )
        world.up[ext.url] = True
        await monitor.check_once()
        assert ext.status is EngineState.READY and ext.url in world.held and ext.registered
        await monitor.stop()

    asyncio.run(main())
