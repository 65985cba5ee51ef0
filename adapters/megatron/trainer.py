"""The :class:`~staleflow.runtime.interfaces.Trainer` seam on Megatron-core (GPU): ``train.world_size``
ranks as ``tensor_parallel x pipeline_parallel x data_parallel``.

The same RL step as the torch and FSDP trainers (``adapters/rlkit/algorithms.py``: GRPO
advantages, off-policy correction, per-token loss) on a Megatron-core ``GPTModel`` split over the
ranks (:mod:`~staleflow.adapters.megatron.parallel`), each rank (:class:`MegatronRank`, a process
of its own: spawned, or a Ray actor with one GPU) wrapped in Megatron's ``DistributedDataParallel``,
stepped by Megatron's optimizer and pipeline schedule (:mod:`~staleflow.adapters.megatron.rank`).

The driver (:class:`MegatronTrainer`) lays out each batch and gives every data-parallel replica a
contiguous share of each minibatch's rows (every rank of a replica gets the same rows). The ranks
publish each version as Hugging Face weights in the training dtype
(:mod:`~staleflow.adapters.megatron.publish`): each pipeline stage gathers its layers across its
tensor-parallel group one weight at a time, converts them one layer at a time and hands them on in
buckets of ``settings.publish_bucket_bytes``. The driver receives the stages' buckets (spawned
ranks) or references to them in Ray's object store (Ray actors), never the model to convert, and
the parameter server and vLLM keep using Hugging Face names.
Checkpoints hold the full model (``megatron_trainer.pt``, any layout can read it) and one optimiser
file per rank (read back only by the same layout); a load checks every file and key first.

**What runs where.** Megatron's optimizer, DDP and schedules need CUDA (``get_megatron_optimizer``
allocates on ``cuda``; the schedules count tokens on ``cuda``), so :class:`MegatronTrainer` runs
**only on CUDA GPUs** and refuses to start without one, after checking the layout against the
model. On CPU the tests check the layout rules against Megatron's own parameter attributes, and a
tensor-parallel and a pipeline-parallel split of the model (two gloo processes, with the CPU
monkeypatches of ``tests/test_megatron_trainer.py``) against the Hugging Face model's log-probs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from staleflow.adapters.megatron.convert import (  # noqa: F401 - re-exported: the trainer's public conversion API
    build_gpt_model,
    check_convertible,
    full_megatron_shapes,
    hf_to_megatron,
    load_hf_into_megatron,
    megatron_to_hf,
    transformer_config_from_hf,
)
from staleflow.adapters.megatron.parallel import MegatronLayout, shard_for_rank, unshard
from staleflow.adapters.megatron.publish import join_stage_publications
from staleflow.adapters.megatron.rank import (  # noqa: F401 - re-exported
    MegatronRank,
    causal_mask,
    megatron_logprobs,
    optimizer_file,
)
from staleflow.adapters.rlkit.algorithms import pack_batch, token_staleness
from staleflow.adapters.rlkit.causal_lm import PublishedWeightsDecoder
from staleflow.adapters.rlkit.checkpoint import check_weights_match, read_checkpoint_file
from staleflow.adapters.rlkit.hf_folder import check_model_folder
from staleflow.adapters.rlkit.settings import TrainerSettings
from staleflow.adapters.rlkit.worker_group import ProcessWorkers, RayWorkers, WorkerGroupTrainer
from staleflow.runtime.types import TrainingBatch, TrainResult

CHECKPOINT_FILE = "megatron_trainer.pt"
CHECKPOINT_FORMAT = "staleflow-megatron/2"


class MegatronTrainer(WorkerGroupTrainer):
    """GRPO training on Megatron-core ranks, one CUDA GPU each (see the module docstring).

    Same constructor and extras (``save_checkpoint``, ``load_checkpoint``, ``generate_greedy``) as
    :class:`~staleflow.adapters.torch.trainer.TorchTrainer`, so the run loop and ``staleflow
    train`` (``train.backend=megatron``) use either; plus the layout (``tensor_parallel``,
    ``pipeline_parallel``, ``world_size``) and the launcher (``process``: spawned processes on this
    node; ``ray``: Ray actors, ``gpus_per_rank`` GPUs each or ``gpus_per_rank[r]`` for rank r, rank r in
    bundle r of ``placement_group``).
    """

    def __init__(self, model_path: str | os.PathLike[str], *, settings: TrainerSettings | None = None, pad_id: int = 0,
                 version: int = 0, seed: int = 0, bf16: bool = True, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 world_size: int = 1, launcher: str = "process", gpus_per_rank: float | Sequence[float] = 1.0,
                 placement_group: Any = None) -> None:
        from transformers import AutoConfig

        self._layout = layout = MegatronLayout(tensor_parallel, pipeline_parallel, world_size)
        folder = check_model_folder(model_path)
        self._hf_config = AutoConfig.from_pretrained(str(folder))
        check_convertible(self._hf_config)  # a model without a conversion (MoE) is refused by name, before any rank starts
        layout.check_model(self._hf_config)
        # Where the ranks run decides: this node's processes need this node's CUDA; Ray actors need GPUs
        # given (train.gpus > 0) and each checks its own (a CPU-only head node may drive GPU workers).
        shares = [gpus_per_rank] * world_size if isinstance(gpus_per_rank, (int, float)) else list(gpus_per_rank)
        if (not torch.cuda.is_available()) if launcher == "process" else not all(share > 0 for share in shares):
            where = "this node has no CUDA device" if launcher == "process" else f"its ranks were given no GPUs ({shares})"
            raise RuntimeError(
                f"the Megatron trainer needs CUDA GPUs (Megatron-core's optimizer, DDP and pipeline schedules are CUDA-only) "
                f"and {where}; use train.backend=torch or fsdp on CPU"
            )
        self._start(  # pragma: no cover - needs CUDA
            folder, settings, pad_id, version, seed, bf16, launcher, gpus_per_rank, placement_group)

    def _start(  # pragma: no cover - needs CUDA
        self, folder: Path, settings: TrainerSettings | None, pad_id: int, version: int, seed: int, bf16: bool, launcher: str,
        gpus_per_rank: float | Sequence[float], placement_group: Any,
    ) -> None:
        """Start the ranks, build the model on them and publish its weights."""
        layout, world_size = self._layout, self._layout.world_size
        if launcher == "ray":
            workers: Any = RayWorkers(MegatronRank, world_size, num_gpus=gpus_per_rank, num_cpus=1, placement_group=placement_group)
        elif launcher == "process":
            workers = ProcessWorkers(MegatronRank, world_size)
        else:
            raise ValueError(f"launcher must be 'process' or 'ray', got {launcher!r}")
        self._workers = workers
        self._settings = settings = settings if settings is not None else TrainerSettings()
        self._pad_id = pad_id
        self._decoder = PublishedWeightsDecoder(folder, pad_id)
        try:
            self._full_shapes = full_megatron_shapes(self._hf_config)  # what a checkpoint load checks
            address = workers.call_all("address")[0]
            args = (layout, address, str(folder), settings, seed, bf16, launcher == "ray")
            workers.call_all("setup", [(rank, *args) for rank in range(world_size)])
            published = self._publish(version)
        except BaseException:
            workers.close()
            raise
        self._steps_taken = 0
        self._start_background(version, published, "megatron-trainer")

    @property
    def _tied(self) -> bool:  # pragma: no cover - needs CUDA
        return bool(getattr(self._hf_config, "tie_word_embeddings", False))

    def _full_megatron(self) -> dict[str, torch.Tensor]:  # pragma: no cover - needs CUDA
        """The whole model under full (TP = PP = 1) Megatron names, from replica 0's ranks."""
        answers = [a for a in self._workers.call_all("local_weights") if a is not None]
        return unshard({(tp, pp): weights for tp, pp, weights in answers}, self._layout, self._hf_config.num_hidden_layers, self._tied)

    def _publish(self, version: int) -> Any:  # pragma: no cover - needs CUDA
        """Version ``version`` as the ranks publish it: each stage's buckets (or references to them), joined."""
        answers = self._workers.call_all("publish", [(version,)] * self._layout.world_size)
        return join_stage_publications([a for a in answers if a is not None], version)

    # ----------------------------------------------------------------------------------- the step
    def _step(self, batch: TrainingBatch) -> TrainResult:  # pragma: no cover - needs CUDA
        started = time.perf_counter()
        settings = self._settings
        packed = pack_batch(batch, pad_id=self._pad_id, scale_advantages=settings.scale_advantages)
        shares = replica_shares(packed, settings.minibatches, self._layout.data_parallel)
        with self._lock:
            args = [(shares[self._layout.coordinates(rank)[2]],) for rank in range(self._layout.world_size)]
            metrics = next(m for m in self._workers.call_all("step", args) if m is not None)
            gathered = time.perf_counter()
            self._published = self._publish(self._version + 1)
            self._steps_taken += 1
            self._version += 1
        seconds = time.perf_counter() - started
        staleness = token_staleness(packed, batch.version).float()
        metrics.update({
            "tokens": float(packed.response_tokens),
            "reward_mean": float(packed.rewards.mean()),
            "token_staleness_mean": float(staleness.mean()),
            "token_staleness_max": float(staleness.max()),
            "train_s": seconds,
            "gather_s": time.perf_counter() - gathered,
        })
        return TrainResult(version=self._version, metrics=metrics)

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, folder: str | os.PathLike[str]) -> Path:  # pragma: no cover - needs CUDA
        """The full model (any layout reads it) and one optimiser file per rank (same layout only)."""
        target = self._checkpoint_folder(folder)
        with self._lock:
            self._workers.call_all("save_optimizer", [(str(optimizer_file(target, r)),) for r in range(self._layout.world_size)])
            layout = self._layout
            torch.save({"format": CHECKPOINT_FORMAT, "version": self._version, "steps_taken": self._steps_taken,
                        "layout": (layout.tensor_parallel, layout.pipeline_parallel, layout.world_size),
                        "model": self._full_megatron()}, target / CHECKPOINT_FILE)
        return target

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> int:  # pragma: no cover - needs CUDA
        """Restore what :meth:`save_checkpoint` wrote; every file, key and shape is checked before any rank is touched."""
        self._restore_folder(folder)
        expected = {name: torch.empty(shape, device="meta") for name, shape in self._full_shapes.items()}
        state = read_megatron_checkpoint(folder, expected, self._layout)
        layers = self._hf_config.num_hidden_layers
        args = []
        for rank in range(self._layout.world_size):
            tp_rank, pp_rank, _ = self._layout.coordinates(rank)
            local = shard_for_rank(state["model"], self._layout, tp_rank, pp_rank, layers, self._tied)
            args.append((local, str(optimizer_file(folder, rank)), int(state["steps_taken"])))
        with self._lock:
            self._workers.call_all("load", args)
            self._version = int(state["version"])
            self._steps_taken = int(state["steps_taken"])
            self._published = self._publish(self._version)
        return self._version


def replica_shares(packed: Any, minibatches: int, replicas: int) -> list[list[Any]]:
    """For each data-parallel replica, its contiguous rows of each of the ``minibatches`` minibatches."""
    rows = packed.input_ids.shape[0]
    bounds = [round(i * rows / minibatches) for i in range(minibatches + 1)]
    shares: list[list[Any]] = [[] for _ in range(replicas)]
    for a, b in zip(bounds, bounds[1:]):
        if b - a < replicas:
            raise ValueError(
                f"a minibatch of {b - a} sequences cannot feed {replicas} data-parallel replicas: lower train.minibatches "
                f"({minibatches}) or the data-parallel size (world_size / (tensor_parallel x pipeline_parallel))"
            )
        cuts = [a + round(j * (b - a) / replicas) for j in range(replicas + 1)]
        for replica in range(replicas):
            shares[replica].append(packed.rows(slice(cuts[replica], cuts[replica + 1])))
    return shares


def read_megatron_checkpoint(folder: str | os.PathLike[str], expected: Mapping[str, Any], layout: MegatronLayout | None = None,
                             map_location: str = "cpu") -> dict[str, Any]:
    """The Megatron trainer's checkpoint in ``folder``, refused (naming the file and the tensors) if it is
    missing, unreadable, of another format, lacks a part, holds a version or step count that is not a
    count, holds weights of another model than ``expected`` (a full state dict, or shapes on the
    ``meta`` device), or, when ``layout`` is given,
    was saved by another layout or lacks a readable optimiser file of one of the layout's ranks."""
    source = Path(folder) / CHECKPOINT_FILE
    if not source.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {CHECKPOINT_FILE}")
    state = read_checkpoint_file(source, lambda path: torch.load(path, map_location=map_location, weights_only=False))
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint file {source} holds a {type(state).__name__}, not a Megatron trainer state")
    missing = [k for k in ("format", "version", "steps_taken", "layout", "model") if k not in state]
    if missing:
        raise ValueError(f"checkpoint file {source} lacks {missing}")
    if state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint file {source} is in format {state['format']!r}, not {CHECKPOINT_FORMAT!r}")
    bad = [k for k in ("version", "steps_taken") if isinstance(state[k], bool) or not isinstance(state[k], int) or state[k] < 0]
    if bad:
        raise ValueError(f"checkpoint file {source} holds {', '.join(f'{k}={state[k]!r}' for k in bad)}: not a count >= 0")
    if not isinstance(state["model"], dict):
        raise ValueError(f"checkpoint file {source} holds no model state dict")
    weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
    check_weights_match(weights, {k: v for k, v in expected.items() if not k.endswith("_extra_state")}, source)
    if layout is not None:
        ours = (layout.tensor_parallel, layout.pipeline_parallel, layout.world_size)
        if tuple(state["layout"]) != ours:
            raise ValueError(
                f"checkpoint {folder} was saved with (tensor_parallel, pipeline_parallel, world_size) = {tuple(state['layout'])}, "
                f"this trainer has {ours}: the optimiser state is per rank, so the layout must match"
            )
        for rank in range(layout.world_size):
            path = optimizer_file(folder, rank)
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint {folder} has no optimiser state of rank {rank} ({path.name})")
            saved = read_checkpoint_file(path, lambda p: torch.load(p, map_location="cpu", weights_only=False, mmap=True))
            if not isinstance(saved, dict) or "optimizer" not in saved or tuple(saved.get("coordinates", ())) != layout.coordinates(rank):
                raise ValueError(f"checkpoint file {path} is not the optimiser state of rank {rank} {layout.coordinates(rank)}")
    return state
