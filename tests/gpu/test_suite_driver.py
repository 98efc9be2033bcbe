"""The GPU suite driver's own logic, on any machine (no GPU, no engine): which steps a selection
runs, how a step's figures and JUnit counts are read back, what a step that fails, hangs or does
not fit the budget leaves in ``results.json``, and that the archive stays within what the device
tool returns."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest

RUNS_WITHOUT_GPU = True
"""Read by this folder's conftest: these tests need no GPU and no dry run."""

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "gpu"
sys.path.insert(0, str(SCRIPTS))

import suite  # noqa: E402
import suite_results  # noqa: E402
import suite_steps  # noqa: E402


def test_groups_expand_in_order_without_duplicates() -> None:
    names = [s.name for s in suite_steps.select(["loop", "tests", "bench_sync"])]
    assert names == ["loop", "contract", "megatron", "bench_sync"]
    assert [s.name for s in suite_steps.select([])] == ["loop", "contract", "megatron"]
    assert [s.name for s in suite_steps.select(["contract", "tests"])] == ["contract", "loop", "megatron"]
    with pytest.raises(suite_steps.SelectionError, match="unknown step 'nope'"):
        suite_steps.select(["tests", "nope"])


def test_commands_point_pytest_and_benches_at_the_collected_directories(tmp_path: Path) -> None:
    steps = suite_steps.STEPS
    argv = suite_steps.command(
        steps["loop"], dry=True, work=tmp_path, basetemp=tmp_path / "b", junit=tmp_path / "j.xml"
    )
    assert argv[1:4] == ["-m", "pytest", "tests/gpu/test_colocated_loop.py"]
    assert f"--basetemp={tmp_path / 'b'}" in argv and f"--junitxml={tmp_path / 'j.xml'}" in argv
    gpu = suite_steps.command(
        steps["bench_sync"], dry=False, work=tmp_path, basetemp=tmp_path, junit=tmp_path
    )
    dry = suite_steps.command(steps["bench_sync"], dry=True, work=tmp_path, basetemp=tmp_path, junit=tmp_path)
    assert "ipc" in gpu and "qwen3-4b" in gpu and "shm" in dry and gpu[-2:] == ["--work", str(tmp_path)]
    train = suite_steps.command(
        steps["bench_train"], dry=False, work=tmp_path, basetemp=tmp_path, junit=tmp_path
    )
    assert train[-2:] == ["--work", str(tmp_path)]  # its JSON and profiles land in the collected work dir
    assert train.count("--variant") >= 2 and "padded" in train
    for step in steps.values():  # every script a step names exists
        assert (SCRIPTS.parents[1] / next(a for a in step.gpu if a.endswith(".py"))).is_file()


def test_figures_come_from_result_lines_and_the_figures_file(tmp_path: Path) -> None:
    log, fig = tmp_path / "s.log", tmp_path / "s.jsonl"
    log.write_text('noise\nVIME_RESULT {"name": "a", "x": 1}\nVIME_RESULT {broken\n')
    fig.write_text('{"name": "a", "x": 1}\n{"name": "b", "y": [1, 2]}\n')
    assert suite_results.figures_of(log, fig) == [{"name": "a", "x": 1}, {"name": "b", "y": [1, 2]}]
    bare = tmp_path / "bare.log"
    bare.write_text('{"not": "this"}\ntable\n{"shape": "0.6b", "vime_mfu": 0.3}\n')
    assert suite_results.figures_of(bare, tmp_path / "none.jsonl") == [{"shape": "0.6b", "vime_mfu": 0.3}]


def fake_steps(tmp_path: Path) -> dict[str, suite_steps.Step]:
    """Three steps that pass (with a figure), fail, and hang."""
    script = tmp_path / "s.py"
    script.write_text(
        "import sys, time\n"
        "mode = sys.argv[1]\n"
        'if mode == \'ok\': print(\'VIME_RESULT {"name": "ok", "v": 7}\')\n'
        "if mode == 'hang': time.sleep(60)\n"
        "sys.exit(3 if mode == 'fail' else 0)\n"
    )
    mk = lambda name, mode: suite_steps.Step(  # noqa: E731
        name, name, [str(script), mode], [str(script), mode], timeout_s=0.5, expect_s=1, work_arg=False
    )
    return {"ok": mk("ok", "ok"), "fail": mk("fail", "fail"), "hang": mk("hang", "hang")}


def test_a_failing_or_hanging_step_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = fake_steps(tmp_path)
    monkeypatch.setattr(suite, "MIN_STEP_S", 0.5)
    args = suite.parse_args(["--dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")])
    rc = suite.Suite(args, [steps["fail"], steps["hang"], steps["ok"]]).run()
    assert rc == 1
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    got = {n: (r["status"], r.get("rc")) for n, r in results["steps"].items()}
    assert got["fail"] == ("failed", 3) and got["hang"][0] == "timeout" and got["ok"] == ("passed", 0)
    assert results["steps"]["ok"]["figures"] == [{"name": "ok", "v": 7}]
    assert "| ok | passed |" in (tmp_path / "out" / "summary.md").read_text()
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert {"logs/ok.log", "logs/fail.log", "logs/hang.log"} <= set(tar.getnames())


def test_a_step_that_does_not_fit_the_budget_is_skipped_and_says_why(tmp_path: Path) -> None:
    steps = fake_steps(tmp_path)
    args = suite.parse_args(
        ["--dry-run", "--budget-s", "20", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]
    )
    assert suite.Suite(args, [steps["ok"]]).run() == 1  # 20 s - reserve < MIN_STEP_S
    r = json.loads((tmp_path / "o" / "results.json").read_text())["steps"]["ok"]
    assert r["status"] == "skipped" and r["reason"].startswith("budget")


def test_the_archive_keeps_log_tails_and_leaves_out_big_files(tmp_path: Path) -> None:
    work = tmp_path / "w"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "big.log").write_bytes(b"x" * (suite_results.LOG_TAIL_BYTES + 100) + b"END")
    (work / "tmp" / "model").mkdir(parents=True)
    (work / "tmp" / "model" / "model.safetensors").write_bytes(b"\0" * 1000)
    (work / "tmp" / "model" / "tokenizer.json").write_text("{}")
    (work / "tmp" / "huge.json").write_bytes(b"1" * (suite_results.LOG_TAIL_BYTES + 1))
    stats = suite_results.write_archive(work, tmp_path / "a.tar.gz")
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        names = set(tar.getnames())
        big = tar.extractfile("logs/big.log").read()  # type: ignore[union-attr]
        left = tar.extractfile("LEFT_OUT.txt").read().decode()  # type: ignore[union-attr]
    assert names == {"logs/big.log", "LEFT_OUT.txt"} and big.endswith(b"END") and b"cut" in big
    assert "tmp/huge.json" in left and stats["left_out"] == 1
