"""A run's two exports score the same in lm-evaluation-harness (``lm_eval``'s ``hf`` model):
the merged folder as ``pretrained=MERGED`` and the PEFT folder as ``pretrained=BASE,peft=PEFT``,
on a local JSON multiple-choice task (nothing downloaded): every request's log-likelihood within
1e-4, the same accuracy (``docs/serving.md``, "Evaluating with lm-evaluation-harness")."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from rankwise.cli import main

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # trains a run through the CLI, then two lm_eval evaluations

CORPUS = ["def add(a, b):\n    return a + b\n", "def sub(a, b):\n    return a - b\n",
          "Return the sum of two numbers.", "Return the difference of two numbers."]
TASK = """task: rankwise_probe
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def _cli(*args) -> None:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def exports(tmp_path_factory, docstrings_jsonl):
    """A SentencePiece tiny Llama (it has a BOS, which lm_eval prefixes), a LoRA run on it and
    the run's merged and PEFT exports."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.data.tokenizer import TokenizerTrainConfig, train_tokenizer
    root = tmp_path_factory.mktemp("lm-eval")
    tok = train_tokenizer(iter(CORPUS * 4), TokenizerTrainConfig(vocab_size=300), root / "base")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(root / "base")
    (root / "run.yaml").write_text(yaml.safe_dump({
        "model": {"path": str(root / "base")}, "task": {"name": "causal-lm"},
        "data": {"source": str(docstrings_jsonl), "max_length": 32},
        "method": {"name": "lora", "r": 4, "alpha": 8, "targets": "all-linear"},
        "optim": {"name": "adamw", "lr": 0.02},
        "train": {"steps": 4, "batch_size": 4, "save_every": 0, "progress": False}}))
    _cli("train", root / "run.yaml", "--out", root / "run")
    _cli("export", root / "run", "--format", "merged", "--out", root / "merged")
    _cli("export", root / "run", "--format", "peft", "--out", root / "peft")
    docs = [{"question": f"Return the {w} of two numbers.", "choices": ["def add(a, b):", "def sub(a, b):"],
             "label": i} for i, w in enumerate(("sum", "difference"))] * 3
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "tasks").mkdir()
    (root / "tasks" / "probe.yaml").write_text(TASK.format(docs=root / "docs.jsonl"))
    return root


def _evaluate(tasks, model_args: dict) -> dict:
    return lm_eval.simple_evaluate(model="hf", model_args={**model_args, "dtype": "float32"},
                                   tasks=["rankwise_probe"], device="cpu", batch_size=4,
                                   task_manager=tasks, log_samples=True)


def _loglikelihoods(result: dict) -> list[float]:
    return [ll for s in result["samples"]["rankwise_probe"] for (ll, _greedy), in s["resps"]]


def test_the_peft_export_and_the_merged_export_score_the_same(exports, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager
    # one index of our task folder alone, for the three evaluations (indexing lm_eval's ~14k
    # built-in task files took ~5 CPU-s per evaluation and none of them is used)
    tasks = TaskManager(include_path=str(exports / "tasks"), include_defaults=False)
    merged = _evaluate(tasks, {"pretrained": str(exports / "merged")})
    peft = _evaluate(tasks, {"pretrained": str(exports / "base"), "peft": str(exports / "peft")})
    base = _evaluate(tasks, {"pretrained": str(exports / "base")})
    ours, theirs, before = _loglikelihoods(merged), _loglikelihoods(peft), _loglikelihoods(base)
    assert len(ours) == 12  # 6 questions x 2 choices
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    assert merged["results"]["rankwise_probe"]["acc,none"] == peft["results"]["rankwise_probe"]["acc,none"]
    # the adapter is in both: the trained run scores differently from its base
    assert max(abs(a - b) for a, b in zip(ours, before)) > 1e-3
