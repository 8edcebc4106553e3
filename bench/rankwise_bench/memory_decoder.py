"""Benchmark: the Memory Decoder against DAPT, LoRA and kNN-LM on the reference base, every
lambda chosen on validation modules (``rankwise bench memory-decoder``; issue 36 item 2; quality
only, no timing claim).

Base: the reference base (:func:`rankwise_bench.common.reference_base`, 6.45M parameters, its
SentencePiece tokenizer of 8,192), loaded as it is and never trained; ``--base DIR`` runs on
another folder (the tests: a tiny in-code base saved with the reference tokenizer).

Domain: the base's own held-out modules -- the 59 ``stdlib-source`` modules its pretraining never
read (``crc32(module) % 10 == 0``) -- split by whole module with a second hash,
``crc32("memdec:" + module) % 10`` (:func:`split_of`): 0-1 test, 2 validation, 3 **general**
(kept out of the domain entirely, neither adapted on nor used to choose anything: the
out-of-domain check), 4-9 training; the lists are in ``results.json``. All of it is text the
base never saw, so "general" is unseen text of the *same* distribution, not another domain.

Decision (issue 35 item 2): the former byte-level base pretrained here without ``email``, its
larger twin for the plug-and-play claim, and their pretraining code are gone; that claim needs
a second base with this tokenizer and is not tested.

Text: each module is ``BOS + its tokens + EOS`` in windows of ``seq`` tokens overlapping by one
(:func:`windows`): every token after BOS is predicted exactly once; per token = total nats /
predicted tokens, per byte = total nats / UTF-8 bytes of the modules' text (the model card's).
Every model trains the same ``steps`` x ``batch`` training windows from the base (AdamW, 5 %
warm-up then linear decay, bf16 autocast as the base was pretrained; evaluation in float32):

* **Memory Decoder** (the engine's ``memory-decoder`` task): a datastore of the base's head
  inputs over every training position (IVF), each position's kNN targets (self-hit excluded),
  a decoder of the base's shape initialised from the base, trained on ``0.5 KL + 0.5 CE``;
* **DAPT + mix**: the same decoder trained with CE only (is the kNN target what helps?);
* **LoRA** r=8 (alpha 16) on the blocks' linears, CE, merged for evaluation;
* **kNN-LM**: the base mixed with ``p_kNN`` of the same datastore (retrieval at test time).

Chosen on the validation modules only (grid ``GRID`` = 0.1 .. 0.9): each mixture's ``lambda``
(:func:`choose_lambda`); kNN-LM's temperature ``T`` jointly with its ``lambda``
(``Sizes.temperatures``), and the Memory Decoder imitates ``p_kNN`` at that ``T``. Base + Memory
Decoder is also reported at the authors' published 0.55 and the code's default 0.25, with its
test-set sweep as a diagnostic. One seed. Pieces (``pieces/<name>.json``, skipped when present;
weights in ``_work/``): ``knn`` (datastore, ``T``, kNN-LM), ``memdec``, ``dapt``, ``lora``, ``eval``.
"""
from __future__ import annotations

import json
import math
import platform
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rankwise.core import atomic
from rankwise_bench.common import reference_base, torch_threads, write_results
from rankwise_bench.memory_decoder_report import markdown, plot

SPLITS = ("train", "validation", "test", "general")
GRID = tuple(round(0.1 * i, 1) for i in range(1, 10))  # lambda, chosen on the validation modules
LAM_PUBLISHED, LAM_CODE = 0.55, 0.25  # the authors' published evaluation; the code's argparse default
SEED = 0
COMMAND = "OMP_NUM_THREADS=1 rankwise bench memory-decoder --out bench/results/memory-decoder"


@dataclass
class Sizes:
    """The benchmark's sizes: the defaults are the committed run; tests pass tiny ones.

    Attributes:
        seq: Window length in tokens (the base's pretraining length).
        batch: Windows per step (and per evaluation batch).
        steps: Steps of every trained model (about two epochs of the training windows).
        lr: Learning rate of the two decoders (full fine-tunes of the base).
        lora_lr: Learning rate of LoRA.
        rank: LoRA's rank (alpha = 2 rank).
        k: Neighbours per query (the paper's 1024).
        temperatures: kNN-LM's candidate ``T`` (squared L2 distances / T), chosen on validation.
        target_tokens: The sparsified kNN target per position (the task's default).
        ivf_lists: Inverted lists of the datastore's IVF index.
        ivf_probe: Lists searched per query (lists x probe / N candidates must exceed ``k``).
        modules: 0: every module of each split; n: its n smallest (tests).
    """

    seq: int = 256
    batch: int = 16
    steps: int = 100
    lr: float = 5e-4
    lora_lr: float = 3e-3
    rank: int = 8
    k: int = 1024
    temperatures: tuple[float, ...] = (3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
    target_tokens: int = 64
    ivf_lists: int = 256
    ivf_probe: int = 16
    modules: int = 0


def split_of(module: str) -> str:
    """The domain split of a held-out module: ``crc32("memdec:" + module) % 10`` 0-1 test,
    2 validation, 3 general, else train."""
    h = zlib.crc32(("memdec:" + module).encode()) % 10
    return "test" if h < 2 else "validation" if h == 2 else "general" if h == 3 else "train"


def domain_records(modules: int = 0) -> dict[str, list[dict]]:
    """The base's held-out ``stdlib-source`` records by split (:func:`split_of`); with
    ``modules`` > 0 only each split's ``modules`` smallest (by bytes, then name)."""
    from rankwise.data.corpus import load_source_records
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for rec in load_source_records():
        if rec["heldout"]:
            out[split_of(rec["id"])].append(rec)
    if modules:
        out = {s: sorted(v, key=lambda r: (len(r["text"].encode()), r["id"]))[:modules] for s, v in out.items()}
    return out


def windows(ids: list[int], seq: int) -> list[list[int]]:
    """``ids`` cut into windows of at most ``seq`` tokens, each starting at the previous one's
    last token: every token but the first is a target exactly once."""
    return [ids[s:s + seq] for s in range(0, max(len(ids) - 1, 0), seq - 1)]


class Windows(list):
    """Token windows (``{"input_ids": [...]}``) with the ``pad_id`` the engine reads, the UTF-8
    bytes of the text they score and its module names."""

    def __init__(self, items: list[dict], pad_id: int, text_bytes: int, modules: list[str]) -> None:
        super().__init__(items)
        self.pad_id, self.bytes, self.modules = pad_id, text_bytes, modules


def token_windows(tok, records: list[dict], seq: int) -> Windows:
    """Every record as ``BOS + tokens + EOS`` in :func:`windows` of ``seq`` tokens."""
    items = []
    for rec in records:
        ids = [tok.bos_token_id] + tok(rec["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        items += [{"input_ids": w} for w in windows(ids, seq)]
    return Windows(items, tok.pad_token_id, sum(len(r["text"].encode()) for r in records),
                   [r["id"] for r in records])


def _batches(data: Windows, size: int):
    from rankwise.engine.task import pad
    for s in range(0, len(data), size):
        yield pad([data[i]["input_ids"] for i in range(s, min(s + size, len(data)))], data.pad_id)


@torch.no_grad()
def target_logprobs(model, data: Windows, size: int, keys: bool = False):
    """``log p(y)`` of every predicted token of ``data`` (``(N,)``, window order); with ``keys``
    also ``(head inputs (N, d), targets (N,))``, the datastore's keys and values."""
    from rankwise.tasks.memory_decoder.task import head_inputs
    lps, hs, ys = [], [], []
    for ids, mask in _batches(data, size):
        h, logits = head_inputs(model, ids, mask)                               # (B, T, d), (B, T, V)
        keep, y = mask[:, 1:].bool(), ids[:, 1:]                                # (B, T-1)
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, y[..., None]).squeeze(-1)
        lps.append(lp[keep])
        if keys:
            hs.append(h[:, :-1][keep].float())
            ys.append(y[keep])
    lp = torch.cat(lps)
    return (lp, torch.cat(hs), torch.cat(ys)) if keys else lp


def knn_target_logprob(dists: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, y: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """``log p_kNN(y)`` per query (``-inf`` when no valid neighbour names ``y``): the task's
    ``knn_distribution`` at the target only. Shapes ``(P, k)``, ``(P, k)``, ``(P, k)``, ``(P,)``."""
    logw = torch.log_softmax((-dists.float() / temperature).masked_fill(~valid, float("-inf")), -1)
    hit = valid & (values == y[:, None])
    return torch.logsumexp(logw.masked_fill(~hit, float("-inf")), -1)


def score(lp: torch.Tensor, data: Windows) -> dict:
    """Loss and perplexity per token and per byte of target log-probs ``lp`` over ``data``."""
    nats = float(-lp.double().sum())
    return {"nats_per_token": nats / lp.numel(), "nats_per_byte": nats / data.bytes,
            "token_ppl": math.exp(nats / lp.numel()), "byte_ppl": math.exp(nats / data.bytes)}


def choose_lambda(base_lp: torch.Tensor, other_lp: torch.Tensor,
                  grid: tuple[float, ...] = GRID) -> tuple[float, dict[str, float]]:
    """The mixture weight of ``grid`` with the lowest per-token perplexity of ``(1 - lambda)
    p_base + lambda p_other`` (pass validation data only; the first on a tie).

    Args:
        base_lp: ``(N,)`` the base's log-probability of each target token.
        other_lp: ``(N,)`` the same of what is mixed in (a decoder, or ``p_kNN``).
        grid: The candidate ``lambda`` values.

    Returns:
        ``(chosen lambda, {str(lambda): perplexity})``.
    """
    from rankwise.tasks.memory_decoder.generation import interpolate
    ppl = {str(lam): math.exp(-float(interpolate(base_lp, other_lp, lam).double().mean())) for lam in grid}
    return min(grid, key=lambda lam: ppl[str(lam)]), ppl


class Setup:
    """The base folder, its tokenizer, the sizes and the windows of every split."""

    def __init__(self, base: Path, sizes: Sizes) -> None:
        from transformers import AutoTokenizer
        self.base, self.sizes = Path(base), sizes
        tok = AutoTokenizer.from_pretrained(str(self.base))
        self.data = {s: token_windows(tok, recs, sizes.seq) for s, recs in domain_records(sizes.modules).items()}

    def model(self, weights: Path | None = None):
        """The base in float32 (``weights``: a saved state dict of its shape instead)."""
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(self.base), dtype=torch.float32)
        if weights is not None:
            model.load_state_dict(torch.load(weights, weights_only=True))
        return model.eval()

    def config(self, temperature: float):
        """The ``memory-decoder`` task's section for this run."""
        from rankwise.tasks.memory_decoder.task import MemoryDecoderConfig
        s = self.sizes
        return MemoryDecoderConfig(base=str(self.base), k=s.k, temperature=temperature, target_tokens=s.target_tokens,
                                   index="ivf", ivf_lists=s.ivf_lists, ivf_probe=s.ivf_probe)


def _knn(setup: Setup) -> dict:
    """The datastore over the training windows, kNN-LM's ``T`` and ``lambda`` chosen on the
    validation modules, and its scores on the test and general modules at that choice."""
    from rankwise.tasks.memory_decoder.generation import interpolate
    from rankwise.tasks.memory_decoder.task import Datastore
    s, base, start = setup.sizes, setup.model(), time.perf_counter()
    _, keys, values = target_logprobs(base, setup.data["train"], s.batch, keys=True)
    store = Datastore(keys, values, setup.config(s.temperatures[0]))
    base_lp, knn_lp, nearest = {}, {}, []
    for split in ("validation", "test", "general"):
        lp, q, y = target_logprobs(base, setup.data[split], s.batch, keys=True)
        parts: dict[float, list] = {t: [] for t in s.temperatures}
        for c in range(0, len(y), 4096):
            d, v, valid = store.search(q[c:c + 4096], s.k)                     # (P, k + 1)
            nearest.append(d[:, 0])
            for t in s.temperatures:
                parts[t].append(knn_target_logprob(d, v, valid, y[c:c + 4096], t))
        base_lp[split], knn_lp[split] = lp, {t: torch.cat(p) for t, p in parts.items()}
    curves = {str(t): choose_lambda(base_lp["validation"], knn_lp["validation"][t]) for t in s.temperatures}
    temp = min(s.temperatures, key=lambda t: min(curves[str(t)][1].values()))
    lam = curves[str(temp)][0]
    return {"seconds": round(time.perf_counter() - start, 1), "datastore": len(store),
            "index": f"{store.kind} lists={s.ivf_lists} probe={s.ivf_probe}",
            "nearest_sq_distance_median": float(torch.cat(nearest).median()),
            "temperature": temp, "lambda": lam, "validation ppl": {t: c[1] for t, c in curves.items()},
            **{split: score(interpolate(base_lp[split], knn_lp[split][temp], lam), setup.data[split])
               for split in ("test", "general")}}


def _fit(model, task, data: Windows, sizes: Sizes, lr: float) -> list[float]:
    """``sizes.steps`` engine steps of AdamW (bf16 autocast); the losses every 10 steps."""
    from rankwise.engine import Engine, linear_schedule
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    engine = Engine(model, task, opt, data, sizes.batch, seed=SEED, precision="bf16", grad_clip=1.0,
                    scheduler=linear_schedule(opt, sizes.steps, 0.05))
    losses = []
    for step in range(sizes.steps):
        loss = engine.train_step(step).loss
        if step % 10 == 0 or step == sizes.steps - 1:
            losses.append(round(float(loss), 4))
    return losses


def _adapt(setup: Setup, work: Path, kind: str, temperature: float) -> dict:
    """Train ``kind`` from the base: ``memdec`` (0.5 KL + 0.5 CE against ``p_kNN`` at
    ``temperature``), ``dapt`` (CE only) or ``lora``; its weights go to ``work/<kind>.pt``."""
    import rankwise
    from rankwise.engine import get_task
    from rankwise.tasks.memory_decoder.task import MemoryDecoderTask
    s, train = setup.sizes, setup.data["train"]
    model = setup.model().train()
    info: dict = {"windows": len(train), "steps": s.steps, "batch": s.batch}
    start = time.perf_counter()
    if kind == "memdec":
        task = MemoryDecoderTask(setup.config(temperature))
        base = setup.model()
        task.base_loader = lambda path, device: base
        info["index"] = task.prepare(model, [train], True, s.batch, "cpu")
        info["datastore"], info["temperature"] = len(task.store), temperature
        info["prepare_s"] = round(time.perf_counter() - start, 1)
    elif kind == "dapt":
        task = get_task("causal-lm")
    else:
        rankwise.apply(model, "lora", r=s.rank, alpha=2 * s.rank, targets="block-linear")
        task = get_task("causal-lm")
        info["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info["lr"] = s.lora_lr if kind == "lora" else s.lr
    info["losses"] = _fit(model, task, train, s, info["lr"])
    if kind == "lora":  # folded into the weights: the evaluation loads a plain model
        from rankwise.core.ops import merge_and_unload
        model = merge_and_unload(model)
    torch.save(model.state_dict(), work / f"{kind}.pt")
    info["seconds"] = round(time.perf_counter() - start, 1)
    return info


def _eval(setup: Setup, work: Path, knn: dict) -> dict:
    """Every model on the test and general modules, each mixture at its ``lambda`` chosen on the
    validation modules (base + Memory Decoder also at 0.55 and 0.25; kNN-LM from ``knn``)."""
    from rankwise.tasks.memory_decoder.generation import interpolate
    s, data, start = setup.sizes, setup.data, time.perf_counter()
    models = {"base": setup.model(), **{k: setup.model(work / f"{k}.pt") for k in ("memdec", "dapt", "lora")}}
    lp = {split: {k: target_logprobs(m, data[split], s.batch) for k, m in models.items()}
          for split in ("validation", "test", "general")}
    v = lp["validation"]
    (lm, curve_m), (ld, curve_d) = choose_lambda(v["base"], v["memdec"]), choose_lambda(v["base"], v["dapt"])
    rows = [("base", None, "base", None), ("base + Memory Decoder", lm, "memdec", "validation"),
            ("base + Memory Decoder", LAM_PUBLISHED, "memdec", "published"),
            ("base + Memory Decoder", LAM_CODE, "memdec", "code default"), ("Memory Decoder alone", None, "memdec", None),
            ("base + DAPT decoder (CE only)", ld, "dapt", "validation"), ("DAPT decoder alone", None, "dapt", None),
            ("LoRA r=8", None, "lora", None)]
    table = []
    for label, lam, key, how in rows:
        row = {"model": label, "lambda": lam, "chosen": how}
        for split in ("test", "general"):
            p = lp[split]
            row[split] = score(p[key] if lam is None or key == "base" else interpolate(p["base"], p[key], lam),
                               data[split])
        table.append(row)
    table.append({"model": f"kNN-LM (T {knn['temperature']:g})", "lambda": knn["lambda"], "chosen": "validation",
                  "test": knn["test"], "general": knn["general"]})
    sweep = {str(lam): score(interpolate(lp["test"]["base"], lp["test"]["memdec"], lam), data["test"])["token_ppl"]
             for lam in GRID}
    return {"seconds": round(time.perf_counter() - start, 1), "rows": table,
            "lambda": {"memdec": lm, "dapt": ld, "knn": knn["lambda"]},
            "validation ppl": {"memdec": curve_m, "dapt": curve_d, "knn": knn["validation ppl"][str(knn["temperature"])]},
            "test sweep (base + Memory Decoder, token ppl)": sweep}


def run(out: Path, base: str | Path | None = None, sizes: Sizes | None = None) -> dict:
    """Run (or resume) every piece and write ``results.json``, ``results.md`` and ``lambda.png``.

    Args:
        out: The results folder (``pieces/`` and the ignored ``_work/`` inside).
        base: The base model folder (``None`` or ``""``: the reference base).
        sizes: The sizes (``None``: the committed run's, :class:`Sizes`).

    Returns:
        The record.

    Raises:
        RankwiseError: faiss missing, or the reference base not built.
    """
    from rankwise.errors import require
    require("faiss", "memory", "rankwise bench memory-decoder")
    import faiss
    sizes, out = sizes or Sizes(), Path(out)
    work, pieces = out / "_work", out / "pieces"
    work.mkdir(parents=True, exist_ok=True)
    pieces.mkdir(parents=True, exist_ok=True)
    folder = Path(base) if base else reference_base()
    faiss.omp_set_num_threads(1)
    with torch_threads(1):
        setup = Setup(folder, sizes)

        def piece(name: str, fn) -> dict:
            path = pieces / f"{name}.json"
            if not path.is_file():
                atomic.write_json(path, fn())
            return json.loads(path.read_text())

        done = {"knn": piece("knn", lambda: _knn(setup))}
        temp = done["knn"]["temperature"]
        for kind in ("memdec", "dapt", "lora"):
            done[kind] = piece(kind, lambda kind=kind: _adapt(setup, work, kind, temp))
        done["eval"] = piece("eval", lambda: _eval(setup, work, done["knn"]))
    d = setup.data
    result = {"command": COMMAND, "base": _shown(folder), "sizes": asdict(sizes), "lambda grid": list(GRID),
              "lambda published": LAM_PUBLISHED, "lambda code default": LAM_CODE,
              "splits": {k: {"modules": v.modules, "windows": len(v), "bytes": v.bytes,
                             "tokens": sum(len(w["input_ids"]) - 1 for w in v)} for k, v in d.items()},
              "torch": torch.__version__, "python": platform.python_version(), **done}
    write_results(out, result, markdown(result))
    plot(result, out / "lambda.png")
    return result


def _shown(folder: Path) -> str:
    from rankwise_bench.common import ROOT
    try:
        return str(folder.resolve().relative_to(ROOT))
    except ValueError:
        return str(folder)


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench memory-decoder --out DIR [--base MODEL_DIR]``."""
    from rankwise_bench.common import keyword_main
    return keyword_main(run, argv, "memory-decoder", base=(str, ""))


__all__ = ["Sizes", "choose_lambda", "domain_records", "knn_target_logprob", "main", "markdown", "run",
           "score", "split_of", "target_logprobs", "token_windows", "windows"]
