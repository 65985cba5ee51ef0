"""Weights published into Ray's object store by the process that made them (a trainer rank).

A multi-process trainer whose ranks are Ray actors publishes each version once: rank 0 puts the full
state dict into the object store and hands back an :class:`ObjectStoreWeights`, a small reference.
The driver passes that reference to the parameter server (its own actor, or the driver's); an
instance that pulls the version fetches the weights from the object store into its own process.
So weights never travel through the driver, and a parameter server that keeps ``keep`` versions
holds ``keep`` references: Ray frees a version's object once its last reference is dropped.
"""

from __future__ import annotations

from typing import Any

from staleflow.runtime.interfaces import TransferFailedError


class ObjectStoreWeights:
    """Version ``version``'s weights in Ray's object store (a ``WeightsReference``)."""

    def __init__(self, ref: Any, version: int) -> None:
        self._ref = ref
        self.version = version

    @classmethod
    def put(cls, weights: Any, version: int) -> ObjectStoreWeights:
        """Put ``weights`` into the object store (from a process connected to Ray)."""
        import ray

        return cls(ray.put(weights), version)

    def fetch(self) -> Any:
        """The weights, read from the object store into this process; :class:`TransferFailedError`
        if the object is gone (its owner, the trainer rank that put it, died)."""
        import ray

        try:
            return ray.get(self._ref)
        except ray.exceptions.RayError as error:
            raise TransferFailedError(f"weights of version {self.version} are not in Ray's object store: {error}") from error

    def __repr__(self) -> str:
        return f"ObjectStoreWeights(version={self.version})"

