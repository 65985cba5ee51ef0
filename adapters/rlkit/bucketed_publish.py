"""Publication of a sharded trainer's weights one bucket at a time, in the training dtype.

Every rank walks the model's state dict in the same order and gathers each sharded tensor whole
(:func:`gather_full`: ``DTensor.full_tensor``, a collective every rank joins); rank 0 copies it to
CPU in the publication dtype (:func:`host_copy`) and adds it to the current bucket, which is handed
on (into Ray's object store, or joined for the driver) as soon as the next tensor would take it past
``bucket_bytes``. So at any moment rank 0 holds one bucket, the tensor being added and that tensor's
gathered form: never the full fp32 state dict of a version (120 GB for Qwen3-30B-A3B).
:func:`fill_buckets` is the bucketing alone, for a trainer whose ranks make their copies otherwise
(Megatron's stages, :mod:`~staleflow.adapters.megatron.publish`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from staleflow.adapters.rlkit.staged_version import unique_tensors

DEFAULT_PUBLISH_BUCKET_BYTES = 512 << 20


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor`` (a DTensor shard is gathered from every rank: a collective)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def host_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CPU copy of ``tensor`` (floating point: in ``dtype``) that training cannot change later."""
    target = dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device="cpu", dtype=target, copy=True)


def gathered_buckets(state: Mapping[str, Any], dtype: torch.dtype, bucket_bytes: int, *, keep: bool,
                     prefix: str = "") -> Iterator[dict[str, torch.Tensor]]:
    """Buckets of ``state``'s tensors, gathered whole, as CPU copies in ``dtype`` (names without
    ``prefix``), each of at most ``bucket_bytes`` (a larger tensor: a bucket of its own). Every rank
    must exhaust it (each tensor's gather is a collective); only where ``keep`` (rank 0) are the
    copies made and yielded."""
    return fill_buckets(_gathered_copies(state, dtype, keep, prefix), bucket_bytes)


def _gathered_copies(state: Mapping[str, Any], dtype: torch.dtype, keep: bool, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The copies of ``state``'s tensors, a tied one (the same storage as an earlier name) published once."""
    for name, tensor in unique_tensors(state.items()):
        full = gather_full(tensor)
        if not keep:
            del full
            continue
        host = host_copy(full, dtype)
        del full
        yield name.removeprefix(prefix), host
        del host


def fill_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """``tensors`` (named CPU copies, as they come) grouped into buckets of at most ``bucket_bytes``
    (a larger tensor: a bucket of its own), each yielded as soon as the next tensor would overflow
    it and not held here afterwards. ``tensors`` is exhausted even when it yields nothing (a rank
    that only joins the collectives)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: dict[str, torch.Tensor] = {}
    used = 0
    for name, host in tensors:
        size = host.numel() * host.element_size()
        if bucket and used + size > bucket_bytes:
            done, bucket, used = bucket, {}, 0
            yield done
            del done
        bucket[name] = host
        used += size
        del host
    if bucket:
        yield bucket
