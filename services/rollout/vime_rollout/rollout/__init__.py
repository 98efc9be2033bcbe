"""The rollout loop (seed steps 15–29): state, one sample, one group, collection, metrics."""
