"""Routers count real tokens only: padding a batch leaves every routed method's balance loss,
dynamic loss and expert load as they were, and the losses follow their formulas over the
unpadded tokens."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.adapters.lope import LopeConfig, apply_lope
from rankwise.adapters.mixture import MixtureLoraLayer, MoeLoraConfig, ThresholdGate, apply_moe_lora
from rankwise.adapters.smore import SmoreConfig, apply_smore
from rankwise.core.protocol import aux_losses, reset_statistics, statistics
from rankwise.core.token_mask import valid_tokens
from rankwise.testing import tiny_batch, tiny_llama_lm

METHODS = {
    "moe-lora": lambda m: apply_moe_lora(m, MoeLoraConfig(num_experts=4, top_k=2, r=2)),
    "moe-lora top-p": lambda m: apply_moe_lora(m, MoeLoraConfig(num_experts=4, top_k=3, r=2,
                                                                mass_threshold=0.5)),
    "smore": lambda m: apply_smore(m, SmoreConfig(ranks=[2, 2], experts=[3, 2], fanout=[2, 1],
                                                  gate_dims=[4, 4], down_dim=4)),
    "lope": lambda m: apply_lope(m, LopeConfig(r=2, num_experts=2, noise_std=0.0)),
}


def _routed(name: str) -> nn.Module:
    model = tiny_llama_lm()
    METHODS[name](model)
    torch.manual_seed(3)
    with torch.no_grad():                                  # experts away from B = 0: outputs move
        for n, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in n or "W_final" in n):
                p.normal_(0, 0.3)
    return model.train()


def _forward(model: nn.Module, batch: dict) -> tuple[dict, dict]:
    reset_statistics(model)
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    losses = {k: float(v.detach()) for k, v in aux_losses(model).items()}
    return losses, statistics(model)


def _padded(batch: dict, extra: int) -> dict:
    ids = torch.cat([batch["input_ids"], torch.zeros(2, extra, dtype=torch.long)], 1)
    mask = torch.cat([batch["attention_mask"], torch.zeros(2, extra, dtype=torch.long)], 1)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", list(METHODS))
def test_padding_changes_neither_the_losses_nor_the_load(name):
    model = _routed(name)
    batch = tiny_batch("llama", seed=5)
    batch["attention_mask"][1, -3:] = 0                    # one example 3 tokens shorter
    losses, stats = _forward(model, batch)
    padded_losses, padded_stats = _forward(model, _padded(batch, 5))
    assert losses.keys() == padded_losses.keys()
    for key in losses:                                     # causal model: real tokens unchanged
        assert padded_losses[key] == pytest.approx(losses[key], abs=1e-7), key
    for path, per in stats.items():
        for adapter, s in per.items():
            got = padded_stats[path][adapter]["train"]
            assert got["decisions"] == s["train"]["decisions"]
            assert got["decisions"] % 13 == 0              # 8 + 5 real tokens (x parent paths)
            for key in ("selected", "top1", "weight", "load"):
                torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(s["train"][key]),
                                           atol=1e-6, rtol=0)
    # without the mask the padding is counted: the load moves (the old behaviour)
    model(input_ids=_padded(batch, 5)["input_ids"])
    if losses:
        unmasked = {k: float(v.detach()) for k, v in aux_losses(model).items()}
        assert any(abs(unmasked[k] - losses[k]) > 1e-6 for k in losses)


def test_layer_losses_follow_their_formulas_over_real_tokens():
    torch.manual_seed(0)
    layer = MixtureLoraLayer(nn.Linear(6, 5))
    mix = layer.add("default", 4, r=2, alpha=4.0, gate=ThresholdGate(0.6, 3), router_init="kaiming",
                    balance_weight=0.05, entropy_weight=1e-4)
    x = torch.randn(3, 7, 6)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, 2:] = 0                                        # 7 + 5 + 2 = 14 real tokens
    mix.token_mask = mask
    layer.train()
    layer(x)
    real = mask.bool()
    probs = torch.softmax(x @ mix.router.weight.T, -1)[real]                 # (14, 4)
    chosen = mix.gate(x @ mix.router.weight.T)[real] > 0
    balance = 0.05 * 4 * ((chosen.float().sum(0) / 14) * probs.mean(0)).sum()
    dynamic = 1e-4 * -(probs * probs.log()).sum(-1).mean()
    aux = layer.aux_losses()
    assert float(aux["balance_loss"]) == pytest.approx(float(balance), abs=1e-7)
    assert float(aux["dynamic_loss"]) == pytest.approx(float(dynamic), abs=1e-10)
    assert statistics(nn.Sequential(layer))["0"]["default"]["train"]["decisions"] == 14


def test_valid_tokens_aligns_the_mask_with_the_input():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    assert valid_tokens(mask, (2, 4)).tolist() == [[False, True, True, True], [True, True, True, False]]
    assert valid_tokens(mask, (2, 1)).tolist() == [[True], [False]]   # a cached decoding step
    assert valid_tokens(mask, (8,)).tolist() == [False, True, True, True, True, True, True, False]
    assert valid_tokens(mask, (3, 4)) is None and valid_tokens(None, (2, 4)) is None
