"""Where the runtime's parts live: in this process (tests, simulation) or as Ray actors.

Both placements build a part from a factory and its arguments and hand back something with the
same methods, so the servers, coordinator and run loop are the same code either way. The Ray layer
is thin: each part runs in a generic host actor, and an :class:`ActorProxy` forwards every method
call to it and waits for the result. Arguments and results travel by pickling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


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
        ray_init: keyword arguments for ``ray.init`` if Ray is not running yet (then :meth:`close`
            shuts it down); e.g. ``{"num_cpus": 2, "include_dashboard": False}``.
    """

    def __init__(self, attributes: Sequence[str] = ("instance_id",), **ray_init: Any) -> None:
        import ray

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(**ray_init)
        self._host = ray.remote(num_cpus=0)(_Host)
        self._attributes = tuple(attributes)
        self._actors: list[Any] = []

    def place(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> ActorProxy:
        import ray

        handle = self._host.remote(factory, args, kwargs)
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
        if self._owns_ray:
            ray.shutdown()
