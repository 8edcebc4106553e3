"""The compression benchmark: budget arithmetic, GLVQ's tiling groups, the bytes behind the
reference base's tokens (fast), and a tiny end-to-end run on a base folder built here that keeps
another model's record and reuses its pieces (slow)."""
import json

import pytest
import torch

from rankwise_bench.base_text import tiny_base
from rankwise_bench.compress import Sizes, budget_sparsity, rows, run, svd_rank, tiling_group


def test_budget_matched_sparsity_gives_the_same_total_parameters():
    shapes = [(128, 128), (256, 128), (128, 256)]
    s = budget_sparsity(shapes, 0.5, 8)
    total = sum(m * n for m, n in shapes)
    assert (1 - s) * total == pytest.approx(0.5 * total + sum(8 * (m + n) for m, n in shapes))
    k = svd_rank(shapes)
    assert abs(k * sum(m + n for m, n in shapes) / total - 0.5) < 0.01


def test_rows_cover_every_method_at_both_patterns_and_bits():
    labels = [label for label, _ in rows(Sizes(), [(128, 128)])]
    for m in ("magnitude", "wanda", "sparsegpt", "3basil"):
        assert f"{m} 50%" in " ".join(labels) and f"{m} 2:4" in " ".join(labels)
    for m in ("rtn", "gptq", "glvq"):
        assert f"{m} int4" in labels and f"{m} int3" in labels


def test_glvq_uses_the_largest_group_that_tiles_every_layer():
    base = [(256, 256), (128, 256), (688, 256), (256, 688)]      # the reference base's (out, in)
    assert tiling_group(base) == 16                              # gcd(256, 688) = 16
    assert tiling_group([(384, 384), (1536, 384), (384, 1536)]) == 128   # MiniLM: unchanged
    got = dict(rows(Sizes(), base))
    assert got["glvq int4, group 16"]["group_size"] == 16 and got["glvq int3, group 16"]["bits"] == 3
    assert got["gptq int4"]["group_size"] == got["rtn int3"]["group_size"] == 128


def test_kv_rows_add_kivi_at_nsnquants_stored_bytes():
    from rankwise_bench.compress import kv_rows
    from rankwise.compress.kv import bits_per_element
    got = kv_rows(32, 16)
    # NSNQuant at d=32, chunk 16 stores 1 + 1 + 1 = 3 and 4 bits/element; KIVI 2-bit and
    # 3-bit with 32-token key groups store 2 (3) + (32/32 + 32/32)/2 = 3 (4): equal bytes
    assert got[-2:] == [("kivi", 2, 32), ("kivi", 3, 32)]
    for (_, nb, _), (kind, b, c) in zip([r for r in got if r[0] == "nsnquant"], got[-2:]):
        assert bits_per_element(kind, b, 32, c) == bits_per_element("nsnquant", nb, 32, 16)


def test_the_bytes_of_the_reference_base_s_tokens_are_the_held_out_text_s():
    from transformers import AutoTokenizer

    from rankwise_bench.base_text import module_stream, scored_bytes, spaced_windows
    from rankwise_bench.common import reference_base
    tok = AutoTokenizer.from_pretrained(reference_base())
    ids, nbytes, info = module_stream(tok, heldout=True)
    # the model card's split: 59 modules, 1,056,598 bytes; every token's bytes add up to them
    assert info["modules"] == 59 and info["bytes"] == 1_056_598 == int(nbytes.sum())
    assert ids.numel() == nbytes.numel() == info["tokens"] and int((ids == tok.bos_token_id).sum()) == 59
    win, wb = spaced_windows(ids, nbytes, 5, 100)
    assert win.shape == wb.shape == (5, 100)
    assert torch.equal(win[0], ids[:100]) and torch.equal(win[-1], ids[-100:])
    # module by module too: the bytes between each BOS and its EOS are that module's text
    from rankwise.data.corpus import load_source_records
    texts = [r["text"] for r in load_source_records() if r["heldout"]]
    starts = (ids == tok.bos_token_id).nonzero().flatten().tolist() + [ids.numel()]
    assert [int(nbytes[a:b].sum()) for a, b in zip(starts, starts[1:])] == [len(t.encode()) for t in texts]
    assert scored_bytes(wb) == int(wb[:, 1:].sum())


def test_an_unknown_model_is_a_one_line_error(tmp_path, capsys):
    from rankwise_bench.compress import main
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "--set", "models=[bert]"])
    assert exit_.value.code == 2 and "expected some of ['minilm', 'llama']" in capsys.readouterr().err


def _old_minilm_record() -> dict:
    """A results.json as written before each model kept its own run (MiniLM only, one row)."""
    row = {"model": "minilm", "row": "dense", "config": {"method": "none"}, "quality": 0.859, "eval_loss": 0.5,
           "rel_error_mean": 0.0, "rel_error_max": 0.0, "target_bytes": 2**20, "target_bytes_before": 2**20,
           "model_bytes": 2**21, "params": 10, "params_before": 10, "compress_s": 1.0, "layers": {}}
    info = {"params": 22_716_296, "train": {"steps": 90, "batch_size": 32}, "train_examples": 1848,
            "eval_examples": 461}
    return {"sizes": {**Sizes().__dict__, "models": ["minilm", "llama"], "heldout_windows": 64},
            "python": "3.11.7", "torch": "2.13.0+cpu", "machine": "x86_64, 1 torch threads", "wall_s": 816.0,
            "models": {"minilm": {"metric": "accuracy", "info": info, "rows": [row]}}}


@pytest.mark.slow
def test_tiny_base_run_keeps_the_other_record_and_reuses_its_pieces(tmp_path):
    base = tiny_base(tmp_path / "base")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(_old_minilm_record()))
    s = Sizes(models=("llama",), base=str(base), llama_seq=32, calib_windows=4, heldout_windows=4, kv_batch=4,
              overrides={"3basil": {"iterations": 10, "min_iterations": 10, "tm_epochs": 1},
                         "glvq": {"rounds": 1, "steps": 1}})
    res = run(out, s)
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "quality_vs_bytes.png", "pieces"}
    assert not (out / "_work").exists()
    record = json.loads((out / "results.json").read_text())
    assert list(record["models"]) == ["minilm", "llama"]
    minilm = record["models"]["minilm"]
    assert minilm["rows"][0]["quality"] == 0.859 and minilm["run"]["wall_s"] == 816.0   # kept, with its run
    llama = record["models"]["llama"]
    assert len(llama["rows"]) == len(res["models"]["llama"]["rows"]) == 20
    assert [r["kind"] for r in llama["kv_cache"]] == ["fp", "nsnquant", "nsnquant", "kivi", "kivi", "kivi",
                                                      "kivi", "kivi"]
    i = llama["info"]
    assert i["scored_tokens"] == 4 * 31 and i["shape"]["head_dim"] == 32 and i["shape"]["kv_heads"] == 1
    dense = llama["rows"][0]
    # nats per byte = mean loss per token x tokens / bytes; the float cache scores what the model does
    assert dense["quality"] == pytest.approx(dense["eval_loss"] * i["scored_tokens"] / i["scored_bytes"])
    assert llama["kv_cache"][0]["nats_per_byte"] == pytest.approx(dense["quality"], rel=1e-4)
    assert dense["perplexity"] == pytest.approx(float(torch.tensor(dense["eval_loss"]).exp()), rel=1e-5)
    md = (out / "results.md").read_text()
    assert "85.90%" in md and "stored bits / element" in md and "nats / byte" in md
    assert "(models run: minilm, llama)" in md and "(models run: llama)" in md

    piece = out / "pieces" / "llama" / "dense.json"                 # a second run reuses every piece
    stored = json.loads(piece.read_text())
    stored["record"]["rel_error_mean"] = 123.0
    piece.write_text(json.dumps(stored))
    again = run(out, s)["models"]["llama"]
    assert again["rows"][0]["rel_error_mean"] == 123.0
    assert [r["quality"] for r in again["rows"][1:]] == [r["quality"] for r in llama["rows"][1:]]
