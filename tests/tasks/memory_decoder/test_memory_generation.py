"""The Memory Decoder's mixture as a logits hook of the one decode loop: at every step of a
decode the hook's distribution is ``λ·p_mem + (1 − λ)·p_base`` of uncached forwards (1e-6), for
one prompt and for a left-padded batch; λ = 0 is the base's own decode. (No faiss needed.)"""
from __future__ import annotations

import pytest
import torch

from rankwise.engine.generation import Step, decode, generate
from rankwise.tasks.memory_decoder.generation import MemoryMixture
from rankwise.testing import tiny_llama64

PROMPT = [3, 17, 5, 9, 22]


def models():
    return tiny_llama64(vocab_size=48, seed=4).eval(), tiny_llama64(vocab_size=48, seed=5).eval()


class Recorder:
    """A hook after the mixture: keeps each step's sequence and mixed log-probabilities."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, step: Step, logits: torch.Tensor) -> torch.Tensor:
        self.steps.append((step.ids.clone(), step.mask.clone(), logits.clone()))
        return logits


def reference(base, mem, ids, mask, lam):
    """(1 − λ) softmax(z_base) + λ softmax(z_mem) at the last position, uncached, in float64."""
    with torch.no_grad():
        kw = {"input_ids": ids, "attention_mask": mask,
              "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
        pb = torch.softmax(base(**kw).logits[:, -1].double(), -1)
        pm = torch.softmax(mem(**kw).logits[:, -1].double(), -1)
    return (1 - lam) * pb + lam * pm                                               # (B, V)


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.9, 1.0])
def test_hook_probabilities_are_the_lambda_mixture(lam):
    base, mem = models()
    seen = Recorder()
    out = generate(base, PROMPT, 8, eos_id=-1, pad_id=0, hooks=[MemoryMixture(mem, lam), seen])
    assert len(out) == len(seen.steps) == 8
    for ids, mask, logp in seen.steps:
        got = torch.softmax(logp.double(), -1)
        assert float((got - reference(base, mem, ids, mask, lam)).abs().max()) < 1e-6
    if lam == 0.0:
        assert out == generate(base, PROMPT, 8, eos_id=-1, pad_id=0)


def test_left_padded_batch_mixes_each_row():
    base, mem = models()
    ids = torch.tensor([[0, 0, 3, 17, 5], [9, 22, 4, 8, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    seen = Recorder()
    decode(base, ids, mask, max_new_tokens=5, eos_id=-1, pad_id=0, hooks=[MemoryMixture(mem, 0.4), seen])
    assert len(seen.steps) == 5
    for ids_t, mask_t, logp in seen.steps:
        got = torch.softmax(logp.double(), -1)
        assert float((got - reference(base, mem, ids_t, mask_t, 0.4)).abs().max()) < 1e-6
