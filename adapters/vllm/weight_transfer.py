"""Weight sync through vLLM's weight-transfer API (``vllm.distributed.weight_transfer``).

The receiving side is vLLM's own: the worker builds a ``WeightTransferEngine`` from
``EngineArgs.weight_transfer_config`` (backend ``nccl`` on GPUs, ``gloo`` on CPU) and the engine is
driven by the four control-plane calls ``init_weight_transfer_engine`` (once: the worker joins a
long-lived group with the sender), ``start_weight_update``, ``update_weights`` and
``finish_weight_update`` with the version, which vLLM stamps on every token sampled afterwards.

``nccl`` is vLLM's engine as shipped. ``gloo`` is registered here through
``WeightTransferEngineFactory.register_engine``: the same lifecycle (layerwise reload around the
model's ``load_weights``, so checkpoint names are fused into vLLM's parameters and a tied output
layer is skipped), over a gloo group in CPU memory. CI therefore runs the GPU code path; only the
transport differs. The ``gloo`` worker engine is :mod:`staleflow.adapters.vllm.gloo_transfer`; the sender's
half is :mod:`staleflow.adapters.rlkit.weight_sender`.
"""

from __future__ import annotations

from typing import Any

import torch

from staleflow.adapters.rlkit.weight_sender import BACKENDS

GLOO = "gloo"


def default_backend() -> str:
    """The weight-transfer backend of this machine's vLLM build: ``nccl`` on CUDA, else ``gloo``."""
    from vllm.platforms import current_platform

    return "nccl" if current_platform.is_cuda_alike() else GLOO


def register_gloo_engine() -> None:
    """Register :class:`GlooWeightTransferEngine` as vLLM's ``gloo`` backend (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(GLOO, "staleflow.adapters.vllm.gloo_transfer", "GlooWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


def weight_transfer_args(backend: str) -> dict[str, Any]:
    """The ``EngineArgs`` that give every worker a weight-transfer engine of ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"weight-transfer backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == GLOO:
        register_gloo_engine()
    return {"weight_transfer_config": {"backend": backend}}


class EngineWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an ``LLMEngine`` in this process: each call goes
    to every worker (``collective_rpc``); ``finish_weight_update(weight_version)`` also sets the
    version the engine core stamps on the tokens it samples from then on. ``calls`` records the
    calls made, in order (their names)."""

    def __init__(self, llm_engine: Any) -> None:
        self._llm = llm_engine
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init_weight_transfer_engine")
        self._llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.calls.append("start_weight_update")
        self._llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update_weights")
        self._llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish_weight_update")
        self._llm.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self._llm.set_weight_version(weight_version)


def refresh_cpu_output_layer(model: torch.nn.Module) -> None:
    """vLLM-CPU computes logits with a GEMM it prepared from the output layer's weight at start-up; a
    reload does not prepare it again for a vocabulary embedding, so with tied embeddings (the output
    layer *is* the input embedding) the logits kept the old weights. Prepare it again."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
