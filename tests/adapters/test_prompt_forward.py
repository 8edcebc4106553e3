"""Prompt methods through the model's own forward (issue 18, item 18): after ``rankwise.apply``, a
plain ``model(input_ids=..., labels=...)`` (what HF ``Trainer`` and users' loops call) and
``model.generate`` carry the virtual tokens exactly as the engine does, once, and train them."""
from __future__ import annotations

import tempfile

import pytest
import torch

import rankwise
from rankwise.core.protocol import input_adapters, transform_inputs
from rankwise.engine import get_task
from rankwise.engine.generation import generate as rankwise_generate
from rankwise.engine.task import IGNORE
from rankwise.errors import RankwiseError
from rankwise.testing import TINY_MODELS, randomize_trainable, tiny_batch

METHODS = {  # small settings; top_k = num_experts so every PT-MoE expert gets a gradient
    "prompt-tuning": {"num_virtual_tokens": 3},
    "pt-moe": {"num_virtual_tokens": 3, "num_experts": 2, "rank": 2, "top_k": 2},
    "capt": {},
}
V = {"prompt-tuning": 3, "pt-moe": 3, "capt": 1}


def adapted(name: str, kind: str) -> torch.nn.Module:
    model = TINY_MODELS[kind]()
    rankwise.apply(model, name, **METHODS[name])
    randomize_trainable(model, std=0.5)      # CaPT's capsules start at zero: make them matter
    return model.eval()


def padded(kind: str) -> dict[str, torch.Tensor]:
    batch = tiny_batch(kind, seed=5)
    batch["attention_mask"][1, -3:] = 0
    if kind != "bert":
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
        batch["labels"][:, :3] = IGNORE   # a prompt without loss: what PT-MoE's router reads
    return batch


def prompt_params(model) -> dict[str, torch.nn.Parameter]:
    (layer,) = input_adapters(model)
    return layer.adapter_params("default")


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("name", list(METHODS))
def test_plain_forward_is_the_engine_forward_and_trains_the_prompt(name, kind):
    model = adapted(name, kind)
    task = get_task("classification" if kind == "bert" else "causal-lm")
    batch = padded(kind)
    with torch.no_grad():
        engine = task.mean_loss(model, batch)                      # transform_inputs, then model(...)
        prepared = model(**transform_inputs(model, batch))         # the engine's batch: prefixed once
    out = model(**batch)                                           # a plain call: the model's own hook
    assert abs(out.loss.item() - engine.item()) < 1e-6
    if kind != "bert":
        assert out.logits.shape[1] == prepared.logits.shape[1] == V[name] + 8
    torch.testing.assert_close(out.logits.detach(), prepared.logits, atol=0, rtol=0)
    out.loss.backward()
    grads = {k: p.grad for k, p in prompt_params(model).items()}
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads.values()), grads


def test_positional_input_ids_and_a_4bit_base():
    """``model(ids)`` (positional) is prefixed too, and on an NF4 base (bitsandbytes CPU path) a
    plain forward's backward reaches the prompt (it failed with 'does not require grad')."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from rankwise.recipes.model import bnb_config
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(cfg).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                     quantization_config=bnb_config("nf4", "bfloat16"))
    rankwise.apply(model, "prompt-tuning", num_virtual_tokens=4)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        engine = get_task("causal-lm").mean_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                         "labels": ids})
    out = model(ids, labels=ids)
    assert out.logits.shape[1] == 4 + 12
    assert abs(out.loss.item() - engine.item()) < 1e-6               # same kernels, same inputs
    out.loss.backward()
    (grad,) = [p.grad for p in prompt_params(model).values()]
    assert grad is not None and grad.dtype == torch.float32 and float(grad.abs().sum()) > 0


def by_hand(model, name: str, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding without a cache, the prefix made from the prompt alone (PT-MoE routes and
    CaPT pools over the prompt, as ``generate``'s first step does): tokens and logits (n, V)."""
    layer = model.get_input_embeddings()
    out: list[int] = []
    steps = []
    with torch.no_grad():
        if name == "capt":   # labels mark the generated tokens as targets: the capsule pools the prompt
            for _ in range(n):
                ids = torch.tensor([prompt + out])
                labels = torch.tensor([[IGNORE] * len(prompt) + out])
                steps.append(model(input_ids=ids, labels=labels).logits[0, -1])
                out.append(int(steps[-1].argmax()))
            return out, torch.stack(steps)
        first = torch.tensor([prompt])
        prefix = layer.prompts["default"](layer(first), torch.ones_like(first), None)  # (1, v, h)
        layer.set_active([])                                       # the prefix goes in by hand
        try:
            for _ in range(n):
                emb = torch.cat([prefix, layer(torch.tensor([prompt + out]))], 1)
                steps.append(model(inputs_embeds=emb).logits[0, -1])
                out.append(int(steps[-1].argmax()))
        finally:
            layer.set_active(["default"])
    return out, torch.stack(steps)


def greedy(model, ids, mask=None):
    """``model.generate``, greedy, 6 new tokens: ``(sequences, logits (B, 6, V))``."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             eos_token_id=64, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)   # 64: outside the vocabulary, never ends
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("name", list(METHODS))
def test_model_generate_carries_the_prefix(name, kind):
    model = adapted(name, kind)
    prompt, other = [5, 9, 12, 3, 7], [8, 2, 11]
    want, want_logits = by_hand(model, name, prompt, 6)
    seqs, logits = greedy(model, torch.tensor([prompt]))
    assert seqs[0, :5].tolist() == prompt and seqs[0, 5:].tolist() == want
    torch.testing.assert_close(logits[0], want_logits, atol=1e-5, rtol=0)
    _, base = greedy(TINY_MODELS[kind]().eval(), torch.tensor([prompt]))
    assert float((base[0] - want_logits).abs().max()) > 1e-3         # the prefix matters here
    # a left-padded batch: each row decodes as it does alone (positions count real tokens)
    seqs, logits = greedy(model, torch.tensor([prompt, [0, 0] + other]),
                          torch.tensor([[1] * 5, [0, 0, 1, 1, 1]]))
    alone, alone_logits = by_hand(model, name, other, 6)
    assert seqs[0, 5:].tolist() == want and seqs[1, 5:].tolist() == alone
    torch.testing.assert_close(logits[1], alone_logits, atol=1e-5, rtol=0)
    assert rankwise_generate(model, prompt, 6, eos_id=64, pad_id=0) == want   # rankwise generate: same path


def test_a_cached_step_that_already_counts_the_prefix_is_left_alone():
    """A user's own cached loop may pass a mask that already covers the virtual tokens."""
    model = adapted("prompt-tuning", "llama")
    ids = torch.tensor([[5, 9, 12, 3]])
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=True)
        nxt = first.logits[:, -1].argmax(-1, keepdim=True)
        short = model(input_ids=nxt, cache=first.cache, attention_mask=torch.ones(1, 5, dtype=torch.long))
        first = model(input_ids=ids, use_cache=True)
        full = model(input_ids=nxt, cache=first.cache, attention_mask=torch.ones(1, 3 + 5, dtype=torch.long))
        whole = model(input_ids=torch.cat([ids, nxt], 1)).logits[:, -1]
    torch.testing.assert_close(short.logits[:, -1], whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(full.logits[:, -1], whole, atol=1e-5, rtol=0)


def test_a_plain_forward_of_packed_positions_is_refused_in_one_line():
    model = adapted("prompt-tuning", "llama")
    batch = tiny_batch("llama")
    restart = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)           # two examples packed per row
    with pytest.raises(RankwiseError, match="data.packing: false"):
        model(**batch, position_ids=restart)
    shifted = model(**{k: v for k, v in batch.items() if k != "labels"}, position_ids=torch.arange(8)[None])
    plain = model(**{k: v for k, v in batch.items() if k != "labels"})
    torch.testing.assert_close(shifted.logits, plain.logits, atol=1e-6, rtol=0)  # arange: counted after v
