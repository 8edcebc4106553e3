"""A loaded adapter that does nothing is an error (``load_adapter`` / ``load_peft`` probe one
batch with and without it); an adapter that is expected to change nothing (B = 0, an untrained
PiSSA pair) loads without a word."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise
from rankwise.core.probe import check_effect, probe_batch
from rankwise.core.protocol import adapter_modules
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_llama_lm


class Bypass(nn.Module):
    """A model whose forward reads ``proj``'s weight itself (as fused or re-implemented forwards
    do), so a LoRA wrapped around ``proj`` never runs; ``called`` runs ``proj`` and drops it."""

    def __init__(self, called: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.proj, self.called = nn.Embedding(16, 8), nn.Linear(8, 8), called
        self.weight = self.proj.weight  # the reference the forward uses

    def get_input_embeddings(self) -> nn.Embedding:
        return self.emb

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)  # (B, T, C)
        if self.called:
            self.proj(h)  # runs the adapted layer, output unused
        return F.linear(h, self.weight)


def _saved(model: nn.Module, tmp_path, init: str = "kaiming", randomize: bool = True):
    cfg = rankwise.apply(model, "lora", r=2, targets=["proj"] if isinstance(model, Bypass) else ["q_proj"],
                         init=init)
    if randomize:
        randomize_trainable(model)
    return rankwise.save_adapter(model, tmp_path / "a", cfg)


def test_a_trained_adapter_loads_and_changes_the_output(tmp_path):
    folder = _saved(tiny_llama_lm(), tmp_path)
    model = tiny_llama_lm()
    rankwise.load_adapter(model, folder)
    batch = probe_batch(model)
    assert batch["input_ids"].shape == (1, 8)
    with torch.no_grad(), rankwise.disable_adapters(model):
        off = model(**batch).logits
    assert (model(**batch).logits - off).abs().max() > 1e-3


@pytest.mark.parametrize("init,randomize", [("kaiming", False), ("pissa", False)])
def test_an_adapter_expected_to_change_nothing_loads(tmp_path, init, randomize):
    folder = _saved(tiny_llama_lm(), tmp_path, init, randomize)
    rankwise.load_adapter(tiny_llama_lm(), folder)  # B = 0, or B A = B0 A0: nothing to see


@pytest.mark.parametrize("called,match", [(False, "never calls its layers"),
                                          (True, "identical with and without it, though 'proj'")])
def test_an_adapter_the_forward_does_not_use_is_refused(tmp_path, called, match):
    folder = _saved(Bypass(called), tmp_path)
    with pytest.raises(RankwiseError, match=f"loaded but does nothing: .*{match}"):
        rankwise.load_adapter(Bypass(called), folder)
    rankwise.load_adapter(Bypass(called), folder, check=False)  # the check can be skipped


def test_load_peft_refuses_a_no_op_too(tmp_path):
    model = Bypass()
    rankwise.apply(model, "lora", r=2, targets=["proj"])
    randomize_trainable(model)
    folder = rankwise.export_peft(model, tmp_path / "p")
    with pytest.raises(RankwiseError, match="never calls its layers"):
        rankwise.load_peft(Bypass(), folder)


def test_the_probe_keeps_active_adapters_and_the_mode(tmp_path):
    model = tiny_llama_lm()
    rankwise.apply(model, "lora", r=2, targets=["q_proj"], adapter_name="one")
    rankwise.apply(model, "lora", r=2, targets=["q_proj"], adapter_name="two")
    randomize_trainable(model)
    rankwise.set_adapter(model, "one")
    model.train()
    check_effect(model, "two")  # probes "two" alone although "one" is the active adapter
    active = {tuple(m.active_names()) for _, m in adapter_modules(model)}
    assert active == {("one",)} and model.training
