"""The fast weight load, driven from the trainer (opt-in; the stock `WeightSync` stays the default).

Same protocol frame as the stock push — seed step 46 pause (``abort`` when flushing, else
``keep``) and prefix-cache flush, step 52 resume — but the weights go in with one
``POST /collective_rpc {"method": "vime_fast_load"}`` per bucket instead of vLLM's
``start/update/finish_weight_update``: the engine's worker extension
(``vime_rollout.vllm_ext.fast_loader``) copies each parameter's bytes straight into its storage.
Needs engines started with ``--worker-extension-cls vime_rollout.vllm_ext.fast_loader.FastWeightLoader``
and tensor parallel size 1; `FastIpcSync.prepare` reads and checks their layout first and raises
`FastPlanError` when the fast path cannot be used.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import time
from collections.abc import Awaitable, Generator, Iterator, Sequence
from typing import Any

from vime.clients.engine import EngineClient
from vime.wire.rollout import EngineInfo
from vime_trainer.weight_sync.fast_plan import FastPlan, FastPlanError
from vime_trainer.weight_sync.ipc import RankActors, call_on_ranks
from vime_trainer.weight_sync.ipc_payload import RankGpu, ranks_for_engine
from vime_trainer.weight_sync.protocol import UPDATE_TIMEOUT_S, PushReport, WeightSync, _fan_out

EXTENSION = "vime_rollout.vllm_ext.fast_loader.FastWeightLoader"


class FastBucket:
    """One bucket as every rank exported it; the ``vime_fast_load`` argument for each engine."""

    def __init__(self, exports: list[dict[str, Any]], ranks: Sequence[RankGpu]) -> None:
        self.exports = {r.rank: e for r, e in zip(ranks, exports, strict=True)}
        self.ranks = list(ranks)
        self.index = int(exports[0]["index"])
        self.nbytes = int(exports[0]["nbytes"])
        self.params = exports[0]["params"]

    def payload(self, engine: EngineInfo) -> str:
        handles: dict[str, Any] = {}
        for r in ranks_for_engine(engine, self.ranks):
            handles.update(self.exports[r]["handles"])
        return base64.b64encode(pickle.dumps({"handles": handles, "params": self.params})).decode("ascii")


def fast_buckets(group: RankActors, plan: FastPlan, bucket_bytes: int) -> Generator[FastBucket, None, None]:
    from vime_trainer.weight_sync import fast_rank

    ranks = [RankGpu(**r) for r in call_on_ranks(group, fast_rank.fast_open, plan.to_dict(), bucket_bytes)]
    try:
        while True:
            raw = call_on_ranks(group, fast_rank.fast_next)
            if all(r is None for r in raw):
                return
            if any(r is None for r in raw):
                raise RuntimeError("trainer ranks ran out of buckets at different points")
            yield FastBucket(raw, ranks)
    finally:
        call_on_ranks(group, fast_rank.fast_close)


async def collective_rpc(client: EngineClient, method: str, *args: str) -> list[Any]:
    body = {"method": method, "args": list(args), "timeout": UPDATE_TIMEOUT_S}
    out = await client.request("POST", "/collective_rpc", json=body, timeout=UPDATE_TIMEOUT_S)
    return list(out["results"])


class FastIpcSync(WeightSync):
    """`WeightSync` with the engines' weights written by the fast loader."""

    def __init__(self, group: RankActors, bucket_bytes: int = 1 << 30, **kwargs: Any) -> None:
        super().__init__(_NoTransport(), **kwargs)
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.plan: FastPlan | None = None

    async def prepare(self, engines: Sequence[EngineInfo]) -> FastPlan:
        """Read every engine's layout (once); they must agree and each be one worker."""
        layouts = []
        for e in engines:
            client = self.client_factory(e.url)
            try:
                results = await collective_rpc(client, "vime_fast_layout")
            finally:
                await client.aclose()
            if len(results) != 1:
                raise FastPlanError(
                    f"{e.url} has {len(results)} workers: the fast load needs tensor parallel size 1"
                )
            layouts.append(results[0])
        if any(layout != layouts[0] for layout in layouts[1:]):
            raise FastPlanError("the engines report different parameter layouts")
        self.plan = FastPlan.from_layout(layouts[0])
        return self.plan

    async def push(self, engines: Sequence[EngineInfo], version: int, flush: bool) -> PushReport:
        report = PushReport(version, flush, [e.url for e in engines])
        if not engines:
            return report
        plan = self.plan or await self.prepare(engines)
        clients = {e.url: self.client_factory(e.url) for e in engines}
        start = time.perf_counter()
        try:
            await self._phase(
                report, "pause", clients, lambda c: c.pause("abort" if flush else "keep", clear_cache=False)
            )
            if flush:
                await self._phase(report, "flush", clients, self._reset_prefix_cache)
            await self._send_fast(report, plan, engines, clients)
            await self._phase(report, "resume", clients, lambda c: c.resume())
        finally:
            await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)
        report.seconds = time.perf_counter() - start
        return report

    async def _send_fast(
        self,
        report: PushReport,
        plan: FastPlan,
        engines: Sequence[EngineInfo],
        clients: dict[str, EngineClient],
    ) -> None:
        it = fast_buckets(self.group, plan, self.bucket_bytes)
        t0 = time.perf_counter()
        try:
            while (bucket := await asyncio.to_thread(next, it, None)) is not None:
                calls: dict[str, Awaitable[Any]] = {e.url: _load(clients[e.url], bucket, e) for e in engines}
                await _fan_out("vime_fast_load", calls)
                report.buckets += 1
                report.nbytes += bucket.nbytes
        finally:
            await asyncio.to_thread(it.close)
            report.phases["update"] = time.perf_counter() - t0


async def _load(client: EngineClient, bucket: FastBucket, engine: EngineInfo) -> None:
    """One bucket into one engine; every byte must have been written."""
    results = await collective_rpc(client, "vime_fast_load", bucket.payload(engine))
    written = [r.get("bytes") if isinstance(r, dict) else r for r in results]
    if written != [bucket.nbytes]:
        raise FastPlanError(f"bucket {bucket.index}: {bucket.nbytes} bytes sent, the engine wrote {written}")


class _NoTransport:
    name = "ipc-fast"
    init_info: dict[str, Any] | None = None

    def buckets(self, engines: Sequence[EngineInfo]) -> Iterator[Any]:
        raise NotImplementedError("FastIpcSync sends its own buckets")
