"""The reward service as a real process on a free port, called over HTTP (seed step 26).

Every reward function on right, wrong and malformed answers; a batch of 256; a group; a hanging
user function timing out while other requests are served; a worker wedged beyond signals; a
worker that dies (``os._exit``); crafted inputs; bad requests; idempotent retries; remote scoring.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vime_reward.pool import WorkerPool

from vime import procs
from vime.clients.reward import RewardClient
from vime.retry import poll_until_blocking
from vime.types import Sample
from vime.wire.reward import RewardResult, RewardStatus

TIMEOUT_S = 3.0
TIMEOUT_REWARD = -0.5
ERROR_REWARD = -0.25
MAX_BODY = 4 * 1024 * 1024
TOKEN = "reward-test-token"
USER_MODULE = "vime_reward_test_user_fns"
ALLOWED = [
    f"{USER_MODULE}:{fn}"
    for fn in ("hang", "wedge", "crash", "async_len", "group_rank", "counted", "token_sum", "picky")
]
"""The user functions the service is started with (``reward.allowed_functions``)."""

USER_FUNCTIONS = '''
import asyncio
import os
import signal
import time


def hang(req):
    """Never returns on its own (sleeps in Python: the worker's soft timeout ends it)."""
    time.sleep(3600)
    return 1.0


def wedge(req):
    """Stuck where no signal reaches it, as C code is: only a kill ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(3600)
    return 1.0


def crash(req):
    os._exit(7)


async def async_len(req):
    await asyncio.sleep(0.01)
    return {"reward": float(len(req.response or "")), "pred": req.response}


def group_rank(reqs):
    """Rank of each response's length within its group (a reward only a whole group can give)."""
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].response))
    return [float(order.index(i)) for i in range(len(reqs))]


def counted(req):
    with open(req.options["path"], "a") as f:
        f.write("call\\n")
    return 1.0


def token_sum(req):
    return float(sum(req.response_token_ids or []))


def picky(req):
    """Hangs, wedges or crashes when the response says so; else the response's length."""
    if req.response in ("hang", "wedge", "crash"):
        globals()[req.response](req)
    return {"reward": float(len(req.response)), "pred": req.response}

'''
FORBIDDEN_MODULE = "vime_reward_test_forbidden"
"""Importable by the service, never allowed: importing it leaves a file behind."""
FORBIDDEN_FUNCTIONS = """
import os

open(os.environ["VIME_TEST_IMPORT_MARK"], "a").close()


def anything(req):
    return 1.0
"""

NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.fixture(scope="module")
def service_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The service's importable modules: the test's user functions, and one it may import but must
    not (importing it creates ``imported.mark`` here)."""
    root = tmp_path_factory.mktemp("reward")
    (root / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_FUNCTIONS))
    (root / f"{FORBIDDEN_MODULE}.py").write_text(textwrap.dedent(FORBIDDEN_FUNCTIONS))
    return root


@pytest.fixture(scope="module")
def service(service_root: Path) -> Iterator[str]:
    """The reward service on a free port, the test's user functions allowed (`ALLOWED`)."""
    root = service_root
    port = procs.free_port()
    overrides = {
        "reward.timeout_s": TIMEOUT_S,
        "reward.timeout_reward": TIMEOUT_REWARD,
        "reward.error_reward": ERROR_REWARD,
        "reward.num_workers": 2,
        "reward.max_body_bytes": MAX_BODY,
        "reward.allowed_functions": json.dumps(ALLOWED),
    }
    argv = procs.python_module("vime_reward", "--port", str(port))
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    pythonpath = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "PYTHONPATH": pythonpath,
        "VIME_API_TOKEN": TOKEN,
        "VIME_TEST_IMPORT_MARK": str(root / "imported.mark"),
    }
    child = procs.start("reward", argv, log_path=root / "reward.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(url, child, timeout_s=60)
        yield url
    finally:
        child.stop()


def client(url: str, **kwargs: object) -> RewardClient:
    return RewardClient(url, token=TOKEN, **kwargs)  # type: ignore[arg-type]


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one Prometheus series (0.0 when it does not exist yet)."""
    text = httpx.get(f"{url}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(f"{name}{{{want}}}" if labels else name) + r" ([0-9.e+-]+)"
    found = re.search(r"^" + pattern + "$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_pool_whole(url: str, timeout_s: float = 20.0) -> dict:
    """/health's pool once every worker is back (a replacement starts in the background)."""

    def whole() -> dict | None:
        pool = httpx.get(f"{url}/health").json()["pool"]
        return pool if pool["alive"] == pool["workers"] else None

    with contextlib.suppress(TimeoutError):
        return poll_until_blocking(whole, timeout_s=timeout_s, interval_s=0.1, what="the pool whole")
    return dict(httpx.get(f"{url}/health").json()["pool"])


# (fn, response, label, options, expected reward)
CASES = [
    ("math", "The probability is $\\boxed{\\frac{1}{2}}$.", "0.5", {}, 1.0),
    ("math", "The probability is $\\boxed{\\frac{1}{3}}$.", "0.5", {}, 0.0),
    ("math", "The probability is $\\boxed{\\frac{1}{2}", "0.5", {}, 0.0),
    ("deepscaler", "<think>try 3</think> so \\boxed{4}", "4", {}, 1.0),
    ("deepscaler", "<think>try 4</think> so \\boxed{3}", "4", {}, 0.0),
    ("deepscaler", "so \\boxed{4}", "4", {}, 0.0),
    ("dapo", "12 + 22 = 34.\nAnswer: 34", "34", {}, 1.0),
    ("dapo", "12 + 22 = 35.\nAnswer: 35", "34", {}, -1.0),
    ("dapo", "it is thirty-four", "34", {}, -1.0),
    ("gsm8k", NATALIA, "72", {}, 1.0),
    ("gsm8k", NATALIA.replace("#### 72", "#### 71"), "72", {}, 0.0),
    ("gsm8k", "seventy-two clips", "72", {}, 0.0),
    ("exact_match", "Paris.", ["paris", "Paris, France"], {}, 1.0),
    ("exact_match", "Lyon", "paris", {}, 0.0),
    ("exact_match", "<answer>paris", "paris", {"extract": "answer_tag"}, 0.0),
    ("f1", "Denver Broncos", "Denver Broncos", {}, 1.0),
    ("f1", "the Broncos", "Denver Broncos", {}, 2 / 3),
    ("f1", "", "Denver Broncos", {}, 0.0),
    ("arithmetic", "46", 46, {}, 1.0),
    ("arithmetic", "45", "46", {}, 0.0),
    ("arithmetic", "forty-six", 46, {}, 0.0),
    (f"{USER_MODULE}:async_len", "abcd", None, {}, 4.0),
]


@pytest.mark.parametrize(("fn", "response", "label", "options", "reward"), CASES)
async def test_every_function_over_http(
    service: str, fn: str, response: str, label: object, options: dict, reward: float
) -> None:
    async with client(service) as c:
        result = await c.score({"response": response, "label": label, "fn": fn, "options": options})
    assert result.status == RewardStatus.OK, result
    assert result.fn == fn and result.reward == pytest.approx(reward)


@pytest.mark.parametrize(
    ("response", "reward"),
    [("so \\boxed{\\frac{1}{2}}", 1.0), ("so \\boxed{3}", 0.0), ("so \\boxed{\\frac{1}{2}", 0.0)],
)
async def test_remote_forwards_to_another_reward_server(service: str, response: str, reward: float) -> None:
    # The remote server here is this same service: the forwarded body names no function, so
    # it scores with its default (math).
    opts = {"url": f"{service}/v1/reward", "timeout_s": 10}
    async with client(service) as c:
        result = await c.score({"response": response, "label": "0.5", "fn": "remote", "options": opts})
    assert (result.status, result.fn, result.reward) == (RewardStatus.OK, "remote", reward)


async def test_remote_failures_are_handled(service: str) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections into the backlog, never answers
    try:
        async with client(service) as c:
            timed = await c.score(
                {
                    "response": "x",
                    "label": None,
                    "fn": "remote",
                    "options": {"url": f"http://127.0.0.1:{silent.getsockname()[1]}/", "timeout_s": 0.5},
                }
            )
            dead_port = procs.free_port()
            dead = await c.score(
                {
                    "response": "x",
                    "label": None,
                    "fn": "remote",
                    "options": {"url": f"http://127.0.0.1:{dead_port}/", "retries": 1},
                }
            )
            wrong_path = await c.score(
                {"response": "x", "label": "1", "fn": "remote", "options": {"url": f"{service}/nope"}}
            )
    finally:
        silent.close()
    assert (timed.status, timed.timed_out, timed.reward) == (RewardStatus.TIMEOUT, True, TIMEOUT_REWARD)
    assert dead.status == RewardStatus.ERROR and dead.reward == ERROR_REWARD
    assert "after 2 attempt" in (dead.error or "")
    assert wrong_path.status == RewardStatus.ERROR and "404" in (wrong_path.error or "")


async def test_a_remote_loop_ends_with_an_error_not_a_flood(tmp_path: Path) -> None:
    """A service whose default is ``remote`` pointing at itself: each forward carries the hop
    count, and the fifth arrival refuses instead of forwarding again."""
    port = procs.free_port()
    argv = procs.python_module("vime_reward", "--port", str(port))
    argv += [
        "--set",
        "reward.rm_type=remote",
        "--set",
        f"reward.remote_url=http://127.0.0.1:{port}/v1/reward",
    ]
    argv += ["--set", "reward.timeout_s=20", "--set", "reward.num_workers=1"]
    child = procs.start("reward-loop", argv, log_path=tmp_path / "loop.log", env={"VIME_API_TOKEN": TOKEN})
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(url, child, timeout_s=60)
        start = time.monotonic()
        async with client(url) as c:
            result = await c.score({"response": "x", "label": "1"})
        elapsed = time.monotonic() - start
        forwarded = httpx.post(
            f"{url}/v1/reward", json={"response": "x", "label": "1"}, headers={"X-Vime-Reward-Hops": "4"}
        )
    finally:
        child.stop()
    assert result.status == RewardStatus.ERROR and result.fn == "remote"
    assert "already came through 4 reward services" in (result.error or "")
    assert elapsed < 10  # five local hops, not a wait for the 20 s timeout
    assert forwarded.status_code == 200 and "came through 4" in forwarded.json()["error"]


async def test_batch_of_256_in_order(service: str) -> None:
    items = [
        {
            "response": f"The answer is \\boxed{{{i if i % 3 else i + 1}}}.",
            "label": str(i),
            "sample_id": f"b{i}",
        }
        for i in range(256)
    ]
    async with client(service) as c:
        results = await c.score_batch(items, fn="math")
        again = await c.score_batch(items, fn="math")
    assert len(results) == 256
    assert [r.reward for r in results] == [1.0 if i % 3 else 0.0 for i in range(256)]
    assert [r.sample_id for r in results] == [f"b{i}" for i in range(256)]
    assert all(r.status == RewardStatus.OK and not r.cached for r in results)
    assert [r.reward for r in again] == [r.reward for r in results] and all(r.cached for r in again)


async def test_group_call_gets_the_whole_group(service: str) -> None:
    responses = ["ccc", "a", "dddd", "bb"]
    async with client(service) as c:
        results = await c.score_batch(
            [{"response": r, "label": None} for r in responses], fn=f"{USER_MODULE}:group_rank", group=True
        )
    assert [r.reward for r in results] == [2.0, 0.0, 3.0, 1.0]


async def test_seed_step_26_group_of_eight(service: str) -> None:
    # Seed step 26: group 0's eight samples of one prompt, scored in one batched call (--group-rm),
    # give rewards [1, 0, 0, 1, 1, 0, 1, 0]. The samples are rollout Samples; their metadata picks
    # the synthetic task's verifier (the service's default is math).
    answers = ["46", "45", "47", "46 because 12+34=46", "46", "4 6", "46", "forty-six"]
    samples = [
        Sample(
            prompt="12+34=", label=46, response=a, group_index=0, index=i, metadata={"rm_type": "arithmetic"}
        )
        for i, a in enumerate(answers)
    ]
    async with client(service) as c:
        grouped = await c.score_batch(samples, group=True)
        one_by_one = [await c.score(s) for s in samples]
    assert [r.reward for r in grouped] == [1, 0, 0, 1, 1, 0, 1, 0]
    assert [r.reward for r in one_by_one] == [1, 0, 0, 1, 1, 0, 1, 0]
    assert {r.fn for r in grouped + one_by_one} == {"arithmetic"}


async def test_token_ids_reach_user_functions(service: str) -> None:
    async with client(service) as c:
        result = await c.score(
            {"response_token_ids": [1, 2, 3], "label": None, "fn": f"{USER_MODULE}:token_sum"}
        )
    assert result.reward == 6.0


async def test_hanging_function_times_out_while_others_are_served(service: str) -> None:
    before = metric(service, "vime_reward_timeouts_total", fn=f"{USER_MODULE}:hang")
    async with client(service) as c:
        hang = asyncio.create_task(c.score({"response": "x", "label": None, "fn": f"{USER_MODULE}:hang"}))
        await asyncio.sleep(0.3)
        others = await asyncio.gather(
            *(c.score({"response": str(i), "label": i, "fn": "arithmetic"}) for i in range(20))
        )
        hang_still_running = not hang.done()
        hung = await hang
    assert [r.reward for r in others] == [1.0] * 20
    assert hang_still_running, "the other requests waited for the hung one"
    assert (hung.status, hung.timed_out, hung.reward) == (RewardStatus.TIMEOUT, True, TIMEOUT_REWARD)
    assert TIMEOUT_S <= hung.elapsed_s < TIMEOUT_S + 1.5
    assert metric(service, "vime_reward_timeouts_total", fn=f"{USER_MODULE}:hang") == before + 1


async def test_wedged_worker_is_killed_and_replaced(service: str) -> None:
    before = metric(service, "vime_reward_worker_restarts_total", reason="timeout")
    async with client(service) as c:
        wedged = await c.score({"response": "x", "label": None, "fn": f"{USER_MODULE}:wedge"})
        after = await asyncio.gather(
            *(c.score({"response": "7", "label": 7, "fn": "arithmetic"}) for _ in range(8))
        )
    assert wedged.status == RewardStatus.TIMEOUT and wedged.reward == TIMEOUT_REWARD
    assert all(r.reward == 1.0 for r in after)
    assert metric(service, "vime_reward_worker_restarts_total", reason="timeout") == before + 1
    assert wait_pool_whole(service)["alive"] == 2


async def test_pool_survives_a_worker_that_exits(service: str) -> None:
    before = metric(service, "vime_reward_worker_restarts_total", reason="crash")
    async with client(service) as c:
        crashed = await c.score({"response": "x", "label": None, "fn": f"{USER_MODULE}:crash"})
        after = await asyncio.gather(
            *(c.score({"response": "\\boxed{2}", "label": "2", "fn": "math"}) for _ in range(8))
        )
    assert crashed.status == RewardStatus.ERROR and crashed.reward == ERROR_REWARD
    assert "exit code 7" in (crashed.error or "")
    assert all(r.reward == 1.0 for r in after)
    assert metric(service, "vime_reward_worker_restarts_total", reason="crash") == before + 1
    assert wait_pool_whole(service)["alive"] == 2


async def test_a_batch_scores_each_sample_as_if_alone(service: str) -> None:
    """A batch goes to the workers in chunks: a sample that hangs, wedges its worker or kills it
    gets its own result, and every other sample of its chunk gets its own."""
    fn = f"{USER_MODULE}:picky"
    stuck = {1: "hang", 3: "crash", 6: "wedge"}
    responses = [stuck.get(i, "x" * (1 + i % 5)) for i in range(24)]
    before = {r: metric(service, "vime_reward_worker_restarts_total", reason=r) for r in ("crash", "timeout")}
    async with client(service) as c:
        start = time.monotonic()
        results = await c.score_batch([{"response": r, "label": None} for r in responses], fn=fn)
        took = time.monotonic() - start
        alone = [await c.score({"response": r, "label": None}, fn=fn) for r in responses if r.startswith("x")]
    for timed_out in (results[1], results[6]):
        assert (timed_out.status, timed_out.timed_out, timed_out.reward) == (
            RewardStatus.TIMEOUT,
            True,
            TIMEOUT_REWARD,
        )
    assert results[3].status == RewardStatus.ERROR and "exit code 7" in (results[3].error or "")
    others = [r for i, r in enumerate(results) if i not in stuck]
    assert [(r.status, r.reward, r.pred) for r in others] == [
        (RewardStatus.OK, float(len(t)), t) for t in responses if t.startswith("x")
    ]
    assert [(r.reward, r.pred, r.details) for r in others] == [(r.reward, r.pred, r.details) for r in alone]
    assert took < 4 * TIMEOUT_S  # about two timeouts: the wedge, then what its chunk had left
    for reason, count in before.items():  # both replacements counted before the next test looks
        poll_until_blocking(
            lambda reason=reason, count=count: (
                metric(service, "vime_reward_worker_restarts_total", reason=reason) == count + 1
            ),
            timeout_s=20,
            interval_s=0.1,
            what=f"the {reason} restart",
        )
    assert wait_pool_whole(service)["alive"] == 2


CRAFTED = {
    "power tower": ("math", "\\boxed{9^{9^{9^{9^{9}}}}}"),
    "huge LaTeX": ("math", "\\boxed{" + "+".join(f"x_{{{i}}}^{{{i}}}" for i in range(20000)) + "}"),
    "deep nesting": ("math", "\\boxed{" + "\\frac{1}{" * 400 + "2" + "}" * 400 + "}"),
    "deep parens": ("math", "\\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}"),
    "1 MB answer": ("math", "\\boxed{" + "9" * 1_000_000 + "}"),
    "1 MB f1": ("f1", "word " * 200_000),
    "1 MB gsm8k": ("gsm8k", "1," * 500_000),
    "1 MB dapo": ("dapo", "Answer: " + "x" * 1_000_000),
}


@pytest.mark.parametrize("name", list(CRAFTED))
async def test_crafted_input_comes_back_within_the_timeout(service: str, name: str) -> None:
    fn, response = CRAFTED[name]
    async with client(service) as c:
        start = time.monotonic()
        result = await c.score({"response": response, "label": "1", "fn": fn})
        took = time.monotonic() - start
    assert result.status in (RewardStatus.OK, RewardStatus.TIMEOUT), result.error
    assert result.reward in (0.0, -1.0, TIMEOUT_REWARD)
    assert took < TIMEOUT_S + 3.0, f"{name} took {took:.1f}s"
    assert httpx.get(f"{service}/health").status_code == 200


def test_bad_requests_get_clear_4xx(service: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    post = lambda path, **kw: httpx.post(f"{service}{path}", timeout=30, **kw)  # noqa: E731
    r = post("/v1/reward", json={"response": "x", "label": "1", "fn": "mathh"})
    assert r.status_code == 400
    assert "mathh" in r.json()["error"]["message"] and "gsm8k" in r.json()["error"]["message"]
    assert set(r.json()["error"]["known"]) >= {"math", "gsm8k", "dapo", "deepscaler", "exact_match", "f1"}
    r = post("/v1/reward", json={"response": "x"})
    assert r.status_code == 422 and "label" in r.json()["error"]["message"]
    r = post("/v1/reward", json={"response": "x", "label": None, "fn": "math"})
    assert r.status_code == 422 and "label" in r.json()["error"]["message"]
    r = post("/v1/reward", json={"response": "x", "label": "1", "options": {"float_rounding": "six"}})
    assert r.status_code == 422 and "options.float_rounding" in r.json()["error"]["message"]
    r = post("/v1/reward", json={"response": 5, "label": "1"})
    assert r.status_code == 422 and "response" in r.json()["error"]["message"]
    r = post("/v1/reward", content=b'{"response": "x", "label"', headers={"content-type": "application/json"})
    assert r.status_code == 422
    deep = '{"response": "x", "label": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = post("/v1/reward", content=deep.encode(), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    r = post("/v1/reward", json={"response": "x" * (MAX_BODY + 10), "label": "1"})
    assert r.status_code == 413
    r = post("/v1/rewards", json={"items": [{"response": "x", "label": "1"}, {"response": "x"}]})
    assert r.status_code == 422 and "items.1.label" in r.json()["error"]["message"]
    r = post(
        "/v1/rewards",
        json={
            "items": [
                {"response": "x", "label": "1", "fn": "math"},
                {"response": "x", "label": "1", "fn": "nope"},
            ]
        },
    )
    assert r.status_code == 400 and "items.1.fn" in r.json()["error"]["message"]
    r = post("/v1/reward", json={"response": "x", "label": "1", "fn": f"{USER_MODULE}:hang"})
    assert r.status_code == 401
    r = post("/v1/reward", json={"response": "x", "label": "1", "fn": "no_such_module_xyz:fn"}, headers=auth)
    assert r.status_code == 403 and "fn: reward function 'no_such_module_xyz:fn' is not allowed" in r.text
    for fn, text in [("math", "so \\\\boxed{\\ud800}"), ("dapo", "Answer: \\ud800")]:
        # A lone surrogate is valid JSON but not UTF-8: the reply must still encode.
        body = f'{{"response": "{text}", "label": "1", "fn": "{fn}"}}'
        r = post("/v1/reward", content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["pred"] is not None, (fn, r.text)
    metrics = httpx.get(f"{service}/metrics").text
    assert not re.search(r'vime_http_requests_total\{[^}]*status="5\d\d"', metrics)


def test_a_request_cannot_name_code_to_import(service: str, service_root: Path) -> None:
    """Issue 17: ``{"fn": "os:getcwd"}`` used to call ``posix.getcwd()``. Only the functions the
    service was started with may be named; any other import path is a 403 naming the field, with
    the token or without, in a batch too, and its module is never imported."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    post = lambda path, body: httpx.post(f"{service}{path}", json=body, headers=auth, timeout=30)  # noqa: E731
    for fn in ("os:getcwd", f"{FORBIDDEN_MODULE}:anything", "subprocess:run"):
        r = post("/v1/reward", {"response": "x", "label": "1", "fn": fn})
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["message"].startswith(f"fn: reward function {fn!r} is not allowed")
        assert err["allowed"] == sorted(ALLOWED)
    r = post("/v1/rewards", {"items": [{"response": "x", "label": None}], "fn": "os:getcwd"})
    assert r.status_code == 403 and r.json()["error"]["message"].startswith("items.0.fn: ")
    meta = {"response": "x", "label": "1", "metadata": {"rm_type": f"{FORBIDDEN_MODULE}:anything"}}
    assert post("/v1/reward", meta).status_code == 403  # a sample's rm_type is held to the same list
    assert not (service_root / "imported.mark").exists()
    allowed = post("/v1/reward", {"response": "abc", "label": None, "fn": f"{USER_MODULE}:async_len"})
    assert allowed.status_code == 200 and allowed.json()["reward"] == 3.0


async def test_retry_with_the_same_sample_id_scores_once(service: str, tmp_path: Path) -> None:
    calls = tmp_path / "calls.txt"
    req = {
        "response": "x",
        "label": None,
        "fn": f"{USER_MODULE}:counted",
        "options": {"path": str(calls)},
        "sample_id": "retry-1",
    }
    async with client(service) as c:
        first, second = await asyncio.gather(c.score(req), c.score(req))
        third = await c.score(req)
        changed = await c.score({**req, "response": "y"})
    assert calls.read_text().splitlines() == ["call", "call"]  # the first request, then the changed one
    assert sorted([first.cached, second.cached]) == [False, True] and third.cached
    assert not changed.cached and changed.reward == 1.0


async def test_functions_listing_and_health(service: str) -> None:
    async with client(service) as c:
        listing = await c.functions()
        health = await c.health()
    names = {f.name for f in listing.functions}
    assert names == {"math", "deepscaler", "dapo", "gsm8k", "exact_match", "f1", "arithmetic", "remote"}
    assert listing.default == "math"
    math = next(f for f in listing.functions if f.name == "math")
    assert "float_rounding" in math.options["properties"] and math.needs_label
    assert health["service"] == "reward" and health["pool"]["workers"] == 2


def test_result_shape_round_trips(service: str) -> None:
    r = httpx.post(f"{service}/v1/reward", json={"response": "#### 72", "label": "72", "fn": "gsm8k"})
    result = RewardResult.model_validate(r.json())
    assert (result.reward, result.pred, result.details, result.timed_out) == (1.0, "72", {"acc": True}, False)


async def test_pool_takes_back_a_worker_whose_caller_gave_up() -> None:
    # The pool on its own (real worker processes, in this test's event loop): a caller cancelled
    # mid-task must neither lose the worker nor let the next task read the abandoned reply.
    pool = WorkerPool(1)
    await pool.start()
    try:
        slow = {
            "kind": "score",
            "fn": "math",
            "items": [{"response": CRAFTED["power tower"][1], "label": "1"}],
        }
        abandoned = asyncio.create_task(pool.run(slow, timeout_s=1.0))
        await asyncio.sleep(0.2)
        abandoned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        quick = {"kind": "score", "fn": "gsm8k", "items": [{"response": "#### 72", "label": "72"}]}
        result = await pool.run(quick, timeout_s=5.0)
        assert result.status == "ok" and result.reply["results"][0]["reward"] == 1.0
        assert pool.stats()["restarts"] == {} and pool.stats()["alive"] == 1
    finally:
        await pool.close()
    assert pool.stats()["alive"] == 0
