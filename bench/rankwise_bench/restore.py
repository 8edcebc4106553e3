"""``rankwise bench restore``: RestoreLCC against LoRA recovery fine-tuning at equal steps, on
Wanda and SparseGPT prunings of the reference base.

The model is the reference base (:func:`rankwise_bench.common.reference_base`: a 6.45M-parameter
Llama that rankwise pretrained on the standard library's source, with its SentencePiece
tokenizer), loaded in float32 as it is; ``Sizes.base`` names another folder (tests pass a tiny
one). Windows (:mod:`rankwise_bench.base_text`, evenly spaced, no draw): calibration windows of
the training modules (``bench compress``'s), recovery windows of the training modules at other
starts (offset by half the calibration spacing), every ``val_every``-th of them kept out of
training as validation, and held-out windows of the held-out modules (the split the base was
pretrained with). Quality: loss on the held-out windows per token and per byte (total nats /
UTF-8 bytes of the scored tokens, so the byte numbers compare with the card and ``bench compress``).

Each pruning (the same calibration windows) is recovered, in the same number of steps and
batches of the same recovery windows, by

* **RestoreLCC** (``compress.restore``; the probes are the calibration windows): the learned
  ``V_hᵀ v_h + b_h`` folded into ``o_proj``'s bias, so the pruned weights are untouched;
* **LoRA recovery** (r=8 on every linear layer, alpha 16, the pruned base frozen), evaluated
  as trained (adapters beside the sparse weights), merged (``W + sBA``: the zeros fill in), and
  merged then re-masked to the pruned pattern (the sparsity kept, part of the update lost).

Each method runs at two learning rates; the one with the lower validation loss is the method's
row, and both are listed. The sparsity is the fraction of exact zeros in the pruned layers of the
model each method would ship.

Decision (issue 35 item 2; sizes): the byte-level Llama this benchmark trained itself (393,856
parameters) is gone; recovery only means something on a trained model. The base has ~16x its
parameters and 2x its window tokens, so the real run is resized to fit 18 minutes of one core:
two prunings (Wanda 2:4, the one the byte-level run moved most, and SparseGPT 50%; not Wanda 50%
or SparseGPT 2:4), 96 steps x 8 windows of 128 tokens (was 120 x 8 x 128 bytes), 256 recovery
windows + 32 validation, 32 calibration/probe windows, 64 held-out windows, 2 learning rates per
method (RestoreLCC 1e-2 / 1e-1, LoRA 1e-3 / 1e-2, the grids of the byte-level run), and no
all-heads RestoreLCC row (``all_heads_lr``). Timed first at smoke size: 8 steps of one recovery
took ~5 s of one core (~0.6 s a step), so 8 runs of 96 steps plus the prunings and evaluations
came to ~10 minutes; the committed run took 8.6 minutes (45-80 s a recovery).

Every run (the pruning's own measurement, each method at each learning rate) is a piece
(``OUT/pieces/PRUNING/RUN.json``) reused when the settings it depends on match, so a killed run
continues where it stopped; ``--set`` changes a size (``rankwise bench restore --help``).
"""
from __future__ import annotations

import copy
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.engine import evaluate, get_task
from rankwise.recipes.compress import Windows
from rankwise_bench.common import reference_base, write_results
from rankwise_bench.compress import Pieces


@dataclass
class Sizes:
    """What sets the benchmark's size (default: 8.6 minutes of one shared core, measured).

    Attributes:
        base: The causal LM, a folder transformers loads with its SentencePiece-style tokenizer
            (``None``: the reference base).
        seq: Tokens per window (every kind).
        calib_windows: Calibration windows of the prunings (also RestoreLCC's probes).
        heldout_windows: Held-out windows (quality).
        prunings: ``[(label, compress config)]`` of the pruned models.
        steps: Recovery steps, the same for every method.
        batch_size: Windows per step.
        recovery_windows: Training-module windows the recoveries train on.
        val_windows: Further training-module windows that pick each method's learning rate.
        restore_lrs: RestoreLCC's learning rates (a decade above the paper's 1e-3, as in the
            byte-level run: short runs left the bias short at 1e-3).
        all_heads_lr: Also run RestoreLCC on every head at this learning rate (``None``: not).
        lora_lrs: LoRA's learning rates.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        heads: RestoreLCC's fraction of heads.
        threads: torch intra-op threads.
        seed: Seeds the compressors, RestoreLCC and the batch order.
    """

    base: str | None = None
    seq: int = 128
    calib_windows: int = 32
    heldout_windows: int = 64
    prunings: tuple = (("wanda 2:4", {"method": "wanda", "pattern": "2:4"}),
                       ("sparsegpt 50%", {"method": "sparsegpt", "sparsity": 0.5}))
    steps: int = 96
    batch_size: int = 8
    recovery_windows: int = 256
    val_windows: int = 32
    restore_lrs: tuple = (1e-2, 1e-1)
    all_heads_lr: float | None = None
    lora_lrs: tuple = (1e-3, 1e-2)
    lora_r: int = 8
    lora_alpha: float = 16.0
    heads: float = 0.25
    threads: int = 1
    seed: int = 0


def _setting(s: Sizes) -> dict:
    """The sizes every piece depends on (not the lists of prunings and learning rates)."""
    drop = ("prunings", "restore_lrs", "all_heads_lr", "lora_lrs", "threads")
    return {k: v for k, v in asdict(s).items() if k not in drop}


def _data(s: Sizes) -> tuple[torch.nn.Module, dict, dict]:
    """The base in float32, its windows (``calib``, ``train``, ``val``, ``heldout``) and what
    they are (tokens and bytes scored)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rankwise_bench.base_text import base_info, module_stream, spaced_windows
    folder = Path(s.base) if s.base else reference_base()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    train_ids, train_bytes, train_info = module_stream(tok, heldout=False)
    held_ids, held_bytes, held_info = module_stream(tok, heldout=True)
    calib, _ = spaced_windows(train_ids, train_bytes, s.calib_windows, s.seq)
    half = max(1, (train_ids.numel() - s.seq) // max(1, s.calib_windows - 1) // 2)
    n = s.recovery_windows + s.val_windows
    rec, _ = spaced_windows(train_ids[half:], train_bytes[half:], n, s.seq)
    every = max(1, n // max(1, s.val_windows))
    is_val = torch.zeros(n, dtype=torch.bool)
    is_val[torch.arange(every - 1, n, every)[:s.val_windows]] = True
    held, held_win_bytes = spaced_windows(held_ids, held_bytes, s.heldout_windows, s.seq)
    pad = tok.pad_token_id or 0
    info = base_info(folder, model, tok, train_info, held_info, held, held_win_bytes)
    windows = {"calib": calib, "train": rec[~is_val], "val": Windows(rec[is_val], pad_id=pad),
               "heldout": Windows(held, pad_id=pad)}
    return model, windows, info


def _batches(ids: torch.Tensor, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    """The same ``steps`` batches for every method: seeded permutations, epoch after epoch (the
    order RestoreLCC's own training draws at the same seed)."""
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        order += torch.randperm(len(ids), generator=g).tolist()
    return [ids[order[k * batch:(k + 1) * batch]] for k in range(steps)]


def _sparsity(model: torch.nn.Module, paths: list[str]) -> float:
    """Fraction of exact zeros over the weights of ``paths``."""
    zeros = total = 0
    for p in paths:
        w = model.get_submodule(p).weight
        zeros += int((w == 0).sum())
        total += w.numel()
    return zeros / total


class _Score:
    """Loss per token and per byte on the held-out windows, per token on validation."""

    def __init__(self, w: dict, info: dict) -> None:
        self.w, self.per_byte = w, info["scored_tokens"] / info["scored_bytes"]

    def loss(self, model, which: str) -> float:
        return evaluate(model, get_task("causal-lm"), self.w[which], 32)["eval_loss"]

    def heldout(self, model) -> dict:
        nats = self.loss(model, "heldout")
        return {"nats_per_token": nats, "nats_per_byte": nats * self.per_byte}


def _lora(pruned, paths, batches, lr, s: Sizes, score: _Score) -> dict:
    """LoRA recovery of a copy of ``pruned``: trained, merged, merged then re-masked."""
    import rankwise
    model = copy.deepcopy(pruned)
    masks = {p: model.get_submodule(p).weight.detach() != 0 for p in paths}
    rankwise.apply(model, "lora", r=s.lora_r, alpha=s.lora_alpha, targets="all-linear")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / len(batches))
    model.eval()
    t0 = time.perf_counter()
    for ids in batches:
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    seconds = time.perf_counter() - t0
    trained = {**score.heldout(model), "val": score.loss(model, "val")}
    rankwise.merge_and_unload(model)
    merged = {**score.heldout(model), "sparsity": _sparsity(model, paths)}
    with torch.no_grad():
        for p, keep in masks.items():
            model.get_submodule(p).weight.mul_(keep)
    remasked = {**score.heldout(model), "sparsity": _sparsity(model, paths)}
    return {"lr": lr, "trainable_params": sum(p.numel() for p in params), "seconds": seconds,
            "trained": trained, "merged": merged, "remasked": remasked, "final_loss": float(loss.detach())}


def _restore(dense, pruned, paths, o_paths, w: dict, lr, s: Sizes, score: _Score, heads: float) -> dict:
    """RestoreLCC on a copy of ``pruned`` (dense head outputs from ``dense``)."""
    from rankwise.compress.config import RestoreConfig
    from rankwise.compress.restore import RestoreLCC
    cfg = RestoreConfig(enabled=True, probes=s.calib_windows, heads=heads, steps=s.steps, lr=lr,
                        batch_size=s.batch_size)
    lcc = RestoreLCC(cfg, o_paths, dense.config.num_attention_heads, seed=s.seed)
    lcc.record_dense(dense, w["calib"])
    model = copy.deepcopy(pruned)
    t0 = time.perf_counter()
    info = lcc.restore(model, w["train"])
    seconds = time.perf_counter() - t0
    same = all(torch.equal(model.get_submodule(p).weight, pruned.get_submodule(p).weight) for p in paths)
    return {"lr": lr, "heads_fraction": heads, "trainable_params": info["trainable_params"], "seconds": seconds,
            **score.heldout(model), "val": score.loss(model, "val"), "sparsity": _sparsity(model, paths),
            "weights_unchanged": same, "heads": info["heads"], "loss_first": info["loss_first"],
            "loss_last": info["loss_last"]}


def _runs(s: Sizes) -> list[tuple[str, str, float, float | None]]:
    """``[(piece name, method, lr, heads fraction)]`` of one pruning."""
    out = [(f"restore-lr{lr:g}", "restore", lr, s.heads) for lr in s.restore_lrs]
    if s.all_heads_lr is not None:
        out.append((f"restore-all-heads-lr{s.all_heads_lr:g}", "restore", s.all_heads_lr, 1.0))
    return out + [(f"lora-lr{lr:g}", "lora", lr, None) for lr in s.lora_lrs]


def _row(label: str, raw: dict, dense, w: dict, s: Sizes, score: _Score, pieces: Pieces, console) -> dict:
    """One pruning: its pruned model's quality and every recovery run (pieces reused)."""
    from rankwise.compress.pipeline import compress_model
    state: dict = {}

    def pruned():
        if not state:
            entry = registry.get("compressor", raw["method"])
            comp = entry.builder(from_dict(entry.config_cls, {**raw, "seed": s.seed}, "compress"))
            model = copy.deepcopy(dense)
            chunks = [{"input_ids": c, "attention_mask": torch.ones_like(c)} for c in w["calib"].split(8)]
            state["paths"] = list(compress_model(model, comp, chunks, "all-linear").layers)
            state["model"] = model
        return state["model"], state["paths"]

    got = pieces.get("pruned", raw)
    if got is None:
        model, paths = pruned()
        got = {**score.heldout(model), "val": score.loss(model, "val"), "sparsity": _sparsity(model, paths)}
        pieces.put("pruned", raw, got)
    row = {"pruning": label, "config": raw, "pruned": got, "restore": [], "lora": []}
    o_paths = [n for n, _ in dense.named_modules() if n.endswith("o_proj")]
    batches = None
    for name, method, lr, heads in _runs(s):
        key = {**raw, "method_run": name}
        rec = pieces.get(name, key)
        if rec is None:
            model, paths = pruned()
            if method == "restore":
                rec = _restore(dense, model, paths, o_paths, w, lr, s, score, heads)
            else:
                batches = batches or _batches(w["train"], s.steps, s.batch_size, s.seed)
                rec = _lora(model, paths, batches, lr, s, score)
            pieces.put(name, key, rec)
        if name.startswith("restore-all-heads"):
            row["restore_all_heads"] = rec
        else:
            row[method].append(rec)
        if console is not None:
            q = rec if method == "restore" else rec["trained"]
            console.print(f"restore | {label} | {name}: {q['nats_per_byte']:.4f} nats/byte, "
                          f"{rec['seconds']:.1f} s")
    row["restore_best"] = min(range(len(row["restore"])), key=lambda i: row["restore"][i]["val"])
    row["lora_best"] = min(range(len(row["lora"])), key=lambda i: row["lora"][i]["trained"]["val"])
    return row


def run(out: Path, sizes: Sizes | None = None, console=None, command: str | None = None) -> dict:
    """Run the benchmark; write ``results.json`` and ``results.md`` (pieces under ``OUT/pieces``).

    Args:
        out: Output folder (created).
        sizes: Override the default :class:`Sizes` (tests use a tiny one).
        console: A ``rich`` console for progress lines (default: stderr).
        command: The command line recorded (default: the plain command).

    Returns:
        The results written to ``results.json``.

    Raises:
        RankwiseError: No reference base built.
    """
    import re

    from rich.console import Console
    console = console or Console(stderr=True)
    s = sizes or Sizes()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    began = time.time()
    results = {"sizes": asdict(s), "python": platform.python_version(), "torch": torch.__version__,
               "machine": f"{platform.machine()}, {s.threads} torch threads",
               "command": command or f"rankwise bench restore --out {out}", "rows": []}
    try:
        dense, w, info = _data(s)
        score = _Score(w, info)
        store = Pieces(out / "pieces" / "dense", s)
        store.setting = _setting(s)
        base = store.get("dense", {}) or {**score.heldout(dense), "val": score.loss(dense, "val")}
        store.put("dense", {}, base)
        results["base"] = {**info, "dense": base}
        for label, raw in s.prunings:
            pieces = Pieces(out / "pieces" / re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-"), s)
            pieces.setting = _setting(s)
            row = _row(label, raw, dense, w, s, score, pieces, console)
            results["rows"].append(row)
            r, lo = row["restore"][row["restore_best"]], row["lora"][row["lora_best"]]
            console.print(f"restore | {label}: pruned {row['pruned']['nats_per_byte']:.4f}, RestoreLCC "
                          f"{r['nats_per_byte']:.4f} (lr {r['lr']}), LoRA {lo['trained']['nats_per_byte']:.4f} "
                          f"(lr {lo['lr']}; re-masked {lo['remasked']['nats_per_byte']:.4f}) nats/byte")
    finally:
        torch.set_num_threads(threads)
    results["wall_s"] = time.time() - began
    write_results(out, results, markdown(results))
    return results


def main(argv: list[str] | None = None) -> dict:
    """``rankwise bench restore --out DIR [--set steps=32] [--set base=FOLDER] ...``."""
    from rankwise_bench.common import preset_main
    return preset_main(argv, name="restore", doc=__doc__, presets={"default": Sizes()}, default="default",
                       run=run)


def _q(r: dict) -> str:
    """``nats/byte (nats/token)``."""
    return f"{r['nats_per_byte']:.4f} ({r['nats_per_token']:.4f})"


def markdown(results: dict) -> str:
    """``results.md`` from the record."""
    s, i = results["sizes"], results["base"]
    sh = i["shape"]
    md = ["# restore: RestoreLCC vs LoRA recovery fine-tuning, on the reference base", "",
          f"Python {results['python']}, torch {results['torch']}, {results['machine']}; wall "
          f"{results['wall_s'] / 60:.1f} min. Produced by `{results['command']}`.", "",
          f"Model: `{i['base']}` ({sh['layers']} layers x {sh['hidden']}, {sh['heads']} heads / {sh['kv_heads']} "
          f"key-value heads, {i['params']:,} parameters, vocabulary {i['vocab']:,}; dense held-out "
          f"{_q(i['dense'])} nats per byte (per token)), pruned with {s['calib_windows']} calibration windows of "
          f"{s['seq']} tokens of the training modules. Recovery: {s['steps']} steps x {s['batch_size']} windows "
          f"from {s['recovery_windows']} other training-module windows, the same batches for both methods; "
          f"learning rate per method picked on {s['val_windows']} further training-module windows. "
          f"RestoreLCC: the {s['calib_windows']} calibration windows as probes, {s['heads']:.0%} of the heads. "
          f"LoRA: r={s['lora_r']}, alpha {s['lora_alpha']:g}, every linear layer. Quality: held-out loss on "
          f"{s['heldout_windows']} windows of the held-out modules ({i['scored_tokens']:,} tokens, "
          f"{i['scored_bytes']:,} bytes scored), nats per byte (per token); lower is better. Sparsity = exact "
          "zeros in the pruned layers of the model each method ships.", "",
          "| pruned model | pruned | RestoreLCC | sparsity | LoRA (adapters kept) | LoRA merged | sparsity | "
          "LoRA merged, re-masked | sparsity | trainable: RestoreLCC / LoRA |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        r, lo = row["restore"][row["restore_best"]], row["lora"][row["lora_best"]]
        md.append(f"| {row['pruning']} | {_q(row['pruned'])}, {row['pruned']['sparsity']:.1%} | "
                  f"{_q(r)} (lr {r['lr']:g}) | {r['sparsity']:.1%} | {_q(lo['trained'])} (lr {lo['lr']:g}) | "
                  f"{_q(lo['merged'])} | {lo['merged']['sparsity']:.1%} | {_q(lo['remasked'])} | "
                  f"{lo['remasked']['sparsity']:.1%} | {r['trainable_params']:,} / {lo['trainable_params']:,} |")
    md += ["", "Every run (validation loss per token picks the learning rate):", "",
           "| pruned model | method | lr | held-out nats/byte | per token | validation | train s |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        for r in row["restore"] + ([row["restore_all_heads"]] if row.get("restore_all_heads") else []):
            name = "RestoreLCC" if r["heads_fraction"] == s["heads"] else f"RestoreLCC, {r['heads_fraction']:.0%} heads"
            md.append(f"| {row['pruning']} | {name} | {r['lr']:g} | {r['nats_per_byte']:.4f} | "
                      f"{r['nats_per_token']:.4f} | {r['val']:.4f} | {r['seconds']:.1f} |")
        for lo in row["lora"]:
            t = lo["trained"]
            md.append(f"| {row['pruning']} | LoRA | {lo['lr']:g} | {t['nats_per_byte']:.4f} | "
                      f"{t['nats_per_token']:.4f} | {t['val']:.4f} | {lo['seconds']:.1f} |")
    every = [r for row in results["rows"] for r in row["restore"] + ([row["restore_all_heads"]]
                                                                      if row.get("restore_all_heads") else [])]
    md += ["", "RestoreLCC leaves every pruned weight bit for bit as pruned in every run: "
           f"{all(r['weights_unchanged'] for r in every)}.", ""]
    return "\n".join(md)


__all__ = ["Sizes", "main", "markdown", "run"]
