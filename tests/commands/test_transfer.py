"""``rankwise transfer`` (LoRASuite, issue 24): the identity transfer between identical models
reproduces the adapter exactly (every layer's ΔW and the logits), the output is a run folder that
``rankwise export --format peft`` writes and PEFT loads with the same logits, the short
fine-tune trains from the transferred adapter, and a base of another family is one line, exit 2."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.commands.transfer.run import TransferConfig, transfer_run

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
IDS = torch.tensor([[2, 5, 7, 3, 9, 11, 4, 6], [8, 3, 3, 10, 2, 12, 5, 1]])
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]


def _tokenizer(first: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate([first, "</s>"] + WORDS)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token=first))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token=first, eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny GQA Llama, a finished LoRA run on it (random factors: a trained adapter's
    stand-in) whose data is a small JSONL file, and a tiny GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from rankwise import registry
    from rankwise.core.io import save_adapter
    from rankwise.recipes import folders
    from rankwise.recipes.model import load_model
    root = tmp_path_factory.mktemp("transfer")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=14, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                 bos_token_id=1, eos_token_id=1)).save_pretrained(root / "base")
    _tokenizer("<unk>").save_pretrained(root / "base")
    GPT2LMHeadModel(GPT2Config(vocab_size=14, n_embd=32, n_layer=2, n_head=2, n_positions=32)
                    ).save_pretrained(root / "gpt2")
    _tokenizer("<unk>").save_pretrained(root / "gpt2")
    g = torch.Generator().manual_seed(1)
    with (root / "data.jsonl").open("w") as f:
        for _ in range(24):
            words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (10,), generator=g)]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    method = {"name": "lora", "r": 4, "alpha": 8, "targets": TARGETS}
    config = {"model": {"path": str(root / "base"), "task": "causal-lm"}, "method": method,
              "data": {"source": str(root / "data.jsonl"), "max_length": 16},
              "train": {"steps": 2, "batch_size": 4, "eval_batch_size": 4, "progress": False}}
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    model, _ = load_model(str(root / "base"), "causal-lm")
    entry = registry.get("method", "lora")
    cfg = entry.config_cls(**{k: v for k, v in method.items() if k != "name"})
    entry.builder(model, cfg, "default")
    torch.manual_seed(5)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.3)
    save_adapter(model, run / "adapter", cfg)
    folders.record(run, "train")
    return {"root": root, "run": run, "base": root / "base", "gpt2": root / "gpt2"}


def _deltas(run):
    from rankwise.core.protocol import adapter_modules, describe, factors
    from rankwise.recipes.export import load_run
    _, model, _ = load_run(run)
    out = {}
    for path, mod in adapter_modules(model):
        a, b = factors(mod, "default")
        out[path] = describe(mod, "default")["scale"] * (b.double() @ a.double())
    with torch.no_grad():
        return out, model(input_ids=IDS).logits


@pytest.mark.slow  # ~4 s: two model loads, a data build, PEFT (the maths alone: tests/adapters/test_lorasuite.py)
def test_identity_transfer_reproduces_the_adapter_and_exports_to_peft(world):
    out = world["root"] / "same"
    record = transfer_run(world["run"], str(world["base"]), out, TransferConfig(calibration_texts=8))
    assert record["w_x"]["kind"] == "identity"
    assert record["layer_mapping"] == [0, 1]
    assert record["head_mapping"] == {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}
    assert record["layers_moved"] == 10 and record["not_transferred"] == []
    assert record["metrics"]["steps"] == 0 and "eval_loss" in record["metrics"]
    assert record["stage"].startswith("transfer only")  # not the paper's whole method
    (old, old_logits), (new, new_logits) = _deltas(world["run"]), _deltas(out)
    assert old.keys() == new.keys() and len(old) == 10
    for path in old:  # float32 factors of a float64 re-factorisation
        torch.testing.assert_close(new[path], old[path], rtol=0, atol=2e-6)
    torch.testing.assert_close(new_logits, old_logits, rtol=0, atol=1e-5)
    result = CliRunner().invoke(main, ["export", str(out), "--format", "peft", "--out", str(out.parent / "peft")])
    assert result.exit_code == 0, result.output
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(world["base"], local_files_only=True)
    model = peft.PeftModel.from_pretrained(base, out.parent / "peft").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, old_logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_finetune_steps_train_from_the_transferred_adapter(world):
    out = world["root"] / "tuned"
    result = CliRunner().invoke(main, ["transfer", str(world["run"]), "--to", str(world["base"]),
                                       "--out", str(out), "--finetune-steps", "3", "--calibration-texts", "4"])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "transfer.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert record["metrics"]["steps"] == metrics["steps"] == 3
    assert record["stage"] == "transfer + 3 fine-tune steps"
    assert f"{record['stage']}: layers [0, 1]" in result.output
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["steps"] == 3
    (old, _), (new, _) = _deltas(world["run"]), _deltas(out)
    # trained on from the transferred pair: close to it, not equal, not the fresh init (B = 0)
    moved = [float((new[p] - old[p]).detach().norm() / old[p].norm()) for p in old]
    assert 0 < max(moved) < 0.5


def test_a_base_of_another_family_is_one_line(world, tmp_path):
    cases = [(["--to", str(world["gpt2"])], "'gpt2' model; rankwise transfer maps between decoders of the Llama layout"),
             (["--to", str(world["base"]), "--finetune-steps", "-1"], "--finetune-steps: got -1")]
    for args, words in cases:
        result = CliRunner().invoke(main, ["transfer", str(world["run"]), *args, "--out", str(tmp_path / "x")])
        assert result.exit_code == 2, result.output
        assert words in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "x").exists()


def test_mlp_linears_whose_intermediate_size_changed_get_their_base_weights():
    """The recipe hands LoRASuite the two base weights of exactly the MLP linears whose
    intermediate size differs (for the code's MLP rule); others keep the W_x-only rule."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.commands.transfer.run import _mlp_weights

    def llama(hidden, inter):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=hidden, intermediate_size=inter,
                                            num_hidden_layers=1, num_attention_heads=2))
    old, new = llama(8, 16), llama(12, 24)
    keys = {"mlp.up_proj": ((16, 8), (24, 12)), "mlp.down_proj": ((8, 16), (12, 24))}
    deltas = {k: (None, k) for k in keys}
    got = _mlp_weights(old, new, "model.layers.0.", "model.layers.0.", deltas, keys, (8, 12))
    assert set(got) == set(keys)
    torch.testing.assert_close(got["mlp.up_proj"][1], new.model.layers[0].mlp.up_proj.weight.double())
    torch.testing.assert_close(got["mlp.down_proj"][0], old.model.layers[0].mlp.down_proj.weight.double())
    same = {"mlp.up_proj": ((16, 8), (16, 12))}  # same intermediate size: not the MLP rule
    assert _mlp_weights(old, llama(12, 16), "model.layers.0.", "model.layers.0.", deltas, same, (8, 12)) == {}
