"""What a training run records: per-step metrics (JSON lines, TensorBoard), a progress bar, and the
rollout instances' timelines (versions, load, weight syncs, where partial rollouts resumed).

Files in the run directory:

``metrics.jsonl``
    one object per line: ``{"kind": "step", "step": ..., ...}`` for training steps,
    ``{"kind": "eval", ...}`` for evaluations, ``{"kind": "checkpoint", ...}``.
``instances.jsonl``
    the instances' snapshots as the run loop took them (``t``, ``instance``, ``version``,
    ``running``, ``waiting``, ``kv_tokens``, ``tokens_per_s``, ``loading``), at most one per
    instance every ``interval_s`` seconds.
``tensorboard/``
    the step and eval scalars, when TensorBoard is on.
``wandb/``
    the same scalars for Weights & Biases (``metrics.wandb.project`` set; ``train/...`` and
    ``eval/...`` keys at the training step), offline runs for a later ``wandb sync``.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from staleflow.runtime.coordination.cost_model import ProfileRecord
from staleflow.runtime.interfaces import RolloutEngine
from staleflow.runtime.types import InstanceSnapshot, RolloutRequest, Trajectory

METRICS_FILE = "metrics.jsonl"
INSTANCES_FILE = "instances.jsonl"


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Appends records to ``metrics.jsonl`` and scalars to TensorBoard; drives a rich progress bar.

    ``append=True`` continues the files of a resumed run.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        tensorboard: bool,
        progress: bool,
        append: bool = False,
        wandb: Mapping[str, Any] | None = None,
        wandb_config: Mapping[str, Any] | None = None,
    ) -> None:
        self._file = open(run_dir / METRICS_FILE, "a" if append else "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the run
        self._wandb = _start_wandb(run_dir, wandb, wandb_config, append) if wandb else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._progress = None
        self._task = None
        if progress:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}"),
                TextColumn("tok/s {task.fields[tps]}"),
                TextColumn("staleness {task.fields[staleness]}"),
                TextColumn("v {task.fields[versions]}"),
                TimeElapsedColumn(),
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, reward="-", tps="-", staleness="-", versions="-")

    def step(self, step: int, metrics: Mapping[str, Any], *, versions: Sequence[int] = ()) -> None:
        """Record training step ``step`` (1-based) and move the progress bar."""
        self._write({"kind": "step", "step": step, **metrics})
        self._scalars("train", step, metrics)
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                completed=step,
                reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                tps=f"{metrics.get('tokens_per_s', 0.0):.0f}",
                staleness=_histogram_text(metrics.get("group_staleness", {})),
                versions="/".join(str(v) for v in versions) or "-",
            )

    def eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._write({"kind": "eval", "step": step, **metrics})
        self._scalars("eval", step, metrics)
        if self._progress is not None:
            self._progress.console.log(
                f"eval at step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float))
            )

    def event(self, kind: str, **fields: Any) -> None:
        self._write({"kind": kind, **fields})
        if self._progress is not None:
            self._progress.console.log(f"{kind}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")

    def _scalars(self, prefix: str, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = {
            f"{prefix}/{key}": value
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=step)


def _start_wandb(run_dir: Path, settings: Mapping[str, Any], config: Mapping[str, Any] | None, append: bool) -> Any:
    """A W&B run for ``run_dir`` (``settings``: project, mode, entity, name); a resumed run continues
    the same W&B run (its id is kept in ``run_dir/wandb-run-id``)."""
    import secrets

    import wandb

    id_file = run_dir / "wandb-run-id"
    run_id = id_file.read_text().strip() if append and id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id)
    return wandb.init(
        project=settings["project"],
        entity=settings.get("entity"),
        name=settings.get("name") or run_dir.name,
        mode=settings.get("mode", "offline"),
        dir=str(run_dir),
        id=run_id,
        resume="allow",
        config=dict(config or {}),
    )


def _histogram_text(histogram: Mapping[Any, int]) -> str:
    if not histogram:
        return "-"
    return " ".join(f"{s}:{n}" for s, n in sorted(histogram.items(), key=lambda kv: int(kv[0])))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (an empty list if there is none)."""
    file = run_dir / METRICS_FILE
    if not file.is_file():
        return []
    return [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]


class TrackedEngine:
    """A :class:`RolloutEngine` wrapper that records weight syncs and where partials resume.

    A request interrupted on one instance and later submitted with output to *another* instance
    counts as ``resumed_elsewhere``; ``sync_seconds`` sums the time spent in ``load_weights``.
    The ledger is shared by all the wrapped engines of a run. ``instance_id`` names an engine
    that does not carry its own (a Ray proxy created without waiting for the actor).
    """

    def __init__(self, engine: RolloutEngine, ledger: EngineLedger, instance_id: str | None = None) -> None:
        self._engine = engine
        self._ledger = ledger
        self.instance_id = instance_id if instance_id is not None else engine.instance_id

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        self._ledger.submitted(self.instance_id, requests)
        self._engine.submit(requests)

    def interrupt(self, request_ids: Sequence[str]) -> list[RolloutRequest]:
        partials = self._engine.interrupt(request_ids)
        self._ledger.interrupted(self.instance_id, partials)
        return partials

    def abort(self, request_ids: Sequence[str]) -> None:
        self._engine.abort(request_ids)

    def load_weights(self, version: int, weights: Any, broadcast: bool = False) -> None:
        started = time.perf_counter()
        self._engine.load_weights(version, weights, broadcast)
        self._ledger.synced(self.instance_id, version, time.perf_counter() - started)

    def snapshot(self) -> InstanceSnapshot:
        snap = self._engine.snapshot()
        self._ledger.observed(snap)
        return snap

    def collect(self) -> list[Trajectory]:
        return self._engine.collect()

    def decode_steps(self) -> list[ProfileRecord]:
        return self._engine.decode_steps()

    def next_event_time(self) -> float | None:
        return self._engine.next_event_time()

    def close(self) -> None:
        self._engine.close()


class EngineLedger:
    """Counts shared by :class:`TrackedEngine` wrappers (thread-safe), and the instance timeline.

    The timeline records the snapshots the run loop takes anyway (no extra snapshot calls, which
    would disturb the engines' throughput windows), at most one per instance per ``interval_s``
    of the snapshots' own clock plus every version change, into ``timeline_path``
    (``instances.jsonl``). It also tracks
    how far apart the instances' versions were (``max_version_spread``).
    """

    def __init__(self, timeline_path: Path | None = None, interval_s: float = 0.1, append: bool = False) -> None:
        self._lock = threading.Lock()
        self._timeline = None if timeline_path is None else open(timeline_path, "a" if append else "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the run
        self._interval = interval_s
        self._last_written: dict[str, float] = {}
        self._versions: dict[str, int] = {}
        self.max_version_spread = 0
        self.mixed_version_observations = 0
        self._interrupted_on: dict[str, str] = {}
        self.interrupted_requests = 0
        self.resumed = 0
        self.resumed_elsewhere = 0
        self.resumed_tokens = 0
        self.syncs: list[tuple[str, int, float]] = []

    def submitted(self, instance_id: str, requests: Sequence[RolloutRequest]) -> None:
        with self._lock:
            for request in requests:
                origin = self._interrupted_on.pop(request.request_id, None)
                if request.output_ids:
                    self.resumed += 1
                    self.resumed_tokens += len(request.output_ids)
                    if origin is not None and origin != instance_id:
                        self.resumed_elsewhere += 1

    def interrupted(self, instance_id: str, partials: Sequence[RolloutRequest]) -> None:
        with self._lock:
            for partial in partials:
                self.interrupted_requests += 1
                self._interrupted_on[partial.request_id] = instance_id

    def synced(self, instance_id: str, version: int, seconds: float) -> None:
        with self._lock:
            self.syncs.append((instance_id, version, seconds))

    def versions(self) -> list[int]:
        """The last observed version of each instance (from the loop's own snapshots: no engine call,
        so a dead instance cannot fail the caller)."""
        with self._lock:
            return [self._versions[iid] for iid in sorted(self._versions)]

    def observed(self, snap: InstanceSnapshot) -> None:
        with self._lock:
            changed = self._versions.get(snap.instance_id) != snap.version
            self._versions[snap.instance_id] = snap.version
            spread = max(self._versions.values()) - min(self._versions.values())
            self.max_version_spread = max(self.max_version_spread, spread)
            self.mixed_version_observations += spread > 0
            last = self._last_written.get(snap.instance_id)
            throttled = last is not None and snap.time - last < self._interval
            if self._timeline is None or (throttled and not changed):
                return
            self._last_written[snap.instance_id] = snap.time
            self._timeline.write(
                json.dumps(
                    {
                        "t": round(snap.time, 4),
                        "instance": snap.instance_id,
                        "version": snap.version,
                        "running": len(snap.running),
                        "waiting": len(snap.waiting),
                        "kv_tokens": snap.kv_tokens,
                        "tokens_per_s": round(snap.tokens_per_s, 1),
                        "loading": snap.loading,
                    }
                )
                + "\n"
            )

    def close(self) -> None:
        with self._lock:
            if self._timeline is not None:
                self._timeline.close()
                self._timeline = None

    def summary(self) -> dict[str, float]:
        with self._lock:
            per_instance: dict[str, float] = defaultdict(float)
            for iid, _, seconds in self.syncs:
                per_instance[iid] += seconds
            return {
                "interrupted_requests": float(self.interrupted_requests),
                "resumed_requests": float(self.resumed),
                "resumed_elsewhere": float(self.resumed_elsewhere),
                "resumed_tokens": float(self.resumed_tokens),
                "weight_syncs": float(len(self.syncs)),
                "sync_seconds": float(sum(per_instance.values())),
                "max_version_spread": float(self.max_version_spread),
                "mixed_version_observations": float(self.mixed_version_observations),
            }
