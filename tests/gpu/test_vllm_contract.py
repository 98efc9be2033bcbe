"""The engine contract suite (`tests/contract/`) against an engine started by the rollout manager's
command builder: real ``vllm serve`` on the GPU with the CUDA IPC pusher of this folder, the
reference engine (shm pusher) in the dry run.

The contract suite runs as its own pytest process pointed at the engine through its documented
switches (``VIME_CONTRACT_ENGINE_URL``, ``VIME_CONTRACT_MODEL_DIR``, ``VIME_CONTRACT_PUSHER``);
this test fails with the names and messages of the contract tests that failed, and also when a
test that needs a weight push was skipped for want of a pusher (the IPC path must run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from gpu_support import StartedEngine, record

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
INNER_TIMEOUT_S = 900


def junit_outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, message) from a JUnit XML report."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or node.text or "")[:500]
                break
        out[name] = (outcome, message)
    return out


@pytest.mark.timeout(INNER_TIMEOUT_S + 600)  # engine start-up + the whole inner suite
def test_contract_suite_passes_against_the_engine(
    contract_engine: StartedEngine, gpu: bool, tmp_path: Path
) -> None:
    report = tmp_path / "contract.xml"
    env = {
        **os.environ,
        "VIME_CONTRACT_ENGINE_URL": contract_engine.url,
        "VIME_CONTRACT_MODEL_DIR": str(contract_engine.model),
    }
    if gpu:
        env["VIME_CONTRACT_PUSHER"] = "ipc_pusher:make_pusher"
    argv = [sys.executable, "-m", "pytest", "tests/contract", "-q", "-rfEs", "-p", "no:cacheprovider"]
    argv += [f"--junitxml={report}", f"--basetemp={tmp_path / 'inner'}", "-o", "addopts="]
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent / "contract"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=INNER_TIMEOUT_S, check=False
    )
    print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\n")
    assert report.exists(), f"the contract suite did not run (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    outcomes = junit_outcomes(report)
    counts = {k: sum(1 for o, _ in outcomes.values() if o == k) for k in ("passed", "failed", "skipped")}
    failed = {n: m for n, (o, m) in outcomes.items() if o == "failed"}
    skipped = {n: m for n, (o, m) in outcomes.items() if o == "skipped"}
    record(
        "contract",
        engine=contract_engine.backend,
        engine_start_s=round(contract_engine.start_s, 1),
        **counts,
        failed_tests=sorted(failed),
        skipped_tests={n.rsplit("::", 1)[-1]: m[:120] for n, m in skipped.items()},
    )
    assert not failed, "contract tests failed:\n" + "\n".join(f"{n}: {m}" for n, m in failed.items())
    no_pusher = [n for n, m in skipped.items() if "no weight pusher" in m]
    assert not no_pusher, f"weight-update tests did not run: {no_pusher}"
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert counts["passed"] >= 20, counts  # the suite really ran against the engine
