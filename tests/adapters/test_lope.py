"""LoPE: the poisoning expert is masked at inference (the normal experts' weights renormalised)
and the inference output changes only through the normal experts; stage 1 trains only the
poisoning expert on generated noisy data, stage 2 only the rest; the optional input noise reaches
the poisoning expert only, and only in training."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.adapters.lope import LopeConfig, LopeLayer, apply_lope, discrete_noise
from rankwise.core.protocol import transform_inputs
from rankwise.engine import get_task
from rankwise.testing import tiny_batch, tiny_bert_cls, tiny_gpt2_lm, tiny_llama_lm


def make_layer(noise_std=0.5, renormalize=True) -> LopeLayer:
    torch.manual_seed(0)
    layer = LopeLayer(nn.Linear(6, 5))
    e = layer.add("default", r=3, num_experts=2, alpha=6.0, noise_std=noise_std, renormalize=renormalize)
    with torch.no_grad():
        e.lora_B.normal_()
        e.lora_B_poison.normal_()
        e.router.weight.normal_()
    return layer


def parts(layer, x, renormalize=False):
    """(normal experts' term, poisoning expert's term without noise), both scaled by s = 2;
    with ``renormalize`` the normal weights are divided by their sum (inference)."""
    e = layer.experts["default"]
    g = torch.softmax(x @ e.router.weight.T, -1)                     # (..., 3)
    w = g[..., :2] / g[..., :2].sum(-1, keepdim=True) if renormalize else g[..., :2]
    h = x @ e.lora_A.T
    normal = sum(w[..., i:i + 1] * (h @ e.lora_B[i].T) for i in range(2)) * 2.0
    poison = g[..., 2:3] * (h @ e.lora_B_poison.T) * 2.0
    return normal, poison


@pytest.mark.parametrize("renormalize", [True, False])
def test_inference_changes_only_through_the_masked_expert(renormalize):
    layer = make_layer(noise_std=0.0, renormalize=renormalize)
    x = torch.randn(4, 7, 6)
    normal, poison = parts(layer, x)
    base = layer.base_layer(x)
    layer.train()
    torch.testing.assert_close(layer(x), base + normal + poison, atol=1e-5, rtol=0)
    layer.eval()
    inference = layer(x)
    masked, _ = parts(layer, x, renormalize)
    torch.testing.assert_close(inference, base + masked, atol=1e-5, rtol=0)
    if not renormalize:                       # then training minus inference is the poison term
        layer.train()
        torch.testing.assert_close(layer(x) - inference, poison, atol=1e-5, rtol=0)
    with torch.no_grad():                     # the poisoning B does not reach inference at all
        layer.experts["default"].lora_B_poison.add_(10.0)
    layer.eval()
    assert torch.equal(layer(x), inference)
    with torch.no_grad():
        layer.experts["default"].lora_B[0].add_(1.0)
    assert not torch.allclose(layer(x), inference)


def test_noise_goes_only_into_the_poisoning_expert():
    layer = make_layer(noise_std=0.5)
    e = layer.experts["default"]
    x = torch.randn(3, 6)
    normal, _ = parts(layer, x)
    layer.train()
    torch.manual_seed(123)
    got = layer(x)
    torch.manual_seed(123)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    eps = 0.5 * rms * torch.randn_like(x)
    g = torch.softmax(x @ e.router.weight.T, -1)
    poison = g[:, 2:3] * ((x + eps) @ e.lora_A.T @ e.lora_B_poison.T) * 2.0
    torch.testing.assert_close(got, layer.base_layer(x) + normal + poison, atol=1e-5, rtol=0)
    layer.eval()
    assert torch.equal(layer(x), layer(x))                            # deterministic at inference


def test_router_statistics_mask_the_poisoning_expert_in_eval():
    layer = make_layer()
    layer.train()
    layer(torch.randn(4, 6))
    layer.eval()
    layer(torch.randn(2, 6))
    stats = layer.statistics()["default"]
    assert stats["experts"] == 3 and stats["train"]["selected"] == [1.0, 1.0, 1.0]
    assert stats["eval"]["selected"] == [1.0, 1.0, 0.0] and stats["eval"]["load"][2] == 0.0


def test_poison_gate_is_the_mean_router_weight_per_kind_of_data():
    """``poison_gate`` = mean softmax(R x)[-1] over real tokens, kept apart for stage-1 noisy
    forwards, stage-2 task forwards and evaluation forwards (before the mask)."""
    layer = make_layer()
    e = layer.experts["default"]
    g_p = lambda x: torch.softmax(x @ e.router.weight.T, -1)[..., -1]
    xs = {k: torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(i)) for i, k in enumerate(("noisy", "task", "eval"))}
    e.token_mask = torch.ones(3, 5, dtype=torch.long)
    e.token_mask[:, 3:] = 0                                     # padding is left out
    layer.train()
    e.stage = "poison"
    layer(xs["noisy"])
    e.stage = "task"
    layer(xs["task"])
    layer.eval()
    layer(xs["eval"])
    got = layer.statistics()["default"]["poison_gate"]
    for kind, x in xs.items():
        assert got[kind]["tokens"] == 9
        assert got[kind]["mean"] == pytest.approx(float(g_p(x)[:, :3].mean()), rel=1e-6)
    layer.reset_statistics(("eval",))
    assert set(layer.statistics()["default"]["poison_gate"]) == {"noisy", "task"}


def test_parameter_budget_and_base_at_init():
    base, model = tiny_gpt2_lm(), tiny_gpt2_lm()
    layers = apply_lope(model, LopeConfig(r=2, num_experts=2, targets=["c_attn"], poison_steps=0))
    layer = next(iter(layers.values()))
    n_in, n_out = layer.in_features, layer.out_features                # GPT-2 Conv1D 16 -> 48
    assert sum(p.numel() for p in layer.adapter_params("default").values()) == 2 * n_in + 3 * (2 * n_out + n_in)
    batch = {k: v for k, v in tiny_batch("gpt2").items() if k != "labels"}
    model.train()                                                     # even with the poison active
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, base(**batch).logits, atol=1e-6, rtol=0)


def test_generated_noise_replaces_tokens_and_labels_at_the_rate():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (64, 32), generator=g)
    mask = torch.ones_like(ids)
    mask[:, 24:] = 0                                                  # padding is never touched
    lm = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    lm["labels"][:, :4] = -100                                        # a prompt without loss
    out = discrete_noise(lm, 0.5, 64, 0, torch.Generator().manual_seed(1))
    changed = out["input_ids"] != ids
    assert not changed[:, 24:].any() and torch.equal(lm["input_ids"], ids)   # inputs not modified
    assert 0.46 < changed[:, :24].float().mean() < 0.5                # 0.5 minus same-token draws
    target = lm["labels"] != -100                                      # LM targets follow tokens
    assert torch.equal(out["labels"][target], out["input_ids"][target])
    assert torch.equal(out["labels"][~target], lm["labels"][~target])
    cls = {"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(64, dtype=torch.long)}
    flipped = discrete_noise(cls, 0.5, 64, 4, torch.Generator().manual_seed(2))["labels"]
    assert 0.3 < flipped.ne(0).float().mean() < 0.45                  # 0.5 * 3/4 of the labels


def test_stage_one_trains_only_the_poisoning_expert_stage_two_only_the_rest():
    torch.manual_seed(0)
    model = tiny_bert_cls()
    layers = apply_lope(model, LopeConfig(r=2, num_experts=2, targets=["query", "value"],
                                          poison_steps=2, noise_rate=0.5))
    experts = [layer.experts["default"] for layer in layers.values()]
    head = model.classifier.weight.detach().clone()
    task = get_task("classification")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    batch = tiny_batch("bert", batch=4, seed=3)
    seen = []                                                       # the ids each forward gets
    model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"]), with_kwargs=True)
    model.train()
    for step in range(4):
        if step == 2:
            after_stage_one = [(e.lora_B.detach().clone(), e.lora_B_poison.detach().clone())
                               for e in experts]
            assert torch.equal(model.classifier.weight, head)       # the head waits for stage 2
        opt.zero_grad()
        loss, _ = task.loss_sum(model, batch)
        loss.backward()
        opt.step()
    assert not torch.equal(seen[0], batch["input_ids"]) and not torch.equal(seen[1], seen[0])
    assert torch.equal(seen[2], batch["input_ids"]) and torch.equal(seen[3], batch["input_ids"])
    for e, (normal, poison) in zip(experts, after_stage_one):
        assert torch.count_nonzero(normal) == 0 and torch.count_nonzero(poison) > 0     # only B_p
        assert torch.equal(e.lora_B_poison, poison)                 # B_p frozen in stage 2
        assert torch.count_nonzero(e.lora_B) > 0                    # the normal experts learn
    assert all(e.stage == "task" for e in experts) and not torch.equal(model.classifier.weight, head)
    model.eval()                                                    # evaluation is never noised
    assert transform_inputs(model, batch) is batch


def test_masking_removes_what_stage_one_put_in_the_poisoning_expert():
    """What masking removes at inference is exactly the poisoning expert's term, and after
    stage 1 (noise only, normal experts still zero) that is the adapter's whole output."""
    torch.manual_seed(0)
    model, base = tiny_bert_cls(), tiny_bert_cls()
    apply_lope(model, LopeConfig(r=2, num_experts=2, targets=["query", "value"], poison_steps=3,
                                 noise_rate=0.5))
    task = get_task("classification")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    batch = tiny_batch("bert", batch=4, seed=3)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        task.loss_sum(model, batch)[0].backward()
        opt.step()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        trained = model(**inputs).logits                             # train mode: B_p active
        model.eval()
        masked = model(**inputs).logits
        reference = base(**inputs).logits                            # the head did not train
    assert (trained - masked).abs().max() > 1e-5                     # B_p learned something
    torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)  # masking removes it all


def test_the_noise_schedule_adds_no_positions_so_packing_stays_allowed():
    from rankwise.data.packing import packed_training_data
    model = tiny_llama_lm()
    apply_lope(model, LopeConfig(r=2, num_experts=2, poison_steps=2))

    class Rows:
        pad_id, label_names, dropped = 0, None, 0

        def lengths(self):
            return torch.tensor([3, 4, 2])

    assert len(packed_training_data(model, Rows(), capacity=8)) == 2   # not refused


def test_a_rebuilt_model_continues_the_schedule_where_the_saved_one_stopped():
    from rankwise.adapters.lope import rebuild_lope
    from rankwise.core.io import structure
    cfg = LopeConfig(r=2, num_experts=2, targets=["query"], poison_steps=3)
    model = tiny_bert_cls()
    apply_lope(model, cfg)
    model.train()
    batch = tiny_batch("bert", seed=1)
    for _ in range(3):
        transform_inputs(model, batch)
    saved = structure(model)
    assert {d["batches_seen"] for d in saved.values()} == {3}
    again = tiny_bert_cls()
    rebuild_lope(again, cfg, "default", saved)
    again.train()
    assert again.lope_noise_injection.batches == 3
    assert transform_inputs(again, batch) is batch                # batch 4: stage 2, the task data
    assert {e.stage for m in again.modules() for e in getattr(m, "experts", {}).values()} == {"task"}
