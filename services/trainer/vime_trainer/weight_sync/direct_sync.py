"""The direct weight load, driven from the trainer (``engine.weight_load: direct``).

The same protocol frame as the stock push (`WeightSync`) — seed step 46 pause (``abort`` when
flushing, else ``keep``) and prefix-cache flush, step 52 resume — but instead of vLLM's
start/update/finish_weight_update each bucket goes in with one ``vime_direct_load`` call of the
engines' worker extension (`vime.wire.direct_load`), which copies it out of the trainer's staging
buffer into the parameter views it recorded.

Before anything is paused, `DirectSync.prepare` reads the layout of every engine it has not checked
since that engine started and checks it against what the trainer exports; whatever cannot be loaded
exactly is refused then, and the run keeps vLLM's loader from that push on, with a warning and a
``weights.direct_refused`` event. The trainer's staging buffers live for one push: the ranks
allocate them and every engine opens them before the pause (``weights.direct_open``); after the
resume the engines let go and the ranks free them (``weights.direct_close``), so a sleeping trainer
holds none of them through the rollout.

Per push the trainer packs the first bucket while the engines open the buffers, then bucket k+1
into one buffer while the engines copy bucket k out of the other; bucket k+1's load is sent as soon
as it is packed, so it waits in the engines' queue, not behind bucket k's round trip. Every engine
returns the checksum of what its parameters hold after the copy; it must equal the trainer's
checksum of what it packed, or the push fails and the engines stay paused — never serving weights
that are not the trainer's. Engines that keep a weight-version label (vLLM ≥ 0.33,
the reference engine) get it with ``/update_weight_version``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from vime.clients.base import ServiceCallError
from vime.clients.engine import EngineClient
from vime.wire.direct_load import CLOSE, EXTENSION, LAYOUT, LOAD, OPEN, encode_load, encode_open
from vime.wire.engine import PauseMode
from vime.wire.rollout import EngineInfo
from vime_trainer.weight_sync.direct_plan import DirectLoadRefused, DirectPlan
from vime_trainer.weight_sync.direct_ranks import DirectBucket, DirectRanks, RankBuffers
from vime_trainer.weight_sync.ipc_payload import ranks_for_engine
from vime_trainer.weight_sync.protocol import (
    UPDATE_TIMEOUT_S,
    PushReport,
    WeightSync,
    WeightSyncError,
    _fan_out,
    pause_mode,
)

log = logging.getLogger("vime.trainer.weights")


async def collective_rpc(client: EngineClient, method: str, *args: str) -> list[Any]:
    """vLLM's ``POST /collective_rpc`` (string arguments only): one result per worker."""
    body = {"method": method, "args": list(args), "timeout": UPDATE_TIMEOUT_S}
    out = await client.request("POST", "/collective_rpc", json=body, timeout=UPDATE_TIMEOUT_S)
    return list(out["results"]) if isinstance(out, dict) else []


def _key(engine: EngineInfo) -> tuple[int | None, int]:
    return engine.pid, engine.restarts


class DirectSync(WeightSync):
    """`WeightSync` with the engines' weights written by the direct-load extension; ``fallback``
    (the stock push) takes over for the rest of the run once the direct load is refused."""

    def __init__(
        self,
        ranks: DirectRanks,
        fallback: WeightSync,
        *,
        bucket_bytes: int = 1 << 30,
        client_factory: Callable[[str], EngineClient] | None = None,
    ) -> None:
        super().__init__(
            fallback.transport,
            on_event=fallback.on_event,
            reset_attempts=fallback.reset_attempts,
            reset_interval_s=fallback.reset_interval_s,
            client_factory=client_factory or fallback.client_factory,
        )
        self.ranks, self.fallback, self.bucket_bytes = ranks, fallback, bucket_bytes
        self.session = uuid.uuid4().hex
        self.plan: DirectPlan | None = None
        self.buffer_bytes = 0
        self.slots = 1
        self.staged = False
        """The ranks hold staging buffers (from the open of a push to its close)."""
        self.opened: list[str] = []
        """Engines holding this push's buffers open."""
        self.checked: dict[str, tuple[int | None, int]] = {}
        """Engines whose layout was checked, with the (pid, restarts) they had then."""
        self.labels: dict[str, bool] = {}
        self.refused: str | None = None

    @property
    def weight_load(self) -> str:
        return "vllm" if self.refused is not None else "direct"

    async def push(
        self, engines: Sequence[EngineInfo], version: int, flush: bool, mode: PauseMode | None = None
    ) -> PushReport:
        if engines and self.refused is None:
            try:
                await self.prepare(engines)
            except DirectLoadRefused as exc:
                self.refused = str(exc)
                log.warning("engine.weight_load=direct refused, using vLLM's loader for this run: %s", exc)
                self.on_event("weights.direct_refused", reason=self.refused)
        if self.refused is not None:
            return await self.fallback.push(engines, version, flush, mode)
        report = PushReport(version, flush, [e.url for e in engines], weight_load="direct")
        if not engines:
            return report
        first: asyncio.Future[list[dict[str, Any] | None]] | None = None
        try:
            t0 = time.perf_counter()
            buffers = await self._allocate()
            first = asyncio.ensure_future(asyncio.to_thread(self._begin))  # while the engines open them
            await self._open(report, engines, buffers, t0)
            return await self._push_direct(report, engines, mode or pause_mode(flush), first)
        finally:
            if first is not None:  # the bucket stream ends here, also when the open or the pause failed
                await asyncio.gather(first, return_exceptions=True)
                await asyncio.to_thread(self.ranks.end)
            await self._close(report)

    # --- once per engine start -------------------------------------------------------------------
    async def prepare(self, engines: Sequence[EngineInfo]) -> None:
        """Check every engine not checked since it started (nothing is paused); DirectLoadRefused
        when one cannot be loaded directly."""
        stale = [e for e in engines if self.checked.get(e.url) != _key(e)]
        if not stale:
            return
        clients = {e.url: self.client_factory(e.url) for e in stale}
        try:
            layouts = await _gather("direct layout", {u: self._layout(u, c) for u, c in clients.items()})
            plans = {u: DirectPlan.from_layout(layout) for u, layout in layouts.items()}
            for url, plan in plans.items():
                if plan != (self.plan or next(iter(plans.values()))):
                    raise DirectLoadRefused(f"{url} reports another parameter layout than the other engines")
            if self.plan is None:
                plan = next(iter(plans.values()))
                plan.check_export(await asyncio.to_thread(self.ranks.export_spec))
                self.slots, self.buffer_bytes = plan.staging(self.bucket_bytes)
                self.plan = plan
            labels = await _gather("weight_info", {u: c.weight_version() for u, c in clients.items()})
        finally:
            await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)
        for e in stale:
            self.checked[e.url] = _key(e)
            self.labels[e.url] = labels[e.url] is not None

    # --- every push: the staging buffers' life -----------------------------------------------------
    async def _allocate(self) -> list[RankBuffers]:
        """The ranks allocate this push's staging buffers."""
        assert self.plan is not None, "prepare first"
        self.staged = True  # a failed allocation is freed too
        return await asyncio.to_thread(self.ranks.open, self.plan, self.buffer_bytes, self.slots)

    async def _open(
        self, report: PushReport, engines: Sequence[EngineInfo], buffers: Sequence[RankBuffers], t0: float
    ) -> None:
        """Every engine opens the ranks' staging buffers (before the pause); the open phase is timed
        from ``t0``, when the ranks began allocating them."""
        t1 = time.perf_counter()
        clients = {e.url: self.client_factory(e.url) for e in engines}
        try:
            opening = {
                e.url: collective_rpc(
                    clients[e.url], OPEN, encode_open(self.session, _buffers_for(e, buffers))
                )
                for e in engines
            }
            self.opened = list(opening)  # a failed open is closed too
            await _gather("direct open", opening)
        finally:
            await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)
        report.phases["open"] = seconds = time.perf_counter() - t0
        self.on_event(
            "weights.direct_open",
            engines=list(self.opened),
            slots=self.slots,
            buffer_bytes=self.buffer_bytes,
            seconds=round(seconds, 4),
            ranks_s=round(t1 - t0, 4),
            engines_s=round(seconds - (t1 - t0), 4),
        )

    async def _close(self, report: PushReport | None = None) -> None:
        """Engines let go of the buffers, then the ranks free them (best effort: a close that fails
        is logged; an engine still holding them drops them at its next open)."""
        t0 = time.perf_counter()
        if self.opened:
            clients = {url: self.client_factory(url) for url in self.opened}
            self.opened = []
            try:
                results = await asyncio.gather(
                    *(collective_rpc(c, CLOSE) for c in clients.values()), return_exceptions=True
                )
            finally:
                await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)
            for url, r in zip(clients, results, strict=True):
                if isinstance(r, BaseException):
                    log.warning("%s did not close the direct-load buffers: %s: %s", url, type(r).__name__, r)
        t1 = time.perf_counter()
        if self.staged:
            self.staged = False
            try:
                await asyncio.to_thread(self.ranks.close)
            except Exception as exc:
                log.warning("freeing the direct-load buffers: %s: %s", type(exc).__name__, exc)
        if report is not None:
            report.phases["close"] = seconds = time.perf_counter() - t0
            self.on_event(
                "weights.direct_close",
                seconds=round(seconds, 4),
                engines_s=round(t1 - t0, 4),
                ranks_s=round(seconds - (t1 - t0), 4),
            )

    async def _layout(self, url: str, client: EngineClient) -> list[dict[str, Any]]:
        try:
            results = await collective_rpc(client, LAYOUT)
        except ServiceCallError as exc:
            raise DirectLoadRefused(
                f"{url} does not answer {LAYOUT} ({exc.status_code}: {exc.message}); engines need "
                f"--worker-extension-cls {EXTENSION} (engine.weight_load=direct starts them with it)"
            ) from None
        if len(results) != 1:
            raise DirectLoadRefused(
                f"{url} has {len(results)} workers: the direct load needs each engine on one"
            )
        layout = results[0]
        if not isinstance(layout, dict) or not isinstance(layout.get("params"), list):
            raise DirectLoadRefused(f"{url} answered {LAYOUT} with {layout!r}")
        if layout.get("refusal"):
            raise DirectLoadRefused(f"{url}: {layout['refusal']}")
        return list(layout["params"])

    # --- every push --------------------------------------------------------------------------------
    async def _push_direct(
        self,
        report: PushReport,
        engines: Sequence[EngineInfo],
        mode: PauseMode,
        first: asyncio.Future[list[dict[str, Any] | None]],
    ) -> PushReport:
        version = report.version

        async def load(clients: dict[str, EngineClient], engines: Sequence[EngineInfo]) -> None:
            await self._load(report, engines, clients, first)
            labelled = {u: c for u, c in clients.items() if self.labels.get(u)}
            if labelled:
                await self._phase(report, "label", labelled, lambda c: _label(c, version), version=version)

        return await self._framed(report, engines, mode, load)

    def _begin(self) -> list[dict[str, Any] | None]:
        """Start the push's bucket stream on every rank and pack its first bucket into slot 0."""
        self.ranks.begin()
        return self.ranks.next(0)

    async def _load(
        self,
        report: PushReport,
        engines: Sequence[EngineInfo],
        clients: dict[str, EngineClient],
        first: asyncio.Future[list[dict[str, Any] | None]],
    ) -> None:
        """Every bucket into every engine, from ``first`` (slot 0) on. A bucket's load is sent as
        soon as it is packed, while the engines may still be copying the one before: an engine runs
        its calls one at a time, so the next waits in its queue rather than behind a round trip. A
        slot is packed again once every engine answered the load that last used it."""
        t0 = time.perf_counter()
        parts = report.update_parts
        using: dict[int, asyncio.Future[None]] = {}
        """Each slot's load in flight."""
        packing = first
        slot = 0
        try:
            while True:
                tw = time.perf_counter()
                bucket = DirectBucket.from_exports(await packing)
                _add(parts, "pack_wait_s", time.perf_counter() - tw)
                if bucket is None:
                    break
                using[slot] = asyncio.ensure_future(self._load_bucket(report, bucket, slot, engines, clients))
                slot = (slot + 1) % self.slots
                tw = time.perf_counter()
                if slot in using:
                    await using.pop(slot)
                _add(parts, "slot_wait_s", time.perf_counter() - tw)
                packing = asyncio.ensure_future(asyncio.to_thread(self.ranks.next, slot))
            for loading in list(using.values()):
                await loading
        finally:
            # nothing is freed while an engine may still read a slot or a rank still packs one
            await asyncio.gather(packing, *using.values(), return_exceptions=True)
            report.phases["update"] = time.perf_counter() - t0
        if report.buckets == 0:
            raise WeightSyncError("the trainer produced no weight bucket")

    async def _load_bucket(
        self,
        report: PushReport,
        bucket: DirectBucket,
        slot: int,
        engines: Sequence[EngineInfo],
        clients: dict[str, EngineClient],
    ) -> None:
        """Every engine copies the bucket out of ``slot`` and checks it; counted into ``report``."""
        tb = time.perf_counter()
        payload = encode_load(self.session, slot, bucket.index, bucket.params)
        answers: dict[str, dict[str, Any]] = {}

        async def one(url: str) -> None:
            results = await collective_rpc(clients[url], LOAD, payload)  # one worker's answer
            answers[url] = results[0] if len(results) == 1 and isinstance(results[0], dict) else {}

        await _fan_out(LOAD, {e.url: one(e.url) for e in engines})
        nbytes = sum(int(n) for _, _, n in bucket.params)
        for url, got in answers.items():
            if int(got.get("bytes", -1)) != nbytes or str(got.get("checksum")) != bucket.checksum:
                raise WeightSyncError(
                    f"bucket {bucket.index}: {url} holds {got.get('bytes')} bytes with checksum "
                    f"{got.get('checksum')} after the copy, the trainer packed {nbytes} with {bucket.checksum}; "
                    "the engines stay paused"
                )
        report.buckets += 1
        report.nbytes += bucket.nbytes
        times = {
            "source_s": bucket.source_s,
            "pack_s": bucket.pack_s,
            "load_s": time.perf_counter() - tb,
            "engine_s": max(float(got.get("seconds", 0.0)) for got in answers.values()),
        }
        for k, v in times.items():
            _add(report.update_parts, k, v)
        self.on_event(
            "weights.update",
            bucket=bucket.index,
            nbytes=bucket.nbytes,
            tensors=len(bucket.params),
            seconds=round(times["load_s"], 4),
            **{k: round(v, 4) for k, v in times.items() if k != "load_s"},
        )

    async def aclose(self) -> None:
        """Close whatever a push left open (best effort: the run is ending)."""
        await self._close()


def _buffers_for(engine: EngineInfo, rank_buffers: Sequence[RankBuffers]) -> list[dict[str, Any]]:
    """The buffer specs ``engine`` opens: its GPUs' IPC handles merged per slot, or rank 0's files."""
    sharing = [r for r in rank_buffers if r.buffers]
    if not sharing:
        raise WeightSyncError("no trainer rank shares a staging buffer")
    if "cuda_ipc" not in sharing[0].buffers[0]:
        return list(sharing[0].buffers)
    chosen = set(ranks_for_engine(engine, [r.gpu for r in sharing]))
    out = []
    for slot, spec in enumerate(sharing[0].buffers):
        handles: dict[str, Any] = {}
        for r in sharing:
            if r.gpu.rank in chosen:
                handles.update(r.buffers[slot]["cuda_ipc"])
        out.append({"nbytes": spec["nbytes"], "cuda_ipc": handles})
    return out


def _add(parts: dict[str, float], key: str, seconds: float) -> None:
    parts[key] = parts.get(key, 0.0) + seconds


async def _label(client: EngineClient, version: int) -> None:
    await client.request("POST", "/update_weight_version", json={"new_version": str(version)})


async def _gather(phase: str, calls: Mapping[str, Awaitable[Any]]) -> dict[str, Any]:
    """Each engine's result; a refusal from any engine wins over other failures (WeightSyncError)."""
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    out = dict(zip(calls, results, strict=True))
    for r in results:
        if isinstance(r, DirectLoadRefused | asyncio.CancelledError | KeyboardInterrupt):
            raise r
    failed = {u: r for u, r in out.items() if isinstance(r, BaseException)}
    if failed:
        detail = "; ".join(f"{u}: {type(e).__name__}: {e}" for u, e in failed.items())
        raise WeightSyncError(f"{phase} failed on {len(failed)} engine(s): {detail}")
    return out
