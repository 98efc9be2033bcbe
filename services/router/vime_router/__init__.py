"""vime router service: engine registry and draining around vllm-router.

The data plane is the `vllm-router` process behind a route filter (only the generate routes reach
the engines); the control plane is a FastAPI app that registers and drains engines and keeps
vllm-router's worker list in step. It judges no engine's health: the rollout manager does, and
registers only the engines that serve. ``python -m vime_router`` starts both.
"""
