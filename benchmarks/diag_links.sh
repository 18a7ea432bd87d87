#!/usr/bin/env bash
# Session 3's link diagnosis on nvidia-h200-x2: topology, NCCL's transport, diag_links.py under
# NCCL settings, then the FSDP2 / DDP weak-scaling bench under the settings worth trying.
# Usage: bash benchmarks/diag_links.sh   (logs under $OUT)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
O=${OUT:-out}; mkdir -p "$O"
{ nvidia-smi topo -m; nvidia-smi nvlink -s | head -12; nvidia-smi -q | grep -iA3 "p2p\|Bus Id" | head -30; } >"$O/topo.log" 2>&1
head -20 "$O/topo.log"
NCCL_DEBUG=INFO timeout 60 torchrun --nproc-per-node 2 benchmarks/diag_links.py --iters 4 >"$O/nccl_info.log" 2>&1
grep -E "^\||^world" "$O/nccl_info.log"
grep -E "via|Channel 00|P2P|SHM|NET|transport|nChannels|Using" "$O/nccl_info.log" | grep -v "^W" | sort -u | head -25
for v in "NCCL_PROTO=^LL" "NCCL_PROTO=Simple" "NCCL_P2P_LEVEL=SYS" "NCCL_MAX_NCHANNELS=2" "NCCL_SHM_DISABLE=1"; do
  echo "== $v"; env $v timeout 60 torchrun --nproc-per-node 2 benchmarks/diag_links.py >>"$O/diag_links.log" 2>&1
  grep -E "^\||^world" "$O/diag_links.log" | tail -9
done
for v in ${BENCH_VARIANTS:-"NCCL_PROTO=Simple:fsdp" "NCCL_PROTO=Simple:ddp"}; do
  e=${v%%:*}; p=${v##*:}; d="$O/$(echo $e | tr -c 'A-Za-z0-9\n' '_')"; mkdir -p "$d"
  echo "== $p with $e"; env $e timeout 120 torchrun --nproc-per-node 2 -m annotate_offload.bench.distributed --parallel $p \
    --steps 5 --warmup 2 --bind >"$d/$p.log" 2>&1
  grep -vE "^W[0-9]|Warning|warn" "$d/$p.log" | grep -E "^\| (1 GPU|2 GPUs)|efficiency|share|Error" | tail -12
done
