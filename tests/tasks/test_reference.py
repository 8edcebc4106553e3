"""``disable_dropout``: every dropout module and Llama's float ``attention_dropout`` set to 0."""
from __future__ import annotations

import torch

from rankwise.tasks.reference import disable_dropout
from rankwise.testing import tiny_gpt2_lm, tiny_llama64


def test_disable_dropout_zeroes_modules_and_attention_rates():
    gpt2 = tiny_gpt2_lm(dropout=0.1)
    n = sum(isinstance(m, torch.nn.Dropout) for m in gpt2.modules())
    assert disable_dropout(gpt2) == n == 7                          # embd + 2 x (attn, resid, mlp)
    assert all(m.p == 0.0 for m in gpt2.modules() if isinstance(m, torch.nn.Dropout))
    llama = tiny_llama64(attention_dropout=0.1)
    attn = [m for m in llama.modules() if hasattr(m, "attention_dropout")]
    assert disable_dropout(llama) == len(attn) == 2 and all(m.attention_dropout == 0.0 for m in attn)
    assert disable_dropout(llama) == 0                              # nothing left to switch off
