"""Port choice: below the ephemeral range, never a port in use, never the same port twice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from vime import procs


def test_ports_lie_below_the_kernels_ephemeral_range() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    base = procs.free_port_run(4)
    assert procs.PORT_RANGE[0] <= base and base + 3 < min(procs.PORT_RANGE[1], ephemeral_low)
    assert procs.free_port() < ephemeral_low


def test_a_port_in_use_or_handed_out_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", procs.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(procs, "PORT_RANGE", (taken - 1, taken + 2))
        monkeypatch.setattr(procs, "_HANDED_OUT", set())
        first, second = procs.free_port(), procs.free_port()
        assert {first, second} == {taken - 1, taken + 1}  # the held one never, neither twice
        assert procs.free_port() in (taken - 1, taken + 1)  # more than half handed out: chosen afresh
        with pytest.raises(RuntimeError, match="no 2 consecutive free ports"):
            procs.free_port_run(2)  # every run of two crosses the held port
