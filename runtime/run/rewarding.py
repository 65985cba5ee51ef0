"""Rewards for finished groups, each group under a timeout, in worker processes (or threads).

A reward function that raises, or that has not returned ``timeout_s`` seconds (wall clock) after
the group was submitted, marks the group failed; the run goes on (a hung reward must never stall
training; peers froze on exactly that).

Two ways to compute rewards:

- :class:`PooledReward` (``staleflow train``): the scorer that ``task.reward`` names runs in
  ``workers`` worker processes (``spawn``), one group per job; a group's timeout counts from when a
  process takes it (groups queue while every process is busy). The driver only decodes and ships
  ``(prompt, response, answer, metadata)``; a CPU-heavy scorer uses another core and never holds the
  run loop's interpreter lock. A worker whose group times out is killed and replaced, so a hung
  scorer costs one timeout per group, not a worker for ever; a worker that dies is replaced too.
- a plain ``reward_fn(trajectory, group_metadata) -> float`` (simulation, tests, chaos testing): on
  a thread pool. A thread running a hung function cannot be killed: it is abandoned, and
  ``max_workers`` bounds how many can pile up.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any

from staleflow.runtime.types import GroupId, Trajectory

#: ``reward_fn(trajectory, group_metadata) -> reward``
RewardFn = Callable[[Trajectory, dict[str, Any]], float]
#: what a scorer is called with: ``(prompt, response, answer, metadata)``
ScoreInput = tuple[Any, str, str, dict[str, Any]]
_MAX_STARTS = 5


@dataclass(frozen=True)
class RewardOutcome:
    """The rewards of one group (in trajectory order), or why there are none."""

    group_id: GroupId
    rewards: list[float] | None
    error: str | None = None


@dataclass(frozen=True)
class PooledReward:
    """Rewards by the scorer ``spec`` (``task.reward``: a built-in name or ``module:function``) in
    ``workers`` processes; ``prepare(trajectory, group_metadata)`` runs in the driver and returns the
    scorer's arguments ``(prompt, response, answer, metadata)`` (it decodes the response)."""

    spec: str
    prepare: Callable[[Trajectory, dict[str, Any]], ScoreInput]
    workers: int = 2


def _reward_group(reward_fn: RewardFn, trajectories: Sequence[Trajectory], metadata: dict[str, Any]) -> list[float]:
    rewards = []
    for trajectory in trajectories:
        reward = reward_fn(trajectory, metadata)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"reward function returned {type(reward).__name__}, not a number")
        rewards.append(float(reward))
    return rewards


# ------------------------------------------------------------------------------ worker processes
def _worker_main(conn: Connection, spec: str) -> None:
    """A scorer process: resolves ``spec`` once, then scores jobs ``(job_id, items)`` until told to stop."""
    from staleflow.runtime.tasks.rewards import resolve_scorer, score_items

    try:
        scorer = resolve_scorer(spec)
    except Exception as err:  # noqa: BLE001 - reported with every job
        scorer, failure = None, f"{type(err).__name__}: {err}"
    conn.send(("ready", None, None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job_id, items = message
        try:
            if scorer is None:
                raise RuntimeError(failure)
            conn.send((job_id, score_items(spec, scorer, items), None))
        except Exception as err:  # noqa: BLE001 - the job fails, the worker lives on
            conn.send((job_id, None, f"{type(err).__name__}: {err}"))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    job: GroupId | None = None
    ready: bool = False  # the process has started and resolved the scorer
    started: float = 0.0  # when it took its job


@dataclass
class _Job:
    group_id: GroupId
    items: list[ScoreInput]


class ScorerPool:
    """``workers`` scorer processes for ``spec``; jobs are groups, queued until a process is free, each
    under ``timeout_s`` from when a (started) process takes it, measured on ``clock`` (wall time; a
    test injects its own)."""

    def __init__(self, spec: str, workers: int, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        self._spec = spec
        self._timeout = timeout_s
        self._now = clock
        self._context = multiprocessing.get_context("spawn")
        self._workers = [self._start() for _ in range(workers)]
        self._queue: deque[_Job] = deque()
        self._jobs: dict[GroupId, _Job] = {}
        self._failed: list[RewardOutcome] = []
        self._failed_starts = 0
        self.restarts = 0

    def _start(self) -> _Worker:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_worker_main, args=(theirs, self._spec), name="staleflow-reward", daemon=True)
        process.start()
        theirs.close()
        return _Worker(process, ours)

    def _replace(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        fresh = self._start()
        worker.process, worker.conn, worker.job, worker.ready = fresh.process, fresh.conn, None, False
        self.restarts += 1

    def submit(self, group_id: GroupId, items: list[ScoreInput]) -> None:
        job = _Job(group_id, items)
        self._jobs[group_id] = job
        self._queue.append(job)
        self._dispatch()

    def pending(self) -> int:
        return len(self._jobs) + len(self._failed)

    def _dispatch(self) -> None:
        for worker in self._workers:
            if worker.ready and worker.job is None and self._queue:
                job = self._queue.popleft()
                try:
                    worker.conn.send((job.group_id, job.items))
                except (BrokenPipeError, OSError):  # the worker died while idle: the job waits for the next one
                    self._queue.appendleft(job)
                    self._replace(worker)
                    continue
                except Exception as err:  # noqa: BLE001 - e.g. metadata that cannot be pickled
                    del self._jobs[job.group_id]
                    self._failed.append(RewardOutcome(job.group_id, None, f"cannot send the group to a scorer: {err}"))
                    continue
                worker.job, worker.started = job.group_id, self._now()

    def poll(self, block: bool = False) -> list[RewardOutcome]:
        """Outcomes ready now; ``block``: wait until every job has an outcome."""
        outcomes = self._collect()
        while block and self._jobs:  # outcomes of failed sends are already in ``outcomes``
            busy = [w for w in self._workers if w.job is not None]
            waiting = [w.conn for w in self._workers if w.job is not None or not w.ready]
            remaining = min((w.started + self._timeout - self._now() for w in busy), default=0.1)
            wait_connections(waiting, timeout=min(max(0.01, remaining), 0.5))
            outcomes += self._collect()
        return outcomes

    def _collect(self) -> list[RewardOutcome]:
        outcomes: list[RewardOutcome] = []
        for worker in self._workers:
            if not worker.ready:
                self._check_started(worker)
                continue
            if worker.job is None:
                continue
            job_id = worker.job
            try:
                ready = worker.conn.poll()
            except (EOFError, OSError):
                ready = False
            if ready:
                try:
                    answered, rewards, error = worker.conn.recv()
                except (EOFError, OSError):
                    worker.process.join(timeout=1)
                    answered, rewards, error = job_id, None, f"scorer process died (exit code {worker.process.exitcode})"
                    self._replace(worker)
                worker.job = None
                if answered != job_id:  # cannot happen with one job per process at a time; never lose the job
                    rewards, error = None, f"scorer process answered {answered!r} for {job_id!r}"
                    self._replace(worker)
                if job_id in self._jobs:
                    del self._jobs[job_id]
                    outcomes.append(RewardOutcome(job_id, rewards, error))
            elif not worker.process.is_alive():
                code = worker.process.exitcode
                self._replace(worker)
                self._jobs.pop(job_id, None)
                outcomes.append(RewardOutcome(job_id, None, f"scorer process died (exit code {code})"))
        now = self._now()
        for worker in self._workers:  # a job past its timeout: kill its worker, start another
            if worker.job is not None and now - worker.started >= self._timeout:
                job_id = worker.job
                self._replace(worker)
                del self._jobs[job_id]
                outcomes.append(RewardOutcome(job_id, None, f"reward timed out after {self._timeout} s"))
        self._dispatch()
        failed, self._failed = self._failed, []  # sends that failed, this dispatch's included
        return failed + outcomes

    def _check_started(self, worker: _Worker) -> None:
        """Mark a starting worker ready once it says so; one that died starting is started again
        (at most ``_MAX_STARTS`` times in a row, then the jobs fail)."""
        try:
            if worker.conn.poll():
                worker.conn.recv()
                worker.ready = True
                self._failed_starts = 0
                return
        except (EOFError, OSError):
            pass
        if not worker.process.is_alive():
            code = worker.process.exitcode
            self._failed_starts += 1
            if self._failed_starts > _MAX_STARTS:
                raise RuntimeError(f"scorer processes for {self._spec!r} keep dying at start (exit code {code})")
            self._replace(worker)

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=1)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.conn.close()
        self._workers = []


# ------------------------------------------------------------------------------------- the runner
class RewardRunner:
    """Runs the reward over groups with a per-group timeout.

    ``reward_fn``: a :class:`PooledReward` (worker processes), a plain function (threads), or None
    (simulation: every group completes at once with ``rewards=None``).
    """

    def __init__(
        self, reward_fn: RewardFn | PooledReward | None, timeout_s: float = 30.0, max_workers: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout must be > 0 seconds, got {timeout_s}")
        self._timeout = timeout_s
        self._now = clock  # the timeout's clock (wall time; a test injects its own)
        self._scorers: ScorerPool | None = None
        self._prepare: Callable[[Trajectory, dict[str, Any]], ScoreInput] | None = None
        self._fn: RewardFn | None = None
        if isinstance(reward_fn, PooledReward):
            self._scorers = ScorerPool(reward_fn.spec, reward_fn.workers, timeout_s, clock)
            self._prepare = reward_fn.prepare
        else:
            self._fn = reward_fn
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="reward") if self._fn else None
        self._running: dict[GroupId, tuple[Future[list[float]], float]] = {}
        self._ready: list[RewardOutcome] = []

    @property
    def scorer_restarts(self) -> int:
        """Scorer processes killed (timeouts) or found dead, and replaced."""
        return self._scorers.restarts if self._scorers is not None else 0

    def submit(self, group_id: GroupId, trajectories: Sequence[Trajectory], metadata: dict[str, Any]) -> None:
        if self._scorers is not None and self._prepare is not None:
            try:
                items = [self._prepare(t, metadata) for t in trajectories]
            except Exception as err:  # noqa: BLE001 - the group fails, the run goes on
                self._ready.append(RewardOutcome(group_id, None, f"{type(err).__name__}: {err}"))
                return
            self._scorers.submit(group_id, items)
            return
        if self._pool is None or self._fn is None:
            self._ready.append(RewardOutcome(group_id, None))
            return
        future = self._pool.submit(_reward_group, self._fn, list(trajectories), dict(metadata))
        self._running[group_id] = (future, self._now())

    def pending(self) -> int:
        scored = self._scorers.pending() if self._scorers is not None else 0
        return len(self._running) + len(self._ready) + scored

    def poll(self, block: bool = False) -> list[RewardOutcome]:
        """Outcomes ready now; ``block``: wait until every submitted group is rewarded or timed out."""
        outcomes, self._ready = self._ready, []
        if self._scorers is not None:
            return outcomes + self._scorers.poll(block)
        if block and self._running:
            deadline = max(start for _, start in self._running.values()) + self._timeout
            wait([f for f, _ in self._running.values()], timeout=max(0.0, deadline - self._now()))
        now = self._now()
        for group_id, (future, start) in list(self._running.items()):
            if future.done():
                error = future.exception()
                outcomes.append(
                    RewardOutcome(group_id, None, f"{type(error).__name__}: {error}")
                    if error is not None
                    else RewardOutcome(group_id, future.result())
                )
            elif now - start >= self._timeout:
                future.cancel()
                outcomes.append(RewardOutcome(group_id, None, f"reward timed out after {self._timeout} s"))
            else:
                continue
            del self._running[group_id]
        return outcomes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._scorers is not None:
            self._scorers.close()
