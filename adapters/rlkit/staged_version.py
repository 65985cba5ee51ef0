"""A version staged once in the sender's process for every instance it goes to.

The first send of a version copies its tensors, in the wire dtype, into one host buffer (pinned
where the sender broadcasts from a GPU, so each chunk's copy to the device is a fast DMA): the
stream of :mod:`~staleflow.adapters.rlkit.wire_chunks`, every tensor's bytes one after another.
Every later send of that version to any instance reads the same buffer: a version held in Ray's
object store (whole, or as a trainer rank's buckets) is fetched from it once, not once per
instance, and the conversion to the wire dtype is made once. Sends to different instances read the
buffer at the same time (it is never written again).

A tensor that shares its storage with an earlier one (a tied embedding: ``lm_head.weight`` is
``model.embed_tokens.weight``) is staged and sent once, under its first name; the receiver ties
it again (vLLM's loaders skip a tied output layer), so the bytes on the wire are the model's unique
bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from staleflow.adapters.rlkit.wire_chunks import Spec, chunk_sizes, nbytes

StorageKey = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def storage_key(tensor: torch.Tensor) -> StorageKey:
    """What two tensors share exactly when one is the other (the same bytes, seen the same way); a
    sharded tensor (DTensor) by its local shard."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def unique_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` without those that are an earlier one under another name (tied weights)."""
    seen: set[StorageKey] = set()
    for name, tensor in tensors:
        key = storage_key(tensor)
        if tensor.device.type != "meta" and key in seen:
            continue
        seen.add(key)
        yield name, tensor


@dataclass(frozen=True)
class StagedVersion:
    """``version``'s wire stream: ``specs`` (each unique tensor's name, wire dtype and shape, in
    order) and ``buffer``, their bytes one after another (a uint8 host tensor)."""

    version: int
    specs: tuple[Spec, ...]
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def update_info(self) -> dict[str, list[object]]:
        """What every worker's ``update_weights`` takes: names, dtype names, shapes."""
        return {"names": [n for n, _, _ in self.specs], "dtype_names": [str(d).removeprefix("torch.") for _, d, _ in self.specs],
                "shapes": [list(s) for _, _, s in self.specs]}

    def chunks(self, bucket_bytes: int) -> Iterator[torch.Tensor]:
        """The stream cut into chunks of at most ``bucket_bytes`` (views of the buffer, no copy)."""
        offset = 0
        for size in chunk_sizes(self.nbytes, bucket_bytes):
            yield self.buffer[offset : offset + size]
            offset += size


def stage(version: int, tensors: Iterable[tuple[str, torch.Tensor]], specs: Iterable[Spec], wire: torch.dtype,
          pinned: bool = False) -> StagedVersion:
    """Stage ``tensors`` (consumed one at a time, each converted to ``wire`` if floating point) into
    one host buffer. ``specs``: the tensors' names, dtypes and shapes as they were announced (known
    before they are fetched), which size the buffer; the names left out (tied to an earlier tensor)
    are dropped from the stream."""
    planned = {name: (dtype, shape) for name, dtype, shape in specs}
    capacity = sum(nbytes(wire if dtype.is_floating_point else dtype, shape) for dtype, shape in planned.values())
    buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
    staged: list[Spec] = []
    used = 0
    for name, tensor in unique_tensors(tensors):
        if name not in planned:
            raise ValueError(f"version {version}: tensor {name!r} was not announced")
        wired = tensor.detach().to(wire) if tensor.is_floating_point() else tensor.detach()
        flat = wired.contiguous().reshape(-1).view(torch.uint8)
        buffer[used : used + flat.numel()].copy_(flat)
        used += flat.numel()
        staged.append((name, wired.dtype, tuple(wired.shape)))
    return StagedVersion(version, tuple(staged), buffer[:used])
