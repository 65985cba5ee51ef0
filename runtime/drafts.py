"""Draft tokens by longest suffix match, from a sequence's own tokens and from its siblings' (engine-agnostic).

A proposer takes the longest suffix of a sequence's last tokens (at most ``max_match``) that occurs in
the texts it may read and drafts the up to ``k`` tokens that followed that occurrence (:func:`longest_match`).
The replay that measures acceptance (``app/draft_replay.py``) and the live proposer of a vLLM engine
(``adapters/vllm/sibling_drafts.py``) both draft with it, so what the replay measures is what the engine runs.

:class:`SiblingDrafts` is the live proposer's memory. An engine hands it, every step, the batch's rows
(each a sequence: prompt, then response) and nothing else: no request ids, no prompt lengths (vLLM's
custom proposer interface). It recognises a row it saw before by its length and last tokens (the row
grew by the tokens accepted since), and a row it did not see before as a new request whose prompt is
all but its last token (a request's first drafting step follows its prefill, which samples one token).
Rows of one prompt are siblings: the responses of one group. A row drafts from, in this order, its
siblings' responses (running or finished, the longest first), its own response, then the prompt. A
sequence stays readable after its row leaves the batch (finished, or not scheduled for a step) until
``capacity`` more recently seen sequences push it out.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

#: The longest suffix matched, in tokens (``app/draft_replay.py`` measures with the same default).
MAX_MATCH = 8
#: How many of a row's last tokens (with its length) recognise it from one step to the next.
TAIL = 16


class SuffixIndex:
    """Where each n-gram (``n <= max_match``) of a growing token sequence ends, ascending."""

    def __init__(self, tokens: Sequence[int] = (), max_match: int = MAX_MATCH) -> None:
        self.tokens: list[int] = []
        self.max_match = max_match
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` and index the n-grams that end in them."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        for end in range(start + 1, len(self.tokens) + 1):
            for n in range(1, min(self.max_match, end) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def continuation(self, pattern: tuple[int, ...], readable: int, k: int, near: int | None = None) -> list[int]:
        """The up to ``k`` tokens after an occurrence of ``pattern`` ending before ``readable`` (only the
        first ``readable`` tokens may be read): the last one, or with ``near`` the one ending nearest
        to ``near`` (at or before it on a tie); empty when there is none."""
        ends = self.ends.get(pattern, ())
        i = bisect.bisect_left(ends, readable) - 1
        if i < 0:
            return []
        if near is not None:
            after = bisect.bisect_right(ends, near, 0, i + 1)  # the first occurrence ending after near
            i = after if after <= i and (after == 0 or ends[after] - near < near - ends[after - 1]) else after - 1
        end = ends[i]
        return self.tokens[end : min(end + k, readable)]


#: Where :func:`longest_match` may look: an index, how many of its tokens may be read, and where to look
#: nearest (None: the last occurrence; see :meth:`SuffixIndex.continuation`).
Source = tuple[SuffixIndex, int, int | None]


def longest_match(context: Sequence[int], sources: Sequence[Source], k: int, max_match: int) -> tuple[list[int], int]:
    """The ``k``-token draft for a sequence ending in ``context`` and the position in ``sources`` it
    came from: for the longest suffix of ``context`` first (at most ``max_match`` tokens), the
    continuation in the first source that holds one (module docstring); ``([], -1)`` when no suffix
    occurs anywhere."""
    for n in range(min(max_match, len(context)), 0, -1):
        pattern = tuple(context[len(context) - n :])
        for position, (index, readable, near) in enumerate(sources):
            found = index.continuation(pattern, readable, k, near) if readable else []
            if found:
                return found, position
    return [], -1


@dataclass(eq=False)
class _Group:
    """The sequences of one prompt; ``prompt`` indexes the prompt once for all of them."""

    key: tuple[int, ...]
    prompt: SuffixIndex
    members: list[_Sequence] = field(default_factory=list)


@dataclass(eq=False)
class _Sequence:
    """One request's sequence: ``response`` indexes its response after the prompt's last
    ``max_match - 1`` tokens (so a suffix across the prompt's end matches too); ``key`` is its length
    and last :data:`TAIL` tokens, by which its row is recognised at the next step."""

    group: _Group
    response: SuffixIndex
    key: tuple[int, tuple[int, ...]] = (0, ())


def _key(row: Sequence[int], length: int) -> tuple[int, tuple[int, ...]]:
    return length, tuple(row[max(0, length - TAIL) : length])


class SiblingDrafts:
    """Drafts for a batch's rows from their siblings, their own response and their prompt (module docstring).

    ``lookback``: how many tokens a row may have grown by since it was last seen (more: it counts as
    a new request); ``capacity``: how many sequences are kept, the least recently seen dropped first.
    ``proposed`` counts the draft tokens proposed, ``from_siblings`` those of them from a sibling.
    """

    def __init__(self, lookback: int, capacity: int, max_match: int = MAX_MATCH) -> None:
        if lookback < 1 or capacity < 1 or max_match < 1:
            raise ValueError(f"lookback, capacity and max_match must be >= 1, got {lookback}, {capacity} and {max_match}")
        self.lookback, self.capacity, self.max_match = lookback, capacity, max_match
        self.proposed = 0
        self.from_siblings = 0
        self._groups: dict[tuple[int, ...], _Group] = {}
        self._by_key: dict[tuple[int, tuple[int, ...]], list[_Sequence]] = {}
        self._recent: OrderedDict[int, _Sequence] = OrderedDict()  # id -> sequence, least recently seen first

    def propose(self, rows: Sequence[Sequence[int] | None], k: int) -> list[list[int]]:
        """Record this step's ``rows`` (a row's whole sequence; None: a row that drafts nothing now,
        such as one still in prefill) and draft up to ``k`` tokens for each (``k`` 0: record only)."""
        claimed: set[int] = set()
        tracked = [None if row is None else self._track(row, claimed) for row in rows]
        self._evict()
        drafts: list[list[int]] = []
        for sequence in tracked:
            drafts.append(self._draft(sequence, k) if sequence is not None and k > 0 else [])
        return drafts

    def _track(self, row: Sequence[int], claimed: set[int]) -> _Sequence:
        """The sequence ``row`` continues, grown to the row's length; a new one when none is."""
        length = len(row)
        for before in [*range(length - 1, max(0, length - self.lookback) - 1, -1), length]:  # grown by one first
            for sequence in self._by_key.get(_key(row, before), ()):
                if id(sequence) not in claimed:
                    claimed.add(id(sequence))
                    sequence.response.extend(list(row[before:length]))
                    self._rekey(sequence, _key(row, length))
                    return sequence
        prompt = tuple(row[: length - 1])
        group = self._groups.get(prompt)
        if group is None:
            group = self._groups[prompt] = _Group(prompt, SuffixIndex(prompt, self.max_match))
        boundary = max(0, length - self.max_match)
        sequence = _Sequence(group, SuffixIndex(list(row[boundary:length]), self.max_match))
        group.members.append(sequence)
        claimed.add(id(sequence))
        self._rekey(sequence, _key(row, length))
        return sequence

    def _rekey(self, sequence: _Sequence, key: tuple[int, tuple[int, ...]]) -> None:
        self._unkey(sequence)
        sequence.key = key
        self._by_key.setdefault(key, []).append(sequence)
        self._recent[id(sequence)] = sequence
        self._recent.move_to_end(id(sequence))

    def _unkey(self, sequence: _Sequence) -> None:
        same = self._by_key.get(sequence.key, [])
        if sequence in same:
            same.remove(sequence)
            if not same:
                del self._by_key[sequence.key]

    def _evict(self) -> None:
        while len(self._recent) > self.capacity:
            _, sequence = self._recent.popitem(last=False)
            self._unkey(sequence)
            group = sequence.group
            group.members.remove(sequence)
            if not group.members:
                del self._groups[group.key]

    def _draft(self, sequence: _Sequence, k: int) -> list[int]:
        group, own = sequence.group, sequence.response
        here = len(own.tokens)  # siblings' responses start where this one does: a sibling's text at this position first
        siblings = sorted((m.response for m in group.members if m is not sequence), key=lambda r: -len(r.tokens))
        sources: list[Source] = [(r, len(r.tokens), here) for r in siblings]
        sources += [(own, here, None), (group.prompt, len(group.prompt.tokens), None)]
        draft, source = longest_match(own.tokens[-self.max_match :], sources, k, self.max_match)
        self.proposed += len(draft)
        if 0 <= source < len(siblings):
            self.from_siblings += len(draft)
        return draft
