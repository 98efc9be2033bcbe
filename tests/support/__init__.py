"""Shared helpers for tests and benches: fake engines, the router and the rollout side of a stack as
real processes, Megatron/HF checkpoints and references, and the seed's order of run events."""
