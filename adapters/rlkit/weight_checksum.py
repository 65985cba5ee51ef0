"""Weight checks comparable across processes: what a tensor-parallel rank's layers compute with its
shard of the weights, compared row by row with the same computed from the trainer's full tensors.

A rank reports, per layer, a *layout* (which rows, ``rows``, or input columns, ``cols``, of which
checkpoint tensors it holds; ``param`` for a tensor checked by value) and its *response*: the layer
applied to a seeded probe ``x`` (:func:`probe`), ``y = W_rank @ x``, one number per output row
(float32 bytes, :func:`reported`). :class:`ExpectedResponses` holds the same computed from the
checkpoint tensors, cast to the rank's dtype, in float64, with each row's rounding tolerance;
:func:`mismatches` compares. Reading
layouts and responses off an engine is the engine binding's part
(:mod:`staleflow.adapters.vllm.weight_checksum`); :class:`VersionReferences` computes each version's
expected responses once, off the send path, for every instance and rank that checks it.

The tolerance of row ``i`` (weights ``w``, ``K`` input columns, products ``t_j = w_j x_j``), for a
dtype of unit roundoff ``u`` (bfloat16 ``2**-8``):

    tol_i = 2 u |y_i|  +  LAMBDA u sqrt(sum t_j**2)  +  K 2**-23 sum |t_j|

The first term is twice the rounding of the output to the dtype; the second covers a kernel that
rounds each product or partial sum to the dtype (round to nearest: independent errors of at most
``u |t|`` each, whose sum passes ``LAMBDA u sqrt(sum t**2)`` with probability below ``2 exp(-LAMBDA**2/2)``,
1e-31 per row, by Hoeffding's inequality); the third is the worst case of float32 accumulation in any
order and rounding mode. So a row of a correct load always passes when the kernel accumulates in
float32 and rounds its output once, and fails with odds below 1e-31 when it rounds more often.
A wrong row (another rank's, a shifted one, another version's) differs by ``d . x``, a normal
variable of deviation ``|d|`` over the probe, and passes only when that lands within about
``2 tol_i``: with unrelated rows of equal norm in bfloat16, probability at most 6.5% at ``K = 1536``
and 13% at 8,960 (measured: 3% and 6%; docs/gpu.md has the figures and the command), and every
wrong row of a shard must pass for the shard to: a shard of 10 wrong rows is missed with
probability below 1e-3, one of 75,968 (half of a 151,936-row ``lm_head``) never.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from staleflow.runtime.interfaces import InstanceLostError

#: Unit roundoff (half the spacing of the numbers at 1) of each dtype a rank may serve in.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: How many deviations of the dtype-level rounding a correct row may be off (false alarm < 1e-31 a row).
LAMBDA = 12.0
#: The relative error of one float32 accumulation step in any rounding mode (truncation included).
ACCUMULATION_EPS = 2.0**-23
#: Elements of a tensor converted at a time while computing its expected responses (bounds the memory).
CHUNK_ELEMENTS = 1 << 22


class WeightChecksumMismatch(InstanceLostError):
    """A rank's weights differ from the trainer's for the version it loaded: the instance cannot serve
    that version, and is treated as lost (its requests recovered elsewhere)."""


def probe(seed: int, size: int) -> torch.Tensor:
    """The seeded probe input of a layer whose checkpoint input size is ``size`` (float32, CPU). The
    seed and size are mixed below 2**32: a CPU generator keeps only the low 32 bits of its seed."""
    mixed = (seed * 1_000_003 + size) % 2**32
    return torch.randn(size, generator=torch.Generator().manual_seed(mixed))


def layer_probe(layout: Mapping[str, Any], seed: int) -> torch.Tensor:
    """The probe a layer of ``layout`` receives on its rank: the whole probe, or its share of the
    input columns for a ``cols`` (row-parallel) layer."""
    x = probe(seed, layout["in"])
    if layout["kind"] == "cols":
        _, start, size = layout["parts"][0]
        x = x[start:start + size]
    return x


def reported(values: torch.Tensor) -> bytes:
    """What a rank reports of a layer's response or a parameter: its values, flattened, as float32
    bytes (exact for float32, bfloat16 and float16; plain bytes cross vLLM's and Ray's messages as
    they are, where a tensor nested in a reply may not)."""
    return values.detach().reshape(-1).to(device="cpu", dtype=torch.float32).numpy().tobytes()


def _response_values(report: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(report), dtype=torch.float32).to(torch.float64)


def rank_dtype(rank: Mapping[str, Any]) -> torch.dtype:
    """The dtype a rank reports serving in (``"torch.bfloat16"``); ValueError for one with no tolerance."""
    dtype = getattr(torch, str(rank["dtype"]).removeprefix("torch."), None)
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"rank {rank.get('rank')} serves in {rank['dtype']!r}: the weight check knows "
                         f"{', '.join(str(d) for d in UNIT_ROUNDOFF)}")
    return dtype  # type: ignore[return-value]


@dataclass(frozen=True)
class Needs:
    """What the ranks' layouts ask of a version's tensors: every row of ``rows`` tensors, the column
    splits ``(name, start, size)`` of ``cols`` ones, the values of ``values`` ones."""

    rows: frozenset[str] = frozenset()
    cols: frozenset[tuple[str, int, int]] = frozenset()
    values: frozenset[str] = frozenset()

    @classmethod
    def of(cls, ranks: Iterable[Mapping[str, Any]]) -> Needs:
        rows, cols, values = set(), set(), set()
        for rank in ranks:
            for entry in rank["entries"]:
                for name, start, size in entry["parts"]:
                    if entry["kind"] == "cols":
                        cols.add((name, int(start), int(size)))
                    else:
                        (rows if entry["kind"] == "rows" else values).add(name)
        rows |= {tied for name in rows if (tied := _tied_name(name)) is not None}  # in case it is tied
        return cls(frozenset(rows), frozenset(cols), frozenset(values))

    def __or__(self, other: Needs) -> Needs:
        return Needs(self.rows | other.rows, self.cols | other.cols, self.values | other.values)

    def __le__(self, other: Needs) -> bool:
        return self.rows <= other.rows and self.cols <= other.cols and self.values <= other.values


def _tied_name(name: str) -> str | None:
    """The tensor a tied ``lm_head`` shares (the input embedding); None for any other name."""
    return "model.embed_tokens.weight" if name.endswith("lm_head.weight") else None


def _row_references(matrix: torch.Tensor, x: torch.Tensor, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's response ``w . x`` and the part of its tolerance that does not scale with it
    (``LAMBDA u |t|_2 + K eps |t|_1``), in float64, a chunk of rows at a time; ``matrix`` and ``x`` are
    in the rank's dtype."""
    width = matrix.shape[1]
    x32 = x.to(device=matrix.device, dtype=torch.float32)
    x64 = x32.to(torch.float64)
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    responses, bases = [], []
    for start in range(0, matrix.shape[0], step):
        rows = matrix[start:start + step].to(torch.float32)  # exact: the dtypes checked fit in float32
        responses.append(rows.to(torch.float64) @ x64)
        l2 = (rows.square() @ x32.square()).sqrt()  # the bounds need no more than float32's precision
        l1 = rows.abs() @ x32.abs()
        bases.append((LAMBDA * u * l2 + width * ACCUMULATION_EPS * l1).to(torch.float64))
    return torch.cat(responses).cpu(), torch.cat(bases).cpu()


@dataclass
class ExpectedResponses:
    """One version's expected responses for one probe seed and dtype: per checkpoint tensor, each
    row's response and tolerance base over all its columns (``rows``), or over a column split
    (``cols``), or its values (``values``)."""

    seed: int
    dtype: torch.dtype
    needs: Needs
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cols: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def compute(cls, tensors: Iterable[tuple[str, torch.Tensor]], seed: int, dtype: torch.dtype, needs: Needs) -> ExpectedResponses:
        """From the version's ``(name, tensor)`` pairs, one at a time (none is kept): what ``needs`` asks."""
        expected = cls(seed, dtype, needs)
        u = UNIT_ROUNDOFF[dtype]
        for name, tensor in tensors:
            asked = name in needs.rows or name in needs.values or any(c[0] == name for c in needs.cols)
            if not asked:
                continue
            values = tensor.detach().to(dtype)
            if name in needs.values:
                expected.values[name] = torch.atleast_1d(values.to(device="cpu", dtype=torch.float64))
            if name in needs.rows:
                expected.rows[name] = _row_references(values, probe(seed, values.shape[1]).to(dtype), u)
            for part, start, size in needs.cols:
                if part == name:
                    x = probe(seed, values.shape[1])[start:start + size].to(dtype)
                    expected.cols[(part, start, size)] = _row_references(values[:, start:start + size], x, u)
        return expected

    def reference(self, entry: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``entry`` (a rank's layer or parameter) should respond, and each row's tolerance."""
        u = UNIT_ROUNDOFF[self.dtype]
        wanted, bases = [], []
        for part, start, size in entry["parts"]:
            if entry["kind"] == "cols":
                response, base = self.cols[(part, int(start), int(size))]
            elif entry["kind"] == "rows":
                response, base = self.rows[self._held(part, self.rows)]
                response, base = response[start:start + size], base[start:start + size]
            else:
                response = self.values[self._held(part, self.values)][start:start + size].reshape(-1)
                base = torch.zeros_like(response)
            wanted.append(response)
            bases.append(base)
        response = torch.cat(wanted)
        return response, 2 * u * response.abs() + torch.cat(bases)

    def _held(self, name: str, table: Mapping[str, Any]) -> str:
        if name in table:
            return name
        tied = _tied_name(name)
        if tied is not None and tied in table:
            return tied
        raise KeyError(f"the trainer's weights hold no tensor {name!r} (a rank's layout names it)")

    def mismatches(self, ranks: Sequence[Mapping[str, Any]]) -> list[str]:
        """Each entry of each rank whose response differs from the expected one beyond its tolerance
        in some row (a non-finite value always does), as ``rank R: NAME: ...``."""
        found = []
        for rank in ranks:
            if rank_dtype(rank) != self.dtype:
                raise ValueError(f"rank {rank['rank']} serves in {rank['dtype']}, these responses are for {self.dtype}")
            for entry in rank["entries"]:
                want, tol = self.reference(entry)
                got = _response_values(entry["response"])
                if got.numel() != want.numel():
                    found.append(f"rank {rank['rank']}: {entry['name']}: {got.numel()} values, the trainer's layer has {want.numel()}")
                    continue
                off = ~((got - want).abs() <= tol)
                if bool(off.any()):
                    i = int(off.nonzero()[0])
                    found.append(f"rank {rank['rank']}: {entry['name']}: {int(off.sum())} of {want.numel()} rows differ "
                                 f"(row {i}: {float(got[i]):.6g}, the trainer's {float(want[i]):.6g} ± {float(tol[i]):.3g})")
        return found


def mismatches(weights: Mapping[str, torch.Tensor], ranks: Sequence[Mapping[str, Any]], seed: int) -> list[str]:
    """Each entry of each rank (their reports after a load) that differs from the trainer's
    ``weights``, probed with ``seed``; empty when every rank holds its shard of ``weights``. A tensor
    a layout names that ``weights`` lacks is a KeyError naming it."""
    if not ranks:
        return []
    expected = ExpectedResponses.compute(weights.items(), seed, rank_dtype(ranks[0]), Needs.of(ranks))
    return expected.mismatches(ranks)


class VersionReferences:
    """The expected responses of the versions a parameter server holds, each computed once per
    version and shared by every instance and rank that checks it.

    ``tensors(version)`` gives a version's ``(name, tensor)`` pairs as sent. The first check shows
    what the instances' layouts need (and that checks are on); from then on each version announced
    by :meth:`prepare` (as it is pushed) is computed in a background thread, one at a time, probed with
    its version number as the seed (the engines' convention), so a check usually finds it ready. A
    check that asks for another seed, dtype or layout has it computed then."""

    def __init__(self, tensors: Callable[[int], Iterable[tuple[str, torch.Tensor]]]) -> None:
        self._tensors = tensors
        self._lock = threading.Lock()
        self._needs: Needs | None = None
        self._dtype: torch.dtype | None = None
        self._computed: dict[tuple[int, int, torch.dtype], Future[ExpectedResponses]] = {}
        # one version at a time: versions pushed faster than computed queue up (a dropped one is skipped)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expected responses")
        self.computations = 0  # versions' responses computed (started), for tests and logs

    def prepare(self, version: int, held: Iterable[int]) -> None:
        """Drop the versions not in ``held``; once a check has run, compute ``version``'s responses
        in the background."""
        keep = set(held)
        with self._lock:
            for key in [k for k in self._computed if k[0] not in keep]:
                self._computed.pop(key).cancel()  # not computed if still queued
            if self._needs is not None and self._dtype is not None:
                self._start(version, version, self._dtype, self._needs)

    def mismatches(self, version: int, ranks: Sequence[Mapping[str, Any]], seed: int) -> list[str]:
        """:meth:`ExpectedResponses.mismatches` of ``ranks`` against ``version`` (waiting for its
        responses if they are being computed); the error of fetching the version if it failed, or
        ``CancelledError`` if the version was dropped before its turn."""
        if not ranks:
            return []
        dtype, needs = rank_dtype(ranks[0]), Needs.of(ranks)
        with self._lock:
            self._needs = needs if self._needs is None else self._needs | needs
            self._dtype = dtype
            future = self._computed.get((version, seed, dtype)) or self._start(version, seed, dtype, self._needs)
        expected = future.result()
        if not needs <= expected.needs:  # computed before these layouts were known: once more, with them
            with self._lock:
                current = self._computed.get((version, seed, dtype))
                future = self._start(version, seed, dtype, self._needs) if current in (None, future) else current
            expected = future.result()
        return expected.mismatches(ranks)

    def _start(self, version: int, seed: int, dtype: torch.dtype, needs: Needs) -> Future[ExpectedResponses]:
        """Queue the computation on the worker thread (under the lock)."""
        future = self._worker.submit(lambda: ExpectedResponses.compute(self._tensors(version), seed, dtype, needs))
        self._computed[(version, seed, dtype)] = future
        self.computations += 1
        return future
