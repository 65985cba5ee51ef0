"""`staleflow train` end to end on real vLLM-CPU instances (Ray actors) and the torch trainer.

A few steps of a shrunken built-in job. Asserts the staleness bound on every consumed group (from the protocol
trace), the learning signal (losses finite, the weights move every step from the first non-zero gradient on, versions advance one per
step), no lost or duplicated trajectory, the run directory's files (metrics, trace, checkpoints,
report), and that the newest complete checkpoint is found. The same run resumed from its step-2
checkpoint (the path `staleflow train --resume` takes, in this process, on one instance): the
instance serves the checkpoint's weights, and the prompts drawn after the resume continue the stream.
The resume of a driver killed mid-run is `tests/test_driver_kill.py` (nightly).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from skips import needs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.ray,
    needs("vllm", "cpu-infer"),
]

SMALL_JOB = [
    "train.steps=4",
    "protocol.batch_groups=4",
    "rollout.group_size=4",
    "warmup.steps=10",
    "warmup.batch_size=32",
    "task.eval_prompts=8",
    "checkpoint.every=2",
    "metrics.progress=false",
]


def _consumed(trace: Path, segment: int) -> list[tuple[int, list[int]]]:
    """(buffer, group versions) of every batch consumed in one segment of a protocol trace."""
    from staleflow.protocol.trace import read_trace

    events = read_trace(trace)[segment].events
    return [(e.batch.version, list(e.batch.group_versions)) for e in events if e.op == "consume" and e.batch is not None]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    from staleflow.app.training_job import train
    from staleflow.runtime.settings.config import load_config

    run_dir = tmp_path_factory.mktemp("train") / "run"
    run_dir.mkdir()
    config = load_config(overrides=SMALL_JOB)
    summary = train(config, run_dir)
    return run_dir, summary


def test_training_run_keeps_the_bound_and_learns(first_run: tuple[Path, dict]) -> None:
    from safetensors.torch import load_file
    from staleflow.app.checkpoints import latest_checkpoint

    run_dir, summary = first_run
    eta = summary["eta"]
    assert summary["steps"] == 4 and eta == 2
    assert (summary["audit_ok"], summary["lost"], summary["duplicated"], summary["orphaned"]) == (True, 0, 0, 0), summary["audit_problems"]
    assert summary["bound_ok"] and summary["max_staleness"] <= eta, summary["staleness_histogram"]
    consumed = _consumed(run_dir / "trace.jsonl", 0)
    assert [b for b, _ in consumed] == [0, 1, 2, 3]  # one version per step
    for buffer, versions in consumed:
        assert len(versions) == 4
        assert all(v <= buffer <= v + eta for v in versions)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["loss"] is not None and r["tokens"] > 0 for r in steps)
    # The weights move at every step once any gradient was non-zero (AdamW's moments then carry on; no
    # weight decay, no KL or entropy term). A step moves nothing only while every gradient so far was
    # exactly zero: batches whose groups each had equal rewards (zero advantages, no learning signal).
    signal = False
    for r in steps:
        signal = signal or r["grad_norm"] > 0
        assert (r["update_norm"] > 0) == signal, [(r["step"], r["reward_mean"], r["grad_norm"], r["update_norm"]) for r in steps]
    assert signal, "no batch of the run carried a learning signal"
    # Trainer weights at the checkpoint (version 2) differ from version 0 everywhere.
    v0 = load_file(str(run_dir / "model-v0" / "model.safetensors"))
    v2 = load_file(str(run_dir / "checkpoints" / "step-000002" / "trainer" / "model.safetensors"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step-000004"  # the final one
    assert set(v0) == set(v2) and all(not (v0[k] == v2[k]).all() for k in v0)
    assert summary["instances"]["weight_syncs"] >= 2 * 3  # both instances pulled new versions
    for name in ("report.md", "reward.png", "throughput.png", "staleness.png", "instances.png", "instances.jsonl", "config.yaml"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "tensorboard").is_dir()
    # every notice of the engine actors is in their log files: vLLM's start-up, the rotary embedding's
    # harmless skip at each reload; no deprecated raw prompt any more
    engine_logs = {name: (run_dir / "logs" / f"{name}.log").read_text() for name in ("rollout-0", "rollout-1")}
    for log in engine_logs.values():
        assert "Initializing a V1 LLM engine" in log and "RotaryEmbedding: Failed to load weights" in log
        assert "Passing raw prompts" not in log


def test_a_resumed_run_serves_the_checkpoints_weights_and_draws_the_prompts_that_follow(
        first_run: tuple[Path, dict], tmp_path: Path) -> None:
    """``TrainingJob`` resumed from the first run's step-2 checkpoint (``staleflow train --resume``'s
    path, given the checkpoint) on one rollout instance, to step 4. Before any step, the instance
    reports the checkpoint's version and its weights' checksums are those of the checkpoint's
    trainer weights (not the base model it started on). The groups the resumed run draws from its
    prompt stream are ``g{D}``, ``g{D+1}``, ... with ``D`` the prompts drawn at the checkpoint, the
    first of them the stream's prompt ``D`` (none skipped), and no group trained before the
    checkpoint is reserved again (none repeated)."""
    import itertools
    import shutil

    from safetensors.torch import load_file
    from staleflow.adapters.rlkit.weight_checksum import mismatches
    from staleflow.app.training_job import TrainingJob
    from staleflow.protocol.trace import read_trace
    from staleflow.runtime.settings.config import load_config

    run_dir = tmp_path / "run"
    shutil.copytree(first_run[0], run_dir)
    checkpoint = run_dir / "checkpoints" / "step-000002"
    state = json.loads((checkpoint / "loop_state.json").read_text())
    drawn = int(state["prompts_drawn"])
    overrides = ["train.steps=4", "rollout.instances=1", "task.eval_prompts=0", "task.eval_every=0", "checkpoint.every=0",
                 "metrics.report=false", "metrics.tensorboard=false"]
    config = load_config(run_dir / "config.yaml", overrides)

    drawn_groups: list = []

    class ResumedJob(TrainingJob):
        """The job as ``--resume`` runs it, keeping its engines and the groups its stream yields."""

        def _start_engines(self, *args: object) -> list:
            self.engines = super()._start_engines(*args)
            return self.engines

        def _groups(self):  # type: ignore[no-untyped-def]
            for group in super()._groups():
                drawn_groups.append(group)
                yield group

    with ResumedJob(config, run_dir, checkpoint) as job:
        job.build()
        trained = load_file(str(checkpoint / "trainer" / "model.safetensors"))
        [engine] = job.engines
        assert engine.snapshot().version == 2
        assert mismatches(trained, engine._engine.weight_checksums(1), seed=1) == []  # the instance serves version 2
        summary = job.run()
        stream_prompt = next(itertools.islice(job.data.stream(config.seed + 1), drawn, None))
    assert (summary["steps"], summary["audit_ok"], summary["lost"], summary["duplicated"]) == (4, True, 0, 0), summary
    assert summary["bound_ok"]
    assert drawn_groups and drawn_groups[0].metadata["prompt"] == stream_prompt.text  # the stream's prompt D
    assert [g.group_id for g in drawn_groups] == [f"g{n}" for n in range(drawn, drawn + len(drawn_groups))]
    first, resumed = read_trace(run_dir / "trace.jsonl")[:2]
    trained_before = {g for e in first.events if e.op == "consume" and e.batch.version < 2 for g in e.batch.group_ids}
    assert not trained_before & {e.group_id for e in resumed.events if e.op == "reserve" and e.accepted}


def test_report_rewrites_a_runs_report_and_compares_runs(first_run: tuple[Path, dict], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from staleflow.__main__ import main
    from staleflow.app.metrics import read_metrics

    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        shutil.copytree(first_run[0], run)
    for name in ("report.md", "reward.png", "throughput.png", "staleness.png", "instances.png"):
        (runs[0] / name).unlink()
    assert main(["report", str(runs[0])]) == 0
    report = (runs[0] / "report.md").read_text()
    assert report.startswith("# Training run: staleflow (eta 2)") and "| steps | 4 |" in report
    assert "| audit (lost, duplicated) | 0, 0: ok |" in report
    assert all((runs[0] / name).stat().st_size > 0 for name in ("reward.png", "throughput.png", "staleness.png", "instances.png"))
    capsys.readouterr()
    assert main(["report", str(runs[0]), "--compare", str(runs[1]), "--out", str(tmp_path / "compare")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| staleflow | 2 | 4 |")]
    assert len(rows) == 2 and "| 1.00x |" in rows[0]
    assert (tmp_path / "compare" / "compare.png").stat().st_size > 0
    records = read_metrics(runs[0])
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 4]
    [last] = [r for r in records if r["kind"] == "step" and r["step"] == 4]
    assert f"| 4 | {last['elapsed_s']:.0f} |" in report  # the last evaluation at the run time its step ended
    assert main(["report", str(tmp_path / "not-a-run")]) == 2
    assert "has no summary.json" in capsys.readouterr().err


def _ancestors(pid: int) -> set[int]:
    """The parent, grandparent, ... of a process (from /proc)."""
    found: set[int] = set()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        found.add(pid)
    return found


def _steps_logged(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.startswith('{"kind": "step"'))


def test_killing_a_vllm_instance_mid_run_loses_nothing_and_keeps_the_bound(tmp_path: Path) -> None:
    """Kill one rollout instance's Ray actor process (SIGKILL) during `staleflow train`: the run
    finishes on the other instance with exit code 0 (clean audit, bound kept) and a trace the spec
    accepts."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from staleflow.verification.proofs.trace_validation import validate_trace

    run_dir = tmp_path / "run"
    steps = 10  # the kill lands after step 4: six steps on one instance
    overrides = [o for o in SMALL_JOB if not o.startswith(("train.steps", "checkpoint.every"))]
    job = subprocess.Popen(
        [sys.executable, "-m", "staleflow", "train", f"train.steps={steps}", "checkpoint.every=0",
         *overrides, "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 400
        while _steps_logged(run_dir / "metrics.jsonl") < 4:
            assert job.poll() is None, f"train ended before the kill: {job.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "train did not reach step 4 in time"
            time.sleep(0.5)
        # this job's own actors only: other Ray jobs may run on the machine
        hosts = [p for p in subprocess.run(["pgrep", "-f", "^ray::_Host"], capture_output=True, text=True).stdout.split()
                 if job.pid in _ancestors(int(p))]
        assert len(hosts) == 2, f"expected two rollout actor processes of this job, found {hosts}"
        os.kill(int(hosts[0]), signal.SIGKILL)
        output, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    assert "audit: lost 0, duplicated 0, orphaned 0, ok True" in output
    assert _steps_logged(run_dir / "metrics.jsonl") == steps
    consumed = _consumed(run_dir / "trace.jsonl", 0)
    assert [b for b, _ in consumed] == list(range(steps))
    eta = json.loads((run_dir / "summary.json").read_text())["eta"]
    assert all(v <= b <= v + eta for b, versions in consumed for v in versions)
    result = validate_trace(run_dir / "trace.jsonl", use_tlc=False)
    assert result.ok, result.detail


def test_the_arithmetic_job_evaluates_held_out_rows_through_a_rollout_engine(tmp_path: Path) -> None:
    """The second built-in job, shrunk: verl-format chat rows, the gsm8k reward in scorer processes,
    held-out evaluation through its own vLLM engine (eval numbers in the metrics, summary and report)."""
    from staleflow.app.job_preparation import data_paths_near
    from staleflow.app.training_job import train
    from staleflow.runtime.settings.config import load_config

    config_file = Path(__file__).resolve().parents[1] / "runtime" / "settings" / "configs" / "arithmetic.yaml"
    overrides = [
        "train.steps=3",
        "train.max_time_s=0.001",  # the time limit stops the run after its first step
        "train.minibatches=2",
        "protocol.batch_groups=2",
        "rollout.group_size=2",
        "rollout.instances=1",
        "warmup.steps=2",
        "warmup.batch_size=8",
        "task.eval_prompts=6",
        "task.eval_every=1",
        "checkpoint.every=0",
        "metrics.progress=false",
        "metrics.tensorboard=false",
    ]
    config = data_paths_near(load_config(config_file, overrides), config_file.parent)
    summary = train(config, tmp_path / "run")
    assert summary["audit_ok"] and summary["bound_ok"] and summary["steps"] == 1
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    # Step 1 is an evaluation step and the last one (time limit): evaluated once, after the loop, of version 1
    # (on the rollout instance, mid-run, it would have been of the version that instance held: 0).
    assert [e["step"] for e in evals] == [0, 1] and [e["eval_version"] for e in evals] == [0, 1]
    assert [r for r in records if r["kind"] == "time_limit"] == [{"kind": "time_limit", "step": 1, "max_time_s": 0.001}]
    for record in evals:
        assert 0.0 <= record["eval_pass@1"] <= 1.0 and 0.0 <= record["eval_reward"] <= 1.0
        assert record["eval_reward_failures"] == 0 and record["eval_response_tokens"] > 0
    steps = [r for r in records if r["kind"] == "step"]
    assert all(r["reward_failures"] == 0 for r in steps)  # every group scored by the gsm8k scorer processes
    assert summary["eval_label"]["exact"] == "eval pass@1 (sampled)"
    report = (tmp_path / "run" / "report.md").read_text()
    assert "held-out arithmetic-eval.jsonl" in report and "## Evaluation" in report
    # the evaluation ran on the rollout instance (task.eval_engine=rollout): its log is the only engine log
    assert "Initializing a V1 LLM engine" in (tmp_path / "run" / "logs" / "rollout-0.log").read_text()
    assert not (tmp_path / "run" / "logs" / "eval.log").exists()
    assert not (tmp_path / "run" / "model-v0").exists() or (tmp_path / "run" / "model-v0" / "model.safetensors").is_file()
