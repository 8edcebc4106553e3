"""``rankwise bench tpa``: Tensor Product Attention (T6) against MHA, GQA and MQA at matched
attention parameters, pre-trained from scratch on the Python standard library's bytes.

Every row is the same Llama-style model (width, depth, MLP, ``d_h``, embeddings) except its
attention, whose head count follows the paper's rule (:mod:`.rows`); MHA, GQA and MQA are
transformers' ``LlamaForCausalLM``, TPA and TPA-KVonly are :mod:`rankwise.models.tpa`. Each
row trains on the same windows in the same order from the same seed, through the shared
:class:`~rankwise.engine.Engine` and ``causal-lm`` task (equal tokens), then reports its
held-out loss, its KV cache per token and layer (measured on the cache after a prefill, beside
the paper's Table 1 formula) and its greedy decoding speed with that cache (rows interleaved
over rounds; ratios to MHA within a round). The corpus is the benchmarks' one
(:func:`rankwise_bench.corpus.load_corpus`).
"""
from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import nn

from rankwise.engine import Engine, evaluate, get_task
from rankwise.errors import RankwiseError
from rankwise_bench.common import torch_threads, write_results
from rankwise_bench.corpus import ByteWindows, corpus_windows
from rankwise_bench.tpa.report import markdown, plot
from rankwise_bench.tpa.rows import ROWS, Sizes, kv_formula, matched_heads

__all__ = ["ROWS", "Sizes", "attention_params", "build", "markdown", "matched_heads", "run"]


def build(row: str, s: Sizes) -> nn.Module:
    """The row's causal LM with seeded random weights (float32)."""
    heads = matched_heads(row, s.hidden, s.head_dim, s.q_rank, s.k_rank, s.v_rank, s.gqa_groups)
    common = dict(vocab_size=256, hidden_size=s.hidden, intermediate_size=s.intermediate,
                  num_hidden_layers=s.layers, num_attention_heads=heads, head_dim=s.head_dim,
                  max_position_embeddings=s.seq + s.prompt + s.new_tokens, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)
    torch.manual_seed(s.seed)
    if row.startswith("tpa"):
        from rankwise.models.tpa import TPAConfig, TPAForCausalLM
        return TPAForCausalLM(TPAConfig(q_rank=s.q_rank, k_rank=s.k_rank, v_rank=s.v_rank,
                                        kv_only=row == "tpa-kvonly", **common))
    from transformers import LlamaConfig, LlamaForCausalLM
    kv = {"mha": heads, "gqa": s.gqa_groups, "mqa": 1}[row]
    cfg = LlamaConfig(num_key_value_heads=kv, tie_word_embeddings=False, **{**common, "num_attention_heads": kv})
    # LlamaConfig's validator wants heads | width even with head_dim set; the modules only need
    # kv | heads, so the matched count is set after validation (h d_h need not equal d).
    cfg.num_attention_heads = heads
    return LlamaForCausalLM(cfg)


def attention_params(model: nn.Module) -> int:
    """Parameters of the attention modules of every layer."""
    return sum(p.numel() for layer in model.model.layers for p in layer.self_attn.parameters())


def _train(row: str, lr: float, s: Sizes, train: ByteWindows, heldout: ByteWindows) -> tuple[nn.Module, dict]:
    model = build(row, s)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, s.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / warm if k < warm else
                                              0.1 + 0.45 * (1 + math.cos(math.pi * (k - warm) / max(1, s.steps - warm))))
    engine = Engine(model, get_task("causal-lm"), opt, train, s.batch, seed=s.seed, scheduler=sched)
    t0 = time.perf_counter()
    curve = [engine.train_step(k).loss for k in range(s.steps)]
    train_s = time.perf_counter() - t0
    loss = evaluate(model, get_task("causal-lm"), heldout, 16)["eval_loss"]
    return model.eval(), {"lr": lr, "train_curve": curve, "heldout_loss": loss, "train_s": train_s}


@torch.no_grad()
def cache_bytes_per_token(model: nn.Module, prompt: torch.Tensor) -> float:
    """Bytes of the KV cache after a prefill of ``prompt`` ``(1, T)``, per token and layer."""
    cache = model(prompt, use_cache=True).cache
    layers = model.config.num_hidden_layers
    if hasattr(cache, "nbytes") and callable(cache.nbytes):     # TPACache
        total = cache.nbytes()
    else:                                                        # transformers' DynamicCache
        total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return total / (prompt.shape[1] * layers)


@torch.no_grad()
def _decode_seconds(model: nn.Module, prompt: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == prompt.shape[1] + n
    return dt


def run(out: Path, sizes: Sizes | None = None, rows: tuple[str, ...] = ROWS) -> dict:
    """Run the benchmark and write ``results.json``, ``results.md`` and ``tpa.png``.

    Args:
        out: Output folder (created).
        sizes: Override the default :class:`Sizes` (tests use a tiny one).
        rows: Which of :data:`ROWS` (``mha`` is always included: it is the reference).

    Returns:
        The results dict written to ``results.json``.

    Raises:
        RankwiseError: An unknown row.
    """
    s = sizes or Sizes()
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise RankwiseError(f"tpa rows: got {unknown}; expected some of {list(ROWS)}")
    rows = tuple(dict.fromkeys(("mha",) + tuple(rows)))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    with torch_threads(s.threads):
        train, heldout, info, held_bytes, g = corpus_windows(s.seq, s.steps, s.batch, s.eval_windows, s.seed)
        p0 = int(torch.randint(0, held_bytes.numel() - s.prompt, (1,), generator=g))
        prompt = held_bytes[p0: p0 + s.prompt].long()[None]
        models, res, sweep = {}, {}, {r: {} for r in rows}
        for lr in s.lrs:                                      # all rows at one rate, then the next
            for row in rows:
                model, r = _train(row, lr, s, train, heldout)
                sweep[row][lr] = r["heldout_loss"]
                if row not in res or r["heldout_loss"] < res[row]["heldout_loss"]:
                    models[row], res[row] = model, r
        for row in rows:
            res[row]["sweep"] = sweep[row]
        for row, model in models.items():
            cfg = model.config
            kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
            res[row].update(heads=cfg.num_attention_heads, kv_heads=kv_heads if not row.startswith("tpa") else "-",
                            attn_params=attention_params(model) // cfg.num_hidden_layers,
                            kv_bytes_per_token_layer=cache_bytes_per_token(model, prompt),
                            kv_formula_bytes=4 * kv_formula(row, cfg.num_attention_heads, s.head_dim,
                                                            s.k_rank, s.v_rank, s.gqa_groups))
        speeds: dict[str, list[float]] = {r: [] for r in rows}
        ratios: dict[str, list[float]] = {r: [] for r in rows}
        for _ in range(s.decode_rounds):                      # interleaved: load spreads over all rows
            sec = {r: _decode_seconds(models[r], prompt, s.new_tokens) for r in rows}
            for r in rows:
                speeds[r].append(s.new_tokens / sec[r])
                ratios[r].append(sec["mha"] / sec[r])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    mha_params = 4 * s.hidden ** 2
    for r in rows:
        res[r].update(decode_tok_s=med(speeds[r]), decode_tok_s_rounds=speeds[r],
                      decode_ratio_to_mha=med(ratios[r]),
                      kv_ratio_to_mha=res[r]["kv_bytes_per_token_layer"] / res["mha"]["kv_bytes_per_token_layer"])
    result = {"sizes": asdict(s), "corpus": info, "tokenizer": "bytes (vocab 256)", "mha_attn_params": mha_params,
              "python": platform.python_version(), "torch": torch.__version__,
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "wall_s": time.time() - t_start, "rows": res}
    write_results(out, result, markdown(result))
    plot(result, out / "tpa.png")
    return result


def tiny() -> Sizes:
    """A size for tests: seconds on one core."""
    return replace(Sizes(), hidden=32, layers=1, intermediate=64, head_dim=8, seq=16, batch=2, steps=3, lrs=(1e-3,),
                   eval_windows=2, prompt=4, new_tokens=3, decode_rounds=1)
