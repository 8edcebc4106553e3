"""The base model a run is loaded onto (issue 18 items 10 and 11): an encoder is never trained
as a causal LM, a base with the run's shapes but other weights is refused, and every command
that rebuilds a run (export, generate, compress) takes ``--model`` when the base has moved."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.testing import error_lines

BASE = {"model": {"task": "causal-lm"},
        "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 48, "limit": 48},
        "method": {"name": "lora", "r": 4},
        "optim": {"name": "adamw", "lr": 0.02},
        "train": {"steps": 2, "batch_size": 8, "progress": False, "save_every": 0}}
PROMPT = "Return the number of items in a container."


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def save_llama(folder, seed: int):
    """tiny-llama's architecture saved as a model folder, with weights drawn from ``seed``."""
    from rankwise.recipes.model import load_model
    model, tok = load_model("tiny-llama", "causal-lm", seed=seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A LoRA run trained on a model folder (not a tiny-* name, so its base can move)."""
    root = tmp_path_factory.mktemp("moved")
    base = save_llama(root / "base", seed=0)
    cfg = root / "run.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "model": {"path": str(base), "task": "causal-lm"}}))
    result = invoke("train", cfg, "--out", root / "run")
    assert result.exit_code == 0, result.output
    return root


def moved(run, tmp_path):
    """A copy of the run whose base folder is gone, and the base's new place."""
    shutil.copytree(run / "run", tmp_path / "run")
    shutil.copytree(run / "base", tmp_path / "elsewhere")
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    cfg["model"]["path"] = str(tmp_path / "gone")
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "run", tmp_path / "elsewhere"


# --- item 10: an encoder is not a causal LM ------------------------------------------------

@pytest.mark.parametrize("path, needle", [("demo", "the demo model (MiniLM"),
                                          ("tiny-bert", "tiny-bert (bert")])
def test_an_encoder_is_refused_as_a_causal_lm(tmp_path, path, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "model": {"path": path, "task": "causal-lm"}}))
    one_line_error(invoke("train", cfg, "--out", tmp_path / "out"), needle, "causal LM folder",
                   "task.name: classification")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# --- item 10: same shapes, other weights ---------------------------------------------------

@pytest.mark.slow
def test_export_onto_a_base_with_other_weights_is_refused(run, tmp_path):
    other = save_llama(tmp_path / "other", seed=1)   # tiny-llama's shapes, other weights
    one_line_error(invoke("export", run / "run", "--format", "merged", "--out", tmp_path / "m",
                          "--model", other),
                   "trained on other weights", "model.embed_tokens.weight differs",
                   "base model it was trained on")
    assert not (tmp_path / "m").exists()
    shutil.copytree(run / "base", tmp_path / "copy")  # the same base anywhere is accepted
    result = invoke("export", run / "run", "--format", "merged", "--out", tmp_path / "m",
                    "--model", tmp_path / "copy")
    assert result.exit_code == 0, result.output


# --- item 11: --model on generate and compress ---------------------------------------------

@pytest.mark.slow
def test_generate_of_a_moved_run_names_and_takes_model(run, tmp_path):
    before = invoke("generate", run / "run", "--prompt", PROMPT, "--max-new-tokens", "5")
    assert before.exit_code == 0, before.output
    run_dir, base = moved(run, tmp_path)
    one_line_error(invoke("generate", run_dir, "--prompt", PROMPT), "gone not found",
                   "base model has moved", "pass --model PATH")
    after = invoke("generate", run_dir, "--prompt", PROMPT, "--max-new-tokens", "5", "--model", base)
    assert after.exit_code == 0, after.output
    assert after.stdout == before.stdout  # the same greedy completion from the same weights


@pytest.mark.slow
def test_compress_of_a_moved_run_names_and_takes_model(run, tmp_path):
    run_dir, base = moved(run, tmp_path)
    cfg = tmp_path / "c.yaml"
    small = {"sequences": 2, "length": 16}
    cfg.write_text(yaml.safe_dump({"model": {"path": str(run_dir)},
                                   "compress": {"method": "none", "calibration": small, "heldout": small}}))
    one_line_error(invoke("compress", cfg, "--out", tmp_path / "c"), "base model has moved",
                   "pass --model PATH")
    assert not (tmp_path / "c").exists()
    result = invoke("compress", cfg, "--out", tmp_path / "c", "--model", base)
    assert result.exit_code == 0, result.output
    # the merged model compressed is the one export writes from the same run and base
    assert invoke("export", run_dir, "--format", "merged", "--out", tmp_path / "m",
                  "--model", base).exit_code == 0
    from safetensors.torch import load_file
    got, want = load_file(tmp_path / "c" / "model.safetensors"), load_file(tmp_path / "m" / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert report["heldout"]["before"] == report["heldout"]["after"]


def test_compress_model_without_a_run_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": "tiny-llama", "task": "causal-lm"},
                                   "compress": {"method": "none"}}))
    one_line_error(invoke("compress", cfg, "--out", tmp_path / "c", "--model", tmp_path),
                   "--model names the base model of a run", "set model.path")
