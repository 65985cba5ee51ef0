"""The real ``staleflow verify --quick --json`` (the CI subset of every layer), not stand-in layers:
exit 0, ``ok`` true, and the rows each layer owes: the Z3 obligations, TLC's safety and liveness,
graph equivalence, conformance, trace validation, the spec-mutant and implementation-mutant rows
(with their baselines), each passed, with the columns a reader and a machine rely on."""

from __future__ import annotations

import json

import pytest
from staleflow.verification.proofs import impl_mutants, spec_mutants

pytestmark = [pytest.mark.slow, pytest.mark.java, pytest.mark.timeout(900)]

KEYS = ["name", "property", "method", "bounds", "explored", "result", "seconds", "detail"]
#: a row of each kind: (what, the pattern its row names match whole). A prefix would not do: the
#: Hypothesis row "conformance" is a prefix of "conformance-exhaustive" and could vanish unnoticed.
ROW_KINDS = [
    ("Z3 obligations on the counter state", r"z3 .+"),
    ("TLC safety", r"tlc-safety"),
    ("TLC liveness", r"tlc-liveness"),
    ("graph equivalence", r"graph-equivalence-.+"),
    ("exhaustive conformance", r"conformance-exhaustive"),
    ("Hypothesis conformance", r"conformance"),
    ("trace validation", r"trace-validation(-eta\d+-B\d+-X\d+)?"),
    ("spec-mutant baseline", r"spec-mutant-baseline"),
    ("implementation-mutant baseline", r"mutant baseline"),
]


@pytest.fixture(scope="module")
def document() -> tuple[int, dict]:
    """The command as a user runs it, in a process of its own: verify forks its layer workers, and a
    fork of the test process (with the threads earlier tests left behind) is not what a user runs."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "staleflow", "verify", "--quick", "--json"],
                         capture_output=True, text=True, timeout=850, check=False)
    assert run.stdout.strip(), f"verify printed no JSON; stderr:\n{run.stderr[-3000:]}"
    return run.returncode, json.loads(run.stdout)


def test_verify_quick_passes_every_row(document: tuple[int, dict]) -> None:
    code, doc = document
    failed = [(c["name"], c["result"], c["detail"][:2000]) for c in doc["checks"] if c["result"] != "pass"]
    assert (code, doc["ok"], failed) == (0, True, [])
    for check in doc["checks"]:
        assert list(check) == KEYS, check["name"]
        assert check["seconds"] >= 0 and check["explored"] and check["method"] and check["bounds"], check["name"]
    names = [c["name"] for c in doc["checks"]]
    assert len(names) == len(set(names)), "row names are unique"


@pytest.mark.parametrize(("what", "pattern"), ROW_KINDS, ids=[w for w, _ in ROW_KINDS])
def test_verify_quick_has_the_rows_of_each_layer(document: tuple[int, dict], what: str, pattern: str) -> None:
    import re

    _, doc = document
    assert any(re.fullmatch(pattern, c["name"]) for c in doc["checks"]), f"no {what} row (a name matching {pattern!r})"


def test_verify_quick_runs_every_implementation_mutant_and_the_quick_spec_mutants(document: tuple[int, dict]) -> None:
    _, doc = document
    rows = {c["name"]: c for c in doc["checks"]}
    for mutant in impl_mutants.MUTANTS:
        row = rows[f"mutant {mutant.name}"]
        assert row["explored"].startswith("caught by "), row
    for name in spec_mutants.QUICK_MUTANTS:
        assert rows[f"spec-mutant-{name}"]["detail"].startswith("caught by "), rows[f"spec-mutant-{name}"]
