"""verl 0.9.1's own ``fully_async_main`` path with ``staleflow_protocol.bindings.verl_dropin``, on CPU.

Run in verl's venv (tests/test_verl_binding.py): ``python tests/verl_dropin_run.py MODE OUT TOTAL_SAMPLES``.
verl's Hydra config ``fully_async_ppo_trainer`` is composed with its defaults (``staleness_threshold``
0.1, ``trigger_parameter_sync_step`` 4, ``require_batches`` 1, ``concurrent_samples_per_replica``
16: one replica gives 16 concurrent samples) and ``ppo_mini_batch_size`` 4 (16 samples per
parameter version, eta 1). :func:`use_protocol` swaps the task runner; verl's own
``FullyAsyncTaskRunner.run`` then builds the actors (queue, rollouter, trainer), sets the client,
loads the checkpoint (``resume_mode`` auto), pushes the weights before ``fit`` and runs both
``fit`` loops: verl's ``_processor_worker``, ``_process_single_sample_streaming``,
``_get_samples_from_queue``, ``fit_step``, ``_fit_update_local_step``, ``_fit_update_weights`` (its
order: the label raised, then the push, then ``reset_staleness``), ``_fit_save_checkpoint`` and the
rollouter's ``data.pt``.

Stand-ins for what needs a GPU or a model (named in docs/integrating.md): the tokenizer, the worker
groups and resource pools (``create_role_worker_mapping``, ``init_workers``), the dataset (a
``StatefulDataLoader`` over prompt numbers), the rollout replicas (a Ray actor ``Replicas`` holding
the version of the weights they run; generation is a seeded sleep with a long tail), the checkpoint
engine (``update_weights`` takes 50 ms, then the replicas hold the new version), and the training
computations of ``fit_step`` (reward, log-probs, advantages, the actor update: a 20 ms sleep).

MODE ``dropin``: the drop-in as shipped. MODE ``label``: the rollouter reserves under the protocol's
version (the label verl and the protocol raise before the weights arrive) instead of the version its
replicas loaded: the test expects samples reserved under a newer version than their weights.
Writes OUT/trained.jsonl (one line per local step: the parameter version and, per sample, its id,
the version it reserved under and the version of the weights it was generated on).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from types import SimpleNamespace
from typing import Any

import ray
from hydra import compose, initialize_config_dir
from staleflow_protocol.bindings.verl_dropin import (
    ProtocolQueue,
    ProtocolQueueClient,
    ProtocolRollouter,
    ProtocolTaskRunner,
    ProtocolTrainer,
    _hosted_like,
    current_reservation,
    use_protocol,
)
from verl.experimental.fully_async_policy import fully_async_main, fully_async_rollouter, fully_async_trainer
from verl.trainer.ppo.utils import Role

MODE, OUT, TOTAL = sys.argv[1], os.path.abspath(sys.argv[2]), int(sys.argv[3])


@ray.remote(num_cpus=0)
class Replicas:
    """The rollout replicas' weights: the version they run."""

    def __init__(self) -> None:
        self.loaded = -1

    async def version(self) -> int:
        return self.loaded

    async def load(self, version: int) -> None:
        self.loaded = version


class FakeBatch:
    """What verl's streaming code touches of a one-prompt ``DataProto``."""

    def __init__(self, prompt: Any, reserved: int = -1, weights: int = -1) -> None:
        self.prompt, self.reserved, self.weights = prompt, reserved, weights
        self.non_tensor_batch: dict[str, Any] = {}

    def __len__(self) -> int:
        return 1


class FakeEngine:
    """verl's ``async_rollout_manager``: the replicas' version when a generation starts, then a seeded sleep."""

    def __init__(self) -> None:
        self.rng = random.Random(7)

    async def generate_sequences_single(self, batch: FakeBatch) -> FakeBatch:
        weights = await ray.get_actor("staleflow_replicas").version.remote()
        await asyncio.sleep(self.rng.choice((0.01, 0.02, 0.05, 0.1)) if self.rng.random() < 0.9 else 0.6)
        return FakeBatch(batch.prompt, current_reservation().version, weights)


class FakeServers:
    def get_active_server_count(self) -> int:
        return 1

    def get_replicas(self) -> list[Any]:
        return []


class StandInRollouter(ProtocolRollouter):
    def __init__(self, config: Any, tokenizer: Any, processor: Any = None, device_name: Any = None) -> None:
        fully_async_rollouter.create_rl_dataset = lambda *args, **kwargs: list(range(100000))
        fully_async_rollouter.create_rl_sampler = lambda *args, **kwargs: None
        fully_async_rollouter.prepare_single_generation_data = lambda batch_dict, config: FakeBatch(batch_dict["prompt"])
        super().__init__(config, tokenizer, processor, device_name)
        self.label_version = 0

    def _create_dataloader(self, train_dataset: Any, val_dataset: Any, collate_fn: Any, sampler: Any) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.train_dataloader = StatefulDataLoader(train_dataset, batch_size=1, collate_fn=lambda items: {"prompt": items[0]})
        self.val_dataloader = []

    async def init_workers(self) -> None:
        self._init_async_objects()
        self.async_rollout_manager, self.llm_server_manager = FakeEngine(), FakeServers()

    def _loaded_version(self) -> int:
        return self.label_version if MODE == "label" else super()._loaded_version()

    async def _process_single_sample_streaming(self, rollout_sample: Any) -> None:
        if MODE == "label" and not hasattr(self, "label_reader"):
            self.label_reader = asyncio.ensure_future(self._read_label())
        await super()._process_single_sample_streaming(rollout_sample)

    async def _read_label(self) -> None:
        """The protocol's version, raised at the consume, before the weights are pushed; read every 10 ms."""
        while True:
            self.label_version = (await self.message_queue_client.get_statistics())["param_version"]
            await asyncio.sleep(0.01)


class FakeCheckpointEngine:
    async def update_weights(self, global_steps: int) -> None:
        await asyncio.sleep(0.05)  # the broadcast
        await ray.get_actor("staleflow_replicas").load.remote(global_steps)


class FakeWorkerGroup:
    def save_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> None:
        os.makedirs(local_path, exist_ok=True)

    def load_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> None:
        assert os.path.isdir(local_path), local_path


class StandInTrainer(ProtocolTrainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fully_async_trainer.assemble_batch_from_rollout_samples = lambda samples, *rest: SimpleNamespace(
            samples=samples, meta_info={"trajectory_param_versions": [s.full_batch.reserved for s in samples]})
        super().__init__(*args, **kwargs)

    async def init_workers(self) -> None:
        self.actor_wg = self.actor_rollout_wg = FakeWorkerGroup()

    async def _setup_checkpoint_manager(self) -> None:
        self.checkpoint_manager = FakeCheckpointEngine()

    def _fit_update_actor(self, batch: Any) -> Any:
        import time

        time.sleep(0.02)
        with open(os.path.join(OUT, "trained.jsonl"), "a") as out:
            samples = [[s.sample_id, s.full_batch.reserved, s.full_batch.weights] for s in batch.samples]
            out.write(json.dumps({"version": self.current_param_version, "samples": samples}) + "\n")
        return batch

    def _fit_compute_reward(self, batch: Any) -> Any:
        return batch

    _fit_compute_log_prob = _fit_compute_ref_log_prob = _fit_compute_critic = _fit_compute_reward
    _fit_compute_advantage = _fit_update_critic = _fit_compute_reward

    def _fit_collect_metrics(self, batch: Any) -> None:
        pass


class StandInTaskRunner(ProtocolTaskRunner):
    replacements = {
        **ProtocolTaskRunner.replacements,
        "FullyAsyncRollouter": _hosted_like(fully_async_rollouter.FullyAsyncRollouter, StandInRollouter),
        "FullyAsyncTrainer": _hosted_like(fully_async_trainer.FullyAsyncTrainer, StandInTrainer),
    }

    def run(self, config: Any) -> None:
        import verl.utils

        verl.utils.hf_tokenizer = verl.utils.hf_processor = lambda *args, **kwargs: None
        fully_async_main.copy_to_local = lambda path, **kwargs: path
        fully_async_main.create_role_worker_mapping = lambda config: ({Role.Actor: object, Role.Rollout: object}, None)
        fully_async_main.create_resource_pool_manager = lambda config, roles: None
        super().run(config)


def verl_config() -> Any:
    import verl.experimental.fully_async_policy as package

    overrides = [
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=0", "actor_rollout_ref.hybrid_engine=False",
        "trainer.logger=[console]", "trainer.save_freq=3", f"trainer.default_local_dir={OUT}/ckpt", "trainer.val_before_train=False",
        f"rollout.total_rollout_steps={TOTAL}", "actor_rollout_ref.model.path=none", "trainer.device=cpu", "algorithm.adv_estimator=grpo",
        f"+async_training.staleflow_trace_path={OUT}/trace.jsonl",
    ]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(package.__file__), "config"), version_base=None):
        return compose("fully_async_ppo_trainer", overrides=overrides)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    config = verl_config()
    ray.init(num_cpus=64, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    replicas = Replicas.options(name="staleflow_replicas").remote()  # held: the actor lives while the run does
    runner = use_protocol(fully_async_main, runner=StandInTaskRunner)
    assert fully_async_main.FullyAsyncTaskRunner is runner and ProtocolQueue and ProtocolQueueClient
    ray.get(runner.remote().run.remote(config))
    ray.shutdown()
    print("done")
