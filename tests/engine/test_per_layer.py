"""Per-layer updates (``optim.per_layer``): the same losses and weights as the ordinary step to
1e-6 in fp32 (full fine-tuning, AdamW with weight decay and the warm-up/decay schedule; GaLore
and SUMO), never more than one gradient held, and one-line refusals where it cannot be exact."""
from __future__ import annotations

import pytest
import torch

from rankwise import registry
from rankwise.engine import Engine, linear_schedule
from rankwise.tasks import CausalLMTask
from rankwise.errors import RankwiseError
from rankwise.recipes.config import load_run_config

VOCAB = 64


class Rows(list):
    pad_id = 0


def tiny_llama(seed: int = 0):
    """A 2-layer, 32-wide Llama, every weight trainable (full fine-tuning)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))


def data() -> Rows:
    g = torch.Generator().manual_seed(2)
    return Rows({"input_ids": torch.randint(1, VOCAB, (5 + i % 6,), generator=g).tolist()}
                for i in range(16))


def run(optim: dict, per_layer: bool, steps: int = 5, watch: list | None = None):
    """Losses and final weights of ``steps`` engine steps."""
    model = tiny_llama()
    cfg = registry.get("optimizer", optim["name"]).config_cls(**optim)
    opt = registry.get("optimizer", optim["name"]).builder(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    if watch is not None:  # how many gradients exist whenever one is complete
        for p in params:
            p.register_post_accumulate_grad_hook(
                lambda _: watch.append(sum(q.grad is not None for q in params)))
    eng = Engine(model, CausalLMTask(), opt, data(), batch_size=4, per_layer=per_layer,
                 scheduler=linear_schedule(opt, steps, 0.4))
    losses = [eng.train_step(k).loss for k in range(steps)]
    assert all(p.grad is None for p in params)
    return losses, [p.detach().clone() for p in params]


@pytest.mark.parametrize("optim", [
    {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1},
    {"name": "galore", "lr": 3e-3, "weight_decay": 0.1, "rank": 4, "update_every": 2},
    {"name": "galore-is", "lr": 3e-3, "weight_decay": 0.1, "rank": 4, "update_every": 2},
    {"name": "sumo", "lr": 3e-3, "rank": 4, "update_every": 2},
], ids=lambda o: o["name"])
def test_per_layer_steps_equal_the_ordinary_step(optim):
    watch: list[int] = []
    ref_losses, ref_weights = run(optim, per_layer=False)
    losses, weights = run(optim, per_layer=True, watch=watch)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    assert len(set(losses)) == len(losses)                   # it trains: the loss moves
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert max(watch) == 1                                   # one gradient at a time


def test_settings_it_cannot_follow_are_refused_in_one_line():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    for kwargs, word in [({"grad_accum": 2}, "grad_accum"), ({"grad_clip": 1.0}, "grad_clip"),
                         ({"precision": "fp16"}, "fp16")]:
        with pytest.raises(RankwiseError, match=word) as err:
            Engine(model, CausalLMTask(), opt, data(), batch_size=4, per_layer=True, **kwargs)
        assert "\n" not in str(err.value)


def test_the_config_turns_auto_clipping_off_and_refuses_the_rest():
    base = {"model": {"path": "tiny-llama", "task": "causal-lm"}, "method": {"name": "full"}}
    cfg = load_run_config(None, ["optim.per_layer=true"], base=base)
    assert cfg.optim.per_layer and cfg.train.grad_clip is None
    assert load_run_config(None, [], base=base).train.grad_clip == 1.0
    from rankwise.recipes.runs import config_hash  # recorded comparisons stay valid
    assert config_hash(base) == config_hash({**base, "optim": {"name": "adamw", "per_layer": False},
                                             "train": {"loss_chunk_tokens": "auto"}})
    assert config_hash(base) != config_hash({**base, "optim": {"name": "adamw", "per_layer": True}})
    for sets, word in [(["train.grad_accum=2"], "grad_accum"), (["train.grad_clip=0.5"], "grad_clip"),
                       (["optim.name=ngn-m"], "per-layer updates work with adamw")]:
        with pytest.raises(RankwiseError, match=word):
            load_run_config(None, ["optim.per_layer=true", *sets], base=base)
