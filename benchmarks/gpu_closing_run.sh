#!/usr/bin/env bash
# One call on a 2-GPU H200 machine (nvidia-h200-x2) that produces every GPU number the issues'
# closing notes cite. Single-GPU parts run on GPU 0 bound to 16 host cores (the one-GPU machine's
# size, so the CPU AdamW thread budget matches it). Needs the peer wheels in .whl (carry it).
# Usage: bash benchmarks/gpu_closing_run.sh   (writes logs under $OUT, default ./out)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=${OUT:-out}
mkdir -p "$O"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
one="env CUDA_VISIBLE_DEVICES=0 taskset -c 0-15"
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
step "GPU tests (one GPU)"
$one timeout "${T_TESTS:-130}" python3 -m pytest -q -m cuda tests/runtime tests/annotate tests/optim \
  tests/peft tests/bench tests/planner tests/cli -p no:cacheprovider >"$O/cuda_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$O/cuda_tests.log" | tail -15
step "W1"
$one timeout "${T_W1:-80}" python3 -m annotate_offload.bench activations --workloads W1 --steps 5 --warmup 2 \
  --no-png >"$O/w1.log" 2>&1
grep -E "^\| (base|annot|save|check|Offload)|PASS|FAIL|floor =" "$O/w1.log"
step "distributed GPU tests + weak scaling (two GPUs)"
timeout "${T_DIST_TESTS:-60}" python3 -m pytest -q -m cuda tests/distributed -p no:cacheprovider >"$O/dist.log" 2>&1
grep -E "passed|failed|^FAILED" "$O/dist.log" | tail -5
timeout "${T_DIST:-100}" torchrun --nproc-per-node 2 -m annotate_offload.bench.distributed --parallel ddp \
  --steps 5 --warmup 2 >>"$O/dist.log" 2>&1
grep -vE "^W[0-9]|Warning|warn" "$O/dist.log" | grep -E "^\||PASS|FAIL|efficiency|parity" | tail -20
step "W3"
$one timeout "${T_W3:-130}" python3 -m annotate_offload.bench.optimizer --steps 5 --warmup 2 --no-diagnostics >"$O/w3.log" 2>&1
grep -E "^\||Reference" "$O/w3.log" | tail -16
step "LoRA"
$one timeout "${T_LORA:-70}" python3 -m annotate_offload.bench.lora --policy opt_out,opt_in >"$O/lora.log" 2>&1
grep -E "^\|" "$O/lora.log" | tail -6
step "llama-1b recipe"
$one timeout "${T_LLAMA:-90}" python3 -m annotate_offload train --recipe llama-1b train.train_iters=6 \
  --plot "$O/llama1b.png" >"$O/llama1b.log" 2>&1
grep -E "max \||peak device|step time|bytes offloaded" "$O/llama1b.log" | tail -6
step "done"
