"""``scripts/speculation_table.py``: the speculation tables of docs/simulation.md from ``staleflow
simulate --speculation MODE --out`` results written here by hand, so each median, share, best
baseline and goal verdict is known in advance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "speculation_table.py"


def report(path: Path, seed: int, mode: str, speeds: dict[str, float], p99: dict[str, int]) -> str:
    """One results.json at eta 1 (upper bound 1,000 tokens/s): each system's steady tokens/s is its whole run's plus 100."""
    systems: dict[str, Any] = {name: {"tokens_per_s": speed, "steady_tokens_per_s": speed + 100, "staleness_p99": p99.get(name, 1)}
                               for name, speed in speeds.items()}
    data = {"workload": "w", "steps": 12, "seed": seed, "speculation": mode, "upper_bound_tokens_per_s": 1000.0,
            "by_eta": {"1": {"systems": systems, "staleflow_of_latency_bound": {"steady_tokens_per_s": 0.5 + seed / 10}}}}
    path.write_text(json.dumps(data))
    return str(path)


def test_the_table_gives_medians_shares_the_best_bound_keeping_baseline_and_the_goal(tmp_path: Path) -> None:
    paths = [
        # off: StaleFlow 700 (steady 800) over roll-flash 600 (700); areal trains past eta, though faster
        report(tmp_path / "a.json", 0, "off", {"staleflow": 700, "roll-flash": 600, "areal": 900}, {"areal": 2}),
        report(tmp_path / "b.json", 0, "siblings", {"staleflow": 800, "roll-flash": 600}, {}),
        report(tmp_path / "c.json", 1, "siblings", {"staleflow": 1000, "roll-flash": 700}, {}),
    ]
    out = subprocess.run([sys.executable, str(SCRIPT), *paths], capture_output=True, text=True, check=True).stdout.splitlines()
    off, siblings = out[2], out[3]
    assert off == "| w | 12 | 1 | off | 0 | 700 / 800 | 0.70 / 0.80 | 0.50 | roll-flash | 1.17x / 1.14x | - |"
    # two seeds: medians with ranges; steady shares 0.9 and 1.1, ratios 900/700 and 1100/800
    assert siblings == ("| w | 12 | 1 | siblings | 0, 1 | 900 [800, 1,000] / 1,000 [900, 1,100] | 0.90 [0.80, 1.00] / 1.00 [0.90, 1.10] "
                        "| 0.55 [0.50, 0.60] | roll-flash | 1.38 [1.33, 1.43]x / 1.33 [1.29, 1.38]x | met |")
