"""Sums of vLLM series read from an engine's ``GET /metrics`` (Prometheus text format).

Two readers need them: the router (requests in flight, to see a drained engine finish) and the
rollout manager (requests each engine finished during a rollout, the seed's ~64 per
engine). A plain line scan: vLLM's /metrics is scraped every second and holds hundreds of
series, of which these read one or two names.
"""

from __future__ import annotations

from collections.abc import Iterable

IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")
"""Running + waiting: what an engine still has to answer."""
FINISHED = ("vllm:request_success_total",)
"""Requests the engine finished (every finish reason), a counter since the engine started."""


def metric_sum(text: bytes, names: Iterable[str]) -> float | None:
    """The sum of every sample of the series ``names`` over all label sets; None when none appears."""
    wanted = {n.encode() for n in names}
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(b"#"):
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        if name in wanted:
            try:
                total += float(line.rsplit(b" ", 1)[1])
            except (IndexError, ValueError):
                continue
            seen = True
    return total if seen else None
