"""Every seeded bug is caught by the layer named for it, at the smallest configuration that catches it.

Goal: each verification layer has teeth against the bugs it exists for, independently of the order
in which ``staleflow verify`` tries the layers (which stops at the first catch). Method: one case
per mutant of the implementation (``verification/proofs/impl_mutants.py``) and of the spec
(``verification/proofs/spec_mutants.py``); each runs only the named layer on the mutant. The unmutated
code and spec pass these layers (the baseline rows of ``verify --quick``, tests/test_verify_real.py,
and the small-grid baseline below), so a catch is the bug's doing. A mutant added without a row
here fails :func:`test_every_mutant_has_a_row`.
"""

from __future__ import annotations

import pytest
from staleflow.verification.proofs import impl_mutants, spec_mutants
from staleflow.verification.proofs.conformance_grid import exhaustive_conformance

#: implementation mutant -> (layer of impl_mutants.LAYERS, the (eta, B, X) grid cell that catches it for
#: "exhaustive", the failure it must be caught with: "ExceptionType: " and the start of the message).
#: AssertionError is the layer's own verdict (impl and spec differ, named); the three others are the
#: mutated manager's own crash on a path the spec allows: occupy of a finished group (KeyError where
#: the spec wants InvalidTransitionError), the done group abort leaves behind found missing from its
#: bucket (KeyError), a consume that takes from the wrong bucket running out of groups (StopIteration).
#: Any other failure (a broken mutant, a harness error) is not a catch.
IMPL_LAYER: dict[str, tuple[str, tuple[int, int, int] | None, str]] = {
    "reserve-checks-own-offset-only": ("exhaustive", (3, 1, 0), "AssertionError: reserve_slack("),
    "reserve-admits-at-zero-slack": ("exhaustive", (3, 1, 0), "AssertionError: reserve at v0 returned True"),
    "reserve-past-deadline": ("exhaustive", (3, 1, 0), "AssertionError: reserve_slack(0) = 1, spec admits 0"),
    "reserve-slack-off-by-one": ("exhaustive", (3, 1, 0), "AssertionError: reserve_slack("),
    "oldest-admissible-skips-oldest": ("exhaustive", (3, 1, 0), "AssertionError: oldest_admissible_version() = 1, spec 0"),
    "reserve-refusal-not-emitted": ("conformance", None, "AssertionError: reserve emitted 0 events"),
    "occupy-skips-status-check": ("conformance", None, "KeyError: "),
    "occupy-keeps-running-copy": ("exhaustive", (3, 1, 0), "AssertionError: groups differ"),
    "occupy-keeps-running-count": ("exhaustive", (3, 1, 0), "AssertionError: counts CounterState("),
    "abort-leaves-done-group": ("exhaustive", (3, 1, 0), "KeyError: "),
    "abort-keeps-index": ("exhaustive", (3, 1, 0), "AssertionError: len(impl) = 1, spec has 0"),
    "consume-waits-for-all-running": ("exhaustive", (3, 1, 0), "AssertionError: can_consume() is False, spec Consume enabled: True"),
    "consume-drops-one-too-many": ("exhaustive", (3, 1, 0), "AssertionError: can_consume() is True, spec Consume enabled: False"),
    "consume-prefix-capacity-off-by-one": ("exhaustive", (3, 1, 0), "AssertionError: can_consume() is True, spec Consume enabled: False"),
    "consume-takes-from-wrong-buckets": ("exhaustive", (3, 1, 0), "StopIteration: "),
    "consume-forgets-running-drops": ("exhaustive", (0, 1, 1), "AssertionError: batch ConsumedBatch("),
    "consume-prefix-not-cumulative": ("exhaustive", (3, 1, 0), "AssertionError: can_consume() is True, spec Consume enabled: False"),
    "consume-guard-next-buffer-only": ("exhaustive", (3, 1, 0), "AssertionError: can_consume() is True, spec Consume enabled: False"),
    "restore-skips-invariant": ("restore", None, "AssertionError: restore accepted an invalid snapshot (inv-capacity)"),
    "restore-wraps-past-deadline": ("restore", None, "AssertionError: restore accepted an invalid snapshot (one-past-deadline)"),
    "buffers-index-off-by-one": ("restore", None, "AssertionError: view 0 has index 6"),
    "buffers-redundancy-in-every-buffer": ("restore", None, "AssertionError: view 1 has capacity 4"),
    "snapshot-loses-status": ("restore", None, "AssertionError: groups differ"),
}

#: spec mutant -> the layer of spec_mutants.LAYERS that catches it
SPEC_LAYER: dict[str, str] = {
    "reserve-no-guard": "TLC safety",
    "reserve-capacity-plus-one": "TLC safety",
    "reserve-checks-head-only": "TLC safety",
    "reserve-checks-first-two-buffers": "TLC safety",
    "reserve-ahead-of-trainer": "TLC safety",
    "occupy-done-or-idle": "TLC safety",
    "abort-leaves-group": "graph equivalence",  # every state it reaches is a legal one: only the edges differ
    "consume-ignores-drop-bound": "TLC safety",
    "consume-running": "TLC safety",
    "consume-no-inv-guard": "TLC safety",
    "consume-needs-extra-group": "TLC safety",
    "no-rollout-fairness": "TLC liveness",
}


def test_every_mutant_has_a_row() -> None:
    assert sorted(m.name for m in impl_mutants.MUTANTS) == sorted(IMPL_LAYER)
    assert sorted(m.name for m in spec_mutants.MUTANTS) == sorted(SPEC_LAYER)


def _exhaustive_at(cell: tuple[int, int, int]) -> impl_mutants.Layer:
    """The exhaustive layer on one grid cell: why it rejects a manager class ("Type: message", the
    message without its "eta=.. B=.. c=..: " state prefix), or None."""

    def layer(cls: type) -> str | None:
        try:
            exhaustive_conformance(cls, [cell])
        except Exception as error:  # noqa: BLE001 - which failure it was is checked by the caller
            message = str(error).split(": ", 1)[-1] if str(error).startswith("eta=") else str(error)
            return f"{type(error).__name__}: {message[:200]}"
        return None

    return layer


def _impl_layer(name: str, cell: tuple[int, int, int] | None) -> impl_mutants.Layer:
    return _exhaustive_at(cell) if cell is not None else impl_mutants.LAYERS[name]


def test_the_small_exhaustive_cells_pass_the_unmutated_manager() -> None:
    baseline = impl_mutants.mutant_class(None)
    for cell in sorted({cell for _, cell, _ in IMPL_LAYER.values() if cell is not None}):
        assert _impl_layer("exhaustive", cell)(baseline) is None, cell


@pytest.mark.parametrize("mutant", impl_mutants.MUTANTS, ids=[m.name for m in impl_mutants.MUTANTS])
def test_implementation_mutant_is_caught_by_its_layer(mutant: impl_mutants.Mutant) -> None:
    layer, cell, expected = IMPL_LAYER[mutant.name]
    why = _impl_layer(layer, cell)(impl_mutants.mutant_class(mutant))
    assert why is not None, f"{mutant.name} ({mutant.bug}) survived the {layer} layer{f' at {cell}' if cell else ''}"
    assert why.startswith(expected), f"{mutant.name} was caught by another failure than its own: {why!r}, expected {expected!r}..."


@pytest.mark.java
@pytest.mark.parametrize("mutant", spec_mutants.MUTANTS, ids=[m.name for m in spec_mutants.MUTANTS])
def test_spec_mutant_is_caught_by_its_layer(mutant: spec_mutants.SpecMutant) -> None:
    layers = {name: (reads, run) for name, reads, run in spec_mutants.LAYERS}
    reads, run = layers[SPEC_LAYER[mutant.name]]
    files = mutant.apply()
    assert reads & files.keys(), f"{mutant.name} edits no file the {SPEC_LAYER[mutant.name]} layer reads"
    why = run(files)
    assert why is not None, f"{mutant.name} ({mutant.description}) survived {SPEC_LAYER[mutant.name]}"
