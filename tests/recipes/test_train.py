"""The training recipe: run folder contents, determinism, crash safety, resume. Every test here
trains through the recipe (12-step runs, several per test), so the module is in the slow tier;
the engine's own step, stops and callbacks are unit-tested in tests/engine/."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rankwise.errors import RankwiseError
from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train

TINY = {
    "model": {"path": "tiny-bert", "task": "classification"},
    "data": {"source": "demo", "max_length": 24, "limit": 192},
    "method": {"name": "lora", "r": 4, "targets": ["query", "value"], "dropout": 0.1},
    "optim": {"name": "adamw", "lr": 0.005},
    "train": {"steps": 12, "batch_size": 8, "save_every": 4, "log_every": 2, "eval_every": 6,
              "progress": False},
}
RANKWISE = str(Path(sys.executable).with_name("rankwise"))
pytestmark = pytest.mark.slow


def _run(tmp: Path, name: str, **train_over) -> dict:
    raw = json.loads(json.dumps(TINY))
    raw["train"].update(train_over)
    return train(load_run_config(None, base=raw), tmp / name)


def test_run_folder_holds_every_artifact(tmp_path):
    m = _run(tmp_path, "a")
    run = tmp_path / "a"
    for name in ("config.yaml", "events.jsonl", "metrics.json", "loss.png", "adapter"):
        assert (run / name).exists(), name
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["method"]["r"] == 4 and saved["model"]["num_labels"] == 8
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if "loss" in e] == [2, 4, 6, 8, 10, 12]
    assert any("eval_accuracy" in e for e in events)
    assert m["steps"] == 12 and 0.0 <= m["eval_accuracy"] <= 1.0
    # LoRA r=4 on query+value of 2 layers (32->32) plus the 32*8+8 head
    assert m["trainable_params"] == 2 * 2 * (4 * 32 + 32 * 4) + 32 * 8 + 8
    assert set(json.loads((run / "metrics.json").read_text())) >= {
        "eval_loss", "eval_accuracy", "trainable_params", "total_params", "steps",
        "train_time_s", "peak_memory_mb"}


def test_same_seed_same_metrics(tmp_path):
    a, b = _run(tmp_path, "a"), _run(tmp_path, "b")
    assert a["eval_loss"] == b["eval_loss"] and a["eval_accuracy"] == b["eval_accuracy"]
    c = _run(tmp_path, "c", seed=1)
    assert c["eval_loss"] != a["eval_loss"]


def test_resume_in_process_matches_uninterrupted(tmp_path):
    full = _run(tmp_path, "full")
    part = tmp_path / "part"  # the same run (a copy: it trains as the first), stopped after step 8
    shutil.copytree(tmp_path / "full", part)
    for p in (part / "metrics.json", part / "checkpoints" / "step-0000012"):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    raw = json.loads(json.dumps(TINY))
    resumed = train(load_run_config(None, base=raw), part, resume=True)
    assert resumed["eval_loss"] == full["eval_loss"]
    assert resumed["eval_accuracy"] == full["eval_accuracy"]


def test_existing_run_folder_is_refused_and_untouched(tmp_path):
    _run(tmp_path, "a")
    before = (tmp_path / "a" / "metrics.json").read_bytes()
    with pytest.raises(RankwiseError, match="already holds a run"):
        _run(tmp_path, "a")
    assert (tmp_path / "a" / "metrics.json").read_bytes() == before


def test_resume_with_a_different_config_is_refused(tmp_path):
    _run(tmp_path, "a")
    raw = json.loads(json.dumps(TINY))
    raw["optim"]["lr"] = 0.1
    with pytest.raises(RankwiseError, match="differs"):
        train(load_run_config(None, base=raw), tmp_path / "a", resume=True)


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path):
    raw = json.loads(json.dumps(TINY))
    raw["optim"]["lr"] = 1e12
    raw["train"].update(grad_clip=0.0, steps=40, save_every=1)
    with pytest.raises(RankwiseError, match="loss became"):
        train(load_run_config(None, base=raw), tmp_path / "nan")
    assert not (tmp_path / "nan" / "metrics.json").exists()
    assert (tmp_path / "nan" / "checkpoints").is_dir()


def _write_cfg(tmp: Path, steps: int) -> Path:
    raw = json.loads(json.dumps(TINY))
    raw["train"].update(steps=steps, save_every=5, eval_every=0, batch_size=16)
    raw["data"]["limit"] = 512
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def default_sigint() -> None:
    """Give the child the Ctrl-C a terminal gives: an ignored SIGINT is inherited across exec, and
    the suite itself may run with it ignored - a non-interactive shell starts background jobs
    (``make test &``, ``( ... ) &``) with SIGINT set to SIG_IGN, and Python then keeps it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_and_wait_for_checkpoint(cfg: Path, out: Path, step: int = 5) -> subprocess.Popen:
    """Start ``rankwise train CFG --out OUT`` in a process of its own and return it once the
    checkpoint of ``step`` is complete (its ``meta.json`` is written last); fail the test if the
    run exits first or takes over two minutes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([RANKWISE, "train", str(cfg), "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=default_sigint)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoints" / f"step-{step:07d}" / "meta.json").exists():
        if proc.poll() is not None:
            pytest.fail(f"training exited early: {proc.stderr.read().decode()[-500:]}")
        time.sleep(0.05)
    return proc


@pytest.mark.integration
@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    cfg = _write_cfg(tmp_path, steps=40)   # the kill lands at the step-5 checkpoint: 35 steps of room
    train(load_run_config(cfg), tmp_path / "ref")   # the reference needs no process of its own
    proc = start_and_wait_for_checkpoint(cfg, tmp_path / "killed")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "metrics.json").exists(), "run finished before the kill"
    res = subprocess.run([RANKWISE, "train", str(cfg), "--out", str(tmp_path / "killed"), "--resume"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-800:]
    a = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    b = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    assert (a["eval_loss"], a["eval_accuracy"], a["steps"]) == (b["eval_loss"], b["eval_accuracy"], b["steps"])


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_writes_checkpoint_and_exits_cleanly(tmp_path):
    cfg = _write_cfg(tmp_path, steps=400)
    proc = start_and_wait_for_checkpoint(cfg, tmp_path / "int")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-500:]
    assert "Traceback" not in err.decode() and "checkpoint saved" in err.decode()
    steps = [json.loads((p / "meta.json").read_text())["step"]
             for p in (tmp_path / "int" / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert max(steps) >= 5


def test_gora_resume_rebuilds_ranks_from_the_checkpoint_without_calibrating(tmp_path, monkeypatch):
    raw = json.loads(json.dumps(TINY))
    raw["method"] = {"name": "gora", "r": 2, "targets": ["query", "value"], "n_batches": 2}
    raw["train"].update(steps=8, save_every=4, eval_every=0)
    full = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "full")
    part = tmp_path / "part"  # the same run (a copy), stopped after step 4
    shutil.copytree(tmp_path / "full", part)
    ranks = (part / "ranks.json").read_bytes()
    shutil.rmtree(part / "checkpoints" / "step-0000008")
    (part / "metrics.json").unlink()

    import rankwise.adapters.gora.layer as gora_layer

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran again on resume")

    monkeypatch.setattr(gora_layer, "accumulate_gradients", no_calibration)
    resumed = train(load_run_config(None, base=json.loads(json.dumps(raw))), part, resume=True)
    assert (part / "ranks.json").read_bytes() == ranks
    assert resumed["eval_loss"] == full["eval_loss"] and resumed["trainable_params"] == full["trainable_params"]


def test_a_resume_at_the_last_step_keeps_the_trained_steps_peak(tmp_path):
    """A run stopped after its last checkpoint (Ctrl-C in the final evaluation) resumes at the
    last step and trains nothing: its peak is the one the checkpoint recorded for the steps,
    the evaluation's is reported apart, and the progress bar prints no ``loss nan``."""
    from io import StringIO

    from rich.console import Console
    first = _run(tmp_path, "a", progress=True)
    run = tmp_path / "a"
    recorded = json.loads((run / "checkpoints" / "step-0000012" / "meta.json").read_text())
    (run / "metrics.json").unlink()
    raw = json.loads(json.dumps(TINY))
    raw["train"]["progress"] = True
    out = StringIO()
    resumed = train(load_run_config(None, base=raw), run, resume=True,
                    console=Console(file=out, width=160))
    assert resumed["steps"] == 12 and recorded["memory_meter"] == resumed["memory_meter"]
    assert resumed["peak_memory_mb"] == recorded["peak_memory_mb"] > 0
    assert recorded["peak_memory_mb"] <= first["peak_memory_mb"]
    # the same final evaluation in both sessions, reported on its own (before, the resumed
    # peak_memory_mb was this evaluation's alone)
    assert 0 < resumed["eval_peak_memory_mb"] == first["eval_peak_memory_mb"] != resumed["peak_memory_mb"]
    text = out.getvalue()
    assert "resuming" in text and "12/12" in text and "loss -" in text and "nan" not in text
