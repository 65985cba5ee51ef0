#!/usr/bin/env bash
# GPU smoke check (issue 9, item 8) for a machine with one CUDA GPU and no network; under 8 minutes.
#   scripts/gpu-smoke.sh                 the trainer part: a ~100M Qwen2-shaped model built locally,
#                                        30 FSDP steps on synthetic GRPO batches, checkpoint, bf16
#                                        export reloaded by transformers; prints GPU-SMOKE-TRAINER {json}
#   scripts/gpu-smoke.sh --device cpu --size tiny --world-size 2 --steps 3   the same on a CPU (self-check)
# The rollout part (2 vLLM instances sharing the GPU, the run loop, audit and bound) is added with
# the GPU placement and weight-sync work; until then this checks the trainer side only.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PYTHON" scripts/gpu_smoke_trainer.py "$@"
