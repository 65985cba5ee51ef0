"""Freshness-aware admission's lookahead: how many buffers beyond the head admission may fill
(:class:`~staleflow.runtime.settings.policies.SystemPolicy` ``freshness``)."""

from __future__ import annotations


class Lookahead:
    """The lookahead's ``width``, adapted at each training step.

    It starts as wide as the protocol (``eta``), widens by one when the trainer waited *and* a
    freshness hold since the last step kept work from an instance that had room (the hold cost
    generation; when the instances were full anyway, a wider lookahead would only add staleness),
    and narrows by one after ``patience`` steps in a row the trainer did not wait for, down to 0
    (only the head buffer: lag 1 when the trainer is the bottleneck). A wait without such a hold
    leaves it as it is.
    """

    def __init__(self, eta: int, patience: int) -> None:
        self.width = eta
        self.patience = patience
        self.hold_left_room = False  # since the step started, a hold kept work from an instance with room
        self._steps_without_wait = 0

    def holds(self, active_groups: int, batch_size: int, redundancy: int) -> bool:
        """Whether admission holds: the active groups fill the head buffer and ``width`` more."""
        return active_groups >= (self.width + 1) * batch_size + redundancy

    def step_started(self, trainer_waited: bool, eta: int) -> bool:
        """A training step started; returns whether the lookahead widened (never beyond ``eta``)."""
        costly, self.hold_left_room = trainer_waited and self.hold_left_room, False
        if trainer_waited:
            self._steps_without_wait = 0
            if costly:
                self.width = min(self.width + 1, eta)
            return costly
        self._steps_without_wait += 1
        if self._steps_without_wait >= self.patience:
            self.width = max(self.width - 1, 0)
            self._steps_without_wait = 0
        return False
