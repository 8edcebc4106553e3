#!/usr/bin/env bash
# Activation offloading on one CUDA GPU: peak memory and step time of LoRA training with and
# without train.offload_activations, with and without gradient checkpointing, on a Llama of
# 8 layers x 1024 wide (intermediate 2816, vocabulary 32000, ~170 M parameters) in bf16 at
# sequence 2048 x batch 4, LoRA r=16 on every linear layer, bf16 autocast; rows plain, offload,
# ckpt, ckpt+offload, 2 warm-up + 3 steps each (the last measured by CUDA's
# max_memory_allocated). Aimed at < 3 minutes on an A100/H100-class GPU. Writes results.json and
# results.md; the +offload rows are compared with their rows without (peak ratio, step time
# ratio, largest loss difference over the steps).
#
#   bench/gpu/offload.sh [OUT] [extra arguments of rankwise bench offload]
#
# Environment: PYTHON (default: python). Extra arguments override the preset, e.g.
# --set seq=4096 or --set "rows=[plain,offload]"; the tests run this script on CPU with
# --preset tiny (no second memory there: the hooks' copying path only, no saving).
set -euo pipefail
OUT="${1:-bench/results/offload/gpu}"
shift || true
PYTHON="${PYTHON:-python}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
# bench/ on PYTHONPATH: the benchmarks are the package bench/rankwise_bench, outside rankwise
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$BENCH${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -W ignore -m rankwise_bench offload --preset gpu --out "$OUT" "$@"
