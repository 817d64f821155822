#!/usr/bin/env bash
# The wheels bench/gpu.sh needs on a lent H200, downloaded here: that machine has torch 2.11
# (CUDA 13), transformers 5.17, numpy, safetensors, tokenizers, pyyaml, xxhash, matplotlib, tqdm,
# einops, psutil and packaging, but no megatron-core and no registry. What it lacks travels in
# the working tree (name the folder in the device call's `carry`; 64 MiB a call, tree included)
# and gpu.sh installs it offline. Never a CI step nor part of `make install`.
#
#   bash bench/gpu_wheels.sh [--python-version 3.12] [--dest .whl]
#
# What gpu.sh imports beyond the image (every step traced with WANDB_MODE=disabled, and run on
# torch 2.11 with only these wheels added; docs/benchmarks.md "GPU kit", docs/gpu/README.md):
#   megatron-core   training (its own needs: torch, numpy, packaging: all in the image)
# Not needed, so not carried: wandb (gpu.sh passes wandb.mode=disabled to every run), deepspeed
# (sdist only; imported by engine=deepspeed alone), webdataset (data.kind=synthetic), datatrove
# and lm-eval (prep and eval downstream are not steps). megaloop itself travels as source.
# Versions are requirements.txt's pins. Exit 1 if a wheel is missing or the total is too big.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(megatron-core)
PYVER=3.12
DEST=.whl
LIMIT_MIB=${LIMIT_MIB:-64}  # the device call's limit on what travels
while [ $# -gt 0 ]; do
  case $1 in
    --python-version) PYVER=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    *) echo "usage: bash bench/gpu_wheels.sh [--python-version 3.12] [--dest .whl]" >&2; exit 2 ;;
  esac
done
PIP=${PIP:-python3 -m pip}

specs=()
for p in "${PACKAGES[@]}"; do
  pin=$(grep -i -m1 "^$p==" requirements.txt || true)
  [ -n "$pin" ] || { echo "gpu_wheels: $p is not pinned in requirements.txt" >&2; exit 1; }
  specs+=("$pin")
done

mkdir -p "$DEST"
rm -f "$DEST"/*.whl "$DEST/MANIFEST.txt"  # one version of each: two stop the install
# pip matches a manylinux_2_N tag exactly: the usual N, oldest compatible first
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# shellcheck disable=SC2086
$PIP download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$DEST" "${specs[@]}"

shopt -s nullglob
wheels=("$DEST"/*.whl)
if [ ${#wheels[@]} != ${#specs[@]} ]; then
  echo "gpu_wheels: expected ${#specs[@]} wheels, got ${#wheels[@]} in $DEST" >&2
  exit 1
fi
wheel_bytes=0
for w in "${wheels[@]}"; do wheel_bytes=$((wheel_bytes + $(stat -c %s "$w"))); done
# the rest of what travels: tracked and untracked-not-ignored files (a deleted file is skipped)
tree_bytes=0
while IFS= read -r -d '' f; do
  [ -f "$f" ] && tree_bytes=$((tree_bytes + $(stat -c %s "$f")))
done < <(git ls-files -z --cached --others --exclude-standard)
{
  echo "# bench/gpu_wheels.sh --python-version $PYVER, $(date -u +%Y-%m-%d): ${specs[*]}"
  echo "# wheel  bytes  sha256"
  for w in "${wheels[@]}"; do
    echo "$(basename "$w")  $(stat -c %s "$w")  $(sha256sum "$w" | cut -d' ' -f1)"
  done
  echo "# total: $wheel_bytes bytes of wheels; with the working tree ($tree_bytes bytes):" \
    "$((wheel_bytes + tree_bytes)) of $((LIMIT_MIB * 1048576))"
} >"$DEST/MANIFEST.txt"
cat "$DEST/MANIFEST.txt"
if [ $((wheel_bytes + tree_bytes)) -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_wheels: OVER the device call's limit: $((wheel_bytes / 1048576)) MiB of wheels +" \
    "$((tree_bytes / 1048576)) MiB of working tree > $LIMIT_MIB MiB; the call would be refused" >&2
  exit 1
fi
echo "gpu_wheels: ${#wheels[@]} wheel(s) for Python $PYVER in $DEST; name $DEST in the call's carry"
