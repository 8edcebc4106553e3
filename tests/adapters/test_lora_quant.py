"""LoRA and GoRA on bitsandbytes 4-bit and 8-bit bases (CPU): wrapping, the trainable set, PEFT
loading our adapter on the same 4-bit base, GoRA's gradients from activations, and the merge
into the dequantized base."""
from __future__ import annotations

import copy

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from rankwise.adapters.gora import GoraConfig, accumulate_gradients, apply_gora, gora_report  # noqa: E402
from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora, export_peft  # noqa: E402
from rankwise.core import quant, weights as layer_weights  # noqa: E402
from rankwise.core.ops import count_parameters, merge_adapters  # noqa: E402
from rankwise.core.protocol import adapter_modules  # noqa: E402
from rankwise.errors import RankwiseError  # noqa: E402
from rankwise.recipes.model import bnb_config  # noqa: E402
from rankwise.testing import randomize_trainable  # noqa: E402

VOCAB = 128



def load(folder, quantize: str | None, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM
    kw = {"quantization_config": bnb_config(quantize, dtype)} if quantize else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kw)


def batch(seed: int = 1, n: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@pytest.mark.parametrize("quantize, cls", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_all_linear_wraps_quantized_layers_with_float32_factors(llama_dir, quantize, cls):
    model = load(llama_dir, quantize)
    base_out = model(**batch()).logits.detach()
    layers = apply_lora(model, LoraConfig(r=4, targets="all-linear"))
    assert len(layers) == 2 * 7 and "lm_head" not in layers
    assert all(type(m.base_layer).__name__ == cls for m in layers.values())
    assert all(p.dtype == torch.float32 for m in layers.values() for p in m.factors("default"))
    expect = sum(4 * (m.in_features + m.out_features) for m in layers.values())
    assert count_parameters(model)[0] == expect                         # exactly the factors
    out = model(**batch())
    assert torch.allclose(out.logits, base_out, atol=1e-5)              # B = 0 at init
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 14 and all(g is not None for g in grads.values())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_merging_in_place_into_a_4bit_base_is_refused(llama_dir):
    model = load(llama_dir, "nf4")
    apply_lora(model, LoraConfig(r=4, targets=["q_proj"]))
    with pytest.raises(RankwiseError, match="--format merged"):
        merge_adapters(model)


def test_peft_loads_our_adapter_on_the_same_4bit_base(llama_dir, tmp_path):
    """PeftModel.from_pretrained on the base loaded with the same BitsAndBytesConfig reproduces
    rankwise's outputs (float32 compute: agreement to float rounding)."""
    ours = load(llama_dir, "nf4")
    apply_lora(ours, LoraConfig(r=4, alpha=8, targets="all-linear"))
    randomize_trainable(ours, std=0.05)
    export_peft(ours, tmp_path / "peft")
    theirs = peft.PeftModel.from_pretrained(load(llama_dir, "nf4"), tmp_path / "peft")
    b = {k: v for k, v in batch(3).items() if k != "labels"}
    with torch.no_grad():
        a, p = ours.train()(**b).logits, theirs.train()(**b).logits
        plain = load(llama_dir, "nf4").train()(**b).logits
    assert (a - plain).abs().max() > 1e-2                   # the adapter changes the outputs
    assert (a - p).abs().max() <= 1e-5 * a.abs().max().clamp(min=1.0)


def test_gora_gradient_of_a_4bit_layer_equals_the_dense_gradient(llama_dir):
    """On a 4-bit base, G = sum dL/dy x^T from hooks equals autograd's dL/dW of a dense model
    holding the dequantized weights.

    Like with like: the 4-bit model is kept in bitsandbytes' training layout first, as
    ``apply_gora`` does. Otherwise, on a CPU with AVX512-BF16, the calibration forwards of the
    layers whose input needs no gradient (eval mode, frozen) repack them for the fused inference
    kernel, whose block scales are rounded to bf16 - a different weight than the dense copy's,
    0.6 % apart in G; that is the kernel, not the hook (the same 1e-4 holds once both read the
    same weights).
    """
    q = load(llama_dir, "nf4")
    quant.keep_training_layout(q)
    dense = quant.dequantize_model(copy.deepcopy(q), torch.float32)
    paths = [p for p in quant.quantized_paths(q)]
    batches = [batch(s) for s in range(2)]
    via_acts = accumulate_gradients(q, {p: q.get_submodule(p) for p in paths}, batches, 2)
    via_grad = accumulate_gradients(dense, {p: dense.get_submodule(p).weight for p in paths}, batches, 2)
    assert via_acts.via_activations == paths and via_acts.peak_grad_bytes == 0
    for p in paths:
        g, ref = via_acts.grads[p], via_grad.grads[p]
        assert ref.abs().max() > 0
        assert (g - ref).abs().max() <= 1e-4 * ref.abs().max(), p


def test_gora_activation_gradient_matches_autograd_on_a_bf16_base(llama_dir):
    """In bf16 the product dL/dy^T x is formed in bf16 like autograd's bf16 .grad, then summed
    in float32: the two paths agree to bf16 rounding."""
    model = load(llama_dir, None, "bfloat16")
    paths = [p for p, m in model.named_modules() if p.endswith("_proj")]
    batches = [batch(s) for s in range(2)]
    via_acts = accumulate_gradients(model, {p: model.get_submodule(p) for p in paths}, batches, 2)
    via_grad = accumulate_gradients(model, {p: model.get_submodule(p).weight for p in paths}, batches, 2)
    for p in paths:
        ref = via_grad.grads[p]
        assert (via_acts.grads[p] - ref).abs().max() <= 2 ** -7 * ref.abs().max(), p


def test_gora_on_a_4bit_base_and_its_gradient_phase_memory(llama_dir):
    """GoRA trains on an NF4 base; its gradient phase holds the accumulators it needs plus less
    than dequantizing every layer at once would (the shared memory meter)."""
    model = load(llama_dir, "nf4")
    layers = apply_gora(model, GoraConfig(r=4, n_batches=2), batches=[batch(s, n=1, seq=8) for s in range(2)])
    rep = gora_report(model)
    mem = rep["memory"]
    dense_bytes = sum(4 * m * n for m, n in rep["shapes"].values())   # every layer dequantized, fp32
    assert mem["via_activations"] == 14 and mem["memory_meter"] == "cpu_live_tensors"
    assert mem["accumulator_bytes"] == dense_bytes
    assert mem["accumulator_bytes"] <= mem["peak_bytes"] < mem["accumulator_bytes"] + dense_bytes
    assert all(layer_weights.is_quantized(m) for m in layers.values())
    assert {p for p, _ in adapter_modules(model)} == set(layers)
    before = model(**batch(5)).loss.item()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    for _ in range(5):
        model(**batch(5)).loss.backward()
        opt.step()
        opt.zero_grad()
    assert model(**batch(5)).loss.item() < before


def test_qlora_merges_into_the_dequantized_base_not_the_original(llama_dir, tmp_path):
    """peft#2105 / transformers#31293: the merged model must hold W_dequantized + s B A."""
    from transformers import AutoModelForCausalLM

    from rankwise.core.merged import export_merged
    model = load(llama_dir, "nf4")
    apply_lora(model, LoraConfig(r=4, targets="all-linear"))
    randomize_trainable(model, std=0.05)
    export_merged(model, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    original = load(llama_dir, None)
    layer = model.model.layers[0].self_attn.q_proj
    want = layer_weights.dense_weight(layer).float() + layer.delta_weight("default")
    got = merged.model.layers[0].self_attn.q_proj.weight
    wrong = original.model.layers[0].self_attn.q_proj.weight + layer.delta_weight("default")
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert (got - wrong).abs().max() > 100 * (got - want).abs().max().clamp(min=1e-9)
    assert not hasattr(merged.config, "quantization_config")
    b = {k: v for k, v in batch(4).items() if k != "labels"}
    with torch.no_grad():
        assert torch.allclose(merged(**b).logits, model.train()(**b).logits, atol=1e-4)
    assert isinstance(model.model.layers[0].self_attn.q_proj, LoraLayer)  # caller's model unchanged
