"""``rankwise federated``: config checks (fast) and one real Flower simulation (slow): four
clients x two rounds on a tiny BERT, one sending NaN and one crashing."""
from __future__ import annotations

import json

import pytest

from rankwise.errors import RankwiseError
from rankwise.federated.run import resolve, run_federated

from fed_helpers import toy_config, write_toy_data


def test_config_errors_name_the_fix(tmp_path):
    data = write_toy_data(tmp_path / "toy.jsonl")
    with pytest.raises(RankwiseError, match="unknown strategy 'fedavg'.*expected one of: fedit"):
        resolve(None, [], toy_config(data, strategy="fedavg"))
    for name in ("fedlease", "ffa-lora", "rolora", "yoco"):    # strategies with needs_factors
        cfg = toy_config(data, strategy=name)
        cfg["method"] = {"name": "full"}
        with pytest.raises(RankwiseError, match=f"{name} needs method.name: lora .*: gora, lora\\); got 'full'"):
            resolve(None, [], cfg)
    cfg = toy_config(data, strategy="yoco")
    cfg["method"] = {"name": "gora", "r": 4}
    assert resolve(None, [], cfg)[0].method.name == "gora"     # factorized: accepted
    cfg = toy_config(data, strategy="fedit")
    cfg["method"] = {"name": "full"}
    assert resolve(None, [], cfg)[1].strategy_name() == "fedit"
    with pytest.raises(RankwiseError, match="faults: partitions \\['7'\\] do not exist"):
        resolve(None, [], toy_config(data, faults={"7": "nan"}))
    with pytest.raises(RankwiseError, match="federated.strategy.pca_components"):
        resolve(None, [], toy_config(data, strategy={"name": "yoco", "pca_components": 0}))
    with pytest.raises(RankwiseError, match="federated.fraction: got 0.0"):
        resolve(None, ["federated.fraction=0.0"], toy_config(data))


def test_cli_reports_config_error_in_one_line(tmp_path):
    from click.testing import CliRunner

    from rankwise.cli import main
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("federated: {strategy: rolora, partition: iid}\n")
    res = CliRunner().invoke(main, ["federated", str(cfg), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "federated.partition" in res.output and "natural" in res.output


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """One shared simulation run (Flower simulation runtime, Ray)."""
    root = tmp_path_factory.mktemp("fedsim")
    data = write_toy_data(root / "toy.jsonl")
    cfg = toy_config(data, strategy="rolora", clients=4, faults={"2": "nan", "3": "crash"})
    out = root / "run"
    metrics = run_federated(None, [], out, base=cfg)
    return out, metrics


@pytest.mark.slow
def test_simulation_survives_bad_and_crashed_clients(simulated):
    out, m = simulated
    assert m["rounds"] == 2 and m["strategy"] == "rolora" and 0.0 <= m["eval_accuracy"] <= 1.0
    lines = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert [e["round"] for e in lines] == [0, 1, 2]
    for e in lines[1:]:
        assert e["sampled"] == 4 and e["aggregated"] == 2
        assert len(e["rejected"]) == 1 and len(e["failed"]) == 1
    assert len(m["rejected"]) == 1 and len(m["failed"]) == 1 and m["rejected"] != m["failed"]
    assert m["bytes_up"] == sum(e["bytes_up"] for e in lines) > 0
    assert m["bytes_down"] == sum(e["bytes_down"] for e in lines) > 0
    # round 1 trains B (no download but configs), round 2 sends the new B down to all four
    assert lines[1]["bytes_down"] < lines[2]["bytes_down"] / 10
    assert (out / "results.md").read_text().count("| rolora |") == 1
    assert (out / "accuracy_vs_bytes.png").stat().st_size > 1000
    assert (out / "config.yaml").is_file()
    with pytest.raises(RankwiseError, match="already holds a finished run"):
        run_federated(None, [], out, base=toy_config(write_toy_data(out.parent / "t2.jsonl")))


def test_results_plot_the_metric_the_task_has(tmp_path):
    """A causal-LM run has no accuracy: its curve is the eval loss against the bytes sent (it
    wrote no plot at all). A classification run keeps ``accuracy_vs_bytes.png``."""
    from rankwise.federated.run import write_results

    def fake_run(folder, metrics):
        folder.mkdir()
        rounds = [{"round": r, "bytes_up": 100 * r, "bytes_down": 50 * r, "cum_bytes": 150 * r * (r + 1) // 2,
                   "aggregated": 2, **{k: round(v - 0.1 * r, 6) for k, v in metrics.items()}} for r in range(3)]
        (folder / "rounds.jsonl").write_text("".join(json.dumps(e) + "\n" for e in rounds))
        (folder / "metrics.json").write_text(json.dumps({
            **{k: round(v - 0.2, 6) for k, v in metrics.items()}, "strategy": "fedavg", "rounds": 2, "bytes_up": 300,
            "bytes_down": 150, "bytes_total": 450, "rejected": [], "failed": [], "missing": []}))
        return folder

    lm = fake_run(tmp_path / "lm", {"eval_loss": 4.2, "eval_perplexity": 66.7})
    rows = write_results({"fedavg": lm}, lm)
    assert (lm / "loss_vs_bytes.png").stat().st_size > 1000 and not (lm / "accuracy_vs_bytes.png").exists()
    assert rows["fedavg"]["eval_loss"] == 4.0 and [e["eval_loss"] for e in rows["fedavg"]["per_round"]] == [4.2, 4.1, 4.0]
    cls = fake_run(tmp_path / "cls", {"eval_accuracy": 0.5, "eval_loss": 1.0})
    write_results({"fedavg": cls}, cls)
    assert (cls / "accuracy_vs_bytes.png").stat().st_size > 1000 and not (cls / "loss_vs_bytes.png").exists()
