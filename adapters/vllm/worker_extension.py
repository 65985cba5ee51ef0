"""A vLLM worker extension: reload the model's weights in place from a safetensors file.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls the method through
``collective_rpc``, which serialises arguments with msgpack: a dict of tensors would arrive as lists,
so the weights travel as a file path (on tmpfs where there is one). Loading goes through the worker's
``reload_weights``, because the CPU backend repacks linear weights after start-up and the model's own
``load_weights`` then fails on the repacked parameters. (Transfers go through vLLM's weight-transfer
API instead, :mod:`staleflow.adapters.vllm.weight_transfer`; importing this module registers
StaleFlow's ``gloo`` and ``staleflow_nccl`` engines in the worker's process, before the worker builds its transfer engine.)
"""

from __future__ import annotations

from typing import Any

from staleflow.adapters.vllm.weight_transfer import refresh_cpu_output_layer, register_engines

register_engines()


class WeightReloadExtension:
    """Methods that vLLM adds to every worker (``self`` is the worker)."""

    reload_weights: Any  # provided by the vLLM worker this class is mixed into

    def staleflow_reload_safetensors(self, path: str) -> int:
        """Load every tensor of the safetensors file ``path`` into the model; returns their count."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        refresh_cpu_output_layer(self.model_runner.model)  # type: ignore[attr-defined]
        return len(tensors)

    def staleflow_weight_checksums(self, seed: int) -> dict[str, Any]:
        """This rank's weight layouts and checksums (:mod:`staleflow.adapters.vllm.weight_checksum`)."""
        from staleflow.adapters.vllm.weight_checksum import rank_checksums
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return rank_checksums(self.model_runner.model, seed, get_tensor_model_parallel_rank())  # type: ignore[attr-defined]
