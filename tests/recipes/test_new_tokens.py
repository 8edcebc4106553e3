"""New special tokens for a chat template, end to end: ``rankwise train`` with
``model.add_special_tokens`` + ``method.trainable_tokens: true`` + LoRA on the tiny Llama (untied
head), then ``export --format peft`` (HF PEFT loads it on the base resized by transformers) and
``--format merged`` (transformers loads the resized vocabulary), and the bad input.

Numbers asserted: 2 new rows, each the mean of the old rows at init; the run moves them; PEFT's
logits equal rankwise's within 1e-5 (fp32); the merged model's vocabulary is 30,524 and its
logits equal rankwise's within 1e-5; every error is one line with exit 2.
"""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.recipes.export import load_run

SPECIAL = ["<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
RUN = {
    "model": {"path": "tiny-llama", "task": "causal-lm", "add_special_tokens": SPECIAL},
    "data": {"format": "chat", "chat_template": TEMPLATE, "max_length": 32, "eval_fraction": 0.25},
    "method": {"name": "lora", "r": 2, "trainable_tokens": True},
    "optim": {"name": "adamw", "lr": 0.05},
    "train": {"steps": 4, "batch_size": 4, "save_every": 0, "eval_batch_size": 8, "progress": False},
}


def _cli(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    with open(root / "chat.jsonl", "w") as f:
        for i in range(16):
            msgs = [{"role": "user", "content": f"say {words[i % 8]}"},
                    {"role": "assistant", "content": f"{words[i % 8]} {words[(i + 3) % 8]}"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    raw = json.loads(json.dumps(RUN))
    raw["data"]["source"] = str(root / "chat.jsonl")
    (root / "run.yaml").write_text(yaml.safe_dump(raw))
    result = _cli("train", root / "run.yaml", "--out", root / "run")
    assert result.exit_code == 0, result.output
    for fmt in ("peft", "merged"):
        result = _cli("export", root / "run", "--format", fmt, "--out", root / fmt)
        assert result.exit_code == 0, result.output
    return root


def _batch(tok) -> dict[str, torch.Tensor]:
    text = "<|im_start|>user say beta<|im_end|><|im_start|>assistant beta delta<|im_end|>"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert {30522, 30523} <= set(ids[0].tolist())  # one id each, never split
    return {"input_ids": ids}


@torch.no_grad()
def _logits(model, batch):
    return model.eval()(**batch).logits


@pytest.mark.slow
def test_trained_rows_export_to_peft_and_merged(chat_run):
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rankwise.recipes.model import load_model
    cfg, ours, tok = load_run(chat_run / "run")
    assert tok.convert_tokens_to_ids(SPECIAL) == [30522, 30523]
    assert AutoTokenizer.from_pretrained(chat_run / "run" / "tokenizer").get_vocab() == tok.get_vocab()
    emb = ours.get_input_embeddings()
    assert emb.token_ids["default"] == [30522, 30523]
    assert emb.deltas["default"].abs().max() > 1e-3            # the run trained the rows
    base_rows = emb.weight.detach()
    torch.testing.assert_close(base_rows[30522:], base_rows[:30522].mean(0).expand(2, -1), atol=1e-6, rtol=0)
    batch = _batch(tok)
    want = _logits(ours, batch)

    config = json.loads((chat_run / "peft" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == {"model.embed_tokens": [30522, 30523], "lm_head": [30522, 30523]}
    assert AutoTokenizer.from_pretrained(chat_run / "peft").convert_tokens_to_ids(SPECIAL) == [30522, 30523]
    base, _ = load_model("tiny-llama", "causal-lm", seed=cfg.train.seed)  # the base before new tokens
    base.resize_token_embeddings(len(tok))                     # as a PEFT user resizes it
    loaded = peft.PeftModel.from_pretrained(base, chat_run / "peft")
    torch.testing.assert_close(_logits(loaded, batch), want, atol=1e-5, rtol=0)

    merged = AutoModelForCausalLM.from_pretrained(chat_run / "merged", local_files_only=True)
    assert merged.config.vocab_size == 30524 and merged.get_input_embeddings().weight.shape[0] == 30524
    assert AutoTokenizer.from_pretrained(chat_run / "merged").convert_tokens_to_ids(SPECIAL) == [30522, 30523]
    torch.testing.assert_close(_logits(merged, batch), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sets, match", [
    (["method.trainable_tokens=['<|im_end|>', '<tool>']"], "'<tool>'; add them with model.add_special_tokens"),
    (["model.add_special_tokens=['<|im_start|>']"], "lacks ('<|im_end|>'); add them with model.add_special_tokens"),
    (["model.add_special_tokens=[]"], "method.trainable_tokens: true trains the added tokens"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sets, match):
    raw = json.loads(json.dumps(RUN))
    raw["data"]["source"] = str(tmp_path / "chat.jsonl")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": msgs}) for _ in range(8)))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    result = _cli("train", tmp_path / "run.yaml", "--out", tmp_path / "out",
                  *[x for s in sets for x in ("--set", s)])
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and match in lines[0], result.output


def test_the_new_keys_at_their_neutral_values_keep_recorded_comparison_hashes():
    """A comparison reuses a finished run by the hash of its resolved config: the new keys at
    the values that change nothing must not make every recorded run stale."""
    from rankwise.recipes.runs import config_hash
    plan = {"model": {"path": "tiny-llama", "task": "causal-lm"}, "method": {"name": "lora", "r": 2}}
    neutral = json.loads(json.dumps(plan))
    neutral["model"].update(add_tokens=[], add_special_tokens=[])
    neutral["method"]["trainable_tokens"] = None
    assert config_hash(neutral) == config_hash(plan)
    plan["model"]["add_special_tokens"] = ["<|im_end|>"]
    assert config_hash(plan) != config_hash(neutral)
    # the comparison records committed in the repository still hash to what they recorded
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "bench" / "results" / "compare-tuned"
    for f in sorted(root.glob("**/compare_plan.json")):
        saved = json.loads(f.read_text())
        assert config_hash(saved["plan"]) == saved["config_sha256"], f
