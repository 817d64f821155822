#!/usr/bin/env bash
# The GPU checks as one call on a lent H200 (docs/benchmarks.md, "GPU (H200)" and "GPU kit").
# The lent machine has torch but no megatron-core and no registry, and a call is short and
# costly, so the run first installs what travels as wheels (bench/gpu_wheels.sh builds .whl/)
# and checks every import, the versions and one collective in seconds; then each benchmark
# runs under its own time limit and writes its figures to OUT as it finishes, so a run cut
# short still returns what it measured. A failed or timed-out step is recorded and the next
# one runs; the exit status is 1 if any step did not pass.
#
#   bash bench/gpu.sh [OUT]          (OUT: figures and steps.tsv; default runs/gpu)
#   bash bench/gpu.sh --smoke [OUT]  (the same flow, tiny shapes, on a CPU with gloo: ~2 min, 2
#                                    cores)
#
# Steps on the H200, each under its own limit (s). The first call (2026-12-04, docs/gpu/README.md
# "First calls") measured the seconds below; fixed_k ran past its first limit (120 s) after its
# training step, somewhere in the 1.4B checkpoint (16 GiB), the export or the timed batches.
#   step              what                                                 measured  limit
#   install           offline pip install of WHEELS into a temporary site dir     0     30
#   kit               imports, torch/CUDA/NCCL versions, one NCCL all_reduce     38     45
#   preempt_resume    tiny config, 3 torchrun launches: 20 steps, SIGUSR1 at 10  102    150
#   recompute_memory  d=1024 L=4 seq 2,048 V=49,152, K=1,4 x 4 options, bf16    32     50
#   mfu_129m          13 steps at K=4 (0.26 s) and at K=1 (0.07 s), 2 builds     24     45
#   mfu_1p4b          8 steps at K=4 (0.51 s) and at K=1 (0.19 s), 2 builds      48     70
#   fixed_k           1.4B: 1 step, 16 GiB checkpoint, export (5.3 GiB), then  >120    240
#                     35 batches of 2 x 2,048 at K=1..4
#   total                                                                     >364    630
# So the run takes ~7 min and at most 10.5 (+5 s a step to kill): the device call's 10 minutes
# cut only a fixed_k that runs to its limit, and every figure before it is already in OUT.
# OUT gets 8 files (a device call returns at most 8): steps.tsv, kit.md (install and kit), one
# .md per step, fixed_k.json. The device call: carry [".whl"], `bash bench/gpu.sh $OUT`.
# Environment:
#   PY=python3      the interpreter (on the H200: the image's, torch 2.11 + CUDA 13)
#   WHEELS=.whl     wheel folder to install offline; absent: no install (PY has everything)
#   STEPS="..."     the benchmark steps to run (default all, in the order above)
#   LIMIT_<step>=S  another time limit for a step (seconds)
#   GPU_TEST_STALL=<step>  that step sleeps past its limit (tests/multiprocess/test_gpu_kit.py)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SMOKE=
if [ "${1:-}" = --smoke ]; then SMOKE=1; shift; fi
OUT=${1:-runs/gpu}
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
ALL_STEPS="preempt_resume recompute_memory mfu_129m mfu_1p4b fixed_k"
declare -A default_limit=([preempt_resume]=150 [recompute_memory]=50 [mfu_129m]=45
                          [mfu_1p4b]=70 [fixed_k]=240)
STEPS=${STEPS:-$ALL_STEPS}
for s in $STEPS; do
  if [ -z "${default_limit[$s]:-}" ]; then
    echo "gpu.sh: unknown step $s (steps: $ALL_STEPS)" >&2
    exit 2
  fi
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# checkpoints, exports and logs stay out of OUT: OUT is what comes back from the device
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/megaloop-gpu.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
rm -f "$OUT"/steps.tsv "$OUT"/kit.md "$OUT"/fixed_k.json
for s in $ALL_STEPS; do rm -f "$OUT/$s.md"; done
export OUT SCRATCH PY SMOKE REPO PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
printf 'step\tstatus\trc\tseconds\tlimit_s\n' >"$OUT/steps.tsv"

# --- the steps: each runs as `bash -c step_NAME`, stdout to OUT/NAME.md -----------------------
step_kit() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
    || echo "no GPU (nvidia-smi absent or failing)"
  # every module a step imports (traced with WANDB_MODE=disabled), then megaloop's entry points
  "$PY" - <<'EOF'
import importlib, importlib.metadata as md, platform, sys
third = ["torch", "numpy", "yaml", "safetensors", "tokenizers", "tqdm", "matplotlib", "xxhash",
         "einops", "psutil", "packaging", "transformers", "megatron.core"]
ours = ["megaloop.cli", "megaloop.experiment", "megaloop.export", "megaloop.evaluation.fixed_k"]
missing = []
for name in third + ours:
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("missing: " + "; ".join(missing))
import torch
def ver(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "?"
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: "
      f"{torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()},"
          f" NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for dist in ("megatron-core", "transformers", "numpy", "safetensors", "tokenizers"):
    print(f"{dist} {ver(dist)}")
import megatron.core
print(f"megatron.core from {megatron.core.__file__}")
EOF
  if [ -z "$SMOKE" ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
'no CUDA device: --smoke runs the CPU flow')"
  fi
  cat >"$SCRATCH/collective.py" <<'EOF'
import os, time, torch, torch.distributed as dist
start = time.perf_counter()
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
x = torch.ones(4, device="cuda" if cuda else "cpu")
dist.all_reduce(x)
assert x.tolist() == [float(dist.get_world_size())] * 4, x
dist.barrier()
print(f"all_reduce over {dist.get_world_size()} rank(s), {dist.get_backend()}: ok in "
      f"{time.perf_counter() - start:.1f} s")
dist.destroy_process_group()
EOF
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 "$SCRATCH/collective.py"
}

step_preempt_resume() {
  local args=()
  [ -n "$SMOKE" ] && args=(--steps 6 --at 3 model.hidden_size=32 model.num_layers=1
                           data.seq_len=16 train.micro_batch_size=2 train.global_batch_size=2)
  "$PY" -m bench preempt_resume --out "$SCRATCH/preempt" "${args[@]}"
}

step_recompute_memory() {
  local mem=(--hidden 1024 --heads 16 --layers 4 --seq 2048 --batch 2 --vocab 49152 --loops "1,4"
             --cuda --bf16)
  [ -n "$SMOKE" ] && mem=(--hidden 64 --layers 2 --seq 32 --batch 1 --vocab 256 --loops "1,2")
  "$PY" -m bench recompute_memory "${mem[@]}"
}

# tiny shapes of the same configs for --smoke
smoke_shape() {
  [ -n "$SMOKE" ] && echo model.hidden_size=64 model.num_heads=4 model.num_layers=2 \
    model.ffn_hidden_size=128 data.seq_len=64 train.micro_batch_size=1 train.bf16=false
  return 0
}

step_mfu_129m() {
  local steps=(--steps 10)
  [ -n "$SMOKE" ] && steps=(--steps 2 --warmup 1)
  # shellcheck disable=SC2046
  "$PY" -m bench mfu configs/experiments/wikitext103/129m/per_loop_norm.yaml "${steps[@]}" \
    $(smoke_shape)
}

step_mfu_1p4b() {
  local steps=(--steps 5)
  [ -n "$SMOKE" ] && steps=(--steps 2 --warmup 1)
  # shellcheck disable=SC2046
  "$PY" -m bench mfu configs/experiments/fineweb/1p4b_baseline.yaml "${steps[@]}" $(smoke_shape)
}

# fixed K: the 1.4B shape after one step (throughput does not depend on the weights), exported,
# on random tokens of its vocabulary; the study's batch 2 x 2,048, 32 timed batches (not 128)
step_fixed_k() {
  local b=2 t=2048 n=32 w=3
  [ -n "$SMOKE" ] && b=1 t=32 n=2 w=1
  # synthetic tokens: the fineweb (webdataset) keys are dropped (null), as the kind switch needs
  # shellcheck disable=SC2046
  "$PY" -m megaloop train configs/experiments/fineweb/1p4b_baseline.yaml data.kind=synthetic \
    data.path=null data.resampled=null data.valid_shards=null \
    train.steps=1 train.global_batch_size=1 train.eval_batches=1 wandb.mode=disabled \
    train.dir="$SCRATCH/1p4b" $(smoke_shape) >&2
  "$PY" -m megaloop export "$SCRATCH/1p4b" --out "$SCRATCH/1p4b-hf" >&2
  "$PY" -c "import numpy as np; np.save('$SCRATCH/tokens.npy', \
np.random.default_rng(0).integers(0, 49152, ($n + $w) * $b * ($t + 1)))"
  "$PY" -m megaloop bench fixed-k "$SCRATCH/1p4b-hf" --data "$SCRATCH/tokens.npy" \
    --loops 1,2,3,4 --batch-size $b --seq-len $t --batches $n --warmup $w \
    --out "$SCRATCH/fixed_k.json"
  cp "$SCRATCH/fixed_k.json" "$OUT/fixed_k.json"
}
export -f step_kit step_preempt_resume step_recompute_memory smoke_shape step_mfu_129m \
  step_mfu_1p4b step_fixed_k

# --- the runner ----------------------------------------------------------------------------
failed=()

record() {  # NAME STATUS RC SECONDS LIMIT
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$OUT/steps.tsv"
  echo "[gpu.sh] $1: $2 (rc $3, $4 s of $5 s)"
  [ "$2" = ok ] || [ "$2" = skipped ] || failed+=("$1")
}

reap() {  # what a step left running: torchrun's workers start sessions of their own
  local pid f
  for f in /proc/[0-9]*/environ; do
    pid=${f#/proc/}
    pid=${pid%/environ}
    if grep -qaxzF "GPU_SH_STEP=$1" "$f" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
  done
}

run_step() {  # NAME DEFAULT_LIMIT: step_NAME under `timeout`, stdout appended to OUT/NAME.md
  local name=$1 var="LIMIT_$1" limit start rc status
  limit=${!var:-$2}
  [ -n "$SMOKE" ] && [ -z "${!var:-}" ] && limit=900  # CPU shapes: a safety net, not a budget
  start=$SECONDS
  echo "[gpu.sh] $name: started (limit $limit s)"
  set +e
  GPU_SH_STEP="$name.$$" timeout -k 5 "$limit" bash -eo pipefail -c \
    "[ \"\${GPU_TEST_STALL:-}\" = $name ] && sleep 3600; step_$name" \
    >>"$OUT/$name.md" 2>"$SCRATCH/$name.log"
  rc=$?
  set -e
  reap "$name.$$"
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  if [ $status != ok ]; then  # the end of its log, where the figures are (a file, not a pipe)
    tail -n 40 "$SCRATCH/$name.log" >"$SCRATCH/$name.tail"
    { echo; echo "[gpu.sh] $name $status (rc $rc); the end of its log:"; cat "$SCRATCH/$name.tail"
    } >>"$OUT/$name.md"
  fi
  record "$name" $status $rc $((SECONDS - start)) "$limit"
}

# --- install: the wheels into a temporary site dir, then PYTHONPATH ---------------------------
start=$SECONDS
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} = 0 ]; then
  echo "no wheels in $WHEELS: install skipped ($PY must already have what the steps import)" \
    >"$OUT/kit.md"
  record install skipped 0 0 0
else
  set +e
  timeout -k 5 "${LIMIT_install:-30}" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --disable-pip-version-check --target "$SCRATCH/site" "${wheels[@]}" \
    >"$OUT/kit.md" 2>&1
  rc=$?
  set -e
  echo "installed ${#wheels[@]} wheels from $WHEELS into $SCRATCH/site (rc $rc)" >>"$OUT/kit.md"
  [ -f "$WHEELS/MANIFEST.txt" ] && cat "$WHEELS/MANIFEST.txt" >>"$OUT/kit.md"
  export PYTHONPATH="$REPO:$SCRATCH/site${PYTHONPATH#"$REPO"}"
  record install "$([ $rc = 0 ] && echo ok || echo failed)" $rc $((SECONDS - start)) \
    "${LIMIT_install:-30}"
fi

if [ ${#failed[@]} = 0 ]; then
  run_step kit 45
fi
if [ ${#failed[@]} != 0 ]; then  # nothing can run: say so for each step
  for s in $STEPS; do record "$s" skipped 0 0 0; done
  cat "$OUT/kit.md"
  echo "[gpu.sh] FAILED before any benchmark: ${failed[*]} (see $OUT)"
  exit 1
fi
cat "$OUT/kit.md"

for s in $STEPS; do run_step "$s" "${default_limit[$s]}"; done

# the figures, then the status table last (a device call returns the end of the output)
for s in $STEPS; do
  echo
  echo "## $s"
  cat "$OUT/$s.md"
done
echo
column -t -s $'\t' "$OUT/steps.tsv" 2>/dev/null || cat "$OUT/steps.tsv"
if [ ${#failed[@]} != 0 ]; then
  echo "[gpu.sh] FAILED: ${failed[*]} (the rest passed; figures in $OUT)"
  exit 1
fi
echo "[gpu.sh] all steps passed; figures in $OUT"
