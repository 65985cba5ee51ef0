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

The index (:class:`SuffixIndex`) is compact, since a reasoning model's responses run to tens of
thousands of tokens and a proposer holds hundreds of them: 16-25 bytes of host memory per token
(``staleflow bench draft-index``; a dict of every 1- to 8-token n-gram, what this began as, held
1.3-1.5 KB). A sequence's tokens are one int32 array; only each position's last two tokens are
indexed, packed into one int64 key (last token high, the one before plus one low, 0 where there is
none) in two numpy arrays sorted by (key, position), so the positions a 2-token suffix ends at form
one contiguous run and those a 1-token suffix ends at another. A longer match is found by comparing
each such candidate's earlier tokens with the context's, up to ``max_match``, in Python for a few
candidates and vectorised for many. Sorting on every token would cost O(n) per token, so new
positions wait in two small dicts (the tail) until there are :data:`_TAIL_MIN` of them or a
sixteenth of the sorted ones (at most :data:`_TAIL_MAX`), then merge into the sorted arrays at once.
Among the occurrences of the longest match the draft follows the last one, or the one nearest a
given position, exactly as the dict did (``tests/test_drafts.py`` checks the two against each other
on random sequences), with one difference no caller meets: a ``readable`` past the sequence's end
counts as its end (the dict could choose an occurrence ending there and draft nothing). Token ids
must lie in ``[0, 2**31 - 1)``. What this costs is the dict's constant-time lookup: the work grows
with how often the context's last two tokens occur (``docs/simulation.md``).
"""

from __future__ import annotations

import bisect
import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: The longest suffix matched, in tokens (``app/draft_replay.py`` measures with the same default).
MAX_MATCH = 8
#: How many of a row's last tokens (with its length) recognise it from one step to the next.
TAIL = 16
#: Up to this many candidate occurrences are compared in Python; more, with numpy.
_SMALL = 16
#: The tail of unsorted positions merges into the sorted arrays at this many, or at a sixteenth of
#: the sorted ones up to :data:`_TAIL_MAX` (each merge copies the arrays: O(n) every n/16 tokens).
_TAIL_MIN, _TAIL_MAX = 64, 1024
_TOKEN_LIMIT = 2**31 - 1

#: Positions a suffix ends at: a list when few, an int32 array when many.
_Ends = list[int] | np.ndarray


def _keys(tokens: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The int64 key of the last two tokens before each of ``ends`` (module docstring)."""
    before = np.where(ends >= 2, tokens[np.maximum(ends - 2, 0)].astype(np.int64) + 1, 0)
    return (tokens[ends - 1].astype(np.int64) << 32) | before


def _pick(ends: _Ends, near: int | None) -> int:
    """The last of ``ends`` (not empty), or with ``near`` the one nearest it (at or before it on a tie)."""
    if isinstance(ends, np.ndarray):  # only the last one at or before near and the first one after it can win
        if near is None:
            return int(ends.max())
        ends = [int(e) for e in (ends[ends <= near].max(initial=-1), ends[ends > near].min(initial=_TOKEN_LIMIT)) if 0 <= e < _TOKEN_LIMIT]
    if near is None:
        return max(ends)
    before = max((e for e in ends if e <= near), default=None)
    after = min((e for e in ends if e > near), default=None)
    return after if after is not None and (before is None or after - near < near - before) else before  # type: ignore[return-value]


class SuffixIndex:
    """A growing token sequence, indexed to find where its suffixes of up to ``max_match`` tokens
    occur (module docstring). ``tokens`` is a read-only view of the sequence."""

    def __init__(self, tokens: Sequence[int] = (), max_match: int = MAX_MATCH) -> None:
        self.max_match = max_match
        self._buffer = np.zeros(0, dtype=np.int32)
        self._length = 0
        self._sorted = 0  # positions 1.._sorted (a position: how many tokens end there) are in the sorted arrays
        self._sorted_keys = np.zeros(0, dtype=np.int64)
        self._sorted_ends = np.zeros(0, dtype=np.int32)
        self._tail1: dict[int, list[int]] = {}  # last token -> the later positions, ascending
        self._tail2: dict[int, list[int]] = {}  # key of the last two tokens -> the later positions, ascending
        self._query = np.zeros(4, dtype=np.int64)  # the keys :meth:`match` looks up
        self.extend(tokens)

    def __len__(self) -> int:
        return self._length

    @property
    def tokens(self) -> np.ndarray:
        view = self._buffer[: self._length]
        view.flags.writeable = False
        return view

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` and index the positions they end (none of them if one is out of range)."""
        added = [operator.index(token) for token in tokens]
        if added and not (0 <= min(added) and max(added) < _TOKEN_LIMIT):
            raise ValueError(f"token ids must lie in [0, {_TOKEN_LIMIT}), got {min(added)}..{max(added)}")
        count, length = len(added), self._length
        if length + count > len(self._buffer):
            grown = np.zeros(max(64, 2 * len(self._buffer), length + count), dtype=np.int32)
            grown[:length] = self._buffer[:length]
            self._buffer = grown
        buffer = self._buffer
        if length - self._sorted + count >= self._tail_limit():  # sort them in at once
            buffer[length : length + count] = added
            self._length += count
            self._merge()
            return
        for token in added:
            buffer[length] = token
            length += 1
            self._tail1.setdefault(token, []).append(length)
            if length >= 2:
                self._tail2.setdefault((token << 32) | (int(buffer[length - 2]) + 1), []).append(length)
        self._length = length

    def _tail_limit(self) -> int:
        return max(_TAIL_MIN, min(_TAIL_MAX, self._sorted // 16))

    def _merge(self) -> None:
        """Sort the tail's positions into the sorted arrays (after the equal keys' positions: all earlier)."""
        ends = np.arange(self._sorted + 1, self._length + 1, dtype=np.int32)
        keys = _keys(self._buffer, ends)
        order = np.argsort(keys, kind="stable")
        keys, ends = keys[order], ends[order]
        at = self._sorted_keys.searchsorted(keys, side="right")
        self._sorted_keys, self._sorted_ends = np.insert(self._sorted_keys, at, keys), np.insert(self._sorted_ends, at, ends)
        self._sorted = self._length
        self._tail1.clear()
        self._tail2.clear()

    def _ends(self, first: int, stop: int, tail: Sequence[int], readable: int) -> _Ends:
        """The positions before ``readable`` among the sorted ones ``first:stop`` and ``tail``'s."""
        ends = self._sorted_ends[first:stop]
        if readable <= self._sorted:  # the tail is past readable
            ends, tail = ends[ends < readable] if stop > first else ends, ()
        elif tail:
            tail = tail[: bisect.bisect_left(tail, readable)]
        if len(ends) + len(tail) > _SMALL:
            return np.concatenate((ends, np.asarray(tail, dtype=np.int32)))
        return ends.tolist() + list(tail)

    def _longest(self, ends: _Ends, context: Sequence[int], limit: int) -> tuple[int, _Ends]:
        """How many of ``context``'s last tokens (2 to ``limit``) the longest match among ``ends`` (which
        match its last two) covers, and the positions where it does; 0 when ``ends`` is empty."""
        if not len(ends):
            return 0, ends
        if isinstance(ends, np.ndarray):  # keep those matching one more token back, while any do
            for n in range(3, limit + 1):
                further = ends[(self._buffer[np.maximum(ends - n, 0)] == context[-n]) & (ends >= n)]
                if not len(further):
                    return n - 1, ends
                ends = further
            return limit, ends
        token = self._buffer.item
        longest, where = 2, []
        for end in ends:
            n = 2
            while n < limit and n < end and token(end - n - 1) == context[-n - 1]:
                n += 1
            if n > longest:
                longest, where = n, [end]
            elif n == longest:
                where.append(end)
        return longest, where

    def match(self, context: Sequence[int], readable: int, near: int | None = None, floor: int = 0) -> tuple[int, int]:
        """The longest suffix of ``context`` (at most ``max_match`` tokens) that occurs ending before
        ``readable`` (only the first ``readable`` tokens may be read), as ``(tokens matched, where the
        chosen occurrence ends)``: the last occurrence, or with ``near`` the one ending nearest to
        ``near`` (at or before it on a tie); ``(0, -1)`` when none is longer than ``floor``. ``context``:
        token ids as Python ints."""
        readable = readable if readable < self._length else self._length
        limit = len(context) if len(context) < self.max_match else self.max_match
        if limit <= floor or readable < 1:
            return 0, -1
        last = context[-1]
        key, one = (last << 32) | (context[-2] + 1 if limit >= 2 else 0), last << 32
        runs = [0] * 4
        if self._sorted:  # where the keys of the last two tokens, and those of the last one, run in the sorted arrays
            query = self._query
            query[0], query[1], query[2], query[3] = key, key + 1, one, one + (1 << 32)
            runs = self._sorted_keys.searchsorted(query).tolist()
        if limit >= 2 and (runs[1] > runs[0] or key in self._tail2):
            longest, ends = self._longest(self._ends(runs[0], runs[1], self._tail2.get(key, ()), readable), context, limit)
            if longest:
                return (longest, _pick(ends, near)) if longest > floor else (0, -1)
        if floor >= 1 or (runs[3] == runs[2] and last not in self._tail1):
            return 0, -1
        ends = self._ends(runs[2], runs[3], self._tail1.get(last, ()), readable)
        return (1, _pick(ends, near)) if len(ends) else (0, -1)

    def continuation(self, pattern: Sequence[int] | np.ndarray, readable: int, k: int, near: int | None = None) -> list[int]:
        """The up to ``k`` tokens after an occurrence of ``pattern`` ending before ``readable``, chosen
        as :meth:`match` chooses; empty when there is none (or ``pattern`` is longer than ``max_match``)."""
        if not 0 < len(pattern) <= self.max_match:
            return []
        matched, end = self.match([int(token) for token in pattern], readable, near, floor=len(pattern) - 1)
        return self._buffer[end : min(end + k, readable)].tolist() if matched else []


#: Where :func:`longest_match` may look: an index, how many of its tokens may be read, and where to look
#: nearest (None: the last occurrence; see :meth:`SuffixIndex.continuation`).
Source = tuple[SuffixIndex, int, int | None]


def longest_match(context: Sequence[int] | np.ndarray, sources: Sequence[Source], k: int, max_match: int) -> tuple[list[int], int]:
    """The ``k``-token draft for a sequence ending in ``context`` and the position in ``sources`` it
    came from: for the longest suffix of ``context`` found (at most ``max_match`` tokens), the
    continuation in the first source that holds one (module docstring); ``([], -1)`` when no suffix
    occurs anywhere."""
    n = min(max_match, len(context))
    if n < 1 or k < 1:
        return [], -1
    suffix = [int(token) for token in context[len(context) - n :]]
    longest, found, draft = 0, -1, []
    for position, (index, readable, near) in enumerate(sources):
        matched, end = index.match(suffix, readable, near, floor=longest) if readable else (0, -1)
        if matched > longest:  # a later source wins only with a longer match
            longest, found, draft = matched, position, index.tokens[end : min(end + k, readable)].tolist()
            if longest == n:
                break
    return draft, found


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
        here = len(own)  # siblings' responses start where this one does: a sibling's text at this position first
        siblings = sorted((m.response for m in group.members if m is not sequence), key=lambda r: -len(r))
        sources: list[Source] = [(r, len(r), here) for r in siblings]
        sources += [(own, here, None), (group.prompt, len(group.prompt), None)]
        draft, source = longest_match(own.tokens[-self.max_match :], sources, k, self.max_match)
        self.proposed += len(draft)
        if 0 <= source < len(siblings):
            self.from_siblings += len(draft)
        return draft
