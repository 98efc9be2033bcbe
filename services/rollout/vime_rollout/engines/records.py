"""What the engine group knows about each engine, and the weight-update lock.

An engine serves (is registered with the router) only while it holds the weights the trainer last
pushed: a restarted engine comes back with the checkpoint's weights and waits, out of the router,
as ``needs_weights`` until the trainer reports them loaded (the seed's
``get_updatable_engines_and_lock``). The lock keeps the set of engines still while the trainer
pushes: no restart or re-registration happens under it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from vime.wire.rollout import LIVE, EngineState
from vime_rollout.engines.control import EngineControl
from vime_rollout.engines.launchers import EngineProcess
from vime_rollout.engines.spec import EngineSpec


@dataclass
class EngineRecord:
    spec: EngineSpec
    control: EngineControl
    process: EngineProcess | None = None
    status: EngineState = EngineState.STARTING
    registered: bool = False
    weight_version: int | None = None
    """Version of the weights it holds: 0 = the checkpoint it started from."""
    asleep: set[str] = field(default_factory=set)
    restarts: int = 0
    failures: int = 0
    last_error: str | None = None
    compact_generate: bool = False
    """It serves vime's compact generate route (checked at each start)."""

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def live(self) -> bool:
        return self.status in LIVE


class LockHeld(RuntimeError):
    """The weight-update lock is held by another lease."""


@dataclass
class UpdateLock:
    """A lease with a time-to-live, so a trainer that dies while pushing does not block forever."""

    lease_id: str | None = None
    expires_at: float = 0.0

    def held(self) -> bool:
        return self.lease_id is not None and time.monotonic() < self.expires_at

    def acquire(self, ttl_s: float, lease_id: str | None = None) -> str:
        """Take the lock as ``lease_id`` (a new id when None); the holder asking again renews it."""
        if self.held() and (lease_id is None or lease_id != self.lease_id):
            raise LockHeld(
                f"the weight-update lock is held by lease {self.lease_id} for "
                f"{self.expires_at - time.monotonic():.0f} more seconds"
            )
        self.lease_id = lease_id or uuid.uuid4().hex[:16]
        self.expires_at = time.monotonic() + ttl_s
        return self.lease_id

    def release(self, lease_id: str) -> bool:
        """Release the lease ``lease_id`` (an expired lease of anyone may be released too)."""
        if self.lease_id is not None and lease_id != self.lease_id and self.held():
            raise LockHeld(f"lease {lease_id} does not hold the weight-update lock ({self.lease_id} does)")
        self.lease_id = None
        self.expires_at = 0.0
        return True
