"""vime trainer: Megatron-core training ranks, checkpoints and weight export (run controller later)."""
