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
group's other responses. The own prefix is searched first, then the siblings in order. The
matching is :func:`staleflow.runtime.drafts.longest_match`, which a vLLM engine's sibling proposer
runs too (``rollout.speculation.method: siblings``), reading the siblings first and, in each, the
occurrence nearest the row's own position rather than the last one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


def replay(own: SuffixIndex, siblings: Sequence[SuffixIndex], k: int, max_match: int, source: str) -> tuple[int, int]:
    """Replay ``own`` with ``k``-token drafts from ``source``: ``(tokens, verification steps)``."""
    x, t, steps = own.tokens, 0, 0
    while t < len(x):
        guess = draft(own, siblings, t, k, max_match, source)
        accepted = 0
        while accepted < len(guess) and t + accepted < len(x) and guess[accepted] == x[t + accepted]:
            accepted += 1
        t = min(len(x), t + accepted + 1)
        steps += 1
    return len(x), steps


@dataclass(frozen=True)
class DraftAcceptance:
    """``tau[source][k - 1]``: tokens per verification step with ``k`` drafts from ``source``, over
    ``groups`` replayed responses of ``tokens`` tokens in all."""

    tau: dict[str, list[float]]
    groups: int
    tokens: int

    def acceptance(self, source: str) -> float:
        """The per-token acceptance rate of the geometric model nearest this source's ``tau(k)``,
        least squares over every ``k`` (:func:`~staleflow.adapters.sim.speculation.fit_acceptance`)."""
        return fit_acceptance(self.tau[source])[0]

    def residual(self, source: str) -> float:
        """The root-mean-square distance (tokens per step) of that fit from this source's ``tau(k)``."""
        return fit_acceptance(self.tau[source])[1]


def measure(groups: Mapping[str, Sequence[Sequence[int]]], max_drafts: int = 8, max_match: int = 8,
            sources: Sequence[str] = SOURCES) -> DraftAcceptance:
    """:class:`DraftAcceptance` of every group with two responses or more (``groups``: id -> the
    group's responses as token ids; a group of one has no siblings and is left out)."""
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown draft source(s) {', '.join(unknown)}; known: {', '.join(SOURCES)}")
    if max_drafts < 1 or max_match < 1:
        raise ValueError(f"max_drafts and max_match must be >= 1, got {max_drafts} and {max_match}")
    replayed = []
    for responses in groups.values():
        if len(responses) < 2:
            continue
        order = sorted(range(len(responses)), key=lambda i: -len(responses[i]))
        indexes = [SuffixIndex(responses[i], max_match) for i in order]
        replayed.append((indexes[0], indexes[1:]))
    if not replayed:
        raise ValueError("no group with two responses or more to replay")
    tau: dict[str, list[float]] = {}
    for source in sources:
        tau[source] = []
        for k in range(1, max_drafts + 1):
            done = [replay(own, siblings, k, max_match, source) for own, siblings in replayed]
            tau[source].append(sum(t for t, _ in done) / max(1, sum(s for _, s in done)))
    return DraftAcceptance(tau=tau, groups=len(replayed), tokens=sum(len(own.tokens) for own, _ in replayed))
