"""DoRA on bitsandbytes NF4 and int8 bases (CPU): the row norm equals the direct formula on the
dequantized weight, gradients reach m, A and B, PEFT loads our adapter on the same 4-bit base with
the same logits in training mode, its eval forward takes the norm from a repacked weight (so the
PEFT export of DoRA on 4 bits is refused), and the merged export folds DoRA into the dequantized
base. The 4-bit model is
packed for bitsandbytes' CPU inference kernel first, so the test holds on CPUs with and without
AVX512-BF16 (applying the adapter must restore the training layout)."""
from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from rankwise.adapters.lora import LoraConfig, apply_lora, dora, export_peft  # noqa: E402
from rankwise.core import adapter_modules, quant, weights as layer_weights  # noqa: E402
from rankwise.recipes.model import bnb_config  # noqa: E402
from rankwise.testing import pack_4bit_for_cpu  # noqa: E402

VOCAB = 128



def load(folder, quantize):
    from transformers import AutoModelForCausalLM
    kw = {"quantization_config": bnb_config(quantize, "float32")} if quantize else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def adapt(model, targets="all-linear"):
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=targets, use_dora=True))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, layer in adapter_modules(model):
            for key, p in layer.adapter_params("default").items():
                noise = torch.randn(p.shape, generator=g) * 0.05
                p.copy_(p * (1 + noise) if key == "lora_magnitude_vector" else noise)
    return model


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_norm_and_gradients_on_a_quantized_base(llama_dir, quantize):
    model = load(llama_dir, quantize)
    if quantize == "nf4":
        assert pack_4bit_for_cpu(model) == 14
    adapt(model)
    assert not any(quant.is_packed_for_cpu(m) for m in model.modules())
    for _, layer in adapter_modules(model):
        a, b = layer.factors("default")
        want = dora.row_norms_direct(layer_weights.dense_weight(layer), a, b, layer.scaling["default"])
        got = layer._dora_norm("default")
        assert (got - want).abs().max() <= 1e-6 * want.max()
    model.train()
    model(**batch()).loss.backward()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum("magnitude" in n for n in params) == 14
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in params.values())


def test_peft_loads_our_adapter_on_the_same_4bit_base(llama_dir, tmp_path):
    ours = adapt(load(llama_dir, "nf4"))
    export_peft(ours, tmp_path / "peft", allow_4bit_dora=True)  # refused by default (below)
    theirs = peft.PeftModel.from_pretrained(load(llama_dir, "nf4"), tmp_path / "peft")
    b = {k: v for k, v in batch(3).items() if k != "labels"}
    with torch.no_grad():  # training mode: an eval forward would repack PEFT's 4-bit layers
        a, p = ours.train()(**b).logits, theirs.train()(**b).logits
        plain = load(llama_dir, "nf4").train()(**b).logits
    assert (a - plain).abs().max() > 1e-2                   # the adapter changes the outputs
    assert (a - p).abs().max() <= 1e-5 * a.abs().max().clamp(min=1.0)


def test_merged_export_folds_dora_into_the_dequantized_base(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from rankwise.core.merged import export_merged
    model = adapt(load(llama_dir, "nf4"), ["q_proj", "down_proj"])
    layer = model.model.layers[0].self_attn.q_proj
    w = layer_weights.dense_weight(layer).float()
    a, b = layer.factors("default")
    direct = w + layer.scaling["default"] * (b @ a)
    want = layer.lora_magnitude_vector["default"][:, None] / direct.norm(dim=1, keepdim=True) * direct
    export_merged(model, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    got = merged.model.layers[0].self_attn.q_proj.weight
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    b_ = {k: v for k, v in batch(4).items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(merged(**b_).logits, model.eval()(**b_).logits, atol=1e-4, rtol=0)


def test_peft_export_of_dora_on_4_bits_is_refused_with_the_reason(llama_dir, tmp_path):
    """Why: after bitsandbytes repacks a 4-bit weight for its CPU inference kernel (the first
    eval forward on an AVX512-BF16 CPU; ``pack_4bit_for_cpu`` does it on any CPU), PEFT's DoRA
    dequantizes the repacked bytes as the standard layout, so its weight norm is another
    matrix's. rankwise reads both layouts (its norms, magnitudes and merged export agree); its
    merged export keeps rankwise's loss change within 5 % (here 1e-3) of the adapter's effect."""
    from peft.utils.integrations import dequantize_module_weight
    from transformers import AutoModelForCausalLM

    from rankwise.core.merged import export_merged
    from rankwise.errors import RankwiseError
    ours = adapt(load(llama_dir, "nf4"))
    with pytest.raises(RankwiseError, match="DoRA on a bitsandbytes 4-bit base .*repacked bytes"
                                            ".*--format merged"):
        export_peft(ours, tmp_path / "peft")
    assert not (tmp_path / "peft").exists()
    packed = load(llama_dir, "nf4")
    layer = packed.model.layers[0].self_attn.q_proj
    want = quant.dequantize_4bit(layer)                              # the training layout
    pack_4bit_for_cpu(packed)
    # rankwise reads the repacked layout: the same codes, block scales rounded to bf16
    eps = torch.finfo(torch.bfloat16).eps
    assert (quant.dequantize_4bit(layer) - want).abs().max() <= eps * want.abs().max()
    theirs = dequantize_module_weight(layer).float()                 # PEFT's DoRA path
    assert (theirs.norm(dim=1) - want.float().norm(dim=1)).abs().max() > 0.05 * want.float().norm(dim=1).max()
    b = batch(3)
    export_merged(ours, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        base = load(llama_dir, "nf4").train()(**b).loss
        own, folded = ours.train()(**b).loss, merged(**b).loss
    assert (own - base).abs() > 1e-4                                 # the adapter has an effect
    assert (folded - own).abs() <= 1e-3 * (own - base).abs()


def test_peft_export_of_dora_on_an_8bit_base_is_written(llama_dir, tmp_path):
    """The refusal is the 4-bit layout's: DoRA on int8 (no repacking) exports as before."""
    export_peft(adapt(load(llama_dir, "int8")), tmp_path / "peft")
    assert (tmp_path / "peft" / "adapter_config.json").is_file()
