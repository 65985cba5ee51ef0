"""StaleFlow: disaggregated RL post-training with a strictly bounded staleness protocol."""

__version__ = "0.1.0"
