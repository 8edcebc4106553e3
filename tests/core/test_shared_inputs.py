"""``core.shared_inputs``: the probe forward finds the layers that read one tensor (q/k/v,
gate/up; BERT's query/key/value; nothing in GPT-2, whose c_attn is already one layer) and
changes nothing a run computes: weights, random state, modules' modes, hooked forwards, a 4-bit
layer's packed layout."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora
from rankwise.core import shared_inputs
from rankwise.testing import tiny_bert_cls, tiny_gpt2_lm, tiny_llama64


def lora_layers(model):
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def paths(prefix, *names):
    return tuple(f"{prefix}.{n}" for n in names)


def test_groups_follow_the_models_own_calls():
    llama = tiny_llama64(128)   # GQA: k, v narrower than q
    apply_lora(llama, LoraConfig(r=2, alpha=4, targets="all-linear"))
    groups = shared_inputs.fix_groups(llama, lora_layers(llama))
    assert groups == [g for i in (0, 1) for g in (
        paths(f"model.layers.{i}.self_attn", "q_proj", "k_proj", "v_proj"),
        paths(f"model.layers.{i}.mlp", "gate_proj", "up_proj"))]
    attn = llama.model.layers[1].self_attn
    assert shared_inputs.partners(attn.q_proj) == (attn.k_proj, attn.v_proj)
    assert shared_inputs.partners(attn.k_proj) == () == shared_inputs.partners(attn.o_proj)
    bert = tiny_bert_cls()
    apply_lora(bert, LoraConfig(r=2, alpha=4, targets=["query", "value"]))  # key not wrapped
    assert shared_inputs.fix_groups(bert, lora_layers(bert)) == [
        paths(f"bert.encoder.layer.{i}.attention.self", "query", "value") for i in (0, 1)]
    gpt2 = tiny_gpt2_lm()
    apply_lora(gpt2, LoraConfig(r=2, alpha=4, targets="all-linear"))
    assert shared_inputs.fix_groups(gpt2, lora_layers(gpt2)) == []
    shared_inputs.forget(lora_layers(llama))
    assert shared_inputs.partners(attn.q_proj) == ()
    twin = copy.deepcopy(bert)
    assert shared_inputs.partners(twin.bert.encoder.layer[0].attention.self.query) == ()


def test_the_probe_changes_nothing_a_run_computes():
    model = tiny_llama64(128)
    apply_lora(model, LoraConfig(r=2, alpha=4, targets="all-linear", dropout=0.1))
    model.train()
    model.model.layers[1].mlp.eval()                     # a mode the probe must give back
    hooked = model.model.layers[0].self_attn.o_proj.base_layer
    own = hooked.forward                                 # accelerate keeps its hook here
    hooked.forward = lambda x, _f=own: _f(x)
    mine = hooked.forward
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    calls = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))
    assert len(shared_inputs.fix_groups(model, lora_layers(model))) == 4
    handle.remove()
    assert calls == [1]                                  # hooks still see the probe's one call
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert hooked.forward is mine
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == [
        "model.layers.0.self_attn.o_proj.base_layer"]
    modes = {n: m.training for n, m in model.named_modules()}
    assert modes["model.layers.1.mlp"] is False and modes["model.layers.1.mlp.up_proj"] is False
    assert modes["model"] is True and modes["model.layers.0.mlp.up_proj"] is True


def test_a_4bit_base_keeps_its_layout(tmp_path):
    """An eval-mode no-grad forward of a bitsandbytes 4-bit layer on a CPU with AVX512-BF16
    repacks its weight for CPU inference (for good: the fused path then refuses the layer);
    the probe never calls a linear layer, so the packed bytes stay as loaded."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from rankwise.recipes.model import bnb_config
    tiny_llama64(128).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16,
                                                 quantization_config=bnb_config("nf4", "bfloat16"))
    apply_lora(model, LoraConfig(r=2, alpha=4, targets=["q_proj", "k_proj", "v_proj"]))
    plain = model.model.layers[0].mlp.up_proj             # a 4-bit layer no adapter wraps
    wrapped = model.model.layers[0].self_attn.q_proj.base_layer
    before = [layer.weight.data.view(torch.uint8).clone() for layer in (plain, wrapped)]
    assert len(shared_inputs.fix_groups(model, lora_layers(model))) == 2
    for layer, packed in zip((plain, wrapped), before):
        assert torch.equal(layer.weight.data.view(torch.uint8), packed)  # bytes, not floats
        assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


class _Tied(nn.Module):
    """One block called twice, and a forward that needs more than token ids."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, attention_mask=None, extra=None):
        h = self.emb(input_ids)
        for _ in range(2):
            h = self.a(h) + self.b(h)
            h = self.c(h) + self.a(h)   # c, a on one tensor: a is in a group already
        return h if extra is None else h + extra


def test_a_block_called_twice_decides_once_and_a_failed_probe_gives_no_groups():
    model = _Tied()
    apply_lora(model, LoraConfig(r=2, alpha=4, targets=["a", "b", "c"]))
    layers = lora_layers(model)
    assert shared_inputs.fix_groups(model, layers) == [("a", "b")]
    assert shared_inputs.partners(model.c) == ()
    batch = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "extra": "not a tensor"}
    with pytest.warns(UserWarning, match=r"probe forward failed \(TypeError.*own products"):
        assert shared_inputs.fix_groups(model, layers, batch=batch) == []
    assert shared_inputs.partners(model.a) == ()         # the earlier groups were dropped
    with pytest.warns(UserWarning, match="no integer input embedding"):
        assert shared_inputs.fix_groups(nn.Sequential(*layers), layers) == []
