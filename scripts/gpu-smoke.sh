#!/usr/bin/env bash
# GPU smoke check (issue 9, item 8) for a machine with one CUDA GPU and no network; under 8 minutes.
#   scripts/gpu-smoke.sh          1. the trainer part: a ~100M Qwen2-shaped model built locally, 30 FSDP
#                                    steps on synthetic GRPO batches, checkpoint, bf16 export reloaded by
#                                    transformers; prints GPU-SMOKE-TRAINER {json}
#                                 2. the whole run: `staleflow train` on that model for 30 steps, two vLLM
#                                    instances (bf16) and the FSDP trainer sharing GPU 0, Ray-placed
#                                    servers, weights by reference pulls (a broadcast over NCCL cannot
#                                    join a sender and its receivers on one GPU); checks the audit and the bound and
#                                    prints GPU-SMOKE-RUN {json} (tokens/s, seconds per weight sync)
#   scripts/gpu-smoke.sh --plan   on any machine: the whole run's resolved config and placement plan
#   scripts/gpu-smoke.sh --trainer-only   the trainer check for one GPU without vLLM or Ray (under 6 minutes):
#                                 a preflight (Python >= 3.11, torch and CUDA, an NVIDIA driver new enough for the
#                                 CUDA runtime torch was built for: R580+ for CUDA 13, else a newer driver or
#                                 cuda-compat; transformers >= 5, setuptools, megatron-core for this Python) that
#                                 prints the driver and the CUDA runtime and stops in seconds naming what is missing;
#                                 then bf16 FSDP world size 1, the plain torch backend, Megatron world size 1,
#                                 SMOKE_STEPS (12) steps each, each backend and its ranks ended at its time
#                                 limit (SMOKE_BACKEND_LIMIT_S 110, all SMOKE_TOTAL_S 330); one GPU-SMOKE-TRAINER
#                                 {json} line per backend (tokens/s, MFU on this GPU's peak, peak GPU memory,
#                                 checkpoint -> bf16 export -> transformers; Megatron: the weights its ranks
#                                 published = the checkpoint's, converted); the verdict read from those lines:
#                                 a `gpu-smoke verdict:` line per backend, GPU-SMOKE-VERDICT {json}; exit 0 ok,
#                                 1 a backend failed, 2 the preflight refused
#   scripts/gpu-smoke.sh --trainer-only --dry-run   the same three import paths only (any machine), each with the
#                                 attention kernel its model runs on the GPU
#   scripts/gpu-smoke.sh --trainer-only --device cpu --size tiny --steps 2   the three on a CPU (Megatron: imports),
#                                 the tiny model on a batch of 2 groups x 2 responses of up to 16 tokens (its default);
#                                 about 3 minutes on 2 busy cores. Add --backend torch for the fastest (under a minute)
#   scripts/gpu-smoke.sh --trainer-only --backend megatron [--world-size 2 --tensor-parallel 2]   one backend only
#
# Without vLLM and Ray: on a machine where `import staleflow` fails, the repository is put on the path
# (it is the package), and the small packages the trainer path needs that the machine lacks are
# installed from a local wheel folder, WHEELS (default ./wheels; no network needed), into the
# smoke folder. Bring them with, on a machine with the registry:
#   pip download --no-deps -d wheels megatron-core==0.16.1    # 2.6 MB; needs numpy, packaging, setuptools
# (add --only-binary=:all: --python-version 3.12 for a Python other than the downloading one's).
# The rest of the path needs torch, transformers >= 5 (with its tokenizers, numpy, pyyaml) and
# safetensors: the check machine's, used as they are (no pydantic, scipy, Ray or vLLM: the CPU self-check
# runs in CI on a Python without them, tests/test_gpu_smoke_script.py). Without the wheel the preflight stops, naming
# it (exit 2); `--backend fsdp` (or torch) checks one backend without Megatron.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
if [[ -z "${PYTHON:-}" ]]; then PYTHON=.venv/bin/python; [[ -x "$PYTHON" ]] || PYTHON=python3; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out="${STALEFLOW_SMOKE_DIR:-$(mktemp -d /tmp/staleflow-gpu-smoke.XXXXXX)}"
#: module -> wheel name, for the trainer-only path (see above)
SMALL_WHEELS=(megatron.core:megatron-core)

# Make `import staleflow` and the small packages work without a network (trainer-only path).
bring_trainer_path() {
  if ! "$PYTHON" -c "import staleflow" 2>/dev/null; then
    mkdir -p "$out/path" && ln -sfn "$repo" "$out/path/staleflow"
    export PYTHONPATH="$out/path${PYTHONPATH:+:$PYTHONPATH}"
  fi
  local wheels="${WHEELS:-$repo/wheels}" missing=() entry
  for entry in "${SMALL_WHEELS[@]}"; do
    # find_spec: installed or not, without importing it (the preflight imports it and names any error)
    "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec(sys.argv[1]) is None)" "${entry%%:*}" 2>/dev/null || missing+=("${entry#*:}")
  done
  ((${#missing[@]})) || return 0
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "gpu-smoke: missing ${missing[*]} and no wheels in $wheels (set WHEELS=DIR; see the top of this script)" >&2
    return 0
  fi
  echo "gpu-smoke: installing ${missing[*]} from $wheels into $out/site" >&2
  # --find-links: pip picks, among the wheels there, the one built for this Python (cp311, cp312...)
  if "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --find-links "$wheels" --target "$out/site" "${missing[@]}"; then
    export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu-smoke: could not install the wheels in $wheels (needed: ${missing[*]})" >&2
  fi
}

# The trainer backends, each under a time limit with its ranks, after a preflight; the verdict from their lines.
trainer_only() {
  bring_trainer_path
  exec "$PYTHON" scripts/gpu_smoke_run.py --out "$out/trainer" --wheels "${WHEELS:-$repo/wheels}" "$@"
}
model="$out/model-100m"
run=(
  train --run-dir "$out/run" model.path="$model" train.steps=30
  train.backend=fsdp train.world_size=1 train.gpus=0.5
  rollout.instances=2 rollout.gpus_per_instance=1 rollout.instances_per_gpu=4 rollout.gpu_memory_utilization=0.2
  servers.placement=ray servers.weight_transfer=reference cluster.num_cpus=null
  task.eval_prompts=0 task.eval_every=0 checkpoint.every=0 metrics.progress=false
)
case "${1:-}" in
  --plan) exec "$PYTHON" -m staleflow "${run[@]}" --dry-run ;;
  --trainer-only) shift; trainer_only "$@"; exit ;;
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
