#!/usr/bin/env bash
# Install megatron-paradyse and everything it needs into the active Python environment.
#
#   bash scripts/install.sh
#
# CPU machine: torch 2.13.0 (CPU wheel), megatron-core 0.19.2 by the recipe that works on Python 3.11
# (its metadata says >=3.12 but a cp311 wheel exists), test tools (pytest, TensorBoard), this package in
# editable mode.
# CUDA machine (nvidia-smi answers): keeps the installed CUDA torch and adds the GPU extras
# (transformer-engine, flash-attn).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  echo "[install] CUDA machine: GPU extras"
  "$PYTHON" -c "import torch" 2>/dev/null || { echo "install a CUDA build of torch first" >&2; exit 1; }
  pip_install "megatron-core==0.19.2" numpy "packaging>=24.2" pyyaml psutil scikit-learn matplotlib pytest pytest-timeout \
    "tensorboard==2.21.0"
  pip_install --no-build-isolation -e ".[gpu,test]"
else
  echo "[install] CPU machine"
  pip_install "torch==2.13.0"
  # tensorboard: Megatron's --tensorboard-dir writer, and the tests that read its event files back
  pip_install numpy "packaging>=24.2" einops pyyaml psutil "scikit-learn==1.9.1" "matplotlib==3.11.2" pytest pytest-timeout \
    "tensorboard==2.21.0"
  pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2"
  pip_install --no-deps --no-build-isolation -e .
fi
"$PYTHON" -m pip check
"$PYTHON" -c "import torch, megatron_paradyse.strategies; print('[install] ok: torch', torch.__version__)"
