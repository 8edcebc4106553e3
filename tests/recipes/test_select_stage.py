"""``rankwise select`` and the ``data.select`` stage of a run on tiny-bert: the folder it writes,
reuse with ``from`` (identical ids), the target/evaluation overlap, the old flat spelling (the same
ids, one notice) and the one-line errors. (The rules' maths, and the seeded random choice, are in
``tests/data/test_select.py``; their configs and registration in
``tests/recipes/test_select_rules.py``.)"""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.recipes import legacy
from rankwise.recipes.config import load_run_config
from rankwise.recipes.select import record_ids
from rankwise.recipes.session import prepare


def _cfg(tmp: Path, source: Path, **select) -> Path:
    path = tmp / f"sel-{len(list(tmp.glob('sel-*')))}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": "tiny-bert"}, "task": {"name": "classification"},
        "data": {"source": str(source), "max_length": 24, "select": select},
        "method": {"name": "lora", "r": 2, "targets": ["query", "value"]},
        "optim": {"name": "adamw", "lr": 0.01},
        "train": {"steps": 2, "batch_size": 4, "progress": False},
    }))
    return path


def _select(cfg: Path, out: Path):
    return CliRunner().invoke(main, ["select", str(cfg), "--out", str(out)])


def test_select_writes_scores_and_from_reuses_the_same_ids(tmp_path, docstrings_jsonl):
    records = [json.loads(line) for line in docstrings_jsonl.read_text().splitlines()]
    target = tmp_path / "target.jsonl"
    target.write_text("".join(json.dumps(r) + "\n" for r in records))  # every record: eval ones overlap
    res = _select(_cfg(tmp_path, docstrings_jsonl, name="random", budget=0.25, target=str(target)),
                  tmp_path / "less")
    assert res.exit_code == 0, res.output
    assert "equal evaluation examples; dropped them" in res.output
    chosen = json.loads((tmp_path / "less" / "chosen.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "less" / "scores.jsonl").read_text().splitlines()]
    assert len(rows) == chosen["pool"] and chosen["k"] == round(0.25 * chosen["pool"]) == len(chosen["ids"])
    assert 0 < chosen["target"] < len(records) and chosen["seconds"] > 0
    assert {r["id"] for r in rows if r["chosen"]} == set(chosen["ids"])
    top = sorted(rows, key=lambda r: -r["score"])[: chosen["k"]]
    assert {r["id"] for r in top} == set(chosen["ids"])       # the top scores are kept
    assert (tmp_path / "less" / "scores.png").stat().st_size > 0
    assert json.loads((tmp_path / "less" / "rankwise.json").read_text()) == {"kind": "select"}
    cfg = load_run_config(_cfg(tmp_path, docstrings_jsonl, **{"from": str(tmp_path / "less")}))
    session = prepare(cfg, device="cpu")
    assert record_ids(cfg.data, session.train_data) == chosen["ids"]
    # select writes again into its own earlier output (the same seeded choice)
    res = _select(_cfg(tmp_path, docstrings_jsonl, name="random", budget=0.25, target=str(target)),
                  tmp_path / "less")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "less" / "chosen.json").read_text())["ids"] == chosen["ids"]


def test_the_old_flat_spelling_chooses_the_same_ids_with_one_notice(tmp_path, docstrings_jsonl, monkeypatch):
    """``method: qcs`` with the flat ``qcs_steps`` (and another rule's key, ``landmarks``, which it
    ignored) chooses exactly the ids of ``{name: qcs-proxy, steps: ...}``, recorded under the new
    name, with one notice line naming the new spelling; the new spelling prints none."""
    monkeypatch.setattr(legacy, "_SHOWN", set())
    records = [json.loads(line) for line in docstrings_jsonl.read_text().splitlines()]
    target = tmp_path / "target.jsonl"
    target.write_text("".join(json.dumps(r) + "\n" for r in records[:6]))
    common = {"budget": 0.25, "target": str(target), "proj_dim": 16}
    spellings = {"old": {"method": "qcs", "qcs_steps": 5, "landmarks": 3, **common},
                 "new": {"name": "qcs-proxy", "steps": 5, **common}}
    got = {}
    for key, select in spellings.items():
        res = _select(_cfg(tmp_path, docstrings_jsonl, **select), tmp_path / key)
        assert res.exit_code == 0, res.output
        notices = [line for line in res.stderr.splitlines() if line.startswith("notice:")]
        got[key] = (json.loads((tmp_path / key / "chosen.json").read_text()), notices)
    (old, notices), (new, none) = got["old"], got["new"]
    assert old["method"] == new["method"] == "qcs-proxy" and old["ids"] == new["ids"] and len(new["ids"]) > 0
    assert none == [] and len(notices) == 1
    assert notices[0].startswith("notice: data.select.method is the old spelling of data.select.name")
    assert "'qcs' is now 'qcs-proxy': a one-step quadratic proxy of QCS" in notices[0]
    written = yaml.safe_load(notices[0].split("; write data.select: ", 1)[1])  # the new spelling, exactly
    assert written == spellings["new"]


def test_bad_selection_input_is_one_line_and_exit_2(tmp_path, docstrings_jsonl):
    empty = tmp_path / "nothing-new.jsonl"
    cases = {
        "budget: got 0": {"name": "random", "budget": 0},
        "expected a fraction in (0, 1] or a count": {"name": "random", "budget": 100_000},
        "needs data standing for the target task": {"name": "less"},
        "data.select names no rule to score with": {"from": str(tmp_path)},
        "landmarks is a setting of influence": {"name": "less", "target": "t.jsonl", "landmarks": 8},
    }
    for message, select in cases.items():
        res = _select(_cfg(tmp_path, docstrings_jsonl, **select), tmp_path / "bad")
        assert res.exit_code == 2 and message in res.output, (select, res.output)
        assert len(res.output.strip().splitlines()) == 1
    # a target made only of evaluation records is empty once the overlap is dropped
    cfg = load_run_config(_cfg(tmp_path, docstrings_jsonl))
    session = prepare(cfg, device="cpu")
    texts = {tuple(session.eval_data[i]["input_ids"]) for i in range(len(session.eval_data))}
    records = [json.loads(line) for line in docstrings_jsonl.read_text().splitlines()]
    tok = session.tokenizer
    in_eval = [r for r in records if tuple(tok(r["text"], truncation=True, max_length=24)["input_ids"]) in texts]
    empty.write_text("".join(json.dumps(r) + "\n" for r in in_eval))
    res = _select(_cfg(tmp_path, docstrings_jsonl, name="less", target=str(empty)), tmp_path / "bad")
    assert res.exit_code == 2 and "gives no target examples" in res.output, res.output
