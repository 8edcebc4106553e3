"""``data.select`` rules against direct computations on a 2-layer model with hand-written
per-example gradients: LESS's cosine, Influence Distillation's JVP embedding, landmark influences
and kernel-ridge propagation, the round-robin pick and the weights' second-order objective, the
feature warm-up, the QCS proxy's budget projection; the weighted loss."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rankwise.data import select as rules
from rankwise.data.select import WeightedData
from rankwise.data.text import TextData
from rankwise.engine import get_task
from rankwise.errors import RankwiseError
from rankwise.recipes import select as stage
from rankwise.recipes.select_features import grad_features, jvp_embeddings
from rankwise.recipes.select_rules import InfluenceConfig, LessConfig, QCSProxyConfig, token_weights

V, D, H, C = 12, 5, 4, 3  # vocabulary, input width, hidden width, classes


class TwoLayer(nn.Module):
    """``h_t = tanh(W1 e_t)`` per token (``e`` a frozen embedding), logits ``W2 mean_t h_t``."""

    def __init__(self, lm: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Parameter(torch.randn(V, D, generator=g), requires_grad=False)
        self.w1 = nn.Parameter(torch.randn(H, D, generator=g) * 0.7)
        self.w2 = nn.Parameter(torch.randn(V if lm else C, H, generator=g) * 0.7)
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        h = torch.tanh(self.emb[input_ids] @ self.w1.T)                       # (B, T, H)
        if self.lm:
            return SimpleNamespace(logits=h @ self.w2.T, hidden_states=(h,))
        m = attention_mask.unsqueeze(-1).float()
        return SimpleNamespace(logits=((h * m).sum(1) / m.sum(1)) @ self.w2.T, hidden_states=(h,))


def dataset(n: int, seed: int) -> TextData:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, V, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
           for _ in range(n)]
    return TextData(ids, torch.randint(0, C, (n,), generator=g).tolist(), ["a", "b", "c"], 0)


def hand_grad(model: TwoLayer, ids: list[int], label: int) -> np.ndarray:
    """d CE / d(W1, W2) of one example, by the chain rule in float64."""
    e = model.emb.detach().double().numpy()[ids]                                # (T, D)
    w1, w2 = model.w1.detach().double().numpy(), model.w2.detach().double().numpy()
    h = np.tanh(e @ w1.T)                                                       # (T, H)
    hbar = h.mean(0)
    z = w2 @ hbar
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    dz = p - np.eye(C)[label]                                                   # (C,)
    dw2 = np.outer(dz, hbar)
    dh = (w2.T @ dz) / len(ids)                                                 # per token
    dw1 = ((dh * (1 - h**2)).T @ e)                                             # (H, D)
    return np.concatenate([dw1.ravel(), dw2.ravel()])


def session(model, train) -> SimpleNamespace:
    return SimpleNamespace(model=model, task=get_task("classification"), train_data=train, device="cpu")


def cos(a, b):
    return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def test_less_scores_equal_the_cosine_of_hand_computed_gradients():
    model, train, target = TwoLayer(), dataset(10, 1), dataset(4, 2)
    cfg = LessConfig(budget=3, target="t", proj_dim=0)
    s, chosen, w, _ = stage.score(session(model, train), cfg, list(range(10)), target, 3)
    g = np.stack([hand_grad(model, train.ids[i], train.labels[i]) for i in range(10)])
    gt = np.stack([hand_grad(model, target.ids[j], target.labels[j]) for j in range(4)])
    mean_t = (gt / np.linalg.norm(gt, axis=1, keepdims=True)).mean(0)
    want = np.array([cos(g[i], mean_t) for i in range(10)])
    np.testing.assert_allclose(s.numpy(), want, atol=1e-5)
    assert chosen == sorted(np.argsort(-want)[:3].tolist()) and w is None
    # with a projection the features are G P, P assembled from its regenerated blocks
    feats = grad_features(model, get_task("classification"), train, list(range(10)), 8, 5, "cpu")
    p = torch.cat([rules.projection_block(H * D, 8, 5, 0), rules.projection_block(C * H, 8, 5, 1)]).double()
    np.testing.assert_allclose(feats.double().numpy(), g @ p.numpy(), atol=1e-5)


def test_influence_matches_jvp_kernel_ridge_and_round_robin_by_hand():
    model, train, target = TwoLayer(), dataset(12, 3), dataset(3, 4)
    cfg = InfluenceConfig(budget=5, target="t", proj_dim=0, landmarks=6, jvp_tangents=2)
    s, chosen, _, _ = stage.score(session(model, train), cfg, list(range(12)), target, 5)
    # JVP of the logits W2 mean_t tanh(W1 e_t) along tangent (V1, V2):
    # V2 mean_t h_t + W2 mean_t (1 - h_t²) ⊙ (V1 e_t)
    gen = torch.Generator().manual_seed(cfg.seed + 17)
    tangents = [[torch.randn(H, D, generator=gen), torch.randn(C, H, generator=gen)] for _ in range(2)]
    w1, w2, e = model.w1.detach().double(), model.w2.detach().double(), model.emb.detach().double()
    emb = []
    for ids in train.ids:
        x = e[ids]                                                              # (T, D)
        h = torch.tanh(x @ w1.T)                                                # (T, H)
        emb.append(torch.cat([v2.double() @ h.mean(0) + w2 @ ((1 - h**2) * (x @ v1.double().T)).mean(0)
                              for v1, v2 in tangents]))
    emb = torch.stack(emb).numpy()
    got = jvp_embeddings(model, get_task("classification"), train, list(range(12)), 2, cfg.seed, "cpu")
    np.testing.assert_allclose(got.numpy(), emb, rtol=1e-3, atol=1e-4)
    land = sorted(torch.randperm(12, generator=torch.Generator().manual_seed(cfg.seed))[:6].tolist())
    g = np.stack([hand_grad(model, train.ids[i], train.labels[i]) for i in land])
    gt = np.stack([hand_grad(model, target.ids[j], target.labels[j]) for j in range(3)])
    unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)  # noqa: E731
    p_land = unit(g) @ unit(gt).T                                               # (L, m)
    el = emb[land]
    dist = np.sqrt(((el[:, None] - el[None]) ** 2).sum(-1))
    sigma = np.median(dist[~np.eye(6, dtype=bool)])
    kern = lambda a, b: np.exp(-((a[:, None] - b[None]) ** 2).sum(-1) / (2 * sigma**2))  # noqa: E731
    k_ll = kern(el, el)
    want = kern(emb, el) @ np.linalg.solve(k_ll + 0.01 * np.diag(k_ll).mean() * np.eye(6), p_land)
    np.testing.assert_allclose(s.numpy(), want.mean(1), rtol=1e-3, atol=1e-4)
    assert chosen == rules.round_robin(torch.as_tensor(want), 5, cfg.seed)


def test_round_robin_and_propagation_known_answers():
    infl = torch.tensor([[0.9, 0.0], [0.8, 0.1], [0.1, 0.7], [0.0, 0.6], [0.5, 0.5]])
    assert rules.round_robin(infl, 3) == [0, 1, 2]      # t0 takes 0, t1 takes 2, t0 takes 1
    assert rules.round_robin(infl, 4) == [0, 1, 2, 3]
    emb = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    p = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
    out = rules.propagate(emb, [0, 2, 4], p, ridge=1e-9)   # interpolates at the landmarks
    np.testing.assert_allclose(out[[0, 2, 4]].numpy(), p.double().numpy(), atol=1e-6)


def test_qcs_budget_projection_and_solver_keep_the_budget():
    w = rules.project_budget(torch.tensor([2.0, 0.5, 0.2, -1.0], dtype=torch.float64), 1.5)
    np.testing.assert_allclose(w.numpy(), [1.0, 0.4, 0.1, 0.0], atol=1e-9)
    y = torch.randn(50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    for total in (1.0, 7.5, 49.0):
        w = rules.project_budget(y, total)
        assert abs(float(w.sum()) - total) < 1e-9 and float(w.min()) >= 0 and float(w.max()) <= 1
    # aligned examples (rows 0-4 along the target gradient) win the budget
    g = torch.randn(20, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.1
    g[:5, 0] += 1.0
    target = torch.zeros(3, 6, dtype=torch.float64)
    target[:, 0] = 1.0
    p = rules.qcs_probabilities(g, target, 5, steps=150, samples=16, lr=0.05, eta=1.0, seed=0)
    assert abs(float(p.sum()) - 5) < 1e-9 and float(p.min()) >= 0 and float(p.max()) <= 1
    assert rules.top_k(p, 5) == [0, 1, 2, 3, 4]
    tw = rules.token_weights([torch.tensor([0.1, 3.0, 2.0, 0.5])], 0.5, 0.1)[0]
    assert tw.tolist() == pytest.approx([0.1, 0.9, 0.9, 0.1])


def test_budget_random_and_weights_rules():
    assert rules.budget_count(0.1, 95) == 10 and rules.budget_count(7, 95) == 7
    for bad in (0, -1, 96, 0.0, 1.5):
        with pytest.raises(ValueError, match="budget"):
            rules.budget_count(bad, 95)
    a, b = rules.top_k(rules.random_scores(100, 3), 10), rules.top_k(rules.random_scores(100, 3), 10)
    assert a == b != rules.top_k(rules.random_scores(100, 4), 10)
    w = rules.influence_weights(torch.tensor([[3.0], [1.0], [0.0], [-2.0]]), 2)
    assert abs(float(w.sum()) - 2) < 1e-9 and float(w.min()) >= 0 and w[0] > w[1] >= w[2] >= w[3]
    with pytest.raises(RankwiseError, match="needs a model with trainable weights"):
        frozen = TwoLayer().requires_grad_(False)
        stage.score(session(frozen, dataset(4, 0)), InfluenceConfig(target="t"),
                    [0, 1, 2, 3], dataset(2, 1), 2)


@torch.no_grad()
def test_weighted_loss_equals_the_formula():
    model, task = TwoLayer(), get_task("classification")
    data = dataset(5, 7)
    w = [0.5, 2.0, 1.0, 0.0, 1.5]
    items = [WeightedData(data, w)[i] for i in range(5)]
    batch = task.collate(items, 0)
    loss, _ = task.loss_sum(model, batch)
    plain = task.collate([data[i] for i in range(5)], 0)
    per = F.cross_entropy(model(**{k: plain[k] for k in ("input_ids", "attention_mask")}).logits,
                          plain["labels"], reduction="none")
    assert float(loss) == pytest.approx(float((per * torch.tensor(w)).sum()), rel=1e-6)
    # causal LM: sum_ij w_i v_ij CE_ij over the predicted tokens
    lm, ctask = TwoLayer(lm=True), get_task("causal-lm")
    tw = [[float(j + 1) for j in range(len(ids))] for ids in data.ids]
    wd = WeightedData(TextData(data.ids, None, [], 0), w, tw)
    batch = ctask.collate([wd[i] for i in range(5)], 0)
    loss, _ = ctask.loss_sum(lm, batch)
    want = 0.0
    for i, ids in enumerate(data.ids):
        logits = lm(torch.tensor([ids])).logits[0, :-1]
        ce = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        want = want + (w[i] * torch.tensor(tw[i][1:]) * ce).sum()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)


def test_qcs_token_weights_keep_the_highest_loss_tokens():
    lm, data = TwoLayer(lm=True), dataset(3, 9)
    sess = SimpleNamespace(model=lm, task=get_task("causal-lm"), train_data=TextData(data.ids, None, [], 0),
                           device="cpu")
    got = token_weights(sess, QCSProxyConfig(token_ratio=0.5, token_floor=0.1), [0, 1, 2])
    for ids, w in zip(data.ids, got):
        logits = lm(torch.tensor([ids])).logits[0, :-1]
        nll = [0.0] + F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none").detach().tolist()
        keep = sorted(range(len(ids)), key=lambda j: -nll[j])[: max(1, round(0.5 * len(ids)))]
        assert w == pytest.approx([0.9 if j in keep else 0.1 for j in range(len(ids))])


def hand_grad_lm(model: TwoLayer, ids: list[int]) -> np.ndarray:
    """d(mean next-token CE)/d(W1, W2) of one sequence of the causal-LM TwoLayer, chain rule in
    float64: ``z_t = W2 tanh(W1 e_t)`` predicts ``ids[t+1]``."""
    e = model.emb.detach().double().numpy()[ids]                                # (T, D)
    w1, w2 = model.w1.detach().double().numpy(), model.w2.detach().double().numpy()
    h = np.tanh(e @ w1.T)                                                       # (T, H)
    dw1, dw2, n = np.zeros_like(w1), np.zeros_like(w2), len(ids) - 1
    for t in range(n):
        z = w2 @ h[t]
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        dz = (p - np.eye(V)[ids[t + 1]]) / n
        dw2 += np.outer(dz, h[t])
        dw1 += np.outer((w2.T @ dz) * (1 - h[t] ** 2), e[t])
    return np.concatenate([dw1.ravel(), dw2.ravel()])


def test_less_and_jvp_features_of_a_causal_lm_equal_hand_computed_ones():
    lm, task = TwoLayer(lm=True), get_task("causal-lm")
    tr, tg = dataset(8, 11), dataset(3, 12)
    train, target = TextData(tr.ids, None, [], 0), TextData(tg.ids, None, [], 0)
    sess = SimpleNamespace(model=lm, task=task, train_data=train, device="cpu")
    cfg = LessConfig(budget=3, target="t", proj_dim=0)
    s, chosen, _, _ = stage.score(sess, cfg, list(range(8)), target, 3)
    g = np.stack([hand_grad_lm(lm, ids) for ids in train.ids])
    gt = np.stack([hand_grad_lm(lm, ids) for ids in target.ids])
    mean_t = (gt / np.linalg.norm(gt, axis=1, keepdims=True)).mean(0)
    want = np.array([cos(g[i], mean_t) for i in range(8)])
    np.testing.assert_allclose(s.numpy(), want, rtol=1e-5, atol=1e-7)
    assert chosen == sorted(np.argsort(-want, kind="stable")[:3].tolist())
    # JVP embedding: the last token's hidden state h_T = tanh(W1 e_T); W2 does not move it, so
    # J v = (1 - h_T²) ⊙ (V1 e_T) for the tangent's W1 block V1
    emb = jvp_embeddings(lm, task, train, list(range(8)), 1, 0, "cpu")
    gen = torch.Generator().manual_seed(17)
    v1 = torch.randn(lm.w1.shape, generator=gen).double().numpy()
    w1, e = lm.w1.detach().double().numpy(), lm.emb.detach().double().numpy()
    for i, ids in enumerate(train.ids):
        h = np.tanh(w1 @ e[ids[-1]])
        np.testing.assert_allclose(emb[i].numpy(), (1 - h**2) * (v1 @ e[ids[-1]]), rtol=1e-3, atol=1e-4)


def test_influence_weights_solve_the_papers_second_order_objective():
    """Influence Distillation's weights (arXiv 2505.19051 §3, H_T the empirical Fisher of the
    target gradients, so G_S H_T G_Sᵀ = P Pᵀ/m): the KKT conditions of
    min -pᵀw + (η/2nm)|Pᵀw|² + (l2·std p/2)|w|² over {w ≥ 0, Σw = k} hold to 1e-6; η = 0 is the
    first-order rule max(p/λ - τ, 0); the second-order term moves weight off duplicated rows."""
    g = torch.Generator().manual_seed(5)
    P = torch.randn(12, 4, generator=g, dtype=torch.float64) * 0.3
    P[1] = P[0] = P[0] + 0.8                      # two identical strong rows
    k, eta, l2 = 6.0, 4.0, 0.5
    w = rules.influence_weights(P, k, eta, l2)
    p = P.mean(1)
    lam = l2 * float(p.std())
    grad = (-p + eta / (12 * 4) * P @ (P.T @ w) + lam * w).numpy()
    on = w.numpy() > 1e-9
    nu = grad[on].mean()
    assert abs(float(w.sum()) - k) < 1e-9 and float(w.min()) >= 0
    np.testing.assert_allclose(grad[on], nu, atol=1e-6)          # stationarity on the support
    assert (grad[~on] >= nu - 1e-6).all()                          # no gain from any zero weight
    first = rules.influence_weights(P, k, 0.0, l2).numpy()
    y = (p / lam).numpy()
    tau = (y[first > 0] - first[first > 0]).mean()
    np.testing.assert_allclose(first, np.clip(y - tau, 0, None), atol=1e-9)
    assert w[0] == pytest.approx(w[1]) and float(w[0]) < first[0] - 0.1


def test_round_robin_shuffles_the_target_order_every_round():
    """The release shuffles the target order afresh each round: round r follows the r-th
    torch.randperm(m) of a generator seeded with the seed; over seeds, an odd budget is no
    longer always decided in favour of target 0."""
    infl = torch.tensor([[0.9, 0.0], [0.8, 0.1], [0.1, 0.7], [0.0, 0.6], [0.5, 0.5]])
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        first, second = torch.randperm(2, generator=gen).tolist(), torch.randperm(2, generator=gen).tolist()
        assert rules.round_robin(infl, 1, seed) == [[0, 2][first[0]]]
        assert rules.round_robin(infl, 3, seed) == sorted([0, 2, [1, 3][second[0]]])
    from_target_1 = sum(rules.round_robin(infl, 1, s) == [2] for s in range(200))
    assert 70 < from_target_1 < 130
    assert rules.round_robin(infl, 3) == [0, 1, 2]   # no seed: the fixed order


def test_warm_up_takes_features_after_training_and_restores_the_weights():
    """warmup_steps: the LESS features are the hand gradients at the weights after 3 AdamW steps
    (lr 0.05) on batches of 8 pool records drawn by a generator seeded seed + 29; afterwards the
    model holds its own weights again."""
    import copy
    model, train, target = TwoLayer(), dataset(12, 3), dataset(3, 4)
    before = [p.detach().clone() for p in (model.w1, model.w2)]
    cfg = LessConfig(budget=4, target="t", proj_dim=0, warmup_steps=3, warmup_lr=0.05)
    s, _, _, _ = stage.score(session(model, train), cfg, list(range(12)), target, 4)
    assert torch.equal(model.w1, before[0]) and torch.equal(model.w2, before[1])
    warm, task = copy.deepcopy(model), get_task("classification")
    opt = torch.optim.AdamW([warm.w1, warm.w2], lr=0.05, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 29)
    for _ in range(3):
        idx = torch.randint(12, (8,), generator=gen).tolist()
        opt.zero_grad()
        task.mean_loss(warm, task.collate([train[i] for i in idx], train.pad_id)).backward()
        opt.step()
    g = np.stack([hand_grad(warm, train.ids[i], train.labels[i]) for i in range(12)])
    gt = np.stack([hand_grad(warm, target.ids[j], target.labels[j]) for j in range(3)])
    mean_t = (gt / np.linalg.norm(gt, axis=1, keepdims=True)).mean(0)
    np.testing.assert_allclose(s.numpy(), [cos(x, mean_t) for x in g], rtol=1e-5, atol=1e-6)
    at_init = stage.score(session(model, train), LessConfig(budget=4, target="t", proj_dim=0),
                          list(range(12)), target, 4)[0]
    assert float((at_init - s).abs().max()) > 1e-3
