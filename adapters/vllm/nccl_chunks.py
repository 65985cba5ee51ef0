"""vLLM's NCCL weight-transfer engine receiving StaleFlow's chunks (registered as backend
``staleflow_nccl`` by :func:`staleflow.adapters.vllm.weight_transfer.register_engines`; imported by
vLLM's factory in the worker process only).

vLLM's own ``nccl`` engine in packed mode receives whole tensors, packed until a buffer is full, so
its sender needs a GPU buffer of at least the largest tensor (twice, with two in flight). This engine
keeps vLLM's group, lifecycle and loading (layerwise reload around the model's ``load_weights``) and
receives the chunks of :mod:`staleflow.adapters.rlkit.wire_chunks` instead, which the gloo engine
receives too: the sender's staging buffer is bounded by the bucket size
(``packed_buffer_size_bytes`` of the init info), whatever the largest tensor.
"""

from __future__ import annotations

import torch
from staleflow.adapters.rlkit.weight_sender import received_specs
from staleflow.adapters.rlkit.wire_chunks import receive_chunks
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo


class ChunkedNCCLWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL engine receiving chunks of at most ``packed_buffer_size_bytes``."""

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        group = self.model_update_group
        if group is None:
            raise RuntimeError("the NCCL weight transfer is not initialised: call init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        specs = received_specs(update_info.names, update_info.dtype_names, update_info.shapes)
        stream = receive_chunks(specs, self.packed_buffer_size_bytes,
                                lambda buffer: group.broadcast(buffer, src=0, stream=torch.cuda.current_stream()), device=self.device)
        with disable_mtp_completeness_check():
            self.model.load_weights(stream)
            for _ in stream:  # what the loader left: the broadcast runs to its end on every rank
                pass
