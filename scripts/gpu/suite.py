#!/usr/bin/env python3
"""The GPU suite driver: the GPU tests and benchmarks as steps, in one device call, within a budget.

    bash scripts/gpu/device.sh run bash scripts/gpu/suite.sh tests      # loop contract megatron
    bash scripts/gpu/device.sh run bash scripts/gpu/suite.sh benches    # bench_sync bench_step
    bash scripts/gpu/suite.sh --dry-run tests                           # here: CPU stand-ins
    bash scripts/gpu/suite.sh --list

Each step (`suite_steps.STEPS`) runs as its own process group with a hard time limit, cut to what
is left of the call's budget (``--budget-s``, default 575 s: the device tool stops a command
at 600 s); a step that cannot get ``MIN_STEP_S`` is skipped and says why. A failing step does
not stop the others. After each step the driver kills whatever the step left behind (it is a
child subreaper, so re-parented grandchildren — vLLM engines, Ray workers, redis — are its to
reap), waits for the GPUs to be free again, and rewrites ``$OUT/results.json``,
``$OUT/summary.md`` and ``$OUT/logs.tar.gz`` (`suite_results`).

Only the standard library and ``vime.launch.orphans`` (standard library only) are imported, so
the driver runs even where the bundle is broken and reports that as each step's failure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

import suite_results  # noqa: E402
from gpu_watch import watch  # noqa: E402
from suite_steps import STEPS, SelectionError, Step, command, select  # noqa: E402

DRY_RUN_ENV = "VIME_GPU_DRY_RUN"
MIN_STEP_S = 45.0
RESERVE_S = 10.0
"""Kept at the end of the budget for the last archive."""
KILL_GRACE_S = 10.0


def log(msg: str) -> None:
    print(f"[suite {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", nargs="*", help="steps or groups (tests, benches, all); default: tests")
    p.add_argument("--dry-run", action="store_true", help=f"CPU stand-ins (also ${DRY_RUN_ENV}=1)")
    p.add_argument("--budget-s", type=float, default=None, help="whole-call budget (GPU 575, dry run 7200)")
    p.add_argument("--out", type=Path, default=None, help="default $OUT, else a new temp dir")
    p.add_argument("--work", type=Path, default=None, help="scratch (default: $TMPDIR/vime-suite-<time>)")
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    args = p.parse_args(argv)
    args.dry_run = args.dry_run or os.environ.get(DRY_RUN_ENV, "").lower() in ("1", "true", "yes")
    if args.budget_s is None:
        args.budget_s = 7200.0 if args.dry_run else 575.0
    return args


def device_info() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    with contextlib.suppress(Exception):
        q = "--query-gpu=index,name,memory.total,driver_version"
        out = subprocess.run(
            ["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        return "; ".join(line.strip() for line in out.stdout.splitlines())
    return None


def gpu_used_mib() -> list[int]:
    if shutil.which("nvidia-smi") is None:
        return []
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return [int(x) for x in out.stdout.split()]
    return []


def wait_gpus_free(timeout_s: float = 30.0, limit_mib: int = 2048) -> list[int]:
    """Until every GPU uses less than ``limit_mib`` (what the step left), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    used = gpu_used_mib()
    while used and max(used) > limit_mib and time.monotonic() < deadline:
        time.sleep(1.0)
        used = gpu_used_mib()
    return used


def reap_leftovers() -> dict[int, str]:
    try:
        from vime.launch.orphans import kill_descendants
    except Exception:  # the driver must still finish and write its results
        return {}
    return kill_descendants()


def run_step(
    step: Step, argv: list[str], env: dict[str, str], log_path: Path, timeout_s: float
) -> tuple[str, int | None]:
    """Run one step in its own process group; (status, return code)."""
    with log_path.open("wb") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        t0 = time.monotonic()
        next_beat = t0 + 60
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > timeout_s:
                log(f"{step.name}: time limit {timeout_s:.0f}s reached, stopping it")
                _stop_group(proc)
                return "timeout", proc.returncode
            if now >= next_beat:
                log(f"{step.name}: running for {now - t0:.0f}s (expected ~{step.expect_s:.0f}s)")
                next_beat += 60
            time.sleep(0.5)
    return ("passed" if proc.returncode == 0 else "failed"), proc.returncode


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


def prune_big_files(root: Path, limit: int = 32 << 20) -> int:
    """Delete what a step left that is too big to bring back (models, checkpoints): disk for the next."""
    freed = 0
    for path in root.rglob("*") if root.exists() else []:
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink() and path.stat().st_size > limit:
                freed += path.stat().st_size
                path.unlink()
    return freed


def become_subreaper() -> None:
    with contextlib.suppress(Exception):
        from vime.launch.orphans import become_subreaper as _become

        _become()


class Suite:
    def __init__(self, args: argparse.Namespace, steps: list[Step], *, reap: bool = False) -> None:
        """``reap``: kill every descendant after each step (only where the driver is the main program)."""
        self.args, self.steps, self.reap = args, steps, reap
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(
            args.out
            or os.environ.get("OUT")
            or Path(os.environ.get("TMPDIR", "/tmp")) / f"vime-suite-out-{stamp}"
        )
        self.work = Path(args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"vime-suite-{stamp}")
        for d in (
            self.out,
            self.work / "logs",
            self.work / "junit",
            self.work / "figures",
            self.work / "tmp",
        ):
            d.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s - RESERVE_S
        self.results: dict[str, Any] = {
            "suite": {
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "dry_run": args.dry_run,
                "steps": [s.name for s in steps],
                "budget_s": args.budget_s,
                "device": device_info(),
                "python": sys.version.split()[0],
                "work": str(self.work),
            },
            "steps": {},
        }

    def env(self, step: Step) -> dict[str, str]:
        env = {**os.environ, **step.env, "PYTHONUNBUFFERED": "1"}
        env["VIME_SUITE_FIGURES"] = str(self.work / "figures" / f"{step.name}.jsonl")
        if self.args.dry_run:
            env[DRY_RUN_ENV] = "1"
        return env

    def run(self) -> int:
        log(
            f"{len(self.steps)} step(s): {', '.join(s.name for s in self.steps)}; budget {self.args.budget_s:.0f}s; out {self.out}"
        )
        for step in self.steps:
            self.results["steps"][step.name] = self.one(step)
            self.save()
        self.results["suite"]["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.save()
        self.print_summary()
        bad = [n for n, r in self.results["steps"].items() if r["status"] != "passed"]
        return 1 if bad else 0

    def one(self, step: Step) -> dict[str, Any]:
        left = self.deadline - time.monotonic()
        record: dict[str, Any] = {"status": "skipped", "expect_s": step.expect_s, "duration_s": 0.0}
        if left < MIN_STEP_S:
            record["reason"] = f"budget: {left:.0f}s left of {self.args.budget_s:.0f}s"
            log(f"{step.name}: skipped ({record['reason']})")
            return record
        timeout = min(step.timeout_s * (4 if self.args.dry_run else 1), left)
        basetemp = self.work / "tmp" / step.name
        basetemp.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(basetemp, ignore_errors=True)
        argv = command(
            step,
            dry=self.args.dry_run,
            work=basetemp,
            basetemp=basetemp,
            junit=self.work / "junit" / f"{step.name}.xml",
        )
        log_path = self.work / "logs" / f"{step.name}.log"
        log(f"{step.name}: start ({step.doc}); limit {timeout:.0f}s")
        t0 = time.monotonic()
        with watch(log_path.parent, step.name, enabled=not self.args.dry_run):
            status, rc = run_step(step, argv, self.env(step), log_path, timeout)
        record.update(
            status=status, rc=rc, duration_s=round(time.monotonic() - t0, 1), timeout_s=round(timeout)
        )
        leftovers = reap_leftovers() if self.reap else {}
        if leftovers:
            record["killed_leftovers"] = sorted(set(leftovers.values()))[:20]
        record["pruned_bytes"] = prune_big_files(basetemp)
        if not self.args.dry_run:
            record["gpu_used_mib_after"] = wait_gpus_free()
        record["figures"] = suite_results.figures_of(log_path, self.work / "figures" / f"{step.name}.jsonl")
        if step.pytest:
            record["tests"] = suite_results.junit_counts(self.work / "junit" / f"{step.name}.xml")
        record["log"] = f"logs/{step.name}.log"
        record["tail"] = _tail_lines(log_path, 25)
        log(f"{step.name}: {status} in {record['duration_s']:.0f}s (rc {rc})")
        return record

    def save(self) -> None:
        suite_results.write_json(self.out / "results.json", self.results)
        (self.out / "summary.md").write_text(suite_results.summary_markdown(self.results))
        self.results["suite"]["archive"] = suite_results.write_archive(self.work, self.out / "logs.tar.gz")

    def print_summary(self) -> None:
        log(f"done in {time.monotonic() - self.t0:.0f}s; results in {self.out}")
        for name, r in self.results["steps"].items():
            tests = r.get("tests") or {}
            extra = (
                f" ({tests.get('passed')} passed, {tests.get('failed')} failed, {tests.get('skipped')} skipped)"
                if tests
                else ""
            )
            print(
                f"  {name:<14} {r['status']:<8} {r.get('duration_s', 0):>6.0f}s{extra} {r.get('reason', '')}"
            )
            for f in r.get("figures", [])[-6:]:
                print(f"      {str(f)[:400]}")


def _tail_lines(path: Path, n: int) -> list[str]:
    if not path.exists():
        return []
    return path.read_text(errors="replace").splitlines()[-n:]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for s in STEPS.values():
            print(f"{s.name:<14} ~{s.expect_s:>4.0f}s (limit {s.timeout_s:.0f}s)  {s.doc}")
        return 0
    try:
        steps = select(args.steps)
    except SelectionError as exc:
        print(f"suite: {exc}", file=sys.stderr)
        return 2
    become_subreaper()
    return Suite(args, steps, reap=True).run()


if __name__ == "__main__":
    sys.exit(main())
