"""A parameter server in its own Ray actor, whose pulls hand out references instead of weights.

The driver coordinates; the weights of a version go from the parameter server's actor straight to
the rollout instance that pulls them: :meth:`RemoteParameterServer.pull` checks that the version is
there and returns a :class:`RemoteWeights` reference, which the instance's engine (in its own actor)
fetches. The server keeps what arrives without copying it again (a Ray transfer is already a copy).
Its actor runs :data:`SERVER_THREADS` calls at once, so no instance's transfer waits behind
another's, and the run loop's pushes and pulls wait behind none.
"""

from __future__ import annotations

from typing import Any

from staleflow.adapters.ray.placement import ActorProxy, RayPlacement
from staleflow.runtime.interfaces import TransferFailedError
from staleflow.runtime.servers.parameter_server import ParameterServer, VersionNotAvailableError

#: Calls the parameter server's actor runs at once (threads): the sends to every instance side by side
#: (each instance's one at a time, under its channel's lock), and the driver's pushes, pulls and
#: version queries beside them. The server is thread-safe (a readers-writer lock, locks per channel).
SERVER_THREADS = 64


def _keep_as_is(weights: Any) -> Any:
    return weights


class RemoteWeights:
    """A reference to version ``version`` on a parameter-server actor (a ``WeightsReference``)."""

    def __init__(self, server: ActorProxy, version: int) -> None:
        self._server = server
        self.version = version

    def fetch(self) -> Any:
        """The weights, fetched from the parameter server's actor into this process."""
        try:
            version, weights = self._server.pull(self.version)
        except ConnectionError as error:
            raise TransferFailedError(f"pull of version {self.version}: {error}") from error
        if version != self.version:
            raise VersionNotAvailableError(f"asked for version {self.version}, the parameter server sent {version}")
        return weights

    def __repr__(self) -> str:
        return f"RemoteWeights(version={self.version})"


class RemoteParameterServer:
    """The parameter-server interface over a :class:`ParameterServer` placed as a Ray actor.

    ``broadcast``: the server is a :class:`~staleflow.adapters.rlkit.collective.CollectiveParameterServer`
    with these transfer settings (``backend``, ``host``, ``wire_dtype``, ``bucket_bytes``), and pulls
    hand out :class:`~staleflow.adapters.rlkit.collective.BroadcastWeights` (vLLM's weight-transfer
    API over a long-lived group per instance, or one collective for a global broadcast's loads);
    None: pulls hand out :class:`RemoteWeights`.
    """

    def __init__(self, server: ActorProxy, broadcast: dict[str, Any] | None = None) -> None:
        self._server = server
        self._broadcast = broadcast

    @classmethod
    def place(
        cls, placement: RayPlacement, name: str | None = None, keep: int = 3, broadcast: dict[str, Any] | None = None
    ) -> RemoteParameterServer:
        """Start the server in the bundle reserved for actor ``name`` (None: anywhere)."""
        factory: Any = ParameterServer
        kwargs: dict[str, Any] = {"keep": keep, "copy_weights": _keep_as_is}
        if broadcast is not None:
            from staleflow.adapters.rlkit.collective import CollectiveParameterServer

            factory = CollectiveParameterServer  # per-instance groups, and collectives of several instances
            kwargs["transfer"] = broadcast
        if name is None:
            return cls(placement.place(factory, threads=SERVER_THREADS, **kwargs), broadcast)
        return cls(placement.place_reserved(name, factory, threads=SERVER_THREADS, **kwargs), broadcast)

    def push(self, version: int, weights: Any) -> None:
        self._server.push(version, weights)

    def latest_version(self) -> int | None:
        latest: int | None = self._server.latest_version()
        return latest

    def versions(self) -> tuple[int, ...]:
        return tuple(self._server.versions())

    def pull(self, version: int | None = None) -> tuple[int, Any]:
        """``(version, reference)``; the weights stay on the server until the puller fetches them
        (or receives them through vLLM's weight-transfer API)."""
        held = self.versions()
        if version is None:
            version = held[-1] if held else None
        if version is None or version not in held:
            raise VersionNotAvailableError(f"version {version} is not on the parameter server (it holds {list(held)})")
        if self._broadcast is not None:
            from staleflow.adapters.rlkit.collective import BroadcastWeights

            return version, BroadcastWeights(self._server, version)
        return version, RemoteWeights(self._server, version)

    def bytes_sent(self) -> int:
        """The weight bytes the server has sent through transfers so far (a collective's once); 0 for reference pulls."""
        return int(self._server.sent_bytes()) if self._broadcast is not None else 0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._server.state_dict()
        return state
