"""RestoreLCC: give a pruned LLM back the head outputs pruning took away, without changing a
single pruned weight.

Zhang et al., "Restoring Pruned Large Language Models via Lost Component Compensation",
NeurIPS 2025 (arXiv 2510.21834), read from the released code ``zijian678/restorelcc`` and the
abstract (explained in docs/compression.md; the paper's own equation numbers were not
available, so the formulas are written out here). For head ``h`` of an attention layer, ``a_h``
is its output at a position: the slice of the ``o_proj`` input that belongs to the head
(``d = head_dim`` wide).

1. **Lost directions.** Over N probe windows, at the last token, ``Δ_h = A_h^dense −
   A_h^pruned`` (N×d) ``= U S Vᵀ``; ``V_h`` is ``Vᵀ`` zero-padded to d×d when N < d, rows
   normalised to unit length. It stays fixed.
2. **Contrastive head selection.** A logistic probe per head on the dense model's last-token
   ``a_h`` separates a window (label 1) from the same window whose second half is another
   window's (label 0); the head's score is the probe's accuracy on held-out pairs. The best
   ``heads`` fraction of all heads is restored.
3. **Learned compensation.** ``ã_h = a_h + V_hᵀ v_h + b_h`` with ``v_h, b_h ∈ R^d`` zero at
   the start, trained with the causal-LM loss, everything else frozen.
4. **Fold.** ``c = concat_h(V_hᵀ v_h + b_h)`` (zeros for heads not chosen) does not depend on
   the input, so ``o_proj(a + c) = W_o a + (bias + W_o c)``: the bias becomes ``bias + W_o c``
   with ``W_o`` the (pruned) weight. No weight changes, so the sparsity is exactly the pruned one.

**The "lost component" form restricts nothing** (here and in the released code alike).
When N ≥ d, ``V_h`` is a full orthonormal basis of R^d. When N < d (``probes: 64`` against
head_dim 128 at real scale), its zero-padded rows are covered by the free bias ``b_h``. Either way
``V_hᵀ v_h + b_h`` can be any vector of R^d, so the trained correction is a plain per-head bias
(as in LoFiT). Only Adam's path to it differs, since the two parametrisations are scaled and
rotated differently. We keep the released parametrisation, so the optimisation follows the
code's. It is not a constraint to lost directions, and no result here should be read as one.

Choices where the sources leave room (see ``docs/compression.md``):

* The released code's contrastive pairs are an Alpaca answer against the most similar other
  answer (a sentence encoder). Here a probe window against the same window with its second half
  taken from the next window: no encoder, any text works.
* The released probe's input also concatenates ``a_h^pruned + m_h`` (the pruned output plus a
  "main component"); it is the same for both members of a pair, so it cannot tell them apart by
  itself (as a shared per-pair offset it can still move both across the probe's threshold, a
  small effect), and it is left out. Ties in accuracy are broken by the held-out BCE.
* The released head-index decoding divides by the number of layers for both the layer and the
  head (right only when #heads = #layers); heads here are decoded as ``(layer, head)`` directly.
* Llama's ``o_proj`` has no bias. The fold then sets ``config.attention_bias = true`` and adds
  the biases that switch creates (``q/k/v/o_proj``) as zeros, the ``o_proj`` ones then carrying
  ``W_o c``: transformers loads the folded model with no missing or unexpected weights.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from rankwise.compress.config import RestoreConfig, Sparsity
from rankwise.errors import RankwiseError


class LostComponents(nn.Module):
    """The learned compensation of one attention layer's chosen heads (step 3 above):
    ``c_h = V_hᵀ v_h + b_h`` added to head ``h``'s output, zeros for the other heads.

    Args:
        directions: ``(k, d, d)`` fixed lost directions ``V_h`` of the ``k`` chosen heads (rows
            are directions).
        heads: The ``k`` head indices, in the order of ``directions``.
        num_heads: Heads of the layer (the ``o_proj`` input is ``num_heads · d`` wide).
    """

    def __init__(self, directions: torch.Tensor, heads: list[int], num_heads: int) -> None:
        super().__init__()
        k, d, _ = directions.shape
        self.register_buffer("directions", directions.float())
        self.register_buffer("heads", torch.tensor(heads, dtype=torch.long))
        self.num_heads, self.head_dim = num_heads, d
        self.v = nn.Parameter(torch.zeros(k, d))     # magnitudes along the lost directions
        self.b = nn.Parameter(torch.zeros(k, d))     # free bias of each head

    def correction(self) -> torch.Tensor:
        """``c``, shape ``(num_heads · d,)``: ``V_hᵀ v_h + b_h`` in each chosen head's slice."""
        per_head = torch.einsum("kij,ki->kj", self.directions, self.v) + self.b    # (k, d)
        full = per_head.new_zeros(self.num_heads, self.head_dim).index_copy(0, self.heads, per_head)
        return full.reshape(-1)                                                     # (H·d,)

    def hook(self, module: nn.Module, args: tuple) -> tuple:
        """Forward pre-hook of ``o_proj``: its input ``(B, T, H·d)`` plus ``c``."""
        x = args[0]
        return (x + self.correction().to(x.dtype),) + tuple(args[1:])


def check_restore_config(config: Any) -> None:
    """The checks of ``compress.restore`` that need no model (run before loading it).

    Args:
        config: The whole ``compress:`` config.

    Raises:
        RankwiseError: The method does not prune, or more probes than calibration windows.
    """
    r: RestoreConfig = config.restore
    if not isinstance(config, Sparsity) or config.target_sparsity <= 0:
        raise RankwiseError(f"compress.restore needs a pruned model, but compress.method {config.method!r} "
                            "does not prune; use magnitude, wanda, sparsegpt or 3basil with sparsity > 0, "
                            "or set compress.restore.enabled: false")
    if r.probes > config.calibration.sequences:
        raise RankwiseError(f"compress.restore.probes is {r.probes} but compress.calibration.sequences is "
                            f"{config.calibration.sequences}; lower probes or raise sequences")


def check_restorable(model: nn.Module, config: Any, task: Any) -> list[str]:
    """Check, before any work, that ``compress.restore`` can run.

    Args:
        model: The (still dense) model.
        config: The whole ``compress:`` config (its method must prune).
        task: The model's task (its ``name``, and ``lm_loss``: trained on the next-token loss).

    Returns:
        The paths of the attention output projections.

    Raises:
        RankwiseError: The method does not prune, the model is not a causal LM, it has no
            ``o_proj`` layers or no head count, or more probes than calibration windows.
    """
    r: RestoreConfig = config.restore
    check_restore_config(config)
    if not task.lm_loss:
        raise RankwiseError(f"compress.restore trains with the causal-LM loss; task.name is {task.name}, "
                            "not causal-lm")
    paths = [n for n, m in model.named_modules() if n.endswith(r.o_proj) and isinstance(m, nn.Linear)]
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if not paths:
        raise RankwiseError(f"compress.restore found no linear layer named *{r.o_proj} (the attention output "
                            "projection); set compress.restore.o_proj to its name suffix")
    if not heads or any(model.get_submodule(p).in_features % heads for p in paths):
        raise RankwiseError(f"compress.restore: the model config's num_attention_heads ({heads}) does not "
                            f"split the *{r.o_proj} inputs into heads")
    return paths


def head_outputs(model: nn.Module, paths: list[str], ids: torch.Tensor, num_heads: int,
                 batch_size: int) -> torch.Tensor:
    """Every head's output at the last token of each window.

    Args:
        model: A causal LM.
        paths: Its ``o_proj`` layers.
        ids: ``(N, T)`` token windows.
        num_heads: Heads per layer.
        batch_size: Windows per forward.

    Returns:
        ``(N, layers, heads, d)`` float32.
    """
    got: dict[str, list[torch.Tensor]] = {p: [] for p in paths}

    def grab(path):
        return lambda module, args: got[path].append(args[0][:, -1].detach().float())   # (B, H·d)

    handles = [model.get_submodule(p).register_forward_pre_hook(grab(p)) for p in paths]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for chunk in ids.split(batch_size):
                model(input_ids=chunk, attention_mask=torch.ones_like(chunk), use_cache=False)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    per_layer = [torch.cat(got[p]).reshape(len(ids), num_heads, -1) for p in paths]   # (N, H, d) each
    return torch.stack(per_layer, dim=1)                                               # (N, L, H, d)


def lost_directions(dense: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """Step 1: per head, the right singular vectors of ``Δ = A^dense − A^pruned``, zero-padded
    to ``d × d`` and row-normalised.

    Args:
        dense: ``(N, L, H, d)`` dense head outputs.
        pruned: The same positions in the pruned model.

    Returns:
        ``(L, H, d, d)``; row ``i`` of ``[l, h]`` is the i-th lost direction of that head.
    """
    n, layers, heads, d = dense.shape
    delta = (dense - pruned).double().permute(1, 2, 0, 3)                 # (L, H, N, d)
    vt = torch.linalg.svd(delta, full_matrices=False).Vh                   # (L, H, min(N, d), d)
    out = torch.zeros(layers, heads, d, d, dtype=torch.float64)
    out[:, :, :vt.shape[2]] = vt
    return torch.nn.functional.normalize(out, dim=-1).float()


def contrast(ids: torch.Tensor) -> torch.Tensor:
    """The negatives of the contrastive probe: each window with its second half replaced by the
    next window's (cyclically)."""
    neg = ids.clone()
    half = ids.shape[1] // 2
    neg[:, half:] = ids.roll(-1, dims=0)[:, half:]
    return neg


def head_scores(pos: torch.Tensor, neg: torch.Tensor, epochs: int, lr: float, holdout: float,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2: one logistic probe per head (all trained at once, full batch, Adam), scored on
    held-out pairs.

    Args:
        pos: ``(P, G, d)`` dense head outputs of the probe windows (G heads in all).
        neg: ``(P, G, d)`` the same for their negatives.
        epochs: Full-batch Adam steps.
        lr: Adam learning rate.
        holdout: Fraction of pairs held out (at least one pair on each side).
        seed: Seeds the split.

    Returns:
        ``(accuracy, loss)``, each ``(G,)``: held-out accuracy and mean BCE of each head's probe.
    """
    p, g, d = pos.shape
    order = torch.randperm(p, generator=torch.Generator().manual_seed(seed))
    n_hold = min(p - 1, max(1, round(holdout * p)))
    hold, train = order[:n_hold], order[n_hold:]

    def split(idx):
        x = torch.cat([pos[idx], neg[idx]])                                 # (2n, G, d)
        y = torch.cat([torch.ones(len(idx)), torch.zeros(len(idx))])        # (2n,)
        return x, y[:, None].expand(-1, g)

    xt, yt = split(train)
    xh, yh = split(hold)
    w = torch.zeros(g, d, requires_grad=True)
    c = torch.zeros(g, requires_grad=True)
    opt = torch.optim.Adam([w, c], lr=lr)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    with torch.enable_grad():
        for _ in range(epochs):
            opt.zero_grad()
            loss = bce(torch.einsum("ngd,gd->ng", xt, w) + c, yt, reduction="none").mean(0).sum()
            loss.backward()
            opt.step()
    with torch.no_grad():
        logits = torch.einsum("ngd,gd->ng", xh, w) + c
        acc = ((logits >= 0).float() == yh).float().mean(0)
        held_loss = bce(logits, yh, reduction="none").mean(0)
    return acc, held_loss


def choose_heads(accuracy: torch.Tensor, loss: torch.Tensor, fraction: float) -> list[int]:
    """The best ``max(1, round(fraction · G))`` heads: highest accuracy, ties by lower loss."""
    k = max(1, round(fraction * accuracy.numel()))
    ranked = sorted(range(accuracy.numel()), key=lambda i: (-float(accuracy[i]), float(loss[i]), i))
    return sorted(ranked[:k])


def add_o_proj_bias(model: nn.Module, paths: list[str]) -> str:
    """Make sure every ``o_proj`` has a bias that transformers will save and load.

    Args:
        model: A transformers model.
        paths: Its ``o_proj`` layers.

    Returns:
        How the bias is stored (for the report).

    Raises:
        RankwiseError: An ``o_proj`` without a bias in a model whose config has no
            ``attention_bias`` switch.
    """
    layers = [model.get_submodule(p) for p in paths]
    if all(m.bias is not None for m in layers):
        return "the o_proj layers' own bias"
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "attention_bias"):
        raise RankwiseError("compress.restore folds into the o_proj bias, but these o_proj layers have none and "
                            "the model config has no attention_bias switch to add one")
    wanted = copy.deepcopy(cfg)
    wanted.attention_bias = True
    with torch.device("meta"):
        reference = type(model)(wanted)           # which parameters the switch adds, and their shapes
    have = dict(model.named_parameters())
    added = []
    for name, p in reference.named_parameters():
        if name in have:
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf != "bias" or not isinstance(module, nn.Linear):
            raise RankwiseError(f"compress.restore: attention_bias would add {name}, not a linear bias; "
                                "this architecture cannot store the folded bias")
        module.bias = nn.Parameter(torch.zeros(p.shape, dtype=module.weight.dtype, device=module.weight.device),
                                   requires_grad=False)
        added.append(name)
    cfg.attention_bias = True
    return f"config.attention_bias = true; {len(added)} zero biases added (q/k/v/o_proj), o_proj's carry W_o c"


def zero_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: weight == 0}`` of every matrix parameter (the sparsity pattern)."""
    return {n: p.detach() == 0 for n, p in model.named_parameters() if p.dim() == 2}


class RestoreLCC:
    """RestoreLCC (Zhang et al., NeurIPS 2025, arXiv 2510.21834): lost directions
    ``Δ_h = A_h^dense − A_h^pruned = U S Vᵀ``, contrastive head selection, learned
    ``ã_h = a_h + V_hᵀ v_h + b_h`` on the chosen heads, folded into ``o_proj``'s bias
    ``bias + W_o c`` (see the module docstring for each step and the choices made).

    Use: :meth:`record_dense` on the dense model, prune it, then :meth:`restore`.

    Args:
        config: ``compress.restore``.
        paths: The ``o_proj`` layers (:func:`check_restorable`).
        num_heads: Heads per layer.
        seed: Seeds the probe split and the batch order.
    """

    def __init__(self, config: RestoreConfig, paths: list[str], num_heads: int, seed: int = 0) -> None:
        self.config, self.paths, self.num_heads, self.seed = config, paths, num_heads, seed
        self.probe_ids: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None
        self.negative: torch.Tensor | None = None
        self.components: dict[str, LostComponents] = {}

    def record_dense(self, model: nn.Module, probe_ids: torch.Tensor, batch_size: int = 8) -> None:
        """Keep the dense model's last-token head outputs on the probes and their negatives."""
        self.probe_ids = probe_ids[:self.config.probes]
        self.dense = head_outputs(model, self.paths, self.probe_ids, self.num_heads, batch_size)
        self.negative = head_outputs(model, self.paths, contrast(self.probe_ids), self.num_heads, batch_size)

    def attach(self, model: nn.Module, pruned: torch.Tensor) -> list:
        """Steps 1-2: build the :class:`LostComponents` of the chosen heads and hook them onto
        ``o_proj``; returns the hook handles."""
        c = self.config
        directions = lost_directions(self.dense, pruned)                              # (L, H, d, d)
        n, layers, heads, d = self.dense.shape
        acc, loss = head_scores(self.dense.reshape(n, layers * heads, d), self.negative.reshape(n, layers * heads, d),
                                c.probe_epochs, c.probe_lr, c.probe_holdout, self.seed)
        self.scores = {"accuracy": acc.tolist(), "loss": loss.tolist()}
        self.chosen = [(i // heads, i % heads) for i in choose_heads(acc, loss, c.heads)]
        self.components = {}
        for li, path in enumerate(self.paths):
            hs = [h for l_, h in self.chosen if l_ == li]
            if hs:
                self.components[path] = LostComponents(directions[li, hs], hs, heads)
        return [model.get_submodule(p).register_forward_pre_hook(m.hook) for p, m in self.components.items()]

    def train(self, model: nn.Module, ids: torch.Tensor) -> list[float]:
        """Step 3: AdamW on ``v, b`` with the causal-LM loss (linear decay to 0), the model
        frozen and in eval mode (no dropout: the result is an inference-time bias)."""
        c = self.config
        params = [p for m in self.components.values() for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / c.steps)
        g = torch.Generator().manual_seed(self.seed)
        queue: list[int] = []
        losses = []
        with torch.enable_grad():
            for _ in range(c.steps):
                while len(queue) < min(c.batch_size, len(ids)):
                    queue += torch.randperm(len(ids), generator=g).tolist()
                batch, queue = ids[queue[:c.batch_size]], queue[c.batch_size:]
                out = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch, use_cache=False)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
                sched.step()
                losses.append(float(out.loss.detach()))
        return losses

    def fold(self, model: nn.Module) -> str:
        """Step 4: ``o_proj.bias += W_o c`` (float64 product); returns how the bias is stored."""
        storage = add_o_proj_bias(model, self.paths)
        with torch.no_grad():
            for path, comp in self.components.items():
                o = model.get_submodule(path)
                o.bias += (o.weight.double() @ comp.correction().double()).to(o.bias.dtype)
        return storage

    def restore(self, model: nn.Module, train_ids: torch.Tensor, batch_size: int = 8) -> dict[str, Any]:
        """Run steps 1-4 on the pruned ``model`` (in place).

        Args:
            model: The model :meth:`record_dense` saw, now pruned.
            train_ids: ``(N, T)`` windows of the LM loss.
            batch_size: Windows per forward while recording.

        Returns:
            The report: chosen heads and probe scores, trainable parameters, first/last losses,
            how the bias is stored, and whether every zero is where it was (always true).
        """
        if self.dense is None:
            raise RuntimeError("record_dense must run on the dense model first")
        masks = zero_masks(model)
        pruned = head_outputs(model, self.paths, self.probe_ids, self.num_heads, batch_size)
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        for p in model.parameters():
            p.requires_grad_(False)
        was = model.training
        model.eval()
        handles = self.attach(model, pruned)
        try:
            losses = self.train(model, train_ids)
        finally:
            for h in handles:
                h.remove()
            model.train(was)
            for n, p in model.named_parameters():
                p.requires_grad_(flags.get(n, False))
        storage = self.fold(model)
        after = zero_masks(model)
        same = all(torch.equal(m, after[n]) for n, m in masks.items())
        assert same, "RestoreLCC changed a weight's zeros"
        c = self.config
        return {"heads": [[self.paths[li], h] for li, h in self.chosen],
                "heads_total": len(self.paths) * self.num_heads, "probe_accuracy": self.scores["accuracy"],
                "trainable_params": sum(p.numel() for m in self.components.values() for p in m.parameters()),
                "steps": c.steps, "lr": c.lr, "batch_size": c.batch_size, "probes": len(self.probe_ids),
                "train_windows": len(train_ids), "loss_first": losses[0], "loss_last": losses[-1],
                "bias_storage": storage, "zeros_unchanged": same}
