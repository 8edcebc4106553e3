"""KV-cache quantization: the cache plugs into transformers, the float cache reproduces the
ordinary perplexity, the quantizers round-trip closely and their bytes are what they store."""
import math

import pytest
import torch

from rankwise.compress.kv import KIVI, NSNQuant, cache_perplexity, fp16_bytes_per_token, make_cache
from rankwise.compress.kv.quantizers import hadamard
from rankwise.engine import evaluate, get_task
from rankwise.errors import RankwiseError
from rankwise.recipes.compress import Windows
from rankwise.testing import tiny_llama_lm


def test_hadamard_is_orthonormal():
    h = hadamard(32)
    assert torch.allclose(h @ h.T, torch.eye(32), atol=1e-6)


def test_fp_cache_token_by_token_equals_the_full_forward_perplexity():
    model = tiny_llama_lm()
    ids = torch.randint(1, 60, (5, 20), generator=torch.Generator().manual_seed(0))
    ref = evaluate(model, get_task("causal-lm"), Windows(ids), 8)
    for step in (1, 7):
        got = cache_perplexity(model, ids, "fp", batch_size=2, step=step)
        assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


def _keys(seed=0):
    g = torch.Generator().manual_seed(seed)
    ch = torch.exp(torch.randn(32, generator=g))          # uneven channels + an offset: real keys
    return torch.randn(2, 3, 16, 32, generator=g) * ch + 2 * torch.randn(32, generator=g)


@pytest.mark.parametrize("bits,bound", [(1, 0.3), (2, 0.08)])
def test_nsnquant_round_trip_error_and_bytes(bits, bound):
    x = _keys()
    q = NSNQuant(bits)
    enc = q.encode(x)
    err = float(((q.decode(enc) - x) ** 2).sum() / (x ** 2).sum())
    assert err < bound
    tokens, heads = 2 * 16, 3
    # codes: one byte per 8 elements per bit; s1, s2 float16 per token; o float16 per channel
    expect = tokens * heads * (32 // 8 * bits + 2 * 2) + 2 * heads * 32 * 2
    assert q.nbytes(enc) == expect


def test_nsnquant_beats_kivi_at_the_same_bits_on_outlier_channels():
    x = _keys(1)
    for bits in (1, 2):
        nsn = NSNQuant(bits)
        e_nsn = float(((nsn.decode(nsn.encode(x)) - x) ** 2).sum())
        kq = KIVI(bits, per_channel=True)
        e_kivi = float(((kq.decode(kq.encode(x)) - x) ** 2).sum())
        assert e_nsn < e_kivi, (bits, e_nsn, e_kivi)


def test_kivi_counts_codes_at_their_bit_width():
    x = _keys()
    q = KIVI(2, per_channel=True)
    enc = q.encode(x)
    assert q.nbytes(enc) == math.ceil(x.numel() * 2 / 8) + 2 * 2 * (2 * 3 * 32)


def test_quantized_cache_quantizes_complete_chunks_only():
    model = tiny_llama_lm()
    ids = torch.randint(1, 60, (2, 11))
    cache = make_cache("kivi", 2, chunk=4)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, cache=cache)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 11 and layer.quantized_tokens == 8 and layer.keys.shape[-2] == 3
    per_token = cache.bytes_per_token()
    assert 0 < per_token < fp16_bytes_per_token(model.config)


def test_generate_runs_with_the_nsnquant_cache():
    model = tiny_llama_lm()
    ids = torch.randint(1, 60, (1, 6))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=make_cache("nsnquant", 2, chunk=2),
                         max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11)


@pytest.mark.parametrize("kind,bits,msg", [("nsn", 2, "unknown KV cache"), ("nsnquant", 3, "1 or 2"),
                                           ("kivi", 9, "1 to 8")])
def test_make_cache_rejects_bad_settings(kind, bits, msg):
    with pytest.raises(RankwiseError, match=msg):
        make_cache(kind, bits)
