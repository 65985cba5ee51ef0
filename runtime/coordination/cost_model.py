"""The decode cost model of one rollout instance (paper section 5.3, Appendix B).

A decode step of ``n`` running requests with ``K`` tokens resident in the KV cache takes

    L(n, K) = a_b + a_k * K + max(thr, o_b + o_k * n)      seconds

(attention: a base plus a term linear in the KV tokens it reads; the other kernels, matmuls above
all: memory-bound, hence flat, up to a batch size, then linear in ``n``). Every running request
gains one token per step, so the instance produces ``T(n, K) = n / L(n, K)`` tokens per second.

Coefficients come from profiles: :func:`fit_cost_model` fits them by least squares to records of
``(n, K, latency)`` and reports the mean relative error (the paper reports 10.5%).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

COEFFICIENTS = ("thr", "o_b", "o_k", "a_b", "a_k")


@dataclass(frozen=True)
class CostModel:
    """Per-step decode latency ``L(n, K) = a_b + a_k*K + max(thr, o_b + o_k*n)`` of one instance.

    Args:
        thr: floor of the non-attention latency (s): the memory-bound regime of small batches.
        o_b: base of the non-attention latency once compute-bound (s).
        o_k: non-attention latency per running request (s).
        a_b: base attention latency (s).
        a_k: attention latency per KV-cache token (s).
    """

    thr: float
    o_b: float
    o_k: float
    a_b: float
    a_k: float

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"cost model coefficient {name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"cost model coefficient {name} must be >= 0, got {value}")
        if self.step_latency(1, 0) <= 0:
            raise ValueError("cost model gives a zero step latency: set thr, o_b, o_k or a_b above 0")

    def with_error(self, error: float, seed: int) -> CostModel:
        """This model as a planner would know it: each coefficient off by a seeded factor
        ``1 + error * z`` (``z`` standard normal, clipped to +-2), e.g. ``error=0.1`` for the ~10%
        estimation error the paper measured. ``error=0`` returns the model unchanged."""
        if not 0 <= error < 0.5:
            raise ValueError(f"estimation error must be in [0, 0.5), got {error}")
        if error == 0:
            return self
        rng = random.Random(f"staleflow-cost-error/{seed}")
        factors = {name: 1 + error * max(-2.0, min(2.0, rng.gauss(0.0, 1.0))) for name in COEFFICIENTS}
        return CostModel(**{name: getattr(self, name) * factors[name] for name in COEFFICIENTS})

    def step_latency(self, n_running: float, kv_tokens: float) -> float:
        """Seconds per decode step of ``n_running`` requests holding ``kv_tokens`` KV-cache tokens."""
        return self.a_b + self.a_k * kv_tokens + max(self.thr, self.o_b + self.o_k * n_running)

    def decode_seconds(self, steps: int, n_running: int, kv_tokens: int) -> float:
        """Seconds for ``steps`` decode steps of a fixed running set that starts at ``kv_tokens``
        (each step adds ``n_running`` KV tokens): ``s*L(n, K) + a_k*n*s*(s-1)/2`` in closed form."""
        return steps * self.step_latency(n_running, kv_tokens) + self.a_k * n_running * steps * (steps - 1) / 2

    def steps_within(self, budget_s: float, n_running: int, kv_tokens: int, limit: int) -> int:
        """The most decode steps (<= ``limit``) of a fixed running set that end within ``budget_s``
        (the root of :meth:`decode_seconds`' quadratic, corrected by a step either way for rounding)."""
        base = self.step_latency(n_running, kv_tokens)
        half = self.a_k * n_running / 2
        if half == 0:
            steps = int(budget_s // base)
        else:
            b = base - half
            steps = int((-b + math.sqrt(b * b + 4 * half * budget_s)) / (2 * half))
        steps = max(0, min(steps, limit))
        while steps < limit and (steps + 1) * base + half * (steps + 1) * steps <= budget_s:
            steps += 1
        while steps > 0 and steps * base + half * steps * (steps - 1) > budget_s:
            steps -= 1
        return steps

    def throughput(self, n_running: float, kv_tokens: float) -> float:
        """Decode tokens per second: ``n / L(n, K)`` (0 for an empty instance)."""
        if n_running <= 0:
            return 0.0
        return n_running / self.step_latency(n_running, kv_tokens)

    def to_dict(self) -> dict[str, float]:
        return {name: float(value) for name, value in asdict(self).items()}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "cost model") -> CostModel:
        """Build from ``{thr, o_b, o_k, a_b, a_k}``; a missing or unknown key is an error naming it."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a mapping of {', '.join(COEFFICIENTS)}, got {type(data).__name__}")
        missing = [name for name in COEFFICIENTS if name not in data]
        unknown = sorted(set(data) - set(COEFFICIENTS))
        if missing or unknown:
            problems = []
            if missing:
                problems.append(f"missing {', '.join(missing)}")
            if unknown:
                problems.append(f"unknown key(s) {', '.join(map(str, unknown))}")
            raise ValueError(f"{source}: {'; '.join(problems)} (expected {', '.join(COEFFICIENTS)})")
        return cls(**{name: data[name] for name in COEFFICIENTS})

    def save(self, path: str | Path) -> None:
        """Write the coefficients as YAML (``.yaml``/``.yml``) or JSON (anything else)."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read coefficients written by :meth:`save` (YAML or JSON, chosen by the suffix)."""
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.from_mapping(data, source=str(path))


@dataclass(frozen=True)
class ProfileRecord:
    """One measured decode step: ``n`` running requests, ``kv_tokens`` resident, ``latency`` seconds."""

    n: int
    kv_tokens: int
    latency: float


@dataclass(frozen=True)
class FitReport:
    """How well a fitted cost model matches its profile records (relative errors of latency)."""

    records: int
    mean_relative_error: float
    max_relative_error: float
    rms_relative_error: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _as_record(item: Any, index: int) -> ProfileRecord:
    if isinstance(item, ProfileRecord):
        record = item
    elif isinstance(item, Mapping):
        try:
            record = ProfileRecord(int(item["n"]), int(item["kv_tokens"]), float(item["latency"]))
        except KeyError as exc:
            raise ValueError(f"profile record {index}: missing key {exc.args[0]!r} (need n, kv_tokens, latency)") from None
    else:
        try:
            n, kv, latency = item
        except (TypeError, ValueError):
            raise ValueError(f"profile record {index}: expected (n, kv_tokens, latency), got {item!r}") from None
        record = ProfileRecord(int(n), int(kv), float(latency))
    if record.n < 1 or record.kv_tokens < 0 or not (record.latency > 0 and math.isfinite(record.latency)):
        raise ValueError(f"profile record {index}: need n >= 1, kv_tokens >= 0, latency > 0; got {record}")
    return record


def fit_cost_model(records: Iterable[ProfileRecord | Mapping[str, Any] | Sequence[float]]) -> tuple[CostModel, FitReport]:
    """Fit ``thr, o_b, o_k, a_b, a_k`` to measured step latencies by least squares on relative error.

    The ``max`` makes the model piecewise linear in ``n``; we fit it with scipy's bounded
    ``least_squares`` (all coefficients ``>= 0``) from several starting breakpoints and keep the best.
    Only ``a_b + thr`` and ``a_b + o_b`` are identifiable (one is paid below the breakpoint, the
    other above), so the fit returns the canonical form in which ``min(thr, o_b) = 0``: the shared
    base sits in ``a_b``. Needs at least 5 records.
    """
    import numpy as np
    from scipy.optimize import least_squares

    rows = [_as_record(item, i) for i, item in enumerate(records)]
    if len(rows) < len(COEFFICIENTS):
        raise ValueError(f"need at least {len(COEFFICIENTS)} profile records to fit the cost model, got {len(rows)}")
    n = np.array([r.n for r in rows], dtype=float)
    kv = np.array([r.kv_tokens for r in rows], dtype=float)
    latency = np.array([r.latency for r in rows], dtype=float)

    def predict(p: Any) -> Any:
        thr, o_b, o_k, a_b, a_k = p
        return a_b + a_k * kv + np.maximum(thr, o_b + o_k * n)

    def residual(p: Any) -> Any:
        return (predict(p) - latency) / latency

    # Starting points: a plain linear fit (no floor), then floors at several quantiles of n.
    design = np.column_stack([np.ones_like(n), n, kv])
    (base, per_n, per_kv), *_ = np.linalg.lstsq(design, latency, rcond=None)
    base, per_n, per_kv = max(base, 1e-6), max(per_n, 0.0), max(per_kv, 0.0)
    scale = np.array([latency.mean(), latency.mean(), latency.mean() / max(n.mean(), 1.0),
                      latency.mean(), latency.mean() / max(kv.mean(), 1.0)])
    best = None
    for q in (0.0, 0.1, 0.25, 0.5, 0.75):
        n_star = float(np.quantile(n, q))
        start = np.array([base + per_n * n_star, 0.0, per_n, base, per_kv])
        fit = least_squares(residual, start, bounds=(0.0, np.inf), x_scale=scale, method="trf")
        if best is None or fit.cost < best.cost:
            best = fit
    assert best is not None
    thr, o_b, o_k, a_b, a_k = (float(v) for v in best.x)
    shared = min(thr, o_b)
    model = CostModel(thr=thr - shared, o_b=o_b - shared, o_k=o_k, a_b=a_b + shared, a_k=a_k)
    rel = np.abs(residual(best.x))
    report = FitReport(
        records=len(rows),
        mean_relative_error=float(rel.mean()),
        max_relative_error=float(rel.max()),
        rms_relative_error=float(np.sqrt((rel**2).mean())),
    )
    return model, report


def load_profile_records(path: str | Path) -> list[ProfileRecord]:
    """Read profile records from JSON lines (``{"n", "kv_tokens", "latency"}`` per line), a JSON
    list of such objects, or a CSV file with the header ``n,kv_tokens,latency``."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        header = set(reader.fieldnames or ())
        missing = {"n", "kv_tokens", "latency"} - header
        if missing:
            raise ValueError(f"{path}: CSV header lacks {', '.join(sorted(missing))} (need n,kv_tokens,latency)")
        return [_as_record(row, i) for i, row in enumerate(reader)]
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            items = json.loads(text)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON lines or a JSON list of profile records ({exc})") from None
    return [_as_record(item, i) for i, item in enumerate(items)]


def fit_cost_model_file(path: str | Path) -> tuple[CostModel, FitReport]:
    """Fit the cost model to the profile records in ``path`` (see :func:`load_profile_records`)."""
    return fit_cost_model(load_profile_records(path))


__all__ = [
    "COEFFICIENTS",
    "CostModel",
    "FitReport",
    "ProfileRecord",
    "fit_cost_model",
    "fit_cost_model_file",
    "load_profile_records",
]
