"""LoRA+ (``optim.loraplus_lr_ratio``): the same param groups and rates as PEFT's
``create_loraplus_optimizer`` (B and 1-D tensors at lr x ratio, A at lr, pairs on embeddings at
the embedding rate), the same trajectory as PEFT's LoRA+ over three steps (1e-6), AdamW with
those groups by hand, and one-line refusals (no pairs; another optimizer)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig
from rankwise.configs import from_dict
from rankwise.core.protocol import NamedAdapters, adapter_modules, factors
from rankwise.errors import RankwiseError
from rankwise.optim.adamw import AdamWConfig, build_adamw
from rankwise.testing import same_factors, tiny_batch, tiny_llama_lm

TARGETS = ["q_proj", "v_proj", "down_proj"]
LR, RATIO = 1e-2, 16.0


def ours_and_peft(use_dora: bool = False):
    """(rankwise LoRA, PEFT LoRA) of one base with the same non-zero factors."""
    peft = pytest.importorskip("peft")
    base = tiny_llama_lm(seed=0)
    ours = copy.deepcopy(base)
    registry.get("method", "lora").apply(ours, LoraConfig(r=4, alpha=8.0, targets=TARGETS, use_dora=use_dora))
    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, use_dora=use_dora))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, mod in adapter_modules(ours):
            for w in factors(mod, "default"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    same_factors(ours, theirs)
    return ours, theirs


def rates(opt: torch.optim.Optimizer) -> dict[int, float]:
    return {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}


def test_groups_and_rates_equal_peft_create_loraplus_optimizer_with_dora():
    from peft.optimizers import create_loraplus_optimizer
    ours, theirs = ours_and_peft(use_dora=True)
    mine = build_adamw(ours, AdamWConfig(lr=LR, loraplus_lr_ratio=RATIO))
    peer = create_loraplus_optimizer(theirs, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=RATIO)
    peer_rates = rates(peer)
    by_name = {n.removeprefix("base_model.model.").removesuffix("lora_magnitude_vector.default.weight")
               + ("lora_magnitude_vector.default" if n.endswith("magnitude_vector.default.weight") else ""):
               peer_rates[id(p)] for n, p in theirs.named_parameters() if p.requires_grad}
    got = {n: rates(mine)[id(p)] for n, p in ours.named_parameters() if p.requires_grad}
    assert got == by_name                                     # every tensor, same rate
    assert set(got.values()) == {LR, LR * RATIO}              # A at lr; B and DoRA's m at lr x 16
    assert [g["lr"] for g in mine.param_groups] == [LR, LR * RATIO]  # lr group first: the logged lr


def test_three_steps_follow_peft_loraplus_and_adamw_with_the_groups_by_hand():
    from peft.optimizers import create_loraplus_optimizer
    ours, theirs = ours_and_peft()
    by_hand, plain = copy.deepcopy(ours), copy.deepcopy(ours)
    mine = build_adamw(ours, AdamWConfig(lr=LR, loraplus_lr_ratio=RATIO))
    peer = create_loraplus_optimizer(theirs, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=RATIO)
    pairs = [factors(m, "default") for _, m in adapter_modules(by_hand)]
    hand = torch.optim.AdamW([{"params": [a for a, _ in pairs], "lr": LR},
                              {"params": [b for _, b in pairs], "lr": LR * RATIO}], weight_decay=0.0)
    one_rate = build_adamw(plain, AdamWConfig(lr=LR))
    for step in range(3):
        batch = tiny_batch("llama", seed=step)
        for model, opt in ((ours, mine), (theirs, peer), (by_hand, hand), (plain, one_rate)):
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
    batch = tiny_batch("llama", seed=9)
    with torch.no_grad():
        logits = [m(**batch).logits for m in (ours, theirs, by_hand, plain)]
    named = dict(theirs.named_modules())
    for path, mod in adapter_modules(ours):
        a, b = factors(mod, "default")
        layer = named["base_model.model." + path]
        torch.testing.assert_close(a, layer.lora_A["default"].weight, atol=1e-6, rtol=0)
        torch.testing.assert_close(b, layer.lora_B["default"].weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[0], logits[2], atol=0, rtol=0)   # the same groups: bit for bit
    assert (logits[0] - logits[3]).abs().max() > 1e-3                     # one rate for all differs


class EmbeddingPair(NamedAdapters, nn.Module):
    """A LoRA-shaped adapter on an embedding (what PEFT's ``lora.Embedding`` is): ``factors``."""

    adapters_attr = "a"

    def __init__(self, base: nn.Embedding, r: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        self.a = nn.ParameterDict({"default": nn.Parameter(torch.zeros(r, base.num_embeddings))})
        self.b = nn.ParameterDict({"default": nn.Parameter(torch.zeros(base.embedding_dim, r))})
        self._active = ["default"]

    def forward(self, ids):
        return self.base_layer(ids) + (self.a["default"].T[ids] @ self.b["default"].T)

    def adapter_params(self, name):
        return {"a": self.a[name], "b": self.b[name]}

    def factors(self, name):
        return self.a[name], self.b[name]

    def merge(self, name): ...

    def unmerge(self): ...

    def delete(self, name): ...


def test_pairs_on_an_embedding_take_the_embedding_rate():
    model = tiny_llama_lm(seed=0)
    registry.get("method", "lora").apply(model, LoraConfig(r=4, targets=["q_proj"]))
    emb = model.model.embed_tokens
    model.model.embed_tokens = wrapped = EmbeddingPair(emb)
    opt = build_adamw(model, AdamWConfig(lr=LR, loraplus_lr_ratio=RATIO, loraplus_lr_embedding=1e-6))
    r = rates(opt)
    assert r[id(wrapped.a["default"])] == r[id(wrapped.b["default"])] == 1e-6
    assert [g["lr"] for g in opt.param_groups] == [LR, 1e-6, LR * RATIO]


def test_refusals_name_the_fix():
    full = tiny_llama_lm(seed=0)  # no adapter: nothing has a B factor
    with pytest.raises(RankwiseError, match="trains none; use a method with LoRA-shaped layers"):
        build_adamw(full, AdamWConfig(loraplus_lr_ratio=RATIO))
    with pytest.raises(RankwiseError, match="option of optim.name: adamw"):
        from_dict(registry.get("optimizer", "galore").config_cls,
                  {"name": "galore", "loraplus_lr_ratio": 16}, "optim")
    with pytest.raises(RankwiseError, match=r"^optim.loraplus_lr_ratio: got 0.0; expected eta_B / eta_A > 0 "
                                            r"or null \(the paper uses 16; null: plain AdamW\)$"):
        from_dict(AdamWConfig, {"loraplus_lr_ratio": 0}, "optim")
    with pytest.raises(RankwiseError, match=r"^optim.loraplus_lr_embedding: got -1.0; expected a learning rate >= 0$"):
        from_dict(AdamWConfig, {"loraplus_lr_embedding": -1}, "optim")
