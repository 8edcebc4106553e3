"""``rankwise bench distill``: Low-Rank Clone against a same-shape student trained from
scratch and a width-pruned + distilled student (Minitron-style), at equal training tokens.

The teacher is the reference base (:func:`rankwise_bench.common.reference_base`: a 6-layer,
256-wide Llama of 6.45M parameters that rankwise pretrained on the standard library's source,
with its SentencePiece tokenizer of 8,192 pieces), loaded as it is and never trained here.
Decision (issue 35 item 2): LRC and Minitron need a pretrained teacher, and a 128-wide student
of the base's 6 x 256 shape fits, so the byte-level 128 x 2 teacher this benchmark used to
pretrain, and its pretraining code, are gone. The windows are ``seq`` tokens of the base's own
tokenizer over the same ``stdlib-source`` text and the base's own split
(:func:`rankwise.data.corpus.heldout_module`): students train, and Minitron calibrates, on
windows of the training modules; every model is evaluated on the same windows of held-out
modules, as loss per token and per byte (total nats / total UTF-8 bytes of the scored tokens'
text, :class:`TokenWindows`), the teacher included (``pieces/teacher.json``).

Every student has the teacher's depth, heads, head size, FFN width and tied head and hidden
``student_hidden``, sees the same windows in the same order (one epoch, seed 1), and is evaluated
at each token budget of :class:`BenchSizes`. Rows (each over a small learning-rate grid, the best
by the final held-out loss reported):

* ``lrc``: :class:`rankwise.compress.clone.LowRankClone` at ``DistillConfig``'s defaults: CE +
  KL(T = 40) summed over each window and averaged over windows (the released code's
  ``batchmean``) + 0.2·clone MSE, from our SVD start; only the projections and student norms train.
* ``lrc-normal``: the same from the released code's N(0, 0.02) start (norms at 1).
* ``scratch``: the same plain student shape, random initialisation, next-token CE.
* ``lrc-noclone``: ablation, LRC without the clone terms (CE + KL).
* ``minitron``: the teacher width-pruned to the hidden channels of largest activation
  importance (mean |RMSNorm output| per channel over calibration windows, summed over every
  norm: Minitron's embedding-channel score), then every weight trained on CE + KL at T = 1
  (logit distillation).

The byte-level run's ``lrc-token-*`` rows (the earlier reading, KL averaged over tokens) are not
rerun: an LRC piece is the costliest (the 6.45M teacher runs beside the student on every step)
and the code path is unchanged; their numbers stay in ``bench/results/distill`` at commit 812268e.

Each piece (the teacher's evaluation, each row x learning rate) writes ``pieces/NAME.json`` and
is skipped when present, so the benchmark can be stopped and run again; a piece of another
teacher is refused. Quality only: no time claims.
"""
from __future__ import annotations

import hashlib
import json
import math
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from rankwise.compress.clone import LowRankClone, kl_teacher_student, student_config
from rankwise.engine import Engine, evaluate, get_task
from rankwise.errors import RankwiseError
from rankwise_bench.common import ROOT, reference_base, write_results
from rankwise_bench.distill_report import markdown, plot


@dataclass
class BenchSizes:
    """Everything that sets the benchmark's size (defaults: 14 pieces, 29 minutes of one shared core).

    Attributes:
        student_hidden: Every student's hidden size.
        seq, batch: Tokens per window, windows per step.
        budgets: Student steps at which held-out loss is measured (the last is the run length).
        lrs: The learning-rate grid of every student row.
        extra_lrs: ``(row, lr)`` pairs run beyond the grid: 3e-4 for the rows whose best rate
            sat at the grid's low edge in the first run and whose verdicts rest on it (LRC
            against Minitron, and the clone-term ablation).
        eval_windows: Held-out windows (of held-out modules).
        calib_windows: Minitron's importance windows (the first training windows).
        temperature: LRC's KL temperature (``DistillConfig``'s default, the authors' published run).
        threads: torch intra-op threads.
    """

    student_hidden: int = 128
    seq: int = 64
    batch: int = 8
    budgets: tuple[int, ...] = (30, 60, 120, 240)
    lrs: tuple[float, ...] = (1e-3, 3e-3)
    extra_lrs: tuple[tuple[str, float], ...] = (("lrc", 3e-4), ("minitron", 3e-4), ("lrc-noclone", 3e-4))
    eval_windows: int = 192
    calib_windows: int = 32
    temperature: float = 40.0
    threads: int = 1


ROWS = ("lrc", "lrc-normal", "minitron", "scratch", "lrc-noclone")


def row_lrs(s: BenchSizes, row: str) -> list[float]:
    """The learning rates ``row`` runs at: the grid, then its extra ones."""
    return [*s.lrs, *(lr for r, lr in s.extra_lrs if r == row)]
# LRC variants over the sizes' temperature: the released code's random start; no activation-clone
# terms (CE + KL only, not in the paper).
LRC_VARIANTS = {"lrc": {}, "lrc-normal": {"init": "normal", "seed": 1}, "lrc-noclone": {"clone_weight": 0.0}}


class TokenWindows:
    """Causal-LM examples: windows of ``seq`` tokens of a token stream, with the UTF-8 bytes of
    the text each token stands for (the base of the loss per byte).

    Args:
        ids: The token stream, shape ``(N,)``.
        nbytes: Bytes of text per token, shape ``(N,)`` (0 for BOS/EOS).
        starts: Start offset of each window, shape ``(W,)``.
        seq: Window length.
        pad_id: The engine's padding id (every window is full, so nothing is padded).
    """

    def __init__(self, ids: torch.Tensor, nbytes: torch.Tensor, starts: torch.Tensor, seq: int,
                 pad_id: int) -> None:
        self.ids, self.nbytes, self.starts, self.seq, self.pad_id = ids, nbytes, starts.flatten(), seq, pad_id

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        """Window ``i`` as ``{"input_ids": [id, ...]}``."""
        start = int(self.starts[i])
        return {"input_ids": self.ids[start: start + self.seq].tolist()}

    def scored(self) -> tuple[int, int]:
        """``(tokens, bytes)`` scored by a next-token loss over every window: positions 1..seq-1
        of each, and the UTF-8 bytes of their text."""
        offsets = self.starts[:, None] + torch.arange(1, self.seq)    # (W, seq - 1)
        return int(offsets.numel()), int(self.nbytes[offsets].sum())


def piece_bytes(tok) -> torch.Tensor:
    """UTF-8 bytes of each vocabulary entry's text: a byte-fallback piece ``<0xNN>`` is one, any
    other piece its text with ``▁`` read as a space (a special token met inside a text, such as
    a literal ``<s>`` in a module, its spelling; the BOS/EOS around texts count nothing)."""
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    return torch.tensor([1 if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", p) else len(p.replace("\u2581", " ").encode())
                         for p in pieces])


def token_stream(tok, heldout: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Every module of one side of the base's split as ``BOS + text + EOS`` (as its pretraining
    cut them), concatenated, with each token's bytes of text (the tokenizer's dummy-prefix
    space, not in the text, taken off each module's first token, so the bytes sum to the text's).

    Returns:
        ``(ids, nbytes, info)``: two ``(N,)`` tensors and the modules, tokens and bytes.
    """
    from rankwise.data.corpus import load_source_records
    table = piece_bytes(tok)
    texts = [r["text"] for r in load_source_records() if r["heldout"] == heldout]
    ids, nbytes, total = [], [], 0
    for text, enc in zip(texts, tok(texts, add_special_tokens=False)["input_ids"]):
        counts = table[torch.tensor(enc, dtype=torch.long)]
        extra = int(counts.sum()) - len(text.encode())
        if not 0 <= extra <= int(counts[0]):
            raise RuntimeError(f"bench distill: the tokenizer's pieces do not add up to the text ({extra} bytes)")
        counts[0] -= extra
        ids += [tok.bos_token_id, *enc, tok.eos_token_id]
        nbytes += [0, *counts.tolist(), 0]
        total += len(text.encode())
    info = {"modules": len(texts), "tokens": len(ids), "bytes": total}
    return torch.tensor(ids), torch.tensor(nbytes), info


def windows(tok, s: BenchSizes) -> tuple[TokenWindows, TokenWindows, dict]:
    """``budgets[-1] x batch`` training windows and ``eval_windows`` held-out ones at seeded
    random offsets (one generator, seed 1), with both splits' sizes."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    g = torch.Generator().manual_seed(1)
    out, info = [], {}
    for split, n in (("train", s.budgets[-1] * s.batch), ("heldout", s.eval_windows)):
        ids, nbytes, info[split] = token_stream(tok, split == "heldout")
        starts = torch.randint(0, len(ids) - s.seq, (n,), generator=g)
        out.append(TokenWindows(ids, nbytes, starts, s.seq, pad))
    tokens, nbytes = out[1].scored()
    info["heldout_windows"] = {"windows": len(out[1]), "scored_tokens": tokens, "scored_bytes": nbytes}
    return out[0], out[1], info


class LogitDistilled(nn.Module):
    """A plain student trained on CE + ``KL(p_t ‖ p_s)`` at temperature ``T``, averaged over
    tokens, against a frozen teacher (the KD of Minitron's retraining); the KL is an auxiliary
    loss for the engine."""

    def __init__(self, student: nn.Module, teacher: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.student, self.temperature = student, temperature
        self.teacher = [teacher.eval().requires_grad_(False)]   # a list: not a submodule
        self._aux: dict[str, torch.Tensor] = {}

    @property
    def config(self):
        return self.student.config

    def forward(self, input_ids, attention_mask=None, **kw):
        out = self.student(input_ids=input_ids, attention_mask=attention_mask, **kw)
        self._aux = {}
        if self.training:
            with torch.no_grad():
                t = self.teacher[0](input_ids=input_ids, attention_mask=attention_mask, **kw).logits
            self._aux = {"kl": kl_teacher_student(t, out.logits, self.temperature, attention_mask, "token")}
        return out

    def aux_losses(self) -> dict[str, torch.Tensor]:
        return dict(self._aux)


def channel_importance(teacher: nn.Module, data) -> torch.Tensor:
    """Per hidden channel: mean ``|RMSNorm output|`` over the windows' tokens, summed over every
    RMSNorm of the teacher (Minitron's activation-based embedding-channel importance)."""
    score = torch.zeros(teacher.config.hidden_size)

    def add(_m, _a, o):
        score.add_(o.detach().abs().float().mean((0, 1)))   # (d,) from (B, T, d); returns None
    hooks = [m.register_forward_hook(add) for name, m in teacher.named_modules() if name.endswith("norm")]
    ids = torch.tensor([data[i]["input_ids"] for i in range(len(data))])   # (N, T)
    with torch.no_grad():
        teacher.eval()(input_ids=ids)
    for h in hooks:
        h.remove()
    return score


def _schedule(opt, steps: int):
    """10% linear warm-up, then constant (so every budget is measured at the same rate)."""
    warm = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warm))


def _train(model: nn.Module, lr: float, train, heldout, budgets, batch: int) -> dict:
    """AdamW on the trainable parameters through the engine; held-out loss at each budget."""
    task = get_task("causal-lm")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    engine = Engine(model, task, opt, train, batch, seed=1, scheduler=_schedule(opt, budgets[-1]),
                    grad_clip=1.0)
    curve, evals, t0 = [], {}, time.perf_counter()
    for k in range(budgets[-1]):
        curve.append(engine.train_step(k).loss)
        if k + 1 in budgets:
            evals[str(k + 1)] = evaluate(model, task, heldout, 32)["eval_loss"]
            if not math.isfinite(evals[str(k + 1)]):
                break
    return {"lr": lr, "heldout_loss": evals, "train_ce_curve": curve[::5],
            "trainable_params": sum(p.numel() for p in params), "wall_s": time.perf_counter() - t0}


def fingerprint(folder: Path) -> str:
    """sha256 of the teacher folder's ``config.json`` and weights (first 16 hex digits)."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _same_teacher(out: Path, mark: str) -> None:
    """Refuse a results folder whose pieces another teacher measured."""
    for path in sorted((out / "pieces").glob("*.json")):
        other = json.loads(path.read_text()).get("teacher")
        if other != mark:
            raise RankwiseError(f"bench distill: {path} was measured with another teacher (fingerprint "
                                f"{other}, this one {mark}); give a new --out or delete {out / 'pieces'}")


def _piece(out: Path, name: str, fn) -> dict:
    path = out / "pieces" / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    print(f"bench distill: {name} ...", flush=True)
    rec = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    return rec


def _per_byte(losses: dict, factor: float) -> dict:
    return {k: v * factor for k, v in losses.items()}


def _student(row: str, load, s: BenchSizes, calib) -> nn.Module:
    """Row ``row``'s model before its first step; ``load()`` gives a fresh frozen teacher (a
    Low-Rank Clone hooks the teacher it is given, so no two models share one)."""
    if row in LRC_VARIANTS:
        return LowRankClone(load(), s.student_hidden, **{"temperature": s.temperature, **LRC_VARIANTS[row]})
    teacher = load()
    if row == "minitron":
        keep = channel_importance(teacher, calib).topk(s.student_hidden).indices.sort().values
        pruner = LowRankClone(teacher, s.student_hidden)
        pruner.select(keep)
        return LogitDistilled(pruner.bake().train().requires_grad_(True), load(), 1.0)
    from transformers import LlamaForCausalLM
    torch.manual_seed(1)
    return LlamaForCausalLM(student_config(teacher.config, s.student_hidden, True))


def _row_piece(row: str, lr: float, load, s: BenchSizes, train, held, factor: float, mark: str):
    def go():
        model = _student(row, load, s, torch.utils.data.Subset(train, range(s.calib_windows)))
        task = get_task("causal-lm")
        start = evaluate(model, task, held, 32)["eval_loss"]
        rec = _train(model, lr, train, held, s.budgets, s.batch)
        rec["heldout_loss_at_0"] = start
        rec["heldout_nats_per_byte"] = _per_byte(rec["heldout_loss"], factor)
        rec["heldout_nats_per_byte_at_0"] = start * factor
        if row in LRC_VARIANTS:   # the baked plain student gives the same held-out loss
            rec["baked_heldout_loss"] = evaluate(model.bake(), task, held, 32)["eval_loss"]
        plain = model.bake() if row in LRC_VARIANTS else getattr(model, "student", model)
        rec["student_params"] = sum(p.numel() for p in plain.parameters())
        rec["teacher"] = mark
        return rec
    return go


def run(out: Path, sizes: BenchSizes | None = None, only: tuple[str, ...] = (),
        teacher: Path | None = None) -> dict:
    """Run the missing pieces, then write ``results.json``, ``results.md``, ``heldout_ppl.png``.

    Args:
        out: The results folder.
        sizes: Override :class:`BenchSizes` (tests use a tiny one).
        only: Run only pieces whose names start with one of these (``teacher``, ``lrc``...);
            the results are written once every piece exists.
        teacher: A Llama folder with its tokenizer (default: the reference base; tests build a
            tiny one).

    Returns:
        The results record, or ``{"missing": [piece, ...]}`` while pieces are still to run.

    Raises:
        RankwiseError: When ``out/pieces`` were measured with another teacher, or the reference
            base is not built.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    s, out = sizes or BenchSizes(), Path(out)
    folder = Path(teacher) if teacher is not None else reference_base()
    mark = fingerprint(folder)
    _same_teacher(out, mark)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        train, held, info = windows(tok, s)
        factor = info["heldout_windows"]["scored_tokens"] / info["heldout_windows"]["scored_bytes"]
        load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # noqa: E731
        wanted = lambda n: not only or any(n.startswith(o) for o in only)  # noqa: E731

        def teacher_piece():
            model = load()
            loss = evaluate(model, get_task("causal-lm"), held, 32)["eval_loss"]
            c = model.config
            shape = {"hidden": c.hidden_size, "layers": c.num_hidden_layers, "heads": c.num_attention_heads,
                     "kv_heads": c.num_key_value_heads, "intermediate": c.intermediate_size,
                     "vocab": c.vocab_size, "tied": bool(c.tie_word_embeddings)}
            return {"teacher": mark, "shape": shape, "params": sum(p.numel() for p in model.parameters()),
                    "heldout_loss": loss, "heldout_nats_per_byte": loss * factor}
        pieces = {}
        if wanted("teacher") or (out / "pieces" / "teacher.json").is_file():
            pieces["teacher"] = _piece(out, "teacher", teacher_piece)
        for row in ROWS:
            for lr in row_lrs(s, row):
                name = f"{row}-lr{lr:g}"
                if wanted(name) or (out / "pieces" / f"{name}.json").is_file():
                    pieces[name] = _piece(out, name, _row_piece(row, lr, load, s, train, held, factor, mark))
    finally:
        torch.set_num_threads(threads)
    names = ["teacher"] + [f"{r}-lr{lr:g}" for r in ROWS for lr in row_lrs(s, r)]
    missing = [n for n in names if n not in pieces]
    if missing:
        print(f"bench distill: pieces still to run: {missing}")
        return {"missing": missing}
    result = _results(s, info, pieces, folder)
    write_results(out, result, markdown(result))
    plot(result, out / "heldout_ppl.png")
    return result


def _results(s: BenchSizes, info: dict, pieces: dict, folder: Path) -> dict:
    best = {}
    for row in ROWS:
        runs = [pieces[f"{row}-lr{lr:g}"] for lr in row_lrs(s, row)]
        final = lambda r: r["heldout_loss"].get(str(s.budgets[-1]), math.inf)  # noqa: E731
        best[row] = min(runs, key=lambda r: final(r) if math.isfinite(final(r)) else math.inf)
    tokens = {b: b * s.batch * s.seq for b in s.budgets}
    name = folder.resolve().relative_to(ROOT).as_posix() if folder.resolve().is_relative_to(ROOT) else folder.name
    t = pieces["teacher"]
    return {"sizes": asdict(s), "corpus": info, "python": platform.python_version(), "torch": torch.__version__,
            "teacher": {"path": name, "fingerprint": t["teacher"], "shape": t["shape"], "params": t["params"],
                        "heldout_loss": t["heldout_loss"], "heldout_nats_per_byte": t["heldout_nats_per_byte"]},
            "tokens_per_budget": tokens, "best": best, "pieces": pieces}
