#!/usr/bin/env bash
# llm-finetune at ~1B parameters on one CUDA GPU: a Llama 16 layers x 2048 wide (intermediate
# 8192, full multi-head attention, byte vocabulary: 1.07 B parameters), sequence 1024 x batch 8,
# LoRA r=16 on every linear layer; rows bf16, bf16+ckpt, nf4, nf4+ckpt, each rankwise vs
# transformers + PEFT, plus the fused LoRA path (train.fused_lora: auto) as a third side with its
# step time, tokens/s and peak memory, and that fused model compiled (train.compile) as a fourth,
# each row naming its best path; 2 warm-up + 10 timed steps per model (the first compiles).
# Aimed at < 12 minutes on an A100/H100-class GPU; writes the same results.json / results.md as `rankwise bench llm-finetune`.
# When the liger_kernel package imports (pip install liger-kernel==0.8.5 on the GPU image; it
# needs triton and CUDA and has no CPU path) a second peer runs too: PEFT on Liger's RMSNorm and
# SwiGLU kernels (--set liger=true; LIGER=0 turns it off).
#
#   bench/gpu/llm-finetune.sh [OUT] [extra arguments of rankwise bench llm-finetune]
#
# Environment: PYTHON (default: python). Extra arguments override the preset, e.g.
# --set steps=20 or --set "rows=[nf4,nf4+ckpt]"; the tests run this script on CPU at a tiny
# size with --preset tiny --set device=cpu.
set -euo pipefail
OUT="${1:-bench/results/llm-finetune/gpu}"
shift || true
PYTHON="${PYTHON:-python}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
LIGER_ARGS=()
if [ "${LIGER:-1}" != 0 ] && "$PYTHON" -c "import torch, liger_kernel; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  LIGER_ARGS=(--set liger=true)
else
  echo "llm-finetune.sh: no Liger peer (liger_kernel not importable or no CUDA)" >&2
fi
# bench/ on PYTHONPATH: the benchmarks are the package bench/rankwise_bench, outside rankwise
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$BENCH${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -W ignore -m rankwise_bench llm-finetune --preset gpu-1b --out "$OUT" "${LIGER_ARGS[@]}" "$@"
