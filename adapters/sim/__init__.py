"""Simulated twins of the rollout engine and the trainer: virtual time, the cost model, the same seams."""
