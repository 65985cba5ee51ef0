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


def test_each_layer_has_its_own_cpu_limit() -> None:
    limits = {"restore": 60.0, "exhaustive": 0.2, "model": 60.0, "conformance": 60.0, "trace validation": 60.0}
    outcome, layer, why = mutation.judge(SOURCE, "test-limits", limits)
    assert (outcome, layer) == ("timeout", "exhaustive") and "0.2 s of CPU" in why, why


def test_mutation_sites_match_the_mutants() -> None:
    sites = mutation.mutation_sites(SOURCE, ["core/ReplaceUnaryOperator"])
    mutants = mutation.enumerate_mutants(SOURCE, ["core/ReplaceUnaryOperator"])
    assert [m[:3] for m in mutants] == [s for s in sites if mutation.mutated_text(SOURCE, s[0], s[1]) is not None]
    outcome = mutation.judge_site(SOURCE, *sites[0], timeout=60)
    assert outcome is not None and outcome.outcome == "killed" and outcome.original != outcome.mutated


def test_an_annotation_only_mutant_is_equivalent_without_running_the_layers() -> None:
    annotation = SOURCE.replace("def _consume_plan(self) -> list[int] | None:", "def _consume_plan(self) -> list[int] - None:")
    code = SOURCE.replace("if len(self._buckets[0]) - plan[0] > self._redundancy:",
                          "if len(self._buckets[0]) - plan[0] >= self._redundancy:")
    assert annotation != SOURCE and code != SOURCE
    assert mutation.annotation_only(SOURCE, annotation) and not mutation.annotation_only(SOURCE, code)
    # without `from __future__ import annotations` an annotation is evaluated: not equivalent
    evaluated = SOURCE.replace("from __future__ import annotations\n", "")
    assert not mutation.annotation_only(evaluated, evaluated.replace("list[int] | None:", "list[int] - None:", 1))


def test_a_mutant_that_does_not_compile_is_incompetent() -> None:
    outcome, layer, _ = mutation.judge(SOURCE.replace("def consume(self)", "def consume(self"), "x", 10)
    assert (outcome, layer) == ("incompetent", "compile")


def test_consume_cost_is_linear_in_the_batch_size() -> None:
    """Quadratic consume (the old next(iter(...)) + del loop) costs ~20x more per group at 16x B."""
    overhead = protocol_bench._timer_overhead_ns()
    small = protocol_bench.consume_cost(1_000, 5, overhead)["ns_per_group"]
    large = protocol_bench.consume_cost(16_000, 5, overhead)["ns_per_group"]
    assert large < 4 * small, (small, large)
