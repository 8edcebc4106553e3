"""``report.json`` -> ``report.md``: the numbers of one ``rankwise compress`` run, readable."""
from __future__ import annotations

from typing import Any


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def _quality(metrics: dict[str, float] | None) -> str:
    if not metrics:
        return "n/a"
    if "eval_accuracy" in metrics:
        return f"accuracy {metrics['eval_accuracy']:.2%}"
    return f"perplexity {metrics['eval_perplexity']:.4f}"


def summary_line(report: dict[str, Any]) -> str:
    """One line: method, quality before -> after, bytes before -> after, time."""
    h = report.get("heldout") or {}
    return (f"{report['method']}: held-out {_quality(h.get('before'))} -> {_quality(h.get('after'))}; "
            f"weights {_mib(report['bytes_before'])} -> {_mib(report['bytes_after'])} MiB; "
            f"{report['time_s']['total']:.1f} s")


def to_markdown(report: dict[str, Any]) -> str:
    """The Markdown of a compression report (the shape :func:`rankwise.recipes.compress.measure`
    writes)."""
    h = report.get("heldout") or {}
    t = report["time_s"]
    lines = [f"# rankwise compress: {report['method']}", "",
             f"Model `{report.get('model', '?')}` ({report.get('task', '?')}), "
             f"{len(report['layers'])} layers compressed, calibration "
             f"{report.get('calibration', {}).get('sequences', '?')} x "
             f"{report.get('calibration', {}).get('length', '?')} tokens "
             f"from `{report.get('calibration', {}).get('source', '?')}`.", "",
             "| measure | before | after |", "|---|---:|---:|",
             f"| held-out | {_quality(h.get('before'))} | {_quality(h.get('after'))} |",
             f"| model weights, MiB | {_mib(report['bytes_before'])} | {_mib(report['bytes_after'])} |",
             f"| compressed layers, MiB | {_mib(report['target_bytes_before'])} | "
             f"{_mib(report['target_bytes_after'])} |",
             f"| compressed layers, parameters | {report['target_params_before']:,} | "
             f"{report['target_params_after']:,} |", "",
             f"Time: calibration + compression {t['compress']:.1f} s, evaluation {t['eval']:.1f} s, "
             f"total {t['total']:.1f} s; calibration activations held at once: "
             f"{report.get('activation_mb_peak', 0):.2f} MiB (one block's inputs, outputs and Gram "
             f"matrices).", ""]
    kv = h.get("kv_cache")
    if kv:
        how = f" at {kv['bits']} bits (chunk {kv['chunk']})" if "bits" in kv else ""  # fp: none
        lines += [f"KV cache `{kv['name']}`{how}: held-out perplexity "
                  f"{kv['eval_perplexity']:.4f}, {kv['bytes_per_token']:.1f} bytes per token "
                  f"(float16 cache: {kv['fp16_bytes_per_token']}).", ""]
    r = report.get("restore")
    if r:
        lines += [f"RestoreLCC: {len(r['heads'])} of {r['heads_total']} heads restored "
                  f"({r['trainable_params']:,} trained parameters, {r['steps']} steps at lr {r['lr']}), held-out "
                  f"{_quality(r.get('heldout_pruned'))} after pruning -> {_quality(h.get('after'))} restored; "
                  f"bias stored as: {r['bias_storage']}; every zero unchanged: {r['zeros_unchanged']}.", ""]
    lines += ["| layer | shape | rel. error ‖WX−ŴX‖²/‖WX‖² | bytes before | bytes after | s |",
              "|---|---|---:|---:|---:|---:|"]
    for path, r in report["layers"].items():
        lines.append(f"| `{path}` | {r['shape'][0]}x{r['shape'][1]} | {r['rel_error']:.5f} | "
                     f"{r['bytes_before']:,} | {r['bytes_after']:,} | {r['seconds']:.2f} |")
    return "\n".join(lines) + "\n"
