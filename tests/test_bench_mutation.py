"""staleflow bench mutation (Cosmic Ray operators judged by the manager-dependent verify rows) and
the consume cost table of bench protocol."""

from __future__ import annotations

from pathlib import Path

import pytest
from skips import require

require("cosmic_ray", "dev")

from staleflow.bench import mutation, mutation_suite
from staleflow.bench import protocol as protocol_bench
from staleflow.protocol import manager as manager_module

SOURCE = Path(manager_module.__file__).read_text(encoding="utf-8")
ROOT = Path(manager_module.__file__).resolve().parents[1]


def test_cosmic_ray_mutants_of_the_manager_are_enumerated() -> None:
    mutants = mutation.enumerate_mutants(SOURCE, ["core/ReplaceUnaryOperator"])
    assert len(mutants) >= 5
    for operator, _, line, mutated in mutants:
        assert operator.startswith("core/ReplaceUnaryOperator") and mutated != SOURCE
        before, after = mutation._changed_line(SOURCE, mutated, line)
        assert before != after


def test_a_wrong_comparison_is_killed_and_a_hang_is_a_timeout() -> None:
    broken = SOURCE.replace("if counts[0] + counts[offsets] - plan[0] > self._redundancy:",
                            "if counts[0] + counts[offsets] - plan[0] >= self._redundancy:")
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
    code = SOURCE.replace("if counts[0] + counts[offsets] - plan[0] > self._redundancy:",
                          "if counts[0] + counts[offsets] - plan[0] >= self._redundancy:")
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


@pytest.fixture
def small_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench mutation`` judging with the restore and exhaustive layers on one small grid cell (the
    real layers; the run's own grids take minutes). Forked workers inherit the patch."""
    from staleflow.verification.proofs import impl_mutants

    layers = impl_mutants.make_layers(((2, 1, 1),), ((2, 1, 1),), 200)
    monkeypatch.setattr(mutation, "judge_layers", lambda: {name: layers[name] for name in ("restore", "exhaustive")})


def test_bench_mutation_reports_killed_and_equivalent_mutants_from_forked_workers(
        small_layers: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from staleflow.__main__ import main

    chosen = "core/ReplaceComparisonOperator_Gt_Eq#0,core/ReplaceComparisonOperator_Gt_Eq#3,core/ReplaceComparisonOperator_Gt_NotEq#0"
    out = tmp_path / "mutation.json"
    code = main(["bench", "mutation", "--mutants", chosen, "--jobs", "2", "--json", "--out", str(out)])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and json.loads(out.read_text()) == report
    assert report["mutants"] == 3 and report["counts"] == {"killed": 2, "equivalent": 1}
    assert report["killed_by_layer"] == {"exhaustive": 1, "restore": 1}
    # the rows' CPU limits, and the wall limit of the last layer, the manager's unit tests (at least 30 s)
    assert set(report["layer_cpu_limits"]) == {"restore", "exhaustive", "tests"} and min(report["layer_cpu_limits"].values()) >= 2.0
    assert report["layer_cpu_limits"]["tests"] >= 30.0
    rows = {(row[0], row[1]): dict(zip(report["outcome_fields"], row)) for row in report["outcomes"]}
    assert rows[("core/ReplaceComparisonOperator_Gt_Eq", 3)]["layer"] == "restore"
    (equivalent,) = report["equivalent"]
    assert equivalent["mutated"] == "return self.reserve_slack(version) != 0" and "never negative" in equivalent["why"]
    assert report["survivors"] == [] and report["timeouts"] == []


def test_bench_mutation_lists_survivors_and_fails(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A judge that catches nothing (rows and unit tests): every mutant survives, each is printed, and the exit code is 1.
    --shard, --skip and --limit pick the sites."""
    from staleflow.__main__ import main

    monkeypatch.setattr(mutation, "judge_layers", lambda: {"restore": lambda cls: None})
    monkeypatch.setattr(mutation, "manager_tests", lambda source, limit_s: ("survived", "", ""))
    sites = mutation.mutation_sites(SOURCE, ["core/ReplaceUnaryOperator"])
    code = main(["bench", "mutation", "--operators", "core/ReplaceUnaryOperator", "--shard", "2/2", "--skip", "1",
                 "--limit", "2", "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 1
    picked = sites[1::2][1:3]
    assert out.startswith("2 mutants: 2 survived in ")
    assert [line.split(":")[0] for line in out.splitlines()[1:]] == [f"SURVIVED {op} #{k} line {line}" for op, k, line in picked]


def test_an_unmutated_file_that_fails_a_layer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mutation, "judge_layers", lambda: {"restore": lambda cls: "lost a group"})
    with pytest.raises(RuntimeError, match="the unmutated manager.py fails the restore layer: lost a group"):
        mutation.calibrate(SOURCE, 4.0, 2.0)


def test_the_results_file_records_repository_paths_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 37: a results file named the mutated module (and ``--out``) by absolute paths of the
    machine that ran it. It now records the module relative to the repository and any other
    absolute path of the command by its bare name."""
    import json
    import sys

    import staleflow
    from staleflow.__main__ import main

    monkeypatch.setattr(mutation, "judge_layers", lambda: {"restore": lambda cls: None})
    monkeypatch.setattr(mutation, "manager_tests", lambda source, limit_s: ("survived", "", ""))
    out = tmp_path / "results" / "run.json"
    out.parent.mkdir()
    argv = ["bench", "mutation", "--file", str(Path(manager_module.__file__).resolve()), "--operators", "core/ReplaceUnaryOperator",
            "--limit", "1", "--jobs", "1", f"--out={out}"]
    monkeypatch.setattr(sys, "argv", ["staleflow", *argv])
    assert main(argv) == 1  # the one mutant survives the judge that catches nothing
    text = out.read_text()
    report = json.loads(text)
    assert report["file"] == "protocol/manager.py"
    assert report["command"] == ("staleflow bench mutation --file protocol/manager.py --operators core/ReplaceUnaryOperator "
                                 "--limit 1 --jobs 1 --out=run.json")
    assert str(tmp_path) not in text and str(Path(staleflow.__file__).resolve().parent) not in text


def test_a_module_outside_the_repository_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main

    outside = tmp_path / "manager.py"
    outside.write_text(SOURCE, encoding="utf-8")
    assert main(["bench", "mutation", "--file", str(outside), "--limit", "1"]) == 2
    assert f"--file {outside}: not a module of this repository" in capsys.readouterr().err


def test_a_protocol_module_other_than_the_manager_is_judged_by_its_own_tests() -> None:
    """``bench mutation --file protocol/waiting.py``: a mutant replaces the module for every importer
    in a forked child, and the module's test files judge it (``bench/mutation_suite.py``)."""
    from staleflow.bench import mutation_suite

    root = Path(__file__).resolve().parents[1]
    source = (root / "protocol" / "waiting.py").read_text(encoding="utf-8")
    suite = {"module": "staleflow.protocol.waiting", "path": str(root / "protocol" / "waiting.py"),
             "tests": mutation_suite.SUITES["protocol/waiting.py"], "root": root}
    assert mutation_suite.judge_with_tests(source, "unmutated", **suite, limit_s=120) == ("survived", "", "")  # 3 s
    wrong = source.replace("if version + manager.eta < manager.version:", "if version + manager.eta <= manager.version:")
    outcome, layer, why = mutation_suite.judge_with_tests(wrong, "deadline", **suite, limit_s=120)
    assert (outcome, layer) == ("killed", "test_protocol_waiting.py") and why.startswith("tests/test_protocol_waiting.py::"), why
    docstring = '    """The predicate both waits test'
    hangs = source.replace(docstring, "    while True:\n        pass\n" + docstring, 1)
    assert mutation_suite.judge_with_tests(hangs, "hang", **suite, limit_s=3)[0] == "timeout"
    assert mutation_suite.judge_with_tests("import nothing_such_module\n", "broken", **suite, limit_s=120)[0] == "incompetent"


def test_a_manager_mutant_the_verify_rows_miss_is_killed_by_the_managers_unit_tests() -> None:
    """The rows of verify --quick never read the manager's queries (here ``stats()``'s tally of
    reserves); its unit tests, the last layer, do."""
    mutated = SOURCE.replace("self._tally.reserved += 1", "self._tally.reserved += 2")
    assert mutated != SOURCE
    outcome, layer, why = mutation.manager_tests(mutated, limit_s=300)
    assert (outcome, layer) == ("killed", "tests") and why.startswith("tests/"), why
    assert mutation.manager_tests(SOURCE, limit_s=300)[0] == "survived"


@pytest.mark.parametrize(("path", "equivalent"), [("protocol/manager.py", mutation.EQUIVALENT), *mutation_suite.EQUIVALENT.items()],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_equivalence_argued_names_a_mutant_of_the_current_text(path: str, equivalent: dict[tuple[str, int], tuple[str, str]]) -> None:
    """An argument recorded for a mutant whose line has since moved or changed would be dead (it
    applies only while the mutated line reads as recorded): each entry must still name its mutant."""
    source = (ROOT / path).read_text()
    stale = []
    for (operator, occurrence), (recorded, _) in equivalent.items():
        mutated = mutation.mutated_text(source, operator, occurrence)
        changed = [new.strip() for old, new in zip(source.splitlines(), (mutated or "").splitlines()) if old != new]
        if changed[:1] != [recorded]:
            stale.append((operator, occurrence, recorded, changed[:1]))
    assert stale == []
