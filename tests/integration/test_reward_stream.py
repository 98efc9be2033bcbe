"""Streamed pool tasks and chunked batches, on real worker processes in the test's event loop.

A batch is scored in chunks (`Scorer.score_many` → `WorkerPool.run_stream`), yet every sample must
come out as it would alone: same results, its own soft timeout, its own error, a worker wedged
beyond signals killed after one sample's hard deadline, items after a dead worker's scored again.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from vime_reward.cache import ResultCache
from vime_reward.functions.remote import RemoteScorer
from vime_reward.pool import TaskResult, WorkerPool
from vime_reward.resolve import Job, Resolver
from vime_reward.scoring import RewardMetrics, Scorer

from vime.config import RewardConfig
from vime.service import Metrics
from vime.wire.reward import RewardRequest, RewardResult, RewardStatus

TIMEOUT_S = 1.0
GRACE_S = 0.5
USER_FUNCTIONS = '''
import os
import signal
import time


def picky(req):
    """What the response says: hang (in Python), wedge (beyond signals), crash, fail, a huge reply;
    else its length."""
    if req.response == "hang":
        time.sleep(3600)
    if req.response == "wedge":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    if req.response == "crash":
        os._exit(7)
    if req.response == "fail":
        raise ValueError("asked to fail")
    if req.response == "huge":
        return {"reward": 1.0, "blob": "x" * 2_000_000}
    return {"reward": float(len(req.response)), "pred": req.response, "seen": req.options.get("tag")}
'''


@pytest.fixture
def user_fn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The import path of `USER_FUNCTIONS`' ``picky``, importable by workers started afterwards."""
    name = f"reward_stream_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_FUNCTIONS))
    monkeypatch.syspath_prepend(str(tmp_path))  # a worker's sys.path is its parent's at its start
    yield f"{name}:picky"
    sys.modules.pop(name, None)


@pytest.fixture
async def pool(user_fn: str) -> AsyncIterator[WorkerPool]:
    pool = WorkerPool(2, grace_s=GRACE_S)
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
def scorer(pool: WorkerPool, user_fn: str) -> Scorer:
    cfg = RewardConfig(
        timeout_s=TIMEOUT_S, timeout_reward=-0.5, error_reward=-0.25, allowed_functions=[user_fn]
    )
    return Scorer(cfg, pool, RemoteScorer(None, TIMEOUT_S), RewardMetrics(Metrics("reward"), pool))


def _task(fn: str, responses: list[str]) -> dict[str, Any]:
    items = [{"response": r, "label": None, "options": {}} for r in responses]
    return {"kind": "score", "fn": fn, "items": items}


def _rewards(results: list[TaskResult | None]) -> list[object]:
    """Each item's reward, or its status when it has none, or None when it did not run."""
    return [
        None if r is None else r.reply["results"][0]["reward"] if r.status == "ok" else r.status
        for r in results
    ]


async def _whole(pool: WorkerPool, restarts: dict[str, int]) -> dict[str, Any]:
    """The pool's stats once it counts ``restarts`` and every worker is back (a replacement
    starts in the background), or after 10 s."""
    for _ in range(200):
        stats = pool.stats()
        if stats["restarts"] == restarts and stats["alive"] == pool.size:
            break
        await asyncio.sleep(0.05)
    return pool.stats()


async def test_stream_answers_each_item_as_a_task_of_its_own(pool: WorkerPool, user_fn: str) -> None:
    responses = ["a", "fail", "abc", "", "huge", "ab"]
    streamed = await pool.run_stream(_task(user_fn, responses), TIMEOUT_S)
    alone = [await pool.run(_task(user_fn, [r]), TIMEOUT_S) for r in responses]
    assert _rewards(streamed) == [1.0, "error", 3.0, 0.0, "error", 2.0]
    for got, want in zip(streamed, alone, strict=True):
        assert got is not None and got.status == want.status
        assert got.reply.get("results") == want.reply.get("results")
        if got.error and "bytes, over" in got.error:  # the size a reply would have had: theirs differ
            assert want.error and "bytes, over" in want.error
        else:
            assert got.error == want.error
    assert streamed[1] is not None and "ValueError: asked to fail" in (streamed[1].error or "")
    assert streamed[4] is not None and "bytes, over" in (streamed[4].error or "")
    builtin = {"kind": "score", "fn": "gsm8k", "options": {"format_score": 0.1}}
    items = [{"response": "#### 72", "label": "72"}, {"response": "#### 70", "label": "72"}]
    assert _rewards(await pool.run_stream({**builtin, "items": items}, TIMEOUT_S)) == [1.0, 0.1]
    assert pool.stats()["restarts"] == {}


async def test_a_hang_in_python_times_out_alone(pool: WorkerPool, user_fn: str) -> None:
    start = time.monotonic()
    results = await pool.run_stream(_task(user_fn, ["a", "hang", "abc", "hang", "ab"]), TIMEOUT_S)
    took = time.monotonic() - start
    assert _rewards(results) == [1.0, "timeout", 3.0, "timeout", 2.0]
    assert results[1] is not None and TIMEOUT_S <= results[1].elapsed_s < TIMEOUT_S + GRACE_S
    assert 2 * TIMEOUT_S <= took < 2 * TIMEOUT_S + 3.0  # each hang had its own timeout, no more
    assert pool.stats()["restarts"] == {}  # the soft timeout ended them: no worker lost


async def test_a_crash_costs_its_item_and_leaves_the_rest_not_run(pool: WorkerPool, user_fn: str) -> None:
    results = await pool.run_stream(_task(user_fn, ["a", "crash", "abc", "ab"]), TIMEOUT_S)
    assert _rewards(results) == [1.0, "error", None, None]
    assert results[1] is not None and "exit code 7" in (results[1].error or "")
    stats = await _whole(pool, {"crash": 1})
    assert stats["restarts"] == {"crash": 1} and stats["alive"] == 2


async def test_a_wedged_item_is_killed_after_its_own_deadline(pool: WorkerPool, user_fn: str) -> None:
    responses = ["a"] * 6 + ["wedge"] + ["ab"] * 3
    start = time.monotonic()
    results = await pool.run_stream(_task(user_fn, responses), TIMEOUT_S)
    took = time.monotonic() - start
    assert _rewards(results) == [1.0] * 6 + ["timeout", None, None, None]
    wedged = results[6]
    assert wedged is not None and TIMEOUT_S + GRACE_S <= wedged.elapsed_s < TIMEOUT_S + GRACE_S + 1.0
    # One item's deadline, not one per item of the task (10 × 1.5 s).
    assert took < TIMEOUT_S + GRACE_S + 2.0
    stats = await _whole(pool, {"timeout": 1})
    assert stats["restarts"] == {"timeout": 1} and stats["alive"] == 2


async def test_a_cancelled_stream_is_drained_and_its_worker_kept(user_fn: str) -> None:
    pool = WorkerPool(1, grace_s=GRACE_S)
    await pool.start()
    try:
        abandoned = asyncio.create_task(pool.run_stream(_task(user_fn, ["a", "hang", "abc"]), TIMEOUT_S))
        await asyncio.sleep(0.3)
        abandoned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        # The next task waits for the abandoned one's last reply, then reads only its own.
        result = await pool.run(_task(user_fn, ["abcd"]), TIMEOUT_S)
        assert _rewards([result]) == [4.0] and pool.stats()["restarts"] == {}
        wedged = asyncio.create_task(pool.run_stream(_task(user_fn, ["wedge", "a"]), TIMEOUT_S))
        await asyncio.sleep(0.3)
        wedged.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wedged
        result = await pool.run(_task(user_fn, ["ab"]), TIMEOUT_S)
        assert _rewards([result]) == [2.0] and pool.stats()["restarts"] == {"abandoned": 1}
    finally:
        await pool.close()


async def _jobs(scorer: Scorer, items: list[dict[str, Any]], fn: str | None = None) -> list[Job]:
    resolver = Resolver(scorer.cfg, scorer.pool)
    return [
        await resolver.job(RewardRequest.model_validate(item), authorized=True, batch_fn=fn) for item in items
    ]


def _same(result: RewardResult) -> dict[str, Any]:
    """What must not depend on how a sample was scored (everything but timing and caching)."""
    return result.model_dump(exclude={"elapsed_s", "cached"})


def _counting_streams(pool: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of items of each `WorkerPool.run_stream` call from now on."""
    sizes: list[int] = []
    run_stream = pool.run_stream

    async def counted(task: dict[str, Any], timeout_s: float) -> list[TaskResult | None]:
        sizes.append(len(task["items"]))
        return await run_stream(task, timeout_s)

    monkeypatch.setattr(pool, "run_stream", counted)
    return sizes


MIXED = [
    ({"response": "Paris.", "label": ["paris", "Paris, France"]}, "exact_match"),
    ({"response": "Lyon", "label": "paris"}, "exact_match"),
    ({"response": "<answer>paris", "label": "paris", "options": {"extract": "answer_tag"}}, "exact_match"),
    (
        {"response": "<answer>Paris</answer>", "label": "paris", "options": {"extract": "answer_tag"}},
        "exact_match",
    ),
    ({"response": "#### 72", "label": "72"}, "gsm8k"),
    ({"response": "#### 71", "label": "72"}, "gsm8k"),
    ({"response": "The answer is \\boxed{\\frac{1}{2}}.", "label": "0.5"}, "math"),
    ({"response": "The answer is \\boxed{3}.", "label": "0.5"}, "math"),
    ({"response": "46", "label": 46}, "arithmetic"),
    ({"response": "forty-six", "label": 46}, "arithmetic"),
]


async def test_a_chunked_batch_scores_as_single_calls(
    scorer: Scorer, user_fn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [{**item, "fn": fn} for item, fn in MIXED] * 8
    items += [{"response": "x" * i, "label": None, "fn": user_fn, "options": {"tag": i}} for i in range(6)]
    items.append({"response": "fail", "label": None, "fn": user_fn})
    items += [{**item, "fn": fn, "sample_id": f"s{i}"} for i, (item, fn) in enumerate(MIXED * 8)]
    jobs = await _jobs(scorer, items)
    sizes = _counting_streams(scorer.pool, monkeypatch)
    chunked = await scorer.score_many(jobs, group=False)
    assert sizes and max(sizes) > 1, "the batch was not scored in chunks"
    assert sum(sizes) > len(items) / 2  # chunks of one (a kind's last few) run as plain tasks
    samples = scorer.metrics.samples.collect()[0].samples
    assert sum(s.value for s in samples if s.name.endswith("_total")) == len(items)  # one each
    assert [r.reward for r in chunked[:10]] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    user = chunked[80:87]
    assert [r.reward for r in user[:6]] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r.details for r in user[:6]] == [{"seen": i} for i in range(6)]
    assert user[6].status == RewardStatus.ERROR and "asked to fail" in (user[6].error or "")
    # The samples with ids were kept: asked again, they come from the cache, unchanged.
    again = await scorer.score_many(jobs, group=False)
    assert [r.cached for r in again] == [False] * 87 + [True] * 80 and not any(r.cached for r in chunked)
    assert [_same(r) for r in again] == [_same(r) for r in chunked]
    scorer.cache = ResultCache()
    alone = [await scorer.score(job) for job in jobs]
    assert [_same(r) for r in chunked] == [_same(r) for r in alone]


async def test_one_bad_sample_in_a_chunk_touches_no_other(
    scorer: Scorer, user_fn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    responses = ["a", "hang", "abc", "crash", "ab", "wedge", "abcd", "", "abcde", "x" * 9, "fail", "xyz"] * 2
    jobs = await _jobs(scorer, [{"response": r, "label": None} for r in responses], fn=user_fn)
    sizes = _counting_streams(scorer.pool, monkeypatch)
    start = time.monotonic()
    results = await scorer.score_many(jobs, group=False)
    took = time.monotonic() - start
    assert sizes and max(sizes) > 1
    for response, result in zip(responses, results, strict=True):
        if response in ("hang", "wedge"):
            assert (result.status, result.reward, result.timed_out) == (RewardStatus.TIMEOUT, -0.5, True)
        elif response == "crash":
            assert result.status == RewardStatus.ERROR and "exit code 7" in (result.error or "")
        elif response == "fail":
            assert result.status == RewardStatus.ERROR and "asked to fail" in (result.error or "")
        else:
            assert (result.status, result.reward, result.pred) == (RewardStatus.OK, len(response), response)
    # Four samples stuck for a timeout each, on two workers, and the reruns after two crashes.
    assert took < 6 * (TIMEOUT_S + GRACE_S)
    stats = await _whole(scorer.pool, {"crash": 2, "timeout": 2})
    assert stats["restarts"] == {"crash": 2, "timeout": 2} and stats["alive"] == 2
