"""The placement plan of a training job: which actors it starts and what each one reserves.

Pure data from the job config, so that ``staleflow train --dry-run`` can print it without starting
anything, and so that a job can be refused, naming what is missing, before any engine starts
(:func:`missing_resources`). The Ray binding (:mod:`staleflow.adapters.ray.placement`) turns a plan
into one placement group with one bundle per actor, so every actor gets exactly its GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig


@dataclass(frozen=True)
class ActorPlan:
    """One actor: its name, its role and the resources it reserves (its placement-group bundle)."""

    name: str
    role: str
    cpus: float
    gpus: float

    def bundle(self) -> dict[str, float]:
        """The Ray bundle: only the resources it asks for (Ray refuses empty bundles: at least a
        token CPU share)."""
        bundle: dict[str, float] = {}
        if self.cpus > 0:
            bundle["CPU"] = self.cpus
        if self.gpus > 0:
            bundle["GPU"] = float(self.gpus)
        return bundle or {"CPU": 0.001}


@dataclass(frozen=True)
class PlacementPlan:
    """Every actor of a job, and the cluster resources they need together."""

    actors: tuple[ActorPlan, ...]
    cluster_address: str | None

    @property
    def total_cpus(self) -> float:
        return sum(a.cpus for a in self.actors)

    @property
    def total_gpus(self) -> float:
        return sum(a.gpus for a in self.actors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster_address": self.cluster_address,
            "actors": [asdict(a) for a in self.actors],
            "total_cpus": self.total_cpus,
            "total_gpus": self.total_gpus,
        }

    def describe(self) -> str:
        lines = [f"cluster: {self.cluster_address or 'a local Ray cluster'}"]
        for actor in self.actors:
            lines.append(f"  {actor.name:<17} {actor.role:<17} {actor.cpus:g} CPU, {actor.gpus:g} GPU")
        lines.append(f"total: {self.total_cpus:g} CPU, {self.total_gpus:g} GPU")
        return "\n".join(lines)


def plan_placement(config: JobConfig, cluster_address: str | None = None) -> PlacementPlan:
    """The actors of ``config``'s job: the trainer's ranks when they have GPUs (first, one bundle
    each), one per rollout instance (its tensor-parallel GPUs or its share of one), and the two
    servers when they are Ray-placed. A CPU trainer runs in the driver's processes and reserves
    nothing."""
    rollout = config.rollout
    trainer = [  # first: the FSDP launcher puts rank r in bundle r
        ActorPlan(f"trainer-{rank}", "trainer rank", 1.0, config.train.gpus) for rank in range(config.train.world_size)
    ] if config.train.gpus > 0 else []
    actors = trainer + [
        ActorPlan(f"rollout-{i}", "rollout instance", rollout.cpus_per_instance, rollout.gpu_share)
        for i in range(rollout.instances)
    ]
    if config.servers.placement == "ray":
        actors.append(ActorPlan("trajectory-server", "trajectory server", config.servers.cpus, 0))
        actors.append(ActorPlan("parameter-server", "parameter server", config.servers.cpus, 0))
    return PlacementPlan(tuple(actors), cluster_address if cluster_address is not None else config.cluster.address)


def missing_resources(plan: PlacementPlan, available: Mapping[str, float]) -> list[str]:
    """What the cluster (``available``: Ray's resource totals, e.g. ``{"CPU": 8, "GPU": 4}``) lacks
    for ``plan``, one line per resource; empty if the plan fits in total.

    A plan that fits in total can still fail to place if no single node holds an actor's GPUs: the
    placement group then reports it (see the Ray binding's timeout).
    """
    problems = []
    for resource, needed in (("GPU", float(plan.total_gpus)), ("CPU", plan.total_cpus)):
        have = float(available.get(resource, 0.0))
        if needed > have + 1e-9:
            users = [a.name for a in plan.actors if (a.gpus if resource == "GPU" else a.cpus) > 0]
            problems.append(
                f"{resource}: the job needs {needed:g} ({', '.join(users)}), the cluster has {have:g}"
            )
    return problems
