"""The comparisons of the implementation with the spec mirror that both conformance layers make:
the same state, the same answers to every query, a consume that is one of the mirror's successors.
"""

from __future__ import annotations

from functools import lru_cache

from staleflow.protocol import ConsumedBatch, CounterState, StalenessManager
from staleflow.spec import mirror
from staleflow.spec.mirror import DONE, RUNNING, ConsumeStep, MirrorState, SpecParams


@lru_cache(maxsize=8192)
def consume_steps(params: SpecParams, state: MirrorState) -> tuple[ConsumeStep, ...]:
    """Every Consume successor of a mirror state (memoised: the mirror enumerates all choices)."""
    return tuple(mirror.consume(params, state))


def mirror_slack(params: SpecParams, state: MirrorState, version: int) -> int:
    """How many fresh groups at ``version`` the mirror admits one after another."""
    slack = 0
    while (grown := mirror.reserve(params, state, f"slack-probe-{slack}", version)) is not None:
        state, slack = grown, slack + 1
    return slack


def mirror_counts(params: SpecParams, state: MirrorState) -> CounterState:
    running = [0] * (params.eta + 1)
    done = [0] * (params.eta + 1)
    for group_id, version, status in state.groups:
        offset = version + params.eta - state.version
        assert 0 <= offset <= params.eta, f"{group_id!r} (v{version}) is outside offsets 0..eta at {state.version}"
        (running if status == RUNNING else done)[offset] += 1
    return CounterState(state.version, tuple(running), tuple(done))


def assert_same_state(impl: StalenessManager, p: SpecParams, spec: MirrorState) -> None:
    """The refinement mapping: same groups (id, version, status), head buffer and counters."""
    impl_groups = {(g.group_id, g.version, g.status.value) for g in impl.groups()}
    assert impl_groups == set(spec.groups), f"groups differ: impl {impl_groups}, spec {set(spec.groups)}"
    assert len(impl) == len(spec.groups), f"len(impl) = {len(impl)}, spec has {len(spec.groups)}"
    assert impl.version == spec.version, f"impl version {impl.version}, spec {spec.version}"
    assert impl.counts() == mirror_counts(p, spec), f"counts {impl.counts()} != spec {mirror_counts(p, spec)}"
    for group_id, version, status in spec.groups:  # the per-group queries: group() and `in`
        record = impl.group(group_id)
        assert (record.group_id, record.version, record.status.value) == (group_id, version, status), (
            f"group({group_id!r}) = {record}, spec has v{version} {status}")
        assert group_id in impl, f"{group_id!r} in manager is False for an active group"


def assert_same_queries(impl: StalenessManager, p: SpecParams, spec: MirrorState) -> None:
    """Eager consume (``can_consume``) and exact admission (``reserve_slack``, ``can_reserve``,
    ``oldest_admissible_version``) agree with the mirror's enabledness."""
    enabled = bool(consume_steps(p, spec))
    assert impl.can_consume() == enabled, f"can_consume() is {not enabled}, spec Consume enabled: {enabled}"
    admissible = []
    for version in range(max(0, spec.version - p.eta - 1), spec.version + 1):
        slack = mirror_slack(p, spec, version)
        got = impl.reserve_slack(version)
        assert got == slack, f"reserve_slack({version}) = {got}, spec admits {slack}"
        assert impl.can_reserve(version) == (slack > 0), f"can_reserve({version}) != {slack > 0}"
        if slack:
            admissible.append(version)
    oldest = impl.oldest_admissible_version()
    expected = min(admissible, default=None)
    assert oldest == expected, f"oldest_admissible_version() = {oldest}, spec {expected}"


def assert_consume_conforms(batch: ConsumedBatch, p: SpecParams, spec: MirrorState) -> ConsumeStep:
    """S1 and S2 for one batch, and the batch with its drops is a Consume successor of ``spec``."""
    assert batch.version == spec.version, f"batch tagged {batch.version}, head buffer is {spec.version}"
    assert len(batch.group_ids) == p.batch_size == len(set(batch.group_ids)), f"batch size: {batch}"
    for group_id, version in zip(batch.group_ids, batch.group_versions, strict=True):
        assert (group_id, version, DONE) in spec.groups, f"{group_id!r} (v{version}) was not done"
        assert version <= batch.version <= version + p.eta, f"S1 broken by {group_id!r}"
    assert len(batch.dropped) <= p.redundancy, f"{len(batch.dropped)} drops > X: {batch}"
    matches = [
        step
        for step in consume_steps(p, spec)
        if step.batch == frozenset(batch.group_ids) and step.dropped == frozenset(batch.dropped)
    ]
    assert matches, f"batch {batch} is not a Consume successor of the spec"
    return matches[0]
