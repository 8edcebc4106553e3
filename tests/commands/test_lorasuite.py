"""LoRASuite's maths (rankwise.commands.transfer.lorasuite): CKA and the layer DP, the head
similarity against its literal h²-sized formula, the Hungarian pairing of permuted heads, the
per-head ΔW rule (exact on a permuted copy; the paper's formula against the normalised one), and
the SVD re-factorisation."""
from __future__ import annotations

import torch

from rankwise.commands.transfer.lorasuite import (Attention, LoRASuite, cka_matrix, head_mapping,
                                             head_similarity, layer_mapping, linear_cka, refactor,
                                             transfer_attention, transfer_dense, transfer_matrix,
                                             transfer_mlp)


def _attention(g, hidden=24, heads=4, kv_heads=2, d=6) -> Attention:
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return Attention(r(heads * d, hidden), r(kv_heads * d, hidden), r(kv_heads * d, hidden),
                     r(hidden, heads * d), heads, kv_heads)


def _permuted(att: Attention, perm: list[int]) -> Attention:
    """New head b = old head perm⁻¹(b): old head a moves to position perm[a] (MHA only)."""
    d, inv = att.head_dim, [perm.index(b) for b in range(att.heads)]
    rows = lambda w: w.reshape(att.heads, d, -1)[inv].reshape(w.shape)  # noqa: E731
    o = att.o.reshape(att.o.shape[0], att.heads, d)[:, inv].reshape(att.o.shape)
    return Attention(rows(att.q), rows(att.k), rows(att.v), o, att.heads, att.kv_heads)


def test_cka_is_one_under_rotation_and_scale_and_the_dp_recovers_the_layer_map():
    g = torch.Generator().manual_seed(0)
    n, h_old, h_new = 200, 16, 24
    old = [torch.randn(n, h_old, generator=g) for _ in range(3)]
    q, _ = torch.linalg.qr(torch.randn(h_new, h_new, generator=g))
    lift = torch.randn(h_old, h_new, generator=g)
    truth = [0, 2, 4]  # old layer i is new layer truth[i]; layers 1 and 3 are unrelated
    new = [torch.randn(n, h_new, generator=g) for _ in range(5)]
    for i, j in enumerate(truth):
        new[j] = 3.0 * (old[i] @ lift) @ q + 0.1 * torch.randn(n, h_new, generator=g)
    x = old[0]
    assert abs(linear_cka(x, 2.5 * x @ torch.linalg.qr(torch.randn(h_old, h_old, generator=g))[0]) - 1) < 1e-12
    sim = cka_matrix(old, new)
    assert layer_mapping(sim) == truth
    # the transposed problem (the new model has fewer layers): old layers left out are None
    assert layer_mapping(sim.T) == [0, None, 1, None, 2]


def test_layer_dp_keeps_order_where_the_greedy_choice_would_not():
    # greedy per row picks [1, 0]; the order-preserving optimum is [0, 1] (0.8 + 0.8 > 0.9)
    sim = torch.tensor([[0.8, 0.9, 0.0], [0.85, 0.8, 0.1]])
    assert layer_mapping(sim) == [0, 1]
    sim = torch.tensor([[0.1, 0.9, 0.2, 0.0], [0.0, 0.1, 0.2, 0.7]])
    assert layer_mapping(sim) == [1, 3]


def test_head_similarity_equals_the_literal_vectors():
    g = torch.Generator().manual_seed(1)
    old, new = _attention(g, hidden=12, heads=4, kv_heads=2), _attention(g, hidden=10, heads=5, kv_heads=5)
    w_x = torch.randn(12, 10, generator=g, dtype=torch.float64)
    sim = head_similarity(old, new, w_x)
    d = old.head_dim
    kx = old.k.reshape(2, d, 12).repeat_interleave(2, 0)
    vx = old.v.reshape(2, d, 12).repeat_interleave(2, 0)
    for a in range(4):
        qa, oa = old.q[a * d:(a + 1) * d], old.o[:, a * d:(a + 1) * d]
        va = torch.cat([(w_x.T @ qa.T @ kx[a] @ w_x).flatten(), (w_x.T @ vx[a].T @ oa.T @ w_x).flatten()])
        for b in range(5):
            qb, kb, vb = (m[b * d:(b + 1) * d] for m in (new.q, new.k, new.v))
            ob = new.o[:, b * d:(b + 1) * d]
            vb_ = torch.cat([(qb.T @ kb).flatten(), (vb.T @ ob.T).flatten()])
            want = torch.dot(va, vb_) / (va.norm() * vb_.norm())
            assert abs(sim[a, b] - want) < 1e-10


def test_hungarian_recovers_a_permuted_head_order_and_the_delta_follows_exactly():
    g = torch.Generator().manual_seed(2)
    old = _attention(g, hidden=24, heads=6, kv_heads=6, d=4)
    perm = [3, 0, 5, 1, 4, 2]
    new = _permuted(old, perm)
    w_x = torch.eye(24, dtype=torch.float64)
    heads = head_mapping(head_similarity(old, new, w_x))
    assert heads == perm
    delta = {r: torch.randn(*getattr(old, r).shape, generator=g, dtype=torch.float64) for r in "qkvo"}
    moved = transfer_attention(delta, old, new, w_x, heads)
    want = _permuted(Attention(delta["q"], delta["k"], delta["v"], delta["o"], 6, 6), perm)
    for r in "qkvo":
        torch.testing.assert_close(moved[r], getattr(want, r), rtol=0, atol=1e-9)


def test_identity_transfer_is_exact_with_grouped_kv_and_the_papers_formula_is_not():
    g = torch.Generator().manual_seed(3)
    att = _attention(g, hidden=24, heads=4, kv_heads=2, d=6)
    delta = {r: torch.randn(*getattr(att, r).shape, generator=g, dtype=torch.float64) for r in "qkvo"}
    suite = LoRASuite(torch.eye(24, dtype=torch.float64))
    moved, heads = suite.block(delta, att, att, {})
    assert heads == [0, 1, 2, 3]
    for r in "qkvo":
        torch.testing.assert_close(moved[r], delta[r], rtol=0, atol=1e-9)
    # the authors' unnormalised map multiplies ΔQ[a] by Q[a] Q[a]ᵀ
    raw, _ = LoRASuite(torch.eye(24, dtype=torch.float64), normalise=False).block(delta, att, att, {})
    qa, dqa = att.q[:6], delta["q"][:6]
    torch.testing.assert_close(raw["q"][:6], qa @ qa.T @ dqa, rtol=0, atol=1e-9)


def test_dense_fallback_maps_hidden_sides_and_refuses_a_changed_intermediate():
    g = torch.Generator().manual_seed(4)
    w_x = torch.randn(8, 12, generator=g, dtype=torch.float64)
    up, down = torch.randn(20, 8, dtype=torch.float64), torch.randn(8, 20, dtype=torch.float64)
    torch.testing.assert_close(transfer_dense(up, (20, 8), (20, 12), w_x), up @ w_x)
    torch.testing.assert_close(transfer_dense(down, (8, 20), (12, 20), w_x), w_x.T @ down)
    assert transfer_dense(up, (20, 8), (30, 12), w_x) is None


def test_transfer_matrix_is_least_squares_and_refactor_reproduces_the_rank_r_product():
    g = torch.Generator().manual_seed(5)
    e_old = torch.randn(50, 8, generator=g, dtype=torch.float64)
    m = torch.randn(8, 12, generator=g, dtype=torch.float64)
    torch.testing.assert_close(transfer_matrix(e_old, e_old @ m), m)
    b0, a0 = torch.randn(16, 3, generator=g, dtype=torch.float64), torch.randn(3, 10, generator=g, dtype=torch.float64)
    a, b = refactor(b0 @ a0, 3)
    assert a.shape == (3, 10) and b.shape == (16, 3)
    torch.testing.assert_close(b @ a, b0 @ a0, rtol=0, atol=1e-10)
    a, b = refactor(b0 @ a0, 5)  # a larger rank pads with zero factors, same product
    torch.testing.assert_close(b @ a, b0 @ a0, rtol=0, atol=1e-10)


def test_mlp_rule_is_the_authors_code_where_the_intermediate_size_changes():
    """The code's MLP factors (BLOOMZ / MiniCPM branches of lora_adaption.py), multiplied out:
    up ``B' = W_new pinv(W_x) pinv(W_old) B``, ``A' = A W_x``; down ``B' = pinv(W_x) B``,
    ``A' = A pinv(W_old) W_x W_new``; and LoRASuite.block uses it only when given the weights."""
    g = torch.Generator().manual_seed(6)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    h_old, h_new, i_old, i_new, rank = 8, 12, 20, 30, 3
    w_x = r(h_old, h_new)
    pinv = torch.linalg.pinv
    u_old, u_new, b, a = r(i_old, h_old), r(i_new, h_new), r(i_old, rank), r(rank, h_old)
    want_up = (u_new @ pinv(w_x) @ pinv(u_old) @ b) @ (a @ w_x)
    torch.testing.assert_close(transfer_mlp(b @ a, u_old, u_new, w_x), want_up, rtol=1e-10, atol=1e-10)
    d_old, d_new, b, a = r(h_old, i_old), r(h_new, i_new), r(h_old, rank), r(rank, i_old)
    want_down = (pinv(w_x) @ b) @ (a @ pinv(d_old) @ w_x @ d_new)
    torch.testing.assert_close(transfer_mlp(b @ a, d_old, d_new, w_x), want_down, rtol=1e-10, atol=1e-10)
    suite, delta = LoRASuite(w_x), {"mlp.down_proj": b @ a}
    shapes = {"mlp.down_proj": ((h_old, i_old), (h_new, i_new))}
    assert suite.block(delta, None, None, shapes)[0]["mlp.down_proj"] is None  # no weights: left out
    moved, _ = suite.block(delta, None, None, shapes, {"mlp.down_proj": (d_old, d_new)})
    torch.testing.assert_close(moved["mlp.down_proj"], want_down, rtol=1e-10, atol=1e-10)
