"""Weights published into Ray's object store by the process that made them (a trainer rank).

A multi-process trainer whose ranks are Ray actors publishes each version once: rank 0 puts the
state dict into the object store one bucket at a time, as it gathers them
(:mod:`~staleflow.adapters.rlkit.bucketed_publish`), and hands back an :class:`ObjectStoreWeights`,
a small reference to the buckets.
The driver passes that reference to the parameter server (its own actor, or the driver's); an
instance that pulls the version fetches the weights from the object store into its own process.
So weights never travel through the driver, and a parameter server that keeps ``keep`` versions
holds ``keep`` references: Ray frees a version's object once its last reference is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from staleflow.runtime.interfaces import TransferFailedError


def hand_on_buckets(buckets: Iterable[dict[str, Any]], version: int, *, keep: bool, by_reference: bool) -> Any:
    """What a trainer rank answers for a version it published as ``buckets``: None where it only
    joined the collectives (``keep`` false: ``buckets`` is exhausted, yielding nothing), an
    :class:`ObjectStoreWeights` (``by_reference``: each bucket put into the object store as it
    comes), or the weights joined into one state dict (for a driver that spawned the ranks)."""
    if not keep:
        for _ in buckets:
            pass
        return None
    if by_reference:
        return ObjectStoreWeights.put_buckets(buckets, version)
    return {name: tensor for bucket in buckets for name, tensor in bucket.items()}


def put_object(value: Any) -> Any:
    """``ray.put(value)``: one object in the store, owned by this process."""
    import ray

    return ray.put(value)


class ObjectStoreWeights:
    """Version ``version``'s weights in Ray's object store, as buckets of named tensors (a ``WeightsReference``)."""

    def __init__(self, refs: list[Any], version: int, specs: list[tuple[str, str, tuple[int, ...]]] | None = None) -> None:
        self._refs = refs
        self.version = version
        self._specs = specs or []

    @classmethod
    def put_buckets(cls, buckets: Iterable[dict[str, Any]], version: int) -> ObjectStoreWeights:
        """Put each bucket into the object store as it comes, keeping none of them here (from a
        process connected to Ray)."""
        refs, specs = [], []
        for bucket in buckets:
            specs.extend((name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in bucket.items())
            refs.append(put_object(bucket))
            del bucket  # not held while the next bucket is gathered
        return cls(refs, version, specs)

    @classmethod
    def joined(cls, parts: Sequence[ObjectStoreWeights], version: int) -> ObjectStoreWeights:
        """One version from ``parts`` put by several processes (a pipeline's stages), their buckets in order."""
        return cls([ref for part in parts for ref in part._refs], version, [spec for part in parts for spec in part._specs])

    def tensor_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every tensor, in the buckets' order (known without fetching)."""
        return list(self._specs)

    def buckets(self) -> Iterator[dict[str, Any]]:
        """The buckets, read from the object store into this process one at a time."""
        for ref in self._refs:
            yield self._get(ref)

    def fetch(self) -> Any:
        """The weights, read from the object store into this process; :class:`TransferFailedError`
        if the object is gone (its owner, the trainer rank that put it, died)."""
        return {name: tensor for bucket in self.buckets() for name, tensor in bucket.items()}

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayError as error:
            raise TransferFailedError(f"weights of version {self.version} are not in Ray's object store: {error}") from error

    def __repr__(self) -> str:
        return f"ObjectStoreWeights(version={self.version})"

