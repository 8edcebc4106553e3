#!/usr/bin/env bash
# lowrank-pretrain at ~1B parameters on one CUDA GPU (bf16 autocast, float32 master weights and
# optimizer state): GaLore's LLaMA-1B shape, 24 layers x 2048 wide, intermediate 5461, byte
# vocabulary (1.21 B parameters), sequence 256 x batch 32, 1000 steps, rank 512, refresh every 200,
# each row over its registry lr grid (3 runs per row).
#
#   bench/gpu/lowrank-pretrain.sh [OUT] [extra arguments of rankwise bench lowrank-pretrain]
#
# Environment: ROWS (comma-separated rows; default below), PYTHON (default: python).
# Extra arguments override size fields, e.g. --set steps=300 --set lrs=[1e-3]; the tests run this
# script on CPU at a tiny size with --set device=cpu --set hidden=16 ...
set -euo pipefail
OUT="${1:-bench/results/lowrank-pretrain-1b}"
shift || true
ROWS="${ROWS:-adamw,galore,galore-oja,sumo,q3r,nanoadam,lowrank-hb,lowrank-adam,lowrank+adamw}"
PYTHON="${PYTHON:-python}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
# bench/ on PYTHONPATH: the benchmarks are the package bench/rankwise_bench, outside rankwise
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$BENCH${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m rankwise_bench lowrank-pretrain --size 1b --rows "$ROWS" --out "$OUT" "$@"
