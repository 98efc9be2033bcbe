"""vime's rollout service: the rollout manager and the CPU reference engine.

The reference engine (`vime_rollout.reference_engine`) is the CPU stand-in for vLLM: it serves
vLLM's HTTP routes with vLLM's JSON shapes so that everything above it runs unchanged on a
machine without a GPU. It is self-contained and imports nothing else from this package.
"""
