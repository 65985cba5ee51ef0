"""Bindings to external systems, one sub-package each, and their simulated twins.

- ``vllm``: the rollout engine on vLLM (CPU or GPU build) and its worker extension.
- ``torch``: the plain-torch trainer, its background step thread and the RL losses on tensors.
- ``megatron``: the Megatron-core trainer (GPU).
- ``ray``: placing parts as Ray actors.
- ``sim``: the simulated engine and trainer that stand in for vLLM and torch at cluster scale.
- ``areal``: the protocol inside AReaL (a peer RL system): its executor and batches driven by
  StaleFlow's staleness protocol (docs/integrating.md).

Each binding implements a seam of :mod:`staleflow.runtime.interfaces` and raises only the
exceptions that seam names. Nothing here decides anything about the protocol.
"""
