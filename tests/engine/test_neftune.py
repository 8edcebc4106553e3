"""NEFTune (``train.neftune_noise_alpha``): on a batch without padding the noised embeddings are
transformers' ``neftune_post_forward_hook``'s with the same seed (1e-6); with padding each row's
noise is bounded by alpha / sqrt(L_i d) with L_i its real tokens (and reaches 97 % of it) and is 0
on padding; evaluation, no-grad forwards and generation see the clean embeddings; the recipe
attaches it from the config."""
from __future__ import annotations

import math

import pytest
import torch

from rankwise.engine.neftune import add_neftune
from rankwise.errors import RankwiseError
from rankwise.testing import VOCAB, tiny_llama_lm

ALPHA = 5.0


def noised_embeddings(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, as-the-model-saw-it) input embeddings of one forward of ``model`` on ``batch``."""
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(out))
    model(**batch)
    handle.remove()
    with torch.no_grad():
        clean = model.get_input_embeddings()(batch["input_ids"])
    return clean, seen[0].detach()


def test_without_padding_equals_transformers_hook_with_the_same_seed():
    from transformers.integrations.neftune import neftune_post_forward_hook
    model = tiny_llama_lm().train()
    add_neftune(model, ALPHA)
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(11)
    clean, ours = noised_embeddings(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    emb = model.get_input_embeddings()
    emb.neftune_noise_alpha = ALPHA
    torch.manual_seed(11)
    theirs = neftune_post_forward_hook(emb, None, clean)
    assert (ours - clean).abs().max() > 0
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_with_padding_each_row_is_scaled_by_its_own_length_and_padding_stays_clean():
    model = tiny_llama_lm().train()
    add_neftune(model, ALPHA)
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0                                                  # row 1: 10 real tokens
    clean, seen = noised_embeddings(model, {"input_ids": ids, "attention_mask": mask})
    noise, d = seen - clean, clean.shape[-1]
    assert torch.equal(noise[1, 10:], torch.zeros_like(noise[1, 10:]))
    for row, length in ((0, 40), (1, 10)):
        bound = ALPHA / math.sqrt(length * d)
        peak = noise[row, :length].abs().max().item()
        assert 0.97 * bound < peak <= bound * (1 + 1e-6)


def test_eval_no_grad_and_generation_see_clean_embeddings():
    model = tiny_llama_lm().train()
    plain = tiny_llama_lm().train()
    add_neftune(model, ALPHA)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():                                             # a reference / rollout forward
        clean, seen = noised_embeddings(model, batch)
    assert torch.equal(clean, seen)
    model.eval()
    clean, seen = noised_embeddings(model, batch)                     # evaluation
    assert torch.equal(clean, seen)
    model.train()
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(**batch, **kw), plain.generate(**batch, **kw))


def test_the_train_config_checks_alpha_and_prepare_attaches_it(tmp_path):
    from rankwise.configs import from_dict
    from rankwise.recipes.config import TrainConfig, load_run_config
    from rankwise.recipes.session import prepare
    with pytest.raises(RankwiseError, match="neftune_noise_alpha: got 0"):
        from_dict(TrainConfig, {"neftune_noise_alpha": 0}, "train")
    cfg = load_run_config(None, base={
        "model": {"path": "tiny-llama", "task": "causal-lm"}, "data": {"max_length": 16, "limit": 8},
        "method": {"name": "lora", "r": 2, "targets": ["q_proj"]},
        "train": {"steps": 1, "batch_size": 2, "progress": False, "neftune_noise_alpha": ALPHA}})
    session = prepare(cfg, device="cpu")
    emb = session.model.get_input_embeddings()
    hooks = [h for h in emb._forward_hooks.values() if getattr(h, "__name__", "") == "noise"]
    assert len(hooks) == 1 and hooks[0].__self__.alpha == ALPHA
