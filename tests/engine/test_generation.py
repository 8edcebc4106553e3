"""The one decode loop (``engine/generation.py``): with no hook it is ``transformers``' ``generate``
token for token (greedy, and sampled under one seed, also for left-padded groups and virtual
tokens); the one sampler's top-p and top-k keep hand-computed sets; a hook's logits are what
is sampled; a cache object handed in is the one the model grows."""
from __future__ import annotations

import pytest
import torch

import rankwise
from rankwise.engine.generation import (Step, decode, filter_top_k, filter_top_p, generate,
                                        sample, sample_groups)
from rankwise.testing import tiny_gpt2_lm, tiny_llama_lm

PROMPT = [5, 9, 12, 3, 7]
NEVER = 999  # an EOS id the tiny models cannot produce (vocabulary 64)


def hf(model, ids, mask, n, eos, temperature=0.0, top_p=1.0, top_k=0, num=1):
    """``model.generate``'s new tokens: the reference."""
    kw = dict(max_new_tokens=n, eos_token_id=eos, pad_token_id=0, use_cache=True)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                  num_return_sequences=num)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **kw)[:, ids.shape[1]:]


@pytest.fixture(scope="module", params=["llama", "gpt2", "llama+prompt-tuning"])
def model(request):
    built = (tiny_gpt2_lm if request.param == "gpt2" else tiny_llama_lm)().eval()
    if request.param.endswith("prompt-tuning"):
        rankwise.apply(built, "prompt-tuning", num_virtual_tokens=3)
    return built


def test_no_hook_is_transformers_generate_token_for_token(model):
    ids = torch.tensor([PROMPT])
    want = hf(model, ids, torch.ones_like(ids), 10, NEVER)
    got = decode(model, ids, max_new_tokens=10, eos_id=NEVER, pad_id=0)
    assert got.shape == (1, 10) and torch.equal(got, want)
    assert generate(model, PROMPT, 10, NEVER, 0) == want[0].tolist()
    # without a cache (every step re-runs the sequence): the same tokens
    assert torch.equal(decode(model, ids, max_new_tokens=10, eos_id=NEVER, use_cache=False), want)
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.8, 5)):
        torch.manual_seed(3)
        want = hf(model, ids, torch.ones_like(ids), 10, NEVER, temperature, top_p, top_k)
        torch.manual_seed(3)
        got = decode(model, ids, max_new_tokens=10, eos_id=NEVER, pad_id=0,
                     temperature=temperature, top_p=top_p, top_k=top_k)
        assert torch.equal(got, want), (temperature, top_p, top_k)


def test_left_padded_groups_are_transformers_generate(model):
    """GRPO's groups: 3 prompts of 1-5 tokens, 3 samples each, an EOS the model does reach."""
    prompts = [[5, 9, 12], [3, 7, 1, 2, 8], [4]]
    eos = generate(model, PROMPT, 4, NEVER, 0)[3]
    ids, mask = torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, 5, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 5 - len(p):], mask[row, 5 - len(p):] = torch.tensor(p), 1
    torch.manual_seed(5)
    want = []
    for row in hf(model, ids, mask, 8, eos, 1.0, 0.95, num=3).tolist():
        want.append(row[: row.index(eos) + 1] if eos in row else row)
    torch.manual_seed(5)
    assert sample_groups(model, prompts, 3, 8, eos, 0, 1.0, 0.95) == want
    assert torch.equal(decode(model, ids, mask, max_new_tokens=8, eos_id=eos, pad_id=0),
                       hf(model, ids, mask, 8, eos))


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled order)
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    kept = lambda p: torch.isfinite(filter_top_p(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.4) == [False, True, False, False]      # 0.5 >= 0.4
    assert kept(0.75) == [False, True, False, True]      # 0.5 < 0.75 <= 0.8
    assert kept(0.9) == [True, True, False, True]        # 0.8 < 0.9 <= 0.95
    assert kept(0.99) == [True, True, True, True]
    assert kept(1e-6) == [False, True, False, False]     # the top token always stays
    # the kept tokens' renormalised probabilities are what is sampled
    probs = torch.softmax(filter_top_p(logits, 0.75), -1)[0]
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=1e-6, rtol=0)
    torch.manual_seed(0)
    draws = torch.stack([sample(logits.expand(4000, 4), 1.0, top_p=0.75) for _ in range(5)])
    share = (draws == 1).float().mean().item()
    assert set(draws.unique().tolist()) == {1, 3} and abs(share - 0.625) < 0.01


def test_top_k_temperature_and_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, -1.0]])
    assert torch.isfinite(filter_top_k(logits, 2))[0].tolist() == [False, True, True, True, False]  # ties kept
    assert torch.equal(filter_top_k(logits, 0), logits)
    assert sample(logits).tolist() == [1]                                 # temperature 0: argmax
    torch.manual_seed(0)
    draws = sample(logits.expand(20000, 5), temperature=2.0, top_k=1)
    assert draws.unique().tolist() == [1]
    draws = sample(logits.expand(20000, 5), temperature=2.0)
    want = torch.softmax(logits[0] / 2.0, -1)
    got = torch.bincount(draws, minlength=5).float() / len(draws)
    assert float((got - want).abs().max()) < 0.015


def test_a_hook_sees_the_sequence_and_its_logits_are_sampled(model):
    seen: list[tuple[list[int], int]] = []

    def ban_argmax(step: Step, logits: torch.Tensor) -> torch.Tensor:
        seen.append((step.ids[0].tolist(), step.index))
        assert logits.dtype == torch.float32 and logits.shape == (1, 64)
        return logits.scatter(1, logits.argmax(-1, keepdim=True), float("-inf"))
    got = generate(model, PROMPT, 4, NEVER, 0, hooks=[ban_argmax])
    with torch.no_grad():  # the reference: the second most likely token, uncached
        ref: list[int] = []
        for _ in range(4):
            z = model(input_ids=torch.tensor([PROMPT + ref])).logits[0, -1]
            ref.append(int(z.topk(2).indices[1]))
    assert got == ref
    assert seen == [(PROMPT + ref[:k], k) for k in range(4)]


def test_a_cache_object_handed_in_is_the_cache_decoded_with():
    from rankwise.compress.kv import find_rotary, make_cache
    model = tiny_llama_lm().eval()
    ids = torch.tensor([PROMPT])
    fp = make_cache("fp", config=model.config)
    assert torch.equal(decode(model, ids, max_new_tokens=6, eos_id=NEVER, cache=fp),
                       decode(model, ids, max_new_tokens=6, eos_id=NEVER))
    assert fp.get_seq_length() == len(PROMPT) + 5          # the last token is never fed back
    q = make_cache("kivi", 2, chunk=4, rotary=find_rotary(model))
    decode(model, ids, max_new_tokens=6, eos_id=NEVER, cache=q)
    assert q.get_seq_length() == len(PROMPT) + 5 and q.layers[0].quantized_tokens == 8


def test_streaming_pieces_add_up_and_training_mode_is_restored():
    model = tiny_llama_lm().train()
    pieces: list[str] = []
    text = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    out = generate(model, PROMPT, 5, NEVER, 0, decode=text, on_text=pieces.append)
    assert len(pieces) == 5 and "".join(pieces) == text(out) and model.training
