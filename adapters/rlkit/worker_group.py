"""A group of trainer ranks, each an object in a process of its own, called all together.

:class:`ProcessWorkers` starts ``world_size`` spawned processes (``torch.multiprocessing``, tensors
pass through shared memory); :class:`RayWorkers` places the same objects as Ray actors (one GPU each
when asked). Either way :meth:`call_all` sends one call to every rank and waits for all answers,
because the ranks' work is collective (FSDP all-gathers and reduce-scatters): a rank that fails or
dies would leave the others blocked in a collective, so the first failure stops the whole group and
raises :class:`WorkerGroupError` naming the rank, never a hang.
"""

from __future__ import annotations

import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from staleflow.adapters.rlkit.step_thread import BackgroundStepTrainer


class WorkerGroupError(RuntimeError):
    """A rank failed or died; the group is stopped."""


def rank_address() -> str:
    """A ``tcp://`` rendezvous address on the calling rank's node (asked of rank 0): inside a Ray
    actor the node's address, reachable from the other nodes; otherwise loopback."""
    import sys

    host = "127.0.0.1"
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def rank_device(requested: str, rank: int, *, without_gpu: str = "or set train.gpus=0 to train on CPU") -> Any:
    """The ``torch.device`` of trainer rank ``rank``, decided in the rank's own process (the driver may
    be a CPU-only head node): ``cuda`` takes one of the GPUs Ray made visible to the rank, and a rank
    that sees none is an error naming it (ending with ``without_gpu``, what the user can do instead),
    never a silent fp32 run on CPU."""
    import os

    import torch

    if requested != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise RuntimeError(
            f"trainer rank {rank} was given GPUs (train.gpus > 0) but sees no CUDA device (CUDA_VISIBLE_DEVICES={visible}); "
            f"check the node's driver and torch build, {without_gpu}"
        )
    return torch.device("cuda", rank % torch.cuda.device_count())  # one visible GPU per Ray actor, or all of them


def _serve(rank: int, conn: Any, factory: Callable[[], Any]) -> None:
    """A rank's process: build the object, then run calls until ``None`` (or the pipe closes)."""
    try:
        target = factory()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        name, args = message
        try:
            conn.send(("ok", getattr(target, name)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class ProcessWorkers:
    """``world_size`` spawned processes, each holding ``factory()``'s object.

    Args:
        factory: a picklable callable building one rank's object (called in the child).
        world_size: number of ranks.
        timeout_s: longest wait for one call's answers (a dead process is noticed at once).
    """

    def __init__(self, factory: Callable[[], Any], world_size: int, timeout_s: float = 3600.0) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self._conns, self._procs = [], []
        self.world_size = world_size
        for rank in range(world_size):
            parent, child = context.Pipe()
            proc = context.Process(target=_serve, args=(rank, child, factory), name=f"staleflow-trainer-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._broken: str | None = None
        self._collect("start")

    def call_all(self, name: str, args: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """``getattr(rank_object, name)(*args[rank])`` on every rank; the answers in rank order."""
        if self._broken is not None:
            raise WorkerGroupError(f"the trainer's worker group is stopped ({self._broken})")
        per_rank = list(args) if args is not None else [()] * self.world_size
        for conn, rank_args in zip(self._conns, per_rank):
            conn.send((name, rank_args))
        return self._collect(name)

    def _collect(self, name: str) -> list[Any]:
        import time

        answers: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + self.timeout_s
        while pending:
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0.05):
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        self._fail(f"rank {rank} died during {name!r} (exit code {_exit_code(proc)})")
                    if status == "error":
                        self._fail(f"rank {rank} failed in {name!r}:\n{value}")
                    answers[rank] = value
                    pending.discard(rank)
                elif not proc.is_alive():
                    self._fail(f"rank {rank} died during {name!r} (exit code {_exit_code(proc)})")
            if time.monotonic() > deadline:
                self._fail(f"ranks {sorted(pending)} did not answer {name!r} within {self.timeout_s:.0f} s")
        return answers

    def _fail(self, reason: str) -> None:
        self._broken = reason
        self._stop(graceful=False)
        raise WorkerGroupError(reason)

    def close(self) -> None:
        if self._broken is None:
            self._broken = "closed"
            self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if graceful and proc.is_alive():
                try:
                    conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
        for proc in self._procs:
            proc.join(timeout=10 if graceful else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns:
            conn.close()


def _exit_code(proc: Any) -> int | None:
    """The exit code of a rank whose pipe closed: its pipe closes as it exits, before it is reaped,
    so it is waited for (briefly) first; None if it has not ended by then."""
    proc.join(timeout=5)
    return proc.exitcode  # type: ignore[no-any-return]


class _RankHost:
    """What a Ray actor holds: one rank's object, called by name."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._target = factory()

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        return getattr(self._target, name)(*args)


class RayWorkers:
    """The ranks as Ray actors (``num_gpus`` each, or ``num_gpus[rank]`` for rank ``rank``; Ray sets
    each actor's ``CUDA_VISIBLE_DEVICES``).

    Ray must be running (``ray.init`` or an existing cluster). ``placement_group``: an optional Ray
    placement group with one bundle per rank, bundle ``rank`` for rank ``rank``. ``timeout_s``: the
    longest wait for one call's answers, as :class:`ProcessWorkers` (a rank Ray cannot schedule, e.g.
    one asking for GPUs outside any placement group on a busy cluster, would otherwise wait forever);
    the first call's wait includes the actors' start-up. The attribute may be changed between calls.
    """

    def __init__(self, factory: Callable[[], Any], world_size: int, *, num_gpus: float | Sequence[float] = 0, num_cpus: float = 1,
                 placement_group: Any = None, timeout_s: float = 3600.0) -> None:
        import ray

        self.world_size = world_size
        self.timeout_s = timeout_s
        self._actors = []
        gpus = [float(num_gpus)] * world_size if isinstance(num_gpus, (int, float)) else list(num_gpus)
        if len(gpus) != world_size:
            raise ValueError(f"num_gpus names {len(gpus)} ranks, the group has {world_size}")
        for rank in range(world_size):
            options: dict[str, Any] = {"num_gpus": gpus[rank], "num_cpus": num_cpus, "name": None}
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=rank)
            self._actors.append(ray.remote(_RankHost).options(**options).remote(factory))
        self._broken: str | None = None

    def call_all(self, name: str, args: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        import ray

        if self._broken is not None:
            raise WorkerGroupError(f"the trainer's worker group is stopped ({self._broken})")
        per_rank = list(args) if args is not None else [()] * self.world_size
        refs = [actor.call.remote(name, a) for actor, a in zip(self._actors, per_rank)]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        answers: list[Any] = [None] * self.world_size
        remaining = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while remaining:  # the first failure (of any rank) stops the group: the others may be in a collective
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._broken = f"ranks {sorted(rank_of[r] for r in remaining)} did not answer {name!r} within {self.timeout_s:.0f} s"
                self.close()
                raise WorkerGroupError(self._broken)
            rank = rank_of[ready[0]]
            try:
                answers[rank] = ray.get(ready[0])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as error:
                self._broken = f"rank {rank} failed in {name!r}: {error}"
                self.close()
                raise WorkerGroupError(self._broken) from error
        return answers

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        self._broken = self._broken or "closed"


class WorkerGroupTrainer(BackgroundStepTrainer):
    """A trainer whose ranks are a worker group (FSDP, Megatron): the shared evaluation and shutdown.

    Subclasses set ``self._workers`` (:class:`ProcessWorkers` or :class:`RayWorkers`) and either
    ``self._decoder`` (a :class:`~staleflow.adapters.rlkit.causal_lm.PublishedWeightsDecoder`, for
    published weights held here) or their own :meth:`generate_greedy` (FSDP: rank 0 decodes).
    """

    _workers: Any
    _decoder: Any

    def generate_greedy(self, prompts: Any, max_new_tokens: int, eos_id: int, batch_size: int = 64) -> list[list[int]]:
        """Greedy responses of the published weights, on a CPU copy of the model in this process."""
        with self._lock:
            return self._decoder.generate(self._published, prompts, max_new_tokens, eos_id, batch_size)  # type: ignore[no-any-return]

    def close(self) -> None:
        super().close()
        try:
            self._workers.call_all("close")
        except Exception:  # noqa: S110 - a broken group is stopped already
            pass
        self._workers.close()
