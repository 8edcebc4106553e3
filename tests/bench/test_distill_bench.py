"""``bench distill`` on a teacher folder: the loss per byte counts every UTF-8 byte of the
scored text once (the tokenizer's pieces add up to each module's bytes), and a run on a tiny
teacher built here (the reference base's tokenizer, random weights) writes every row, bakes
each LRC student to the same held-out loss, regenerates its ``results.md`` from the record,
resumes from its pieces and refuses pieces of another teacher."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from rankwise.errors import RankwiseError
from rankwise_bench import distill
from rankwise_bench.common import llama, reference_base

TINY = distill.BenchSizes(student_hidden=16, seq=16, batch=2, budgets=(2, 4), lrs=(1e-3,), eval_windows=4,
                          calib_windows=4, extra_lrs=(("lrc", 3e-4),))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(reference_base())


def test_the_pieces_add_up_to_the_held_out_text(tok):
    from rankwise.data.corpus import load_source_records
    ids, nbytes, info = distill.token_stream(tok, heldout=True)
    texts = [r["text"] for r in load_source_records() if r["heldout"]]
    assert info["modules"] == len(texts) and info["tokens"] == len(ids) == len(nbytes)
    assert int(nbytes.sum()) == info["bytes"] == sum(len(t.encode()) for t in texts)
    assert int((ids == tok.bos_token_id).sum()) == len(texts) and int(nbytes[ids == tok.eos_token_id].sum()) == 0
    table = distill.piece_bytes(tok)
    assert table[tok.convert_tokens_to_ids("<0x0A>")] == 1 and table[tok.convert_tokens_to_ids("\u2581def")] == 4
    assert table[tok.bos_token_id] == len("<s>")   # a literal <s> inside a module (lib2to3, zoneinfo)


def test_windows_score_positions_one_on():
    ids, nbytes = torch.arange(10), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    w = distill.TokenWindows(ids, nbytes, torch.tensor([0, 5]), 4, pad_id=0)
    assert w[1] == {"input_ids": [5, 6, 7, 8]}
    assert w.scored() == (6, (1 + 2 + 3) + (6 + 7 + 8))


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory, tok):
    folder = tmp_path_factory.mktemp("teacher")
    model = llama(len(tok), 32, 2, 4, 64, positions=64, kv_heads=2, seed=0, tie_word_embeddings=True,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(reference_base() / name, folder / name)
    return folder


@pytest.mark.slow
def test_a_tiny_teacher_run_writes_every_row_and_resumes(tmp_path, tiny_teacher, monkeypatch):
    from rankwise_bench.distill_report import markdown
    res = distill.run(tmp_path / "out", TINY, teacher=tiny_teacher)
    assert list(res["best"]) == list(distill.ROWS)
    assert len(res["pieces"]) == 1 + len(distill.ROWS) + 1 and "lrc-lr0.0003" in res["pieces"]   # the extra rate
    w = res["corpus"]["heldout_windows"]
    assert w["scored_tokens"] == 4 * 15
    for name, rec in res["pieces"].items():
        loss = rec["heldout_loss"] if name == "teacher" else rec["heldout_loss"]["4"]
        per_byte = rec["heldout_nats_per_byte"] if name == "teacher" else rec["heldout_nats_per_byte"]["4"]
        assert per_byte == pytest.approx(loss * w["scored_tokens"] / w["scored_bytes"], rel=1e-12)
        if "baked_heldout_loss" in rec:
            assert rec["baked_heldout_loss"] == pytest.approx(loss, abs=1e-5)
    assert res["best"]["lrc"]["student_params"] == res["best"]["scratch"]["student_params"]   # one plain shape
    assert res["best"]["lrc"]["trainable_params"] < res["best"]["scratch"]["trainable_params"]
    assert res["teacher"]["params"] == sum(p.numel() for p in llama(8192, 32, 2, 4, 64, positions=64, kv_heads=2,
                                                                    tie_word_embeddings=True).parameters())
    out = tmp_path / "out"
    assert (out / "results.md").read_text() == markdown(json.loads((out / "results.json").read_text()))
    assert (out / "heldout_ppl.png").is_file()
    monkeypatch.setattr(distill, "_train", lambda *a, **k: pytest.fail("a finished piece ran again"))
    assert distill.run(out, TINY, teacher=tiny_teacher)["best"] == res["best"]
    piece = out / "pieces" / "scratch-lr0.001.json"
    piece.write_text(json.dumps({**json.loads(piece.read_text()), "teacher": "0123"}))
    with pytest.raises(RankwiseError, match="measured with another teacher"):
        distill.run(out, TINY, teacher=tiny_teacher)
