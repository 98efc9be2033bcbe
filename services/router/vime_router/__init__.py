"""vime router service: engine registry, health ejection and draining around vllm-router.

The data plane is the `vllm-router` process behind a route filter (only the generate routes reach
the engines); the control plane is a FastAPI app that registers, drains and health-checks engines
and keeps vllm-router's worker list in step. ``python -m vime_router`` starts both.
"""
