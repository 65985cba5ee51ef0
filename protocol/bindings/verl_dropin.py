"""The protocol as a drop-in for verl 0.9's ``fully_async_main`` (imports ``verl`` and ``ray``).

A user's script changes by two lines (docs/integrating.md, "verl")::

    from verl.experimental.fully_async_policy import fully_async_main
    from staleflow_protocol.bindings.verl_dropin import use_protocol

    if __name__ == "__main__":
        use_protocol(fully_async_main)   # before verl's Hydra entry point runs
        fully_async_main.main()

:func:`use_protocol` makes verl's task runner build, in its own process, the classes below instead
of verl's (everything else, including the order of the calls, is verl's own ``fully_async_main``):

- :class:`ProtocolQueue` (the actor, hosted with verl's ``MessageQueue`` options: ``max_concurrency
  = 20``) takes verl's ``(config, max_queue_size)`` and reads ``eta`` and the batch from
  ``async_training`` (:func:`~.verl.protocol_settings`); ``staleflow_trace_path`` and
  ``staleflow_redundancy`` there are optional;
- :class:`ProtocolQueueClient` (verl's ``MessageQueueClient``) adds ``reserve`` (waiting on the
  caller's side), ``abort`` and ``param_synced``; its ``put_sample`` carries the sample's id;
- :class:`ProtocolRollouterMixin` reserves each sample before generating, at the parameter version
  of the weights the replicas have *loaded* (set by the trainer after the push, never by raising a
  label), aborts a sample whose generation failed or that was never put (filtered), and takes no
  rollouter lock on the reserve path;
- :class:`ProtocolTrainerMixin` calls ``param_synced`` once the weights are pushed (wrapping the
  checkpoint manager's ``update_weights``: verl raises ``current_param_version`` before it pushes),
  tells the rollouter the loaded version, and saves and restores the queue with verl's checkpoints.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

import ray
from verl.experimental.fully_async_policy import fully_async_main as verl_main
from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter
from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
from verl.experimental.fully_async_policy.message_queue import MessageQueue, MessageQueueClient
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from ..events import GroupId
from .verl import Admission, ProtocolMessageQueue, protocol_settings, wait_admitted


def _plain(actor_class: Any) -> Any:
    """The class under verl's ``@ray.remote`` (Ray refuses subclasses of an actor class)."""
    return actor_class.__ray_metadata__.modified_class


def _hosted_like(verl_actor: Any, cls: type) -> Any:
    """``cls`` as a Ray actor with the options verl gives its own class."""
    return ray.remote(**verl_actor._default_options)(cls)


class ProtocolQueue(ProtocolMessageQueue):
    """:class:`~.verl.ProtocolMessageQueue` built from verl's ``MessageQueue(config, max_queue_size)``."""

    def __init__(self, config: Any, max_queue_size: Optional[int] = None) -> None:
        training = config.async_training
        eta, batch_size = protocol_settings(config.actor_rollout_ref.actor.ppo_mini_batch_size, training.require_batches,
                                            training.trigger_parameter_sync_step, training.staleness_threshold)
        super().__init__(eta, batch_size, redundancy=int(training.get("staleflow_redundancy", 0)),
                         trace_path=training.get("staleflow_trace_path"))


@dataclass
class Reservation:
    """The sample a generation task reserved, the parameter version it was admitted under, and
    whether it was put; :func:`current_reservation` inside the generation (e.g. to stamp the sample)."""

    sample_id: GroupId
    version: int = -1
    put: bool = False


_RESERVATION: contextvars.ContextVar[Optional[Reservation]] = contextvars.ContextVar("staleflow_reservation", default=None)


def current_reservation() -> Optional[Reservation]:
    """The reservation of the generation running in this task (None outside one)."""
    return _RESERVATION.get()


class ProtocolQueueClient(MessageQueueClient):
    """verl's client for :class:`ProtocolQueue`: verl's methods plus the protocol's."""

    async def _call(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(getattr(self.queue_actor, method).remote(*args).future())

    def _call_sync(self, method: str, *args: Any) -> Any:
        return getattr(self.queue_actor, method).remote(*args).future().result()

    async def try_reserve(self, sample_id: GroupId, version: int) -> Admission:
        result: Admission = await self._call("try_reserve", sample_id, version)
        return result

    async def reserve(self, sample_id: GroupId, version: Union[int, Callable[[], int]], timeout: Optional[float] = None) -> bool:
        """Wait (here, not in the actor) until the protocol admits ``sample_id``: see :func:`~.verl.wait_admitted`."""
        return await wait_admitted(self.try_reserve, sample_id, version, timeout)

    async def put_sample(self, sample: Any, sample_id: Optional[GroupId] = None) -> bool:
        """verl's call, ``put_sample(sample=...)``, inside a generation the rollouter mixin reserved: the id is that sample's."""
        reservation = _RESERVATION.get()
        if sample is not None and sample_id is None and reservation is not None:
            sample_id, reservation.put = reservation.sample_id, True
        result: bool = await self._call("put_sample", sample, sample_id)
        return result

    async def get_sample(self) -> Any:
        """``(sample, samples queued)``; ``(None, 0)`` once the queue is shut down with no batch ready:
        verl's ``_get_samples_from_queue`` unpacks a pair and stops at a None sample (its own
        ``MessageQueue`` answers a bare None there, which that unpacking cannot take)."""
        got = await self._call("get_sample")
        return (None, 0) if got is None else got

    async def abort(self, sample_id: GroupId) -> bool:
        result: bool = await self._call("abort", sample_id)
        return result

    async def param_synced(self, version: int) -> List[GroupId]:
        result: List[GroupId] = await self._call("param_synced", version)
        return result

    def save_checkpoint_sync(self, global_step_folder: str) -> str:
        result: str = self._call_sync("save_checkpoint", global_step_folder)
        return result

    async def load_checkpoint(self, global_step_folder: str, param_version: int) -> List[GroupId]:
        result: List[GroupId] = await self._call("load_checkpoint", global_step_folder, param_version)
        return result


class ProtocolRollouterMixin:
    """Mix in before verl's rollouter class: admission by the protocol before each generation."""

    message_queue_client: ProtocolQueueClient
    loaded_param_version: Optional[int] = None  # the version of the weights the replicas run, set after each push

    async def _should_pause_generation(self) -> bool:
        return False  # no sample count: the protocol admits each sample before it starts

    def _loaded_version(self) -> int:
        if self.loaded_param_version is None:
            raise RuntimeError("no weights were pushed to the replicas yet: fully_async_main pushes them before fit")
        return self.loaded_param_version

    async def weights_loaded(self, version: int, dropped: List[GroupId]) -> None:
        """The trainer pushed parameter ``version`` and the replicas loaded it; ``dropped``: ids the
        protocol dropped since the last push, whose generations are stopped here. No lock: the
        processor may hold the rollouter's lock while every generation waits for this version."""
        self.loaded_param_version = version
        for sample_id in dropped:
            task = self._staleflow_generations().get(sample_id)
            if task is not None:
                task.cancel()

    def _staleflow_generations(self) -> Dict[GroupId, "asyncio.Task[None]"]:
        generations: Optional[Dict[GroupId, asyncio.Task[None]]] = self.__dict__.get("_staleflow_tasks")
        if generations is None:
            generations = self.__dict__["_staleflow_tasks"] = {}
        return generations

    async def _process_single_sample_streaming(self, rollout_sample: Any) -> None:
        sample_id = rollout_sample.sample_id
        client = self.message_queue_client
        reservation = Reservation(sample_id)

        def admitted_version() -> int:  # read at every ask: a push while this sample waits counts
            reservation.version = self._loaded_version()
            return reservation.version

        await client.reserve(sample_id, admitted_version)
        token = _RESERVATION.set(reservation)
        try:
            generation = asyncio.ensure_future(super()._process_single_sample_streaming(rollout_sample))  # type: ignore[misc]
        finally:
            _RESERVATION.reset(token)
        self._staleflow_generations()[sample_id] = generation
        try:
            await generation
        except asyncio.CancelledError:
            if not generation.cancelled():  # this task was cancelled, not the dropped generation
                generation.cancel()
                await client.abort(sample_id)
                raise
        except BaseException:
            await client.abort(sample_id)
            raise
        finally:
            self._staleflow_generations().pop(sample_id, None)
        if not reservation.put:  # filtered (or dropped): never put, its place is freed
            await client.abort(sample_id)


class _PushThenSync:
    """The trainer's checkpoint manager, calling ``after_push(version)`` once ``update_weights`` returned."""

    def __init__(self, manager: Any, after_push: Callable[[int], Any]) -> None:
        self._manager = manager
        self._after_push = after_push

    async def update_weights(self, global_steps: int, **kwargs: Any) -> Any:
        result = await self._manager.update_weights(global_steps=global_steps, **kwargs)
        await self._after_push(global_steps)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


class ProtocolTrainerMixin:
    """Mix in before verl's trainer class: the protocol told of each push, saved with each checkpoint."""

    config: Any
    rollouter: Any
    current_param_version: int
    message_queue_client: ProtocolQueueClient
    dynamic_schedule_enabled: bool
    checkpoint_manager: Any

    async def set_rollouter(self, rollouter: Any) -> None:
        if self.dynamic_schedule_enabled:
            raise NotImplementedError("use_dynamic_resource_scheduling pushes weights to hybrid replicas outside the checkpoint "
                                      "manager: the protocol drop-in covers the standalone rollout replicas only")
        await super().set_rollouter(rollouter)  # type: ignore[misc]
        self.checkpoint_manager = _PushThenSync(self.checkpoint_manager, self._weights_pushed)

    async def _weights_pushed(self, version: int) -> None:
        dropped = await self.message_queue_client.param_synced(version)
        await asyncio.wrap_future(self.rollouter.weights_loaded.remote(version, dropped).future())

    def _save_checkpoint(self) -> None:
        """The queue first: verl's ``latest_checkpointed_iteration.txt``, written last, names only complete folders."""
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.current_param_version}")
        self.message_queue_client.save_checkpoint_sync(os.path.abspath(folder))
        super()._save_checkpoint()  # type: ignore[misc]

    async def load_checkpoint(self) -> int:
        """verl's resume, then the queue from the same ``global_step_N`` folder (found as verl finds it)."""
        version: int = await super().load_checkpoint()  # type: ignore[misc]
        if version:
            trainer = self.config.trainer
            folder = (trainer.resume_from_path if trainer.resume_mode == "resume_path"
                      else find_latest_ckpt_path(os.path.abspath(trainer.default_local_dir)))
            await self.message_queue_client.load_checkpoint(os.path.abspath(folder), version)
        return version


class ProtocolRollouter(ProtocolRollouterMixin, _plain(FullyAsyncRollouter)):  # type: ignore[misc]
    """verl's ``FullyAsyncRollouter`` with the protocol."""


class ProtocolTrainer(ProtocolTrainerMixin, _plain(FullyAsyncTrainer)):  # type: ignore[misc]
    """verl's ``FullyAsyncTrainer`` with the protocol."""


class ProtocolTaskRunner(_plain(verl_main.FullyAsyncTaskRunner)):  # type: ignore[misc]
    """verl's task runner; in its own process, verl's ``fully_async_main`` builds the protocol's classes."""

    #: verl's name in ``fully_async_main`` -> the class it builds instead.
    replacements: Dict[str, Any] = {}

    def run(self, config: Any) -> None:
        for name, replacement in self.replacements.items():
            setattr(verl_main, name, replacement)
        super().run(config)


ProtocolTaskRunner.replacements = {
    "MessageQueue": _hosted_like(MessageQueue, ProtocolQueue),
    "MessageQueueClient": ProtocolQueueClient,
    "FullyAsyncRollouter": _hosted_like(FullyAsyncRollouter, ProtocolRollouter),
    "FullyAsyncTrainer": _hosted_like(FullyAsyncTrainer, ProtocolTrainer),
}


def use_protocol(module: Any = verl_main, runner: Optional[type] = None) -> Any:
    """Make ``fully_async_main.main()`` run verl with the protocol: its task runner becomes
    :class:`ProtocolTaskRunner` (or ``runner``, a subclass) hosted as verl hosts its own."""
    module.FullyAsyncTaskRunner = _hosted_like(verl_main.FullyAsyncTaskRunner, runner or ProtocolTaskRunner)
    return module.FullyAsyncTaskRunner


__all__ = ["ProtocolQueue", "ProtocolQueueClient", "ProtocolRollouter", "ProtocolRollouterMixin", "ProtocolTaskRunner",
           "ProtocolTrainer", "ProtocolTrainerMixin", "Reservation", "current_reservation", "use_protocol"]
