"""``rankwise bench lota-qaf``: LoTA-QAF vs LoRA on a 4-bit round-to-nearest base vs QLoRA (nf4)
on the demo task - accuracy, the merged model's accuracy *after re-quantization*, and memory,
over 3 seeds.

Rows (every setting not written here comes from the method's and optimizer's own config):

* ``lota-qaf``: rankwise's own 4-bit grid (asymmetric, group 128, RTN), ternary adapters of rank
  16 trained by ``t-signsgd`` (the classification head by its AdamW group). Merged: codes
  ``q + m`` (integer, on the grid) with the offset factors folded into float zero points, and
  ``merged-int``: the same with the zero points rounded to integers (GPTQ's format, the only
  loss the integer grid forces).
* ``lora-rtn4``: LoRA (r 8, alpha 16, AdamW 2e-3, the demo's) on the same 4-bit RTN base.
  Merged: ``W_deq + s B A`` re-quantized to the same 4-bit RTN grid.
* ``qlora-nf4``: LoRA on the bitsandbytes NF4 base (``model.quantize: nf4``). Merged: ``W_deq +
  s B A`` re-quantized to NF4 (blocks of 64, bitsandbytes' own quantizer). Not in the default
  rows: loading the demo classifier with ``model.quantize: nf4`` quantizes its new,
  uninitialised classification head, whose forward then fails inside bitsandbytes; run it with
  ``rankwise bench lota-qaf --rows qlora-nf4 --out DIR`` once that is fixed.

Memory: the model's storage (packed codes at their packed size), trainable weights, optimizer
state and the run's peak memory (rankwise's meter).
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch
from torch import nn

from rankwise.adapters.lota import LotaLayer, QuantLinear, quantize_linears
from rankwise.core import merge_adapters
from rankwise.core import weights as layer_weights
from rankwise.core.inject import replace_module
from rankwise.core.protocol import adapter_modules
from rankwise_bench.common import (DEMO_BASE, Settings, accuracy, chosen_rows, markdown_table, memory_record, mib,
                                   pct, run_row, seeded_rows, summarise, with_settings, write_results)

BITS, GROUP = 4, 128

ROWS: dict[str, dict] = {
    "lota-qaf": {**DEMO_BASE, "method": {"name": "lota-qaf", "r": 16, "bits": BITS, "group_size": GROUP},
                 "optim": {"name": "t-signsgd", "lr": 2e-3}},
    "lora-rtn4": {**DEMO_BASE, "method": {"name": "lora", "r": 8, "alpha": 16},
                  "optim": {"name": "adamw", "lr": 2e-3}},
    "qlora-nf4": {**DEMO_BASE, "model": {**DEMO_BASE["model"], "quantize": "nf4"},
                  "method": {"name": "lora", "r": 8, "alpha": 16}, "optim": {"name": "adamw", "lr": 2e-3}},
}


DEFAULT_ROWS = ("lota-qaf", "lora-rtn4")


def _rtn_base(model: nn.Module) -> None:
    """The ``lora-rtn4`` base: every linear layer but the head on the 4-bit RTN grid."""
    quantize_linears(model, "all-linear", BITS, GROUP)


def _nf4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """``w`` quantized to NF4 and back by bitsandbytes (blocks of 64, QLoRA's format)."""
    import bitsandbytes.functional as F
    packed, state = F.quantize_4bit(w.float().contiguous(), blocksize=64, quant_type="nf4")
    return F.dequantize_4bit(packed, state).float()


def _merge_requantized(model: nn.Module, requantize) -> None:
    """Replace every LoRA layer by ``requantize(W_deq + s B A)`` (in place)."""
    for path, mod in list(adapter_modules(model)):
        dense = layer_weights.dense_weight(mod).detach().float()
        for name in mod.active_names():
            dense = dense + mod.delta_weight(name).float()
        base = layer_weights.base_layer(mod)
        bias = getattr(base, "bias", None)
        new = requantize(dense, bias)
        replace_module(model, path, new)


def _rtn_layer(dense: torch.Tensor, bias) -> nn.Module:
    lin = nn.Linear(dense.shape[1], dense.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(dense)
        if bias is not None:
            lin.bias.copy_(bias.float())
    return QuantLinear.from_linear(lin, BITS, min(GROUP, dense.shape[1]))


def _nf4_layer(dense: torch.Tensor, bias) -> nn.Module:
    lin = nn.Linear(dense.shape[1], dense.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(_nf4_roundtrip(dense))
        if bias is not None:
            lin.bias.copy_(bias.float())
    return lin


def _merged_scores(row: str, session) -> dict:
    """Accuracies of the merged, re-quantized model (changes the session's model)."""
    model = session.model
    if row == "lota-qaf":
        merge_adapters(model)                       # q + m, offsets folded into the zero points
        codes_ok = all(int(m.base_layer.codes().max()) <= m.base_layer.maxq for m in model.modules()
                       if isinstance(m, LotaLayer))
        merged = accuracy(model, session)
        for m in model.modules():
            if isinstance(m, LotaLayer):
                m.base_layer.zeros.round_()         # GPTQ's integer zero points
        return {"merged_accuracy": merged, "merged_int_accuracy": accuracy(model, session),
                "codes_on_grid": codes_ok}
    _merge_requantized(model, _rtn_layer if row == "lora-rtn4" else _nf4_layer)
    return {"merged_accuracy": accuracy(model, session)}


def run(out: Path, settings: Settings | None = None) -> dict:
    """Run every row for each seed and write ``results.json`` and ``results.md``.

    Args:
        out: Output folder (each run in ``<row>/seed<k>/``).
        settings: Size of the comparison (default: 3 seeds, the demo's budget).

    Returns:
        The results written to ``results.json``.

    Raises:
        RankwiseError: On an unknown row.
    """
    s = settings or Settings()
    rows = chosen_rows("lota-qaf", s.rows, ROWS, DEFAULT_ROWS)
    if "qlora-nf4" in rows and importlib.util.find_spec("bitsandbytes") is None:
        rows = tuple(r for r in rows if r != "qlora-nf4")
    out = Path(out)
    began = time.time()

    def one(row: str, seed: int) -> dict:
        hook = _rtn_base if row == "lora-rtn4" else None
        metrics, session = run_row(with_settings(ROWS[row], s, seed), out / row / f"seed{seed}", hook)
        return {"seed": seed, "accuracy": metrics["eval_accuracy"], **memory_record(session, metrics),
                "train_time_s": metrics["train_time_s"], **_merged_scores(row, session)}
    records = seeded_rows(rows, s.seeds, one)
    keys = ("accuracy", "merged_accuracy", "merged_int_accuracy", "model_bytes", "trainable_bytes",
            "state_bytes", "peak_memory_mb", "train_time_s")
    summary = summarise(records, keys)
    result = {"settings": s.__dict__, "rows": {r: ROWS[r] for r in rows}, "runs": records,
              "summary": summary, "wall_s": time.time() - began, "torch": torch.__version__}
    write_results(out, result, markdown(result))
    return result


def markdown(result: dict) -> str:
    """``results.md`` from the record: the mean ± std table over seeds."""
    md = ["# lota-qaf on the demo task\n",
          f"{result['settings']['seeds']} seed(s); mean ± sample std. Merged accuracies are of the merged model "
          "after re-quantization to the base's format (see the module docstring).\n",
          markdown_table(result["summary"], [
              ("accuracy", "accuracy (%)", pct), ("merged_accuracy", "merged, re-quantized (%)", pct),
              ("merged_int_accuracy", "merged, integer zero points (%)", pct),
              ("model_bytes", "model MiB", mib), ("trainable_bytes", "trainable MiB", mib),
              ("state_bytes", "optimizer state MiB", mib), ("peak_memory_mb", "peak MiB", lambda x: f"{x:.0f}"),
              ("train_time_s", "train s", lambda x: f"{x:.0f}")]), ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench lota-qaf --out DIR [--rows a,b] [--seeds N] [--steps N] ...``."""
    from rankwise_bench.common import demo_main
    return demo_main(run, tuple(ROWS), argv)


if __name__ == "__main__":
    import sys
    sys.exit(main())
