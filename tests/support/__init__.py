"""Shared helpers for tests and benches: fake engines and the router service as real processes."""
