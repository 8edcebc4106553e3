"""Benchmark: Memory Decoder domain adaptation on a standard-library package the base never saw
(``rankwise bench memory-decoder``; quality only, no timing claim).

Setup. Byte-level (vocabulary 256) Llama models built in code. The *base* (3 layers, 96 wide)
is pretrained from scratch on the standard library's source (the corpus of ``lowrank-pretrain``,
:func:`rankwise_bench.corpus.load_corpus`'s file rule) with the ``email``
package family left out entirely. The domain is ``email``: its files are split by module name
into training files, validation files (carved from the training side: left out of every
training and of the datastore) and held-out test files. From the base and the domain's training
windows:

* **Memory Decoder** (``task.name: memory-decoder``'s task in the engine): a datastore of the
  base's head inputs over every training position (IVF index), the kNN targets of each position
  (self-hit excluded), and a decoder of the base's shape initialised from the base (the paper's
  GPT2-small base + GPT2-small decoder setting) trained on ``0.5 KL + 0.5 CE``; evaluated mixed
  with the base (and alone);
* **DAPT + mix**: the same decoder trained with CE only (ablation: is the kNN target what helps?);
* **LoRA**: the base adapted with LoRA r=8 (attention and MLP linears) on the same windows and
  steps (CE);
* **kNN-LM**: the base mixed with ``p_kNN`` itself (retrieval at test time).

Decision (issue 35 item 2): the claim needs a base that has *not* seen the domain, and the
reference base's pretraining read the ``email`` package (all but its held-out modules), so this
benchmark still pretrains its own base with the family left out. Converting it means taking
the reference base's own held-out modules (59 modules it never saw) as the domain, split into
training, validation and test modules; not done yet.

``lambda``, every mixture's share of its second distribution, is chosen per mixture on the
validation windows (:func:`choose_lambda`, the grid ``GRID`` = 0.1 .. 0.9), never on the test
windows; base + Memory Decoder is also reported at the authors' published 0.55
(``scripts/evaluate_joint_gpt2.sh``, the README's joint model) and at the released code's
argparse default 0.25 (``evaluate_joint.py``), and its test-set sweep as a diagnostic.

Measured: per-byte perplexity of every model on the held-out ``email`` windows, and on held-out
general windows (the stdlib modules ``load_corpus`` holds out, family excluded) to see what
adaptation costs outside the domain. One seed. Each piece (``base``, ``memdec``, ``dapt``, ``lora``,
``eval``) writes ``pieces/<name>.json`` and is skipped when that file exists (weights in
``_work/``, not committed), so the benchmark resumes piece by piece.
"""
from __future__ import annotations

import json
import math
import platform
import sysconfig
import zlib
from pathlib import Path

import torch
from torch.nn import functional as F

from rankwise.core import atomic
from rankwise_bench.common import llama, write_results
from rankwise_bench.corpus import ByteWindows

FAMILY = "email"
SEQ, BATCH, SEED = 128, 16, 0
HIDDEN, LAYERS, HEADS = 96, 3, 4
LARGE = (128, 4)  # a second, larger base with the same tokenizer (the plug-and-play claim)
BASE_STEPS, BASE_LR = 1500, 3e-3
ADAPT_STEPS, ADAPT_LR, LORA_LR, RANK = 300, 5e-4, 3e-3, 8
K, TEMPERATURE, TARGET_TOKENS, LISTS, PROBE = 256, 10.0, 32, 512, 8
GRID = tuple(round(0.1 * i, 1) for i in range(1, 10))  # lambda, chosen on the validation windows
LAM_PUBLISHED, LAM_CODE = 0.55, 0.25  # the authors' published evaluation; the code's argparse default
EVAL_GENERAL = 256


def _corpus() -> dict[str, torch.Tensor]:
    """``general`` (stdlib minus the family; load_corpus's training modules), ``general_held``
    (its held-out modules), ``domain`` / ``domain_val`` / ``domain_held`` (the family, split by
    module name: training, validation carved from the training side, test)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
    parts: dict[str, list[bytes]] = {k: [] for k in ("general", "general_held", "domain", "domain_val",
                                                     "domain_held")}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if skip & set(rel.parts):
            continue
        h = zlib.crc32(".".join(rel.with_suffix("").parts).encode())
        if rel.parts[0] == FAMILY:  # the test split as before; validation from the training side
            kind = "domain_held" if h % 5 == 0 else "domain_val" if h % 5 == 1 else "domain"
        else:
            kind = "general_held" if h % 10 == 0 else "general"
        parts[kind].append(f.read_bytes() + b"\n\n")
    return {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8) for k, v in parts.items()}


def _windows(data: torch.Tensor, stride: int = SEQ, limit: int | None = None):
    starts = torch.arange(0, data.numel() - SEQ, stride)
    if limit is not None and len(starts) > limit:
        starts = starts[torch.linspace(0, len(starts) - 1, limit).long()]
    return ByteWindows(data, starts, SEQ)


def _model(hidden: int = HIDDEN, layers: int = LAYERS):
    return llama(256, hidden, layers, HEADS, 2 * hidden, positions=SEQ, seed=SEED,
                 bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


def _fit(model, task, data, steps: int, lr: float) -> list[float]:
    """``steps`` engine steps of AdamW (5% warm-up, linear decay); the losses every 50 steps."""
    from rankwise.engine import Engine, linear_schedule
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    engine = Engine(model, task, opt, data, BATCH, seed=SEED, scheduler=linear_schedule(opt, steps, 0.05),
                    grad_clip=1.0)
    losses = []
    for step in range(steps):
        loss = engine.train_step(step).loss
        if step % 50 == 0 or step == steps - 1:
            losses.append(round(float(loss), 4))
    return losses


def _base(work: Path, corpus, name: str = "base", size: tuple[int, int] = (HIDDEN, LAYERS)) -> dict:
    from rankwise.engine import get_task
    g = torch.Generator().manual_seed(SEED)
    starts = torch.randint(0, corpus["general"].numel() - SEQ, (BASE_STEPS * BATCH,), generator=g)
    model = _model(*size)
    losses = _fit(model, get_task("causal-lm"), ByteWindows(corpus["general"], starts, SEQ), BASE_STEPS, BASE_LR)
    torch.save(model.state_dict(), work / f"{name}.pt")
    return {"steps": BASE_STEPS, "lr": BASE_LR, "tokens": BASE_STEPS * BATCH * SEQ, "hidden": size[0],
            "layers": size[1], "losses": losses}


def _load(work: Path, name: str, size: tuple[int, int] = (HIDDEN, LAYERS)):
    model = _model(*size)
    model.load_state_dict(torch.load(work / f"{name}.pt", weights_only=True))
    return model.eval()


def _memdec_config():
    from rankwise.tasks.memory_decoder.task import MemoryDecoderConfig
    return MemoryDecoderConfig(base="(in memory)", k=K, temperature=TEMPERATURE, target_tokens=TARGET_TOKENS,
                               index="ivf", ivf_lists=LISTS, ivf_probe=PROBE)


def _adapt(work: Path, corpus, kind: str) -> dict:
    """Train the domain piece ``kind``: ``memdec`` (the objective 0.5 KL + 0.5 CE), ``dapt`` (CE only) or ``lora``."""
    import rankwise
    from rankwise.engine import get_task
    from rankwise.tasks.memory_decoder.task import MemoryDecoderTask
    train = _windows(corpus["domain"])
    model = _load(work, "base").train()
    info: dict = {"windows": len(train), "steps": ADAPT_STEPS}
    if kind == "memdec":
        task = MemoryDecoderTask(_memdec_config())
        base = _load(work, "base")
        task.base_loader = lambda path, device: base
        info["index"] = task.prepare(model, [train], True, 64, "cpu")
        info["datastore"] = len(task.store)
    elif kind == "dapt":
        task = get_task("causal-lm")
    else:
        rankwise.apply(model, "lora", r=RANK, alpha=2 * RANK, targets="block-linear")
        task = get_task("causal-lm")
        info["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info["losses"] = _fit(model, task, train, ADAPT_STEPS, LORA_LR if kind == "lora" else ADAPT_LR)
    if kind == "lora":  # folded into the weights: the evaluation loads a plain model
        from rankwise.core.ops import merge_and_unload
        model = merge_and_unload(model)
    torch.save(model.state_dict(), work / f"{kind}.pt")
    return info


@torch.no_grad()
def _logprobs(model, data) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p (N, 256) of every next byte position, targets (N,))`` over ``data``'s windows."""
    out, ys = [], []
    for s in range(0, len(data), 64):
        ids = torch.tensor([data[i]["input_ids"] for i in range(s, min(s + 64, len(data)))])
        out.append(F.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).reshape(-1, 256))
        ys.append(ids[:, 1:].reshape(-1))
    return torch.cat(out), torch.cat(ys)


def _ppl(logp: torch.Tensor, y: torch.Tensor) -> float:
    return math.exp(float(-logp.gather(1, y[:, None]).mean()))


def choose_lambda(base_logp: torch.Tensor, other_logp: torch.Tensor, y: torch.Tensor,
                  grid: tuple[float, ...] = GRID) -> tuple[float, dict[str, float]]:
    """The mixture weight of ``grid`` with the lowest perplexity of ``(1 - lambda) p_base +
    lambda p_other`` on the targets ``y`` (pass validation data only; the first on a tie).

    Args:
        base_logp: ``(N, V)`` log-probs of the base.
        other_logp: ``(N, V)`` log-probs mixed in (a decoder's, or ``p_kNN``).
        y: ``(N,)`` the next tokens.
        grid: The candidate ``lambda`` values.

    Returns:
        ``(chosen lambda, {str(lambda): perplexity})``.
    """
    from rankwise.tasks.memory_decoder.generation import interpolate
    ppl = {str(lam): _ppl(interpolate(base_logp, other_logp, lam), y) for lam in grid}
    return min(grid, key=lambda lam: ppl[str(lam)]), ppl


@torch.no_grad()
def _knn_logprobs(base, corpus, sets: list) -> list[torch.Tensor]:
    """``log p_kNN`` of every position of each of ``sets`` from the domain-training datastore."""
    from rankwise.tasks.memory_decoder.task import Datastore, head_inputs, knn_distribution
    train = _windows(corpus["domain"])
    keys, values = [], []
    for s in range(0, len(train), 64):
        ids = torch.tensor([train[i]["input_ids"] for i in range(s, min(s + 64, len(train)))])
        keys.append(head_inputs(base, ids)[0][:, :-1].reshape(-1, HIDDEN))
        values.append(ids[:, 1:].reshape(-1))
    store = Datastore(torch.cat(keys), torch.cat(values), _memdec_config())
    outs = []
    for held in sets:
        out = []
        for s in range(0, len(held), 64):
            ids = torch.tensor([held[i]["input_ids"] for i in range(s, min(s + 64, len(held)))])
            q = head_inputs(base, ids)[0][:, :-1].reshape(-1, HIDDEN)
            d, v, valid = store.search(q, K)
            out.append(knn_distribution(d, v, 256, TEMPERATURE, valid).clamp(min=1e-30).log())
        outs.append(torch.cat(out))
    return outs


def _sets(corpus) -> dict:
    return {"validation": _windows(corpus["domain_val"]), "domain": _windows(corpus["domain_held"]),
            "general": _windows(corpus["general_held"], limit=EVAL_GENERAL)}


def _eval(work: Path, corpus) -> dict:
    """Every model on the test sets, each mixture at its ``lambda`` chosen on the validation
    windows (Memory Decoder also at 0.55 and 0.25); ``lambda``: the choices and the curves."""
    from rankwise.tasks.memory_decoder.generation import interpolate
    sets = _sets(corpus)
    base, models = _load(work, "base"), {k: _load(work, k) for k in ("memdec", "dapt", "lora")}
    logp = {name: {"base": _logprobs(base, data)} for name, data in sets.items()}
    for name, data in sets.items():
        logp[name].update({k: _logprobs(m, data)[0] for k, m in models.items()})
    knn_val, knn_test = _knn_logprobs(base, corpus, [sets["validation"], sets["domain"]])
    (lb_v, y_v), v = logp["validation"]["base"], logp["validation"]
    chosen, curves = {}, {}
    for key, other in (("memdec", v["memdec"]), ("dapt", v["dapt"]), ("knn", knn_val)):
        chosen[key], curves[key] = choose_lambda(lb_v, other, y_v)
    lm, ld, lk = chosen["memdec"], chosen["dapt"], chosen["knn"]
    rows: dict[str, dict] = {}
    for name in ("domain", "general"):
        (lb, y), p = logp[name]["base"], logp[name]
        r = {"base": _ppl(lb, y),
             f"base + Memory Decoder (lambda {lm}, chosen on validation)": _ppl(interpolate(lb, p["memdec"], lm), y),
             f"base + Memory Decoder (lambda {LAM_PUBLISHED}, the authors' published evaluation)":
                 _ppl(interpolate(lb, p["memdec"], LAM_PUBLISHED), y),
             f"base + Memory Decoder (lambda {LAM_CODE}, the released code's default)":
                 _ppl(interpolate(lb, p["memdec"], LAM_CODE), y),
             "Memory Decoder alone": _ppl(p["memdec"], y),
             f"base + DAPT decoder (CE only, lambda {ld}, chosen on validation)": _ppl(interpolate(lb, p["dapt"], ld), y),
             "DAPT decoder alone": _ppl(p["dapt"], y), "LoRA r=8": _ppl(p["lora"], y)}
        if name == "domain":
            r[f"kNN-LM (lambda {lk}, chosen on validation)"] = _ppl(interpolate(lb, knn_test, lk), y)
            r["lambda sweep (base + Memory Decoder)"] = {
                str(lam): _ppl(interpolate(lb, p["memdec"], lam), y) for lam in GRID}
        rows[name] = {"windows": len(sets[name]), "tokens": int(y.numel()), **r}
    rows["lambda"] = {"grid": list(GRID), "chosen": chosen, "validation ppl": curves,
                      "validation windows": len(sets["validation"]), "validation tokens": int(y_v.numel())}
    return rows


def _eval_large(work: Path, corpus) -> dict:
    """The larger base alone and with the *same* Memory Decoder (trained on the small base's
    datastore), at the ``lambda`` chosen with the larger base on the validation windows and at
    0.55: the plug-and-play claim."""
    from rankwise.tasks.memory_decoder.generation import interpolate
    sets = _sets(corpus)
    large, mem = _load(work, "base_large", LARGE), _load(work, "memdec")
    lb_v, y_v = _logprobs(large, sets["validation"])
    lam, curve = choose_lambda(lb_v, _logprobs(mem, sets["validation"])[0], y_v)
    rows: dict = {"lambda": {"chosen": lam, "validation ppl": curve}}
    for name in ("domain", "general"):
        lb, y = _logprobs(large, sets[name])
        lm, _ = _logprobs(mem, sets[name])
        rows[name] = {"large base": _ppl(lb, y),
                      f"large base + Memory Decoder (lambda {lam}, chosen on validation)":
                          _ppl(interpolate(lb, lm, lam), y),
                      f"large base + Memory Decoder (lambda {LAM_PUBLISHED})": _ppl(interpolate(lb, lm, LAM_PUBLISHED), y)}
    return rows


def run(out: Path) -> dict:
    """Run (or resume) every piece and write ``results.json`` + ``results.md``."""
    from rankwise.errors import require
    require("faiss", "memory", "rankwise bench memory-decoder")
    torch.set_num_threads(1)
    out = Path(out)
    work, pieces = out / "_work", out / "pieces"
    work.mkdir(parents=True, exist_ok=True)
    pieces.mkdir(parents=True, exist_ok=True)
    corpus = _corpus()
    steps = {"base": lambda: _base(work, corpus), "memdec": lambda: _adapt(work, corpus, "memdec"),
             "dapt": lambda: _adapt(work, corpus, "dapt"), "lora": lambda: _adapt(work, corpus, "lora"),
             "eval": lambda: _eval(work, corpus),
             "base_large": lambda: _base(work, corpus, "base_large", LARGE),
             "eval_large": lambda: _eval_large(work, corpus)}
    done = {}
    for name, fn in steps.items():
        path = pieces / f"{name}.json"
        if not path.is_file():
            atomic.write_json(path, fn())
        done[name] = json.loads(path.read_text())
    result = {"family": FAMILY, "bytes": {k: int(v.numel()) for k, v in corpus.items()},
              "sizes": {"hidden": HIDDEN, "layers": LAYERS, "seq": SEQ, "batch": BATCH},
              "memory_decoder": {"k": K, "temperature": TEMPERATURE, "target_tokens": TARGET_TOKENS,
                                 "index": f"ivf lists={LISTS} probe={PROBE}", "lambda grid": list(GRID),
                                 "lambda published": LAM_PUBLISHED, "lambda code default": LAM_CODE},
              "torch": torch.__version__, "python": platform.python_version(), **done}
    write_results(out, result, markdown(result))
    return result


def markdown(r: dict) -> str:
    """``results.md`` from the record."""
    ev, md = r["eval"], r["memory_decoder"]
    lam = ev["lambda"]
    names = [k for k in ev["domain"] if k not in ("windows", "tokens") and not isinstance(ev["domain"][k], dict)]
    grid = md["lambda grid"]
    lines = [f"# Memory Decoder on the unseen `{r['family']}` package (byte-level, one seed)", "",
             f"Base: {r['sizes']['layers']}-layer {r['sizes']['hidden']}-wide Llama pretrained "
             f"{r['base']['steps']} steps ({r['base']['tokens']:,} bytes) on the stdlib without `{r['family']}`. "
             f"Domain training: {r['memdec']['windows']} windows of {r['sizes']['seq']} bytes, "
             f"{r['memdec']['steps']} steps each; datastore {r['memdec']['datastore']:,} keys "
             f"({md['index']}), k={md['k']}, T={md['temperature']}. Each mixture's lambda is chosen "
             f"on a validation split of {lam['validation windows']} windows ({lam['validation tokens']:,} "
             f"bytes) carved from the domain's training modules (left out of every training and the "
             f"datastore), from the grid {grid[0]}..{grid[-1]}; never on the test windows.", "",
             "| model | held-out domain ppl | held-out general ppl |", "|---|---|---|"]
    for n in names:
        gen = ev["general"].get(n)
        lines.append(f"| {n} | {ev['domain'][n]:.3f} | {'' if gen is None else f'{gen:.3f}'} |")
    if "eval_large" in r:
        big = r["eval_large"]
        lines += ["", f"The same Memory Decoder plugged into a larger base ({LARGE[1]} layers, {LARGE[0]} wide, "
                  "same pretraining data and steps; lambda chosen with the larger base on the validation split):",
                  "", "| model | held-out domain ppl | held-out general ppl |", "|---|---|---|"]
        lines += [f"| {n} | {big['domain'][n]:.3f} | {big['general'][n]:.3f} |" for n in big["domain"]]
    lines += ["", "Validation ppl by lambda (the choice):"]
    labels = {"memdec": "base + Memory Decoder", "dapt": "base + DAPT decoder", "knn": "kNN-LM"}
    for key, curve in lam["validation ppl"].items():
        lines.append(f"- {labels[key]}: " + ", ".join(f"{k}: {v:.3f}" for k, v in curve.items())
                     + f" (chosen {lam['chosen'][key]})")
    if "eval_large" in r:
        big = r["eval_large"]["lambda"]
        lines.append("- large base + Memory Decoder: " + ", ".join(
            f"{k}: {v:.3f}" for k, v in big["validation ppl"].items()) + f" (chosen {big['chosen']})")
    sweep = ev["domain"]["lambda sweep (base + Memory Decoder)"]
    lines += ["", "Test-set lambda sweep (diagnostic only, not used to choose; domain ppl, base + Memory Decoder): "
              + ", ".join(f"{k}: {v:.3f}" for k, v in sweep.items()), "",
              f"Held-out tokens: domain {ev['domain']['tokens']:,}, general {ev['general']['tokens']:,}. "
              "Perplexity is per byte (the vocabulary is bytes).", ""]
    return "\n".join(lines)


__all__ = ["choose_lambda", "markdown", "run"]
