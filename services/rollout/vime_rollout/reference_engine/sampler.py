"""Batched sampling with vLLM's semantics: raw log-probs, then temperature, top-k, top-p, min-p.

The log-probs reported follow vLLM's ``--logprobs-mode`` (a server-wide setting, vLLM 0.26's
``Sampler``): ``raw_logprobs`` (vLLM's default) is the log-softmax of the model's logits before
min-tokens masking, temperature, top-k/top-p/min-p; ``processed_logprobs`` is the log-softmax of
what is sampled from — masked logits / T with top-k/top-p/min-p applied (entries outside them are
-inf, reported as the -9999 floor) — the distribution the trainer's log-probs (logits / T) are
compared with. A greedy row's processed log-probs are of the masked logits at T = 1, as in vLLM's
all-greedy path (vLLM gives a greedy row batched with sampled ones top-k/top-p at T = 1 as well;
here a row's numbers never depend on its batch). Sampling draws one exponential variate per vocabulary entry and
takes ``argmax(p / q)`` (vLLM's trick, equivalent to sampling from ``p``); a request with a seed
draws its variates from its own generator, so its tokens do not depend on what else is batched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
"""vLLM's ``--logprobs-mode`` values the reference engine serves (the ``*_logits`` ones it does not)."""

LOGPROB_FLOOR = -9999.0
"""vLLM clamps reported log-probs to this value (and writes it when a token has none)."""


@dataclass
class RowSpec:
    """How to sample one row of the batch."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    greedy: bool
    generator: torch.Generator | None
    num_logprobs: int | None
    banned: tuple[int, ...] = ()


@dataclass
class RowResult:
    token: int
    logprob: float
    top: list[tuple[int, float]] | None


def _filter(logits: torch.Tensor, specs: list[RowSpec]) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p / min-p applied (masked entries are -inf)."""
    temps = torch.tensor([max(s.temperature, 1e-5) for s in specs], dtype=logits.dtype).unsqueeze(1)
    scaled = logits / temps
    if all(s.top_k <= 0 and s.top_p >= 1.0 and s.min_p <= 0.0 for s in specs):
        return scaled
    vocab = scaled.shape[1]
    sorted_logits, order = scaled.sort(dim=1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    ks = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs]).unsqueeze(1)
    drop = ranks >= ks
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
    top_p = torch.tensor([s.top_p for s in specs], dtype=probs.dtype).unsqueeze(1)
    drop |= (probs.cumsum(dim=1) - probs) > top_p
    min_p = torch.tensor([s.min_p for s in specs], dtype=probs.dtype).unsqueeze(1)
    drop |= probs < probs[:, :1] * min_p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)


def _noise(specs: list[RowSpec], vocab: int, shared: torch.Generator) -> torch.Tensor:
    q = torch.empty(len(specs), vocab)
    unseeded = [i for i, s in enumerate(specs) if s.generator is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), vocab).exponential_(generator=shared)
    for i, s in enumerate(specs):
        if s.generator is not None:
            q[i].exponential_(generator=s.generator)
    return q


def _top(lp: torch.Tensor, token: int, k: int, ranked: torch.Tensor) -> list[tuple[int, float]]:
    """vLLM's per-position entries: the sampled token first, then the top ranks, max(k, 1) of them."""
    entries = {token: float(lp[token])}
    for t in ranked.tolist():
        entries.setdefault(int(t), float(lp[t]))
    return [(t, max(lp, LOGPROB_FLOOR)) for t, lp in list(entries.items())[: max(k, 1)]]


@torch.inference_mode()
def sample(
    logits: torch.Tensor, specs: list[RowSpec], shared: torch.Generator, processed: bool = False
) -> list[RowResult]:
    """One token per row of ``logits [B, V]`` with its log-prob and top entries: raw, or after
    masking, temperature and top-k/top-p/min-p when ``processed`` (vLLM's ``processed_logprobs``)."""
    logits = torch.nan_to_num(logits.float(), nan=0.0, posinf=1e4, neginf=-1e4)
    work = logits.clone()
    for i, s in enumerate(specs):
        if s.banned:
            work[i, list(s.banned)] = float("-inf")
    tokens = work.argmax(dim=1)
    reported = (work if processed else logits).log_softmax(dim=1)
    sampled_rows = [i for i, s in enumerate(specs) if not s.greedy]
    if sampled_rows:
        sub = [specs[i] for i in sampled_rows]
        filtered = _filter(work[sampled_rows], sub)
        probs = filtered.softmax(dim=1)
        q = _noise(sub, probs.shape[1], shared)
        tokens[sampled_rows] = (probs / q).argmax(dim=1)
        if processed:
            reported[sampled_rows] = filtered.log_softmax(dim=1)
    want = max((s.num_logprobs or 0) for s in specs)
    ranked = reported.topk(min(want + 1, reported.shape[1]), dim=1).indices if want > 0 else None
    results = []
    for i, s in enumerate(specs):
        token = int(tokens[i])
        top = None
        if s.num_logprobs is not None:
            top = _top(reported[i], token, s.num_logprobs, ranked[i] if ranked is not None else tokens[:0])
        results.append(RowResult(token, max(float(reported[i, token]), LOGPROB_FLOOR), top))
    return results
