"""``bench memory-decoder`` on the reference base: the domain is exactly the base's held-out
modules, split by whole module; windows predict every token once; lambda is the grid point of
lowest validation perplexity (a constructed case with a hand-computed optimum); ``log p_kNN(y)``
equals the task's dense ``p_kNN`` at the target; per-byte loss is nats over text bytes; and a tiny
in-code base run end to end scores its base row as plain transformers does, then resumes from its
pieces to the same record."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch

from rankwise.data.corpus import load_source_records
from rankwise_bench import memory_decoder as bench
from rankwise_bench.common import REFERENCE_BASE


def test_the_domain_is_the_bases_held_out_modules_split_by_module():
    recs = load_source_records()
    held = {r["id"] for r in recs if zlib.crc32(r["id"].encode()) % 10 == 0}
    splits = bench.domain_records()
    names = {s: [r["id"] for r in v] for s, v in splits.items()}
    every = [m for v in names.values() for m in v]
    assert sorted(every) == sorted(held) and len(every) == len(set(every))   # a partition, nothing seen
    assert all(r["heldout"] for v in splits.values() for r in v)
    for split, mods in names.items():
        assert mods and all(bench.split_of(m) == split for m in mods)
    size = {s: sum(len(r["text"].encode()) for r in v) for s, v in splits.items()}
    assert size["train"] > 2 * size["test"] and min(size["validation"], size["general"]) > 40_000
    small = bench.domain_records(modules=2)
    assert all(len(v) == 2 for v in small.values())
    assert [r["id"] for r in small["test"]] == [r["id"] for r in sorted(
        splits["test"], key=lambda r: (len(r["text"].encode()), r["id"]))[:2]]


@pytest.mark.parametrize("length, seq", [(1, 4), (2, 4), (4, 4), (5, 4), (11, 4), (300, 32)])
def test_windows_predict_every_token_but_the_first_exactly_once(length, seq):
    ids = list(range(100, 100 + length))
    ws = bench.windows(ids, seq)
    assert [t for w in ws for t in w[1:]] == ids[1:]
    assert all(2 <= len(w) <= seq for w in ws)
    assert all(b[0] == a[-1] for a, b in zip(ws, ws[1:]))  # each starts at the last token before it


def test_lambda_is_the_grid_point_of_lowest_validation_perplexity():
    # the true token's probability: half the positions the decoder is right (base 0.1, decoder
    # 0.9), half it is wrong (base 0.5, decoder 0.01): the validation loss
    # -1/2 [log(0.1 + 0.8 lam) + log(0.5 - 0.49 lam)] is least at lam = 0.351 / 0.784 = 0.448,
    # and on the grid at 0.4 (1.02908) before 0.5 (1.02983)
    base = torch.tensor([0.1, 0.5] * 3).log()
    mem = torch.tensor([0.9, 0.01] * 3).log()
    lam, curve = bench.choose_lambda(base, mem)
    assert lam == 0.4 and list(curve) == [str(g) for g in bench.GRID]
    assert curve["0.4"] == pytest.approx(math.exp(-(math.log(0.42) + math.log(0.304)) / 2), rel=1e-6)
    assert curve["0.5"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.255)) / 2), rel=1e-6)
    assert min(curve.values()) == curve["0.4"]
    # a decoder that is always right: the largest lambda; always wrong: the smallest
    assert bench.choose_lambda(base[:1], mem[:1])[0] == 0.9
    assert bench.choose_lambda(base[1:2], mem[1:2])[0] == 0.1


def test_knn_target_logprob_is_the_dense_knn_distribution_at_the_target():
    from rankwise.tasks.memory_decoder.task import knn_distribution
    g = torch.Generator().manual_seed(0)
    d = torch.rand(50, 9, generator=g) * 400
    v = torch.randint(0, 6, (50, 9), generator=g)
    valid = torch.rand(50, 9, generator=g) > 0.2
    valid[0] = False                                   # no neighbour at all
    y = torch.randint(0, 6, (50,), generator=g)
    for t in (3.0, 100.0):
        want = knn_distribution(d, v, 6, t, valid).gather(1, y[:, None]).squeeze(1)   # (50,)
        got = bench.knn_target_logprob(d, v, valid, y, t).exp()
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert got[0] == 0.0


def test_score_is_per_token_and_per_byte():
    data = bench.Windows([], 0, text_bytes=20, modules=[])
    got = bench.score(torch.tensor([-1.0, -2.0, -3.0, -4.0]), data)
    assert got["nats_per_token"] == 2.5 and got["nats_per_byte"] == 0.5
    assert got["token_ppl"] == pytest.approx(math.exp(2.5)) and got["byte_ppl"] == pytest.approx(math.exp(0.5))


@pytest.mark.slow
def test_a_tiny_base_runs_end_to_end_and_resumes_from_its_pieces(tmp_path):
    pytest.importorskip("faiss")
    if not (REFERENCE_BASE / "tokenizer.json").is_file():
        pytest.skip("the reference base's tokenizer is not built")
    from transformers import AutoTokenizer

    from rankwise_bench.common import llama
    tok = AutoTokenizer.from_pretrained(str(REFERENCE_BASE))
    model = llama(len(tok), 16, 1, 2, 32, positions=64, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  tie_word_embeddings=True).eval()
    base = tmp_path / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    sizes = bench.Sizes(seq=32, batch=4, steps=2, k=8, temperatures=(10.0, 100.0), ivf_lists=2, ivf_probe=2,
                        modules=2)
    out = tmp_path / "out"
    rec = bench.run(out, base=base, sizes=sizes)
    # the base row, scored independently through transformers' own loss over the same windows
    data = bench.token_windows(tok, bench.domain_records(2)["test"], 32)
    nats = tokens = 0.0
    with torch.no_grad():
        for w in data:
            ids = torch.tensor([w["input_ids"]])
            n = ids.shape[1] - 1
            nats, tokens = nats + float(model(input_ids=ids, labels=ids).loss) * n, tokens + n
    row = rec["eval"]["rows"][0]
    assert row["model"] == "base" and rec["splits"]["test"]["tokens"] == tokens
    assert row["test"]["token_ppl"] == pytest.approx(math.exp(nats / tokens), rel=1e-5)
    assert row["test"]["nats_per_byte"] == pytest.approx(nats / rec["splits"]["test"]["bytes"], rel=1e-5)
    for key, curve in rec["eval"]["validation ppl"].items():      # each lambda: its validation argmin
        assert curve[str(rec["eval"]["lambda"][key])] == min(curve.values())
    assert len(rec["eval"]["rows"]) == 9 and (out / "lambda.png").is_file()
    first = (out / "results.json").read_text()
    assert bench.markdown(json.loads(first)) == (out / "results.md").read_text()
    assert bench.run(out, base=base, sizes=sizes)["eval"] == rec["eval"]            # resumed: pieces reused
    assert (out / "results.json").read_text() == first
    assert sorted(p.name for p in (out / "pieces").iterdir()) == [f"{n}.json" for n in
                                                                   ("dapt", "eval", "knn", "lora", "memdec")]
    assert Path(rec["base"]) == base
