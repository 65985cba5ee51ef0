"""The response lengths seen so far, and what they say of a response still generating.

:class:`LengthModel` keeps the output lengths of the last ``window`` finished responses (the run
loop reports them as :class:`~staleflow.runtime.coordination.observations.RequestsLeft`) and answers
the one question routing and the tail moves ask: how many more tokens a response that has
generated ``g`` tokens is expected to add, ``E[L - g | L > g]`` over the lengths seen. Where fewer
than ``tail_samples`` seen lengths exceed ``g`` (a response longer than nearly all seen so far), the
mean of the ``tail_samples`` longest stands in for ``E[L | L > g]`` (floored at 0 remaining tokens):
the estimate never rests on one or two samples.

It knows only finished responses: early in a run the long ones are still generating, so it
underestimates until they finish (no censoring correction). Until ``warmup`` lengths are seen it is
not :attr:`~LengthModel.ready` and nothing plans with it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

#: the sorted lengths are rebuilt after this many new ones (until then the answers use the older sort)
RESORT_EVERY = 64


class LengthModel:
    """Output lengths of finished responses and the conditional expectation of the rest (module docstring)."""

    def __init__(self, window: int = 4096, tail_samples: int = 16, warmup: int = 32) -> None:
        if tail_samples < 1 or warmup < tail_samples or window < warmup:
            raise ValueError("need 1 <= tail_samples <= warmup <= window")
        self._seen = np.zeros(window)  # a ring: length ``i`` seen is at ``i % window``
        self.observed = 0  # lengths seen in all (the window keeps the last ``window``)
        self._tail = tail_samples
        self._warmup = warmup
        self._sorted: np.ndarray | None = None  # the seen lengths sorted (None: to rebuild)
        self._sorted_at = 0  # :attr:`observed` when ``_sorted`` was built
        self._suffix = np.zeros(1)  # _suffix[i]: the sum of _sorted[i:]

    def observe(self, lengths: Iterable[int]) -> None:
        """Responses finished with these output lengths."""
        seen, window, before = self._seen, len(self._seen), self.observed
        for length in lengths:
            seen[self.observed % window] = length
            self.observed += 1
        if self.observed > before:
            if self._sorted is None or self.observed - self._sorted_at >= RESORT_EVERY:
                self._sorted = None

    @property
    def ready(self) -> bool:
        """Whether enough lengths were seen to plan with (``warmup``)."""
        return min(self.observed, len(self._seen)) >= self._warmup

    def expected_remaining(self, generated: np.ndarray) -> np.ndarray:
        """``E[L - g | L > g]`` for each ``g`` of ``generated`` (module docstring); 0 where not :attr:`ready`."""
        generated = np.asarray(generated, dtype=np.float64)
        if not self.ready:
            return np.zeros_like(generated)
        lengths = self._lengths()
        n = len(lengths)
        above = np.minimum(np.searchsorted(lengths, generated, side="right"), n - self._tail)
        mean_above = self._suffix[above] / (n - above)
        return np.maximum(mean_above - generated, 0.0)

    def _lengths(self) -> np.ndarray:
        if self._sorted is None:
            self._sorted = np.sort(self._seen[: min(self.observed, len(self._seen))])
            self._sorted_at = self.observed
            self._suffix = np.concatenate([np.cumsum(self._sorted[::-1])[::-1], [0.0]])
        return self._sorted
