"""Tokens per speculative step, measured by replaying recorded samples: ``tau(k)`` for each draft source.

With a deterministic draft ``d`` of ``k`` tokens, speculative sampling accepts its first ``j``
tokens with the probability that the model samples ``d_1..d_j`` itself; a recorded sample was
drawn from the model, so counting how many draft tokens equal the recorded ones while replaying it
estimates the acceptance without bias, at the temperature the sample was drawn at.

The replay walks a response ``x`` position by position. At position ``t`` the proposer takes the
longest suffix of ``x[:t]`` (at most ``max_match`` tokens) that occurs in the text it may read and
drafts the ``k`` tokens that followed its most recent occurrence there (fewer where that text ends);
the step emits the ``j`` draft tokens that equal ``x[t:t+j]`` and one token of the model's own
(``j + 1``, capped at the end of ``x``). ``tau(k)`` is tokens over steps, summed over the replayed
responses. What the proposer may read at ``t`` (:data:`SOURCES`):

* ``request``: the response's own tokens before ``t`` (vLLM's n-gram and suffix proposers);
* ``causal``: also each sibling's first ``t`` tokens (the group's responses start together and
  decode a token a step each: what a grouped proposer has at that moment);
* ``finished``: also, whole, the siblings shorter than ``t`` (finished by then), but nothing of the
  ones still running;
* ``whole``: also every sibling whole (an upper bound: no proposer has them all).

Each group's longest response is replayed (the tail the trainer waits for), its siblings the
group's other responses (or, ``replayed="all"``, every response in turn). The own prefix is
searched first, then the siblings in order. ``tau(k)`` is also split by where in its response a
step starts (position buckets) and by the replayed response's length (quartiles): whether acceptance
varies between requests, the only case where drafting more for some requests than for others can
pay (docs/simulation.md). The matching is :func:`staleflow.runtime.drafts.longest_match`, which a vLLM engine's sibling proposer
runs too (``rollout.speculation.method: siblings``), reading the siblings first and, in each, the
occurrence nearest the row's own position rather than the last one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from staleflow.adapters.sim.speculation import fit_acceptance
from staleflow.runtime.drafts import SuffixIndex, longest_match

SOURCES = ("request", "causal", "finished", "whole")


def _readable(source: str, sibling_length: int, t: int) -> int:
    """How many of a sibling's tokens the proposer may read at position ``t`` under ``source``."""
    if source == "causal":
        return min(t, sibling_length)
    if source == "finished":
        return sibling_length if sibling_length < t else 0
    return sibling_length if source == "whole" else 0


def draft(own: SuffixIndex, siblings: Sequence[SuffixIndex], t: int, k: int, max_match: int, source: str) -> list[int]:
    """The proposer's ``k``-token draft at position ``t`` of ``own`` (module docstring)."""
    sources = [(own, t, None)] + [(sibling, _readable(source, len(sibling.tokens), t), None) for sibling in siblings]
    return longest_match(own.tokens[max(0, t - max_match) : t], sources, k, max_match)[0]


def replay(own: SuffixIndex, siblings: Sequence[SuffixIndex], k: int, max_match: int, source: str) -> np.ndarray:
    """Replay ``own`` with ``k``-token drafts from ``source``: one row per verification step, the
    position it starts at and the tokens it emits (they sum to ``len(own)``)."""
    x, t, steps = own.tokens, 0, []
    while t < len(x):
        guess = draft(own, siblings, t, k, max_match, source)
        accepted = 0
        while accepted < len(guess) and t + accepted < len(x) and guess[accepted] == x[t + accepted]:
            accepted += 1
        emitted = min(len(x) - t, accepted + 1)
        steps.append((t, emitted))
        t += emitted
    return np.array(steps, dtype=np.int64).reshape(-1, 2)


def _fit(tau: Sequence[float]) -> float:
    return fit_acceptance(tau)[0]


@dataclass(frozen=True)
class Bucket:
    """The replayed steps of one slice of the responses: ``tau[source][k - 1]`` over the steps that
    start in it, which emit ``tokens`` tokens (the same for every ``k`` and source)."""

    label: str
    tokens: int
    tau: dict[str, list[float]]

    def acceptance(self, source: str) -> float:
        """The geometric fit of this slice's ``tau(k)`` (:meth:`DraftAcceptance.acceptance`)."""
        return _fit(self.tau[source])


@dataclass(frozen=True)
class DraftAcceptance:
    """``tau[source][k - 1]``: tokens per verification step with ``k`` drafts from ``source``, over
    ``groups`` groups' replayed responses of ``tokens`` tokens in all; the same by where in its
    response a step starts (``by_position``) and by how long the response ends up (``by_length``:
    the quartiles of the replayed responses' lengths)."""

    tau: dict[str, list[float]]
    groups: int
    tokens: int
    by_position: list[Bucket] = field(default_factory=list)
    by_length: list[Bucket] = field(default_factory=list)

    def acceptance(self, source: str) -> float:
        """The per-token acceptance rate of the geometric model nearest this source's ``tau(k)``,
        least squares over every ``k`` (:func:`~staleflow.adapters.sim.speculation.fit_acceptance`)."""
        return _fit(self.tau[source])

    def residual(self, source: str) -> float:
        """The root-mean-square distance (tokens per step) of that fit from this source's ``tau(k)``."""
        return fit_acceptance(self.tau[source])[1]


#: Where the position buckets of :func:`measure` start, in tokens of the response before a step.
POSITION_EDGES = (0, 256, 1024, 2048, 4096)
#: Which responses :func:`measure` replays: each group's longest (the tail the trainer waits for), or every one.
REPLAYED = ("longest", "all")


def _label(edges: Sequence[int], i: int) -> str:
    return f"{edges[i]}-{edges[i + 1]}" if i + 1 < len(edges) else f"{edges[i]}+"


def _buckets(steps: Mapping[str, list[list[np.ndarray]]], slot: Callable[[int, np.ndarray], np.ndarray],
             labels: Sequence[str]) -> list[Bucket]:
    """Per ``labels[i]``, ``tau(k)`` over the steps whose ``slot(response, steps)`` is ``i``; empty slices left out."""
    sums: dict[str, list[np.ndarray]] = {}
    counts: dict[str, list[np.ndarray]] = {}
    for source, by_k in steps.items():
        sums[source], counts[source] = [], []
        for per_response in by_k:
            emitted, stepped = np.zeros(len(labels)), np.zeros(len(labels))
            for r, rows in enumerate(per_response):
                at = slot(r, rows)
                emitted += np.bincount(at, weights=rows[:, 1], minlength=len(labels))
                stepped += np.bincount(at, minlength=len(labels))
            sums[source].append(emitted)
            counts[source].append(stepped)
    first = next(iter(sums))
    return [Bucket(label, int(sums[first][0][i]), {s: [float(e[i] / c[i]) for e, c in zip(sums[s], counts[s])] for s in sums})
            for i, label in enumerate(labels) if counts[first][0][i]]


def measure(groups: Mapping[str, Sequence[Sequence[int]]], max_drafts: int = 8, max_match: int = 8,
            sources: Sequence[str] = SOURCES, position_edges: Sequence[int] = POSITION_EDGES,
            replayed: str = "longest") -> DraftAcceptance:
    """:class:`DraftAcceptance` of every group with two responses or more (``groups``: id -> the
    group's responses as token ids; a group of one has no siblings and is left out). ``replayed``:
    each group's longest response, its siblings the others (module docstring), or every response in
    turn against the rest of its group; ``position_edges``: where the position buckets start."""
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown draft source(s) {', '.join(unknown)}; known: {', '.join(SOURCES)}")
    if max_drafts < 1 or max_match < 1:
        raise ValueError(f"max_drafts and max_match must be >= 1, got {max_drafts} and {max_match}")
    if replayed not in REPLAYED:
        raise ValueError(f"replayed must be one of {', '.join(REPLAYED)}, got {replayed!r}")
    if not position_edges or position_edges[0] != 0 or list(position_edges) != sorted(set(position_edges)):
        raise ValueError(f"position_edges must rise from 0, got {list(position_edges)}")
    pairs, groups_kept = [], 0
    for responses in groups.values():
        if len(responses) < 2:
            continue
        groups_kept += 1
        order = sorted(range(len(responses)), key=lambda i: -len(responses[i]))
        indexes = [SuffixIndex(responses[i], max_match) for i in order]
        pairs += [(own, indexes[:i] + indexes[i + 1:]) for i, own in enumerate(indexes[: 1 if replayed == "longest" else None])]
    if not pairs:
        raise ValueError("no group with two responses or more to replay")
    steps = {source: [[replay(own, siblings, k, max_match, source) for own, siblings in pairs] for k in range(1, max_drafts + 1)]
             for source in sources}
    lengths = np.array([len(own) for own, _ in pairs])
    quartiles = sorted(set(np.quantile(lengths, [0.25, 0.5, 0.75], method="lower").astype(int).tolist()))
    length_edges = [0] + [q + 1 for q in quartiles if q + 1 <= lengths.max()]  # a quartile's upper edge is a length in it
    whole = _buckets(steps, lambda r, rows: np.zeros(len(rows), dtype=np.int64), ["all"])[0]
    position_labels = [_label(position_edges, i) for i in range(len(position_edges))]
    length_labels = [f"{low}-{high - 1}" for low, high in zip(length_edges, length_edges[1:] + [int(lengths.max()) + 1])]
    return DraftAcceptance(
        tau=whole.tau, groups=groups_kept, tokens=whole.tokens,
        by_position=_buckets(steps, lambda r, rows: np.searchsorted(position_edges, rows[:, 0], side="right") - 1, position_labels),
        by_length=_buckets(steps, lambda r, rows: np.full(len(rows), np.searchsorted(length_edges, lengths[r], side="right") - 1),
                           length_labels))
