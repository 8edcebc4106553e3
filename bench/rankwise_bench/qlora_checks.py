"""Two checks the LLM fine-tuning benchmark runs beside its rows (:mod:`.llm_finetune`).

* :func:`requantize_drift`: how far a QLoRA model moves when its merged export (the adapter
  folded into the dequantized NF4 base, saved in bf16) is quantized to NF4 again.
* :func:`gora_phase_memory`: GoRA's gradient phase on the same model in bf16 and in NF4 (where
  each weight's gradient comes from activations and output gradients), by the shared meter.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def requantize_drift(model: nn.Module, s, heldout, tmp: Path) -> dict:
    """How far a QLoRA model moves when its merged export is quantized again.

    The merged export (the adapter folded into the dequantized NF4 base, saved in bf16) is
    loaded plain and re-quantized to NF4; each is compared with the adapted 4-bit model on
    the held-out windows (loss, and logits on one batch), beside the 4-bit base without adapter.

    Args:
        model: The trained rankwise model of the ``nf4`` row.
        s: The benchmark's :class:`~rankwise_bench.llm_finetune.Sizes`.
        heldout: Held-out windows.
        tmp: A scratch folder for the merged export.

    Returns:
        Held-out losses (4-bit base, adapter, merged bf16, re-quantized NF4), mean absolute
        logit changes, the logits' standard deviation, and the share of the adapter's loss gain
        kept after re-quantizing.
    """
    from transformers import AutoModelForCausalLM

    from rankwise.core.merged import export_merged
    from rankwise.core.ops import disable_adapters
    from rankwise.engine import evaluate, get_task
    from rankwise.recipes.model import bnb_config
    task = get_task("causal-lm")

    def auto():
        return torch.autocast(s.device.split(":")[0], dtype=torch.bfloat16)
    export_merged(model, tmp / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp / "merged", dtype=torch.bfloat16).to(s.device)
    requant = AutoModelForCausalLM.from_pretrained(
        tmp / "merged", dtype=torch.bfloat16, quantization_config=bnb_config("nf4", "bfloat16"),
        device_map={"": s.device})
    batch = task.collate([heldout[i] for i in range(min(len(heldout), s.batch))], heldout.pad_id)
    batch = {k: v.to(s.device) for k, v in batch.items() if k != "labels"}
    out: dict[str, float] = {}
    with torch.no_grad():
        ref = model.train()(**batch).logits.float()  # train mode: bitsandbytes' training kernel
        for name, m in (("adapter", model), ("merged_bf16", merged), ("requantized_nf4", requant)):
            out[f"eval_loss_{name}"] = evaluate(m.train(), task, heldout, s.batch, s.device, auto)["eval_loss"]
            diff = (m(**batch).logits.float() - ref).abs()
            out[f"logit_mean_abs_diff_{name}"] = float(diff.mean())
        with disable_adapters(model):
            out["eval_loss_base_nf4"] = evaluate(model, task, heldout, s.batch, s.device, auto)["eval_loss"]
    out["logit_std"] = float(ref.std())
    gain = out["eval_loss_base_nf4"] - out["eval_loss_adapter"]
    out["gain_kept_after_requantizing"] = ((out["eval_loss_base_nf4"] - out["eval_loss_requantized_nf4"]) / gain
                                           if gain > 0 else None)
    return out


def gora_phase_memory(folder: Path, s, data) -> dict:
    """GoRA's gradient phase on the benchmark's model loaded in bf16 and in NF4.

    Args:
        folder: The saved base model.
        s: The benchmark's sizes (``gora_batches`` calibration batches of ``batch`` windows).
        data: Training windows.

    Returns:
        ``{"bf16": ..., "nf4": ...}``: GoRA's memory report (``peak_bytes`` by the shared meter,
        ``accumulator_bytes``, ...) plus the base's bytes and what every target weight
        dequantized to float32 at once would take (``dense_fp32_bytes``).
    """
    from rankwise.adapters.gora import GoraConfig, apply_gora, gora_report
    from rankwise_bench.llm_finetune import load_base
    from rankwise.core.quant import model_bytes
    from rankwise.engine import get_task
    task = get_task("causal-lm")
    out = {}
    for row in ("bf16", "nf4"):
        model = load_base(folder, row, s.device).train()
        base = model_bytes(model)
        cal = [{k: v.to(s.device) for k, v in task.collate(
            [data[i] for i in range(b * s.batch, (b + 1) * s.batch)], data.pad_id).items()}
            for b in range(s.gora_batches)]
        apply_gora(model, GoraConfig(r=s.r, n_batches=s.gora_batches), batches=cal, loss_fn=task.mean_loss)
        rep = gora_report(model)
        out[row] = {**rep["memory"], "base_bytes": base,
                    "dense_fp32_bytes": sum(4 * m * n for m, n in rep["shapes"].values()),
                    "ranks": sorted(set(rep["ranks"].values()))}
        del model
    return out
