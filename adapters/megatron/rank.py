"""One rank of the Megatron trainer: its part of the model, its optimiser state, its share of a step.

A rank holds the slice of the ``GPTModel`` that its tensor-parallel rank and pipeline stage own
(:mod:`~staleflow.adapters.megatron.parallel`), wrapped in Megatron's ``DistributedDataParallel``
and stepped by Megatron's optimizer. A step runs Megatron's own pipeline schedule
(``get_forward_backward_func``: no pipelining at PP = 1, 1F1B otherwise) over equal-sized
micro-batches; the last stage computes the policy loss's token *sum* and its counted tokens, and
with ``calculate_per_token_loss`` Megatron's ``finalize_model_grads`` sums the gradients over the
data-parallel ranks and divides by the tokens counted on all of them, so the update is the per-token
average over the whole minibatch, as in the one-process torch trainer. After each step the ranks
publish their stages' weights (:meth:`MegatronRank.publish`, :mod:`~staleflow.adapters.megatron.publish`).

GPU only: Megatron's schedules, DDP and optimizer allocate on CUDA. On CPU the forward pieces
(:func:`logprobs_from_logits`, :func:`megatron_logprobs`) run with the test-only monkeypatches of
``tests/test_megatron_trainer.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from staleflow.adapters.megatron.convert import build_gpt_model, hf_to_megatron, stage_reads, transformer_config_from_hf
from staleflow.adapters.megatron.parallel import MegatronLayout, shard_for_rank
from staleflow.adapters.megatron.publish import is_stage_publisher, stage_buckets
from staleflow.adapters.rlkit.algorithms import Correction, PackedBatch, add_sums, metrics_from_sums, policy_terms
from staleflow.adapters.rlkit.packing import VARLEN_MICRO_BATCH_TOKENS
from staleflow.adapters.rlkit.settings import TrainerSettings
from staleflow.adapters.rlkit.worker_group import rank_address, rank_device


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """Megatron's attention mask (True = masked out) for causal attention, ``[1, 1, length, length]``.

    Given explicitly: with ``attention_mask=None`` Megatron builds its default mask on ``cuda``.
    """
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Next-token log-probs ``[rows, length - 1]`` from a GPTModel's logits ``[rows, length, vocab / TP]``.

    The logits stay split over the tensor-parallel ranks: ``vocab_parallel_cross_entropy`` reduces
    over the split, so no rank ever holds the whole vocabulary.
    """
    from megatron.core import tensor_parallel

    scaled = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    # vocab_parallel_cross_entropy wants [sequence, batch, vocab].
    nll = tensor_parallel.vocab_parallel_cross_entropy(scaled.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)


def megatron_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Next-token log-probs of a (right-padded) batch under a whole-model (PP = 1) GPTModel.

    Causal attention alone is exact for right padding: a real token never attends to the pads
    after it, and the pads' own outputs are masked out of the loss. (``attention_mask`` is
    accepted for symmetry with the torch trainer.)
    """
    mask = causal_mask(input_ids.shape[1], input_ids.device)
    logits = model(input_ids=input_ids, position_ids=_positions(input_ids), attention_mask=mask)
    return logprobs_from_logits(logits, input_ids, temperature)


def micro_batches(part: PackedBatch, max_tokens: int) -> list[PackedBatch]:
    """``part`` cut into micro-batches of equal row counts (pipeline stages exchange fixed shapes):
    the largest divisor of the row count whose rows fit ``max_tokens`` padded tokens (at least 1)."""
    rows, length = part.input_ids.shape
    fitting = max(1, max_tokens // max(length, 1))
    size = max(d for d in range(1, rows + 1) if rows % d == 0 and d <= fitting)
    return [part.rows(slice(start, start + size)) for start in range(0, rows, size)]


def _on_device(part: PackedBatch, device: torch.device) -> PackedBatch:
    return PackedBatch(**{name: getattr(part, name).to(device) for name in PackedBatch.__dataclass_fields__})


def local_state(model: Any) -> dict[str, torch.Tensor]:
    """The rank's weights under their local Megatron names, as the model holds them (training dtype, its device)."""
    state = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
    return {k.removeprefix("module."): v.detach() for k, v in state.items() if not k.endswith("_extra_state")}  # Float16Module


def _local_weights(model: Any) -> dict[str, torch.Tensor]:
    """The rank's weights under their local Megatron names, fp32 copies on CPU."""
    return {k: v.float().cpu().clone() for k, v in local_state(model).items()}


class MegatronRank:
    """One rank of :class:`~staleflow.adapters.megatron.trainer.MegatronTrainer` (its own process, one GPU)."""

    def address(self) -> str:
        return rank_address()

    def setup(  # pragma: no cover - needs CUDA
        self, rank: int, layout: MegatronLayout, address: str, model_path: str, settings: TrainerSettings, seed: int, bf16: bool,
        by_reference: bool,
    ) -> tuple[int, int, int]:
        """Join the group, build this rank's part of the model from the Hugging Face folder; its coordinates.
        ``by_reference``: :meth:`publish` puts its stage's buckets into Ray's object store (the ranks are Ray actors)."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core import tensor_parallel as mcore_tp
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from transformers import AutoConfig

        # this rank's own GPU (the driver may be a CPU-only head node); none is an error naming the rank
        torch.cuda.set_device(rank_device("cuda", rank, without_gpu="or use train.backend=torch or fsdp: Megatron trains on GPUs only"))
        dist.init_process_group("nccl", init_method=address, rank=rank, world_size=layout.world_size, timeout=timedelta(minutes=30))
        parallel_state.initialize_model_parallel(layout.tensor_parallel, layout.pipeline_parallel)
        mcore_tp.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        self.layout, self.settings, self.by_reference = layout, settings, by_reference
        self.coordinates = layout.coordinates(rank)
        self.dtype = torch.bfloat16 if bf16 else torch.float32  # trained and published in
        self.hf_config = hf_config = AutoConfig.from_pretrained(model_path)
        config = transformer_config_from_hf(hf_config, bf16=bf16, tensor_parallel=layout.tensor_parallel,
                                            pipeline_parallel=layout.pipeline_parallel)
        config.calculate_per_token_loss = True
        model = build_gpt_model(hf_config, config).cuda()
        tp_rank, pp_rank, _ = self.coordinates
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        stage = layout.stage(pp_rank, hf_config.num_hidden_layers)
        hf = read_hf_weights(Path(model_path), lambda name: stage_reads(name, stage, tied))  # this stage's tensors only
        local = shard_for_rank(hf_to_megatron(hf, hf_config, stage), layout, tp_rank, pp_rank, hf_config.num_hidden_layers, tied)
        missing, unexpected = model.load_state_dict(local, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"rank {rank}: the model split does not match the built stage: missing {missing}, unexpected {unexpected}")
        if bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=settings.lr, weight_decay=settings.weight_decay, adam_beta1=settings.betas[0],
                            adam_beta2=settings.betas[1], clip_grad=settings.grad_clip, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32),
            [self.model],
        )
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.steps_taken = 0
        return self.coordinates

    # ----------------------------------------------------------------------------------- the step
    def _schedule(  # pragma: no cover - needs CUDA
        self, plan: list[PackedBatch], forward_only: bool, proximal: list[torch.Tensor] | None = None,
    ) -> list[Any]:
        """Megatron's pipeline schedule over ``plan``; the last stage's per-micro-batch outputs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        settings = self.settings
        device = torch.device("cuda", torch.cuda.current_device())

        def forward_step(iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            index, micro = next(iterator)
            ids = micro.input_ids.to(device)
            output = model(input_ids=ids, position_ids=_positions(ids), attention_mask=causal_mask(ids.shape[1], device))

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
                logp = logprobs_from_logits(logits, ids, settings.temperature)
                if forward_only:
                    return logp.sum() * 0.0, torch.ones((), dtype=torch.int, device=device), {"logprobs": logp.detach()}
                part = _on_device(micro, device)
                advantages = part.advantages.unsqueeze(-1).expand_as(part.loss_mask)
                prox = proximal[index] if proximal is not None else logp.detach()
                loss_sum, sums = policy_terms(logp, part.behaviour_logprobs, part.loss_mask, advantages, settings.loss, prox)
                counted = torch.as_tensor(sums["keep"], device=device).to(torch.int).reshape(())
                return loss_sum, counted, {"sums": {k: float(v) for k, v in sums.items()}}

            return output, loss_func

        rows, length = plan[0].input_ids.shape
        return get_forward_backward_func()(  # type: ignore[no-any-return]
            forward_step_func=forward_step, data_iterator=iter(enumerate(plan)), model=[self.model], num_microbatches=len(plan),
            seq_length=length, micro_batch_size=rows, forward_only=forward_only,
        )

    def step(self, minibatches: list[PackedBatch]) -> dict[str, float] | None:  # pragma: no cover - needs CUDA
        """One optimiser step per minibatch (this data-parallel rank's rows); metrics from the reporting rank."""
        settings = self.settings
        budget = settings.micro_batch_tokens or VARLEN_MICRO_BATCH_TOKENS  # equal padded rows: no packed mask
        plans = [micro_batches(part, budget) for part in minibatches]
        self.model.train()
        proximal = None
        if len(plans) > 1 and settings.loss.correction is not Correction.NONE:
            with torch.no_grad():
                proximal = [[out["logprobs"] for out in self._schedule(plan, forward_only=True)] for plan in plans]
        factor = min(1.0, (self.steps_taken + 1) / settings.lr_warmup_steps) if settings.lr_warmup_steps > 0 else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = settings.lr * factor
        averaged: dict[str, float] = {}
        grad_norms = []
        for index, plan in enumerate(plans):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self._schedule(plan, forward_only=False, proximal=proximal[index] if proximal else None)
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError("Megatron optimizer step was skipped (non-finite gradients)")
            grad_norms.append(float(grad_norm or 0.0))
            totals: dict[str, float] = {}
            for out in outputs:  # empty on every stage but the last
                add_sums(totals, out["sums"])
            for key, value in (metrics_from_sums(totals, settings.loss) if totals else {}).items():
                averaged[key] = averaged.get(key, 0.0) + value / len(plans)
        self.steps_taken += 1
        averaged.update({"grad_norm": max(grad_norms), "lr": settings.lr * factor,
                         "packed_tokens": float(sum(part.input_ids.numel() for part in minibatches)),
                         "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        tp_rank, pp_rank, dp_rank = self.coordinates
        reporting = tp_rank == 0 and dp_rank == 0 and pp_rank == self.layout.pipeline_parallel - 1
        return averaged if reporting else None

    # ---------------------------------------------------------------------- weights and checkpoints
    def local_weights(self) -> tuple[int, int, dict[str, torch.Tensor]] | None:  # pragma: no cover - needs CUDA
        """``(tp_rank, pp_rank, weights)`` on the ranks of data-parallel replica 0, else None."""
        tp_rank, pp_rank, dp_rank = self.coordinates
        return (tp_rank, pp_rank, _local_weights(self.model)) if dp_rank == 0 else None

    def publish(self, version: int) -> Any:  # pragma: no cover - needs CUDA
        """Publish this stage's weights (a collective of replica 0's tensor-parallel groups: every rank
        calls it): the stage publisher returns its buckets' weights, or a reference to them in Ray's
        object store (``by_reference``); every other rank None (:mod:`~staleflow.adapters.megatron.publish`)."""
        from megatron.core import parallel_state
        from staleflow.adapters.ray.object_weights import hand_on_buckets

        buckets = stage_buckets(local_state(self.model), self.hf_config, self.layout, self.coordinates,
                                parallel_state.get_tensor_model_parallel_group(), self.dtype, self.settings.publish_bucket_bytes)
        return hand_on_buckets(buckets, version, keep=is_stage_publisher(self.coordinates), by_reference=self.by_reference)

    def save_optimizer(self, path: str) -> None:  # pragma: no cover - needs CUDA
        """This rank's optimiser state (its own slice of every parameter's moments)."""
        torch.save({"layout": self.layout, "coordinates": self.coordinates, "optimizer": self.optimizer.state_dict()}, path)

    def load(self, local: dict[str, torch.Tensor], optimizer_path: str, steps_taken: int) -> None:  # pragma: no cover - needs CUDA
        """Weights (this rank's slice, checked by the driver) and the optimiser state file the driver checked."""
        state = torch.load(optimizer_path, map_location="cuda", weights_only=False)
        target = getattr(self.model.module, "module", self.model.module)  # inside Float16Module, if any
        target.load_state_dict(local, strict=False)  # every tensor: checked by the driver
        self.optimizer.reload_model_params()  # the fp32 main copies follow the loaded weights
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_taken = steps_taken

    def close(self) -> None:  # pragma: no cover - needs CUDA
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def read_hf_weights(folder: Path, wanted: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder's safetensors files (sharded or not) whose names are
    ``wanted``; the others are never read from disk."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as stream:
            for name in stream.keys():
                if wanted(name):
                    weights[name] = stream.get_tensor(name)
    return weights


def optimizer_file(folder: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank``'s optimiser state lives in a checkpoint folder."""
    return Path(folder) / f"megatron_optimizer.rank{rank:05d}.pt"
