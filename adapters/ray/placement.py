"""Where the runtime's parts live: in this process (tests, simulation) or as Ray actors.

Both placements build a part from a factory and its arguments and hand back something with the
same methods, so the servers, coordinator and run loop are the same code either way. The Ray layer
is thin: each part runs in a generic host actor, and an :class:`ActorProxy` forwards every method
call to it and waits for the result. Arguments and results travel by pickling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from staleflow.runtime.settings.placement_plan import ActorPlan, PlacementPlan, missing_resources


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
        address: an existing Ray cluster to connect to (``ray_init``'s resource arguments are then
            dropped: Ray refuses them for an existing cluster); None: ``RAY_ADDRESS`` if set, else
            a local cluster.
        ray_init: keyword arguments for ``ray.init`` if Ray is not running yet (then :meth:`close`
            shuts it down); e.g. ``{"num_cpus": 2, "include_dashboard": False}``.
    """

    def __init__(self, attributes: Sequence[str] = ("instance_id",), address: str | None = None, **ray_init: Any) -> None:
        import os

        import ray

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            address = address or os.environ.get("RAY_ADDRESS") or None
            if address is not None:
                ray_init = {k: v for k, v in ray_init.items() if k not in ("num_cpus", "num_gpus", "resources")}
                ray.init(address=address, **ray_init)
            else:
                ray.init(**{k: v for k, v in ray_init.items() if v is not None})
        self._host = ray.remote(num_cpus=0)(_Host)
        self._attributes = tuple(attributes)
        self._actors: list[Any] = []
        self._group: Any = None
        self._bundles: dict[str, int] = {}
        self._plan: dict[str, ActorPlan] = {}

    def reserve(self, plan: PlacementPlan, timeout_s: float = 120.0) -> None:
        """Reserve every actor of ``plan`` at once (one placement group, a bundle per actor), or
        raise :class:`PlacementError` naming what is missing, before any actor starts."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        problems = missing_resources(plan, ray.cluster_resources())
        if problems:
            raise PlacementError("the Ray cluster lacks resources for this job: " + "; ".join(problems))
        group = placement_group([actor.bundle() for actor in plan.actors], strategy="PACK")
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            widest = max(plan.actors, key=lambda a: a.gpus)
            raise PlacementError(
                f"the Ray cluster could not place the job's {len(plan.actors)} actors within {timeout_s:g} s "
                f"(no node holds a bundle? the largest is {widest.name}: {widest.gpus} GPU)"
            ) from None
        self._group = group
        self._bundles = {actor.name: index for index, actor in enumerate(plan.actors)}
        self._plan = {actor.name: actor for actor in plan.actors}

    @property
    def placement_group(self) -> Any:
        """The placement group :meth:`reserve` made (None before), for launchers that place their
        own actors in its bundles (the FSDP trainer's ranks: bundles ``0 .. world_size - 1``)."""
        return self._group

    def place_reserved(
        self, name: str, factory: Callable[..., Any], *args: Any, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> ActorProxy:
        """Build ``factory(*args, **kwargs)`` in the bundle :meth:`reserve` set aside for actor
        ``name``, with its GPUs (Ray sets the actor's ``CUDA_VISIBLE_DEVICES``) and ``env``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if name not in self._bundles:
            raise KeyError(f"actor {name!r} is not in the reserved plan ({', '.join(self._bundles) or 'none reserved'})")
        actor = self._plan[name]
        options: dict[str, Any] = {
            "num_cpus": actor.bundle().get("CPU", 0),
            "num_gpus": actor.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=self._bundles[name]),
        }
        if env:
            options["runtime_env"] = {"env_vars": dict(env)}
        return self._start(self._host.options(**options), factory, args, kwargs)

    def place(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> ActorProxy:
        return self._start(self._host, factory, args, kwargs)

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
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None
        if self._owns_ray:
            ray.shutdown()
