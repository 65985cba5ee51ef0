"""Run-length token lists for simulated trajectories.

A simulated response of 40,000 tokens has one token id, one log-prob and a handful of versions:
materialising three 40,000-element lists per response would cost more than the rest of the
simulation. :class:`RunLengthList` stores ``(value, count)`` runs and behaves as a read-only list
(``len``, indexing, slicing, iteration, ``==`` with lists, ``+``), so the runtime, which only reads
token lists, cannot tell the difference; ``len`` is O(1) and ``count`` O(runs) (the run loop counts
the trajectories more than one version sampled with it, never walking their tokens).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload


class RunLengthList(Sequence[Any]):
    """An immutable sequence stored as runs of equal values."""

    __slots__ = ("_ends", "_values")

    def __init__(self, runs: Iterable[tuple[Any, int]] = ()) -> None:
        self._values: list[Any] = []
        self._ends: list[int] = []
        self._append(runs)

    @classmethod
    def of(cls, items: Sequence[Any]) -> RunLengthList:
        """The runs of an ordinary sequence (a no-op for a :class:`RunLengthList`)."""
        if type(items) is RunLengthList:
            return items
        return cls((value, len(list(group))) for value, group in itertools.groupby(items))

    @classmethod
    def extended(cls, prefix: Sequence[Any], runs: Iterable[tuple[Any, int]]) -> RunLengthList:
        """``prefix`` followed by ``runs`` (cheap when ``prefix`` is empty or run-length already:
        its runs are taken as they are, the new ones appended to copies of them)."""
        if not prefix:
            return cls(runs)
        base = cls.of(prefix)
        new = cls.__new__(cls)
        new._values, new._ends = list(base._values), list(base._ends)
        new._append(runs)
        return new

    def _append(self, runs: Iterable[tuple[Any, int]]) -> None:
        """Add ``runs`` at the end (building only: the list is immutable once made)."""
        values, ends = self._values, self._ends
        total = ends[-1] if ends else 0
        for value, count in runs:
            if count < 0:
                raise ValueError(f"run length must be >= 0, got {count}")
            if count == 0:
                continue
            total += count
            if values and values[-1] == value:
                ends[-1] = total
            else:
                values.append(value)
                ends.append(total)

    def runs(self) -> list[tuple[Any, int]]:
        starts = [0, *self._ends[:-1]]
        return [(v, end - start) for v, start, end in zip(self._values, starts, self._ends)]

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("RunLengthList index out of range")
        return self._values[bisect.bisect_right(self._ends, index)]

    def __iter__(self) -> Iterator[Any]:
        for value, count in self.runs():
            yield from itertools.repeat(value, count)

    def count(self, value: Any) -> int:
        """How many items equal ``value``, from the runs (no item is walked)."""
        starts = [0, *self._ends[:-1]]
        return sum(end - start for v, start, end in zip(self._values, starts, self._ends) if v == value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunLengthList):
            return self._values == other._values and self._ends == other._ends
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other: Sequence[Any]) -> RunLengthList:
        return RunLengthList([*self.runs(), *RunLengthList.of(other).runs()])

    def __radd__(self, other: Sequence[Any]) -> RunLengthList:
        return RunLengthList([*RunLengthList.of(other).runs(), *self.runs()])

    def __repr__(self) -> str:
        return f"RunLengthList({self.runs()!r})"

    __hash__ = None  # type: ignore[assignment]
