"""What an FSDP trainer rank holds in device memory for its model state, and whether it must move
that state to CPU memory (FSDP2's ``CPUOffloadPolicy``). Pure arithmetic on the job's numbers, so
``staleflow train --dry-run`` can print it and the trainer can decide by it.

The formula (mixed precision as the FSDP trainer runs it: fp32 master weights, bf16 compute): each
of the ``world_size`` ranks keeps ``ceil(parameters / world_size)`` parameters' share of

- weights: 4 bytes per parameter (fp32),
- gradients: 4 bytes per parameter (reduced in fp32),
- AdamW: 8 bytes per parameter (``exp_avg`` and ``exp_avg_sq``, fp32),

so 16 bytes per parameter per rank in all: Qwen2.5-7B (7.62e9 parameters) on 2 ranks is 56.8 GiB,
Qwen2.5-1.5B (1.54e9) on 2 ranks 11.5 GiB. Activations, the layer gathered for compute in bf16,
the CUDA context and the parameter server's staging buffer (one bucket) come on top and are not
counted here: the state is deemed to fit while it takes at most :data:`STATE_SHARE` of the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
ADAMW_BYTES = 8
#: The share of a GPU's memory the sharded model state may take before it is moved to CPU memory
#: (the rest: activations at the micro-batch, the gathered layer, the CUDA context).
STATE_SHARE = 0.5
OFFLOAD_SETTINGS = ("auto", "on", "off")


@dataclass(frozen=True)
class RankState:
    """Bytes of model state one trainer rank keeps (see the module docstring)."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def rank_state_bytes(parameters: int, world_size: int) -> RankState:
    """The model state per rank of ``parameters`` sharded over ``world_size`` ranks."""
    if parameters < 0 or world_size < 1:
        raise ValueError(f"need parameters >= 0 and world_size >= 1, got {parameters} and {world_size}")
    share = math.ceil(parameters / world_size)
    return RankState(weights=share * WEIGHT_BYTES, gradients=share * GRADIENT_BYTES, optimizer=share * ADAMW_BYTES)


def fits_device(state: RankState, device_bytes: int) -> bool:
    """Whether ``state`` takes at most :data:`STATE_SHARE` of a device of ``device_bytes``."""
    return state.total <= STATE_SHARE * device_bytes


def choose_offload(setting: str, parameters: int, world_size: int, device_bytes: int | None) -> bool:
    """Whether a rank on a GPU of ``device_bytes`` keeps its parameters, gradients and optimiser
    state in CPU memory: ``on`` / ``off`` as asked; ``auto``: when the state does not fit
    (:func:`fits_device`). Never for a rank on CPU (``device_bytes`` None): its state is in CPU
    memory already, and FSDP2's ``CPUOffloadPolicy`` needs an accelerator."""
    if setting not in OFFLOAD_SETTINGS:
        raise ValueError(f"train.cpu_offload must be one of {', '.join(OFFLOAD_SETTINGS)}, got {setting!r}")
    if device_bytes is None or setting == "off":
        return False
    return setting == "on" or not fits_device(rank_state_bytes(parameters, world_size), device_bytes)
