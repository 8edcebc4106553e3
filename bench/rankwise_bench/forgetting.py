"""``rankwise bench forgetting``: NanoAdam's forgetting claim on the reference base, read from the
comparison's own runs (issue 36 item 2).

Claim (NanoAdam, "updates only the small-magnitude weights"): keeping the large-magnitude weights
fixed "reduces the risk of catastrophic forgetting" against full fine-tuning. Measured here as
what fine-tuning costs the base on its *pretraining* distribution: the loss per token and per
byte on windows of the reference base's held-out standard-library modules (whole modules its
pretraining never read, :func:`rankwise.data.corpus.heldout_module`), before and after.

The fine-tuned models are the ``rankwise compare examples/compare-reference.yaml`` runs of the
rows ``nanoadam`` (every weight matrix masked to its 10 % smallest entries), ``full`` (AdamW on
every weight) and ``lora`` (r = 8 on every linear layer), each at the learning rate the comparison
chose on its validation split and at each of its seeds (``ROW/seedK/``): the same tuning, data,
steps and seeds as the table, so no row is tuned for this measurement. Nothing trains here; the
trained weights are read from the comparison's run folders on this machine (they are not
committed: rerun the comparison's command to rebuild them; its records make that reuse the
finished runs' settings, not their weights).

Windows: each held-out module is encoded alone (BOS first, as in pretraining), cut into
non-overlapping windows of ``seq`` tokens, and ``windows`` of them are taken evenly over the
concatenated list (no randomness). Loss per token: mean next-token cross-entropy over the scored
positions (every position after the first of a window); per byte: the summed nats over the UTF-8
bytes of those target tokens' pieces (SentencePiece's ``▁`` counted as the one space it stands
for, byte-fallback tokens as one byte).

Each run's measurement is written to ``pieces/ROW-seedK.json`` with the run's ``metrics.json``
hash and is reused while that hash matches, so the benchmark reruns in seconds and a run that
finished later is added on the next call.
"""
from __future__ import annotations

import hashlib
import platform
import statistics
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn import functional as F

from rankwise_bench.common import RESULTS, reference_base, write_json, write_results

ROWS = ("nanoadam", "full", "lora")
SEQ, WINDOWS, BATCH = 256, 96, 8


def heldout_windows(tokenizer, seq: int = SEQ, windows: int = WINDOWS) -> torch.Tensor:
    """``(windows, seq)`` token ids from the base's held-out modules (see the module docstring).

    Raises:
        ValueError: When the held-out modules hold fewer than ``windows`` full windows.
    """
    from rankwise.data.corpus import load_source_records
    cut = []
    for rec in load_source_records():
        if not rec["heldout"]:
            continue
        ids = tokenizer(rec["text"], add_special_tokens=True)["input_ids"]
        cut += [ids[i:i + seq] for i in range(0, len(ids) - seq + 1, seq)]
    if len(cut) < windows:
        raise ValueError(f"only {len(cut)} held-out windows of {seq} tokens; ask for fewer")
    step = len(cut) / windows
    return torch.tensor([cut[int(i * step)] for i in range(windows)])


def target_bytes(tokenizer, targets: torch.Tensor) -> int:
    """UTF-8 bytes of the pieces of ``targets`` (a byte-fallback piece ``<0x..>`` is one byte)."""
    pieces = tokenizer.convert_ids_to_tokens(targets.reshape(-1).tolist())
    return sum(1 if p.startswith("<0x") and p.endswith(">") else len(p.replace("▁", " ").encode())
               for p in pieces)


@torch.no_grad()
def pretraining_loss(model: torch.nn.Module, windows: torch.Tensor, n_bytes: int,
                     batch: int = BATCH) -> dict[str, float]:
    """Next-token cross-entropy of ``model`` on ``windows``: nats per token and per byte.

    Args:
        model: A causal LM (``model(input_ids).logits``).
        windows: ``(n, seq)`` token ids.
        n_bytes: UTF-8 bytes of every window's targets (:func:`target_bytes` of ``windows[:, 1:]``).
        batch: Windows per forward.

    Returns:
        ``{"loss_per_token", "loss_per_byte", "tokens", "bytes"}``.
    """
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch]
        logits = model(input_ids=ids).logits[:, :-1].float()              # (B, T-1, V)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                 reduction="sum").item()
    tokens = windows[:, 1:].numel()
    return {"loss_per_token": total / tokens, "loss_per_byte": total / n_bytes,
            "tokens": tokens, "bytes": n_bytes}


def _load_run(run_dir: Path):
    from rankwise.recipes.export import load_run
    _, model, _ = load_run(run_dir, model_path=reference_base())
    return model.float()


def run(out: Path, compare: Path | None = None, rows: tuple[str, ...] = ROWS, seq: int = SEQ,
        windows: int = WINDOWS, load: Callable[[Path], torch.nn.Module] = _load_run,
        base: Path | None = None, command: str | None = None) -> dict[str, Any]:
    """Measure every finished seed run of ``rows`` in ``compare`` and write the results.

    Args:
        out: Results folder (``results.json``, ``results.md``, ``pieces/``).
        compare: The comparison's output folder (default ``bench/results/compare-reference``).
        rows: Its rows to read.
        seq, windows: Held-out window length and count.
        load: Builds a run folder's trained model (tests pass their own).
        base: The base model folder (default: the reference base).
        command: The command line recorded in the results.

    Returns:
        The results record.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    compare = Path(compare or RESULTS / "compare-reference")
    base = Path(base or reference_base())
    tok = AutoTokenizer.from_pretrained(str(base))
    ids = heldout_windows(tok, seq, windows)
    n_bytes = target_bytes(tok, ids[:, 1:])
    before = pretraining_loss(AutoModelForCausalLM.from_pretrained(str(base)).float(), ids, n_bytes)
    runs: dict[str, list[dict]] = {}
    for row in rows:
        for run_dir in sorted((compare / row).glob("seed*")):
            if (run_dir / "metrics.json").is_file():
                runs.setdefault(row, []).append(_measure(out, row, run_dir, ids, n_bytes, load))
    res = {"command": command or f"rankwise bench forgetting --out {out}", "compare": str(compare),
           "rows": list(rows), "seq": seq, "windows": windows, "base": before, "runs": runs,
           "summary": _summary(runs, before),
           "versions": {"python": platform.python_version(), "torch": torch.__version__}}
    write_results(out, res, markdown(res))
    return res


def _measure(out: Path, row: str, run_dir: Path, ids, n_bytes: int, load) -> dict:
    """One run's record, reused from ``pieces/`` while its ``metrics.json`` is unchanged."""
    import json
    metrics_text = (run_dir / "metrics.json").read_bytes()
    digest = hashlib.sha256(metrics_text).hexdigest()[:16]
    piece = Path(out) / "pieces" / f"{row}-{run_dir.name}.json"
    if piece.is_file():
        rec = json.loads(piece.read_text())
        if rec.get("metrics_sha256") == digest:
            return rec
    metrics = json.loads(metrics_text)
    after = pretraining_loss(load(run_dir), ids, n_bytes)
    rec = {"run": run_dir.name, "metrics_sha256": digest, "after": after,
           "task_eval_loss": metrics.get("eval_loss"), "task_exact_match": metrics.get("eval_exact_match"),
           "trainable_params": metrics.get("trainable_params")}
    write_json(piece, rec)
    return rec


def _summary(runs: dict[str, list[dict]], before: dict) -> dict[str, dict]:
    out = {}
    for row, recs in runs.items():
        rise = [r["after"]["loss_per_byte"] - before["loss_per_byte"] for r in recs]
        task = [r["task_eval_loss"] for r in recs]
        out[row] = {"seeds": len(recs), "rise_per_byte_mean": statistics.fmean(rise),
                    "rise_per_byte_std": statistics.stdev(rise) if len(rise) > 1 else 0.0,
                    "task_eval_loss_mean": statistics.fmean(task),
                    "trainable_params": recs[0]["trainable_params"]}
    return out


def markdown(res: dict) -> str:
    """``results.md`` from the record."""
    b = res["base"]
    lines = ["# Forgetting on the reference base: NanoAdam vs full fine-tuning vs LoRA", "",
             f"Command: `{res['command']}` (reads the finished seed runs of `{res['compare']}`)", "",
             f"Held-out pretraining text: {res['windows']} windows of {res['seq']} tokens from the "
             f"reference base's held-out standard-library modules ({b['tokens']:,} scored tokens, "
             f"{b['bytes']:,} bytes). The base before fine-tuning: {b['loss_per_token']:.4f} nats "
             f"per token, {b['loss_per_byte']:.4f} nats per byte.", "",
             "| row | seeds | trainable | rise in held-out nats/byte (mean ± std) | relative rise "
             "| task eval loss (mean) |", "|---|---:|---:|---:|---:|---:|"]
    for row in res["rows"]:
        s = res["summary"].get(row)
        if s is None:
            lines.append(f"| {row} | 0 | — | not yet run | — | — |")
            continue
        lines.append(f"| {row} | {s['seeds']} | {s['trainable_params']:,} | "
                     f"{s['rise_per_byte_mean']:+.4f} ± {s['rise_per_byte_std']:.4f} | "
                     f"{100 * s['rise_per_byte_mean'] / b['loss_per_byte']:+.1f} % | "
                     f"{s['task_eval_loss_mean']:.4f} |")
    lines += ["", "Forgetting = held-out loss after fine-tuning - before (lower is less forgetting); "
              "every run at the learning rate the comparison chose on its validation split.",
              "", f"Versions: {res['versions']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench forgetting --out DIR [--compare DIR] [--windows N]``."""
    import sys

    from rankwise_bench.common import command_line, keyword_main
    line = command_line("forgetting", sys.argv[1:] if argv is None else argv)
    return keyword_main(lambda out, compare, windows: run(out, Path(compare), windows=windows,
                                                          command=line),
                        argv, "forgetting", compare=(str, "bench/results/compare-reference"),
                        windows=(int, WINDOWS))


__all__ = ["heldout_windows", "main", "markdown", "pretraining_loss", "run", "target_bytes"]
