"""A run's life on the command line (issue 18, items 9, 13, 14, 15): what ``train`` prints,
extending a run with ``--resume --set train.steps=N`` (a learning rate without a jump),
resuming a finished run, cleaning a checkpoint a kill left half-deleted, optimizers whose own
update would apply to nothing, ``list`` and an empty prompts file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from test_cli_errors import GOOD, assert_user_error, invoke, snapshot, write_yaml

from rankwise.recipes.resume import schedule_factor
from rankwise.testing import error_lines

LR = 0.01
RUN = {**GOOD, "optim": {"name": "adamw", "lr": LR},
       "data": {"source": "demo", "max_length": 16, "limit": 64},
       "train": {"steps": 4, "batch_size": 4, "progress": False, "save_every": 2, "log_every": 1,
                 "warmup_fraction": 0.25, "keep_checkpoints": 10}}


def train_run(tmp_path: Path, out: str, *args: str, raw: dict | None = None):
    cfg = write_yaml(tmp_path / "run.yaml", raw or RUN)
    return invoke("train", cfg, "--out", tmp_path / out, *args)


def lrs(run: Path) -> dict[int, float]:
    """The learning rate each logged step left for the next one."""
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["lr"] for e in events if "lr" in e}


@pytest.mark.slow
def test_train_prints_its_metrics_and_the_folder(tmp_path):
    result = train_run(tmp_path, "a")
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    lines = result.stdout.splitlines()
    assert lines[-1] == f"wrote {tmp_path / 'a'}"
    assert f"eval_loss {metrics['eval_loss']:.4g}" in lines[-2] and "steps 4" in lines[-2]


@pytest.mark.slow
def test_resume_of_a_finished_run_says_so_and_appends_nothing(tmp_path):
    assert train_run(tmp_path, "a").exit_code == 0
    before = snapshot(tmp_path / "a")
    result = train_run(tmp_path, "a", "--resume")
    assert result.exit_code == 0, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "is a finished run (4 of 4 steps" in lines[0], result.stderr
    assert "--set train.steps=8" in lines[0] and result.stdout == ""
    assert snapshot(tmp_path / "a") == before  # no second evaluation line, no "loss nan"


@pytest.mark.slow
def test_resume_of_a_finished_run_rewrites_only_a_corrupt_adapter(tmp_path):
    """What ``export`` suggests for a corrupt adapter: the last checkpoint writes it again, and
    nothing else in the folder changes."""
    assert train_run(tmp_path, "a").exit_code == 0
    weights = tmp_path / "a" / "adapter" / "adapter.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:100])
    before = snapshot(tmp_path / "a")
    result = train_run(tmp_path, "a", "--resume")
    assert result.exit_code == 0, result.output
    assert "again from the checkpoint of step 4" in result.stderr
    assert weights.read_bytes() == good
    after = snapshot(tmp_path / "a")
    assert {k for k in after if after[k] != before.get(k)} == {"adapter/adapter.safetensors"}


@pytest.mark.slow
def test_extending_a_finished_run_continues_the_schedule_without_a_jump(tmp_path):
    assert train_run(tmp_path, "a").exit_code == 0
    result = train_run(tmp_path, "a", "--resume", "--set", "train.steps=12")
    assert result.exit_code == 0, result.output
    assert "train.steps 4 -> 12" in result.stderr
    got = lrs(tmp_path / "a")
    assert sorted(got) == list(range(1, 13))
    # the lr logged after step s is the one step s + 1 uses. Steps 1-4: the run's own schedule
    # (warm-up of int(4 * 0.25) = 1 step, then linear to 0 at step 4)
    assert [got[s] for s in (1, 2, 3, 4)] == pytest.approx([LR * 1, LR * 2 / 3, LR * 1 / 3, 0.0])
    # then from 0 (where it stood) linearly over the new warm-up, w = int(12 * 0.25) = 3 steps,
    # to the new schedule's value at step 7, (12 - 7) / (12 - 3) = 5/9; then linear to 0 at 12
    factor = {4: 5 / 27, 5: 10 / 27, 6: 15 / 27, **{s: (12 - s) / 9 for s in range(7, 13)}}
    assert [got[s] for s in range(5, 13)] == pytest.approx([LR * factor[s] for s in range(5, 13)])
    assert schedule_factor(12, 0.25, [(4, 4)])(4) == pytest.approx(factor[4])  # step 5's, unlogged
    used = [LR, LR, LR * 2 / 3, LR * 1 / 3] + [LR * factor[s] for s in range(4, 12)]  # steps 1-12
    assert max(abs(b - a) for a, b in zip(used, used[1:])) <= LR / 3 + 1e-12  # no jump
    # restarting the schedule for 12 steps would have jumped from lr/3 to 8/9 of lr at step 5
    assert LR * 8 / 9 - used[3] > LR / 2
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["steps"] == 12
    assert yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["train"]["steps"] == 12


@pytest.mark.slow
def test_a_resume_inside_the_ramp_is_exact(tmp_path):
    """The checkpoint remembers the extension: stopping at step 6 (inside the ramp) and resuming
    ends where the uninterrupted extension ended."""
    for name in ("full", "cut"):
        assert train_run(tmp_path, name).exit_code == 0
        assert train_run(tmp_path, name, "--resume", "--set", "train.steps=12").exit_code == 0
    cut = tmp_path / "cut"
    meta = json.loads((cut / "checkpoints" / "step-0000006" / "meta.json").read_text())
    assert meta["schedule_extensions"] == [[4, 4]]
    for step in (8, 10, 12):
        shutil.rmtree(cut / "checkpoints" / f"step-{step:07d}")
    (cut / "metrics.json").unlink()
    result = train_run(tmp_path, "cut", "--resume", "--set", "train.steps=12")
    assert result.exit_code == 0, result.output
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())
    again = json.loads((cut / "metrics.json").read_text())
    assert (again["eval_loss"], again["eval_accuracy"]) == (full["eval_loss"], full["eval_accuracy"])
    factor = schedule_factor(12, 0.25, [(4, 4)])
    assert lrs(cut)[7] == pytest.approx(LR * factor(7)) == pytest.approx(LR * 5 / 9)


@pytest.mark.slow
def test_resume_names_the_differing_keys_and_refuses_fewer_steps_than_done(tmp_path):
    assert train_run(tmp_path, "a").exit_code == 0
    before = snapshot(tmp_path / "a")
    line = assert_user_error(train_run(tmp_path, "a", "--resume", "--set", "optim.lr=0.1",
                                       "--set", "train.seed=3"),
                             "optim.lr (0.1 here, 0.01 in the run)", "train.seed (3 here, 0 in the run)",
                             "only train.steps may change")
    assert "section" not in line
    assert_user_error(train_run(tmp_path, "a", "--resume", "--set", "train.steps=2"),
                      "train.steps 2 is below the 4 steps", "at least 4")
    assert snapshot(tmp_path / "a") == before


@pytest.mark.slow
def test_an_incomplete_checkpoint_left_by_a_kill_is_removed_and_resume_stays_exact(tmp_path):
    raw = json.loads(json.dumps(RUN))
    raw["train"].update(steps=8, keep_checkpoints=2)
    assert train_run(tmp_path, "full", raw=raw).exit_code == 0
    shutil.copytree(tmp_path / "full", tmp_path / "cut")  # the same run (a copy), then cut short
    cut = tmp_path / "cut" / "checkpoints"
    # pretend a kill -9 hit after step 6: checkpoint 8 and metrics.json not written yet, and the
    # rotation that followed checkpoint 6 had deleted all of step-2 but its state.pt
    shutil.rmtree(cut / "step-0000008")
    (tmp_path / "cut" / "metrics.json").unlink()
    (cut / "step-0000002").mkdir()
    shutil.copy(cut / "step-0000006" / "state.pt", cut / "step-0000002" / "state.pt")
    (cut / ".step-0000004.old").mkdir()  # a deletion interrupted after its rename
    (cut / ".step-0000004.old" / "trainable.safetensors").write_bytes(b"x")
    result = train_run(tmp_path, "cut", "--resume", raw=raw)
    assert result.exit_code == 0, result.output
    assert "removed the incomplete checkpoint" in result.stderr and "resuming" in result.stderr
    assert sorted(p.name for p in cut.iterdir()) == ["step-0000006", "step-0000008"]
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())
    again = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert (again["eval_loss"], again["eval_accuracy"]) == (full["eval_loss"], full["eval_accuracy"])


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["galore", "galore-is", "sumo", "q3r", "t-signsgd"])
def test_an_optimizer_whose_own_update_would_touch_nothing_is_refused(tmp_path, optim):
    """LoRA r=2 on query and value of 2 blocks (8 factors) plus the head's weight and bias: none
    is a block weight or a ternary tensor, so the run was AdamW bit for bit, silently."""
    line = assert_user_error(train_run(tmp_path, "out", "--set", f"optim.name={optim}"),
                             f"optimizer '{optim}' acts on", "method 'lora' trains none of them",
                             "all 10 trainable tensors would step as plain AdamW", "optim.name: adamw")
    assert ("lota-qaf" in line) == (optim == "t-signsgd")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_what_a_projected_optimizer_covers_is_printed_and_recorded(tmp_path):
    raw = json.loads(json.dumps(RUN))
    raw["method"] = {"name": "full"}
    raw["optim"] = {"name": "galore", "lr": LR, "rank": 4}
    result = train_run(tmp_path, "a", raw=raw)
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    # tiny-bert: 2 blocks of q, k, v, o (32 x 32) and the feed-forward pair (32 x 64, 64 x 32)
    projected = 2 * (4 * 32 * 32 + 2 * 32 * 64)
    assert (m["optim_own_update_tensors"], m["optim_own_update_params"]) == (12, projected)
    assert m["optim_adamw_params"] == m["trainable_params"] - projected
    assert "optimizer galore updates 12 of " in result.stderr
    assert f"its own way ({projected:,} of {m['trainable_params']:,} parameters)" in result.stderr
    adamw = train_run(tmp_path, "b")
    assert adamw.exit_code == 0 and "optim_own_update_params" not in json.loads(
        (tmp_path / "b" / "metrics.json").read_text())


def test_list_shows_compressors():
    result = invoke("list")
    assert result.exit_code == 0
    kinds = {line.split()[0] for line in result.stdout.splitlines()}
    assert kinds == {"method", "optimizer", "compressor", "strategy", "exporter", "task", "tracker", "command",
                     "kv-cache", "merge-rule", "schedule", "order", "select-rule", "reward", "steer"}
    assert any(line.split()[:2] == ["compressor", "wanda"] for line in result.stdout.splitlines())
    help_text = invoke("list", "--help").stdout
    assert "compressors" in help_text and "methods and optimizers." not in help_text


@pytest.mark.slow
def test_generate_from_an_empty_prompts_file(tmp_path):
    raw = {"model": {"path": "tiny-gpt2", "task": "causal-lm"},
           "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 32,
                    "limit": 16},
           "train": {"steps": 1, "batch_size": 4, "progress": False, "save_every": 0}}
    assert train_run(tmp_path, "lm", raw=raw).exit_code == 0
    for text in ("", "\n  \n"):
        (tmp_path / "p.jsonl").write_text(text)
        assert_user_error(invoke("generate", tmp_path / "lm", "--file", tmp_path / "p.jsonl"),
                          "p.jsonl is empty", "--prompt")
