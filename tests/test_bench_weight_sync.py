"""``staleflow bench weight-sync`` on the tiny model: both ways load every version, and a bf16
broadcast moves half the bytes of the fp32 file."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (cpu-infer extra) is not installed"),
]


def test_weight_sync_bench_reports_bytes_and_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main

    assert main(["bench", "weight-sync", "--models", "tiny", "--syncs", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert row["model"] == "tiny" and row["parameters"] == 377_984
    assert row["broadcast"]["bytes"] * 2 == row["file"]["bytes"] == row["parameters"] * 4
    assert all(len(row[way]["all_seconds"]) == 2 and row[way]["seconds"] > 0 for way in ("broadcast", "file"))
    assert report["command"].startswith("staleflow bench weight-sync")
