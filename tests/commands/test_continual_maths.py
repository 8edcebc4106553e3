"""HRM-PET maths (commands/continual/maths.py): matching, direct and confidence-based re-matching, CTIRD."""
import math

import torch

from rankwise.commands.continual.maths import (TaskIdentity, candidate_tasks, confidence, confidence_rematch,
                                     direct_rematch, gate_score, generalized_entropy, low_confidence,
                                     match_keys, relation_distillation, relation_matrix, task_keys,
                                     tune_threshold)
from rankwise.commands.continual.run import ContinualConfig, hybrid_rematch, summary


def test_keys_are_normalised_task_means_and_matching_picks_the_right_module():
    # task 0 lives near e0, task 1 near e1, task 2 near e2 (scaled: keys use normalised features)
    feats = torch.tensor([[2.0, 0.1, 0.0], [1.0, -0.1, 0.0], [0.0, 3.0, 0.2], [0.1, 1.0, 0.0],
                          [0.0, 0.0, 5.0], [0.2, 0.0, 1.0]])
    task_of = torch.tensor([0, 0, 1, 1, 2, 2])
    keys = task_keys(feats, task_of, 3)
    f = feats / feats.norm(dim=1, keepdim=True)
    want0 = (f[0] + f[1]) / (f[0] + f[1]).norm()
    assert torch.allclose(keys[0], want0, atol=1e-6)
    assert torch.allclose(keys.norm(dim=1), torch.ones(3), atol=1e-6)
    queries = torch.tensor([[0.0, 0.2, 9.0], [7.0, 0.3, 0.0], [0.1, 0.5, 0.0], [-1.0, 0.0, 0.1]])
    assert match_keys(queries, keys).tolist() == [2, 0, 1, 2]


def test_direct_rematch_switches_exactly_where_the_predicted_task_differs():
    class_task = torch.tensor([0, 0, 1, 1, 2, 2])
    matched = torch.tensor([0, 1, 2, 0, 2])
    logits = torch.tensor([[5.0, 0, 0, 0, 0, 0],    # class 0 -> task 0 = matched: stay
                           [0, 0, 0, 0, 7.0, 0],    # class 4 -> task 2 != 1: switch to 2
                           [0, 0, 0, 0, 0, 1.0],    # class 5 -> task 2: stay
                           [0, 0, 0, 3.0, 0, 0],    # class 3 -> task 1 != 0: switch to 1
                           [0, 9.0, 0, 0, 0, 0]])   # class 1 -> task 0 != 2: switch to 0
    modules, switched = direct_rematch(matched, logits, class_task)
    assert modules.tolist() == [0, 2, 2, 1, 0]
    assert switched.tolist() == [False, True, False, True, True]


def test_confidence_is_the_smooth_max_logit_and_rematch_takes_its_argmax():
    l = torch.tensor([1.0, 2.0, float("-inf")])
    assert math.isclose(float(confidence(l, 0.1)), 0.1 * math.log(math.exp(10) + math.exp(20)), rel_tol=1e-6)
    cands = torch.tensor([[[1.0, 0.5], [0.2, 3.0], [2.0, 2.1]],      # scores ~1.0, ~3.0, ~2.14 -> 1
                          [[4.0, 0.0], [1.0, 1.0], [0.0, 3.9]]])     # ~4.0, ~1.07, ~3.9 -> 0
    scores = 0.1 * torch.logsumexp(cands / 0.1, dim=-1)
    assert confidence_rematch(cands).tolist() == scores.argmax(-1).tolist() == [1, 0]
    p = torch.tensor([[2.0, 0.0], [0.1, 0.0]]).softmax(-1).amax(-1)     # 0.881, 0.525
    assert low_confidence(torch.tensor([[2.0, 0.0], [0.1, 0.0]]), 0.8).tolist() == (p < 0.8).tolist() == [False, True]
    assert candidate_tasks(torch.tensor([[0.0, 5.0, 4.0, 1.0]]), torch.tensor([0, 0, 1, 1]), 2).tolist() == [[0, 1]]


def test_relation_distillation_equals_its_formula():
    new = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 2.0]])
    old = torch.tensor([[1.0, 1.0], [1.0, 0.0], [-1.0, 0.5]])

    def rel(x):
        n = [[a / math.hypot(*v) for a in v] for v in x.tolist()]
        cos = [[sum(a * b for a, b in zip(u, w)) for w in n] for u in n]
        return [[math.exp(c) / sum(math.exp(d) for d in row) for c in row] for row in cos]
    pn, po = rel(new), rel(old)
    want = sum(po[i][j] * (math.log(po[i][j]) - math.log(pn[i][j])) for i in range(3) for j in range(3)) / 3
    assert torch.allclose(relation_matrix(new), torch.tensor(pn), atol=1e-6)
    got = relation_distillation(new, old)
    assert math.isclose(float(got), want, rel_tol=1e-5)
    assert float(relation_distillation(old, old)) < 1e-7
    x = new.clone().requires_grad_(True)
    relation_distillation(x, old).backward()
    assert x.grad.abs().sum() > 0


def test_hybrid_rematch_on_constructed_module_logits():
    # 2 tasks x 2 classes; logits[m][i] = example i's logits under module m
    class_task = torch.tensor([0, 0, 1, 1])
    table = torch.tensor([
        [[4.0, 0, 0, 0], [0, 0, 3.0, 0], [1.0, 0.9, 0.8, 0], [0, 0, 0, 0.5]],   # module 0
        [[0, 0, 0, 0], [0, 0, 0, 6.0], [0, 0, 0, 9.0], [0, 0, 0, 8.0]],         # module 1
    ])
    get = lambda mods, rows: table[mods, rows]
    matched = torch.tensor([0, 0, 0, 1])
    allowed = torch.ones(4, dtype=torch.bool)
    out = hybrid_rematch(ContinualConfig(gate="msp", tau=0.8), get, matched, class_task, allowed, multi=True)
    assert out["match"].tolist() == [0, 2, 0, 3]
    # ex 1: class 2 is task 1 != matched 0 -> re-run with module 1, which says class 3;
    # ex 0, 2, 3 predict a class of their matched task: unchanged
    assert out["direct"].tolist() == [0, 3, 0, 3]
    # ex 2 is the only unsure one (p_max 0.29 < 0.8; ex 0: 0.95, ex 1: 0.87, ex 3: 1.0): its top-2
    # classes 0, 1 are both task 0, so every candidate is module 0 -> unchanged
    assert out["hrm"].tolist() == [0, 3, 0, 3]
    # top-2 classes of ex 2 now 0 and 2 (tasks 0, 1): module 1 (score 0.1 lse(90) ~ 9.0) beats
    # module 0 (0.1 lse(10, 9, 9.5, 0) ~ 1.05) -> class 3; the direct rule alone keeps class 0
    table[0, 2] = torch.tensor([1.0, 0.9, 0.95, 0.0])
    out = hybrid_rematch(ContinualConfig(gate="msp", tau=0.8), get, matched, class_task, allowed, multi=True)
    assert out["match"][2] == 0 and out["direct"][2] == 0 and out["hrm"][2] == 3
    # with one task seen the confidence rule is off (as in the code)
    assert hybrid_rematch(ContinualConfig(gate="msp", tau=0.8), get, matched, class_task, allowed, multi=False)["hrm"][2] == 0


def test_average_accuracy_and_forgetting_formula():
    m = [[0.9], [0.7, 0.8], [0.6, 0.5, 1.0]]
    s = summary(m)
    assert math.isclose(s["average_accuracy"], (0.6 + 0.5 + 1.0) / 3)
    assert math.isclose(s["forgetting"], ((0.9 - 0.6) + (0.8 - 0.5)) / 2)


def _gen(logits, gamma=0.1, m=20):
    """The released code's ``generalized_entropy(softmax, 0.1, 20)``, in plain Python."""
    out = []
    for row in logits.tolist():
        e = [math.exp(v) if v != float("-inf") else 0.0 for v in row]
        z = sum(e)
        top = sorted(range(len(e)), key=lambda j: e[j])[-m:]    # 1 - p_j = (z - e_j) / z, no cancellation
        out.append(-sum((e[j] / z) ** gamma * ((z - e[j]) / z) ** gamma for j in top))
    return out


def test_gen_score_is_the_released_generalized_entropy_over_the_top_20():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g) * torch.tensor([[0.1], [1.0], [3.0], [10.0], [6.0]])
    logits[1, 50:] = float("-inf")                  # masked (unseen) classes add 0
    want = _gen(logits)
    assert torch.allclose(generalized_entropy(logits), torch.tensor(want), atol=1e-5)
    assert torch.allclose(gate_score(logits, "gen"), torch.tensor(want), atol=1e-5)
    # near-uniform over 100 classes: -20 (0.01^0.1)(0.99^0.1) ~ -12.6 < -10 fires the code's gate;
    # a confident row does not
    assert low_confidence(logits, -10.0, gate="gen").tolist()[0] is True
    assert low_confidence(logits, -10.0, gate="gen").tolist()[4] is False
    # 8 classes: the lowest possible score (uniform) is -8 (1/8)^0.1 (7/8)^0.1 = -6.43 > -10: never fires
    uniform8 = torch.zeros(1, 8)
    assert math.isclose(float(generalized_entropy(uniform8)), -8 * (1 / 8) ** 0.1 * (7 / 8) ** 0.1, rel_tol=1e-5)
    assert not low_confidence(torch.randn(200, 8, generator=g), -10.0, gate="gen").any()
    assert torch.allclose(gate_score(logits, "msp"), logits.softmax(-1).amax(-1))


def test_tune_threshold_finds_the_best_gate_by_brute_force():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        scores = torch.randint(0, 6, (12,), generator=g).float() / 2   # ties on purpose
        re, kept = torch.rand(12, generator=g) < 0.5, torch.rand(12, generator=g) < 0.5
        tau, acc = tune_threshold(scores, re, kept)
        grid = [-1.0] + [v / 4 for v in range(0, 12)] + [4.0]
        accs = [float(torch.where(scores < t, re, kept).float().mean()) for t in grid]
        assert math.isclose(acc, max(accs), abs_tol=1e-6)
        assert math.isclose(float(torch.where(scores < tau, re, kept).float().mean()), acc, abs_tol=1e-6)
        fewest = min(int((scores < t).sum()) for t, a in zip(grid, accs) if math.isclose(a, max(accs)))
        assert int((scores < tau).sum()) == fewest          # ties: the fewest re-matched examples


def test_task_identity_learns_tasks_without_moving_other_rows_and_alignment_repairs_bias():
    # 2 tasks x 2 classes, class c's features ~ N(mu_c, 0.3^2 I) in 6 dims
    g = torch.Generator().manual_seed(2)
    mu = torch.eye(6)[:4] * 3.0
    x = torch.cat([mu[c] + 0.3 * torch.randn(50, 6, generator=g) for c in range(4)])
    y = torch.arange(4).repeat_interleave(50)
    class_task = torch.tensor([0, 0, 1, 1])
    tii = TaskIdentity(6, 4, seed=0)
    tii.learn_task(x[y < 2], y[y < 2], class_task == 0, steps=100, lr=0.05)
    rows0 = tii.linear.weight[:2].detach().clone(), tii.linear.bias[:2].detach().clone()
    untouched = tii.linear.weight[2:].detach().clone()
    tii.learn_task(x[y >= 2], y[y >= 2], class_task == 1, steps=100, lr=0.05)
    assert torch.equal(tii.linear.weight[:2], rows0[0]) and torch.equal(tii.linear.bias[:2], rows0[1])
    assert not torch.equal(tii.linear.weight[2:], untouched)
    assert torch.allclose(tii.stats[0][0], x[:50].mean(0)) and torch.allclose(tii.stats[3][1], x[150:].var(0, unbiased=False) + 1e-4)
    seen = torch.ones(4, dtype=torch.bool)
    tii.align(seen, steps=30, lr=0.05, samples=16)
    acc = float((tii.match(x, class_task, seen) == class_task[y]).float().mean())
    assert acc > 0.97
