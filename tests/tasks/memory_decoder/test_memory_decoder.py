"""Memory Decoder (arXiv 2508.09874): the log-space mixture against the direct formula, the
faiss kNN distribution against a brute-force one, the task's loss against 0.5 KL + 0.5 CE written out,
two-KV-cache decoding against decoding without caches, and the one-line refusals."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("faiss")

from rankwise.tasks.memory_decoder.task import (Datastore, MemoryDecoderConfig, MemoryDecoderTask,  # noqa: E402
                                            head_inputs, knn_distribution, memdec_loss)
from rankwise.tasks.memory_decoder.generation import generate_with_memory, interpolate  # noqa: E402
from rankwise.errors import RankwiseError  # noqa: E402
from rankwise.testing import tiny_llama64  # noqa: E402


class Windows(list):
    pad_id = 0


def brute_knn(queries, keys, values, self_ids, k, temperature, vocab):
    """p_kNN written out: all squared distances, the own row dropped, the k smallest, softmax(-d/T),
    summed per next token (float64)."""
    d = ((queries[:, None, :].double() - keys[None].double()) ** 2).sum(-1)     # (P, N)
    out = torch.zeros(len(queries), vocab, dtype=torch.float64)
    for i in range(len(queries)):
        row = d[i].clone()
        if self_ids[i] >= 0:
            row[self_ids[i]] = math.inf
        near = row.topk(k, largest=False).indices
        w = torch.softmax(-row[near] / temperature, 0)
        out[i].index_add_(0, values[near], w)
    return out


def test_interpolation_equals_the_log_space_formula():
    g = torch.Generator().manual_seed(0)
    lb = F.log_softmax(torch.randn(4, 50, generator=g, dtype=torch.float64) * 3, -1)
    lm = F.log_softmax(torch.randn(4, 50, generator=g, dtype=torch.float64) * 3, -1)
    for lam in (0.0, 0.25, 0.7, 1.0):
        want = torch.log((1 - lam) * lb.exp() + lam * lm.exp())
        assert torch.allclose(interpolate(lb, lm, lam), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("index", ["flat", "ivf"])
def test_knn_distribution_equals_brute_force(index):
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(60, 8, generator=g)
    values = torch.randint(0, 11, (60,), generator=g)
    queries = torch.cat([keys[:5], torch.randn(3, 8, generator=g)])        # 5 stored rows, 3 new
    own = torch.tensor([0, 1, 2, 3, 4, -1, -1, -1])
    # IVF with every list probed searches exhaustively, so it must agree too
    store = Datastore(keys, values, MemoryDecoderConfig(base="x", index=index, ivf_lists=4, ivf_probe=4))
    assert store.kind == index
    d, v, valid = store.search(queries, 7, own)
    assert int(valid.sum()) == 8 * 7                                           # self-hits dropped
    got = knn_distribution(d, v, 11, temperature=3.0, valid=valid)
    want = brute_knn(queries, keys, values, own, 7, 3.0, 11)
    assert torch.allclose(got.double(), want, atol=2e-6, rtol=0)
    # a query whose only neighbour is itself has no kNN target (zeros, not NaN)
    lone = Datastore(keys[:1], values[:1], MemoryDecoderConfig(base="x", index="flat"))
    d, v, valid = lone.search(keys[:1], 7, torch.tensor([0]))
    assert not valid.any() and torch.equal(knn_distribution(d, v, 11, 3.0, valid), torch.zeros(1, 11))


def test_flat_index_above_its_memory_names_the_ivf_option():
    keys = torch.zeros(1024, 64)   # 0.25 MiB
    with pytest.raises(RankwiseError) as err:
        Datastore(keys, torch.zeros(1024, dtype=torch.long),
                  MemoryDecoderConfig(base="x", index="flat", flat_max_mb=0.1))
    assert "\n" not in str(err.value) and "task.index: ivf" in str(err.value)
    auto = Datastore(keys, torch.zeros(1024, dtype=torch.long),
                     MemoryDecoderConfig(base="x", index="auto", flat_max_mb=0.1))
    assert auto.kind == "ivf"


def test_task_loss_is_half_kl_plus_half_ce_with_the_bases_knn_targets():
    base, mem = tiny_llama64(vocab_size=32, seed=0).eval(), tiny_llama64(vocab_size=32, seed=1)
    g = torch.Generator().manual_seed(2)
    train = Windows({"input_ids": torch.randint(1, 32, (12,), generator=g).tolist()} for _ in range(6))
    held = Windows({"input_ids": torch.randint(1, 32, (12,), generator=g).tolist()} for _ in range(2))
    cfg = MemoryDecoderConfig(base="unused", k=5, temperature=2.0)
    task = MemoryDecoderTask(cfg)
    task.base_loader = lambda path, device: base
    assert task.prepare(mem, [train, held], True, 4, "cpu") == "flat"
    with torch.no_grad():
        keys = torch.cat([head_inputs(base, torch.tensor([x["input_ids"]]))[0][0, :-1] for x in train])
        held_keys = torch.cat([head_inputs(base, torch.tensor([x["input_ids"]]))[0][0, :-1] for x in held])
    values = torch.cat([torch.tensor(x["input_ids"][1:]) for x in train])
    for data, q, own in ((train, keys, torch.arange(len(keys))), (held, held_keys, torch.full((len(held_keys),), -1))):
        p = brute_knn(q, keys, values, own, 5, 2.0, 32)                        # (P, V)
        batch = task.collate(list(data), 0)
        with torch.no_grad():
            loss, out = task.loss_sum(mem, batch)
            logp = F.log_softmax(mem(input_ids=batch["input_ids"]).logits[:, :-1].double(), -1).reshape(-1, 32)
        y = batch["input_ids"][:, 1:].reshape(-1)
        ce = -logp.gather(1, y[:, None]).sum()
        kl = (torch.where(p > 0, p * (p.clamp(min=1e-300).log() - logp), torch.zeros_like(p))).sum()
        assert math.isclose(out.ce, float(ce), rel_tol=1e-5)
        assert math.isclose(out.kl, float(kl), rel_tol=1e-4, abs_tol=1e-4)
        assert math.isclose(float(loss), float(0.5 * kl + 0.5 * ce), rel_tol=1e-4)


def test_memdec_loss_weights():
    g = torch.Generator().manual_seed(3)
    logits, y = torch.randn(5, 9, generator=g), torch.randint(0, 9, (5,), generator=g)
    ids = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(5)])
    probs = torch.softmax(torch.randn(5, 3, generator=g), -1)
    total, kl, ce = memdec_loss(logits, y, ids, probs, 0.3, 0.7)
    assert math.isclose(float(total), 0.3 * float(kl) + 0.7 * float(ce), rel_tol=1e-6)
    dense = torch.zeros(5, 9).scatter(1, ids, probs)
    ref = F.kl_div(F.log_softmax(logits, -1), dense, reduction="sum")
    assert math.isclose(float(kl), float(ref), rel_tol=1e-5)


@pytest.mark.parametrize("lam", [0.25, 0.9])
def test_two_kv_caches_decode_as_without_caches(lam):
    base, mem = tiny_llama64(vocab_size=48, seed=4), tiny_llama64(vocab_size=48, seed=5)
    prompt = [3, 17, 5, 9, 22]
    cached = generate_with_memory(base, mem, prompt, 12, eos_id=-1, lam=lam, use_cache=True)
    plain = generate_with_memory(base, mem, prompt, 12, eos_id=-1, lam=lam, use_cache=False)
    assert len(cached) == 12 and cached == plain
    # the reference loop, written out: argmax of log((1 - lam) p_base + lam p_mem) each step
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            pb = torch.softmax(base(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
            pm = torch.softmax(mem(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
            ids.append(int(((1 - lam) * pb + lam * pm).argmax()))
    assert cached == ids[len(prompt):]


def test_a_base_with_another_vocabulary_is_refused_before_the_datastore():
    task = MemoryDecoderTask(MemoryDecoderConfig(base="other-base", k=2))
    task.base_loader = lambda path, device: tiny_llama64(vocab_size=32)
    with pytest.raises(RankwiseError) as err:
        task.prepare(tiny_llama64(vocab_size=48), [Windows([{"input_ids": [1, 2, 3]}])], True, 2, "cpu")
    assert "\n" not in str(err.value) and "32 tokens" in str(err.value) and "tokenizer" in str(err.value)
