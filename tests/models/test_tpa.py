"""Tensor Product Attention (``rankwise.models.tpa``): the paper's defining properties.

MHA, GQA and MQA are non-contextual TPA (paper §4): with ``A`` fixed to scaled indicator
vectors and ``B`` set to transformers' Llama projections, the T6 model gives Llama's logits.
RoPE on the ``B`` factors equals RoPE on the product (Theorem 3.1); the cache holds
``(R_K + R_V)(h + d_h)`` numbers per token per layer (Table 1); decoding with it gives the
logits and greedy tokens of full forwards; folders round-trip through ``from_pretrained``.
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.errors import RankwiseError
from rankwise.models import register_architectures
from rankwise.models.tpa import TPAConfig, TPAForCausalLM
from rankwise.models.tpa.attention import apply_rope, tensor_product
from rankwise.testing import error_lines

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def tpa(seed: int = 0, **kw) -> TPAForCausalLM:
    torch.manual_seed(seed)
    return TPAForCausalLM(TPAConfig(**{**TINY, **kw})).eval()


def rope_angles(model, positions: torch.Tensor):
    return model.model.rope(positions, torch.float32)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])   # MHA, GQA (G = 2), MQA
def test_mha_gqa_mqa_are_non_contextual_tpa(kv_heads):
    """§4: ``A_Q = h e_i`` with ``R_Q = h``; ``A_K = A_V = G · 1[head i in group j]`` with
    ``R = G`` (G = h: MHA, G = 1: MQA, ``a = 1_h``); ``B`` = the per-head projections."""
    from transformers import LlamaConfig, LlamaForCausalLM
    h, dh = 4, 8
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                         tie_word_embeddings=False, pad_token_id=0)).eval()
    model = tpa(q_rank=h, k_rank=kv_heads, v_rank=kv_heads, contextual_a=False)
    state = {k.replace("q_proj", "q.b_proj").replace("k_proj", "k.b_proj").replace("v_proj", "v.b_proj"): v
             for k, v in llama.state_dict().items() if "rotary" not in k}
    group = torch.arange(h) // (h // kv_heads)                        # Llama's head -> KV head
    a_kv = kv_heads * (group[None, :] == torch.arange(kv_heads)[:, None]).float()   # (G, h)
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        state[p + "q.a_const"] = h * torch.eye(h)
        state[p + "k.a_const"] = state[p + "v.a_const"] = a_kv
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = llama(ids).logits, model(ids, use_cache=False).logits
    assert (got - want).abs().max() < 1e-5
    assert dh == TINY["hidden_size"] // h


def test_rope_on_b_equals_rope_on_the_product_and_stays_relative():
    """Theorem 3.1: ``(1/R) Aᵀ RoPE(B) = RoPE((1/R) AᵀB)``, so ``q_t · k_s`` depends on ``t - s`` only."""
    model = tpa()
    g = torch.Generator().manual_seed(0)
    b, t, r, h, dh = 2, 7, 3, 4, 8
    a, bf = torch.randn(b, t, r, h, generator=g), torch.randn(b, t, r, dh, generator=g)
    pos = torch.arange(t).expand(b, t) + 5
    cos, sin = rope_angles(model, pos)
    rotated_b = tensor_product(a, apply_rope(bf, cos, sin))                    # (B, h, T, d_h)
    rotated_k = apply_rope(tensor_product(a, bf).transpose(1, 2), cos, sin).transpose(1, 2)
    assert (rotated_b - rotated_k).abs().max() < 1e-5
    qa, qb = torch.randn(1, 1, r, h, generator=g), torch.randn(1, 1, r, dh, generator=g)
    ka, kb = torch.randn(1, 1, r, h, generator=g), torch.randn(1, 1, r, dh, generator=g)

    def score(tq: int, tk: int) -> torch.Tensor:
        cq, sq = rope_angles(model, torch.tensor([[tq]]))
        ck, sk = rope_angles(model, torch.tensor([[tk]]))
        return (tensor_product(qa, apply_rope(qb, cq, sq)) * tensor_product(ka, apply_rope(kb, ck, sk))).sum(-1)
    assert (score(9, 4) - score(30, 25)).abs().max() < 1e-4
    assert (score(9, 4) - score(9, 3)).abs().max() > 1e-2                  # the angle matters


@pytest.mark.parametrize("kv_only, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_cache_bytes_per_token_per_layer_follow_table_1(kv_only, dtype):
    model = tpa(kv_only=kv_only, k_rank=2, v_rank=3).to(dtype)
    h, dh = 4, 8
    ids = torch.randint(0, 64, (3, 10))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    size = torch.tensor([], dtype=dtype).element_size()
    want = (2 + 3) * (h + dh) * size                                        # (R_K + R_V)(h + d_h) × bytes
    assert [cache.bytes_per_token(i) for i in range(2)] == [want, want]
    assert model.config.kv_cache_elements() * size == want == 60 * size
    assert cache.get_seq_length() == 10 and cache.nbytes() == 2 * 3 * 10 * want


@pytest.mark.parametrize("kw", [{}, {"kv_only": True}, {"contextual_a": False}])
def test_decoding_with_the_cache_equals_full_forwards(kw):
    model = tpa(seed=3, **kw)
    ids = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)                               # prefill
        pieces, cache = [out.logits], out.cache
        for s in (slice(5, 6), slice(6, 9), slice(9, 14)):                    # one token, then chunks
            step = model(ids[:, s], cache=cache)
            pieces.append(step.logits)
    assert (torch.cat(pieces, 1) - full).abs().max() < 1e-5
    prompt = ids[:1, :4]
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        seq = prompt
        for _ in range(10):                                                   # argmax without a cache
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert cached.tolist() == seq.tolist()


def test_padding_mask_leaves_real_tokens_unchanged():
    model = tpa(seed=4)
    ids = torch.randint(1, 64, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        got = model(padded, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    use_cache=False).logits[:, 3:]
    assert (got - want).abs().max() < 1e-5


def test_packed_examples_attend_only_to_themselves():
    """Restarting ``position_ids`` without a mask (``data.packing``) = each example on its own."""
    model = tpa(seed=6)
    a, b = torch.randint(1, 64, (1, 5)), torch.randint(1, 64, (1, 4))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), position_ids=pos, use_cache=False).logits
        alone = torch.cat([model(a, use_cache=False).logits, model(b, use_cache=False).logits], 1)
    assert (packed - alone).abs().max() < 1e-5


def test_save_and_load_through_the_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    register_architectures()
    model = tpa(seed=5, kv_only=True, q_rank=3)
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "rankwise-tpa"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(loaded) is TPAForCausalLM and loaded.config.kv_only and loaded.config.k_rank == 2
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


@pytest.mark.parametrize("kw, needles", [
    ({"k_rank": 0}, ["k_rank got 0", ">= 1"]),
    ({"q_rank": 0, "v_rank": -1}, ["q_rank got 0", "v_rank got -1"]),
    ({"hidden_size": 30}, ["num_attention_heads 4 does not divide hidden_size 30", "set head_dim"]),
])
def test_bad_sizes_are_one_line_errors(kw, needles):
    with pytest.raises(RankwiseError) as err:
        TPAConfig(**{**TINY, **kw})
    assert "\n" not in str(err.value) and all(n in str(err.value) for n in needles)


def tpa_folder(folder, **kw):
    """A T6 model with the tiny models' tokenizer (the packaged MiniLM's), saved to ``folder``."""
    from rankwise.recipes.model import load_tokenizer
    tok = load_tokenizer("tiny-llama")
    tpa(**{"vocab_size": len(tok), "bos_token_id": tok.cls_token_id, "eos_token_id": tok.sep_token_id,
           "pad_token_id": tok.pad_token_id, **kw}).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_rankwise_generate_decodes_a_trained_t6_run_with_its_cache(tmp_path):
    """``rankwise train`` (LoRA on every linear, factor projections included) then ``rankwise
    generate``: the cached greedy completion equals an argmax loop of full forwards; a base
    folder with a bad rank is a one-line error."""
    from rankwise.data.formats import end_id
    from rankwise.recipes.config import load_run_config
    from rankwise.commands.generate.decode import DecodeConfig
    from rankwise.commands.generate.run import load_for_generation, run_generate
    from rankwise.recipes.train import train
    folder = tpa_folder(tmp_path / "t6")
    rows = [{"prompt": f"Open file {i}.", "completion": f"open(f{i})"} for i in range(10)]
    for name, part in (("train", rows[:8]), ("eval", rows[8:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    base = {"model": {"path": str(folder), "task": "causal-lm"},
            "data": {"source": str(tmp_path / "train.jsonl"), "eval_source": str(tmp_path / "eval.jsonl"),
                     "format": "prompt-completion", "max_length": 32},
            "method": {"name": "lora", "r": 2}, "optim": {"name": "adamw", "lr": 0.02},
            "train": {"steps": 2, "batch_size": 4, "progress": False, "save_every": 0}}
    train(load_run_config(None, base=base), tmp_path / "run")
    cfg, model, tok, enc = load_for_generation(tmp_path / "run")
    assert type(model).__name__ == "TPAForCausalLM"
    ids, eos = enc.prompt_ids("Open a file."), end_id(tok)
    want: list[int] = []
    with torch.no_grad():
        for _ in range(6):
            t = int(model(input_ids=torch.tensor([ids + want]), use_cache=False).logits[0, -1].argmax())
            if t == eos:
                break
            want.append(t)
    assert len(want) == 6                                   # six real tokens, no early end
    got = run_generate(tmp_path / "run", "Open a file.", DecodeConfig(max_new_tokens=6), echo=lambda s: None)
    assert got[0]["completion"] == tok.decode(want, skip_special_tokens=True)
    result = CliRunner().invoke(main, ["generate", str(tmp_path / "run"), "--prompt", "Open a file.",
                                       "--max-new-tokens", "6"])
    assert result.exit_code == 0 and result.output == got[0]["completion"] + "\n", result.output
    # a base folder whose config has a rank < 1: one line, exit 2
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "v_rank": 0}))
    result = CliRunner().invoke(main, ["generate", str(tmp_path / "run"), "--prompt", "x"])
    lines = error_lines(result.stderr)
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "v_rank got 0" in lines[0] and "cannot load" in lines[0]
