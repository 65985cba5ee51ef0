"""The accelerators StaleFlow knows by their datasheet figures, and the board names the driver
reports for them. Standard library only: the trainer-only GPU check (``scripts/gpu-smoke.sh
--trainer-only``) reads the peak FLOP/s here on a machine without pydantic, scipy, Ray or vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU thread): peak dense FLOP/s, memory bandwidth (bytes/s), memory (GB)
    and the fixed cost of one engine step (s)."""

    flops: float
    bandwidth: float
    memory_gb: float
    step_overhead_s: float


#: Datasheet figures (dense bf16 tensor FLOP/s: half the "with sparsity" figure NVIDIA prints; HBM
#: bandwidth); ``h100`` and ``h200`` are the SXM boards; ``cpu``: one thread of vLLM-CPU.
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(flops=989e12, bandwidth=3.35e12, memory_gb=80, step_overhead_s=1.5e-3),
    "h100-pcie": DeviceSpec(flops=756e12, bandwidth=2.0e12, memory_gb=80, step_overhead_s=1.5e-3),
    "h100-nvl": DeviceSpec(flops=835e12, bandwidth=3.9e12, memory_gb=94, step_overhead_s=1.5e-3),
    "h200": DeviceSpec(flops=989e12, bandwidth=4.8e12, memory_gb=141, step_overhead_s=1.5e-3),
    "h200-nvl": DeviceSpec(flops=835e12, bandwidth=4.8e12, memory_gb=141, step_overhead_s=1.5e-3),
    "h20": DeviceSpec(flops=148e12, bandwidth=4.0e12, memory_gb=96, step_overhead_s=1.5e-3),
    "a100-80gb": DeviceSpec(flops=312e12, bandwidth=2.039e12, memory_gb=80, step_overhead_s=1.5e-3),
    "a100-40gb": DeviceSpec(flops=312e12, bandwidth=1.555e12, memory_gb=40, step_overhead_s=1.5e-3),
    "cpu": DeviceSpec(flops=5e10, bandwidth=1e10, memory_gb=8, step_overhead_s=2e-3),
}


#: ``torch.cuda.get_device_name()`` (the driver's board name, as ``nvidia-smi`` prints it) -> a key of
#: :data:`DEVICES`. Exact names: ``"NVIDIA H200 NVL"`` contains ``"NVIDIA H200"``.
GPU_NAMES: dict[str, str] = {
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA H20": "h20",
}


def device_for_gpu_name(gpu_name: str) -> str | None:
    """The key of :data:`DEVICES` for a GPU reported as ``gpu_name``; None for a board not listed."""
    return GPU_NAMES.get(gpu_name.strip())


def device_spec(name: str) -> DeviceSpec:
    """The device called ``name`` (a key of :data:`DEVICES`); a ValueError lists the known ones."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None
