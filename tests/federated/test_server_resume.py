"""A federated run survives its server dying: SIGKILL after a round's checkpoint, then
``resume`` continues from it and ends with the evaluation numbers of an uninterrupted run (for
a single-model strategy and for FedLEASE, whose clusters come back by data partition). The
resumed federation's nodes are new (other node ids, no copy of the adapter), so only the bytes
differ: they include the first-contact resync."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from rankwise.errors import RankwiseError
from rankwise.federated.checkpoint import list_rounds
from rankwise.federated.inprocess import run_inprocess

from fed_helpers import toy_config, write_toy_data

EVAL = ("round", "eval_loss", "eval_accuracy", "aggregated", "sampled", "train_loss")


def evals(run) -> list[dict]:
    lines = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]
    return [{k: e.get(k) for k in EVAL} for e in lines]


def killed_after(path, out, rounds_done: int) -> None:
    """Run the federation in a child process and SIGKILL it once round ``rounds_done`` is
    checkpointed (between rounds: the next round has not been checkpointed)."""
    code = ("import sys; from rankwise.federated.inprocess import run_inprocess; "
            "run_inprocess(sys.argv[1], sys.argv[2], node_ids=[21, 22, 23])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=os.path.dirname(__file__))
    target = out / "checkpoints" / f"round-{rounds_done:04d}"
    deadline = time.time() + 300
    while not (target / "round.json").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and (target / "round.json").is_file()
    assert not (out / "metrics.json").exists()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["fedit", "fedlease"])
def test_resume_after_sigkill_ends_like_an_uninterrupted_run(tmp_path, strategy):
    raw = toy_config(write_toy_data(tmp_path / "toy.jsonl", n=96), strategy=strategy, clients=3,
                     rounds=4, local_steps=2, fraction=0.67, min_clients=2)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    whole = run_inprocess(path, tmp_path / "whole", node_ids=[11, 12, 13])
    out = tmp_path / "killed"
    killed_after(path, out, rounds_done=2)
    resumed = run_inprocess(path, out, node_ids=[31, 32, 33], resume=True)   # a new federation
    assert evals(out) == evals(tmp_path / "whole")
    for key in ("eval_loss", "eval_accuracy", "rounds", "initial_eval_accuracy"):
        assert resumed.get(key) == whole.get(key), key
    assert resumed["resumed_after_round"] >= 2
    if strategy == "fedlease":
        assert resumed["fedlease_experts"] == whole["fedlease_experts"]
    assert [p.name for p in list_rounds(out)] == ["round-0003", "round-0004"]   # the newest two


@pytest.mark.slow
def test_resume_needs_a_checkpoint_of_the_same_strategy(tmp_path):
    raw = toy_config(write_toy_data(tmp_path / "toy.jsonl", n=48), strategy="fedit", clients=2,
                     rounds=1, local_steps=1, min_clients=2)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RankwiseError, match="no completed round to resume"):
        run_inprocess(path, tmp_path / "none", resume=True)
    run_inprocess(path, tmp_path / "done")
    (tmp_path / "done" / "metrics.json").unlink()
    raw["federated"]["strategy"] = "ffa-lora"
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    with pytest.raises(RankwiseError, match="written by strategy 'fedit'"):
        run_inprocess(other, tmp_path / "done", resume=True)
