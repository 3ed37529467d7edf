# shellcheck shell=bash
# The job environment of the SLURM scripts in this folder; sourced, never run.
#
# Megatron reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT and has no fallback to
# SLURM's variables, so they are derived here:
#
#   paradyse_first_host LIST     first host of a SLURM hostlist ("gpu[007-008,012],cpu1" -> gpu007)
#   paradyse_master_env          MASTER_ADDR (the job's first node, where rank 0 runs) and MASTER_PORT
#   paradyse_srun_env            in an srun task (one per GPU): RANK, WORLD_SIZE, LOCAL_RANK + the above
#   paradyse_torchrun_node ...   in an srun task (one per node): exec torchrun for this node's GPUs
#                                (restarting them up to MAX_RESTARTS times)
#   paradyse_job_setup           in the batch script: checks the job's variables, exports the environment
#                                Megatron needs, fills PARADYSE_CMD (what each rank runs) and SRUN_ARGS
#   paradyse_run CMD...          runs CMD; with PARADYSE_DRY_RUN=1 prints it instead
#
# MASTER_ADDR and MASTER_PORT are kept when already set. The first host comes from
# `scontrol show hostnames` where scontrol exists, else from the parser below. Rank 0 runs on the first
# node when a step spans the job's nodes with SLURM's default (block) distribution, as here.

# Job variables read by paradyse_job_setup (exported from the submitting shell: sbatch passes them on):
#   PARADYSE_CONFIG     paradyse YAML config (required)
#   MEGATRON_ARGS_FILE  Megatron flags, whitespace-separated, '#' starts a comment (optional)
#   MEGATRON_ARGS       more Megatron flags (optional); later flags win: the config's megatron_args,
#                       then MEGATRON_ARGS_FILE, then MEGATRON_ARGS. No quoting: values hold no spaces
#   MEGATRON_LM_DIR     run this Megatron-LM checkout's pretrain_gpt.py, patched by
#                       scripts/apply_patch.sh (optional; default: python -m megatron_paradyse.pretrain_gpt)
#   CONTAINER_IMAGE     run every task in this container (pyxis/enroot srun flags; optional), in
#                       the directory the job was submitted from, with
#   CONTAINER_MOUNTS    these mounts (optional), which must include that directory and the data
#   GPUS_PER_NODE       default: SLURM_GPUS_ON_NODE, else 8
#   MAX_RESTARTS        train_torchrun.sbatch only: torchrun starts every rank again, up to this many
#                       times, when one exits non-zero (optional; default: never). An out-of-memory
#                       error exits every rank with the memory budget shrunk and saved in the --save
#                       directory: give --save and --load the same directory, and the restart re-runs
#                       the failed step from the last checkpoint (docs/configs.md, "Out of memory")

paradyse_first_host() {
  local list=${1:?paradyse_first_host needs a SLURM hostlist}
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$list" | head -n 1
  else
    _paradyse_first_host_parse "$list"
  fi
}

# Without scontrol: the first entry of the list (up to the first comma outside brackets), with each
# bracket group replaced by its first value, zero padding kept.
_paradyse_first_host_parse() {
  local list=$1 entry="" c i depth=0 head inner tail
  for ((i = 0; i < ${#list}; i++)); do
    c=${list:i:1}
    case $c in
      '[') depth=$((depth + 1)) ;;
      ']') depth=$((depth - 1)) ;;
      ',') ((depth == 0)) && break ;;
    esac
    entry+=$c
  done
  while [[ $entry == *'['*']'* ]]; do
    head=${entry%%\[*}
    inner=${entry#*\[}
    tail=${inner#*\]}
    inner=${inner%%\]*}
    inner=${inner%%,*}
    entry=$head${inner%%-*}$tail
  done
  if [[ -z $entry || $entry == *[][,]* ]]; then
    echo "env.sh: cannot read a host name from the SLURM hostlist '$list'" >&2
    return 1
  fi
  printf '%s\n' "$entry"
}

_paradyse_require() {
  local name
  for name in "$@"; do
    if [[ -z ${!name:-} ]]; then
      echo "env.sh: $name is not set (run inside a SLURM job, or export it)" >&2
      return 1
    fi
  done
}

paradyse_master_env() {
  if [[ -z ${MASTER_ADDR:-} ]]; then
    _paradyse_require SLURM_JOB_NODELIST || return 1
    MASTER_ADDR=$(paradyse_first_host "$SLURM_JOB_NODELIST") || return 1
  fi
  # a port per job, so that jobs sharing a node do not collide
  export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
}

paradyse_srun_env() {
  _paradyse_require SLURM_PROCID SLURM_NTASKS SLURM_LOCALID || return 1
  export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
  paradyse_master_env
}

paradyse_torchrun_node() {
  _paradyse_require SLURM_NNODES SLURM_NODEID || return 1
  paradyse_master_env || return 1
  local nproc=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  if ((${MAX_RESTARTS:-0} > 0)); then
    # Restarts need the c10d rendezvous with a store of their own per attempt: the static rendezvous
    # and the store torchrun shares by default keep the first attempt's keys, and the restarted ranks'
    # process group fails to connect (pytorch/pytorch#135712). Node ranks then come in the order the
    # nodes join, but each node still holds GPUS_PER_NODE consecutive ranks (TP groups stay in a node).
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    exec torchrun --nnodes "$SLURM_NNODES" --nproc_per_node "$nproc" --max-restarts "$MAX_RESTARTS" \
      --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "paradyse-${SLURM_JOB_ID:-0}" "$@"
  fi
  # static rendezvous: node i holds ranks i*GPUS_PER_NODE .. (i+1)*GPUS_PER_NODE-1, so a TP group of
  # at most GPUS_PER_NODE consecutive ranks stays on one node
  exec torchrun --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" --nproc_per_node "$nproc" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$@"
}

_paradyse_add_flags() {  # append the words of $1 to PARADYSE_FLAGS, unglobbed ("--save ckpt/*" stays)
  local words
  set -f
  # shellcheck disable=SC2206
  words=($1)
  set +f
  PARADYSE_FLAGS+=("${words[@]}")
}

paradyse_job_setup() {
  _paradyse_require PARADYSE_CONFIG || return 1
  if [[ ! -f $PARADYSE_CONFIG ]]; then
    echo "env.sh: PARADYSE_CONFIG=$PARADYSE_CONFIG is not a file" >&2
    return 1
  fi
  PARADYSE_CONFIG=$(cd "$(dirname "$PARADYSE_CONFIG")" && pwd)/$(basename "$PARADYSE_CONFIG")

  PARADYSE_FLAGS=()
  if [[ -n ${MEGATRON_ARGS_FILE:-} ]]; then
    if [[ ! -f $MEGATRON_ARGS_FILE ]]; then
      echo "env.sh: MEGATRON_ARGS_FILE=$MEGATRON_ARGS_FILE is not a file" >&2
      return 1
    fi
    local line
    while IFS= read -r line || [[ -n $line ]]; do
      _paradyse_add_flags "${line%%#*}"
    done <"$MEGATRON_ARGS_FILE"
  fi
  _paradyse_add_flags "${MEGATRON_ARGS:-}"

  if [[ -n ${MEGATRON_LM_DIR:-} ]]; then
    local script=$MEGATRON_LM_DIR/pretrain_gpt.py
    if ! grep -q -- '--paradyse-config' "$script" 2>/dev/null; then
      echo "env.sh: $script is missing or not patched; run scripts/apply_patch.sh $MEGATRON_LM_DIR" >&2
      return 1
    fi
    PARADYSE_ENTRY=("$script")
  else
    PARADYSE_ENTRY=(-m megatron_paradyse.pretrain_gpt)
  fi
  PARADYSE_CMD=("${PARADYSE_ENTRY[@]}" "${PARADYSE_FLAGS[@]}" --paradyse-config "$PARADYSE_CONFIG")

  SRUN_ARGS=(--kill-on-bad-exit=1)
  # recent SLURM no longer hands the batch script's --cpus-per-task to srun
  [[ -z ${SLURM_CPUS_PER_TASK:-} ]] || SRUN_ARGS+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
  if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    SRUN_ARGS+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$PWD")
    [[ -z ${CONTAINER_MOUNTS:-} ]] || SRUN_ARGS+=(--container-mounts="$CONTAINER_MOUNTS")
  fi

  export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  # Megatron asserts it with TP or CP on GPUs before Blackwell: kernels reach the GPU in issue order,
  # so a communication kernel issued before a GEMM is not held back behind it
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  # plans that switch with the sequence length leave the caching allocator's cache fragmented: on an
  # H200 (benchmarks/results/allocator_h200_20261126_5acd810.md) it reserved 1.38x the most it allocated
  # with its defaults and 1.03x with expandable segments, which the memory budget's margin covers. A job
  # that configures the allocator itself (either of torch's names) keeps its own settings.
  if [[ -z ${PYTORCH_ALLOC_CONF:-} ]]; then
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
  # Cluster-specific NCCL settings (uncomment what your cluster's documentation asks for):
  # export NCCL_DEBUG=WARN                   # INFO to see the rings, trees and transports chosen
  # export NCCL_SOCKET_IFNAME=ib0            # the interface of the bootstrap connection
  # export NCCL_IB_HCA=mlx5                  # InfiniBand adapters to use
  # export NCCL_IB_TIMEOUT=22                # larger for big or busy fabrics
  # export NCCL_NVLS_ENABLE=0                # if NVLink SHARP fails on your driver
  paradyse_master_env
}

paradyse_run() {  # run a command; with PARADYSE_DRY_RUN=1 print it, shell-quoted, instead
  if [[ ${PARADYSE_DRY_RUN:-0} == 1 ]]; then
    printf '%s\n' "${*@Q}"
  else
    "$@"
  fi
}
