"""The causal-LM task's evaluation: token accuracy and exact match are what greedy decoding does."""
from __future__ import annotations

import torch

from rankwise.engine.loop import evaluate
from rankwise.engine.task import IGNORE
from rankwise.tasks.common import CausalLMTask
from rankwise.testing import tiny_llama64


class _Records(list):
    pad_id = 0


def _greedy_hits(model, prompt: list[int], target: list[int]) -> tuple[int, bool]:
    """Target tokens that greedy decoding from ``prompt`` gets right while it still follows the
    target, and whether it reproduces the whole target (transformers' own ``generate``)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=len(target), do_sample=False,
                         pad_token_id=0)[0, len(prompt):].tolist()
    exact = out == target
    # teacher forcing: the argmax after each target prefix
    ids = torch.tensor([prompt + target])
    with torch.no_grad():
        pred = model(input_ids=ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    return sum(p == t for p, t in zip(pred, target)), exact


def test_exact_match_is_greedy_decoding_reproducing_the_target():
    """Six prompt → completion records, two of them completions the model itself would write
    greedily: eval_exact_match counts exactly those (2 / 6), and eval_token_accuracy is the
    share of target tokens that are the argmax after the true prefix (computed by hand)."""
    model = tiny_llama64(seed=3).eval()
    g = torch.Generator().manual_seed(0)
    records, hits, exact, targets = _Records(), 0, 0, 0
    for i in range(6):
        prompt = torch.randint(1, 128, (5,), generator=g).tolist()
        if i < 2:   # the model's own greedy continuation: an exact match by construction
            target = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                                    pad_token_id=0)[0, 5:].tolist()
        else:
            target = torch.randint(1, 128, (3 + i % 2,), generator=g).tolist()
        h, e = _greedy_hits(model, prompt, target)
        hits, exact, targets = hits + h, exact + e, targets + len(target)
        records.append({"input_ids": prompt + target, "labels": [IGNORE] * len(prompt) + target})
    got = evaluate(model, CausalLMTask(), records, batch_size=4)
    assert exact == 2
    assert got["eval_exact_match"] == exact / 6
    assert got["eval_token_accuracy"] == hits / targets
    assert 0 < got["eval_token_accuracy"] < 1
