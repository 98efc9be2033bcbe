"""The reward service's parts without processes: outcomes, user functions, tasks, cache, resolution."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
from pathlib import Path

import pytest
from vime_reward.cache import ResultCache, fingerprint
from vime_reward.functions import BUILTINS
from vime_reward.functions.base import Outcome, as_outcome, utf8_safe
from vime_reward.functions.remote import RemoteFailed, RemoteTimeout, _reply_outcome
from vime_reward.functions.user import describe, is_import_path, load
from vime_reward.pool import TaskResult, WorkerPool
from vime_reward.resolve import Resolver
from vime_reward.scoring import CHUNK_ITEMS, chunk_sizes
from vime_reward.worker import run_stream, run_task

from vime.config import RewardConfig
from vime.service import ServiceError
from vime.wire.reward import RewardRequest, RewardResult, RewardStatus

USER_MODULE = """
import asyncio

def half(req):
    '''Half a point for anything.'''
    return 0.5

async def length(req):
    await asyncio.sleep(0)
    return {"score": float(len(req.response)), "pred": req.response, "note": "async"}

def per_item(reqs):
    return [float(i) for i, _ in enumerate(reqs)]

def short_group(reqs):
    return [1.0]

def raises(req):
    raise RuntimeError("boom")

def exits(req):
    raise SystemExit(3)

def nan(req):
    return float("nan")

def weird_details(req):
    return {"reward": 1.0, "ratio": float("inf")}

not_callable = 42
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"reward_user_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_as_outcome_accepts_numbers_bools_and_dicts() -> None:
    assert as_outcome(1).reward == 1.0
    assert as_outcome(True).reward == 1.0 and as_outcome(False).reward == 0.0
    out = as_outcome({"score": -1, "pred": 7, "acc": False})
    assert (out.reward, out.pred, out.details) == (-1.0, "7", {"acc": False})
    assert as_outcome({"reward": 0.25, "score": 9}).reward == 0.25
    kept = Outcome(0.5)
    assert as_outcome(kept) is kept


@pytest.mark.parametrize("bad", ["1.0", None, [1.0], {"value": 1}, math.nan, math.inf])
def test_as_outcome_refuses_what_is_not_a_reward(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        as_outcome(bad)


def test_import_paths(user_module: str) -> None:
    assert is_import_path("pkg.mod:fn") and is_import_path("mod:Cls.method")
    for bad in ["math", "pkg.mod", "pkg.mod:", ":fn", "a b:c", "mod:fn()"]:
        assert not is_import_path(bad), bad
    assert describe(f"{user_module}:half") == {"is_async": False, "doc": "Half a point for anything."}
    assert describe(f"{user_module}:length")["is_async"] is True
    with pytest.raises(TypeError):
        load(f"{user_module}:not_callable")
    with pytest.raises(ModuleNotFoundError):
        load("no_such_module_here:fn")
    with pytest.raises(AttributeError):
        load(f"{user_module}:missing")


def _score(fn: str, items: list[dict], **extra: object) -> dict:
    return run_task({"kind": "score", "fn": fn, "items": items, **extra})


def test_run_task_builtin_with_options() -> None:
    reply = _score("gsm8k", [{"response": "#### 70", "label": "72"}], options={"format_score": 0.1})
    assert reply == {"ok": True, "results": [{"reward": 0.1, "pred": "70", "details": {"acc": False}}]}


def test_run_task_user_functions(user_module: str) -> None:
    item = {"response": "abcd", "label": None}
    assert _score(f"{user_module}:half", [item])["results"][0]["reward"] == 0.5
    out = _score(f"{user_module}:length", [item])["results"][0]
    assert out == {"reward": 4.0, "pred": "abcd", "details": {"note": "async"}}
    group = _score(f"{user_module}:per_item", [item, item, item], group=True)
    assert [r["reward"] for r in group["results"]] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    ("fn", "group", "message"),
    [
        ("raises", False, "RuntimeError: boom"),
        ("exits", False, "SystemExit: 3"),
        ("nan", False, "non-finite"),
        ("short_group", True, "returned 1"),
    ],
)
def test_run_task_failures_become_error_replies(user_module: str, fn: str, group: bool, message: str) -> None:
    reply = _score(f"{user_module}:{fn}", [{"response": "x", "label": 1}] * 2, group=group)
    assert reply["ok"] is False and message in reply["error"]


def test_run_stream_answers_each_item_as_a_task_of_its_own(user_module: str) -> None:
    items = [
        {"response": "ab", "label": None},
        {"response_token_ids": [1], "label": None},  # len(None) fails: this item only
        {"response": "abcd", "label": None},
    ]
    task = {"kind": "stream", "fn": f"{user_module}:length", "items": items}
    replies = list(run_stream(task))
    assert [r["index"] for r in replies] == [0, 1, 2]
    assert all(isinstance(r["elapsed_s"], float) for r in replies)
    alone = [_score(f"{user_module}:length", [item]) for item in items]
    assert [{k: v for k, v in r.items() if k not in ("index", "elapsed_s")} for r in replies] == alone
    assert [r["ok"] for r in replies] == [True, False, True] and "TypeError" in replies[1]["error"]
    gsm8k = {"kind": "stream", "fn": "gsm8k", "options": {"format_score": 0.1}}
    graded = run_stream({**gsm8k, "items": [{"response": f"#### {n}", "label": "72"} for n in (72, 70)]})
    assert [r["results"][0]["reward"] for r in graded] == [1.0, 0.1]


def test_run_task_keeps_unserialisable_details_readable(user_module: str) -> None:
    out = _score(f"{user_module}:weird_details", [{"response": "x", "label": 1}])["results"][0]
    assert out["reward"] == 1.0 and "inf" in out["details"]["unserializable"]


def test_remote_reply_shapes() -> None:
    assert _reply_outcome(0.75, None).reward == 0.75
    assert _reply_outcome({"reward": 1, "pred": "x", "details": {"a": 1}}, None).details == {"a": 1}
    assert _reply_outcome({"score": 2.0, "acc": True}, None).reward == 2.0
    assert _reply_outcome({"rm": 3.0}, "rm").reward == 3.0
    with pytest.raises(RemoteTimeout):
        _reply_outcome({"reward": 0.0, "status": "timeout"}, None)
    with pytest.raises(RemoteFailed):
        _reply_outcome({"reward": 0.0, "status": "error", "error": "x"}, None)
    for bad in ["nope", {"value": 1}, [1]]:
        with pytest.raises(RemoteFailed):
            _reply_outcome(bad, None)


def _result(reward: float, status: RewardStatus = RewardStatus.OK) -> RewardResult:
    return RewardResult(reward=reward, fn="math", status=status)


async def test_cache_answers_repeats_and_joins_running_duplicates() -> None:
    cache = ResultCache(capacity=2)
    calls = 0

    async def compute() -> RewardResult:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return _result(1.0)

    first, second = await asyncio.gather(cache.once("s1", "d", compute), cache.once("s1", "d", compute))
    assert calls == 1 and first == (_result(1.0), False) and second == (_result(1.0), True)
    assert await cache.once("s1", "d", compute) == (_result(1.0), True)
    # Same id, different request: scored afresh.
    await cache.once("s1", "other", compute)
    assert calls == 2
    # LRU: a third key pushes out the oldest.
    await cache.once("s2", "d", compute)
    await cache.once("s3", "d", compute)
    assert cache.get("s1", "other") is None and cache.get("s3", "d") is not None


async def test_cache_begin_starts_only_what_it_has_not_seen() -> None:
    cache = ResultCache()
    loop = asyncio.get_running_loop()
    slot: asyncio.Future[RewardResult] = loop.create_future()
    first, repeated = cache.begin("s", "d", lambda: slot)
    joined, joined_repeated = cache.begin(
        "s", "d", lambda: pytest.fail("a running request was started again")
    )
    assert (repeated, joined_repeated) == (False, True) and not first.done()
    slot.set_result(_result(1.0))
    assert await first == await joined == _result(1.0)
    kept, kept_repeated = cache.begin("s", "d", lambda: pytest.fail("a kept answer was computed again"))
    assert kept_repeated and kept.done() and kept.result() == _result(1.0)


async def test_cache_keeps_no_errors() -> None:
    cache = ResultCache()

    async def failing() -> RewardResult:
        return _result(0.0, RewardStatus.ERROR)

    await cache.once("e", "d", failing)
    assert cache.get("e", "d") is None
    cache.put("t", "d", _result(0.0, RewardStatus.TIMEOUT))
    assert cache.get("t", "d") is not None


@pytest.mark.parametrize(("count", "workers"), [(256, 2), (256, 16), (10, 2), (1, 4), (1000, 1)])
def test_chunks_shrink_as_the_work_left_does(count: int, workers: int) -> None:
    sizes = chunk_sizes(count, workers)
    assert sum(sizes) == count and sizes == sorted(sizes, reverse=True)
    assert sizes[0] <= CHUNK_ITEMS and sizes[-1] == 1
    assert len(sizes) >= min(count, 2 * workers)  # every worker gets work, twice over


def test_fingerprint_covers_what_decides_the_answer() -> None:
    base = RewardRequest(response="\\boxed{1}", label="1")
    same = fingerprint("math", {}, base)
    assert same == fingerprint("math", {}, base.model_copy(update={"metadata": {"x": 1}}))
    assert same != fingerprint("math", {}, base.model_copy(update={"label": "2"}))
    assert same != fingerprint("math", {}, base.model_copy(update={"response": "\\boxed{2}"}))
    assert same != fingerprint("dapo", {}, base)
    assert same != fingerprint("math", {"strict": False}, base)


@pytest.fixture
def resolver() -> Resolver:
    # The pool is never started: built-in names resolve without it.
    return Resolver(RewardConfig(rm_type="gsm8k"), WorkerPool(1))


async def test_resolver_picks_the_function_in_slimes_order(resolver: Resolver) -> None:
    req = RewardRequest(response="#### 1", label="1")
    assert resolver.choose(req) == "gsm8k"
    assert resolver.choose(req.model_copy(update={"metadata": {"rm_type": "arithmetic"}})) == "arithmetic"
    assert resolver.choose(req, batch_fn="f1") == "f1"
    assert resolver.choose(req.model_copy(update={"fn": "dapo"}), batch_fn="f1") == "dapo"
    job = await resolver.job(req, authorized=False)
    assert job.target.builtin is BUILTINS["gsm8k"] and job.options["method"] == "strict"


async def test_resolver_refuses_what_cannot_be_scored(resolver: Resolver) -> None:
    async def status(where: str = "", **fields: object) -> tuple[int, str]:
        req = RewardRequest.model_validate({"response": "x", "label": "1", **fields})
        with pytest.raises(ServiceError) as err:
            await resolver.job(req, authorized=False, where=where)
        return err.value.status_code, err.value.message

    code, msg = await status(fn="mathh")
    assert code == 400 and "'mathh'" in msg and "gsm8k" in msg and "exact_match" in msg
    code, msg = await status("items.3.", fn="math", label=None)
    assert code == 422 and msg.startswith("items.3.label")
    code, msg = await status(fn="gsm8k", options={"method": "loose"})
    assert code == 422 and "options.method" in msg
    code, msg = await status(fn="gsm8k", options={"nope": 1})
    assert code == 422 and "options.nope" in msg
    code, msg = await status(fn="arithmetic", label="twelve")
    assert code == 422 and "integer label" in msg
    code, msg = await status(fn="pkg.mod:fn")
    assert code == 403 and msg.startswith("fn: reward function 'pkg.mod:fn' is not allowed")
    code, _ = await status(fn="remote", options={"url": "http://elsewhere:1/x"})
    assert code == 401
    tokens_only = RewardRequest(response_token_ids=[1, 2], label="1", fn="math")
    with pytest.raises(ServiceError) as err:
        await resolver.job(tokens_only, authorized=True)
    assert err.value.status_code == 422 and "response text" in err.value.message


class RecordingPool:
    """Stands in for the worker pool: records every task (a user function is imported by one)."""

    def __init__(self) -> None:
        self.tasks: list[dict[str, object]] = []

    async def run(self, task: dict[str, object], timeout_s: float) -> TaskResult:
        self.tasks.append(task)
        return TaskResult("ok", {"value": {"is_async": False}}, None, 0.0)


async def test_only_functions_configured_at_start_are_imported() -> None:
    cfg = RewardConfig(rm_type="pkg.default:score", custom_rm_path=None, allowed_functions=["pkg.extra:fn"])
    pool = RecordingPool()
    resolver = Resolver(cfg, pool)  # type: ignore[arg-type]
    assert resolver.allowed == {"pkg.default:score", "pkg.extra:fn"}
    for fn in ("os:getcwd", "pkg.extra:other", "builtins:eval"):
        with pytest.raises(ServiceError) as err:
            await resolver.job(RewardRequest(response="x", label="1", fn=fn), authorized=True)
        assert err.value.status_code == 403 and err.value.message.startswith(f"fn: reward function {fn!r}")
        assert err.value.details["allowed"] == ["pkg.default:score", "pkg.extra:fn"]
    assert pool.tasks == []  # nothing refused reached a worker, so nothing was imported
    await resolver.job(RewardRequest(response="x", label="1", fn="pkg.extra:fn"), authorized=True)
    await resolver.job(RewardRequest(response="x", label="1"), authorized=False)  # the configured default
    assert [t["fn"] for t in pool.tasks] == ["pkg.extra:fn", "pkg.default:score"]
    with pytest.raises(ServiceError) as err:  # an allowed one that is not the default needs the token
        await resolver.job(RewardRequest(response="x", label="1", fn="pkg.extra:fn"), authorized=False)
    assert err.value.status_code == 401


def test_utf8_safe_replaces_lone_surrogates_only() -> None:
    assert utf8_safe("héllo ∑") == "héllo ∑"
    cleaned = utf8_safe({"pred": "a\ud800b", "list": ["\udfff"], "n": 1})
    assert cleaned == {"pred": "a?b", "list": ["?"], "n": 1}
    assert utf8_safe(None) is None
