"""vLLM's four-phase weight update as the trainer drives it (seed steps 46–52), against engines that
record every call: the order, the query parameters, the retries of the cache flush, and what is
left behind when a bucket fails."""

from __future__ import annotations

import pytest
from engine_fakes import FakeEngines, FakeTransport, engine_info
from vime_trainer.weight_sync import WeightSync, WeightSyncError


def _sync(engines: FakeEngines, transport: FakeTransport, **kw: object) -> tuple[WeightSync, list[str]]:
    events: list[str] = []
    sync = WeightSync(
        transport,
        on_event=lambda action, **_: events.append(action),
        client_factory=engines.client,
        reset_interval_s=0.0,
        **kw,  # type: ignore[arg-type]
    )
    return sync, events


def _infos(engines: FakeEngines) -> list:
    return [engine_info(u, i) for i, u in enumerate(engines.urls())]


async def test_flush_push_runs_the_seed_order_on_every_engine() -> None:
    engines, transport = FakeEngines(2), FakeTransport(3)
    sync, events = _sync(engines, transport)
    report = await sync.push(_infos(engines), version=2, flush=True)
    for url, s in engines.states.items():
        names = [c[0] for c in s.calls]
        assert names == [
            "pause",
            "reset_prefix_cache",
            "start_weight_update",
            "update_weights",
            "update_weights",
            "update_weights",
            "finish_weight_update",
            "resume",
        ]
        assert s.calls[0][1] == {"mode": "abort", "clear_cache": "false"}  # step 46: abort, flush separately
        assert s.calls[1][1] == {"reset_running_requests": "true", "reset_external": "true"}
        assert [c[1]["index"] for c in s.calls if c[0] == "update_weights"] == [0, 1, 2]
        assert all(c[1]["engine"] == url for c in s.calls if c[0] == "update_weights")
        assert s.calls[-2][1] == {"weight_version": "2"}  # step 51 carries the new version
        assert s.version == "2" and s.paused is None and not s.update_active
    assert transport.released == [0, 1, 2] and transport.closed == 1
    assert (report.version, report.flushed, report.buckets, report.nbytes) == (2, True, 3, 300)
    assert events == [
        "weights.pause",
        "weights.flush",
        "weights.start",
        "weights.update",
        "weights.update",
        "weights.update",
        "weights.finish",
        "weights.resume",
    ]


async def test_the_next_bucket_is_prepared_while_the_engines_load_the_current_one() -> None:
    engines = FakeEngines(2)
    for s in engines.states.values():
        s.update_s = 0.2
    loaded_when_made: list[int] = []
    transport = FakeTransport(
        4, on_bucket=lambda i: loaded_when_made.append(len(engines.states["http://e0"].loaded))
    )
    sync, _ = _sync(engines, transport)
    report = await sync.push(_infos(engines), version=2, flush=True)
    assert loaded_when_made == [0, 0, 1, 2]  # bucket i+1 is made while bucket i is still loading
    assert report.buckets == 4 and transport.closed == 1
    assert set(report.phases) == {"pause", "flush", "start", "update", "finish", "resume"}
    assert report.weight_load == "vllm"


async def test_push_without_flush_keeps_requests_and_skips_the_cache_reset() -> None:
    engines = FakeEngines(1)
    sync, _ = _sync(engines, FakeTransport(1))
    await sync.push(_infos(engines), version=3, flush=False)
    calls = engines.states["http://e0"].calls
    assert calls[0] == ("pause", {"mode": "keep", "clear_cache": "false"})
    assert "reset_prefix_cache" not in [c[0] for c in calls]


async def test_an_in_flight_update_keeps_requests_and_still_flushes() -> None:
    """The async mode's push: requests in flight are frozen (``keep``), not aborted, and the pause
    itself clears the caches (vLLM does it once the engine is idle), so they recompute their KV
    with the new weights; no separate, retried reset."""
    engines = FakeEngines(1)
    sync, events = _sync(engines, FakeTransport(1))
    report = await sync.push(_infos(engines), version=4, flush=True, mode="keep")
    calls = engines.states["http://e0"].calls
    assert calls[0] == ("pause", {"mode": "keep", "clear_cache": "true"})
    assert "reset_prefix_cache" not in [c[0] for c in calls] and report.flushed
    assert "weights.flush" not in events and "flush" not in report.phases
    unflushed = FakeEngines(1)
    sync, _ = _sync(unflushed, FakeTransport(1))
    await sync.push(_infos(unflushed), version=5, flush=False, mode="keep")
    assert unflushed.states["http://e0"].calls[0] == ("pause", {"mode": "keep", "clear_cache": "false"})


async def test_cache_reset_is_retried_while_blocks_are_held() -> None:
    engines = FakeEngines(2)
    engines.states["http://e0"].reset_failures = 2
    sync, _ = _sync(engines, FakeTransport(1))
    await sync.push(_infos(engines), version=1, flush=True)
    resets = [c for c in engines.states["http://e0"].calls if c[0] == "reset_prefix_cache"]
    assert len(resets) == 3
    assert len([c for c in engines.states["http://e1"].calls if c[0] == "reset_prefix_cache"]) == 1


async def test_cache_reset_gives_up_after_the_last_attempt_and_never_starts_the_update() -> None:
    engines = FakeEngines(1)
    engines.states["http://e0"].reset_failures = 100
    sync, _ = _sync(engines, FakeTransport(1), reset_attempts=4)
    with pytest.raises(WeightSyncError, match="reset_prefix_cache failed 4 times"):
        await sync.push(_infos(engines), version=1, flush=True)
    names = [c[0] for c in engines.states["http://e0"].calls]
    assert names.count("reset_prefix_cache") == 4 and "start_weight_update" not in names


async def test_a_failed_bucket_leaves_engines_paused_with_the_session_closed() -> None:
    engines, transport = FakeEngines(2), FakeTransport(3)
    engines.states["http://e1"].fail_update_at = 1
    sync, events = _sync(engines, transport)
    with pytest.raises(WeightSyncError, match=r"update_weights failed on 1 engine\(s\): http://e1"):
        await sync.push(_infos(engines), version=2, flush=True)
    for s in engines.states.values():
        names = [c[0] for c in s.calls]
        assert "resume" not in names and s.paused == "abort"  # no half-updated weights served
        assert [c[1]["index"] for c in s.calls if c[0] == "update_weights"] == [0, 1]  # bucket 2 never sent
        assert s.calls[-1] == ("finish_weight_update", {"weight_version": None}) and not s.update_active
        assert s.version is None  # the new version was never announced
    assert transport.closed == 1 and "weights.finish" not in events


async def test_an_engine_gone_at_the_pause_is_left_out_and_the_others_get_the_version() -> None:
    """An engine that died after the rollout (its gate answers 502) must not fail the run's push:
    the others load the version; the report names only them, for the rollout manager."""
    engines, transport = FakeEngines(3), FakeTransport(2)
    engines.states["http://e1"].gone = True
    sync, events = _sync(engines, transport)
    report = await sync.push(_infos(engines), version=4, flush=True)
    assert report.engines == ["http://e0", "http://e2"] and report.buckets == 2
    for url in report.engines:
        s = engines.states[url]
        assert [c[0] for c in s.calls][-1] == "resume" and s.version == "4" and s.paused is None
    assert engines.states["http://e1"].calls == [] and "weights.engine_gone" in events
    for s in engines.states.values():
        s.gone = True
    report = await sync.push(_infos(engines), version=5, flush=True)
    assert report.engines == [] and report.buckets == 0  # nobody to load: the restarts are caught up


async def test_a_gone_engine_beside_a_failing_one_still_fails_the_push() -> None:
    engines = FakeEngines(2)
    engines.states["http://e0"].gone = True
    engines.states["http://e1"].weights_asleep = True  # a refusal is not an absence
    sync, _ = _sync(engines, FakeTransport(2))
    with pytest.raises(WeightSyncError, match="weights are asleep"):
        await sync.push(_infos(engines), version=2, flush=False)
    engines = FakeEngines(2)
    engines.states["http://e1"].fail_update_at = 0  # gone-ness counts at the pause only
    sync, _ = _sync(engines, FakeTransport(2))
    with pytest.raises(WeightSyncError, match="update_weights failed"):
        await sync.push(_infos(engines), version=2, flush=False)


async def test_engine_with_weights_asleep_refuses_and_the_push_fails() -> None:
    engines = FakeEngines(1)
    engines.states["http://e0"].weights_asleep = True
    sync, _ = _sync(engines, FakeTransport(2))
    with pytest.raises(WeightSyncError, match="weights are asleep"):
        await sync.push(_infos(engines), version=1, flush=True)


async def test_no_engines_no_calls_and_no_buckets_is_an_error() -> None:
    engines, transport = FakeEngines(1), FakeTransport(0)
    sync, _ = _sync(engines, transport)
    report = await sync.push([], version=1, flush=True)
    assert report.buckets == 0 and engines.states["http://e0"].calls == []
    with pytest.raises(WeightSyncError, match="produced no weight bucket"):
        await sync.push(_infos(engines), version=1, flush=True)


async def test_a_transport_with_an_init_body_initialises_every_engine_before_the_session() -> None:
    engines = FakeEngines(2)
    sync, _ = _sync(engines, FakeTransport(1, init_info={}))
    await sync.push(_infos(engines), version=1, flush=False)
    for s in engines.states.values():
        names = [c[0] for c in s.calls]
        assert names[:3] == ["pause", "init_weight_transfer_engine", "start_weight_update"]
        assert s.calls[1][1] == {}
