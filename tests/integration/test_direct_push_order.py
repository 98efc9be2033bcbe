"""The order of one direct push's calls (`DirectSync`), against a real reference engine with the
worker extension: the trainer packs the first bucket while the engines open the staging buffers;
a bucket's load is sent while the engines may still be copying the one before, never more than
the two staging buffers hold, and no buffer is packed again while an engine may read it; a push
whose open or pause fails ends its bucket stream and frees the buffers, and the next push loads
everything. The trainer side is `LocalRanks` (the real rank-side exporter, in-process)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from vime_trainer.weight_sync import WeightSyncError
from vime_trainer.weight_sync.direct_sync import DirectSync

from tests.support.direct_engines import Unused, info, pushed_weights, start_engine
from tests.support.direct_ranks import LocalRanks
from vime.clients.base import ServiceCallError
from vime.clients.engine import EngineClient
from vime.wire.direct_load import EXTENSION, LOAD, OPEN, decode_load

pytestmark = pytest.mark.slow

BUCKET = 32 << 10
"""Small buckets: the nano checkpoint is pushed in many."""


@pytest.fixture(scope="module")
def engine(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    child, url = start_engine(
        qwen3, tmp_path_factory.mktemp("engine"), "direct", "--worker-extension-cls", EXTENSION
    )
    try:
        yield url
    finally:
        child.stop()


@pytest.fixture(scope="module")
def weights(qwen3: Path) -> dict[str, torch.Tensor]:
    return pushed_weights(qwen3)


class Calls:
    """What the engine clients and the ranks did, in order; the slots of the loads in flight."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.lock = threading.Lock()
        self.reading: list[int] = []
        """The slot of each load sent and not yet answered."""
        self.most_in_flight = 0
        self.packed_while_read: list[int] = []


class RecordingRanks(LocalRanks):
    """Records each bucket packed, and any slot packed while a load of it was in flight."""

    def __init__(self, tensors: dict[str, torch.Tensor], directory: Path, calls: Calls) -> None:
        super().__init__(tensors, directory)
        self.calls = calls

    def next(self, slot: int) -> list[dict[str, Any] | None]:
        with self.calls.lock:
            if slot in self.calls.reading:
                self.calls.packed_while_read.append(slot)
        out = super().next(slot)
        if out[0] is not None:
            self.calls.log.append(f"packed bucket {out[0]['index']}")
        return out


def recording(
    calls: Calls,
    *,
    open_delay_s: float = 0.0,
    fail_open: bool = False,
    pause_delay_s: float = 0.0,
    fail_pause: bool = False,
    load_delay_s: float = 0.0,
) -> Callable[[str], EngineClient]:
    """An engine client factory recording the push's calls; each delay (or failure) comes before
    the call reaches the engine, as a slow network would."""

    class Recording(EngineClient):
        async def pause(self, *args: Any, **kwargs: Any) -> None:
            calls.log.append("pause sent")
            await asyncio.sleep(pause_delay_s)
            if fail_pause:
                raise ServiceCallError("POST", self.base_url + "/pause", 500, "pause failed")
            await super().pause(*args, **kwargs)
            calls.log.append("paused")

        async def request(self, method: str, path: str, **options: Any) -> Any:
            rpc = options["json"]["method"] if path == "/collective_rpc" else None
            if rpc == OPEN:
                calls.log.append("open sent")
                await asyncio.sleep(open_delay_s)
                if fail_open:
                    raise ServiceCallError("POST", self.base_url + path, 500, "open failed")
                out = await super().request(method, path, **options)
                calls.log.append("opened")
                return out
            if rpc != LOAD:
                return await super().request(method, path, **options)
            slot = int(decode_load(options["json"]["args"][0])["slot"])
            with calls.lock:
                calls.reading.append(slot)
                calls.most_in_flight = max(calls.most_in_flight, len(calls.reading))
            try:
                await asyncio.sleep(load_delay_s)
                return await super().request(method, path, **options)
            finally:
                with calls.lock:
                    calls.reading.remove(slot)

    return lambda url: Recording(url)


def push_once(
    url: str, weights: dict[str, torch.Tensor], directory: Path, version: int, **delays: Any
) -> tuple[Calls, DirectSync, Any]:
    """One push to ``url`` with the engine calls delayed as `recording` is told; what was recorded."""
    calls = Calls()
    ranks = RecordingRanks(weights, directory, calls)
    sync = DirectSync(ranks, Unused(), bucket_bytes=BUCKET, client_factory=recording(calls, **delays))
    try:
        report = asyncio.run(sync.push([info(url)], version, flush=True))
    finally:
        asyncio.run(sync.aclose())
    return calls, sync, report


def check_whole_push(url: str, weights: dict[str, torch.Tensor], report: Any, version: int) -> None:
    assert report.nbytes == sum(t.numel() * t.element_size() for t in weights.values())
    assert httpx.get(url + "/weight_info").json() == {"weight_version": str(version)}
    assert httpx.get(url + "/is_paused").json() == {"is_paused": False}


def test_the_first_bucket_is_packed_while_the_engines_open_the_buffers(
    engine: str, weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    calls, _, report = push_once(engine, weights, tmp_path, 8, open_delay_s=0.3)
    log = calls.log
    assert log.index("open sent") < log.index("opened") < log.index("pause sent")
    assert log.index("packed bucket 0") < log.index("opened")
    assert log.index("packed bucket 1") > log.index("paused")  # the rest while the engines are paused
    assert report.buckets > 3
    check_whole_push(engine, weights, report, 8)


def test_a_bucket_is_sent_while_the_one_before_is_loading_and_no_buffer_is_packed_while_read(
    engine: str, weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    calls, sync, report = push_once(engine, weights, tmp_path, 9, load_delay_s=0.1)
    assert sync.slots == 2 and report.buckets > 3
    assert calls.most_in_flight == 2  # the next bucket went before the one ahead of it was answered
    assert calls.packed_while_read == []
    assert report.update_parts["load_s"] > report.phases["update"]  # the loads' calls overlapped
    check_whole_push(engine, weights, report, 9)


@pytest.mark.parametrize("fails", ["open", "pause"])
def test_a_push_whose_open_or_pause_fails_frees_its_buffers_and_the_next_loads_everything(
    engine: str, weights: dict[str, torch.Tensor], tmp_path: Path, fails: str
) -> None:
    calls = Calls()
    ranks = RecordingRanks(weights, tmp_path, calls)
    failing = recording(calls, fail_open=fails == "open", fail_pause=fails == "pause", pause_delay_s=0.1)
    sync = DirectSync(ranks, Unused(), bucket_bytes=BUCKET, client_factory=failing)
    try:
        with pytest.raises(WeightSyncError, match=f"ServiceCallError: .* 500: {fails} failed"):
            asyncio.run(sync.push([info(engine)], 10, flush=True))
        assert "packed bucket 0" in calls.log and "packed bucket 1" not in calls.log
        assert ranks.exporter is None and not sync.staged and sync.opened == []
        assert not list(tmp_path.iterdir())  # the staging files are gone
        assert httpx.get(engine + "/is_paused").json() == {"is_paused": False}
        sync.client_factory = recording(calls)
        report = asyncio.run(sync.push([info(engine)], 11, flush=True))
    finally:
        asyncio.run(sync.aclose())
    assert calls.log.count("packed bucket 0") == 2
    check_whole_push(engine, weights, report, 11)
