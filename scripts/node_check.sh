#!/usr/bin/env bash
# The node check, one command on one node of GPUs (8 by default):
#
#   bash scripts/node_check.sh [--gpus N] [--wheels DIR] [--profile FILE] [--results-dir DIR]
#   bash scripts/node_check.sh --cpu [--gpus N] [--profile FILE] [--results-dir DIR]
#
# On the node: checks that N CUDA GPUs are there; runs the GPU tests (pytest -m gpu: one GPU each, none
# runs on several); calibrates at N ranks with NCCL (paradyse calibrate: kernels, every collective at
# p=N, configs/llama3-8b.yaml's layer up to the longest sequence, bf16) unless --profile gives a profile
# of this node; then the training comparison under torchrun --nproc-per-node N with NCCL (bench e2e
# --device cuda): 4 Llama-3-8B layers in bf16 (fp32 weights in the optimizer, as Megatron keeps them) at
# TP=N on code documents of long-tailed lengths, every static strategy, Megatron's stock layers (TE's
# where installed) and the adaptive planner, with per rank the predicted and measured peak and forward +
# backward time, the host synchronisations, tokens/s and MFU. The last line is bench e2e's, prefixed with
# each part's exit status:
#   node_check: tests=<rc> calibration=<rc> training=<rc> adaptive_vs_best_static=<ratio> ...
#     peak_predicted_over_measured_max=<ratio> ... host_syncs=<n> tokens_per_s=<n> mfu=<%>
# The command, the machine (nvidia-smi -L, torch, NCCL) and the output go to
# <results-dir>/node-check_<machine>_<date>_<commit>.md (default benchmarks/results). Exits non-zero if
# a part failed.
#
# --cpu: the reduced form, for a machine without GPUs (the test suite runs it): N gloo ranks (default 2),
# a Llama-3-8B layer shrunk to h=64, a few short synthetic documents; no GPU tests. Without --cpu a
# machine without N GPUs is an error, not a quiet CPU run. --wheels DIR: install first (scripts/install.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
usage="usage: bash scripts/node_check.sh [--cpu] [--gpus N] [--wheels DIR] [--profile FILE] [--results-dir DIR]"
fail() { echo "node_check.sh: error: $1" >&2; exit 2; }
command="bash scripts/node_check.sh $*"

cpu=0 gpus="" wheels="" profile="" results_dir=benchmarks/results
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1; shift; continue ;;
    --gpus|--wheels|--profile|--results-dir) [ $# -ge 2 ] || fail "$1 takes a value ($usage)" ;;
    *) fail "unknown argument '$1' ($usage)" ;;
  esac
  case "$1" in
    --gpus) gpus=$2 ;; --wheels) wheels=$2 ;; --profile) profile=$2 ;; --results-dir) results_dir=$2 ;;
  esac
  shift 2
done
[ "$cpu" -eq 1 ] && [ -n "$wheels" ] && fail "--wheels installs for CUDA; the --cpu form uses what is installed"
if [ -z "$gpus" ]; then gpus=$((cpu ? 2 : 8)); fi
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || fail "--gpus takes a number of ranks, got '$gpus'"
[ -z "$profile" ] || [ -f "$profile" ] || fail "--profile $profile: no such file"
mkdir -p "$results_dir" 2>/dev/null && [ -w "$results_dir" ] || fail "--results-dir $results_dir: not a writable folder"
if [ -n "$wheels" ]; then bash scripts/install.sh --machine cuda --wheels "$wheels" || exit; fi

if [ "$cpu" -eq 1 ]; then
  device=cpu machine=cpu-$(nproc)core
  # configs/llama3-8b.yaml's layer (GQA, SwiGLU, RMSNorm, no biases, RoPE) at a CPU's size
  model=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --kv-channels 16
    --ffn-hidden-size 224 --seq-length 512)
  data=(--corpora dna --sequences 4 --min-len 64 --max-len 512 --repeats 1)
else
  device=cuda
  "$PYTHON" -c "import sys, torch; n = torch.cuda.device_count(); sys.exit(0 if n >= $gpus else
    f'node_check.sh: error: --gpus $gpus, and torch sees {n} CUDA device(s) (--cpu: the reduced form)')" || exit 2
  machine=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr 'A-Z ' 'a-z-')x$gpus
  model=(--num-layers 4 --seq-length 32768)
  data=(--corpora code --sequences 16 --min-len 1024 --max-len 32768 --repeats 3)
fi
result="$results_dir/node-check_${machine}_$(date -u +%Y%m%d)_$(git rev-parse --short HEAD 2>/dev/null || echo nogit).md"
log=$(mktemp)
work=$(mktemp -d)
trap 'rm -rf "$log" "$work"' EXIT

{
  echo "[node_check] $command: the output goes to $result"
  if [ "$cpu" -eq 1 ]; then
    echo "[node_check] --cpu: no GPU tests"; tests=0
  else
    echo "[node_check] pytest -m gpu (one GPU each: no GPU test runs on several GPUs yet)"
    "$PYTHON" -m pytest -m gpu -q; tests=$?
  fi
  if [ -n "$profile" ]; then
    echo "[node_check] cost profile: $profile (given)"; calibrated=0
  else
    profile="$work/profile.json"
    echo "[node_check] paradyse calibrate on $gpus ranks ($device, bf16): kernels, every collective at p=$gpus," \
      "configs/llama3-8b.yaml's layer up to the longest sequence, the correction from whole layers"
    "$PYTHON" -m megatron_paradyse.cli calibrate --config configs/llama3-8b.yaml --device "$device" --dtype bfloat16 \
      --grid quick --fit-correction --quiet --output "$profile" -- --tensor-model-parallel-size "$gpus" "${model[@]}"
    calibrated=$?
  fi
  echo "[node_check] bench e2e under torchrun --nproc-per-node $gpus, $device"
  arms=tp_sp/tp_sp,ulysses/zero3,ring/zero3,lean/lean,megatron,adaptive
  if [ "$calibrated" -eq 0 ]; then
    OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
      -m megatron_paradyse.bench e2e --p "$gpus" --device "$device" --dtype bfloat16 --model configs/llama3-8b.yaml \
      "${data[@]}" \
      --arms "$arms" --profile "$profile" --cache-dir "$work/cache" -- "${model[@]}" 2>&1 | tee "$work/training.log"
    trained=${PIPESTATUS[0]}
  else
    echo "[node_check] no profile: no training run"; trained=1
  fi
  summary=$(grep -E '^adaptive_vs_best_static=' "$work/training.log" 2>/dev/null | tail -n 1)
  echo "node_check: tests=$tests calibration=$calibrated training=$trained ${summary:-(no summary: the training run failed)}"
  [ "$tests" -eq 0 ] && [ "$calibrated" -eq 0 ] && [ "$trained" -eq 0 ]
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

{
  echo "# node check: $machine"
  echo
  echo "\`$command\` at $(git rev-parse --short HEAD 2>/dev/null), $(date -u '+%Y-%m-%d %H:%M UTC'), exit $status"
  echo
  echo '```'
  if [ "$cpu" -eq 1 ]; then echo "CPU: $(nproc) cores"; else nvidia-smi -L; fi
  "$PYTHON" -c "import torch; nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else 'none'
print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}')"
  echo '```'
  echo
  echo '```'
  cat "$log"
  echo '```'
} >"$result"
exit "$status"
