"""What a run is asked to do, whatever its parts: :class:`RunSpec`, from a job config
(:meth:`RunSpec.from_job`) or a simulated workload (:meth:`RunSpec.from_workload`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from staleflow.runtime.coordination.sync import TransferCosts
from staleflow.runtime.interfaces import Clock
from staleflow.runtime.settings.policies import SystemPolicy, make_policy

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig
    from staleflow.runtime.settings.workload import Workload

#: The coordinator's full-tick period when a run does not set one: one simulated second on a
#: virtual clock (simulated instances report events exactly), 5 ms of polling on a real one.
DEFAULT_TICK_S = {True: 1.0, False: 0.005}


@dataclass(frozen=True)
class RunSpec:
    """What is asked of a run.

    ``policy``: the system (:func:`~staleflow.runtime.settings.policies.make_policy`); ``eta``: the
    staleness bound asked for (a policy may run with a smaller one: sync uses 0, see
    :meth:`~staleflow.runtime.settings.policies.SystemPolicy.protocol_eta`); ``batch_size``: groups per
    training batch (``B``); ``tick_s``: period of full coordinator ticks (snapshots of every
    instance, migration), with a real clock also the polling period (None: :data:`DEFAULT_TICK_S`
    for the run's clock); ``reward_timeout_s``: per-group reward timeout (wall clock);
    ``pending_groups``: drawn prompt groups kept waiting for admission (default
    ``2 * batch_size * (eta + 1)``); ``transfer``: what moving a version costs, which the
    ``adaptive`` sync compares (a simulated workload's network; None: it pulls per instance).
    """

    policy: SystemPolicy
    eta: int
    batch_size: int
    tick_s: float | None = None
    reward_timeout_s: float = 30.0
    pending_groups: int | None = None
    transfer: TransferCosts | None = None

    def __post_init__(self) -> None:
        if self.tick_s is not None and self.tick_s <= 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")

    @classmethod
    def from_job(cls, config: JobConfig, weights_gb: float | None = None) -> RunSpec:
        """A training job's run: its system with the knobs the config sets. ``weights_gb``: a version's
        bytes on the wire (GB); with ``servers.weight_transfer=broadcast`` they give the transfer costs
        the ``adaptive`` sync compares (:func:`job_transfer_costs`)."""
        policy = make_policy(
            config.system,
            batch_redundancy=config.protocol.redundancy,
            group_redundancy=config.rollout.group_extra,
            **config.coordinator.policy_knobs(),
        )
        return cls(
            engine_bound(policy, config.rollout.max_num_seqs),
            eta=config.protocol.eta,
            batch_size=config.protocol.batch_groups,
            tick_s=config.coordinator.tick_s,
            reward_timeout_s=config.task.reward_timeout_s,
            transfer=job_transfer_costs(config, weights_gb),
        )

    @classmethod
    def from_workload(
        cls, workload: Workload, system: str, eta: int, tick_s: float | None = None, **knobs: Any
    ) -> RunSpec:
        """A simulated workload's run of ``system`` (``knobs`` override the policy's); the tick is
        ``tick_s``, else the policy's ``check_period_s``, else the workload's."""
        policy = engine_bound(make_policy(system, **knobs), workload.instance.max_running)
        default_tick = policy.check_period_s or workload.simulation.tick_s
        net, load_s = workload.network, workload.instance.weight_load_s
        transfer = TransferCosts(net.weights_gb, net.ps_gb_per_s, net.link_gb_per_s, net.broadcast_gb_per_s, load_s)
        return cls(policy, eta=eta, batch_size=workload.batch.groups_per_step, tick_s=default_tick if tick_s is None else tick_s,
                   transfer=transfer)

    def tick_for(self, clock: Clock) -> float:
        """The tick period on ``clock``: :attr:`tick_s`, or the clock's default."""
        return self.tick_s if self.tick_s is not None else DEFAULT_TICK_S[clock.simulated]


def engine_bound(policy: SystemPolicy, max_num_seqs: int) -> SystemPolicy:
    """``policy`` with throughput routing capped at what an engine runs at once (vLLM's
    ``max_num_seqs``): the cap the router fills an instance to when its cost model says the instance
    is memory-bound. The other routing rules keep the caps of the code they follow."""
    if policy.routing != "throughput" or policy.max_running <= max_num_seqs:
        return policy
    return replace(policy, max_running=max_num_seqs)


def job_transfer_costs(config: JobConfig, weights_gb: float | None) -> TransferCosts | None:
    """What moving a version of ``weights_gb`` costs a job whose parameter server sends it
    (``servers.weight_transfer=broadcast``; None otherwise, or without the bytes): per-instance sends
    share the server's link (``servers.transfer_link_gb_s``), while one collective to every instance
    behind sends the bytes once (``servers.collective_gb_s``, by default the same link), so the
    ``adaptive`` sync takes the collective once two or more instances would pull together."""
    servers = config.servers
    if weights_gb is None or servers.weight_transfer != "broadcast":
        return None
    collective = servers.collective_gb_s or servers.transfer_link_gb_s
    return TransferCosts(weights_gb, ps_gb_per_s=servers.transfer_link_gb_s, broadcast_gb_per_s=collective)
