"""``rankwise bench restore``: RestoreLCC against LoRA recovery fine-tuning at equal steps, on
Wanda and SparseGPT models of a small byte-level Llama.

The model is the small Llama ``bench compress`` trained before it loaded the reference base
(:func:`byte_llama`, moved here from there so this benchmark's committed results still reproduce:
``lowrank-pretrain``'s byte-level model, 1,500 AdamW steps on the standard library's training
modules, calibration / held-out byte windows), pruned by Wanda and SparseGPT at
50% unstructured and 2:4 with the same 64 calibration windows. (Not converted to the reference
base yet: the pruned rows and both recoveries would have to be rerun on it.) Each pruned model is then
recovered, from the same training windows of the standard library's training modules (other
draws than calibration), in the same number of steps and batches, by

* **RestoreLCC** (``compress.restore``; the probes are the calibration windows): the learned
  ``V_hᵀ v_h + b_h`` folded into ``o_proj``'s bias, so the pruned weights are untouched;
* **LoRA recovery** (r=8 on every linear layer, alpha 16, the pruned base frozen), evaluated
  as trained (adapters beside the sparse weights), merged (``W + sBA``: the zeros fill in), and
  merged then re-masked to the pruned pattern (the sparsity kept, part of the update lost).

Each method runs at two learning rates; the one with the lower loss on validation windows (more
training-module windows, not trained on) is the method's row, and both are listed. Quality is
perplexity per byte on held-out modules; the sparsity is the fraction of exact zeros in the
pruned layers of the model each method would ship.
"""
from __future__ import annotations

import copy
import dataclasses
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.engine import evaluate, get_task
from rankwise.recipes.compress import Windows
from rankwise_bench.common import write_results


@dataclass
class ByteLlama:
    """The byte-level Llama and its windows (``bench compress``'s row 2 until it loaded the
    reference base; these are the sizes its record calls ``compress_sizes``).

    Attributes:
        llama_hidden, llama_layers, llama_heads, llama_intermediate: The Llama's shape.
        llama_seq: Bytes per window (training, calibration, held-out).
        llama_batch: Windows per training step.
        llama_steps: Training steps.
        llama_lr: AdamW peak learning rate (5% warm-up, cosine to 10%).
        calib_windows: Calibration windows.
        heldout_windows: Held-out windows.
        seed: Seeds the Llama's weights, windows and batch order.
    """

    llama_hidden: int = 128
    llama_layers: int = 2
    llama_heads: int = 4
    llama_intermediate: int = 256
    llama_seq: int = 128
    llama_batch: int = 16
    llama_steps: int = 1500
    llama_lr: float = 3e-3
    calib_windows: int = 64
    heldout_windows: int = 64
    seed: int = 0


def byte_llama(s: ByteLlama, console) -> tuple[torch.nn.Module, torch.Tensor, Windows, dict]:
    """Train the byte-level Llama; return it with calibration and held-out byte windows."""
    import math

    from rankwise.engine import Engine
    from rankwise_bench.corpus import load_corpus
    from rankwise_bench.lowrank_pretrain import Sizes as PretrainSizes
    from rankwise_bench.lowrank_pretrain import build_model
    train, held, info = load_corpus()
    shape = dataclasses.replace(PretrainSizes(), hidden=s.llama_hidden, layers=s.llama_layers,
                                heads=s.llama_heads, intermediate=s.llama_intermediate,
                                seq=s.llama_seq, seed=s.seed)
    model = build_model(shape)
    g = torch.Generator().manual_seed(s.seed)
    span = torch.arange(s.llama_seq)

    def cut(data: torch.Tensor, n: int) -> torch.Tensor:
        return data[torch.randint(0, data.numel() - s.llama_seq, (n,), generator=g)[:, None] + span].long()

    data = Windows(cut(train, s.llama_steps * s.llama_batch))
    opt = torch.optim.AdamW(model.parameters(), lr=s.llama_lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, s.llama_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / warm if k < warm else 0.1 + 0.45 * (
        1 + math.cos(math.pi * (k - warm) / max(1, s.llama_steps - warm))))
    engine = Engine(model, get_task("causal-lm"), opt, data, s.llama_batch, seed=s.seed, scheduler=sched,
                    grad_clip=1.0)
    t0, losses = time.perf_counter(), []
    for k in range(s.llama_steps):
        losses.append(engine.train_step(k).loss)
        if console is not None and (k + 1) % max(1, s.llama_steps // 10) == 0:
            console.print(f"llama step {k + 1}/{s.llama_steps}: loss {sum(losses[-50:]) / len(losses[-50:]):.3f}")
    model.eval()
    info = {**info, "params": sum(p.numel() for p in model.parameters()), "train_s": time.perf_counter() - t0,
            "final_train_loss": sum(losses[-50:]) / len(losses[-50:]), "shape": asdict(shape)}
    return model, cut(train, s.calib_windows), Windows(cut(held, s.heldout_windows)), info


@dataclass
class Sizes:
    """What sets the benchmark's size (default: about 8 min of one core, 15 min of wall on the
    shared machine, most of it the Llama's training).

    Attributes:
        compress: :class:`ByteLlama` fields to change (the Llama and its windows).
        prunings: ``[(label, compress config)]`` of the pruned models.
        steps: Recovery steps, the same for every method.
        batch_size: Windows per step.
        train_windows: Training-module windows the recoveries train on.
        val_windows: Training-module windows that pick each method's learning rate.
        restore_lrs: RestoreLCC's learning rates (a decade above the paper's 1e-3: at 1e-3 the
            120 steps left the bias short of where 1e-2 took it in a trial on wanda 2:4).
        all_heads_lr: Also run RestoreLCC on every head at this learning rate (``None``: not),
            to see what the contrastive selection gives up.
        lora_lrs: LoRA's learning rates.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        probes: RestoreLCC probes (the first calibration windows).
        heads: RestoreLCC's fraction of heads.
        threads: torch intra-op threads.
        model_file: Where to keep the trained Llama with its calibration and held-out windows
            (``torch.save``): loaded when it exists, written after training when it does not
            (``None``: train, keep nothing). The training is seeded and single-threaded, so a
            kept model is the one a fresh run trains.
    """

    compress: dict = dataclasses.field(default_factory=dict)
    prunings: tuple = (("wanda 50%", {"method": "wanda", "sparsity": 0.5}),
                       ("wanda 2:4", {"method": "wanda", "pattern": "2:4"}),
                       ("sparsegpt 50%", {"method": "sparsegpt", "sparsity": 0.5}),
                       ("sparsegpt 2:4", {"method": "sparsegpt", "pattern": "2:4"}))
    steps: int = 120
    batch_size: int = 8
    train_windows: int = 512
    val_windows: int = 32
    restore_lrs: tuple = (1e-2, 1e-1)
    all_heads_lr: float | None = 1e-2
    lora_lrs: tuple = (1e-3, 1e-2)
    lora_r: int = 8
    lora_alpha: float = 16.0
    probes: int = 64
    heads: float = 0.25
    threads: int = 1
    model_file: str | None = None


def _batches(ids: torch.Tensor, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    """The same ``steps`` batches for every method: seeded permutations, epoch after epoch."""
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


def _ppl(model, windows: Windows) -> float:
    return evaluate(model, get_task("causal-lm"), windows, 32)["eval_perplexity"]


def _lora(pruned, paths, batches, lr, s: Sizes, heldout: Windows, val: Windows) -> dict:
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
    trained = {"heldout": _ppl(model, heldout), "val": _ppl(model, val)}
    rankwise.merge_and_unload(model)
    merged = {"heldout": _ppl(model, heldout), "sparsity": _sparsity(model, paths)}
    with torch.no_grad():
        for p, keep in masks.items():
            model.get_submodule(p).weight.mul_(keep)
    remasked = {"heldout": _ppl(model, heldout), "sparsity": _sparsity(model, paths)}
    return {"lr": lr, "trainable_params": sum(p.numel() for p in params), "seconds": seconds,
            "trained": trained, "merged": merged, "remasked": remasked, "final_loss": float(loss.detach())}


def _restore(dense, pruned, paths, o_paths, calib, train_ids, lr, s: Sizes, heldout: Windows, val: Windows,
             heads: float | None = None) -> dict:
    """RestoreLCC on a copy of ``pruned`` (dense head outputs from ``dense``)."""
    from rankwise.compress.config import RestoreConfig
    from rankwise.compress.restore import RestoreLCC
    heads = s.heads if heads is None else heads
    cfg = RestoreConfig(enabled=True, probes=s.probes, heads=heads, steps=s.steps, lr=lr,
                        batch_size=s.batch_size)
    lcc = RestoreLCC(cfg, o_paths, dense.config.num_attention_heads, seed=0)
    lcc.record_dense(dense, calib)
    model = copy.deepcopy(pruned)
    t0 = time.perf_counter()
    info = lcc.restore(model, train_ids)
    seconds = time.perf_counter() - t0
    same = all(torch.equal(model.get_submodule(p).weight, pruned.get_submodule(p).weight) for p in paths)
    return {"lr": lr, "heads_fraction": heads, "trainable_params": info["trainable_params"], "seconds": seconds,
            "heldout": _ppl(model, heldout), "val": _ppl(model, val), "sparsity": _sparsity(model, paths),
            "weights_unchanged": same, "heads": info["heads"], "loss_first": info["loss_first"],
            "loss_last": info["loss_last"]}


def run(out: Path, sizes: Sizes | None = None, console=None) -> dict:
    """Run the benchmark; write ``results.json`` and ``results.md``.

    Args:
        out: Output folder (created).
        sizes: Override the default :class:`Sizes` (tests use a tiny one).
        console: A ``rich`` console for progress lines (default: stderr).

    Returns:
        The results written to ``results.json``.
    """
    from rich.console import Console

    from rankwise_bench.corpus import load_corpus
    from rankwise.compress.pipeline import compress_model
    console = console or Console(stderr=True)
    s = sizes or Sizes()
    cs = dataclasses.replace(ByteLlama(), **s.compress)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    began = time.time()
    results = {"sizes": asdict(s), "compress_sizes": asdict(cs), "python": platform.python_version(),
               "torch": torch.__version__, "machine": f"{platform.machine()}, {s.threads} torch threads", "rows": []}
    try:
        if s.model_file and Path(s.model_file).is_file():
            dense, calib, heldout, info = torch.load(s.model_file, weights_only=False)
            info = {**info, "loaded_from": s.model_file}
        else:
            dense, calib, heldout, info = byte_llama(cs, console)
            if s.model_file:
                torch.save((dense, calib, heldout, info), s.model_file)
        train, _, _ = load_corpus()
        g = torch.Generator().manual_seed(cs.seed + 1)     # other draws than the Llama's own windows
        span = torch.arange(cs.llama_seq)
        starts = torch.randint(0, train.numel() - cs.llama_seq, (s.train_windows + s.val_windows,), generator=g)
        windows = train[starts[:, None] + span].long()
        train_ids, val = windows[:s.train_windows], Windows(windows[s.train_windows:])
        batches = _batches(train_ids, s.steps, s.batch_size, cs.seed)
        o_paths = [n for n, _ in dense.named_modules() if n.endswith("o_proj")]
        results["llama"] = {**info, "dense_heldout": _ppl(dense, heldout)}
        for label, raw in s.prunings:
            entry = registry.get("compressor", raw["method"])
            comp = entry.builder(from_dict(entry.config_cls, {**raw, "seed": cs.seed}, "compress"))
            pruned = copy.deepcopy(dense)
            chunks = [{"input_ids": c, "attention_mask": torch.ones_like(c)} for c in calib.split(8)]
            paths = list(compress_model(pruned, comp, chunks, "all-linear").layers)
            row = {"pruning": label, "config": raw,
                   "pruned": {"heldout": _ppl(pruned, heldout), "val": _ppl(pruned, val),
                              "sparsity": _sparsity(pruned, paths)},
                   "restore": [], "lora": []}
            for lr in s.restore_lrs:
                row["restore"].append(_restore(dense, pruned, paths, o_paths, calib, train_ids, lr, s, heldout, val))
            if s.all_heads_lr is not None:
                row["restore_all_heads"] = _restore(dense, pruned, paths, o_paths, calib, train_ids, s.all_heads_lr,
                                                    s, heldout, val, heads=1.0)
            for lr in s.lora_lrs:
                row["lora"].append(_lora(pruned, paths, batches, lr, s, heldout, val))
            row["restore_best"] = min(range(len(row["restore"])), key=lambda i: row["restore"][i]["val"])
            row["lora_best"] = min(range(len(row["lora"])), key=lambda i: row["lora"][i]["trained"]["val"])
            results["rows"].append(row)
            r, lo = row["restore"][row["restore_best"]], row["lora"][row["lora_best"]]
            console.print(f"restore | {label}: pruned {row['pruned']['heldout']:.4f}, RestoreLCC {r['heldout']:.4f} "
                          f"(lr {r['lr']}), LoRA {lo['trained']['heldout']:.4f} (lr {lo['lr']}; merged sparsity "
                          f"{lo['merged']['sparsity']:.1%}, re-masked {lo['remasked']['heldout']:.4f})")
    finally:
        torch.set_num_threads(threads)
    results["wall_s"] = time.time() - began
    write_results(out, results, markdown(results))
    return results


def markdown(results: dict) -> str:
    """``results.md`` from the record."""
    s, cs, i = results["sizes"], results["compress_sizes"], results["llama"]
    md = ["# restore: RestoreLCC vs LoRA recovery fine-tuning", "",
          f"Python {results['python']}, torch {results['torch']}, {results['machine']}; wall "
          f"{results['wall_s'] / 60:.1f} min. Produced by `rankwise bench restore`.", "",
          f"Model: `bench compress`'s Llama {cs['llama_layers']}x{cs['llama_hidden']} ({cs['llama_heads']} heads, "
          f"{i['params']:,} parameters, byte tokens, {cs['llama_steps']} AdamW steps; dense held-out perplexity "
          f"{i['dense_heldout']:.4f}), pruned with its {cs['calib_windows']} calibration windows. Recovery: "
          f"{s['steps']} steps x {s['batch_size']} windows of {cs['llama_seq']} bytes from {s['train_windows']} "
          f"training-module windows, the same batches for LoRA; learning rate per method picked on "
          f"{s['val_windows']} other training-module windows. RestoreLCC: {s['probes']} probes, "
          f"{s['heads']:.0%} of the heads. LoRA: r={s['lora_r']}, alpha {s['lora_alpha']:g}, every linear layer. "
          "Perplexity per byte on held-out modules; sparsity = exact zeros in the pruned layers of the "
          "model each method ships.", "",
          "| pruned model | pruned | RestoreLCC | sparsity | RestoreLCC, all heads | LoRA (adapters kept) | "
          "LoRA merged | sparsity | LoRA merged, re-masked | sparsity | trainable: RestoreLCC / LoRA |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        r, lo = row["restore"][row["restore_best"]], row["lora"][row["lora_best"]]
        a = row.get("restore_all_heads")
        every = f"{a['heldout']:.4f} (lr {a['lr']:g})" if a else "-"
        md.append(f"| {row['pruning']} | {row['pruned']['heldout']:.4f} ({row['pruned']['sparsity']:.1%}) | "
                  f"{r['heldout']:.4f} (lr {r['lr']:g}) | {r['sparsity']:.1%} | {every} | "
                  f"{lo['trained']['heldout']:.4f} "
                  f"(lr {lo['lr']:g}) | {lo['merged']['heldout']:.4f} | {lo['merged']['sparsity']:.1%} | "
                  f"{lo['remasked']['heldout']:.4f} | {lo['remasked']['sparsity']:.1%} | "
                  f"{r['trainable_params']:,} / {lo['trainable_params']:,} |")
    md += ["", "Every run (perplexity per byte; validation picks the learning rate):", "",
           "| pruned model | method | lr | held-out | validation | train s |", "|---|---|---:|---:|---:|---:|"]
    for row in results["rows"]:
        for r in row["restore"] + ([row["restore_all_heads"]] if row.get("restore_all_heads") else []):
            name = "RestoreLCC" if r["heads_fraction"] == s["heads"] else f"RestoreLCC, {r['heads_fraction']:.0%} heads"
            md.append(f"| {row['pruning']} | {name} | {r['lr']:g} | {r['heldout']:.4f} | {r['val']:.4f} | "
                      f"{r['seconds']:.1f} |")
        for lo in row["lora"]:
            md.append(f"| {row['pruning']} | LoRA | {lo['lr']:g} | {lo['trained']['heldout']:.4f} | "
                      f"{lo['trained']['val']:.4f} | {lo['seconds']:.1f} |")
    every = [r for row in results["rows"] for r in row["restore"] + ([row["restore_all_heads"]]
                                                                      if row.get("restore_all_heads") else [])]
    md += ["", "RestoreLCC leaves every pruned weight bit for bit as pruned in every run: "
           f"{all(r['weights_unchanged'] for r in every)}.", ""]
    return "\n".join(md)

