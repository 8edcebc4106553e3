"""``bench shapley --setting related``: the related / target split by package family, the
command line's dispatch and one-line errors, and a tiny base end to end (stage 1 once, the sweep
choosing on validation, the neurons each score trains, the per-byte loss, pieces reused)."""
import json

import pytest

from rankwise_bench import shapley, shapley_related as bench
from rankwise_bench.base_text import tiny_base


def _records():
    recs = [{"prompt": f"doc {i}\n", "completion": f"def f{i}():", "id": f"email.mime.m{i:02d}:f{i}:{i}"}
            for i in range(20)]
    return recs + [{"prompt": "d\n", "completion": "def g():", "id": f"json.decoder:g{i}:1"} for i in range(3)]


def test_the_target_family_splits_into_train_validation_test_and_the_rest_is_related():
    got = bench.split_records(_records()[::-1], "email", test_every=4, val_every=5)
    # 20 email records sorted by id: every 4th (3, 7, 11, 15, 19) is test; of the 15 others
    # every 5th (their positions 4, 9, 14: records 5, 12, 18) is validation
    assert [r["id"].split(":")[1] for r in got["test"]] == ["f3", "f7", "f11", "f15", "f19"]
    assert [r["id"].split(":")[1] for r in got["val"]] == ["f5", "f12", "f18"]
    assert len(got["train"]) == 12 and len(got["related"]) == 3
    assert all(bench.family(r["id"]) == "json" for r in got["related"])
    ids = [r["id"] for k in ("train", "val", "test") for r in got[k]]
    assert len(set(ids)) == 20                                    # disjoint and complete
    assert bench.family("email.mime.text:MIMEText.__init__:17") == "email"


def test_a_target_too_small_to_split_is_one_line(tmp_path):
    from rankwise.errors import RankwiseError
    with pytest.raises(RankwiseError, match="too few"):
        bench.split_records(_records(), "json", test_every=4, val_every=5)


def test_the_setting_switch_reaches_the_related_bench_and_its_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:   # --set is not an abbreviation of --setting
        shapley.main(["--setting", "related", "--out", str(tmp_path), "--set", "stepz=3"])
    assert exit_.value.code == 2 and "unknown field" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        shapley.main(["--setting", "related", "--out", str(tmp_path), "--set", "rows=[top5-shapley]"])
    assert exit_.value.code == 2 and "unknown rows/starts ['top5-shapley']" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_base_runs_both_stages_chooses_on_validation_and_reuses_its_pieces(tmp_path, monkeypatch):
    base = tiny_base(tmp_path / "base")
    out = tmp_path / "out"
    s = bench.Sizes(base=str(base), max_length=48, batch_size=4, related_steps=2, steps=2, lrs=(1e-3, 1e-2),
                    calibration_batches=1, rows=("top10-shapley", "top10-random", "full"), seeds=2)
    res = bench.run(out, s, command="rankwise bench shapley --setting related --out OUT")
    assert {p.name for p in out.iterdir()} == {"results.json", "results.md", "results.png", "pieces", "_work"}
    assert (out / "_work" / "related" / "stage1.json").is_file()
    assert res["splits"] == {"related": 1167, "train": 140, "val": 34, "test": 58}
    st1 = res["stage1"]
    assert st1["records"] > 1000 and st1["after"]["test"]["loss"] < st1["base_on_target"]["loss"]
    # the tiny Llama's block linears: 2 x (q 64 + k 32 + v 32 + o 64 + gate 128 + up 128 + down 64) = 1024
    # neurons; 10 % = 102 rows, of 64 inputs (q, k, v, o, gate, up) or 128 (down) each
    total = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(base).parameters())
    for row, v in res["runs"]["related"].items():
        assert len(v["sweep"]) == 2 and len(v["seeds"]) == 2
        best = min(v["sweep"], key=lambda r: r["val"]["loss"])
        assert v["seeds"][0] == best and v["seeds"][1]["lr"] == best["lr"] and v["seeds"][1]["seed"] == 1
        for r in v["seeds"]:
            t = r["test"]
            assert t["nats_per_byte"] == pytest.approx(t["loss"] * t["targets"] / t["bytes"])
            assert 50 <= t["examples"] <= 58 and t["bytes"] > t["targets"]   # a few completions exceed 48 tokens
        if row == "full":
            assert v["seeds"][0]["selected"] is None and v["seeds"][0]["requires_grad_params"] == total
        else:
            sel = v["seeds"][0]["selected"]
            assert sel["count"] == 102 and 102 * 64 <= sel["weights"] <= 102 * 128
    piece = json.loads((out / "pieces" / "related" / "top10-random" / f"lr{best['lr']:g}-seed1.json").read_text())
    chosen = {(p, i) for p, rows in piece["selection"]["neurons"].items() for i in rows}
    first = json.loads((out / "pieces" / "related" / "top10-random" / f"lr{best['lr']:g}-seed0.json").read_text())
    assert chosen != {(p, i) for p, rows in first["selection"]["neurons"].items() for i in rows}  # seeded draws
    ov = res["overlap"]["related"]
    assert len(ov["with_shapley"]["top10-random"]) == 2 and all(0 <= x <= 1 for x in ov["with_shapley"]["top10-random"])
    s_row = res["summary"]["related"]["full"]
    vals = [r["test"]["loss"] for r in res["runs"]["related"]["full"]["seeds"]]
    assert s_row["test_loss"][0] == pytest.approx(sum(vals) / 2)
    md = (out / "results.md").read_text()
    assert "| stage-1 model, no stage 2 |" in md and "| top10-shapley |" in md and "Command: `rankwise bench" in md
    assert shapley.markdown(json.loads((out / "results.json").read_text())) == md   # regenerates

    def no_training(*_a, **_k):
        raise AssertionError("a recorded piece was run again")
    monkeypatch.setattr(bench, "_one", no_training)
    monkeypatch.setattr(bench, "_stage1", no_training)
    again = bench.run(out, s, command="rankwise bench shapley --setting related --out OUT")
    assert again["summary"] == res["summary"]
