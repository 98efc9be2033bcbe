"""vime trainer: the run controller (the seed's driver loop over REST), the weight push to the
engines (`weight_sync`), and the Megatron-core training ranks, checkpoints and weight export
(`megatron`, `weights`). ``python -m vime_trainer`` serves the REST API."""
