"""The placement plan of a training job: which actors it starts, which GPUs and CPUs each one
reserves, and how a tensor-parallel rollout instance lays its workers out.

Pure data from the job config, so that ``staleflow train --dry-run`` can print it without starting
anything, and so that a job can be refused, naming what is missing, before any engine starts
(:func:`missing_resources`). The Ray binding (:mod:`staleflow.adapters.ray.placement`) turns each
:class:`GroupPlan` into one Ray placement group and starts each :class:`ActorPlan` in its bundle.

The layout follows what vLLM's Ray executor accepts and what OpenRLHF and verl do (vLLM 0.32
``v1/executor/ray_utils.py``: a bundle may hold at most one GPU):

- a rollout instance of ``tp`` GPUs gets a placement group of its own with ``tp`` bundles of one
  GPU each, on one node unless it is wider than a node (``cluster.gpus_per_node``). With ``tp > 1``
  its engine actor takes no GPU itself (``num_gpus=0``, its CPUs in bundle 0): vLLM's Ray workers
  take one GPU per bundle and no CPU (``VLLM_RAY_BUNDLE_INDICES`` names the bundles; the actor
  captures its group for its child tasks). With
  ``tp == 1`` (or a share of one GPU) the actor holds the GPU and vLLM runs in its process;
- the evaluation engine, when the job asks for one (``task.eval_engine=own``), is planned like a
  rollout instance (its own group); by default the rollout instances evaluate and nothing is added;
- trainer ranks with GPUs share one group, rank ``r`` in bundle ``r``, one GPU (or a share) each;
- Ray-placed servers share a CPU-only group, except a parameter server that broadcasts over NCCL
  (``JobConfig.parameter_server_needs_gpu``): it sends from a GPU, as OpenRLHF sends from trainer
  rank 0's. It shares trainer rank 0's bundle and GPU (:data:`PARAMETER_SERVER_GPU_SHARE` of it;
  rank 0 keeps the rest), on the node where rank 0 puts each version's buckets into Ray's object
  store. Both processes then see the same device, which NCCL allows: it refuses two ranks of *one*
  communicator on one GPU, and the two are in different ones (the trainer ranks' collective; the
  server's group per rollout instance, whose other ranks are that instance's vLLM workers on the
  instance's own GPUs). With the trainer on CPU it gets a one-GPU bundle of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig

#: Ray's placement strategies by what they promise about nodes.
ONE_NODE = "STRICT_PACK"
ANY_NODES = "PACK"
_NODE_WORDS = {ONE_NODE: "one node", ANY_NODES: "any nodes (packed)"}

#: The fraction of trainer rank 0's GPU share that a parameter server sending over NCCL takes (Ray's
#: bookkeeping only: both processes use the one device; the server holds one staging buffer of
#: ``servers.bucket_mb`` and NCCL's own buffers beside rank 0's model).
PARAMETER_SERVER_GPU_SHARE = 0.1


@dataclass(frozen=True)
class BundlePlan:
    """One bundle of a placement group: what it reserves and who runs in it."""

    cpus: float
    gpus: float
    used_by: str

    def resources(self) -> dict[str, float]:
        """The Ray bundle: only the resources it asks for (Ray refuses empty bundles: at least a
        token CPU share)."""
        resources: dict[str, float] = {}
        if self.cpus > 0:
            resources["CPU"] = float(self.cpus)
        if self.gpus > 0:
            resources["GPU"] = float(self.gpus)
        return resources or {"CPU": 0.001}


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: bundles reserved together, with a node strategy."""

    name: str
    strategy: str
    bundles: tuple[BundlePlan, ...]

    @property
    def node_constraint(self) -> str:
        return _NODE_WORDS[self.strategy]


@dataclass(frozen=True)
class ActorPlan:
    """One actor: where it runs (its group and bundle), what it takes itself (``num_cpus``,
    ``num_gpus``), the bundles its own workers use, and the environment it starts with."""

    name: str
    role: str
    group: str
    bundle: int
    num_cpus: float
    num_gpus: float
    gpus: float
    """GPUs the actor uses in all (its own and its workers')."""
    worker_bundles: tuple[int, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=())

    @property
    def environment(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class PlacementPlan:
    """Every placement group and actor of a job, and the cluster resources they need together."""

    groups: tuple[GroupPlan, ...]
    actors: tuple[ActorPlan, ...]
    cluster_address: str | None

    @property
    def total_cpus(self) -> float:
        return sum(b.cpus for g in self.groups for b in g.bundles)

    @property
    def total_gpus(self) -> float:
        return sum(b.gpus for g in self.groups for b in g.bundles)

    def actor(self, name: str) -> ActorPlan:
        for actor in self.actors:
            if actor.name == name:
                return actor
        raise KeyError(f"actor {name!r} is not in the plan ({', '.join(a.name for a in self.actors) or 'none'})")

    def group(self, name: str) -> GroupPlan:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"placement group {name!r} is not in the plan ({', '.join(g.name for g in self.groups) or 'none'})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster_address": self.cluster_address,
            "groups": [
                {"name": g.name, "strategy": g.strategy, "node_constraint": g.node_constraint,
                 "bundles": [{"index": i, **asdict(b)} for i, b in enumerate(g.bundles)]}
                for g in self.groups
            ],
            "actors": [{**asdict(a), "env": a.environment, "worker_bundles": list(a.worker_bundles)} for a in self.actors],
            "total_cpus": self.total_cpus,
            "total_gpus": self.total_gpus,
        }

    def describe(self) -> str:
        lines = [f"cluster: {self.cluster_address or 'a local Ray cluster'}"]
        for group in self.groups:
            lines.append(f"  group {group.name} ({group.node_constraint})")
            for index, bundle in enumerate(group.bundles):
                lines.append(f"    bundle {index:<3} {bundle.cpus:g} CPU, {bundle.gpus:g} GPU  {bundle.used_by}")
        for actor in self.actors:
            lines.append(
                f"  {actor.name:<17} {actor.role:<17} {actor.gpus:g} GPU (actor: {actor.num_cpus:g} CPU, {actor.num_gpus:g} GPU)"
            )
        lines.append(f"total: {self.total_cpus:g} CPU, {self.total_gpus:g} GPU")
        return "\n".join(lines)


def has_eval_engine(config: JobConfig) -> bool:
    """Whether the job evaluates on an engine of its own: prompts from files, evaluation on, and
    ``task.eval_engine=own`` (by default the rollout instances evaluate between steps; the built-in
    task is evaluated by the trainer's greedy decoder)."""
    return config.task.prompt_file is not None and config.task.eval_prompts > 0 and config.task.eval_engine == "own"


def trainer_rank_gpus(config: JobConfig) -> tuple[float, ...]:
    """The GPUs each trainer rank's actor takes (``train.gpus``; rank 0 less the parameter server's
    share when the server shares its GPU, ``JobConfig.parameter_server_needs_gpu``); empty on CPU."""
    train = config.train
    if train.gpus <= 0:
        return ()
    gpus = [float(train.gpus)] * train.world_size
    if config.parameter_server_needs_gpu:
        gpus[0] = train.gpus - _server_share(config)
    return tuple(gpus)


def _server_share(config: JobConfig) -> float:
    return round(config.train.gpus * PARAMETER_SERVER_GPU_SHARE, 4)  # Ray counts GPU fractions to 1e-4


def plan_placement(config: JobConfig, cluster_address: str | None = None) -> PlacementPlan:
    """The placement groups and actors of ``config``'s job (module docstring): trainer ranks with
    GPUs first, then one group per rollout instance, the evaluation engine, and the Ray-placed
    servers. A CPU trainer runs in the driver's processes and reserves nothing."""
    groups: list[GroupPlan] = []
    actors: list[ActorPlan] = []
    train = config.train
    rank_gpus = trainer_rank_gpus(config)
    if rank_gpus:
        ranks = [f"trainer-{rank}" for rank in range(train.world_size)]
        bundles = [BundlePlan(1.0, train.gpus, name) for name in ranks]
        if config.parameter_server_needs_gpu:  # the parameter server shares rank 0's bundle and GPU (module docstring)
            bundles[0] = BundlePlan(1.0 + config.servers.cpus, train.gpus, "trainer-0 and parameter-server")
        groups.append(GroupPlan("trainer", ANY_NODES, tuple(bundles)))
        actors += [ActorPlan(name, "trainer rank", "trainer", r, 1.0, gpus, gpus) for r, (name, gpus) in enumerate(zip(ranks, rank_gpus))]
    engines = [(f"rollout-{i}", "rollout instance") for i in range(config.rollout.instances)]
    if has_eval_engine(config):
        engines.append(("eval", "evaluation engine"))
    for name, role in engines:
        group, actor = _engine_placement(config, name, role)
        groups.append(group)
        actors.append(actor)
    if config.servers.placement == "ray":
        group, server_actors = _server_placement(config, beside_rank_0=bool(rank_gpus))
        groups.append(group)
        actors += server_actors
    address = cluster_address if cluster_address is not None else config.cluster.address
    return PlacementPlan(tuple(groups), tuple(actors), address)


#: What engines holding a share of one GPU hold, for :func:`engine_gpus`: Ray picks which shares
#: land on one GPU, so any two of them may.
SHARED_GPU = "a shared GPU"


def engine_gpus(config: JobConfig, name: str) -> frozenset[str]:
    """What the vLLM engine ``name`` holds of the GPUs, as names equal where two engines may share a
    GPU (for starting engines side by side: :func:`~staleflow.app.job_parts.start_engines`): its own
    name where it holds whole GPUs (its own bundles: Ray never gives two whole-GPU bundles one GPU),
    :data:`SHARED_GPU` where it holds a share of one (``rollout.instances_per_gpu`` > 1), nothing on CPU."""
    rollout = config.rollout
    if rollout.gpus_per_instance == 0:
        return frozenset()
    return frozenset({SHARED_GPU if rollout.gpu_share < 1 else name})


def _engine_placement(config: JobConfig, name: str, role: str) -> tuple[GroupPlan, ActorPlan]:
    """One vLLM engine's group and actor (module docstring)."""
    rollout = config.rollout
    tp = rollout.gpus_per_instance
    if tp <= 1:  # a CPU instance, one GPU, or a share of one: vLLM runs in the actor's own process(es)
        bundle = BundlePlan(rollout.cpus_per_instance, rollout.gpu_share, name)
        cpus = bundle.resources()["CPU"] if "CPU" in bundle.resources() else 0.0
        # vLLM's engine core in a process of its own for a tensor-parallel CPU instance (its workers
        # too) and on a GPU: there torch.compile and CUDA-graph capture run in the core process's main
        # thread, as under `vllm serve`, not in the engine actor's background thread
        own_core = rollout.tensor_parallel_size > 1 or rollout.gpu_share > 0
        env = (("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),) if own_core else ()
        actor = ActorPlan(name, role, name, 0, cpus, rollout.gpu_share, rollout.gpu_share, env=env)
        return GroupPlan(name, ONE_NODE, (bundle,)), actor
    per_node = config.cluster.gpus_per_node
    strategy = ANY_NODES if per_node is not None and tp > per_node else ONE_NODE
    actor_cpus = rollout.cpus_per_instance or 1.0  # the engine actor's own; vLLM's workers take num_cpus=0
    users = [f"{name} (engine actor and worker 0)", *(f"{name} worker {r}" for r in range(1, tp))]
    bundles = tuple(BundlePlan(actor_cpus if r == 0 else 0.0, 1.0, user) for r, user in enumerate(users))
    workers = tuple(range(tp))
    env = (("VLLM_RAY_BUNDLE_INDICES", ",".join(map(str, workers))), ("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))
    return GroupPlan(name, strategy, bundles), ActorPlan(name, role, name, 0, actor_cpus, 0.0, float(tp), workers, env)


def _server_cpus(config: JobConfig) -> float:
    """CPUs a server actor takes: ``servers.cpus``, or a token share (Ray refuses empty bundles)."""
    return BundlePlan(config.servers.cpus, 0, "").resources()["CPU"]


def _server_placement(config: JobConfig, beside_rank_0: bool) -> tuple[GroupPlan, list[ActorPlan]]:
    """The Ray-placed servers' CPU-only group and their actors. A parameter server that needs a GPU
    (``JobConfig.parameter_server_needs_gpu``) runs in trainer rank 0's bundle with a share of its GPU when
    ``beside_rank_0`` (the trainer has GPUs), else in a one-GPU bundle of this group."""
    cpus = _server_cpus(config)
    needs_gpu = config.parameter_server_needs_gpu
    bundles = [BundlePlan(config.servers.cpus, 0, "trajectory-server")]
    actors = [ActorPlan("trajectory-server", "trajectory server", "servers", 0, cpus, 0, 0)]
    if needs_gpu and beside_rank_0:  # servers.cpus, no token share: Ray truncates a bundle of 1 + 0.001 CPU to 1.0009
        share = _server_share(config)
        actors.append(ActorPlan("parameter-server", "parameter server", "trainer", 0, config.servers.cpus, share, share))
    else:
        bundle = BundlePlan(config.servers.cpus, 1.0 if needs_gpu else 0, "parameter-server")
        bundles.append(bundle)
        own_cpus = bundle.resources().get("CPU", 0.0)
        actors.append(ActorPlan("parameter-server", "parameter server", "servers", 1, own_cpus, bundle.gpus, bundle.gpus))
    return GroupPlan("servers", ANY_NODES, tuple(bundles)), actors


def missing_resources(plan: PlacementPlan, available: Mapping[str, float]) -> list[str]:
    """What the cluster (``available``: Ray's resource totals, e.g. ``{"CPU": 8, "GPU": 4}``) lacks
    for ``plan``, one line per resource; empty if the plan fits in total.

    A plan that fits in total can still fail to place if no single node holds a one-node group: the
    placement group then reports it (see the Ray binding's timeout).
    """
    problems = []
    for resource, needed in (("GPU", float(plan.total_gpus)), ("CPU", plan.total_cpus)):
        have = float(available.get(resource, 0.0))
        if needed > have + 1e-9:
            users = [g.name for g in plan.groups if any(b.resources().get(resource, 0.0) >= 1e-2 for b in g.bundles)]
            problems.append(
                f"{resource}: the job needs {needed:g} ({', '.join(users)}), the cluster has {have:g}"
            )
    return problems
