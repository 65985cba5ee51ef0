"""staleflow bench mutation (Cosmic Ray operators judged by the manager-dependent verify rows) and
the consume cost table of bench protocol."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray")

from staleflow.bench import mutation
from staleflow.bench import protocol as protocol_bench
from staleflow.protocol import manager as manager_module

SOURCE = Path(manager_module.__file__).read_text(encoding="utf-8")


def test_cosmic_ray_mutants_of_the_manager_are_enumerated() -> None:
    mutants = mutation.enumerate_mutants(SOURCE, ["core/ReplaceUnaryOperator"])
    assert len(mutants) >= 5
    for operator, _, line, mutated in mutants:
        assert operator.startswith("core/ReplaceUnaryOperator") and mutated != SOURCE
        before, after = mutation._changed_line(SOURCE, mutated, line)
        assert before != after


def test_a_wrong_comparison_is_killed_and_a_hang_is_a_timeout() -> None:
    broken = SOURCE.replace("if len(self._buckets[0]) - plan[0] > self._redundancy:",
                            "if len(self._buckets[0]) - plan[0] >= self._redundancy:")
    assert broken != SOURCE
    outcome, layer, why = mutation.judge(broken, "test-ge", timeout=60)
    assert (outcome, layer) == ("killed", "exhaustive"), why
    outcome, _, why = mutation.judge(SOURCE, "test-timeout", timeout=0.05)
    assert outcome == "timeout" and "ran past" in why


def test_a_mutant_that_does_not_compile_is_incompetent() -> None:
    outcome, layer, _ = mutation.judge(SOURCE.replace("def consume(self)", "def consume(self"), "x", 10)
    assert (outcome, layer) == ("incompetent", "compile")


def test_consume_cost_is_linear_in_the_batch_size() -> None:
    """Quadratic consume (the old next(iter(...)) + del loop) costs ~20x more per group at 16x B."""
    overhead = protocol_bench._timer_overhead_ns()
    small = protocol_bench.consume_cost(1_000, 5, overhead)["ns_per_group"]
    large = protocol_bench.consume_cost(16_000, 5, overhead)["ns_per_group"]
    assert large < 4 * small, (small, large)
