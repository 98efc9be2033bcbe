"""What the GPU suite brings back in ``$OUT``: ``results.json``, ``summary.md`` and ``logs.tar.gz``.

All three are rewritten after every step, so a call cut short still returns what had finished.
The device tool returns at most 8 files of at most 16 MiB each, hence one tarball for every
per-step log and the useful small files the steps left (service logs, JUnit reports, run
records, figures), each log cut to its last ``LOG_TAIL_BYTES`` and the whole archive to a budget.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import time
from pathlib import Path
from typing import Any

RESULT_LINE = re.compile(r"^VIME_RESULT (\{.*\})\s*$")
KEPT_SUFFIXES = (".log", ".json", ".jsonl", ".yaml", ".yml", ".xml", ".txt", ".md", ".csv")
SKIPPED_NAMES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
LOG_TAIL_BYTES = 2 << 20
ARCHIVE_BUDGET_BYTES = 14 << 20


def figures_of(log: Path, figures_file: Path) -> list[dict[str, Any]]:
    """Every ``VIME_RESULT {...}`` line of the step's log plus the lines of its figures file."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    lines: list[str] = []
    if figures_file.exists():
        lines += figures_file.read_text(errors="replace").splitlines()
    if log.exists():
        lines += [
            m.group(1)
            for line in log.read_text(errors="replace").splitlines()
            if (m := RESULT_LINE.match(line))
        ]
    if (
        not lines and log.exists()
    ):  # a script that prints its result as a bare JSON line (bench/train_step.py)
        bare = [
            x
            for x in log.read_text(errors="replace").splitlines()
            if x.startswith("{") and x.rstrip().endswith("}")
        ]
        lines = bare[-1:]
    for line in lines:
        line = line.strip()
        if not line or line in seen:
            continue
        seen.add(line)
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"unparsed": line[:500]})
    return out


def junit_counts(path: Path) -> dict[str, Any] | None:
    """passed/failed/skipped counts and the failed tests' names and messages from a JUnit report."""
    import xml.etree.ElementTree as ET

    if not path.exists():
        return None
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": {}, "skips": {}}
    try:
        cases = list(ET.parse(path).getroot().iter("testcase"))
    except ET.ParseError as exc:  # a run cut short mid-write
        return {**counts, "unreadable": str(exc)}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            counts["failures"][name] = (bad.get("message") or "")[:1500]
        elif skip is not None:
            counts["skipped"] += 1
            counts["skips"][name] = (skip.get("message") or "")[:200]
        else:
            counts["passed"] += 1
    return counts


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def summary_markdown(results: dict[str, Any]) -> str:
    """One table row per step and, below it, each step's figures (for docs/benchmarks.md)."""
    suite = results["suite"]
    lines = [
        f"# GPU suite {suite['started']} ({'CPU dry run' if suite['dry_run'] else 'GPU'})",
        "",
        f"device: {suite.get('device') or 'n/a'}",
        "",
        "| step | status | seconds | expected | notes |",
        "|---|---|---|---|---|",
    ]
    for name, r in results["steps"].items():
        note = r.get("reason") or ""
        tests = r.get("tests")
        if tests:
            note = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped " + note
        lines.append(
            f"| {name} | {r['status']} | {r.get('duration_s', 0):.0f} | {r.get('expect_s', 0):.0f} | {note} |"
        )
    for name, r in results["steps"].items():
        if r.get("figures"):
            lines += ["", f"## {name}", "", "```json"]
            lines += [json.dumps(f, default=str) for f in r["figures"]]
            lines.append("```")
    return "\n".join(lines) + "\n"


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _tail(path: Path, limit: int) -> bytes:
    size = path.stat().st_size
    with path.open("rb") as f:
        if size > limit:
            f.seek(size - limit)
            return b"[... cut: the first %d bytes ...]\n" % (size - limit) + f.read()
        return f.read()


def collect(work: Path) -> list[tuple[str, Path]]:
    """(archive name, file) of everything worth bringing back: logs first, then artifacts."""
    first: list[tuple[str, Path]] = []
    rest: list[tuple[str, Path]] = []
    for path in sorted(work.rglob("*")):
        if not path.is_file() or path.name in SKIPPED_NAMES or not path.name.endswith(KEPT_SUFFIXES):
            continue
        rel = path.relative_to(work).as_posix()
        (first if rel.startswith(("logs/", "junit/", "figures/")) else rest).append((rel, path))
    return first + rest


def write_archive(work: Path, out: Path, budget: int = ARCHIVE_BUDGET_BYTES) -> dict[str, int]:
    """``logs.tar.gz`` of `collect`; files past the budget are listed in ``LEFT_OUT.txt``."""
    buffer = io.BytesIO()
    kept, left_out = 0, []
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, path in collect(work):
            try:
                data = _tail(path, LOG_TAIL_BYTES) if name.endswith(".log") else path.read_bytes()
            except OSError:
                continue
            if buffer.tell() + len(data) // 4 > budget or (
                len(data) > LOG_TAIL_BYTES and not name.endswith(".log")
            ):
                left_out.append(f"{name} ({len(data)} bytes)")
                continue
            _add_bytes(tar, name, data)
            kept += 1
        if left_out:
            _add_bytes(tar, "LEFT_OUT.txt", "\n".join(left_out).encode())
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, out)
    return {"files": kept, "left_out": len(left_out), "bytes": out.stat().st_size}
