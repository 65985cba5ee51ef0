"""The plain-torch trainer (a :class:`~staleflow.runtime.interfaces.Trainer`) and the RL losses it computes."""
