"""``staleflow train --dry-run``: what a run would use and whether it can fit, before anything starts.

Beside the resolved config and the placement plan it reports and checks:

* **capacity**: the plan's GPUs against ``cluster.gpus_per_node x cluster.nodes`` (when both are
  set) and against the running Ray cluster (the one ``ray.init()`` would join: ``RAY_ADDRESS`` or
  the address ``ray start`` recorded on this machine); a plan larger than either is refused,
  naming the shortfall;
* the **rollout engine settings** vLLM is built with (``rollout.engine_settings()``);
* the **cost model** the coordinator starts from (a profile file, or the roofline of the model on a
  named device) and whether it is refitted online;
* the **attention kernel** the trainer ranks load (:func:`~staleflow.adapters.rlkit.causal_lm.attention_kernel`
  decided for the ranks' device and dtype: flash-attention on GPUs where it is installed in this
  environment, else flex attention on GPUs, sdpa on CPUs) and the micro-batch it implies; a warning
  when a kernel with a dense ``[T, T]`` mask is given micro-batches past its ``auto`` budget;
* the **driver**: a warning when this machine's NVIDIA driver shows GPUs that torch cannot use (a
  driver too old for the CUDA runtime of the wheels, :mod:`~staleflow.adapters.rlkit.cuda_driver`),
  where Ray would still count them;
* a **memory estimate per trainer GPU** (:mod:`~staleflow.runtime.settings.memory_estimate`) on the
  busiest rank against the device's memory; a plan that cannot fit is refused.

Refusals are listed in :attr:`DryRun.problems`, warnings in :attr:`DryRun.warnings`; ``staleflow
train --dry-run`` prints the report, then the warnings and the problems, and exits 2 when there are problems.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from staleflow.runtime.settings.config import JobConfig
from staleflow.runtime.settings.cost_prior import ModelShape
from staleflow.runtime.settings.devices import DEVICES
from staleflow.runtime.settings.memory_estimate import GIB, Offload, TrainerShape, choose_offload, estimate_trainer_memory
from staleflow.runtime.settings.placement_plan import PlacementPlan


@dataclass
class DryRun:
    """The dry run's checks (module docstring): ``report`` for print, ``problems`` for the exit code."""

    report: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_plan(config: JobConfig, plan: PlacementPlan) -> DryRun:
    out = DryRun()
    out.report["capacity"] = _capacity(config, plan, out.problems)
    out.report["engine_settings"] = config.rollout.engine_settings()
    out.report["cost_model"] = cost_model_source(config)
    kernel = attention_kernel_for(config)
    out.report["attention_kernel"] = kernel
    out.warnings += dense_mask_warnings(config, kernel)
    out.report["trainer_memory"] = _trainer_memory(config, kernel, out.problems)
    if plan.total_gpus > 0:
        out.report["driver"] = _driver(out.warnings)
    return out


def attention_kernel_for(config: JobConfig) -> str:
    """The kernel the trainer ranks will load (:func:`~staleflow.adapters.rlkit.causal_lm.choose_attention_kernel`
    for their device and dtype; flash-attn as installed in this environment: ranks on other nodes
    need the same). Flex attention where the model's class supports it (assumed for a model whose
    config this machine does not hold); ``train.attention`` when it names one."""
    import torch
    from staleflow.adapters.rlkit.causal_lm import choose_attention_kernel

    train = config.train
    if train.attention != "auto":
        return train.attention
    on_gpu = train.gpus > 0
    dtype = torch.float32 if train.dtype == "fp32" or (train.dtype == "auto" and not on_gpu) else torch.bfloat16
    return choose_attention_kernel(on_gpu, dtype, flex=_supports_flex(config))


def _supports_flex(config: JobConfig) -> bool:
    if config.model.path is None:
        return True  # the built-in tiny model is a Qwen2
    folder = Path(config.model.path).expanduser()
    if not (folder / "config.json").is_file():
        return True
    from staleflow.adapters.rlkit.causal_lm import supports_flex_attention
    from transformers import AutoConfig

    return supports_flex_attention(AutoConfig.from_pretrained(str(folder)))


def dense_mask_warnings(config: JobConfig, kernel: str) -> list[str]:
    """A warning when ``kernel`` packs with a dense ``[T, T]`` mask and ``train.micro_batch_tokens``
    is past the budget ``auto`` gives it (T^2 mask entries per micro-batch and layer)."""
    from staleflow.adapters.rlkit.packing import DENSE_MASK_MICRO_BATCH_TOKENS, PACKED_KERNELS

    tokens = config.train.micro_batch_tokens
    if config.train.backend == "megatron" or kernel in PACKED_KERNELS or tokens == "auto" or tokens <= DENSE_MASK_MICRO_BATCH_TOKENS:
        return []
    return [f"train.micro_batch_tokens={tokens} with {kernel} attention: every micro-batch builds a dense "
            f"{tokens:,} x {tokens:,} mask ({tokens**2 / DENSE_MASK_MICRO_BATCH_TOKENS**2:,.0f}x the "
            f"{DENSE_MASK_MICRO_BATCH_TOKENS}-token budget of train.micro_batch_tokens=auto for it); set "
            "train.micro_batch_tokens=auto, or train on GPUs, where flex attention packs without one"]


def _driver(warnings: list[str]) -> str:
    """This machine's NVIDIA driver and what torch makes of it; a warning when the driver shows GPUs
    that torch cannot use (Ray counts them all the same, so the plan would fit and the engines fail)."""
    import torch
    from staleflow.adapters.rlkit.cuda_driver import driver_problem, query_driver

    driver = query_driver()
    said = f"driver {driver.describe()}, torch {torch.__version__} built for CUDA {torch.version.cuda or 'none (a CPU build)'}"
    if driver.gpus and not torch.cuda.is_available():
        why = driver_problem(driver, torch.version.cuda) or "CUDA_VISIBLE_DEVICES, or torch's CUDA libraries?"
        warnings.append(f"the NVIDIA driver on this machine shows {driver.gpus} GPUs, which Ray counts, but torch "
                        f"{torch.__version__} sees none: {why}")
    return said


def cost_model_source(config: JobConfig) -> str:
    """Where the coordinator's cost model comes from (:func:`~staleflow.app.job_parts.job_cost_model`)."""
    settings, rollout = config.coordinator.cost_model, config.rollout
    if settings.profile is not None:
        prior = f"profile {settings.profile}"
    else:
        model = config.model.path or "the built-in tiny model"
        prior = f"roofline of {model} on {settings.device_name(rollout.gpus_per_instance)} x {rollout.tensor_parallel_size}"
    return prior + (f", refitted online every {settings.refit_s:g} s" if settings.online else ", fixed")


def _capacity(config: JobConfig, plan: PlacementPlan, problems: list[str]) -> dict[str, Any]:
    needed = plan.total_gpus
    cluster = config.cluster
    found: dict[str, Any] = {"gpus_needed": needed}
    if cluster.gpus_per_node is not None and cluster.nodes is not None:
        configured = cluster.gpus_per_node * cluster.nodes
        found["gpus_configured"] = configured
        if needed > configured:
            problems.append(
                f"the plan needs {needed:g} GPUs but cluster.gpus_per_node x cluster.nodes = "
                f"{cluster.gpus_per_node} x {cluster.nodes} = {configured}: {needed - configured:g} short"
            )
    from staleflow.adapters.ray.cluster import ClusterStartError, cluster_resources, running_cluster_address

    address = running_cluster_address()
    if address is None:
        found["running_cluster"] = None
        return found
    try:
        gpus = cluster_resources(address).get("GPU", 0.0)
    except ClusterStartError as error:
        problems.append(f"the running Ray cluster at {address} could not be read: {error}")
        return found
    found["running_cluster"] = {"address": address, "gpus": gpus}
    if needed > gpus:
        problems.append(f"the plan needs {needed:g} GPUs but the running Ray cluster at {address} has {gpus:g}: {needed - gpus:g} short")
    return found


def _trainer_memory(config: JobConfig, kernel: str, problems: list[str]) -> dict[str, Any] | str:
    train = config.train
    if train.gpus == 0:
        return "trainer on CPU: no GPU memory"
    if config.model.path is None:
        return "the built-in tiny model: not estimated"
    hf_config_file = Path(config.model.path).expanduser() / "config.json"
    if not hf_config_file.is_file():
        return f"not estimated: no config.json at {hf_config_file.parent} on this machine"
    hf_config = json.loads(hf_config_file.read_text(encoding="utf-8"))
    shape = TrainerShape.from_hf_config(hf_config, ModelShape.from_hf_config(hf_config).stored_params)
    shards = train.world_size if train.backend == "fsdp" else train.tensor_parallel * train.pipeline_parallel
    from staleflow.adapters.rlkit.packing import auto_micro_batch_tokens

    micro = train.micro_batch_tokens if train.micro_batch_tokens != "auto" else auto_micro_batch_tokens(kernel)
    device = config.coordinator.cost_model.device_name(1)
    beside_rank_0 = config.parameter_server_needs_gpu and config.servers.weight_transfer == "broadcast"
    server = config.servers.bucket_mb << 20 if beside_rank_0 else None
    device_bytes = int(DEVICES[device].memory_gb * 1e9 * train.gpus)
    offloaded = train.backend == "fsdp" and choose_offload(train.cpu_offload, shape.params, shards, device_bytes)
    memory = estimate_trainer_memory(
        shape, shards=shards, micro_batch_tokens=micro, logprob_chunk=train.logprob_chunk,
        activation_checkpointing=train.activation_checkpointing, device_bytes=device_bytes,
        mixed_precision=train.dtype != "fp32", parameter_server_bucket_bytes=server, offload=Offload(offloaded, offloaded),
    )
    if not memory.fits:
        problems.append(
            f"trainer rank 0 needs about {memory.total / GIB:.1f} GiB but a {device} share of {train.gpus:g} GPU holds "
            f"{memory.device_bytes / GIB:.1f} GiB (coordinator.cost_model.device names the card; more ranks, "
            "a smaller train.micro_batch_tokens, activation checkpointing or train.cpu_offload=on lower it)"
        )
    text = memory.describe() + (", model state offloaded to CPU memory (train.cpu_offload)" if offloaded else "")
    return {**memory.to_dict(), "device": device, "micro_batch_tokens": micro, "shards": shards, "cpu_offload": offloaded, "text": text}

