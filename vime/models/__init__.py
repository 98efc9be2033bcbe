"""Model kits: small Qwen3-architecture checkpoints and tokenizers built locally (nothing downloaded)."""
