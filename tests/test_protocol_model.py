"""Model-based conformance of StalenessManager with the spec mirror, and the mutants it must catch.

``HYPOTHESIS_PROFILE=nightly pytest tests/test_protocol_model.py`` runs the long profile.
"""

from __future__ import annotations

import pytest
from staleflow.protocol import StalenessManager
from staleflow.verification.proofs import impl_mutants
from staleflow.verification.proofs.conformance import load_profile, run_conformance
from staleflow.verification.proofs.conformance_grid import EXHAUSTIVE_GRID, exhaustive_conformance

PROFILE = load_profile()


def test_the_implementation_conforms_to_the_mirror_and_runs_deep() -> None:
    """The conformance machine under the loaded profile (``ci`` by default); on failure Hypothesis
    prints the steps. The run must reach consumes, drops, refusals and later versions."""
    stats = run_conformance(profile=PROFILE, quiet=False)
    assert stats.examples >= 200
    assert stats.consumes > 100 and stats.drops > 0 and stats.refusals > 0
    assert stats.max_version >= 4


def test_every_inv_state_of_the_small_grid_conforms() -> None:
    assert exhaustive_conformance(StalenessManager, EXHAUSTIVE_GRID) == 12470


def test_every_mutation_applies_to_the_current_manager() -> None:
    for mutant in impl_mutants.MUTANTS:
        cls = impl_mutants.mutant_class(mutant)
        assert cls is not StalenessManager and cls.__name__ == "StalenessManager"


def test_a_mutation_whose_text_is_gone_is_reported() -> None:
    ghost = impl_mutants.Mutant("ghost", "reserve", "never applies", "no such text", "x")
    with pytest.raises(impl_mutants.MutationError, match="occurs 0 times"):
        impl_mutants.mutant_class(ghost)


@pytest.mark.parametrize(
    "name, layer",
    [
        ("consume-prefix-capacity-off-by-one", "exhaustive"),
        ("consume-drops-one-too-many", "exhaustive"),
        ("reserve-refusal-not-emitted", "conformance"),
        ("occupy-skips-status-check", "conformance"),
        ("snapshot-loses-status", "restore"),
    ],
)
def test_mutants_are_caught_by_the_expected_layer(name: str, layer: str) -> None:
    mutant = next(m for m in impl_mutants.MUTANTS if m.name == name)
    row, caught_by = impl_mutants.check_mutant(mutant, every_layer=False)
    assert row.result == "pass" and caught_by == [layer], row.detail


def test_the_unmutated_source_passes_the_exhaustive_and_trace_layers() -> None:
    row = impl_mutants.check_baseline(["exhaustive", "trace validation"])
    assert row.result == "pass", row.detail
