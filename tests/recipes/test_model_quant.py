"""A 4-bit classification base (the packaged MiniLM, ``model.quantize: nf4``): bitsandbytes
quantizes the pretrained layers and leaves the new classifier head (not in the checkpoint,
trained in full) a float ``nn.Linear``. Before, the head was quantized too and QLoRA on MiniLM
classification crashed on its first step."""
from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from rankwise.recipes.model import load_model  # noqa: E402


def test_the_classifier_head_stays_float_on_a_4bit_base():
    model, tok = load_model("demo", "classification", num_labels=3, quantize="nf4")
    assert type(model.classifier) is torch.nn.Linear
    assert model.classifier.weight.dtype == torch.float32 and model.classifier.weight.shape == (3, 384)
    quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 6 * 6 + 1                        # q, k, v, o, up, down in 6 layers + pooler
    enc = tok(["def add(a, b): return a + b"], return_tensors="pt")
    logits = model(**enc).logits
    assert logits.shape == (1, 3) and torch.isfinite(logits.float()).all()
