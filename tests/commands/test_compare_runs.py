"""A comparison's runs: ``--jobs N`` gives the numbers of ``--jobs 1``; a finished run is reused
from its small files alone (on another checkout too) and only while its resolved config is
unchanged; an interrupted run continues from its checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from rankwise.errors import RankwiseError
from rankwise.recipes import runs
from rankwise.commands.compare.run import run_compare

BASE = {
    "model": {"path": "tiny-bert", "task": "classification"},
    "method": {"name": "lora", "r": 4, "alpha": 8, "targets": ["query", "value"]},
    "optim": {"name": "adamw", "lr": 0.005},
    "train": {"steps": 3, "batch_size": 8, "eval_batch_size": 64, "save_every": 0, "log_every": 1,
              "progress": False},
}
WORDS = {"cat": "feline whiskers purr", "dog": "canine bark fetch", "fish": "fins swim gills"}
NUMBERS = ("eval_accuracy", "eval_loss", "trainable_params")


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data path relative to the working folder, as a checkout has it
    rows = [{"text": f"{WORDS[lab]} {i}", "label": lab} for i in range(12) for lab in WORDS]
    (tmp_path / "pets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "cmp.yaml"
    path.write_text(yaml.safe_dump({**BASE, "data": {"source": "pets.jsonl", "max_length": 8,
                                                     "eval_fraction": 0.25}}))
    return path


def numbers(result: dict) -> dict:
    return {row: [{k: m[k] for k in NUMBERS} | {"curve": m.get("eval_history")} for m in r["runs"]]
            for row, r in result["rows"].items()}


@pytest.mark.slow
@pytest.mark.integration
def test_two_jobs_give_the_numbers_of_one(config, tmp_path):
    """Two worker processes (one torch thread each) against one process: same metrics."""
    one = run_compare(config, ["lora"], 2, [], tmp_path / "one", jobs=1)
    two = run_compare(config, ["lora"], 2, [], tmp_path / "two", jobs=2)
    assert numbers(one) == numbers(two)
    for row in ("lora",):
        for k in (0, 1):
            a, b = (json.loads((tmp_path / o / row / f"seed{k}" / "metrics.json").read_text())
                    for o in ("one", "two"))
            assert a["eval_loss"] == b["eval_loss"] and a["eval_accuracy"] == b["eval_accuracy"]


@pytest.mark.slow
def test_finished_runs_are_reused_from_their_small_files_on_another_checkout(config, tmp_path, monkeypatch):
    first = run_compare(config, ["lora"], 2, [], tmp_path / "cmp")
    # what a repository keeps of a comparison: the records, no weights, no checkpoints
    records = tmp_path / "clone"
    shutil.copytree(tmp_path, records / "work", ignore=shutil.ignore_patterns("adapter", "checkpoints", "clone"))
    monkeypatch.chdir(records / "work")                       # another checkout of the same files
    trained = []
    monkeypatch.setattr("rankwise.recipes.train.train", lambda *a, **k: trained.append(a) or {})
    again = run_compare(records / "work" / "cmp.yaml", ["lora"], 2, [], records / "work" / "cmp")
    assert trained == [] and numbers(again) == numbers(first)


def test_the_hash_is_of_the_resolved_config():
    """Writing a default out changes nothing; changing a value (or a default in code, which
    changes the resolved config the same way) changes the hash."""
    from rankwise.adapters.lora import LoraConfig
    plan = {**BASE, "data": {"source": "demo"}}
    explicit = {**plan, "method": {**plan["method"], "dropout": LoraConfig().dropout}}
    changed = {**plan, "method": {**plan["method"], "dropout": LoraConfig().dropout + 0.25}}
    quiet = {**plan, "train": {**plan["train"], "progress": True}}
    assert runs.config_hash(plan) == runs.config_hash(explicit) == runs.config_hash(quiet)
    assert runs.config_hash(changed) != runs.config_hash(plan)


@pytest.mark.slow
def test_a_changed_resolved_config_never_reuses_a_stale_run(config, tmp_path, monkeypatch):
    run_compare(config, ["lora"], 1, [], tmp_path / "cmp")
    run_dir = tmp_path / "cmp" / "lora" / "seed0"
    plan, digest = runs.read_plan(run_dir)
    assert digest == runs.config_hash(plan) and (run_dir / "metrics.json").is_file()
    # the record of a run whose resolved config was another (an older default): same plan
    (run_dir / runs.PLAN).write_text(json.dumps({"plan": plan, "config_sha256": "0" * 64}))
    from rankwise.recipes import train as train_mod
    trained = []
    monkeypatch.setattr(train_mod, "train", lambda cfg, out, **k: trained.append(k) or {"eval_loss": 0.0})
    run_compare(config, ["lora"], 1, [], tmp_path / "cmp")
    assert trained == [{"resume": False, "console": trained[0]["console"]}]
    assert runs.read_plan(run_dir) == (plan, digest) and not (run_dir / "metrics.json").exists()


@pytest.mark.slow
def test_an_interrupted_run_continues_from_its_checkpoint(config, tmp_path, monkeypatch):
    from rankwise.recipes import train as train_mod
    run_compare(config, ["lora"], 1, ["train.save_every=1"], tmp_path / "cmp")
    run_dir = tmp_path / "cmp" / "lora" / "seed0"
    (run_dir / "metrics.json").unlink()                       # as if killed after a checkpoint
    trained = []
    monkeypatch.setattr(train_mod, "train", lambda cfg, out, **k: trained.append(k["resume"]) or {"eval_loss": 0.0})
    run_compare(config, ["lora"], 1, ["train.save_every=1"], tmp_path / "cmp")
    assert trained == [True]


def test_foreign_folders_and_bad_jobs_are_refused(config, tmp_path):
    (tmp_path / "cmp" / "lora" / "seed0").mkdir(parents=True)
    (tmp_path / "cmp" / "lora" / "seed0" / "notes.txt").write_text("mine")
    with pytest.raises(RankwiseError, match="not a comparison"):  # no record: not compare's folder
        run_compare(config, ["lora"], 1, [], tmp_path / "cmp")
    (tmp_path / "cmp" / "rankwise.json").write_text('{"kind": "compare"}')
    with pytest.raises(RankwiseError, match="not this comparison's"):
        run_compare(config, ["lora"], 1, [], tmp_path / "cmp")
    with pytest.raises(RankwiseError, match="--jobs: got 0"):
        run_compare(config, ["lora"], 1, [], tmp_path / "other", jobs=0)


def test_a_worker_stopped_by_ctrl_c_is_an_interrupt_with_the_way_to_continue(config, tmp_path, monkeypatch):
    """Ctrl-C reaches a worker before the parent: its KeyboardInterrupt (no message) was shown as
    ``error: runs/cmp2/lora/seed1: `` with exit 2 (issue 32, item 8); now exit 130 and one line."""
    import concurrent.futures as cf

    from click.testing import CliRunner

    from rankwise.cli import main

    class Pool:  # workers whose run was interrupted, in this process
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, fn, *args):
            fut = cf.Future()
            fut.set_exception(KeyboardInterrupt())
            return fut

        def shutdown(self, **kwargs):
            pass

    monkeypatch.setattr(cf, "ProcessPoolExecutor", Pool)
    res = CliRunner().invoke(main, ["compare", str(config), "--methods", "lora", "--seeds", "2",
                                    "--jobs", "2", "--out", str(tmp_path / "cmp2")])
    assert res.exit_code == 130, res.output
    assert res.stderr.strip().splitlines()[-1] == "interrupted; rerun the same command to continue"
    assert "error" not in res.output


@pytest.mark.slow
@pytest.mark.integration
def test_ctrl_c_stops_every_job_and_keeps_finished_runs(config, tmp_path):
    """SIGINT to ``rankwise compare --jobs 2`` once a run has finished: every process ends and
    the finished runs stay with the record that makes the same command reuse them (tested above)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "rankwise", "compare", str(config), "--methods", "lora", "--seeds", "3",
           "--jobs", "2", "--out", str(out), "--set", "train.steps=20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal
    deadline = time.time() + 240
    while not list(out.glob("lora/seed*/metrics.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
    os.killpg(proc.pid, signal.SIGINT)                        # what Ctrl-C in a terminal sends
    assert proc.wait(timeout=120) == 130
    said = proc.stdout.read().decode().strip().splitlines()
    # (a loaded machine can add multiprocessing's resource_tracker line about a semaphore of a
    # killed worker after ours; it is Python's shutdown, not the command's last word)
    said = [line for line in said if "resource_tracker" not in line and "warnings.warn(" not in line]
    assert said[-1] == "interrupted; rerun the same command to continue", said[-5:]
    finished = {p: p.stat().st_mtime_ns for p in out.glob("lora/seed*/metrics.json")}
    assert finished and len(finished) < 3
    for _ in range(20):                                       # no worker left behind
        alive = subprocess.run(["pgrep", "-a", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        if not alive:
            break
        time.sleep(0.5)
    assert alive == ""
    for path in finished:
        plan, digest = runs.read_plan(path.parent)
        assert digest == runs.config_hash(plan)


@pytest.mark.slow
def test_a_comparison_resumed_with_other_threads_still_owns_its_runs(config, tmp_path, monkeypatch):
    """train.threads (like train.progress) changes how fast, not what: a later command with
    another thread count reuses the finished runs instead of refusing their folders."""
    first = run_compare(config, ["lora"], 1, ["train.threads=1"], tmp_path / "cmp")
    from rankwise.recipes import train as train_mod
    monkeypatch.setattr(train_mod, "train", lambda *a, **k: pytest.fail("retrained"))
    again = run_compare(config, ["lora"], 1, ["train.threads=2"], tmp_path / "cmp")
    assert numbers(again) == numbers(first)


def test_a_run_recorded_in_the_old_task_spelling_is_owned_by_the_new_one(tmp_path):
    """A comparison recorded with ``model.task`` and resumed after its config moved to
    ``task:`` still owns its folders (the same plan, spelled twice); another plan does not."""
    old = {"model": {"path": "demo", "task": "classification"}, "method": {"name": "lora"},
           "train": {"threads": 1}}
    new = {"model": {"path": "demo"}, "task": {"name": "classification"}, "method": {"name": "lora"}}
    (tmp_path / runs.PLAN).write_text(json.dumps({"plan": old, "config_sha256": "x"}))
    runs.check_owned(tmp_path, new)
    with pytest.raises(RankwiseError, match="not this comparison's"):
        runs.check_owned(tmp_path, {**new, "method": {"name": "dora"}})


def test_every_committed_comparison_record_is_still_reused():
    """The per-run records committed under bench/results/ are reused by a rerun of their table's
    command only while their resolved config hashes as it did: a new config key must enter the
    hash at its neutral default as absent (runs.NEUTRAL_NEW), or every committed run goes stale."""
    from pathlib import Path

    from rankwise.recipes.runs import config_hash, read_plan
    root = Path(__file__).resolve().parents[2] / "bench" / "results"
    plans = sorted(root.glob("**/compare_plan.json"))
    assert len(plans) >= 14
    stale = [str(p.parent.relative_to(root)) for p in plans
             if (h := read_plan(p.parent))[1] and config_hash(h[0]) != h[1]]
    assert stale == []


@pytest.mark.slow
def test_one_compare_process_keeps_its_memory_flat_over_six_minilm_runs(tmp_path, monkeypatch):
    """Six sequential MiniLM runs in one ``compare`` (LoRA, 6 seeds): the resident set after the
    last is within 10 % of the one after the second. The cyclic garbage collector is off, as it
    all but is in a long comparison (a large heap runs full collections seldom): before the CPU
    memory meter dropped each step's profiler events itself, one compare grew to 24 GB over 9
    MiniLM runs and was killed."""
    import gc

    from rankwise.memory import rss_mb
    real, sizes = runs.run_one, []

    def measured(*args, **kwargs):
        metrics = real(*args, **kwargs)
        sizes.append(rss_mb())
        return metrics
    monkeypatch.setattr(runs, "run_one", measured)
    base = {"model": {"path": "demo", "task": "classification"},
            "data": {"source": "demo", "max_length": 32, "eval_fraction": 0.05},  # one eval batch
            "method": {"name": "lora", "r": 8, "alpha": 16, "targets": "all-linear"},
            "optim": {"name": "adamw", "lr": 0.003},
            "train": {"steps": 2, "batch_size": 8, "eval_batch_size": 128, "eval_every": 0,
                      "save_every": 0, "progress": False}}
    gc.collect()
    gc.disable()
    try:
        run_compare(None, ["lora"], 6, [], tmp_path / "cmp", base=base)
    finally:
        gc.enable()
    assert len(sizes) == 6
    assert sizes[-1] <= 1.10 * sizes[1], sizes
