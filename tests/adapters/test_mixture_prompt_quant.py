"""The mixture and prompt methods on a bitsandbytes 4-bit (NF4) base, on CPU: they wrap the
quantized layers (or its embeddings), train float32 weights only, start at the quantized base's
output where they promise it, and forward + backward are finite."""
from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from rankwise import registry  # noqa: E402
from rankwise.configs import from_dict  # noqa: E402
from rankwise.core import quant  # noqa: E402
from rankwise.core.ops import disable_adapters  # noqa: E402
from rankwise.core.protocol import adapter_modules, aux_losses, transform_inputs  # noqa: E402
from rankwise.recipes.model import bnb_config  # noqa: E402

VOCAB = 128
CONFIGS = {  # small settings; every method here starts at the base output except the prompts
    "moe-lora": ({"num_experts": 3, "top_k": 2, "r": 2}, True),
    "smore": ({"experts": [3, 2], "ranks": [2, 2], "fanout": [2, 1], "gate_dims": [4, 4], "down_dim": 4}, True),
    "lope": ({"r": 2, "num_experts": 2, "poison_steps": 0}, True),  # stages: tests/adapters/test_lope.py
    "fvae-lora": ({"r": 2, "enc_hidden": 8, "dec_hidden": 8}, True),
    "prompt-tuning": ({"num_virtual_tokens": 3}, False),
    "pt-moe": ({"num_virtual_tokens": 3, "num_experts": 2, "rank": 2}, False),
    "capt": ({}, False),
}



@pytest.mark.parametrize("name", list(CONFIGS))
def test_method_on_an_nf4_base(name, llama_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16,
                                                 quantization_config=bnb_config("nf4", "bfloat16"))
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    # Like with like: the reference is computed in the training layout the builder leaves the
    # model in. Left alone, an eval forward on an AVX512-BF16 CPU would repack the weights for
    # bitsandbytes' fused inference kernel (bf16-rounded block scales, one bf16 ulp off); that
    # the builder unpacks such a model is tested in tests/core/test_quant_entries.py.
    quant.keep_training_layout(model)
    with torch.no_grad():
        base = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits.float()
    settings, identity = CONFIGS[name]
    entry = registry.get("method", name)
    entry.builder(model, from_dict(entry.config_cls, {"name": name, **settings}, "method"), "default")
    wrapped = [type(m.base_layer).__name__ for _, m in adapter_modules(model)]
    assert wrapped and (set(wrapped) == {"Linear4bit"} or name in ("prompt-tuning", "pt-moe", "capt"))
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float32 for p in params)
    model.eval()
    with torch.no_grad():
        out = model(**{k: v for k, v in transform_inputs(model, batch).items() if k != "labels"}).logits
        v = out.shape[1] - ids.shape[1]
        if identity:
            torch.testing.assert_close(out.float(), base, atol=1e-6, rtol=0)
        with disable_adapters(model):
            torch.testing.assert_close(model(**{k: x for k, x in batch.items() if k != "labels"}).logits.float(),
                                       base, atol=1e-6, rtol=0)
    assert v == (0 if identity else {"capt": 1}.get(name, 3))
    model.train()
    loss = model(**transform_inputs(model, batch)).loss
    extra = aux_losses(model)
    total = loss + sum(extra.values()) if extra else loss
    assert torch.isfinite(total)
    total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
