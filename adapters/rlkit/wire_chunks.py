"""A version on the wire: every tensor's bytes one after another, in the announced order, cut into
chunks of at most ``bucket_bytes``, each broadcast from one staging buffer.

A tensor larger than a chunk is split across chunks, and a chunk may end inside a tensor, so the
sender's staging memory is one buffer of ``min(bucket_bytes, total)`` bytes whatever the largest
tensor (Qwen2.5-7B's 1.09 GB bf16 embedding passes through a 64 MiB buffer): the only memory the
parameter server takes on its GPU for a transfer. Both sides derive the chunks from the announced
names, dtypes and shapes and the bucket size (:func:`chunk_sizes`), so nothing else is sent. The
receiver copies each tensor out of its chunks into a tensor of its own and yields it whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """The bytes of a tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * dtype.itemsize


def chunk_sizes(total: int, bucket_bytes: int) -> list[int]:
    """The chunk sizes of a stream of ``total`` bytes: full chunks of ``bucket_bytes``, then the rest."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    full, rest = divmod(total, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def send_chunks(tensors: Iterable[tuple[str, torch.Tensor]], total: int, bucket_bytes: int,
                stage: Callable[[int], torch.Tensor], broadcast: Callable[[torch.Tensor], None]) -> int:
    """Copy the tensors' bytes (``total`` in all) into one staging buffer from ``stage(size)`` (a
    uint8 tensor where the broadcast reads: the GPU for NCCL) and ``broadcast`` it each time it is
    full, and the rest at the end; returns the bytes sent."""
    staging = stage(min(bucket_bytes, total)) if total else None
    used = sent = 0
    for _, tensor in tensors:
        flat = _flat_bytes(tensor)
        offset = 0
        while offset < flat.numel():
            assert staging is not None, "more bytes than announced"
            n = min(staging.numel() - used, flat.numel() - offset)
            staging[used : used + n].copy_(flat[offset : offset + n])
            used, offset = used + n, offset + n
            if used == staging.numel():
                broadcast(staging)
                sent, used = sent + used, 0
    if used:
        assert staging is not None
        broadcast(staging[:used])
        sent += used
    if sent != total:
        raise ValueError(f"the tensors sent hold {sent} bytes, {total} were announced")
    return sent


def receive_chunks(specs: Sequence[Spec], bucket_bytes: int, receive: Callable[[torch.Tensor], None],
                   device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving side of :func:`send_chunks`: ``(name, tensor)`` of every spec, each a tensor of
    its own on ``device``, as soon as its last byte has arrived; ``receive(buffer)`` fills a uint8
    buffer with the next chunk (a broadcast from the sender). Every chunk is received once the
    iterator is exhausted."""
    sizes = [nbytes(dtype, shape) for _, dtype, shape in specs]
    chunks = _chunks(chunk_sizes(sum(sizes), bucket_bytes), bucket_bytes, receive, device)
    chunk, pos = torch.empty(0, dtype=torch.uint8, device=device), 0
    for (name, dtype, shape), size in zip(specs, sizes):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        flat, filled = tensor.reshape(-1).view(torch.uint8), 0
        while filled < size:
            if pos == chunk.numel():
                chunk, pos = next(chunks), 0
            n = min(size - filled, chunk.numel() - pos)
            flat[filled : filled + n].copy_(chunk[pos : pos + n])
            filled, pos = filled + n, pos + n
        yield name, tensor


def _chunks(sizes: list[int], bucket_bytes: int, receive: Callable[[torch.Tensor], None],
            device: torch.device | str) -> Iterator[torch.Tensor]:
    buffer = torch.empty(min(bucket_bytes, max(sizes, default=0)), dtype=torch.uint8, device=device)
    for size in sizes:
        chunk = buffer[:size]
        receive(chunk)
        yield chunk
