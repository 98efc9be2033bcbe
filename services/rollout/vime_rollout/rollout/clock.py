"""When things happened during one rollout, in seconds from its start: the rollout's fixed cost
against driving the engines directly, broken into parts (``rollout/t_*`` metrics).

Direct vLLM sends every request at once and is done when the last reply lands. The rollout adds:
the delay before the first request goes out and the spread of the sends (``t_first_request``,
``t_last_request``), the replies (``t_first_response``, ``t_median_response``,
``t_last_response``), the rewards still running after the last reply (``t_reward_tail``; their
summed time is ``t_reward_total``, concurrent with generation), the wait for the group that
completes the batch (``t_last_group``), aborting the leftovers (``t_abort``), and, around the loop,
the engines' request counters read before and after (``t_engine_metrics``), building and publishing
the batch (``t_build``, ``t_publish``; set by the manager).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass
class RolloutClock:
    start: float = field(default_factory=time.perf_counter)
    first_request: float | None = None
    last_request: float | None = None
    responses: list[float] = field(default_factory=list)
    reward_s: float = 0.0
    last_group: float | None = None
    abort_s: float = 0.0

    def restart(self) -> None:
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def request(self) -> None:
        t = self.now()
        if self.first_request is None:
            self.first_request = t
        self.last_request = t

    def response(self) -> None:
        self.responses.append(self.now())

    def group_done(self) -> None:
        self.last_group = self.now()

    def metrics(self) -> dict[str, float]:
        """``t_<part>_s`` (without the ``rollout/`` prefix); parts that did not happen are left out."""
        out: dict[str, float] = {"t_reward_total_s": self.reward_s, "t_abort_s": self.abort_s}
        points = {
            "first_request": self.first_request,
            "last_request": self.last_request,
            "last_group": self.last_group,
        }
        if self.responses:
            points |= {
                "first_response": min(self.responses),
                "median_response": statistics.median(self.responses),
                "last_response": max(self.responses),
            }
        out |= {f"t_{k}_s": v for k, v in points.items() if v is not None}
        if self.last_group is not None and self.responses:
            out["t_reward_tail_s"] = max(0.0, self.last_group - max(self.responses))
        return out
