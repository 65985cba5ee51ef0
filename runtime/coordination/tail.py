"""The head buffer's stragglers: abort them (proactive abort) or move them where they decode fastest.

The trainer waits for the head buffer (the groups due in the next batch), and at its end for the
last few of them: long responses decoding on instances that are busy with later buffers' work.
Two remedies, each a policy knob:

* :func:`proactive_aborts` (the authors' ``abort_and_truncate_strategy``): while the trainer waits,
  if at most ``proactive_abort`` groups due in the head buffer are still generating and enough
  finished groups wait to fill the batch without them, those groups are re-queued.
* :class:`TailMoves` (``tail_hosted``): once at most ``tail_share`` of a batch of groups due in the
  head buffer are still generating, their running requests are the tail. Each goes to the instance
  where the cost model says it finishes soonest, if that is sooner than where it is counting the
  re-prefill of its context there: on its instance ``r * L(n, K)``, on another
  ``prefill(c) + r * L(n' + 1, K' + c)``, with ``r`` its expected remaining tokens
  (:class:`~staleflow.runtime.coordination.lengths.LengthModel`, from its estimated progress) and
  ``c`` its context. A lightly loaded instance decodes fastest; one that receives tail requests
  is a *host* while it holds them (at most ``tail_hosted``), and takes no other work meanwhile
  (the coordinator keeps new groups and other queued requests off it), so it stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import FleetArrays, InstanceView
from staleflow.runtime.coordination.lengths import LengthModel
from staleflow.runtime.coordination.routing import fleet_throughput
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.settings.policies import SystemPolicy
from staleflow.runtime.types import GroupId


def proactive_aborts(groups: GroupLife, threshold: int) -> list[GroupId]:
    """The groups to re-queue while the trainer waits (module docstring; none if ``threshold`` is 0)."""
    manager: StalenessManager = groups.manager
    counts = manager.counts()
    if not threshold or not 0 < counts.running[0] <= threshold or sum(counts.done) < manager.batch_size:
        return []
    due = groups.generating_due(manager.version)
    if len(due) != counts.running[0]:  # some are being rewarded: they are about to be done
        return []
    return due


class TailMoves:
    """Plans the moves of the head buffer's tail and remembers its hosts (module docstring).

    Args:
        cost_model: the instances' decode cost model.
        lengths: the lengths seen so far (no move before it is ready).
        prefill: seconds to rebuild a context of so many tokens on an instance.
        policy: its ``tail_hosted`` (the most tail requests an instance hosts) and ``tail_share`` (the
            tail starts once at most this share of a batch of head-buffer groups generate).
    """

    def __init__(self, cost_model: CostModel, lengths: LengthModel, prefill: Callable[[int], float], policy: SystemPolicy) -> None:
        self.cost_model = cost_model
        self.lengths = lengths
        self.prefill = prefill
        self.hosted = policy.tail_hosted
        self.share = policy.tail_share
        self.moved: dict[str, int] = {}  # tail request id -> the index of the instance it moved to

    def hosts(self, size: int) -> np.ndarray:
        """The mask of the ``size`` instances that host tail requests (no other work for them)."""
        mask = np.zeros(size, dtype=bool)
        mask[list(set(self.moved.values()))] = True
        return mask

    def active(self, manager: StalenessManager) -> bool:
        """Whether the head buffer has a tail to move now: the lengths are known and some, at most
        ``tail_share`` of a batch, of its groups are still generating."""
        return self.lengths.ready and 0 < manager.counts().running[0] <= self.share * manager.batch_size

    def plan(
        self, views: Sequence[InstanceView], fleet: FleetArrays, groups: GroupLife, unrouted: dict[str, int],
    ) -> dict[int, list[str]]:
        """Instance index -> tail requests to interrupt there. ``unrouted``: requests interrupted and
        not routed again yet -> the instance they go to (a moved one among them still counts for its
        host); each request moved now is added, with its host, and to :attr:`moved`."""
        self.moved = {rid: i for rid, i in self.moved.items() if rid in views[i].requests or rid in unrouted}
        if not self.active(groups.manager):
            return {}
        due = set(groups.generating_due(groups.manager.version))
        up = ~fleet.loading & ~fleet.down
        n, kv = fleet.n.copy(), fleet.kv.copy()
        hosted = np.bincount(list(self.moved.values()), minlength=len(views))
        candidates = []  # (expected remaining tokens, source, request id, context)
        for i, view in enumerate(views):
            tail = [rid for rid, group in view.groups.items() if group in due and rid not in self.moved]
            if tail and up[i]:
                generated = view.generated(tail)
                remaining = self.lengths.expected_remaining(generated)
                contexts = [view.prompts[rid] + int(g) for rid, g in zip(tail, generated)]
                candidates += zip(remaining.tolist(), [i] * len(tail), tail, contexts)
        plan: dict[int, list[str]] = {}
        for remaining, source, rid, context in sorted(candidates, reverse=True):
            stay = remaining * self.cost_model.step_latency(n[source], kv[source])
            open_ = up & (hosted < self.hosted) & (fleet.version >= views[source].requests[rid][1])
            open_[source] = False
            targets = np.flatnonzero(open_)
            if not targets.size:
                continue
            latency = (n[targets] + 1) / fleet_throughput(self.cost_model, n[targets] + 1, kv[targets] + context)
            best = int(np.argmin(latency))
            target = int(targets[best])
            if self.prefill(context) + remaining * latency[best] >= stay:
                continue
            plan.setdefault(source, []).append(rid)
            self.moved[rid] = unrouted[rid] = target
            hosted[target] += 1
            n[source] -= 1
            kv[source] -= context
            n[target] += 1
            kv[target] += context
        return plan
