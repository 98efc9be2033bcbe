"""vime's reward service: rule-based verifiers and user functions in a process pool with timeouts."""

__version__ = "0.1.0"
