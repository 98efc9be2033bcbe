"""The rollout loop (seed steps 16, 27, 28): submit groups, collect them as they finish, filter,
re-sample until the batch is full, then abort what is still running.

Groups are submitted ``over_sampling_batch_size`` at a time whenever fewer than
``rollout_batch_size`` are still candidates (submitted minus dropped); finished groups are taken
with ``asyncio.wait(FIRST_COMPLETED)``; a group the dynamic filter drops frees a candidate slot,
which makes the loop fetch more prompts. Once the batch is full the leftovers are aborted and,
with ``partial_rollout``, handed back to the data source to be continued next rollout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from vime.types import Sample
from vime_rollout.filters import apply_filter
from vime_rollout.rollout.generate import generate_and_rm_group
from vime_rollout.rollout.state import GenerateState, logprobs_wanted

log = logging.getLogger("vime.rollout.loop")

MAX_DRAW_FACTOR = 64
"""A rollout that has drawn this many times its batch of groups fails instead of looping forever."""
ABORT_GRACE_S = 30.0
"""How long aborted requests may take to come back before their tasks are cancelled."""


class RolloutError(RuntimeError):
    """A rollout that could not produce its batch; the message says why."""


@dataclass
class RolloutOutput:
    """The kept groups (in the order they finished), the aborted leftovers, and timing."""

    groups: list[list[Sample]]
    aborted_groups: list[list[Sample]] = field(default_factory=list)
    wall_s: float = 0.0


def _submit(
    state: GenerateState, pendings: set[asyncio.Task[list[Sample]]], groups: list[list[Sample]]
) -> None:
    for group in groups:
        lp = None if state.evaluation else logprobs_wanted(state.cfg, group[0].group_index or 0)
        pendings.add(asyncio.create_task(generate_and_rm_group(state, group, lp)))
    state.counters.groups_submitted += len(groups)


async def generate_rollout(
    state: GenerateState,
    rollout_id: int,
    get_samples: Callable[[int], list[list[Sample]]],
    *,
    target: int,
    over_sampling: int,
    dynamic_filter: Callable[..., Any] | None = None,
    progress: bool = True,
) -> RolloutOutput:
    """Collect ``target`` groups that pass the filter (seed steps 16–28)."""
    start = time.perf_counter()
    state.counters.clock.restart()
    n = state.cfg.n_samples_per_prompt if not state.evaluation else state.cfg.data.n_samples_per_eval_prompt
    data: list[list[Sample]] = []
    pendings: set[asyncio.Task[list[Sample]]] = set()
    remaining = 0
    bar = tqdm(
        total=target * n, desc=f"rollout {rollout_id}", disable=not progress, mininterval=2.0, leave=False
    )
    try:
        while len(data) < target:
            while remaining < target:
                if state.counters.groups_submitted >= MAX_DRAW_FACTOR * target:
                    raise RolloutError(
                        f"rollout {rollout_id}: drew {state.counters.groups_submitted} groups but the dynamic "
                        f"filter dropped {state.counters.groups_dropped}; only {len(data)} of {target} kept"
                    )
                if state.admitted is not None:
                    await state.admitted()
                groups = get_samples(over_sampling)
                _submit(state, pendings, groups)
                remaining += len(groups)
            done, pendings = await asyncio.wait(pendings, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                if len(group) != n:
                    raise RolloutError(f"a group came back with {len(group)} samples instead of {n}")
                verdict = apply_filter(dynamic_filter, state.cfg, group)
                if not verdict.keep:
                    remaining -= 1
                    state.counters.groups_dropped += 1
                    reason = verdict.reason or "filtered"
                    state.counters.drop_reasons[reason] = state.counters.drop_reasons.get(reason, 0) + 1
                    continue
                if len(data) < target:
                    data.append(group)
                    bar.update(n)
                    state.counters.clock.group_done()
    except BaseException:
        state.aborted = True
        for t in pendings:
            t.cancel()
        await asyncio.gather(*pendings, return_exceptions=True)
        raise
    finally:
        bar.close()
    t_abort = time.perf_counter()
    aborted = await abort(state, pendings)
    state.counters.clock.abort_s = time.perf_counter() - t_abort
    return RolloutOutput(data, aborted, time.perf_counter() - start)


async def abort(state: GenerateState, pendings: set[asyncio.Task[list[Sample]]]) -> list[list[Sample]]:
    """Stop the leftovers (step 28): queued samples return at once, running ones are aborted."""
    state.aborted = True
    if not pendings:
        return []
    deadline = time.monotonic() + ABORT_GRACE_S
    finished: list[asyncio.Task[list[Sample]]] = []
    while pendings and time.monotonic() < deadline:
        if state.abort_engines is not None:
            try:
                await state.abort_engines()
            except Exception as exc:  # an unreachable engine must not fail a full batch
                log.warning("abort on the engines failed: %s", exc)
        done, pendings = await asyncio.wait(pendings, timeout=1.0)
        finished.extend(done)
    for t in pendings:
        t.cancel()
    await asyncio.gather(*pendings, return_exceptions=True)
    groups = []
    for t in finished:
        if t.cancelled() or t.exception() is not None:
            continue
        groups.append(t.result())
    state.counters.aborted_samples = sum(1 for g in groups for s in g if s.status.value == "aborted")
    return groups
