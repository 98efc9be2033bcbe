"""Model kits: small Qwen3-architecture checkpoints and tokenizers built locally (nothing downloaded),
and `policy_model_path`, the one place that says which checkpoint a run's policy is."""

from vime.models.path import policy_model_path

__all__ = ["policy_model_path"]
