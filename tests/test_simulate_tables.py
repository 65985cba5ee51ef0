"""``scripts/simulate_tables.py``: the tables of docs/simulation.md from ``staleflow simulate --out``
results. Reports are written here by hand (the figures the script reads, nothing else) so each
median, ratio and grouping is known in advance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "simulate_tables.py"
PAPER = ("verl-sync", "one-step-off", "verl-async", "areal", "roll-flash")
BASELINES = (*PAPER, "areal-filter", "areal-tight", "roll-flash-2026")


def figures(tokens_per_s: float, eta: int, *, past: float = 0.0, steady: float = 1.0) -> dict[str, Any]:
    """A system's figures; its steady-state tokens/s is ``steady`` times the whole run's."""
    return {"tokens_per_s": tokens_per_s, "steady_tokens_per_s": steady * tokens_per_s, "steady_step_time_s": 90.0,
            "generated_tokens_per_s": 950.0, "staleness_p99": eta + (1 if past else 0), "max_staleness": eta + (1 if past else 0),
            "past_eta_share": past, "admission_eta": max(0, eta - 1), "wasted_tokens": 0, "step_time_s": 100.0,
            "trainer_busy": 0.5, "proactive_aborted": 0, "mean_trained_length": 1000.0, "lost": 0, "duplicated": 0,
            "keeps_bound": not past, "eta": eta}


def report(path: Path, seed: int, systems: dict[str, float], *, tick: float | None = 2.0, etas: tuple[int, ...] = (1, 2)) -> str:
    """One ``results.json``: every system at ``tokens_per_s`` (verl-async trains past eta; StaleFlow's
    steady state is twice its whole run, the others' equal to it)."""
    data: dict[str, Any] = {
        "workload": "w", "steps": 30, "seed": seed, "upper_bound_tokens_per_s": 1000.0,
        "upper_bound": {"rollout_tokens_per_s": 1000.0}, "by_eta": {
            str(eta): {"systems": {name: figures(speed, eta, past=0.2 if name == "verl-async" else 0.0,
                                                 steady=2.0 if name == "staleflow" else 1.0) for name, speed in systems.items()}}
            for eta in etas}}
    if tick is not None:  # results written before the tick was recorded have neither field
        data |= {"tick_s": tick, "workload_tick_s": 2.0}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return str(path)


def tables(*paths: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def row(text: str, start: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(start))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_grids_merge_by_seed_variants_are_measured_against_the_best_baseline_and_ticks_stay_apart(tmp_path: Path) -> None:
    grid = {"staleflow": 600.0, **{b: 500.0 for b in BASELINES}, "roll-flash": 400.0, "verl-async": 900.0}
    paths = [
        report(tmp_path / "s0/results.json", 0, grid, tick=None),  # written before the tick was recorded: the default
        report(tmp_path / "s1/results.json", 1, {**grid, "staleflow": 550.0}),
        report(tmp_path / "s0-authors/results.json", 0, {"staleflow-authors": 700.0}),
        report(tmp_path / "s1-authors/results.json", 1, {"staleflow-authors": 450.0}),
        report(tmp_path / "s0-ablation/results.json", 0, {"staleflow-no-migration": 300.0}, etas=(2,)),
        report(tmp_path / "s0-tick4/results.json", 0, {"staleflow": 60.0, "roll-flash": 40.0}, tick=4.0),
    ]
    out = tables(*paths)

    paper_part, keeping_part = out.split("### Summary: the bound-keeping basis")
    summary = row(paper_part, "| w |")
    assert summary[1] == "2/2"  # both seeds ran StaleFlow and every baseline
    # the paper's basis. StaleFlow over roll-flash: 600/400 = 1.5 and 550/400 = 1.375 (the tick-4 run,
    # 60/40, is not in the grid); in steady state StaleFlow is twice as fast
    assert summary[2 + PAPER.index("roll-flash")] == "1.44x [1.38, 1.50] (steady 2.88x [2.75, 3.00])"
    # verl-async trains 20% past eta, its largest lag 3 (eta 2 + 1); it is the best system the paper ran (900)
    assert summary[2 + PAPER.index("verl-async")].endswith("up to 20.0% past eta, max lag 3)")
    assert summary[2 + len(PAPER)] == "0.64x [0.61, 0.67] (steady 1.28x [1.22, 1.33])"
    # the bound-keeping basis: the best is 500 (verl-async, faster, trains past eta); the authors' variant over it: 1.4, 0.9
    keeping = row(keeping_part, "| w |")
    assert keeping[1:4] == ["1.15x [1.10, 1.20]", "2.30x [2.20, 2.40]", "1.15x [0.90, 1.40]"]
    assert keeping[-1] == "1: rollout; 2: rollout"  # the trainer half busy, the fleet at 95% of the rollout bound

    eta1 = row(out, "| 1 |")
    assert eta1[1] == "575 [550, 600] (57% [55%, 60%] of bound)"
    assert eta1[2] == "575 [450, 700] (0.99x [0.82, 1.17] of staleflow; 1.15x [0.90, 1.40] best)"

    ablation = [line for line in out.splitlines() if line.startswith("| 2 | staleflow")]
    assert [row(line, "|")[1] for line in ablation] == ["staleflow", "staleflow-no-migration"]  # not the authors' variant
    assert "-50.0%" in ablation[1]  # 300 against seed 0's 600

    tick = row(out, "| w | 1 | roll-flash |")
    assert tick[3] == "default: 400 (1.50x); 4 s: 40 (1.50x)" and tick[4] == "4 s: -90.0%"


def test_a_seed_with_another_step_count_is_refused_naming_the_file(tmp_path: Path) -> None:
    first = report(tmp_path / "a/results.json", 0, {"staleflow": 1.0, **{b: 1.0 for b in BASELINES}})
    second = tmp_path / "b/results.json"
    report(second, 0, {"staleflow-authors": 1.0})
    second.write_text(second.read_text().replace('"steps": 30', '"steps": 10'))
    done = subprocess.run([sys.executable, str(SCRIPT), first, str(second)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"{second}: 10 steps, other runs of this seed have 30" in done.stderr
