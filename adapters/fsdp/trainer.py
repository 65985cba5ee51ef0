"""The :class:`~staleflow.runtime.interfaces.Trainer` seam on FSDP2: ``train.world_size`` ranks.

Each rank (:class:`FSDPRank`, a process of its own: spawned, or a Ray actor with one GPU) builds the
Hugging Face model on the meta device, shards it with ``torch.distributed.fsdp.fully_shard`` (each
decoder layer, then the whole :class:`~staleflow.adapters.rlkit.packing.LogProbModel`), receives its
shards from rank 0 (the only rank that reads the checkpoint, on CPU), and runs the same RL step as
the one-process torch trainer (:func:`~staleflow.adapters.rlkit.packed_step.train_minibatches`):
packed token-budget micro-batches, chunked log-probs, gradient accumulation, the per-token average
taken over the whole minibatch on all ranks. Mixed precision on GPU: parameters computed in bf16
(``MixedPrecisionPolicy``), gradients reduced and weights kept in fp32; fp32 on CPU (gloo). With
``settings.cpu_offload`` on (or ``auto`` where :func:`~staleflow.runtime.settings.memory_estimate.choose_offload`
finds the state too large for the GPU) each rank keeps its shards of the weights, gradients and AdamW
state in CPU memory (FSDP2's ``CPUOffloadPolicy``: a layer is copied to the GPU for its compute and
the optimiser steps on CPU), as verl's 2-GPU 7B recipe does.

The driver side (:class:`FSDPTrainer`) checks and lays out each batch, spreads every minibatch's
sequences over the ranks with balanced token counts and runs the step on all ranks; after each step
the ranks publish the full weights from rank 0 in the training dtype, gathered one bucket of
``settings.publish_bucket_bytes`` at a time (:mod:`~staleflow.adapters.rlkit.bucketed_publish`):
rank 0 never holds a full fp32 copy of a version. With Ray actors as ranks it puts each bucket into
Ray's object store as it is gathered and the driver gets an
:class:`~staleflow.adapters.ray.object_weights.ObjectStoreWeights` reference, which the parameter
server keeps and the instances fetch: weights never travel through the driver (with spawned
processes they come to the driver, where the parameter server then is). The greedy evaluation
gathers the fp32 weights when it runs (rank 0 decodes). Checkpoints are sharded
(:mod:`~staleflow.adapters.fsdp.sharded_checkpoint`): each rank writes and reads its own shards of
the weights and the AdamW state, keyed by parameter name, so no rank holds the whole state and a
checkpoint restores at any world size; rank 0 checks the checkpoint's index, every shard file and
its small state before any rank is touched, and a refused one raises in the driver, the group
intact. A checkpoint of the full format that came before (``staleflow-fsdp/1``) is refused by name.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from staleflow.adapters.fsdp.sharded_checkpoint import check_shards, load_shards, save_shards
from staleflow.adapters.rlkit.bucketed_publish import gathered_buckets
from staleflow.adapters.rlkit.causal_lm import PublishedWeightsDecoder, empty_causal_lm, load_causal_lm
from staleflow.adapters.rlkit.checkpoint import CHECKPOINT_STATE, check_run_state, read_checkpoint_file
from staleflow.adapters.rlkit.hf_folder import check_model_folder
from staleflow.adapters.rlkit.packed_step import DistributedReducer, batch_metrics, split_groups, train_minibatches
from staleflow.adapters.rlkit.packing import (
    LogProbModel,
    batch_sequences,
    enable_activation_checkpointing,
    resolve_micro_batch_tokens,
    split_across_ranks,
)
from staleflow.adapters.rlkit.settings import TrainerSettings
from staleflow.adapters.rlkit.worker_group import ProcessWorkers, RayWorkers, WorkerGroupTrainer, rank_address, rank_device
from staleflow.runtime.settings.memory_estimate import choose_offload
from staleflow.runtime.types import TrainingBatch, TrainResult

CHECKPOINT_FORMAT = "staleflow-fsdp/2"
FULL_FORMAT = "staleflow-fsdp/1"  # full weights and optimiser state in rank 0's files (no longer read)
FSDP_PREFIX = "causal_lm."  # the LogProbModel's name for the Hugging Face model (before each weight's name)


class FSDPRank:
    """One rank of the FSDP trainer (lives in its own process)."""

    def address(self) -> str:
        """A ``tcp://`` rendezvous address on this rank's node (asked of rank 0)."""
        return rank_address()

    def setup(self, rank: int, world_size: int, address: str, model_path: str, settings: TrainerSettings,
              seed: int, device: str, threads: int, pad_id: int, by_reference: bool) -> bool:
        """Join the process group and shard the model; ``by_reference``: :meth:`publish` puts rank
        0's copy into Ray's object store and returns a reference (the ranks are Ray actors). Whether
        the model state is offloaded to CPU memory."""
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        torch.set_num_threads(threads)
        self.device = rank_device(device, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
        self.rank, self.world_size, self.settings, self.by_reference = rank, world_size, settings, by_reference
        self.decoder = PublishedWeightsDecoder(model_path, pad_id)
        torch.manual_seed(seed)
        # Only rank 0 reads the checkpoint (on CPU); every rank builds the model on the meta device,
        # shards it, and then receives its shards from rank 0.
        dtype = settings.compute_dtype(self.device)
        loaded = load_causal_lm(model_path) if rank == 0 else None  # the weights' source only: never run
        model = empty_causal_lm(model_path, self.device, dtype, settings.attention)
        model.eval()  # no dropout (as the torch trainer)
        if settings.activation_checkpointing:
            enable_activation_checkpointing(model)
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else MixedPrecisionPolicy()
        self.model = LogProbModel(model, chunk=settings.logprob_chunk, temperature=settings.temperature)
        self.micro_batch_tokens = resolve_micro_batch_tokens(model, settings.micro_batch_tokens)
        device_bytes = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
        self.offloaded = choose_offload(settings.cpu_offload, sum(p.numel() for p in model.parameters()), world_size, device_bytes)
        offload = CPUOffloadPolicy() if self.offloaded else OffloadPolicy()
        for layer in model.get_decoder().layers:
            fully_shard(layer, mp_policy=policy, offload_policy=offload)
        fully_shard(self.model, mp_policy=policy, offload_policy=offload)
        self._receive_weights(model, loaded)
        del loaded
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )
        warmup = settings.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        self.reducer = DistributedReducer(self.device)
        self.shapes, self.params = shapes, [name for name, _ in self.model.named_parameters()]
        return self.offloaded

    def _receive_weights(self, model: Any, loaded: Any) -> None:
        """Materialise the sharded meta-device ``model`` and fill it from rank 0's ``loaded`` copy:
        each rank keeps its shard of every weight; the buffers (rotary tables, which no state dict
        holds) are copied whole."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self.model.to_empty(device="cpu" if self.offloaded else self.device)  # offloaded shards live in CPU memory
        full = {FSDP_PREFIX + k: v for k, v in loaded.state_dict().items()} if loaded is not None else {}
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        source = dict(loaded.named_buffers()) if loaded is not None else {}
        for name, buffer in model.named_buffers():
            if loaded is not None:
                buffer.copy_(source[name])
            dist.broadcast(buffer, src=0)

    def step(self, minibatches: list[list[Any]]) -> dict[str, float] | None:
        s = self.settings
        metrics = train_minibatches(
            self.model, self.optimizer, list(self.model.parameters()), minibatches, loss=s.loss, grad_clip=s.grad_clip,
            max_tokens=self.micro_batch_tokens, device=self.device, reducer=self.reducer,
        )
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return metrics if self.rank == 0 else None

    def publish(self, version: int) -> Any:
        """Gather the full weights on rank 0 in the training dtype, one bucket at a time (a
        collective: every rank calls it); rank 0 returns them, or a reference to its buckets in
        Ray's object store (``by_reference``: each bucket is put there as it is gathered)."""
        from staleflow.adapters.ray.object_weights import hand_on_buckets

        buckets = gathered_buckets(self.model.state_dict(), self.settings.compute_dtype(self.device),
                                   self.settings.publish_bucket_bytes, keep=self.rank == 0, prefix=FSDP_PREFIX)
        return hand_on_buckets(buckets, version, keep=self.rank == 0, by_reference=self.by_reference)

    def _full_weights(self) -> dict[str, torch.Tensor] | None:
        """The fp32 weights gathered on rank 0, on CPU (a collective); None on the other ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k.removeprefix(FSDP_PREFIX): v for k, v in state.items()} if self.rank == 0 else None

    def save(self, folder: str, version: int, python_rng: Any) -> None:
        """Write a checkpoint to ``folder`` (a collective: each rank writes its own shards, then rank 0
        the small state, last)."""
        target = Path(folder)
        save_shards(self.model, self.optimizer, target)
        if self.rank == 0:
            torch.save({"format": CHECKPOINT_FORMAT, "version": version, "world_size": self.world_size, "torch_rng": torch.get_rng_state(),
                        "python_rng": python_rng, "scheduler": self.scheduler.state_dict()}, target / CHECKPOINT_STATE)

    def read_checkpoint(self, folder: str) -> dict[str, Any] | None:
        """Rank 0: check the checkpoint in ``folder`` (its small state, the shards' index and files);
        the small state every rank and the driver need, or ``{"refused": (kind, message)}``."""
        if self.rank != 0:
            return None
        source = Path(folder)
        try:
            if not (source / CHECKPOINT_STATE).is_file():
                raise FileNotFoundError(f"checkpoint {source} has no {CHECKPOINT_STATE}")
            state = read_checkpoint_file(source / CHECKPOINT_STATE, lambda path: torch.load(path, weights_only=False))
            _check_format(state, source / CHECKPOINT_STATE)
            check_run_state(state, source / CHECKPOINT_STATE)
            check_shards(source, {FSDP_PREFIX + name: shape for name, shape in self.shapes.items()}, self.params)
        except (ValueError, FileNotFoundError) as error:
            return {"refused": (type(error).__name__, str(error))}
        return {key: state[key] for key in ("version", "python_rng", "scheduler", "torch_rng")}

    def load(self, small: dict[str, Any], folder: str) -> None:
        """Restore the checkpoint in ``folder`` that :meth:`read_checkpoint` checked (a collective:
        each rank reads its own shards); ``small``: what that returned."""
        load_shards(self.model, self.optimizer, Path(folder))
        self.scheduler.load_state_dict(small["scheduler"])
        torch.set_rng_state(small["torch_rng"])

    def generate_greedy(self, prompts: Any, max_new_tokens: int, eos_id: int, batch_size: int) -> list[list[int]] | None:
        """Rank 0: greedy responses of the current (published) weights, on a CPU copy of the model in
        fp32 (a collective: every rank joins the gather)."""
        weights = self._full_weights()
        if weights is None:
            return None
        return self.decoder.generate(weights, prompts, max_new_tokens, eos_id, batch_size)  # type: ignore[no-any-return]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class FSDPTrainer(WorkerGroupTrainer):
    """GRPO training on ``world_size`` FSDP2 ranks (see the module docstring).

    Same constructor arguments and extras (``save_checkpoint``, ``load_checkpoint``,
    ``generate_greedy``) as :class:`~staleflow.adapters.torch.trainer.TorchTrainer`, plus
    ``world_size``, ``device`` (``cpu``: gloo; ``cuda``: NCCL, one GPU per rank) and ``launcher``
    (``process``: spawned processes; ``ray``: Ray actors, ``gpus_per_rank`` GPUs each on CUDA, or
    ``gpus_per_rank[r]`` for rank ``r``, in bundles ``0 .. world_size - 1`` of ``placement_group``
    when one is given). ``cpu_offload``: whether the ranks keep their model state in CPU memory
    (``settings.cpu_offload``, decided in each rank by the device it has). With ``ray``,
    :meth:`weights` is an :class:`~staleflow.adapters.ray.object_weights.ObjectStoreWeights`
    reference to rank 0's copy, not the weights.
    """

    def __init__(self, model_path: str | os.PathLike[str], *, settings: TrainerSettings | None = None, pad_id: int = 0,
                 version: int = 0, world_size: int = 2, device: str = "cpu", seed: int = 0, threads: int = 1,
                 launcher: str = "process", gpus_per_rank: float | Sequence[float] = 1.0, placement_group: Any = None) -> None:
        self._model_path = check_model_folder(model_path)
        settings = settings if settings is not None else TrainerSettings()
        self._settings, self._world = settings, world_size
        if launcher == "ray":
            gpus, cpus = (gpus_per_rank, 1) if device == "cuda" else (0.0, 0)
            self._workers: Any = RayWorkers(FSDPRank, world_size, num_gpus=gpus, num_cpus=cpus, placement_group=placement_group)
        elif launcher == "process":
            self._workers = ProcessWorkers(FSDPRank, world_size)
        else:
            raise ValueError(f"launcher must be 'process' or 'ray', got {launcher!r}")
        try:
            address = self._workers.call_all("address")[0]
            args = (world_size, address, str(self._model_path), settings, seed, device, threads, pad_id, launcher == "ray")
            self.cpu_offload = bool(self._workers.call_all("setup", [(rank, *args) for rank in range(world_size)])[0])
            published = self._publish(version)
        except BaseException:
            self._workers.close()
            raise
        self._start_background(version, published, "fsdp-trainer")

    def _publish(self, version: int) -> Any:
        return self._workers.call_all("publish", [(version,)] * self._world)[0]

    # ----------------------------------------------------------------------------------- the step
    def _step(self, batch: TrainingBatch) -> TrainResult:
        started = time.perf_counter()
        groups = batch_sequences(batch, scale_advantages=self._settings.scale_advantages)
        minibatches = split_groups(groups, self._settings.minibatches)
        shares: list[list[list[Any]]] = [[[] for _ in minibatches] for _ in range(self._world)]
        for m, mini in enumerate(minibatches):
            for rank, indices in enumerate(split_across_ranks([len(s) for s in mini], self._world)):
                shares[rank][m] = [mini[i] for i in indices]
        with self._lock:
            metrics = self._workers.call_all("step", [(share,) for share in shares])[0]
            gathered = time.perf_counter()
            self._published = self._publish(self._version + 1)
            self._version += 1
        seconds = time.perf_counter() - started
        metrics.update(batch_metrics(groups, batch.version))
        metrics.update({"train_s": seconds, "gather_s": time.perf_counter() - gathered,
                        "train_tokens_per_s": metrics["tokens"] / seconds if seconds > 0 else 0.0})
        return TrainResult(version=self._version, metrics=metrics)

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, folder: str | os.PathLike[str]) -> Path:
        """Every rank's shards of the weights and the optimiser state (by parameter name), and the
        schedule, version and RNG states (``folder`` must be on a filesystem every rank shares)."""
        target = self._checkpoint_folder(folder)
        with self._lock:
            self._workers.call_all("save", [(str(target.resolve()), self._version, random.getstate())] * self._world)
        return target

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> int:
        """Restore what :meth:`save_checkpoint` wrote (any world size); returns the restored version.
        A checkpoint that cannot be restored whole raises (ValueError or FileNotFoundError, naming
        the file) and changes nothing."""
        source = self._restore_folder(folder)
        with self._lock:
            small = self._workers.call_all("read_checkpoint", [(str(source.resolve()),)] * self._world)[0]
            if "refused" in small:
                kind, message = small["refused"]
                raise (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(message)
            self._workers.call_all("load", [(small, str(source.resolve()))] * self._world)
            random.setstate(small["python_rng"])
            self._version = int(small["version"])
            self._published = self._publish(self._version)
        return self._version

    # --------------------------------------------------------------------------------- evaluation
    def generate_greedy(self, prompts: Any, max_new_tokens: int, eos_id: int, batch_size: int = 64) -> list[list[int]]:
        """Greedy responses of the published weights, decoded by rank 0 on a CPU copy of the model."""
        with self._lock:
            return self._workers.call_all("generate_greedy", [(prompts, max_new_tokens, eos_id, batch_size)] * self._world)[0]  # type: ignore[no-any-return]


def _check_format(state: Any, path: Path) -> None:
    """Refuse a trainer state that is not this trainer's sharded format, naming the format found."""
    found = state.get("format", "a torch-trainer state") if isinstance(state, dict) else type(state).__name__
    if found == FULL_FORMAT:
        raise ValueError(
            f"checkpoint file {path} is of the full format {FULL_FORMAT} (model.safetensors and the whole optimiser state "
            f"on rank 0), which this trainer no longer restores; it restores sharded checkpoints ({CHECKPOINT_FORMAT}). "
            "`staleflow export` still turns its weights into a Hugging Face folder to start a new run from"
        )
    if found != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint file {path} is not an FSDP trainer state ({CHECKPOINT_FORMAT}); found {found}")
