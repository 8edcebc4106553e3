"""LoRASuite (Li et al. 2025, "LoRASuite: Efficient LoRA Adaptation Across Large Language Model
Upgrades", arXiv 2505.13515): carry a LoRA trained on an old base model over to a new one.

The tensor maths only; :mod:`rankwise.commands.transfer.run` reads the models and writes the run.
Every function takes plain float tensors in ``nn.Linear`` layout (``(out, in)``), hidden states
as rows, and returns float64 results.

1. Transfer matrix ``W_x`` (paper §3.2): least squares between the embedding rows of the
   tokens both vocabularies hold, ``W_x = pinv(E_old[common]) E_new[common]``, ``(h_old, h_new)``
   (:func:`transfer_matrix`); the identity when vocabularies and widths agree.
2. Layer mapping (§3.3): linear CKA (Kornblith et al. 2019) between every old and new layer's
   hidden states on calibration text (:func:`cka_matrix`), then the order-preserving
   assignment of largest summed similarity by a dynamic programme (:func:`layer_mapping`).
3. Head mapping (§3.4): cosine similarity of ``vec[W_xᵀ Q_aᵀ K_a W_x ⊕ W_xᵀ V_aᵀ O_aᵀ W_x]``
   (old head ``a``) and ``vec[Q_bᵀ K_b ⊕ V_bᵀ O_bᵀ]`` (new head ``b``), grouped K/V expanded to
   one per query head (:func:`head_similarity`), paired by the Hungarian algorithm
   (:func:`head_mapping`, ``scipy.optimize.linear_sum_assignment``).
4. Per-head ΔW (§3.4, the paper's eq. for ΔQ and ΔO): ``ΔQ_new[b] = T_Q ΔQ_old[a] W_x`` with
   ``T_Q = (Q_old[a] W_x Q_new[b]ᵀ)ᵀ`` (K, V alike) and
   ``ΔO_new[:, b] = W_xᵀ ΔO_old[:, a] T_O`` with ``T_O = O_old[:, a]ᵀ W_x O_new[:, b]``
   (:func:`transfer_attention`). Other linears: ``ΔW_new = W_xᵀ ΔW_old W_x`` on their hidden
   sides (:func:`transfer_dense`).
5. Re-factorisation to the old rank: ``B = U_r √S_r``, ``A = √S_r V_rᵀ`` (:func:`refactor`).

Where we differ from the authors' code (``lora_adaption.py``): with ``normalise=True`` (the
default) each head map is divided by the old head's Gram matrix, ``T_Q = (Q_old[a] W_x
Q_new[b]ᵀ)ᵀ (Q_old[a] Q_old[a]ᵀ)⁺`` and ``T_O = (O_old[:, a]ᵀ O_old[:, a])⁺ O_old[:, a]ᵀ W_x
O_new[:, b]``: the least-squares maps between the heads' spaces. Without it, transferring an
adapter to the very model it was trained on multiplies ΔQ by ``Q Qᵀ`` instead of returning it
(the identity transfer is not exact); with it, it is exact. ``normalise=False`` is the code's
formula.

MLPs. When an MLP's intermediate size is the same in both models, its intermediate side is kept
as is and its hidden side maps through ``W_x`` (:func:`transfer_dense`). When it changed, the
authors' code's MLP rule (used for its MiniCPM and BLOOMZ pairs, commented out for its Llama
pairs) applies (:func:`transfer_mlp`): for an up / gate projection (hidden in, intermediate out)
``ΔU_new = W_new_U pinv(W_x) pinv(W_old_U) ΔU_old W_x`` (the code's
``B_new = W_new_U pinv(W_x) pinv(W_old_U) B_old``, ``A_new = A_old W_x``); for a down projection
``ΔD_new = pinv(W_x) ΔD_old pinv(W_old_D) W_x W_new_D`` (``B_new = pinv(W_x) B_old``,
``A_new = A_old pinv(W_old_D) W_x W_new_D``). The intermediate side thus goes through the two
models' own weights, and the hidden output side through ``pinv(W_x)``, as in the code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION = ("q", "k", "v", "o")


def transfer_matrix(emb_old: torch.Tensor, emb_new: torch.Tensor) -> torch.Tensor:
    """``W_x = pinv(E_old) E_new``: the least-squares map from old to new hidden rows (step 1).

    Args:
        emb_old: Embedding rows of the shared tokens in the old model, ``(n, h_old)``.
        emb_new: The same tokens' rows in the new model, ``(n, h_new)``, row-aligned.

    Returns:
        ``(h_old, h_new)`` float64.
    """
    return torch.linalg.pinv(emb_old.double()) @ emb_new.double()


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two representations of the same ``n`` inputs (Kornblith et al. 2019, eq. 5):
    ``‖Yᵀ X‖²_F / (‖Xᵀ X‖_F ‖Yᵀ Y‖_F)`` after centring each column.

    Args:
        x: ``(n, h1)``. y: ``(n, h2)``.

    Returns:
        A similarity in [0, 1], invariant to rotations and isotropic scaling of either side.
    """
    x = x.double() - x.double().mean(0)
    y = y.double() - y.double().mean(0)
    num = (y.T @ x).square().sum()
    den = (x.T @ x).norm() * (y.T @ y).norm()
    return float(num / den) if den > 0 else 0.0


def cka_matrix(old: list[torch.Tensor], new: list[torch.Tensor]) -> torch.Tensor:
    """``S[i, j] = CKA(old[i], new[j])`` over layers' ``(n, h)`` hidden states (step 2)."""
    return torch.tensor([[linear_cka(x, y) for y in new] for x in old], dtype=torch.float64)


def layer_mapping(sim: torch.Tensor) -> list[int | None]:
    """The order-preserving layer assignment of largest summed similarity (step 2's DP).

    Every layer of the shorter side gets one distinct layer of the longer side, in increasing
    order: ``best[i][j] = max(best[i][j-1], best[i-1][j-1] + S[i-1][j-1])`` over the first ``i``
    short-side and ``j`` long-side layers, then one trace back.

    Args:
        sim: ``(L_old, L_new)`` similarities.

    Returns:
        For each old layer, the new layer it maps to (``None``: an old layer left out because
        the new model has fewer layers).
    """
    flip = sim.shape[0] > sim.shape[1]
    s = (sim.T if flip else sim).double()
    n, m = s.shape
    best = torch.full((n + 1, m + 1), float("-inf"), dtype=torch.float64)
    best[0, :] = 0.0
    for i in range(1, n + 1):
        for j in range(i, m + 1):
            best[i, j] = max(best[i, j - 1], best[i - 1, j - 1] + s[i - 1, j - 1])
    pairs, j = [], m
    for i in range(n, 0, -1):  # trace back: take (i-1, j-1) where the diagonal move made best[i, j]
        while best[i, j] == best[i, j - 1] and j > i:
            j -= 1
        pairs.append((i - 1, j - 1))
        j -= 1
    if flip:  # rows were new layers
        out: list[int | None] = [None] * sim.shape[0]
        for new_i, old_j in pairs:
            out[old_j] = new_i
        return out
    return [j for _, j in sorted(pairs)]


@dataclass
class Attention:
    """One attention block's base weights, ``nn.Linear`` layout.

    Attributes:
        q: ``(heads * head_dim, hidden)``. k, v: ``(kv_heads * head_dim, hidden)``.
        o: ``(hidden, heads * head_dim)``.
        heads: Query heads. kv_heads: Key/value heads (``< heads``: grouped-query attention).
    """
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.q.shape[0] // self.heads

    def rows(self, role: str) -> torch.Tensor:
        """``(heads, head_dim, hidden)`` of ``q``/``k``/``v`` (K, V repeated per query head) or
        ``(heads, hidden, head_dim)`` column blocks of ``o``."""
        d = self.head_dim
        if role == "o":
            return self.o.double().reshape(self.o.shape[0], self.heads, d).permute(1, 0, 2)
        w = getattr(self, role).double().reshape(-1, d, self.q.shape[1])
        return expand_kv(w, self.heads // w.shape[0])


def expand_kv(blocks: torch.Tensor, rep: int) -> torch.Tensor:
    """``(kv_heads, d, h)`` -> ``(kv_heads * rep, d, h)``: each K/V head once per query head of
    its group (transformers' ``repeat_kv`` order)."""
    return blocks.repeat_interleave(rep, dim=0)


def head_similarity(old: Attention, new: Attention, w_x: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the old and new heads' QK and VO maps in the new hidden space (step 3).

    The vectors ``vec[W_xᵀ Q_aᵀ K_a W_x ⊕ W_xᵀ V_aᵀ O_aᵀ W_x]`` are ``h_new²``-long each; their
    inner products are taken through ``head_dim``-sized products instead
    (``⟨Q_aᵀK_a, Q_bᵀK_b⟩ = ⟨Q_a Q_bᵀ, K_a K_bᵀ⟩``), so nothing of size ``h²`` per head is built.

    Returns:
        ``(heads_old, heads_new)`` cosines.
    """
    w = w_x.double()
    qa, ka, va = (old.rows(r) @ w for r in ("q", "k", "v"))  # (H_old, d_old, h_new)
    oa = (w.T @ old.rows("o"))  # (H_old, h_new, d_old)
    qb, kb, vb, ob = (new.rows(r) for r in ATTENTION)

    def inner(x1, y1, x2, y2):  # <x1ᵀ y1, x2ᵀ y2>_F for all head pairs = <x1 x2ᵀ, y1 y2ᵀ>_F
        return (torch.einsum("aij,bkj->abik", x1, x2) * torch.einsum("aij,bkj->abik", y1, y2)).sum((2, 3))

    # QK: x = Q, y = K; VO: Vᵀ Oᵀ, so x = V, y = Oᵀ (all (d, h_new))
    ot_a, ot_b = oa.transpose(1, 2), ob.transpose(1, 2)
    cross = inner(qa, ka, qb, kb) + inner(va, ot_a, vb, ot_b)
    self_a = (inner(qa, ka, qa, ka) + inner(va, ot_a, va, ot_a)).diagonal()
    self_b = (inner(qb, kb, qb, kb) + inner(vb, ot_b, vb, ot_b)).diagonal()
    return cross / (self_a.clamp_min(0).sqrt()[:, None] * self_b.clamp_min(0).sqrt()[None, :]).clamp_min(1e-300)


def head_mapping(sim: torch.Tensor) -> list[int | None]:
    """The one-to-one head pairing of largest total similarity (Hungarian algorithm, step 3).

    Returns:
        For each old head, its new head (``None`` when the new block has fewer heads and this
        one is left out).
    """
    from scipy.optimize import linear_sum_assignment
    rows, cols = linear_sum_assignment(sim.double().numpy(), maximize=True)
    out: list[int | None] = [None] * sim.shape[0]
    for a, b in zip(rows.tolist(), cols.tolist()):
        out[a] = b
    return out


def _pinv_gram(m: torch.Tensor) -> torch.Tensor:
    return torch.linalg.pinv(m @ m.T)


def transfer_attention(delta: dict[str, torch.Tensor], old: Attention, new: Attention,
                       w_x: torch.Tensor, heads: list[int | None],
                       normalise: bool = True) -> dict[str, torch.Tensor]:
    """Map the old block's ΔQ/ΔK/ΔV/ΔO head by head onto the new block (step 4).

    Args:
        delta: ``{"q"|"k"|"v"|"o": ΔW_old}`` for the adapted projections (``(out, in)``).
        old, new: The two blocks' base weights.
        w_x: ``(h_old, h_new)`` transfer matrix.
        heads: :func:`head_mapping`'s pairing.
        normalise: Divide each head map by the old head's Gram matrix (the module docstring).

    Returns:
        ``{role: ΔW_new}`` in the new block's shapes; a new head no old head maps to gets zero
        rows (columns of ΔO); grouped ΔK/ΔV average the mapped query heads of each group.
    """
    w = w_x.double()
    d_new, h_new = new.head_dim, new.q.shape[1]
    out: dict[str, torch.Tensor] = {}
    for role, dw in delta.items():
        src = old.rows(role)
        dst = new.rows(role)
        if role == "o":
            blocks = dw.double().reshape(dw.shape[0], old.heads, old.head_dim).permute(1, 0, 2)
            res = torch.zeros(new.heads, h_new, d_new, dtype=torch.float64)
            for a, b in enumerate(heads):
                if b is None:
                    continue
                t = src[a].T @ w @ dst[b]  # (d_old, d_new), the paper's O_old[:, a]ᵀ W_x O_new[:, b]
                if normalise:
                    t = _pinv_gram(src[a].T) @ t
                res[b] = w.T @ blocks[a] @ t
            out[role] = res.permute(1, 0, 2).reshape(h_new, new.heads * d_new)
            continue
        rep_old = old.heads // (dw.shape[0] // old.head_dim)
        blocks = expand_kv(dw.double().reshape(-1, old.head_dim, dw.shape[1]), rep_old)
        res = torch.zeros(new.heads, d_new, h_new, dtype=torch.float64)
        mapped = torch.zeros(new.heads, dtype=torch.float64)
        for a, b in enumerate(heads):
            if b is None:
                continue
            t = (src[a] @ w @ dst[b].T).T  # (d_new, d_old), the paper's (Q_old[a] W_x Q_new[b]ᵀ)ᵀ
            if normalise:
                t = t @ _pinv_gram(src[a])
            res[b] = t @ blocks[a] @ w
            mapped[b] = 1.0
        groups = new.heads // (new.kv_heads if role in ("k", "v") else new.heads)
        res = res.reshape(-1, groups, d_new, h_new).sum(1)
        count = mapped.reshape(-1, groups).sum(1).clamp_min(1.0)
        out[role] = (res / count[:, None, None]).reshape(-1, h_new)
    return out


def transfer_dense(delta: torch.Tensor, old_shape: tuple[int, int], new_shape: tuple[int, int],
                   w_x: torch.Tensor) -> torch.Tensor | None:
    """``ΔW_new = M_out ΔW_old M_in`` for a linear outside the per-head rule (step 4's fallback).

    A hidden side (``h_old`` -> ``h_new``) maps through ``W_x`` (input) or ``W_xᵀ`` (output);
    another side (an MLP's intermediate size) is kept when its size is the same in both models.

    Returns:
        ``(out_new, in_new)`` float64, or ``None`` when a non-hidden side changed size.
    """
    w = w_x.double()
    h_old, h_new = w.shape
    dw = delta.double()
    (o_old, i_old), (o_new, i_new) = old_shape, new_shape
    if i_old == h_old and i_new == h_new:
        dw = dw @ w
    elif i_old != i_new:
        return None
    if o_old == h_old and o_new == h_new:
        dw = w.T @ dw
    elif o_old != o_new:
        return None
    return dw


def transfer_mlp(delta: torch.Tensor, w_old: torch.Tensor, w_new: torch.Tensor,
                 w_x: torch.Tensor) -> torch.Tensor:
    """The authors' code's MLP rule, for an MLP linear whose intermediate size changed.

    An up / gate projection (in = the hidden size): ``W_new pinv(W_x) pinv(W_old) ΔW W_x``; a
    down projection (out = the hidden size): ``pinv(W_x) ΔW pinv(W_old) W_x W_new``.

    Args:
        delta: ``ΔW_old`` ``(out_old, in_old)``.
        w_old: The old base weight of that linear, same shape.
        w_new: The mapped new linear's base weight ``(out_new, in_new)``.
        w_x: ``(h_old, h_new)`` transfer matrix.

    Returns:
        ``ΔW_new`` ``(out_new, in_new)``, float64.

    Raises:
        ValueError: Neither side of the linear is the hidden size of both models.
    """
    w, dw, wo, wn = w_x.double(), delta.double(), w_old.double(), w_new.double()
    h_old, h_new = w.shape
    if wo.shape[1] == h_old and wn.shape[1] == h_new:            # up / gate: (inter, hidden)
        return wn @ torch.linalg.pinv(w) @ torch.linalg.pinv(wo) @ dw @ w
    if wo.shape[0] == h_old and wn.shape[0] == h_new:            # down: (hidden, inter)
        return torch.linalg.pinv(w) @ dw @ torch.linalg.pinv(wo) @ w @ wn
    raise ValueError(f"an MLP linear {tuple(wo.shape)} -> {tuple(wn.shape)} has no hidden side "
                     f"(hidden sizes {h_old} -> {h_new})")


def refactor(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ΔW ≈ B A`` at ``rank`` by truncated SVD: ``B = U_r √S_r``, ``A = √S_r V_rᵀ`` (step 5).

    Returns:
        ``(A (rank, in), B (out, rank))``, the protocol's factor order.
    """
    u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    a = torch.zeros(rank, delta.shape[1], dtype=torch.float64)
    b = torch.zeros(delta.shape[0], rank, dtype=torch.float64)
    a[:r], b[:, :r] = root[:, None] * vh[:r], u[:, :r] * root
    return a, b


class LoRASuite:
    """LoRASuite (arXiv 2505.13515), one mapped block at a time: head mapping by the Hungarian
    algorithm on the head-similarity vectors (§3.4), the per-head ΔQ/ΔK/ΔV/ΔO equations (§3.4),
    the hidden-side rule ``W_xᵀ ΔW W_x`` for the block's other linears, and the SVD
    re-factorisation to the old rank (§3.5). Steps 1-2 (``W_x``, the layer mapping) are
    :func:`transfer_matrix` and :func:`layer_mapping`.

    Args:
        w_x: ``(h_old, h_new)`` transfer matrix.
        normalise: Least-squares head maps (exact identity transfer); ``False``: the authors'
            code's unnormalised ones (module docstring).
    """

    def __init__(self, w_x: torch.Tensor, normalise: bool = True) -> None:
        self.w_x, self.normalise = w_x.double(), normalise

    def block(self, delta: dict[str, torch.Tensor], old: Attention | None, new: Attention | None,
              shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]],
              weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
              ) -> tuple[dict[str, torch.Tensor | None], list[int | None] | None]:
        """ΔW of one old block's adapted linears, moved onto the mapped new block.

        Args:
            delta: ``{key: ΔW_old}``; keys ``q``/``k``/``v``/``o`` are the attention projections
                (the per-head rule), any other key a linear of the block (the fallback).
            old, new: The blocks' attention weights (``None``: no attention key in ``delta``).
            shapes: ``{key: ((out, in) old, (out, in) new)}`` for the fallback keys.
            weights: ``{key: (W_old, W_new)}``, the base weights of fallback keys whose
                non-hidden (intermediate) side changed size: those move by :func:`transfer_mlp`.

        Returns:
            ``({key: ΔW_new or None (not transferable)}, head mapping or None)``.
        """
        attn = {k: v for k, v in delta.items() if k in ATTENTION}
        heads = None
        out: dict[str, torch.Tensor | None] = {}
        if attn:
            assert old is not None and new is not None
            heads = head_mapping(head_similarity(old, new, self.w_x))
            out.update(transfer_attention(attn, old, new, self.w_x, heads, self.normalise))
        for key, dw in delta.items():
            if key not in ATTENTION:
                out[key] = transfer_dense(dw, *shapes[key], self.w_x)
                if out[key] is None and weights and key in weights:
                    out[key] = transfer_mlp(dw, *weights[key], self.w_x)
        return out, heads


__all__ = ["LoRASuite", "ATTENTION", "Attention", "cka_matrix", "expand_kv", "head_mapping", "head_similarity",
           "layer_mapping", "linear_cka", "refactor", "transfer_attention", "transfer_dense",
           "transfer_matrix", "transfer_mlp"]
