"""Pretraining from scratch (``model.init``, ``model.train_tokenizer``, ``data.split_long``): a
folder holding only ``config.json`` starts from random weights with a tokenizer learned from the
run's training text; the result loads in plain transformers; a SIGKILL-ed run resumes bit for
bit; two torchrun processes give one process's numbers; ``rankwise plan`` sizes it."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rankwise.data.corpus import load_source_records
from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train
from tests.recipes.test_train import start_and_wait_for_checkpoint
from tests.recipes.torchrun_helpers import ENV, losses, torchrun

pytestmark = pytest.mark.slow
VOCAB = 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Real text nobody here wrote: the json and email packages' modules, one record each."""
    path = tmp_path_factory.mktemp("corpus") / "modules.jsonl"
    records = [r for r in load_source_records() if r["id"].split(".")[0] in ("json", "email")]
    path.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> Path:
    from transformers import LlamaConfig
    out = tmp_path_factory.mktemp("llama-config")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64, vocab_size=32000,
                tie_word_embeddings=True).save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    return out


def raw(corpus: Path, folder: Path, steps: int = 6, **train_over) -> dict:
    return {"model": {"path": str(folder), "task": "causal-lm",
                      "train_tokenizer": {"vocab_size": VOCAB}},
            "data": {"source": str(corpus), "max_length": 32, "split_long": True, "packing": True,
                     "eval_fraction": 0.2},
            "method": {"name": "full"}, "optim": {"name": "adamw", "lr": 0.01},
            "train": {"steps": steps, "batch_size": 8, "eval_batch_size": 32, "save_every": 2,
                      "eval_every": 0, "log_every": 1, "threads": 1, "progress": False, **train_over}}


@pytest.fixture(scope="module")
def run(corpus, config_only, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pretrain") / "run"
    train(load_run_config(None, base=raw(corpus, config_only)), out)
    return out


def test_a_config_only_folder_pretrains_with_its_own_tokenizer(run):
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    first, last = losses(run)[0], losses(run)[-1]
    assert abs(first - math.log(VOCAB)) < 0.3            # random weights: near-uniform predictions
    assert last < first - 0.5                            # and it learns
    assert {"tokenizer.model", "tokenizer.json"} <= {p.name for p in (run / "tokenizer").iterdir()}
    model = AutoModelForCausalLM.from_pretrained(str(run / "model"))
    tok = AutoTokenizer.from_pretrained(str(run / "model"))
    assert model.config.vocab_size == len(tok) == VOCAB  # sized to the learned tokenizer, not 32000
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 2)
    assert (run / "model" / "tokenizer.model").is_file()  # the SentencePiece file travels with it
    sp = spm.SentencePieceProcessor(model_file=str(run / "model" / "tokenizer.model"))
    text = "def dumps(obj, *, indent=None):\n    return obj\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["trainable_params"] == metrics["total_params"] == model.num_parameters()


@pytest.mark.integration
def test_sigkill_then_resume_equals_uninterrupted(run, corpus, config_only, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw(corpus, config_only)))
    out = tmp_path / "killed"
    proc = start_and_wait_for_checkpoint(cfg, out, step=2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "metrics.json").exists(), "run finished before the kill"
    res = subprocess.run([sys.executable, "-m", "rankwise", "train", str(cfg), "--out", str(out), "--resume"],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-800:]
    assert "learning a" not in res.stderr                  # the tokenizer is read back, not learned again
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (run, out))
    assert a["eval_loss"] == b["eval_loss"] and a["steps"] == b["steps"] == 6
    assert losses(out) == losses(run)


@pytest.mark.integration
def test_two_torchrun_processes_give_one_process_numbers(run, corpus, config_only, tmp_path):
    """FSDP2 over every weight of the random model (rank 0 learns the tokenizer, rank 1 waits
    for it): the step losses and final loss of the single process."""
    proc = torchrun(tmp_path, tmp_path / "two", "train.distributed=fsdp", raw=raw(corpus, config_only))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((d / "metrics.json").read_text()) for d in (run, tmp_path / "two"))
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert losses(tmp_path / "two") == pytest.approx(losses(run), rel=1e-5)


def test_plan_sizes_the_vocabulary_to_the_tokenizer_it_will_learn(corpus, config_only, tmp_path):
    from rankwise.cli import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw(corpus, config_only)))
    res = CliRunner().invoke(main, ["plan", str(cfg), "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = LlamaConfig.from_pretrained(str(config_only))
    shape.vocab_size = VOCAB                            # never the config's 32,000 rows
    assert json.loads(res.output)["trainable_params"] == LlamaForCausalLM(shape).num_parameters()


def test_bf16_with_checkpointing_pretrains(corpus, config_only, tmp_path):
    out = tmp_path / "bf16"
    metrics = train(load_run_config(None, base=raw(corpus, config_only, precision="bf16",
                                                   gradient_checkpointing=True)), out)
    assert math.isfinite(metrics["eval_loss"]) and losses(out)[-1] < losses(out)[0] - 0.5
