"""Evaluation of a causal LM forwards row slices of each batch whose float32 logits fit a
budget (issue 18 item 17): the same ``eval_loss`` as whole batches and as a per-example
formula, and a peak that follows the budget instead of ``eval batch x seq x vocab``."""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from rankwise.engine import evaluate
from rankwise.engine.task import IGNORE
from rankwise.tasks import CausalLMTask
from rankwise.memory import PeakMemory


class Examples:
    """Variable-length prompt-completion examples: the first 3 tokens carry no loss."""

    def __init__(self, n: int, vocab: int, longest: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(6, longest + 1, (1,), generator=g))
            ids = torch.randint(1, vocab, (length,), generator=g).tolist()
            self.items.append({"input_ids": ids, "labels": [IGNORE] * 3 + ids[3:]})
        self.pad_id = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=64, pad_token_id=0)).eval()


def per_example_loss(model, data: Examples) -> float:
    """The formula: every example alone, unpadded; summed cross-entropy over summed targets."""
    total, count = 0.0, 0
    with torch.no_grad():
        for it in data.items:
            logits = model(input_ids=torch.tensor([it["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(it["labels"][1:])
            total += float(F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum"))
            count += int((labels != IGNORE).sum())
    return total / count


def test_sliced_evaluation_gives_the_same_loss():
    model, data = llama(64), Examples(21, 64, 24)
    whole = CausalLMTask()
    small = CausalLMTask()
    small.eval_logits_bytes = 3 * 24 * 64 * 4                  # 3 rows of the widest batch
    forwards = []
    hook = model.register_forward_hook(lambda m, a, kw: forwards.append(1))
    got = evaluate(model, small, data, batch_size=8)
    sliced = len(forwards)
    want = evaluate(model, whole, data, batch_size=8)
    hook.remove()
    assert len(forwards) - sliced == 3                          # 21 examples: batches of 8, 8, 5
    assert sliced >= 8                                          # ...each cut into slices of <= 3 rows
    assert abs(got["eval_loss"] - want["eval_loss"]) <= 1e-6
    assert abs(got["eval_loss"] - per_example_loss(model, data)) <= 1e-5
    assert math.isclose(got["eval_perplexity"], math.exp(got["eval_loss"]))
    one = CausalLMTask()
    one.eval_logits_bytes = 1                                   # never fewer than one row
    assert abs(evaluate(model, one, data, batch_size=8)["eval_loss"] - want["eval_loss"]) <= 1e-6


def test_peak_follows_the_budget_not_the_batch():
    model, data = llama(8192), Examples(32, 8192, 32)
    width = max(len(it["input_ids"]) for it in data.items)
    whole = CausalLMTask()
    whole.eval_logits_bytes = 2**40
    small = CausalLMTask()
    small.eval_logits_bytes = 2 * width * 8192 * 4               # 2 rows: 2 MiB of logits
    peaks = {}
    for name, task in (("whole", whole), ("small", small)):
        with PeakMemory("cpu") as mem:
            peaks[name] = (evaluate(model, task, data, batch_size=32)["eval_loss"], mem)
    logits = 32 * width * 8192 * 4                              # one batch's float32 logits
    assert peaks["whole"][1].peak_bytes >= logits               # whole batches hold them all
    assert peaks["small"][1].peak_bytes <= 4 * small.eval_logits_bytes + 2**20
    # measured here: 94.2 MiB whole (the logits and two copies for the loss), 5.9 MiB sliced
    assert peaks["small"][1].peak_bytes <= peaks["whole"][1].peak_bytes / 10
    assert abs(peaks["small"][0] - peaks["whole"][0]) <= 1e-6
