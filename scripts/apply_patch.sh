#!/usr/bin/env bash
# Give a Megatron-LM checkout's stock pretrain_gpt.py the --paradyse-config flag.
#
#   git clone -b core_v0.19.0 https://github.com/NVIDIA/Megatron-LM
#   scripts/apply_patch.sh Megatron-LM
#   torchrun --nproc_per_node 8 Megatron-LM/pretrain_gpt.py <Megatron flags> --paradyse-config cfg.yaml
#
# Refuses a checkout of another version (megatron/core/package_info.py must say 0.19.1, as it does at
# tag core_v0.19.0) and a pretrain_gpt.py the patch does not fit. Tries the patch first (--dry-run),
# then applies it with GNU patch, which replaces the file only once the whole patch has applied. A
# second run says "already applied" and changes nothing.
set -euo pipefail

TAG=core_v0.19.0
VERSION=0.19.1 # megatron/core/package_info.py at $TAG
PATCH_FILE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/patches/pretrain_gpt_$TAG.patch

die() {
  echo "apply_patch.sh: error: $*" >&2
  exit 1
}

if [[ $# -ne 1 || $1 == -* ]]; then
  echo "usage: scripts/apply_patch.sh <Megatron-LM checkout at tag $TAG>" >&2
  exit 2
fi
checkout=${1%/}
command -v patch >/dev/null || die "GNU patch is not installed (e.g. apt-get install patch)"
[[ -d $checkout ]] || die "$checkout is not a directory"

info=$checkout/megatron/core/package_info.py
[[ -f $info ]] || die "$info not found: $checkout is not a Megatron-LM checkout"
part() { sed -n -E "s/^$1 = ([0-9]+).*/\1/p" "$info"; }
found=$(part MAJOR).$(part MINOR).$(part PATCH)
if [[ $found != "$VERSION" ]]; then
  die "$checkout is megatron-core $found (from $info), but this patch is for tag $TAG" \
    "(megatron-core $VERSION); check out that tag: git -C $checkout checkout $TAG"
fi

target=$checkout/pretrain_gpt.py
[[ -f $target ]] || die "$target not found: $checkout is not a Megatron-LM checkout"
# --fuzz=0: the hunk's one line of context on each side must match exactly, never approximately
if patch --dry-run --reverse --force --fuzz=0 --silent "$target" <"$PATCH_FILE" >/dev/null 2>&1; then
  echo "already applied: $target"
  exit 0
fi
if ! patch --dry-run --forward --fuzz=0 --silent "$target" <"$PATCH_FILE" >/dev/null 2>&1; then
  die "the patch does not fit $target (changed since $TAG, or patched by another version of" \
    "this patch); nothing was changed. Restore it with: git -C $checkout checkout $TAG -- pretrain_gpt.py"
fi
patch --forward --fuzz=0 --silent --no-backup-if-mismatch "$target" <"$PATCH_FILE"
echo "patched: $target (--paradyse-config runs megatron_paradyse.pretrain_gpt)"
