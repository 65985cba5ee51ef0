"""`staleflow train` (FSDP ranks and servers as Ray actors) killed with SIGKILL mid-run, then
`staleflow train --resume`: nothing lost, the bound kept, the new instances started at the
checkpoint's version, throughput counted for the resumed run alone, and the protocol trace (whose
last line the kill may tear) accepted by `verify --trace`.

The victim is the job's own driver process (the subprocess this test started); the processes it
had started (Ray's, the engines', the reward scorers') are found among its descendants before the
kill and killed after it, as an operator's cleanup would. A SIGKILL between two writes leaves whole
lines, so the torn line a kill inside a write leaves is added by hand before the resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from skips import needs
from test_train_e2e import SMALL_JOB, _ancestors, _consumed, _steps_logged

pytestmark = [
    pytest.mark.nightly,  # 2.5-4 minutes of CI's 15 (two whole jobs: the killed one and its resume)
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.java,  # verify --trace replays the trace in TLC too
    needs("vllm", "cpu-infer"),
]

STEPS = 4  # killed after step 3 (a checkpoint at step 2), then steps 3 and 4 resumed
#: The job runs as on a cluster: FSDP ranks and both servers as Ray actors, so the weights go from
#: rank 0 through Ray's object store to the instances, each rank writes its shards of the checkpoints
#: and reads them back for the resume.
GPU_PATH = ["train.backend=fsdp", "train.world_size=2", "servers.placement=ray"]
#: One rollout instance and no evaluation: what is under test is the driver's death and the resume
#: (two instances and the evaluation are the other end-to-end tests'), at half the suite time.
LEAN = ["rollout.instances=1", "task.eval_prompts=0", "task.eval_every=0"]


def _descendants(pid: int) -> list[int]:
    """Every live process whose ancestors include ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != pid and pid in _ancestors(int(entry.name)):
            found.append(int(entry.name))
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_driver_killed_mid_run_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    from staleflow.__main__ import main
    from staleflow.protocol.trace import read_trace

    run_dir = tmp_path / "run"
    overrides = [o for o in SMALL_JOB if not o.startswith(("train.steps", "checkpoint.every"))]
    command = [sys.executable, "-m", "staleflow", "train", f"train.steps={STEPS}", "checkpoint.every=2", *GPU_PATH, *overrides, *LEAN]
    job = subprocess.Popen([*command, "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 1200  # a hang guard only: a loaded 2-core machine took 571 s
        # past the first checkpoint (step 2) and into the steps after it
        while not ((run_dir / "checkpoints" / "step-000002").is_dir() and _steps_logged(run_dir / "metrics.jsonl") >= 3):
            assert job.poll() is None, f"train ended before the kill: {job.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "train did not reach step 3 in time"
            time.sleep(0.2)
        children = _descendants(job.pid)
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
        _kill_all(children + _descendants(job.pid))
    assert job.returncode == -signal.SIGKILL
    killed_at = _steps_logged(run_dir / "metrics.jsonl")
    assert 3 <= killed_at < STEPS and not (run_dir / "summary.json").exists()
    trace = run_dir / "trace.jsonl"
    last = trace.read_text().splitlines()[-1]
    with open(trace, "a", encoding="utf-8") as stream:
        stream.write(last[: len(last) // 2])  # the kill landed inside the write of an event
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    resumed_from = int(checkpoints[-1].split("-")[1])
    state = json.loads((run_dir / "checkpoints" / checkpoints[-1] / "loop_state.json").read_text())
    import torch

    trainer_state = torch.load(run_dir / "checkpoints" / checkpoints[-1] / "trainer" / "trainer_state.pt", weights_only=False)
    assert (trainer_state["format"], trainer_state["version"]) == ("staleflow-fsdp/2", resumed_from)
    shards = run_dir / "checkpoints" / checkpoints[-1] / "trainer" / "shards"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # each rank its own
    assert state["parameter_server"]["latest_version"] == state["steps_done"] == resumed_from

    timeline = run_dir / "instances.jsonl"
    before_resume = len(timeline.read_text().splitlines())
    resumed = subprocess.run([sys.executable, "-m", "staleflow", "train", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=1200)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["audit_ok"], summary["lost"], summary["duplicated"]) == (STEPS, True, 0, 0), summary
    assert summary["bound_ok"] and summary["max_staleness"] <= summary["eta"]
    # The new instance started at the checkpoint's version, and throughput counts the resumed run's tokens only.
    first_seen = json.loads(timeline.read_text().splitlines()[before_resume])
    assert (first_seen["instance"], first_seen["version"]) == ("rollout-0", resumed_from), first_seen
    assert summary["tokens_per_s"] * summary["elapsed_s"] == pytest.approx(summary["tokens_trained"] - state["tokens"][1])
    segments = read_trace(trace)
    assert len(segments) == 2  # the killed run's (its torn last line ignored) and the resumed run's
    consumed = _consumed(trace, 1)
    assert [b for b, _ in consumed] == list(range(resumed_from, STEPS))  # every step after the checkpoint, once
    assert all(v <= b <= v + summary["eta"] for b, versions in consumed for v in versions)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "resumed" and r["step"] == resumed_from for r in records)
    assert [r["step"] for r in records if r["kind"] == "step"][-(STEPS - resumed_from):] == list(range(resumed_from + 1, STEPS + 1))
    assert main(["verify", "--trace", str(trace), "--json"]) == 0
