"""Where the runtime's parts live: in this process (tests, simulation) or as Ray actors.

Both placements build a part from a factory and its arguments and hand back something with the
same methods, so the servers, coordinator and run loop are the same code either way. The Ray layer
is thin: each part runs in a generic host actor, and an :class:`ActorProxy` forwards every method
call to it and waits for the result. Arguments and results travel by pickling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from staleflow.adapters.ray.cluster import join_or_start
from staleflow.runtime.settings.placement_plan import PlacementPlan, missing_resources


class PlacementError(RuntimeError):
    """The cluster cannot hold the job's actors; the message names what is missing."""


class InProcessPlacement:
    """Builds every part in this process."""

    def place(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return factory(*args, **kwargs)

    def close(self) -> None:
        pass


class _Host:
    """The Ray actor body: owns one part and runs method calls on it."""

    def __init__(self, factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._part = factory(*args, **kwargs)

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(self._part, name)(*args, **kwargs)

    def attribute(self, name: str) -> Any:
        return getattr(self._part, name)


class ActorProxy:
    """Looks like the part: ``proxy.method(...)`` runs ``part.method(...)`` in the actor and returns
    its result; the attributes named at creation (e.g. ``instance_id``) are read once and cached."""

    def __init__(self, handle: Any, attributes: dict[str, Any]) -> None:
        self._handle = handle
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        import ray

        handle = self.__dict__["_handle"]

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return ray.get(handle.call.remote(name, args, kwargs))
            except ray.exceptions.RayActorError as error:  # the actor is gone: the run loop recovers its work
                raise ConnectionError(f"{name}(): the actor is gone ({type(error).__name__})") from error

        call.__name__ = name
        return call


class RayPlacement:
    """Builds every part as a Ray actor.

    Args:
        attributes: attribute names to copy from each part to its proxy (an engine's
            ``instance_id``); those a part does not have are skipped.
        address: an existing Ray cluster to connect to; None: the running one (``RAY_ADDRESS``, or
            the one ``ray start`` recorded), else a local cluster started for the job
            (:func:`~staleflow.adapters.ray.cluster.join_or_start`: a running cluster gets no
            resource arguments, which Ray refuses for it; a refusal raises ``ClusterStartError``).
        ray_init: keyword arguments for ``ray.init`` if Ray is not initialised in this process yet (then
            :meth:`close` disconnects); e.g. ``{"num_cpus": 2, "include_dashboard": False}``.
    """

    def __init__(self, attributes: Sequence[str] = ("instance_id",), address: str | None = None, **ray_init: Any) -> None:
        import ray

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            join_or_start(address, **ray_init)
        self._host = ray.remote(num_cpus=0)(_Host)
        self._attributes = tuple(attributes)
        self._actors: list[Any] = []
        self._groups: dict[str, Any] = {}
        self._plan: PlacementPlan | None = None

    def reserve(self, plan: PlacementPlan, timeout_s: float = 120.0) -> None:
        """Reserve every placement group of ``plan`` at once, or raise :class:`PlacementError`
        naming what is missing, before any actor starts (a group that cannot be placed in
        ``timeout_s`` removes them all)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        problems = missing_resources(plan, ray.cluster_resources())
        if problems:
            raise PlacementError("the Ray cluster lacks resources for this job: " + "; ".join(problems))
        groups = {g.name: placement_group([b.resources() for b in g.bundles], strategy=g.strategy) for g in plan.groups}
        try:
            ray.get([group.ready() for group in groups.values()], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            for group in groups.values():
                remove_placement_group(group)
            widest = max(plan.groups, key=lambda g: sum(b.gpus for b in g.bundles))
            raise PlacementError(
                f"the Ray cluster could not place the job's {len(plan.groups)} placement groups within {timeout_s:g} s "
                f"(no node holds a group? the widest is {widest.name}: {sum(b.gpus for b in widest.bundles):g} GPU "
                f"on {widest.node_constraint})"
            ) from None
        self._groups = groups
        self._plan = plan

    def group_handle(self, name: str) -> Any:
        """The Ray placement group :meth:`reserve` made for group ``name`` (None if there is none),
        for launchers that place their own actors in its bundles (trainer rank ``r`` in bundle ``r``
        of ``trainer``)."""
        return self._groups.get(name)

    def actor_options(self, name: str) -> dict[str, Any]:
        """The Ray options of actor ``name`` of the reserved plan: its own CPUs and GPUs, its bundle,
        capture of child tasks (a tensor-parallel engine's Ray workers land in its group) and its
        environment."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._plan is None:
            raise KeyError(f"actor {name!r}: no plan is reserved")
        actor = self._plan.actor(name)
        options: dict[str, Any] = {
            "num_cpus": actor.num_cpus,
            "num_gpus": actor.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self._groups[actor.group], placement_group_bundle_index=actor.bundle,
                placement_group_capture_child_tasks=bool(actor.worker_bundles),
            ),
        }
        if actor.env:
            options["runtime_env"] = {"env_vars": actor.environment}
        return options

    def place_reserved(
        self, name: str, factory: Callable[..., Any], *args: Any, env: Mapping[str, str] | None = None, threads: int = 1,
        **kwargs: Any
    ) -> ActorProxy:
        """Build ``factory(*args, **kwargs)`` as actor ``name`` of the reserved plan
        (:meth:`actor_options`; Ray sets the actor's ``CUDA_VISIBLE_DEVICES``), ``env`` added to
        the plan's environment; ``threads``: how many calls it runs at once (a part that is
        thread-safe; 1: one call at a time)."""
        options = self.actor_options(name)
        if env:
            options["runtime_env"] = {"env_vars": {**options.get("runtime_env", {}).get("env_vars", {}), **env}}
        return self._start(self._host.options(**options, max_concurrency=threads), factory, args, kwargs)

    def place(self, factory: Callable[..., Any], *args: Any, threads: int = 1, **kwargs: Any) -> ActorProxy:
        """Build ``factory(*args, **kwargs)`` as an actor anywhere, running ``threads`` calls at once."""
        return self._start(self._host.options(max_concurrency=threads), factory, args, kwargs)

    def _start(self, host: Any, factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> ActorProxy:
        import ray

        handle = host.remote(factory, args, kwargs)
        self._actors.append(handle)
        values = {}
        for name in self._attributes:
            try:
                values[name] = ray.get(handle.attribute.remote(name))  # type: ignore[attr-defined]
            except AttributeError:
                continue
            except ray.exceptions.RayTaskError as error:
                if isinstance(error.cause, AttributeError):
                    continue
                raise
        return ActorProxy(handle, values)

    def close(self) -> None:
        import ray

        for handle in self._actors:
            ray.kill(handle)
        self._actors.clear()
        if self._groups:
            from ray.util.placement_group import remove_placement_group

            for group in self._groups.values():
                remove_placement_group(group)
            self._groups = {}
        if self._owns_ray:
            ray.shutdown()
