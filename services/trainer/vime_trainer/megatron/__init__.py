"""The Megatron-core training backend: ranks as Ray actors, the GRPO train step, memory, checkpoints.

Importing this package does not import megatron; the modules that need it import it inside the
training-rank processes, after the CPU shim is installed where there is no GPU.
"""
