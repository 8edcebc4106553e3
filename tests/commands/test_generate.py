"""``rankwise generate``: greedy output equals a hand-written argmax loop, for a mergeable
adapter, a non-mergeable mixture, a PEFT folder, a chat run, and a model with virtual tokens."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from rankwise.cli import main
from rankwise.data.formats import end_id
from rankwise.engine.generation import generate
from rankwise.recipes.config import load_run_config
from rankwise.commands.generate.decode import DecodeConfig, SteerConfig
from rankwise.compress.kv.config import NSNQuantCacheConfig
from rankwise.commands.generate.run import load_for_generation, run_generate
from rankwise.recipes.train import train

# Plain-text role markers (a <|...|> marker is a special token the tokenizer lacks: refused).
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} [SEP] {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
BASE = {"model": {"path": "tiny-llama", "task": "causal-lm"},
        "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 48, "limit": 48},
        "optim": {"name": "adamw", "lr": 0.02},
        "train": {"steps": 3, "batch_size": 8, "progress": False, "save_every": 0}}


def greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    """Argmax decoding without a KV cache: the reference."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if t == eos:
                break
            out.append(t)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    lora = dict(BASE, method={"name": "lora", "r": 4})
    chat_file = root / "chat.jsonl"
    chat_file.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"name function {i}"},
        {"role": "assistant", "content": f"def f{i}():"}]}) + "\n" for i in range(40)))
    moe = dict(BASE, method={"name": "moe-lora"},
               data={"source": str(chat_file), "format": "chat", "chat_template": TEMPLATE, "max_length": 48})
    train(load_run_config(None, base=lora), root / "lora")
    train(load_run_config(None, base=moe), root / "moe")
    return root


@pytest.mark.slow
def test_greedy_cli_equals_argmax_loop_and_streams(runs):
    cfg, model, tok, enc = load_for_generation(runs / "lora")
    prompt = "Return the number of items in a container."
    want = tok.decode(greedy(model, enc.prompt_ids(prompt), 6, end_id(tok)), skip_special_tokens=True)
    result = CliRunner().invoke(main, ["generate", str(runs / "lora"), "--prompt", prompt,
                                       "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert result.output == want + "\n"
    pieces: list[str] = []  # the streamed pieces arrive one by one and add up to the completion
    rows = run_generate(runs / "lora", prompt, DecodeConfig(max_new_tokens=6), echo=lambda s: None,
                        stream=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == rows[0]["completion"] == want


@pytest.mark.slow
def test_file_of_prompts_and_a_peft_adapter_agree_with_the_run(runs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Open a file."}\n"Close the loop."\n')
    own = run_generate(runs / "lora", prompts, DecodeConfig(max_new_tokens=5), echo=lambda s: None)
    assert [r["prompt"] for r in own] == ["Open a file.", "Close the loop."]
    result = CliRunner().invoke(main, ["export", str(runs / "lora"), "--format", "peft", "--out",
                                       str(tmp_path / "peft")])
    assert result.exit_code == 0, result.output
    via_peft = run_generate(runs / "lora", prompts, DecodeConfig(max_new_tokens=5), adapter=tmp_path / "peft",
                            echo=lambda s: None)
    assert via_peft == own
    result = CliRunner().invoke(main, ["generate", str(runs / "lora"), "--file", str(prompts),
                                       "--max-new-tokens", "5"])
    assert [json.loads(x) for x in result.output.splitlines()] == own


@pytest.mark.slow
def test_chat_run_with_a_non_mergeable_adapter_uses_the_template(runs):
    cfg, model, tok, enc = load_for_generation(runs / "moe")
    ids = enc.prompt_ids([{"role": "user", "content": "name function 3"}])
    assert ids == tok("<user> name function 3 [SEP] <assistant>", add_special_tokens=False)["input_ids"]
    want = tok.decode(greedy(model, ids, 5, end_id(tok)), skip_special_tokens=True)
    got = run_generate(runs / "moe", "name function 3", DecodeConfig(max_new_tokens=5), echo=lambda s: None)
    assert got[0]["completion"] == want


@pytest.mark.slow
def test_temperature_and_top_p_change_what_is_sampled(runs):
    """After 3 steps the model is close to uniform over its vocabulary, so a sample at
    temperature 1 is almost never the argmax sequence; temperature -> 0 and top-p -> 0 each
    collapse sampling onto the argmax (if either were ignored they would not)."""
    cfg, model, tok, enc = load_for_generation(runs / "lora")
    ids, eos, pad = enc.prompt_ids("Parse a header."), end_id(tok), tok.pad_token_id
    want = greedy(model, ids, 6, eos)
    assert len(want) == 6

    def sample(seed: int, temperature: float, top_p: float) -> list[int]:
        torch.manual_seed(seed)
        return generate(model, ids, 6, eos, pad, temperature=temperature, top_p=top_p)
    free = [sample(s, 1.0, 1.0) for s in range(4)]
    assert all(x != want for x in free) and len({tuple(x) for x in free}) == 4
    assert [sample(s, 1e-4, 1.0) for s in range(4)] == [want] * 4     # T -> 0: the argmax
    assert [sample(s, 1.0, 1e-6) for s in range(4)] == [want] * 4     # nucleus of one token
    assert sample(2, 1.0, 1.0) == free[2]                              # the seed fixes the draw


@pytest.mark.slow
def test_the_seed_option_seeds_sampling(runs):
    def sampled(seed: int) -> str:
        return run_generate(runs / "lora", "Parse a header.", DecodeConfig(
            max_new_tokens=6, temperature=1.0, seed=seed), echo=lambda s: None)[0]["completion"]
    a, b = sampled(3), sampled(4)
    assert sampled(3) == a != b


class VirtualTokens(nn.Module):
    """A minimal InputAdapter: ``n`` learned embeddings in front of every sequence."""

    def __init__(self, model, n: int = 3):
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(n, model.config.hidden_size))

    def transform_inputs(self, model, batch):
        emb = model.get_input_embeddings()(batch["input_ids"])                  # (B, T, H)
        pre = self.prefix.unsqueeze(0).expand(emb.shape[0], -1, -1)             # (B, n, H)
        mask = torch.ones(emb.shape[0], pre.shape[1], dtype=batch["attention_mask"].dtype)
        return {"inputs_embeds": torch.cat([pre, emb], 1),
                "attention_mask": torch.cat([mask, batch["attention_mask"]], 1)}

    def virtual_tokens(self):
        return self.prefix.shape[0]


def test_generation_goes_through_input_adapters():
    from rankwise.engine import get_task
    from rankwise.recipes.model import load_model
    model, tok = load_model("tiny-llama", get_task("causal-lm"))
    model.eval()
    model.virtual = VirtualTokens(model)
    ids = tok("hello there", add_special_tokens=False)["input_ids"]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(5):
            emb = torch.cat([model.virtual.prefix[None], model.get_input_embeddings()(torch.tensor([ids + out]))], 1)
            out.append(int(model(inputs_embeds=emb).logits[0, -1].argmax()))
    assert generate(model, ids, 5, eos_id=-1, pad_id=tok.pad_token_id) == out
    del model.virtual                                   # without it: plain greedy decoding
    assert generate(model, ids, 5, eos_id=-1, pad_id=tok.pad_token_id) == greedy(model, ids, 5, -1)


@pytest.mark.slow
@pytest.mark.parametrize("args, match", [
    (["{tmp}", "--prompt", "x"], "is not a run folder"),
    (["{bert}", "--prompt", "x"], "generate needs a causal-lm run"),
    (["{lora}"], "exactly one of --prompt"),
    (["{lora}", "--prompt", "x", "--top-p", "0"], "--top-p"),
    (["{lora}", "--file", "{tmp}/none.jsonl"], "prompts file"),
    # a plain LoRA run is no Memory Decoder (issue 32, item 7): refused, not mixed in
    (["{lora}", "--prompt", "x", "--memory-decoder", "{lora}"], "is a causal-lm run (method lora), not a memory-decoder run"),
    (["{lora}", "--prompt", "x", "--memory-decoder", "{bert}"], "not a memory-decoder run"),
    (["{lora}", "--prompt", "x", "--memory-decoder", "{tmp}"], "holds nothing (missing or empty)"),
])
def test_bad_generate_input_is_one_line(runs, tiny_bert_run, tmp_path, args, match):
    fill = {"tmp": str(tmp_path), "bert": str(tiny_bert_run), "lora": str(runs / "lora")}
    result = CliRunner().invoke(main, ["generate", *[a.format(**fill) for a in args]])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and match in result.output, result.output


@pytest.mark.slow
def test_generate_with_a_quantized_kv_cache(runs, monkeypatch):
    import rankwise.compress.kv as kv
    made = []

    def spy(*args, **kwargs):
        made.append(kv.caches.build_cache(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(kv, "build_cache", spy)
    prompt = "Return the number of items in a container, counting every nested item as well."
    fp = run_generate(runs / "lora", prompt, DecodeConfig(max_new_tokens=6), echo=lambda s: None)
    q = run_generate(runs / "lora", prompt, DecodeConfig(max_new_tokens=6, kv_cache=NSNQuantCacheConfig(bits=2)),
                     echo=lambda s: None)
    assert isinstance(q[0]["completion"], str) and q[0]["prompt"] == fp[0]["prompt"]
    used = made[-1]  # the cache generation decoded with holds the prompt and the new tokens
    assert isinstance(used, kv.QuantizedKVCache) and used.get_seq_length() >= 16
    # NSNQuant quantizes keys before RoPE: generation hands the cache the model's rotary module
    assert all(layer.rotary is not None for layer in used.layers)
    result = CliRunner().invoke(main, ["generate", str(runs / "lora"), "--prompt", prompt,
                                       "--kv-cache", "nsnquant", "--kv-bits", "3"])
    assert result.exit_code == 2 and "decode.kv_cache.bits: got 3; expected an integer in 1..2" in result.output


@pytest.mark.slow
def test_steer_svdecode_through_the_cli_strength_zero_is_plain_and_default_steers(runs, tmp_path):
    """``--steer svdecode --steer-from RUN`` on the run itself: λ = 0 gives plain generate's rows;
    the default step gives the greedy argmax of the closed form (adapters on / off), with μ
    calibrated on the run's own training data and logged in one line."""
    from rankwise.core.ops import disable_adapters
    from rankwise.data.text import build_data
    from rankwise.engine import get_task
    from rankwise.engine.svdecode import SVDecode
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Open a file."}\n')
    plain = run_generate(runs / "lora", prompts, DecodeConfig(max_new_tokens=5), echo=lambda s: None)
    result = CliRunner().invoke(main, ["generate", str(runs / "lora"), "--file", str(prompts),
                                       "--max-new-tokens", "5", "--steer", "svdecode", "--steer-from",
                                       str(runs / "lora"), "--steer-strength", "0"])
    assert result.exit_code == 0, result.output
    assert [json.loads(x) for x in result.output.splitlines()] == plain
    cfg, model, tok, enc = load_for_generation(runs / "lora")
    sv = SVDecode()
    sv.calibrate(model, build_data(cfg.data, get_task(cfg.task.name), tok)[0])
    ids, out = enc.prompt_ids("Open a file."), []
    with torch.no_grad():
        for _ in range(5):  # the reference: uncached forwards, the formula, argmax
            x = torch.tensor([ids + out])
            z_w = model(input_ids=x).logits[0, -1]
            with disable_adapters(model):
                z_0 = model(input_ids=x).logits[0, -1]
            t = int(sv.steer(z_w, z_w, z_0).argmax())
            if t == end_id(tok):
                break
            out.append(t)
    lines: list[str] = []
    steer = SteerConfig(name="svdecode", from_=str(runs / "lora"))
    steered = run_generate(runs / "lora", prompts, DecodeConfig(max_new_tokens=5, steer=steer),
                           echo=lambda s: None, note=lines.append)
    assert lines == [sv.fit.line()] and "mu*" in lines[0]
    assert steered[0]["completion"] == tok.decode(out, skip_special_tokens=True)
