"""An empty prompt (issue 18 item 5) generates from BOS, as ``transformers``' ``generate()``
does when given no input: the same tokens, on GPT-2 and Llama, from ``--prompt ""`` and from
``{"prompt": ""}`` in ``--file``; no traceback."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def home_made(folder, arch: str):
    """A model folder as people make them: a word-level tokenizer that adds no special tokens
    (GPT-2 style, ``<|endoftext|>`` as BOS and EOS; or Llama style with no BOS at all) and a
    small GPT-2 or Llama built from config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>"] if arch == "gpt2" else ["<unk>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS + [str(i) for i in range(24)])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    if arch == "gpt2":
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|endoftext|>",
                                      eos_token="<|endoftext|>", unk_token="<|endoftext|>")
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=2,
                                           n_positions=64, bos_token_id=0, eos_token_id=0))
    else:
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=1, max_position_embeddings=64,
                                             bos_token_id=1, eos_token_id=1))
    assert tok("")["input_ids"] == []  # nothing in front of a prompt: "" is no tokens at all
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_an_empty_prompt_generates_from_bos_like_transformers(tmp_path, arch):
    from rankwise.data.formats import end_id
    from rankwise.commands.generate.run import load_for_generation
    torch.manual_seed(0)
    base = home_made(tmp_path / "base", arch)
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"alpha beta gamma delta {i}"}) + "\n" for i in range(24)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(base), "task": "causal-lm"}, "data": {"source": str(data), "max_length": 16},
        "method": {"name": "lora", "r": 2}, "optim": {"name": "adamw", "lr": 0.05},
        "train": {"steps": 4, "batch_size": 4, "progress": False}}))
    run = tmp_path / "run"
    res = invoke("train", cfg, "--out", run)
    assert res.exit_code == 0, res.output
    _, adapted, tok, _ = load_for_generation(run)
    with torch.no_grad():  # transformers without input: starts from generation_config.bos_token_id
        ref = adapted.generate(max_new_tokens=6, do_sample=False, eos_token_id=end_id(tok),
                               pad_token_id=tok.pad_token_id)[0].tolist()
    # GPT-2 style: the tokenizer's BOS (<|endoftext|>, 0); Llama style without one: the config's (1)
    assert ref[0] == {"gpt2": 0, "llama": 1}[arch] and len(ref) > 1
    want = tok.decode([t for t in ref[1:] if t != end_id(tok)], skip_special_tokens=True)

    res = invoke("generate", run, "--prompt", "", "--max-new-tokens", 6)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert res.stdout.strip() == want.strip()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": ""}\n{"prompt": "alpha beta"}\n')
    res = invoke("generate", run, "--file", prompts, "--max-new-tokens", 6)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.strip()]
    assert [r["prompt"] for r in rows] == ["", "alpha beta"]
    assert rows[0]["completion"] == want


def test_an_empty_prompt_without_any_bos_is_one_line(monkeypatch):
    from rankwise.errors import RankwiseError
    from rankwise.commands.generate.run import start_id

    class NoBos:
        bos_token_id = None

    class Model:
        generation_config = NoBos()

    assert start_id(type("Tok", (), {"bos_token_id": 7})(), Model()) == 7
    with pytest.raises(RankwiseError, match="give a non-empty prompt"):
        start_id(NoBos(), Model())
