"""vime: RL post-training for language models (GRPO first), built as services."""

__version__ = "0.1.0"
