"""Registering engines with the router (seed step 2) and taking them out (dead, restarted, waiting
for weights).

The router service owns the engine registry (health ejection, draining) around vllm-router; the
rollout manager only says which engines should serve.
"""

from __future__ import annotations

from vime.config import RunConfig
from vime_rollout.engines.group import RouterRegistry


def router_registry(cfg: RunConfig) -> RouterRegistry:
    """The router control-plane client for this run's router."""
    from vime.clients.router import RouterClient

    services = cfg.services
    return RouterClient(services.url("router_control"), token=services.token())
