"""Port choice: below the ephemeral range, never a port in use, never one another process chose."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vime import procs


@pytest.fixture(autouse=True)
def claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "claims.json"
    monkeypatch.setattr(procs, "CLAIMS_FILE", path)
    return path


def test_ports_lie_below_the_kernels_ephemeral_range() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    base = procs.free_port_run(4)
    assert procs.PORT_RANGE[0] <= base and base + 3 < min(procs.PORT_RANGE[1], ephemeral_low)
    assert procs.free_port() < ephemeral_low


def test_a_port_in_use_or_chosen_before_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", procs.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(procs, "PORT_RANGE", (taken - 1, taken + 2))
        first, second = procs.free_port(), procs.free_port()
        assert {first, second} == {taken - 1, taken + 1}  # the held one never, neither twice
        with pytest.raises(RuntimeError, match="no 2 consecutive free ports"):
            procs.free_port_run(2)  # every run of two crosses the held port


def test_another_process_never_gets_a_port_this_one_chose(
    claims: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    low = procs.free_port_run(40)
    claims.write_text("{}")  # the 40 free ports: this process takes 10, another 10 more
    monkeypatch.setattr(procs, "PORT_RANGE", (low, low + 40))
    mine = {procs.free_port() for _ in range(10)}
    code = (
        "import json; from pathlib import Path; from vime import procs\n"
        f"procs.CLAIMS_FILE = Path({str(claims)!r}); procs.PORT_RANGE = ({low}, {low + 40})\n"
        "print(json.dumps([procs.free_port() for _ in range(10)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    theirs = set(json.loads(out.stdout))
    assert len(mine) == len(theirs) == 10 and not mine & theirs
    assert set(json.loads(claims.read_text())) == {str(p) for p in mine | theirs}


def test_a_damaged_claims_file_is_started_afresh(claims: Path) -> None:
    claims.write_text('{"2')  # a writer killed halfway
    port = procs.free_port()
    assert json.loads(claims.read_text()).keys() == {str(port)}


def test_old_claims_give_way_before_the_range_runs_out(monkeypatch: pytest.MonkeyPatch) -> None:
    low = procs.free_port_run(4)
    monkeypatch.setattr(procs, "PORT_RANGE", (low, low + 4))
    picks = [procs.free_port() for _ in range(12)]  # three times the range, none refused
    assert all(a != b for a, b in itertools.pairwise(picks))  # the newest claim is kept
