"""HF ↔ Megatron weight names and layouts, TP sharding, buckets and the shared-memory bucket files.

Nothing here imports megatron: the conversions are plain tensor operations usable anywhere.
"""
