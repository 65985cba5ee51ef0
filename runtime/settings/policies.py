"""System policies: StaleFlow with switchable strategies, and the peer systems, in one runtime.

:data:`POLICIES` is the one table of systems: each entry says how the system admits, routes,
synchronises and consumes, the bound it keeps (``fixed_eta``; otherwise the one asked for, by
default :data:`DEFAULT_ETA`) and whether it takes redundancy. The job config
(:mod:`staleflow.runtime.settings.config`) takes from it which systems a job runs
(:func:`training_systems`), their default ``eta`` and its consistency rules; nothing restates them.

Systems that keep the bound (StaleFlow, ``verl-sync``, ``one-step-off``, ``roll-flash``,
``roll-flash-2026``, ``inflight-cap``) run through :class:`~staleflow.protocol.StalenessManager`, which alone decides
admission and consumption, so their staleness never exceeds ``eta``. The peers that do not keep a
per-group bound (``areal``, ``verl-async``) run as the real systems run: their admission cap, their
consumption order, and an unbounded accounting (:class:`~staleflow.runtime.run.group_life.CompletionLedger`,
owned by the group owner like the protocol); their staleness is **measured** (histogram, p99, max,
share past ``eta``), never prevented. Each baseline follows the peer code named below:

``verl-sync`` (VeRL ``main_ppo``, colocated)
    Every GPU rolls out, then every GPU trains (the simulator gives it all GPUs as instances and
    scales the training step by ``trainer_gpus / gpus``); bound 0; weights are resharded in place.
``one-step-off`` (VeRL ``recipe/one_step_off_policy``)
    Rollout of step k+1 overlaps training of step k (bound 1), separate GPU pools, a global NCCL
    broadcast once the rollout of a batch is drained; least-requests routing.
``verl-async`` (VeRL ``recipe/fully_async_policy``)
    Rollouter and trainer on separate GPUs; the rollouter admits while samples in flight or queued
    stay within ``(eta + version + 1) * B`` (``staleness_threshold`` in batches); partial rollout on
    each parameter sync (in-flight requests aborted and resubmitted), a blocking broadcast; the
    trainer takes groups from the message queue in the order they finished, and trains on the
    rollout's log-probs without recomputing them (``use_rollout_log_probs: True``, the recipe's
    default in verl 0.9).
``areal`` (AReaL ``areal/core/staleness_manager.py``, ``workflow_executor.py``)
    Capacity ``min(max_concurrent - running, (eta + version + 1) * B - (accepted + running))`` with
    ``max_concurrent_rollouts`` = the batch size; round-robin routing; a request interrupted by a
    weight update is resubmitted, with its tokens so far, to the server it ran on
    (``remote_inf_engine.py``); the trainer takes the oldest-created *finished* groups (a straggler
    never holds it back, so some groups are trained more than ``eta`` versions after they started);
    the weight update pauses rollout and blocks the trainer while it broadcasts.
``areal-filter``
    ``areal`` with a filter that drops finished groups past ``eta`` at consume (``should_accept_fn``);
    their tokens are reported as wasted.
``roll-flash`` (ROLL ``AsyncDynamicSamplingScheduler``, ``rlvr_pipeline.py``, commit aa6ad590, December 2025: the code the paper measured)
    Each prompt is bound to its start step (``async_generation_ratio`` = ``eta``) and the batch
    waits for the oldest start-step groups, through the protocol (earliest-deadline consumption, as
    ``roll-flash-2026``). Differences from ``roll-flash-2026``, each a knob:
    *admission* (``outstanding="ratio"``): ``AsyncDynamicSamplingScheduler.sending_request`` sends a
    new prompt only while the prompts in its replay buffer (admitted and not yet taken by
    ``get_batch``) are fewer than ``batch_size * max(1, async_generation_ratio)``, so at most
    ``max(1, eta)`` batches are outstanding, one fewer than the protocol allows;
    *placement* (``routing="prompt_round_robin"``): ``send_query_items`` takes
    ``next(get_available_dp_rank())`` (``pre_send_dp_rank``) once per prompt, the next instance in turn
    with no look at its load or its requests, and sends all the prompt's samples there; the only cap
    is the fleet's: ``sending_request`` sends no new prompt while the requests in flight reach
    ``max_running_requests`` (128) x the instances (``cluster_max_running_requests``);
    *update*: ``pause_sampling`` STOPs every worker and waits for every request to come back (the
    same whole-fleet pause, ``update_pause_s``, trainer blocked), then ``send_paused_requests`` resends
    the interrupted requests as prompt plus partial output (a full re-prefill) one at a time, each to
    the next instance in turn (``resend_round_robin``: per request, so a group's partials spread over
    the instances), before any new prompt.
    *reference model* (``reference_forward``): ``rlvr_pipeline.py`` runs the reference model's forward
    over every batch of a run that is not LoRA, on the trainer (later code: with ``enable_reference``).
``roll-flash-2026`` (ROLL ``generate_scheduler.py``, ``router.py``, ``rlvr_pipeline.py``, commit 8eb27cc2; old name ``start-version-gc``)
    Each prompt is bound to its start step (``async_generation_ratio`` = ``eta``); the batch waits
    for the oldest start-step groups and leftovers past their start step are aborted only after the
    batch is assembled (never a group that could still be trained). Without additional prompts
    (ROLL's default) no leftover is ever past its step, so this is the protocol's earliest-deadline
    consumption, with its admission (up to ``eta + 1`` batches outstanding). Routing is ROLL's
    ``PromptAffinityRouter`` (``prompt_affinity``): a group's requests
    all go to one instance, picked by requests in flight only, at most ``max_running_requests`` = 128
    per instance, pins cleared at each ``abort_all``. Each step every instance pauses at once
    (``pause_sampling``: router suspended, ``abort_all``, ``wait_complete``; ``offload_states``,
    ``model_update`` broadcast, ``load_states``) with the trainer blocked throughout
    (``update_pause_s``); every request in flight is resent as prompt plus partial output (a full
    re-prefill), routed again by its group's new pin. Both versions also offload the trainer's states
    to host memory after every step and load them back (``offloads_trainer``; ``actor_train``'s
    ``offload_states`` / ``load_states`` in ``rlvr_pipeline.py``): 16 bytes per parameter per trainer
    GPU out and back at the workload's ``network.host_gb_per_s`` (25 GB/s in the paper workloads, an
    effective PCIe Gen5 x16 rate), about 0.6 s per step for the 30B and 32B models on 64 trainer GPUs.
``roll-flash-ideal-routing``
    ``roll-flash-2026`` with the least-requests routing the simulator gave it before (no pins, no cap,
    instances with a waiting queue avoided): an ablation row that shows what routing alone is worth.
``inflight-cap``
    A hybrid kept for comparison: AReaL's admission cap through the strict protocol (a straggler
    holds the trainer back instead of being trained stale); global immediate updates.
``staleflow``
    Protocol admission at each instance's version, cost-model routing with the waterfall (oldest
    version tier first for partials) and ``mu``, per-instance synchronization through the parameter
    server, migration with ``phi_wait`` and ``phi_throughput``, proactive abort of the last
    ``proactive_abort`` straggler groups the trainer waits for (the authors'
    ``abort_and_truncate_strategy``); an instance that pulls keeps its running requests (in-place
    reload, as the engine seam provides). Knob defaults are the authors' experiment script's where
    the paper is silent (``mu`` 0.2, sync at KV use <= 0.6, migration ratio 5, ``phi_wait`` 3,
    proactive-abort threshold 2), and routing that plans for the KV growth of the requests it
    places (``plan_growth``). ``staleflow-no-routing`` / ``-no-sync`` / ``-no-migration`` /
    ``-no-proactive-abort`` / ``-no-growth`` switch one strategy to its vanilla counterpart (or off)
    for the ablation. ``staleflow-tail`` adds the head buffer's tail moved to lightly loaded hosts
    (``tail_hosted`` 8): off by default, as it cost throughput in our measurements (docs/simulation.md).
    ``staleflow-spec`` models speculative decoding on instances running 8 requests or fewer
    (``speculative_speedup`` 1.5, an assumed speed-up: ``adapters/sim/speculation.py``), reported
    apart from the headline until a GPU has measured it.
``staleflow-authors`` (psrl ``examples/paper_exp/e2e/moe_ours.sh``, ``14b_ours.sh``; the coordinator's
``sync_and_migrate/status_based.py`` and ``sync_and_migrate_mixin.py``)
    StaleFlow as the authors' code runs it: ``mu`` 0.3, sync when the KV cache is at most half full
    (``sync.threshold=0.5``), and a SYNC interrupts the instance's requests, which come back to the
    router as partials and are prefilled again (``pause_for_sync``, then the interrupted partials
    loop back); migration evacuates the whole instance of the highest throughput ratio over a
    starved instance (ratio above 5) when it holds at least 10 requests (``stop_threshold``), checked
    every 100 ms (``check_interval_in_ms``); the engine sends the requests waiting beyond
    ``phi_wait`` = 3 back to the router (``max_num_waiting_reqs_after_preemption``); at most 128
    requests per instance (``max_concurrent_seqs_per_instance``); no proactive abort.
    ``staleflow-authors-sync99`` is the same with ``sync.threshold=0.99`` (``14b_ours.sh``).
``staleflow-no-recompute``
    ``staleflow`` whose trainer skips the forward pass that recomputes the old log-probs: what
    StaleFlow's own trainer does when a step is one minibatch (the proximal policy is then the
    weights at the start of the step, ``adapters/rlkit/packed_step.py``), and what verl's fully-async
    recipe does by default. ``staleflow`` pays for it, as the authors' scripts do
    (``enable_train_engine_recompute_log_prob=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

Routing = Literal["throughput", "least_loaded", "round_robin", "prompt_affinity", "prompt_round_robin"]
Sync = Literal["per_instance", "global_immediate", "global_drained", "adaptive"]
Admission = Literal["protocol", "inflight_cap"]
Outstanding = Literal["protocol", "ratio"]
Consumption = Literal["deadline", "oldest_finished", "finish_order"]
MigrationRule = Literal["split", "evacuate"]
WeightTransfer = Literal["ps_pull", "broadcast", "colocated"]


@dataclass(frozen=True)
class SystemPolicy:
    """How the runtime admits, routes, synchronises and migrates.

    Args:
        name: the system's name in reports.
        routing: ``throughput`` (marginal gain of the cost model, waterfall over versions, ``mu``),
            ``least_loaded`` (fewest requests, at most ``max_running`` per instance),
            ``round_robin`` (the next instance in turn, AReaL), ``prompt_affinity`` (a group's
            requests on the instance with the fewest requests when its first one is placed, each
            waiting there while it holds ``max_running``: ROLL 2026) or ``prompt_round_robin`` (a
            group's requests all at once on the next instance in turn below ``max_running``: ROLL
            aa6ad590); see :mod:`~staleflow.runtime.coordination.routing`.
        sync: ``per_instance`` (pull one instance when it is nearly drained or can no longer
            admit), ``global_immediate`` (every instance as soon as a version is pushed),
            ``global_drained`` (every instance together once all are drained), or ``adaptive``
            (``per_instance``, or a global broadcast to every instance behind where the run's
            transfer costs make it cheaper: :mod:`~staleflow.runtime.coordination.sync`).
        migration: interrupt and re-route waiting and excess requests.
        admission: ``protocol`` (reserve only) or ``inflight_cap`` (also the AReaL cap).
        outstanding: the most groups admitted and not yet consumed: ``protocol`` (what the protocol
            reserves, ``eta + 1`` batches plus the redundancy) or ``ratio`` (``max(1, eta)`` batches,
            ROLL aa6ad590's ``batch_size * max(1, async_generation_ratio)``).
        fixed_eta: the bound this system runs with whatever the user asks (sync: 0, one-step-off: 1);
            a job config must ask for exactly this bound, and leaving ``eta`` out takes it
            (:attr:`default_eta`).
        takes_redundancy: whether the protocol may admit redundant groups beyond the batches
            (``batch_redundancy``); the synchronous systems admit exactly one batch per version.
        consumption: ``deadline`` (the strict protocol: earliest deadline first, the bound kept),
            ``oldest_finished`` (AReaL: the oldest-admitted finished groups) or ``finish_order``
            (VeRL fully async: groups in the order they finished); the last two are not bounded:
            their staleness is measured.
        filter_stale: with an unbounded consumption, drop finished groups past ``eta`` at consume
            (their tokens are counted as wasted).
        rollout_concurrency: most groups generating at once, in batches (AReaL's
            ``max_concurrent_rollouts`` defaults to the batch size: 1.0); 0: no cap.
        weight_transfer: ``ps_pull`` (each instance pulls from the parameter server, sharing its
            bandwidth), ``broadcast`` (a global NCCL broadcast that blocks the trainer and every
            instance) or ``colocated`` (trainer and rollout share GPUs: an in-place reshard).
        colocated: rollout and training take turns on every GPU (VeRL's synchronous mode).
        proactive_abort: when the trainer waits for the head buffer and at most this many groups
            due in it are still generating (and enough finished groups wait to fill the batch),
            abort them and re-queue their prompts (0: off).
        batch_redundancy: protocol redundancy ``X`` (extra groups beyond the batches).
        group_redundancy: ``n_extra`` responses sampled per group (the first ``n_samples`` kept).
        mu: routing threshold, a fraction of an empty instance's throughput.
        phi_wait: migrate an instance's waiting requests beyond this many.
        phi_throughput: migrate when one instance's throughput is this many times another's.
        migration_rule: what an imbalance migration moves: ``split`` (half the request-count
            difference between the busiest instance and the least busy starved one, and the waiting
            requests beyond ``phi_wait`` while starved instances can start them) or ``evacuate``
            (every request of the instance whose throughput is the highest multiple of a starved
            instance's, when it holds at least ``evacuate_min_requests``: the authors' coordinator).
        evacuate_min_requests: the ``evacuate`` rule leaves an instance with fewer requests alone.
        waiting_bounce: at every decision, every instance's waiting requests beyond ``phi_wait``
            go back to the router, whether or not another instance could start them (the authors'
            engine-side loop-back after a preemption).
        check_period_s: the period of full coordinator ticks (snapshots, migration) this system
            runs with in simulation when none is asked for (0: the workload's).
        sync_kv_fraction: per-instance sync pulls an instance whose KV cache is at most this full.
        max_running: per-instance cap on the requests the router places (every routing rule).
        freshness: freshness-aware admission: admit work for later buffers only when the trainer
            would otherwise wait. Admission stops once the active groups fill the head buffer and
            ``lookahead`` more (starting at ``eta``, the protocol's own limit, and never above it); the lookahead
            grows by one after a step the trainer waited for when the hold kept work from an
            instance with room (see :meth:`Coordinator.step_started`), and shrinks by one after
            ``freshness_patience`` steps in a row without that; instances pull a new version as soon
            as it is pushed (``per_instance`` sync made eager) and new groups go first to instances at
            the newest admissible version. It only chooses when to reserve, never what the
            protocol allows. Where the trainer waits at every step (a rollout-bound workload) the lookahead
            never narrows below ``eta`` and the policy runs exactly as without it.
        freshness_patience: steps without a costly wait before the lookahead shrinks.
        request_budget: queued requests of one version whose KV tokens fall in the same bucket of
            this many tokens (the reference's ``request_budget``, 1024 in the authors' script) are
            placed by one router call, each planned as the largest of them (0 or 1: one call per
            distinct size).
        pull_keeps_requests: an instance that pulls keeps its running requests, which go on with
            the new weights (in-place reload, vLLM ``pause_generation(mode="keep")``); by default
            they are interrupted first and re-routed as partials (abort-and-resubmit, as the
            reference coordinator's SYNC command and the peer systems do), which costs a prefill
            of their tokens so far.
        resend_round_robin: the requests interrupted by a pull are routed one at a time, each to the
            next instance in turn below ``max_running`` (the turn of ``prompt_round_robin`` when the
            policy routes so), whatever their group's pin, in the queue's order and before any new
            group is admitted (ROLL aa6ad590's ``send_paused_requests``).
        resubmit_same_instance: a request interrupted by a pull goes back to the instance it ran on
            once that instance has the new weights (AReaL's ``agenerate`` keeps one server per
            request id across interruptions), not wherever routing would place it.
        update_pause_s: with a ``broadcast`` weight transfer, seconds of ROLL's whole-fleet pause
            around each update (router suspended, ``abort_all`` round trip, ``wait_complete``, the
            prefix-cache reset and memory clear of ``offload_states`` / ``load_states``), added to
            every instance's weight load; when > 0 the trainer is blocked through the whole update
            (this pause, the broadcast and the instances' ``weight_load_s``), as ROLL's driver runs
            them in sequence before the next ``get_batch``. 0: the broadcast alone blocks the trainer.
            A simulated cost (``staleflow simulate``); a training job pays its engines' real one.
        recomputes_logprobs: the trainer recomputes the old (behaviour) log-probs before its update, a
            forward pass over the batch (VeRL's and AReaL's default, and StaleFlow's); False trains on
            the log-probs the rollout returned (verl's fully-async recipe: ``use_rollout_log_probs``
            defaults to True). A simulated cost (:class:`~staleflow.runtime.settings.workload.TrainingSpec`).
        reference_forward: the trainer also runs a reference model's forward pass over the batch each
            step (ROLL Flash at aa6ad590: module docstring), 2 FLOPs per active parameter per token
            and one attention pass. A simulated cost, as ``recomputes_logprobs``.
        plan_growth: throughput routing places a request only where the KV cache holds, besides what
            is resident, the tokens the requests there and this one are expected to add until they
            finish (from the lengths seen so far, given each one's progress:
            :mod:`~staleflow.runtime.coordination.lengths`); otherwise the fit is on the KV in use now.
        tail_hosted: the head buffer's tail (its running requests once at most ``tail_share`` of a
            batch of its groups generate) moves, request by request where the cost model says it
            finishes sooner counting the re-prefill, to lightly loaded instances that host at most
            this many tail requests each and take no other work meanwhile
            (:mod:`~staleflow.runtime.coordination.tail`); 0: off.
        tail_share: see ``tail_hosted``.
        offloads_trainer: after each step the trainer's states (weights, gradients, optimizer) go to
            host memory and come back before the next (ROLL's ``offload_states`` / ``load_states`` of
            the actor around every step, ``rlvr_pipeline.py``); the trainer is busy meanwhile. A
            simulated cost (``adapters/sim/network.py``, ``trainer_offload_seconds``).
        speculative_speedup: simulated engines decode ``speculative_speedup`` times faster while they
            run at most ``speculative_max_batch`` requests, as vLLM's dynamic speculative decoding
            does (:mod:`~staleflow.adapters.sim.speculation`); 1.0: off. A training job sets its
            engines' speculation in ``rollout.speculation`` and gets what they measure.
        speculative_max_batch: see ``speculative_speedup``.
        draft_acceptance: simulated engines verify up to ``max_drafts`` draft tokens a step at every
            batch size, each accepted with this probability once the ones before it were (0: off),
            timed by their cost model (:class:`~staleflow.adapters.sim.speculation.DraftVerification`).
    """

    name: str
    routing: Routing = "throughput"
    sync: Sync = "per_instance"
    migration: bool = True
    admission: Admission = "protocol"
    outstanding: Outstanding = "protocol"
    fixed_eta: int | None = None
    takes_redundancy: bool = True
    consumption: Consumption = "deadline"
    filter_stale: bool = False
    rollout_concurrency: float = 0.0
    weight_transfer: WeightTransfer = "ps_pull"
    colocated: bool = False
    proactive_abort: int = 0
    batch_redundancy: int = 0
    group_redundancy: int = 0
    mu: float = 0.3
    phi_wait: int = 3
    phi_throughput: float = 5.0
    migration_rule: MigrationRule = "split"
    evacuate_min_requests: int = 10
    waiting_bounce: bool = False
    check_period_s: float = 0.0
    sync_kv_fraction: float = 0.1
    max_running: int = 1_000_000
    freshness: bool = False
    freshness_patience: int = 3
    pull_keeps_requests: bool = False
    request_budget: int = 1024
    resubmit_same_instance: bool = False
    resend_round_robin: bool = False
    update_pause_s: float = 0.0
    recomputes_logprobs: bool = True
    reference_forward: bool = False
    offloads_trainer: bool = False
    plan_growth: bool = False
    tail_hosted: int = 0
    tail_share: float = 0.25
    speculative_speedup: float = 1.0
    speculative_max_batch: int = 8
    draft_acceptance: float = 0.0
    max_drafts: int = 8

    def __post_init__(self) -> None:
        _choice("routing", self.routing, ("throughput", "least_loaded", "round_robin", "prompt_affinity", "prompt_round_robin"))
        _choice("consumption", self.consumption, ("deadline", "oldest_finished", "finish_order"))
        _choice("weight_transfer", self.weight_transfer, ("ps_pull", "broadcast", "colocated"))
        _choice("sync", self.sync, ("per_instance", "global_immediate", "global_drained", "adaptive"))
        _choice("admission", self.admission, ("protocol", "inflight_cap"))
        _choice("outstanding", self.outstanding, ("protocol", "ratio"))
        _choice("migration_rule", self.migration_rule, ("split", "evacuate"))
        counts = ("batch_redundancy", "group_redundancy", "phi_wait", "max_running", "freshness_patience", "proactive_abort",
                  "request_budget", "evacuate_min_requests", "tail_hosted", "speculative_max_batch", "max_drafts")
        for name in counts:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"policy {self.name!r}: {name} must be an int >= 0, got {value!r}")
        if not self.speculative_speedup >= 1.0:
            raise ValueError(f"policy {self.name!r}: speculative_speedup must be >= 1 (1: off), got {self.speculative_speedup!r}")
        if not 0.0 <= self.draft_acceptance < 1.0 or (self.draft_acceptance and self.speculative_speedup > 1.0):
            raise ValueError(f"policy {self.name!r}: draft_acceptance must be in [0, 1), without speculative_speedup")
        if self.fixed_eta is not None and (not isinstance(self.fixed_eta, int) or self.fixed_eta < 0):
            raise ValueError(f"policy {self.name!r}: fixed_eta must be None or an int >= 0")
        if self.batch_redundancy and not self.takes_redundancy:
            raise ValueError(f"policy {self.name!r}: batch_redundancy must be 0 (this system admits exactly one batch per version)")
        if self.resend_round_robin and self.resubmit_same_instance:
            raise ValueError(f"policy {self.name!r}: resend_round_robin and resubmit_same_instance are two rules for the same requests")
        if self.filter_stale and self.keeps_bound:
            raise ValueError(f"policy {self.name!r}: filter_stale needs an unbounded consumption (the protocol keeps the bound)")
        for name in ("mu", "phi_throughput", "sync_kv_fraction", "rollout_concurrency", "update_pause_s", "check_period_s", "tail_share"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"policy {self.name!r}: {name} must be a number >= 0")

    @property
    def keeps_bound(self) -> bool:
        """Whether the strict protocol decides consumption (else staleness is only measured)."""
        return self.consumption == "deadline"

    @property
    def default_eta(self) -> int:
        """The bound a job runs with when it leaves ``eta`` out: the system's own, else :data:`DEFAULT_ETA`."""
        return DEFAULT_ETA if self.fixed_eta is None else self.fixed_eta

    @property
    def trainable(self) -> bool:
        """Whether a training job (``staleflow train``) can run this system: it keeps the bound (a job
        writes the protocol trace, which only the protocol has) and places rollout and training on
        separate GPUs (a job does not colocate them)."""
        return self.keeps_bound and not self.colocated

    def protocol_eta(self, eta: int) -> int:
        """The bound the protocol runs with: the user's, or the system's own if smaller (sync: 0)."""
        return eta if self.fixed_eta is None else min(self.fixed_eta, eta)


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


#: ``eta`` of a system without a bound of its own when a job or workload leaves it out.
DEFAULT_ETA = 2

_BASELINE: dict[str, Any] = {"routing": "least_loaded", "migration": False, "weight_transfer": "broadcast"}

#: StaleFlow's engines reload weights in place (the RolloutEngine seam); the peers abort and
#: resubmit in-flight requests around a weight update, and so do their policies here. The other
#: knobs are the authors' experiment script's (``all_strategy.sh``): mu 0.2, sync on KV use <= 0.6,
#: migration at a throughput ratio of 5, phi_wait 3, proactive abort with threshold 2.
_STALEFLOW: dict[str, Any] = {
    "pull_keeps_requests": True, "mu": 0.2, "sync_kv_fraction": 0.6, "phi_wait": 3, "phi_throughput": 5.0,
    "proactive_abort": 2, "plan_growth": True,
}
#: StaleFlow as the authors' code runs it (psrl ``examples/paper_exp/e2e/moe_ours.sh``): see the
#: module docstring for each knob's source.
_STALEFLOW_AUTHORS: dict[str, Any] = {
    "pull_keeps_requests": False, "mu": 0.3, "sync_kv_fraction": 0.5, "phi_wait": 3, "phi_throughput": 5.0,
    "proactive_abort": 0, "max_running": 128, "migration_rule": "evacuate", "evacuate_min_requests": 10,
    "waiting_bounce": True, "check_period_s": 0.1,
}
_AREAL: dict[str, Any] = {
    **_BASELINE, "routing": "round_robin", "sync": "global_immediate", "admission": "inflight_cap",
    "consumption": "oldest_finished", "rollout_concurrency": 1.0, "resubmit_same_instance": True,
}

#: ROLL's ``max_running_requests`` default (``roll/configs/base_config.py``), the RLVR router's cap per instance.
ROLL_MAX_RUNNING_REQUESTS = 128
#: ROLL Flash's update (``roll/pipeline/rlvr/rlvr_pipeline.py``): global sync, a blocking broadcast and
#: the pause around it. 1 s for the pause is our estimate (an ``abort_requests`` RPC to every instance,
#: ``wait_complete``, two prefix-cache resets and a ``gc.collect`` / ``empty_cache`` per instance), not a
#: measurement; the broadcast runs at the workload's ``network.broadcast_gb_per_s``.
_ROLL: dict[str, Any] = {**_BASELINE, "sync": "global_immediate", "update_pause_s": 1.0, "offloads_trainer": True}
#: ROLL Flash as the paper measured it (commit aa6ad590): see the module docstring for each knob's source.
_ROLL_AA6AD590: dict[str, Any] = {
    **_ROLL, "routing": "prompt_round_robin", "max_running": ROLL_MAX_RUNNING_REQUESTS, "outstanding": "ratio",
    "resend_round_robin": True, "reference_forward": True,
}


def _staleflow(name: str, **knobs: Any) -> SystemPolicy:
    return SystemPolicy(name, **{**_STALEFLOW, **knobs})


POLICIES: dict[str, SystemPolicy] = {
    "staleflow": _staleflow("staleflow"),
    "staleflow-no-routing": _staleflow("staleflow-no-routing", routing="least_loaded"),
    "staleflow-no-sync": _staleflow("staleflow-no-sync", sync="global_immediate"),
    "staleflow-no-migration": _staleflow("staleflow-no-migration", migration=False),
    "staleflow-no-proactive-abort": _staleflow("staleflow-no-proactive-abort", proactive_abort=0),
    "staleflow-no-growth": _staleflow("staleflow-no-growth", plan_growth=False),
    "staleflow-tail": _staleflow("staleflow-tail", tail_hosted=8),
    "staleflow-spec": _staleflow("staleflow-spec", speculative_speedup=1.5),
    "staleflow-fresh": _staleflow("staleflow-fresh", freshness=True),
    "staleflow-authors": SystemPolicy("staleflow-authors", **_STALEFLOW_AUTHORS),
    "staleflow-no-recompute": _staleflow("staleflow-no-recompute", recomputes_logprobs=False),
    "staleflow-authors-sync99": SystemPolicy("staleflow-authors-sync99", **{**_STALEFLOW_AUTHORS, "sync_kv_fraction": 0.99}),
    "verl-sync": SystemPolicy("verl-sync", sync="global_drained", fixed_eta=0, takes_redundancy=False, colocated=True,
                              **{**_BASELINE, "weight_transfer": "colocated"}),
    "sync": SystemPolicy("sync", sync="global_drained", fixed_eta=0, takes_redundancy=False, **_BASELINE),
    "one-step-off": SystemPolicy("one-step-off", sync="global_drained", fixed_eta=1, **_BASELINE),
    "verl-async": SystemPolicy("verl-async", sync="global_immediate", admission="inflight_cap",
                               consumption="finish_order", recomputes_logprobs=False, **_BASELINE),
    "areal": SystemPolicy("areal", **_AREAL),
    "areal-filter": SystemPolicy("areal-filter", filter_stale=True, **_AREAL),
    "roll-flash": SystemPolicy("roll-flash", **_ROLL_AA6AD590),
    "roll-flash-2026": SystemPolicy("roll-flash-2026", **{**_ROLL, "routing": "prompt_affinity", "max_running": ROLL_MAX_RUNNING_REQUESTS}),
    "roll-flash-ideal-routing": SystemPolicy("roll-flash-ideal-routing", **_ROLL),
    "inflight-cap": SystemPolicy("inflight-cap", sync="global_immediate", admission="inflight_cap", **_BASELINE),
}

#: Old names that still work: ``start-version-gc`` aborted groups at once when the trainer waited
#: (it churned: chaos seed 100051); ROLL Flash waits first, which ``roll-flash-2026`` does (the
#: model the old name was replaced by).
ALIASES = {"start-version-gc": "roll-flash-2026"}


def find_policy(name: str) -> SystemPolicy | None:
    """The policy of the system called ``name`` (an old name in :data:`ALIASES` included), or None."""
    return POLICIES.get(ALIASES.get(name, name))


def training_systems() -> list[str]:
    """The names a training job accepts for ``system``: every :attr:`~SystemPolicy.trainable` system
    of :data:`POLICIES` and the old names of those."""
    return [name for name in [*POLICIES, *ALIASES] if (policy := find_policy(name)) is not None and policy.trainable]


def make_policy(name: str, **overrides: Any) -> SystemPolicy:
    """The named policy, with knobs overridden (``make_policy("staleflow", mu=0.2)``)."""
    policy = find_policy(name)
    if policy is None:
        raise ValueError(f"unknown system {name!r}; known: {', '.join([*POLICIES, *ALIASES])}")
    unknown = set(overrides) - set(SystemPolicy.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown policy knob(s) {', '.join(sorted(unknown))} for system {name!r}")
    return replace(policy, **overrides)
