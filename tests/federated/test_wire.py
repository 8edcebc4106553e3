"""Roles of the factors come from the adapter protocol (``factors``), never from a name."""
from __future__ import annotations

import torch
from torch import nn

from rankwise.adapters.gora import GoraConfig, apply_gora, gora_report
from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.federated.wire import factor_owners, factor_roles, load_tensors, mark_wire, plain_parameters
from rankwise.testing import tiny_batch, tiny_bert_cls, tiny_gpt2_lm


def by_substring(model: nn.Module) -> dict[str, str]:
    """What the old name rule found (kept here only to compare)."""
    out = {}
    for n, _ in model.named_parameters():
        if ".lora_A." in n:
            out[n] = "A"
        elif ".lora_B." in n:
            out[n] = "B"
    return out


def test_lora_roles_on_bert_and_gpt2():
    for build, layers in ((tiny_bert_cls, 13), (tiny_gpt2_lm, 8)):   # gpt2: Conv1D c_attn c_proj c_fc mlp.c_proj
        model = build()
        apply_lora(model, LoraConfig(r=2, targets="all-linear"))
        roles = factor_roles(model)
        assert roles == by_substring(model) and len(roles) == 2 * layers
        params = dict(model.named_parameters())
        for name, (path, adapter, role) in factor_owners(model).items():
            a, b = model.get_submodule(path).factors(adapter)
            assert params[name] is (a if role == "A" else b)


def test_gora_roles_match_its_factor_names():
    model = tiny_bert_cls()
    apply_gora(model, GoraConfig(r=4, r_min=0, r_max=16, n_batches=3),
               batches=[tiny_batch("bert", seed=i) for i in range(3)])
    ranks = gora_report(model)["ranks"]
    assert len(set(ranks.values())) > 1 and 0 in ranks.values()    # adaptive ranks, some layers skipped
    roles = factor_roles(model)
    assert roles == by_substring(model)
    assert len(roles) == 2 * sum(r > 0 for r in ranks.values())
    params = dict(model.named_parameters())
    for name, (path, _, role) in factor_owners(model).items():
        r = ranks[path]
        assert params[name].shape[0 if role == "A" else 1] == r     # A (r, in), B (out, r)


def test_no_factors_without_a_factorized_method():
    assert factor_roles(tiny_bert_cls()) == {}
    # a parameter named like a factor is no factor unless the protocol says so
    fake = nn.Module()
    fake.register_parameter("lora_A", nn.Parameter(torch.zeros(2, 2)))
    assert factor_roles(fake) == {}


def test_plain_wire_names_survive_training_flags_and_load():
    model = tiny_bert_cls()
    apply_lora(model, LoraConfig(r=2, targets=["query"]))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    mark_wire(model, names)
    for p in model.parameters():
        p.requires_grad_(False)
    params = plain_parameters(model)
    assert list(params) == names and len(names) == 4 + 2          # 2 layers x (A, B) + head
    b = names[1]
    load_tensors(params, {b: torch.full(params[b].shape, 2.0), "unknown": torch.ones(1),
                          names[0]: torch.ones(1, 1)})                # wrong shape: ignored
    assert torch.equal(params[b], torch.full(params[b].shape, 2.0))
    assert not torch.equal(params[names[0]], torch.ones_like(params[names[0]]))
