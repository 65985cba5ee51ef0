#!/usr/bin/env bash
# GPU smoke check (issue 9, item 8) for a machine with one CUDA GPU and no network; under 8 minutes.
#   scripts/gpu-smoke.sh          1. the trainer part: a ~100M Qwen2-shaped model built locally, 30 FSDP
#                                    steps on synthetic GRPO batches, checkpoint, bf16 export reloaded by
#                                    transformers; prints GPU-SMOKE-TRAINER {json}
#                                 2. the whole run: `staleflow train` on that model for 30 steps, two vLLM
#                                    instances (bf16) and the FSDP trainer sharing GPU 0, Ray-placed
#                                    servers, weights by broadcast; checks the audit and the bound and
#                                    prints GPU-SMOKE-RUN {json} (tokens/s, seconds per weight sync)
#   scripts/gpu-smoke.sh --plan   on any machine: the whole run's resolved config and placement plan
#   scripts/gpu-smoke.sh --trainer-only --device cpu --size tiny --world-size 2 --steps 3   part 1 on a CPU
#   scripts/gpu-smoke.sh --trainer-only --backend megatron [--world-size 2 --tensor-parallel 2]   part 1 on Megatron (GPUs)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out="${STALEFLOW_SMOKE_DIR:-$(mktemp -d /tmp/staleflow-gpu-smoke.XXXXXX)}"
model="$out/model-100m"
run=(
  train --run-dir "$out/run" model.path="$model" train.steps=30
  train.backend=fsdp train.world_size=1 train.gpus=0.5
  rollout.instances=2 rollout.gpus_per_instance=1 rollout.instances_per_gpu=4 rollout.gpu_memory_utilization=0.2
  servers.placement=ray servers.weight_transfer=broadcast cluster.num_cpus=null
  task.eval_prompts=0 task.eval_every=0 checkpoint.every=0 metrics.progress=false
)
case "${1:-}" in
  --plan) exec "$PYTHON" -m staleflow "${run[@]}" --dry-run ;;
  --trainer-only) shift; exec "$PYTHON" scripts/gpu_smoke_trainer.py "$@" ;;
esac
"$PYTHON" scripts/gpu_smoke_trainer.py "$@"
"$PYTHON" -c "
import sys
from staleflow.bench.weight_sync import MODELS
from staleflow.app.tiny_model import TinyModelSpec, ensure_tiny_model
ensure_tiny_model(sys.argv[1], TinyModelSpec(**MODELS['100m']))" "$model"
"$PYTHON" -m staleflow "${run[@]}"
"$PYTHON" -c "
import json, sys
s = json.load(open(sys.argv[1]))
i = s['instances']
print('GPU-SMOKE-RUN', json.dumps({'steps': s['steps'], 'audit_ok': s['audit_ok'], 'bound_ok': s['bound_ok'],
      'tokens_per_s': s['tokens_per_s'], 'weight_syncs': i['weight_syncs'],
      'seconds_per_sync': i['sync_seconds'] / max(i['weight_syncs'], 1), 'staleness': s['staleness_histogram']}))
sys.exit(0 if s['audit_ok'] and s['bound_ok'] and s['steps'] == 30 else 1)" "$out/run/summary.json"
