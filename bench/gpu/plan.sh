#!/usr/bin/env bash
# rankwise plan against CUDA's memory counter on one GPU: the single-process rows of
# `rankwise bench plan` (every llm-finetune row, full fine-tuning with AdamW / GaLore / 8-bit /
# per-layer, a mixture adapter, accumulation, a large vocabulary, chunked loss, a BERT-style
# classifier), each predicted with `rankwise plan --device cuda` and measured with
# torch.cuda.max_memory_allocated over one step after two warm-up steps. The 2-process
# FSDP2/ddp rows need one GPU per process and are left out here (they run on CPU with gloo in
# `rankwise bench plan`). The tiny model takes seconds; the CUDA context and allocator
# fragmentation are not counted by either side. Writes results.json and results.md.
#
#   bench/gpu/plan.sh [OUT] [ROW ...]
#
# Environment: PYTHON (default: python).
set -euo pipefail
OUT="${1:-bench/results/plan/gpu}"
shift || true
PYTHON="${PYTHON:-python}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
# bench/ on PYTHONPATH: the benchmarks are the package bench/rankwise_bench, outside rankwise
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$BENCH${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -W ignore -m rankwise_bench plan --out "$OUT" --device cuda "$@"
