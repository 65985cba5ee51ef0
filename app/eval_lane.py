"""Evaluation on the rollout instances (``task.eval_engine=rollout``, the default for prompts from files).

verl (``RayPPOTrainer._validate``, and its fully-async rollouter right after a parameter sync) and
OpenRLHF (``PPOTrainer.evaluate``) send their validation prompts to the rollout engines themselves:
no GPU sits idle for an evaluation engine. StaleFlow does the same between two steps of the run loop.
While the loop waits for an evaluation no Pull runs, so the instance evaluated keeps one version for
the whole evaluation ("between versions"); its training requests go on generating beside the
evaluation's.

* :class:`SharedEngine` wraps each rollout engine so that the run loop and the evaluation can both
  submit to it: what the evaluation submitted comes back only through its :class:`EvaluationLane`,
  everything else only through the loop's :meth:`SharedEngine.collect`. It also remembers the version
  last loaded through it (the loop's Pulls and the job's loads), so choosing an instance asks no engine.
* :class:`RolloutEvaluation` evaluates the newest version any instance holds, on every instance
  holding it, as they are, the prompts dealt out among them as verl and OpenRLHF spread validation
  over every engine (during the run: the figures carry the version the tokens were sampled with,
  which may trail the trainer's); after the run loop (every request interrupted, no Pull can follow)
  the final version is loaded into every instance that does not hold it yet, so the last evaluation
  is of the trained model, on all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from staleflow.runtime.types import RolloutRequest, Trajectory


class SharedEngine:
    """A rollout engine the run loop and the evaluation share (see the module docstring)."""

    def __init__(self, engine: Any, instance_id: str, version: int = 0) -> None:
        self._engine = engine
        self.instance_id = instance_id
        self.version = version
        self._lock = threading.Lock()
        self._evaluating: set[str] = set()
        self._for_loop: list[Trajectory] = []
        self._for_eval: list[Trajectory] = []

    # -- the run loop's side (the RolloutEngine seam) -------------------------------------------
    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        self._engine.submit(requests)

    def interrupt(self, request_ids: Sequence[str]) -> list[RolloutRequest]:
        result: list[RolloutRequest] = self._engine.interrupt(request_ids)
        return result

    def abort(self, request_ids: Sequence[str]) -> None:
        self._engine.abort(request_ids)

    def load_weights(self, version: int, weights: Any, broadcast: bool = False) -> None:
        self._engine.load_weights(version, weights, broadcast)
        self.version = version

    def snapshot(self) -> Any:
        return self._engine.snapshot()

    def collect(self) -> list[Trajectory]:
        """The finished trajectories of the loop's requests (the evaluation's are kept for its lane)."""
        with self._lock:
            self._sort(self._engine.collect())
            out, self._for_loop = self._for_loop, []
        return out

    def decode_steps(self) -> Any:
        return self._engine.decode_steps()

    def next_event_time(self) -> float | None:
        result: float | None = self._engine.next_event_time()
        return result

    def close(self) -> None:
        self._engine.close()

    # -- the evaluation's side ------------------------------------------------------------------
    def lane(self) -> EvaluationLane:
        return EvaluationLane(self)

    def _submit_eval(self, requests: Sequence[RolloutRequest]) -> None:
        with self._lock:
            self._evaluating.update(r.request_id for r in requests)
        self._engine.submit(requests)

    def _collect_eval(self) -> list[Trajectory]:
        with self._lock:
            self._sort(self._engine.collect())
            out, self._for_eval = self._for_eval, []
        return out

    def _abort_eval(self, request_ids: Sequence[str]) -> None:
        self._engine.abort(request_ids)
        with self._lock:
            self._evaluating.difference_update(request_ids)

    def _sort(self, finished: list[Trajectory]) -> None:
        for trajectory in finished:
            if trajectory.request_id in self._evaluating:
                self._evaluating.discard(trajectory.request_id)
                self._for_eval.append(trajectory)
            else:
                self._for_loop.append(trajectory)


class EvaluationLane:
    """The evaluation's view of a :class:`SharedEngine`: the engine calls :class:`~staleflow.app.evaluation.EngineEvaluator` makes."""

    def __init__(self, shared: SharedEngine) -> None:
        self._shared = shared

    @property
    def version(self) -> int:
        return self._shared.version

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        self._shared._submit_eval(requests)

    def collect(self) -> list[Trajectory]:
        return self._shared._collect_eval()

    def abort(self, request_ids: Sequence[str]) -> None:
        self._shared._abort_eval(request_ids)

    def load_weights(self, version: int, weights: Any) -> None:
        self._shared.load_weights(version, weights)


class RolloutEvaluation:
    """An :class:`~staleflow.app.evaluation.EngineEvaluator` run on the rollout instances (module docstring).

    Args:
        evaluator: the evaluator (prompts, reward, sampling); its own engine is not used.
        engines: the run's rollout engines, each a :class:`SharedEngine`.
    """

    enabled = True

    def __init__(self, evaluator: Any, engines: Sequence[SharedEngine]) -> None:
        if not engines:
            raise ValueError("evaluation on the rollout instances needs at least one instance")
        self._evaluator = evaluator
        self._engines = list(engines)

    @property
    def prompts(self) -> int:
        result: int = self._evaluator.prompts
        return result

    def newest(self) -> list[SharedEngine]:
        """Every instance holding the newest version any of them holds."""
        version = max(e.version for e in self._engines)
        return [e for e in self._engines if e.version == version]

    def run_between_steps(self) -> dict[str, Any]:
        """Evaluate the newest version on every instance holding it, as they are: the run loop is between two steps."""
        engines = self.newest()
        return self._run(engines, engines[0].version)

    def run_after_loop(self, version: int, weights: Callable[[], Any]) -> dict[str, Any]:
        """Evaluate ``version`` once the run loop is over, on every instance: loaded (``weights()``: what
        a Pull of it gets) into each that does not hold it already."""
        for engine in self._engines:
            if engine.version != version:
                engine.load_weights(version, weights())
        return self._run(self._engines, version)

    def _run(self, engines: list[SharedEngine], version: int) -> dict[str, Any]:
        figures = self._evaluator.run_loaded([e.lane() for e in engines], version)
        return {**figures, "eval_instances": [e.instance_id for e in engines]}

    def close(self) -> None:
        self._evaluator.close()
