#!/usr/bin/env bash
# The GPU checks, as one run on a lent H200 (docs/benchmarks.md records the figures):
# 1. one rank under torchrun with NCCL: 20 steps, SIGUSR1 at step 10, resume, same losses;
# 2. activation memory of each train.recompute option (CUDA peak beside the saved-tensor count
#    and `megaloop plan`'s figure);
# 3. bf16 training steps of the 129M and 1.4B shapes with MFU;
# 4. the fixed-K benchmark at the study's batch 2 x 2,048 tokens, 128 timed batches, on an
#    export of the 1.4B shape.
#   bash bench/gpu.sh [OUT]          (OUT: where the tables and JSON go; default runs/gpu)
#   SMOKE=1 bash bench/gpu.sh        (the same flow with tiny shapes, to try it on a CPU first:
#                                     ~3 min on 2 cores)
# PY: a Python with requirements.txt installed (on a bare GPU machine, carry them as wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
mkdir -p "$OUT"
shape=() steps=(10 5) fk=(--batch-size 2 --seq-len 2048 --batches 128 --warmup 3)
mem=(--hidden 1024 --heads 16 --layers 4 --seq 2048 --batch 2 --vocab 49152 --loops 1,4 --cuda
     --bf16)
if [ -n "${SMOKE:-}" ]; then
  shape=(model.hidden_size=64 model.num_heads=4 model.num_layers=2 model.ffn_hidden_size=128
         data.seq_len=64 train.micro_batch_size=1 train.bf16=false)
  steps=(2 2) fk=(--batch-size 1 --seq-len 32 --batches 2 --warmup 1)
  mem=(--hidden 64 --layers 2 --seq 32 --batch 1 --vocab 256 --loops 1,2)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
  | tee "$OUT/gpu.txt" || echo "no GPU" | tee "$OUT/gpu.txt"

"$PY" bench/preempt_resume.py "$OUT/preempt" | tee "$OUT/preempt_resume.md"
"$PY" bench/recompute_memory.py "${mem[@]}" | tee "$OUT/recompute_memory.md"

"$PY" bench/mfu.py configs/experiments/wikitext103/129m/per_loop_norm.yaml \
  --steps "${steps[0]}" "${shape[@]}" | tee "$OUT/mfu_129m.md"
"$PY" bench/mfu.py configs/experiments/fineweb/1p4b_baseline.yaml --steps "${steps[1]}" "${shape[@]}" \
  | tee "$OUT/mfu_1p4b.md"

# fixed K: the 1.4B shape after one step (throughput does not depend on the weights), on random
# tokens of its vocabulary
"$PY" -m megaloop train configs/experiments/fineweb/1p4b_baseline.yaml data.kind=synthetic \
  train.steps=1 train.global_batch_size=1 train.eval_batches=1 train.dir="$OUT/1p4b" \
  "${shape[@]}"
"$PY" -m megaloop export "$OUT/1p4b" "$OUT/1p4b-hf"
"$PY" -c "import numpy as np; np.save('$OUT/tokens.npy', \
np.random.default_rng(0).integers(0, 49152, 131 * 2 * 2049))"
"$PY" -m megaloop bench fixed-k "$OUT/1p4b-hf" --data "$OUT/tokens.npy" --loops 1,2,3,4 \
  "${fk[@]}" --out "$OUT/fixed_k.json" | tee "$OUT/fixed_k.md"
