#!/usr/bin/env bash
# Install megatron-paradyse and everything it needs into the active Python environment.
#
#   bash scripts/install.sh [--with te,flash-attn] [--wheels DIR] [--machine cpu|cuda] [--dry-run]
#
# CPU machine: torch 2.13.0 (CPU wheel), megatron-core 0.19.2 by the recipe that works on Python 3.11
# (its metadata says >=3.12 but a cp311 wheel exists), test tools (pytest, TensorBoard), this package in
# editable mode.
# CUDA machine (nvidia-smi answers): keeps the installed CUDA build of torch, adds megatron-core 0.19.2
# and what else is missing, this package in editable mode; compiles nothing. Without Transformer Engine
# and apex the model runs Megatron's local modules (docs/gpu.md).
#
#   --with te,flash-attn  also Transformer Engine (transformer-engine[pytorch]) and/or flash-attn (CUDA
#                         only); both build CUDA code against the installed torch where no matching
#                         wheel is found (nvcc, minutes to an hour). apex is not on PyPI: docs/gpu.md
#   --wheels DIR          install from the wheels in DIR only, without a network (docs/gpu.md)
#   --machine cpu|cuda    the recipe to follow (default: cuda where nvidia-smi answers)
#   --dry-run             print the commands, run none
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

die() { echo "install.sh: error: $*" >&2; exit 2; }
needs_value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }

extras="" wheels="" machine="" dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --with) needs_value "$@"; extras=$2; shift 2 ;;
    --with=*) extras=${1#*=}; shift ;;
    --wheels) needs_value "$@"; wheels=$2; shift 2 ;;
    --wheels=*) wheels=${1#*=}; shift ;;
    --machine) needs_value "$@"; machine=$2; shift 2 ;;
    --machine=*) machine=${1#*=}; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

if [ -z "$machine" ]; then
  machine=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then machine=cuda; fi
fi
case "$machine" in cpu | cuda) ;; *) die "--machine takes cpu or cuda, got '$machine'" ;; esac

extra_packages=()
IFS=, read -r -a asked <<<"$extras"
for extra in "${asked[@]}"; do
  case "$extra" in
    te) # the core library built for the installed torch's CUDA major version, as megatron-core's "te" extra
      cuda_major=$("$PYTHON" -c "import torch; print((torch.version.cuda or '').split('.')[0])" 2>/dev/null || true)
      extra_packages+=("transformer-engine[${cuda_major:+core_cu$cuda_major,}pytorch]") ;;
    flash-attn) extra_packages+=("flash-attn>=2.6") ;;
    apex) die "apex is not on PyPI; build it from its source if you want its fused kernels (docs/gpu.md)" ;;
    "") ;;
    *) die "--with takes te and flash-attn, got '$extra'" ;;
  esac
done
if [ ${#extra_packages[@]} -gt 0 ] && [ "$machine" = cpu ]; then
  die "--with $extras: Transformer Engine and flash-attn need a CUDA machine"
fi
if [ -n "$wheels" ] && [ "$dry_run" = 0 ] && [ ! -d "$wheels" ]; then
  die "--wheels $wheels: no such folder"
fi

run() {
  printf '+'; printf ' %q' "$@"; echo  # as a shell reads it back
  [ "$dry_run" = 1 ] || "$@"
}
index=()
[ -z "$wheels" ] || index=(--no-index --find-links "$wheels")
pip_install() { run "$PYTHON" -m pip install --disable-pip-version-check ${index[@]+"${index[@]}"} "$@"; }

if [ "$machine" = cuda ]; then
  echo "[install] CUDA machine"
  run "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.version.cuda else f'install.sh: torch {torch.__version__} is not a CUDA build; install one first')"
  # every package by name, and megatron-core and this package without their requirements: pip never
  # replaces the installed torch, and an offline install needs nothing beyond these
  pip_install numpy "packaging>=24.2" einops pyyaml psutil scikit-learn matplotlib pytest pytest-timeout tensorboard
  pip_install --no-deps "megatron-core==0.19.2"
  pip_install --no-deps --no-build-isolation -e .
  if [ ${#extra_packages[@]} -gt 0 ]; then
    pip_install --no-build-isolation "${extra_packages[@]}"
  fi
else
  echo "[install] CPU machine"
  pip_install "torch==2.13.0"
  # tensorboard: Megatron's --tensorboard-dir writer, and the tests that read its event files back
  pip_install numpy "packaging>=24.2" einops pyyaml psutil "scikit-learn==1.9.1" "matplotlib==3.11.2" pytest pytest-timeout \
    "tensorboard==2.21.0"
  pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2"
  pip_install --no-deps --no-build-isolation -e .
fi
if [ "$machine" = cuda ]; then
  # a GPU image may hold packages whose requirements disagree with each other: reported, not fatal (what
  # this package needs is imported below)
  run "$PYTHON" -m pip check || echo "[install] pip check: the environment's conflicts above are not this package's" >&2
else
  run "$PYTHON" -m pip check
fi
run "$PYTHON" -c "import torch, megatron_paradyse.strategies; print('[install] ok: torch', torch.__version__)"
