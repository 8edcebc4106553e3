"""What the pair tasks' tests share (``dpo``, ``orpo``, ``simpo``, ``reward``, the chunked
log-probs, the benchmarks' checks): random token pairs, the word-level tokenizer TRL's trainers
want, a tiny LoRA Llama and the TRL trainer over a PEFT LoRA of the same base with equal
factors, TRL's pair-batch keys, real-text pair records, completion log-probs and the NLL by
hand, and the gradient comparisons."""
from __future__ import annotations

import copy

import pytest
import torch

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig as RwLoraConfig
from rankwise.core.protocol import adapter_modules, factors
from rankwise.data.instruct import load_function_records
from rankwise.testing import VOCAB, same_factors, tiny_llama_lm

TARGETS = ["q_proj", "v_proj", "down_proj"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} [SEP] {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")  # a template of plain words
MARGINS = [0.0, 1.5, -0.5, 3.0]  # the reward pairs' margins, in turn


def pairs(seed: int = 3, n: int = 4, longest: int = 6, margins: bool = False) -> list[dict]:
    """Random token pairs (no pad id inside): a shared prompt of 2-5 tokens (no target) and
    completions of 1-``longest`` tokens, drawn apart for the two sides (so padding and per-token
    means matter); with ``margins``, pair ``i`` has ``margin`` ``MARGINS[i % 4]``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        c, r = (torch.randint(1, VOCAB, (int(torch.randint(1, longest + 1, (1,), generator=g)),),
                              generator=g).tolist() for _ in range(2))
        pair = {"chosen_ids": prompt + c, "chosen_labels": [-100] * len(prompt) + c,
                "rejected_ids": prompt + r, "rejected_labels": [-100] * len(prompt) + r}
        if margins:
            pair["margin"] = MARGINS[i % 4]
        out.append(pair)
    return out


def pair_records(n: int = 24) -> list[dict]:
    """Real-text pair records: a docstring -> its function's ``def`` line (chosen) or the next
    function's (rejected)."""
    recs = load_function_records()[:n + 1]
    return [{"prompt": " ".join(a["prompt"].split()[:12]) + "\n", "chosen": a["completion"],
             "rejected": b["completion"]} for a, b in zip(recs, recs[1:])]


def tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary (TRL's trainers want one)."""
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel(
        {f"t{i}": i for i in range(VOCAB)}, unk_token="t1")), pad_token="t0", eos_token="t0")


def lora_model(seed: int = 2):
    """Tiny Llama with LoRA r=4 on :data:`TARGETS`, its B factors drawn (std 0.3, ``seed``), in
    train mode."""
    model = tiny_llama_lm(seed=0)
    registry.get("method", "lora").apply(model, RwLoraConfig(r=4, alpha=8.0, targets=TARGETS))
    for _, mod in adapter_modules(model):
        torch.nn.init.normal_(factors(mod, "default")[1], std=0.3, generator=torch.Generator().manual_seed(seed))
    return model.train()


def lora_and_trainer(make_trainer):
    """(rankwise LoRA model, TRL trainer over a PEFT LoRA) of one tiny Llama with equal, non-zero
    adapters (r = 4, alpha 8 on q/v/down). ``make_trainer(base, peft_config, dataset, tokenizer)``
    builds the trainer (a one-pair dataset; TRL gets the base and a ``peft_config``: a PEFT model
    handed to it would have its adapter copied as the reference); the factors are set after it
    built the adapter."""
    peft = pytest.importorskip("peft")
    from datasets import Dataset
    base = tiny_llama_lm(seed=0)
    ours = copy.deepcopy(base)
    registry.get("method", "lora").apply(ours, RwLoraConfig(r=4, alpha=8.0, targets=TARGETS))
    data = Dataset.from_dict({"prompt": ["t2 t3"], "chosen": [" t4"], "rejected": [" t5"]})
    trainer = make_trainer(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                                lora_dropout=0.0), data, tokenizer())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, mod in adapter_modules(ours):  # non-zero B, so the adapters matter
            for w in factors(mod, "default"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    same_factors(ours, trainer.model)
    return ours.train(), trainer


def trl_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our collated pair batch (chosen rows, then rejected) under the keys of TRL's
    ``DPODataCollatorWithPadding`` that ``ORPOTrainer`` / ``CPOTrainer`` read."""
    b = batch["input_ids"].shape[0] // 2
    out = {}
    for side, rows in (("chosen", slice(0, b)), ("rejected", slice(b, None))):
        for key in ("input_ids", "attention_mask", "labels"):
            out[f"{side}_{key}"] = batch[key][rows]
    return out


def first_batch_with_trl(task, make_trainer) -> tuple:
    """One first batch of :func:`pairs` through ``task`` on the rankwise LoRA and through the TRL
    trainer ``make_trainer`` builds (:func:`lora_and_trainer`; ``ORPOTrainer`` / ``CPOTrainer``:
    ``get_batch_loss_metrics`` on :func:`trl_batch`), both losses backpropagated.

    Returns:
        ``(ours, trainer, our mean loss per pair, TRL's loss, TRL's logged metrics)``.
    """
    ours, trainer = lora_and_trainer(make_trainer)
    batch = task.collate(pairs(), pad_id=0)
    total, _ = task.loss_sum(ours, batch)
    mine = total / task.count_targets(batch)
    mine.backward()
    trainer.model.train()
    ref, logged = trainer.get_batch_loss_metrics(trainer.model, trl_batch(batch))
    ref.backward()
    return ours, trainer, mine, ref, logged


def assert_same_peer_grads(ours, peer, atol: float = 1e-5) -> int:
    """Every LoRA factor's gradient of ``ours`` equals the PEFT ``peer``'s (``atol``); returns
    how many were compared."""
    named = dict(peer.named_modules())
    n = 0
    for path, mod in adapter_modules(ours):
        a, b = factors(mod, "default")
        layer = named["base_model.model." + path]
        for mine, theirs in ((a, layer.lora_A["default"].weight), (b, layer.lora_B["default"].weight)):
            assert mine.grad is not None and float(mine.grad.abs().sum()) > 0, path
            assert torch.allclose(mine.grad, theirs.grad, atol=atol, rtol=0), \
                (path, float((mine.grad - theirs.grad).abs().max()))
            n += 1
    return n


def completion_by_hand(model, item, side: str) -> tuple[float, int]:
    """``(summed log-prob, tokens)`` of one completion, token by token from ``log_softmax``."""
    ids, labels = item[f"{side}_ids"], item[f"{side}_labels"]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    picked = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if labels[t] != -100]
    return sum(picked), len(picked)


def nll_by_hand(model, items, on_prompt: bool) -> float:
    """The chosen rows' NLL, the mean over their target tokens (every token after the first
    with ``on_prompt``, else the completion's), summed token by token from ``log_softmax``."""
    total, n = 0.0, 0
    with torch.no_grad():
        for it in items:
            ids = torch.tensor([it["chosen_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            for t in range(1, len(it["chosen_ids"])):
                if on_prompt or it["chosen_labels"][t] != -100:
                    total -= float(logp[t - 1, it["chosen_ids"][t]])
                    n += 1
    return total / n


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every trainable parameter's gradient, by name."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def assert_same_grads(got: dict, ref: dict) -> None:
    """Two :func:`grads` of the same parameters agree to 1e-5 (and the reference's is not zero)."""
    assert got.keys() == ref.keys() and len(ref) > 0
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-5, msg=name)
    assert sum(float(g.abs().sum()) for g in ref.values()) > 0
