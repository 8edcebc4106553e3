"""``rankwise continual``: bad input ends with one line and exit code 2, before any model loads."""
import pytest
from click.testing import CliRunner

from rankwise import configs
from rankwise.cli import main
from rankwise.data.demo import PACKAGES
from rankwise.commands.continual.run import DEMO_TASKS, ContinualConfig, load_config, parse_tasks
from rankwise.testing import error_lines


@pytest.mark.parametrize("tasks, says", [
    ("asyncio,email/http,numpy", "unknown class 'numpy' in task 2"),
    ("asyncio,email//http", "task 2 has no classes"),
    ("asyncio,email,http", "at least 2 tasks, got 1"),
    ("asyncio/asyncio", "class 'asyncio' is in two tasks"),
])
def test_bad_tasks_one_line_exit_2(tmp_path, tasks, says):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("continual: {steps_per_task: 1}\n")
    result = CliRunner().invoke(main, ["continual", str(cfg), "--tasks", tasks])
    assert result.exit_code == 2
    lines = error_lines(result.output)
    assert len(lines) == 1 and lines[0].startswith("error: --tasks:") and says in lines[0]


def test_bad_config_one_line_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("continual: {stepz: 1}\n")
    result = CliRunner().invoke(main, ["continual", str(cfg), "--tasks", DEMO_TASKS])
    assert result.exit_code == 2 and "continual.stepz: unknown key" in result.output
    result = CliRunner().invoke(main, ["continual", str(cfg), "--tasks", DEMO_TASKS, "--method", "ewc"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1


def test_demo_split_is_four_tasks_of_two_packages_and_config_reads_yaml(tmp_path):
    tasks = parse_tasks(DEMO_TASKS, PACKAGES)
    assert [len(t) for t in tasks] == [2, 2, 2, 2] and sorted(c for t in tasks for c in t) == sorted(PACKAGES)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("continual: {steps_per_task: 3, tau: 0.5}\n")
    c = load_config(cfg, overrides={"method": "joint"})
    assert (c.steps_per_task, c.tau, c.method, c.candidates) == (3, 0.5, "joint", 2)
    assert (c.gate, ContinualConfig().tau, c.matcher) == ("gen", -10.0, "tii")    # the released rule


def test_config_is_read_by_the_one_reader_with_set(tmp_path):
    """``lr: 1e-3`` is a number (YAML 1.2), ``--set`` takes KEY or continual.KEY, and every bad
    key and value of the file and the overrides is in one line."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("continual: {lr: 1e-3, steps_per_task: 3}\n")
    c = load_config(cfg, ["head_lr=5e-2", "continual.r=4"], {"method": "joint"})
    assert (c.lr, c.head_lr, c.r, c.steps_per_task, c.method) == (1e-3, 5e-2, 4, 3, "joint")
    assert isinstance(c.lr, float)
    cfg.write_text("lr: 1e-3\nr: 0\n")                                 # keys at the top level
    result = CliRunner().invoke(main, ["continual", str(cfg), "--tasks", DEMO_TASKS, "--set", "lr=fast"])
    lines = error_lines(result.stderr)
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "continual.lr: got 'fast'; expected a number" in lines[0]
    result = CliRunner().invoke(main, ["continual", str(cfg), "--tasks", DEMO_TASKS])
    assert result.exit_code == 2 and "continual.r must be >= 1, got 0" in result.stderr


def test_bad_gate_settings_are_all_reported_in_one_line():
    msg = "; ".join(configs.problems_of(ContinualConfig(gate="msp", matcher="oracle", val_per_class=-1)))
    assert "tau -10.0 with gate msp" in msg and "matcher 'oracle'" in msg and "val_per_class" in msg


@pytest.mark.slow
def test_hrm_pet_end_to_end_on_a_tiny_model_keeps_earlier_head_rows():
    from rankwise.commands.continual.run import ContinualConfig, run_continual
    tasks = parse_tasks("asyncio,email/http,importlib/logging,xml", PACKAGES)
    rec = run_continual(ContinualConfig(model="tiny-bert", steps_per_task=2, batch_size=4, eval_per_class=2,
                                        key_examples=4), tasks)
    assert rec["head_drift"] == 0.0        # rows of earlier tasks' classes never move
    assert rec["primary"] == "tii:hrm"
    for rule in ("tii:match", "tii:hrm", "tii:hrm-tuned", "keys:match", "keys:direct", "oracle"):
        m = rec["rules"][rule]["matrix"]
        assert [len(row) for row in m] == [1, 2, 3]
        assert rec["rules"][rule]["average_accuracy"] == pytest.approx(sum(m[-1]) / 3)
    for m in ("tii", "keys"):
        assert len(rec["rematch"][m]["switched"]) == 3 and rec["rematch"][m]["unsure"][0] == 0
        assert rec["rematch"][m]["tau_tuned"][0] == -10.0           # nothing to tune with one task
