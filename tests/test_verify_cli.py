"""``staleflow verify``: arguments, exit codes, the JSON document, trace validation of a file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from staleflow import cli as staleflow_cli
from staleflow.verification import cli
from staleflow.verification.checks import CheckResult
from staleflow.verification.proofs.trace_validation import record_workload_trace

KEYS = ["name", "property", "method", "bounds", "explored", "result", "seconds", "detail"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="staleflow verify")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def row(name: str, result: str) -> CheckResult:
    return CheckResult(name, "a property", "a method", "some bounds", "3 states", result, 0.5, f"{name} detail")


@pytest.fixture
def fake_layers(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[CheckResult]]:
    """Replace the layers by in-memory modules whose ``checks`` return the rows in the dict
    (a module may also print to stdout, as TLC's runner could)."""
    rows: dict[str, list[CheckResult]] = {"one": [row("a", "pass")], "two": [row("b", "pass")]}
    names = []
    for title in list(rows):
        module = types.ModuleType(f"fake_layer_{title}")

        def checks(quick: bool, title: str = title) -> list[CheckResult]:
            print(f"noise from {title}")  # must not reach stdout under --json
            if rows[title] is None:
                raise RuntimeError("layer exploded")
            return rows[title]

        module.checks = checks  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
        names.append((title, module.__name__))
    monkeypatch.setattr(cli, "LAYERS", tuple(names))
    return rows


def test_verify_is_registered_with_the_staleflow_cli() -> None:
    assert staleflow_cli.SUBCOMMANDS["verify"][0] is cli


@pytest.mark.parametrize(
    "argv", [["--quick", "--nightly"], ["--quick", "--trace", "t.jsonl"], ["--bogus"], ["--trace"], ["--jobs", "0"]]
)
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2


def test_missing_trace_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(parse("--trace", str(tmp_path / "missing.jsonl"))) == 2
    assert "no such file" in capsys.readouterr().err


def test_json_document_holds_every_row_and_nothing_else_on_stdout(
    fake_layers: dict[str, list[CheckResult]], capfd: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(parse("--quick", "--json")) == 0
    out, err = capfd.readouterr()
    document = json.loads(out)
    assert document["ok"] is True
    assert [c["name"] for c in document["checks"]] == ["a", "b"]
    assert all(list(c) == KEYS for c in document["checks"])
    assert "noise from one" in err and "noise" not in out


@pytest.mark.parametrize("jobs", ["1", "3"])
def test_rows_come_in_layer_order_in_process_and_in_workers(
    fake_layers: dict[str, list[CheckResult]], capfd: pytest.CaptureFixture[str], jobs: str
) -> None:
    fake_layers["one"] = [row("a1", "pass"), row("a2", "fail")]
    assert cli.run(parse("--json", "--jobs", jobs)) == 1
    out, err = capfd.readouterr()
    assert [c["name"] for c in json.loads(out)["checks"]] == ["a1", "a2", "b"]
    assert "verify: one done: 2 rows" in err and "noise from two" in err


def test_a_failing_row_exits_1_and_sets_ok_false(
    fake_layers: dict[str, list[CheckResult]], capfd: pytest.CaptureFixture[str]
) -> None:
    fake_layers["two"] = [row("b", "fail")]
    assert cli.run(parse("--json")) == 1
    assert json.loads(capfd.readouterr().out)["ok"] is False


def test_a_crashing_layer_is_a_failed_row(
    fake_layers: dict[str, list[CheckResult]], capfd: pytest.CaptureFixture[str]
) -> None:
    fake_layers["one"] = None  # type: ignore[assignment]
    assert cli.run(parse("--json")) == 1
    checks = json.loads(capfd.readouterr().out)["checks"]
    assert [(c["name"], c["result"]) for c in checks] == [("one", "fail"), ("b", "pass")]


def test_a_layer_with_no_rows_fails(fake_layers: dict[str, list[CheckResult]]) -> None:
    fake_layers["two"] = []
    assert cli.run(parse("--json")) == 1


def test_table_output_lists_rows_and_failure_details(
    fake_layers: dict[str, list[CheckResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_layers["two"] = [row("b", "fail")]
    assert cli.run(parse()) == 1
    out = capsys.readouterr().out
    assert "staleflow verify" in out and "FAIL b: b detail" in out and "2 checks, 1 failed" in out


def test_nightly_selects_the_nightly_hypothesis_profile(
    fake_layers: dict[str, list[CheckResult]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")  # restored after the test
    assert cli.run(parse("--nightly", "--json")) == 0
    assert os.environ["HYPOTHESIS_PROFILE"] == "nightly"


def run_verify(*argv: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import argparse, sys\n"
        "from staleflow.verification import cli\n"
        "p = argparse.ArgumentParser(); cli.add_arguments(p)\n"
        "sys.exit(cli.run(p.parse_args(sys.argv[1:])))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300, check=False
    )


def test_trace_file_is_validated_and_a_tampered_one_rejected(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    record_workload_trace(good, eta=1, batch_size=2, redundancy=1, ops=200, seed=3)
    done = run_verify("--trace", str(good), "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["ok"] is True and len(document["checks"]) == 1
    assert document["checks"][0]["explored"].startswith("200 events")

    lines = good.read_text().splitlines()
    first_accept = next(
        i for i, line in enumerate(lines) if '"op":"reserve"' in line and '"accepted":true' in line
    )
    lines[first_accept] = lines[first_accept].replace('"accepted":true', '"accepted":false')
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    rejected = run_verify("--trace", str(bad), "--json")
    assert rejected.returncode == 1
    check = json.loads(rejected.stdout)["checks"][0]
    assert check["result"] == "fail"
