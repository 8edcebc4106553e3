"""``bench restore`` on a tiny base folder built here: per-byte quality from the scored bytes,
RestoreLCC keeps the pruned weights bit for bit, LoRA's trainable count and its merged / re-masked
sparsity, the same batches as RestoreLCC's own order, and a second run reusing (or redoing) pieces."""
import json

import pytest
import torch

from rankwise_bench.base_text import tiny_base
from rankwise_bench.restore import Sizes, _batches, run


def test_the_batches_are_restorelccs_own_order():
    ids = torch.arange(10)[:, None].repeat(1, 3)     # window k holds k
    got = _batches(ids, 4, 3, 0)
    g = torch.Generator().manual_seed(0)
    first, second = torch.randperm(10, generator=g).tolist(), torch.randperm(10, generator=g).tolist()
    assert [b[:, 0].tolist() for b in got] == [first[0:3], first[3:6], first[6:9], [first[9]] + second[:2]]


def test_an_unknown_size_is_a_one_line_error(tmp_path, capsys):
    from rankwise_bench.restore import main
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "--set", "stepz=3"])
    assert exit_.value.code == 2 and "unknown field" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_base_run_measures_both_recoveries_and_reuses_its_pieces(tmp_path):
    base = tiny_base(tmp_path / "base")
    out = tmp_path / "out"
    s = Sizes(base=str(base), seq=32, calib_windows=8, heldout_windows=4, steps=3, batch_size=2,
              recovery_windows=8, val_windows=4, restore_lrs=(1e-2,), lora_lrs=(1e-3, 1e-2), all_heads_lr=1e-2)
    res = run(out, s)
    assert {p.name for p in out.iterdir()} == {"results.json", "results.md", "pieces"}
    i = res["base"]
    assert i["scored_tokens"] == 4 * 31 and i["shape"]["kv_heads"] == 1
    per_byte = i["scored_tokens"] / i["scored_bytes"]
    assert [r["pruning"] for r in res["rows"]] == ["wanda 2:4", "sparsegpt 50%"]
    for row in res["rows"]:
        p = row["pruned"]
        assert p["nats_per_byte"] == pytest.approx(p["nats_per_token"] * per_byte)
        assert p["sparsity"] == pytest.approx(0.5)
        assert len(row["restore"]) == 1 and len(row["lora"]) == 2 and row["restore_all_heads"]["heads_fraction"] == 1.0
        for r in row["restore"] + [row["restore_all_heads"]]:
            assert r["weights_unchanged"] and r["sparsity"] == p["sparsity"]
            assert r["nats_per_byte"] == pytest.approx(r["nats_per_token"] * per_byte)
        # 1 of 4 heads (25%): its 32-wide direction and bias; every head: 4 x 2 x 32
        assert row["restore"][0]["trainable_params"] == 2 * 32 and row["restore_all_heads"]["trainable_params"] == 256
        for lo in row["lora"]:
            # r (in + out) per linear layer: q, o 64->64; k, v 64->32; gate, up 64->128, down 128->64
            assert lo["trainable_params"] == 2 * 8 * (2 * 128 + 2 * 96 + 3 * 192) == 16384
            assert lo["merged"]["sparsity"] < 0.01 and lo["remasked"]["sparsity"] == p["sparsity"]
            assert lo["merged"]["nats_per_token"] == pytest.approx(lo["trained"]["nats_per_token"], rel=1e-4)
        assert row["lora_best"] == min((0, 1), key=lambda k: row["lora"][k]["trained"]["val"])
    md = (out / "results.md").read_text()
    assert "nats per byte (per token)" in md and "RestoreLCC, 100% heads" in md and "bit for bit as pruned" in md
    assert json.loads((out / "results.json").read_text())["rows"][0]["pruned"] == res["rows"][0]["pruned"]

    pieces = out / "pieces" / "wanda-2-4"
    stored = json.loads((pieces / "lora-lr0-001.json").read_text())
    stored["record"]["seconds"] = 123.0                          # a reused piece is read, not redone
    (pieces / "lora-lr0-001.json").write_text(json.dumps(stored))
    (pieces / "restore-lr0-01.json").unlink()                    # a missing one is measured again
    again = run(out, s)["rows"][0]
    assert again["lora"][0]["seconds"] == 123.0
    assert again["restore"][0]["nats_per_token"] == pytest.approx(res["rows"][0]["restore"][0]["nats_per_token"])
    assert again["lora"][1] == res["rows"][0]["lora"][1]
