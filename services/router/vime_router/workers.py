"""vllm-router's worker list, driven from the control plane.

vllm-router has no drain state and its own health checks pile a dead engine's consistent-hash
keys onto one other engine, so the control plane decides which engines serve and keeps
vllm-router's list equal to that set: engines it takes out are removed (their keys spread over
the ring of the others), engines it lets in are added. ``POST /workers`` blocks until the worker
answers ``/health``, so only engines that just passed a probe are added.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

import httpx

log = logging.getLogger("vime.router.workers")


class WorkerSyncError(RuntimeError):
    """vllm-router refused or did not answer a worker-list call."""


class RouterWorkers:
    """Calls to vllm-router's ``/workers`` API on its private port."""

    def __init__(self, base_url: str, *, timeout_s: float = 15.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)
        self._lock = asyncio.Lock()
        self.last_seen: list[str] = []
        """Worker URLs vllm-router held after the last successful sync."""

    async def aclose(self) -> None:
        await self._http.aclose()

    async def list(self) -> set[str]:
        try:
            r = await self._http.get("/workers")
        except httpx.HTTPError as exc:
            raise WorkerSyncError(f"vllm-router did not list its workers: {exc!r}") from exc
        if r.status_code != 200:
            raise WorkerSyncError(f"GET /workers -> {r.status_code}: {r.text[:200]}")
        return {str(w["url"]).rstrip("/") for w in r.json().get("workers", [])}

    async def add(self, url: str) -> None:
        try:
            r = await self._http.post("/workers", json={"url": url})
        except httpx.HTTPError as exc:
            raise WorkerSyncError(f"vllm-router did not add {url}: {exc!r}") from exc
        if r.status_code not in (200, 201, 202) and "already exists" not in r.text:
            raise WorkerSyncError(f"POST /workers {url} -> {r.status_code}: {r.text[:200]}")

    async def remove(self, url: str) -> None:
        try:
            r = await self._http.delete("/workers/" + quote(url, safe=""))
        except httpx.HTTPError as exc:
            raise WorkerSyncError(f"vllm-router did not remove {url}: {exc!r}") from exc
        if r.status_code not in (200, 202, 204, 404):
            raise WorkerSyncError(f"DELETE /workers/{url} -> {r.status_code}: {r.text[:200]}")

    async def sync(self, desired: set[str]) -> tuple[set[str], set[str]]:
        """Make vllm-router's list equal ``desired``: removals first (they stop traffic at once).

        Returns (added, removed). One failing add does not stop the others; the first error is
        raised after all were tried, and the next sync tries again.
        """
        async with self._lock:
            actual = await self.list()
            removed, added = actual - desired, desired - actual
            errors: list[str] = []
            held = set(actual)
            for url in sorted(removed):
                try:
                    await self.remove(url)
                    held.discard(url)
                except WorkerSyncError as exc:
                    errors.append(str(exc))
            to_add = sorted(added)
            results = await asyncio.gather(*(self.add(url) for url in to_add), return_exceptions=True)
            errors += [str(r) for r in results if isinstance(r, BaseException)]
            held |= {url for url, r in zip(to_add, results, strict=True) if r is None}
            self.last_seen = sorted(held)
            if errors:
                raise WorkerSyncError("; ".join(errors))
            return added, removed
