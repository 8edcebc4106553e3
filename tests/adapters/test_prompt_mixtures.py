"""PT-MoE (routed prompts A_i B with B shared) and CaPT (one instance-aware capsule per layer at
position 0): their defining formulas in numbers, and no target leaks into a causal capsule."""
from __future__ import annotations

import torch

from rankwise.adapters.prompt import CaptConfig, PtMoeConfig, apply_capt, apply_pt_moe
from rankwise.adapters.prompt.generators import masked_mean
from rankwise.core.protocol import transform_inputs
from rankwise.engine.task import IGNORE
from rankwise.testing import tiny_batch, tiny_bert_cls, tiny_gpt2_lm


def test_pt_moe_prompt_is_the_routed_sum_of_a_i_b():
    model = tiny_gpt2_lm()
    layer = apply_pt_moe(model, PtMoeConfig(num_virtual_tokens=3, num_experts=4, rank=5, top_k=2))
    gen = layer.prompts["default"]
    assert gen.A.shape == (4, 3, 5) and gen.B.shape == (5, 16)           # B shared by all experts
    assert sum(p.numel() for p in layer.adapter_params("default").values()) == 4 * 3 * 5 + 5 * 16 + 16 * 4 + 4
    layer.eval()
    batch = tiny_batch("gpt2", seed=4)
    batch["attention_mask"][0, -3:] = 0
    batch["labels"][:, :5] = IGNORE                       # the router pools the 5-token prompts
    out = transform_inputs(model, batch)
    emb = layer.base_layer(batch["input_ids"])
    pool = batch["attention_mask"].bool() & batch["labels"].eq(IGNORE)
    probs = torch.softmax(gen.router(masked_mean(emb, pool)), -1)                  # (2, 4)
    top = probs.topk(2, -1)
    w = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
    want = sum(w[:, i, None, None] * (gen.A[i] @ gen.B) for i in range(4))          # (2, 3, 16)
    torch.testing.assert_close(out["inputs_embeds"][:, :3], want, atol=1e-6, rtol=0)
    assert layer.statistics()["default"]["eval"]["selected"] == w.gt(0).float().mean(0).tolist()


def test_pt_moe_svd_init_reconstructs_vocabulary_prompts():
    model = tiny_gpt2_lm()
    torch.manual_seed(3)
    gen = apply_pt_moe(model, PtMoeConfig(num_virtual_tokens=2, num_experts=3, rank=6)).prompts["default"]
    table = model.get_input_embeddings().weight.detach()
    prompts = torch.einsum("inr,rh->inh", gen.A, gen.B).detach().reshape(-1, 16)   # rank 6 = N n: exact
    assert float(torch.cdist(prompts, table).min(-1).values.max()) < 1e-4


def test_capt_sets_one_capsule_per_layer_at_position_zero():
    model = tiny_bert_cls()
    layer = apply_capt(model, CaptConfig())
    gen = layer.prompts["default"]
    assert gen.blocks_path == "bert.encoder.layer" and gen.capsules.shape == (2, 16)
    with torch.no_grad():
        gen.capsules.normal_()
    seen = []
    for block in model.bert.encoder.layer:   # registered after CaPT's hook: sees the block input it made
        block.register_forward_pre_hook(lambda m, a, k: seen.append(a[0] if a else k["hidden_states"]),
                                        with_kwargs=True)
    batch = tiny_batch("bert", seed=2)
    batch["attention_mask"][1, -4:] = 0
    with torch.no_grad():
        model(**{k: v for k, v in transform_inputs(model, batch).items() if k != "labels"})
    pool = torch.cat([torch.zeros(2, 1, dtype=torch.long), batch["attention_mask"]], 1)
    for i, hidden in enumerate(seen):                                  # S_i = p_i + mean over the instance
        torch.testing.assert_close(hidden[:, 0], gen.capsules[i] + masked_mean(hidden, pool), atol=1e-5, rtol=0)
    assert len(seen) == 2 and hidden.shape[1] == 1 + 8


def logits_before_and_after_a_later_target_changes(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 4-token prompt + 4 target tokens, and of the same with target token 6
    changed (the leakage probe of the prompt methods on a causal LM)."""
    batch = tiny_batch("gpt2", batch=1, seed=6)
    batch["labels"][:, :4] = IGNORE                       # a 4-token prompt, then 4 target tokens

    def logits(b):
        with torch.no_grad():
            return model(**{k: v for k, v in transform_inputs(model, b).items() if k != "labels"}).logits

    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, 6] = (changed["input_ids"][0, 6] + 1) % 64
    changed["labels"][0, 6] = changed["input_ids"][0, 6]
    return logits(batch), logits(changed)


def test_capt_on_a_causal_lm_pools_only_tokens_without_loss():
    model = tiny_gpt2_lm()
    apply_capt(model, CaptConfig())
    before, after = logits_before_and_after_a_later_target_changes(model)
    # positions before the changed target (capsule + tokens 0..5) do not see it
    torch.testing.assert_close(after[:, :7], before[:, :7], atol=1e-6, rtol=0)
    assert not torch.allclose(after[:, 7:], before[:, 7:])


def test_pt_moe_on_a_causal_lm_routes_on_the_prompt_only():
    model = tiny_gpt2_lm()
    torch.manual_seed(0)
    apply_pt_moe(model, PtMoeConfig(num_virtual_tokens=3, num_experts=4, rank=5, top_k=2))
    model.eval()                                          # no router noise
    before, after = logits_before_and_after_a_later_target_changes(model)
    # the 3 virtual positions and tokens 0..5 do not see target token 6 (pooling it: 7e-4 here)
    assert torch.equal(after[:, :3 + 6], before[:, :3 + 6])
    assert not torch.allclose(after[:, 3 + 6:], before[:, 3 + 6:])
    # generation sees only the prompt: its logits equal the training forward's prompt positions
    batch = tiny_batch("gpt2", batch=1, seed=6)
    prompt = {"input_ids": batch["input_ids"][:, :4], "attention_mask": batch["attention_mask"][:, :4]}
    with torch.no_grad():
        got = model(**transform_inputs(model, prompt)).logits
    torch.testing.assert_close(got, before[:, :3 + 4], atol=1e-6, rtol=0)


def test_pt_moe_noise_keeps_one_plus_eps_positive():
    sigma = PtMoeConfig().noise_std
    assert sigma == 0.1
    # P(1 + eps < 0) = Phi(-1 / sigma): 7.6e-24 at 0.1 (it was 0.16 at sigma = 1)
    assert 0.5 * torch.erfc(torch.tensor(1 / sigma / 2 ** 0.5, dtype=torch.float64)) < 1e-20
