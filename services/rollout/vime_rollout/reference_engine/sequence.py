"""One generate request and its choices (sequences), with vLLM's stop rules.

A request with ``n`` choices holds ``n`` sequences, each sampled independently (seed + index when
seeded, as vLLM's parallel sampling does). After every token, `Sequence.append` applies vLLM
0.26's ``check_stop`` order: nothing stops before ``min_tokens``; then EOS (unless
``ignore_eos``), then ``stop_token_ids`` (the stop token stays in the output, as in vLLM), then
the length caps (``max_tokens``, ``max_model_len``); stop strings are matched on the decoded text
afterwards, as vLLM's detokenizer does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .protocol import SamplingParams
from .sampler import RowSpec

Decoder = Callable[[list[int], bool], str]


@dataclass
class Sequence:
    """One choice of a request: its tokens so far and how far its KV cache is computed."""

    request: Request
    index: int
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    computed: int = 0
    """Tokens whose keys/values are in the sequence's cache slot (0 = needs a (re)prefill)."""

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def row_spec(self, eos_ids: set[int]) -> RowSpec:
        p = self.params
        banned: tuple[int, ...] = ()
        if len(self.output) < p.min_tokens:
            stops = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stops |= eos_ids
            banned = tuple(sorted(stops))
        return RowSpec(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            greedy=p.greedy,
            generator=self.generator,
            num_logprobs=p.logprobs,
            banned=banned,
        )

    def append(
        self,
        token: int,
        logprob: float,
        top: list[tuple[int, float]] | None,
        version: str | None,
        eos_ids: set[int],
        max_model_len: int,
        decode: Decoder | None,
    ) -> None:
        """Record a sampled token and finish the sequence if a stop rule fires."""
        self.output.append(token)
        self.logprobs.append(logprob)
        self.top.append(top)
        self.versions.append(version)
        self.computed = len(self.tokens) - 1
        p = self.params
        at_limit = len(self.tokens) >= max_model_len
        if len(self.output) < p.min_tokens:
            if at_limit:  # no room left in the context: stop anyway
                self.finish("length")
            return
        if not p.ignore_eos and token in eos_ids:
            self.finish("stop")
        elif token in (p.stop_token_ids or ()):
            self.finish("stop", token)
        elif at_limit or len(self.output) >= self.request.max_tokens:
            self.finish("length")
        elif p.stop and decode is not None and len(self.output) > p.min_tokens:
            hit = self._stop_string(p.stop, p.skip_special_tokens, p.min_tokens, decode)
            if hit is not None:
                self.finish("stop", hit)

    def _stop_string(
        self, stops: list[str], skip_special: bool, min_tokens: int, decode: Decoder
    ) -> str | None:
        """A stop string ending in the newest token (vLLM checks only text after ``min_tokens`` tokens).

        Any earlier occurrence would have stopped the sequence already, so decoding a tail a few
        tokens longer than the longest stop string finds every new match in O(1) per step.
        """
        window = max(len(s) for s in stops) + 4
        text = decode(self.output[max(min_tokens, len(self.output) - window) :], skip_special)
        return next((s for s in stops if s in text), None)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason
            self.request.on_sequence_finished()


@dataclass
class Request:
    """A generate request: ``n`` sequences and a future resolved when all of them finished."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    future: asyncio.Future[None]
    sequences: list[Sequence] = field(default_factory=list)

    @classmethod
    def create(cls, request_id: str, prompt: list[int], params: SamplingParams, max_tokens: int) -> Request:
        req = cls(request_id, list(prompt), params, max_tokens, asyncio.get_running_loop().create_future())
        for i in range(params.n):
            seed = params.child_seed(i)
            gen = None if seed is None else torch.Generator().manual_seed(seed)
            req.sequences.append(Sequence(req, i, gen))
        return req

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def on_sequence_finished(self) -> None:
        if self.finished and not self.future.done():
            self.future.set_result(None)

    def abort(self) -> None:
        for s in self.sequences:
            s.finish("abort")
