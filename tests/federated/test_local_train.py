"""Local training goes through the engine: parity with a hand-written loop (batch order, seed,
clipping, AdamW), YOCO's regularisers as loss hooks against their formula, LEFF's importance."""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora
from rankwise.data.text import TextData
from rankwise.engine import batch_indices, get_task
from rankwise.federated import keys
from rankwise.federated.config import FederatedConfig
from rankwise.federated.payload import layer_index
from rankwise.federated.strategies import FedIt, Leff, Yoco
from rankwise.federated.task import Client, local_train
from rankwise.federated.wire import factor_roles, mark_wire
from rankwise.optim.adamw import AdamWConfig
from rankwise.recipes.config import TrainConfig
from rankwise.testing import VOCAB, tiny_bert_cls

PID, SEED, BS, CLIP, LR = 1, 3, 4, 0.5, 0.01
YOCO = {keys.PHASE: "oneshot", keys.YOCO_SIGN_WEIGHT: 0.3, keys.YOCO_GAMMA_MAX: 50.0,
        keys.YOCO_SPARSE_WEIGHT: 0.2}


def make_client(strategy, rounds_trained: int = 0) -> Client:
    """A tiny BERT + LoRA (non-zero B) client with 18 random 3-class examples."""
    model = tiny_bert_cls()
    apply_lora(model, LoraConfig(r=2, alpha=4, targets="all-linear"))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.lora_B["default"].weight.normal_(0, 0.1, generator=g)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    mark_wire(model, names)
    ids = [torch.randint(1, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
           for _ in range(18)]
    data = TextData(ids, [i % 3 for i in range(18)], ["a", "b", "c"], 0)
    cfg = SimpleNamespace(optim=AdamWConfig(lr=1.0), train=TrainConfig(seed=SEED, grad_clip=CLIP, batch_size=BS))
    return Client(cfg, FederatedConfig(clients=2, local_steps=3), PID, model, get_task("classification"),
                  data, names, factor_roles(model), strategy, rounds_trained)


def svd_with_signs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, S)`` of ``w`` with each column of U signed so its largest-magnitude entry is
    positive (the convention YOCO fixes so every process gets the same bits)."""
    u, sv, _ = torch.linalg.svd(w.detach().double(), full_matrices=False)
    return u * torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True))), sv


def yoco_reference(model, s: int, steps: int) -> torch.Tensor:
    """YOCO Sec. 3.2 written out: sign term over every B, sparse term over the trainable A."""
    gamma = 1 + (YOCO[keys.YOCO_GAMMA_MAX] - 1) * 0.5 * (1 - math.cos(math.pi * s / (steps - 1)))
    signs, sparse = [], []
    for m in model.modules():
        if isinstance(m, LoraLayer):
            b = m.lora_B["default"].weight
            u = svd_with_signs(m.base_layer.weight)[0]
            target = torch.sign(u[:, : b.shape[1]]).float()
            signs.append(torch.linalg.norm(torch.tanh(gamma * b) - target) / (torch.linalg.norm(target) + 1e-6))
            if m.lora_A["default"].weight.requires_grad:
                sparse.append(m.lora_A["default"].weight.abs().sum())      # ||A||_1, entrywise
    return (YOCO[keys.YOCO_SIGN_WEIGHT] * torch.stack(signs).mean()
            + YOCO[keys.YOCO_SPARSE_WEIGHT] * torch.stack(sparse).sum())


@pytest.mark.parametrize("strategy,extra", [(FedIt, {}), (Yoco, YOCO)])
def test_local_train_matches_a_hand_written_loop(strategy, extra):
    steps, done = 3, 2          # a client in its third round: global steps 6, 7, 8
    client = make_client(strategy, rounds_trained=done)
    ref = copy.deepcopy(client.model)
    cfg_rec = {keys.TRAIN_STEPS: steps, keys.LEARNING_RATE: LR, keys.TRAIN_FACTORS: "AB", **extra}
    sent, metrics = local_train(client, cfg_rec)

    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    task, losses = get_task("classification"), []
    for s in range(steps):
        idx = batch_indices(done * steps + s, 18, BS, SEED + 1000 * PID)
        batch = task.collate([client.train_data[i] for i in idx], 0)
        logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits, batch["labels"])
        losses.append(float(loss.detach()))
        (loss + yoco_reference(ref, s, steps) if extra else loss).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
    want = dict(ref.named_parameters())
    assert set(sent) == set(client.names) and len(sent) == 28      # 13 layers x (A, B) + head
    worst = max(float((sent[k] - want[k].detach()).abs().max()) for k in sent)
    assert worst < 1e-6, worst
    assert client.rounds_trained == done + 1
    assert metrics[keys.TRAIN_LOSS] == pytest.approx(sum(losses) / steps, abs=1e-6)
    assert metrics[keys.NUM_EXAMPLES] == 18 and metrics[keys.PARTITION] == PID


def test_yoco_hooks_ramp_gamma_over_the_local_steps():
    client = make_client(Yoco)
    assert Yoco.loss_hooks(client.model, client.roles, {keys.PHASE: "train"}, 0, 4) == {}
    hooks = Yoco.loss_hooks(client.model, client.roles, YOCO, first_step=8, steps=4)
    assert set(hooks) == {"yoco_sign", "yoco_sparse"}
    for s in (0, 3):            # gamma = 1 at the first local step, gamma_max at the last
        got = hooks["yoco_sign"](client.model, 8 + s) + hooks["yoco_sparse"](client.model, 8 + s)
        assert torch.allclose(got, yoco_reference(client.model, s, 4), atol=1e-6)


def test_yoco_sparse_term_gradient_is_lambda_sign_a_per_entry():
    """The paper's R_sparse = lambda ||A||_1: every entry of every trained A gets exactly
    lambda sign(A) (the former lambda mean_A mean|A| gave lambda / (entries x matrices))."""
    client = make_client(Yoco)
    a_params = [p for n, p in client.model.named_parameters() if client.roles.get(n) == "A"]
    with torch.no_grad():
        for p in a_params:
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    hooks = Yoco.loss_hooks(client.model, client.roles, YOCO, first_step=0, steps=4)
    grads = torch.autograd.grad(hooks["yoco_sparse"](client.model, 0), a_params)
    assert len(a_params) == 13
    for p, g in zip(a_params, grads):
        assert torch.equal(g, YOCO[keys.YOCO_SPARSE_WEIGHT] * torch.sign(p.detach()))


def test_yoco_initial_b_comes_from_the_svd_of_w_and_a_is_zero():
    """B0 = U_r S_r^{1/2} of each layer's base weight, A = 0: the global model starts at the
    base model, and B's signs are the sign targets B_s."""
    client = make_client(Yoco)
    model = client.model
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    init = Yoco.initial_tensors(model, state, client.roles)
    params = dict(model.named_parameters())
    checked = 0
    for m in model.modules():
        if isinstance(m, LoraLayer):
            a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
            name_a = next(n for n, p in params.items() if p is a)
            name_b = next(n for n, p in params.items() if p is b)
            u, sv = svd_with_signs(m.base_layer.weight)
            torch.testing.assert_close(init[name_b], (u[:, :2] * sv[:2].sqrt()).float(), rtol=0, atol=1e-6)
            assert torch.equal(init[name_a], torch.zeros_like(a))
            assert torch.equal(torch.sign(init[name_b]), torch.sign(u[:, :2]))
            checked += 1
    assert checked == 13
    head = [n for n in state if n not in client.roles]
    assert head and all(torch.equal(init[n], state[n]) for n in head)


def test_ffa_trains_only_the_b_factors_found_through_the_protocol():
    from rankwise.federated.strategies import FfaLora
    client = make_client(FfaLora)
    a_before = {n: p.detach().clone() for n, p in client.model.named_parameters() if client.roles.get(n) == "A"}
    sent, _ = local_train(client, {keys.TRAIN_STEPS: 2, keys.LEARNING_RATE: LR, keys.TRAIN_FACTORS: "B"})
    assert not any(client.roles.get(n) == "A" for n in sent)
    assert sum(client.roles.get(n) == "B" for n in sent) == 13 and "classifier.weight" in sent
    params = dict(client.model.named_parameters())
    assert all(torch.equal(params[n], a) for n, a in a_before.items())


def test_leff_importance_and_query_answer():
    client = make_client(Leff)
    ref = copy.deepcopy(client.model)
    for p in ref.parameters():
        p.requires_grad_(True)
    task = get_task("classification")
    idx = batch_indices(0, 18, BS, 7 + PID)
    batch = task.collate([client.train_data[i] for i in idx], 0)
    out = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    F.cross_entropy(out.logits, batch["labels"]).backward()
    want = [0.0, 0.0]
    for n, p in ref.named_parameters():
        if layer_index(n) is not None:
            want[layer_index(n)] += float((p.grad * p.detach()).abs().sum())
    flags = [p.requires_grad for p in client.model.parameters()]
    got = Leff.pre_train_metrics(client, {keys.TRAIN_LAYERS: [1]})[keys.IMPORTANCE]
    assert got == pytest.approx(want, rel=1e-5) and min(got) > 0
    assert [p.requires_grad for p in client.model.parameters()] == flags
    assert Leff.pre_train_metrics(client, {keys.TRAIN_LAYERS: []}) == {}
    answer = Leff.answer_query(client, {keys.CAPACITIES: [1, 2]}, {})
    assert answer[keys.CAPACITY] == 2 and answer[keys.IMPORTANCE] == pytest.approx(want, rel=1e-5)
    assert Leff.answer_query(client, {keys.CAPACITIES: [1, 2]}, {keys.CAPACITY: 5})[keys.CAPACITY] == 5
    assert answer[keys.IMPORTANCE_S] > 0.0                   # the pass's cost is reported
