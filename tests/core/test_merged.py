"""Merged export: transformers loads it without rankwise and gives the adapted model's logits."""
from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.core.merged import export_merged
from rankwise.core.protocol import adapter_modules
from rankwise.core.summary import print_summary, summary_rows
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_batch, tiny_logits, tiny_bert_cls, tiny_gpt2_lm



@pytest.mark.parametrize("kind,build,auto,targets", [
    ("bert", tiny_bert_cls, "AutoModelForSequenceClassification", ["query", "value"]),
    ("gpt2", tiny_gpt2_lm, "AutoModelForCausalLM", ["c_attn", "c_proj"]),
])
def test_transformers_loads_merged_export(kind, build, auto, targets, tmp_path):
    import transformers
    model = build()
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=targets))
    randomize_trainable(model, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ours = tiny_logits(model, kind)
    export_merged(model, tmp_path / "merged")
    loaded = getattr(transformers, auto).from_pretrained(str(tmp_path / "merged")).eval()
    torch.testing.assert_close(tiny_logits(loaded, kind), ours, atol=1e-5, rtol=0)
    assert not any("lora" in k for k in loaded.state_dict())
    after = model.state_dict()  # the caller's model is untouched
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert len(list(adapter_modules(model))) > 0


def test_merged_export_refuses_plain_modules(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(RankwiseError, match="not a transformers model"):
        export_merged(model, tmp_path / "m")


def test_summary_rows_and_print():
    model = tiny_bert_cls()
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["query"], rank_pattern={"layer.1.*": 2}))
    rows = summary_rows(model)
    lora = [r for r in rows if r["adapter"] == "default"]
    assert [r["rank"] for r in lora] == [4, 2]
    assert [r["scale"] for r in lora] == [2.0, 4.0]
    assert lora[0]["params"] == 4 * 16 + 16 * 4 and lora[1]["params"] == 2 * 16 + 16 * 2
    assert rows[-1]["path"] == "classifier" and rows[-1]["params"] == 16 * 3 + 3
    buf = io.StringIO()
    print_summary(model, Console(file=buf, width=160))
    text = buf.getvalue()
    trainable = 128 + 64 + 51
    assert f"trainable params: {trainable:,}" in text and "bert.encoder.layer.1" in text
