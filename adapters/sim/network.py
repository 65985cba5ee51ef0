"""Costs of moving data on a simulated cluster: weight transfers and KV-cache rebuilds.

* :class:`ParameterServerLink`: instances pull a new version from the parameter server one by one
  (StaleFlow). One pull takes ``weights_gb / min(link_gb_per_s, ps_gb_per_s / k)`` where ``k`` is the
  number of pulls in flight when it starts, itself included: the server's egress is shared, and a
  pull that starts while many others run is slower (the share is fixed at its start, a
  simplification of fair sharing). A load the coordinator marks as part of a global broadcast (the
  ``adaptive`` sync) takes the :class:`Broadcast` time instead, with the trainer not blocked (the
  parameter server sends, not the trainer).
* :class:`Broadcast`: a global NCCL broadcast (the peers): every instance receives the version at
  once in ``weights_gb / broadcast_gb_per_s``, after ``pause_s`` of a whole-fleet pause if the
  system pauses around its updates (ROLL's ``pause_sampling``); the trainer is blocked as long
  (``SimTrainer``'s ``after_step_s``).
* :func:`trainer_offload_seconds`: a system that offloads the trainer's states after every step
  (ROLL) moves, per trainer GPU, its share of the weights, gradients and optimizer states to host
  memory and back over its host link.
* :func:`prefill_seconds`: rebuilding the KV cache of ``c`` context tokens (a new request's prompt, or
  a resubmitted partial's prompt and tokens so far) with chunked prefill costs a linear term
  ``per_token * c`` (the matmuls) and an attention term: chunk after chunk attends to every earlier
  token, ``attn_per_token2 * c^2 / 2`` in all, which dominates for long partials.
"""

from __future__ import annotations

from typing import Protocol

from staleflow.runtime.settings.workload import NetworkSpec


class WeightTransfer(Protocol):
    def transfer_s(self, start: float, broadcast: bool = False) -> float:
        """Seconds a weight load that starts at ``start`` spends receiving the weights; ``broadcast``:
        the load is one of a global broadcast's."""
        ...


class ParameterServerLink:
    """Pulls from a parameter server whose egress the pulls in flight share (module docstring)."""

    def __init__(self, network: NetworkSpec) -> None:
        self._network = network
        self._ends: list[float] = []
        self._broadcast = Broadcast(network)

    def transfer_s(self, start: float, broadcast: bool = False) -> float:
        if broadcast:
            return self._broadcast.seconds
        self._ends = [end for end in self._ends if end > start]
        net = self._network
        seconds = net.weights_gb / min(net.link_gb_per_s, net.ps_gb_per_s / (len(self._ends) + 1))
        self._ends.append(start + seconds)
        return seconds

    @property
    def in_flight(self) -> int:
        return len(self._ends)


class Broadcast:
    """A global broadcast: the same time for every instance, whatever the others do; ``pause_s``: a
    pause of the whole fleet before it (ROLL's router suspension, ``abort_all`` and ``wait_complete``)."""

    def __init__(self, network: NetworkSpec, pause_s: float = 0.0) -> None:
        self.seconds = pause_s + network.weights_gb / network.broadcast_gb_per_s

    def transfer_s(self, start: float, broadcast: bool = False) -> float:
        return self.seconds  # a broadcast whatever the load


def prefill_seconds(context: int, per_token: float, attn_per_token2: float) -> float:
    """Seconds to rebuild the KV cache of ``context`` tokens (module docstring)."""
    return context * per_token + attn_per_token2 * context * context / 2


#: Bytes of trainer state per parameter, as a multiple of the bf16 weights (2 B/param): bf16 weights
#: and gradients (2 + 2 B) and fp32 master weights and Adam moments (4 + 4 + 4 B) = 16 B/param.
TRAINER_STATE_PER_WEIGHT_BYTE = 8


def trainer_offload_seconds(network: NetworkSpec, trainer_gpus: int) -> float:
    """Seconds to move each trainer GPU's share of the states out to host memory and back in."""
    per_gpu_gb = TRAINER_STATE_PER_WEIGHT_BYTE * network.weights_gb / max(1, trainer_gpus)
    return 2 * per_gpu_gb / network.host_gb_per_s
