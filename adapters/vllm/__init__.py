"""The vLLM rollout engine (a :class:`~staleflow.runtime.interfaces.RolloutEngine`)."""
