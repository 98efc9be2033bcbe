"""The reward service as the rollout loop scores with it (seed step 26).

Per sample (``/v1/reward``) or, with ``reward.group_rm``, one batched call per group
(``/v1/rewards`` with ``group=true``). ``reward.custom_rm_path`` names the function; otherwise the
service picks it (``metadata.rm_type`` of the sample, else its configured ``rm_type``), which is
how the synthetic task's ``arithmetic`` samples reach their verifier.
"""

from __future__ import annotations

from typing import Any

from vime.clients.reward import RewardClient
from vime.types import Sample
from vime.wire.reward import RewardResult


def _details(r: RewardResult) -> dict[str, Any]:
    out: dict[str, Any] = {"status": r.status.value, "fn": r.fn}
    if r.pred is not None:
        out["pred"] = r.pred
    if r.error:
        out["error"] = r.error
    return out


class RewardScorer:
    """Adapter from the typed reward client to the loop's `Scorer` protocol."""

    def __init__(self, client: RewardClient, *, fn: str | None, group_rm: bool) -> None:
        self.client = client
        self.fn = fn
        self.group_rm = group_rm

    async def aclose(self) -> None:
        await self.client.aclose()

    async def score(self, samples: list[Sample]) -> list[tuple[float, dict[str, Any] | None]]:
        if len(samples) == 1 and not self.group_rm:
            results = [await self.client.score(samples[0], fn=self.fn)]
        else:
            results = await self.client.score_batch(samples, fn=self.fn, group=self.group_rm)
        if len(results) != len(samples):
            raise RuntimeError(f"reward service answered {len(results)} results for {len(samples)} samples")
        return [(float(r.reward), _details(r)) for r in results]
