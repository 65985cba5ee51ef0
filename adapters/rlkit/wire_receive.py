"""The receiving half of the wire, shared by the transports: the specs of an update as the sender
announced them, and a gloo group's receive of the sender's chunks with a deadline. The sending half
is :mod:`staleflow.adapters.rlkit.weight_sender`."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from staleflow.adapters.rlkit.wire_chunks import Spec, receive_chunks


def received_specs(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[Spec]:
    """The specs of an update as announced (:meth:`TransferParameterServer.stage`'s three lists)."""
    return [(n, getattr(torch, d), tuple(s)) for n, d, s in zip(names, dtype_names, shapes, strict=True)]


def receive_gloo(group: Any, specs: Sequence[Spec], bucket_bytes: int,
                 timeout_s: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving side of a gloo transfer from rank 0 of ``group``: ``(name, tensor)`` of each
    announced tensor, chunk by chunk (:func:`~staleflow.adapters.rlkit.wire_chunks.receive_chunks`),
    every chunk's wait ending by ``timeout_s`` from the first (None: the group's own timeout)."""
    import torch.distributed as dist

    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def receive(buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the weight transfer did not complete within {timeout_s:g} s")
            options.timeout = datetime.timedelta(seconds=remaining)
        group.broadcast([buffer], options).wait()

    return receive_chunks(specs, bucket_bytes, receive)
