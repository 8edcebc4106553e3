"""``results.md`` of ``rankwise bench llm-finetune`` (and its ``-dora`` and ``-fused`` presets),
rendered from the record alone."""
from __future__ import annotations

from rankwise_bench.common import ordered

DORA = "dora-"  # row prefix: the row after it, with DoRA on both sides
FUSED_TARGET = 0.85  # issue 22: the fused side's step time and peak memory vs PEFT's
BEST_TARGETS = (0.8, 0.85)  # issue 39: the best path's step time and peak memory vs PEFT's
TARGETS = {"step_time_ratio": 1.0, "memory_ratio": 1.0, "nf4_base_bytes_ratio": 0.30}
VERSIONS = ("python", "torch", "transformers", "peft", "bitsandbytes", "machine", "gpu")  # _versions()'s order


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    s = res["sizes"]
    rows = ordered(res["rows"], s["rows"])
    dora = any(r.startswith(DORA) for r in rows)
    lines = ["# LLM fine-tuning: rankwise vs transformers + PEFT", "",
             f"Command: `{res['command']}`", "",
             f"Llama {s['layers']}x{s['hidden']} (intermediate {s['intermediate']}, "
             f"{res['params'] / 1e6:.1f}M parameters, byte vocabulary), LoRA r={s['r']} alpha="
             f"{s['alpha']:g} on all linear layers"
             + (" (`dora-` rows: DoRA, `use_dora` on both sides, magnitudes copied)" if dora else "")
             + f", AdamW lr {s['lr']:g}, batch {s['batch']} x "
             f"{s['seq']} tokens of stdlib source, {s['warmup']} warm-up + {s['steps']} timed steps "
             f"per model, interleaved; device {res['device']}; timer: {res['timer']}.", "",
             "| row | step s (rankwise / PEFT) | ratio | tokens/s (rankwise / PEFT) | peak MiB "
             "(rankwise / PEFT) | ratio | base weights MiB | loss after last step (rankwise / PEFT) "
             "| held-out loss (rankwise / PEFT) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, r in rows.items():
        a, b = r["rankwise"], r["peft"]
        lines.append(
            f"| {row} | {a['step_s']:.3f} / {b['step_s']:.3f} | {r['step_time_ratio']:.3f} | "
            f"{a['tokens_per_s']:.0f} / {b['tokens_per_s']:.0f} | {a['peak_bytes'] / 2**20:.1f} / "
            f"{b['peak_bytes'] / 2**20:.1f} | {r['memory_ratio']:.3f} | "
            f"{r['base_weight_bytes'] / 2**20:.1f} | {a['loss_last_step']:.4f} / "
            f"{b['loss_last_step']:.4f} | {a['eval_loss']:.4f} / {b['eval_loss']:.4f} |")
    fused_rows = {row: r for row, r in rows.items() if "fused" in r}
    if fused_rows:
        lines += ["", "Fused LoRA path (`train.fused_lora: auto`; the rankwise columns above are "
                  "the plain path):", "",
                  "| row | step s fused | tokens/s fused | fused / PEFT step | fused / plain step | "
                  "peak MiB fused | "
                  "fused / PEFT memory | fused / plain memory | max loss diff fused vs plain |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row, r in fused_rows.items():
            f = r["fused"]
            lines.append(f"| {row} | {f['step_s']:.3f} | {f['tokens_per_s']:.0f} | "
                         f"{r['fused_step_time_ratio']:.3f} | "
                         f"{r['fused_vs_plain_step']:.3f} | {f['peak_bytes'] / 2**20:.1f} | "
                         f"{r['fused_memory_ratio']:.3f} | {r['fused_vs_plain_memory']:.3f} | "
                         f"{r['fused_vs_plain_max_loss_diff']:.2e} |")
        lines += ["", f"Fused targets: step time and peak memory <= {FUSED_TARGET}x PEFT's."]
    lines += _compiled_lines(rows)
    liger_rows = {row: r for row, r in rows.items() if "liger" in r}
    if liger_rows:
        lines += ["", "Liger peer (PEFT on Liger's RMSNorm and SwiGLU kernels; RoPE and the fused "
                  "loss off, see the module docstring):", "",
                  "| row | step s Liger | tokens/s Liger | Liger / PEFT step | peak MiB Liger | "
                  "Liger / PEFT memory | fused / Liger step | fused / Liger memory | "
                  "max loss diff Liger vs PEFT |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row, r in liger_rows.items():
            g = r["liger"]
            lines.append(f"| {row} | {g['step_s']:.3f} | {g['tokens_per_s']:.0f} | "
                         f"{r['liger_step_time_ratio']:.3f} | {g['peak_bytes'] / 2**20:.1f} | "
                         f"{r['liger_memory_ratio']:.3f} | {r.get('fused_vs_liger_step', float('nan')):.3f} | "
                         f"{r.get('fused_vs_liger_memory', float('nan')):.3f} | "
                         f"{r['liger_max_loss_diff']:.2e} |")
    lines += ["", f"Targets: step time <= {TARGETS['step_time_ratio']}x PEFT and peak memory <= "
              f"{TARGETS['memory_ratio']}x PEFT on every row; nf4 base weight bytes <= "
              f"{TARGETS['nf4_base_bytes_ratio']}x the bf16 base's."]
    if res.get("nf4_base_bytes_ratio") is not None:
        lines.append(f"nf4 / bf16 base weight bytes: {res['nf4_base_bytes_ratio']:.3f}.")
    lines += ["", "Fastest-step ratios (a noise gauge): " + ", ".join(
        f"{row} {r['step_time_ratio_min']:.3f}" for row, r in rows.items()) + ". PEFT side: "
        + "; ".join(f"{row}: {r['peft_setup']}" for row, r in rows.items()) + "."]
    q = rows.get("nf4", {}).get("requantize")
    if q:
        kept = q["gain_kept_after_requantizing"]
        lines += ["", "Re-quantizing the merged QLoRA model (nf4 row, rankwise): held-out loss "
                  f"4-bit base {q['eval_loss_base_nf4']:.4f}, with adapter {q['eval_loss_adapter']:.4f}, "
                  f"merged bf16 {q['eval_loss_merged_bf16']:.4f}, merged re-quantized to NF4 "
                  f"{q['eval_loss_requantized_nf4']:.4f}"
                  + (f" ({100 * kept:.0f}% of the adapter's gain kept)" if kept is not None else "")
                  + f"; mean |logit change| vs the adapted model: merged bf16 "
                  f"{q['logit_mean_abs_diff_merged_bf16']:.4f}, re-quantized "
                  f"{q['logit_mean_abs_diff_requantized_nf4']:.4f} (logit std {q['logit_std']:.3f})."]
    g = res.get("gora_gradient_phase")
    if g:
        lines += ["", "GoRA's gradient phase on the same model ({} calibration batches; peak by the shared "
                  "meter, accumulators included): ".format(s["gora_batches"]) + "; ".join(
                      f"{row} base {v['base_bytes'] / 2**20:.1f} MiB, peak {v['peak_bytes'] / 2**20:.1f} MiB "
                      f"(accumulators {v['accumulator_bytes'] / 2**20:.1f} MiB, gradients from "
                      f"{'activations' if v['via_activations'] else '.grad'})" for row, v in g.items())
                  + f"; every target dequantized to fp32 at once would be "
                    f"{next(iter(g.values()))['dense_fp32_bytes'] / 2**20:.1f} MiB."]
    lines += ["", f"Peak memory = {res['memory_definition']}", "",
              f"Versions: {ordered(res['versions'], VERSIONS)}. Total time {res['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def _compiled_lines(rows: dict) -> list[str]:
    """The compiled side's table and every row's best path (empty without a compiled side)."""
    compiled = {row: r for row, r in rows.items() if "compiled" in r}
    if not compiled:
        return []
    lines = ["", "Compiled fused path (`train.compile: true` on the fused side; its first step "
             "compiles):", "",
             "| row | step s compiled | tokens/s compiled | compiled / PEFT step | compiled / fused "
             "step | peak MiB compiled | compiled / PEFT memory | compile s | max loss diff compiled "
             "vs fused | best path | best / PEFT step | best / PEFT memory |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for row, r in compiled.items():
        c = r["compiled"]
        lines.append(f"| {row} | {c['step_s']:.3f} | {c['tokens_per_s']:.0f} | "
                     f"{r['compiled_step_time_ratio']:.3f} | {r['compiled_vs_fused_step']:.3f} | "
                     f"{c['peak_bytes'] / 2**20:.1f} | {r['compiled_memory_ratio']:.3f} | "
                     f"{c['compile_s']:.1f} | {r['compiled_vs_fused_max_loss_diff']:.2e} | "
                     f"{r['best_path']} | {r['best_step_time_ratio']:.3f} | {r['best_memory_ratio']:.3f} |")
    return lines + ["", f"Best-path targets (issue 39): step <= {BEST_TARGETS[0]}x and peak memory "
                    f"<= {BEST_TARGETS[1]}x PEFT's on every row."]


__all__ = ["markdown"]
